"""The default decoding loops: transformers' greedy and beam search, step for step, without their per-step waste.

`generate()` prepares everything as transformers does (generation config, logits processors, stopping criteria,
the encoder output, beams expanded) and then, where nothing asks for more than the sequences, its decoding
method is this module's `greedy_search` or `beam_search` rather than transformers' `_sample` or `_beam_search`
(generation_vaswani.py). They make the same choices from the same scores, calling the same processors and
stopping criteria and transformers' own beam-search bookkeeping (`_update_finished_beams`,
`_check_early_stop_heuristic`, ...; `_get_top_k_continuations` as `top_k_continuations`, whose top-k reads block
maxima first), so the output ids are transformers' own. What they save, per step:
- the keys and values: the self-attention's grow in place (`GrowingKeysValues`, no concatenation of the whole
  past every step), the encoder-decoder attention's are kept once per source, not once per beam, and a beam's
  reordering moves the written positions only;
- the pre-softmax projection, the largest product of a step (d_model x 37,000 for the base model): on CPU, from
  3 rows on, its weight is packed once for oneMKL's GEMM (`PackedProjection`), 1.2-1.9x faster than the
  transposed product `nn.Linear` asks for (4 to 128 rows, base shape, one core; the logits agree to float32
  rounding); with 1-2 rows packing gains nothing and costs a copy of W (`Projection`), and below 8 rows only a
  share of W is packed, for memory; greedy search at 1-7 rows finds its argmax through an int8 copy of W and
  computes in float32 only the columns that can hold it (`ScreenedArgmax`; its small operations in the
  beam-search library's C++ where a compiled folder loaded it);
- on x86 CPUs other than Intel's, where oneMKL's float32 products take slow code paths at a few rows, the products
  are oneDNN's instead (`gemm_backend`, CTranslate2's rule): W and the decoder's layers are packed once for oneDNN's
  inner product (`PackedProjection`, `PackedLinears`), and calls of 2-63 rows on one thread decode eagerly on them
  rather than through the compiled step (`packs_beat_compiled`), whose products there are oneDNN's on unpacked
  weights;
  the plain weights' pages then go back to the file they were read from (`release_file_pages`), so that the
  process does not hold each weight twice; logits of many rows come from oneDNN a block of rows at a time, and
  the encoder's products (run once a call) are oneDNN's on the weights as they are (`unpacked_onednn_products`);
- the logits: no float32 copy of them, very large ones written into a buffer kept for the call (a fresh tensor
  above 32 MiB costs page faults every step), a block of rows at a time where the model's own pre-softmax layer
  computes them (int8, bfloat16, a bias: `OwnProjection`), and beam search's log-softmax written over them (as
  each block of rows is written, where the projection goes a block at a time), and the processors
  that would rewrite all of them to mask a few columns (minimum lengths, suppressed tokens) mask those columns in
  place;
- finished sentences leave the decoder's batch (transformers decodes them to the end of the batch's longest),
  and beam search's log-softmax and top-k too where the processors can follow (`sources_can_leave`).
- beam search's top-k over each source's beams x V scores searches only the 64-score blocks with the k largest
  maxima (`largest`: the same values at the same indices, 2.5x faster than `torch.topk` at 6 x 8,000), and adds
  the beams' scores to those blocks only, not to all k x V log-probabilities;
- a sentence a call (one source: a service, the pipeline given a string), beam search's bookkeeping over the 2k
  candidates runs in Python rather than as some 40 tensor operations a step on tensors of a dozen numbers
  (`one_source_search`, the same float32 scores and choices).
The model's own decoder `forward` computes each step: the attention reads its keys and values from the cache it
is given (`DecodingCache` has the part of transformers' EncoderDecoderCache interface it uses).
Where the model's folder holds a compiled decoding step (`vaswani-tx compile`, compiled_decoding.py) that fits the
call, each step runs that instead (`CompiledSession`): the same forward, compiled ahead of time, without
Python's per-operator overhead; the same ids (tested).

Anything else (sampling, scores or attention weights returned, a streamer, a cache passed in, a static cache,
`fast_decoding=False`) runs transformers' loops unchanged.

This file travels with saved weights for `trust_remote_code`: torch, transformers (and numpy, which transformers
requires), compiled_decoding.py and static_decoding.py only.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import sys
import threading
import weakref
from pathlib import Path

import numpy
import torch
from torch import nn
from transformers.cache_utils import EncoderDecoderCache
from transformers.generation import logits_process
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    SuppressTokensLogitsProcessor,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

from .compiled_decoding import (
    BEAMS_MODULE,
    FEW_ROWS_MAXIMA,
    ROWS_BUFFERS,
    CompiledStep,
    EncodedSource,
    gemm_backend,
    load_rows_kernel,
    onednn_linear_available,
    release_file_pages,
    rows_kernel_loaded,
    step_for_rows,
    step_tensors,
    tensor_fingerprint,
)
from .static_decoding import CACHE_FIELD, _Keys, is_static_cache

# --- the cache ---------------------------------------------------------------------------------------------------


class GrowingKeysValues:
    """The self-attention keys and values of every decoder layer, (B, h, capacity, d) each, written in place.

    The written prefix is a view that the attention's batched products read without a copy; when the capacity is
    reached it doubles (one copy of the prefix), so that a sentence of T tokens costs O(T) copying, not the
    O(T^2) of concatenating the past to each new position. Beam search reorders the rows of the written prefix
    into one spare buffer, which then takes the layer's place (one copy, not a gather and a copy back)."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers  # positions written, per layer (a step updates them one after another)
        self.spare: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return self.lengths[-1]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the new positions' keys and values (B, h, T, d); return all positions', (B, h, P + T, d)."""
        start = self.lengths[layer_idx]
        end = start + key.shape[2]
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if keys is None or end > keys.shape[2]:
            keys = self.keys[layer_idx] = _grown(keys, key, start)
            values = self.values[layer_idx] = _grown(values, value, start)
        keys[:, :, start:end] = key
        values[:, :, start:end] = value
        self.lengths[layer_idx] = end
        return keys[:, :, :end], values[:, :, :end]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder to) these rows of the batch: the beams that go on, or the sentences not finished.

        The copies hold the written positions and room for one more, no spare capacity: the next step's keys are
        then the whole buffer, which the attention's batched products read 2.5-4x faster than a prefix of a
        larger one (oneMKL's small products over strided matrices; 1,440 rows x 8 heads x 12 positions: 2.1
        against 9.2 ms a product on an AMD EPYC). Beam search reorders at every step, so it always reads whole
        buffers."""
        for buffers in (self.keys, self.values):
            self.spare = select_written_rows(buffers, rows, self.lengths, self.spare, room=1)


def select_written_rows(
    buffers: list, rows: torch.Tensor, written: list[int], spare: torch.Tensor | None, room: int | None = None
) -> torch.Tensor | None:
    """Keep (and reorder to) `rows` of each layer's (rows, h, positions, d) buffer, copying its `written[layer]`
    positions only, into the spare buffer, which then takes the layer's place while the layer's old buffer becomes
    the spare (one copy, no allocation). Fewer rows (finished sentences) go into the first elements of the spare: a
    fresh tensor that large would cost page faults at every selection (see FRESH_BYTES), 3x the copy itself on
    Multi30k val. With `room`, the copies are `written + room` positions long rather than the buffer's capacity
    (views of the spare's allocation, which is kept whole). Returns the spare."""
    for layer, buffer in enumerate(buffers):
        if buffer is None:
            continue
        end = written[layer]
        shape = [rows.numel(), *buffer.shape[1:]]
        if room is not None:
            shape[2] = end + room
        target = _within(spare, shape, buffer, slack=room is not None)
        torch.index_select(buffer.narrow(2, 0, end), 0, rows, out=target.narrow(2, 0, end))
        # With `room` every buffer is this function's (or `_grown`'s) own allocation or a view of one: its whole
        # allocation becomes the spare.
        buffers[layer], spare = target, (buffer._base if room is not None and buffer._base is not None else buffer)
    return spare


def _within(spare: torch.Tensor | None, shape: list[int], like: torch.Tensor, slack: bool = False) -> torch.Tensor:
    """A contiguous tensor of `shape` in the first elements of `spare` (contiguous) where it has room, else a new one
    (with `slack`, a view of one twice that size, so that buffers growing a position a step are not new at each)."""
    size = math.prod(shape)
    if not has_room(spare, size, like):
        return like.new_empty(2 * size)[:size].view(shape) if slack else like.new_empty(shape)
    return spare.view(-1)[:size].view(shape)


def has_room(spare: torch.Tensor | None, size: int, like: torch.Tensor) -> bool:
    """Whether `spare` can hold `size` elements of a tensor like `like` (its dtype, its device)."""
    return spare is not None and spare.numel() >= size and spare.dtype == like.dtype and spare.device == like.device


def _grown(buffer: torch.Tensor | None, new: torch.Tensor, written: int) -> torch.Tensor:
    """A buffer for at least twice the positions `written` + `new` hold, with the first `written` copied over."""
    capacity = max(16, 2 * (written + new.shape[2]))
    grown = new.new_empty(*new.shape[:2], capacity, new.shape[3])
    if written:
        grown[:, :, :written] = buffer[:, :, :written]
    return grown


class SourceKeysValues:
    """The encoder-decoder keys and values of every layer, computed at the first step and kept, one row per
    source: the beams of a source attend to them as one block of queries (`MultiHeadAttention`)."""

    def __init__(self, num_layers: int):
        self.layers = [_Keys(None, None) for _ in range(num_layers)]
        self.spare: torch.Tensor | None = None  # see `select_written_rows`

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        # Contiguous once: the projections' (B, S, h, d) -> (B, h, S, d) views would make every step's batched
        # products copy them.
        layer.keys, layer.values = key.contiguous(), value.contiguous()
        return layer.keys, layer.values

    def select_rows(self, rows: torch.Tensor) -> None:
        for name in ("keys", "values"):
            buffers = [getattr(layer, name) for layer in self.layers]
            written = [0 if buffer is None else buffer.shape[2] for buffer in buffers]
            self.spare = select_written_rows(buffers, rows, written, self.spare)
            for layer, buffer in zip(self.layers, buffers):
                setattr(layer, name, buffer)


class DecodingCache:
    """What the decoder's attention reads from transformers' EncoderDecoderCache (`self_attention_cache.update`,
    `cross_attention_cache.layers`, `is_updated`, `get_seq_length`), for this module's loops."""

    def __init__(self, num_layers: int):
        self.self_attention_cache = GrowingKeysValues(num_layers)
        self.cross_attention_cache = SourceKeysValues(num_layers)
        self.is_updated: dict[int, bool] = {}

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.self_attention_cache.length


# --- the pre-softmax projection ----------------------------------------------------------------------------------


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# --- the products ---------------------------------------------------------------------------------------------------


def can_pack(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    if packing_backend(weight) == "onednn":
        return weight.dtype == torch.float32 or onednn_linear_available()
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def packing_backend(weight: torch.Tensor) -> str:
    """Whose packed product a pre-softmax W takes: float32's, the faster GEMM library here (`gemm_backend`);
    bfloat16's, oneDNN's on every CPU (oneMKL packs float32 only)."""
    return gemm_backend() if weight.dtype == torch.float32 else "onednn"


def onednn_linear(
    rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, then: str = "none"
) -> torch.Tensor:
    """rows (M, K) x W^T + b through oneDNN's inner product, W packed by `mkldnn._reorder_linear_weight` or not;
    `then="relu"` applies max(0, .) to the sums as oneDNN writes them (a post-op: no second pass over the output)."""
    return torch.ops.mkldnn._linear_pointwise(rows, packed, bias, then, [], "")


class PackedLinears:
    """The decoder's float32 `nn.Linear` layers (the attention projections of Section 3.2.2 and the feed-forward
    layers of Section 3.3) with their weights packed once for oneDNN, kept per model while the weights are unchanged
    (checked at every `generate()`), where oneMKL's product is the slower one on these CPUs (`gemm_backend`). A call
    that starts with `min_rows()` rows or more packs them; `installed()` then runs them in place of the layers' own
    product at every step of it, down to one row (beam search's first step, a source at a time; greedy search's last
    sentences): once packed, the plain weights' pages are given back (`release_file_pages`), and reading them again
    would hold both copies, for no speed (at one row from memory the two products are within 5%, bench_gemm.py)."""

    @staticmethod
    def min_rows() -> int:
        """From 2 rows on with one thread. One row is a matrix-vector product bound by reading W: oneMKL runs it on
        one thread, faster than oneDNN there (a greedy step, base shape: 13.6 ms through the compiled step against
        21.1 with oneDNN's), but oneDNN spreads it over all threads (2 threads: 12.8 against 10.9 ms)."""
        return 1 if torch.get_num_threads() > 1 else 2

    def __init__(self, modules: list[nn.Linear]):
        self.fingerprint = [tensor_fingerprint(module.weight) for module in modules]
        self.layers = []
        with torch.no_grad():
            for module in modules:
                packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
                self.layers.append((module, OneDNNForward(packed, module.bias)))
                release_file_pages(module.weight)  # one layer at a time: never both copies of every layer at once

    def installed(self):
        return forwards_installed(self.layers)

    @classmethod
    def of(cls, model: nn.Module) -> PackedLinears | None:
        """The model's decoder layers packed, or None where this does not apply (oneMKL chosen, not float32 on the
        CPU, no float32 `nn.Linear` layers: an int8 model's are quantized)."""
        if gemm_backend() != "onednn":
            return None
        modules = float32_cpu_linears(model.get_decoder())
        if not modules:
            return None
        entry = _LINEARS.get(model)
        if entry is None or entry.fingerprint != [tensor_fingerprint(module.weight) for module in modules]:
            _LINEARS.pop(model, None)  # one packing in memory at a time
            entry = _LINEARS[model] = cls(modules)
        return entry


def float32_cpu_linears(module: nn.Module) -> list[nn.Linear]:
    """The plain float32 `nn.Linear` layers on the CPU under `module` (not an int8 model's quantized ones): those
    whose product oneDNN can take over."""
    return [
        layer
        for layer in module.modules()
        if type(layer) is nn.Linear and layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
    ]


class OneDNNForward:
    """An `nn.Linear`'s forward through oneDNN's inner product, on its weight packed (`PackedLinears`) or as it is
    (the compiled step's, compile_step.py)."""

    __slots__ = ("weight", "bias")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight, self.bias = weight, bias

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = onednn_linear(hidden.reshape(-1, hidden.shape[-1]), self.weight, self.bias)
        return rows.view(*hidden.shape[:-1], -1)


# From this many rows (a batch's source tokens) oneDNN's product on the weights as they are beats oneMKL's where
# oneDNN is chosen: the main job's encoder shapes on an AMD EPYC, one thread, 1,024-3,500 rows: 13-26% less time
# (256 x 1,024 at 3,500 rows: 17.7 against 24.0 ms); at 64 rows within 5%, below it oneMKL's is the faster.
UNPACKED_ONEDNN_MIN_ROWS = 256


def unpacked_onednn_products(module: nn.Module, rows: int):
    """While the block runs, the float32 `nn.Linear` layers under `module` compute through oneDNN's inner product
    on their weights as they are (no packed copy: run once a call, as the encoder and the encoder-decoder keys and
    values are), where oneDNN is chosen (`gemm_backend`), gradients are off and the product has `rows` rows or
    more; otherwise nothing changes. The same outputs to float32 rounding."""
    if rows < UNPACKED_ONEDNN_MIN_ROWS or torch.is_grad_enabled() or gemm_backend() != "onednn":
        return contextlib.nullcontext()
    layers = [(layer, OneDNNForward(layer.weight, layer.bias)) for layer in float32_cpu_linears(module)]
    return forwards_installed(layers + [(ffn, ReLUFeedForward(ffn)) for ffn in relu_feed_forwards(module, layers)])


def relu_feed_forwards(module: nn.Module, layers: list[tuple[nn.Module, OneDNNForward]]) -> list[nn.Module]:
    """The feed-forward networks under `module` (Section 3.3) whose max(0, .) oneDNN can apply as it writes W_1's
    product (`ReLUFeedForward`): ReLU, no dropout between the two products, both layers among `layers`."""
    taken = {id(layer) for layer, _ in layers}
    return [
        ffn
        for ffn in module.modules()
        if getattr(ffn, "activation", None) is torch.relu
        and id(getattr(ffn, "w_1", None)) in taken
        and id(getattr(ffn, "w_2", None)) in taken
        and not (ffn.activation_dropout.training and ffn.activation_dropout.p > 0)
    ]


class ReLUFeedForward:
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Equation 2) through oneDNN's inner product on the weights as they are,
    max(0, .) applied as oneDNN writes x W1 + b1: the encoder's widest activation (rows x d_ff) is written once, not
    written and then read and written again by a separate ReLU (the main job's model, Multi30k val in batches, one
    thread, AMD EPYC: the ReLU took 36 ms of the encoder's 940). The same values: max(0, .) of the same sums."""

    __slots__ = ("ffn",)

    def __init__(self, ffn: nn.Module):
        self.ffn = ffn

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        w_1, w_2 = self.ffn.w_1, self.ffn.w_2
        inner = onednn_linear(hidden.reshape(-1, hidden.shape[-1]), w_1.weight, w_1.bias, then="relu")
        return onednn_linear(inner, w_2.weight, w_2.bias).view(*hidden.shape[:-1], -1)


@contextlib.contextmanager
def forwards_installed(layers: list[tuple[nn.Module, OneDNNForward]]):
    """Each module's forward replaced by its given one while the block runs, the module's own again after."""
    for module, forward in layers:
        module.forward = forward  # an instance attribute: nn.Module's __call__ looks it up first
    try:
        yield
    finally:
        for module, _ in layers:
            # another thread decoding with this model may have taken it off already (its steps then take the
            # layer's own product, the same to float32 rounding)
            module.__dict__.pop("forward", None)


_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PackedProjection:
    """x W^T for the pre-softmax matrix W (V, D) (Section 3.4), through oneMKL's GEMM on a copy of W packed once
    for a number of rows (as Inductor's weight freezing does); oneMKL's packed GEMM takes only that number of rows,
    and torch computes any other with its usual product. Kept per model (one packing, about W's size, or a share
    of it below `PACK_ALL_ROWS` rows where W is larger than `PACK_WHOLE_BYTES`, the other rows of W taking the
    usual product) while W is unchanged (its identity and in-place version are checked at every `generate()`); a
    `generate()` with another number of rows packs again (about 20 ms for the base model). Where `gemm_backend()` is
    oneDNN, W is packed whole for oneDNN's inner product instead, which takes any number of rows: one packing serves
    every call."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.weight, self.rows = weight, rows
        self.fingerprint = tensor_fingerprint(weight)
        self.backend = packing_backend(weight)
        # Below PACK_ALL_ROWS rows, W's first PACK_FEW_ROWS_SHARE only, unless W is small (PACK_WHOLE_BYTES); its
        # other rows take the usual product (oneMKL's; where that is the slow one, oneDNN packs all of W).
        vocabulary = weight.shape[0]
        small = weight.numel() * weight.element_size() <= PACK_WHOLE_BYTES
        whole = rows >= PACK_ALL_ROWS or self.backend == "onednn" or small
        self.split = vocabulary if whole else math.ceil(vocabulary * PACK_FEW_ROWS_SHARE)
        self.parts: list[torch.Tensor] = []  # (oneDNN's packing, in parts of rows of W)
        with torch.no_grad():
            if self.backend == "onednn":
                # In parts of rows (`PACK_PART_BYTES`), each part's file pages given back once it is packed
                part_rows = max(64, PACK_PART_BYTES // (weight.shape[1] * weight.element_size()) // 64 * 64)
                for start in range(0, vocabulary, part_rows):
                    part = weight.detach()[start : start + part_rows]
                    self.parts.append(torch.ops.mkldnn._reorder_linear_weight(part))
                    if part_rows < vocabulary:
                        release_file_pages(part)
                self.packed = self.parts[0] if len(self.parts) == 1 else None
                # (the pages at the parts' edges too) the embeddings read a few rows of W a step, and products of
                # very many rows W itself
                release_file_pages(weight)
            else:
                self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach()[: self.split], rows)

    def serves(self, rows: int) -> bool:
        """Whether a product of this many rows can use the packing."""
        return self.backend == "onednn" or rows == self.rows

    def onednn_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 logits (rows, V) through oneDNN's packing, part by part where W was packed in parts."""
        if len(self.parts) == 1:
            return onednn_linear(rows, self.parts[0], None).float()
        return torch.cat([onednn_linear(rows, part, None) for part in self.parts], dim=1).float()

    @property
    def whole(self) -> bool:
        """Whether all of W is packed (then the logits are oneMKL's own tensor, and `out` is not needed)."""
        return self.split == self.weight.shape[0]

    def __call__(
        self, hidden: torch.Tensor, out: torch.Tensor | None = None, log_softmax: bool = False
    ) -> torch.Tensor:
        """The logits (..., V), or their log-softmax; where W is packed in part, or by oneDNN, written into `out`
        (rows, V) when given."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        split, weight = self.split, self.weight
        # (a bfloat16 W's logits are bfloat16: made float32, as the loops read them, before the log-softmax)
        if self.backend == "onednn" and out is not None:  # oneDNN's product has no `out`: a block at a time
            blocks = logits_in_blocks(self.onednn_logits, rows, out, log_softmax)
            return blocks.view(*hidden.shape[:-1], -1)
        if self.backend == "onednn":
            return in_log_space(self.onednn_logits(rows), log_softmax).view(*hidden.shape[:-1], -1)
        logits = torch.ops.mkl._mkl_linear(rows, self.packed, weight[:split], None, self.rows)
        if not self.whole:
            head, logits = logits, out if out is not None else rows.new_empty(rows.shape[0], weight.shape[0])
            logits[:, :split] = head
            logits[:, split:] = torch.mm(rows, weight[split:].t())
        return in_log_space(logits, log_softmax).view(*hidden.shape[:-1], -1)

    @classmethod
    def of(cls, model: nn.Module, rows: int):
        """The model's projection packed for `rows` rows, or None where packing does not apply (not float32 or
        bfloat16 on the CPU, no oneMKL, an int8 or otherwise replaced pre-softmax layer)."""
        weight = projection_weight(model, bfloat16=True)
        if weight is None or not can_pack(weight):
            return None
        entry = _PACKED.get(model)
        backend = packing_backend(weight)
        stale = entry is None or entry.backend != backend or entry.fingerprint != tensor_fingerprint(weight)
        if stale or not entry.serves(rows):
            _PACKED.pop(model, None)  # the old packing goes before the new one is made: one at a time in memory
            entry = _PACKED[model] = cls(weight, rows)
        return entry


def projection_weight(model: nn.Module, bfloat16: bool = False) -> torch.Tensor | None:
    """The pre-softmax matrix W where the loops may compute its product themselves: a float32 `nn.Linear`
    without bias on the CPU (with `bfloat16`, a bfloat16 one too); None for an int8 or otherwise replaced layer
    (then the model's own `project`)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        return None
    weight = head.weight
    dtypes = (torch.float32, torch.bfloat16) if bfloat16 else (torch.float32,)
    return weight if weight.device.type == "cpu" and weight.dtype in dtypes else None


# Below this many rows the product is bound by reading W, and packing gains nothing there (1-2 rows, base shape:
# within 3%) for its cost, a second copy of W. From 3 rows on it pays (at 4 rows 4.75 against 7.3 ms).
PACK_MIN_ROWS = 3
# The copy costs W's size whatever the rows (72 MiB for the base model), and what it saves grows with them (1.2x
# at 4 rows, 1.9x at 128). Below PACK_ALL_ROWS rows only W's first PACK_FEW_ROWS_SHARE is packed. At beam 4,
# batch 1: all of W, MarianMT's peak + 11%; half, + 5% but 1.0x CTranslate2 instead of 1.1x; three quarters, + 8%
# at the full packing's speed (docs/speed.md).
PACK_ALL_ROWS = 8
PACK_FEW_ROWS_SHARE = 0.75
# A W of at most this many bytes is packed whole at any rows: the quarter left out would save under 1% of the
# process' peak (4 MiB of 430 or more), and its own product costs a sixth of the projection (8,000 x 256 at beam 4,
# one thread, Intel Xeon, inside the decoding loop: 0.62-0.69 against 0.52-0.57 ms a step, docs/speed.md).
PACK_WHOLE_BYTES = 16 * 2**20
# oneDNN packs W in parts of at most this many bytes (whole multiples of 64 rows), each part's own pages given back
# as soon as it is packed: packed whole, W's pages and its packed copy were resident together at the first call (the
# base shape's 75 MB W: 691 MiB at that moment against 614 before and 619 after, beam 4 batch 1's peak MarianMT's
# + 10.0-10.8%). The parts' products are the whole packing's bit for bit (2, 3 and 4 parts, one and two threads,
# 1-800 rows: oneDNN sums each column alone); many rows then take one copy more of their logits (`torch.cat`).
PACK_PART_BYTES = 16 * 2**20
# glibc maps every allocation above 32 MiB afresh (its largest mmap threshold), and a fresh (rows, V) tensor then
# costs a page fault per 4 KiB at each step: 16-20 ms for Multi30k's 1,750 x 8,000 logits, more than the product.
# Logits that large go into one buffer kept for the call.
FRESH_BYTES = 32 * 2**20
FLOAT32_BYTES = 4


class KeptBuffers:
    """The large buffers of a model's decoding calls on the CPU (`PositionSlots`' keys, values and spares, the
    logits' buffer of `Projection` and `OwnProjection`, `first_step`'s logits for the beams), kept on the model from
    one call to the next. A call's own, above glibc's mmap threshold (see FRESH_BYTES), were mapped afresh at its
    start and unmapped at its end, and every call's first write to each 4 KiB page of them was a page fault: a
    batched pass of Multi30k val (beam 6, one thread, AMD EPYC) took 300,000-400,000 faults in calls after the
    first, 0.5-0.9 s of its 13 in the kernel; 13,000 and 0.04 s kept. A buffer is lent to an owner, the object that
    holds it, and is free again once the owner is gone or gives it back (`give`). At most `KEEP` are kept (more
    while more are lent), the smallest free ones dropped first. The cost: they stay with the model between calls,
    as its packed weights do (after that pass, 1,090 MB resident against 864; the peak is unchanged)."""

    KEEP = 6

    def __init__(self):
        self.lent: list[tuple[torch.Tensor, weakref.ref | None]] = []  # (buffer, its owner; None: free)
        self.lock = threading.Lock()  # (calls of one model from several threads)

    @classmethod
    def of(cls, model: nn.Module) -> KeptBuffers:
        if model not in _KEPT:
            _KEPT[model] = cls()
        return _KEPT[model]

    def take(self, owner, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of `size` elements, lent to `owner`: the first elements of the smallest free buffer that
        holds them, else a new buffer. Off the CPU a new tensor each time: torch's caching allocator keeps its own."""
        if torch.device(device).type != "cpu":
            return torch.empty(size, dtype=dtype, device=device)
        with self.lock:
            free = [i for i, (buffer, held) in enumerate(self.lent) if (held is None or held() is None)]
            fits = [i for i in free if self.lent[i][0].numel() >= size and self.lent[i][0].dtype == dtype]
            if fits:
                index = min(fits, key=lambda i: self.lent[i][0].numel())
                buffer = self.lent[index][0]
            else:
                # the free buffers too small for it go first, the smallest first, down to KEEP in all
                for i in sorted(free, key=lambda i: self.lent[i][0].numel())[: max(0, len(self.lent) + 1 - self.KEEP)]:
                    self.lent[i] = None
                self.lent = [entry for entry in self.lent if entry is not None]
                buffer = torch.empty(size, dtype=dtype, device=device)
                self.lent.append((buffer, None))
                index = len(self.lent) - 1
            self.lent[index] = (buffer, weakref.ref(owner))
            return buffer[:size]

    def give(self, tensor: torch.Tensor | None) -> None:
        """The buffer `tensor` is in (a view taken from it) is free again."""
        if tensor is None:
            return
        with self.lock:
            for i, (buffer, _) in enumerate(self.lent):
                if buffer.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr():
                    self.lent[i] = (buffer, None)


_KEPT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The largest mmap threshold glibc's own adjustment reaches (DEFAULT_MMAP_THRESHOLD_MAX on 64 bits), less two pages:
# a block freed of this size takes the threshold (and the trim threshold, twice it) to their highest.
MALLOC_RAISING_BYTES = 32 * 2**20 - 2 * 4096
# Variables by which a user sets glibc's thresholds: then theirs stand.
MALLOC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@functools.cache
def raise_malloc_thresholds() -> bool:
    """Once a process, at its first call in batches on the CPU: take glibc malloc's mmap threshold to its highest
    (32 MiB), as glibc itself does once a mapped block that large is freed, by allocating and freeing one (a page
    touched). Not for a sentence a call, whose temporaries are small: there the heap kept up to twice the threshold
    free would raise the process' peak (greedy batch 1 sits at MarianMT's + 7.5% on the base shape).

    Why: glibc starts at 128 KiB and raises the threshold only as mapped blocks are freed, and it gives the top of its
    heap back to the kernel past twice the threshold. A batched call's temporaries (its step's products, tens of MB
    a step) were thus mapped, given back and faulted in again: Multi30k val in batches, beam 4, a fresh process'
    first pass took 290,000-300,000 page faults (0.5 s of the kernel's time, two threads, AMD EPYC Zen 5), against
    206,000-226,000 raised (the rest: its peak's pages, touched once), and later passes 65,000-69,000 against
    45,000-63,000. Nothing is pinned: glibc goes on adjusting as it would, and where the user set the thresholds
    (`MALLOC_VARIABLES`, GLIBC_TUNABLES) or the process' malloc is not glibc's (jemalloc, tcmalloc preloaded), this
    does nothing. Returns whether it raised them."""
    import ctypes
    import os
    import platform

    if platform.libc_ver()[0] != "glibc" or "GLIBC_TUNABLES" in os.environ:
        return False
    if any(variable in os.environ for variable in MALLOC_VARIABLES):
        return False
    try:
        process, libc = ctypes.CDLL(None), ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    malloc, free = process.malloc, process.free
    if ctypes.cast(malloc, ctypes.c_void_p).value != ctypes.cast(libc.malloc, ctypes.c_void_p).value:
        return False  # another allocator serves this process
    malloc.restype, malloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    block = malloc(MALLOC_RAISING_BYTES)
    if not block:
        return False
    free(block)
    return True


def kept_rows(owner, kept: KeptBuffers, old: torch.Tensor | None, rows: int, width: int, device) -> torch.Tensor:
    """A float32 (rows, width) buffer from `kept` for `owner`, in place of its `old` one (given back first, so that a
    larger buffer can take its place)."""
    kept.give(old)
    return kept.take(owner, rows * width, torch.float32, device).view(rows, width)


# oneDNN's product of many rows a block of logits of this size at a time (`PackedProjection`): under FRESH_BYTES, so
# glibc serves each from its heaps after the first. Multi30k's 1,200-1,800 rows x 8,000 (one thread, AMD EPYC): 60-95
# ms against oneMKL's 87-130 into the kept buffer, the log-softmax included.
ONEDNN_BLOCK_BYTES = 16 * 2**20


def fits_fresh(rows: int, vocabulary: int) -> bool:
    """Whether `rows` rows of float32 logits over the vocabulary are small enough for a fresh tensor (`FRESH_BYTES`)."""
    return rows * vocabulary * FLOAT32_BYTES <= FRESH_BYTES


def logits_in_blocks(product, rows: torch.Tensor, out: torch.Tensor, log_softmax: bool) -> torch.Tensor:
    """`product`'s logits of `rows` (N, D) a block of rows at a time (`ONEDNN_BLOCK_BYTES` of them), written into
    `out` (N, V), through the log-softmax with `log_softmax`: each block's fresh logits small enough for glibc's
    heaps (`FRESH_BYTES`), and written while still in the cache. Returns `out`."""
    block = max(1, ONEDNN_BLOCK_BYTES // (out.shape[1] * out.element_size()))
    for start in range(0, rows.shape[0], block):
        logits = product(rows[start : start + block])
        if log_softmax:
            torch.ops.aten._log_softmax.out(logits, -1, False, out=out[start : start + block])
        else:
            out[start : start + block] = logits
    return out


def in_log_space(logits: torch.Tensor, log_softmax: bool) -> torch.Tensor:
    """The logits, or their log-softmax over the vocabulary written over them (rows, V)."""
    return torch.ops.aten._log_softmax.out(logits, -1, False, out=logits) if log_softmax else logits


class Projection:
    """x W^T for the pre-softmax matrix W (V, D) (Section 3.4), one call of `generate()` long: through
    `PackedProjection` for the number of rows it packed (oneMKL's: between `PACK_MIN_ROWS` and logits of
    `FRESH_BYTES`; oneDNN's: any, logits above `FRESH_BYTES` a block of rows at a time into the kept buffer),
    otherwise torch's product of x and W^T written into a buffer reused from step to step (the same GEMM as
    `nn.Linear`, bit for bit). The logits returned are valid until the next call."""

    def __init__(
        self, weight: torch.Tensor, packed: PackedProjection | None, kept: KeptBuffers | None = None, library=None
    ):
        self.weight, self.packed, self.library = weight, packed, library
        self.kept = kept or KeptBuffers()
        self.buffer: torch.Tensor | None = None

    def __call__(self, hidden: torch.Tensor, log_softmax: bool = False) -> torch.Tensor:
        """The logits (..., V), or their log-softmax (written over them: beam search's scores)."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        packed = self.packed is not None and self.packed.serves(rows.shape[0])  # (never with the library's)
        if packed and self.packed.whole and fits_fresh(rows.shape[0], self.weight.shape[0]):
            return self.packed(hidden, log_softmax=log_softmax)
        if self.buffer is None or self.buffer.shape[0] < rows.shape[0]:
            self.buffer = kept_rows(self, self.kept, self.buffer, rows.shape[0], self.weight.shape[0], rows.device)
        logits = self.buffer[: rows.shape[0]]
        if packed:
            return self.packed(hidden, out=logits, log_softmax=log_softmax)
        if self.library is not None and rows.shape[0] <= ROWS_PROJECTION_MAX_ROWS:
            self.library.rows_projection(rows.contiguous(), self.weight, logits)
        else:
            torch.mm(rows, self.weight.t(), out=logits)
        return in_log_space(logits, log_softmax).view(*hidden.shape[:-1], -1)

    @classmethod
    def of(cls, model: nn.Module, rows: int, pack: bool = True):
        """The model's projection for a call that starts with `rows` rows, or None where this does not apply
        (not float32 or bfloat16 on the CPU, a bfloat16 one not packed, an int8 or otherwise replaced pre-softmax
        layer): the model's own `project`. `pack=False`: never packed (greedy search's screen computes most steps'
        argmax without it)."""
        weight = projection_weight(model, bfloat16=True)
        if weight is None:
            return None
        if weight.dtype == torch.bfloat16:
            # bfloat16: oneDNN's product on W packed for it, or the model's own (`OwnProjection`). Packed, a few rows
            # take 0.53-0.58 against 0.86-0.94 ms (6 rows x 256 x 8,000, one thread, AMD EPYC), the same logits.
            packed = PackedProjection.of(model, rows) if pack else None
            return cls(weight, packed, KeptBuffers.of(model)) if packed is not None else None
        library = projection_library(weight, rows)
        if library is not None:  # (W unpacked: the library reads the model's own)
            return cls(weight, None, KeptBuffers.of(model), library)
        # oneDNN's beats oneMKL's at any rows there, many a block at a time; oneMKL's packing takes only `rows`
        onednn = gemm_backend() == "onednn"
        packs = pack and rows >= (1 if onednn else PACK_MIN_ROWS) and (onednn or fits_fresh(rows, weight.shape[0]))
        return cls(weight, PackedProjection.of(model, rows) if packs else None, KeptBuffers.of(model))


# A call of up to this many rows (a sentence a call: beam search's k beams, greedy search's one row) projects through
# the library's few-rows product where W fits in the last-level cache (`projection_library`).
ROWS_PROJECTION_MAX_ROWS = 8


def projection_library(weight: torch.Tensor, rows: int):
    """The beam-search library, for a call of `rows` rows to take its few-rows product of the float32 pre-softmax W
    (`rows_projection` in one_source_beams.cpp), or None. Where oneDNN is the chosen library (`gemm_backend`) and W
    takes at most half the last-level cache (the step's weights share it): there the library's product read the main
    job's model's 8 MB W a quarter faster than oneDNN's on W packed for it (4 rows: 0.21-0.23 against 0.26-0.29 ms,
    one thread, AMD EPYC Zen 5), where oneDNN's packed layout streamed the base shape's 75 MB W from memory the
    faster (2.3-2.5 against 2.7-2.9 ms). Not measured on oneMKL's CPUs (Intel's), which keep oneMKL's packed W.
    A process that also decodes batches (whose calls pack W and give its plain pages back, `PackedProjection`) reads
    the plain W again at its next sentence: both copies, at most half the cache's size more than before."""
    library = sys.modules.get(BEAMS_MODULE)
    if (
        library is None
        or not hasattr(library, "rows_projection")
        or rows > ROWS_PROJECTION_MAX_ROWS
        or weight.dtype != torch.float32
        or weight.device.type != "cpu"
        or not weight.is_contiguous()
        or weight.numel() * weight.element_size() > last_level_cache_bytes() // 2
        or gemm_backend() != "onednn"
        or not library.decoder_rows_supported()
    ):
        return None
    return library


@functools.cache
def last_level_cache_bytes() -> int:
    """The size of this CPU's largest cache (Linux's sysfs: the L3 a core shares), or 0 where it cannot be read."""
    units, sizes = {"K": 2**10, "M": 2**20, "G": 2**30}, {}
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:  # (`size` reads like "32768K")
            size = (index / "size").read_text().strip()
            bytes_ = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
            sizes[int((index / "level").read_text())] = bytes_
        except (OSError, ValueError, IndexError):
            continue
    return sizes[max(sizes)] if sizes else 0


class OwnProjection:
    """The model's own `project` (Section 3.4's pre-softmax layer as the model holds it, Marian's fixed bias
    included) where `Projection` does not apply: an int8 layer (`--int8`), bfloat16, a bias. Its logits in float32;
    where they would exceed `FRESH_BYTES`, a block of rows at a time (`ONEDNN_BLOCK_BYTES` of logits) into a buffer
    kept for the call, with the log-softmax taken block by block where asked: a fresh tensor that large costs a page
    fault per 4 KiB every step (Multi30k val through int8 layers: 540,000 faults a run). The layer maps each row
    alone, so blocks are the same maths; an int8 layer quantizes its input per call, so each block's activations
    get a scale of their own, within the quantization's own error. The logits returned are valid until the next
    call."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.vocabulary = model.config.vocab_size  # read once: a config's attributes cost microseconds each
        self.kept = KeptBuffers.of(model)
        self.buffer: torch.Tensor | None = None
        # An int8 layer with the int8 few-rows kernel's weights (int8_rows.py): its product of a few rows called
        # straight, as the layer would call it, plus Marian's fixed bias as `project` adds it (a sentence a call,
        # beam 4: 93 us of the kernel in some 120 through `project`, the main job's model, one thread, Intel Xeon).
        layer = model.get_output_embeddings()
        few_rows = "rows_packed" in getattr(layer, "_buffers", {})
        self.few_rows = (
            (layer.rows_kernel_elements, *(layer._buffers[name] for name in ROWS_BUFFERS), layer.out_features)
            if few_rows
            else None
        )
        self.final_bias = model.final_logits_bias if model.config.final_logits_bias else None

    def __call__(self, hidden: torch.Tensor, log_softmax: bool = False) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        count, vocabulary = rows.shape[0], self.vocabulary
        if self.few_rows is not None and rows.numel() <= self.few_rows[0]:
            logits = torch.ops.vaswani_tx_int8.linear(rows, *self.few_rows[1:])
            if self.final_bias is not None:
                logits = logits + self.final_bias
            return in_log_space(logits, log_softmax).view(*hidden.shape[:-1], -1)
        if fits_fresh(count, vocabulary):
            return in_log_space(self.model.project(hidden).float(), log_softmax)
        if self.buffer is None or self.buffer.shape[0] < count:
            self.buffer = kept_rows(self, self.kept, self.buffer, count, vocabulary, rows.device)
        blocks = logits_in_blocks(
            lambda block: self.model.project(block).float(), rows, self.buffer[:count], log_softmax
        )
        return blocks.view(*hidden.shape[:-1], -1)


# --- greedy search's argmax: screened in int8, computed in float32 where it can be ------------------------------------

# The screen pays from this many columns on (below, the whole product is a few microseconds).
SCREEN_MIN_VOCABULARY = 4096
# Up to this many rows torch's int8 product beats float32's (base shape, one core: 3.8 against 6.2 ms at one row, 5.1
# against 8.2 packed at 4, 9.9 against 15.7 at 7; even at 8 and 2.5x slower at 32), and the step is bound by
# reading W. Greedy search from this many rows on packs W instead (PackedProjection).
SCREEN_MAX_ROWS = PACK_ALL_ROWS - 1
# Where the int8 few-rows kernel is loaded (int8_rows.py: VNNI's four products of bytes an instruction, where
# float32's FMA does one), the screen beats float32's packed product at any number of rows: greedy search's batches
# (Multi30k val: 95-292 rows a step at first, down to one) take it whole. The main job's model, 8,000 x 256, one
# thread, Intel Xeon: the screen 0.10 / 0.38 / 1.49 / 3.01 / 8.4 ms at 8 / 32 / 128 / 256 / 512 rows, against 0.52
# / 1.39 / 5.17 / 12.2 / 25.2 for oneMKL's packed product and its argmax; two threads 0.10 / 0.30 / 1.18 / 2.20 /
# 6.1 against 0.49 / 0.79 / 2.73 / 5.31 / 12.6. Up to the rows the library's choice counts (in 16 bits).
SCREEN_MAX_ROWS_KERNEL = 65535
# More columns left than this share of the vocabulary (a flat distribution): the whole product instead.
SCREEN_MAX_SHARE = 1 / 16
# Rows of W quantized at a time: the temporaries stay under a MiB (2,048 rows at a time: a peak 21 MiB higher).
SCREEN_CHUNK = 256
FLOAT32_UNIT, BFLOAT16_UNIT = 2.0**-24, 2.0**-8  # unit roundoffs (24 and 8 significant bits)
# CPU capabilities where torch's weight-only int8 product is vectorized (its plain C++ loop is 4x slower than
# float32's product).
SCREEN_CAPABILITIES = ("AVX2", "AVX512")

_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ScreenedArgmax:
    """argmax_j (x W^T)_j for greedy search's rows, reading a quarter of W's bytes for most of the vocabulary.

    At 1-7 rows the pre-softmax product is bound by reading W (V x d_model float32); with the int8 few-rows kernel
    (below), a batch's hundreds of rows are bound by its multiply-adds, four bytes' products an instruction where
    float32's takes one (`SCREEN_MAX_ROWS_KERNEL`). An int8 copy of W, one scale a row (as CTranslate2's int8), read
    by torch's weight-only int8 product (`torch._weight_int8pack_mm`, bfloat16
    rows) gives each logit to within a bound from norms: for x̂ the row in bfloat16 and ŵ_j the copy's row,
    |x̂·ŵ_j - x·w_j| <= |x̂ - x| |ŵ_j| + |x| |ŵ_j - w_j| (Cauchy-Schwarz), plus the float32 sums' rounding and the
    bfloat16 result's (one unit, 2^-8 of it, counted twice). A column can hold the row's maximum only if its
    screened logit plus the bound reaches the largest screened logit minus it; those few columns are computed in
    float32 (x W_c^T), and their argmax is the step's token, the whole product's to float32 rounding (the columns'
    own product rounds as `nn.Linear`'s, to a unit in the last place). Columns the processors mask (minimum
    lengths, suppressed tokens, the fairseq length cap: `screens_argmax`) are masked in both. Where more than
    `SCREEN_MAX_SHARE` of the columns remain, or a row keeps none (all masked, not a number), `__call__` gives
    None and the caller computes every logit.

    Where the beam-search library is loaded (a folder `vaswani-tx compile` made), the work after the int8 product
    is one C++ call (`screened_choice`, the same columns or a superset of them, the same product and tokens): in
    Python it is some 35 small tensor operations, 0.15-0.2 ms a step, as long as the decoder's step. It settles a
    row that keeps one column without a product, and where the union of the other rows' columns is too many for one
    product, computes each row's own (a batch's rows: `SCREEN_MAX_SHARE` is then the Python screen's only).

    Where the int8 few-rows kernel is loaded (int8_rows.py: a CPU with AVX512-VNNI and a folder `vaswani-tx
    compile` built it into), the product is that kernel's on the same int8 copy (blocks of 16 rows), the rows
    quantized to int8 (a scale a row) rather than rounded to bfloat16: 63 against 157 us at one row and 8,000 x
    256 (Intel Xeon, one thread), where torch's product spends its time converting, not reading W. The bound takes
    the rows' larger rounding (`bounds`, rounded None); the columns left stay one or a few.

    Kept per model while W is unchanged, as `PackedProjection` is: the copy is W's size / 4 (19 MB for the base
    model), made in about 0.13 s at the first greedy call. The int8 product's rounding is checked against the
    bound once, when the copy is made (`_rounding_within_bound`); a torch whose product rounds otherwise gets no
    screen."""

    def __init__(self, weight: torch.Tensor):
        self.weight, self.fingerprint = weight, tensor_fingerprint(weight)
        vocabulary, width = weight.shape
        self.quantized = torch.empty(vocabulary, width, dtype=torch.int8)
        self.scales = torch.empty(vocabulary, dtype=torch.bfloat16)
        norm = error = 0.0
        with torch.no_grad():
            for start in range(0, vocabulary, SCREEN_CHUNK):
                w = weight.detach()[start : start + SCREEN_CHUNK]
                scales = (w.abs().amax(dim=1) / 127).to(torch.bfloat16)
                divisors = scales.float().masked_fill(scales == 0, 1.0)[:, None]
                # bfloat16 may round a scale down: clamped, so that no value leaves int8's range
                quantized = torch.round(w / divisors).clamp_(-127, 127).to(torch.int8)
                self.quantized[start : start + SCREEN_CHUNK] = quantized
                self.scales[start : start + SCREEN_CHUNK] = scales
                # The product may read each row as q s in float32 or rounded to bfloat16: the bound holds for both.
                screened = quantized.float() * scales.float()[:, None]
                for read in (screened, screened.to(torch.bfloat16).float()):
                    norm = max(norm, float(read.norm(dim=1).max()))
                    error = max(error, float((read - w).norm(dim=1).max()))
                norm = max(norm, float(w.norm(dim=1).max()))
        self.norm, self.error = norm, error  # max_j |ŵ_j| (and |w_j|), max_j |ŵ_j - w_j|
        self.rows_kernel = None  # the int8 few-rows kernel's copy: (blocks, float32 scales, shifted sums)
        if rows_kernel_loaded():
            ops = torch.ops.vaswani_tx_int8
            self.rows_kernel = (ops.pack(self.quantized), self.scales.float(), ops.shift_sums(self.quantized))
            self.quantized = None  # one copy: the kernel's

    def screened_logits(self, rows: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(x^, the rows as the int8 product read them, or None where the int8 few-rows kernel quantized them;
        the screened logits (R, V), float32)."""
        if self.rows_kernel is not None:
            packed, scales, sums = self.rows_kernel
            return None, torch.ops.vaswani_tx_int8.linear(rows, packed, scales, sums, None, scales.shape[0])
        library = beams_library()
        if library is not None:  # the same, in C++ (kernels/one_source_beams.cpp)
            return library.screened_logits(rows, self.quantized, self.scales)
        rounded = rows.to(torch.bfloat16)
        return rounded, torch._weight_int8pack_mm(rounded, self.quantized, self.scales).float()

    def bounds(self, rows: torch.Tensor, rounded: torch.Tensor | None, screened: torch.Tensor) -> torch.Tensor:
        """For each screened logit (R, V), a bound on its distance to the float32 logit x·w_j. With `rounded`
        None, the rows the int8 few-rows kernel quantized (s = max |x| / 127 a row, q = round(x / s) in float32):
        |x^ - x| <= sqrt(D) s (1/2 + 2e-5), half a step each plus x / s's and s's roundings, taken as
        sqrt(D) s (1 + 1e-4) / 2, and |x^| <= |x| + that."""
        width = rows.shape[-1]
        x = rows.norm(dim=1, keepdim=True)
        if rounded is None:
            shift = rows.abs().amax(dim=1, keepdim=True) * (math.sqrt(width) / 127 * (1 + 1e-4) / 2)
            x_hat = x + shift
        else:
            x_hat = rounded.float().norm(dim=1, keepdim=True)
            shift = (rounded.float() - rows).norm(dim=1, keepdim=True)
        sums = 2 * width * FLOAT32_UNIT * (x + x_hat) * self.norm  # the int8 product's and float32's sums
        return shift * self.norm + x * self.error + sums + 2 * BFLOAT16_UNIT * screened.abs()

    def __call__(self, hidden: torch.Tensor, mask=None) -> torch.Tensor | None:
        """The argmax of each row of `hidden @ W^T` over the columns `mask(scores)` leaves (it returns the scores
        with the masked columns at -inf), or None where the caller should compute all the logits."""
        rows = hidden.reshape(-1, hidden.shape[-1])
        rounded, screened = self.screened_logits(rows)
        library = beams_library()
        if library is not None:  # the same, in C++ (kernels/one_source_beams.cpp); W, and so x, is on the CPU
            if mask is not None:
                screened = mask(screened)
            chosen = library.screened_choice(
                rows, rounded, screened, self.weight, self.norm, self.error, SCREEN_MAX_SHARE
            )
            return chosen if chosen.numel() else None
        slack = self.bounds(rows, rounded, screened)
        if mask is not None:
            screened = mask(screened)
        # |screened - logit| <= slack: a column whose highest possible logit is below some column's lowest is out
        lowest = (screened - slack).amax(dim=1, keepdim=True)
        possible = screened + slack >= lowest  # -inf + inf (masked) is not a number: never possible
        if not bool(possible.any(dim=1).all()):
            return None
        columns = possible.any(dim=0).nonzero().squeeze(1)
        if columns.numel() > SCREEN_MAX_SHARE * screened.shape[1]:
            return None
        logits = torch.mm(rows, self.weight.index_select(0, columns).t())
        logits.masked_fill_(screened[:, columns] == -math.inf, -math.inf)
        return columns[logits.argmax(dim=1)]

    @classmethod
    def of(cls, model: nn.Module, rows: int):
        """The model's screen for a greedy call of `rows` rows, or None where it does not apply: more rows, a small
        vocabulary, not float32 on the CPU, a replaced or biased pre-softmax layer, Marian's logit bias, a width
        the int8 product cannot take (a multiple of 16), a CPU where that product is not vectorized, or a torch
        whose product rounds beyond the bound."""
        weight = projection_weight(model) if rows <= SCREEN_MAX_ROWS_KERNEL else None
        if weight is None or (rows > SCREEN_MAX_ROWS and not _kernel_screens(model)):
            return None
        if weight.shape[0] < SCREEN_MIN_VOCABULARY or weight.shape[1] % 16 or model.config.final_logits_bias:
            return None
        if (
            not hasattr(torch, "_weight_int8pack_mm")
            or torch.backends.cpu.get_cpu_capability() not in SCREEN_CAPABILITIES
        ):
            return None
        fingerprint, screen = _SCREENS.get(model, (None, None))
        if fingerprint != tensor_fingerprint(weight):
            _SCREENS.pop(model, None)  # the old copy goes before the new one is made
            if getattr(model, "_compiled_folder", None) is not None:  # its int8 few-rows kernel, where it has one
                load_rows_kernel(model._compiled_folder, quiet=True)
            screen = cls(weight)
            screen = screen if _rounding_within_bound(screen) else None
            _SCREENS[model] = (tensor_fingerprint(weight), screen)
        if screen is not None and rows > SCREEN_MAX_ROWS and screen.rows_kernel is None:
            return None  # (made before the kernel was loaded)
        return screen


def _kernel_screens(model: nn.Module) -> bool:
    """Whether a screen of the model would take the int8 few-rows kernel's product and the beam-search library's
    choice (`SCREEN_MAX_ROWS_KERNEL`): both loaded from the model's folder, where `vaswani-tx compile` built them.
    Asked before the screen's int8 copy of W is made, which a call of more rows would not use otherwise."""
    if beams_library() is None:
        return False
    folder = getattr(model, "_compiled_folder", None)
    return rows_kernel_loaded() or (folder is not None and load_rows_kernel(folder, quiet=True))


def _rounding_within_bound(screen: ScreenedArgmax, columns: int = 256) -> bool:
    """Whether the screen's int8 product (torch's, or the int8 few-rows kernel's) lands within
    `ScreenedArgmax.bounds` of the float32 logits (float64 sums) for 1 to `SCREEN_MAX_ROWS` rows of random hidden
    states, on W's first columns."""
    g = torch.Generator().manual_seed(0)
    weight = screen.weight.detach()
    for count in range(1, SCREEN_MAX_ROWS + 1):
        rows = torch.randn(count, weight.shape[1], generator=g) * 4
        rounded, screened = screen.screened_logits(rows)
        screened = screened[:, :columns]  # (the product of all of W, as the screen calls it)
        exact = rows.double() @ weight[:columns].double().t()
        if not bool(((screened.double() - exact).abs() <= screen.bounds(rows, rounded, screened).double()).all()):
            return False
    return True


# --- one step ----------------------------------------------------------------------------------------------------


class DecodingSession:
    """The decoder's state for one `generate()` call: the encoder output and mask once per source, the cache, the
    projection; `step` gives the next position's logits (rows, V), in float32."""

    def __init__(self, model: nn.Module, model_kwargs: dict, rows_per_source: int = 1, pack: bool = True):
        self.model = model
        encoder_output = model_kwargs["encoder_outputs"][0]
        mask = model_kwargs.get("attention_mask")
        self.sources = encoder_output[::rows_per_source]
        self.source_mask = mask[::rows_per_source] if mask is not None else None
        self.cache = DecodingCache(model.config.num_decoder_layers)
        self.projection = Projection.of(model, encoder_output.shape[0], pack) or OwnProjection(model)
        self.final_bias = getattr(model, "final_logits_bias", None) if model.config.final_logits_bias else None
        # packed only for calls that will use them (a copy of the decoder's weights)
        self.linears = PackedLinears.of(model) if encoder_output.shape[0] >= PackedLinears.min_rows() else None

    def step(self, tokens: torch.Tensor, log_softmax: bool = False) -> torch.Tensor:
        """Logits of the position after `tokens` (rows, T): the new positions (all of the decoder's prefix at the
        first step, one token after that); their log-softmax with `log_softmax`."""
        return logits_of(self, self.hidden(tokens), log_softmax)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """The decoder's output (rows, d_model) at the position after `tokens`, before the projection."""
        with self.linears.installed() if self.linears is not None else contextlib.nullcontext():
            return self.model.get_decoder()(
                input_ids=tokens,
                encoder_hidden_states=self.sources,
                encoder_attention_mask=self.source_mask,
                past_key_values=self.cache,
                use_cache=True,
                return_dict=True,
            ).last_hidden_state[:, -1]

    def select(self, sources: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Keep these sources, and of the decoder's rows these (default: the sources' own, one row each): the
        sentences that are not finished yet."""
        self.sources = self.sources.index_select(0, sources)
        if self.source_mask is not None:
            self.source_mask = self.source_mask.index_select(0, sources)
        self.cache.cross_attention_cache.select_rows(sources)
        self.cache.self_attention_cache.select_rows(sources if rows is None else rows)

    def reorder(self, rows: torch.Tensor) -> None:
        """Beam search: the decoder's rows become these (each a beam of its own source)."""
        self.cache.self_attention_cache.select_rows(rows)


def logits_of(session, hidden: torch.Tensor, log_softmax: bool = False) -> torch.Tensor:
    """A session's logits (rows, V), float32, for the decoder's output at the new position: its projection, plus
    Marian's fixed bias where the model has one; the model's own `project` where the projection does not apply.
    With `log_softmax` their log-softmax (Section 3.4's softmax, in log space), written over them: computed block
    by block as the projection writes them where it can (`PackedProjection`), while they are still in the cache."""
    if session.final_bias is None or type(session.projection) is OwnProjection:
        return session.projection(hidden, log_softmax=log_softmax)
    return in_log_space(session.projection(hidden).add_(session.final_bias), log_softmax)


def open_session(
    model, model_kwargs: dict, input_ids: torch.Tensor, max_length: int, rows_per_source: int = 1, pack: bool = True
):
    """The compiled step's session where the model has one that applies to this call (compiled_decoding.py),
    else the eager one; both give the same logits to float32 rounding. `pack`: see `Projection.of`."""
    compiled = session_applies(model, input_ids, max_length, model_kwargs)
    if input_ids.shape[0] > rows_per_source and input_ids.device.type == "cpu":  # (a call in batches)
        raise_malloc_thresholds()
    # (an int8 model has no float32 layers to pack)
    if compiled is None or (
        compiled.few_rows is None and compiled.int8 is None and packs_beat_compiled(model, input_ids.shape[0])
    ):
        return DecodingSession(model, model_kwargs, rows_per_source, pack)
    projection = Projection.of(model, model_kwargs["encoder_outputs"][0].shape[0], pack)
    return CompiledSession(model, compiled, model_kwargs, rows_per_source, projection)


def packs_beat_compiled(model: nn.Module, rows: int) -> bool:
    """Whether a call of `rows` rows decodes faster eagerly on oneDNN's packed weights (`PackedLinears`) than through
    the compiled step, whose products read the weights unpacked: from 2 to `PACKS_MAX_ROWS` - 1 rows, where oneDNN is
    chosen. There packing pays most (at 4 rows oneDNN's product on packed weights takes 41 us for 512 x 512 where the
    unpacked one takes 70, 100 against 220 for 2,048 x 512; base shape, one thread). With more rows the two are
    within 5-15% of each other, and the compiled step's fused attention and norms win: the main job's model on
    Multi30k val (beam 6, hundreds of rows) decodes 7-12% faster through it (docs/speed.md). On one thread only:
    with more, the products' time is shared by the threads and the eager step's Python is not, and the compiled
    step has none (base shape, AMD EPYC, 2 threads: beam 4 batch 1 70-74 tokens/s against 53-62 eagerly on the
    packed weights, greedy batch 8 465-532 against 389-507; one thread, beam 4 batch 1: 41-50 against 53-55)."""
    return torch.get_num_threads() == 1 and 2 <= rows < PACKS_MAX_ROWS and PackedLinears.of(model) is not None


PACKS_MAX_ROWS = 64


# --- the compiled step (compiled_decoding.py) ------------------------------------------------------------------------


class PositionSlots:
    """The self-attention keys and values of every layer, position-major, one tensor for all layers' keys and one
    for their values, (layers, capacity, rows, h, d): a layer's written prefix plus this step's slot is a contiguous
    view, which is what the compiled step takes. Capacity doubles as positions are written. One tensor for all
    layers makes beam search's reordering two copies a step, not two a layer (`select_rows`)."""

    def __init__(self, num_layers: int, kept: KeptBuffers | None = None):
        self.num_layers = num_layers
        self.kept = kept or KeptBuffers()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0
        self.spare: list[torch.Tensor | None] = [None, None]
        # (rows, capacity) int64 while beam search's reordering is followed rather than copied (`follow`): row r's
        # keys and values at position p are in row lineage[r, p]
        self.lineage: torch.Tensor | None = None

    def make_room(self, rows: int, heads: int, d_k: int, d_v: int, like: torch.Tensor) -> None:
        """Room in the buffers for this step's position (the `length` written ones kept)."""
        end = self.length + 1
        if self.keys is None or self.keys.shape[1] < end:
            if self.lineage is not None and self.keys.shape[2] != rows:  # (rows left: the grown buffers hold the rest)
                self.select_rows(torch.arange(rows))
            self.keys, self.values = (
                self._grown(buffer, end, rows, heads, depth, like)
                for buffer, depth in ((self.keys, d_k), (self.values, d_v))
            )

    def views(self, rows: int, groups: int, heads: int, d_k: int, d_v: int, like: torch.Tensor):
        """(P + 1, G, k, h, d) views of each layer's keys and values, P the positions written so far."""
        self.make_room(rows, heads, d_k, d_v, like)
        end = self.length + 1
        library = beams_library()
        if library is not None:  # the same views, in C++ (one_source_beams.py)
            return library.slot_views(self.keys, self.values, end, rows, groups, heads)
        shape = (end, groups, rows // groups, heads)
        keys = tuple(self.keys[layer, :end].view(*shape, d_k) for layer in range(self.num_layers))
        values = tuple(self.values[layer, :end].view(*shape, d_v) for layer in range(self.num_layers))
        return keys, values

    def _grown(self, buffer, end: int, rows: int, heads: int, depth: int, like: torch.Tensor) -> torch.Tensor:
        shape = (self.num_layers, max(16, 2 * end), rows, heads, depth)
        grown = self.kept.take(self, math.prod(shape), like.dtype, like.device).view(shape)
        if buffer is not None and self.length:
            grown[:, : self.length] = buffer[:, : self.length]
        self.kept.give(buffer)
        return grown

    def lineage_for_step(self) -> torch.Tensor:
        """The lineage (rows, more than the positions written) that this step's call reads and writes its column
        of: each row's own at every position until `follow` reorders the rows."""
        rows = self.keys.shape[2] if self.lineage is None else self.lineage.shape[0]
        if self.lineage is None or self.lineage.shape[1] <= self.length:
            lineage = torch.arange(rows).unsqueeze(1).expand(rows, self.keys.shape[1]).contiguous()
            if self.lineage is not None:
                lineage[:, : self.length] = self.lineage[:, : self.length]
            self.lineage = lineage
        return self.lineage

    def follow(self, rows: torch.Tensor) -> bool:
        """Beam search's reordering, or the rows of the sources not finished, without a copy, where the step reads
        through the lineage (the library's `RowsSession.step`): the new rows' lineages are those of the rows they
        continue. At a sentence a call the copy of every written position (`select_rows`) was 35 us a step, some 8%
        of an int8 step (main job's model, beam 4, Intel Xeon); in batches the copies were 0.5 s of a 6.9 s pass of
        Multi30k val. Attention then reads each position's vector from the row the lineage names. Rows that left
        stay in the buffers until fewer than half of their rows are left (then copied, as where rows multiply: beam
        search's first step) or the buffers grow. Returns whether it applied (else nothing is changed)."""
        if self.keys is None or not self.keys.shape[2] // 2 < rows.numel() <= self.keys.shape[2]:
            return False
        self.lineage = self.lineage_for_step().index_select(0, rows)
        return True

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep (and reorder to) these rows: beam search's reordering or the sentences not finished. One
        `index_select` over all layers' written positions a tensor, into a tensor of exactly those positions plus
        the next step's slot (whose copy is of the last written position: the step overwrites it), so that the copy
        is contiguous. It gathers (layer, position, row) vectors along the first dimension, which torch spreads over
        its threads (along the rows' dimension it does not: 2.3x slower on 2 threads). It goes into the spare (the
        buffer before last) where that has room, as `_within` says."""
        if self.keys is None:
            return
        for kind, buffer in enumerate((self.keys, self.values)):  # a spare with room, from the kept buffers
            size = buffer.shape[0] * (self.length + 1) * rows.numel() * math.prod(buffer.shape[3:])
            if not has_room(self.spare[kind], size, buffer):
                self.kept.give(self.spare[kind])
                self.spare[kind] = self.kept.take(self, 2 * size, buffer.dtype, buffer.device)
        library = beams_library()
        lineage, self.lineage = self.lineage, None  # (followed rows: copied in order again)
        if library is not None and self.keys.device.type == "cpu":  # the same, in C++ (one_source_beams.py)
            self.keys, self.values, *self.spare = library.select_slots(
                self.keys, self.values, *self.spare, self.length, rows, lineage
            )
            return
        layers, capacity, old_rows = self.keys.shape[:3]
        end = self.length
        # Flat (layer, position, row) of each copied vector: positions 0 .. end - 1, and end - 1 again for the slot.
        positions = torch.arange(end + 1, device=rows.device).clamp_(max=max(end - 1, 0))
        starts = (torch.arange(layers, device=rows.device)[:, None] * capacity + positions) * old_rows
        # each new row's old row at each position: its own, or where followed rows' lineages say
        sources = rows if lineage is None or not end else lineage.index_select(0, rows)[:, positions].T
        pairs = (starts[:, :, None] + sources).reshape(-1)
        copies = []
        for kind, buffer in enumerate((self.keys, self.values)):
            shape = [layers, end + 1, rows.numel(), *buffer.shape[3:]]
            target = _within(self.spare[kind], shape, buffer, slack=True)
            torch.index_select(buffer.view(-1, math.prod(shape[3:])), 0, pairs, out=target.view(pairs.numel(), -1))
            self.spare[kind] = buffer._base if buffer._base is not None else buffer
            copies.append(target)
        self.keys, self.values = copies


class CompiledSession:
    """`DecodingSession`'s interface (`step`, `select`, `reorder`) over a folder's compiled step."""

    def __init__(self, model: nn.Module, compiled: CompiledStep, model_kwargs: dict, rows_per_source: int, projection):
        self.model, self.compiled, self.k = model, compiled, rows_per_source
        config = model.config
        self.heads, self.d_k, self.d_v = config.num_heads, config.d_k, config.d_v
        encoder_output = model_kwargs["encoder_outputs"][0]
        mask = model_kwargs.get("attention_mask")
        self.sources = encoder_output[::rows_per_source].contiguous()
        if mask is None:
            mask = torch.ones(encoder_output.shape[:2], dtype=torch.long)
        self.source_mask = mask[::rows_per_source].long().contiguous()
        # The encoder-decoder keys and values, once per source: the compiled encoder's where it encoded this source
        # (a sentence a call), else by the model's own attention modules.
        self.cross = SourceKeysValues(config.num_decoder_layers)
        encoded = EncodedSource.taken(model, self.sources)
        for index, layer in enumerate(model.get_decoder().layers):
            if encoded is not None:
                self.cross.update(encoded.keys[index], encoded.values[index], index)
                continue
            with unpacked_onednn_products(layer.cross_attn, int(self.source_mask.numel())):
                self.cross.update(*layer.cross_attn.keys_values(self.sources), index)
        self.slots = PositionSlots(config.num_decoder_layers, KeptBuffers.of(model))
        self.projection = projection or OwnProjection(model)
        self.final_bias = getattr(model, "final_logits_bias", None) if config.final_logits_bias else None
        self.library_step: tuple | None = None  # (the library's step, its session: `rows_session`)

    def step(self, tokens: torch.Tensor, log_softmax: bool = False) -> torch.Tensor:
        return logits_of(self, self.hidden(tokens), log_softmax)

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        groups, slots = self.sources.shape[0], self.slots
        tokens = tokens.reshape(groups, -1).contiguous()  # the library reads contiguous inputs: the loops' are views
        rows = self.rows_session()
        if rows is not None:  # the library's step on the whole buffers, through the lineage (`PositionSlots.follow`)
            slots.make_room(tokens.numel(), self.heads, self.d_k, self.d_v, self.sources)
            hidden = rows.step(tokens, slots.keys, slots.values, slots.length, slots.lineage_for_step())
        else:
            if slots.lineage is not None:  # (rows followed by a step before this one: copied in order)
                slots.select_rows(torch.arange(tokens.numel()))
            keys, values = slots.views(tokens.numel(), groups, self.heads, self.d_k, self.d_v, self.sources)
            hidden = self.compiled(
                tokens,
                keys,
                values,
                tuple(layer.keys for layer in self.cross.layers),
                tuple(layer.values for layer in self.cross.layers),
                self.sources,
                self.source_mask,
            )
        slots.length += 1
        return hidden

    def rows_session(self):
        """The library's session of the step (`RowsDecoder.session`) where the step is the library's, else None:
        made again when the sources or the step change."""
        decoder = self.compiled.rows_decoder
        if decoder is None:
            return None
        if self.library_step is None or self.library_step[0] is not decoder:
            cross = self.cross.layers
            self.library_step = (
                decoder,
                decoder.session([c.keys for c in cross], [c.values for c in cross], self.source_mask),
            )
        return self.library_step[1]

    def select(self, sources: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        self.sources = self.sources.index_select(0, sources)
        self.source_mask = self.source_mask.index_select(0, sources)
        self.cross.select_rows(sources)
        self.library_step = None  # (its session holds the sources' keys and values)
        rows = sources if rows is None else rows
        self.reorder(rows)
        self.fewer_rows(rows.numel())

    def fewer_rows(self, count: int) -> None:
        """Go on through the few-rows step once a call in batches is down to the rows it serves (the longest
        sentences of a batch, decoded alone at the end: 2.2-2.4 ms a step of one or two rows through the batched
        step, the model trained 1,600 steps, one thread). It takes the same inputs; its products read weights it
        packed, about twice as fast at a few rows."""
        kind = self.compiled.manifest.get("precision", "float32")
        if self.compiled.few_rows is not None or count > FEW_ROWS_MAXIMA.get(kind, 0):
            return
        step = step_for_rows(self.model, count)
        if step is not None and step.few_rows is not None and step.rows >= self.compiled.rows:
            release_replaced(self.model, step)
            self.compiled = step

    def reorder(self, rows: torch.Tensor) -> None:
        if self.compiled.rows_decoder is None or not self.slots.follow(rows):
            self.slots.select_rows(rows)


def session_applies(model: nn.Module, input_ids: torch.Tensor, max_length: int, model_kwargs: dict):
    """The model's compiled step if this call can decode through it, else None."""
    compiled = step_for_rows(model, input_ids.shape[0])
    if compiled is None or input_ids.shape[1] != 1 or max_length > compiled.rows:
        return None
    encoder_output = model_kwargs["encoder_outputs"][0]
    if encoder_output.dtype != compiled.dtype or encoder_output.device.type != "cpu":
        return None
    if compiled.few_rows is not None:
        release_replaced(model, compiled)
    return compiled


def release_replaced(model: nn.Module, packed: CompiledStep) -> None:
    """The plain pages of the model's tensors that a library with its own packed weights (a few-rows step, the
    compiled encoder) holds a copy of, given back once (`release_file_pages`), as `PackedLinears` does for its packed
    copies: read back from the file where another step or the eager path needs them again."""
    if packed.released or not packed.manifest.get("weights_packed", True) or packed.rows_decoder is not None:
        return  # (an encoder whose products read the model's own weights, `compile_step.encoder_configs`; the
        # few-rows step's `RowsDecoder`)
    tensors = step_tensors(model)
    for name, source in packed.manifest["constants"].items():
        if source == name:
            release_file_pages(tensors[name])
    packed.released = True


# --- which calls ---------------------------------------------------------------------------------------------------

# `generate(fast_decoding=...)` for the call it is passed to; None: the generation config's `fast_decoding` (True
# when it has none). A context variable rather than a generation-config field: transformers would take an
# unknown keyword argument for the model's forward.
_REQUEST: contextvars.ContextVar = contextvars.ContextVar("fast_decoding", default=None)


@contextlib.contextmanager
def requested(fast: bool | None):
    token = _REQUEST.set(None if fast is None else bool(fast))
    try:
        yield
    finally:
        _REQUEST.reset(token)


def fast_decoding_applies(
    model: nn.Module, generation_config, model_kwargs: dict, streamer=None, synced_gpus=False
) -> bool:
    """Whether this module's loops can give this call's result: the sequences only, from a decoder prefix of ids,
    with the cache generate() made for it (an empty dynamic one)."""
    request = _REQUEST.get()
    if (request if request is not None else getattr(generation_config, "fast_decoding", True)) is False:
        return False
    if generation_config.return_dict_in_generate or streamer is not None or synced_gpus:
        return False
    if generation_config.do_sample or getattr(generation_config, "is_assistant", False):
        return False
    if getattr(generation_config, "prefill_chunk_size", None) is not None:
        return False
    encoder_outputs = model_kwargs.get("encoder_outputs")
    if encoder_outputs is None or model_kwargs.get("decoder_inputs_embeds") is not None:
        return False
    decoder_mask = model_kwargs.get("decoder_attention_mask")
    if decoder_mask is not None and not bool(decoder_mask.all()):
        return False
    cache = model_kwargs.get(CACHE_FIELD, model_kwargs.get("past_key_values"))
    if cache is not None:  # generate() made it: empty and dynamic; a caller's own or a static one: theirs
        if not isinstance(cache, EncoderDecoderCache) or is_static_cache(cache) or cache.get_seq_length():
            return False
        if getattr(cache, "_is_user_defined", False):
            return False
    return model_kwargs.get("use_cache", True) is not False


# --- the processors ---------------------------------------------------------------------------------------------


def process(logits_processor, input_ids: torch.Tensor, scores: torch.Tensor, columns: dict) -> torch.Tensor:
    """`logits_processor(input_ids, scores)`, except that the processors which only mask a few columns mask
    them in `scores` itself (the loops own it) instead of writing a whole new (rows, V) tensor. `columns` keeps
    each such processor's column index between steps."""
    for processor in logits_processor:
        if isinstance(processor, MinNewTokensLengthLogitsProcessor):
            if input_ids.shape[-1] - processor.prompt_length_to_skip < processor.min_new_tokens:
                scores[:, _columns(columns, processor, processor.eos_token_id, scores)] = -math.inf
        elif isinstance(processor, MinLengthLogitsProcessor):
            if input_ids.shape[-1] < processor.min_length:
                scores[:, _columns(columns, processor, processor.eos_token_id, scores)] = -math.inf
        elif isinstance(processor, SuppressTokensLogitsProcessor):
            scores[:, _columns(columns, processor, processor.suppress_tokens, scores)] = -math.inf
        else:
            scores = processor(input_ids, scores)
    return scores


# The processors `process` applies as column masks (exact types).
MASKING_PROCESSORS = (MinNewTokensLengthLogitsProcessor, MinLengthLogitsProcessor, SuppressTokensLogitsProcessor)


def screens_argmax(processor) -> bool:
    """Whether greedy search's argmax may go through the int8 screen (`ScreenedArgmax`) with this processor: it
    only sets scores to -inf, or leaves a single column finite (a length cap forcing </s>), so that the argmax of
    its output is the float32 logits' argmax over the columns it leaves. A processor class says so with
    `screens_argmax = True`."""
    return type(processor) in MASKING_PROCESSORS or getattr(type(processor), "screens_argmax", False) is True


def _columns(columns: dict, processor, ids, scores: torch.Tensor) -> torch.Tensor:
    """Token ids as an index into the columns of `scores`, those outside the vocabulary left out (as the
    processors' `isin` over the vocabulary leaves them out)."""
    index = columns.get(id(processor))
    if index is None:
        ids = torch.as_tensor(ids, device=scores.device).reshape(-1).long()
        index = columns[id(processor)] = ids[(ids >= 0) & (ids < scores.shape[-1])]
    return index


# Processors and criteria that look at each row alone (its ids and scores), so that they give a source's rows
# the same answer whichever other sources share the batch. Exact types: a subclass may keep state per row.
ROW_LOCAL_PROCESSORS = (
    logits_process.ForcedBOSTokenLogitsProcessor,
    logits_process.ForcedEOSTokenLogitsProcessor,
    logits_process.InfNanRemoveLogitsProcessor,
    logits_process.LogitNormalization,
    logits_process.MinLengthLogitsProcessor,
    logits_process.MinNewTokensLengthLogitsProcessor,
    logits_process.NoBadWordsLogitsProcessor,
    logits_process.NoRepeatNGramLogitsProcessor,
    logits_process.RepetitionPenaltyLogitsProcessor,
    logits_process.SuppressTokensAtBeginLogitsProcessor,
    logits_process.SuppressTokensLogitsProcessor,
)
ROW_LOCAL_CRITERIA = (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria)


def sources_can_leave(logits_processor, stopping_criteria) -> bool:
    """Whether beam search may drop finished sources from the rows it gives the processors and criteria: each
    is row-local, or per source with a `select_sources(sources)` that gives it for a subset of its sources (as
    `SourceLengthCap` does)."""
    return all(
        type(p) in ROW_LOCAL_PROCESSORS or callable(getattr(p, "select_sources", None)) for p in logits_processor
    ) and all(type(c) in ROW_LOCAL_CRITERIA for c in stopping_criteria)


def for_sources(processors, sources: torch.Tensor) -> LogitsProcessorList:
    """The processors for a subset of their sources (rows of greedy search), where `sources_can_leave` said they can
    follow one: a row-local one as it is, another its `select_sources(sources)`."""
    return LogitsProcessorList(p if type(p) in ROW_LOCAL_PROCESSORS else p.select_sources(sources) for p in processors)


def stop(stopping_criteria, input_ids: torch.Tensor) -> torch.Tensor:
    """`stopping_criteria(input_ids, None)`: whether each row is done. The two criteria every call has are answered
    here the same way, cheaper: the length (one comparison for all rows) and the end-of-sentence token (a
    comparison with the last tokens instead of `isin`, which sorts)."""
    done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for criteria in stopping_criteria:
        if type(criteria) is MaxLengthCriteria:
            if input_ids.shape[1] >= criteria.max_length:
                done = torch.ones_like(done)
        elif type(criteria) is EosTokenCriteria:
            eos = criteria.eos_token_id.to(input_ids.device).reshape(-1)
            done = done | (input_ids[:, -1:] == eos).any(dim=-1)
        else:
            done = done | criteria(input_ids, None)
    return done


def in_inference_mode(loop):
    """Run a loop under `torch.inference_mode` (less bookkeeping per operation than `no_grad`), and hand back a
    normal tensor to a caller outside it."""

    def run(*args, **kwargs):
        outside = not torch.is_inference_mode_enabled()
        with torch.inference_mode():
            result = loop(*args, **kwargs)
        return result.clone() if outside else result

    run.__name__, run.__doc__, run.__wrapped__ = loop.__name__, loop.__doc__, loop
    return run


# From this many scores on, `argmax_rows` goes through block maxima (4 rows of 8,000: 0.025 against 0.038 ms; one row:
# 0.035 against 0.016, one thread, AMD EPYC).
BLOCK_ARGMAX_MIN = 32_000


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(scores, dim=-1)` of (N, V) scores: the same index, the first of equal maxima (a NaN the
    largest, as torch takes it). ATen's argmax reads about 5 GB/s on one thread, its amax 80-90: the maxima of
    blocks of `BLOCK` columns, the first block holding the row's largest, then the first column within it that
    holds it. 300 rows of 8,000: 0.41-0.44 against 2.0 ms (one thread, AMD EPYC)."""
    rows, width = scores.shape
    blocks = width // BLOCK
    if rows * width < BLOCK_ARGMAX_MIN or not blocks:
        return torch.argmax(scores, dim=-1)
    maxima = scores[:, : blocks * BLOCK].reshape(rows, blocks, BLOCK).amax(-1)
    if blocks * BLOCK < width:  # the partial last block
        maxima = torch.cat([maxima, scores[:, blocks * BLOCK :].amax(-1, keepdim=True)], dim=1)
    starts = maxima.argmax(-1) * BLOCK
    # (a partial last block's columns past the end read its last one again, after it: never the first maximum)
    columns = (starts[:, None] + torch.arange(BLOCK, device=scores.device)).clamp_(max=width - 1)
    return starts + scores.gather(1, columns).argmax(-1)


# --- greedy search ----------------------------------------------------------------------------------------------------


@in_inference_mode
def greedy_search(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """transformers' `_sample` without sampling: the highest-scoring token at each step, finished rows padded,
    until every row meets a stopping criterion. Finished rows leave the decoder's batch."""
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    batch = input_ids.shape[0]
    # Few rows, and processors that only mask columns: the argmax through the int8 screen, W packed for no step.
    screen = ScreenedArgmax.of(model, batch) if all(map(screens_argmax, logits_processor)) else None
    session = open_session(model, model_kwargs, input_ids, generation_config.max_length, pack=screen is None)
    if one_source_applies(batch, stopping_criteria):  # through the screen where there is one, else every logit
        return one_source_greedy(session, screen, input_ids, logits_processor, stopping_criteria)
    unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
    active = None  # the rows the decoder still computes (None: all)
    tokens, scores, columns = input_ids, None, {}
    # Finished rows are padded whatever their scores, so where every processor and criterion can follow a subset of
    # the rows (`sources_can_leave`), the processors and the argmax see the rows still decoded only, not stale
    # logits of all (Multi30k val greedy in batches: 3.5 times the rows otherwise, and a copy of them into one buffer).
    narrowing = has_eos_stopping_criteria and sources_can_leave(logits_processor, stopping_criteria)
    processors = logits_processor
    while True:
        hidden = session.hidden(tokens)
        chosen = None
        if screen is not None and (active is None or has_eos_stopping_criteria):

            def mask(screened, active=active, input_ids=input_ids, processors=processors):
                if active is None:
                    return process(logits_processor, input_ids, screened, columns)
                if narrowing:  # the rows decoded only, as the argmax below gives them (a batch's tail: a few rows)
                    return process(processors, input_ids[active], screened, columns)
                # the processors see every row, as transformers'
                rows = screened.new_zeros(batch, screened.shape[1]).index_copy_(0, active, screened)
                return process(logits_processor, input_ids, rows, columns)[active]

            chosen = screen(hidden, mask)
        if chosen is not None:  # finished rows are padded below whatever their token
            next_tokens = chosen if active is None else chosen.new_zeros(batch).index_copy_(0, active, chosen)
        elif active is not None and narrowing:
            chosen = argmax_rows(process(processors, input_ids[active], logits_of(session, hidden), columns))
            next_tokens = chosen.new_zeros(batch).index_copy_(0, active, chosen)  # (finished rows padded below)
        else:
            logits = logits_of(session, hidden)
            if active is not None:  # finished rows are padded whatever their scores: any row of logits will do
                if scores is None:
                    scores = logits.new_zeros(batch, logits.shape[-1])
                logits = scores.index_copy_(0, active, logits)
            next_tokens = argmax_rows(process(logits_processor, input_ids, logits, columns))
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        unfinished = unfinished & ~stop(stopping_criteria, input_ids)
        remaining = int(unfinished.sum())
        if remaining == 0:
            return input_ids
        if leave_now(batch if active is None else active.numel(), remaining):
            still = unfinished.nonzero().squeeze(1)
            kept = still if active is None else torch.searchsorted(active, still)
            session.select(kept)
            if narrowing:  # each processor for the rows still decoded (as beam search narrows its sources)
                processors = for_sources(processors, kept)
            active = still
        tokens = next_tokens[:, None] if active is None else next_tokens[active, None]


def one_source_greedy(session, screen, input_ids, logits_processor, stopping_criteria) -> torch.Tensor:
    """`greedy_search` for one source (a sentence a call), through the int8 screen where there is one (`screen`; None:
    every logit, as an int8 or bfloat16 model's greedy search takes them), its stopping on Python ints: the same
    tokens step for step, without the dozen small tensor operations a step that rows finishing apart and criteria
    asked as tensors need (0.1 ms of a 1 ms step at a sentence a call, one thread; of the int8 model's 0.4 ms a step,
    about 50 us). The processors see the ids so far, as in `greedy_search`."""
    max_length, ends = criteria_limits(stopping_criteria)
    columns: dict = {}

    def mask(screened):  # called within the step: `input_ids` is still the ids before its token
        return process(logits_processor, input_ids, screened, columns)

    tokens = input_ids  # the whole decoder prompt at the first step, as `greedy_search`
    while True:
        hidden = session.hidden(tokens)
        chosen = None if screen is None else screen(hidden, mask if len(logits_processor) else None)
        if chosen is None:  # no screen, or it left too many columns: every logit, as `greedy_search`
            chosen = argmax_rows(process(logits_processor, input_ids, logits_of(session, hidden), columns))
        tokens = chosen.view(1, 1)
        input_ids = torch.cat([input_ids, tokens], dim=-1)
        if int(chosen) in ends or (max_length is not None and input_ids.shape[1] >= max_length):
            return input_ids


def leave_now(computed: int, remaining: int) -> bool:
    """Whether the finished rows among the `computed` ones leave the decoder's batch now: once they are `LEAVE_SHARE`
    of them. Each leaving copies every kept row's keys and values (all layers, every position written, and the
    encoder-decoder ones); a finished row left in costs its step until the next leaving, its token padded whatever
    it is, as transformers pads every finished row."""
    return computed - remaining >= max(1, computed * LEAVE_SHARE)


# A finished row left in costs a step (the main job's model, Multi30k val greedy, one thread: about 140 us a row, the
# projection's share included); a leaving copies each kept row's keys and values, about 0.9 us a row for each
# position written and each source position. Counted over val's batches, finished rows leaving at a share of 1/8
# compute 1.3% more rows and copy 52% less (0.2 s of a 3.7 s pass at every end), about the least of that sum, which
# stays within 0.01 s of it from 1/10 to 1/4.
LEAVE_SHARE = 1 / 8


# --- beam search ------------------------------------------------------------------------------------------------------


# Below this many scores a source, torch.topk is as fast (block maxima gain from tens of thousands on: 2.5x at
# 6 x 8,000).
BLOCK_TOP_K_MIN = 4096
BLOCK = 64


def largest(scores: torch.Tensor, k: int, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`torch.topk(scores + shift[..., None], k)` over each source's m rows of V scores together, (B, m, V) scores
    and (B, m) shifts (beam search: the log-probabilities of a source's beams and the beams' scores; a (B, N) tensor
    is one row a source, unshifted): the same values at the same indices into m x V (up to the order of exact ties,
    which torch.topk leaves unspecified too), without writing the sums or selecting over all of them.

    The k largest sums lie in the k blocks of 64 columns of a row with the largest maxima (a block outside them
    has k larger sums in those blocks), and rounding is monotone, so a block's largest sum is its maximum plus the
    shift: only the chosen blocks' 64k sums (and the columns of a partial last block) are added and searched. That
    saves transformers' pass writing all m x V sums (`log_probs + beam_scores`) as well as the full top-k."""
    if scores.dim() == 2:
        scores = scores[:, None]
    sources, m, width = scores.shape
    blocks = width // BLOCK
    if m * width < BLOCK_TOP_K_MIN or m * blocks < k:
        flat = scores if shift is None else scores + shift[:, :, None]  # what transformers adds, then its top-k
        return torch.topk(flat.reshape(sources, m * width), k)
    chosen = chosen_blocks(scores, k, shift)  # (B, k) of the m x blocks
    beam = chosen // blocks
    starts = beam * width + (chosen - beam * blocks) * BLOCK  # each block's first column in m x V
    candidates = (starts[:, :, None] + torch.arange(BLOCK, device=scores.device)).view(sources, -1)
    flat = scores.view(sources, m * width)
    values = flat.gather(1, candidates)
    if shift is not None:  # the same float32 sums as transformers' whole-tensor add, each block's beam's score
        values.view(sources, k, BLOCK).add_(shift.gather(1, beam)[:, :, None])
    if blocks * BLOCK < width:  # the partial last block of each row: candidates as they are
        columns = torch.arange(blocks * BLOCK, width, device=scores.device)
        tail = (columns + width * torch.arange(m, device=scores.device)[:, None]).view(-1)  # (m x its columns)
        tail_values = flat[:, tail]
        if shift is not None:
            tail_values += shift.repeat_interleave(width - blocks * BLOCK, dim=1)
        candidates = torch.cat([candidates, tail.expand(sources, -1)], dim=1)
        values = torch.cat([values, tail_values], dim=1)
    values, picked = torch.topk(values, k)
    return values, candidates.gather(1, picked)


def chosen_blocks(scores: torch.Tensor, k: int, shift: torch.Tensor | None) -> torch.Tensor:
    """`largest`'s choice among each source's (B, m, V) scores: the k blocks of 64 columns, of the m x (V // 64)
    whole ones, with the largest maxima plus their beam's shift (B, m)."""
    sources, m, width = scores.shape
    blocks = width // BLOCK
    maxima = scores[:, :, : blocks * BLOCK].reshape(sources, m, blocks, BLOCK).amax(-1)
    if shift is not None:
        maxima += shift[:, :, None]
    return torch.topk(maxima.view(sources, m * blocks), k).indices


def one_source_largest(scores: torch.Tensor, k: int, shift: torch.Tensor) -> tuple[list[float], list[int]]:
    """`largest` for one source: its beams' (m, V) scores, each row shifted by its beam's score (m,), as Python
    lists. The same values at the same indices in the same order, in half its tensor operations where V is whole
    blocks (the index arithmetic in Python over the k chosen blocks, each block's shift read by `index_select`);
    otherwise `largest` itself."""
    m, width = scores.shape
    blocks = width // BLOCK
    if blocks * BLOCK != width or m * width < BLOCK_TOP_K_MIN or m * blocks < k:
        values, indices = largest(scores[None], k, shift[None])
        return values[0].tolist(), indices[0].tolist()
    chosen = chosen_blocks(scores[None], k, shift[None])[0]  # of the m x blocks, each its beam's block of columns
    values = scores.view(m * blocks, BLOCK).index_select(0, chosen)
    values.add_(shift.index_select(0, chosen // blocks)[:, None])  # the same float32 sums as `largest`'s
    values, picked = torch.topk(values.view(-1), k)
    chosen = chosen.tolist()
    return values.tolist(), [chosen[i // BLOCK] * BLOCK + i % BLOCK for i in picked.tolist()]


def top_k_continuations(
    model, log_probs, beam_scores, running_sequences, running_beam_indices, cur_len, prompt_len, k
):
    """transformers' `_get_top_k_continuations` without sampling, its top-k through `largest`: the k best
    continuations of each source's beams (log-probabilities (B, beams, V) plus the beams' running scores, which
    `largest` adds where it looks only), their sequences with the new token written at `cur_len`, and their beam
    indices with this step's (batch-wide) beam row."""
    batch_size, num_beams = running_sequences.shape[:2]
    topk_log_probs, topk_indices = largest(log_probs, k, beam_scores)
    vocab_size = log_probs.shape[-1]
    topk_current_beam_indices = topk_indices // vocab_size
    topk_running_beam_indices = model._gather_beams(running_beam_indices, topk_current_beam_indices)
    topk_running_sequences = model._gather_beams(running_sequences, topk_current_beam_indices)
    topk_running_sequences[:, :, cur_len] = topk_indices % vocab_size
    batch_offset = torch.arange(batch_size, device=topk_indices.device).view(-1, 1) * num_beams
    topk_running_beam_indices[:, :, cur_len - prompt_len] = topk_current_beam_indices + batch_offset
    return topk_log_probs, topk_running_sequences, topk_running_beam_indices


def first_step(session, tokens: torch.Tensor, num_beams: int, log_softmax: bool = False) -> torch.Tensor:
    """The first step's logits (rows, V) for the k beams of each source, decoded from one row per source: the beams
    of a source start from the same prefix, so their keys, values and logits are the same (transformers' loop
    decodes all k). The cache then holds k copies of each row. Rows whose beams start apart are decoded whole."""
    sources = tokens.shape[0] // num_beams
    prefixes = tokens.view(sources, num_beams, -1)
    if num_beams == 1 or not bool((prefixes == prefixes[:, :1]).all()):
        return session.step(tokens, log_softmax)
    beams = torch.arange(sources, device=tokens.device).repeat_interleave(num_beams)
    hidden = session.hidden(tokens[::num_beams])  # (the session's `step` is its projection of this)
    session.reorder(beams)
    if packed_for_beams_only(session, sources, beams.numel()):
        # W is packed for the beams' rows only (oneMKL's packing takes one number of rows): each source's one row,
        # repeated for its beams, through that packing, rather than through the plain W, which this step alone
        # would read (from memory: 0.57 ms at a row in the loop against 0.29 warm, and a copy of W more in the
        # caches)
        return logits_of(session, hidden.index_select(0, beams), log_softmax)
    logits = logits_of(session, hidden, log_softmax)
    # into a buffer kept on the model (`KeptBuffers`): the (rows, V) copy is tens of megabytes in batches
    out = KeptBuffers.of(session.model).take(session, beams.numel() * logits.shape[1], logits.dtype, logits.device)
    return torch.index_select(logits, 0, beams, out=out.view(beams.numel(), logits.shape[1]))


def packed_for_beams_only(session, sources: int, rows: int) -> bool:
    """Whether the first step's one row a source, repeated for its beams, should take the session's W packed for the
    beams' `rows` rows: it is packed for those but not for the sources' rows (oneMKL's packing serves one number of
    rows: `PackedProjection.serves`), and they are few enough for the repeated rows to cost no more than the plain
    product of the sources' rows (`REPEATED_FIRST_ROWS_MAX`)."""
    projection = session.projection
    if type(projection) is not Projection or projection.packed is None or rows > REPEATED_FIRST_ROWS_MAX:
        return False
    return projection.packed.serves(rows) and not projection.packed.serves(sources)


# Up to this many rows (sources x beams), the product through W packed for them costs about what the plain product of
# a quarter of them does, warm (8,000 x 256, one thread, Intel Xeon: 4 rows 0.36 against 0.30 ms, 16 0.54 against
# 0.60, 32 0.79 against 0.89, 64 1.33 against 0.77), and the plain W is read at the first step alone.
REPEATED_FIRST_ROWS_MAX = 32


def widened(tensor: torch.Tensor, fill: int) -> torch.Tensor:
    """`tensor` (B, k, W) with a column more, of `fill` (beam search's sequences and beam indices, a step on)."""
    out = tensor.new_full((*tensor.shape[:-1], tensor.shape[-1] + 1), fill)
    out[..., :-1] = tensor
    return out


def output_fill(generation_config) -> int:
    """What transformers' beam search writes after a hypothesis' end: the pad id, or the first end-of-sentence id
    where the pad id is None or 0 (its `pad or eos` reads a 0 id as false), or -1 without either."""
    pad_token_id, eos_token_id = generation_config._pad_token_tensor, generation_config._eos_token_tensor
    return int(pad_token_id or eos_token_id[0] if eos_token_id is not None else -1)


@in_inference_mode
def beam_search(model, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs):
    """transformers' `_beam_search` (without sampling), with its own bookkeeping functions: at each step the
    2k best continuations of each source's k beams, the best k unfinished ones go on, and finished ones
    replace the worst kept hypotheses while they score better (after the length penalty)."""
    early_stopping = generation_config.early_stopping
    length_penalty = generation_config.length_penalty
    max_length = generation_config.max_length
    num_beams = generation_config.num_beams
    num_return_sequences = generation_config.num_return_sequences
    eos_token_id = generation_config._eos_token_tensor

    batch_size_unflattened, cur_len = input_ids.shape[:2]
    batch_size = batch_size_unflattened // num_beams
    decoder_prompt_len = cur_len
    device = input_ids.device
    n_eos_tokens = eos_token_id.shape[0] if eos_token_id is not None else 0
    beams_to_keep = max(2, 1 + n_eos_tokens) * num_beams
    # The library's bookkeeping (it reads the log-probabilities in host memory: the CPU's), for one source or for
    # sources that can leave the processors as they finish
    native = (
        beams_library() is not None
        and input_ids.device.type == "cpu"
        and limits_only(stopping_criteria)
        and (batch_size == 1 or sources_can_leave(logits_processor, stopping_criteria))
    )
    if native or one_source_applies(batch_size, stopping_criteria):
        session = open_session(model, model_kwargs, input_ids, max_length, rows_per_source=num_beams)
        search = native_search if native else one_source_search
        return search(session, input_ids, logits_processor, stopping_criteria, generation_config, beams_to_keep)
    top_num_beam_mask = torch.cat(
        (torch.ones(num_beams, dtype=torch.bool), torch.zeros(beams_to_keep - num_beams, dtype=torch.bool))
    ).to(device)

    # The sequences and beam indices are as wide as the steps so far, a column wider each step (`widened`), where
    # transformers' are max_length wide from the start: each step gathers and concatenates them some fifteen times
    # (`top_k_continuations`, `_get_running_beams_for_next_iteration`, `_update_finished_beams`), and their columns
    # past the current one hold nothing but the fill. The same hypotheses, the same output.
    output_fill_value = output_fill(generation_config)
    running_sequences = input_ids.view(batch_size, num_beams, cur_len).clone()
    sequences = running_sequences.clone()
    running_beam_scores = torch.zeros((batch_size, num_beams), dtype=torch.float, device=device)
    running_beam_scores[:, 1:] = -1e9
    beam_scores = torch.full((batch_size, num_beams), fill_value=-1e9, dtype=torch.float, device=device)
    is_sent_finished = torch.zeros((batch_size, num_beams), dtype=torch.bool, device=device)
    is_early_stop_heuristic_unsatisfied = torch.ones((batch_size, 1), dtype=torch.bool, device=device)
    running_beam_indices = torch.full((batch_size, num_beams, 0), fill_value=-1, dtype=torch.int32, device=device)
    beam_indices = running_beam_indices.clone()

    session = open_session(model, model_kwargs, input_ids, max_length, rows_per_source=num_beams)
    tokens = flat_running_sequences = input_ids
    columns, scores, log_probs_buffer = {}, None, None
    # Finished sources leave the bookkeeping too where every processor and stopping criterion can follow
    # (`sources_can_leave`): the log-softmax and top-k then run over the sources still decoded only (half the
    # rows of a Multi30k val run). Otherwise their rows stay there, frozen.
    narrowing, processors = sources_can_leave(logits_processor, stopping_criteria), logits_processor
    sources = torch.arange(batch_size, device=device)  # the original source of each bookkeeping row
    final = []  # (original ids, sequences, beam indices) of the sources that left, as wide as they were then
    active = torch.arange(batch_size, device=device)  # the bookkeeping's sources still decoded
    active_rows = None  # their rows, source-major (None: all)
    while True:
        # Narrowing, the logits are not needed after this step: their log-softmax is written over them, a block of
        # rows at a time as the projection makes them where it can
        if cur_len == decoder_prompt_len:
            logits = first_step(session, tokens, num_beams, log_softmax=narrowing)
        else:
            logits = session.step(tokens, log_softmax=narrowing)
        if active_rows is not None:  # a finished source's rows keep their last logits: it cannot change any more
            logits = scores.index_copy_(0, active_rows, logits)
        scores = logits
        if narrowing:
            log_probs = logits
        else:  # a finished source's rows keep their logits (above): into one buffer for the call instead (a fresh
            # (rows, V) tensor each step costs page faults, see FRESH_BYTES)
            if (
                log_probs_buffer is None
                or log_probs_buffer.shape[0] < logits.shape[0]
                or log_probs_buffer.shape[1:] != logits.shape[1:]
                or log_probs_buffer.dtype != logits.dtype
            ):
                log_probs_buffer = torch.empty_like(logits)
            log_probs = torch.ops.aten._log_softmax.out(logits, -1, False, out=log_probs_buffer[: logits.shape[0]])
        log_probs = process(processors, flat_running_sequences, log_probs, columns)
        # (B, k, V): `largest` adds the beams' scores where it looks (transformers adds them to all k x V first)
        log_probs = log_probs.view(batch_size, num_beams, -1)
        running_sequences = widened(running_sequences, output_fill_value)
        sequences = widened(sequences, output_fill_value)
        running_beam_indices, beam_indices = widened(running_beam_indices, -1), widened(beam_indices, -1)
        topk_log_probs, topk_running_sequences, topk_running_beam_indices = top_k_continuations(
            model,
            log_probs,
            running_beam_scores,
            running_sequences,
            running_beam_indices,
            cur_len,
            decoder_prompt_len,
            beams_to_keep,
        )
        del log_probs
        next_token_hits_stopping_criteria = stop(
            stopping_criteria, topk_running_sequences[:, :, : cur_len + 1].reshape(batch_size * beams_to_keep, -1)
        ).view(batch_size, beams_to_keep)
        running_sequences, running_beam_scores, running_beam_indices = model._get_running_beams_for_next_iteration(
            topk_log_probs=topk_log_probs,
            topk_running_sequences=topk_running_sequences,
            topk_running_beam_indices=topk_running_beam_indices,
            next_token_hits_stopping_criteria=next_token_hits_stopping_criteria,
            num_beams=num_beams,
        )
        sequences, beam_scores, beam_indices, is_sent_finished = model._update_finished_beams(
            sequences=sequences,
            topk_running_sequences=topk_running_sequences,
            beam_scores=beam_scores,
            topk_log_probs=topk_log_probs,
            beam_indices=beam_indices,
            topk_running_beam_indices=topk_running_beam_indices,
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            is_sent_finished=is_sent_finished,
            next_token_hits_stopping_criteria=next_token_hits_stopping_criteria,
            top_num_beam_mask=top_num_beam_mask,
            num_beams=num_beams,
            cur_len=cur_len,
            decoder_prompt_len=decoder_prompt_len,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        beam_idx = running_beam_indices[..., cur_len - decoder_prompt_len].reshape(-1).long()
        cur_len += 1
        is_early_stop_heuristic_unsatisfied = model._check_early_stop_heuristic(
            is_early_stop_heuristic_unsatisfied=is_early_stop_heuristic_unsatisfied,
            running_beam_scores=running_beam_scores,
            beam_scores=beam_scores,
            is_sent_finished=is_sent_finished,
            cur_len=cur_len,
            max_length=max_length,
            decoder_prompt_len=decoder_prompt_len,
            early_stopping=early_stopping,
            length_penalty=length_penalty,
        )
        # A source is finished once no continuation can enter its kept hypotheses (transformers adds -1e9 to
        # them): all k kept with early stopping, or the heuristic says none can score better. It stays so.
        finished = ~is_early_stop_heuristic_unsatisfied[:, 0]
        if early_stopping is True:
            finished |= is_sent_finished.all(dim=-1)
        if not model._beam_search_has_unfinished_sequences(
            is_early_stop_heuristic_unsatisfied[active],
            is_sent_finished[active],
            next_token_hits_stopping_criteria[active],
            early_stopping,
        ):
            break
        # The beams that go on, as rows of the decoder's batch (a beam continues one of its own source's).
        keep = beam_idx if active_rows is None else torch.searchsorted(active_rows, beam_idx[active_rows])
        still = active[~finished[active]]
        if still.numel() < active.numel():  # finished sources leave the decoder's batch
            kept_sources = torch.searchsorted(active, still)
            keep = keep.view(-1, num_beams)[kept_sources].reshape(-1)
            session.select(kept_sources, keep)
            if narrowing:  # ... and the bookkeeping (all its sources are active: `still` are rows)
                final.append((sources[finished], sequences[finished], beam_indices[finished]))  # their hypotheses
                running = [t[still] for t in (sources, running_sequences, running_beam_scores, running_beam_indices)]
                sources, running_sequences, running_beam_scores, running_beam_indices = running
                ended = [t[still] for t in (sequences, beam_scores, beam_indices, is_sent_finished)]
                sequences, beam_scores, beam_indices, is_sent_finished = ended
                is_early_stop_heuristic_unsatisfied = is_early_stop_heuristic_unsatisfied[still]
                batch_size = still.numel()
                active = torch.arange(batch_size, device=device)
                processors = for_sources(processors, still)
            else:
                if active_rows is None:  # the logits of all rows, kept from here on, are the projection's buffer
                    scores = scores.clone()
                offsets = torch.arange(num_beams, device=device)
                active, active_rows = still, (still[:, None] * num_beams + offsets).reshape(-1)
        else:
            session.reorder(keep)
        flat_running_sequences = running_sequences[:, :, :cur_len].reshape(batch_size * num_beams, cur_len)
        tokens = flat_running_sequences[:, -1:] if active_rows is None else flat_running_sequences[active_rows, -1:]

    if final:  # every source's final hypotheses in their original order, the narrower ones filled out
        final.append((sources, sequences, beam_indices))
        count = sum(part[0].numel() for part in final)
        sequences = sequences.new_full((count, num_beams, sequences.shape[-1]), output_fill_value)
        beam_indices = beam_indices.new_full((count, num_beams, beam_indices.shape[-1]), -1)
        for ids, part_sequences, part_indices in final:
            sequences[ids, :, : part_sequences.shape[-1]] = part_sequences
            beam_indices[ids, :, : part_indices.shape[-1]] = part_indices
    sequences = sequences[:, :num_return_sequences, :].reshape(-1, sequences.shape[-1])
    beam_indices = beam_indices[:, :num_return_sequences, :].reshape(-1, beam_indices.shape[-1])
    max_generated_length = ((beam_indices + 1).bool()).sum(dim=1).max()
    return sequences[:, : decoder_prompt_len + max_generated_length]


# --- beam search over one source ---------------------------------------------------------------------------------


def one_source_applies(batch_size: int, stopping_criteria) -> bool:
    """Whether `one_source_search` can take this beam search (and `one_source_greedy` a greedy one): one source (a
    sentence a call: a service, the pipeline given a string), stopped by its length and end-of-sentence tokens only
    (`limits_only`)."""
    return batch_size == 1 and limits_only(stopping_criteria)


def limits_only(stopping_criteria) -> bool:
    """Whether the stopping criteria are a length and end-of-sentence tokens only, as every call's are unless a
    caller adds criteria (whose state and answers over the 2k candidates stay transformers' to ask): those the
    library's bookkeeping (`native_search`) and `one_source_search` read as numbers (`criteria_limits`)."""
    return all(type(c) in (MaxLengthCriteria, EosTokenCriteria) for c in stopping_criteria)


def reads_shape_only(processor) -> bool:
    """Whether a processor reads the rows' number and length only, not their ids: those `process` masks by length,
    and a processor class that says so with `reads_ids = False` (`SourceLengthCap`). With these alone,
    `one_source_search` hands them a tensor of that shape rather than writing the beams' ids into one."""
    return type(processor) in MASKING_PROCESSORS or getattr(type(processor), "reads_ids", True) is False


def _float32(value: float) -> float:
    return float(numpy.float32(value))


def _divided(value: float, divisor: float) -> float:
    """`value / divisor` as torch divides a float32 tensor by a Python float: both in float32 (checked)."""
    return float(numpy.float32(value) / numpy.float32(divisor))


def top(scores: list[float], k: int) -> list[int]:
    """The positions of the k largest of these float32 scores, as torch.topk orders them: its order among exact ties
    is its own (bfloat16 logits make them common), so the choice is left to it, on a tensor of a dozen numbers."""
    return torch.topk(torch.tensor([scores], dtype=torch.float32), k).indices[0].tolist()


class _Entry:
    """A hypothesis of the loop below: its float32 score (a Python float holding it exactly), its ids (the decoder's
    prefix included) and whether it has ended (for a kept hypothesis)."""

    __slots__ = ("score", "ids", "finished")

    def __init__(self, score: float, ids: list[int], finished: bool = False):
        self.score, self.ids, self.finished = score, ids, finished


def criteria_limits(stopping_criteria) -> tuple[int | None, set[int]]:
    """The length limit (None: none) and the end-of-sentence ids of a one-source search's stopping criteria
    (`one_source_applies`: those two kinds only)."""
    max_length = min((c.max_length for c in stopping_criteria if type(c) is MaxLengthCriteria), default=None)
    ends = {int(t) for c in stopping_criteria if type(c) is EosTokenCriteria for t in c.eos_token_id.reshape(-1)}
    return max_length, ends


def scored_step(session, tokens, first: bool, num_beams: int, logits_processor, columns: dict, row_ids):
    """A one-source search's step (`one_source_search`, `native_search`): the k beams' log-probabilities (the first
    step decoded once for all of them: `first_step`), through the processors, which get `row_ids()` (the beams' ids,
    or a tensor of their shape where the processors read no more: `reads_shape_only`)."""
    if first:
        log_probs = first_step(session, tokens, num_beams, log_softmax=True)
    else:
        log_probs = session.step(tokens, log_softmax=True)
    if len(logits_processor):
        log_probs = process(logits_processor, row_ids(), log_probs, columns)
    return log_probs


def one_source_search(session, input_ids, logits_processor, stopping_criteria, generation_config, k2: int):
    """`beam_search` for one source, its bookkeeping in Python over the 2k candidates rather than in some 40 tensor
    operations a step on tensors of a dozen numbers (about 0.5 ms a step, as long as the decoder's step at a
    sentence a call). The same choices: transformers' `_beam_search` step for step, its float32 sums and quotients
    rounded as torch rounds them (`_divided`), its top-k's torch.topk's over the same values (`top`, so that exact
    ties go the same way); what transformers' masks (-1e9) do to a score is done to it here too. Rows of the
    decoder's batch are the source's k beams."""
    early_stopping = generation_config.early_stopping
    length_penalty = generation_config.length_penalty
    num_beams = generation_config.num_beams
    fill = output_fill(generation_config)
    max_length, ends = criteria_limits(stopping_criteria)
    device = input_ids.device
    prompt_len = cur_len = input_ids.shape[1]
    prompt = input_ids[0].tolist()
    # A beam of rows: the first starts at score 0, the others at -1e9 (their copies of the prefix are not chosen)
    running = [_Entry(0.0 if beam == 0 else -1e9, prompt) for beam in range(num_beams)]
    kept = [_Entry(-1e9, prompt) for _ in range(num_beams)]  # transformers' `sequences`, `beam_scores`
    improvable = True  # transformers' `is_early_stop_heuristic_unsatisfied`
    needs_ids = not all(reads_shape_only(p) for p in logits_processor)
    shape_only = torch.empty((num_beams, generation_config.max_length), dtype=torch.long, device=device)
    columns, tokens = {}, input_ids

    def row_ids() -> torch.Tensor:
        if needs_ids:
            return torch.tensor([entry.ids for entry in running], device=device)
        return shape_only[:, :cur_len]

    while True:
        log_probs = scored_step(session, tokens, cur_len == prompt_len, num_beams, logits_processor, columns, row_ids)
        width = log_probs.shape[-1]
        shift = torch.tensor([entry.score for entry in running], dtype=torch.float32, device=device)
        values, indices = one_source_largest(log_probs, k2, shift)
        at_length = max_length is not None and cur_len + 1 >= max_length
        candidates = []  # (score, ids, beam, ended, score as a running beam's: an ended one's is 1e9 lower)
        for value, index in zip(values, indices):
            beam, token = divmod(index, width)
            ended = at_length or token in ends
            candidates.append(
                (value, running[beam].ids + [token], beam, ended, _float32(value - 1e9) if ended else value)
            )
        # The k best continuations go on as running beams (transformers' `_get_running_beams_for_next_iteration`)
        order = top([candidate[4] for candidate in candidates], num_beams)
        # Those among the first k that ended compete with the kept hypotheses, their scores divided by the length
        # penalty; transformers lowers every other candidate (and all of them once nothing can improve) by 1e9
        # (`_update_finished_beams`)
        penalty = (cur_len + 1 - prompt_len) ** length_penalty
        full = all(entry.finished for entry in kept) and early_stopping is True
        merged = list(kept)
        for j, (value, ids, _, ended, _) in enumerate(candidates):
            ended = ended and j < num_beams
            score = _divided(value, penalty)
            for lowered in (full, not improvable, not ended):
                if lowered:
                    score = _float32(score - 1e9)
            merged.append(_Entry(score, ids, ended))
        kept = [merged[i] for i in top([entry.score for entry in merged], num_beams)]
        running = [_Entry(candidates[j][4], candidates[j][1]) for j in order]
        beams = [candidates[j][2] for j in order]
        cur_len += 1
        # transformers' `_check_early_stop_heuristic`: can the best running beam still beat the worst kept one?
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = generation_config.max_length - prompt_len
        else:
            best_length = cur_len - prompt_len
        best_possible = _divided(running[0].score, best_length**length_penalty)
        worst = min(entry.score for entry in kept)
        improvable = improvable and any(best_possible > (worst if entry.finished else -1e9) for entry in kept)
        all_kept = all(entry.finished for entry in kept)
        if not improvable or (all_kept and early_stopping is True) or all(c[3] for c in candidates):
            break
        if beams != list(range(num_beams)):
            session.reorder(torch.tensor(beams, device=device))
        tokens = torch.tensor([[entry.ids[-1]] for entry in running], device=device)

    returned = kept[: generation_config.num_return_sequences]
    length = max(len(entry.ids) for entry in returned)
    return torch.tensor([entry.ids + [fill] * (length - len(entry.ids)) for entry in returned], device=device)


def native_search(session, input_ids, logits_processor, stopping_criteria, generation_config, k2: int):
    """`beam_search`'s loop (and `one_source_search`'s, one source) with its bookkeeping in C++ (one_source_beams.py's
    library, `Beams`): one call a step gives the next tokens, the sources that go on and the rows their beams
    continue, by the same choices. Here stay the decoder's step and the processors, which are given the sources that
    go on as finished ones leave (`sources_can_leave`, which `beam_search` asks where there are several).

    Why: in batches the Python bookkeeping was some 100 tensor operations a step, 8-11% of a pass (Multi30k val,
    beam 4, the main job's model, AMD EPYC Zen 5: 0.35 s of 4.1 on one thread, 0.30 of 2.6 on two)."""
    early_stopping = generation_config.early_stopping
    length_penalty = generation_config.length_penalty
    num_beams = generation_config.num_beams
    max_length, ends = criteria_limits(stopping_criteria)
    device = input_ids.device
    prompt_len = input_ids.shape[1]
    # n ** length_penalty for n output tokens (the length penalty may be a float subclass with its own power:
    # GNMTLengthPenalty), as the Python loop computes it; n = 0 is never divided by
    longest = generation_config.max_length - prompt_len + 1
    penalties = [0.0] + [float(n**length_penalty) for n in range(1, longest + 1)]
    best_length = longest - 1 if early_stopping == "never" and length_penalty > 0.0 else -1
    beams = beams_library().Beams(
        input_ids.cpu(), num_beams, k2, penalties, early_stopping is True, best_length,
        -1 if max_length is None else max_length, sorted(ends), BLOCK, BLOCK_TOP_K_MIN,
    )  # fmt: skip
    fill, count = output_fill(generation_config), generation_config.num_return_sequences
    whole = library_search(session, input_ids, logits_processor)
    if whole is not None:  # the whole loop below in one call (one source)
        rows, weight, bias, masks = whole
        return rows.search(beams, int(input_ids[0, 0]), weight, bias, masks, count, fill).to(device)
    needs_ids = not all(reads_shape_only(p) for p in logits_processor)
    shape_only = torch.empty((input_ids.shape[0], generation_config.max_length), dtype=torch.long, device=device)
    columns, tokens, processors = {}, input_ids, logits_processor

    def row_ids() -> torch.Tensor:
        return beams.running_ids() if needs_ids else shape_only[: beams.rows, : beams.cur_len]

    while True:
        first = beams.cur_len == prompt_len
        log_probs = scored_step(session, tokens, first, num_beams, processors, columns, row_ids)
        done, still, rows, tokens = beams.advance(log_probs.contiguous())
        if done:
            return beams.result(count, fill).to(device)
        if still is not None:  # finished sources leave the decoder's batch and the processors
            session.select(still, rows)
            processors = for_sources(processors, still)
        elif rows is not None:
            session.reorder(rows)


def library_search(session, input_ids: torch.Tensor, logits_processor):
    """What the library's `RowsSession.search` needs to run `native_search`'s whole loop in one call (its session,
    the pre-softmax W and the logits' fixed bias, the processors as column masks), or None where the loop must stay
    here: the step is not the library's (`CompiledSession.rows_session`), the projection not its few-rows product on
    the plain float32 W (`Projection.library`), the beams do not start from one token, or a processor is not a column
    mask (`column_masks`)."""
    if type(session) is not CompiledSession or session.slots.length or session.sources.shape[0] != 1:
        return None
    projection = session.projection
    if type(projection) is not Projection or projection.library is None:
        return None
    if input_ids.shape[1] != 1 or not bool((input_ids == input_ids[0, 0]).all()):
        return None
    width = projection.weight.shape[0]
    bias = session.final_bias
    if bias is None:
        bias = projection.weight.new_empty(0)
    elif bias.dtype != torch.float32 or bias.numel() != width:
        return None
    masks = column_masks(logits_processor, input_ids.shape[1], width)
    rows = session.rows_session() if masks is not None else None
    return None if rows is None else (rows, projection.weight, bias.reshape(-1).contiguous(), masks)


# The library's `until_len` for a column mask that lasts to the end (None in `column_masks`' tuples)
_NO_END = 1 << 62


def column_masks(logits_processor, prompt_len: int, width: int) -> list | None:
    """The processors as the library's `ColumnMask`s (each sets columns of the k beams' log-probabilities to -inf
    from one length to another), applied in their order; None where one is not such a mask. Those `process` masks
    (minimum lengths, suppressed tokens: exact types), and a processor with `as_column_mask(prompt_len)`
    (`SourceLengthCap`) that gives (columns, from_len, until_len, cap, forced), until_len None for "to the end",
    or None."""
    library, masks = beams_library(), []
    for processor in logits_processor:
        kind = type(processor)
        if kind is MinLengthLogitsProcessor:
            mask = (processor.eos_token_id, 0, processor.min_length, False, False)
        elif kind is MinNewTokensLengthLogitsProcessor:
            until = processor.prompt_length_to_skip + processor.min_new_tokens
            mask = (processor.eos_token_id, 0, until, False, False)
        elif kind is SuppressTokensLogitsProcessor:
            mask = (processor.suppress_tokens, 0, None, False, False)
        elif callable(getattr(processor, "as_column_mask", None)):
            mask = processor.as_column_mask(prompt_len)
        else:
            return None
        if mask is None:
            return None
        ids, from_len, until_len, cap, forced = mask
        ids = torch.as_tensor(ids).reshape(-1).tolist()
        columns = [i for i in ids if 0 <= i < width]  # (as `_columns`: those outside the vocabulary left out)
        if cap and (len(ids) != 1 or len(columns) != 1):
            return None
        until_len = _NO_END if until_len is None else int(until_len)
        masks.append(library.ColumnMask(columns, int(from_len), until_len, bool(cap), bool(forced)))
    return masks


def beams_library():
    """The beam-search library's module where one is loaded in this process, else None."""
    return sys.modules.get(BEAMS_MODULE)
