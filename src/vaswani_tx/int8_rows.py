"""int8 products of a few rows on CPUs with AVX512-VNNI: `kernels/int8_rows.cpp`, built once into a model folder.

At a sentence a call (beam search over one source: about 6 rows a step) an int8 product is a microsecond or two of
VNNI work, and fbgemm's dynamic quantized linear, what `quantize_int8` gives every layer, spends some 20 us around it:
its quantization parameters, the activations' packing, the requantization. The kernel here quantizes each row of
the activations symmetrically (one scale a row: the same or less error than fbgemm's one 7-bit scale a call) and
reads each 64-byte block of the weights once for all the rows. The weights are the layer's own int8 weights and
scales, repacked.

    vaswani-tx compile MODEL         # builds MODEL/kernels/int8_rows.so beside the int8 step (about 10 s, g++)
    quantize_int8(model)             # a model loaded from MODEL: its int8 layers take the kernel (`rows_limit`)

The float32 model from such a folder takes it too, in greedy search's int8 screen (fast_decoding.py's
`ScreenedArgmax`): the screen's product of a step's rows by its int8 copy of the pre-softmax matrix, where torch's
weight-only int8 product takes two and a half times as long at a few rows (it converts more than it reads), and
float32's four times as long at a batch's hundreds.

The library is built with the C++ compiler for this torch (`torch.utils.cpp_extension`'s headers and libraries)
and loaded where its manifest matches: this torch, this source, a CPU with the instructions. Anywhere else (another
torch, a CPU without AVX512-VNNI, no compiler when compiling) the layers keep fbgemm's kernel, with one logged line.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from . import compiled_decoding, native
from .compiled_decoding import (
    FEW_ROWS_MAX_INT8,
    INT8_ALL_ROWS,
    ROWS_BUFFERS,
    file_sha256,
)
from .errors import UserInputError
from .precision import cpu_bf16_instructions

FOLDER, LIBRARY = compiled_decoding.ROWS_KERNEL_FOLDER, compiled_decoding.ROWS_KERNEL_LIBRARY
MANIFEST = compiled_decoding.MANIFEST  # what `native.build_into` writes beside the library
SOURCE = compiled_decoding.ROWS_KERNEL_SOURCE
# Up to this many rows the int8 layers take the kernel: at least as many as the int8 few-rows step serves
# (FEW_ROWS_MAX_INT8), so that the eager int8 path and that step compute the same products, and as many as the kernel
# stays ahead of fbgemm's there. Since the kernel allocates nothing but its output, fbgemm's time over the kernel's is
# 2.2-3.1x at 1 row, 1.8-2.5x at 6, 1.1-1.7x at 24 and 32 rows at every layer of the main job's model and the base
# shape but the base shape's pre-softmax projection, 0.84-0.95x there from 12 rows (one thread, AMD EPYC Zen 4,
# `benchmarks/bench_int8_kernels.py --rows-kernel`, docs/speed.md). 17-32 rows: a sentence of that many tokens
# through the encoder, a few sources' beams.
FEW_ROWS = 32
# A layer with more weights than this takes the kernel up to FEW_ROWS_MAX_INT8 rows only (512 x 37,000 above).
LARGE_LAYER = 1 << 23
# Where the CPU has no AMX tiles (VNNI alone: fbgemm's kernels and oneDNN's are the same kind of loop as this one's),
# the kernel takes a layer's products at every number of rows. fbgemm's time over the kernel's at 32 / 64 / 128 / 256 /
# 512 / 2,600 rows: 1.94 / 1.67 / 1.55 / 1.38 / 1.30 / 1.21 at 256 x 256, 1.55-1.17 at 256 x 1,024, 1.48-1.14 at
# 1,024 x 256, 1.25-1.06 at the base shape's 512 x 2,048 (one thread, AMD EPYC Zen 5; `benchmarks/bench_int8_kernels.py
# --rows-kernel --rows 32 64 128 256 512 2600`). oneDNN's, which a layer took from 384 rows, is 0.84-1.0x the
# kernel's time at 256-2,600 rows of the feed-forward shapes only, where a batch's encoder goes a source at a time
# anyway (`SourcesApart`). The kernel's one scale a row also makes the blocks of SCALE_ROWS rows (`Int8Linear`)
# needless, and a batch's step calls neither fbgemm nor Python (the beam-search library's step:
# `int8_batched_on_library`). With AMX tiles, oneDNN's kernel is several times faster from 32 rows.
ALL_ROWS = INT8_ALL_ROWS


def rows_limit(module: torch.nn.Module, projection: bool = False) -> int:
    """The most rows of a product the kernel takes for this int8 layer: `FEW_ROWS` where the CPU has AMX tiles, any
    number (`ALL_ROWS`) where it has not, and `FEW_ROWS_MAX_INT8` for a large one. The pre-softmax `projection` takes
    it up to `FEW_ROWS` only: past those, oneDNN's kernel is as fast or faster at its many columns on either kind of
    CPU (8,000 x 256: 0.85-0.97x the kernel's time at 128-2,600 rows, one thread, AMD EPYC Zen 5), and the layer takes
    it from `Int8Linear.MANY_ROWS`."""
    if module.in_features * module.out_features > LARGE_LAYER:
        return FEW_ROWS_MAX_INT8
    return FEW_ROWS if projection or cpu_bf16_instructions() == "AMX" else ALL_ROWS


# The instructions the library is compiled for (gcc's names); the /proc/cpuinfo flags that say a CPU has them, and
# the loading, live with the compiled steps' (compiled_decoding.py travels with saved models: the float32 model's
# greedy search loads the kernel for its int8 screen).
COMPILE_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
CPU_FLAGS = compiled_decoding.ROWS_KERNEL_CPU_FLAGS
cpu_supports = compiled_decoding.rows_kernel_cpu_supports
load, loaded = compiled_decoding.load_rows_kernel, compiled_decoding.rows_kernel_loaded


def source_digest() -> str:
    """sha256 of the kernel's source: a library is used only with the source it was built from."""
    return file_sha256(SOURCE)


def build(folder: str | os.PathLike) -> Path:
    """Compile the kernel into `folder`/kernels (replaced whole); returns that folder.

    Raises:
        UserInputError: this CPU lacks the instructions, or no C++ compiler could build it."""
    supported, why = cpu_supports()
    if not supported:
        raise UserInputError(f"no int8 few-rows kernel: {why}")
    manifest = compiled_decoding.rows_kernel_manifest()
    # OpenMP: a large product's blocks of columns shared between torch's threads. Greedy search's screen of a batch's
    # rows (hundreds a step at first) at 128 rows: 1.09 ms on two threads without it as on one (1.06), 0.60 with it
    # (Intel Xeon).
    return native.build_into(Path(folder) / FOLDER, SOURCE, LIBRARY, "int8 few-rows kernel", manifest, COMPILE_FLAGS)


def attach_weights(module: torch.nn.Module, projection: bool = False) -> None:
    """Give an int8 layer (`quantize_int8`'s) its weights as the kernel reads them, as buffers: its int8 weights packed
    in blocks of 16 output rows, their scales, 128 times their sums (what the unsigned activations' offset adds to
    each product) and its bias in float32. Buffers, so that a compiled step that calls the kernel reads them as the
    model's own tensors (compile_step.py). The model's pre-softmax `projection` takes the kernel at fewer rows
    (`rows_limit`)."""
    weight, bias = module._packed_params._weight_bias()
    if weight.qscheme() not in (torch.per_channel_symmetric, torch.per_channel_affine):
        raise ValueError(f"the int8 few-rows kernel takes weights with a scale a row, not {weight.qscheme()}")
    if bool(weight.q_per_channel_zero_points().ne(0).any()):
        raise ValueError("the int8 few-rows kernel takes symmetric int8 weights (zero points 0)")
    values = weight.int_repr()
    ops = torch.ops.vaswani_tx_int8
    tensors = (ops.pack(values), weight.q_per_channel_scales().float().contiguous(), ops.shift_sums(values))
    tensors += (None if bias is None else bias.detach().float().contiguous(),)
    for name, tensor in zip(ROWS_BUFFERS, tensors):
        module.register_buffer(name, tensor, persistent=False)
    # Int8Linear.forward's test, precomputed
    module.rows_kernel_elements = rows_limit(module, projection) * module.in_features


def linear(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The int8 layer's product of `x` (..., K) by the kernel (its `attach_weights` buffers)."""
    packed, scales, sums, bias = (module._buffers[name] for name in ROWS_BUFFERS)
    return torch.ops.vaswani_tx_int8.linear(x, packed, scales, sums, bias, module.out_features)
