"""The decoder's computation for decoding, one new position a step (Sections 3.1-3.4), in one precision.

The model defines the maths; this file computes the same maths with what decoding allows and training does not:
- the self-attention keys and values of the positions decoded so far grow by one position a step, and beam
  search's reordering of the rows is applied in that same copy (`KeysValues`);
- the encoder-decoder keys and values are computed once per source, not once per beam, and the beams of a source
  attend to them as one block of queries;
- the products are those of one precision (`Products`): the model's own tensors (float32 or bfloat16, as the
  model is), or int8 weights quantized per output channel (torch's dynamic quantized linear, fbgemm's kernels on
  x86). The int8 copies belong to the engine; the model is never changed.

Every operation is the model's own in float32 (the same products, the attention's float32 softmax, LayerNorm), so
a float32 step gives the logits of the model's decoder `forward` with a cache: search.py's loops then make
transformers' choices from them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

Product = Callable[[torch.Tensor], torch.Tensor]
COMPUTE_TYPES = ("float32", "bfloat16", "int8")


class Products:
    """The linear maps x W^T + b of one precision (`compute_type`), made once per engine from the model's layers:
    the model's own tensors for float32 and bfloat16 (the model has that dtype: `Translator` sees to it), an int8
    copy for int8."""

    def __init__(self, compute_type: str):
        self.compute_type = compute_type

    def __call__(self, layer: nn.Linear) -> Product:
        if self.compute_type == "int8":
            return int8_product(layer)
        weight, bias = layer.weight.detach(), None if layer.bias is None else layer.bias.detach()
        return lambda x: F.linear(x, weight, bias)


def int8_product(layer: nn.Linear) -> Int8Linear:
    """An int8 copy of `layer`: weights quantized symmetrically per output row (one scale a row, as CTranslate2's
    int8), activations quantized per call by the kernel (dynamic quantization), float32 bias and output."""
    weight = layer.weight.detach().float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    zeros = torch.zeros(weight.shape[0], dtype=torch.long)
    quantized = torch.quantize_per_channel(weight, scales, zeros, 0, torch.qint8)
    product = Int8Linear(weight.shape[1], weight.shape[0], bias_=layer.bias is not None, dtype=torch.qint8)
    product.set_weight_bias(quantized, None if layer.bias is None else layer.bias.detach().float())
    return product


class Attention:
    """Multi-head attention's projections (Section 3.2.2) as products of one precision."""

    def __init__(self, module: nn.Module, products: Products):
        self.heads, self.d_k, self.d_v, self.scaling = module.num_heads, module.d_k, module.d_v, module.scaling
        self.q, self.k, self.v, self.out = (
            products(getattr(module, name)) for name in ("q_proj", "k_proj", "v_proj", "out_proj")
        )

    def split(self, x: torch.Tensor, d: int) -> torch.Tensor:
        """(B, L, h * d) -> (B, h, L, d)."""
        return x.view(x.shape[0], -1, self.heads, d).transpose(1, 2)


class Norm:
    def __init__(self, module: nn.LayerNorm):
        self.shape, self.eps = module.normalized_shape, module.eps
        self.weight, self.bias = module.weight.detach(), module.bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.shape, self.weight, self.bias, self.eps)


class Layer:
    """One decoder layer (Section 3.1): masked self-attention, encoder-decoder attention, feed-forward, each
    LayerNorm(x + Sublayer(x)) (post-LN)."""

    def __init__(self, layer: nn.Module, products: Products):
        self.self_attn, self.cross_attn = Attention(layer.self_attn, products), Attention(layer.cross_attn, products)
        self.self_norm, self.cross_norm = Norm(layer.self_attn_norm), Norm(layer.cross_attn_norm)
        self.w_1, self.w_2 = products(layer.feed_forward.w_1), products(layer.feed_forward.w_2)
        self.activation = layer.feed_forward.activation  # ReLU (Equation 2), or a converted model's swish
        self.ffn_norm = Norm(layer.feed_forward_norm)


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, mask) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d_k) + mask) V (Equation 1) as the model's eager attention computes it."""
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype), value)


class KeysValues:
    """A layer's self-attention keys and values for every row, (rows, h, positions, d), one position longer each
    step. Beam search's reordering of the rows (`select`) is kept as an order and applied when the next position
    is added, in the same copy: one gather of the written positions a step, whatever the rows did in between."""

    def __init__(self):
        self.keys = self.values = self.order = None

    def select(self, rows: torch.Tensor) -> None:
        """Row i now continues row rows[i]."""
        self.order = rows if self.order is None else self.order[rows]

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new position's keys and values (rows, h, 1, d); returns all of them."""
        if self.keys is not None:
            old_keys, old_values = self.keys, self.values
            if self.order is not None:
                old_keys, old_values = old_keys.index_select(0, self.order), old_values.index_select(0, self.order)
            keys, values = torch.cat((old_keys, keys), dim=2), torch.cat((old_values, values), dim=2)
        self.keys, self.values, self.order = keys, values, None
        return keys, values


class DecoderStep:
    """The decoder of `model` as a step over one new position, its products made once: `start` a call from the
    encoder output, then call that call's `Decoding` with the tokens of each position. The step holds no call's
    state, so threads may share it."""

    def __init__(self, model: nn.Module, compute_type: str = "float32"):
        if compute_type not in COMPUTE_TYPES:
            raise ValueError(f"compute_type {compute_type!r}: choose one of {', '.join(COMPUTE_TYPES)}")
        self.dtype = next(model.parameters()).dtype  # the step computes in the model's dtype (int8: float32 around)
        if self.dtype != {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}[compute_type]:
            raise ValueError(f"a {compute_type} step needs a model in that dtype (float32 for int8), not {self.dtype}")
        products = self.products = Products(compute_type)
        decoder = model.get_decoder()
        self.embeddings = decoder.embeddings  # the token table x sqrt(d_model) plus positions (Sections 3.4-3.5)
        self.layers = [Layer(layer, products) for layer in decoder.layers]
        self.project = products(model.get_output_embeddings())  # the pre-softmax projection (Section 3.4)
        bias = getattr(model, "final_logits_bias", None) if model.config.final_logits_bias else None
        self.logits_bias = None if bias is None else bias.detach().float()

    def start(self, memory: torch.Tensor, source_mask: torch.Tensor | None, rows: int) -> Decoding:
        """A call's state: `memory` (sources, S, D) the encoder output, `source_mask` (sources, S) 1 for real
        tokens, `rows` = sources x beams."""
        return Decoding(self, memory, source_mask, rows)


class Decoding:
    """One call's decoding state over a `DecoderStep`: the encoder-decoder keys and values of each source, the
    sources' mask, and each layer's self-attention keys and values."""

    def __init__(self, step: DecoderStep, memory: torch.Tensor, source_mask: torch.Tensor | None, rows: int):
        self.step, self.beams = step, rows // memory.shape[0]
        self.cross = [
            (attention.split(attention.k(memory), attention.d_k), attention.split(attention.v(memory), attention.d_v))
            for attention in (layer.cross_attn for layer in step.layers)
        ]
        self.source_mask = None
        if source_mask is not None and not bool(source_mask.all()):  # additive, as the model's: the dtype's minimum
            allowed = source_mask[:, None, None, :].bool()
            self.source_mask = torch.zeros(allowed.shape, dtype=step.dtype, device=memory.device).masked_fill(
                ~allowed, torch.finfo(step.dtype).min
            )
        self.cache = [KeysValues() for _ in step.layers]

    def keep_sources(self, sources: torch.Tensor) -> None:
        """Only these sources go on (the others are done): their encoder-decoder keys and values, mask and rows."""
        self.cross = [(keys[sources], values[sources]) for keys, values in self.cross]
        if self.source_mask is not None:
            self.source_mask = self.source_mask[sources]
        rows = (sources[:, None] * self.beams + torch.arange(self.beams, device=sources.device)).reshape(-1)
        self.reorder(rows)

    def reorder(self, rows: torch.Tensor) -> None:
        for cache in self.cache:
            cache.select(rows)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """The logits (rows, V), in float32, of the next position after `tokens` (rows,) at `position`."""
        step, rows = self.step, tokens.shape[0]
        hidden = step.embeddings(tokens[:, None], offset=position)[0]  # (rows, 1, D)
        groups = self.cross[0][0].shape[0] if self.cross else rows
        for layer, cache, (cross_keys, cross_values) in zip(step.layers, self.cache, self.cross):
            attention = layer.self_attn
            keys, values = cache.add(
                attention.split(attention.k(hidden), attention.d_k),
                attention.split(attention.v(hidden), attention.d_v),
            )
            query = attention.split(attention.q(hidden), attention.d_k)
            out = attend(query, keys, values, attention.scaling, None).transpose(1, 2).reshape(rows, 1, -1)
            hidden = layer.self_norm(hidden + attention.out(out))
            attention = layer.cross_attn  # a source's beams as one block of queries against its keys
            query = attention.q(hidden).view(groups, -1, attention.heads, attention.d_k).transpose(1, 2)
            out = attend(query, cross_keys, cross_values, attention.scaling, self.source_mask)
            hidden = layer.cross_norm(hidden + attention.out(out.transpose(1, 2).reshape(rows, 1, -1)))
            hidden = layer.ffn_norm(hidden + layer.w_2(layer.activation(layer.w_1(hidden))))
        logits = step.project(hidden[:, 0]).float()
        return logits if step.logits_bias is None else logits + step.logits_bias
