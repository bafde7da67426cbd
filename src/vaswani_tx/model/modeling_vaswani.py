"""The Transformer of "Attention Is All You Need" (Vaswani et al., 2017), Section 3, as a Hugging Face model.

The classes follow the paper's order: positional encoding (3.5), scaled dot-product and multi-head
attention (3.2), the position-wise feed-forward network (3.3), encoder and decoder layers and stacks
(3.1), embeddings shared with the pre-softmax projection (3.4), then the Hugging Face model classes.
Section 6.1's decoding (beam search settings, length penalty, output length) is generation_vaswani.py.

Shape legend: B batch, S source length, T target length (new tokens this call), P cached target
positions, h heads, d_k query/key size per head,
d_v value size per head, D d_model, F d_ff, V vocabulary.

One body per layer: training and decoding with a cache run the same `forward`; the attention takes earlier keys
and values from the cache it is given. Fast decoding is not here: `generate()` hands its calls to the package's
engine (vaswani_tx.engine) where the package is installed.

Where this file departs from the paper, and why (each is pinned by a test):
- Initialisation is not given in the paper. Linear weights use Xavier-uniform, as in the authors'
  tensor2tensor code; biases are zero; the shared embedding is N(0, D^-0.5), so that after the
  sqrt(D) scale of Section 3.4 the embeddings have unit variance, the scale's evident purpose.
- LayerNorm epsilon is not given in the paper; 1e-5 (`layer_norm_eps`).
- Padding is skipped: the position-wise maps run only at the positions that can affect a result, the
  same maths for every real position (skip_padding.py; `skip_padding=False` computes them all).
- Attention weights are normalised in float32 when the model runs in bf16/fp16, so that the softmax
  keeps its precision; masked positions get the dtype's minimum, never -inf, so a fully masked row
  gives uniform weights instead of NaN.
Options (`VaswaniConfig` documents each): where the paper itself varies the model (Table 3), and what published
checkpoints need (`vaswani_tx.interop.convert`), all off by default, each a small named branch.

Copied next to saved weights for `trust_remote_code` with the rest of model/: imports torch, transformers and model/.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AutoModel, AutoModelForSeq2SeqLM, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPastAndCrossAttentions,
    Seq2SeqLMOutput,
    Seq2SeqModelOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bart.modeling_bart import shift_tokens_right

from .configuration_vaswani import VaswaniConfig
from .dropout import Dropout, apply_dropout
from .errors import UserInputError, check_decoder_mask, check_mask, check_token_ids, load_fitting_weights
from .generation_vaswani import CACHE_FIELD, VaswaniGenerationMixin, decoding_cache, paper_generation_config
from .pipeline_vaswani import CUSTOM_PIPELINES
from .skip_padding import PaddingPlan, at_positions, scatter_positions

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

    The table is a plain attribute, not a parameter or buffer: never saved, so no checkpoint carries a stale
    or truncated copy; rebuilt for the device and dtype it is used with, so it stays exact after
    `from_pretrained` (meta-device init) and `.to(dtype)`; grown on demand.
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


def additive_mask(
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
    (B, h, T, S). Same signature as transformers' attention interface, which supplies the SDPA version."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling  # (B, h, T, S)
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = apply_dropout(weights, dropout, module.training)
    output = torch.matmul(weights, value)
    return output.transpose(1, 2), weights  # (B, h, T, d_v) -> (B, T, h, d_v)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O, head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V) (Section 3.2.2).

    The h projections W_i^Q (D x d_k) are stored side by side as one D x h*d_k matrix (likewise K and
    V); the paper's projections have no bias, and neither do these unless `config.attention_bias`
    (converted Marian/fairseq checkpoints) gives each Linear its own `.bias`. While decoding, the keys
    and values come from the cache: the encoder-decoder attention's are computed at the first step and
    kept; the self-attention's grow by the new positions each step.
    """

    def __init__(self, config: VaswaniConfig, is_causal: bool = False, layer_idx: int | None = None):
        super().__init__()
        self.config = config
        self.num_heads, self.d_k, self.d_v = config.num_heads, config.d_k, config.d_v
        self.scaling = self.d_k**-0.5  # 1 / sqrt(d_k)
        self.attention_dropout = config.attention_dropout
        self.is_causal = is_causal  # the decoder's self-attention; also read by transformers' SDPA interface
        self.layer_idx = layer_idx
        d_model, h = config.d_model, config.num_heads
        bias = config.attention_bias
        self.q_proj = nn.Linear(d_model, h * self.d_k, bias=bias)
        self.k_proj = nn.Linear(d_model, h * self.d_k, bias=bias)
        self.v_proj = nn.Linear(d_model, h * self.d_v, bias=bias)
        self.out_proj = nn.Linear(h * self.d_v, d_model, bias=bias)  # W^O

    def keys_values(
        self, states: torch.Tensor, index: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K W^K and V W^V for all heads: states (B, S, D) -> keys (B, h, S, d_k), values (B, h, S, d_v)."""
        batch = states.shape[0]
        key = at_positions(self.k_proj, states, index).view(batch, -1, self.num_heads, self.d_k).transpose(1, 2)
        value = at_positions(self.v_proj, states, index).view(batch, -1, self.num_heads, self.d_v).transpose(1, 2)
        return key, value

    def cached_keys_values(
        self,
        states: torch.Tensor,
        is_cross: bool,
        past_key_values: EncoderDecoderCache | None,
        index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values to attend to, (B, h, P + T or S, d): computed from `states` (the encoder
        output for encoder-decoder attention, the new positions for self-attention) and, while decoding,
        taken from and added to the cache."""
        if past_key_values is None:
            return self.keys_values(states, index)
        if not is_cross:
            return past_key_values.self_attention_cache.update(*self.keys_values(states), self.layer_idx)
        if past_key_values.is_updated.get(self.layer_idx):
            layer = past_key_values.cross_attention_cache.layers[self.layer_idx]
            return layer.keys, layer.values
        key, value = past_key_values.cross_attention_cache.update(*self.keys_values(states, index), self.layer_idx)
        past_key_values.is_updated[self.layer_idx] = True
        return key, value

    def forward(
        self,
        hidden_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        output_attentions: bool = False,
        padding: PaddingPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """hidden_states (B, T, D) are the queries; key_value_states (B, S, D) the encoder output for
        encoder-decoder attention, None for self-attention; `mask` additive (`additive_mask`). Returns
        (B, T, D) and the weights if asked."""
        is_cross = key_value_states is not None
        query_rows = key_rows = None
        if padding is not None:
            query_rows = padding.target if (is_cross or self.is_causal) else padding.source
            key_rows = padding.source if is_cross else query_rows
        batch, length, _ = hidden_states.shape
        query = at_positions(self.q_proj, hidden_states, query_rows)  # (B, T, h * d_k)
        states = key_value_states if is_cross else hidden_states
        key, value = self.cached_keys_values(states, is_cross, past_key_values, key_rows)
        query = query.view(batch, -1, self.num_heads, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

        # Attention weights exist only in the eager path; asking for them selects it for this call. So does
        # decoding: for a few queries against cached keys, two batched products and a softmax beat the SDPA
        # kernel, which is built for long query blocks.
        attend = scaled_dot_product_attention
        if not output_attentions and past_key_values is None:
            attend = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, scaled_dot_product_attention
            )
        dropout = self.attention_dropout if self.training else 0.0
        output, weights = attend(self, query, key, value, mask, scaling=self.scaling, dropout=dropout)
        output = output.reshape(batch, length, self.num_heads * self.d_v)  # Concat(head_1..head_h): (B, T, h*d_v)
        return at_positions(self.out_proj, output, query_rows), (weights if output_attentions else None)


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
        self.activation_dropout = Dropout(config.activation_dropout)  # 0 in the paper
        self.activation = torch.relu if config.activation_function == "relu" else nn.functional.silu

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w_2(
            self.activation_dropout(self.activation(self.w_1(hidden_states)))
        )  # (B, T, D) -> (B, T, F) -> (B, T, D)


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
        self.dropout = Dropout(config.dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        mask: torch.Tensor | None = None,
        output_attentions: bool = False,
        padding: PaddingPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, weights = self.self_attn(
            hidden_states, mask=mask, output_attentions=output_attentions, padding=padding
        )
        hidden_states = self.self_attn_norm(hidden_states + self.dropout(attended))
        fed = at_positions(self.feed_forward, hidden_states, padding.source if padding else None)
        hidden_states = self.feed_forward_norm(hidden_states + self.dropout(fed))
        return hidden_states, weights


class DecoderLayer(GradientCheckpointingLayer):
    """Masked self-attention, encoder-decoder attention, then the feed-forward network, each sub-layer
    wrapped as LayerNorm(x + Dropout(Sublayer(x))) (Section 3.1). The same `forward` runs whole target
    sequences in training and the new positions of each decoding step, with any cache."""

    def __init__(self, config: VaswaniConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MultiHeadAttention(config, is_causal=True, layer_idx=layer_idx)
        self.self_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.cross_attn = MultiHeadAttention(config, layer_idx=layer_idx)
        self.cross_attn_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.feed_forward = PositionwiseFeedForward(config, config.decoder_d_ff)
        self.feed_forward_norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.dropout = Dropout(config.dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        self_mask: torch.Tensor | None = None,
        cross_mask: torch.Tensor | None = None,
        past_key_values: EncoderDecoderCache | None = None,
        output_attentions: bool = False,
        padding: PaddingPlan | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        attended, self_weights = self.self_attn(
            hidden_states,
            mask=self_mask,
            past_key_values=past_key_values,
            output_attentions=output_attentions,
            padding=padding,
        )
        hidden_states = self.self_attn_norm(hidden_states + self.dropout(attended))
        attended, cross_weights = self.cross_attn(
            hidden_states,
            key_value_states=encoder_hidden_states,
            mask=cross_mask,
            past_key_values=past_key_values,
            output_attentions=output_attentions,
            padding=padding,
        )
        hidden_states = self.cross_attn_norm(hidden_states + self.dropout(attended))
        fed = at_positions(self.feed_forward, hidden_states, padding.target if padding else None)
        hidden_states = self.feed_forward_norm(hidden_states + self.dropout(fed))
        return hidden_states, self_weights, cross_weights


class Embeddings(nn.Module):
    """Token embeddings times sqrt(d_model), plus positional encodings, then dropout (Sections 3.4, 3.5, 5.4).

    The token table is the model's one shared matrix (passed in, not owned)."""

    def __init__(self, config: VaswaniConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_positions = positional_encoding(config)
        self.dropout = Dropout(config.dropout)

    def forward(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None = None, offset: int = 0):
        """Returns (embedding output before dropout, after dropout), both (B, length, D), for the positions
        offset, offset + 1, ... `inputs_embeds` replaces the table lookup and is scaled like it."""
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
        padding: PaddingPlan | None = None,
        **kwargs,
    ) -> BaseModelOutput | tuple:
        """`padding`: the forward's `PaddingPlan`; built here from `attention_mask` when the encoder runs alone."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Encoder: pass exactly one of input_ids and inputs_embeds.")
        source = input_ids if input_ids is not None else inputs_embeds
        if input_ids is not None:
            check_token_ids(input_ids, self.config.vocab_size, "input_ids")
        check_mask(attention_mask, source, "attention_mask", "input_ids")
        output_attentions = bool(output_attentions)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if padding is None:
            padding = PaddingPlan.build(self.config, source_mask=attention_mask)
        embedded, hidden_states = self.embeddings(input_ids, inputs_embeds)
        mask = additive_mask(attention_mask, source.shape[1], source.shape[1], causal=False, dtype=embedded.dtype)
        all_hidden = [embedded] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        for layer in self.layers:
            hidden_states, weights = layer(hidden_states, mask, output_attentions=output_attentions, padding=padding)
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
        padding: PaddingPlan | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPastAndCrossAttentions | tuple:
        """`padding`: the forward's `PaddingPlan`; built here from the masks when the decoder runs alone.
        Not used with a cache: decoding computes every position it is given. `past_key_values`: any cache
        with the interface of transformers' `EncoderDecoderCache` (see `MultiHeadAttention.cached_keys_values`)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Decoder: pass exactly one of decoder_input_ids and decoder_inputs_embeds.")
        if encoder_hidden_states is None:
            raise ValueError("Decoder: encoder_hidden_states are required (it attends to the encoder output).")
        target = input_ids if input_ids is not None else inputs_embeds
        if input_ids is not None:
            check_token_ids(input_ids, self.config.target_vocab_size, "decoder_input_ids")
        output_attentions = bool(output_attentions)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        return_dict = self.config.return_dict if return_dict is None else return_dict

        if use_cache and past_key_values is None:
            past_key_values = EncoderDecoderCache(DynamicCache(), DynamicCache())
        if past_key_values is not None and not hasattr(past_key_values, "cross_attention_cache"):
            raise TypeError(
                f"past_key_values must be an EncoderDecoderCache (self- and cross-attention), got {type(past_key_values).__name__}."
            )
        if not use_cache:
            past_key_values = None
        past_length = past_key_values.get_seq_length() if past_key_values is not None else 0
        length = target.shape[1]
        check_decoder_mask(attention_mask, length, past_length)
        if attention_mask is not None and attention_mask.shape[1] == length and past_length:  # over the cache too
            attention_mask = torch.cat(
                [attention_mask.new_ones(attention_mask.shape[0], past_length), attention_mask], 1
            )

        if past_key_values is not None:
            padding = None
        elif padding is None:
            padding = PaddingPlan.build(self.config, encoder_attention_mask, attention_mask, target_length=length)
        embedded, hidden_states = self.embeddings(input_ids, inputs_embeds, offset=past_length)
        self_mask = additive_mask(attention_mask, length, past_length + length, causal=True, dtype=embedded.dtype)
        source_length = encoder_hidden_states.shape[1]  # every target position may attend to every real source one
        cross_mask = additive_mask(encoder_attention_mask, 1, source_length, causal=False, dtype=embedded.dtype)
        all_hidden = [embedded] if output_hidden_states else None
        all_self, all_cross = ([], []) if output_attentions else (None, None)
        for layer in self.layers:
            hidden_states, self_weights, cross_weights = layer(
                hidden_states,
                encoder_hidden_states,
                self_mask,
                cross_mask,
                past_key_values=past_key_values,
                output_attentions=output_attentions,
                padding=padding,
            )
            if output_hidden_states:
                all_hidden.append(hidden_states)
            if output_attentions:
                all_self.append(self_weights)
                all_cross.append(cross_weights)
        output = BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden_states,
            **{CACHE_FIELD: past_key_values},
            hidden_states=tuple(all_hidden) if output_hidden_states else None,
            attentions=tuple(all_self) if output_attentions else None,
            cross_attentions=tuple(all_cross) if output_attentions else None,
        )
        return output if return_dict else output.to_tuple()


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

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, refusing weights that do not fit the config with an error that
        names the config fields (`errors.load_fitting_weights`). Nothing but the config and weights is read."""
        return load_fitting_weights(super().from_pretrained, *args, **kwargs)


class VaswaniModel(VaswaniPreTrainedModel):
    """Encoder and decoder around one embedding matrix shared by source and target (Section 3.4). With
    `share_encoder_decoder_embeddings=False` (converted FSMT, some OPUS-MT) the decoder owns the target's."""

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
        # Source and target share one matrix whatever `tie_word_embeddings` says (that is the projection's flag).
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
        padding: PaddingPlan | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> Seq2SeqModelOutput | tuple:
        """`padding`: the `PaddingPlan` of VaswaniForConditionalGeneration's forward, which knows the labels;
        without one, the encoder and the decoder each plan from their masks. `cache` is `past_key_values` under
        the name transformers uses from 5.24 on."""
        past_key_values = decoding_cache(past_key_values, cache)
        if decoder_input_ids is None and decoder_inputs_embeds is None:
            start = self.config.decoder_start_token_id
            raise ValueError(f"Pass decoder_input_ids (the target shifted right, starting with {start}), or labels.")
        return_dict = self.config.return_dict if return_dict is None else return_dict
        output_hidden_states = output_hidden_states or (
            output_hidden_states is None and self.config.output_hidden_states
        )
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids,
                attention_mask=attention_mask,
                inputs_embeds=inputs_embeds,
                output_attentions=output_attentions,
                output_hidden_states=output_hidden_states,
                return_dict=True,
                padding=padding,
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
            padding=padding,
        )
        output = Seq2SeqModelOutput(
            last_hidden_state=decoder_outputs.last_hidden_state,
            **{CACHE_FIELD: getattr(decoder_outputs, CACHE_FIELD)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


class VaswaniForConditionalGeneration(VaswaniPreTrainedModel, VaswaniGenerationMixin):
    """The Transformer with its pre-softmax linear projection, which shares its weight with both
    embeddings (Section 3.4), a cross-entropy loss over `labels` (-100 ignored; the Trainer adds the
    label smoothing of Section 5.4) and the decoding defaults of Section 6.1 in `generation_config`
    (generation_vaswani.py)."""

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
        """`PreTrainedModel.save_pretrained`, declaring the translation pipeline in config.json (`custom_pipelines`)."""
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
        cache: Cache | None = None,
        epsilon_ls: float = 0.0,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> Seq2SeqLMOutput | tuple:
        """The Transformer's output distribution for each target position (logits (B, T, V)), and with `labels`
        the cross-entropy loss. `cache` is `past_key_values` under the name transformers uses from 5.24 on.

        The loss is over the labelled positions (-100 ignored), against targets smoothed by `epsilon_ls`
        (Section 5.4's label smoothing, spread over the whole vocabulary; 0 is plain cross-entropy; not named
        `label_smoothing`: transformers takes every forward argument with "label" in its name for a label
        column), their mean, or
        with `num_items_in_batch` (the Trainer's count of labelled tokens in the whole optimizer step) their sum
        divided by it. `VaswaniTrainer` trains through this loss: computed from the logits of labelled positions
        only, it never builds the (B, T, V) tensor's softmax and gradient."""
        past_key_values = decoding_cache(past_key_values, cache)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        if input_ids is not None and attention_mask is None and self.config.pad_token_id is not None:
            attention_mask = input_ids.ne(self.config.pad_token_id).long()
        padding = None
        if labels is not None:  # training: whole targets, no cache, only the positions that can matter
            check_token_ids(labels[labels.ne(-100)], self.config.target_vocab_size, "labels")
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self.prepare_decoder_input_ids_from_labels(labels)
            target = decoder_input_ids if decoder_input_ids is not None else decoder_inputs_embeds
            padding = PaddingPlan.build(
                self.config, attention_mask, decoder_attention_mask, labels, target_length=target.shape[1]
            )
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
            padding=padding,
        )
        logits, loss = self.logits_and_loss(outputs.last_hidden_state, labels, padding, epsilon_ls, num_items_in_batch)
        carried = {name: value for name, value in outputs.items() if name != "last_hidden_state"}  # cache, weights...
        output = Seq2SeqLMOutput(loss=loss, logits=logits, **carried)
        return output if return_dict else output.to_tuple()

    def logits_and_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor | None,
        padding: PaddingPlan | None,
        epsilon_ls: float = 0.0,
        num_items_in_batch: int | torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) of the decoder output (B, T, D), and the (label-smoothed) cross-entropy over labels
        (-100 ignored): their mean, or their sum over `num_items_in_batch` (see `forward`)."""
        labelled = padding.labelled if padding is not None else None
        if labelled is None:
            logits = picked = self.project(hidden)  # (B, T, V)
            picked_labels = labels
        else:  # the projection, the largest product of all, only at labelled positions; zero logits elsewhere
            batch, length, _ = hidden.shape
            picked = self.project(hidden.reshape(batch * length, -1).index_select(0, labelled))  # (N, V)
            logits = scatter_positions(picked, labelled, batch, length)  # the loss below needs `picked` itself
            picked_labels = labels.reshape(-1).index_select(0, labelled)
        if labels is None:
            return logits, None
        if not 0.0 <= epsilon_ls < 1.0:
            raise UserInputError(f"epsilon_ls (label smoothing) must be in [0, 1), got {epsilon_ls}")
        # torch's smoothing is the paper's reference [36]'s: (1 - eps) * one-hot + eps / V over every class.
        loss = nn.functional.cross_entropy(
            picked.float().reshape(-1, picked.shape[-1]),
            picked_labels.to(picked.device).reshape(-1),
            ignore_index=-100,
            label_smoothing=epsilon_ls,
            reduction="mean" if num_items_in_batch is None else "sum",
        )
        if num_items_in_batch is not None:
            loss = loss / (
                num_items_in_batch.to(loss.device) if torch.is_tensor(num_items_in_batch) else num_items_in_batch
            )
        return logits, loss

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The pre-softmax linear transformation (Section 3.4), plus Marian's fixed bias where configured."""
        logits = self.lm_head(hidden)
        return logits + self.final_logits_bias if self.config.final_logits_bias else logits

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The target "offset by one position" (Section 3.1): the start token, then labels[:-1] (-100 as pad)."""
        return shift_tokens_right(labels, self.config.pad_token_id, self.config.decoder_start_token_id)


# the package's copy registers its classes; transformers registers a saved folder's copy itself
if __name__ == "vaswani_tx.model.modeling_vaswani":
    for auto, model_class in ((AutoModel, VaswaniModel), (AutoModelForSeq2SeqLM, VaswaniForConditionalGeneration)):
        auto.register(VaswaniConfig, model_class, exist_ok=True)
        model_class.register_for_auto_class(auto.__name__)

__all__ = [
    "MultiHeadAttention",
    "SinusoidalPositionalEncoding",
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "fairseq_sinusoidal_table",
    "sinusoidal_table",
]
