"""Convert a published checkpoint into a vaswani_tx model folder whose translations are the source model's.

SOURCE is one of:
  - a MarianMTModel folder (OPUS-MT: config.json, weights, the Marian tokenizer files),
  - an FSMTForConditionalGeneration folder (transformers' port of fairseq's WMT19 models),
  - a fairseq checkpoint file (checkpoint*.pt / model.pt), or a folder holding exactly one, with its
    dict.<lang>.txt files and BPE codes beside it (read without fairseq and without running pickle code).
OUT receives safetensors weights, config.json with the model code and translation pipeline,
generation_config.json with the source's decoding settings, and the source's tokenizer.

examples:
  vaswani-tx convert opus-mt-en-de converted/opus-mt-en-de
  vaswani-tx convert wmt16.en-de.joined-dict.transformer/model.pt converted/fairseq-wmt16-en-de-big
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import add_output_dir_argument, output_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("source", help="MarianMTModel or FSMT folder, or a fairseq checkpoint (file or its folder)")
    add_output_dir_argument(parser, "output model folder (refused if it exists and is not empty)")
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty output folder (whole, once the new one is written)"
    )


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.folders import refuse_to_overwrite

    out = output_dir(args)
    refuse_to_overwrite(out, args.force, inputs=[args.source])
    from vaswani_tx.interop.convert import convert, describe_decoding

    out = convert(args.source, out)
    print(f"converted {args.source} -> {out}")
    print(describe_decoding(out))
    return 0
