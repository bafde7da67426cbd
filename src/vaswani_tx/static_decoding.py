"""Decoding with a static cache: `generate(..., cache_implementation="static")`, compiled by default.

An engineering path, not the paper's: the maths is the decoder of Section 3 one target position at a
time, exactly as with the default (dynamic) cache, and tests hold the two to the same tokens. What
changes is the shape of the work. Every step is one call of `decode_step` on tensors whose shapes do
not change during a `generate` call: the keys and values of past positions sit in the cache's
preallocated (B, h, P_max, d) tensors, the positions not yet written are masked, and the
encoder-decoder keys and values are computed once per source before the first step. Fixed shapes let
`torch.compile` turn the step into one graph; on CPU it is compiled with Inductor's weight freezing
and its C++ GEMM template, whose small-row matrix products run about twice as fast as MKL's on the
decoder's 1 to 32 rows (see benchmarks/), and Python's per-operator overhead goes with the graph.

Costs, which the README's speed section measures: the first call compiles (tens of seconds, cached
on disk by Inductor for later processes); the compiled step holds its own packed copy of the decoder
weights and the pre-softmax matrix; and freezing bakes the weights in, so a change to any of them
(training on, loading a state dict) is detected and compiles again. `disable_compile=True` runs the
same step eagerly. Attention weights and hidden states are not returned on this path.

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

# Freezing makes the weights constants, which lets Inductor pack them once for its own GEMM kernels
# (max_autotune picks, per product, between those and ATen's). Only on CPU: elsewhere the defaults.
CPU_INDUCTOR_OPTIONS = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


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
    bias: torch.Tensor,
    position: torch.Tensor | None = None,
) -> torch.Tensor:
    """MultiHead(Q, K, V) (Section 3.2.2) for one new position per row against cached keys and values.

    hidden_states (B, 1, D); keys (B, h, L, d_k), values (B, h, L, d_v); bias (B or 1, 1, 1, L), additive.
    With `position` (1,), this is self-attention: the new key and value are first written at that
    position of the cache, in place. Returns W^O applied to the heads, (B, 1, D).
    """
    batch, heads = hidden_states.shape[0], attention.num_heads
    query = attention.q_proj(hidden_states).view(batch, 1, heads, attention.d_k).transpose(1, 2)  # (B, h, 1, d_k)
    if position is not None:
        keys.index_copy_(2, position, attention.k_proj(hidden_states).view(batch, 1, heads, attention.d_k).transpose(1, 2))
        values.index_copy_(2, position, attention.v_proj(hidden_states).view(batch, 1, heads, attention.d_v).transpose(1, 2))
    # Equation 1 written out: for one query per row, two batched products and a softmax that the compiler
    # fuses are several times faster than the SDPA kernel, which is built for long query blocks.
    scores = torch.matmul(query, keys.transpose(-1, -2)) * attention.scaling + bias  # (B, h, 1, L)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights, values)  # (B, h, 1, d_v)
    return attention.out_proj(output.transpose(1, 2).reshape(batch, 1, heads * attention.d_v))  # Concat(heads) W^O


def decode_step(
    model: nn.Module,
    tokens: torch.Tensor,
    position: torch.Tensor,
    position_encoding: torch.Tensor,
    self_keys: list[torch.Tensor],
    self_values: list[torch.Tensor],
    cross_keys: list[torch.Tensor],
    cross_values: list[torch.Tensor],
    cross_bias: torch.Tensor,
) -> torch.Tensor:
    """Logits (B, 1, V) for the target position `position` (1,), whose input tokens are `tokens` (B, 1),
    writing that position's keys and values into `self_keys` / `self_values` (one (B, h, P_max, d) per layer).

    The decoder of Section 3.1 with the same modules as `VaswaniForConditionalGeneration.forward`:
    embedding times sqrt(D) plus `position_encoding` (1, D); per layer masked self-attention over the
    positions written so far, encoder-decoder attention over `cross_keys` / `cross_values` (B, h, S, d)
    with `cross_bias` (B, 1, 1, S), the FFN, each as LayerNorm(x + Sublayer(x)); then the pre-softmax projection.
    """
    decoder = model.model.decoder
    embeddings = decoder.embeddings
    hidden = embeddings.embed_tokens(tokens) * embeddings.embed_scale + position_encoding  # (B, 1, D)
    written = torch.arange(self_keys[0].shape[2], device=tokens.device) <= position  # (P_max,): this and earlier positions
    self_bias = torch.zeros(written.shape, dtype=hidden.dtype, device=hidden.device)
    self_bias = self_bias.masked_fill(~written, torch.finfo(hidden.dtype).min)[None, None, None, :]  # (1, 1, 1, P_max)
    for layer, keys, values, source_keys, source_values in zip(
        decoder.layers, self_keys, self_values, cross_keys, cross_values
    ):
        hidden = layer.self_attn_norm(hidden + cached_attention(layer.self_attn, hidden, keys, values, self_bias, position))
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


def _initialise(layer: StaticLayer, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
    """Fill a StaticLayer ourselves: transformers' own lazy initialisation marks its tensors as static
    addresses, which makes dynamo guard on their identity and recompile for every new cache."""
    layer.keys, layer.values = keys, values
    layer.dtype, layer.device = keys.dtype, keys.device
    layer.batch_size, layer.num_heads = keys.shape[:2]
    layer.k_head_dim, layer.v_head_dim = keys.shape[-1], values.shape[-1]
    layer.cumulative_length = torch.tensor(length, device=keys.device)
    layer.is_initialized = True


def _prepare(model: nn.Module, cache: EncoderDecoderCache, batch: int, encoder_hidden_states: torch.Tensor,
             encoder_attention_mask: torch.Tensor | None) -> dict:
    """Before the first step of a cache: allocate the self-attention tensors, compute the encoder-decoder
    keys and values and the source mask once per source, and choose the step (compiled or not)."""
    from .modeling_vaswani import attention_bias  # the model imports this module

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
    while len(cross_cache.layers) < len(layers):  # a dynamic cross-attention cache starts with no layers
        cross_cache.layers.append(DynamicLayer())
    for layer, self_layer, cross_layer in zip(layers, self_cache.layers, cross_cache.layers):
        attention = layer.self_attn
        shape = (batch, attention.num_heads, length)
        _initialise(self_layer, torch.zeros(*shape, attention.d_k, dtype=dtype, device=device),
                    torch.zeros(*shape, attention.d_v, dtype=dtype, device=device), 0)
        attention = layer.cross_attn
        keys = attention.k_proj(encoder_hidden_states).view(batch, source_length, attention.num_heads, attention.d_k)
        values = attention.v_proj(encoder_hidden_states).view(batch, source_length, attention.num_heads, attention.d_v)
        _initialise(cross_layer, keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous(), source_length)
        cache.is_updated[layer.cross_attn.layer_idx] = True
    bias = attention_bias(encoder_attention_mask, 1, source_length, causal=False, dtype=dtype)
    if bias is None:  # one graph for masked and unmasked sources
        bias = torch.zeros(batch, 1, 1, source_length, dtype=dtype, device=device)
    step = decode_step
    # int8 layers hold packed weights that Inductor cannot freeze: those models decode eagerly.
    packed = any(hasattr(module, "_packed_params") for module in model.modules())
    if getattr(model, "_compile_static_decoding", False) and not packed:
        step = compiled_decode_step(model)
    return {"cross_bias": bias, "step": step}


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
            torch.tensor([written], device=decoder_input_ids.device),
            positions(1, written, like=encoder_hidden_states),
            [layer.keys for layer in self_layers],
            [layer.values for layer in self_layers],
            [layer.keys for layer in cross_layers],
            [layer.values for layer in cross_layers],
            state["cross_bias"],
        )
        try:
            logits.append(state["step"](model, *arguments))
        except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as error:
            # No C++ compiler, a platform Inductor does not support: the same step, eagerly.
            if state["step"] is decode_step:
                raise
            warnings.warn(f"Compiling the static-cache decoding step failed ({error}); decoding eagerly.", stacklevel=2)
            state["step"] = decode_step
            logits.append(decode_step(model, *arguments))
        for layer in self_layers:
            layer.cumulative_length.add_(1)
    return torch.cat(logits, dim=1)
