"""Checkpoints whose generation_config.json sets none of num_beams, length_penalty, max_length, early_stopping
(issue 83): transformers 5 leaves them None and generate() reads its defaults (beam 1, alpha 1.0, max_length 20,
no early stopping); `convert`, the model card, `translate`, `evaluate` and the engine read them the same way.

The Marian and FSMT folders are written by transformers' own save_pretrained; the fairseq one is converted from a
checkpoint fairseq trained (tests/fixtures/fairseq), its generation config then saved without the four fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig, MarianMTModel

from test_convert import EN, _fairseq_dictionary, _fsmt_model, _marian_folder, _write_fairseq
from vaswani_tx import VaswaniForConditionalGeneration
from vaswani_tx.cli import main
from vaswani_tx.engine.settings import as_generate_reads, describe_generation
from vaswani_tx.interop.convert import _fairseq_tokenizer, convert
from vaswani_tx.interop.publishing import render_model_card

UNSET = ("num_beams", "length_penalty", "max_length", "early_stopping")
FAIRSEQ = Path(__file__).parent / "fixtures" / "fairseq" / "shared"
DEFAULT_CAP = "at most 20 new tokens (max_length unset: transformers' default)"
CARD = dict(repo="me/m", source_lang="en", target_lang="de", training_data="converted")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def unset_decoding(folder: Path) -> None:
    """Save `folder`'s generation config again with the four fields unset, as transformers 5 writes such a config."""
    generation = GenerationConfig.from_pretrained(folder)
    for name in UNSET:
        setattr(generation, name, None)
    generation.save_pretrained(folder)
    assert not set(UNSET) & json.loads((folder / "generation_config.json").read_text()).keys()


def test_the_defaults_are_transformers_own():
    resolved = as_generate_reads(GenerationConfig())
    defaults = GenerationConfig._get_default_generation_params()
    assert [getattr(resolved, name) for name in UNSET] == [defaults[name] for name in UNSET] == [1, 1.0, 20, False]
    given = as_generate_reads(GenerationConfig(num_beams=4, length_penalty=0.6))
    assert (given.num_beams, given.length_penalty) == (4, 0.6)  # only the unset fields are filled


def _convert_and_check(source: Path, out: Path, capsys, expected_cap: str) -> VaswaniForConditionalGeneration:
    """`vaswani-tx convert` exits 0 and says what decoding does; the card says the same; generate() through the
    engine gives transformers' loops' ids (both read the unset fields as transformers' defaults)."""
    capsys.readouterr()
    assert main(["convert", str(source), str(out)]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert f"decoding: greedy search (beam 1, no length penalty); {expected_cap}" in printed
    model = VaswaniForConditionalGeneration.from_pretrained(out).eval()
    assert all(getattr(model.generation_config, name) is None for name in UNSET)
    assert (
        f"Decoding defaults (Section 6.1 of the paper): greedy search (beam 1, no length penalty); {expected_cap}"
        in (render_model_card(model, **CARD))
    )
    batch = AutoTokenizer.from_pretrained(out)(EN[:2], return_tensors="pt", padding=True)
    engine = model.generate(**batch)
    assert torch.equal(engine, model.generate(**batch, use_engine=False))
    return model


def test_marian_folder_without_decoding_settings_converts_and_translates(tmp_path, capsys):
    _marian_folder(tmp_path / "marian", share=True, activation="relu")
    unset_decoding(tmp_path / "marian")
    marian = MarianMTModel.from_pretrained(tmp_path / "marian").eval()  # as saved: with no decoding settings
    _convert_and_check(tmp_path / "marian", tmp_path / "out", capsys, DEFAULT_CAP)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    expected = tokenizer.decode(marian.generate(**tokenizer(EN[0], return_tensors="pt"))[0], skip_special_tokens=True)
    assert main(["translate", str(tmp_path / "out"), EN[0], "--device", "cpu", "--quiet"]) == 0
    assert capsys.readouterr().out == expected.strip() + "\n"


def test_fsmt_folder_without_decoding_settings_converts(tmp_path, capsys):
    """An FSMT folder as transformers' FSMT port saves it (test_convert's way), its generation config then saved
    without the four fields (FSMT's model config carries beam 5 and max_length 200; that config gives none)."""
    size = len(_fairseq_dictionary(tmp_path, "en"))
    _fairseq_dictionary(tmp_path, "de")
    (tmp_path / "bpecodes").write_text("#version: 0.2\nt h 500\n", encoding="utf-8")
    fsmt = _fsmt_model(size, size, tie=False)
    _write_fairseq(fsmt, tmp_path / "checkpoint_best.pt")
    (tmp_path / "fsmt").mkdir()
    _fairseq_tokenizer(tmp_path / "checkpoint_best.pt", {"source_lang": "en", "target_lang": "de"}, tmp_path / "fsmt")
    tokenizer_config = json.loads((tmp_path / "fsmt" / "tokenizer_config.json").read_text())
    del tokenizer_config["moses_normalize"]
    tokenizer_config["tokenizer_class"] = "FSMTTokenizer"
    (tmp_path / "fsmt" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    fsmt.save_pretrained(tmp_path / "fsmt")
    unset_decoding(tmp_path / "fsmt")
    _convert_and_check(tmp_path / "fsmt", tmp_path / "out", capsys, DEFAULT_CAP)


def test_fairseq_model_without_decoding_settings_describes_and_translates(tmp_path, capsys):
    convert(FAIRSEQ, tmp_path / "converted")
    unset_decoding(tmp_path / "converted")
    expected = "at most 0 * source length + 200 tokens (fairseq's)"  # the fairseq cap, set, still applies
    assert describe_generation(GenerationConfig.from_pretrained(tmp_path / "converted")).endswith(expected)
    model = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "converted").eval()
    assert f"greedy search (beam 1, no length penalty); {expected}" in render_model_card(model, **CARD)
    batch = AutoTokenizer.from_pretrained(tmp_path / "converted")(["A dog runs."], return_tensors="pt")
    assert torch.equal(model.generate(**batch), model.generate(**batch, use_engine=False))
    scores = tmp_path / "eval" / "test.scores.json"
    (tmp_path / "test.en").write_text("A dog runs.\n", encoding="utf-8")
    (tmp_path / "test.de").write_text("Ein Hund rennt.\n", encoding="utf-8")
    arguments = ["-s", str(tmp_path / "test.en"), "-r", str(tmp_path / "test.de"), "-o", str(tmp_path / "eval")]
    assert main(["evaluate", str(tmp_path / "converted"), *arguments, "--device", "cpu", "--quiet"]) == 0
    assert "greedy (1 beam, no length penalty)" in capsys.readouterr().out
    recorded = json.loads(scores.read_text())
    assert (recorded["num_beams"], recorded["length_penalty"]) == (1, None)
