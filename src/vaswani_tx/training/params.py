"""Parameter counts of model configs against the paper's Table 3 (used by `vaswani-tx params` and the tests),
and the matrix-multiply FLOPs of a training step for a config."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vaswani_tx.metrics.paper import ALL_MODEL_CONFIGS, TOLERANCE_MILLIONS
from vaswani_tx.model.configuration_vaswani import VaswaniConfig
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration


def num_parameters_closed_form(config) -> int:
    """Trainable parameters, from the sizes alone (Sections 3.2-3.5); checked against the built model in tests."""
    d, h = config.d_model, config.num_heads
    attention = d * h * config.d_k * 2 + d * h * config.d_v + h * config.d_v * d  # W^Q, W^K, W^V, W^O: no biases
    if config.attention_bias:
        attention += h * config.d_k * 2 + h * config.d_v + d
    ffn = d * config.d_ff + config.d_ff + config.d_ff * d + d  # W1, b1, W2, b2
    decoder_d_ff = config.decoder_d_ff or config.d_ff
    decoder_ffn = d * decoder_d_ff + decoder_d_ff + decoder_d_ff * d + d
    norm = 2 * d
    encoder = config.num_encoder_layers * (attention + ffn + 2 * norm)
    decoder = config.num_decoder_layers * (2 * attention + decoder_ffn + 3 * norm)
    embeddings = config.vocab_size * d + config.target_vocab_size * d * (
        (0 if config.share_encoder_decoder_embeddings else 1) + (0 if config.tie_word_embeddings else 1)
    )
    positions = 2 * config.max_position_embeddings * d if config.position_encoding == "learned" else 0
    return encoder + decoder + embeddings + positions


def load_model_config(path: str | Path) -> VaswaniConfig:
    """A `VaswaniConfig` from a JSON file such as `configs/model/base.json` (or a model folder's config.json)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"model config {path} does not exist") from None
    except json.JSONDecodeError as err:
        raise UserInputError(f"model config {path} is not valid JSON: {err}") from None
    except UnicodeDecodeError as err:
        raise UserInputError(f"model config {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    if not isinstance(values, dict):
        raise UserInputError(
            f"model config {path} must be a JSON object of config fields, got {type(values).__name__}"
        )
    model_type = values.pop("model_type", VaswaniConfig.model_type)
    if model_type != VaswaniConfig.model_type:
        raise UserInputError(
            f"model config {path} has model_type={model_type!r}; expected {VaswaniConfig.model_type!r}"
        )
    return VaswaniConfig(**values)


def count_parameters(config: VaswaniConfig) -> int:
    """Trainable parameters of the built model, each shared Parameter counted once (built on the meta device)."""
    with torch.device("meta"):
        model = VaswaniForConditionalGeneration(config)
    return sum(p.numel() for p in model.parameters())


def training_flops(
    config, source_tokens: float, target_tokens: float, source_length: float, target_length: float
) -> float:
    """Matrix-multiply FLOPs of one training step: forward and backward (3x forward), 2 FLOPs per multiply-add.

    Counts every projection, the feed-forward layers, the attention scores and weighted sums (which grow
    with ``source_length``/``target_length``, the mean padded sentence lengths) and the pre-softmax
    projection; embedding lookups, softmax, LayerNorm and the loss are element-wise and left out.
    ``tests/test_training.py`` checks it against ``torch.utils.flop_counter``. The paper gives no count
    of its own, only GPU time times an assumed sustained rate (Table 2: 3.3e18 base, 2.3e19 big).
    """
    d, d_ff, h, d_k, d_v = config.d_model, config.d_ff, config.num_heads, config.d_k, config.d_v
    projections = d * h * (2 * d_k + d_v) + h * d_v * d  # Q, K, V and the output projection, per token
    encoder = config.num_encoder_layers * (projections + 2 * d * d_ff + h * source_length * (d_k + d_v))
    decoder_per_target = (
        config.num_decoder_layers
        * (
            projections
            + 2 * d * d_ff
            + h * target_length * (d_k + d_v)  # self-attention and feed-forward
            + d * h * d_k
            + h * d_v * d
            + h * source_length * (d_k + d_v)  # encoder-decoder attention: Q, O, scores
        )
        + d * config.vocab_size
    )
    decoder_per_source = config.num_decoder_layers * d * h * (d_k + d_v)  # its K and V, from the encoder output
    multiply_adds = source_tokens * (encoder + decoder_per_source) + target_tokens * decoder_per_target
    return 3 * 2 * multiply_adds


def parameter_table(files: list[Path]) -> tuple[list[dict], bool]:
    paper = {row.name: row.params_millions for row in ALL_MODEL_CONFIGS}
    rows, all_ok = [], True
    for file in files:
        config = load_model_config(file)
        built = count_parameters(config)
        closed = num_parameters_closed_form(config)
        reported = paper.get(file.stem)
        checks = []
        if built != closed:
            checks.append(f"built {built} != closed form {closed}")
        if reported is not None and abs(built / 1e6 - reported) > TOLERANCE_MILLIONS:
            checks.append(f"more than {TOLERANCE_MILLIONS:g}M from the paper")
        all_ok &= not checks
        rows.append(
            {
                "name": file.stem,
                "N": f"{config.num_encoder_layers}+{config.num_decoder_layers}"
                if config.num_encoder_layers != config.num_decoder_layers
                else config.num_encoder_layers,
                "d_model": config.d_model,
                "d_ff": config.d_ff,
                "h": config.num_heads,
                "d_k": config.d_k,
                "d_v": config.d_v,
                "dropout": config.dropout,
                "built": built,
                "paper": reported,
                "check": "; ".join(checks) or "ok",
            }
        )
    return rows, all_ok
