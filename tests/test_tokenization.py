"""Shared vocabularies (Section 5.1): fixed special ids, lossless round trips on the real files, bad input."""

from __future__ import annotations

from types import SimpleNamespace

import datasets
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from vaswani_tx.data.data import CorpusError, iter_lines
from vaswani_tx.data.tokenization import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    UNK_TOKEN_ID,
    check_tokenizer_fits_model,
    normalize,
    train_tokenizer,
)

# every EN-DE and EN-FR file of ../shared/data (dev.en is the same file in both newstest folders)
SHARED_TEXT = (
    "newstest2013-en-de/dev.en",
    "newstest2013-en-de/dev.de",
    "newstest2013-en-fr/dev.en",
    "newstest2013-en-fr/dev.fr",
    "multi30k-en-de/train.en",
    "multi30k-en-de/train.de",
    "multi30k-en-de/val.en",
    "multi30k-en-de/val.de",
)
TRAINING_TEXT = [name for name in SHARED_TEXT if not name.startswith("newstest2013-en-fr/dev.en")]


@pytest.fixture(scope="module")
def joint_tokenizers(shared_data, tmp_path_factory):
    """BPE and WordPiece learned on all the shared text, each saved and reloaded with AutoTokenizer."""
    loaded = {}
    for kind in ("bpe", "wordpiece"):
        trained = train_tokenizer([shared_data / name for name in TRAINING_TEXT], kind, 4000, show_progress=False)
        folder = tmp_path_factory.mktemp(kind)
        trained.save_pretrained(folder)
        loaded[kind] = AutoTokenizer.from_pretrained(folder)
    return loaded


@pytest.fixture(scope="module")
def small_bpe(shared_data):
    """BPE learned on Multi30k val only: newstest2013 then holds characters it never saw."""
    return train_tokenizer(
        [shared_data / "multi30k-en-de/val.en", shared_data / "multi30k-en-de/val.de"], "bpe", 700, show_progress=False
    )


def _round_trip_failures(tokenizer, lines: list[str]) -> list[tuple[int, str, str]]:
    decoded = tokenizer.batch_decode(tokenizer(lines)["input_ids"], skip_special_tokens=True)
    return [
        (number, normalize(line), out)
        for number, (line, out) in enumerate(zip(lines, decoded), 1)
        if out != normalize(line)
    ]


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
@pytest.mark.parametrize("name", SHARED_TEXT)
def test_every_shared_line_round_trips(joint_tokenizers, shared_data, kind, name):
    lines = list(iter_lines(shared_data / name))
    assert _round_trip_failures(joint_tokenizers[kind], lines) == []


@pytest.mark.parametrize(
    "name", ["newstest2013-en-de/dev.de", "newstest2013-en-fr/dev.fr", "newstest2013-en-de/dev.en"]
)
def test_byte_fallback_round_trips_unseen_characters(small_bpe, shared_data, name):
    lines = list(iter_lines(shared_data / name))
    ids = small_bpe(lines)["input_ids"]
    assert all(UNK_TOKEN_ID not in sequence for sequence in ids)
    assert _round_trip_failures(small_bpe, lines) == []


def test_normalization_changes_only_the_unusual_spaces(shared_data):
    # README of shared/data: replacing U+00A0 / U+2009 by spaces changes 11, 1 and 100 lines, nothing else
    # (two dev.fr lines also have a space next to the U+00A0: the pair becomes one space)
    changed = {}
    for name in ("newstest2013-en-de/dev.de", "newstest2013-en-de/dev.en", "newstest2013-en-fr/dev.fr"):
        lines = list(iter_lines(shared_data / name))
        changed[name] = sum(normalize(line) != line for line in lines)
        assert all(normalize(line) == " ".join(line.split()) for line in lines)
        assert all(normalize(line) == line for line in lines if "\u00a0" not in line and "\u2009" not in line)
    assert changed == {
        "newstest2013-en-de/dev.de": 11,
        "newstest2013-en-de/dev.en": 1,
        "newstest2013-en-fr/dev.fr": 100,
    }


def test_normalize_rules():
    assert normalize("  a\u00a0b\u2009c\td  \u2581e ") == "a b c d e"
    assert normalize("\ufeffA\u200b dog\u2060 runs.\ufeff") == "A dog runs."  # format characters: dropped
    assert normalize("µ ﬁ") == "µ ﬁ"  # NFC keeps compatibility characters (NFKC would not)
    assert normalize("e\u0301") == "\u00e9"


def test_bpe_is_lossless_for_any_string(small_bpe):
    for text in ["a . b ,c", "中文 ∑ 🙂 ﬁ", "x\u2581y", "  lead and trail  ", "\u00a0", "l'été « oui »"]:
        ids = small_bpe(text)["input_ids"]
        assert small_bpe.decode(ids, skip_special_tokens=True) == normalize(text)


CLEAN = "A dog runs in the park."
DIRTY = ["\ufeffA dog runs in the park.", "A dog\u200b runs in the park.", "A dog runs in\u2060 the park.\ufeff"]


def test_format_characters_are_dropped_by_trained_and_older_tokenizers(small_bpe, tmp_path):
    """A BOM and zero-width characters reach no tokenizer (issue 28): a tokenizer trained now drops them in its
    normalizer; one saved before that step existed encodes them as byte tokens, and `load_tokenizer` gives it the
    step (which it keeps when saved again)."""
    import json

    from vaswani_tx.data.tokenization import load_tokenizer

    clean = small_bpe(CLEAN)["input_ids"]
    assert all(small_bpe(text)["input_ids"] == clean for text in DIRTY)
    small_bpe.save_pretrained(tmp_path / "old")
    spec = json.loads((tmp_path / "old" / "tokenizer.json").read_text(encoding="utf-8"))
    steps = spec["normalizer"]["normalizers"]
    spec["normalizer"]["normalizers"] = [step for step in steps if step.get("content") != ""]  # as saved before
    assert len(spec["normalizer"]["normalizers"]) == len(steps) - 3
    (tmp_path / "old" / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    old = AutoTokenizer.from_pretrained(tmp_path / "old")
    assert all(old(text)["input_ids"] != clean for text in DIRTY)  # the byte tokens that changed translations
    upgraded = load_tokenizer(tmp_path / "old")
    assert all(upgraded(text)["input_ids"] == clean for text in DIRTY)
    upgraded.save_pretrained(tmp_path / "new")
    assert all(AutoTokenizer.from_pretrained(tmp_path / "new")(t)["input_ids"] == clean for t in DIRTY)


def test_wordpiece_unknown_word_becomes_unk(joint_tokenizers):
    tokenizer = joint_tokenizers["wordpiece"]
    ids = tokenizer("ein 中文 Hund")["input_ids"]
    assert ids.count(UNK_TOKEN_ID) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "ein Hund"


def test_special_ids_and_encoding_convention(joint_tokenizers):
    for tokenizer in joint_tokenizers.values():
        assert isinstance(tokenizer, PreTrainedTokenizerFast)
        assert len(tokenizer) == 4000
        assert (tokenizer.pad_token, tokenizer.unk_token, tokenizer.bos_token, tokenizer.eos_token) == (
            "<pad>",
            "<unk>",
            "<s>",
            "</s>",
        )
        assert (tokenizer.pad_token_id, tokenizer.unk_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
            0,
            1,
            2,
            3,
        )
        batch = tokenizer(["A dog runs."], text_target=["Ein Hund rennt."])
        source, labels = batch["input_ids"][0], batch["labels"][0]
        assert source[-1] == EOS_TOKEN_ID and labels[-1] == EOS_TOKEN_ID
        assert BOS_TOKEN_ID not in source and BOS_TOKEN_ID not in labels
        assert source.count(EOS_TOKEN_ID) == 1
        assert tokenizer.decode(labels, skip_special_tokens=True) == "Ein Hund rennt."


def test_dataset_and_files_learn_the_same_vocabulary(shared_data):
    en, de = shared_data / "multi30k-en-de/val.en", shared_data / "multi30k-en-de/val.de"
    pairs = datasets.Dataset.from_dict({"source": list(iter_lines(en)), "target": list(iter_lines(de))})
    from_files = train_tokenizer([en, de], "bpe", 600, show_progress=False)
    from_dataset = train_tokenizer(pairs, "bpe", 600, show_progress=False)
    assert from_files.get_vocab() == from_dataset.get_vocab()
    with pytest.raises(ValueError, match=r"no column\(s\) \['text'\]"):
        train_tokenizer(pairs, columns=["text"], show_progress=False)


def test_vocab_size_smaller_than_alphabet(shared_data):
    files = [shared_data / "multi30k-en-de/val.en", shared_data / "multi30k-en-de/val.de"]
    with pytest.raises(
        ValueError,
        match=r"vocab_size=300 is smaller than the alphabet of .*val\.en.*: 260 reserved tokens \+ \d+ characters",
    ):
        train_tokenizer(files, "bpe", 300, show_progress=False)
    with pytest.raises(ValueError, match=r"vocab_size=200 is smaller than the alphabet: bpe reserves 260 ids"):
        train_tokenizer(files, "bpe", 200, show_progress=False)
    with pytest.raises(ValueError, match=r"vocab_size=20 is smaller than the alphabet of"):
        train_tokenizer(files, "wordpiece", 20, show_progress=False)


def test_empty_corpus(tmp_path):
    empty = tmp_path / "empty.en"
    empty.write_text("")
    blank = tmp_path / "blank.de"
    blank.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"empty corpus: .*empty\.en, .*blank\.de has no text"):
        train_tokenizer([empty, blank], show_progress=False)


def test_undecodable_bytes_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.de"
    bad.write_bytes("gut\nschön\n".encode() + b"b\xe4d\n")
    with pytest.raises(CorpusError, match=r"bad\.de, line 3: not valid UTF-8 \(byte 0xe4 at column 2\)"):
        train_tokenizer([bad], vocab_size=400, show_progress=False)


def test_unknown_kind():
    with pytest.raises(ValueError, match=r"kind must be one of \['bpe', 'word', 'wordpiece'\], got 'unigram'"):
        train_tokenizer([], "unigram")


def _config(**overrides):
    values = dict(
        vocab_size=4000,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=BOS_TOKEN_ID,
        eos_token_id=EOS_TOKEN_ID,
        decoder_start_token_id=BOS_TOKEN_ID,
    )
    return SimpleNamespace(**{**values, **overrides})


def test_config_check_accepts_matching_config(joint_tokenizers):
    check_tokenizer_fits_model(joint_tokenizers["bpe"], _config())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"vocab_size": 37000}, "vocab_size: config has 37000, tokenizer has 4000"),
        ({"pad_token_id": 1}, "pad_token_id: config has 1, tokenizer has 0"),
        ({"bos_token_id": 0}, "bos_token_id: config has 0, tokenizer has 2"),
        ({"eos_token_id": 2}, "eos_token_id: config has 2, tokenizer has 3"),
        ({"decoder_start_token_id": 0}, "decoder_start_token_id: config has 0, tokenizer has 2"),
    ],
)
def test_config_check_refuses_clashes(joint_tokenizers, override, message):
    with pytest.raises(ValueError, match="model config and tokenizer disagree; " + message):
        check_tokenizer_fits_model(joint_tokenizers["bpe"], _config(**override))


class _ConvertedTokenizer(SimpleNamespace):
    def __len__(self):
        return self.size


@pytest.mark.parametrize(
    ("ids", "start", "message"),
    [
        (dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, unk_token_id=3), 2, None),  # fairseq, FSMT: </s>
        (dict(bos_token_id=None, pad_token_id=39, eos_token_id=0, unk_token_id=1), 39, None),  # Marian: <pad>
        (
            dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, unk_token_id=3),
            3,
            "decoder_start_token_id: config has 3, which is none of the tokenizer's bos 0, eos 2, pad 1",
        ),
    ],
)
def test_config_check_takes_a_converted_models_decoder_start(ids, start, message):
    """Vocabularies without this package's fixed ids (converted models) start where their source did."""
    tokenizer = _ConvertedTokenizer(size=40, **ids)
    config = SimpleNamespace(
        vocab_size=40, decoder_start_token_id=start, **{k: v for k, v in ids.items() if k != "unk_token_id"}
    )
    if message is None:
        check_tokenizer_fits_model(tokenizer, config)
    else:
        with pytest.raises(ValueError, match=message):
            check_tokenizer_fits_model(tokenizer, config)


def test_config_check_with_vaswani_config(joint_tokenizers):
    configuration = pytest.importorskip("vaswani_tx.model.configuration_vaswani")
    check_tokenizer_fits_model(joint_tokenizers["bpe"], configuration.VaswaniConfig(vocab_size=4000))
    with pytest.raises(ValueError, match="vocab_size: config has 37000, tokenizer has 4000"):
        check_tokenizer_fits_model(joint_tokenizers["bpe"], configuration.VaswaniConfig())
