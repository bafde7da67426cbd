"""`vaswani-tx train-tokenizer` and `vaswani-tx prepare-data` end to end on Multi30k val; bad input to every command."""

from __future__ import annotations

import subprocess
import sys

import datasets
import pytest
from transformers import AutoTokenizer

from vaswani_tx.cli import main


def test_command_modules_import_no_heavy_libraries():
    code = (
        "import sys, vaswani_tx.cli.train_tokenizer, vaswani_tx.cli.prepare_data\n"
        "print(sorted(m for m in ('datasets', 'vaswani_tx.data.data', 'vaswani_tx.data.tokenization') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_train_tokenizer_then_prepare_data(shared_data, tmp_path, capsys):
    en, de = shared_data / "multi30k-en-de/val.en", shared_data / "multi30k-en-de/val.de"
    tokenizer_dir, data_dir = tmp_path / "tok", tmp_path / "data"
    assert main(["train-tokenizer", str(en), str(de), "--vocab-size", "600", "--output-dir", str(tokenizer_dir)]) == 0
    assert "trained a 600-token bpe vocabulary" in capsys.readouterr().out
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert len(tokenizer) == 600 and tokenizer.eos_token_id == 3

    argv = [
        "prepare-data",
        "--source-file",
        str(en),
        "--target-file",
        str(de),
        "--tokenizer",
        str(tokenizer_dir),
        "--output-dir",
        str(data_dir),
        "--cache-dir",
        str(tmp_path / "cache"),
        "--max-tokens",
        "512",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pairs read: 1014" in out and "removed, duplicate: 0" in out and "pairs too long for the budget" in out
    saved = datasets.load_from_disk(str(data_dir))
    kept = int(out.split("pairs kept: ")[1].split()[0])
    assert saved.num_rows == kept and set(saved.column_names) == {"input_ids", "attention_mask", "labels"}


def test_prepare_data_needs_exactly_one_input(tmp_path, capsys):
    assert (
        main(
            [
                "prepare-data",
                "--tsv",
                "a.tsv",
                "--jsonl",
                "b.jsonl",
                "--tokenizer",
                str(tmp_path),
                "--output-dir",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "vaswani-tx prepare-data: error: give exactly one input" in capsys.readouterr().err


def test_prepare_data_names_a_folder_without_tokenizer(tmp_path, capsys):
    assert (
        main(["prepare-data", "--tsv", "a.tsv", "--tokenizer", str(tmp_path), "--output-dir", str(tmp_path / "out")])
        == 2
    )
    assert "holds no tokenizer.json; create one with `vaswani-tx train-tokenizer`" in capsys.readouterr().err


def test_train_tokenizer_needs_files_or_wmt14(tmp_path, capsys):
    assert main(["train-tokenizer", "--output-dir", str(tmp_path)]) == 2
    assert "vaswani-tx train-tokenizer: error: give either text FILEs or --wmt14" in capsys.readouterr().err


def test_every_command_reports_bad_input_the_same_way(tmp_path, capsys):
    """Bad input is one line on stderr, `vaswani-tx COMMAND: error: MESSAGE`, and exit status 2, never a traceback."""
    missing, empty = tmp_path / "missing", tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "bad.json").write_text("{not json", encoding="utf-8")
    cases = [
        (["train", str(missing / "run.yaml")], "run.yaml"),
        (
            ["average-checkpoints", str(empty), "--output-dir", str(tmp_path / "avg")],
            "holds no checkpoint-<step> folders",
        ),
        (
            ["average-checkpoints", str(empty), "--last", "0", "--output-dir", str(tmp_path / "avg")],
            "--last must be >= 1",
        ),
        (["translate", str(missing), "Ein Hund."], "does not exist"),
        (["evaluate", str(empty), "-s", str(missing / "test.en"), "-r", str(missing / "test.de")], "test.en"),
        (["train-tokenizer", str(missing / "train.en"), "--output-dir", str(tmp_path / "tok")], "train.en"),
        (
            [
                "prepare-data",
                "--tsv",
                str(missing / "pairs.tsv"),
                "--tokenizer",
                str(empty),
                "--output-dir",
                str(tmp_path / "d"),
            ],
            "holds no tokenizer.json",
        ),
        (["params", str(missing)], "is neither a config file nor a folder"),
        (["params", str(tmp_path / "bad.json")], "bad.json"),
        (
            ["attention", str(missing), "--source", "Ein Hund.", "--output-dir", str(tmp_path / "maps")],
            "does not exist",
        ),
        (["convert", str(missing), str(tmp_path / "out")], "no such file or folder"),
        (["export-marian", str(empty), str(tmp_path / "out")], "not a model folder"),
        (["parse", "score", str(missing / "gold.mrg"), str(missing / "pred.mrg")], "gold.mrg"),
    ]
    for argv, named in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"vaswani-tx {argv[0]}: error: ") and named in err, (argv, err)
        assert "Traceback" not in err


@pytest.mark.parametrize("command", ["train-tokenizer", "prepare-data"])
def test_help_is_complete(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    help_text = capsys.readouterr().out
    assert "Section 5.1" in help_text and "examples:" in help_text and "--output-dir" in help_text
