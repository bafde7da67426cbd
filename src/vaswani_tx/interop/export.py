"""Exports of a saved model to other runtimes: CTranslate2, for serving on CPU (optional extra ``ct2``:
``pip install vaswani_tx[ct2]``), and MarianMT, for tools that read Marian.

    vaswani-tx export-ct2 MODEL_DIR OUT_DIR [--quantization int8]
    vaswani-tx export-marian MODEL_DIR OUT_DIR

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

CTranslate2 has no place in its model for decoding settings, so the model's own (its generation config's:
Section 6.1's beam 4 and length penalty 0.6 unless its run config chose others) are written next to the model in
``vaswani_decoding.json`` as CTranslate2 ``translate_batch`` options (:func:`ct2_decoding_options` reads them).
Two parts of Section 6.1 have no CTranslate2 equivalent: its length penalty is transformers' ``|Y|^alpha``, not
the GNMT form ``((5 + |Y|) / 6)^alpha``, and its output limit is one ``max_decoding_length`` for the batch, not
each source's length + 50 (the file stores the offset; the options set the limit from the longest source).

:func:`export_marian` writes a MarianMTModel folder with our logits: the hidden dimension permuted to Marian's
sin-half/cos-half layout by the mapping ``vaswani_tx.interop.convert`` reads Marian with, so the two directions cannot
drift apart. Its generation_config.json carries beam size, alpha and early stopping, and records the length
penalty's form and the source-length offset as two fields of ours (``length_penalty_type``,
``max_output_length_offset``): MarianMTModel's ``generate()`` ignores them and applies transformers' ``|Y|^alpha``
with one ``max_length`` (the export warns when the model decodes otherwise), and ``vaswani-tx convert`` reads
them back, so a model exported and converted back decodes as it did (GNMT stays GNMT).

Nothing is imported at module level beyond the standard library: ``vaswani-tx export-ct2 --help`` lists
:data:`QUANTIZATIONS` without loading torch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vaswani_tx.atomic import atomic_folder
from vaswani_tx.folders import refuse_to_overwrite
from vaswani_tx.model.errors import UserInputError

if TYPE_CHECKING:
    from transformers import MarianMTModel

    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration

logger = logging.getLogger(__name__)

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
        raise UserInputError(
            f"CTranslate2 needs d_k = d_v = d_model / num_heads; this model has d_k={config.d_k}, d_v={config.d_v}, "
            f"d_model={config.d_model}, num_heads={config.num_heads}."
        )
    if len(tokens) != config.vocab_size:
        raise UserInputError(
            f"the tokenizer has {len(tokens)} tokens but the model's vocab_size is {config.vocab_size}."
        )
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
    from vaswani_tx.model.modeling_vaswani import LearnedPositionalEmbedding, sinusoidal_table

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
    model folder `out_dir`; `quantization` (e.g. "int8") is CTranslate2's weight quantization.

    A non-empty `out_dir` is refused unless `force`; the export is written beside it and takes its place whole
    once complete, so a failed or interrupted export leaves what `out_dir` held before."""
    import torch

    from vaswani_tx.data.tokenization import check_tokenizer_fits_model, load_tokenizer
    from vaswani_tx.engine.settings import as_generate_reads
    from vaswani_tx.engine.translation import check_model_folder
    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise UserInputError(
            f"quantization={quantization!r} is not allowed; choose one of {', '.join(QUANTIZATIONS)}."
        )
    check_model_folder(model_dir)  # a MarianMT or FSMT folder is refused, naming `vaswani-tx convert`
    refuse_to_overwrite(out_dir, force, inputs=[model_dir])
    try:
        tokenizer = load_tokenizer(model_dir)
    except FileNotFoundError:
        raise
    except Exception as err:  # the tokenizers library raises a bare Exception for a garbage tokenizer.json
        raise UserInputError(f"{model_dir} holds no tokenizer that AutoTokenizer can load ({err})") from None
    model = VaswaniForConditionalGeneration.from_pretrained(model_dir).float().eval()
    try:
        check_tokenizer_fits_model(tokenizer, model.config)
    except UserInputError as err:
        raise UserInputError(f"{model_dir}: {err}") from None
    tokens = tokenizer.convert_ids_to_tokens(list(range(model.config.vocab_size)))
    with torch.no_grad():
        spec = build_ct2_spec(model, tokens, unk_token=tokenizer.unk_token or "<unk>")
        spec.validate()
        spec.optimize(quantization=quantization)
    generation = as_generate_reads(model.generation_config)
    decoding = {
        "beam_size": generation.num_beams,
        "length_penalty": float(generation.length_penalty),
        "max_output_length_offset": getattr(generation, "max_output_length_offset", None),
        "note": "Section 6.1 decoding as CTranslate2 translate_batch options; CTranslate2's length penalty is "
        "|Y|^alpha, not the paper's GNMT form; ct2_decoding_options sets max_decoding_length from the longest source.",
    }
    with atomic_folder(out_dir) as partial:  # an interrupted export leaves the earlier one (or none) whole
        spec.save(str(partial))
        (partial / DECODING_FILE).write_text(json.dumps(decoding, indent=2) + "\n")
    return out_dir


def ct2_decoding_options(ct2_dir: str | os.PathLike, sources: Sequence[Sequence[str]] | None = None) -> dict[str, Any]:
    """`translate_batch` keyword arguments for the paper's decoding, read from an export's vaswani_decoding.json;
    with `sources` (token lists), `max_decoding_length` is the longest source + the offset."""
    saved = json.loads((Path(ct2_dir) / DECODING_FILE).read_text())
    options = {"beam_size": saved["beam_size"], "length_penalty": saved["length_penalty"]}
    if sources is not None and saved.get("max_output_length_offset") is not None:
        options["max_decoding_length"] = max(len(s) for s in sources) + int(saved["max_output_length_offset"])
    return options


# ---------------------------------------------------------------------------------------------------
# Ours -> Marian
# ---------------------------------------------------------------------------------------------------


def vaswani_to_marian(model: VaswaniForConditionalGeneration) -> MarianMTModel:
    """One of ours as a MarianMTModel with the same logits (the hidden dimension permuted to Marian's layout).

    Refused, naming the field: learned or fairseq positions, d_k or d_v times h other than d_model,
    a LayerNorm epsilon other than 1e-5 (Marian's are fixed)."""
    import torch
    from transformers import MarianConfig, MarianMTModel

    from .convert import ConversionError, layer_tensor_map, marian_hidden_permutation, permute_hidden

    c = model.config
    if c.position_encoding != "sinusoidal":
        raise ConversionError(
            f"position_encoding={c.position_encoding!r} cannot be exported: Marian has the paper's sinusoids only."
        )
    for name in ("d_k", "d_v"):
        if getattr(c, name) * c.num_heads != c.d_model:
            raise ConversionError(
                f"{name}={getattr(c, name)} with num_heads={c.num_heads} cannot be exported: "
                f"Marian's heads are d_model / num_heads = {c.d_model / c.num_heads:g} wide."
            )
    if c.layer_norm_eps != 1e-5:
        raise ConversionError(f"layer_norm_eps={c.layer_norm_eps} cannot be exported: Marian's LayerNorms use 1e-5.")
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=c.vocab_size,
            decoder_vocab_size=c.target_vocab_size,
            d_model=c.d_model,
            encoder_layers=c.num_encoder_layers,
            decoder_layers=c.num_decoder_layers,
            encoder_attention_heads=c.num_heads,
            decoder_attention_heads=c.num_heads,
            encoder_ffn_dim=c.d_ff,
            decoder_ffn_dim=c.decoder_d_ff or c.d_ff,
            activation_function=c.activation_function,
            scale_embedding=c.scale_embedding,
            dropout=c.dropout,
            attention_dropout=c.attention_dropout,
            activation_dropout=c.activation_dropout,
            pad_token_id=c.pad_token_id,
            eos_token_id=c.eos_token_id,
            bos_token_id=c.bos_token_id,
            forced_eos_token_id=None,
            decoder_start_token_id=c.decoder_start_token_id,
            max_position_embeddings=c.max_position_embeddings,
            share_encoder_decoder_embeddings=c.share_encoder_decoder_embeddings,
            tie_word_embeddings=c.tie_word_embeddings,
        )
    ).eval()
    perm = marian_hidden_permutation(c.d_model)
    ours = model.state_dict()
    theirs = {
        f"model.{their_key}": permute_hidden(ours[our_key], kind, perm)
        for our_key, their_key, kind in layer_tensor_map(c)
    }
    if not c.attention_bias:  # Marian's projections always have biases: zeros change nothing
        for key, value in marian.state_dict().items():
            if re.search(r"attn\.(q|k|v|out)_proj\.bias$", key):
                theirs[key] = torch.zeros_like(value)
    source = permute_hidden(ours["model.shared.weight"], "reads", perm)
    target = permute_hidden(ours["model.decoder.embeddings.embed_tokens.weight"], "reads", perm)
    theirs.update(
        {
            "model.encoder.embed_tokens.weight": source,
            "model.decoder.embed_tokens.weight": target,
            "lm_head.weight": permute_hidden(ours["lm_head.weight"], "reads", perm),
            "final_logits_bias": ours["final_logits_bias"]
            if c.final_logits_bias
            else torch.zeros(1, c.target_vocab_size),
        }
    )
    if c.share_encoder_decoder_embeddings:
        theirs["model.shared.weight"] = source
    missing, unexpected = marian.load_state_dict(theirs, strict=False)
    missing = [key for key in missing if not key.endswith("embed_positions.weight")]  # Marian's own sinusoids
    if missing or unexpected:
        raise ConversionError(f"internal mapping mismatch: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        marian.tie_weights()
    return marian


def export_marian(model: str | os.PathLike | VaswaniForConditionalGeneration, out: str | os.PathLike) -> Path:
    """Write one of ours (a model folder or object) as a MarianMTModel folder at `out`, with its tokenizer when
    `model` is a folder, built beside `out` and put in its place whole (what `out` held is gone; an interrupted
    export leaves it as it was). Decoding settings that Marian's config can hold carry over (beam size, alpha, early
    stopping); the length penalty's form and the source-length offset are recorded for `vaswani-tx convert`
    (``length_penalty_type``, ``max_output_length_offset``), which MarianMTModel ignores: it applies transformers'
    ``|Y|^alpha``, and a warning says so when the model decodes with the GNMT form or the offset."""
    from transformers import AutoTokenizer, GenerationConfig

    from vaswani_tx.engine.settings import as_generate_reads
    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration
    from vaswani_tx.model.vocabulary import check_tokenizer_fits_model

    from .convert import ConversionError

    folder = None
    if not isinstance(model, VaswaniForConditionalGeneration):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ConversionError(f"{folder}: not a model folder (no config.json)")
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
        if model_type != "vaswani":
            raise ConversionError(
                f"{folder / 'config.json'}: model_type={model_type!r}; export-marian reads vaswani_tx models"
            )
        model = VaswaniForConditionalGeneration.from_pretrained(folder)
    marian = vaswani_to_marian(model.eval())
    ours = as_generate_reads(model.generation_config)
    penalty_type = getattr(ours, "length_penalty_type", "hf")
    offset = getattr(ours, "max_output_length_offset", None)
    if penalty_type == "gnmt" or offset is not None:
        logger.warning(
            "MarianMTModel decodes otherwise than this model: its generate() divides scores by transformers' length "
            "penalty |Y|^%s, not the GNMT ((5 + |Y|) / 6)^%s this model uses, and stops at one max_length (%d) "
            "rather than each source's length + %s tokens, so its translations can differ. generation_config.json "
            "records both settings (length_penalty_type, max_output_length_offset), and `vaswani-tx convert` reads "
            "them back.",
            float(ours.length_penalty),
            float(ours.length_penalty),
            model.config.max_position_embeddings,
            offset,
        )
    marian.generation_config = GenerationConfig(
        num_beams=ours.num_beams,
        length_penalty=float(ours.length_penalty),
        length_penalty_type=penalty_type,  # ours; MarianMT ignores it, `vaswani-tx convert` reads it back
        max_output_length_offset=offset,
        early_stopping=ours.early_stopping,
        max_length=model.config.max_position_embeddings,
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
        decoder_start_token_id=model.config.decoder_start_token_id,
    )
    tokenizer = None
    if folder is not None and any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
        try:
            check_tokenizer_fits_model(tokenizer, model.config)  # the one check wherever a tokenizer meets a model
        except UserInputError as err:
            raise UserInputError(f"{folder}: {err}") from None
    out = Path(out)
    with atomic_folder(out) as partial:  # takes the place of `out` whole once written
        marian.save_pretrained(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
    return out


__all__ = [
    "DECODING_FILE",
    "QUANTIZATIONS",
    "build_ct2_spec",
    "ct2_decoding_options",
    "export_ct2",
    "export_marian",
    "vaswani_to_marian",
]
