"""Write a vaswani_tx model folder as a MarianMTModel folder, for tools that read Marian (CTranslate2's converter among them).

The weights are permuted to Marian's sin-half/cos-half layout of the hidden dimension, so the exported
model's logits are ours. The tokenizer files are copied as they are. The paper's GNMT length penalty and
its source length + 50 output cap have no Marian equivalent; beam size and length penalty carry over.

example:
  vaswani-tx export-marian runs/multi30k-en-de/averaged exported/multi30k-en-de-marian
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="a vaswani_tx model folder")
    parser.add_argument("out", help="output MarianMTModel folder")


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.convert import export_marian

    try:
        out = export_marian(args.model, args.out)
    except (ValueError, OSError) as err:
        return fail("export-marian", err)
    print(f"exported {args.model} -> {out} (MarianMTModel)")
    return 0
