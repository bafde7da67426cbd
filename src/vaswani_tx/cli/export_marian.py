"""Write a vaswani_tx model folder as a MarianMTModel folder, for tools that read Marian (CTranslate2's converter among them).

The weights are permuted to Marian's sin-half/cos-half layout of the hidden dimension, so the exported
model's logits are ours. The tokenizer files are copied as they are. The paper's GNMT length penalty and
its source length + 50 output cap have no Marian equivalent; beam size and length penalty carry over.

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
    parser.add_argument("--force", action="store_true", help="write into a non-empty output folder")


def _remove_our_code_files(folder) -> None:
    """A Marian folder written over one of ours (--force) keeps none of our model code files beside it."""
    from pathlib import Path

    import vaswani_tx

    package = Path(vaswani_tx.__file__).parent
    for path in Path(folder).glob("*.py"):
        if (package / path.name).is_file():
            path.unlink()


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.folders import refuse_to_overwrite

    out = output_dir(args)
    refuse_to_overwrite(out, args.force)
    from vaswani_tx.export import export_marian
    from vaswani_tx.translation import check_model_folder

    check_model_folder(args.model)  # another model type names `vaswani-tx convert`; truncated weights
    out = export_marian(args.model, out)
    _remove_our_code_files(out)
    print(f"exported {args.model} -> {out} (MarianMTModel)")
    return 0
