"""Corpora, counted cleaning, cached tokenisation, and the token-budget batch sampler (Section 5.1)."""

from __future__ import annotations

import logging
import math
import os

import datasets
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, MarianConfig, MarianMTModel, Seq2SeqTrainingArguments

from vaswani_tx.data import data
from vaswani_tx.data.data import CorpusError, TokenBudgetBatchSampler, clean_pairs, tokenize_pairs
from vaswani_tx.data.tokenization import EOS_TOKEN_ID, train_tokenizer
from vaswani_tx.training.training import TokenBudgetSeq2SeqTrainer


@pytest.fixture(scope="module")
def val_files(shared_data):
    return shared_data / "multi30k-en-de/val.en", shared_data / "multi30k-en-de/val.de"


@pytest.fixture(scope="module")
def tokenizer(val_files):
    return train_tokenizer(list(val_files), "bpe", 700, show_progress=False)


@pytest.fixture(scope="module")
def encoded_val(val_files, tokenizer, tmp_path_factory):
    pairs = data.read_parallel_files(*val_files, cache_dir=tmp_path_factory.mktemp("cache"))
    return tokenize_pairs(pairs, tokenizer)


def _write(path, text: str | bytes):
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


# ---- reading ----


def test_read_parallel_files(val_files, tmp_path):
    pairs = data.read_parallel_files(*val_files, cache_dir=tmp_path)
    assert pairs.column_names == ["source", "target"] and pairs.num_rows == 1014
    assert pairs[0] == {"source": next(data.iter_lines(val_files[0])), "target": next(data.iter_lines(val_files[1]))}


def test_misaligned_files(tmp_path):
    source = _write(tmp_path / "train.en", "a\nb\nc\n")
    target = _write(tmp_path / "train.de", "a\nb\n")
    with pytest.raises(CorpusError, match=r"misaligned parallel files: .*train\.en has 3 lines, .*train\.de has 2"):
        data.read_parallel_files(source, target, cache_dir=tmp_path / "cache")


def test_empty_parallel_files(tmp_path):
    source, target = _write(tmp_path / "e.en", ""), _write(tmp_path / "e.de", "")
    with pytest.raises(CorpusError, match=r"empty corpus: .*e\.en and .*e\.de have no lines"):
        data.read_parallel_files(source, target, cache_dir=tmp_path / "cache")


def test_undecodable_bytes_in_parallel_file(tmp_path):
    source = _write(tmp_path / "x.en", "one\ntwo\n")
    target = _write(tmp_path / "x.de", b"eins\nzw\xff\n")
    with pytest.raises(CorpusError, match=r"x\.de, line 2: not valid UTF-8 \(byte 0xff at column 3\)"):
        data.read_parallel_files(source, target, cache_dir=tmp_path / "cache")


def test_one_line_reader_for_corpora_and_test_sets(tmp_path):
    """Corpora and scored files split at \\n only, drop a Windows \\r and the byte-order mark that starts a file
    (a U+FEFF elsewhere is text, which the tokenizers drop); a corpus keeps trailing whitespace (a TSV's empty
    last field), a test set strips it as sacreBLEU does."""
    from vaswani_tx.metrics.evaluation import read_lines

    path = _write(tmp_path / "x.txt", "\ufeffeins\r\nzwei\u2028drei \t\n\ufeff\nvier".encode())
    assert list(data.iter_lines(path)) == ["eins", "zwei\u2028drei \t", "\ufeff", "vier"]
    assert read_lines(path) == ["eins", "zwei\u2028drei", "\ufeff", "vier"]
    _write(path, b"gut\nsch\xf6n\n")
    for read in (data.iter_lines, read_lines):
        with pytest.raises(CorpusError, match=r"x\.txt, line 2: not valid UTF-8 \(byte 0xf6 at column 4\)"):
            list(read(path))


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"corpus file not found: .*nope\.en"):
        data.read_parallel_files(tmp_path / "nope.en", tmp_path / "nope.de")


def test_lines_split_on_newline_only(tmp_path):
    # a lone \r or U+2028 inside a line must not shift the alignment
    source = _write(tmp_path / "s.en", "a\rb\nc\u2028d\r\n")
    target = _write(tmp_path / "s.de", "x\ny\n")
    pairs = data.read_parallel_files(source, target, cache_dir=tmp_path / "cache")
    assert pairs["source"] == ["a\rb", "c\u2028d"]


def test_tsv(tmp_path):
    good = _write(tmp_path / "p.tsv", "Hello.\tHallo.\nYes\tJa\n")
    assert data.read_tsv(good, cache_dir=tmp_path / "cache").to_dict() == {
        "source": ["Hello.", "Yes"],
        "target": ["Hallo.", "Ja"],
    }
    bad = _write(tmp_path / "bad.tsv", "a\tb\na\tb\tc\n")
    with pytest.raises(
        CorpusError, match=r"bad\.tsv, line 2: expected 2 tab-separated fields \(source, target\), got 3"
    ):
        data.read_tsv(bad, cache_dir=tmp_path / "cache")
    with pytest.raises(CorpusError, match=r"empty corpus: .*none\.tsv has no lines"):
        data.read_tsv(_write(tmp_path / "none.tsv", ""), cache_dir=tmp_path / "cache")


def test_jsonl(tmp_path):
    flat = _write(tmp_path / "f.jsonl", '{"source": "Hi", "target": "Salut"}\n')
    assert data.read_jsonl(flat, cache_dir=tmp_path / "cache")[0] == {"source": "Hi", "target": "Salut"}
    nested = _write(tmp_path / "n.jsonl", '{"translation": {"de": "Hallo", "en": "Hello"}}\n')
    assert data.read_jsonl(nested, source_key="en", target_key="de", cache_dir=tmp_path / "cache")[0] == {
        "source": "Hello",
        "target": "Hallo",
    }
    bad = _write(tmp_path / "b.jsonl", '{"source": "a", "target": "b"}\n{"source": "a"\n')
    with pytest.raises(CorpusError, match=r"b\.jsonl, line 2: not JSON"):
        data.read_jsonl(bad, cache_dir=tmp_path / "cache")
    with pytest.raises(CorpusError, match=r"f\.jsonl, line 1: expected an object with string fields 'en' and 'de'"):
        data.read_jsonl(flat, source_key="en", target_key="de", cache_dir=tmp_path / "cache")


def test_wmt14_uses_the_hub_and_selects_the_direction(monkeypatch):
    calls = []

    def fake_load_dataset(path, name, **kwargs):
        calls.append((path, name, kwargs["split"]))
        return datasets.Dataset.from_dict({"translation": [{"de": "Hallo Welt", "en": "Hello world"}]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert data.load_wmt14("en", "de", "validation")[0] == {"source": "Hello world", "target": "Hallo Welt"}
    assert data.load_wmt14("de", "en")[0] == {"source": "Hallo Welt", "target": "Hello world"}
    assert calls == [("wmt/wmt14", "de-en", "validation"), ("wmt/wmt14", "de-en", "train")]
    with pytest.raises(ValueError, match=r"WMT14 pairs English with one other language; got 'de' -> 'fr'"):
        data.load_wmt14("de", "fr")


def test_wmt14_offline_error_is_clear(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # fail at once instead of retrying DNS
    with pytest.raises(
        ConnectionError,
        match=r"could not load WMT14 fr-en \(train\) from the Hugging Face Hub \(wmt/wmt14\).*use local files",
    ):
        data.load_wmt14("en", "fr", cache_dir=None)


# ---- cleaning ----


def test_cleaning_counts_each_rule():
    pairs = datasets.Dataset.from_dict(
        {
            "source": ["a b", "", "a b c d e", "one", "a b", "x y", "  ", "ok"],
            "target": ["c d", "x", "v", "one two three four", "c d", "u v", "y", "ok"],
        }
    )
    kept, report = clean_pairs(pairs, max_words=4, max_length_ratio=3.0)
    assert report.removed == {"empty": 2, "length": 1, "length ratio": 1, "duplicate": 1}
    assert (report.pairs_in, report.pairs_out) == (8, 3)
    assert kept["source"] == ["a b", "x y", "ok"]
    assert "removed, length ratio: 1" in str(report) and "pairs kept: 3" in str(report)
    _, loose = clean_pairs(pairs, max_words=None, max_length_ratio=None, deduplicate=False)
    assert loose.removed == {"empty": 2, "length": 0, "length ratio": 0}


def test_cleaning_multi30k_train(shared_data, tmp_path):
    pairs = data.read_parallel_files(
        shared_data / "multi30k-en-de/train.en", shared_data / "multi30k-en-de/train.de", cache_dir=tmp_path
    )
    kept, report = clean_pairs(pairs)
    # the two pairs whose German side is the placeholder "@@", and three repeated captions
    assert report.removed == {"empty": 0, "length": 0, "length ratio": 2, "duplicate": 3}
    assert "@@" not in kept["target"]


def test_cleaning_everything_away_is_an_error():
    pairs = datasets.Dataset.from_dict({"source": [""], "target": ["x"]})
    with pytest.raises(CorpusError, match=r"empty corpus after cleaning:\npairs read: 1\n  removed, empty: 1"):
        clean_pairs(pairs)


def test_cleaning_rejects_bad_limits():
    pairs = datasets.Dataset.from_dict({"source": ["a"], "target": ["b"]})
    with pytest.raises(ValueError, match=r"max_length_ratio is longer/shorter and must be >= 1, got 0.5"):
        clean_pairs(pairs, max_length_ratio=0.5)
    with pytest.raises(ValueError, match=r"min_words=5, max_words=2"):
        clean_pairs(pairs, min_words=5, max_words=2)


# ---- tokenisation ----


def test_tokenize_pairs_columns_and_convention(encoded_val, tokenizer, val_files):
    assert set(encoded_val.column_names) == {"input_ids", "attention_mask", "labels"}
    first = encoded_val[0]
    assert first["input_ids"][-1] == EOS_TOKEN_ID and first["labels"][-1] == EOS_TOKEN_ID
    assert tokenizer.decode(first["labels"], skip_special_tokens=True) == next(data.iter_lines(val_files[1]))
    lengths = data.sequence_lengths(encoded_val, "labels")
    assert lengths.tolist() == [len(ids) for ids in encoded_val["labels"]]


def test_tokenize_is_cached_and_num_proc_agrees(val_files, tokenizer, tmp_path):
    pairs = data.read_parallel_files(*val_files, cache_dir=tmp_path).select(range(300))
    first = tokenize_pairs(pairs, tokenizer, num_proc=2)
    files = [entry["filename"] for entry in first.cache_files]
    assert len(files) == 2 and all(name.startswith(str(tmp_path)) for name in files)
    stamps = [(name, os.stat(name).st_mtime_ns) for name in files]
    again = tokenize_pairs(
        data.read_parallel_files(*val_files, cache_dir=tmp_path).select(range(300)), tokenizer, num_proc=2
    )
    assert [(name, os.stat(name).st_mtime_ns) for name in (e["filename"] for e in again.cache_files)] == stamps
    single = tokenize_pairs(pairs, tokenizer)
    assert single["labels"] == first["labels"] and single["input_ids"] == first["input_ids"]


# ---- the sampler ----


def _lengths(n: int = 3000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    source = rng.integers(1, 120, size=n)
    target = np.clip(source + rng.integers(-10, 20, size=n), 1, None)
    return source, target


def _padded_cost(batch, source, target, multiple=1):
    pad = lambda length: math.ceil(length / multiple) * multiple  # noqa: E731
    return len(batch) * pad(max(source[batch])), len(batch) * pad(max(target[batch]))


@pytest.mark.parametrize("multiple", [1, 8])
def test_sampler_never_exceeds_the_budget_and_covers_every_pair(multiple):
    source, target = _lengths()
    sampler = TokenBudgetBatchSampler(source, target, 1000, pad_to_multiple_of=multiple if multiple > 1 else None)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler)
        for batch in batches:
            assert max(_padded_cost(batch, source, target, multiple)) <= 1000
        assert sorted(i for batch in batches for i in batch) == list(range(len(source)))
        # packing is tight: the budget is mostly used, not just respected
        assert np.mean([max(_padded_cost(b, source, target, multiple)) for b in batches]) > 800


def test_sampler_same_seed_same_batches_and_epochs_differ():
    source, target = _lengths()
    first, second = (
        TokenBudgetBatchSampler(source, target, 1000, seed=7),
        TokenBudgetBatchSampler(source, target, 1000, seed=7),
    )
    assert list(first) == list(second)
    epoch0 = list(first)
    first.set_epoch(1)
    assert list(first) != epoch0
    first.set_epoch(0)
    assert list(first) == epoch0
    assert list(TokenBudgetBatchSampler(source, target, 1000, seed=8)) != epoch0


def test_sampler_without_shuffle_is_length_sorted():
    source, target = _lengths()
    batches = list(TokenBudgetBatchSampler(source, target, 1000, shuffle=False))
    longest = [max(source[batch]) for batch in batches]
    assert longest == sorted(longest)


@pytest.mark.parametrize("world", [2, 3])
def test_sampler_ranks_get_disjoint_equal_shares(world):
    source, target = _lengths(2999)
    shares = []
    for rank in range(world):
        sampler = TokenBudgetBatchSampler(source, target, 1000, num_replicas=world, rank=rank, seed=3)
        sampler.set_epoch(5)
        shares.append(list(sampler))
    assert len({len(share) for share in shares}) == 1
    seen = [i for share in shares for batch in share for i in batch]
    assert sorted(seen) == list(range(len(source)))  # disjoint and complete
    for share in shares:
        assert all(max(_padded_cost(batch, source, target)) <= 1000 for batch in share)


def test_sampler_splits_a_batch_to_make_shares_equal():
    # 3 equal pairs, budget for 2: batches [2 pairs, 1 pair]; 2 ranks need an even count -> no split
    # needed; with 3 ranks one batch is split so every rank gets one.
    source = target = np.array([10, 10, 10])
    shares = [list(TokenBudgetBatchSampler(source, target, 20, num_replicas=3, rank=rank)) for rank in range(3)]
    assert [len(share) for share in shares] == [1, 1, 1]
    assert sorted(i for share in shares for batch in share for i in batch) == [0, 1, 2]


@pytest.mark.parametrize("world", [2, 3])
def test_one_process_accumulating_p_batches_gets_the_batches_of_p_processes(world):
    """`accumulation` splits batches as P ranks would, so that one process accumulating P batches a step and P
    processes take the same optimizer steps (the distributed tests compare the two runs' losses and weights)."""
    for pairs in (23, 24, 25):  # a batch count that P divides, and ones it does not
        source, target = _lengths()
        source, target = source[:pairs], target[:pairs]
        one = list(TokenBudgetBatchSampler(source, target, 100, seed=5, accumulation=world))
        ranks = [
            list(TokenBudgetBatchSampler(source, target, 100, seed=5, num_replicas=world, rank=r))
            for r in range(world)
        ]
        assert len(one) % world == 0
        steps = [[share[step] for share in ranks] for step in range(len(ranks[0]))]
        assert [one[world * step : world * (step + 1)] for step in range(len(steps))] == steps


def test_sampler_drops_remainder_only_when_no_batch_can_split():
    source = target = np.array([10, 10, 10])
    samplers = [TokenBudgetBatchSampler(source, target, 10, num_replicas=2, rank=rank) for rank in range(2)]
    shares = [list(sampler) for sampler in samplers]
    assert [len(share) for share in shares] == [1, 1] and samplers[0].num_dropped == 1


def test_sampler_resumes_mid_epoch():
    source, target = _lengths()
    sampler = TokenBudgetBatchSampler(source, target, 1000, seed=11, num_replicas=2, rank=1)
    sampler.set_epoch(3)
    full = list(sampler)
    iterator = iter(sampler)
    consumed = [next(iterator) for _ in range(5)]
    state = sampler.state_dict()
    assert state["epoch"] == 3 and state["batches_yielded"] == 5
    restored = TokenBudgetBatchSampler(source, target, 1000, seed=11, num_replicas=2, rank=1)
    restored.load_state_dict(state)
    restored.set_epoch(3)  # what a training loop calls on resume; must keep the position
    assert consumed + list(restored) == full
    assert list(restored) == full  # the following pass starts the epoch from the top


def test_sampler_refuses_a_state_from_another_setup():
    source, target = _lengths()
    state = TokenBudgetBatchSampler(source, target, 1000, seed=1).state_dict()
    with pytest.raises(ValueError, match=r"cannot resume: saved seed=1, this sampler has seed=2"):
        TokenBudgetBatchSampler(source, target, 1000, seed=2).load_state_dict(state)


def test_sampler_drops_and_counts_oversized_pairs(caplog):
    source = np.array([5, 50, 5, 5, 8])
    target = np.array([5, 5, 5, 70, 8])
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.data.data"):
        sampler = TokenBudgetBatchSampler(source, target, 40)
    assert sampler.num_oversized == 2 and sampler.oversized_indices.tolist() == [1, 3]
    assert "dropping 2 of 5 pairs longer than max_tokens=40" in caplog.text
    assert sorted(i for batch in sampler for i in batch) == [0, 2, 4]


@pytest.mark.parametrize("max_tokens", [0, -5, 2.5])
def test_sampler_rejects_bad_budget(max_tokens):
    with pytest.raises(
        ValueError, match=rf"max_tokens must be a positive number of tokens per batch, got {max_tokens}"
    ):
        TokenBudgetBatchSampler([1], [1], max_tokens)


def test_sampler_rejects_bad_setup():
    with pytest.raises(ValueError, match=r"one source and one target length per pair"):
        TokenBudgetBatchSampler([1, 2], [1], 10)
    with pytest.raises(CorpusError, match="empty corpus: no pairs to batch"):
        TokenBudgetBatchSampler([], [], 10)
    with pytest.raises(ValueError, match=r"need 0 <= rank < num_replicas, got rank=2, num_replicas=2"):
        TokenBudgetBatchSampler([1], [1], 10, num_replicas=2, rank=2)


def test_sampler_in_a_plain_dataloader(encoded_val, tokenizer):
    sampler = TokenBudgetBatchSampler.from_dataset(encoded_val, 600, pad_to_multiple_of=8)
    loader = DataLoader(
        encoded_val, batch_sampler=sampler, collate_fn=DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8)
    )
    rows = 0
    for batch in loader:
        assert batch["input_ids"].numel() <= 600 and batch["labels"].numel() <= 600
        rows += batch["input_ids"].shape[0]
    assert rows == encoded_val.num_rows


def test_trainer_subclass_trains_on_token_budget_batches(encoded_val, tokenizer, tmp_path):
    torch.manual_seed(0)
    config = MarianConfig(
        vocab_size=len(tokenizer),
        d_model=24,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=3,
        decoder_attention_heads=3,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=3,
        bos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
    )
    model = MarianMTModel(config)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model)
    shapes = []

    def recording_collator(features):
        batch = collator(features)
        shapes.append((batch["input_ids"].numel(), batch["labels"].numel()))
        return batch

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        seed=0,
    )
    trainer = TokenBudgetSeq2SeqTrainer(
        model=model,
        args=args,
        train_dataset=encoded_val,
        eval_dataset=encoded_val.select(range(120)),
        data_collator=recording_collator,
        processing_class=tokenizer,
        max_tokens=300,
        eval_max_tokens=500,
    )
    assert len(trainer.get_train_dataloader()) == len(TokenBudgetBatchSampler.from_dataset(encoded_val, 300))
    shapes.clear()
    result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    assert len(shapes) >= 3 and all(max(shape) <= 300 for shape in shapes)
    shapes.clear()
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"])
    assert all(max(shape) <= 500 for shape in shapes) and len(shapes) < 120 / 8  # fewer, fuller batches
    with pytest.raises(ValueError, match=r"max_tokens must be a positive number of tokens per batch, got 0"):
        TokenBudgetSeq2SeqTrainer(model=model, args=args, train_dataset=encoded_val, max_tokens=0)
