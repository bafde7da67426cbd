"""The one family of exceptions for input a user can fix: a config, corpus, checkpoint, conversion or folder
that a command or library call cannot use.

Every such error derives from `UserInputError`, which the CLI's `main()` catches once (one line on stderr,
exit 2), together with `OSError` (a file that is missing or cannot be read or written: the user's environment).
Anything else that escapes a command is a bug: one line and exit 1, the traceback with `--debug`.
`UserInputError` is a `ValueError`, so library callers that catch ValueError for bad arguments keep working;
torch's own ValueErrors (shape mismatches inside the model) are not user errors and stay bugs.

It also holds the model's checks of its inputs (ids inside the vocabulary, masks the shape of the ids),
which raise it. This file travels with saved weights for `trust_remote_code` (the config and the model raise
these errors): it imports nothing (the checks use tensor methods only).
"""

from __future__ import annotations


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


__all__ = ["UserInputError", "check_decoder_mask", "check_mask", "check_token_ids"]
