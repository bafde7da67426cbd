"""The one family of exceptions for input a user can fix: a config, corpus, checkpoint, conversion or folder
that a command or library call cannot use.

Every such error derives from `UserInputError`, which the CLI's `main()` catches once (one line on stderr,
exit 2), together with `OSError` (a file that is missing or cannot be read or written: the user's environment).
Anything else that escapes a command is a bug: one line and exit 1, the traceback with `--debug`.
`UserInputError` is a `ValueError`, so library callers that catch ValueError for bad arguments keep working;
torch's own ValueErrors (shape mismatches inside the model) are not user errors and stay bugs.

It also holds the model's checks of its inputs (ids inside the vocabulary, masks the shape of the ids, weights
that fit the config), which raise it. This file travels with saved weights for `trust_remote_code` (the config
and the model raise these errors): it imports nothing but the standard library (the checks use tensor methods).
"""

from __future__ import annotations

import re


class UserInputError(ValueError):
    """Input the user can fix; the message names the field, file or value and what is allowed."""


def check_token_ids(ids, vocab_size: int, name: str) -> None:
    """Refuse ids outside the vocabulary with a message, rather than an opaque index error deep in the embedding."""
    if ids.numel() == 0:
        return
    smallest, largest = (int(v) for v in ids.aminmax())  # one pass and one sync: this runs every decode step
    if smallest < 0 or largest >= vocab_size:
        bad = largest if largest >= vocab_size else smallest
        raise UserInputError(
            f"{name} contains id {bad} (largest {largest}, smallest {smallest}) outside the vocabulary of "
            f"vocab_size={vocab_size}; ids must be in [0, {vocab_size}). Is the tokenizer the one this model was trained with?"
        )


def check_mask(mask, ids_or_embeds, mask_name: str, ids_name: str) -> None:
    """Refuse a mask whose (batch, length) differs from its ids' (or embeddings')."""
    if mask is not None and tuple(mask.shape) != tuple(ids_or_embeds.shape[:2]):
        raise UserInputError(
            f"{mask_name} has shape {tuple(mask.shape)} but {ids_name} has shape {tuple(ids_or_embeds.shape[:2])}; "
            "they must match (batch, length)."
        )


def check_decoder_mask(mask, length: int, past_length: int) -> None:
    """Refuse a decoder mask that covers neither the new positions nor the cached and new ones."""
    if mask is not None and mask.shape[1] not in (length, past_length + length):
        raise UserInputError(
            f"decoder_attention_mask has length {mask.shape[1]} but the decoder sees {length} new positions after "
            f"{past_length} cached ones; it must have length {length} or {past_length + length}."
        )


def check_source_length(
    length: int, config, what: str = "the text", remedy: str = "shorten it or split it into sentences"
) -> None:
    """Refuse a source of more tokens (its `</s>` counted) than the positions the model was made for
    (`config.max_position_embeddings`), naming it (`what`) and its length. Learned positions cannot take it;
    sinusoids can, but a model that never saw such lengths stops its translation early (a 5,000-word line came out
    as 28 words), after minutes of beam search over a source that long.

    Raises:
        UserInputError: `length` is past the positions."""
    limit = config.max_position_embeddings
    if length > limit:
        raise UserInputError(
            f"{what} is {length} tokens long, more than this model's {limit} positions (max_position_embeddings): "
            f"{remedy}"
        )


# The config fields that set each dimension of a weight: (pattern of the weight's name, one field per dimension).
# A field config.json does not give takes VaswaniConfig's default (the base model's), which the weights may not have.
_H_DK, _H_DV = "num_heads * d_k", "num_heads * d_v"
_FIELDS_OF_WEIGHT = (
    (r"(^|\.)shared\.weight$|encoder\.embeddings\.embed_tokens\.weight$", ("vocab_size", "d_model")),
    (r"decoder\.embeddings\.embed_tokens\.weight$|(^|\.)lm_head\.weight$", ("decoder_vocab_size", "d_model")),
    (r"final_logits_bias$", (None, "decoder_vocab_size")),
    (r"attn\.[qk]_proj\.weight$", (_H_DK, "d_model")),
    (r"attn\.[qk]_proj\.bias$", (_H_DK,)),
    (r"attn\.v_proj\.weight$", (_H_DV, "d_model")),
    (r"attn\.v_proj\.bias$", (_H_DV,)),
    (r"attn\.out_proj\.weight$", ("d_model", _H_DV)),
    (r"decoder\.layers\.\d+\.feed_forward\.w_1\.weight$", ("decoder_d_ff", "d_model")),
    (r"decoder\.layers\.\d+\.feed_forward\.w_1\.bias$", ("decoder_d_ff",)),
    (r"decoder\.layers\.\d+\.feed_forward\.w_2\.weight$", ("d_model", "decoder_d_ff")),
    (r"feed_forward\.w_1\.weight$", ("d_ff", "d_model")),
    (r"feed_forward\.w_1\.bias$", ("d_ff",)),
    (r"feed_forward\.w_2\.weight$", ("d_model", "d_ff")),
    (r"(_norm\.(weight|bias)|out_proj\.bias|w_2\.bias)$", ("d_model",)),
)


def _config_value(config, field: str) -> tuple[str, int]:
    """(the field as named to the user, its value) for a field of `_FIELDS_OF_WEIGHT`."""
    if field == "decoder_d_ff" and config.decoder_d_ff is None:
        return "d_ff", config.d_ff
    if field == "decoder_vocab_size" and config.share_encoder_decoder_embeddings:
        return "vocab_size", config.vocab_size
    if field in (_H_DK, _H_DV):
        return field, config.num_heads * getattr(config, field.rpartition(" ")[2])
    return field, getattr(config, field)


def weights_against_config(config, loading_info: dict) -> str | None:
    """What `from_pretrained`'s `loading_info` says is wrong between the weights and the config, by config field
    (`vocab_size: config has 37000, the weights have 500`), or None when they fit. Weights whose misfit no field
    explains are named with both shapes; missing and unexpected layers give the layer count."""
    clashes: dict[str, str] = {}
    unexplained = []
    for key, in_weights, in_model in sorted(loading_info.get("mismatched_keys", ())):
        fields = next((f for pattern, f in _FIELDS_OF_WEIGHT if re.search(pattern, key)), None)
        if fields is None or len(fields) != len(in_weights) or len(in_weights) != len(in_model):
            unexplained.append(f"{key} is {tuple(in_weights)} in the weights, {tuple(in_model)} by the config")
            continue
        for field, size, expected in zip(fields, in_weights, in_model):
            if field is not None and size != expected:
                name, value = _config_value(config, field)
                clashes.setdefault(name, f"{name}: config has {value}, the weights have {size}")
    layers: dict[str, list[int]] = {}
    others = []
    for kind in ("missing_keys", "unexpected_keys"):
        for key in sorted(loading_info.get(kind, ())):
            match = re.search(r"(encoder|decoder)\.layers\.(\d+)\.", key)
            if match:
                layers.setdefault(match[1], []).append(int(match[2]) + (kind == "unexpected_keys"))
            else:
                others.append(
                    f"{key} {'is missing from the weights' if kind == 'missing_keys' else 'is in the weights, not in the model'}"
                )
    for stack, counts in sorted(layers.items()):
        field = f"num_{stack}_layers"
        expected = getattr(config, field)
        actual = max(counts) if max(counts) > expected else min(counts)  # unexpected: past the end; missing: gaps
        clashes.setdefault(field, f"{field}: config has {expected}, the weights have {actual}")
    problems = [*clashes.values(), *unexplained[:3], *others[:3]]
    if not problems:
        return None
    return (
        "the weights do not fit the config; "
        + "; ".join(problems)
        + " (config.json must give the sizes the model was saved with: a field it leaves out takes VaswaniConfig's "
        "default, the base model's)"
    )


def load_fitting_weights(from_pretrained, *args, **kwargs):
    """`from_pretrained(*args, **kwargs)` (transformers'), refusing weights that do not fit the config with a
    `UserInputError` naming the config fields (`weights_against_config`), where transformers raises a bare
    RuntimeError for a size mismatch and fills missing layers with random weights without an error. With
    `ignore_mismatched_sizes` given, transformers' own behaviour."""
    if "ignore_mismatched_sizes" in kwargs:
        return from_pretrained(*args, **kwargs)
    wants_info = kwargs.pop("output_loading_info", False)
    model, info = from_pretrained(*args, ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
    problem = weights_against_config(model.config, info)
    if problem:
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        raise UserInputError(f"{source}: {problem}")
    return (model, info) if wants_info else model


__all__ = [
    "UserInputError",
    "check_decoder_mask",
    "check_mask",
    "check_source_length",
    "check_token_ids",
    "load_fitting_weights",
    "weights_against_config",
]
