"""Where `gemm_backend()` comes from: torch's float32 product (oneMKL's GEMM) against oneDNN's inner product on
the same weights, unpacked and packed once, by number of rows, at the base shape's layers.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_gemm.py [--threads 1 2] [--rounds 5] [--shapes small]
        [--rows 2 4 8 16 32 64 128 255]

Shapes (in x out): the attention projections 512 x 512, the feed-forward layers 512 x 2048 and 2048 x 512, and the
pre-softmax projection 512 x 37000 (the paper's base); `--shapes small`: the main job's model's (`small-cpu.json`:
256 x 256, 256 x 1024, 1024 x 256 and its 256 x 8000 projection). Each cell is microseconds a call: `F.linear` (what
`nn.Linear` runs: oneMKL), `mkldnn._linear_pointwise` on the weight as it is ("oneDNN") and on a copy packed by
`mkldnn._reorder_linear_weight` ("packed"), the median of `--rounds` alternating measurements. A weight that fits
in the cache is read from it here; the last line ("decoder, one row") reads a whole decoding step's worth of
weights (6 layers' 8 products, 88 MB, more than the caches) once per call, as a step of greedy search does.
Results are printed, not saved: rerun it on the CPU in question (its vendor is printed: `gemm_backend()` chooses
oneMKL on Intel CPUs and oneDNN on other x86 CPUs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vaswani_tx.compiled_decoding import cpu_vendor, gemm_backend, onednn_linear_available

SHAPES = {
    "base": ((512, 512), (512, 2048), (2048, 512), (512, 37000)),
    "small": ((256, 256), (256, 1024), (1024, 256), (256, 8000)),
}
ROWS = (1, 2, 4, 8, 32, 128)
LINEAR = torch.ops.mkldnn._linear_pointwise


def microseconds(call, budget: float = 0.1) -> float:
    """Mean time of `call()` over about `budget` seconds, after a warm-up call."""
    call()
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < budget:
        call()
        count += 1
    return (time.perf_counter() - start) / count * 1e6


def products(rows: int, inputs: int, outputs: int) -> dict:
    x, weight, bias = torch.randn(rows, inputs), torch.randn(outputs, inputs) * 0.05, torch.randn(outputs)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return {
        "oneMKL": lambda: torch.nn.functional.linear(x, weight, bias),
        "oneDNN": lambda: LINEAR(x, weight, bias, "none", [], ""),
        "packed": lambda: LINEAR(x, packed, bias, "none", [], ""),
    }


def decoder_step() -> dict:
    """A base decoder's products at one row, each weight read from memory once per call."""
    shapes = [(512, 512)] * 6 + [(512, 2048), (2048, 512)]  # W^Q, W^K, W^V, W^O twice (self, cross); W_1, W_2
    layers = [(torch.randn(o, i) * 0.05, torch.randn(o)) for _ in range(6) for i, o in shapes]
    packed = [(torch.ops.mkldnn._reorder_linear_weight(w), b) for w, b in layers]
    inputs = {512: torch.randn(1, 512), 2048: torch.randn(1, 2048)}

    def run(weights, kind):
        for weight, bias in weights:
            x = inputs[weight.shape[1]]
            if kind == "oneMKL":
                torch.nn.functional.linear(x, weight, bias)
            else:
                LINEAR(x, weight, bias, "none", [], "")

    return {
        "oneMKL": lambda: run(layers, "oneMKL"),
        "oneDNN": lambda: run(layers, "oneDNN"),
        "packed": lambda: run(packed, "packed"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="base", help="the base model's or the main job's")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    args = parser.parse_args()
    if not onednn_linear_available():
        raise SystemExit("this torch has no oneDNN inner product (torch.ops.mkldnn._linear_pointwise)")
    print(f"CPU vendor {cpu_vendor() or 'unknown'}, torch {torch.__version__}, capability "
          f"{torch.backends.cpu.get_cpu_capability()}; gemm_backend() chooses {gemm_backend()}")  # fmt: skip
    cases = [
        (f"{rows:4d} x {i:>5} -> {o:>5}", products(rows, i, o)) for i, o in SHAPES[args.shapes] for rows in args.rows
    ]
    if args.shapes == "base":
        cases.append(("decoder, one row (88 MB)", decoder_step()))
    for threads in args.threads:
        torch.set_num_threads(threads)
        print(f"\n{threads} thread(s): microseconds a call, median of {args.rounds}; oneMKL / packed above 1: "
              "oneDNN's packed product faster")  # fmt: skip
        print(f"{'rows x in -> out':28} {'oneMKL':>10} {'oneDNN':>10} {'packed':>10} {'oneMKL/packed':>14}")
        for name, calls in cases:
            times = {kind: [] for kind in calls}
            for _ in range(args.rounds):  # alternating, so a slow moment of a shared machine hits all three
                for kind, call in calls.items():
                    times[kind].append(microseconds(call))
            median = {kind: statistics.median(values) for kind, values in times.items()}
            print(f"{name:28} {median['oneMKL']:10.1f} {median['oneDNN']:10.1f} {median['packed']:10.1f} "
                  f"{median['oneMKL'] / median['packed']:14.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
