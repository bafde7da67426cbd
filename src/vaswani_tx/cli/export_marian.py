"""Write a vaswani_tx model folder as a MarianMTModel folder, for tools that read Marian (CTranslate2's converter among them).

The weights are permuted to Marian's sin-half/cos-half layout of the hidden dimension, so the exported
model's logits are ours. The tokenizer files are copied as they are. Beam size, alpha and early stopping carry
over. MarianMTModel's generate() has no GNMT length penalty and no per-source output cap: it applies
transformers' |Y|^alpha and one max_length, so a warning says when the model decodes otherwise (the paper's
GNMT form and source length + 50 do). generation_config.json records both (length_penalty_type,
max_output_length_offset) for `vaswani-tx convert`, which reads them back: GNMT stays GNMT both ways.

example:
  vaswani-tx export-marian runs/multi30k-en-de/averaged exported/multi30k-en-de-marian
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import add_output_dir_argument, output_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="a vaswani_tx model folder")
    add_output_dir_argument(parser, "output MarianMTModel folder (refused if it exists and is not empty)")
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty output folder (whole, once the new one is written)"
    )


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.folders import refuse_to_overwrite

    out = output_dir(args)
    refuse_to_overwrite(out, args.force, inputs=[args.model])
    from vaswani_tx.engine.translation import check_model_folder
    from vaswani_tx.interop.export import export_marian

    check_model_folder(args.model)  # another model type names `vaswani-tx convert`; truncated weights
    out = export_marian(args.model, out)  # replaces a folder of ours (--force) whole: none of our code files stay
    print(f"exported {args.model} -> {out} (MarianMTModel)")
    return 0
