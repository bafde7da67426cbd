"""What a model and its tokenizer must agree on, and what every path does to text before the tokenizer.

* :func:`check_tokenizer_fits_model`: the one check wherever a tokenizer meets a model (training, fine-tuning,
  publishing, the commands, ``pipeline("translation")``): sizes, special ids and, where the config records one,
  the :func:`vocabulary_fingerprint` of the tokenizer the model was made with.
* :func:`drop_format_characters`: U+FEFF (a byte-order mark, at the start of a file or inside a line),
  U+200B ZERO WIDTH SPACE and U+2060 WORD JOINER are invisible and mean nothing to a translation, but no
  trained alphabet holds them: the byte-level BPE encodes each as three byte tokens the model never saw in
  training, which changes the translation ("A dog runs in the park." -> "Ein Hausmeister läuft im Park.").
  Tokenizers trained by this package drop them in their normalizer (``vaswani_tx.data.tokenization``); the
  commands, ``Translator`` and the pipeline drop them from the text as well, for tokenizers trained before
  that and for converted (Marian, fairseq, FSMT) ones.

This file travels with saved weights for `trust_remote_code` (the pipeline runs the check and drops the
characters): it imports the standard library and ``errors.py`` only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .errors import UserInputError

# The fixed ids of this package's vocabularies, which VaswaniConfig's defaults agree with.
PAD_TOKEN_ID, UNK_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID = range(4)

FORMAT_CHARACTERS = ("\ufeff", "\u200b", "\u2060")  # BYTE ORDER MARK, ZERO WIDTH SPACE, WORD JOINER
_NO_FORMAT_CHARACTERS = {ord(character): None for character in FORMAT_CHARACTERS}


def drop_format_characters(text: str) -> str:
    """``text`` without U+FEFF, U+200B and U+2060, wherever they are (see the module docstring)."""
    return text.translate(_NO_FORMAT_CHARACTERS)


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """A short hash of the tokenizer's vocabulary (every token and its id; the target vocabulary too where a
    tokenizer has its own, as Marian's and fairseq's do).

    Two tokenizers of the same size trained on other text give other fingerprints, which the vocabulary size
    alone cannot tell: a model trained with one and run with the other decodes garbage without an error.
    `train()`, `vaswani-tx convert` and `prepare-data` record it (config's ``tokenizer_fingerprint``, the
    prepared data's ``vaswani_data.json``) and `check_tokenizer_fits_model` compares it."""
    digest = hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False).encode("utf-8"))
    target = getattr(tokenizer, "target_encoder", None)
    if target and target != tokenizer.get_vocab():
        digest.update(json.dumps(sorted(target.items()), ensure_ascii=False).encode("utf-8"))
    return "sha256:" + digest.hexdigest()[:16]


def check_tokenizer_fits_model(tokenizer: Any, config: Any) -> None:
    """Refuse a tokenizer and a model config that were not made for each other.

    The one check wherever the two meet: training, fine-tuning, publishing, loading a model to
    translate, the translation pipeline. ``config`` is any object with ``vocab_size``, ``pad_token_id``,
    ``bos_token_id``, ``eos_token_id`` and ``decoder_start_token_id`` (such as ``VaswaniConfig``). It must
    agree with the tokenizer on:

    * ``vocab_size``, which must be ``len(tokenizer)``: a larger tokenizer's last ids would index past
      the embedding, and a larger embedding has rows no token reaches (a config written for another
      vocabulary);
    * ``pad_token_id``, ``bos_token_id``, ``eos_token_id``, and ``unk_token_id`` when the config has
      one: with another ``</s>`` decoding never stops where it should;
    * ``decoder_start_token_id``: ``<s>`` for a vocabulary with this package's fixed ids (the model
      shifts ``labels`` right behind it); a converted model keeps its source's start token, which
      must be one of the tokenizer's ``<s>``, ``</s>`` or ``<pad>`` (fairseq and FSMT start from
      ``</s>``; Marian vocabularies have no ``<s>`` and start from ``<pad>``);
    * ``tokenizer_fingerprint``, where the config records one (models trained by `train()` or converted):
      the `vocabulary_fingerprint` of the tokenizer the model was made with, so that a tokenizer of
      another model of the same size is refused too.

    Raises:
        UserInputError: ``model config and tokenizer disagree; ...`` naming every field that differs,
            with both values.
    """
    clashes = []
    size, rows = len(tokenizer), getattr(config, "vocab_size", None)
    if rows != size:
        why = ""
        if isinstance(rows, int):
            why = (
                f" (its last {size - rows} ids would index past the embedding)"
                if size > rows
                else f" ({rows - size} embedding rows no token reaches)"
            )
        clashes.append(f"vocab_size: config has {rows}, tokenizer has {size}{why}")
    fields = ["pad_token_id", "bos_token_id", "eos_token_id"]
    if getattr(config, "unk_token_id", None) is not None:
        fields.append("unk_token_id")
    for field in fields:
        config_value, tokenizer_value = getattr(config, field, None), getattr(tokenizer, field)
        if config_value != tokenizer_value:
            clashes.append(f"{field}: config has {config_value}, tokenizer has {tokenizer_value}")
    start = getattr(config, "decoder_start_token_id", None)
    specials = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    fixed = (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        PAD_TOKEN_ID,
        UNK_TOKEN_ID,
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
    )
    if fixed and start != BOS_TOKEN_ID:
        clashes.append(f"decoder_start_token_id: config has {start}, tokenizer has {BOS_TOKEN_ID}")
    elif not fixed and (start is None or start not in specials.values()):
        named = ", ".join(f"{name} {value}" for name, value in specials.items() if value is not None)
        clashes.append(f"decoder_start_token_id: config has {start}, which is none of the tokenizer's {named}")
    recorded = getattr(config, "tokenizer_fingerprint", None)
    fingerprint = vocabulary_fingerprint(tokenizer) if recorded and not clashes else recorded
    if fingerprint != recorded:
        clashes.append(
            f"tokenizer_fingerprint: config has {recorded}, tokenizer has {fingerprint} "
            "(a vocabulary of the same size but other tokens: the tokenizer of another model)"
        )
    if clashes:
        raise UserInputError("model config and tokenizer disagree; " + "; ".join(clashes))


__all__ = [
    "BOS_TOKEN_ID",
    "EOS_TOKEN_ID",
    "FORMAT_CHARACTERS",
    "PAD_TOKEN_ID",
    "UNK_TOKEN_ID",
    "check_tokenizer_fits_model",
    "drop_format_characters",
    "vocabulary_fingerprint",
]
