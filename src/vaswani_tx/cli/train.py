"""Train a model from a run config (paper Section 5): `vaswani-tx train CONFIG [key=value ...]`.

CONFIG is a YAML file under configs/train/: every key is a Seq2SeqTrainingArguments field or one of
the recipe's own (model_config, tokenizer, train_source/train_target or wmt14, dev_source/dev_target,
max_tokens, tokens_per_step, save_minutes, ...). key=value arguments override it (values read as YAML).
Runs alone on CPU or under `accelerate launch` (one process per device). --resume continues from the
last checkpoint in output_dir (optimizer, schedule, data order and random state restored).

examples:
  vaswani-tx train configs/train/multi30k-en-de.yaml --resume
  vaswani-tx train configs/train/multi30k-en-de.yaml max_steps=200 output_dir=runs/try
  accelerate launch --config_file configs/accelerate/ddp-8gpu.yaml -m vaswani_tx.cli train configs/train/wmt14-en-de-base.yaml
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import fail

INTERMIXED = "overrides"  # key=value may also follow --resume (see vaswani_tx.cli.main)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", help="run config (YAML) under configs/train/")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override a config key, e.g. max_steps=100")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in output_dir (start fresh if none)"
    )


def run(args: argparse.Namespace) -> int:
    import json
    import logging

    from vaswani_tx.checkpoints import CheckpointError
    from vaswani_tx.recipe import ConfigError, load_run_config, train

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    try:
        recipe, arguments = load_run_config(args.config, args.overrides)
        metrics = train(recipe, arguments, resume=args.resume)
    except (ConfigError, CheckpointError, ValueError, OSError) as err:  # e.g. a tokenizer that does not fit the model
        return fail("train", err)
    if arguments.process_index == 0:
        print(json.dumps(metrics, indent=1))
        print(f"model, checkpoints and curves.png in {arguments.output_dir}")
    return 0
