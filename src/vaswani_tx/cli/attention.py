"""Draw attention maps for one sentence pair, per layer and head, as PNG files (like the paper's Figures 3-5).

Writes encoder-layerN.png (encoder self-attention), decoder-layerN.png (decoder self-attention) and
cross-layerN.png (encoder-decoder attention) to --output-dir, each a grid with one panel per head.
Without --target the model's own translation of --source is drawn.

Example: vaswani-tx attention runs/multi30k/averaged --source "Ein Hund läuft." --output-dir attention/
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a saved model folder (from_pretrained) with its tokenizer")
    parser.add_argument("--source", required=True, help="the source sentence")
    parser.add_argument("--target", help="the target sentence (default: the model's translation)")
    parser.add_argument("--output-dir", required=True, help="folder for the PNG files")
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
    from vaswani_tx.translation import load_translator

    layers = None if args.layers is None else [n - 1 for n in args.layers]
    try:
        translator = load_translator(args.model, device="cpu")  # the folder checks `translate` makes
        paths = plot_attention_maps(
            translator.model,
            translator.tokenizer,
            args.source,
            args.output_dir,
            target=args.target,
            kinds=args.kinds,
            layers=layers,
        )
    except (ValueError, OSError) as err:  # not a usable model folder, a layer it does not have, unwritable output
        return fail("attention", err)
    for path in paths:
        print(path)
    return 0
