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
    parser.add_argument("-o", "--output-dir", required=True, metavar="DIR", help="folder for the PNG files")
    parser.add_argument(
        "--kinds",
        nargs="+",
        default=["encoder", "decoder", "cross"],
        choices=["encoder", "decoder", "cross"],
        help="which attention to draw (default: all)",
    )
    parser.add_argument("--layers", nargs="+", type=int, help="1-based layer numbers to draw (default: all)")
    parser.add_argument("--force", action="store_true", help="replace PNG files of the same names in --output-dir")
    parser.add_argument(
        "--truncate",
        action="store_true",
        help="cut a sentence or translation longer than the model's positions to fit, with a warning (default: "
        "refuse it)",
    )


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from vaswani_tx.atomic import atomic_folder
    from vaswani_tx.demo.attention_maps import plot_attention_maps
    from vaswani_tx.engine.translation import load_translator
    from vaswani_tx.folders import check_writable, refuse_to_replace
    from vaswani_tx.model.errors import UserInputError, check_source_length

    layers = None if args.layers is None else [n - 1 for n in args.layers]
    if not args.source.strip():
        return fail("attention", "--sentence is empty: give the sentence to draw attention for")
    check_writable(args.output_dir)
    translator = load_translator(args.model, device="cpu")  # the folder checks `translate` makes
    config, tokenizer = translator.model.config, translator.tokenizer
    lengths = {"--sentence": len(tokenizer(args.source)["input_ids"])}
    if args.target is not None:
        lengths["--translation"] = len(tokenizer(text_target=args.target)["input_ids"])
    for option, length in lengths.items():
        if not args.truncate:
            check_source_length(length, config, option, "shorten it, or pass --truncate to cut it to fit")
        elif length > config.max_position_embeddings:
            print(
                f"vaswani-tx attention: warning: {option} is {length} tokens long, more than the model's "
                f"{config.max_position_embeddings} positions: cut to its first {config.max_position_embeddings} "
                "tokens (--truncate)",
                file=sys.stderr,
            )
    for kind in args.kinds:
        count = config.num_encoder_layers if kind == "encoder" else config.num_decoder_layers
        stack = {"encoder": "encoder", "decoder": "decoder", "cross": "decoder (cross-attention)"}[kind]
        wrong = [n for n in args.layers or () if not 1 <= n <= count]
        if wrong:
            raise UserInputError(
                f"--layers {' '.join(map(str, wrong))}: the {stack} stack has {count} layers, numbered 1 to {count}"
            )
    # drawn beside the folder, then moved in (each file whole; the folder's other files stay): an interrupted
    # run leaves the maps an earlier run drew, and existing maps are refused without --force
    with atomic_folder(args.output_dir, merge=True) as partial:
        drawn = plot_attention_maps(
            translator.model,
            translator.tokenizer,
            args.source,
            partial,
            target=args.target,
            kinds=args.kinds,
            layers=layers,
            truncate=args.truncate,
        )
        paths = [Path(args.output_dir) / path.name for path in drawn]
        refuse_to_replace(paths, args.force)
    for path in paths:
        print(path)
    return 0
