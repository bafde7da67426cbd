"""Multi30k for the main job: the local copy when it is there, else the Hub's `bentrevett/multi30k` written into the
clone (a local folder in the Hub's layout stands in for the Hub), and one line, exit 2, when neither can be had."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from itertools import product
from pathlib import Path

import datasets
import pytest
import yaml

from vaswani_tx.cli import main
from vaswani_tx.data import multi30k
from vaswani_tx.data.tokenization import train_tokenizer
from vaswani_tx.model.configuration_vaswani import VaswaniConfig
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.training.run_config import ConfigError, load_run_config

REPO = Path(__file__).resolve().parents[1]
REAL_LOAD_DATASET = datasets.load_dataset
WORDS = (
    [("dog", "Hund"), ("man", "Mann"), ("child", "Kind")],
    [("runs", "läuft"), ("sits", "sitzt"), ("sleeps", "schläft")],
)


def _pairs(count: int) -> list[dict[str, str]]:
    pairs = [
        {"en": f"A {noun} {verb} in the park.", "de": f"Ein {nomen} {verbum} im Park."}
        for (noun, nomen), (verb, verbum) in product(*WORDS)
    ]
    return (pairs * count)[:count]


@pytest.fixture
def hub_stand_in(tmp_path) -> Path:
    """A folder in the layout of the Hub's bentrevett/multi30k: train.jsonl, val.jsonl, test.jsonl of {"en", "de"}."""
    folder = tmp_path / "hub-multi30k"
    folder.mkdir()
    for name, count in (("train", 40), ("val", 6), ("test", 5)):
        rows = _pairs(count)
        if name == "train":
            rows[1] = {"en": "A dog\nruns.", "de": "Ein Hund\r\nläuft."}  # a line break must not shift the lines
        lines = (json.dumps(row, ensure_ascii=False) for row in rows)
        (folder / f"{name}.jsonl").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
    return folder


@pytest.fixture
def clone(tmp_path, monkeypatch) -> Path:
    """A working directory with no local copy of Multi30k (VASWANI_SHARED_DATA names an empty folder)."""
    folder = tmp_path / "clone"
    folder.mkdir()
    (tmp_path / "no-data").mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setenv("VASWANI_SHARED_DATA", str(tmp_path / "no-data"))
    return folder


@pytest.fixture
def hub(monkeypatch, hub_stand_in) -> list[str]:
    """`datasets.load_dataset("bentrevett/multi30k")` answered from the stand-in; returns the ids asked for."""
    asked = []

    def load_dataset(path, *args, **kwargs):
        asked.append(path)
        assert path == "bentrevett/multi30k"  # the real code path asks the Hub for that id
        return REAL_LOAD_DATASET(str(hub_stand_in), *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return asked


def test_the_local_copy_is_read_when_it_is_there(tmp_path, monkeypatch, hub, caplog):
    shared = tmp_path / "data" / "multi30k-en-de"
    shared.mkdir(parents=True)
    monkeypatch.setenv("VASWANI_SHARED_DATA", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="vaswani_tx.data.multi30k"):
        assert multi30k.provide_multi30k() == shared
    assert hub == [] and "the local copy in" in caplog.text
    recipe, _ = load_run_config(REPO / "configs/train/multi30k-en-de.yaml", {"output_dir": str(tmp_path / "run")})
    assert (recipe.train_source, recipe.dev_target) == (str(shared / "train.en"), str(shared / "val.de"))


def test_without_a_local_copy_the_hub_dataset_is_written_into_the_clone(clone, hub, hub_stand_in, caplog):
    with caplog.at_level(logging.INFO, logger="vaswani_tx.data.multi30k"):
        folder = multi30k.provide_multi30k()
    assert folder == Path("runs/data/multi30k-en-de") and hub == ["bentrevett/multi30k"]
    assert (
        "no local copy" in caplog.text and "downloading bentrevett/multi30k from the Hugging Face Hub" in caplog.text
    )
    names = sorted(path.name for path in (clone / folder).iterdir())
    assert names == ["test.de", "test.en", "train.de", "train.en", "val.de", "val.en"]  # nothing else, no partial
    train_en = (folder / "train.en").read_text(encoding="utf-8").split("\n")
    assert len(train_en) == 41 and train_en[1] == "A dog runs." and train_en[-1] == ""  # 40 lines, one a sentence
    assert (folder / "train.de").read_text(encoding="utf-8").split("\n")[1] == "Ein Hund  läuft."
    assert (folder / "val.de").read_text(encoding="utf-8").splitlines() == [row["de"] for row in _pairs(6)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="vaswani_tx.data.multi30k"):
        assert multi30k.provide_multi30k() == folder
    assert hub == ["bentrevett/multi30k"] and "downloaded earlier" in caplog.text  # once only


def test_a_stopped_download_leaves_nothing_a_later_run_would_use(clone, monkeypatch, hub_stand_in, hub):
    stand_in = REAL_LOAD_DATASET(str(hub_stand_in))

    class Stopped:  # the test split: Ctrl-C while the files are being written
        @property
        def column_names(self):
            raise KeyboardInterrupt

    monkeypatch.setattr(datasets, "load_dataset", lambda path: {**stand_in, "test": Stopped()})
    with pytest.raises(KeyboardInterrupt):
        multi30k.provide_multi30k()
    assert list(clone.iterdir()) == []  # neither the folder nor a half-written one (nor runs/data, made for it)
    # a half-filled folder (a copy made by hand, an older layout) is not taken for the data: written again whole
    (clone / multi30k.DOWNLOAD_FOLDER).mkdir(parents=True)
    (clone / multi30k.DOWNLOAD_FOLDER / "train.en").write_text("half\n", encoding="utf-8")
    monkeypatch.setattr(datasets, "load_dataset", lambda path: stand_in)
    folder = multi30k.provide_multi30k()
    assert len((folder / "train.en").read_text(encoding="utf-8").splitlines()) == 40 and (folder / "test.de").is_file()


def test_a_clone_without_the_data_trains_from_the_hub(clone, hub, hub_stand_in, tmp_path, capsys, caplog):
    """The main job's run config, unchanged but for a tiny model and two steps, from a clone with no local copy."""
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"{row['en']}\n{row['de']}\n" for row in _pairs(40)), encoding="utf-8")
    tokenizer = train_tokenizer([texts], "bpe", 300, show_progress=False)
    tokenizer.save_pretrained(clone / "tok")
    config = VaswaniConfig(
        vocab_size=len(tokenizer),
        d_model=24,
        d_ff=48,
        num_heads=3,
        d_k=8,
        d_v=8,
        num_encoder_layers=1,
        num_decoder_layers=1,
    )
    (clone / "model.json").write_text(json.dumps(config.to_dict()), encoding="utf-8")
    overrides = ["model_config=model.json", "tokenizer=tok", "output_dir=runs/m", "max_steps=2", "max_tokens=200"]
    overrides += ["eval_strategy=no", "save_strategy=no", "report_to=none", "bf16=false", "disable_tqdm=true"]
    with caplog.at_level(logging.INFO, logger="vaswani_tx.data.multi30k"):
        assert main(["train", str(REPO / "configs/train/multi30k-en-de.yaml"), *overrides]) == 0, capsys.readouterr()
    assert hub == ["bentrevett/multi30k"] and "into runs/data/multi30k-en-de" in caplog.text
    assert (clone / "runs" / "m" / "model.safetensors").is_file()


def test_offline_without_the_data_the_run_stops_first_with_one_line(clone, tmp_path):
    """The real `load_dataset("bentrevett/multi30k")` with the Hub unreachable (HF_HUB_OFFLINE, an empty cache)."""
    config = clone / "run.yaml"
    values = {"model_config": "model.json", "tokenizer": "tok", "multi30k": "en-de", "output_dir": "runs/m"}
    config.write_text(yaml.safe_dump({**values, "report_to": "none", "use_cpu": True}), encoding="utf-8")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(
        [sys.executable, "-m", "vaswani_tx.cli", "train", str(config)],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("vaswani-tx train: error: Multi30k is not at "), done.stderr
    assert "no-data/multi30k-en-de" in errors[0] and "VASWANI_SHARED_DATA" in errors[0]  # the first way
    assert "connect to the internet with HF_HUB_OFFLINE unset" in errors[0]  # the second
    assert sorted(path.name for path in clone.iterdir()) == ["run.yaml"]  # nothing trained, nothing half-written


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"multi30k": "en-fr"}, "multi30k must be en-de or de-en"),
        ({"multi30k": "de-en"}, "but source_lang 'en'"),
        ({"train_source": "a.en", "train_target": "a.de"}, "one of them"),
        ({"dev_source": "dev.en"}, "dev_source with dev_target, or neither"),
    ],
)
def test_the_multi30k_key_is_checked(clone, values, message):
    with pytest.raises(ConfigError, match=message):
        load_run_config(REPO / "configs/train/multi30k-en-de.yaml", values)


def test_the_dev_files_may_be_given_and_a_dry_run_downloads_nothing(clone, hub, capsys):
    recipe, _ = load_run_config(
        REPO / "configs/train/multi30k-en-de.yaml", {"dev_source": "d.en", "dev_target": "d.de"}
    )
    assert recipe.train_target == "runs/data/multi30k-en-de/train.de" and recipe.dev_source == "d.en"
    model = f"model_config={REPO / 'configs/model/small-cpu.json'}"
    assert main(["train", str(REPO / "configs/train/multi30k-en-de.yaml"), model, "--dry-run"]) == 0
    assert hub == [] and "runs/data/multi30k-en-de/train.en" in capsys.readouterr().out


def test_the_error_names_both_ways_to_provide_the_data(clone, monkeypatch):
    def offline(path):
        raise ConnectionError("Couldn't reach 'bentrevett/multi30k' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(UserInputError) as caught:
        multi30k.provide_multi30k()
    assert "\n" not in str(caught.value) and "(LocalEntryNotFoundError)" in str(caught.value)
    assert not (clone / "runs" / "data" / "multi30k-en-de").exists()
