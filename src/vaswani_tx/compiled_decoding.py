"""The decoding step compiled ahead of time: `vaswani-tx compile MODEL` once, then every process decodes with it.

What is compiled is one decoder step, the model's own decoder `forward` over the keys and values of a cache
(Sections 3.1-3.2: masked self-attention over the prefix, encoder-decoder attention, feed-forward, each with
its residual and LayerNorm), exported with `torch.export` for any number of sources, rows per source (beams),
source length and prefix length, and compiled by AOTInductor (`torch._inductor.aoti_compile_and_package`)
into a shared library in the model's folder, `compiled/decoder_step.pt2`, with `compiled/manifest.json`
saying what it was made for. The pre-softmax projection stays outside it (fast_decoding.py packs it for
oneMKL or oneDNN, which is faster there than the compiled product).

`from_pretrained` of a folder that holds one loads it when the torch version, the CPU's instruction set
(torch's CPU capability), the GEMM library chosen (`gemm_backend`: oneMKL's products on Intel CPUs, oneDNN's on
other x86 CPUs), the architecture and the weights' fingerprint are those it was made for;
otherwise it logs one line naming the difference and the model decodes eagerly, with the same result.
The library holds no weights: it reads the model's own tensors (AOTInductor's user-managed constants), so
it costs no memory beyond its code, and it follows the weights if they change in place.

fast_decoding.py's loops (`CompiledSession`) use it where it applies: float32 on the CPU, the model in eval mode, one
decoder start token per row, and lengths within the compiled positional table; anything else decodes
eagerly. The first step of a sentence computes the encoder-decoder keys and values with the model's own
attention modules (`keys_values`) and keeps them once per source.

An int8 model (`quantize_int8`, `vaswani-tx translate --int8`) has a step of its own, `compiled-int8/`, made by
`vaswani-tx compile` from the same weights: its int8 layers hold packed weights that `torch.export` cannot trace,
so the graph calls each through a custom operator, `vaswani_tx::int8_linear(x, index)`, which runs the model's own
layer (`int8_layers`), and Inductor compiles everything around them (attention, norms, residuals). `quantize_int8`
loads it for a model from a folder that has one. A bfloat16 model (`from_pretrained(folder, dtype=torch.bfloat16)`,
`--dtype auto` on CPUs with bf16 instructions) has one too, `compiled-bf16/`, the same graph over bfloat16 tensors.

Calls of a few rows (at most `FEW_ROWS_MAXIMA` sources x beams: a sentence at a time, greedy or with a small beam)
read every weight once a step for a handful of products, which makes them bound by reading the weights. The float32
model has a step for them, `compiled-few/` (the bfloat16 model `compiled-few-bf16/`): the same graph compiled with
Inductor's freezing and its C++ GEMM template, whose matrix-vector kernels read weights it packed at compile time
about twice as fast as oneDNN's product (docs/speed.md). Those packed weights are its own copy
(`compiled-few/weights.safetensors`, mapped at loading), so it serves the weights it was compiled from only: a model
whose tensors changed since decodes through the other step. The int8 model's, `compiled-few-int8/`, is the int8
step with each int8 product a call of the int8 few-rows kernel (int8_rows.py, `vaswani_tx_int8::linear`, which
`quantize_int8` loads from the folder's `kernels/`) on the layer's own buffers: no Python between the library and the
kernel, where the other int8 step calls each layer through Python. It reads the model's tensors, as that one does,
and is used only where the kernel is loaded.

A call of one source without padding (a sentence a call) is encoded by the float32 model's compiled encoder,
`compiled-encoder/` (`CompiledEncoder`, `encoder_for`): the encoder stack of Section 3.1 and each decoder layer's
encoder-decoder keys and values of its output, compiled as the few-rows step is (its own packed copy of those
weights), which generate()'s encoder pass calls and whose keys and values the decoding session takes
(`EncodedSource`). Anything else is encoded eagerly.

Compiling is compile_step.py's (it stays in the package). This file travels with saved weights for
`trust_remote_code`: torch, errors.py and (for the few-rows step's weights) safetensors, which transformers needs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.util
import json
import logging
import mmap
import operator
import os
import platform
import sys
import threading
import zlib
from pathlib import Path

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear  # imported by torch itself already

from .errors import UserInputError

logger = logging.getLogger(__name__)

FOLDER = "compiled"
INT8_FOLDER = "compiled-int8"  # the int8 model's step, beside the float32 one
BF16_FOLDER = "compiled-bf16"  # the bfloat16 model's (`--dtype auto` on CPUs with bf16 instructions)
FEW_ROWS_FOLDER = "compiled-few"  # the float32 model's for calls of at most FEW_ROWS_MAX rows (compile_step.py)
FEW_ROWS_BF16_FOLDER = "compiled-few-bf16"  # the bfloat16 model's (`--dtype auto` where the CPU has bf16 instructions)
# The int8 model's for calls of at most FEW_ROWS_MAX_INT8 rows: each int8 product a call of the int8 few-rows kernel
# (int8_rows.py, `vaswani_tx_int8::linear`) on the layer's own buffers, from the library; the other int8 step calls
# the layers' fbgemm kernels through Python (`int8_linear`).
FEW_ROWS_INT8_FOLDER = "compiled-few-int8"
FEW_ROWS_FOLDERS = {"float32": FEW_ROWS_FOLDER, "bfloat16": FEW_ROWS_BF16_FOLDER, "int8": FEW_ROWS_INT8_FOLDER}
# Up to this many rows (sources x beams) a call decodes through the few-rows step. Its products read the weights
# about twice as fast as oneDNN's at 1-4 rows, but read them again for each further block of rows: the base model,
# AMD EPYC, against the other step, 1 / 2 threads: 1.5-1.7x / 1.4-1.5x at 1, 4 and 6 rows, 1.07-1.15x / 1.22-1.24x
# at 8, 0.84-0.92x / 0.95-0.99x at 16, 0.78x / 0.86x at 32 (docs/speed.md).
FEW_ROWS_MAX = 8
# The bfloat16 step's from 7 rows on read the weights again as well (base model, the bfloat16 steps, 1 / 2 threads:
# 1.40-1.68x / 1.46-1.66x at 1, 4 and 6 rows, 0.95-0.97x / 1.00-1.09x at 7 and 8).
FEW_ROWS_MAX_BF16 = 6
# The int8 few-rows kernel's calls without Python beat fbgemm's called through Python up to 16 rows (int8_rows.py).
FEW_ROWS_MAX_INT8 = 16
# The rows of a product an int8 layer gives that kernel where it takes every one (int8_rows.py's `rows_limit`).
INT8_ALL_ROWS = 1 << 40
FEW_ROWS_MAXIMA = {"float32": FEW_ROWS_MAX, "bfloat16": FEW_ROWS_MAX_BF16, "int8": FEW_ROWS_MAX_INT8}
# An int8 layer's buffers for that kernel: derived from its int8 weights (which no fingerprint covers: the int8
# steps read the layers), so no fingerprint of the weights covers them either.
ROWS_BUFFERS = ("rows_packed", "rows_scales", "rows_sums", "rows_bias")
# The float32 model's encoder for one source without padding (a sentence a call), compiled as the few-rows step is.
ENCODER_FOLDER = "compiled-encoder"
FEW_ROWS_WEIGHTS = "weights.safetensors"  # its own tensors: the weights packed for its products, mapped at loading
PACKAGE = "decoder_step.pt2"
MANIFEST = "manifest.json"
FORMAT = 1
TABLE = "positional_table"  # the manifest's name for the sinusoid table, a constant of the graph
# Config fields that do not change the step (names, bookkeeping, what generate() reads).
_VOLATILE_CONFIG = {
    "_name_or_path", "transformers_version", "architectures", "auto_map", "custom_pipelines", "dtype",
    "torch_dtype", "use_cache", "output_attentions", "output_hidden_states", "return_dict", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation",
}  # fmt: skip


# --- the products: oneMKL's GEMM on Intel CPUs, oneDNN's on other x86 CPUs -------------------------------------------

# Which library's GEMM the loops' float32 products use where they choose it: "mkl", "onednn", or "auto" (the default).
GEMM_VARIABLE = "VASWANI_TX_GEMM"
GEMM_NAMES = {"mkl": "oneMKL", "onednn": "oneDNN"}


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string as the kernel reports it ("GenuineIntel", "AuthenticAMD", ...), "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return next((name for name in ("GenuineIntel", "AuthenticAMD") if name in platform.processor()), "")


def onednn_linear_available() -> bool:
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def gemm_backend() -> str:
    """Whose GEMM computes the float32 products of a decoding step of several rows: "mkl" (torch's own product, and
    oneMKL's packed GEMM for the pre-softmax projection) or "onednn" (oneDNN's inner product on weights packed once
    for it). torch's float32 product is oneMKL's, which on x86 CPUs from other vendors than Intel takes slow code
    paths at a few rows: on an AMD EPYC (Zen 4, one thread), 4 rows times the base model's 37,000 x 512 projection
    take 13.8 ms against oneDNN's 4.4, 4 x 512 -> 2,048 215 against 103 us (docs/speed.md). So "auto" is oneMKL on
    Intel CPUs and oneDNN on other x86 CPUs, the rule CTranslate2 follows; `VASWANI_TX_GEMM=mkl` or `=onednn`
    chooses (oneDNN costs a packed copy of the decoder's weights and of W)."""
    choice = os.environ.get(GEMM_VARIABLE, "auto").strip().lower() or "auto"
    if choice not in ("auto", "mkl", "onednn"):
        raise UserInputError(f"{GEMM_VARIABLE}={os.environ[GEMM_VARIABLE]!r}: expected auto, mkl or onednn")
    if choice == "auto":
        x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
        choice = "onednn" if x86 and cpu_vendor() not in ("GenuineIntel", "") else "mkl"
    return "onednn" if choice == "onednn" and onednn_linear_available() else "mkl"


# --- fingerprints ------------------------------------------------------------------------------------------------


def cpu_capability() -> str:
    """The instruction set torch's CPU kernels (and so the compiled code) use here: AVX512, AVX2, ..."""
    return torch.backends.cpu.get_cpu_capability()


def architecture_fingerprint(config) -> str:
    fields = {key: value for key, value in config.to_dict().items() if key not in _VOLATILE_CONFIG}
    return f"{zlib.crc32(json.dumps(fields, sort_keys=True, default=str).encode()):08x}"


# --- the packed weights' plain pages, given back ----------------------------------------------------------------------

# madvise(2)'s advice to reclaim the pages now (Linux 5.4 on; 21 on every architecture, which Python's mmap module
# names only where it was built with the kernel's newer headers): a file's clean pages leave memory and are read from
# the file again when touched; changed or anonymous pages are swapped out or, without swap, kept. No data is lost.
MADV_PAGEOUT = getattr(mmap, "MADV_PAGEOUT", 21)
PAGE = mmap.PAGESIZE


# The data pointers of the tensors whose pages `release_file_pages` gave back. A later read of every weight (a
# library's CRC as it loads, `weights_fingerprint`) gives each of them back again as soon as it has read it: the
# compiled encoder gives its plain pages back at the first call, and the few-rows step, loaded next in that call,
# read them again for its CRC, so the base shape held its encoder twice (72 MB; beam 4 batch 1 at MarianMT's + 14%).
GIVEN_BACK: set[int] = set()


def release_file_pages(tensor: torch.Tensor) -> int:
    """Give back the memory of `tensor`'s whole pages where it lies in a file mapped into memory, as
    `from_pretrained` leaves a model's weights (safetensors' mapping of model.safetensors, read lazily): its packed
    copy now serves decoding (`PackedLinears`, `PackedProjection`), so without this the process would hold each
    weight twice, plain and packed (164 MB more than MarianMT at the base shape, docs/speed.md). Touched again (the
    compiled step, training, `state_dict`), the pages are read back from the file, the same bytes. A no-op, returning
    0, where the tensor is not in a file mapping (weights made in memory: nothing to read them back from) or off
    Linux; pages changed since they were read are the process' own: swapped out or kept, never dropped. Returns the bytes
    advised."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # whole pages only: a neighbour's stay
    if last <= first or not _in_file_mapping(first, last):
        return 0
    madvise = _madvise()
    if madvise is None or madvise(first, last - first, MADV_PAGEOUT) != 0:
        return 0  # an older kernel (EINVAL): the pages stay, as before
    GIVEN_BACK.add(start)
    return last - first


@functools.cache
def _madvise():
    """The C library's madvise(2), or None where it cannot be had."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes, madvise.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return madvise


def _in_file_mapping(first: int, last: int) -> bool:
    """Whether [first, last) lies in one mapping of a file (/proc/self/maps: a path, not [heap] or anonymous)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                if low <= first < high:
                    return last <= high and len(fields) == 6 and fields[5].startswith("/")
    except OSError:
        pass
    return False


def weights_fingerprint(model: nn.Module) -> str:
    """CRC-32 of the names, shapes and bytes of every tensor the step reads; a tensor shared under several names
    (the one embedding matrix of Section 3.4) is read once. A tensor whose pages were given back (its packed copy
    serves: `GIVEN_BACK`) gives them back again once read, so that the CRC holds one at a time."""
    crc, seen = 0, set()
    for name, tensor in step_tensors(model).items():
        if name.rpartition(".")[2] in ROWS_BUFFERS:
            continue
        crc = zlib.crc32(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode(), crc)
        if tensor.numel() and (tensor.data_ptr(), tensor.shape) not in seen:
            seen.add((tensor.data_ptr(), tensor.shape))
            crc = zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy(), crc)
            if tensor.data_ptr() in GIVEN_BACK:
                release_file_pages(tensor)
    return f"{crc:08x}"


def step_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers under the names the exported step gives them (tied ones under each)."""
    tensors = {f"model.{name}": tensor for name, tensor in model.named_parameters(remove_duplicate=False)}
    tensors.update({f"model.{name}": tensor for name, tensor in model.named_buffers(remove_duplicate=False)})
    return tensors


def machine() -> dict:
    return {"torch": torch.__version__, "cpu_capability": cpu_capability(), "gemm": gemm_backend()}


# --- precisions: a step for float32, bfloat16 and int8 models ----------------------------------------------------


# A step for each precision the model may decode in: the folder it lives in and the dtype of the tensors it reads.
PRECISIONS = {
    "float32": (FOLDER, torch.float32),
    "bfloat16": (BF16_FOLDER, torch.bfloat16),
    "int8": (INT8_FOLDER, torch.float32),  # int8 layers, everything else float32
}


def precision(model: nn.Module) -> str | None:
    """Which step serves `model`: "int8" (int8 layers), "float32", "bfloat16"; None for another dtype."""
    if int8_layers(model):
        return "int8"
    dtype = next(model.parameters()).dtype
    return next((name for name, (_, step_dtype) in PRECISIONS.items() if step_dtype == dtype), None)


# int8 layers, called from the compiled step


def int8_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's int8 linear layers (quantization.py's `Int8Linear`), by name, in module order: the
    compiled int8 step calls layer i as `vaswani_tx::int8_linear(x, i)`."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, DynamicQuantizedLinear)]


def int8_signature(model: nn.Module) -> list[list]:
    """What the compiled int8 step assumes of the model's int8 layers: their names and sizes, in order."""
    return [[name, module.in_features, module.out_features] for name, module in int8_layers(model)]


def int8_operator() -> threading.local:
    """Define `vaswani_tx::int8_linear(x, index)` once in this process and return the table it reads: `layers`, the
    int8 layers of the model whose step runs on this thread (`CompiledStep.__call__` sets it). The package's copy of
    this file and a saved folder's (`trust_remote_code`) share the operator and its table, kept on torch's namespace
    for the operator."""
    namespace = torch.ops.vaswani_tx
    table = namespace.__dict__.get("_int8_layers")
    if table is None:
        table = threading.local()

        @torch.library.custom_op("vaswani_tx::int8_linear", mutates_args=())
        def int8_linear(x: torch.Tensor, index: int) -> torch.Tensor:
            return table.layers[index](x)

        @int8_linear.register_fake
        def _(x: torch.Tensor, index: int) -> torch.Tensor:
            return x.new_empty(*x.shape[:-1], table.layers[index].out_features)

        namespace._int8_layers = table
    return table


# --- loading -----------------------------------------------------------------------------------------------------


def layer_tensors(layers) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """The tensors the beam-search library's rows functions (`RowsDecoder`, `RowsEncoder`) take of each layer's
    modules, in order: a linear layer's W and b (float32 W (N, K), or an int8 layer's packing of its weights for the
    int8 few-rows kernel, `int8_rows.attach_weights`), a LayerNorm's weight and bias (an empty tensor: no bias); and of
    each int8 layer its weight scales and shifted sums (None: a layer without the kernel's buffers)."""
    none = torch.empty(0)
    weights, quantized = [], []
    for modules in layers:
        for module in modules:
            if isinstance(module, DynamicQuantizedLinear):
                packed, scales, sums, bias = (module._buffers.get(name) for name in ROWS_BUFFERS)
                weights += [packed, none if bias is None else bias]
                quantized += [scales, sums]
            else:
                weights += [module.weight.detach(), none if module.bias is None else module.bias.detach()]
    return weights, quantized


def rows_library(model: nn.Module, function: str):
    """The beam-search library where it has `function` for this model (an int8 one's `function`_int8, with the int8
    few-rows kernel loaded), else None: no library loaded (or one built before it had the function), a CPU without
    AVX-512, another activation than ReLU, a stack of no layers."""
    library = sys.modules.get(BEAMS_MODULE)
    if library is None or not hasattr(library, "decoder_rows") or not library.decoder_rows_supported():
        return None
    config = model.config
    if config.activation_function != "relu" or not (config.num_encoder_layers and config.num_decoder_layers):
        return None
    if int8_layers(model.get_decoder()) or int8_layers(model.get_encoder()):
        function += "_int8"
        if not rows_kernel_loaded():
            return None
    return library if hasattr(library, function) else None


# (tensors, products) a layer in the rows functions' lists: a decoder layer's, an encoder layer's, a decoder layer's
# encoder-decoder W^K and W^V (one_source_beams.cpp's kLayerTensors, kEncoderTensors, kMemoryTensors and theirs)
DECODER_LAYER, ENCODER_LAYER, MEMORY_LAYER = (22, 8), (16, 6), (4, 2)


def plain_rows_tensors(weights: list, quantized: list, layer: tuple[int, int], *others: torch.Tensor) -> bool:
    """Whether the rows functions can read these: contiguous tensors on the CPU, float32 where there are no int8
    layers, every layer's products int8 where there are (`layer`: its tensors and products)."""
    tensors, products = layer
    if quantized and len(quantized) * tensors != len(weights) * 2 * products:
        return False  # some of the layers int8, others not
    every = (*weights, *quantized, *others)
    if not all(t is not None and t.device.type == "cpu" and t.is_contiguous() for t in every):
        return False
    return bool(quantized) or all(t.dtype == torch.float32 for t in every)  # (int8: int8 weights, int32 sums)


class RowsDecoder:
    """The few-rows step's work in one call of the beam-search library's `decoder_rows` (one_source_beams.cpp), on the
    model's own weights: the same function as the compiled few-rows step (`DecoderStep`), whose 18 products a step
    (the main job's model) read the weights at 16-18 GB/s on an Intel Xeon where one core reads 25-26 (the library's
    products read each block of W once for all the rows). Where it serves, the compiled step's packed copy of the
    weights is not loaded and the model's pages are kept (`release_replaced`).

    An int8 model's (`--int8`) goes through `decoder_rows_int8`: each product the int8 few-rows kernel's on the
    layer's own int8 weights (int8_rows.py's `attach_weights` buffers), as in the compiled int8 few-rows step, whose
    18 calls of the kernel a step each went through AOTInductor's proxy executor (0.23 against 0.19 ms a step for the
    main job's model, a sentence a call, one thread, Intel Xeon)."""

    def __init__(self, library, model: nn.Module):
        decoder = model.get_decoder()
        self.library, embeddings = library, decoder.embeddings
        self.heads, self.eps = int(model.config.num_heads), float(model.config.layer_norm_eps)
        self.embedding, self.scale = embeddings.embed_tokens.weight.detach(), float(embeddings.embed_scale)
        # every position's encoding (Section 3.5, or a converted model's learned ones), (positions, D), as the eager
        # path adds them
        positions = int(model.config.max_position_embeddings)
        self.positions = embeddings.embed_positions(positions, 0, like=self.embedding).detach()
        self.weights, self.quantized = layer_tensors(
            [
                *(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.out_proj),
                *(layer.self_attn_norm, layer.cross_attn.q_proj, layer.cross_attn.out_proj, layer.cross_attn_norm),
                *(layer.feed_forward.w_1, layer.feed_forward.w_2, layer.feed_forward_norm),
            ]
            for layer in decoder.layers
        )
        self.bound = None  # the tensors bound once for the decoding calls' sessions (`session`)
        # float32 products of more than a few rows (in batches) through oneDNN's inner product where it is the chosen
        # GEMM library, as the compiled batched step's there, else torch's (oneMKL's)
        self.onednn = gemm_backend() == "onednn"

    def session(self, cross_keys, cross_values, source_mask):
        """A decoding call's step over the whole buffers of its keys and values (fast_decoding.py's
        `CompiledSession`): `step(tokens, keys, values, written, lineage)`, with this call's encoder-decoder keys and
        values (per layer (G, h, S, d)) and source mask (G, S) passed once. A step's call then passes five arguments
        where `__call__` passes some 120 tensors and views (20 us of a 0.4 ms step in passing alone). The model's
        tensors are bound at the first session (`of` has checked them by then)."""
        if self.bound is None:
            self.bound = self.library.RowsModel(
                self.embedding, self.scale, self.positions, self.weights, self.quantized, self.heads, self.eps,
                onednn=self.onednn,
            )  # fmt: skip
        return self.bound.session(list(cross_keys), list(cross_values), source_mask)

    @classmethod
    def of(cls, model: nn.Module) -> RowsDecoder | None:
        """The library's step for this float32 or int8 model, or None (the compiled step then serves): no library
        with the step (`rows_library`), or weights it cannot read (`plain_rows_tensors`)."""
        library = rows_library(model, "decoder_rows")
        if library is None:
            return None
        decoder = cls(library, model)
        return (
            decoder
            if plain_rows_tensors(decoder.weights, decoder.quantized, DECODER_LAYER, decoder.embedding)
            else None
        )

    def __call__(self, tokens, self_keys, self_values, cross_keys, cross_values, sources, source_mask) -> torch.Tensor:
        if self.quantized:
            return self.library.decoder_rows_int8(
                tokens, self.embedding, self.scale, self.positions, self.weights, self.quantized,
                self_keys, self_values, cross_keys, cross_values, source_mask, self.heads, self.eps,
            )  # fmt: skip
        return self.library.decoder_rows(
            tokens,
            self.embedding,
            self.scale,
            self.positions,
            self.weights,
            self_keys,
            self_values,
            cross_keys,
            cross_values,
            source_mask,
            self.heads,
            self.eps,
            self.onednn,
        )  # fmt: skip  (the library takes the tuples of tensors as they come)


class RowsEncoder:
    """The encoder for one source without padding (a sentence a call) in one call of the beam-search library's
    `encoder_rows` (`encoder_rows_int8` for an int8 model): `EncoderPass`'s function (compile_step.py), the Section 3.1
    stack and each decoder layer's encoder-decoder keys and values of its output, on the model's own weights, the
    products `RowsDecoder`'s. The eager int8 encoder of a 13-token source is some 40 modules' calls around products of
    a few microseconds each (about 1.1 ms for the main job's model, one thread, Intel Xeon; see docs/speed.md).

    It serves while the model's tensors are those it was made from (`usable`, as the compiled steps'), else it is made
    again from the model's."""

    released = True  # (`release_replaced`: it holds no copy of the model's weights)

    def __init__(self, library, model: nn.Module):
        config, encoder = model.config, model.get_encoder()
        self.library, embeddings = library, encoder.embeddings
        self.heads, self.eps = int(config.num_heads), float(config.layer_norm_eps)
        self.d_k, self.d_v = int(config.d_k), int(config.d_v)
        self.embedding, self.scale = embeddings.embed_tokens.weight.detach(), float(embeddings.embed_scale)
        self.rows = int(config.max_position_embeddings)  # (the longest source it encodes)
        self.positions = embeddings.embed_positions(self.rows, 0, like=self.embedding).detach()
        self.weights, self.quantized = layer_tensors(
            [
                *(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.out_proj),
                *(layer.self_attn_norm, layer.feed_forward.w_1, layer.feed_forward.w_2, layer.feed_forward_norm),
            ]
            for layer in encoder.layers
        )
        self.memory, self.memory_quantized = layer_tensors(
            [layer.cross_attn.k_proj, layer.cross_attn.v_proj] for layer in model.get_decoder().layers
        )
        self.bound = _versions(model)

    @classmethod
    def of(cls, model: nn.Module) -> RowsEncoder | None:
        """The library's encoder for this float32 or int8 model, or None (as `RowsDecoder.of`)."""
        library = rows_library(model, "encoder_rows")
        if library is None:
            return None
        encoder = cls(library, model)
        plain = plain_rows_tensors(encoder.weights, encoder.quantized, ENCODER_LAYER, encoder.embedding)
        plain = plain and plain_rows_tensors(encoder.memory, encoder.memory_quantized, MEMORY_LAYER)
        return encoder if plain and bool(encoder.quantized) == bool(encoder.memory_quantized) else None

    def usable(self, model: nn.Module) -> bool:
        """Whether it encodes for `model` now: eval mode, the tensors it was made from, unchanged."""
        return not model.training and _versions(model) == self.bound

    def __call__(self, input_ids: torch.Tensor) -> EncodedSource:
        """The encoder output (1, S, D) of one source's ids (1, S), and each decoder layer's encoder-decoder keys and
        values of it."""
        if self.quantized:
            hidden, *memory = self.library.encoder_rows_int8(
                input_ids, self.embedding, self.scale, self.positions, self.weights, self.quantized, self.memory,
                self.memory_quantized, self.heads, self.d_k, self.d_v, self.eps,
            )  # fmt: skip
        else:
            hidden, *memory = self.library.encoder_rows(
                input_ids, self.embedding, self.scale, self.positions, self.weights, self.memory,
                self.heads, self.d_k, self.d_v, self.eps,
            )  # fmt: skip
        return EncodedSource(hidden, memory[0::2], memory[1::2])


class CompiledStep:
    """A loaded step and the tensors it reads (the model's own, and the positional table, kept alive here)."""

    what, instead = "decoding step", "decoding"  # for the line that says why it is not used

    def __init__(self, runner, manifest: dict, model: nn.Module | None, package: str):
        self.runner, self.manifest, self.package = runner, manifest, package
        self.rows = int(manifest["positions"])
        self.table = None
        self.bound: tuple | None = None
        # an int8 step: the model's int8 layers, which the step calls by index (`int8_operator`)
        self.int8: list[nn.Module] | None = [] if manifest.get("precision") == "int8" else None
        # the few-rows step: it reads its own copy of the weights (packed for its products), takes the tokens'
        # embedding rows, and serves while the model's tensors are those it was bound to, unchanged (`_versions`)
        self.few_rows: int | None = manifest.get("few_rows")
        # its weights packed into a copy of its own (the few-rows steps, the encoder), which serves while the model's
        # tensors are the ones it was made from
        self.own_weights = self.few_rows is not None or manifest.get("part") == "encoder"
        self.embedding: torch.Tensor | None = None
        self.own: dict | None = None
        # the library's step doing this step's work, where it has it: the float32 and int8 few-rows steps', the float32
        # batched step's (`batched_on_library`)
        self.rows_decoder: RowsDecoder | None = None
        self.released = False  # the model's plain pages of the tensors it copies, given back (fast_decoding.py)
        self.refused: tuple | None = None  # a copy's tensors found to be other weights than its own (`usable`)
        # (the model's `TensorPlaces`, `_versions`) when `usable` last said yes: while both are the same, so is its
        # answer (the walk over every tensor's name, shape and dtype and the int8 layers costs some 0.4 ms a call)
        self.checked: tuple | None = None
        self.dtype = PRECISIONS[manifest.get("precision", "float32")][1]  # of the tensors it reads and gives
        if model is not None:
            self.bind(model)

    def __getstate__(self) -> dict:
        """Copied (`copy.deepcopy` of the model) or pickled (`torch.save` of the whole model, a process spawned with
        it): the loaded library itself cannot be, so the copy loads its own from the same package and binds it to
        its own tensors at its first call (`usable`); where the package is gone by then, it decodes eagerly."""
        state = dict(self.__dict__, runner=None, own=None, embedding=None, released=False, refused=None, checked=None)
        state["rows_decoder"] = None
        state["bound"] = tuple(
            (name, shape, None, dtype, device) for name, shape, _, dtype, device in self.bound or ()
        ) if not self.own_weights else None  # fmt: skip
        return state

    def __setstate__(self, state: dict) -> None:
        # pickled before int8, bf16 and few-rows steps
        before = {"int8": None, "dtype": torch.float32, "few_rows": None, "released": False, "refused": None}
        before.update(checked=None, own_weights=state.get("few_rows") is not None)
        self.__dict__.update({**before, "embedding": None, "own": None, "rows_decoder": None, **state})
        try:
            self.runner = _loader(self.package)
        except Exception as error:  # moved, deleted, or another machine's
            logger.warning("%s: not using the compiled decoding step: %s; decoding eagerly", self.package, error)

    def bind(self, model: nn.Module) -> None:
        """Point the library at the model's tensors (again, if they were replaced: `load_state_dict(assign=True)`).
        A few-rows step's are in its library: it keeps the embedding matrix and the tensors' versions."""
        if self.few_rows is not None and self.dtype == torch.float32:
            self.rows_decoder = RowsDecoder.of(model)
            if self.rows_decoder is not None:  # the model's own weights serve: the step's copy is not loaded
                self.own, self.bound, self.embedding = None, _versions(model), self.embedding_table(model)
                return
        if self.int8 is not None and ("rows_kernel" in self.manifest or int8_batched_on_library(model)):
            self.rows_decoder = RowsDecoder.of(model)  # the int8 few-rows step, or the batched one where it may
            if self.rows_decoder is not None:  # bound to the model's own tensors as the step is
                self.bound, self.int8 = _identity(model), [module for _, module in int8_layers(model)]
                return
        if self.batched_on_library():
            self.rows_decoder = RowsDecoder.of(model)
            if self.rows_decoder is not None:  # the model's own tensors, as the compiled step's
                self.bound = _identity(model)
                return
        tensors = step_tensors(model)
        if self.own_weights and self.own is None:
            from safetensors import safe_open

            with safe_open(str(Path(self.package).parent / FEW_ROWS_WEIGHTS), framework="pt") as weights:
                self.own = {name: weights.get_tensor(name) for name in weights.keys()}  # noqa: SIM118
        if self.table is None and TABLE in self.manifest["constants"].values():
            decoder = model.get_decoder()
            table_function = decoder.embeddings.embed_positions.table_function
            self.table = table_function(int(self.manifest["table_rows"]), model.config.d_model).to(self.dtype)
        constants = {name: (self.table if source == TABLE else self.own[name] if source == FEW_ROWS_WEIGHTS
                            else tensors[source]) for name, source in self.manifest["constants"].items()}  # fmt: skip
        # (use_inactive, check_full_update, user_managed): the library reads these tensors, no copy
        self.runner.load_constants(constants, False, True, True)
        self.bound = _versions(model) if self.own_weights else _identity(model)
        if self.own_weights:
            self.embedding = self.embedding_table(model)
        if self.int8 is not None:
            self.int8 = [module for _, module in int8_layers(model)]

    def batched_on_library(self) -> bool:
        """Whether the float32 batched step's work goes through the beam-search library's step (`RowsDecoder`) where
        that has it. Its products at many rows are the compiled step's: oneMKL's on Intel CPUs, oneDNN's inner product
        on the model's own weights on other x86 CPUs (`gemm_backend`). Both take 53 us a row at 256-750 rows (the main
        job's model, one thread, Intel Xeon); the library's reads beam search's reordering, and the rows left once
        sources finish, through lineages (`PositionSlots.follow`), where the compiled step's views need the rows
        copied in order, 0.5 s of a 6.9 s pass of Multi30k val in batches, beam 4."""
        return (
            self.few_rows is None
            and self.int8 is None
            and self.dtype == torch.float32
            and self.manifest.get("part") != "encoder"
        )

    @staticmethod
    def embedding_table(model: nn.Module) -> torch.Tensor:
        """The table whose rows a library that takes embedded tokens (the few-rows step) is given: the decoder's."""
        return model.get_decoder().embeddings.embed_tokens.weight

    def usable(self, model: nn.Module) -> bool:
        """Whether this call can decode through the library: the step's dtype on the CPU (int8 layers for an int8
        step), eval mode; tensors or int8 layers replaced since loading are bound again (same names and shapes; anything
        else decodes eagerly)."""
        if model.training or self.runner is None:
            return False
        if self.own_weights:  # its weights are its own copy: the model's must be those, unchanged
            versions = _versions(model)
            if self.embedding is None and versions != self.refused:
                # a copy of the model (`copy.deepcopy`, unpickled): its step binds at its first call where the
                # copy's weights are still those it was compiled from (checked once while they stay unchanged)
                if weights_fingerprint(model) != self.manifest["weights"]:
                    self.refused = versions
                    return False
                self.bind(model)
            return versions == self.bound
        versions = _versions(model)
        places = model.__dict__["_tensor_places"]  # the modules and tensors as `_versions` found them
        if self.checked is not None and self.checked[0] is places and self.checked[1] == versions:
            return True
        identity = _identity(model)
        layers = None if self.int8 is None else int8_layers(model)
        same_layers = layers is None or [module for _, module in layers] == self.int8
        if identity == self.bound and same_layers:
            self.checked = (places, versions)
            return True
        if any(
            (dtype != self.dtype and name.rpartition(".")[2] not in ROWS_BUFFERS) or device != "cpu"
            for name, _, _, dtype, device in identity
        ):  # (the int8 few-rows kernel's buffers are int8 and int32)
            return False
        if [entry[:2] for entry in identity] != [entry[:2] for entry in self.bound]:
            return False
        if layers is not None and int8_signature(model) != self.manifest["int8_layers"]:
            return False
        self.bind(model)
        self.checked = (places, versions)
        return True

    def __call__(self, tokens, self_keys, self_values, cross_keys, cross_values, sources, source_mask) -> torch.Tensor:
        if self.rows_decoder is not None:
            return self.rows_decoder(tokens, self_keys, self_values, cross_keys, cross_values, sources, source_mask)
        if self.int8 is not None:
            int8_operator().layers = self.int8
        if self.few_rows is not None:
            tokens = nn.functional.embedding(tokens, self.embedding)
        # The library's own entry point with the flat list of tensors (the package's __call__ would parse its
        # input and output specs again at every step).
        flat = [tokens, *self_keys, *self_values, *cross_keys, *cross_values, sources, source_mask]
        return self.runner.boxed_run(flat)[0]


def int8_batched_on_library(model: nn.Module) -> bool:
    """Whether the int8 batched step's work goes through the beam-search library's step (`RowsDecoder`, its products
    the int8 few-rows kernel's): where every int8 layer of the decoder's step takes that kernel at any number of rows
    (`int8_rows.rows_limit`: a CPU without AMX tiles), so that the library's products are the eager layers'.
    The compiled int8 step calls each of its 48 layers (the main job's model) through Python (`int8_linear`), some
    10 us a call; the library calls the kernel itself, and follows beam search's reordering and the rows of finished
    sources through lineages (`batched_on_library`)."""
    layers = [module for _, module in int8_layers(model.get_decoder())]
    return bool(layers) and all(map(takes_every_row, layers))


def takes_every_row(layer: nn.Module) -> bool:
    """Whether this int8 layer's products are all the int8 few-rows kernel's (its buffers, and no limit on rows)."""
    return "rows_packed" in layer._buffers and layer.rows_kernel_elements >= INT8_ALL_ROWS


class CompiledEncoder(CompiledStep):
    """The float32 model's encoder compiled for one source without padding (compile_step.py's `EncoderPass`): the
    same Section 3.1 stack, about twice as fast for a sentence's few rows. Its products read the model's own weights
    (oneMKL's CPUs) or, like the few-rows step's, a packed copy of its own (the manifest's `weights_packed`); either
    way it serves only while the model's are those it was made from."""

    what, instead = "encoder", "encoding"

    @staticmethod
    def embedding_table(model: nn.Module) -> torch.Tensor:
        """The source's table: the decoder's too where the model shares one (Section 3.4), its own where source and
        target have tables of their own (`share_encoder_decoder_embeddings=False`)."""
        return model.get_encoder().embeddings.embed_tokens.weight

    def __call__(self, input_ids: torch.Tensor) -> EncodedSource:
        """The encoder output (1, S, D) of one source's ids (1, S), and each decoder layer's encoder-decoder keys and
        values of it."""
        hidden, *memory = self.runner.boxed_run([nn.functional.embedding(input_ids, self.embedding)])
        return EncodedSource(hidden, memory[0::2], memory[1::2])


class EncodedSource:
    """A source the compiled encoder encoded: its output (1, S, D) and each decoder layer's encoder-decoder keys
    (1, h, S, d_k) and values (1, h, S, d_v) of it. generate()'s encoder pass keeps the last one on the model, and the
    decoding session that starts on that same output takes its keys and values rather than computing them
    (`taken`)."""

    __slots__ = ("hidden", "keys", "values")

    def __init__(self, hidden: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.hidden, self.keys, self.values = hidden, keys, values

    @staticmethod
    def taken(model: nn.Module, sources: torch.Tensor) -> EncodedSource | None:
        """The source kept on `model` (and no longer kept) where `sources` (the session's encoder output, one row a
        source) is its output to the last bit, else None. The comparison, not the call it came from, decides: a
        call given its own encoder output, or another thread's call on the same model, takes keys and values only
        of the same output, which are then the same."""
        encoded = model.__dict__.pop("_encoded_source", None)
        if encoded is None or encoded.hidden.shape != sources.shape or not torch.equal(encoded.hidden, sources):
            return None
        # (an encoder compiled before it gave the keys and values gives none)
        return encoded if len(encoded.keys) == model.config.num_decoder_layers else None


def encoder_for(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
) -> CompiledEncoder | RowsEncoder | SourcesApart | None:
    """The model's compiled encoder where it can encode this call now: a float32 model on the CPU in eval mode, with
    gradients off; one source (1, S) of at most the positions it was compiled for, unpadded (no mask, or all ones);
    its folder's `compiled-encoder`, fitting the model (loaded at the first such call, then kept). An int8 model's is
    the beam-search library's `RowsEncoder` where the folder has that library and the int8 few-rows kernel, and a
    float32 model's too where the library encodes faster (`library_encodes`: oneDNN's CPUs). Else
    None: the eager encoder, with the same output to float32 rounding (int8's: to the quantization's own error). (A
    model converted or quantized since loading holds other tensors than those the encoder was bound to, which
    `usable` tells: walking its modules for its precision at every call would cost 0.1 ms.) A batch of sources: an
    int8 model's `SourcesApart` where it can take them, else None."""
    if input_ids.dim() == 2 and input_ids.shape[0] > 1:
        return SourcesApart.of(model, input_ids, attention_mask)
    folder = getattr(model, "_compiled_folder", None)
    if folder is None or model.training or torch.is_grad_enabled() or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        return None
    if input_ids.device.type != "cpu" or (attention_mask is not None and not bool(attention_mask.all())):
        return None
    embedding = model.get_input_embeddings().weight
    if embedding.dtype != torch.float32 or embedding.device.type != "cpu":
        return None  # (a bfloat16 model, or one on a GPU: no line, as no step of theirs is missing)
    steps = model.__dict__.setdefault("_compiled_steps", {})
    if "encoder" not in steps:  # (an int8 model is never float32 again)
        kind = precision(model)
        taken = None
        if kind == "int8" or (kind == "float32" and library_encodes()):
            taken = RowsEncoder.of(model)
        if taken is None and kind == "float32":
            taken = _loaded(model, Path(folder) / ENCODER_FOLDER, folder, CompiledEncoder)
        steps["encoder"] = taken
    encoder = steps["encoder"]
    if type(encoder) is RowsEncoder and not encoder.usable(model):  # the model's tensors replaced or changed
        encoder = steps["encoder"] = RowsEncoder.of(model)
    if encoder is None or input_ids.shape[1] > encoder.rows or not encoder.usable(model):
        return None
    return encoder


class SourcesApart:
    """An int8 model's encoder for a batch of sources: each source alone, without its padding, through the library's
    encoder (`RowsEncoder`, as a sentence a call), the outputs, keys and values put back in the batch's padded shape
    (zeros at the padding, which the decoder's encoder-decoder attention leaves out). Where the CPU has no AMX tiles
    (`int8_batched_on_library`: every int8 layer takes the int8 few-rows kernel at any number of rows, so that the
    products are the eager encoder's). Multi30k val through `translate --int8` in batches, greedy, one thread (AMD EPYC
    Zen 5): its 1,014 sources 0.18 s a source at a time, against 0.24-0.26 s for the eager int8 encoder, whose
    attention, norms and residuals run over each batch's padding, and the session computes no keys and values of its
    own (0.03 s). Not a float32 model's: the eager float32 encoder's products are oneDNN's over a batch's rows
    (`unpacked_onednn_products`), 0.43-0.48 s there, against 0.90 s a source at a time."""

    released = True  # (`release_replaced`: it holds no copy of the model's weights)

    def __init__(self, encoder: RowsEncoder, lengths: list[int]):
        self.encoder, self.lengths = encoder, lengths

    @classmethod
    def of(cls, model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> SourcesApart | None:
        """The batch encoder for `model` and these padded sources, or None (the eager encoder): an int8 model whose
        layers all take the kernel at any number of rows, sources padded on the right (each source's positions then
        those of the source alone) by `attention_mask`, and what `encoder_for` asks of one source."""
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            return None
        projection = model.get_output_embeddings()  # (which no encoder reads, and which takes fewer rows)
        layers = [module for _, module in int8_layers(model) if module is not projection]
        if not layers or not all(map(takes_every_row, layers)):
            return None  # (no int8 layers: a float32 or bfloat16 model)
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        lengths = mask.sum(1)
        if not torch.equal(mask, torch.arange(mask.shape[1], device=mask.device) < lengths[:, None]):
            return None  # padded on the left, or holes
        if int(lengths.min()) == 0:
            return None  # (an empty source: the eager encoder's answer, whatever it is)
        longest = int(lengths.max())
        encoder = encoder_for(model, input_ids[:1, :longest], None)  # (the model's, made or kept there)
        return cls(encoder, lengths.tolist()) if type(encoder) is RowsEncoder else None

    def __call__(self, input_ids: torch.Tensor) -> EncodedSource:
        """The encoder output (B, S, D) of the sources' padded ids (B, S), and each decoder layer's encoder-decoder
        keys (B, h, S, d_k) and values (B, h, S, d_v) of it."""
        parts = [self.encoder(input_ids[i : i + 1, :length]) for i, length in enumerate(self.lengths)]
        batch, width = input_ids.shape
        first = parts[0]
        hidden = first.hidden.new_zeros(batch, width, first.hidden.shape[-1])
        keys = [k.new_zeros(batch, k.shape[1], width, k.shape[3]) for k in first.keys]
        values = [v.new_zeros(batch, v.shape[1], width, v.shape[3]) for v in first.values]
        for i, (part, length) in enumerate(zip(parts, self.lengths)):
            hidden[i, :length] = part.hidden[0]
            for whole, own in zip(keys + values, part.keys + part.values):
                whole[i, :, :length] = own[0]
        return EncodedSource(hidden, keys, values)


def library_encodes() -> bool:
    """Whether a float32 sentence a call is encoded by the beam-search library (`RowsEncoder`) rather than the compiled
    encoder: where oneDNN is the chosen GEMM library (other x86 CPUs than Intel's), whose compiled encoder reads a
    packed copy of the weights. In the decoding loop, its weights cold after the decoder's steps, the library's took
    1.26-1.31 ms a source against the compiled encoder's 1.68-1.69 (400 Multi30k val sources, the recipe's model
    trained 1,600 steps, beam 4, one thread, AMD EPYC Zen 5), and it holds no copy. On oneMKL's CPUs the compiled
    encoder stays, measured the faster there (docs/speed.md)."""
    return gemm_backend() == "onednn"


def tensor_fingerprint(tensor: torch.Tensor) -> tuple:
    """The tensor, and whether it was changed in place or its storage replaced since (its version counter)."""
    return (id(tensor), tensor._version, tensor.data_ptr())


# Where `one_call` keeps the call's fingerprints (None until the first check of the call takes them).
CALL_VERSIONS = "_call_versions"


@contextlib.contextmanager
def one_call(model: nn.Module):
    """Within one decoding call (`generate()`), the fingerprints of the tensors the libraries read (`_versions`) are
    taken once: the compiled encoder and the compiled step each ask whether the model's weights are still those they
    were bound to (`CompiledStep.usable`), and nothing within the call changes a weight. Each taking walks the
    model's 94 tensors and 242 places, cold after decoding (0.17 ms; a sentence a call, one thread, AMD EPYC: 1% of
    it). A call made within another (another thread's, on the same model) takes the outer call's."""
    fresh = CALL_VERSIONS not in model.__dict__
    if fresh:
        model.__dict__[CALL_VERSIONS] = None
    try:
        yield
    finally:
        if fresh:
            model.__dict__.pop(CALL_VERSIONS, None)


def _versions(model: nn.Module) -> tuple:
    """`tensor_fingerprint` of each tensor the step reads (written out: a call a tensor costs a third more), taken once
    a call within `one_call`."""
    taken = model.__dict__.get(CALL_VERSIONS)
    if taken is not None:
        return taken
    versions = tuple([(id(tensor), tensor._version, tensor.data_ptr()) for tensor in held_tensors(model).values()])
    if CALL_VERSIONS in model.__dict__:
        model.__dict__[CALL_VERSIONS] = versions
    return versions


def _identity(model: nn.Module) -> tuple:
    return tuple(
        (name, tuple(t.shape), t.data_ptr(), t.dtype, t.device.type) for name, t in held_tensors(model).items()
    )


def held_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """`step_tensors(model)`, as found the last time while the modules still hold them (`TensorPlaces`)."""
    places = model.__dict__.get("_tensor_places")
    if places is None or not places.hold():
        places = model.__dict__["_tensor_places"] = TensorPlaces(model)
    return places.tensors


class TensorPlaces:
    """`step_tensors(model)` and where each is held: every module's children and every parameter and buffer, as
    (the dict holding it, its key, it), and each dict's size. While each is still there and no name was added
    (`hold`), the tensors are the same objects under the same names. Every decoding call asks whether the compiled
    step's weights are still the model's (`CompiledStep.usable`): walking `named_parameters` and `named_buffers` for
    it costs 0.2 ms (the main job's model), and this 0.03; a sentence a call is 0.29 ms (1%) faster for it. A
    module or tensor replaced (an assignment, `load_state_dict(assign=True)`, `quantize_int8`), removed or added
    fails `hold`, and the walk is made again; a tensor changed in place or given new data is the same object, whose
    change `tensor_fingerprint` tells."""

    def __init__(self, model: nn.Module):
        self.tensors = step_tensors(model)
        held = [
            held
            for _, module in model.named_modules(remove_duplicate=False)
            for held in (module._modules, module._parameters, module._buffers)
        ]
        self.held, self.sizes = held, [len(dict_) for dict_ in held]  # a name added (registered, even as None)
        links = [(dict_, key, value) for dict_ in held for key, value in dict_.items()]
        self.link_dicts, self.link_keys, self.link_values = (list(column) for column in zip(*links))

    def hold(self) -> bool:
        # (the loops in C: map and all, 0.1 ms a call less on the main job's model than Python's generators)
        return list(map(len, self.held)) == self.sizes and all(
            map(operator.is_, map(dict.get, self.link_dicts, self.link_keys), self.link_values)
        )


def load_compiled_step(model: nn.Module, folder: str | os.PathLike, few_rows: bool = False) -> CompiledStep | None:
    """The compiled step in `folder`/compiled for `model` (`folder`/compiled-int8 for an int8 model, compiled-bf16
    for a bfloat16 one; with `few_rows`, the model's few-rows step, compiled-few, compiled-few-bf16 or
    compiled-few-int8), or None (with one logged line saying why) when there is none, or it was made for another torch,
    CPU, architecture, set of weights or of int8 layers, or it cannot be read. A model in another dtype than the steps'
    is told so by the float32 step's manifest; a folder without a few-rows step for the model's dtype, or an int8 one
    without the int8 few-rows kernel loaded (`int8_rows.load` said why), gives None silently."""
    kind = precision(model)
    if few_rows and kind not in FEW_ROWS_FOLDERS:
        return None
    where = Path(folder) / (FEW_ROWS_FOLDERS[kind] if few_rows else PRECISIONS[kind or "float32"][0])
    if kind == "bfloat16" and not few_rows and not (where / MANIFEST).is_file():
        where = Path(folder) / FOLDER  # a folder compiled before bf16 steps existed, or on a CPU without them
    return _loaded(model, where, folder, CompiledStep)


def _loaded(model: nn.Module, where: Path, folder: str | os.PathLike, kind: type) -> CompiledStep | None:
    """`kind` (`CompiledStep`, `CompiledEncoder`) of the library in `where` for `model`, as `load_compiled_step`
    says: None where there is none, or (one logged line) where it does not fit."""
    manifest_path = where / MANIFEST
    if not manifest_path.is_file():
        return None
    here = machine()  # before reading the manifest: a VASWANI_TX_GEMM that names no library is the user's to fix
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        problem = _mismatch(manifest, model, here)
    except (ValueError, KeyError, TypeError, OSError) as error:
        problem = f"its manifest cannot be read ({error})"
    if problem is None:
        problem = _changed_files(where, manifest)
    if problem is None and manifest.get("rows_kernel") and not has_rows_kernel(model):
        return None  # the kernel's folder said why the model does not take it (int8_rows.load), or has none
    if problem is None:
        try:
            if manifest.get("precision") == "int8":
                int8_operator()  # the library looks the operator up as it loads
            return kind(_loader(str(where / PACKAGE)), manifest, model, str(where / PACKAGE))
        except Exception as error:  # a truncated or foreign library: torch says so in many ways
            problem = f"it cannot be loaded ({_first_line(error)})"
    logger.warning(
        "%s: not using the compiled %s: %s; %s eagerly (same results; `vaswani-tx compile MODEL` makes a new one)",
        where, kind.what, problem, kind.instead,
    )  # fmt: skip
    return None


def _changed_files(where: Path, manifest: dict) -> str | None:
    """Why the files of a compiled step are not those `vaswani-tx compile` wrote (their sha256 in the manifest,
    `files`), in words; None where they are. A truncated or changed shared library can end the process (SIGBUS)
    where no exception can be caught, so nothing is loaded before this check."""
    files = manifest.get("files")
    if not isinstance(files, dict) or PACKAGE not in files:
        return "its manifest lists no digests of its files (made by an older version)"
    for name, digest in files.items():
        path = where / name
        if not path.is_file() or file_sha256(path) != digest:
            return f"its {name} is not the one built (truncated or changed since)"
    return None


def has_rows_kernel(model: nn.Module) -> bool:
    """Whether the model's int8 layers take the int8 few-rows kernel (`quantize_int8` gave them its buffers, which it
    does where the model's folder has a kernel that loaded: int8_rows.py)."""
    layers = int8_layers(model)
    return bool(layers) and all(ROWS_BUFFERS[0] in module._buffers for _, module in layers)


def _loader(package: str):
    # torch's loader itself (what `torch._inductor.aoti_load_package` wraps): importing Inductor for it would add most
    # of a second to every model load.
    return torch._C._aoti.AOTIModelPackageLoader(package, "model", False, 1, -1)


def _mismatch(manifest: dict, model: nn.Module, here: dict) -> str | None:
    if manifest.get("format") != FORMAT:
        return f"it has format {manifest.get('format')}, this version reads {FORMAT}"
    if manifest["torch"] != here["torch"]:
        return f"it was made with torch {manifest['torch']}, this is torch {here['torch']}"
    if manifest["cpu_capability"] != here["cpu_capability"]:
        return f"it was made for a CPU with {manifest['cpu_capability']}, this one has {here['cpu_capability']}"
    if manifest.get("gemm", "mkl") != here["gemm"]:  # artifacts from before the choice existed are oneMKL's
        made, here = (GEMM_NAMES.get(name, str(name)) for name in (manifest.get("gemm", "mkl"), here["gemm"]))
        return f"its products are {made}'s, and {here}'s are the ones chosen here (VASWANI_TX_GEMM, or this CPU)"
    if manifest["architecture"] != architecture_fingerprint(model.config):
        return "it was made for a model of another configuration"
    parameter = next(model.parameters())
    made = manifest.get("precision", "float32")  # artifacts from before bf16 and int8 steps are float32's
    if parameter.dtype != PRECISIONS[made][1] or parameter.device.type != "cpu":
        return f"it is for {made} on the CPU, and the model is {parameter.dtype} on {parameter.device}"
    if made == "int8" and manifest["int8_layers"] != int8_signature(model):
        return "it was made for other int8 layers than this model's"
    if manifest["weights"] != weights_fingerprint(model):
        return "it was made for other weights"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:200] if text else type(error).__name__


def cache_root() -> Path:
    """The per-user cache of what `vaswani-tx compile` builds: $VASWANI_TX_CACHE, else $XDG_CACHE_HOME/vaswani_tx
    (~/.cache by default). Only this package writes there, from its own sources, on this machine."""
    if os.environ.get("VASWANI_TX_CACHE"):
        return Path(os.environ["VASWANI_TX_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "vaswani_tx"


def native_folder(folder: str | os.PathLike) -> Path | None:
    """Where the compiled steps and libraries of the model saved in `folder` are kept: a folder of the per-user cache
    (`cache_root`/models), keyed by this package's version, torch, the CPU's instruction set and a CRC of the folder's weight files. Never the model folder itself: a downloaded folder is data, and the hub's
    promise is that data runs no code, so nothing native is ever loaded from it (a planted `compiled/*.pt2` or
    `beam-search/*.so` is ignored). None for a copy of this file that travels with saved weights (remote code
    loads no native code at all)."""
    if not __name__.startswith("vaswani_tx."):
        return None
    from vaswani_tx import __version__

    crc, files = 0, sorted([*Path(folder).glob("*.safetensors"), *Path(folder).glob("*.bin")])
    if not files:
        return None
    for path in files:
        crc = zlib.crc32(f"{path.name}:{path.stat().st_size}".encode(), crc)
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
            crc = zlib.crc32(data, crc)
    # (the GEMM library chosen is the manifest's to check: a step made for the other one says so in one line)
    key = f"{__version__}-torch{torch.__version__}-{cpu_capability()}-{crc:08x}"
    return cache_root() / "models" / key.replace("+", "_").replace("/", "_")


def attach(model: nn.Module, folder: str | os.PathLike) -> None:
    """Load the compiled step that `vaswani-tx compile` built for `folder`'s weights (`native_folder`, in the
    per-user cache; never from `folder` itself) for `model` (from_pretrained calls this, and `quantize_int8` again for
    the int8 step), where there is one and it fits. The cache folder is kept, so that a model converted later
    (`.to(torch.bfloat16)`, `.float()`) gets the step for its new dtype (`step_for_dtype`)."""
    where = folder if getattr(model, "_compiled_folder", None) == str(folder) else None
    if where is None and (cache_root() / "models").is_dir() and Path(folder).is_dir():
        where = native_folder(folder)
    found = where is not None and Path(where).is_dir()
    if found:  # beam search's bookkeeping in C++, where `vaswani-tx compile` built it: first, as the float32 batched
        load_beams_library(where)  # step's work may be its step's (`CompiledStep.batched_on_library`)
    model._compiled_step = load_compiled_step(model, where) if found else None
    model._compiled_folder = str(where) if found else None
    model._compiled_steps = {precision(model): model._compiled_step}  # the steps loaded so far, by precision
    model._compiled_for = next(model.parameters()).dtype


def step_for_dtype(model: nn.Module) -> CompiledStep | None:
    """The model's compiled step for the dtype its weights have now. A model converted since its step was attached
    (`from_pretrained(folder)` then `.to(torch.bfloat16)`, or back with `.float()`) gets its folder's step for the
    new dtype, loaded at the first call after the conversion (and kept, one per precision, so that converting back
    and forth loads each once); where the folder has none, the one logged line of `load_compiled_step` and the
    eager path. Unconverted, the model's `_compiled_step` as it is (None: eager, as set)."""
    folder = getattr(model, "_compiled_folder", None)
    dtype = next(model.parameters()).dtype
    if folder is None or dtype == getattr(model, "_compiled_for", dtype):
        return getattr(model, "_compiled_step", None)
    kind = precision(model)
    steps = model.__dict__.setdefault("_compiled_steps", {})
    if kind not in steps:
        steps[kind] = load_compiled_step(model, folder) if kind is not None else None
    model._compiled_step, model._compiled_for = steps[kind], dtype
    return model._compiled_step


def few_rows_key(kind: str) -> str:
    """The few-rows step's key among a model's loaded steps (`_compiled_steps`, by precision): "few_rows" for the
    float32 model's, "few_rows:bfloat16" and "few_rows:int8" for the others'."""
    return "few_rows" if kind == "float32" else f"few_rows:{kind}"


def step_for_rows(model: nn.Module, rows: int) -> CompiledStep | None:
    """The step that can decode a call of `rows` rows (sources x beams) now (`CompiledStep.usable`), or None: the
    float32, bfloat16 or int8 model's few-rows step up to `FEW_ROWS_MAXIMA` rows where its folder has one that fits
    the model (loaded at the first such call, then kept), else `step_for_dtype`'s."""
    compiled = step_for_dtype(model)
    if compiled is None:
        return None
    folder = getattr(model, "_compiled_folder", None)
    kind = compiled.manifest.get("precision", "float32")
    if folder is not None and kind in FEW_ROWS_FOLDERS and rows <= FEW_ROWS_MAXIMA[kind]:
        steps = model.__dict__.setdefault("_compiled_steps", {})
        key = few_rows_key(kind)
        if key not in steps:
            steps[key] = load_compiled_step(model, folder, few_rows=True)
        few = steps[key]
        if few is not None and few.usable(model):
            return few
    return compiled if compiled.usable(model) else None


# --- beam search's bookkeeping in C++ (one_source_beams.py builds it) ------------------------------------------------

BEAMS_FOLDER = "beam-search"
# The library's Python module: loaded under this name into sys.modules, where fast_decoding.py finds it.
BEAMS_MODULE = "vaswani_tx_beams"
BEAMS_LIBRARY = BEAMS_MODULE + ".so"
BEAMS_SOURCE = Path(__file__).with_name("kernels") / "one_source_beams.cpp"


def file_sha256(path: Path) -> str:
    """sha256 of a file: a library's source (it is used only with the source it was built from), or the built
    library, kept in its manifest (loading a truncated shared library can end the process with SIGBUS, where no
    exception can be caught)."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_library_manifest(where: Path, what: str) -> dict | None:
    """A built library's manifest (`where`/manifest.json); None where there is none, or, with one logged line naming
    `what`, where it is unreadable."""
    if not (where / MANIFEST).is_file():
        return None
    try:
        return json.loads((where / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.warning("%s: not using %s: its manifest is unreadable (%s)", where, what, error)
        return None


def source_and_manifest(where: Path, source: Path, what: str) -> dict | None:
    """The manifest of the library built into `where` from `source` (`read_library_manifest`); None where there is
    none, or where this copy of the package has no such source beside it (a saved folder's copy of this file: remote
    code loads no library, since none can be checked against its source)."""
    return read_library_manifest(where, what) if source.is_file() else None


def library_mismatch(manifest: dict, here: dict) -> str | None:
    """The first way a library's manifest does not fit this process (`here`: what a library built now would say),
    in words; None where it fits."""
    for key, what in (("torch", "torch"), ("python", "Python")):
        if key in here and manifest.get(key) != here[key]:
            return f"it was built for {what} {manifest.get(key)}, this is {here[key]}"
    return "it was built from another version of its source" if manifest.get("source") != here["source"] else None


def load_checked(manifest: dict, library: Path, load, digest_required: bool = True) -> str | None:
    """`load()` the built `library` where its sha256 is its manifest's (`file_sha256` says why); None where it
    loaded, else why not in words. Without `digest_required`, a manifest that keeps no digest (written before
    manifests did) is taken at its word."""
    try:
        digest = manifest.get("library")
        if (digest is not None or digest_required) and digest != file_sha256(library):
            return "its library is not the one built (truncated or changed since)"
        load()
    except (ImportError, OSError, RuntimeError) as error:
        return f"its library does not load ({_first_line(error)})"
    return None


def beams_manifest() -> dict:
    """What a beam-search library is built for: this torch, this Python, this source."""
    return {"torch": torch.__version__, "python": sys.implementation.cache_tag, "source": file_sha256(BEAMS_SOURCE)}


def load_beams_library(folder: str | os.PathLike) -> bool:
    """Whether beam search over one source can go through the library now: `folder`/beam-search holds one that fits
    (this torch, this Python, this source; its own digest), loaded into this process at the first such folder, or
    one was loaded before. A folder with none says nothing; one that does not fit logs one line. A saved folder's
    copy of this file (remote code, no C++ source beside it) loads none."""
    if BEAMS_MODULE in sys.modules:
        return True
    where = Path(folder) / BEAMS_FOLDER
    manifest = source_and_manifest(where, BEAMS_SOURCE, "the beam-search library")
    if manifest is None:
        return False

    def import_library() -> None:
        spec = importlib.util.spec_from_file_location(BEAMS_MODULE, where / BEAMS_LIBRARY)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[BEAMS_MODULE] = module

    problem = library_mismatch(manifest, beams_manifest()) or load_checked(
        manifest, where / BEAMS_LIBRARY, import_library
    )
    if problem is not None:
        logger.warning("%s: not using the beam-search library: %s; beam search's Python loop instead", where, problem)
        return False
    return True


# --- the int8 few-rows kernel (int8_rows.py builds it) -------------------------------------------------------------

ROWS_KERNEL_FOLDER = "kernels"
ROWS_KERNEL_LIBRARY = "int8_rows.so"
ROWS_KERNEL_SOURCE = Path(__file__).with_name("kernels") / "int8_rows.cpp"
# The /proc/cpuinfo flags that say a CPU has the instructions the kernel is compiled for.
ROWS_KERNEL_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")

_rows_kernel_loaded = False  # one library a process (it registers the operators), of the source the loading checks


def rows_kernel_cpu_supports() -> tuple[bool, str]:
    """(whether this CPU runs the int8 few-rows kernel, why not in words)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False, f"it is for x86-64 CPUs, this one is {platform.machine()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False, "this system does not say which instructions its CPU has (/proc/cpuinfo)"
    missing = [flag for flag in ROWS_KERNEL_CPU_FLAGS if flag not in flags]
    if missing:
        return False, f"this CPU lacks {', '.join(missing)}"
    return True, ""


def rows_kernel_manifest() -> dict:
    """What an int8 few-rows kernel is built for: this torch, this source, these instructions."""
    return {
        "torch": torch.__version__,
        "source": file_sha256(ROWS_KERNEL_SOURCE),
        "cpu_flags": [*ROWS_KERNEL_CPU_FLAGS],
    }


def rows_kernel_loaded() -> bool:
    """Whether the int8 few-rows kernel's library is loaded into this process (`load_rows_kernel`)."""
    return _rows_kernel_loaded


def load_rows_kernel(folder: str | os.PathLike, quiet: bool = False) -> bool:
    """Whether a model from `folder` takes the int8 few-rows kernel (int8_rows.py): its `kernels/` holds one that fits
    (this torch, this source, this CPU), loaded into this process at the first such folder (one library a process:
    the same source). A folder with none says nothing; one that does not fit logs one line (at debug level where
    `quiet`: greedy search's screen asks for a float32 model, which keeps torch's int8 product without it). A saved
    folder's copy of this file (remote code, no C++ source beside it) loads none."""
    kernels = Path(folder) / ROWS_KERNEL_FOLDER
    manifest = source_and_manifest(kernels, ROWS_KERNEL_SOURCE, "the int8 few-rows kernel")
    if manifest is None:
        return False
    supported, why = rows_kernel_cpu_supports()
    problem = library_mismatch(manifest, rows_kernel_manifest()) or (None if supported else why)

    def load_operators() -> None:
        global _rows_kernel_loaded
        torch.ops.load_library(str(kernels / ROWS_KERNEL_LIBRARY))
        _rows_kernel_loaded = True

        @torch.library.register_fake("vaswani_tx_int8::linear")  # for torch.export (compile_step.py)
        def _(x, packed, scales, sums, bias, out_features):
            return x.new_empty(*x.shape[:-1], out_features)

    if problem is None and not _rows_kernel_loaded:
        problem = load_checked(manifest, kernels / ROWS_KERNEL_LIBRARY, load_operators)
    if problem is not None:
        (logger.debug if quiet else logger.warning)(
            "%s: not using the int8 few-rows kernel: %s; fbgemm's kernel instead", kernels, problem
        )
        return False
    return True
