"""Publishing a trained model: the complete hub file set and a model card, saved locally or pushed.

`save_for_hub` writes what a hub user needs: config.json with `auto_map` and `custom_pipelines`, the
code files (configuration, modeling, generation, pipeline, static decoding, skip padding, errors), safetensors weights,
generation_config.json, the tokenizer files, and README.md rendered from the package's model card
template with the training data, the measured scores with their signatures, and every departure
from the paper.
`push_to_hub` saves first, then uploads, and fails at once with a clear message when the hub cannot
be reached (the saved folder stays usable).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from string import Template
from typing import Any

from vaswani_tx.atomic import atomic_folder
from vaswani_tx.engine.settings import describe_generation
from vaswani_tx.metrics.paper import DEPARTURES_FROM_THE_PAPER
from vaswani_tx.model.configuration_vaswani import VaswaniConfig
from vaswani_tx.model.errors import UserInputError

TEMPLATE = Path(__file__).with_name("templates") / "model_card_template.md"
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "configuration_vaswani.py",
    "modeling_vaswani.py",
    "generation_vaswani.py",
    "pipeline_vaswani.py",
    "skip_padding.py",
    "dropout.py",
    "errors.py",
    "vocabulary.py",
    "tokenizer.json",
    "tokenizer_config.json",
    "README.md",
)

# Options whose VaswaniConfig default is the paper's: a model that changes one lists it in its card.
_PAPER_OPTIONS = {
    "position_encoding": "positions other than the paper's sinusoids: 'learned' is Table 3 row E; 'fairseq_sinusoidal' "
    "is fairseq's frequencies 10000^(-i/(D/2-1)) with positions from pad_token_id + 1",
    "tie_word_embeddings": "the pre-softmax projection is not tied to the embeddings",
    "scale_embedding": "embeddings are not multiplied by sqrt(d_model)",
    "attention_dropout": "dropout on attention weights",
    "activation_dropout": "dropout after the feed-forward ReLU",
    "attention_bias": "biases on the attention projections W^Q, W^K, W^V, W^O",
    "activation_function": "the feed-forward network uses swish, x * sigmoid(x), instead of ReLU",
    "final_logits_bias": "a fixed bias is added to the logits",
    "share_encoder_decoder_embeddings": "separate source and target vocabularies, each with its own embedding",
    "decoder_d_ff": "the decoder's feed-forward network has its own inner size",
}

# The options only published checkpoints need (vaswani_tx.interop.convert), and which checkpoints need each.
CONVERSION_OPTIONS = {
    "attention_bias": "Marian (OPUS-MT), FSMT and fairseq checkpoints: their W^Q, W^K, W^V, W^O have biases",
    "position_encoding": "`fairseq_sinusoidal` for FSMT and fairseq checkpoints (their sinusoid frequencies and "
    "positions starting after the padding index)",
    "final_logits_bias": "Marian (OPUS-MT) checkpoints whose logits bias is not all zero",
    "activation_function": "`swish` for OPUS-MT checkpoints trained with it",
    "share_encoder_decoder_embeddings": "`False` (with `decoder_vocab_size`) for FSMT and OPUS-MT checkpoints with "
    "separate source and target vocabularies",
    "tie_word_embeddings": "`False` for FSMT and fairseq checkpoints with their own output projection (Table 3's option too)",
    "decoder_d_ff": "FSMT's and fairseq's WMT19 models (feed-forward 8192 in the encoder, 4096 in the decoder)",
}


def options_table(model) -> str:
    """Markdown table of the conversion options: the paper's value, this model's, and which checkpoints need each.
    Marian's and fairseq's sin-half/cos-half hidden layout needs none: conversion permutes the weights."""
    defaults = VaswaniConfig.__dataclass_fields__
    rows = ["| option | paper (default) | this model | needed by |", "| --- | --- | --- | --- |"]
    rows += [
        f"| `{field}` | `{defaults[field].default!r}` | `{getattr(model.config, field)!r}` | {needed_by} |"
        for field, needed_by in CONVERSION_OPTIONS.items()
    ]
    return "\n".join(rows)


def departures(model) -> list[str]:
    """The package's documented choices, plus every option of this model that differs from the paper."""
    items = list(DEPARTURES_FROM_THE_PAPER)
    defaults = VaswaniConfig.__dataclass_fields__
    for field, description in _PAPER_OPTIONS.items():
        value = getattr(model.config, field)
        if value != defaults[field].default:
            items.append(f"`{field}={value!r}`: {description}.")
    generation = model.generation_config
    if getattr(generation, "length_penalty_type", "gnmt") != "gnmt":
        items.append("Beam search uses transformers' length penalty |Y|^alpha instead of the paper's GNMT form.")
    if getattr(generation, "max_output_length_offset", 50) != 50:
        items.append(f"Maximum output length is source length + {generation.max_output_length_offset} (paper: + 50).")
    return items


def render_model_card(
    model,
    *,
    repo: str,
    source_lang: str,
    target_lang: str,
    training_data: str,
    results: Sequence[dict[str, Any]] = (),
    datasets: Sequence[str] = (),
    space: str | None = None,
) -> str:
    """The README.md text. `results` items: {"name", "score", "signature", "data"}; none means 'not measured'.
    `space`: the id of the Space serving the demo page (`vaswani-tx demo MODEL --write-space DIR --repo-id REPO`)."""
    config, generation = model.config, model.generation_config
    if results:
        rows = ["| data | metric | score | signature |", "| --- | --- | --- | --- |"]
        rows += [
            f"| {r.get('data', '')} | {r['name']} | {r['score']:.2f} | `{r.get('signature', '')}` |" for r in results
        ]
        rows.append(
            "\nsacreBLEU (detokenized) and the paper's tokenized BLEU are different measures; compare "
            "each only with its own kind."
        )
        results_text = "\n".join(rows)
    else:
        results_text = "Not measured for this model."
    decoding = describe_generation(generation)
    return Template(TEMPLATE.read_text(encoding="utf-8")).substitute(
        title=repo.rsplit("/", 1)[-1],
        repo=repo,
        source_lang=source_lang,
        target_lang=target_lang,
        languages="\n".join(f"- {lang}" for lang in (source_lang, target_lang)),
        datasets="\n".join(f"- {name}" for name in datasets) or "- custom",
        layers=f"{config.num_encoder_layers} + {config.num_decoder_layers}",
        d_model=config.d_model,
        d_ff=config.d_ff,
        num_heads=config.num_heads,
        d_k=config.d_k,
        d_v=config.d_v,
        dropout=config.dropout,
        position_encoding=config.position_encoding,
        vocab_size=config.vocab_size,
        parameters=f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M",
        decoding=decoding,
        training_data=training_data,
        results=results_text,
        departures="\n".join(f"- {item}" for item in departures(model)),
        options=options_table(model),
        demo=(
            f"Try it, and see the attention of each translation by layer and head, in the Space "
            f"[{space}](https://huggingface.co/spaces/{space}).\n"
            if space
            else ""
        ),
    )


def save_for_hub(model, tokenizer, folder: str | os.PathLike, **card: Any) -> Path:
    """Save model, tokenizer and model card into `folder` and check that the hub file set is complete."""
    from vaswani_tx.data.tokenization import check_tokenizer_fits_model

    check_tokenizer_fits_model(tokenizer, model.config)
    folder = Path(folder)
    with atomic_folder(folder, merge=True) as partial:  # each file whole; what else `folder` holds (.git) stays
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        (partial / "README.md").write_text(render_model_card(model, **card), encoding="utf-8")
    check_hub_folder(folder)
    return folder


def check_hub_folder(folder: str | os.PathLike) -> None:
    """Raise UserInputError naming every file a hub user would miss, or a config without the remote-code entries."""
    folder = Path(folder)
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise UserInputError(f"{folder} is not a complete vaswani_tx model folder: missing {', '.join(missing)}")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for key in ("auto_map", "custom_pipelines"):
        if key not in config:
            raise UserInputError(
                f"{folder / 'config.json'} has no {key!r}: save the model with save_pretrained of vaswani_tx"
            )


def push_to_hub(
    model,
    tokenizer,
    repo_id: str,
    folder: str | os.PathLike,
    *,
    private: bool = False,
    token: str | None = None,
    **card: Any,
) -> str:
    """Save the complete folder (`save_for_hub`), then upload it to `repo_id`. Returns the commit URL."""
    from huggingface_hub import HfApi

    folder = save_for_hub(model, tokenizer, folder, repo=repo_id, **card)
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        return str(api.upload_folder(repo_id=repo_id, folder_path=str(folder)))
    except Exception as err:
        if not _is_network_error(err):
            raise
        raise ConnectionError(
            f"push_to_hub could not reach the Hugging Face Hub ({type(err).__name__}: {err}). The complete model "
            f"folder is saved at {folder}; upload it later with `huggingface-cli upload {repo_id} {folder}`."
        ) from err


def _is_network_error(err: BaseException) -> bool:
    """Offline mode, or a transport failure (DNS, refused, timeout) of huggingface_hub's HTTP client, whose
    exception classes (httpx / httpx2 / requests) share no base class with OSError."""
    from huggingface_hub.errors import OfflineModeIsEnabled

    if isinstance(err, (OfflineModeIsEnabled, OSError)):
        return True
    return any(cls.__name__ in ("TransportError", "ConnectionError", "Timeout") for cls in type(err).__mro__)
