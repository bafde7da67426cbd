"""Where `Int8Linear.MANY_ROWS` and `MANY_ROWS_WITHOUT_AMX` come from: torch's dynamically quantized int8 linear
kernel on fbgemm's packing against the same int8 weights packed for oneDNN, by number of rows, at the base shape's
layers.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_int8_kernels.py [--threads 1] [--repeats 200]

Shapes (in x out): the attention projections 512 x 512, the feed-forward layers 512 x 2048 and 2048 x 512, the
pre-softmax projections 256 x 8000 (the main job's model) and 512 x 37000 (the paper's base). Each cell is
fbgemm's time over oneDNN's (above 1: oneDNN faster), the median of `--rounds` alternating measurements of
`--repeats` calls each (fewer for more rows or outputs); the column where a shape's ratio passes 1 is where
oneDNN starts to pay. Both kernels quantize the same activations the same way, up to an activation that rounds
to the neighbouring int8 value, so their outputs agree to float rounding or to one quantization step (the largest
difference is printed). Results are printed, not saved: rerun it on the CPU in question.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
from torch import nn

SHAPES = ((512, 512), (512, 2048), (2048, 512), (256, 8000), (512, 37000))
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 128, 384)
KERNEL = torch.ops.quantized.linear_dynamic.default  # what Int8Linear.forward calls, with either packing


def seconds(packed, x: torch.Tensor, repeats: int) -> float:
    """Mean time of one call of the int8 kernel on `x` with the weights `packed`."""
    KERNEL(x, packed, True)
    start = time.perf_counter()
    for _ in range(repeats):
        KERNEL(x, packed, True)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--repeats",
        type=int,
        default=200,
        help="calls per measurement at up to 32 rows and 512 outputs, fewer above (default 200)",
    )
    parser.add_argument("--rounds", type=int, default=5, help="alternating measurements per cell (default 5)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if "onednn" not in torch.backends.quantized.supported_engines:
        raise SystemExit("this torch has no oneDNN quantized engine")
    from vaswani_tx.quantization import Int8Linear, quantize_int8

    print(f"torch {torch.__version__}, {args.threads} thread(s); fbgemm time / oneDNN time (above 1: oneDNN faster)")
    print(f"{'in x out':>12} " + " ".join(f"{rows:>6}" for rows in ROWS) + "   max |difference|")
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        for inputs, outputs in SHAPES:
            module = quantize_int8(nn.Sequential(nn.Linear(inputs, outputs)), inplace=True)[0]
            assert isinstance(module, Int8Linear)
            fbgemm, onednn = module._packed_params._packed_params, module.many_rows_params
            cells, difference = [], 0.0
            for rows in ROWS:
                x = torch.randn(rows, inputs)
                repeats = max(5, args.repeats * 32 // max(rows, 32) * 512 // max(outputs, 512))
                ratios = [seconds(fbgemm, x, repeats) / seconds(onednn, x, repeats) for _ in range(args.rounds)]
                cells.append(statistics.median(ratios))
                difference = max(difference, (KERNEL(x, fbgemm, True) - KERNEL(x, onednn, True)).abs().max().item())
            print(f"{inputs:>5} x {outputs:<5} " + " ".join(f"{c:6.2f}" for c in cells) + f"   {difference:.1e}")
    print(
        f"Int8Linear.MANY_ROWS = {Int8Linear.MANY_ROWS}: oneDNN's packing from that many rows up (with AMX; "
        "without, the pre-softmax projection only, the other layers from "
        f"MANY_ROWS_WITHOUT_AMX = {Int8Linear.MANY_ROWS_WITHOUT_AMX})"
    )


if __name__ == "__main__":
    main()
