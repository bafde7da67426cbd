"""Corpora, cleaning, tokenisation and token-budget batches (Section 5.1 of the paper).

The paper trains on WMT 2014 EN-DE (about 4.5M sentence pairs) and EN-FR (36M), and "sentence pairs
were batched together by approximate sequence length. Each training batch contained a set of sentence
pairs containing approximately 25000 source tokens and 25000 target tokens."

Every loader returns a ``datasets.Dataset`` with two string columns, ``source`` and ``target``:

- :func:`load_wmt14`: WMT14 from the Hugging Face Hub (``wmt/wmt14``), failing with a clear message offline;
- :func:`read_parallel_files`: line-aligned files such as ``train.en`` / ``train.de``;
- :func:`read_tsv` and :func:`read_jsonl`: one pair per line.

Local files are read strictly (UTF-8, split on ``\\n`` only, as ``wc -l`` counts), through
``Dataset.from_generator`` so the result is an Arrow file in the datasets cache; the cache key
includes each file's size and modification time, and every later ``map`` (tokenisation) is cached by
fingerprint on top of it, so running the same preparation twice reuses both.

:func:`clean_pairs` removes pairs by explicit, counted rules; :func:`tokenize_pairs` encodes both sides
with ``datasets.map``; :class:`TokenBudgetBatchSampler` forms the batches.

A pair longer than the token budget on its own cannot be batched: the sampler drops it, counts it in
``num_oversized`` and logs a warning, rather than failing a long run over a few long sentences
(fairseq's ``--skip-invalid-size-inputs-valid-test`` behaviour). :func:`clean_pairs` with a
``max_words`` limit is the place to remove such pairs up front.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from torch.utils.data import Sampler

from vaswani_tx.model.errors import UserInputError
from vaswani_tx.text_io import CorpusError, iter_lines  # callers import both from here too

# Beside a `vaswani-tx prepare-data` output: the tokenizer folder it was encoded with and that tokenizer's
# `vocabulary_fingerprint`, which `train` compares with its own tokenizer's.
PREPARED_DATA_RECORD = "vaswani_data.json"

logger = logging.getLogger(__name__)

WMT14_HUB_PATH = "wmt/wmt14"


# ---- reading (lines through vaswani_tx.text_io) ----


def _file_stamp(path: str | os.PathLike) -> tuple[str, int, int]:
    """Part of the datasets cache key: a file that changes gets a new cache."""
    stat = os.stat(path)
    return str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns


def _pairs_from_parallel_files(source_stamp: tuple, target_stamp: tuple) -> Iterator[dict[str, str]]:
    source_file, target_file = source_stamp[0], target_stamp[0]
    source_count = target_count = 0
    for source, target in zip_longest(iter_lines(source_file), iter_lines(target_file)):
        source_count += source is not None
        target_count += target is not None
        if source is not None and target is not None:
            yield {"source": source, "target": target}
    if source_count != target_count:
        raise CorpusError(
            f"misaligned parallel files: {source_file} has {source_count} lines, {target_file} has {target_count}"
        )
    if source_count == 0:
        raise CorpusError(f"empty corpus: {source_file} and {target_file} have no lines")


def _pairs_from_tsv(stamp: tuple) -> Iterator[dict[str, str]]:
    path, count = stamp[0], 0
    for count, line in enumerate(iter_lines(path), start=1):
        fields = line.split("\t")
        if len(fields) != 2:
            raise CorpusError(
                f"{path}, line {count}: expected 2 tab-separated fields (source, target), got {len(fields)}"
            )
        yield {"source": fields[0], "target": fields[1]}
    if count == 0:
        raise CorpusError(f"empty corpus: {path} has no lines")


def _pairs_from_jsonl(stamp: tuple, source_key: str, target_key: str) -> Iterator[dict[str, str]]:
    path, count = stamp[0], 0
    for count, line in enumerate(iter_lines(path), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}, line {count}: not JSON ({err.msg})") from None
        # Hub exports nest the pair as {"translation": {"en": ..., "de": ...}}
        record = record.get("translation", record) if isinstance(record, dict) else record
        if (
            not isinstance(record, dict)
            or not isinstance(record.get(source_key), str)
            or not isinstance(record.get(target_key), str)
        ):
            raise CorpusError(
                f"{path}, line {count}: expected an object with string fields {source_key!r} and {target_key!r}"
            )
        yield {"source": record[source_key], "target": record[target_key]}
    if count == 0:
        raise CorpusError(f"empty corpus: {path} has no lines")


def _from_generator(generator, gen_kwargs: dict[str, Any], cache_dir: str | os.PathLike | None) -> datasets.Dataset:
    features = datasets.Features({"source": datasets.Value("string"), "target": datasets.Value("string")})
    try:
        return datasets.Dataset.from_generator(
            generator,
            features=features,
            gen_kwargs=gen_kwargs,
            cache_dir=None if cache_dir is None else str(cache_dir),
        )
    except datasets.exceptions.DatasetGenerationError as err:
        # datasets wraps the reader's error in a generic one; the reader's names the file and line
        if isinstance(err.__cause__, CorpusError):
            raise err.__cause__ from None
        raise


def read_parallel_files(
    source_file: str | os.PathLike, target_file: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None
) -> datasets.Dataset:
    """Line-aligned files (line i of ``source_file`` translates line i of ``target_file``).

    Raises:
        CorpusError: a file is not UTF-8 (file and line named), the line counts differ, or both are empty.
    """
    for path in (source_file, target_file):
        if not Path(path).is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
    gen_kwargs = {"source_stamp": _file_stamp(source_file), "target_stamp": _file_stamp(target_file)}
    return _from_generator(_pairs_from_parallel_files, gen_kwargs, cache_dir)


def read_tsv(path: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> datasets.Dataset:
    """One ``source<TAB>target`` pair per line."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    return _from_generator(_pairs_from_tsv, {"stamp": _file_stamp(path)}, cache_dir)


def read_jsonl(
    path: str | os.PathLike,
    *,
    source_key: str = "source",
    target_key: str = "target",
    cache_dir: str | os.PathLike | None = None,
) -> datasets.Dataset:
    """One JSON object per line: ``{"source": ..., "target": ...}`` or, as the Hub exports WMT,
    ``{"translation": {"en": ..., "de": ...}}`` with ``source_key="en", target_key="de"``."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"corpus file not found: {path}")
    gen_kwargs = {"stamp": _file_stamp(path), "source_key": source_key, "target_key": target_key}
    return _from_generator(_pairs_from_jsonl, gen_kwargs, cache_dir)


def _translation_to_columns(batch: dict[str, list], source_lang: str, target_lang: str) -> dict[str, list[str]]:
    return {
        "source": [pair[source_lang] for pair in batch["translation"]],
        "target": [pair[target_lang] for pair in batch["translation"]],
    }


def load_wmt14(
    source_lang: str = "en",
    target_lang: str = "de",
    split: str = "train",
    *,
    cache_dir: str | os.PathLike | None = None,
    num_proc: int | None = None,
    local_files: str = "read_parallel_files('train.en', 'train.de'), read_tsv or read_jsonl",
) -> datasets.Dataset:
    """WMT 2014 from the Hugging Face Hub (``wmt/wmt14``): EN-DE and EN-FR are the paper's (Section 5.1).

    ``split`` is ``train``, ``validation`` (newstest2013, the paper's dev set) or ``test`` (newstest2014).
    ``local_files`` names what the caller takes instead (its own options, for a command), in the error
    raised without a network.

    Raises:
        UserInputError: a language pair without English, or a split WMT14 does not have.
        ConnectionError: the Hub cannot be reached and the data is not in the datasets cache.
    """
    other = {source_lang, target_lang} - {"en"}
    if len(other) != 1:
        raise UserInputError(f"WMT14 pairs English with one other language; got {source_lang!r} -> {target_lang!r}")
    if split.partition("[")[0] not in ("train", "validation", "test"):  # datasets' slices (train[:1%]) are fine
        raise UserInputError(
            f"WMT14 has the splits train, validation (newstest2013) and test (newstest2014); got {split!r}"
        )
    config = f"{other.pop()}-en"
    try:
        raw = datasets.load_dataset(WMT14_HUB_PATH, config, split=split, cache_dir=cache_dir, num_proc=num_proc)
    except ConnectionError as err:
        raise ConnectionError(
            f"could not load WMT14 {config} ({split}) from the Hugging Face Hub ({WMT14_HUB_PATH}): {err}. "
            f"Connect to the internet once (the datasets cache keeps it), or use local files instead: {local_files}."
        ) from err
    return raw.map(
        _translation_to_columns,
        batched=True,
        remove_columns=raw.column_names,
        fn_kwargs={"source_lang": source_lang, "target_lang": target_lang},
        num_proc=num_proc,
        desc="Selecting languages",
    )


# ---- cleaning ----


@dataclass
class CleaningReport:
    """How many pairs each rule removed; a pair is counted under the first rule it fails."""

    pairs_in: int
    removed: dict[str, int] = field(default_factory=dict)

    @property
    def pairs_out(self) -> int:
        return self.pairs_in - sum(self.removed.values())

    def __str__(self) -> str:
        lines = [f"pairs read: {self.pairs_in}"]
        lines += [f"  removed, {rule}: {count}" for rule, count in self.removed.items()]
        lines.append(f"pairs kept: {self.pairs_out}")
        return "\n".join(lines)


def clean_pairs(
    dataset: datasets.Dataset,
    *,
    min_words: int = 1,
    max_words: int | None = 250,
    max_length_ratio: float | None = 3.0,
    deduplicate: bool = True,
) -> tuple[datasets.Dataset, CleaningReport]:
    """Remove pairs by explicit rules, in this order, and count each.

    1. ``empty``: either side is empty or only whitespace;
    2. ``length``: either side has fewer than ``min_words`` or more than ``max_words`` words;
    3. ``length ratio``: the longer side has more than ``max_length_ratio`` times the words of the shorter;
    4. ``duplicate``: the exact (source, target) pair appeared earlier (the first copy is kept).

    Words are whitespace-separated, since cleaning runs before a vocabulary exists. ``max_words=250``
    is fairseq's WMT14 EN-DE preparation (``clean-corpus-n.perl ... 1 250``). Its ``-ratio 1.5`` counts
    BPE tokens; on words it removes 888 of Multi30k's 29,000 human translations, while 3.0 removes
    the 2 pairs whose German side is the placeholder ``@@``, hence the default. ``None`` switches a
    rule off.
    """
    if min_words < 0 or (max_words is not None and max_words < min_words):
        raise UserInputError(f"need 0 <= min_words <= max_words, got min_words={min_words}, max_words={max_words}")
    if max_length_ratio is not None and max_length_ratio < 1:
        raise UserInputError(f"max_length_ratio is longer/shorter and must be >= 1, got {max_length_ratio}")
    removed = {"empty": 0, "length": 0, "length ratio": 0}
    if deduplicate:
        removed["duplicate"] = 0
    seen: set[tuple[str, str]] = set()
    keep: list[int] = []
    index = 0
    for batch in dataset.select_columns(["source", "target"]).iter(batch_size=10_000):
        for source, target in zip(batch["source"], batch["target"]):
            source_words, target_words = len(source.split()), len(target.split())
            if source_words == 0 or target_words == 0:
                removed["empty"] += 1
            elif min(source_words, target_words) < min_words or (
                max_words is not None and max(source_words, target_words) > max_words
            ):
                removed["length"] += 1
            elif max_length_ratio is not None and max(source_words, target_words) > max_length_ratio * min(
                source_words, target_words
            ):
                removed["length ratio"] += 1
            elif deduplicate and (source, target) in seen:
                removed["duplicate"] += 1
            else:
                if deduplicate:
                    seen.add((source, target))
                keep.append(index)
            index += 1
    report = CleaningReport(pairs_in=index, removed=removed)
    if not keep:
        raise CorpusError(f"empty corpus after cleaning:\n{report}")
    return dataset.select(keep), report


# ---- tokenisation ----


def _encode_batch(batch: dict[str, list[str]], tokenizer) -> dict[str, list[list[int]]]:
    return dict(tokenizer(batch["source"], text_target=batch["target"]))


def tokenize_pairs(
    dataset: datasets.Dataset, tokenizer, *, num_proc: int | None = None, batch_size: int = 1000
) -> datasets.Dataset:
    """``input_ids``, ``attention_mask`` and ``labels`` (each ending in ``</s>``) through ``datasets.map``.

    Batched, optionally over ``num_proc`` processes, and cached by fingerprint: a second call on the
    same (file-backed) dataset with the same tokenizer loads the cached Arrow file instead of encoding.
    """
    return dataset.map(
        _encode_batch,
        batched=True,
        batch_size=batch_size,
        num_proc=num_proc,
        fn_kwargs={"tokenizer": tokenizer},
        remove_columns=dataset.column_names,
        desc="Tokenizing",
    )


def sequence_lengths(dataset: datasets.Dataset, column: str) -> np.ndarray:
    """Lengths of a list column, read from Arrow without building Python lists."""
    lists = dataset.with_format("arrow")[column]
    return pc.list_value_length(lists).to_numpy(zero_copy_only=False).astype(np.int64)


# ---- token-budget batches ----


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Length-grouped batches of at most ``max_tokens`` source and ``max_tokens`` target tokens (Section 5.1).

    Tokens are counted with padding, as fairseq's ``--max-tokens``: a batch of ``n`` pairs costs
    ``n * longest source`` and ``n * longest target`` (each rounded up to ``pad_to_multiple_of`` when the
    collator pads that way). Each epoch the pairs are shuffled from ``(seed, epoch)``, sorted by source
    then target length (so equal lengths land in random order), packed greedily, and the batches are
    shuffled. The sorted length sequence is the same in every epoch, so the number of batches is too.

    Distributed: every rank builds the same global list and takes ``batches[rank::num_replicas]``. To
    give every rank the same number of batches (DDP hangs otherwise) the largest batches are split in
    two until the count divides evenly; splitting never adds tokens and keeps every pair exactly once.
    Only if every batch is a single pair is the remainder dropped (counted in ``num_dropped``). With
    ``accumulation`` (the optimizer step's gradient-accumulation batches) the count is made to divide by
    ``num_replicas * accumulation``, so that P processes and one process accumulating P batches split alike
    and take the same optimizer steps.

    Pairs longer than the budget alone are dropped and counted in ``num_oversized`` (module docstring).

    Call :meth:`set_epoch` before each epoch, as with ``DistributedSampler``; :meth:`state_dict` and
    :meth:`load_state_dict` resume mid-epoch. The state counts batches handed out by the sampler, which
    equals batches consumed for a ``DataLoader`` with ``num_workers=0``; with workers, it runs ahead by
    the prefetched batches.
    """

    def __init__(
        self,
        source_lengths: Sequence[int] | np.ndarray,
        target_lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        pad_to_multiple_of: int | None = None,
        accumulation: int = 1,
    ) -> None:
        if accumulation < 1:
            raise ValueError(f"accumulation must be >= 1, got {accumulation}")
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens <= 0:
            raise UserInputError(f"max_tokens must be a positive number of tokens per batch, got {max_tokens!r}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1 or None, got {pad_to_multiple_of}")
        source = np.asarray(source_lengths, dtype=np.int64)
        target = np.asarray(target_lengths, dtype=np.int64)
        if source.shape != target.shape or source.ndim != 1:
            raise ValueError(f"need one source and one target length per pair, got {source.shape} and {target.shape}")
        if source.size == 0:
            raise CorpusError("empty corpus: no pairs to batch")
        if pad_to_multiple_of:
            source = -(-source // pad_to_multiple_of) * pad_to_multiple_of
            target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
        self.source_lengths, self.target_lengths = source, target
        self.max_tokens = int(max_tokens)
        self.shuffle, self.seed = shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self.pad_to_multiple_of = pad_to_multiple_of
        self.accumulation = accumulation

        oversized = (source > self.max_tokens) | (target > self.max_tokens)
        self.oversized_indices = np.flatnonzero(oversized)
        self._batchable = np.flatnonzero(~oversized)
        if self.num_oversized:
            logger.warning(
                "dropping %d of %d pairs longer than max_tokens=%d on their own",
                self.num_oversized,
                source.size,
                self.max_tokens,
            )
        if self._batchable.size < num_replicas:
            raise CorpusError(
                f"{self._batchable.size} pairs fit max_tokens={self.max_tokens}: too few for {num_replicas} ranks"
            )
        self.num_dropped = 0
        self.epoch = 0
        self._cache: tuple[int, list[np.ndarray]] | None = None
        self._resume_at = 0
        self._yielded = 0

    @classmethod
    def from_dataset(
        cls,
        dataset: datasets.Dataset,
        max_tokens: int,
        *,
        source_column: str = "input_ids",
        target_column: str = "labels",
        **kwargs: Any,
    ) -> TokenBudgetBatchSampler:
        """Read the lengths from a tokenized dataset (see :func:`tokenize_pairs`)."""
        return cls(
            sequence_lengths(dataset, source_column), sequence_lengths(dataset, target_column), max_tokens, **kwargs
        )

    @property
    def num_oversized(self) -> int:
        return int(self.oversized_indices.size)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._resume_at = 0
        self.epoch = epoch

    def _pack(self, order: np.ndarray) -> list[list[int]]:
        batches: list[list[int]] = []
        current: list[int] = []
        longest_source = longest_target = 0
        budget = self.max_tokens
        sources, targets = self.source_lengths[order].tolist(), self.target_lengths[order].tolist()
        for index, source, target in zip(order.tolist(), sources, targets):
            new_source, new_target = max(longest_source, source), max(longest_target, target)
            size = len(current) + 1
            if current and (size * new_source > budget or size * new_target > budget):
                batches.append(current)
                current, longest_source, longest_target = [index], source, target
            else:
                current.append(index)
                longest_source, longest_target = new_source, new_target
        if current:
            batches.append(current)
        return batches

    def _equal_shares(self, batches: list[list[int]]) -> list[list[int]]:
        """Split the largest batches in two until every rank can get the same number."""
        short = -len(batches) % (self.num_replicas * self.accumulation)
        largest = [(-len(batch), i) for i, batch in enumerate(batches) if len(batch) > 1]
        heapq.heapify(largest)
        while short and largest:
            _, i = heapq.heappop(largest)
            half = len(batches[i]) // 2
            batches[i], tail = batches[i][:half], batches[i][half:]
            batches.append(tail)
            for j in (i, len(batches) - 1):
                if len(batches[j]) > 1:
                    heapq.heappush(largest, (-len(batches[j]), j))
            short -= 1
        if short:  # every batch is one pair: drop the remainder (the longest pairs, packed last)
            self.num_dropped = len(batches) % self.num_replicas  # equal shares are what DDP needs
            batches = batches[: len(batches) - self.num_dropped]
        return batches

    def _global_batches(self) -> list[list[int]]:
        """The batches of every rank for the current epoch, identical on every rank."""
        if self._cache is not None and self._cache[0] == self.epoch:
            return self._cache[1]
        self.num_dropped = 0
        order = self._batchable
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.shuffle:
            order = rng.permutation(order)
        # two stable sorts = sort by (source, target) with the shuffle breaking ties
        order = order[np.argsort(self.target_lengths[order], kind="stable")]
        order = order[np.argsort(self.source_lengths[order], kind="stable")]
        batches = self._equal_shares(self._pack(order))
        if self.shuffle:
            batches = [batches[i] for i in rng.permutation(len(batches))]
        self._cache = (self.epoch, batches)
        return batches

    def batches(self) -> list[list[int]]:
        """This rank's batches for the current epoch, from the start (ignores a resume position)."""
        return self._global_batches()[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return len(self._global_batches()) // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        own = self.batches()
        start, self._resume_at = self._resume_at, 0
        self._yielded = start
        for batch in own[start:]:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batches_yielded": self._yielded,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "num_pairs": int(self.source_lengths.size),
            "num_replicas": self.num_replicas,
            "rank": self.rank,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue the saved epoch after its last handed-out batch; the next ``iter`` starts there."""
        mine = self.state_dict()
        for key in ("seed", "max_tokens", "num_pairs", "num_replicas", "rank"):
            if state[key] != mine[key]:
                raise UserInputError(f"cannot resume: saved {key}={state[key]}, this sampler has {key}={mine[key]}")
        self.epoch = int(state["epoch"])
        self._resume_at = self._yielded = int(state["batches_yielded"])
