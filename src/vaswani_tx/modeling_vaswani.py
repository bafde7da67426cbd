"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), Section 3, as a Hugging Face model.

The classes follow the paper's order: positional encoding (3.5), scaled dot-product and multi-head
attention (3.2), the position-wise feed-forward network (3.3), encoder and decoder layers and stacks
(3.1), embeddings shared with the pre-softmax projection (3.4), then the Hugging Face model classes
and the decoding defaults of Section 6.1.

Shape legend: B batch, S source length, T target length (new tokens this call), P cached target
positions, h heads, d_k query/key size per head, d_v value size per head, D d_model, F d_ff, V vocabulary.

Where this file departs from the paper, and why (each is pinned by a test):
- Initialisation is not given in the paper. Linear weights use Xavier-uniform, as in the authors'
  tensor2tensor code; biases are zero; the shared embedding is N(0, D^-0.5), so that after the
  sqrt(D) scale of Section 3.4 the embeddings have unit variance, the scale's evident purpose.
- LayerNorm epsilon is not given in the paper; 1e-5 (`layer_norm_eps`).
- Beam search uses `generate()`'s early stopping: a sentence stops once `num_beams` hypotheses have
  ended, the closest `generate()` comes to "terminate early when possible" (Section 6.1).
- Padding is skipped: the position-wise maps (W^Q, W^K, W^V, W^O, the FFN, the pre-softmax
  projection) run only at the positions that can affect a result, which is the same maths for every
  real position (no real query attends to a padded key). Padded source positions and target
  positions after the last label (or the last 1 of `decoder_attention_mask`) therefore hold no
  meaningful values: zero projections there, and zero logits at unlabelled positions when the
  model computes its loss. `skip_padding=False` in the config computes them as other libraries do.
- Attention weights are normalised in float32 when the model runs in bf16/fp16, so that the softmax
  keeps its precision; masked positions get the dtype's minimum, never -inf, so a fully masked row
  gives uniform weights instead of NaN.
Options where the paper itself varies the model (Table 3): `num_heads`, `d_k`, `d_v`, sizes, dropouts,
and learned positions (row E). `tie_word_embeddings=False` unties the pre-softmax projection.
Options that only published checkpoints need (`vaswani_tx.convert`), all off by default, each a small
named branch: `attention_bias` (biases on W^Q, W^K, W^V, W^O), `activation_function="swish"`,
`position_encoding="fairseq_sinusoidal"`, `final_logits_bias`, separate source and target
vocabularies (`share_encoder_decoder_embeddings=False`, `decoder_vocab_size`), and a decoder
feed-forward size of its own (`decoder_d_ff`). Marian's and fairseq's
sin-half/cos-half layout of the hidden dimension needs no option: conversion permutes the weights.

This file is copied next to saved weights for `trust_remote_code`: it imports only torch,
transformers, the config, the translation pipeline (which saving declares in config.json) and
static_decoding.py, the step that `generate(cache_implementation="static")` runs (compiled).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .configuration_vaswani import VaswaniConfig
from .pipeline_vaswani import CUSTOM_PIPELINES
from .static_decoding import decode_with_static_cache, is_static_cache, reorder_static_cache

# ---------------------------------------------------------------------------------------------------
# 3.5 Positional encoding
# ---------------------------------------------------------------------------------------------------


def sinusoidal_table(length: int, d_model: int) -> torch.Tensor:
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(pos / 10000^(2i/D)) (Section 3.5), as (length, D).

    Computed in float64 so that the table is exact in float32 at every position, then returned as float32.
    """
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)  # (length, 1)
    two_i = torch.arange(0, d_model, 2, dtype=torch.float64)  # (D/2,)
    angles = position / torch.pow(10000.0, two_i / d_model)  # (length, D/2)
    table = torch.empty(length, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(angles)  # even dimensions: sin
    table[:, 1::2] = torch.cos(angles)  # odd dimensions: cos (interleaved, as printed)
    return table.float()


def fairseq_sinusoidal_table(length: int, d_model: int) -> torch.Tensor:
    """fairseq's and FSMT's variant of the table (`position_encoding="fairseq_sinusoidal"`), as (length, D):
    frequencies 10000^(-i/(D/2 - 1)) instead of 10000^(-2i/D), computed in float32 as fairseq computes
    them so that converted checkpoints match exactly. Interleaved like `sinusoidal_table`: conversion
    permutes fairseq's sin-half/cos-half layout of the weights instead."""
    half = d_model // 2
    frequencies = torch.exp(torch.arange(half, dtype=torch.float32) * -(math.log(10000) / (half - 1)))  # (D/2,)
    angles = torch.arange(length, dtype=torch.float32).unsqueeze(1) * frequencies.unsqueeze(0)  # (length, D/2)
    return torch.stack([torch.sin(angles), torch.cos(angles)], dim=-1).reshape(length, d_model)


class SinusoidalPositionalEncoding(nn.Module):
    """Fixed sinusoids of Section 3.5 for any number of positions (the reason the paper preferred them).

    The table is a plain attribute, not a parameter or buffer: it is never saved, so no checkpoint can
    carry a stale or truncated copy, and it is rebuilt for the device and dtype it is used with, so it
    stays exact after `from_pretrained` (meta-device init) and after `.to(dtype)`. It grows on demand.
    """

    def __init__(self, d_model: int, table_function=sinusoidal_table, first_position: int = 0):
        super().__init__()
        self.d_model = d_model
        self.table_function = table_function
        self.first_position = first_position  # fairseq counts positions from pad_token_id + 1
        self._table: torch.Tensor | None = None

    def forward(self, length: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        """Encodings of positions offset, ..., offset + length - 1: (length, D) in `like`'s dtype and device."""
        offset = offset + self.first_position
        end = offset + length
        table = self._table
        if table is None or table.shape[0] < end or table.device != like.device or table.dtype != like.dtype:
            size = max(end, 512 if table is None else 2 * table.shape[0])
            table = self._table = self.table_function(size, self.d_model).to(device=like.device, dtype=like.dtype)
        return table[offset:end]


class LearnedPositionalEmbedding(nn.Embedding):
    """Learned positional embeddings instead of sinusoids: Table 3 row (E). Limited to `max_position_embeddings`."""

    def forward(self, length: int, offset: int, like: torch.Tensor) -> torch.Tensor:
        end = offset + length
        if end > self.num_embeddings:
            raise ValueError(
                f"Sequence of {end} positions is longer than max_position_embeddings={self.num_embeddings} "
                "of the learned positional embeddings (position_encoding='learned'); shorten the input or "
                "use position_encoding='sinusoidal', which works for any length."
            )
        return self.weight[offset:end]


def positional_encoding(config: VaswaniConfig) -> nn.Module:
    if config.position_encoding == "learned":
        return LearnedPositionalEmbedding(config.max_position_embeddings, config.d_model)
    if config.position_encoding == "fairseq_sinusoidal":  # converted fairseq / FSMT checkpoints
        return SinusoidalPositionalEncoding(config.d_model, fairseq_sinusoidal_table, config.pad_token_id + 1)
    return SinusoidalPositionalEncoding(config.d_model)


# ---------------------------------------------------------------------------------------------------
# 3.2 Attention
# ---------------------------------------------------------------------------------------------------


def attention_bias(
    key_mask: torch.Tensor | None, query_length: int, key_length: int, causal: bool, dtype: torch.dtype
) -> torch.Tensor | None:
    """Additive mask, (B or 1, 1, T, S): 0 where a query may attend, the dtype's minimum where it may not.

    `key_mask` (B, S) is 1 for real tokens and 0 for padding. `causal` hides later positions from each
    query: "masking out (setting to -inf) all values in the input of the softmax which correspond to
    illegal connections" (Section 3.2.3). The dtype's minimum stands in for -inf so that a row with
    nothing to attend to gives uniform weights rather than NaN. Returns None when nothing is masked.
    """
    allowed = None
    if key_mask is not None:
        allowed = key_mask[:, None, None, :].bool()  # (B, 1, 1, S)
    if causal and query_length > 1:
        device = key_mask.device if key_mask is not None else None
        query_positions = torch.arange(key_length - query_length, key_length, device=device)
        causal_allowed = torch.arange(key_length, device=device)[None, :] <= query_positions[:, None]  # (T, S)
        causal_allowed = causal_allowed[None, None]  # (1, 1, T, S)
        allowed = causal_allowed if allowed is None else allowed & causal_allowed
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def scaled_dot_product_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention(Q, K, V) = softmax(Q K^T / sqrt(d_k)) V (Section 3.2.1, Equation 1): the "eager" implementation.

    query (B, h, T, d_k), key (B, h, S, d_k), value (B, h, S, d_v); returns (B, T, h, d_v) and the weights
    (B, h, T, S). Same signature as transformers' attention interface, which supplies the SDPA version.
    """
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, h, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2)  # (B, h, T, d_v) -> (B, T, h, d_v)
    return output, weights


def at_positions(function, hidden_states: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """`function` (a position-wise map: a Linear, the FFN) applied only at the flat positions `index`
    of hidden_states (B, L, D_in), zeros elsewhere; (B, L, D_out). All of them when `index` is None.

    Padding is a third of a typical batch of sentences; the matrix products at padded positions,
    most of the model's work, would be thrown away (see `real_positions`).
    """
    if index is None:
        return function(hidden_states)
    batch, length, width = hidden_states.shape
    picked = function(hidden_states.reshape(batch * length, width).index_select(0, index))  # (N, D_out)
    return scatter_positions(picked, index, batch, length)


def scatter_positions(picked: torch.Tensor, index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Rows `picked` (N, D) put back at the flat positions `index` of a (B, L, D) tensor of zeros."""
    return picked.new_zeros(batch * length, picked.shape[-1]).index_copy(0, index, picked).view(batch, length, -1)


def real_positions(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Flat indices into (B, L) of the positions where `mask` (B, L) is nonzero: the positions to
    compute. A row with none is computed whole, as without skipping (a fully padded source then
    still gets uniform attention over its padding). None when that is every position."""
    if mask is None:
        return None
    keep = mask.bool()
    keep = keep | ~keep.any(1, keepdim=True)
    if bool(keep.all()):
        return None
    return keep.reshape(-1).nonzero().squeeze(1)


def prefix_lengths(mask: torch.Tensor) -> torch.Tensor:
    """(B,): one past the last nonzero position of each row of `mask` (B, L); 0 for a row of zeros."""
    ones = mask.bool()
    return torch.where(ones.any(1), ones.shape[1] - ones.flip(1).int().argmax(1), 0)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) (Section 3.2.2).

    The h projections W_i^Q (D x d_k) are stored side by side as one D x h*d_k matrix (likewise K and
    V); the paper's projections have no bias, and neither do these unless `attention_bias` (converted
    Marian/fairseq checkpoints) gives each Linear its own `.bias`. Keys and values of the
    encoder-decoder attention are computed once per source and kept in the cache during decoding.
    """

    def __init__(self, config: VaswaniConfig, is_causal: bool = False, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.num_heads, self.d_k, self.d_v = config.num_heads, config.d_k, config.d_v
        self.scaling = self.d_k**-0.5  # 1 / sqrt(d_k)
        self.attention_dropout = config.attention_dropout
        self.is_causal = is_causal  # read by transformers' SDPA interface
        self.layer_idx = layer_idx
        d_model, h = config.d_model, config.num_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(d_model, h * self.d_k, bias=bias)
        self.k_proj = nn.Linear(d_model, h * self.d_k, bias=bias)
        self.v_proj = nn.Linear(d_model, h * self.d_v, bias=bias)
        self.out_proj = nn.Linear(h * self.d_v, d_model, bias=bias)  # W^O

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_bias: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        output_attentions: bool = False,
        index: torch.Tensor | None = None,
        source_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, T, D) are the queries; key_value_states (B, S, D) the encoder output for
        encoder-decoder attention, None for self-attention. Returns (B, T, D) and the weights if asked.
        `index` / `source_index`: the flat query / key positions to project (`real_positions`), None for all."""
        batch, length, _ = hidden_states.shape
        query = at_positions(self.q_proj, hidden_states, index).view(batch, length, self.num_heads, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

        is_cross = key_value_states is not None
        cache = None
        if past_key_values is not None:
            cache = past_key_values.cross_attention_cache if is_cross else past_key_values.self_attention_cache
        if is_cross and cache is not None and past_key_values.is_updated.get(self.layer_idx):
            key, value = cache.layers[self.layer_idx].keys, cache.layers[self.layer_idx].values
        else:
            source, kept = (key_value_states, source_index) if is_cross else (hidden_states, index)
            key = at_positions(self.k_proj, source, kept).view(batch, -1, self.num_heads, self.d_k).transpose(1, 2)  # (B, h, S, d_k)
            value = at_positions(self.v_proj, source, kept).view(batch, -1, self.num_heads, self.d_v).transpose(1, 2)  # (B, h, S, d_v)
            if cache is not None:
                key, value = cache.update(key, value, self.layer_idx)  # self-attention: (B, h, P + T, d)
                if is_cross:
                    past_key_values.is_updated[self.layer_idx] = True

        # Attention weights exist only in the eager path; asking for them selects it for this call.
        attend = scaled_dot_product_attention
        if not output_attentions:
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, scaled_dot_product_attention)
        output, weights = attend(
            self,
            query,
            key,
            value,
            attention_bias,
            scaling=self.scaling,
            dropout=self.attention_dropout if self.training else 0.0,
        )
        output = output.reshape(batch, length, self.num_heads * self.d_v)  # Concat(head_1..head_h): (B, T, h*d_v)
        return at_positions(self.out_proj, output, index), (weights if output_attentions else None)


# ---------------------------------------------------------------------------------------------------
# 3.3 Position-wise feed-forward network
# ---------------------------------------------------------------------------------------------------


class PositionwiseFeedForward(nn.Module):
    """FFN(x) = max(0, x W1 + b1) W2 + b2 (Section 3.3, Equation 2), applied to each position alike.
    `activation_function="swish"` replaces max(0, .) with x * sigmoid(x) for converted OPUS-MT models;
    `d_ff` overrides `config.d_ff` (the decoder's `decoder_d_ff` of converted WMT19 models)."""

    def __init__(self, config: VaswaniConfig, d_ff: int | None = None):
        super().__init__()
        d_ff = d_ff or config.d_ff
        self.w_1 = nn.Linear(config.d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, config.d_model)
        self.activation_dropout = nn.Dropout(config.activation_dropout)  # 0 in the paper
        self.activation = torch.relu if config.activation_function == "relu" else nn.functional.silu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.activation_dropout(self.activation(self.w_1(hidden_states))))  # (B, T, D) -> (B, T, F) -> (B, T, D)


# ---------------------------------------------------------------------------------------------------
# 3.1 Encoder and decoder stacks
# ---------------------------------------------------------------------------------------------------


class EncoderLayer(GradientCheckpointingLayer):
    """Self-attention, then the feed-forward network; each sub-layer is LayerNorm(x + Dropout(Sublayer(x)))
    (Section 3.1, with residual dropout from Section 5.4): post-LN, as in the paper."""

    def __init__(self, config: VaswaniConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, layer_idx=layer_idx)
        self.self_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = PositionwiseFeedForward(config)
        self.feed_forward_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_bias: torch.Tensor | None = None,
        output_attentions: bool = False,
        index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, weights = self.self_attn(
            hidden_states, attention_bias=attention_bias, output_attentions=output_attentions, index=index
        )
        hidden_states = self.self_attn_norm(hidden_states + self.dropout(attended))
        fed = at_positions(self.feed_forward, hidden_states, index)
        hidden_states = self.feed_forward_norm(hidden_states + self.dropout(fed))
        return hidden_states, weights


class DecoderLayer(GradientCheckpointingLayer):
    """Masked self-attention, encoder-decoder attention, then the feed-forward network, each sub-layer
    wrapped as LayerNorm(x + Dropout(Sublayer(x))) (Section 3.1)."""

    def __init__(self, config: VaswaniConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, is_causal=True, layer_idx=layer_idx)
        self.self_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.cross_attn = MultiHeadAttention(config, layer_idx=layer_idx)
        self.cross_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = PositionwiseFeedForward(config, config.decoder_d_ff)
        self.feed_forward_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        self_attention_bias: torch.Tensor | None = None,
        cross_attention_bias: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        output_attentions: bool = False,
        index: torch.Tensor | None = None,
        source_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        attended, self_weights = self.self_attn(
            hidden_states, attention_bias=self_attention_bias, past_key_values=past_key_values,
            output_attentions=output_attentions, index=index,
        )
        hidden_states = self.self_attn_norm(hidden_states + self.dropout(attended))
        attended, cross_weights = self.cross_attn(
            hidden_states, key_value_states=encoder_hidden_states, attention_bias=cross_attention_bias,
            past_key_values=past_key_values, output_attentions=output_attentions, index=index, source_index=source_index,
        )
        hidden_states = self.cross_attn_norm(hidden_states + self.dropout(attended))
        fed = at_positions(self.feed_forward, hidden_states, index)
        hidden_states = self.feed_forward_norm(hidden_states + self.dropout(fed))
        return hidden_states, self_weights, cross_weights


def check_token_ids(ids: torch.Tensor, vocab_size: int, name: str) -> None:
    """Refuse ids outside the vocabulary with a message, rather than an opaque index error deep in the embedding."""
    if ids.numel() == 0:
        return
    smallest, largest = (int(v) for v in torch.aminmax(ids))  # one pass and one sync: this runs every decode step
    if smallest < 0 or largest >= vocab_size:
        bad = largest if largest >= vocab_size else smallest
        raise ValueError(
            f"{name} contains id {bad} (largest {largest}, smallest {smallest}) outside the vocabulary of "
            f"vocab_size={vocab_size}; ids must be in [0, {vocab_size}). Is the tokenizer the one this model was trained with?"
        )


def check_mask(mask: torch.Tensor | None, ids_or_embeds: torch.Tensor, mask_name: str, ids_name: str) -> None:
    if mask is not None and tuple(mask.shape) != tuple(ids_or_embeds.shape[:2]):
        raise ValueError(
            f"{mask_name} has shape {tuple(mask.shape)} but {ids_name} has shape {tuple(ids_or_embeds.shape[:2])}; "
            "they must match (batch, length)."
        )


class Embeddings(nn.Module):
    """Token embeddings times sqrt(d_model), plus positional encodings, then dropout (Sections 3.4, 3.5, 5.4).

    The token table is the model's one shared matrix (passed in, not owned)."""

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_positions = positional_encoding(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None, offset: int = 0):
        """Returns (embedding output before dropout, after dropout), both (B, length, D). `inputs_embeds`
        replaces the table lookup and is scaled like it."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        embedded = inputs_embeds * self.embed_scale
        embedded = embedded + self.embed_positions(embedded.shape[1], offset, like=embedded)  # (B, L, D) + (L, D)
        return embedded, self.dropout(embedded)


class Encoder(nn.Module):
    """N identical layers over the embedded source (Section 3.1); no LayerNorm after the last layer."""

    main_input_name = "input_ids"

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList([EncoderLayer(config, i) for i in range(config.num_encoder_layers)])

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Encoder: pass exactly one of input_ids and inputs_embeds.")
        source = input_ids if input_ids is not None else inputs_embeds
        if input_ids is not None:
            check_token_ids(input_ids, self.config.vocab_size, "input_ids")
        check_mask(attention_mask, source, "attention_mask", "input_ids")
        output_attentions = bool(output_attentions)
        return_dict = self.config.return_dict if return_dict is None else return_dict

        embedded, hidden_states = self.embeddings(input_ids, inputs_embeds)
        bias = attention_bias(attention_mask, source.shape[1], source.shape[1], causal=False, dtype=embedded.dtype)
        # Padded keys are masked for every query, so padded positions need not be computed at all.
        index = real_positions(attention_mask) if self.config.skip_padding else None
        all_hidden = [embedded] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        for layer in self.layers:
            hidden_states, weights = layer(hidden_states, bias, output_attentions=output_attentions, index=index)
            if output_hidden_states:
                all_hidden.append(hidden_states)
            if output_attentions:
                all_weights.append(weights)
        output = BaseModelOutput(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_weights) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()


class Decoder(nn.Module):
    """N identical layers over the embedded, right-shifted target, attending to the encoder output
    (Section 3.1); causal self-attention; no LayerNorm after the last layer."""

    main_input_name = "input_ids"

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.config = config
        self.embeddings = Embeddings(config, embed_tokens)
        self.layers = nn.ModuleList([DecoderLayer(config, i) for i in range(config.num_decoder_layers)])

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        lengths: torch.Tensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        """`lengths` (B,): only the first lengths[b] target positions of each row matter (the rest are
        padding after the last label); with causal attention no earlier position sees the rest, so they
        are not computed. Also read from the last 1 of `attention_mask`. Ignored when decoding with a cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Decoder: pass exactly one of decoder_input_ids and decoder_inputs_embeds.")
        if encoder_hidden_states is None:
            raise ValueError("Decoder: encoder_hidden_states are required (the decoder attends to the encoder output).")
        target = input_ids if input_ids is not None else inputs_embeds
        if input_ids is not None:
            check_token_ids(input_ids, self.config.target_vocab_size, "decoder_input_ids")
        output_attentions = bool(output_attentions)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        return_dict = self.config.return_dict if return_dict is None else return_dict

        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if past_key_values is not None and not isinstance(past_key_values, EncoderDecoderCache):
            raise TypeError(
                f"past_key_values must be an EncoderDecoderCache (self- and cross-attention), got {type(past_key_values).__name__}."
            )
        if not use_cache:
            past_key_values = None
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        length = target.shape[1]
        if attention_mask is not None and attention_mask.shape[1] not in (length, past_length + length):
            raise ValueError(
                f"decoder_attention_mask has length {attention_mask.shape[1]} but the decoder sees {length} new "
                f"positions after {past_length} cached ones; it must have length {length} or {past_length + length}."
            )
        if attention_mask is not None and attention_mask.shape[1] == length and past_length:
            attention_mask = torch.cat([attention_mask.new_ones(attention_mask.shape[0], past_length), attention_mask], 1)

        embedded, hidden_states = self.embeddings(input_ids, inputs_embeds, offset=past_length)
        self_bias = attention_bias(attention_mask, length, past_length + length, causal=True, dtype=embedded.dtype)
        cross_bias = self._cross_attention_bias(
            encoder_attention_mask, encoder_hidden_states.shape[1], embedded.dtype, past_key_values
        )
        index = source_index = None
        if self.config.skip_padding and past_key_values is None:
            if attention_mask is not None:
                ends = prefix_lengths(attention_mask)
                lengths = ends if lengths is None else torch.minimum(lengths, ends)
            if lengths is not None:
                index = real_positions(torch.arange(length, device=target.device)[None, :] < lengths[:, None])
            source_index = real_positions(encoder_attention_mask)
        all_hidden = [embedded] if output_hidden_states else None
        all_self, all_cross = ([], []) if output_attentions else (None, None)
        for layer in self.layers:
            hidden_states, self_weights, cross_weights = layer(
                hidden_states,
                encoder_hidden_states,
                self_bias,
                cross_bias,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
                index=index,
                source_index=source_index,
            )
            if output_hidden_states:
                all_hidden.append(hidden_states)
            if output_attentions:
                all_self.append(self_weights)
                all_cross.append(cross_weights)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values,
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()

    @staticmethod
    def _cross_attention_bias(
        encoder_attention_mask: torch.Tensor | None, source_length: int, dtype: torch.dtype,
        past_key_values: EncoderDecoderCache | None,
    ) -> torch.Tensor | None:
        """The encoder-decoder attention bias, (B, 1, 1, S), built once per source rather than once per decode step.

        It is kept in the cache next to the encoder-decoder keys and values it goes with, and reused
        exactly when those are (once the cache holds them, the source cannot change).
        """
        if past_key_values is not None and past_key_values.is_updated.get(0):
            cached = getattr(past_key_values, "_cross_attention_bias", None)
            if cached is not None and cached[0] == (source_length, dtype):
                return cached[1]
        bias = attention_bias(encoder_attention_mask, 1, source_length, causal=False, dtype=dtype)
        if past_key_values is not None:
            past_key_values._cross_attention_bias = ((source_length, dtype), bias)
        return bias


# ---------------------------------------------------------------------------------------------------
# 3.4 Embeddings and softmax; the Hugging Face model classes
# ---------------------------------------------------------------------------------------------------


class VaswaniPreTrainedModel(PreTrainedModel):
    config_class = VaswaniConfig
    config: VaswaniConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _no_split_modules = ["EncoderLayer", "DecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = False  # the additive float masks above are the eager/SDPA format
    _supports_flex_attn = False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """See the module docstring: Xavier-uniform linears, N(0, D^-0.5) embeddings, unit LayerNorms."""
        if isinstance(module, nn.Linear):
            init.xavier_uniform_(module.weight)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=self.config.d_model**-0.5)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, VaswaniForConditionalGeneration) and module.config.final_logits_bias:
            init.zeros_(module.final_logits_bias)


class VaswaniModel(VaswaniPreTrainedModel):
    """Encoder and decoder around one embedding matrix shared by source and target (Section 3.4).
    With `share_encoder_decoder_embeddings=False` (converted FSMT and some OPUS-MT models) the decoder
    owns a second table for the target vocabulary and `shared` is the source's."""

    _tied_weights_keys = {
        "encoder.embeddings.embed_tokens.weight": "shared.weight",
        "decoder.embeddings.embed_tokens.weight": "shared.weight",
    }

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Encoder(config, self.shared)
        target_embeddings = self.shared
        if not config.share_encoder_decoder_embeddings:
            target_embeddings = nn.Embedding(config.decoder_vocab_size, config.d_model)
            self._tied_weights_keys = {"encoder.embeddings.embed_tokens.weight": "shared.weight"}
        self.decoder = Decoder(config, target_embeddings)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        # Source and target embeddings are one matrix whatever `tie_word_embeddings` says: that flag
        # governs only the pre-softmax projection, one level up.
        return dict(self._tied_weights_keys)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.shared = value
        self.encoder.embeddings.embed_tokens = value
        if self.config.share_encoder_decoder_embeddings:
            self.decoder.embeddings.embed_tokens = value

    def get_encoder(self, modality: str | None = None) -> Encoder:
        return self.encoder

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        decoder_lengths: torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput | tuple:
        """`decoder_lengths` (B,): target positions at and after decoder_lengths[b] are padding whose outputs
        are not needed (VaswaniForConditionalGeneration passes one past the last label); see `Decoder`."""
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            raise ValueError(
                "Pass decoder_input_ids (the target shifted right, starting with decoder_start_token_id="
                f"{self.config.decoder_start_token_id}), or labels to VaswaniForConditionalGeneration, which shifts them."
            )
        return_dict = self.config.return_dict if return_dict is None else return_dict
        output_hidden_states = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=True,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(*encoder_outputs)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            attention_mask=decoder_attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            lengths=decoder_lengths,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            past_key_values=decoder_outputs.past_key_values,
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


def shift_tokens_right(labels: torch.Tensor, pad_token_id: int, decoder_start_token_id: int) -> torch.Tensor:
    """Decoder input = the target "offset by one position" (Section 3.1): start token, then labels[:-1]; -100 -> pad."""
    shifted = labels.new_full(labels.shape, pad_token_id)
    shifted[:, 1:] = labels[:, :-1]
    shifted[:, 0] = decoder_start_token_id
    return shifted.masked_fill(shifted == -100, pad_token_id)


# ---------------------------------------------------------------------------------------------------
# 6.1 Decoding: beam 4, length penalty alpha 0.6 in the GNMT form, maximum output length input + 50
# ---------------------------------------------------------------------------------------------------


class GNMTLengthPenalty(float):
    """The length penalty the paper used (Section 6.1, from Wu et al. 2016): lp(Y) = ((5 + |Y|) / 6)^alpha.

    transformers' beam search divides a hypothesis' log-probability by `length ** length_penalty`.
    This float subclass is alpha everywhere except in that one power, where it yields the GNMT form:
    `length ** GNMTLengthPenalty(alpha) == ((5 + length) / 6) ** alpha`.
    """

    def __rpow__(self, length):
        return ((5.0 + length) / 6.0) ** float(self)

    def __repr__(self) -> str:
        return f"GNMTLengthPenalty({float(self)!r})"


class SourceLengthCap(LogitsProcessor):
    """Per-sentence maximum output length: "input length + 50" (Section 6.1), not one global maximum.

    `max_tokens` (B,) holds each source's limit in output tokens, end-of-sentence included; at the
    last allowed position only `eos_token_id` remains possible. Rows of beams or of several returned
    sequences per source are matched to their source by position (they are laid out source-major).
    """

    def __init__(self, max_tokens: torch.Tensor, eos_token_id: int):
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.prompt_length: int | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]  # the decoder start token (and any forced prefix)
        generated = input_ids.shape[1] - self.prompt_length
        limits = self.max_tokens.to(scores.device).repeat_interleave(input_ids.shape[0] // self.max_tokens.numel())
        at_limit = (generated + 1 >= limits)[:, None]  # the next token is the last one allowed
        only_eos = torch.full_like(scores, -float("inf"))
        only_eos[:, self.eos_token_id] = 0.0
        return torch.where(at_limit, only_eos, scores)


def paper_generation_config(config: VaswaniConfig) -> GenerationConfig:
    """Section 6.1 decoding: beam size 4, length penalty alpha = 0.6 (GNMT form), maximum output length
    input length + 50, early stopping. `length_penalty_type="hf"` selects transformers' `|Y|^alpha`."""
    return GenerationConfig(
        num_beams=4,
        length_penalty=0.6,
        length_penalty_type="gnmt",
        max_output_length_offset=50,
        early_stopping=True,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, GenerationMixin):
    """The Transformer with its pre-softmax linear projection, which shares its weight with both
    embeddings (Section 3.4), a cross-entropy loss over `labels` (-100 ignored; the Trainer adds the
    label smoothing of Section 5.4) and the decoding defaults of Section 6.1 in `generation_config`."""

    _tied_weights_keys = {"lm_head.weight": "model.shared.weight"}

    def __init__(self, config: VaswaniConfig):
        super().__init__(config)
        self.model = VaswaniModel(config)
        if not config.share_encoder_decoder_embeddings:  # separate vocabularies: tie to the target table
            self._tied_weights_keys = {"lm_head.weight": "model.decoder.embeddings.embed_tokens.weight"}
        self.lm_head = nn.Linear(config.d_model, config.target_vocab_size, bias=False)
        if config.final_logits_bias:  # Marian's fixed bias on the logits (a buffer there too)
            self.register_buffer("final_logits_bias", torch.zeros(1, config.target_vocab_size))
        self.post_init()
        self.generation_config = paper_generation_config(config)

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`, declaring the translation pipeline in config.json
        (`custom_pipelines`); pipeline_vaswani.py travels with the code files, as this file imports it."""
        self.config.custom_pipelines = CUSTOM_PIPELINES
        return super().save_pretrained(save_directory, *args, **kwargs)

    def get_encoder(self, modality: str | None = None) -> Encoder:
        return self.model.encoder

    def get_decoder(self) -> Decoder:
        return self.model.decoder

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
        encoder_outputs: BaseModelOutput | tuple | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if input_ids is not None and attention_mask is None and self.config.pad_token_id is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        if labels is None and use_cache is not False and is_static_cache(past_key_values):
            output = self._forward_static_cache(
                input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
                past_key_values, inputs_embeds, decoder_inputs_embeds, output_attentions, output_hidden_states,
            )
            return output if return_dict else output.to_tuple()
        labelled = decoder_lengths = None
        if labels is not None:
            has_label = labels.ne(-100)
            check_token_ids(labels[has_label], self.config.target_vocab_size, "labels")
            if self.config.skip_padding:  # only labelled positions, and those before them, need computing
                labelled = real_positions(has_label)
                decoder_lengths = prefix_lengths(has_label)
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            decoder_lengths=decoder_lengths,
        )
        hidden = outputs.last_hidden_state  # (B, T, D)
        if labelled is None:
            picked_labels, logits = labels, self._project(hidden)  # (B, T, V)
            picked = logits
        else:  # the projection, the largest product of all, only at labelled positions; zero logits elsewhere
            batch, length, _ = hidden.shape
            picked = self._project(hidden.reshape(batch * length, -1).index_select(0, labelled))  # (N, V)
            logits = scatter_positions(picked, labelled, batch, length)  # the loss below needs `picked` itself
            picked_labels = labels.reshape(-1).index_select(0, labelled)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(
                picked.float().reshape(-1, picked.shape[-1]), picked_labels.to(picked.device).reshape(-1), ignore_index=-100
            )
        output = Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            past_key_values=outputs.past_key_values,
            decoder_hidden_states=outputs.decoder_hidden_states,
            decoder_attentions=outputs.decoder_attentions,
            cross_attentions=outputs.cross_attentions,
            encoder_last_hidden_state=outputs.encoder_last_hidden_state,
            encoder_hidden_states=outputs.encoder_hidden_states,
            encoder_attentions=outputs.encoder_attentions,
        )
        return output if return_dict else output.to_tuple()

    def _forward_static_cache(
        self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, encoder_outputs,
        past_key_values, inputs_embeds, decoder_inputs_embeds, output_attentions, output_hidden_states,
    ) -> Seq2SeqLMOutput:
        """Decoding with transformers' StaticCache (`generate(cache_implementation="static")`): see static_decoding.py."""
        unsupported = {
            "decoder_inputs_embeds": decoder_inputs_embeds is not None,
            "output_attentions": bool(output_attentions),
            "output_hidden_states": bool(output_hidden_states),
            # generate() passes its own 4D causal mask over the cache, which the step rebuilds from the position.
            "a decoder_attention_mask with zeros": decoder_attention_mask is not None and decoder_attention_mask.dim() == 2
            and not bool(decoder_attention_mask.all()),
        }
        for name, given in unsupported.items():
            if given:
                raise ValueError(
                    f"{name} is not supported with a static cache (cache_implementation='static'); "
                    "decode with the default dynamic cache instead."
                )
        if decoder_input_ids is None:
            raise ValueError("Decoding with a static cache needs decoder_input_ids.")
        check_token_ids(decoder_input_ids, self.config.target_vocab_size, "decoder_input_ids")
        if encoder_outputs is None:
            encoder_outputs = self.model.encoder(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds)
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(last_hidden_state=encoder_outputs[0])
        encoder_hidden_states = encoder_outputs.last_hidden_state
        logits = decode_with_static_cache(self, decoder_input_ids, encoder_hidden_states, attention_mask, past_key_values)
        return Seq2SeqLMOutput(logits=logits, past_key_values=past_key_values, encoder_last_hidden_state=encoder_hidden_states)

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pre-softmax linear transformation (Section 3.4), plus Marian's fixed bias where configured."""
        logits = self.lm_head(hidden)
        return logits + self.final_logits_bias if self.config.final_logits_bias else logits

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)

    def _reorder_cache(self, past_key_values: EncoderDecoderCache, beam_idx: torch.LongTensor) -> EncoderDecoderCache:
        """Beam search: reorder only the self-attention keys and values. A beam is only ever replaced by a
        beam of the same source, and all beams of one source share its encoder-decoder keys and values,
        so reordering those (half of the cache, every step) would copy them onto themselves."""
        if is_static_cache(past_key_values):
            reorder_static_cache(past_key_values, beam_idx)
            return past_key_values
        past_key_values.self_attention_cache.reorder_cache(beam_idx)
        return past_key_values

    @torch.no_grad()
    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 logits_processor: LogitsProcessorList | None = None, **kwargs):
        """`GenerationMixin.generate` with the two Section 6.1 settings it lacks: the GNMT length penalty
        (`length_penalty_type="gnmt"`) and a maximum output length of each source's length plus
        `max_output_length_offset` tokens. Passing `max_length` or `max_new_tokens` replaces the latter
        with that global limit; `max_output_length_offset=None` turns it off."""
        config = generation_config if generation_config is not None else self.generation_config
        penalty_type = kwargs.pop("length_penalty_type", getattr(config, "length_penalty_type", "hf"))
        offset = kwargs.pop("max_output_length_offset", getattr(config, "max_output_length_offset", None))
        if penalty_type not in ("gnmt", "hf"):
            raise ValueError(f"length_penalty_type={penalty_type!r} is not allowed; choose 'gnmt' (the paper's) or 'hf'.")
        if penalty_type == "gnmt":
            kwargs["length_penalty"] = GNMTLengthPenalty(kwargs.get("length_penalty", config.length_penalty))

        explicit_limit = any(kwargs.get(k) is not None for k in ("max_length", "max_new_tokens"))
        if generation_config is not None:  # a caller's own config counts as explicit where it sets a limit
            explicit_limit = explicit_limit or generation_config.max_new_tokens is not None or (
                generation_config.max_length is not None and generation_config.max_length != 20
            )
        source_lengths = self._source_lengths(inputs if inputs is not None else kwargs.get("input_ids"),
                                              kwargs.get("attention_mask"))
        if offset is not None and not explicit_limit and source_lengths is not None:
            limits = source_lengths + int(offset)  # (B,)
            # As max_length (decoder prefix + longest cap), not max_new_tokens: a saved generation config
            # that carries a max_length (Seq2SeqTrainer's evaluation writes its defaults into the model's)
            # would otherwise clash with it and make generate() warn.
            prefix = kwargs["decoder_input_ids"].shape[1] if kwargs.get("decoder_input_ids") is not None else 1
            kwargs["max_length"] = prefix + int(limits.max())
            cap = SourceLengthCap(limits, self.config.eos_token_id)
            logits_processor = LogitsProcessorList([*(logits_processor or []), cap])
        # With a static cache, forward() runs static_decoding's step, compiled unless disable_compile.
        self._compile_static_decoding = not kwargs.get("disable_compile", getattr(config, "disable_compile", False))
        try:
            return super().generate(inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs)
        finally:
            self._compile_static_decoding = False

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config: GenerationConfig) -> bool:
        """Never compile the whole forward (transformers would, on GPU, with a static cache): the static-cache
        path compiles its own decoding step, and forward's input checks would break the graph."""
        return False

    def _source_lengths(self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """Source lengths in tokens, end-of-sentence included, from the attention mask or the padding."""
        if attention_mask is not None:
            return attention_mask.sum(-1).long()
        if input_ids is not None and input_ids.dtype == torch.long:
            return input_ids.ne(self.config.pad_token_id).sum(-1).long()
        return None


__all__ = [
    "GNMTLengthPenalty",
    "SinusoidalPositionalEncoding",
    "SourceLengthCap",
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "fairseq_sinusoidal_table",
    "paper_generation_config",
    "sinusoidal_table",
]
