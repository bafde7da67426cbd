"""Train a model from a run config (paper Section 5): `vaswani-tx train CONFIG [key=value ...]`.

CONFIG is a YAML file under configs/train/: every key is a Seq2SeqTrainingArguments field or one of
the recipe's own (model_config, tokenizer, train_source/train_target or wmt14, dev_source/dev_target,
max_tokens, tokens_per_step, save_minutes, ...). key=value arguments override it (values read as YAML).
Runs alone on CPU or under `accelerate launch` (one process per device). --resume continues from the
last checkpoint in output_dir (optimizer, schedule, data order and random state restored).
While it runs, output_dir holds a lock (.vaswani-train.lock): a second `train` on the same folder is
refused, naming the process that holds it; the lock of a killed run is taken over. Config values are
checked (numbers, ranges, paths, a writable output_dir that is not already a model) before any data is
read. A new run in an output_dir holding another run's results (averaged/, scores, a final model) but no
checkpoint is refused unless --force, which replaces them once the new run has finished. The averaged model
(average_last) is built beside output_dir/averaged and swapped in whole; one that already holds this exact
average is kept with what was written beside it. Ctrl-C or SIGTERM says which checkpoint was saved last and
the command that resumes from it: each checkpoint is built beside its name and moved in once complete, so an
interrupted save leaves none. A write that fails (full disk, quota, permissions) names the file; --resume with
a model config or tokenizer other than the checkpoints' is refused before any work, naming what differs.

examples:
  vaswani-tx train configs/train/multi30k-en-de.yaml --resume
  vaswani-tx train configs/train/multi30k-en-de.yaml max_steps=200 output_dir=runs/try
  accelerate launch --config_file configs/accelerate/ddp-8gpu.yaml -m vaswani_tx.cli train configs/train/wmt14-en-de-base.yaml
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("config", help="run config (YAML) under configs/train/")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override a config key, e.g. max_steps=100")
    parser.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in output_dir (start fresh if none)"
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="start a new run in an output_dir that holds another run's results but no checkpoint (an averaged "
        "model, scores, a final model): they are replaced once the new run has finished",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="print what the run will do (processes, tokens per step, steps, schedule peak, FLOPs, checkpoints) "
        "and stop before reading any training data",
    )


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import os
    import sys

    from vaswani_tx.training.checkpoints import complete_checkpoints
    from vaswani_tx.training.recipe import end_distributed, train
    from vaswani_tx.training.run_config import load_run_config
    from vaswani_tx.training.training import ReturnFreedMemory

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    arguments = None
    try:
        # a plan computes, so it reads a config for any machine: bf16 and tf32 are not checked against this one
        recipe, arguments = load_run_config(args.config, args.overrides, check_device=not args.dry_run)
        if args.dry_run:
            from vaswani_tx.training.plan import describe_plan, run_plan

            if arguments.process_index == 0:
                print(describe_plan(run_plan(recipe, arguments)))
            return 0
        try:
            # the command owns its process, so it may tune glibc's allocator for it (a library would not)
            callbacks = [ReturnFreedMemory()]
            metrics = train(recipe, arguments, resume=args.resume, callbacks=callbacks, force=args.force)
        finally:
            end_distributed()
    except KeyboardInterrupt:
        if arguments is None or arguments.process_index != 0:
            return 130
        # a save the Ctrl-C stopped left no checkpoint-<step>; a damaged one --resume would skip is not named
        complete = (
            complete_checkpoints(arguments.output_dir, warn=lambda line: None, for_resume=True)
            if os.path.isdir(arguments.output_dir)
            else []
        )
        saved = f"the last checkpoint saved is {complete[-1]}" if complete else "no checkpoint was saved yet"
        print(
            f"vaswani-tx train: interrupted; {saved}. Continue with: vaswani-tx train {args.config} "
            f"{' '.join(args.overrides) + ' ' if args.overrides else ''}--resume",
            file=sys.stderr,
        )
        return 130
    if arguments.process_index == 0:
        print(json.dumps(metrics, indent=1))
        print(f"model, checkpoints and curves.png in {arguments.output_dir}")
        if "averaged" in metrics:
            chosen = metrics["averaged_from"]
            print(
                f"averaged the last {len(chosen)} checkpoints ({', '.join(chosen)}; Section 6.1) into {metrics['averaged']}"
            )
    return 0
