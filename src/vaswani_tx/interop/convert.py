"""Published checkpoints in: MarianMT (OPUS-MT), FSMT and fairseq Transformers to vaswani_tx.

`convert(source, out)` turns a MarianMTModel folder, an FSMTForConditionalGeneration folder, or a
fairseq checkpoint (with its `dict.*.txt` and BPE codes) into a vaswani_tx model folder whose logits
and translations are the source model's; the `vaswani-tx convert` command calls it. The way back to
Marian (`export_marian`) is with the other exports in `vaswani_tx.interop.export`, and uses the layout mapping
defined here (`marian_hidden_permutation`, `layer_tensor_map`, `permute_hidden`).

What differs, and how each difference is handled (options default to the paper; see VaswaniConfig):

| difference | handled by | needed by |
| --- | --- | --- |
| hidden layout sin-half/cos-half instead of interleaved | permuting the weights (no option) | Marian, FSMT, fairseq |
| biases on W^Q, W^K, W^V, W^O | `attention_bias=True` | Marian, FSMT, fairseq (unless all zero) |
| frequencies 10000^(-i/(D/2-1)), positions from pad+1 | `position_encoding="fairseq_sinusoidal"` | FSMT, fairseq |
| a fixed bias on the logits | `final_logits_bias=True` | Marian (unless all zero) |
| swish instead of ReLU | `activation_function="swish"` | many OPUS-MT models |
| separate source and target vocabularies | `share_encoder_decoder_embeddings=False`, `decoder_vocab_size` | FSMT, Marian with separate vocabularies |
| untied pre-softmax projection | `tie_word_embeddings=False` (Table 3's own option) | FSMT, fairseq without shared output embeddings |
| decoder feed-forward size other than the encoder's | `decoder_d_ff` | FSMT's and fairseq's WMT19 models (8192 / 4096) |

A source that cannot be represented exactly (pre-LN, an embedding LayerNorm, a final stack LayerNorm,
learned or relative positions, different encoder and decoder widths, ...) is refused with
`ConversionError` naming the field, its value and why, before anything is written.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from vaswani_tx.atomic import atomic_folder
from vaswani_tx.data.tokenization import vocabulary_fingerprint
from vaswani_tx.data.tokenization_fairseq import FairseqTokenizer
from vaswani_tx.model.configuration_vaswani import VaswaniConfig
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.text_io import iter_lines

from .fairseq_checkpoint import CheckpointError, checkpoint_settings, load_checkpoint, read_dictionary


class ConversionError(UserInputError):
    """A source model that cannot be converted exactly; the message names the field, its value and why."""


# ---------------------------------------------------------------------------------------------------
# The hidden-dimension permutation and the per-layer names (both directions: export.py's Marian export too)
# ---------------------------------------------------------------------------------------------------


def fairseq_generation_config(config, beam: int = 5, max_len_a: float = 0.0, max_len_b: int = 200) -> GenerationConfig:
    """fairseq-generate's decoding (fairseq 0.12 `SequenceGenerator` defaults): beam 5, scores divided by
    length^1 (eos counted), a sentence done once `beam` hypotheses have ended (early stopping), `</s>` not
    allowed first (`min_len=1`), `<pad>` never, and at most `max_len_a * source length + max_len_b` tokens
    (source `</s>` counted, capped at `max_position_embeddings - 1`) before `</s>` is forced and scored with
    its own log-probability."""
    return GenerationConfig(
        num_beams=beam,
        length_penalty=1.0,
        length_penalty_type="hf",
        max_output_length_offset=None,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        early_stopping=True,
        min_new_tokens=1,
        suppress_tokens=[config.pad_token_id],
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def marian_hidden_permutation(d_model: int) -> torch.Tensor:
    """Marian, FSMT and fairseq lay sinusoids out as [sin_0..sin_{D/2-1}, cos_0..cos_{D/2-1}]; ours interleave
    sin and cos (Section 3.5). Their dimension j holds our dimension perm[j]."""
    half = torch.arange(d_model // 2)
    return torch.cat([2 * half, 2 * half + 1])


# our sub-module name -> theirs (BART naming, shared by Marian, FSMT and fairseq)
_SUBLAYERS = {
    "self_attn": "self_attn",
    "cross_attn": "encoder_attn",
    "self_attn_norm": "self_attn_layer_norm",
    "cross_attn_norm": "encoder_attn_layer_norm",
    "feed_forward_norm": "final_layer_norm",
    "feed_forward.w_1": "fc1",
    "feed_forward.w_2": "fc2",
}


def layer_tensor_map(config: VaswaniConfig) -> list[tuple[str, str, str]]:
    """(our key, their key without prefix, how the hidden dimension enters) for every layer tensor.
    `reads`: the weight's input is the hidden state (permute columns); `writes`: its output is (permute
    rows); `vector`: a hidden-sized vector (permute it); `inner`: no hidden dimension."""
    rows = []
    for stack, count in (("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)):
        attentions = ("self_attn",) if stack == "encoder" else ("self_attn", "cross_attn")
        for i in range(count):
            ours, theirs = f"model.{stack}.layers.{i}.", f"{stack}.layers.{i}."
            for attn in attentions:
                for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                    weight_kind, bias_kind = ("writes", "vector") if proj == "out_proj" else ("reads", "inner")
                    rows.append(
                        (f"{ours}{attn}.{proj}.weight", f"{theirs}{_SUBLAYERS[attn]}.{proj}.weight", weight_kind)
                    )
                    if config.attention_bias:
                        rows.append(
                            (f"{ours}{attn}.{proj}.bias", f"{theirs}{_SUBLAYERS[attn]}.{proj}.bias", bias_kind)
                        )
                rows += [
                    (f"{ours}{attn}_norm.{p}", f"{theirs}{_SUBLAYERS[attn + '_norm']}.{p}", "vector")
                    for p in ("weight", "bias")
                ]
            rows += [
                (f"{ours}feed_forward.w_1.weight", f"{theirs}fc1.weight", "reads"),
                (f"{ours}feed_forward.w_1.bias", f"{theirs}fc1.bias", "inner"),
                (f"{ours}feed_forward.w_2.weight", f"{theirs}fc2.weight", "writes"),
                (f"{ours}feed_forward.w_2.bias", f"{theirs}fc2.bias", "vector"),
                (f"{ours}feed_forward_norm.weight", f"{theirs}final_layer_norm.weight", "vector"),
                (f"{ours}feed_forward_norm.bias", f"{theirs}final_layer_norm.bias", "vector"),
            ]
    return rows


def permute_hidden(tensor: torch.Tensor, kind: str, index: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` with its hidden dimension reordered by `index`, where `kind` (see `layer_tensor_map`)
    says it is."""
    if kind == "reads":
        return tensor[:, index].contiguous()
    if kind in ("writes", "vector"):
        return tensor[index].contiguous()
    return tensor.clone()


# ---------------------------------------------------------------------------------------------------
# Theirs -> ours: one path for all three sources, from tensors in BART naming without a prefix
# ---------------------------------------------------------------------------------------------------


def _attention_biases(tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [value for key, value in tensors.items() if re.search(r"attn\.(q|k|v|out)_proj\.bias$", key)]


def _to_vaswani(fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> VaswaniForConditionalGeneration:
    """Build our model from `fields` (VaswaniConfig values) and their tensors: `encoder.embed_tokens.weight`,
    `decoder.embed_tokens.weight`, optional `lm_head.weight` and `final_logits_bias`, and the layers.
    Options that would only add zeros are left off: all-zero attention biases or logits bias change nothing."""
    biases = _attention_biases(tensors)
    fields["attention_bias"] = any(bool(b.any()) for b in biases)
    logits_bias = tensors.get("final_logits_bias")
    fields["final_logits_bias"] = logits_bias is not None and bool(logits_bias.any())
    try:
        config = VaswaniConfig(**fields)
    except ValueError as err:
        raise ConversionError(f"the source model's settings have no vaswani_tx equivalent: {err}") from None
    inverse = torch.argsort(marian_hidden_permutation(config.d_model))
    ours = {}
    for our_key, their_key, kind in layer_tensor_map(config):
        if their_key not in tensors:
            raise ConversionError(f"the source weights have no {their_key!r} (needed for {our_key})")
        ours[our_key] = permute_hidden(tensors[their_key], kind, inverse)
    ours["model.shared.weight"] = permute_hidden(tensors["encoder.embed_tokens.weight"], "reads", inverse)
    if not config.share_encoder_decoder_embeddings:
        ours["model.decoder.embeddings.embed_tokens.weight"] = permute_hidden(
            tensors["decoder.embed_tokens.weight"], "reads", inverse
        )
    if not config.tie_word_embeddings:
        ours["lm_head.weight"] = permute_hidden(tensors["lm_head.weight"], "reads", inverse)
    if config.final_logits_bias:
        ours["final_logits_bias"] = logits_bias.reshape(1, -1).clone()

    model = VaswaniForConditionalGeneration(config).eval()
    expected = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    if set(ours) != expected:
        raise ConversionError(
            f"internal mapping mismatch: missing {sorted(expected - set(ours))}, extra {sorted(set(ours) - expected)}"
        )
    for key, value in ours.items():
        target = model.get_parameter(key) if "." in key else model.get_buffer(key)
        if tuple(target.shape) != tuple(value.shape):
            raise ConversionError(
                f"{key}: the source tensor has shape {tuple(value.shape)}, the config implies {tuple(target.shape)}"
            )
        with torch.no_grad():
            target.copy_(value.to(target.dtype))
    return model


_UNREPRESENTABLE = {  # config field -> why it cannot be represented (refused when truthy)
    "normalize_before": "pre-LN layers (LayerNorm before each sub-layer); the paper's are post-LN",
    "encoder_normalize_before": "a pre-LN encoder; the paper's is post-LN",
    "decoder_normalize_before": "a pre-LN decoder; the paper's is post-LN",
    "add_final_layer_norm": "a LayerNorm after the last layer of a stack; the paper has none",
    "normalize_embedding": "a LayerNorm on the embeddings; the paper has none",
    "layernorm_embedding": "a LayerNorm on the embeddings; the paper has none",
    "encoder_learned_pos": "learned positions offset by the padding index; use sinusoidal positions",
    "decoder_learned_pos": "learned positions offset by the padding index; use sinusoidal positions",
    "no_token_positional_embeddings": "no positional encoding at all; the paper adds one (Section 3.5)",
    "adaptive_input": "adaptive input embeddings; the paper has one embedding table",
    "adaptive_softmax_cutoff": "an adaptive softmax; the paper has one pre-softmax projection",
    "cross_self_attention": "cross+self attention in one sub-layer; the paper has two",
    "no_cross_attention": "a decoder without encoder-decoder attention",
    "relative_attention_num_buckets": "relative positions; the paper's are absolute",
    "alignment_heads": "alignment supervision heads",
    "alignment_layer": "alignment supervision heads",
}


def _refuse_unrepresentable(settings: dict[str, Any], where: str) -> None:
    for field, why in _UNREPRESENTABLE.items():
        value = settings.get(field)
        if value not in (None, False, 0, "", "False", "false"):
            raise ConversionError(f"{where}: {field}={value!r} cannot be represented: {why}.")


def _same(settings: dict[str, Any], first: str, second: str, where: str) -> Any:
    if settings.get(first) != settings.get(second):
        raise ConversionError(
            f"{where}: {first}={settings.get(first)!r} differs from {second}={settings.get(second)!r}; vaswani_tx "
            "uses one value for both stacks, as the paper does."
        )
    return settings.get(first)


def _activation(value: Any, where: str, field: str = "activation_function") -> str:
    names = {"relu": "relu", "swish": "swish", "silu": "swish"}
    if value not in names:
        raise ConversionError(
            f"{where}: {field}={value!r} cannot be represented; vaswani_tx has relu (the paper's) and swish."
        )
    return names[value]


def _stack_fields(settings: dict[str, Any], where: str) -> dict[str, Any]:
    """The VaswaniConfig fields shared by Marian and FSMT configs (BART-style names)."""
    _refuse_unrepresentable(settings, where)
    return dict(
        d_model=settings["d_model"],
        d_ff=settings["encoder_ffn_dim"],
        decoder_d_ff=None
        if settings["decoder_ffn_dim"] == settings["encoder_ffn_dim"]
        else settings["decoder_ffn_dim"],
        num_heads=_same(settings, "encoder_attention_heads", "decoder_attention_heads", where),
        num_encoder_layers=settings["encoder_layers"],
        num_decoder_layers=settings["decoder_layers"],
        dropout=settings.get("dropout", 0.1),
        attention_dropout=settings.get("attention_dropout", 0.0),
        activation_dropout=settings.get("activation_dropout", 0.0),
        activation_function=_activation(settings.get("activation_function", "relu"), where),
        scale_embedding=bool(settings.get("scale_embedding", False)),
        layer_norm_eps=1e-5,  # nn.LayerNorm's default, which Marian, FSMT and fairseq all use
        max_position_embeddings=settings.get("max_position_embeddings", 1024),
        pad_token_id=settings.get("pad_token_id"),
        bos_token_id=settings.get("bos_token_id"),
        eos_token_id=settings.get("eos_token_id"),
        decoder_start_token_id=settings.get("decoder_start_token_id"),
    )


def _source_settings(model, model_type: str, where: str) -> dict:
    """The source model's config as a dict, refused unless it is of `model_type`."""
    settings = model.config.to_dict()
    if settings.get("model_type") != model_type:
        raise ConversionError(f"{where}: model_type={settings.get('model_type')!r}, expected {model_type!r}")
    return settings


def marian_to_vaswani(marian) -> VaswaniForConditionalGeneration:
    """A MarianMTModel (OPUS-MT) as our model: the same logits, up to float rounding of the permuted sums."""
    where = "MarianMTModel config"
    settings = _source_settings(marian, "marian", where)
    fields = _stack_fields(settings, where)
    share = bool(settings.get("share_encoder_decoder_embeddings", True))
    fields.update(
        vocab_size=settings["vocab_size"],
        share_encoder_decoder_embeddings=share,
        decoder_vocab_size=None if share else settings["decoder_vocab_size"],
        tie_word_embeddings=bool(settings.get("tie_word_embeddings", True)),
    )
    state = marian.state_dict()
    tensors = {key.removeprefix("model."): value for key, value in state.items() if key.startswith("model.")}
    if share:
        tensors["encoder.embed_tokens.weight"] = tensors["decoder.embed_tokens.weight"] = tensors["shared.weight"]
    tensors["lm_head.weight"] = state["lm_head.weight"]
    tensors["final_logits_bias"] = state["final_logits_bias"]
    return _to_vaswani(fields, tensors)


def fsmt_to_vaswani(fsmt) -> VaswaniForConditionalGeneration:
    """An FSMTForConditionalGeneration (transformers' port of fairseq's WMT19 models) as our model."""
    where = "FSMTForConditionalGeneration config"
    settings = _source_settings(fsmt, "fsmt", where)
    fields = _stack_fields(settings, where)
    # FSMT ties all three tables or none (FSMTModel._tied_weights_keys).
    tied = bool(settings.get("tie_word_embeddings", False))
    if tied and settings["src_vocab_size"] != settings["tgt_vocab_size"]:
        raise ConversionError(
            f"{where}: tie_word_embeddings=True with src_vocab_size={settings['src_vocab_size']} "
            f"!= tgt_vocab_size={settings['tgt_vocab_size']} is inconsistent"
        )
    fields.update(
        vocab_size=settings["src_vocab_size"],
        share_encoder_decoder_embeddings=tied,
        decoder_vocab_size=None if tied else settings["tgt_vocab_size"],
        tie_word_embeddings=tied,
        position_encoding="fairseq_sinusoidal",
    )
    state = fsmt.state_dict()
    tensors = {key.removeprefix("model."): value for key, value in state.items()}
    tensors["lm_head.weight"] = tensors.pop("decoder.output_projection.weight")
    return _to_vaswani(fields, tensors)


# ---------------------------------------------------------------------------------------------------
# fairseq checkpoints: settings and tensors in fairseq's names -> the same path
# ---------------------------------------------------------------------------------------------------


def fairseq_to_vaswani(checkpoint_path: str | os.PathLike) -> tuple[VaswaniForConditionalGeneration, dict[str, Any]]:
    """A fairseq translation checkpoint as our model; returns (model, settings), the settings as read.

    Reads `dict.<source>.txt` and `dict.<target>.txt` beside the checkpoint to check that their sizes are
    the embeddings' (a mismatched dictionary would translate into the wrong tokens)."""
    path = Path(checkpoint_path)
    checkpoint = load_checkpoint(path)
    settings = checkpoint_settings(checkpoint, path)
    where = f"{path} ({settings['arch']})"
    _refuse_unrepresentable(settings, where)
    state = {key: value for key, value in checkpoint["model"].items() if torch.is_tensor(value)}
    tensors = _fairseq_tensors(state, where)
    for key, why in (
        ("encoder.layer_norm.weight", "a final encoder LayerNorm (pre-LN model)"),
        ("decoder.layer_norm.weight", "a final decoder LayerNorm (pre-LN model)"),
        ("encoder.layernorm_embedding.weight", "an embedding LayerNorm"),
        ("encoder.embed_positions.weight", "learned positions"),
        ("decoder.project_in_dim.weight", "a projection between embedding and decoder width"),
    ):
        if key in tensors:
            raise ConversionError(f"{where}: the weights hold {key!r}: {why}, which cannot be represented.")
    d_model = tensors["encoder.embed_tokens.weight"].shape[1]
    for field in ("encoder_embed_dim", "decoder_embed_dim", "decoder_output_dim", "decoder_input_dim"):
        if settings.get(field, d_model) != d_model:
            raise ConversionError(f"{where}: {field}={settings[field]} differs from the embedding width {d_model}.")
    source_lang, target_lang = _languages(settings, path, tensors, where)
    settings.update(source_lang=source_lang, target_lang=target_lang)
    for lang, key in ((source_lang, "encoder.embed_tokens.weight"), (target_lang, "decoder.embed_tokens.weight")):
        size = len(read_dictionary(path.with_name(f"dict.{lang}.txt")))
        if size != tensors[key].shape[0]:
            raise ConversionError(
                f"{path.with_name(f'dict.{lang}.txt')}: {size} tokens (with fairseq's 4 specials) but {key} has "
                f"{tensors[key].shape[0]} rows; the dictionary does not belong to this checkpoint."
            )
    share = bool(settings.get("share_all_embeddings", False))
    tied = share or bool(settings.get("share_decoder_input_output_embed", False)) or "lm_head.weight" not in tensors
    fields = dict(
        vocab_size=tensors["encoder.embed_tokens.weight"].shape[0],
        decoder_vocab_size=None if share else tensors["decoder.embed_tokens.weight"].shape[0],
        share_encoder_decoder_embeddings=share,
        tie_word_embeddings=tied,
        d_model=d_model,
        d_ff=tensors["encoder.layers.0.fc1.weight"].shape[0],
        decoder_d_ff=tensors["decoder.layers.0.fc1.weight"].shape[0],
        num_heads=_same(settings, "encoder_attention_heads", "decoder_attention_heads", where),
        num_encoder_layers=_count_layers(tensors, "encoder"),
        num_decoder_layers=_count_layers(tensors, "decoder"),
        dropout=settings.get("dropout", 0.1),
        attention_dropout=settings.get("attention_dropout", 0.0),
        activation_dropout=settings.get("activation_dropout", settings.get("relu_dropout", 0.0)),
        activation_function=_activation(settings.get("activation_fn", "relu"), where, "activation_fn"),
        scale_embedding=not settings.get("no_scale_embedding", False),
        position_encoding="fairseq_sinusoidal",
        max_position_embeddings=settings.get("max_source_positions", 1024),
        bos_token_id=0,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,  # fairseq starts the decoder with </s>
    )
    if fields["decoder_d_ff"] == fields["d_ff"]:
        fields["decoder_d_ff"] = None
    return _to_vaswani(fields, tensors), settings


def _languages(settings: dict[str, Any], path: Path, tensors: dict[str, torch.Tensor], where: str) -> tuple[str, str]:
    """source_lang and target_lang as the checkpoint records them or, where fairseq-train inferred them from its
    data folder and recorded None, from the two `dict.<lang>.txt` beside the checkpoint: the one whose size is
    the encoder embedding's is the source's."""
    source_lang, target_lang = settings.get("source_lang"), settings.get("target_lang")
    if source_lang and target_lang:
        return source_lang, target_lang
    files = sorted(path.parent.glob("dict.*.txt"))
    langs = [file.name.removeprefix("dict.").removesuffix(".txt") for file in files]
    if len(langs) == 2:
        sizes = {lang: len(read_dictionary(file)) for lang, file in zip(langs, files)}
        rows = (tensors["encoder.embed_tokens.weight"].shape[0], tensors["decoder.embed_tokens.weight"].shape[0])
        pairs = [
            (first, second)
            for first, second in (langs, langs[::-1])
            if (sizes[first], sizes[second]) == rows and source_lang in (None, first) and target_lang in (None, second)
        ]
        if len(pairs) == 1:
            return pairs[0]
    raise ConversionError(
        f"{where}: source_lang/target_lang are not recorded in the checkpoint's settings, and the dictionaries "
        f"beside it ({', '.join(file.name for file in files) or 'none'}) do not tell them: two of different sizes "
        "would (the encoder's is the source's)."
    )


def _fairseq_tensors(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """fairseq's keys in the BART naming `_to_vaswani` reads, including the layouts of fairseq before 0.7
    (one `in_proj_weight` for q, k, v; encoder `layer_norms.0/1`) and `decoder.embed_out`."""
    tensors = {}
    for key, value in state.items():
        if key.endswith((".version", "embed_positions._float_tensor")):
            continue
        match = re.fullmatch(r"(.*attn)\.in_proj_(weight|bias)", key)
        if match:
            for name, part in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                tensors[f"{match[1]}.{name}.{match[2]}"] = part
            continue
        key = re.sub(r"^(encoder\.layers\.\d+)\.layer_norms\.0\.", r"\1.self_attn_layer_norm.", key)
        key = re.sub(r"^(encoder\.layers\.\d+)\.layer_norms\.1\.", r"\1.final_layer_norm.", key)
        key = {"decoder.output_projection.weight": "lm_head.weight", "decoder.embed_out": "lm_head.weight"}.get(
            key, key
        )
        tensors[key] = value
    for key in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "encoder.layers.0.fc1.weight"):
        if key not in tensors:
            raise ConversionError(f"{where}: the model state dict has no {key!r}; is this a translation Transformer?")
    return tensors


def _count_layers(tensors: dict[str, torch.Tensor], stack: str) -> int:
    return len({int(m[1]) for key in tensors if (m := re.match(rf"{stack}\.layers\.(\d+)\.", key))})


def _fairseq_tokenizer(checkpoint_path: Path, settings: dict[str, Any], out: Path) -> None:
    """FairseqTokenizer files (FSMTTokenizer's: moses + BPE, as transformers' FSMT port of fairseq): vocab-src.json,
    vocab-tgt.json (fairseq's `@@` continuation marks rewritten as FSMT's `</w>` word ends) and merges.txt from
    the BPE codes; Moses tokenization without FSMT's punctuation normalisation, as fairseq's `--tokenizer moses`."""
    folder = checkpoint_path.parent
    codes = next((folder / name for name in ("bpecodes", "code") if (folder / name).is_file()), None)
    if codes is None:
        raise ConversionError(f"{folder}: no BPE codes file ('bpecodes' or 'code') beside the checkpoint")
    source_lang, target_lang = settings["source_lang"], settings["target_lang"]
    for lang, name in ((source_lang, "vocab-src.json"), (target_lang, "vocab-tgt.json")):
        tokens = read_dictionary(folder / f"dict.{lang}.txt")
        vocab = {}
        for index, token in enumerate(tokens):
            if index >= 4:
                token = token[:-2] if token.endswith("@@") else token + "</w>"
            vocab.setdefault(token, index)
        (out / name).write_text(json.dumps(vocab, ensure_ascii=False, indent=2), encoding="utf-8")
    merges = [
        " ".join(line.split()[:2]) for line in iter_lines(codes) if line.strip() and not line.startswith("#version")
    ]
    (out / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
    lowercase = all(not any(c.isupper() for c in token) for token in json.loads((out / "vocab-src.json").read_text()))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "FairseqTokenizer",
                "langs": [source_lang, target_lang],
                "moses_normalize": False,
                "model_max_length": 1024,
                "do_lower_case": lowercase,
            },
            indent=2,
        ),
        encoding="utf-8",
    )


# ---------------------------------------------------------------------------------------------------
# Decoding settings, the output folder, and the entry point
# ---------------------------------------------------------------------------------------------------


def _generation_config(model: VaswaniForConditionalGeneration, source: dict[str, Any]):
    """The source's decoding settings, as they are (beam size, length penalty, max_length, bad_words_ids,
    forced end, ...), so that `generate` reproduces the source model's translations: transformers' length penalty
    form |Y|^alpha and no source-length cap, as MarianMT and FSMT decode, unless the source records ours (a model
    `vaswani_tx.interop.export.export_marian` wrote: `length_penalty_type`, `max_output_length_offset`), which then stay
    as they were before the export (GNMT stays GNMT). The special ids are ours (the same ids)."""
    from transformers import GenerationConfig

    settings = {
        key: value for key, value in source.items() if not key.startswith("_") and key != "transformers_version"
    }
    settings.update(
        length_penalty_type=source.get("length_penalty_type", "hf"),
        max_output_length_offset=source.get("max_output_length_offset"),
    )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        settings[name] = getattr(model.config, name)
    return GenerationConfig(**settings)


def describe_decoding(folder: str | os.PathLike) -> str:
    """How a converted folder decodes, in one line (`vaswani_tx.engine.settings.describe_generation`): beam size,
    alpha and the length penalty's form, the output cap, each field the source left unset read as generate() reads it."""
    from transformers import GenerationConfig

    from vaswani_tx.engine.settings import describe_generation

    return f"decoding: {describe_generation(GenerationConfig.from_pretrained(folder))}"


def _detect(source: Path) -> tuple[str, Path]:
    if source.is_file():
        return "fairseq", source
    if not source.is_dir():
        raise ConversionError(f"{source}: no such file or folder")
    config_file = source / "config.json"
    if config_file.is_file():
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
        if model_type in ("marian", "fsmt"):
            return model_type, source
        raise ConversionError(
            f"{config_file}: model_type={model_type!r} is not convertible; vaswani-tx convert reads MarianMTModel "
            "('marian') and FSMTForConditionalGeneration ('fsmt') folders and fairseq checkpoints."
        )
    checkpoints = sorted([*source.glob("checkpoint*.pt"), *source.glob("model.pt")])
    if len(checkpoints) == 1:
        return "fairseq", checkpoints[0]
    if checkpoints:
        raise ConversionError(f"{source}: several checkpoints ({', '.join(p.name for p in checkpoints)}); name one")
    raise ConversionError(f"{source}: neither a model folder with config.json nor a fairseq checkpoint*.pt/model.pt")


def convert(source: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Convert a MarianMTModel folder, an FSMTForConditionalGeneration folder or a fairseq checkpoint into a
    vaswani_tx model folder at `out`: safetensors weights, config with our code files and pipeline,
    generation config with the source's decoding settings, and the source's tokenizer. Returns `out`.

    The folder is built beside `out` and takes its place whole once complete: nothing is written when the source
    is refused (`ConversionError`, `CheckpointError`), and a failed or interrupted conversion leaves `out` as it was."""
    from transformers import AutoTokenizer, GenerationConfig

    kind, path = _detect(Path(source))
    out = Path(out)
    with atomic_folder(out) as staging:  # takes the place of `out` whole once written
        if kind == "fairseq":
            model, settings = fairseq_to_vaswani(path)
            _fairseq_tokenizer(path, settings, staging)
            generation = fairseq_generation_config(model.config).to_dict()  # fairseq-generate's defaults
        else:
            from transformers import FSMTForConditionalGeneration, MarianMTModel

            source_class = MarianMTModel if kind == "marian" else FSMTForConditionalGeneration
            original = source_class.from_pretrained(path)
            model = (marian_to_vaswani if kind == "marian" else fsmt_to_vaswani)(original)
            generation = (
                GenerationConfig.from_pretrained(path)
                if (path / "generation_config.json").is_file()
                else original.generation_config
            ).to_dict()
            del original
            # FSMT's tokenizer has no eos token and encodes targets with the source vocabulary: ours fixes both
            (FairseqTokenizer if kind == "fsmt" else AutoTokenizer).from_pretrained(path).save_pretrained(staging)
        model.generation_config = _generation_config(model, generation)
        tokenizer = AutoTokenizer.from_pretrained(staging)
        model.config.tokenizer_fingerprint = vocabulary_fingerprint(tokenizer)  # refuses another model's tokenizer
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    return out


__all__ = [
    "CheckpointError",
    "ConversionError",
    "convert",
    "describe_decoding",
    "fairseq_to_vaswani",
    "fsmt_to_vaswani",
    "layer_tensor_map",
    "marian_hidden_permutation",
    "marian_to_vaswani",
    "permute_hidden",
]
