"""Reading UTF-8 text one line at a time: the one reader behind corpora, test sets and vocabularies.

Lines end at ``\\n`` only, as ``wc -l`` counts them (``str.splitlines`` would also break at U+2028,
U+0085 and friends and misalign a parallel corpus); a final ``\\n`` ends the last line rather than
starting an empty one; a Windows ``\\r`` before the ``\\n`` is dropped; a byte-order mark at the start of
the file (U+FEFF, as Windows editors write it) is the encoding's signature, not text, and is dropped
(Python's ``utf-8-sig``); anywhere else U+FEFF is a character like any other, which the tokenizers drop
(``vaswani_tx.model.vocabulary.drop_format_characters``). Bytes that are not UTF-8 raise :class:`CorpusError`
naming the file, the line and the byte.

Light on purpose (no ``datasets``, no torch): ``vaswani_tx.data.data`` reads corpora through it and
``vaswani_tx.metrics.evaluation`` reads hypotheses and references through it.
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Iterable, Iterator

from vaswani_tx.model.errors import UserInputError


class CorpusError(UserInputError):
    """Bad corpus input; the message names the file and line or the value."""


def decode_lines(lines: Iterable[bytes], name: str) -> Iterator[str]:
    """Decode ``\\n``-terminated byte lines (a file or ``sys.stdin.buffer`` opened in binary mode) strictly
    as UTF-8, without their ``\\n`` and trailing ``\\r`` and without a byte-order mark that starts the first;
    ``name`` labels errors."""
    for number, raw in enumerate(lines, start=1):
        if number == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise CorpusError(
                f"{name}, line {number}: not valid UTF-8 (byte {raw[err.start]:#04x} at column {err.start + 1})"
            ) from None
        yield line.rstrip("\n").rstrip("\r")


def iter_lines(path: str | os.PathLike) -> Iterator[str]:
    """Lines of a UTF-8 text file, read as the module docstring says (streamed: any size fits)."""
    if os.path.isdir(path):
        raise CorpusError(f"{path} is a folder, not a text file")
    with open(path, "rb") as handle:
        yield from decode_lines(handle, str(path))


__all__ = ["CorpusError", "decode_lines", "iter_lines"]
