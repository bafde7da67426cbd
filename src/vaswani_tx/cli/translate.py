"""Translate sentences, a file or standard input with a saved model (paper Section 6.1 decoding).

Decoding follows the model's generation config (the paper's beam 4, length penalty alpha 0.6, at
most source length + 50 tokens, never more than the model's positions) unless --num-beams /
--length-penalty say otherwise. A line longer than the model's positions is refused before any
decoding, naming its number, unless --truncate cuts it to fit. Lines are
batched by a token budget in length order and written back in input order, one output line per input
line: empty lines stay empty. A progress bar goes to standard error.

examples:
  vaswani-tx translate runs/multi30k-en-de/averaged "A man rides a bike." "Two dogs play in the snow."
  vaswani-tx translate MODEL --input test.en --output test.hyp.de --num-beams 4 --length-penalty 0.6
  cat test.en | vaswani-tx translate MODEL > test.hyp.de
  vaswani-tx translate MODEL -i test.en -o hyp.de --device cuda --dtype bfloat16 --max-tokens 8192
  vaswani-tx translate MODEL -i test.en -o hyp.de --device cpu --int8
"""

from __future__ import annotations

import argparse
import os
import sys

from vaswani_tx.cli import fail


def add_decoding_arguments(parser: argparse.ArgumentParser) -> None:
    """The options `translate` and `evaluate` share: decoding, batching, device and dtype."""
    group = parser.add_argument_group("decoding (defaults: the model's generation config, Section 6.1)")
    group.add_argument("--num-beams", type=int, help="beam size (the paper: 4; 1 is greedy)")
    group.add_argument(
        "--length-penalty",
        type=float,
        metavar="ALPHA",
        help="length penalty alpha, in the form the model's generation config names (length_penalty_type): "
        "GNMT ((5+|Y|)/6)^alpha for models trained here (the paper: 0.6), transformers' |Y|^alpha for converted "
        "MarianMT, FSMT and fairseq models; no effect with --num-beams 1",
    )
    group.add_argument(
        "--max-length-offset",
        type=int,
        metavar="N",
        help="stop each output at its source length + N tokens (the paper: 50)",
    )
    group.add_argument(
        "--max-tokens",
        type=int,
        default=4096,
        help="padded source tokens per batch (default 4096; memory grows with it times the beam)",
    )
    group.add_argument("--batch-size", type=int, help="at most this many sentences per batch (default: no limit)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, mps, ... (default: the GPU if any)")
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights' dtype for decoding; auto: bfloat16 where the CPU has bf16 instructions (AVX512-BF16, AMX) or the GPU "
        "bf16, else float32 (default: as saved)",
    )
    group.add_argument(
        "--int8",
        action="store_true",
        help="int8 products for every linear map, for CPU decoding (weights quantized per output row, activations per call)",
    )
    group.add_argument(
        "--truncate",
        action="store_true",
        help="cut a line longer than the model's positions (max_position_embeddings tokens) to fit, with a warning "
        "(default: refuse it, naming its line, before any decoding)",
    )
    group.add_argument("--quiet", action="store_true", help="no progress bar")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "model", help="a model folder with its tokenizer (train, average-checkpoints or save_pretrained output)"
    )
    parser.add_argument("sentences", nargs="*", help="sentences to translate (otherwise --input or standard input)")
    parser.add_argument(
        "-i",
        "--input",
        "--source",
        dest="input",
        metavar="FILE",
        help="UTF-8 file of source sentences, one per line ('-': standard input, the default)",
    )
    parser.add_argument("-o", "--output", metavar="FILE", help="write translations here (default: standard output)")
    parser.add_argument(
        "--force", action="store_true", help="replace an existing --output file (once every line is translated)"
    )
    add_decoding_arguments(parser)


def check_decoding_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the shared decoding options, before a model is loaded (None when nothing).
    With --quiet it also turns off transformers' progress bars ("Loading weights"), before the model loads."""
    import math

    if args.quiet:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()

    for option, least in (("num_beams", 1), ("max_tokens", 1), ("batch_size", 1), ("max_length_offset", 0)):
        value = getattr(args, option)
        if value is not None and value < least:
            return f"--{option.replace('_', '-')} must be >= {least}, got {value}"
    if args.length_penalty is not None and not math.isfinite(args.length_penalty):
        return f"--length-penalty must be a finite number, got {args.length_penalty}"
    from vaswani_tx.engine.translation import resolve_device
    from vaswani_tx.model.errors import UserInputError

    try:
        resolve_device(args.device)
    except UserInputError as err:  # before the model loads: a GPU that is not here
        return str(err)
    return None


def decoding_options(args: argparse.Namespace) -> dict:
    """`Translator.translate` keyword arguments from the shared options."""
    options = {
        "num_beams": args.num_beams,
        "length_penalty": args.length_penalty,
        "max_tokens": args.max_tokens,
        "batch_size": args.batch_size,
        "progress": not args.quiet,
        "truncate": args.truncate,
    }
    if args.num_beams == 1 and args.length_penalty is None:
        options["length_penalty"] = 1.0  # greedy has no length penalty: no warning about the model's alpha
    if args.max_length_offset is not None:
        options["max_output_length_offset"] = args.max_length_offset
    return options


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.engine.translation import load_translator, read_text, write_lines
    from vaswani_tx.folders import check_writable, refuse_to_replace

    if args.sentences and args.input:
        return fail("translate", "give sentences or --input FILE, not both")
    problem = check_decoding_arguments(args)
    if problem:
        return fail("translate", problem)
    try:
        if args.output is not None and args.output != "-":
            check_writable(args.output, "file")
            refuse_to_replace([args.output], args.force)
        lines = list(args.sentences) if args.sentences else read_text(args.input)
        translator = load_translator(args.model, device=args.device, dtype=args.dtype, int8=args.int8)
        hypotheses = translator.translate(lines, **decoding_options(args))
        write_lines(hypotheses, args.output)
    except KeyboardInterrupt:
        where = f"{args.output} was not written" if args.output not in (None, "-") else "no translation was printed"
        if args.output not in (None, "-") and os.path.exists(args.output):
            where += " (what it held before is unchanged)"
        print(
            f"vaswani-tx translate: interrupted; {where} (translations are written once all are done); "
            "run the same command again to translate everything",
            file=sys.stderr,
        )
        return 130
    return 0
