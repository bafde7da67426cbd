"""Export a saved model to CTranslate2, for serving on CPU (optional extra ``ct2``: ``pip install vaswani_tx[ct2]``).

    vaswani-tx export-ct2 MODEL_DIR OUT_DIR [--quantization int8]

The CTranslate2 model spec is built directly from our weights; nothing goes through another
library's converter. How each part of Section 3 maps onto CTranslate2's Transformer:

- post-LN layers (``pre_norm=False``), no LayerNorm after either stack, ReLU feed-forward (3.1, 3.3);
- Q, K, V of self-attention fused into one projection, K and V of encoder-decoder attention into
  another (CTranslate2's layout; the maths is the same matrices side by side);
- the paper's interleaved sin/cos positions (3.5), or the learned table of Table 3 row (E), passed
  as an explicit position table of ``max_position_embeddings`` rows: CTranslate2 cannot extend
  positions on demand, so that is the longest sequence the export translates;
- embeddings multiplied by sqrt(d_model) (3.4), one matrix shared by both embeddings and, unless
  untied, the pre-softmax projection; LayerNorm epsilon from the config;
- the vocabulary is the saved tokenizer's, in id order; ``</s>`` ends the source as our tokenizer
  writes it, and decoding starts from ``<s>`` (the config's ``decoder_start_token_id``).

CTranslate2 has no place in its model for decoding settings, so the paper's (Section 6.1) are written
next to the model in ``vaswani_decoding.json`` as CTranslate2 ``translate_batch`` options
(:func:`ct2_decoding_options` reads them): beam 4 and length penalty 0.6. Two parts of Section 6.1
have no CTranslate2 equivalent: its length penalty is transformers' ``|Y|^alpha``, not the GNMT form
``((5 + |Y|) / 6)^alpha``, and its output limit is one ``max_decoding_length`` for the batch, not each
source's length + 50 (the file stores the offset; the options set the limit from the longest source).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DECODING_FILE = "vaswani_decoding.json"
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "bfloat16", "int8_float16", "int8_bfloat16")


def _require_ctranslate2():
    try:
        import ctranslate2
    except ImportError as error:  # pragma: no cover - exercised only without the extra
        raise ImportError("CTranslate2 export needs the optional extra: pip install 'vaswani_tx[ct2]'") from error
    return ctranslate2


def build_ct2_spec(model, tokens: Sequence[str], unk_token: str = "<unk>"):
    """A ``ctranslate2.specs.TransformerSpec`` holding `model`'s weights (a `VaswaniForConditionalGeneration`);
    `tokens` is the vocabulary in id order."""
    _require_ctranslate2()
    from ctranslate2.specs import common_spec, transformer_spec

    config = model.config
    if config.d_k * config.num_heads != config.d_model or config.d_v != config.d_k:
        raise ValueError(
            f"CTranslate2 needs d_k = d_v = d_model / num_heads; this model has d_k={config.d_k}, d_v={config.d_v}, "
            f"d_model={config.d_model}, num_heads={config.num_heads}."
        )
    if len(tokens) != config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens but the model's vocab_size is {config.vocab_size}.")
    spec = transformer_spec.TransformerSpec.from_config(
        (config.num_encoder_layers, config.num_decoder_layers),
        config.num_heads,
        pre_norm=False,
        activation=common_spec.Activation.RELU,
    )
    encoder, decoder = model.model.encoder, model.model.decoder
    positions = _position_table(model)
    for stack_spec, stack in ((spec.encoder, encoder), (spec.decoder, decoder)):
        stack_spec.scale_embeddings = stack.embeddings.embed_scale
        stack_spec.position_encodings.encodings = positions
    spec.encoder.embeddings[0].weight = model.model.shared.weight
    spec.decoder.embeddings.weight = model.model.shared.weight
    _set_linear(spec.decoder.projection, model.lm_head)

    for layer_spec, layer in zip(spec.encoder.layer, encoder.layers):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_norm, self_attention=True)
        _set_feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_norm)
    for layer_spec, layer in zip(spec.decoder.layer, decoder.layers):
        _set_attention(layer_spec.self_attention, layer.self_attn, layer.self_attn_norm, self_attention=True)
        _set_attention(layer_spec.attention, layer.cross_attn, layer.cross_attn_norm, self_attention=False)
        _set_feed_forward(layer_spec.ffn, layer.feed_forward, layer.feed_forward_norm)

    spec.register_source_vocabulary(list(tokens))
    spec.register_target_vocabulary(list(tokens))
    spec.config.unk_token = unk_token
    spec.config.bos_token = tokens[config.bos_token_id]
    spec.config.eos_token = tokens[config.eos_token_id]
    spec.config.decoder_start_token = tokens[config.decoder_start_token_id]
    spec.config.add_source_bos = False
    spec.config.add_source_eos = False  # our tokenizer already ends every source with </s>
    spec.config.layer_norm_epsilon = config.layer_norm_eps
    return spec


def _position_table(model):
    from .modeling_vaswani import LearnedPositionalEmbedding, sinusoidal_table

    positions = model.model.encoder.embeddings.embed_positions
    if isinstance(positions, LearnedPositionalEmbedding):
        return positions.weight
    return sinusoidal_table(model.config.max_position_embeddings, model.config.d_model)


def _set_linear(spec, linear, weight=None, bias=None) -> None:
    spec.weight = linear.weight if weight is None else weight
    bias = linear.bias if bias is None else bias
    if bias is not None:
        spec.bias = bias


def _cat_bias(linears):
    """Concatenated biases of fused projections, zeros where one has none; None if none has one."""
    import torch

    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat(
        [
            linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.out_features)
            for linear in linears
        ]
    )


def _set_attention(spec, attention, norm, self_attention: bool) -> None:
    import torch

    if self_attention:
        fused = [attention.q_proj, attention.k_proj, attention.v_proj]
        _set_linear(spec.linear[0], fused[0], torch.cat([p.weight for p in fused]), _cat_bias(fused))
    else:
        _set_linear(spec.linear[0], attention.q_proj)
        fused = [attention.k_proj, attention.v_proj]
        _set_linear(spec.linear[1], fused[0], torch.cat([p.weight for p in fused]), _cat_bias(fused))
    _set_linear(spec.linear[-1], attention.out_proj)
    spec.layer_norm.gamma, spec.layer_norm.beta = norm.weight, norm.bias


def _set_feed_forward(spec, feed_forward, norm) -> None:
    _set_linear(spec.linear_0, feed_forward.w_1)
    _set_linear(spec.linear_1, feed_forward.w_2)
    spec.layer_norm.gamma, spec.layer_norm.beta = norm.weight, norm.bias


def export_ct2(
    model_dir: str | os.PathLike, out_dir: str | os.PathLike, quantization: str | None = None, force: bool = False
) -> Path:
    """Convert the saved model folder `model_dir` (weights, config and tokenizer) into a CTranslate2
    model folder `out_dir`; `quantization` (e.g. "int8") is CTranslate2's weight quantization."""
    import torch

    from .modeling_vaswani import VaswaniForConditionalGeneration
    from .tokenization import check_tokenizer_fits_model, load_tokenizer
    from .translation import check_model_folder

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization={quantization!r} is not allowed; choose one of {', '.join(QUANTIZATIONS)}.")
    check_model_folder(model_dir)  # a MarianMT or FSMT folder is refused, naming `vaswani-tx convert`
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass force=True (--force) to overwrite it.")
    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError:
        raise
    except Exception as err:  # the tokenizers library raises a bare Exception for a garbage tokenizer.json
        raise ValueError(f"{model_dir} holds no tokenizer that AutoTokenizer can load ({err})") from None
    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).float().eval()
    try:
        check_tokenizer_fits_model(tokenizer, model.config)
    except ValueError as err:
        raise ValueError(f"{model_dir}: {err}") from None
    tokens = tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size)))
    with torch.no_grad():
        spec = build_ct2_spec(model, tokens, unk_token=tokenizer.unk_token or "<unk>")
        spec.validate()
        spec.optimize(quantization=quantization)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    generation = model.generation_config
    decoding = {
        "beam_size": generation.num_beams,
        "length_penalty": float(generation.length_penalty),
        "max_output_length_offset": getattr(generation, "max_output_length_offset", None),
        "note": "Section 6.1 decoding as CTranslate2 translate_batch options; CTranslate2's length penalty is "
        "|Y|^alpha, not the paper's GNMT form; ct2_decoding_options sets max_decoding_length from the longest source.",
    }
    (out_dir / DECODING_FILE).write_text(json.dumps(decoding, indent=2) + "\n")
    return out_dir


def ct2_decoding_options(ct2_dir: str | os.PathLike, sources: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """`translate_batch` keyword arguments for the paper's decoding, read from an export's vaswani_decoding.json;
    with `sources` (token lists), `max_decoding_length` is the longest source + the offset."""
    saved = json.loads((Path(ct2_dir) / DECODING_FILE).read_text())
    options = {"beam_size": saved["beam_size"], "length_penalty": saved["length_penalty"]}
    if sources is not None and saved.get("max_output_length_offset") is not None:
        options["max_decoding_length"] = max(len(s) for s in sources) + int(saved["max_output_length_offset"])
    return options
