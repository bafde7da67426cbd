"""Decoding with a static cache: `generate(..., cache_implementation="static")`, compiled by default.

An engineering path, not the paper's: the maths is the decoder of Section 3 one target position at a
time (`VaswaniForConditionalGeneration.decode_step`, which runs each layer's `step` method beside its
`forward`), and tests hold the two caches to the same tokens. What changes is the shape of the work:
the keys and values of past positions sit in the cache's preallocated (P_max, B, h, d) tensors and
each step sees the written prefix of them (a view, no copy); the encoder-decoder keys and values are
computed once per source before the first step (once per sentence, not per beam: the beams of a
sentence attend to them as one block of queries, and start from one computed first position); and
nothing is allocated or concatenated per step. That lets `torch.compile` turn the step into one graph,
compiled once for any batch, source and prefix length (one each for greedy and beam search, and for a
batch of one), on CPU with Inductor's weight freezing and its C++ GEMM template, and Python's
per-operator overhead goes with the graph.

This module holds what is not the model's maths: cache allocation, per-source row sharing, and
compilation with its eager fallback. It takes the model as an argument and never imports the model
file. Costs (measured in docs/speed.md): the first call of each process compiles (Inductor's on-disk
cache cannot keep a graph that holds oneDNN-packed weights); the compiled step holds its own packed
copy of the decoder weights and the pre-softmax matrix; and freezing bakes the weights in, so a change
to any of them (training on, loading a state dict) is detected and compiles again. `disable_compile=True`
runs the same step eagerly. Attention weights and hidden states are not returned on this path.

This file travels with saved weights for `trust_remote_code`: torch and transformers only.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, EncoderDecoderCache, StaticLayer

# Freezing makes the weights constants, which lets Inductor pack them once for its own GEMM kernels
# (max_autotune picks, per product, between those and ATen's, without printing its timings). Only on
# CPU: elsewhere the defaults.
CPU_INDUCTOR_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
}


def is_static_cache(cache) -> bool:
    """Whether `cache` is an EncoderDecoderCache whose self-attention part is transformers' StaticCache."""
    return isinstance(cache, EncoderDecoderCache) and any(
        isinstance(layer, StaticLayer) for layer in cache.self_attention_cache.layers
    )


@dataclass
class StaticDecodingState:
    """What the first step of a cache prepares for all later ones."""

    cross_mask: torch.Tensor  # (G, 1, 1, S), additive: the encoder-decoder attention mask, one row per source
    step: Callable  # decode_step, compiled or not
    rows_per_source: int  # k: the consecutive rows (beams) that share a source


class StaticDecodingCache(EncoderDecoderCache):
    """transformers' EncoderDecoderCache (a StaticCache for self-attention) with what this path keeps
    between steps: whether to compile the step, and the state the first step prepares."""

    def __init__(self, self_attention_cache, cross_attention_cache, compile: bool = True):
        super().__init__(self_attention_cache, cross_attention_cache)
        self.compile = compile
        self.state: StaticDecodingState | None = None


def _weights_fingerprint(model: nn.Module) -> tuple:
    """Identity and in-place version of every tensor the step reads: changes whenever a weight does."""
    return tuple((id(t), t._version) for t in (*model.parameters(), *model.buffers()))


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def eager_decode_step(model: nn.Module, *arguments) -> torch.Tensor:
    """The model's own one-position step (`decode_step`), uncompiled."""
    return model.decode_step(*arguments)


def compiled_decode_step(model: nn.Module) -> Callable:
    """`model.decode_step` compiled for `model`'s current weights, reused while they do not change;
    called as `step(model, *arguments)`.

    Each compilation gets a code object of its own: dynamo keeps compiled graphs per code object and
    does not guard on the values of frozen weights, so a shared one could serve one model's graph (and
    weights) to another model of the same shapes, or to this model after its weights changed.
    """
    fingerprint = _weights_fingerprint(model)
    entry = _COMPILED.get(model)
    if entry is not None and entry[0] == fingerprint:
        return entry[1]
    # Imported here, not at the top: importing Inductor takes seconds, which only compiled decoding should pay.
    import torch._inductor.config

    method = type(model).decode_step
    function = types.FunctionType(method.__code__.replace(), method.__globals__, method.__name__)
    compiled = torch.compile(function, fullgraph=True)
    options = CPU_INDUCTOR_OPTIONS if next(model.parameters()).device.type == "cpu" else {}

    def step(model: nn.Module, *arguments) -> torch.Tensor:
        # As a config patch around the call (where any compilation happens): torch.compile's own
        # `options=` does not reach freezing.
        with torch._inductor.config.patch(options):
            return compiled(model, *arguments)

    _COMPILED[model] = (fingerprint, step)
    return step


def _initialise(layer, keys: torch.Tensor, values: torch.Tensor, length: int, position_major: bool = False) -> None:
    """Fill a cache layer ourselves: transformers' own lazy initialisation marks its tensors as static
    addresses, which makes dynamo guard on their identity and recompile for every new cache. The
    self-attention layers are position-major, (P_max, B, h, d): only this module reads them."""
    layer.keys, layer.values = keys, values
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.batch_size, layer.num_heads = keys.shape[1:3] if position_major else keys.shape[:2]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.cumulative_length = torch.tensor(length, device=keys.device)
    layer.is_initialized = True


def rows_per_source(encoder_hidden_states: torch.Tensor, encoder_attention_mask: torch.Tensor | None) -> int:
    """k when the rows come in consecutive runs of k identical sources (encoder output and mask), else 1.

    Beam search repeats each source once per beam (and sampling once per returned sequence), so that
    work done per source, rather than per row, is done k times over. Checked, not assumed: rows are
    shared only where they are equal, which keeps the result exactly that of one row each.
    """
    batch = encoder_hidden_states.shape[0]

    def same_as_first(row: int) -> bool:
        return torch.equal(encoder_hidden_states[row], encoder_hidden_states[0]) and (
            encoder_attention_mask is None or torch.equal(encoder_attention_mask[row], encoder_attention_mask[0])
        )

    rows = 1
    while rows < batch and same_as_first(rows):
        rows += 1
    if rows == 1 or batch % rows:
        return 1
    tensors = (encoder_hidden_states, encoder_attention_mask)
    return rows if all(tensor is None or repeats_in_runs(tensor, rows) for tensor in tensors) else 1


def repeats_in_runs(tensor: torch.Tensor, rows: int) -> bool:
    """Whether `tensor`'s rows come in consecutive runs of `rows` equal rows."""
    runs = tensor.unflatten(0, (-1, rows))
    return torch.equal(runs, runs[:, :1].expand_as(runs))


def _prepare(
    model: nn.Module,
    cache: StaticDecodingCache,
    batch: int,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor | None,
) -> StaticDecodingState:
    """Before the first step of a cache: allocate the self-attention tensors, compute the encoder-decoder
    keys and values and the source mask once per source (not per beam: `rows_per_source`), and choose
    the step (compiled or not)."""
    decoder = model.get_decoder()
    layers = decoder.layers
    self_cache, cross_cache = cache.self_attention_cache, cache.cross_attention_cache
    if len(self_cache.layers) != len(layers):
        raise ValueError(f"The static cache has {len(self_cache.layers)} layers but the decoder has {len(layers)}.")
    if encoder_hidden_states.shape[0] != batch:
        raise ValueError(
            f"decoder_input_ids have {batch} rows but the encoder output has {encoder_hidden_states.shape[0]}."
        )
    length, dtype, device = (
        self_cache.layers[0].max_cache_len,
        encoder_hidden_states.dtype,
        encoder_hidden_states.device,
    )
    rows = rows_per_source(encoder_hidden_states, encoder_attention_mask)
    sources = encoder_hidden_states[::rows]  # (G, S, D), G = B / rows
    while len(cross_cache.layers) < len(layers):  # a dynamic cross-attention cache starts with no layers
        cross_cache.layers.append(DynamicLayer())
    for layer, self_layer, cross_layer in zip(layers, self_cache.layers, cross_cache.layers):
        attention = layer.self_attn
        shape = (length, batch, attention.num_heads)
        _initialise(
            self_layer,
            torch.zeros(*shape, attention.d_k, dtype=dtype, device=device),
            torch.zeros(*shape, attention.d_v, dtype=dtype, device=device),
            0,
            position_major=True,
        )
        keys, values = layer.cross_attn.keys_values(sources)  # (G, h, S, d_k), (G, h, S, d_v)
        _initialise(cross_layer, keys.contiguous(), values.contiguous(), sources.shape[1])
        cache.is_updated[layer.cross_attn.layer_idx] = True
    source_mask = None if encoder_attention_mask is None else encoder_attention_mask[::rows]
    cross_mask = decoder.cross_attention_mask(source_mask, sources.shape[1], dtype)
    if cross_mask is None:  # one graph for masked and unmasked sources
        cross_mask = torch.zeros(sources.shape[0], 1, 1, sources.shape[1], dtype=dtype, device=device)
    step = eager_decode_step
    # int8 layers hold packed weights that Inductor cannot freeze: those models decode eagerly.
    packed = any(hasattr(module, "_packed_params") for module in model.modules())
    if cache.compile and not packed:
        step = compiled_decode_step(model)
    return StaticDecodingState(cross_mask=cross_mask, step=step, rows_per_source=rows)


def dynamic_sizes(arguments: tuple) -> None:
    """One graph for any number of rows, prefix length and source length: translating a test set gives
    batches of every size, and a graph per size would mean a compilation per batch."""
    tokens, _, self_keys, self_values, cross_keys, cross_values, cross_mask = arguments
    for tensor in (tokens, cross_mask, *self_keys, *self_values, *cross_keys, *cross_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in (*self_keys, *self_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    for tensor in (*cross_keys, *cross_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 2)
    torch._dynamo.maybe_mark_dynamic(cross_mask, 3)


def reorder_static_cache(cache: EncoderDecoderCache, beam_idx: torch.LongTensor) -> None:
    """Beam search: reorder the written positions of the self-attention cache only (the rest is unused)."""
    for layer in cache.self_attention_cache.layers:
        written = int(layer.cumulative_length) if layer.is_initialized else 0
        if written:
            layer.keys[:written] = layer.keys[:written].index_select(1, beam_idx)
            layer.values[:written] = layer.values[:written].index_select(1, beam_idx)


def _first_position_per_source(model: nn.Module, rows: int, arguments: tuple, self_layers: list) -> torch.Tensor:
    """The first target position once per source when its `rows` rows (its beams) start with the same
    token: their logits, keys and values are equal, so one row is computed (eagerly) and copied."""
    tokens, position_encoding, self_keys, self_values, *cross = arguments
    logits = model.decode_step(
        tokens[::rows],
        position_encoding,
        [k[:, ::rows] for k in self_keys],
        [v[:, ::rows] for v in self_values],
        *cross,
    )
    for layer in self_layers:  # the written rows 0, k, 2k, ... to the k - 1 rows after each
        layer.keys[0] = layer.keys[0, ::rows].repeat_interleave(rows, dim=0)
        layer.values[0] = layer.values[0, ::rows].repeat_interleave(rows, dim=0)
    return logits.repeat_interleave(rows, dim=0)  # (G, 1, V) -> (B, 1, V)


def _run_step(model: nn.Module, state: StaticDecodingState, written: int, arguments: tuple) -> torch.Tensor:
    """One step through the prepared step function; the first position (one slot) eagerly, since a
    prefix of one would be a graph of its own. A failed compilation (no C++ compiler, a platform
    Inductor does not support) falls back to the same step, eagerly, with a warning."""
    step = eager_decode_step if written == 0 else state.step
    if written == 1:
        dynamic_sizes(arguments)
    try:
        return step(model, *arguments)
    except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as error:
        if step is eager_decode_step:
            raise
        warnings.warn(f"Compiling the static-cache decoding step failed ({error}); decoding eagerly.", stacklevel=3)
        state.step = eager_decode_step
        return eager_decode_step(model, *arguments)


def decode_with_static_cache(
    model: nn.Module,
    decoder_input_ids: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor | None,
    cache: StaticDecodingCache,
) -> torch.Tensor:
    """Logits (B, T, V) for the T new target positions `decoder_input_ids` (B, T), one step at a time,
    continuing from the positions already in `cache` (filled here)."""
    batch, new = decoder_input_ids.shape
    if cache.state is None:
        cache.state = _prepare(model, cache, batch, encoder_hidden_states, encoder_attention_mask)
    state = cache.state
    self_layers, cross_layers = cache.self_attention_cache.layers, cache.cross_attention_cache.layers
    positions = model.get_decoder().embeddings.embed_positions
    capacity = self_layers[0].max_cache_len
    logits = []
    for t in range(new):
        written = int(self_layers[0].cumulative_length)
        if written >= capacity:
            raise ValueError(
                f"The static cache holds {capacity} target positions and all are used; pass a larger max_length "
                "(or max_cache_len) to generate()."
            )
        arguments = (
            decoder_input_ids[:, t : t + 1],
            positions(1, written, like=encoder_hidden_states),
            [layer.keys[: written + 1] for layer in self_layers],  # contiguous views: the step writes the last slot
            [layer.values[: written + 1] for layer in self_layers],
            [layer.keys for layer in cross_layers],
            [layer.values for layer in cross_layers],
            state.cross_mask,
        )
        rows = state.rows_per_source
        if written == 0 and rows > 1 and repeats_in_runs(arguments[0], rows):
            logits.append(_first_position_per_source(model, rows, arguments, self_layers))
        else:
            logits.append(_run_step(model, state, written, arguments))
        for layer in self_layers:
            layer.cumulative_length.add_(1)
    return torch.cat(logits, dim=1)
