"""Draw attention maps for one sentence pair, per layer and head, as PNG files (like the paper's Figures 3-5).

Writes encoder-layerN.png (encoder self-attention), decoder-layerN.png (decoder self-attention) and
cross-layerN.png (encoder-decoder attention) to --output-dir, each a grid with one panel per head.
Without --translation the model's own translation of --sentence is drawn. (--sentence and --translation take
text, not files: --source and --target, their older names, are kept as aliases.)

Example: vaswani-tx attention runs/multi30k-en-de/averaged --sentence "A dog runs." -o attention/
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a saved model folder (from_pretrained) with its tokenizer")
    parser.add_argument("--sentence", "--source", dest="source", required=True, help="the source sentence (text)")
    parser.add_argument(
        "--translation", "--target", dest="target", help="its translation (text; default: the model's own)"
    )
    parser.add_argument("-o", "--output-dir", required=True, help="folder for the PNG files")
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["encoder", "decoder", "cross"],
        choices=["encoder", "decoder", "cross"],
        help="which attention to draw (default: all)",
    )
    parser.add_argument("--layers", nargs="+", type=int, help="1-based layer numbers to draw (default: all)")


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.attention_maps import plot_attention_maps
    from vaswani_tx.errors import UserInputError
    from vaswani_tx.folders import check_writable
    from vaswani_tx.translation import load_translator

    layers = None if args.layers is None else [n - 1 for n in args.layers]
    if not args.source.strip():
        return fail("attention", "--sentence is empty: give the sentence to draw attention for")
    check_writable(args.output_dir)
    translator = load_translator(args.model, device="cpu")  # the folder checks `translate` makes
    config = translator.model.config
    for kind in args.kinds:
        count = config.num_encoder_layers if kind == "encoder" else config.num_decoder_layers
        stack = {"encoder": "encoder", "decoder": "decoder", "cross": "decoder (cross-attention)"}[kind]
        wrong = [n for n in args.layers or () if not 1 <= n <= count]
        if wrong:
            raise UserInputError(
                f"--layers {' '.join(map(str, wrong))}: the {stack} stack has {count} layers, numbered 1 to {count}"
            )
    paths = plot_attention_maps(
        translator.model,
        translator.tokenizer,
        args.source,
        args.output_dir,
        target=args.target,
        kinds=args.kinds,
        layers=layers,
    )
    for path in paths:
        print(path)
    return 0
