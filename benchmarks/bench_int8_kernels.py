"""Where `Int8Linear.MANY_ROWS` and `MANY_ROWS_WITHOUT_AMX` come from: torch's dynamically quantized int8 linear
kernel on fbgemm's packing against the same int8 weights packed for oneDNN, by number of rows, at the base shape's
layers.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_int8_kernels.py [--threads 1] [--repeats 200]
    PYTHONPATH=src .venv/bin/python benchmarks/bench_int8_kernels.py --rows-kernel   # fbgemm against int8_rows.py's

`--rows-kernel`: where `int8_rows.FEW_ROWS` and `rows_limit` come from. fbgemm's kernel against the int8 few-rows
kernel (built into a temporary folder first, about 10 s), on the same int8 weights, at the main job's model's layers
(256 x 256, 256 x 1,024, 1,024 x 256, 256 x 8,000), the base shape's and a few rows: each cell fbgemm's time over the
kernel's (above 1: the kernel faster), with the kernel's microseconds at 6 rows (beam 6 over one source) beside; then
the same for oneDNN's kernel on the same weights (what a layer takes from `many_rows` rows). `--rows 32 64 128 256
512 2600`: more rows (a batch's steps and its encoder), where on a CPU without AMX tiles every product of a layer
but the pre-softmax projection is the kernel's.

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
import functools
import statistics
import time
import warnings

import torch
from torch import nn

SHAPES = ((512, 512), (512, 2048), (2048, 512), (256, 8000), (512, 37000))
ROWS = (1, 4, 8, 16, 24, 32, 48, 64, 128, 384)
ROWS_KERNEL_SHAPES = ((256, 256), (256, 1024), (1024, 256), *SHAPES)
ROWS_KERNEL_ROWS = (1, 4, 6, 8, 12, 16, 24, 32)
KERNEL = torch.ops.quantized.linear_dynamic.default  # what Int8Linear.forward calls, with either packing


def seconds(packed, x: torch.Tensor, repeats: int) -> float:
    """Mean time of one call of the int8 kernel on `x` with the weights `packed`."""
    return timed(lambda: KERNEL(x, packed, True), repeats)


def timed(call, repeats: int) -> float:
    """Mean time of `call()` over `repeats` calls, after one."""
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats


def quantized_layers(shapes):
    """(in, out, layer) for each shape: `quantize_int8` of a new nn.Linear, the caller's loop under inference mode
    with torch's quantization warnings silenced."""
    from vaswani_tx.quantization import quantize_int8

    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        for inputs, outputs in shapes:
            yield inputs, outputs, quantize_int8(nn.Sequential(nn.Linear(inputs, outputs)), inplace=True)[0]


def rows_kernel(args) -> None:
    """fbgemm's kernel against the int8 few-rows kernel, by rows (see the module docstring)."""
    import tempfile

    from vaswani_tx import int8_rows

    with tempfile.TemporaryDirectory() as folder:
        int8_rows.build(folder)
        int8_rows.load(folder)
    rows_list = tuple(args.rows or ROWS_KERNEL_ROWS)
    layers = list(quantized_layers(ROWS_KERNEL_SHAPES))
    for name, packing in (
        ("fbgemm", lambda m: m._packed_params._packed_params),
        ("oneDNN", lambda m: m.many_rows_params),
    ):
        print(f"torch {torch.__version__}, {args.threads} thread(s); {name} time / int8 few-rows kernel time")
        six_label = "   kernel at 6 rows" if 6 in rows_list else ""
        print(f"{'in x out':>12} " + " ".join(f"{rows:>6}" for rows in rows_list) + six_label)
        for inputs, outputs, module in layers:
            if packing(module) is None:
                continue  # (torch without oneDNN's int8 engine)
            int8_rows.attach_weights(module)
            cells, six = [], 0.0
            for rows in rows_list:
                x = torch.randn(rows, inputs)
                repeats = max(5, args.repeats * 8 // max(rows, 8) * 512 // max(outputs, 512))
                pairs = [
                    (
                        seconds(packing(module), x, repeats),
                        timed(functools.partial(int8_rows.linear, module, x), repeats),
                    )
                    for _ in range(args.rounds)
                ]
                cells.append(statistics.median(a / b for a, b in pairs))
                six = statistics.median(b for _, b in pairs) if rows == 6 else six
            six_cell = f"   {six * 1e6:8.1f} us" if six_label else ""
            print(f"{inputs:>5} x {outputs:<5} " + " ".join(f"{c:6.2f}" for c in cells) + six_cell)
    amx = int8_rows.cpu_bf16_instructions() == "AMX"
    print(
        f"int8_rows.FEW_ROWS = {int8_rows.FEW_ROWS}: the kernel takes products of up to that many rows where the CPU "
        f"has AMX tiles ({'this one has' if amx else 'this one has not'}; without them, every product but the "
        f"pre-softmax projection's past that); a layer of more than {int8_rows.LARGE_LAYER:,} weights: "
        f"{int8_rows.FEW_ROWS_MAX_INT8}"
    )


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
    parser.add_argument("--rows-kernel", action="store_true", help="fbgemm against the int8 few-rows kernel instead")
    parser.add_argument("--rows", type=int, nargs="+", help="with --rows-kernel: these numbers of rows instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.rows_kernel:
        return rows_kernel(args)
    if "onednn" not in torch.backends.quantized.supported_engines:
        raise SystemExit("this torch has no oneDNN quantized engine")
    from vaswani_tx.quantization import Int8Linear

    print(f"torch {torch.__version__}, {args.threads} thread(s); fbgemm time / oneDNN time (above 1: oneDNN faster)")
    print(f"{'in x out':>12} " + " ".join(f"{rows:>6}" for rows in ROWS) + "   max |difference|")
    for inputs, outputs, module in quantized_layers(SHAPES):
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
