"""Convert a saved model folder to CTranslate2, for fast CPU serving (needs the extra: pip install 'vaswani_tx[ct2]').

The output folder holds CTranslate2's model.bin, the shared vocabulary and vaswani_decoding.json: the
model's own decoding settings (its generation config's beam size, length penalty alpha and source-length
offset) as translate_batch options. CTranslate2 applies the length penalty as |Y|^alpha, not in the GNMT
form, and one max_decoding_length per batch. Feed CTranslate2 the tokens of our tokenizer, </s> included:
tokenizer.convert_ids_to_tokens(tokenizer(text).input_ids).

examples:
  vaswani-tx export-ct2 runs/multi30k-en-de/averaged ct2-multi30k
  vaswani-tx export-ct2 runs/multi30k-en-de/averaged ct2-multi30k-int8 --quantization int8
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import add_output_dir_argument, fail, output_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from vaswani_tx.interop.export import QUANTIZATIONS

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="saved model folder (config.json, weights, tokenizer.json)")
    add_output_dir_argument(parser, "folder to write the CTranslate2 model to (refused if it exists and is not empty)")
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="CTranslate2 weight quantization (default: none, float32)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty output folder (whole, once the new one is written)"
    )


def run(args: argparse.Namespace) -> int:
    import importlib.util

    out = output_dir(args)
    if importlib.util.find_spec("ctranslate2") is None:
        return fail("export-ct2", "CTranslate2 export needs the optional extra: pip install 'vaswani_tx[ct2]'")
    from vaswani_tx.interop.export import export_ct2

    out = export_ct2(args.model, out, quantization=args.quantization, force=args.force)
    print(f"wrote CTranslate2 model to {out}" + (f" ({args.quantization})" if args.quantization else ""))
    return 0
