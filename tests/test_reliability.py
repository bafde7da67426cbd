"""Nothing lost (issue 28): every command writes its result beside the target and moves it into place at the end,
so a full disk, a crash, Ctrl-C or SIGTERM leaves the earlier result whole and the message names the file;
temporary names are unique per process; nothing that exists is replaced without --force; `train` into a folder
holding another run's results is refused unless --force, and a resumed run keeps an unchanged average.

Full disks are real where a subprocess can have one (RLIMIT_FSIZE with SIGXFSZ ignored, so that a write fails with
EFBIG) and simulated elsewhere (a writer that writes part of its output, then raises); interruptions are a
KeyboardInterrupt raised part way, and a real SIGTERM sent to a subprocess.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from test_cli_errors import run_config  # the CLI tests' tiny run config
from vaswani_tx.atomic import atomic_file, atomic_folder, write_text
from vaswani_tx.cli import main

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def tree_hash(path: Path) -> str:
    digest = hashlib.sha256()
    for item in sorted([path, *path.rglob("*")] if path.is_dir() else [path]):
        digest.update(str(item.relative_to(path)).encode())
        if item.is_file():
            digest.update(item.read_bytes())
    return digest.hexdigest()


def leftovers(folder: Path) -> list[str]:
    """Temporary files or folders of ours left in `folder` (there must be none)."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".partial", ".old")))


def full_disk(limit: int = 1024):
    """A preexec_fn: writes past `limit` bytes fail with EFBIG (SIGXFSZ ignored), as on a full disk (`ulimit -f`)."""

    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "vaswani_tx.cli", *args],
        env=ENV,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def fail_part_way(monkeypatch, owner, name: str, error: BaseException) -> None:
    """Make `owner.name` (a writer) do its work, then raise `error`: the output is part written when it stops."""
    real = getattr(owner, name)

    def writer(*args, **kwargs):
        real(*args, **kwargs)
        raise error

    monkeypatch.setattr(owner, name, writer)


def efbig() -> OSError:
    return OSError(errno.EFBIG, "File too large")  # as a write() on a full disk raises it: no file name


@pytest.fixture(scope="module")
def ws(tiny_translator, shared_data, tmp_path_factory) -> Path:
    folder, model, tokenizer = tiny_translator
    ws = tmp_path_factory.mktemp("reliability")
    shutil.copytree(folder, ws / "model")
    tokenizer.save_pretrained(ws / "tok")
    for lang in ("en", "de"):
        lines = (shared_data / "multi30k-en-de" / f"val.{lang}").read_text(encoding="utf-8").splitlines()
        (ws / f"test.{lang}").write_text("\n".join(lines[:12]) + "\n", encoding="utf-8")
        (ws / f"long.{lang}").write_text("\n".join(lines[:400]) + "\n", encoding="utf-8")
    (ws / "model.json").write_text(json.dumps(model.config.to_dict()), encoding="utf-8")
    from vaswani_tx.interop.export import export_marian

    export_marian(ws / "model", ws / "marian")  # a source for `convert`, with its tokenizer
    return ws


# ---- the helpers ----


def test_a_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "out.txt"
    write_text(target, "good\n")
    with pytest.raises(KeyboardInterrupt), atomic_file(target) as partial:
        partial.write_text("half")
        raise KeyboardInterrupt
    assert target.read_text() == "good\n" and leftovers(tmp_path) == []
    with pytest.raises(OSError) as raised, atomic_file(target) as partial:
        partial.write_text("half")
        raise efbig()
    assert raised.value.filename == str(target) and raised.value.errno == errno.EFBIG
    assert "the earlier one is unchanged" in raised.value.strerror
    assert target.read_text() == "good\n" and leftovers(tmp_path) == []
    with atomic_file(target) as partial:
        assert partial.parent == target.parent and f".{os.getpid()}." in partial.name  # beside it, this process's
        partial.write_text("new\n")
    assert target.read_text() == "new\n" and leftovers(tmp_path) == []
    with pytest.raises(OSError) as raised, atomic_file(tmp_path / "a" / "b" / "new.txt"):  # nothing existed
        raise efbig()
    assert "nothing was left behind" in raised.value.strerror and not (tmp_path / "a").exists()  # nor its folders


def test_a_folder_is_swapped_in_whole_or_not_at_all(tmp_path):
    target = tmp_path / "model"
    with atomic_folder(target) as partial:
        (partial / "weights").write_text("old")
    (target / "val.scores.json").write_text("{}")  # written beside it later
    before = tree_hash(target)
    for error in (KeyboardInterrupt(), efbig(), Exception("I/O error: File too large (os error 27)")):
        with pytest.raises((KeyboardInterrupt, OSError)) as raised, atomic_folder(target) as partial:
            (partial / "weights").write_text("ne")
            raise error
        assert tree_hash(target) == before and leftovers(tmp_path) == []
        if not isinstance(error, KeyboardInterrupt):  # safetensors' and tokenizers' I/O errors too name the target
            assert raised.value.filename == str(target) and raised.value.errno == errno.EFBIG
    with atomic_folder(target, keep_unchanged=True) as partial:  # the same weights: kept, with its scores
        (partial / "weights").write_text("old")
    assert tree_hash(target) == before
    with atomic_folder(target, keep_unchanged=True) as partial:  # new weights: the folder is replaced whole
        (partial / "weights").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["weights"] and leftovers(tmp_path) == []
    with atomic_folder(target, merge=True) as partial:  # merge: each file whole, the rest stays
        (partial / "card.md").write_text("card")
    assert sorted(p.name for p in target.iterdir()) == ["card.md", "weights"]  # no temporary left inside either
    with pytest.raises(KeyboardInterrupt), atomic_folder(target, merge=True) as partial:
        assert partial.parent == target  # built inside the folder it fills: only that folder need be writable
        (partial / "card.md").write_text("half")
        raise KeyboardInterrupt
    assert (
        sorted(p.name for p in target.iterdir()) == ["card.md", "weights"]
        and (target / "card.md").read_text() == "card"
    )


def test_a_real_full_disk_names_the_file_and_keeps_the_earlier_one(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("good\n")
    code = (
        "from vaswani_tx.atomic import write_text\n"
        "try:\n"
        f"    write_text({str(target)!r}, 'x' * 100_000)\n"
        "except OSError as err:\n"
        "    print(err.errno, err.filename, err.strerror)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=ENV, capture_output=True, text=True, preexec_fn=full_disk(), timeout=60
    )
    assert result.stdout.startswith(f"{errno.EFBIG} {target} File too large"), result.stdout + result.stderr
    assert target.read_text() == "good\n" and leftovers(tmp_path) == []


def test_sigterm_while_writing_leaves_the_earlier_file(tmp_path):
    """A real SIGTERM in the middle of a slow write, under the handler `vaswani-tx` installs."""
    target = tmp_path / "out.txt"
    target.write_text("good\n")
    code = textwrap.dedent(f"""
        import sys, time
        from vaswani_tx.atomic import atomic_file, sigterm_as_interrupt
        received = []
        try:
            with sigterm_as_interrupt(received), atomic_file({str(target)!r}) as partial:
                with open(partial, "w") as file:
                    for chunk in range(200):  # 10 s at most
                        file.write("x" * 1000)
                        file.flush()
                        if chunk == 0:
                            print("writing", flush=True)
                        time.sleep(0.05)
        except KeyboardInterrupt:
            sys.exit(143 if received else 130)
    """)
    process = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "writing"
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 143
    assert target.read_text() == "good\n" and leftovers(tmp_path) == []


def test_a_sigterm_that_lands_where_python_drops_exceptions_still_stops_the_block(tmp_path):
    """Python runs a signal's handler between any two bytecodes, also inside a ``__del__`` or a weakref callback
    (an import's module-lock callback), where the ``KeyboardInterrupt`` it raises is printed and dropped: the
    block went on and the process exited 0 (what CI once met in a compiling process). Here the signal is raised
    inside a ``__del__``; the block must still stop, its file must not be written, and nothing is printed."""
    target = tmp_path / "out.txt"
    target.write_text("good\n")
    code = textwrap.dedent(f"""
        import signal, sys, time
        from vaswani_tx.atomic import atomic_file, sigterm_as_interrupt

        def a_call():  # its first bytecode is where the pending handler runs: inside __del__
            pass

        class Freed:
            def __del__(self):
                signal.raise_signal(signal.SIGTERM)
                a_call()

        received = []
        try:
            with sigterm_as_interrupt(received), atomic_file({str(target)!r}) as partial:
                with open(partial, "w") as file:
                    file.write("partial")
                Freed()  # freed at once
                deadline = time.monotonic() + 20
                while time.monotonic() < deadline:
                    time.sleep(0.01)
        except KeyboardInterrupt:
            sys.exit(143 if received == [signal.SIGTERM] else 130)
    """)
    result = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 143 and result.stderr == "", result.stderr
    assert target.read_text() == "good\n" and leftovers(tmp_path) == []


# ---- translate ----


def translate_argv(ws: Path, out: Path) -> list[str]:
    return ["translate", str(ws / "model"), "-i", str(ws / "test.en"), "-o", str(out), "--device", "cpu", "--quiet"]


def test_translate_refuses_an_existing_output_and_keeps_it_on_failure(ws, tmp_path, capsys, monkeypatch):
    out = tmp_path / "hyp.de"
    out.write_text("earlier\n")
    assert main(translate_argv(ws, out)) == 2
    assert f"output file {out} already exists" in capsys.readouterr().err and out.read_text() == "earlier\n"

    with monkeypatch.context() as patch:
        fail_part_way(patch, Path, "write_bytes", efbig())
        assert main([*translate_argv(ws, out), "--force"]) == 2
    assert f"{out}: File too large; not written, the earlier one is unchanged" in capsys.readouterr().err
    assert out.read_text() == "earlier\n" and leftovers(tmp_path) == []

    fail_part_way(monkeypatch, Path, "write_bytes", KeyboardInterrupt())
    assert main([*translate_argv(ws, out), "--force"]) == 130
    assert "what it held before is unchanged" in capsys.readouterr().err
    assert out.read_text() == "earlier\n" and leftovers(tmp_path) == []


def test_translate_on_a_full_disk_names_the_file(ws, tmp_path):
    out = tmp_path / "hyp.de"
    out.write_text("earlier\n")
    process = cli(*translate_argv(ws, out), "--num-beams", "1", "--force", preexec_fn=full_disk(200))
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err[-2000:]
    assert err.strip().endswith(f"{out}: File too large; not written, the earlier one is unchanged"), err[-2000:]
    assert out.read_text() == "earlier\n" and leftovers(tmp_path) == []


def test_sigterm_during_translate_leaves_the_earlier_output(ws, tmp_path):
    out = tmp_path / "hyp.de"
    out.write_text("earlier\n")
    argv = ["translate", str(ws / "model"), "-i", str(ws / "long.en"), "-o", str(out), "--force", "--device", "cpu"]
    process = cli(*argv, "--batch-size", "1")
    deadline = time.monotonic() + 120
    seen = ""
    while "Translating" not in seen:  # the progress bar: decoding has begun (400 lines take far longer)
        assert process.poll() is None and time.monotonic() < deadline, seen
        seen += process.stderr.read(1)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err
    assert out.read_text() == "earlier\n" and leftovers(tmp_path) == []


def test_two_translate_processes_writing_one_file_both_succeed(ws, tmp_path):
    out = tmp_path / "hyp.de"
    runs = [cli(*translate_argv(ws, out), "--num-beams", "1", "--force") for _ in range(2)]
    errors = [run.communicate(timeout=180)[1] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for err in errors]
    assert len(out.read_text(encoding="utf-8").splitlines()) == 12 and leftovers(tmp_path) == []


# ---- evaluate ----


def evaluate_argv(ws: Path, out: Path) -> list[str]:
    return ["evaluate", str(ws / "model"), "-s", str(ws / "test.en"), "-r", str(ws / "test.de"), "-o", str(out)]


def test_evaluate_keeps_the_earlier_pair_whole(ws, tmp_path, capsys, monkeypatch):
    argv = [*evaluate_argv(ws, tmp_path / "eval"), "--num-beams", "1", "--device", "cpu", "--quiet"]
    assert main(argv) == 0
    before = tree_hash(tmp_path / "eval")
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["test.hyp.de", "test.scores.json"]

    capsys.readouterr()
    assert main(argv) == 2  # refused before decoding, naming both files
    err = capsys.readouterr().err
    assert "test.hyp.de" in err and "test.scores.json" in err and "--force" in err

    # the disk fills while the scores are written: the hypotheses, already complete, are not put in place either
    real = Path.write_text

    def scores_fill_the_disk(self, text, *args, **kwargs):
        if ".scores.json." in self.name:
            real(self, text[:50], *args, **kwargs)
            raise efbig()
        return real(self, text, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Path, "write_text", scores_fill_the_disk)
        assert main([*argv, "--force"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'eval' / 'test.scores.json'}: File too large; not written" in err
    assert tree_hash(tmp_path / "eval") == before and leftovers(tmp_path / "eval") == []

    fail_part_way(monkeypatch, Path, "write_text", KeyboardInterrupt())
    assert main([*argv, "--force"]) == 130
    assert tree_hash(tmp_path / "eval") == before and leftovers(tmp_path / "eval") == []


def test_evaluate_on_a_real_full_disk(ws, tmp_path):
    out = tmp_path / "eval"
    argv = [*evaluate_argv(ws, out), "--num-beams", "1", "--device", "cpu", "--quiet"]
    process = cli(*argv)  # also fills the evaluate library's module cache before the disk is full
    assert process.wait(timeout=180) == 0, process.communicate()[1][-2000:]
    before = tree_hash(out)
    process = cli(*argv, "--force", preexec_fn=full_disk(600))
    _, err = process.communicate(timeout=180)
    assert process.returncode == 2, err[-2000:]
    assert "File too large; not written, the earlier one is unchanged" in err and str(out / "test.") in err, err
    assert tree_hash(out) == before and leftovers(out) == []


# ---- the commands that write a folder ----


def _export_ct2_interrupted(monkeypatch, error):
    """export-ct2's CTranslate2 writer stops after model.bin: cut to 237 bytes, as a SIGINT left it (issue 28)."""
    from ctranslate2.specs.model_spec import SequenceToSequenceModelSpec

    save = SequenceToSequenceModelSpec.save

    def stopped(self, folder):
        save(self, folder)
        with open(Path(folder) / "model.bin", "r+b") as file:
            file.truncate(237)
        raise error

    monkeypatch.setattr(SequenceToSequenceModelSpec, "save", stopped)


def _folder_cases(ws: Path):
    """command -> (argv writing OUT, a function making its writer fail part way with an error)."""
    import datasets
    from transformers import MarianMTModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    from vaswani_tx import VaswaniForConditionalGeneration

    prepare = ["prepare-data", "--source-file", str(ws / "test.en"), "--target-file", str(ws / "test.de")]
    return {
        "export-ct2": (["export-ct2", str(ws / "model"), "{out}"], _export_ct2_interrupted),
        "export-marian": (
            ["export-marian", str(ws / "model"), "{out}"],
            lambda mp, error: fail_part_way(mp, MarianMTModel, "save_pretrained", error),
        ),
        "convert": (
            ["convert", str(ws / "marian"), "{out}"],
            lambda mp, error: fail_part_way(mp, VaswaniForConditionalGeneration, "save_pretrained", error),
        ),
        "average-checkpoints": (
            ["average-checkpoints", str(ws / "model"), str(ws / "model"), "-o", "{out}"],
            lambda mp, error: fail_part_way(mp, VaswaniForConditionalGeneration, "save_pretrained", error),
        ),
        "train-tokenizer": (
            ["train-tokenizer", str(ws / "test.en"), "--vocab-size", "300", "-o", "{out}"],
            lambda mp, error: fail_part_way(mp, PreTrainedTokenizerBase, "save_pretrained", error),
        ),
        "prepare-data": (
            [*prepare, "--tokenizer", str(ws / "tok"), "-o", "{out}", "--cache-dir", str(ws / "cache")],
            lambda mp, error: fail_part_way(mp, datasets.Dataset, "save_to_disk", error),
        ),
    }


@pytest.mark.parametrize(
    "command", ["export-ct2", "export-marian", "convert", "average-checkpoints", "train-tokenizer", "prepare-data"]
)
def test_a_failed_or_interrupted_folder_write_leaves_the_earlier_folder(command, ws, tmp_path, capsys, monkeypatch):
    if command == "export-ct2":
        pytest.importorskip("ctranslate2")
    argv, stop = _folder_cases(ws)[command]
    out = tmp_path / "out"
    argv = [arg.replace("{out}", str(out)) for arg in argv]
    assert main(argv) == 0, capsys.readouterr().err
    (out / "notes.txt").write_text("the user's own file in it")  # --force replaces the folder whole, notes too
    before = tree_hash(out)
    capsys.readouterr()
    with monkeypatch.context() as patch:
        stop(patch, KeyboardInterrupt())
        assert main([*argv, "--force"]) == 130
    assert tree_hash(out) == before and leftovers(tmp_path) == []
    with monkeypatch.context() as patch:
        stop(patch, efbig())
        assert main([*argv, "--force"]) == 2
    assert f"{out}: File too large; not written, the earlier one is unchanged" in capsys.readouterr().err
    assert tree_hash(out) == before and leftovers(tmp_path) == []
    assert main([*argv, "--force"]) == 0
    # replaced whole; the same average again keeps the folder as it is (what was written beside it stays valid)
    assert (out / "notes.txt").exists() == (command == "average-checkpoints") and leftovers(tmp_path) == []

    shutil.rmtree(out)  # a first write interrupted leaves nothing that would need --force
    with monkeypatch.context() as patch:
        stop(patch, KeyboardInterrupt())
        assert main(argv) == 130
    assert not out.exists() and leftovers(tmp_path) == []


def test_force_never_replaces_a_folder_holding_the_input(ws, tmp_path, capsys):
    shutil.copytree(ws / "model", tmp_path / "model")
    argv = ["export-marian", str(tmp_path / "model"), "-o", str(tmp_path), "--force"]
    assert main(argv) == 2
    assert "which this command reads" in capsys.readouterr().err and (tmp_path / "model" / "config.json").is_file()


def test_attention_maps_keep_the_earlier_ones(ws, tmp_path, capsys, monkeypatch):
    import vaswani_tx.demo.attention_maps

    out = tmp_path / "maps"
    argv = ["attention", str(ws / "model"), "--sentence", "A dog runs.", "--translation", "Ein Hund läuft.", "-o"]
    argv += [str(out), "--kinds", "cross", "--layers", "1"]
    assert main(argv) == 0
    (out / "notes.txt").write_text("kept")
    before = tree_hash(out)
    assert main(argv) == 2 and "cross-layer1.png" in capsys.readouterr().err and tree_hash(out) == before
    fail_part_way(monkeypatch, vaswani_tx.demo.attention_maps, "plot_attention_maps", KeyboardInterrupt())
    assert main([*argv, "--force"]) == 130
    assert tree_hash(out) == before and leftovers(tmp_path) == [] and leftovers(out) == []


# ---- train: another run's results, a resumed run's average ----


LANGUAGES = (("source", "en"), ("target", "de"))


def train_config(ws: Path, tmp_path: Path, run: Path, **values) -> str:
    """test_cli_errors' tiny run config, trained on this workspace's test files, saving each step, averaging 2."""
    files = {f"{split}_{side}": str(ws / f"test.{lang}") for split in ("train", "dev") for side, lang in LANGUAGES}
    return run_config(
        ws, tmp_path, **files, output_dir=str(run), save_strategy="steps", save_steps=1, average_last=2, **values
    )


def test_train_refuses_a_folder_with_another_runs_results_unless_force(ws, tmp_path, capsys):
    run = tmp_path / "run"
    config = train_config(ws, tmp_path, run)
    assert main(["train", config]) == 0
    averaged = run / "averaged"
    (averaged / "val.scores.json").write_text('{"sacrebleu": 38.61}')  # scripts/main.sh evaluates into it
    (run / "val.scores.json").write_text('{"sacrebleu": 38.61}')
    earlier_weights = (averaged / "model.safetensors").read_bytes()

    # the run resumed after it finished: the same average, kept as it was with its scores
    before = tree_hash(averaged)
    assert main(["train", config, "--resume"]) == 0
    assert tree_hash(averaged) == before

    # its checkpoints and final model removed, a new run into it is refused, and nothing changes
    for path in run.iterdir():
        if path.name.startswith("checkpoint-") or path.name in ("config.json", "model.safetensors"):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    before = tree_hash(run)
    capsys.readouterr()
    assert main(["train", config, "seed=7"]) == 2
    err = capsys.readouterr().err
    assert "already holds" in err and "averaged/" in err and "val.scores.json" in err and "--force" in err
    assert tree_hash(run) == before

    # with --force the new run replaces them once finished: no score of the earlier weights beside the new ones
    assert main(["train", config, "seed=7", "--force"]) == 0
    assert (averaged / "model.safetensors").read_bytes() != earlier_weights
    assert not (averaged / "val.scores.json").exists() and not (run / "val.scores.json").exists()
    assert (run / "model.safetensors").is_file() and (run / "log_history.json").is_file()
    assert leftovers(run) == [] and leftovers(averaged) == []


def test_a_resumed_run_replaces_its_average_whole_and_says_what_went(ws, tmp_path, caplog):
    run = tmp_path / "run"
    config = train_config(ws, tmp_path, run)
    assert main(["train", config]) == 0
    (run / "averaged" / "val.scores.json").write_text("{}")
    with caplog.at_level("WARNING", logger="vaswani_tx.training.recipe"):
        assert main(["train", config, "max_steps=3", "--resume"]) == 0
    averaged_from = json.loads((run / "averaged" / "averaged_from.json").read_text())["checkpoints"]
    assert [Path(c).name for c in averaged_from] == ["checkpoint-2", "checkpoint-3"]
    assert not (run / "averaged" / "val.scores.json").exists() and "val.scores.json" in caplog.text


def test_an_interrupted_average_leaves_the_earlier_one(ws, tmp_path, monkeypatch):
    from vaswani_tx import VaswaniForConditionalGeneration
    from vaswani_tx.training.checkpoints import average_checkpoints

    out = tmp_path / "averaged"
    average_checkpoints([ws / "model"], out)
    before = tree_hash(out)
    fail_part_way(monkeypatch, VaswaniForConditionalGeneration, "save_pretrained", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        average_checkpoints([ws / "model", ws / "model"], out)
    assert tree_hash(out) == before and leftovers(tmp_path) == []


STEP = """
import signal, sys, time
marker = sys.argv[1]
def stop(signum, frame):
    time.sleep(0.3)  # a step that takes a moment to stop (a checkpoint being written)
    open(marker, "a").write(signal.Signals(signum).name + "\\n")
    sys.exit(130)
signal.signal(signal.SIGTERM, stop)
open(marker, "w").write("started\\n")
time.sleep(60)
"""


@pytest.mark.parametrize("sent, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupt_of_the_main_script_stops_its_running_step(tmp_path, sent, status):
    """scripts/main.sh runs each step through `forwarding` (scripts/forward_signals.sh): SIGINT or SIGTERM sent to
    the script reaches the step as SIGTERM (what `vaswani-tx` takes as Ctrl-C), the script waits for the step to
    stop and exits, running nothing after it. Bash alone would wait for the step (SIGINT) or leave it running
    (SIGTERM)."""
    step, marker, after = tmp_path / "step.py", tmp_path / "marker", tmp_path / "after"
    step.write_text(STEP)
    script = (
        f"set -euo pipefail; source {REPO / 'scripts' / 'forward_signals.sh'}; "
        f"forwarding {sys.executable} {step} {marker}; touch {after}"
    )
    # A test run started in the background (`nohup ... &`, a runner without job control) ignores SIGINT, and bash
    # cannot trap a signal ignored when it starts: the script gets SIGINT's default here, as from a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler, so the child's is the default
    try:
        process = subprocess.Popen(["bash", "-c", script])
    finally:
        signal.signal(signal.SIGINT, previous)
    deadline = time.monotonic() + 30
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    process.send_signal(sent)
    assert process.wait(timeout=30) == status
    assert marker.read_text().split() == ["started", "SIGTERM"]  # stopped by its own handler, before the script
    assert not after.exists()


def test_the_main_script_passes_on_each_steps_exit_status_and_runs_every_step_through_forwarding():
    """Without a signal `forwarding` returns the step's exit status (so `set -e` and `||` act on it as before); every
    `vaswani-tx` command of scripts/main.sh goes through it."""
    script = f"source {REPO / 'scripts' / 'forward_signals.sh'}; forwarding {sys.executable} -c 'exit(3)' || echo $?"
    assert subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout.strip() == "3"
    lines = (REPO / "scripts" / "main.sh").read_text().splitlines()
    steps = [line for line in lines if "$VX " in line and not line.lstrip().startswith("#")]
    assert len(steps) == 4 and all(line.startswith("forwarding $VX ") for line in steps)
