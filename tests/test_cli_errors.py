"""Bad input to every command (issue 19): refused before any work with `vaswani-tx COMMAND: error: MESSAGE`,
exit 2, no traceback, and nothing that existed before changed; the run-folder lock of `train`.

One table of bad inputs per command; each case runs in-process against a workspace of small folders (a tiny
model, a MarianMT export of it, a truncated copy, a tokenizer, a run with a checkpoint, odd text files) whose
hash is taken before and after.
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from vaswani_tx.cli import main
from vaswani_tx.folders import LOCK_NAME, RunLock, RunLockError, check_writable, refuse_to_overwrite
from vaswani_tx.model.errors import UserInputError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ws(tiny_translator, shared_data, tmp_path_factory) -> Path:
    """The workspace every case runs against (read-only for the cases: its hash must not change)."""
    from vaswani_tx.interop.export import export_marian

    folder, model, tokenizer = tiny_translator
    ws = tmp_path_factory.mktemp("ws")
    shutil.copytree(folder, ws / "model")
    export_marian(model, ws / "marian")
    (ws / "trunc").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(folder / name, ws / "trunc" / name)
    (ws / "trunc" / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:2000])
    tokenizer.save_pretrained(ws / "tok")
    checkpoint = ws / "run" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    shutil.copy(folder / "config.json", checkpoint / "config.json")
    (checkpoint / "trainer_state.json").write_text("{}", encoding="utf-8")
    (ws / "empty.txt").write_bytes(b"")
    (ws / "blank.txt").write_bytes(b"\n  \n")
    (ws / "latin1.txt").write_bytes(b"caf\xe9\n")
    (ws / "ok.txt").write_text("A dog runs.\nTwo men.\n", encoding="utf-8")
    (ws / "ok.tsv").write_text("A dog.\tEin Hund.\n", encoding="utf-8")
    (ws / "garbage.json").write_text("{not json", encoding="utf-8")
    (ws / "list.json").write_text("[1, 2]", encoding="utf-8")
    (ws / "adir").mkdir()
    (ws / "adir" / "keep").write_text("x", encoding="utf-8")
    # a tiny run config's inputs (for train: the numbers are refused before any of them is read)
    lines = (shared_data / "multi30k-en-de" / "val.en").read_text(encoding="utf-8").splitlines()[:40]
    (ws / "train.en").write_text("\n".join(lines) + "\n", encoding="utf-8")
    lines = (shared_data / "multi30k-en-de" / "val.de").read_text(encoding="utf-8").splitlines()[:40]
    (ws / "train.de").write_text("\n".join(lines) + "\n", encoding="utf-8")
    (ws / "model.json").write_text(json.dumps(model.config.to_dict()), encoding="utf-8")
    return ws


def tree_hash(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def run_config(ws: Path, tmp_path: Path, **values) -> str:
    config = {
        "model_config": str(ws / "model.json"),
        "tokenizer": str(ws / "tok"),
        "train_source": str(ws / "train.en"),
        "train_target": str(ws / "train.de"),
        "dev_source": str(ws / "train.en"),
        "dev_target": str(ws / "train.de"),
        "output_dir": str(tmp_path / "out"),
        "max_tokens": 200,
        "max_steps": 2,
        "learning_rate": 1.0,
        "lr_scheduler_type": "inverse_sqrt",
        "warmup_steps": 2,
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
        **values,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path)


def _live_other_pid() -> int:
    return os.getppid()  # pytest's parent: alive while the test runs, not this process


# command -> [(argv after the command, with {ws} for the workspace, key words of the message)]
CASES: dict[str, list[tuple[list[str], list[str]]]] = {
    "export-ct2": [
        (["{ws}/marian", "{ws}/new"], ["type 'marian'", "vaswani-tx convert"]),
        (["{ws}/trunc", "{ws}/new"], ["trunc/model.safetensors", "not a readable safetensors"]),
        (["{ws}/missing", "{ws}/new"], ["does not exist"]),
        (["{ws}/adir", "{ws}/new"], ["not a model folder", "no config.json"]),
        (["{ws}/model", "{ws}/tok"], ["already exists", "tokenizer folder", "--force"]),
        (["{ws}/model", "{ws}/model/..", "--force"], ["holds", "which this command reads"]),
    ],
    "export-marian": [
        (["{ws}/marian", "{ws}/new"], ["type 'marian'", "vaswani-tx convert"]),
        (["{ws}/trunc", "{ws}/new"], ["not a readable safetensors"]),
        (["{ws}/adir", "{ws}/new"], ["no config.json"]),
        (["{ws}/model", "{ws}/marian"], ["already exists", "marian model folder", "--force"]),
        (["{ws}/model", "--output-dir", "{ws}/marian"], ["already exists", "marian model folder", "--force"]),
    ],
    "convert": [
        (["{ws}/marian", "{ws}/model"], ["already exists", "vaswani_tx model folder", "--force"]),
        (["{ws}/marian", "-o", "{ws}/model"], ["already exists", "vaswani_tx model folder", "--force"]),
        (["{ws}/marian"], ["no output folder", "-o/--output-dir"]),
        (["{ws}/marian", "{ws}/new", "-o", "{ws}/other"], ["two output folders"]),
        (["{ws}/missing", "{ws}/new"], ["no such file or folder"]),
    ],
    "average-checkpoints": [
        (["{ws}/model", "--output-dir", "{ws}/run/checkpoint-2"], ["training checkpoint folder", "--force"]),
        (["{ws}/run", "--output-dir", "{ws}/model"], ["vaswani_tx model folder", "--force"]),
        (["{ws}/run", "--output-dir", "{ws}/ok.txt/avg"], ["ok.txt", "not a folder"]),
        (["{ws}/run", "--last", "0", "--output-dir", "{ws}/new"], ["--last must be >= 1"]),
    ],
    "train-tokenizer": [
        (["{ws}/empty.txt", "--output-dir", "{ws}/new"], ["empty corpus", "empty.txt"]),
        (["{ws}/blank.txt", "--output-dir", "{ws}/new"], ["empty corpus", "blank.txt"]),
        (["{ws}/latin1.txt", "--output-dir", "{ws}/new"], ["latin1.txt, line 1", "not valid UTF-8"]),
        (["{ws}/missing.txt", "--output-dir", "{ws}/new"], ["missing.txt", "does not exist"]),
        (["{ws}/adir", "--output-dir", "{ws}/new"], ["adir is a folder"]),
        (["{ws}/ok.txt", "--vocab-size", "-5", "--output-dir", "{ws}/new"], ["--vocab-size", "-5"]),
        (["{ws}/ok.txt", "--output-dir", "{ws}/model"], ["vaswani_tx model folder", "--force"]),
    ],
    "prepare-data": [
        (["--tsv", "{ws}/empty.txt", "--tokenizer", "{ws}/tok", "--output-dir", "{ws}/new"], ["empty.txt"]),
        (["--tsv", "{ws}/latin1.txt", "--tokenizer", "{ws}/tok", "--output-dir", "{ws}/new"], ["not valid UTF-8"]),
        (["--tsv", "{ws}/missing.tsv", "--tokenizer", "{ws}/tok", "--output-dir", "{ws}/new"], ["missing.tsv"]),
        (["--tsv", "{ws}/adir", "--tokenizer", "{ws}/tok", "--output-dir", "{ws}/new"], ["adir is a folder"]),
        (
            ["--tsv", "{ws}/ok.tsv", "--tokenizer", "{ws}/tok", "--output-dir", "{ws}/new", "--max-tokens", "-5"],
            ["--max-tokens must be >= 1"],
        ),
        (
            ["--tsv", "{ws}/ok.tsv", "--tokenizer", "{ws}/tok", "--output-dir", "{ws}/tok"],
            ["tokenizer folder", "--force"],
        ),
    ],
    "translate": [
        (["{ws}/model", "-i", "{ws}/ok.txt", "--num-beams", "0"], ["--num-beams must be >= 1"]),
        (["{ws}/model", "-i", "{ws}/ok.txt", "--num-beams", "-3"], ["--num-beams must be >= 1"]),
        (["{ws}/model", "-i", "{ws}/ok.txt", "--max-tokens", "0"], ["--max-tokens must be >= 1"]),
        (["{ws}/model", "-i", "{ws}/adir"], ["adir is a folder"]),
        (["{ws}/model", "-i", "{ws}/ok.txt", "-o", "{ws}/adir"], ["adir is a folder"]),
        (["{ws}/model", "-i", "{ws}/ok.txt", "-o", "{ws}/ok.txt/hyp"], ["ok.txt is a file"]),
        (["{ws}/marian", "A dog."], ["type 'marian'", "vaswani-tx convert"]),
        (["{ws}/trunc", "A dog."], ["not a readable safetensors"]),
        (["{ws}/model", "-i", "{ws}/latin1.txt"], ["latin1.txt, line 1"]),
    ],
    "evaluate": [
        (["{ws}/model", "-s", "{ws}/ok.txt", "-r", "{ws}/ok.txt", "--output-dir", "{ws}/ok.txt"], ["is a file"]),
        (["{ws}/model", "-s", "{ws}/ok.txt", "-r", "{ws}/ok.txt", "--output-dir", "{ws}/ok.txt/x"], ["is a file"]),
        (
            [
                "{ws}/model",
                "-s",
                "{ws}/blank.txt",
                "-r",
                "{ws}/blank.txt",
                "--target-lang",
                "de",
                "--output-dir",
                "{ws}/new",
            ],
            ["all blank"],
        ),
        (["{ws}/model", "-s", "{ws}/ok.txt", "-r", "{ws}/ok.txt", "--num-beams", "0"], ["--num-beams"]),
    ],
    "attention": [
        (["{ws}/model", "--source", "A dog.", "--output-dir", "{ws}/new", "--layers", "9"], ["--layers 9", "1 to 2"]),
        (["{ws}/model", "--source", "A dog.", "--output-dir", "{ws}/new", "--layers", "0"], ["--layers 0", "1 to 2"]),
        (["{ws}/marian", "--source", "A dog.", "--output-dir", "{ws}/new"], ["vaswani-tx convert"]),
        (["{ws}/trunc", "--source", "A dog.", "--output-dir", "{ws}/new"], ["not a readable safetensors"]),
        (["{ws}/model", "--source", "A dog.", "--output-dir", "{ws}/ok.txt"], ["ok.txt is a file"]),
        (["{ws}/model", "--source", " ", "--output-dir", "{ws}/new"], ["--sentence is empty"]),
    ],
    "params": [
        (["{ws}/garbage.json"], ["garbage.json", "not valid JSON"]),
        (["{ws}/missing"], ["is neither a config file nor a folder"]),
        (["{ws}/list.json"], ["list.json", "must be a JSON object"]),
        (["{ws}/latin1.txt"], ["latin1.txt", "not UTF-8"]),
    ],
    "parse": [
        (["predict", "{ws}/model", "--sentences", "{ws}/empty.txt"], ["empty.txt holds no sentence"]),
        (["predict", "{ws}/model", "--sentences", "{ws}/blank.txt"], ["holds no sentence"]),
        (["predict", "{ws}/model", "--sentences", "{ws}/ok.txt", "--num-beams", "0"], ["--num-beams must be >= 1"]),
        (["score", "{ws}/ok.txt", "{ws}/ok.txt", "--max-length", "-1"], ["--max-length must be >= 1"]),
    ],
}
if not torch.cuda.is_available():
    CASES["translate"].append((["{ws}/model", "-i", "{ws}/ok.txt", "--device", "cuda"], ["no CUDA GPU", "cpu"]))


def _check(argv: list[str], words: list[str], ws: Path, capsys) -> None:
    before = tree_hash(ws)
    assert main(argv) == 2, argv
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()[-1] if captured.err.strip() else ""
    assert err.startswith(f"vaswani-tx {argv[0]}: error: "), (argv, captured.err[-2000:])
    for word in words:
        assert word in err, (argv, word, err)
    assert "Traceback" not in captured.err + captured.out
    assert tree_hash(ws) == before, f"{argv} changed the workspace"
    assert not (ws / "new").exists(), f"{argv} created its output"


@pytest.mark.parametrize("command", sorted(CASES))
def test_bad_input_is_refused_before_work_and_changes_nothing(command, ws, capsys):
    for args, words in CASES[command]:
        argv = [command, *(arg.replace("{ws}", str(ws)) for arg in args)]
        _check(argv, words, ws, capsys)


def test_train_refuses_bad_numbers_and_a_held_folder(ws, tmp_path, capsys):
    for override, words in [
        ("max_steps=-5", ["max_steps=-5", "> 0"]),
        ("max_steps=abc", ["max_steps='abc'", "not a number"]),
        ("learning_rate=abc", ["learning_rate='abc'", "not a number"]),
        ("max_tokens=0", ["max_tokens=0"]),
        (f"output_dir={ws / 'ok.txt' / 'run'}", ["ok.txt is a file"]),
    ]:
        _check(["train", run_config(ws, tmp_path), override], words, ws, capsys)
    assert not (tmp_path / "out").exists()
    _check(["train", run_config(ws, tmp_path), f"output_dir={ws / 'model'}"], ["vaswani_tx model folder"], ws, capsys)
    another_tokenizer = [f"output_dir={ws / 'tok'}", f"tokenizer={ws / 'model'}", "--resume"]
    _check(["train", run_config(ws, tmp_path), *another_tokenizer], ["tokenizer folder"], ws, capsys)
    _check(
        ["train", run_config(ws, tmp_path), f"output_dir={ws / 'run' / 'checkpoint-2'}"], ["already holds"], ws, capsys
    )
    held = tmp_path / "out"
    held.mkdir()
    (held / LOCK_NAME).write_text(json.dumps({"pid": _live_other_pid(), "host": os.uname().nodename}))
    _check(
        ["train", run_config(ws, tmp_path)], [f"process {_live_other_pid()}", "another `vaswani-tx train`"], ws, capsys
    )
    assert sorted(p.name for p in held.iterdir()) == [LOCK_NAME]


def _same_size_other_tokenizer(source: Path, out: Path) -> Path:
    """A copy of a tokenizer folder with two ordinary tokens' ids swapped: another vocabulary of the same
    size and special ids, as a tokenizer trained for another model would be."""
    shutil.copytree(source, out)
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return out


def test_a_same_size_tokenizer_of_another_model_is_refused(ws, tmp_path, capsys):
    from vaswani_tx.data.tokenization import load_tokenizer, vocabulary_fingerprint

    model = tmp_path / "model"
    shutil.copytree(ws / "model", model)
    config = json.loads((model / "config.json").read_text(encoding="utf-8"))
    config["tokenizer_fingerprint"] = vocabulary_fingerprint(load_tokenizer(ws / "model"))  # as train() writes it
    (model / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert main(["translate", str(model), "A dog runs.", "--quiet", "--device", "cpu"]) == 0
    capsys.readouterr()
    other = _same_size_other_tokenizer(ws / "tok", tmp_path / "other")
    assert len(load_tokenizer(other)) == len(load_tokenizer(ws / "tok"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(other / name, model / name)
    _check(["translate", str(model), "A dog runs."], ["tokenizer_fingerprint", "another model"], ws, capsys)
    out = tmp_path / "hyp"
    _check(
        [
            "evaluate",
            str(model),
            "-s",
            str(ws / "ok.txt"),
            "-r",
            str(ws / "ok.txt"),
            "--target-lang",
            "de",
            "-o",
            str(out),
        ],
        ["tokenizer_fingerprint"],
        ws,
        capsys,
    )
    assert not out.exists()
    # every command that meets the model's tokenizer runs the one check (the pipeline too: test_pipeline.py)
    for argv in (
        ["attention", str(model), "--sentence", "A dog runs.", "-o", str(out)],
        ["export-marian", str(model), str(out)],
        ["parse", "predict", str(model), "--sentences", str(ws / "ok.txt")],
    ):
        _check(argv, ["tokenizer_fingerprint"], ws, capsys)
        assert not out.exists()


def test_train_refuses_prepared_data_encoded_with_another_tokenizer(ws, tmp_path, capsys):
    prepared = tmp_path / "prepared"
    argv = ["prepare-data", "--source-file", str(ws / "train.en"), "--target-file", str(ws / "train.de")]
    assert main([*argv, "--tokenizer", str(ws / "tok"), "--output-dir", str(prepared)]) == 0
    capsys.readouterr()
    other = _same_size_other_tokenizer(ws / "tok", tmp_path / "other")
    config = run_config(ws, tmp_path, train_source=None, train_target=None, train_dataset=str(prepared))
    _check(
        ["train", config, f"tokenizer={other}"], ["train_dataset", "was encoded with the tokenizer", "ws"], ws, capsys
    )
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_translate_blank_input_gives_blank_output(ws, tmp_path, capsys, monkeypatch):
    assert main(["translate", str(ws / "model"), "", "--quiet", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "\n"
    assert main(["translate", str(ws / "model"), "-i", str(ws / "blank.txt"), "--quiet", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "\n\n"
    assert main(["translate", str(ws / "model"), "-i", str(ws / "empty.txt"), "--quiet", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"\n\n\n")))
    assert main(["translate", str(ws / "model"), "--quiet", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == "\n\n\n"


def test_force_lets_an_existing_folder_be_written(ws, tmp_path, capsys):
    out = tmp_path / "marian"
    shutil.copytree(ws / "model", out)  # one of ours, with its code files
    assert main(["export-marian", str(ws / "model"), str(out)]) == 2
    assert main(["export-marian", str(ws / "model"), "-o", str(out), "--force"]) == 0  # -o as in every command
    assert json.loads((out / "config.json").read_text(encoding="utf-8"))["model_type"] == "marian"
    assert not list(out.glob("*.py")), "our model code files stayed inside the Marian folder"


# ---- the folder checks and the run lock ----


def test_refuse_to_overwrite_and_check_writable(tmp_path):
    refuse_to_overwrite(tmp_path / "missing", force=False)
    (tmp_path / "empty").mkdir()
    refuse_to_overwrite(tmp_path / "empty", force=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty.*--force"):
        refuse_to_overwrite(tmp_path / "full", force=False)
    refuse_to_overwrite(tmp_path / "full", force=True)
    check_writable(tmp_path / "a" / "b")
    check_writable(tmp_path / "a" / "f.txt", "file")
    with pytest.raises(ValueError, match="is a folder"):
        check_writable(tmp_path / "full", "file")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_writable(tmp_path / "full" / "x" / "y")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full"]  # the probes leave nothing


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    with RunLock(tmp_path) as lock:
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
        assert lock.took_over is None
    assert not (tmp_path / LOCK_NAME).exists()

    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": _live_other_pid(), "host": os.uname().nodename}))
    with pytest.raises(RunLockError, match=f"process {_live_other_pid()}"):
        RunLock(tmp_path).acquire()

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead_pid, "host": os.uname().nodename}))
    with RunLock(tmp_path) as lock:
        assert lock.took_over == {"pid": dead_pid, "host": os.uname().nodename}
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_NAME).exists()


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "vaswani_tx.cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_concurrent_train_runs_on_one_folder_exactly_one_runs(ws, tmp_path):
    """Both start together; the one that takes the lock first trains, the other is refused naming its PID."""
    # 400 steps (about 10 s): with 100, under a loaded CI the second process once reached the lock after the first had
    # finished, and both exited 0.
    config = run_config(ws, tmp_path, max_steps=400, save_strategy="steps", save_steps=100)
    runs = [_cli("train", config, "--resume"), _cli("train", config, "--resume")]
    outputs = [run.communicate(timeout=300)[0] for run in runs]
    codes = sorted(run.returncode for run in runs)
    assert codes == [0, 2], [output[-3000:] for output in outputs]
    winner, loser = (0, 1) if runs[0].returncode == 0 else (1, 0)
    assert f"process {runs[winner].pid}" in outputs[loser] and "Traceback" not in outputs[loser]
    assert outputs[loser].strip().splitlines()[-1].startswith("vaswani-tx train: error: ")
    assert "averaged the last 4 checkpoints" in outputs[winner]  # average_last 5, and 4 were written
    assert (tmp_path / "out" / "averaged" / "model.safetensors").is_file()
    from vaswani_tx.data.tokenization import load_tokenizer, vocabulary_fingerprint

    saved = json.loads((tmp_path / "out" / "config.json").read_text(encoding="utf-8"))
    assert saved["tokenizer_fingerprint"] == vocabulary_fingerprint(load_tokenizer(ws / "tok"))
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (tmp_path / "out" / LOCK_NAME).exists()


# ---- Ctrl-C and errors no check foresaw ----


def test_ctrl_c_in_train_says_what_was_saved_and_how_to_resume(ws, tmp_path, capsys, monkeypatch):
    import vaswani_tx.training.checkpoints
    import vaswani_tx.training.recipe

    def interrupted(recipe, arguments, resume=False, force=False, callbacks=()):  # -20 complete, -30 half written
        (Path(arguments.output_dir) / "checkpoint-30").mkdir(parents=True)
        (Path(arguments.output_dir) / "checkpoint-20").mkdir(parents=True)
        raise KeyboardInterrupt

    def complete_only_20(folder, for_resume=True):
        if Path(folder).name != "checkpoint-20":
            raise vaswani_tx.training.checkpoints.CheckpointError(f"checkpoint {folder} is incomplete")

    monkeypatch.setattr(vaswani_tx.training.recipe, "train", interrupted)
    monkeypatch.setattr(vaswani_tx.training.checkpoints, "check_checkpoint", complete_only_20)
    config = run_config(ws, tmp_path)
    assert main(["train", config, "max_steps=3"]) == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "checkpoint-20" in err and "checkpoint-30" not in err
    assert f"vaswani-tx train {config} max_steps=3 --resume" in err


def test_ctrl_c_in_translate_says_nothing_was_written(ws, tmp_path, capsys, monkeypatch):
    from vaswani_tx.engine.translation import Translator

    def interrupted(self, lines, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Translator, "translate", interrupted)
    out = tmp_path / "hyp.de"
    argv = ["translate", str(ws / "model"), "-i", str(ws / "ok.txt"), "-o", str(out), "--device", "cpu", "--quiet"]
    assert main(argv) == 130
    assert f"{out} was not written" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_an_unforeseen_error_is_one_line_unless_debug(capsys, monkeypatch):
    import vaswani_tx.cli.params

    def broken(args):
        raise RuntimeError("something no check foresaw")

    monkeypatch.setattr(vaswani_tx.cli.params, "run", broken)
    assert main(["params", "x.json"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vaswani-tx params: error: unexpected RuntimeError: something no check foresaw")
    assert "--debug" in err and "Traceback" not in err
    with pytest.raises(RuntimeError, match="no check foresaw"):
        main(["--debug", "params", "x.json"])


# ---- one family of user errors (issue 27): it and OSError exit 2, anything else is a bug ----

SHAPE_BUG = "mat1 and mat2 shapes cannot be multiplied (3x24 and 40x24)"  # torch's ValueError for a shape bug


def test_a_plain_value_error_inside_a_command_is_a_bug_not_bad_input(ws, capsys, monkeypatch):
    """torch raises ValueError for a shape mismatch: one from inside a library call is a bug (exit 1, one line
    asking for a report), not `error: MESSAGE` and exit 2 as if the user's input were wrong."""
    from vaswani_tx.engine.translation import Translator

    def translate_with_a_shape_bug(self, lines, **kwargs):
        raise ValueError(SHAPE_BUG)

    monkeypatch.setattr(Translator, "translate", translate_with_a_shape_bug)
    argv = ["translate", str(ws / "model"), "A dog runs.", "--device", "cpu", "--quiet"]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        f"vaswani-tx translate: error: unexpected ValueError: {SHAPE_BUG} "
        "(run `vaswani-tx --debug ...` for the traceback, and please report it)"
    ]
    assert captured.out == ""
    with pytest.raises(ValueError, match=r"mat1 and mat2 shapes") as raised:
        main(["--debug", *argv])
    assert type(raised.value) is ValueError
    assert any(entry.name == "translate_with_a_shape_bug" for entry in raised.traceback)


def test_debug_prints_the_traceback_of_a_bug(tmp_path):
    """The same through the installed entry point's code path, in a process of its own: `--debug` lets the bug
    out, so Python prints its traceback down to the library function that raised it."""
    config = tmp_path / "model.json"
    config.write_text("{}", encoding="utf-8")
    script = textwrap.dedent(f"""
        import sys
        import vaswani_tx.training.params
        from vaswani_tx.cli import main

        def parameter_table(files):
            raise ValueError({SHAPE_BUG!r})

        vaswani_tx.training.params.parameter_table = parameter_table
        sys.exit(main(sys.argv[1:]))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-c", script, "--debug", "params", str(config)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback (most recent call last)" in result.stderr
    assert "vaswani_tx/cli/params.py" in result.stderr and ", in parameter_table\n" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"ValueError: {SHAPE_BUG}"
    assert "please report it" not in result.stderr


@pytest.mark.parametrize(
    "error, message",
    [
        (UserInputError("model config m.json: d_model=7 is odd"), "model config m.json: d_model=7 is odd"),
        (
            FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/data/m.json"),
            f"/data/m.json: {os.strerror(errno.ENOENT)}",
        ),
        (
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/out/model.safetensors"),
            f"/out/model.safetensors: {os.strerror(errno.ENOSPC)}",
        ),
        (
            PermissionError(errno.EACCES, os.strerror(errno.EACCES), "/out/a.tmp", None, "/out/a"),
            f"/out/a.tmp -> /out/a: {os.strerror(errno.EACCES)}",
        ),
        (FileExistsError("output folder out exists; pass --force"), "output folder out exists; pass --force"),
    ],
    ids=["user-input", "missing-file", "full-disk", "permission", "our-os-error"],
)
def test_user_input_and_os_errors_exit_2_in_one_line_even_with_debug(error, message, tmp_path, capsys, monkeypatch):
    import vaswani_tx.training.params

    def parameter_table(files):
        raise error

    monkeypatch.setattr(vaswani_tx.training.params, "parameter_table", parameter_table)
    config = tmp_path / "model.json"
    config.write_text("{}", encoding="utf-8")
    for debug in ([], ["--debug"]):  # --debug is for bugs: bad input stays one line
        assert main([*debug, "params", str(config)]) == 2
        captured = capsys.readouterr()
        assert captured.err.strip().splitlines() == [f"vaswani-tx params: error: {message}"], captured.err
        assert captured.out == ""


def test_a_config_value_the_paper_does_not_allow_exits_2(tmp_path, capsys):
    config = tmp_path / "odd.json"
    config.write_text(json.dumps({"d_model": 9, "num_heads": 3}), encoding="utf-8")
    assert main(["--debug", "params", str(config)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vaswani-tx params: error: VaswaniConfig: d_model=9 must be even"), err


def _package_modules() -> list[str]:
    import vaswani_tx

    root = Path(vaswani_tx.__file__).parent
    names = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "__main__.py":  # runs the CLI when imported
            continue
        parts = path.relative_to(root.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_every_error_class_of_the_package_is_a_user_input_error():
    """The package defines exception classes for input a user can fix only: each derives from UserInputError,
    so `main()` reports it as bad input (exit 2). A class for something else would need a reason here."""
    defined = {}
    for name in _package_modules():
        for value in vars(importlib.import_module(name)).values():
            if isinstance(value, type) and issubclass(value, BaseException) and value.__module__ == name:
                defined[f"{name}.{value.__name__}"] = value
    names = {cls.__name__ for cls in defined.values()}
    assert names >= {
        "UserInputError",
        "CorpusError",
        "CheckpointError",
        "ConfigError",
        "ConversionError",
        "RunLockError",
        "TreebankFormatError",
    }, sorted(defined)
    assert [name for name, cls in defined.items() if not issubclass(cls, UserInputError)] == []


def test_a_saved_model_carries_its_user_input_error(tmp_path):
    """The config raises UserInputError from errors.py, which save_pretrained copies beside it: the folder
    loads with trust_remote_code where vaswani_tx cannot be imported, and a bad value there is its
    UserInputError (a ValueError) too."""
    import vaswani_tx.model.errors
    from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration

    config = VaswaniConfig(vocab_size=40, d_model=8, d_ff=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1)
    folder = tmp_path / "model"
    VaswaniForConditionalGeneration(config).save_pretrained(folder)
    assert (folder / "errors.py").read_bytes() == Path(vaswani_tx.model.errors.__file__).read_bytes()
    script = textwrap.dedent(f"""
        import sys
        sys.modules["vaswani_tx"] = None  # importing vaswani_tx now fails, as where it is not installed
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
        config_class = type(model.config)
        assert config_class.__module__.startswith("transformers_modules"), config_class.__module__
        try:
            config_class(d_model=9, num_heads=3)
        except ValueError as error:
            print(type(error).__name__, type(error).__module__.rpartition(".")[2], error)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("UserInputError errors VaswaniConfig: d_model=9 must be even"), result.stdout


# ---- average-checkpoints: several runs, an incomplete last checkpoint ----


def _tiny_run(folder: Path, steps=(1, 2, 3)) -> None:
    from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration

    config = VaswaniConfig(vocab_size=40, d_model=8, d_ff=16, num_heads=2, num_encoder_layers=1, num_decoder_layers=1)
    for step in steps:
        torch.manual_seed(step)
        VaswaniForConditionalGeneration(config).save_pretrained(folder / f"checkpoint-{step}")


def test_average_checkpoints_skips_an_incomplete_last_checkpoint_and_refuses_several_runs(tmp_path, capsys):
    _tiny_run(tmp_path / "run")
    weights = tmp_path / "run" / "checkpoint-3" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # killed while saving
    assert (
        main(["average-checkpoints", str(tmp_path / "run"), "--last", "2", "--output-dir", str(tmp_path / "a")]) == 0
    )
    captured = capsys.readouterr()
    assert "skipping checkpoint-3" in captured.err and "checkpoint-1, checkpoint-2" in captured.out

    _tiny_run(tmp_path / "other")
    argv = ["average-checkpoints", str(tmp_path / "run"), str(tmp_path / "other"), "--output-dir", str(tmp_path / "b")]
    assert main(argv) == 2
    assert "is a run folder" in capsys.readouterr().err and not (tmp_path / "b").exists()


def test_quiet_greedy_translate_prints_nothing_on_stderr(ws):
    process = _cli("translate", str(ws / "model"), "A dog.", "--num-beams", "1", "--quiet", "--device", "cpu")
    output, _ = process.communicate(timeout=120)  # stderr goes to the same pipe
    assert process.returncode == 0 and len(output.splitlines()) == 1, output  # no bar, no length_penalty warning


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_is_found_before_work(tmp_path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            check_writable(tmp_path / "ro" / "out")
    finally:
        (tmp_path / "ro").chmod(0o700)


@pytest.mark.parametrize(
    "command",
    [
        "translate",
        "evaluate",
        "attention",
        "average-checkpoints",
        "train-tokenizer",
        "prepare-data",
        "convert",
        "export-marian",
        "export-ct2",
    ],
)
def test_every_command_with_an_output_option_takes_dash_o(command, capsys):
    """One convention (docs/translation.md): `-o FILE, --output FILE` where a command writes one file,
    `-o DIR, --output-dir DIR` where it writes a folder."""
    with pytest.raises(SystemExit):
        main([command, "--help"])
    out = capsys.readouterr().out
    assert "-o " in out
    expected = "-o FILE, --output FILE" if command == "translate" else "-o DIR, --output-dir DIR"
    assert expected in out, out


def test_help_of_every_command_loads_no_torch():
    """`vaswani-tx --help` and each command's --help print without importing torch or transformers (seconds of
    imports, issue 28): the package import is light and each command imports its libraries inside run()."""
    from vaswani_tx.cli import COMMANDS

    script = textwrap.dedent(f"""
        import contextlib, io, sys
        from vaswani_tx.cli import main
        heavy = ("torch", "transformers", "datasets", "tokenizers", "sacrebleu")
        for argv in [["--help"], *[[command, "--help"] for command in {sorted(COMMANDS)!r}]]:
            with contextlib.redirect_stdout(io.StringIO()) as out:
                try:
                    main(argv)
                except SystemExit:
                    pass
            assert "usage: vaswani-tx" in out.getvalue(), argv
            loaded = [name for name in heavy if name in sys.modules]
            assert not loaded, f"vaswani-tx {{' '.join(argv)}} imported {{loaded}}"
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_help_texts_say_what_the_code_does(capsys):
    """export-ct2 writes the model's own decoding settings (not always the paper's beam 4 and 0.6); the length
    penalty's form is the model's (GNMT for models trained here, |Y|^alpha for converted ones)."""
    for command, present, absent in [
        ("export-ct2", ["model's own decoding settings", "|Y|^alpha"], ["beam 4 and length penalty 0.6"]),
        ("translate", ["length_penalty_type", "|Y|^alpha", "GNMT"], []),
        ("export-marian", ["GNMT stays GNMT"], ["have no Marian equivalent"]),
    ]:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert all(words in text for words in present), (command, text)
        assert not any(words in text for words in absent), (command, text)


# ---- prepare-data's output feeds train ----


def test_prepare_data_output_feeds_train(ws, tmp_path, capsys):
    prepared = tmp_path / "prepared"
    argv = ["prepare-data", "--source-file", str(ws / "train.en"), "--target-file", str(ws / "train.de")]
    argv += ["--cache-dir", str(tmp_path / "cache")]
    assert main([*argv, "--tokenizer", str(ws / "tok"), "--output-dir", str(prepared)]) == 0
    config = run_config(ws, tmp_path, train_source=None, train_target=None, train_dataset=str(prepared))
    assert main(["train", config]) == 0, capsys.readouterr().err[-3000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()
    capsys.readouterr()
    # a dataset encoded with a bigger vocabulary than the run's tokenizer is refused before training
    small = tmp_path / "small-tok"
    assert main(["train-tokenizer", str(ws / "train.en"), "--vocab-size", "300", "--output-dir", str(small)]) == 0
    config = run_config(ws, tmp_path, train_source=None, train_target=None, train_dataset=str(prepared))
    overrides = [f"tokenizer={small}", f"output_dir={tmp_path / 'out2'}", "model_config=" + str(tmp_path / "m.json")]
    model_config = json.loads((ws / "model.json").read_text(encoding="utf-8"))
    (tmp_path / "m.json").write_text(json.dumps({**model_config, "vocab_size": 300}), encoding="utf-8")
    capsys.readouterr()
    assert main(["train", config, *overrides]) == 2
    assert "encoded with another tokenizer" in capsys.readouterr().err
