"""Decoding with a static cache: `generate(..., cache_implementation="static")`, compiled by default.

An engineering path, not the paper's: the maths is the decoder of Section 3 one target position at a
time, exactly as with the default (dynamic) cache, and tests hold the two to the same tokens. What
changes is the shape of the work. Every step is one call of `decode_step`: the keys and values of
past positions sit in the cache's preallocated (P_max, B, h, d) tensors and the step sees the
written prefix of them (a view, no copy), the encoder-decoder keys and values are computed once per
source before the first step (once per sentence, not per beam: the beams of a sentence attend to them
as one block of queries, and start from one computed first position), and nothing is allocated or
concatenated per step. That lets `torch.compile` turn the step into one graph, compiled once for any
batch, source and prefix length (one each for greedy and beam search, and for a batch of one);
on CPU with Inductor's weight freezing and its C++ GEMM template, whose small-row matrix products run
about twice as fast as MKL's on the decoder's rows (see benchmarks/), and Python's per-operator
overhead goes with the graph.

Costs, which the README's speed section measures: the first call of each process compiles (tens of
seconds; Inductor's on-disk cache cannot keep a graph that holds oneDNN-packed weights); the compiled
step holds its own packed copy of the decoder weights and the pre-softmax matrix; and freezing bakes
the weights in, so a change to any of them (training on, loading a state dict) is detected and
compiles again. `disable_compile=True` runs the same step eagerly. Attention weights and hidden
states are not returned on this path.

This file travels with saved weights for `trust_remote_code` (the model imports it): torch and
transformers only.
"""

from __future__ import annotations

import types
import warnings
import weakref

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, EncoderDecoderCache, StaticLayer

# The model imports this module; a module reference (not names) lets the two import each other.
from . import modeling_vaswani as modeling

# Freezing makes the weights constants, which lets Inductor pack them once for its own GEMM kernels
# (max_autotune picks, per product, between those and ATen's, without printing its timings). Only on
# CPU: elsewhere the defaults.
CPU_INDUCTOR_OPTIONS = {
    "freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
    "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False,
}


def is_static_cache(cache) -> bool:
    """Whether `cache` is an EncoderDecoderCache whose self-attention part is transformers' StaticCache."""
    return isinstance(cache, EncoderDecoderCache) and any(
        isinstance(layer, StaticLayer) for layer in cache.self_attention_cache.layers
    )


def cached_attention(
    attention: nn.Module,
    hidden_states: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None = None,
    is_self_attention: bool = False,
) -> torch.Tensor:
    """MultiHead(Q, K, V) (Section 3.2.2) for one new position per row against cached keys and values.

    hidden_states (B, 1, D); keys (G, h, L, d_k), values (G, h, L, d_v); bias (G, 1, 1, L), additive; G
    divides B, and the B / G consecutive rows of each of the G key rows (the beams of one source) share it.
    Self-attention (`is_self_attention`): keys (L, B, h, d_k) and values (L, B, h, d_v), position-major,
    so that the written prefix of the cache is a contiguous view; the last of the L positions is the
    new one, whose key and value are written there first, in place. Returns W^O applied to the heads, (B, 1, D).
    """
    batch, heads = hidden_states.shape[0], attention.num_heads
    if is_self_attention:
        keys[-1].copy_(attention.k_proj(hidden_states).view(batch, heads, attention.d_k))
        values[-1].copy_(attention.v_proj(hidden_states).view(batch, heads, attention.d_v))
        keys, values = keys.permute(1, 2, 0, 3), values.permute(1, 2, 0, 3)  # (B, h, L, d)
    # Encoder-decoder keys may hold one row per source (G, h, S, d_k) for B = G * k rows (k beams of
    # each source, consecutive): the k queries of a source then attend together, as one block of k.
    groups = keys.shape[0]
    query = attention.q_proj(hidden_states).view(groups, -1, heads, attention.d_k).transpose(1, 2)  # (G, h, k, d_k)
    # The model's eager Equation 1: for one query per row, two batched products and a softmax that the
    # compiler fuses are several times faster than the SDPA kernel, which is built for long query blocks.
    output, _ = modeling.scaled_dot_product_attention(attention, query, keys, values, bias, scaling=attention.scaling)
    return attention.out_proj(output.reshape(batch, 1, heads * attention.d_v))  # Concat(heads) W^O: (G, k, h, d_v) -> (B, 1, D)


def decode_step(
    model: nn.Module,
    tokens: torch.Tensor,
    position_encoding: torch.Tensor,
    self_keys: list[torch.Tensor],
    self_values: list[torch.Tensor],
    cross_keys: list[torch.Tensor],
    cross_values: list[torch.Tensor],
    cross_bias: torch.Tensor,
) -> torch.Tensor:
    """Logits (B, 1, V) for the next target position, whose input tokens are `tokens` (B, 1).

    `self_keys` / `self_values` hold, per layer, the cache's positions up to and including this one,
    (P + 1, B, h, d): its key and value are written into the last slot. The decoder of Section 3.1 with
    the modules `VaswaniForConditionalGeneration.forward` uses: embedding times sqrt(D) plus
    `position_encoding` (1, D); per layer self-attention over those positions (all earlier, so no
    mask), encoder-decoder attention over `cross_keys` / `cross_values` (G, h, S, d) with `cross_bias`
    (G, 1, 1, S), one row per source (G divides B; see `rows_per_source`), the FFN, each as
    LayerNorm(x + Sublayer(x)); then the pre-softmax projection.
    """
    decoder = model.model.decoder
    embeddings = decoder.embeddings
    hidden = embeddings.embed_tokens(tokens) * embeddings.embed_scale + position_encoding  # (B, 1, D)
    for layer, keys, values, source_keys, source_values in zip(
        decoder.layers, self_keys, self_values, cross_keys, cross_values
    ):
        hidden = layer.self_attn_norm(hidden + cached_attention(layer.self_attn, hidden, keys, values, is_self_attention=True))
        hidden = layer.cross_attn_norm(hidden + cached_attention(layer.cross_attn, hidden, source_keys, source_values, cross_bias))
        hidden = layer.feed_forward_norm(hidden + layer.feed_forward(hidden))
    return model._project(hidden)


def _weights_fingerprint(model: nn.Module) -> tuple:
    """Identity and in-place version of every tensor the step reads: changes whenever a weight does."""
    return tuple((id(t), t._version) for t in (*model.parameters(), *model.buffers()))


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_decode_step(model: nn.Module):
    """`decode_step` compiled for `model`'s current weights, reused while they do not change.

    Each compilation gets a code object of its own: dynamo keeps compiled graphs per code object and
    does not guard on the values of frozen weights, so a shared one could serve one model's graph (and
    weights) to another model of the same shapes, or to this model after its weights changed.
    """
    fingerprint = _weights_fingerprint(model)
    entry = _COMPILED.get(model)
    if entry is not None and entry[0] == fingerprint:
        return entry[1]
    function = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, decode_step.__name__)
    import torch._inductor.config  # noqa: F401  (the options below patch it)

    compiled = torch.compile(function, fullgraph=True)
    options = CPU_INDUCTOR_OPTIONS if next(model.parameters()).device.type == "cpu" else {}

    def step(*arguments):
        # As a config patch around the call (where any compilation happens): torch.compile's own
        # `options=` does not reach freezing.
        with torch._inductor.config.patch(options):
            return compiled(*arguments)

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
    return rows if all(
        tensor is None or repeats_in_runs(tensor, rows) for tensor in (encoder_hidden_states, encoder_attention_mask)
    ) else 1


def repeats_in_runs(tensor: torch.Tensor, rows: int) -> bool:
    """Whether `tensor`'s rows come in consecutive runs of `rows` equal rows."""
    runs = tensor.unflatten(0, (-1, rows))
    return torch.equal(runs, runs[:, :1].expand_as(runs))


def _prepare(model: nn.Module, cache: EncoderDecoderCache, batch: int, encoder_hidden_states: torch.Tensor,
             encoder_attention_mask: torch.Tensor | None) -> dict:
    """Before the first step of a cache: allocate the self-attention tensors, compute the encoder-decoder
    keys and values and the source mask once per source (not per beam: `rows_per_source`), and choose
    the step (compiled or not)."""
    layers = model.model.decoder.layers
    self_cache, cross_cache = cache.self_attention_cache, cache.cross_attention_cache
    if len(self_cache.layers) != len(layers):
        raise ValueError(f"The static cache has {len(self_cache.layers)} layers but the decoder has {len(layers)}.")
    if encoder_hidden_states.shape[0] != batch:
        raise ValueError(
            f"decoder_input_ids have {batch} rows but the encoder output has {encoder_hidden_states.shape[0]}."
        )
    length, dtype, device = self_cache.layers[0].max_cache_len, encoder_hidden_states.dtype, encoder_hidden_states.device
    source_length = encoder_hidden_states.shape[1]
    rows = rows_per_source(encoder_hidden_states, encoder_attention_mask)
    sources = encoder_hidden_states[::rows]  # (G, S, D), G = B / rows
    groups = sources.shape[0]
    while len(cross_cache.layers) < len(layers):  # a dynamic cross-attention cache starts with no layers
        cross_cache.layers.append(DynamicLayer())
    for layer, self_layer, cross_layer in zip(layers, self_cache.layers, cross_cache.layers):
        attention = layer.self_attn
        shape = (length, batch, attention.num_heads)
        _initialise(self_layer, torch.zeros(*shape, attention.d_k, dtype=dtype, device=device),
                    torch.zeros(*shape, attention.d_v, dtype=dtype, device=device), 0, position_major=True)
        attention = layer.cross_attn
        keys = attention.k_proj(sources).view(groups, source_length, attention.num_heads, attention.d_k)
        values = attention.v_proj(sources).view(groups, source_length, attention.num_heads, attention.d_v)
        _initialise(cross_layer, keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous(), source_length)
        cache.is_updated[layer.cross_attn.layer_idx] = True
    source_mask = None if encoder_attention_mask is None else encoder_attention_mask[::rows]
    bias = modeling.attention_bias(source_mask, 1, source_length, causal=False, dtype=dtype)
    if bias is None:  # one graph for masked and unmasked sources
        bias = torch.zeros(groups, 1, 1, source_length, dtype=dtype, device=device)
    step = decode_step
    # int8 layers hold packed weights that Inductor cannot freeze: those models decode eagerly.
    packed = any(hasattr(module, "_packed_params") for module in model.modules())
    if getattr(model, "_compile_static_decoding", False) and not packed:
        step = compiled_decode_step(model)
    return {"cross_bias": bias, "step": step, "rows_per_source": rows}


def dynamic_sizes(arguments: tuple) -> None:
    """One graph for any number of rows, prefix length and source length: translating a test set gives
    batches of every size, and a graph per size would mean a compilation per batch."""
    tokens, _, self_keys, self_values, cross_keys, cross_values, cross_bias = arguments
    for tensor in (tokens, cross_bias, *self_keys, *self_values, *cross_keys, *cross_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in (*self_keys, *self_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    for tensor in (*cross_keys, *cross_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 2)
    torch._dynamo.maybe_mark_dynamic(cross_bias, 3)


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
    logits = decode_step(
        model, tokens[::rows], position_encoding, [k[:, ::rows] for k in self_keys], [v[:, ::rows] for v in self_values], *cross
    )
    for layer in self_layers:  # the written rows 0, k, 2k, ... to the k - 1 rows after each
        layer.keys[0] = layer.keys[0, ::rows].repeat_interleave(rows, dim=0)
        layer.values[0] = layer.values[0, ::rows].repeat_interleave(rows, dim=0)
    return logits.repeat_interleave(rows, dim=0)  # (G, 1, V) -> (B, 1, V)


def _run_step(model: nn.Module, state: dict, written: int, arguments: tuple) -> torch.Tensor:
    """One step through the prepared step function; the first position (one slot) eagerly, since a
    prefix of one would be a graph of its own. A failed compilation (no C++ compiler, a platform
    Inductor does not support) falls back to the same step, eagerly, with a warning."""
    step = decode_step if written == 0 else state["step"]
    if written == 1:
        dynamic_sizes(arguments)
    try:
        return step(model, *arguments)
    except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as error:
        if step is decode_step:
            raise
        warnings.warn(f"Compiling the static-cache decoding step failed ({error}); decoding eagerly.", stacklevel=3)
        state["step"] = decode_step
        return decode_step(model, *arguments)


def decode_with_static_cache(
    model: nn.Module,
    decoder_input_ids: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_attention_mask: torch.Tensor | None,
    cache: EncoderDecoderCache,
) -> torch.Tensor:
    """Logits (B, T, V) for the T new target positions `decoder_input_ids` (B, T), one step at a time,
    continuing from the positions already in `cache` (a static EncoderDecoderCache, filled here)."""
    batch, new = decoder_input_ids.shape
    state = getattr(cache, "_vaswani_static", None)
    if state is None:
        state = cache._vaswani_static = _prepare(model, cache, batch, encoder_hidden_states, encoder_attention_mask)
    self_layers, cross_layers = cache.self_attention_cache.layers, cache.cross_attention_cache.layers
    positions = model.model.decoder.embeddings.embed_positions
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
            state["cross_bias"],
        )
        rows = state["rows_per_source"]
        if written == 0 and rows > 1 and repeats_in_runs(arguments[0], rows):
            logits.append(_first_position_per_source(model, rows, arguments, self_layers))
        else:
            logits.append(_run_step(model, state, written, arguments))
        for layer in self_layers:
            layer.cumulative_length.add_(1)
    return torch.cat(logits, dim=1)
