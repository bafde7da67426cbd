"""Decoding with a static cache: `generate(..., cache_implementation="static")`, compiled by default.

An engineering path, not the paper's: the maths is the model's own decoder `forward`, which takes its
keys and values from whatever cache it is given. What changes is where they live:
- `SlotLayer`: the self-attention keys and values of past positions sit in preallocated, position-major
  (P_max, B, h, d) tensors; each step writes its slot and attends over the written prefix (a view, no
  copy), and nothing is allocated or concatenated per step;
- `SourceLayer`: the encoder-decoder keys and values are kept once per source, not once per beam (the
  beams of a source attend to them as one block of queries; `rows_per_source`).
That lets `torch.compile` turn a decoding step into one graph, compiled once for any batch, source and
prefix length (one each for greedy and beam search, and for a batch of one), on CPU with Inductor's weight
freezing and its C++ GEMM template, and Python's per-operator overhead goes with the graph.

The compiled step plugs in through the cache: a call of the model with a `StaticDecodingCache` that compiles
runs `StaticDecodingStep` (generation_vaswani.py's `__call__`); the first position (generate()'s prefill),
a step with `disable_compile=True` and int8 models run the same forward eagerly.
This module never imports the model file: it takes the model as an argument. Costs (measured in
docs/speed.md): the first compiled step of each process compiles (Inductor's on-disk cache cannot keep a
graph that holds oneDNN-packed weights); the compiled step holds its own packed copy of the decoder
weights and the pre-softmax matrix; and freezing bakes the weights in, so a change to any of them
(training on, loading a state dict) is detected and compiles again. Attention weights and hidden states
are not returned on the compiled path (asking for them decodes eagerly).

This file travels with saved weights for `trust_remote_code`: torch, transformers and errors.py only.
"""

from __future__ import annotations

import types
import warnings
import weakref
from collections.abc import Callable

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, EncoderDecoderCache, StaticLayer
from transformers.modeling_outputs import Seq2SeqLMOutput

from .errors import check_token_ids

# transformers 5.24 renamed the decoding cache `past_key_values` -> `cache`, in generate()'s model kwargs, its calls to
# forward and the output classes (the old name is a deprecated alias). This is the installed release's name for it.
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"

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


def write_slots(slots_keys, slots_values, key, value) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the new positions' keys (B, h, T, d) into the last T slots of position-major prefix views
    (P + T, B, h, d), in place, and return the whole prefix as the attention reads it, (B, h, P + T, d)."""
    new = key.shape[2]
    # index_copy_, not a copy into the slice: compiled with a symbolic prefix length, Inductor turned the slice's
    # copy into a kernel that reads and writes every slot (the whole cache, every step); the index's scatter
    # touches the new slots only.
    positions = torch.arange(slots_keys.shape[0] - new, slots_keys.shape[0], device=slots_keys.device)
    slots_keys.index_copy_(0, positions, key.permute(2, 0, 1, 3))
    slots_values.index_copy_(0, positions, value.permute(2, 0, 1, 3))
    return slots_keys.permute(1, 2, 0, 3), slots_values.permute(1, 2, 0, 3)


class SlotLayer(StaticLayer):
    """One decoder layer's self-attention keys and values in preallocated position-major slots,
    (P_max, B, h, d): a cache's written prefix is then a contiguous view."""

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len)
        self.written = 0  # as a number: reading `cumulative_length` would synchronise every step

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        # Not transformers' own: it marks the tensors as static addresses, which makes dynamo guard on their
        # identity and recompile for every new cache.
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_zeros(self.max_cache_len, batch, heads, key_states.shape[-1])
        self.values = value_states.new_zeros(self.max_cache_len, batch, heads, value_states.shape[-1])
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_heads = batch, heads
        self.k_head_dim, self.v_head_dim = key_states.shape[-1], value_states.shape[-1]
        self.cumulative_length = torch.tensor(0, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.written + key_states.shape[2]
        self.check_room(end)
        keys, values = write_slots(self.keys[:end], self.values[:end], key_states, value_states)
        self.advance(key_states.shape[2])
        return keys, values

    def check_room(self, end: int) -> None:
        if end > self.max_cache_len:
            raise ValueError(
                f"The static cache holds {self.max_cache_len} target positions and all are used; pass a larger "
                "max_length (or max_cache_len) to generate()."
            )

    def advance(self, positions: int) -> None:
        self.written += positions
        self.cumulative_length.add_(positions)

    def get_seq_length(self) -> int:
        return self.written

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder the written positions only (the rest is unused)."""
        if self.written:
            self.keys[: self.written] = self.keys[: self.written].index_select(1, beam_idx)
            self.values[: self.written] = self.values[: self.written].index_select(1, beam_idx)


class SourceLayer(DynamicLayer):
    """One decoder layer's encoder-decoder keys and values, once per source: of each run of `rows` equal
    rows (the beams of one source, `rows_per_source`) only the first is kept."""

    def __init__(self, rows: int = 1):
        super().__init__()
        self.rows = rows

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = key_states[:: self.rows].contiguous(), value_states[:: self.rows].contiguous()
        self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
        return self.keys, self.values

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Nothing to do: a beam is only replaced by a beam of the same source, which shares these."""


class StaticDecodingCache(EncoderDecoderCache):
    """transformers' EncoderDecoderCache over a StaticCache, its layers replaced by `SlotLayer`s (self-attention)
    and `SourceLayer`s (encoder-decoder attention), with what this path keeps between steps: whether to
    compile the step, and the state the first compiled step prepares."""

    def __init__(self, self_attention_cache, cross_attention_cache, compile: bool = True, rows_per_source: int = 1):
        super().__init__(self_attention_cache, cross_attention_cache)
        layers = self_attention_cache.layers
        if not all(isinstance(layer, SlotLayer) for layer in layers):  # else laid out already, by an earlier call
            if any(layer.get_seq_length() for layer in layers):
                raise ValueError("A static cache that already holds positions cannot be continued; start a new one.")
            self_attention_cache.layers = [SlotLayer(layer.max_cache_len) for layer in layers]
            cross_attention_cache.layers = [SourceLayer(rows_per_source) for _ in layers]
        self.is_updated = {i: layer.is_initialized for i, layer in enumerate(cross_attention_cache.layers)}
        self.compile = compile
        self.rows_per_source = rows_per_source
        self.state: dict | None = None

    @classmethod
    def from_cache(cls, cache: EncoderDecoderCache, compile: bool = True, rows_per_source: int = 1):
        """The same cache (transformers' static one) laid out for this path: its layers are replaced in place,
        so that the caller's object goes on decoding whichever of the two it passes next."""
        return cls(cache.self_attention_cache, cache.cross_attention_cache, compile, rows_per_source)


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


# --- the decoding step, compiled ------------------------------------------------------------------------------------


class _Keys:
    """Keys and values, as a cache layer holds them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values


class _SlotsSelfAttention:
    """Written-prefix views (P + 1, B, h, d) of a `StaticDecodingCache`'s self-attention slots, per layer."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        return write_slots(self.keys[layer_idx], self.values[layer_idx], key, value)


class _SlotsSources:
    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.layers = [_Keys(*pair) for pair in zip(keys, values)]


class _Slots:
    """A `StaticDecodingCache`'s tensors with the part of the EncoderDecoderCache interface the decoder's forward
    uses. Built inside the step from its tensor arguments, so that the compiled graph sees tensors only (and
    one graph serves any cache)."""

    def __init__(self, self_keys, self_values, cross_keys, cross_values):
        self.self_attention_cache = _SlotsSelfAttention(self_keys, self_values)
        self.cross_attention_cache = _SlotsSources(cross_keys, cross_values)
        self.is_updated = dict.fromkeys(range(len(cross_keys)), True)

    def get_seq_length(self) -> int:
        return self.self_attention_cache.keys[0].shape[0] - 1  # the views end with this step's slot


def decode_step(
    model: nn.Module,
    tokens: torch.Tensor,
    self_keys: list[torch.Tensor],
    self_values: list[torch.Tensor],
    cross_keys: list[torch.Tensor],
    cross_values: list[torch.Tensor],
    sources: torch.Tensor,
    source_mask: torch.Tensor,
) -> torch.Tensor:
    """Logits (B, 1, V) for the next target position, whose input tokens are `tokens` (B, 1): the model's own
    decoder forward with keys and values from the cache's slots (written prefix views (P + 1, B, h, d), this
    position's slot last) and the encoder-decoder keys and values (G, h, S, d) once per source; `sources`
    (G, S, D) and `source_mask` (G, S) are the encoder output and mask, one row per source."""
    slots = _Slots(self_keys, self_values, cross_keys, cross_values)
    hidden = model.get_decoder()(
        input_ids=tokens,
        encoder_hidden_states=sources,
        encoder_attention_mask=source_mask,
        past_key_values=slots,
        use_cache=True,
        return_dict=True,
    ).last_hidden_state
    return model.project(hidden)


def _weights_fingerprint(model: nn.Module) -> tuple:
    """Identity and in-place version of every tensor the step reads: changes whenever a weight does."""
    return tuple((id(t), t._version) for t in (*model.parameters(), *model.buffers()))


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def eager_decode_step(model: nn.Module, *arguments) -> torch.Tensor:
    """`decode_step`, uncompiled."""
    return decode_step(model, *arguments)


def compiled_decode_step(model: nn.Module) -> Callable:
    """`decode_step` compiled for `model`'s current weights, reused while they do not change; called as
    `step(model, *arguments)`.

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

    function = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__, decode_step.__name__)
    compiled = torch.compile(function, fullgraph=True)
    options = CPU_INDUCTOR_OPTIONS if next(model.parameters()).device.type == "cpu" else {}

    def step(model: nn.Module, *arguments) -> torch.Tensor:
        # As a config patch around the call (where any compilation happens): torch.compile's own
        # `options=` does not reach freezing.
        with torch._inductor.config.patch(options):
            return compiled(model, *arguments)

    _COMPILED[model] = (fingerprint, step)
    return step


def is_packed(model: nn.Module) -> bool:
    """int8 layers hold packed weights that Inductor cannot freeze: those models decode eagerly."""
    return any(hasattr(module, "_packed_params") for module in model.modules())


def dynamic_sizes(arguments: tuple) -> None:
    """One graph for any number of rows, prefix length and source length: translating a test set gives
    batches of every size, and a graph per size would mean a compilation per batch."""
    tokens, self_keys, self_values, cross_keys, cross_values, sources, source_mask = arguments
    for tensor in (tokens, sources, source_mask, *self_keys, *self_values, *cross_keys, *cross_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in (*self_keys, *self_values, sources, source_mask):
        torch._dynamo.maybe_mark_dynamic(tensor, 1)
    for tensor in (*cross_keys, *cross_values):
        torch._dynamo.maybe_mark_dynamic(tensor, 2)


class StaticDecodingStep:
    """A decoding step with a `StaticDecodingCache`, through the compiled `decode_step`: how the model's call
    (generation_vaswani.py) runs a step whose cache compiles, given the model's forward arguments. Anything the compiled step does not
    cover (more than one new position, no encoder output, attention weights or hidden states asked for, a decoder
    mask with zeros, embeddings instead of ids) goes to the model's forward, which gives the same result eagerly."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, **inputs) -> Seq2SeqLMOutput:
        cache = inputs.get(CACHE_FIELD, inputs.get("past_key_values"))
        tokens = inputs.get("decoder_input_ids")
        decoder_mask = inputs.get("decoder_attention_mask")
        eager = (
            not isinstance(cache, StaticDecodingCache)
            or not cache.is_updated.get(0)  # the first position: generate()'s prefill fills the cache
            or tokens is None
            or tokens.shape[1] != 1
            or inputs.get("encoder_outputs") is None
            or inputs.get("output_attentions")
            or inputs.get("output_hidden_states")
            or inputs.get("labels") is not None
            or (decoder_mask is not None and decoder_mask.dim() == 2 and not bool(decoder_mask.all()))
        )
        if eager:  # the model's forward, through nn.Module's call (the model's own call is what called this)
            return nn.Module.__call__(self.model, **inputs)
        check_token_ids(tokens, self.model.config.target_vocab_size, "decoder_input_ids")  # as the forward would
        if cache.state is None:
            cache.state = self._prepare(cache, inputs)
        self_layers = cache.self_attention_cache.layers
        written = self_layers[0].written
        self_layers[0].check_room(written + 1)
        arguments = (
            tokens,
            [layer.keys[: written + 1] for layer in self_layers],  # contiguous views: the step writes the last slot
            [layer.values[: written + 1] for layer in self_layers],
            [layer.keys for layer in cache.cross_attention_cache.layers],
            [layer.values for layer in cache.cross_attention_cache.layers],
            cache.state["sources"],
            cache.state["source_mask"],
        )
        logits = self._run(cache, arguments)
        for layer in self_layers:
            layer.advance(1)
        return Seq2SeqLMOutput(logits=logits, **{CACHE_FIELD: cache})

    def _prepare(self, cache: StaticDecodingCache, inputs: dict) -> dict:
        """Before the first compiled step of a cache: the encoder output and mask once per source, the
        positional encodings grown to the cache's length (so that the graph never grows them), the step."""
        encoder_outputs, mask = inputs["encoder_outputs"], inputs.get("attention_mask")
        sources = encoder_outputs[0][:: cache.rows_per_source]  # (G, S, D)
        if mask is None:  # one graph for masked and unmasked sources
            mask = torch.ones(sources.shape[:2], dtype=torch.long, device=sources.device)
        else:
            mask = mask[:: cache.rows_per_source]
        capacity = cache.self_attention_cache.layers[0].max_cache_len
        self.model.get_decoder().embeddings.embed_positions(capacity, 0, like=sources)
        step = eager_decode_step if is_packed(self.model) else compiled_decode_step(self.model)
        return {"sources": sources, "source_mask": mask, "step": step, "marked": False}

    def _run(self, cache: StaticDecodingCache, arguments: tuple) -> torch.Tensor:
        """One step through the prepared step function. A failed compilation (no C++ compiler, a platform
        Inductor does not support) falls back to the same step, eagerly, with a warning."""
        state = cache.state
        if not state["marked"]:
            dynamic_sizes(arguments)
            state["marked"] = True
        try:
            return state["step"](self.model, *arguments)
        except (torch._dynamo.exc.TorchDynamoException, RuntimeError, OSError) as error:
            if state["step"] is eager_decode_step:
                raise
            warnings.warn(
                f"Compiling the static-cache decoding step failed ({error}); decoding eagerly.", stacklevel=3
            )
            state["step"] = eager_decode_step
            return eager_decode_step(self.model, *arguments)
