"""Shared source-target vocabularies (Section 5.1): joint BPE and WordPiece trained with `tokenizers`.

The paper encodes WMT14 EN-DE with a byte-pair encoding of about 37,000 tokens shared by source and
target, and EN-FR with a 32,000 word-piece vocabulary. :func:`train_tokenizer` learns either one on
both sides of a corpus at once and returns a transformers fast tokenizer (``PreTrainedTokenizerFast``,
which transformers 5 implements as ``TokenizersBackend``) that ``save_pretrained`` writes and
``AutoTokenizer.from_pretrained(folder)`` reads back.

Fixed ids, which the model config defaults agree with (checked by :func:`check_tokenizer_fits_model`, which
lives with the fingerprint in ``vocabulary.py``, a file that travels with saved models, and is re-exported here):
``<pad>`` = 0, ``<unk>`` = 1, ``<s>`` = 2 (bos, also the decoder start), ``</s>`` = 3 (eos).
Every encoded sequence, source and ``labels`` alike, is its subword tokens followed by ``</s>``; the
source has no ``<s>``: the model shifts ``labels`` right itself and starts the decoder with ``<s>``.

Normalisation, applied before anything else and the only thing decoding does not undo:

0. U+FEFF (a byte-order mark), U+200B ZERO WIDTH SPACE and U+2060 WORD JOINER are dropped wherever they
   are (``vocabulary.FORMAT_CHARACTERS``): invisible, meaningless to a translation, and otherwise encoded
   as byte tokens no training sentence had. Tokenizers trained before this step existed get it when
   :func:`load_tokenizer` (or ``vaswani_tx.engine.translation.load_translator``) loads them, and the commands and
   the pipeline drop the characters from the text too (converted Marian and fairseq tokenizers included);
1. Unicode NFC (a no-op on the shared WMT13 and Multi30k files; NFKC was rejected because it also
   rewrites real characters, e.g. U+00B5 MICRO SIGN in newstest2013 ``dev.fr``);
2. every run of Unicode whitespace becomes one U+0020 space, so U+00A0 NO-BREAK SPACE (11 lines of
   newstest2013 ``dev.de``, 99 of ``dev.fr``, 44 of Multi30k ``train.de``), U+2009 THIN SPACE
   (line 2414 of newstest2013 ``dev.en``), tabs and double spaces all become a plain space. That is
   what sacrebleu does when it reads the official newstest2013 ``.sgm`` files, and BLEU splits on
   them anyway;
3. U+2581 LOWER ONE EIGHTH BLOCK (the word-boundary marker below) becomes a space, so it cannot be
   confused with a real one;
4. leading and trailing whitespace is stripped.

Pre-tokenisation is SentencePiece-style (``Metaspace``): each space becomes ``▁`` and starts a new
word, so subwords never cross a word boundary yet decoding restores every space exactly. The paper
(and fairseq) instead ran the Moses tokenizer first, which splits punctuation off words and cannot be
undone; ``benchmarks/bench_data.py`` measures both (round-trip failures, tokens per sentence,
unknown-token rate) and records why this one was chosen. The BPE model falls back to the 256
``<0xNN>`` byte tokens for characters outside its alphabet, so ``decode(encode(s)) == normalize(s)``
holds for *every* string and BPE never emits ``<unk>``. WordPiece has no byte fallback: a word with
a character outside its alphabet becomes one ``<unk>`` (which decoding drops), so its round trip is
exact only for text whose characters it was trained on. WordPiece here marks word starts with
``▁`` instead of marking continuations with ``##`` so that it decodes losslessly the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vaswani_tx.data.tokenization_fairseq import FairseqTokenizer
from vaswani_tx.model.configuration_vaswani import VaswaniConfig
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.model.vocabulary import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    FORMAT_CHARACTERS,
    PAD_TOKEN_ID,
    UNK_TOKEN_ID,
    check_tokenizer_fits_model,
    vocabulary_fingerprint,
)
from vaswani_tx.text_io import iter_lines

if TYPE_CHECKING:
    import datasets

PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<unk>", "<s>", "</s>"
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, BOS_TOKEN, EOS_TOKEN)  # list order = ids 0, 1, 2, 3 (vocabulary.py's)
BYTE_TOKENS = tuple(f"<0x{byte:02X}>" for byte in range(256))  # the names ByteFallback decodes
WORD_BOUNDARY = "\u2581"

TokenizerKind = Literal["bpe", "wordpiece", "word"]
# Section 5.1; "word" (whole words, no subwords) is for small closed vocabularies such as the parser's.
DEFAULT_VOCAB_SIZE: dict[str, int] = {"bpe": 37_000, "wordpiece": 32_000, "word": 32_000}


def _format_character_removers() -> list[normalizers.Normalizer]:
    return [normalizers.Replace(character, "") for character in FORMAT_CHARACTERS]


def build_normalizer() -> normalizers.Normalizer:
    """The normalisation described in the module docstring, as a `tokenizers` normalizer."""
    return normalizers.Sequence(
        [
            *_format_character_removers(),
            normalizers.NFC(),
            normalizers.Replace(WORD_BOUNDARY, " "),
            normalizers.Replace(Regex(r"\s+"), " "),
            normalizers.Strip(),
        ]
    )


_NORMALIZER = build_normalizer()


def normalize(text: str) -> str:
    """What ``decode(encode(text))`` returns for a BPE tokenizer (and for WordPiece on known characters)."""
    return _NORMALIZER.normalize_str(text)


def _is_dataset(corpus: object) -> bool:
    # imported here: loading a model to translate checks its tokenizer with this module, without datasets
    import datasets

    return isinstance(corpus, datasets.Dataset)


def _corpus_batches(
    corpus: Sequence[str | os.PathLike] | datasets.Dataset, columns: Sequence[str]
) -> Iterator[list[str]]:
    """Batches of training text; both sides of a parallel corpus feed one joint vocabulary."""
    if _is_dataset(corpus):
        missing = [name for name in columns if name not in corpus.column_names]
        if missing:
            raise UserInputError(f"dataset has no column(s) {missing}; its columns are {corpus.column_names}")
        for batch in corpus.select_columns(list(columns)).iter(batch_size=10_000):
            for name in columns:
                yield batch[name]
        return
    for path in corpus:
        batch: list[str] = []
        for line in iter_lines(path):
            batch.append(line)
            if len(batch) == 10_000:
                yield batch
                batch = []
        if batch:
            yield batch


def _describe(corpus: Sequence[str | os.PathLike] | datasets.Dataset) -> str:
    if _is_dataset(corpus):
        return f"the dataset ({corpus.num_rows} rows)"
    return ", ".join(str(path) for path in corpus)


def train_tokenizer(
    corpus: Sequence[str | os.PathLike] | datasets.Dataset,
    kind: TokenizerKind = "bpe",
    vocab_size: int | None = None,
    *,
    min_frequency: int = 2,
    limit_alphabet: int = 1000,
    columns: Sequence[str] = ("source", "target"),
    show_progress: bool = True,
) -> PreTrainedTokenizerFast:
    """Learn one vocabulary shared by source and target (Section 5.1).

    Args:
        corpus: text files (one sentence per line; pass both sides, e.g. ``train.en`` and ``train.de``)
            or a ``datasets.Dataset`` whose ``columns`` hold the text.
        kind: ``"bpe"`` (the paper's EN-DE choice, default 37,000), ``"wordpiece"`` (EN-FR, 32,000) or
            ``"word"``: whole space-separated tokens, the ``vocab_size`` most frequent ones seen at least
            ``min_frequency`` times, any other ``<unk>``. For text whose tokens matter whole, such as the
            parser's linearised trees (``(NP``, ``)NP``, ``XX``: constrained decoding needs each to be one id).
        vocab_size: final size including the 4 special tokens (and BPE's 256 byte tokens).
        min_frequency: pairs seen fewer times are never merged.
        limit_alphabet: at most this many distinct characters enter the alphabet; rarer ones fall back
            to bytes (BPE) or ``<unk>`` (WordPiece), so one stray script cannot crowd out subwords.
        show_progress: the `tokenizers` progress bar on stderr.

    Raises:
        UserInputError: the corpus has no text, or ``vocab_size`` cannot hold the special tokens and the
            corpus alphabet.
    """
    if kind not in DEFAULT_VOCAB_SIZE:
        raise UserInputError(f"kind must be one of {sorted(DEFAULT_VOCAB_SIZE)}, got {kind!r}")
    vocab_size = DEFAULT_VOCAB_SIZE[kind] if vocab_size is None else vocab_size
    reserved = SPECIAL_TOKENS + (BYTE_TOKENS if kind == "bpe" else ())
    if vocab_size <= len(reserved):
        raise UserInputError(
            f"vocab_size={vocab_size} is smaller than the alphabet: {kind} reserves {len(reserved)} ids for "
            f"special{' and byte' if kind == 'bpe' else ''} tokens before any character"
        )

    if kind == "bpe":
        tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN, byte_fallback=True))
        # The byte tokens go in as trainer "special tokens" only to reserve ids 4..259; they are made
        # ordinary vocabulary below so that decode(skip_special_tokens=True) keeps them.
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            limit_alphabet=limit_alphabet,
            special_tokens=list(reserved),
            show_progress=show_progress,
        )
        tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace()])
    elif kind == "word":
        tokenizer = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
        trainer = trainers.WordLevelTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(reserved),
            show_progress=show_progress,
        )
    else:
        tokenizer = Tokenizer(models.WordPiece(unk_token=UNK_TOKEN, continuing_subword_prefix=""))
        trainer = trainers.WordPieceTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            limit_alphabet=limit_alphabet,
            special_tokens=list(reserved),
            continuing_subword_prefix="",
            show_progress=show_progress,
        )
        tokenizer.decoder = decoders.Metaspace()
    tokenizer.normalizer = build_normalizer()
    # whole words: split on whitespace, decoded joined by spaces (no decoder needed)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit() if kind == "word" else pre_tokenizers.Metaspace()

    lines_seen = 0

    def counted(batches: Iterable[list[str]]) -> Iterator[list[str]]:
        nonlocal lines_seen
        for batch in batches:
            lines_seen += sum(1 for line in batch if line.strip())
            yield batch

    tokenizer.train_from_iterator(counted(_corpus_batches(corpus, columns)), trainer=trainer)
    if lines_seen == 0:
        raise UserInputError(f"cannot train a vocabulary on an empty corpus: {_describe(corpus)} has no text")
    learned = tokenizer.get_vocab_size()
    if learned > vocab_size:
        # The trainers keep the whole alphabet even when it overflows vocab_size; refuse instead.
        characters = learned - len(reserved)
        raise UserInputError(
            f"vocab_size={vocab_size} is smaller than the alphabet of {_describe(corpus)}: "
            f"{len(reserved)} reserved tokens + {characters} characters need at least {learned}"
        )

    state = json.loads(tokenizer.to_str())
    state["added_tokens"] = [token for token in state["added_tokens"] if token["content"] in SPECIAL_TOKENS]
    tokenizer = Tokenizer.from_str(json.dumps(state))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}", pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, EOS_TOKEN_ID)]
    )
    return wrap_tokenizer(tokenizer)


def wrap_tokenizer(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers face of a trained `tokenizers.Tokenizer`, with the fixed special ids checked."""
    for token, expected in zip(SPECIAL_TOKENS, range(4)):
        actual = tokenizer.token_to_id(token)
        if actual != expected:
            raise UserInputError(f"special token {token} must have id {expected}, the tokenizer gives it {actual}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        # transformers' "clean up" deletes the space in "word ." and would break the lossless round trip
        clean_up_tokenization_spaces=False,
    )


def drop_format_characters_in(tokenizer):
    """Make a fast tokenizer drop U+FEFF, U+200B and U+2060 before its own normalisation (step 0 of the module
    docstring), in place, and return it: tokenizers trained before that step was part of `build_normalizer`, and
    those of other libraries, get it on loading (and keep it when saved again). A slow tokenizer (Marian's
    SentencePiece, `FairseqTokenizer`) is returned as it is: the commands and the pipeline drop the characters
    from the text before it sees them."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return tokenizer
    current = backend.normalizer
    if current is not None and current.normalize_str("".join(FORMAT_CHARACTERS)) == "":
        return tokenizer
    backend.normalizer = normalizers.Sequence([*_format_character_removers(), *([current] if current else [])])
    return tokenizer


def load_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by ``save_pretrained`` (``AutoTokenizer`` with a clear error for a wrong folder),
    dropping the format characters of step 0 (`drop_format_characters_in`)."""
    if not (Path(folder) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{folder} holds no tokenizer.json; create one with `vaswani-tx train-tokenizer`")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # a tokenizer.json tokenizers cannot read is a bare Exception, bad JSON a ValueError
        raise UserInputError(f"{folder} holds no tokenizer that AutoTokenizer can load ({err})") from err
    return drop_format_characters_in(tokenizer)


# converted fairseq and FSMT folders name FairseqTokenizer in tokenizer_config.json: found without remote code
AutoTokenizer.register(VaswaniConfig, tokenizer_class=FairseqTokenizer, exist_ok=True)

__all__ = [
    "BOS_TOKEN",
    "BOS_TOKEN_ID",
    "BYTE_TOKENS",
    "DEFAULT_VOCAB_SIZE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "PAD_TOKEN",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "UNK_TOKEN",
    "UNK_TOKEN_ID",
    "WORD_BOUNDARY",
    "TokenizerKind",
    "build_normalizer",
    "check_tokenizer_fits_model",
    "drop_format_characters_in",
    "load_tokenizer",
    "normalize",
    "train_tokenizer",
    "vocabulary_fingerprint",
    "wrap_tokenizer",
]
