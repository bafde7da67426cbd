"""Average the weights of a run's last checkpoints into one model folder (paper Section 6.1).

"For the base models, we used a single model obtained by averaging the last 5 checkpoints, which were
written at 10-minute intervals. For the big models, we averaged the last 20 checkpoints." Give a run's
output folder (its checkpoint-<step> folders are read) or checkpoint folders themselves. The result
loads with from_pretrained and carries the tokenizer and generation config of the last checkpoint.
Checkpoints with different configs, tensor names or shapes are refused.

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
    parser.add_argument("--output-dir", required=True, help="folder to write the averaged model to")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vaswani_tx.checkpoints import CheckpointError, average_checkpoints, checkpoint_folders

    if args.last < 1:
        return fail("average-checkpoints", f"--last must be >= 1, got {args.last}")
    try:
        # a run folder holds checkpoint-<step> folders (and, once finished, its final model too)
        found = checkpoint_folders(args.paths[0]) if len(args.paths) == 1 else []
        if len(args.paths) == 1 and not found and not (Path(args.paths[0]) / "config.json").is_file():
            raise CheckpointError(f"{args.paths[0]} holds no checkpoint-<step> folders")
        if found:
            chosen = found[-args.last :]
            if len(chosen) < args.last:
                print(f"only {len(chosen)} checkpoints in {args.paths[0]}: averaging those")
        else:
            chosen = [Path(p) for p in args.paths]
        output = average_checkpoints(chosen, args.output_dir)
    except (ValueError, OSError) as err:  # CheckpointError is a ValueError
        return fail("average-checkpoints", err)
    print(f"averaged {len(chosen)} checkpoints ({', '.join(p.name for p in chosen)}) into {output}")
    return 0
