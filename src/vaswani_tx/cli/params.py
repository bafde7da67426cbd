"""Build each model config and print its parameter count against the paper's Table 3.

Each model is built on PyTorch's meta device (no memory, no initialisation), its parameters are
counted and compared with the closed form of VaswaniConfig and with the paper's "params x10^6"
column where Table 3 prints one. Exits non-zero if a built model differs from its closed form, or
is more than 5M from the paper's figure.

Example: vaswani-tx params configs/model
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="model config JSON files, or folders of them")


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.training.params import parameter_table

    files = []
    for path in args.paths:
        if path.is_dir():
            files.extend(sorted(path.glob("*.json")))
        elif path.is_file():
            files.append(path)
        else:
            return fail("params", f"{path} is neither a config file nor a folder")
    if not files:
        return fail("params", f"no *.json model configs found in {', '.join(map(str, args.paths))}")
    rows, ok = parameter_table(files)
    header = (
        f"{'config':28} {'N':>3} {'d_model':>7} {'d_ff':>5} {'h':>3} {'d_k':>4} {'d_v':>4} {'P_drop':>6} "
        f"{'params(M)':>10} {'paper(M)':>8} {'diff(M)':>8}  check"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        paper = f"{r['paper']:.0f}" if r["paper"] is not None else "-"
        diff = f"{r['built'] / 1e6 - r['paper']:+.2f}" if r["paper"] is not None else "-"
        print(
            f"{r['name']:28} {r['N']:>3} {r['d_model']:>7} {r['d_ff']:>5} {r['h']:>3} {r['d_k']:>4} {r['d_v']:>4} "
            f"{r['dropout']:>6} {r['built'] / 1e6:>10.2f} {paper:>8} {diff:>8}  {r['check']}"
        )
    print(
        f"\n{len(rows)} configs; built counts equal the closed form; paper figures use one shared vocabulary "
        "of each config's vocab_size (37,000 for the paper's rows)."
        if ok
        else "\nFAILED: see the check column."
    )
    return 0 if ok else 1
