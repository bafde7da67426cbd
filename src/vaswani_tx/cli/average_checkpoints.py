"""Average the weights of a run's last checkpoints into one model folder (paper Section 6.1).

"For the base models, we used a single model obtained by averaging the last 5 checkpoints, which were
written at 10-minute intervals. For the big models, we averaged the last 20 checkpoints." Give a run's
output folder (its checkpoint-<step> folders are read) or checkpoint folders themselves. The result
loads with from_pretrained and carries the tokenizer and generation config of the last checkpoint.
Checkpoints with different configs, tensor names or shapes are refused; in a run folder, an incomplete
checkpoint (a run killed while saving) is skipped, as `train --resume` skips it. Several run folders are
refused (give one run, or checkpoint folders), and so is an output folder that is not empty, unless --force.

examples:
  vaswani-tx average-checkpoints runs/multi30k-en-de --last 5 --output-dir runs/multi30k-en-de/averaged
  vaswani-tx average-checkpoints runs/x/checkpoint-900 runs/x/checkpoint-1000 --output-dir avg
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "paths", nargs="+", help="a run folder (holding checkpoint-<step> folders) or checkpoint folders"
    )
    parser.add_argument(
        "--last",
        type=int,
        default=5,
        help="with a run folder: average its last N checkpoints (default 5; the paper: 5 base, 20 big)",
    )
    parser.add_argument(
        "-o",
        "--output-dir",
        required=True,
        metavar="DIR",
        help="folder to write the averaged model to (refused if it exists and is not empty)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty output folder (whole, once the new one is written)"
    )


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from vaswani_tx.folders import check_writable, refuse_to_overwrite
    from vaswani_tx.training.checkpoints import (
        CheckpointError,
        average_checkpoints,
        average_last_checkpoints,
        checkpoint_folders,
    )

    if args.last < 1:
        return fail("average-checkpoints", f"--last must be >= 1, got {args.last}")
    refuse_to_overwrite(args.output_dir, args.force, inputs=args.paths)
    check_writable(args.output_dir, "whole-dir")
    # a run folder holds checkpoint-<step> folders (and, once finished, its final model too)
    if len(args.paths) > 1:
        for path in args.paths:
            if Path(path).is_dir() and checkpoint_folders(path):
                raise CheckpointError(
                    f"{path} is a run folder (it holds checkpoint-<step> folders): give one run folder, "
                    "or checkpoint folders, not several runs"
                )
    if len(args.paths) == 1 and checkpoint_folders(args.paths[0]):  # one run: its last complete checkpoints
        output, chosen = average_last_checkpoints(
            args.paths[0], args.last, args.output_dir, warn=lambda line: print(line, file=sys.stderr)
        )
        if len(chosen) < args.last:
            print(f"only {len(chosen)} complete checkpoints in {args.paths[0]}: averaged those")
    else:
        if len(args.paths) == 1 and not (Path(args.paths[0]) / "config.json").is_file():
            raise CheckpointError(f"{args.paths[0]} holds no checkpoint-<step> folders")
        chosen = [Path(p) for p in args.paths]
        output = average_checkpoints(chosen, args.output_dir)
    print(f"averaged {len(chosen)} checkpoints ({', '.join(p.name for p in chosen)}) into {output}")
    return 0
