"""Checkpoints written whole (issue 83): a save that is interrupted or fails leaves no `checkpoint-N` folder, the
command the log prints resumes, rotation keeps complete checkpoints, two processes build each checkpoint together;
a write that fails names its file and cause (exit 2); a resume with another model config or tokenizer names the
fields that differ, before any work.

Runs are the CLI tests' tiny run (test_cli_errors), in-process; a real SIGTERM, two processes and a real file size
limit run the command in a subprocess.
"""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

import test_cli_errors
from test_cli_errors import run_config
from test_reliability import ENV, REPO, fail_part_way, full_disk
from test_training import _free_port as free_port
from vaswani_tx.cli import main
from vaswani_tx.training.checkpoints import check_checkpoint, checkpoint_folders

ws = test_cli_errors.ws  # the CLI tests' workspace fixture: a tiny model, its tokenizer, 40 training pairs
TORCH_WRITE_FAILURE = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"  # torch 2.13, full disk


def saving_config(ws: Path, tmp_path: Path, **values) -> str:
    return run_config(ws, tmp_path, **{"save_strategy": "steps", "save_steps": 1, "max_steps": 3, **values})


def names(run: Path) -> list[str]:
    """Everything the run folder holds that a checkpoint or a save left (hidden entries included)."""
    return sorted(p.name for p in run.iterdir() if "checkpoint" in p.name)


def save_stopped_at(monkeypatch, step: int, error: BaseException) -> None:
    """torch.save writes part of checkpoint-`step`'s optimizer.pt, then raises `error`."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if str(f).endswith(f"checkpoint-{step}/optimizer.pt"):
            Path(f).write_bytes(b"PK\x03\x04 part of a zip")
            raise error
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


# ---- item 6: whole or not at all ----


@pytest.mark.parametrize("step", [1, 2])
def test_an_interrupted_save_leaves_no_checkpoint_and_the_printed_command_resumes(
    step, ws, tmp_path, capsys, caplog, monkeypatch
):
    config, run = saving_config(ws, tmp_path, save_total_limit=2), tmp_path / "out"
    save_stopped_at(monkeypatch, step, KeyboardInterrupt())  # Ctrl-C, or SIGTERM under `vaswani-tx`
    assert main(["train", config]) == 130
    err = capsys.readouterr().err
    assert names(run) == [f"checkpoint-{n}" for n in range(1, step)]  # no half checkpoint, no staging folder
    saved = f"the last checkpoint saved is {run / 'checkpoint-1'}" if step == 2 else "no checkpoint was saved yet"
    assert saved in err, err
    command = err.split("Continue with: ")[1].strip()
    assert command == f"vaswani-tx train {config} --resume"

    monkeypatch.undo()
    with caplog.at_level("INFO", logger="vaswani_tx"):
        assert main(command.split()[1:]) == 0
    assert ("resuming from" if step == 2 else "starting a new run") in caplog.text
    # the Trainer's rotation (save_total_limit 2) ran on published checkpoints only
    assert names(run) == ["checkpoint-2", "checkpoint-3"]
    for folder in checkpoint_folders(run):
        check_checkpoint(folder)
        assert (folder / "sampler_state.json").is_file()
    assert json.loads((run / "checkpoint-3" / "trainer_state.json").read_text())["global_step"] == 3


def test_sigterm_during_a_save_leaves_the_checkpoints_before_it_and_the_printed_command_resumes(ws, tmp_path):
    config, run, saving = saving_config(ws, tmp_path), tmp_path / "out", tmp_path / "saving"
    slowed = textwrap.dedent(f"""
        import sys, time, torch
        from pathlib import Path
        from vaswani_tx.cli import main
        real = torch.save
        def save(obj, f, *args, **kwargs):  # checkpoint-2's optimizer is written slowly
            real(obj, f, *args, **kwargs)
            if str(f).endswith("checkpoint-2/optimizer.pt"):
                Path({str(saving)!r}).touch()
                time.sleep(60)
        torch.save = save
        sys.exit(main(["train", {config!r}]))
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", slowed], env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 240
    while not saving.exists():
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "checkpoint-2 was not being saved within 240 s"
        time.sleep(0.05)
    assert (run / ".checkpoint-2.partial" / "checkpoint-2" / "optimizer.pt").is_file()  # built beside its name
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err[-3000:]
    assert names(run) == ["checkpoint-1"], err[-3000:]
    check_checkpoint(run / "checkpoint-1")
    assert f"the last checkpoint saved is {run / 'checkpoint-1'}" in err
    command = err.split("Continue with: ")[1].strip()
    assert main(command.split()[1:]) == 0
    assert names(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_what_a_killed_save_left_is_removed_with_a_line_and_resume_starts_fresh(ws, tmp_path, caplog):
    config, run = saving_config(ws, tmp_path), tmp_path / "out"
    # kill -9 during the first save: its staging folder, and atomic_folder's one while it was moved in
    left = run / ".checkpoint-1.partial" / "checkpoint-1"
    left.mkdir(parents=True)
    (left / "model.safetensors").write_bytes(b"\x08\x00")
    (run / ".checkpoint-1.4242.0a1b2c3d.partial").mkdir()
    with caplog.at_level("INFO", logger="vaswani_tx"):
        assert main(["train", config, "--resume"]) == 0
    log = caplog.text
    assert f"removed {run / '.checkpoint-1.partial'}, left by a checkpoint save that was interrupted" in log
    assert f"removed {run / '.checkpoint-1.4242.0a1b2c3d.partial'}, left by" in log and "starting a new run" in log
    assert names(run) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_save_replaces_a_checkpoint_of_its_step_that_could_not_be_resumed(ws, tmp_path, caplog):
    config, run = saving_config(ws, tmp_path), tmp_path / "out"
    assert main(["train", config, "max_steps=2"]) == 0
    (run / "checkpoint-2" / "optimizer.pt").write_bytes(b"damaged")
    with caplog.at_level("INFO", logger="vaswani_tx"):
        assert main(["train", config, "--resume"]) == 0
    assert "skipping checkpoint-2" in caplog.text and f"replacing {run / 'checkpoint-2'}" in caplog.text
    for folder in checkpoint_folders(run):
        check_checkpoint(folder)


def test_two_processes_build_each_checkpoint_together_and_move_it_in_whole(ws, tmp_path):
    """Every process writes its RNG state into the staging folder; the main one moves it in only after all have
    (transformers' own staging renamed while other processes still wrote: #27925, #36076)."""
    config, run = saving_config(ws, tmp_path, save_total_limit=2), tmp_path / "out"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    result = subprocess.run(
        [*launch, "--main_process_port", str(free_port()), "-m", "vaswani_tx.cli", "train", config],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert names(run) == ["checkpoint-2", "checkpoint-3"]
    for folder in checkpoint_folders(run):
        check_checkpoint(folder)
        assert sorted(path.name for path in folder.glob("rng_state*")) == ["rng_state_0.pth", "rng_state_1.pth"]


# ---- item 7: a write that fails names its file and cause ----


def test_a_real_file_size_limit_during_a_save_names_the_file_and_keeps_no_checkpoint(ws, tmp_path):
    config, run = saving_config(ws, tmp_path), tmp_path / "out"
    # model.safetensors fits, torch's optimizer.pt (twice its size) does not: torch's writer fails as on a full disk
    limit = int((ws / "model" / "model.safetensors").stat().st_size * 1.3)
    result = subprocess.run(
        [sys.executable, "-m", "vaswani_tx.cli", "train", config],
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
        preexec_fn=full_disk(limit),
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-3000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line == (
        f"vaswani-tx train: error: {run / 'checkpoint-1' / 'optimizer.pt'}: File too large; checkpoint-1 was not "
        "written (there is no complete one yet)"
    ), result.stderr[-3000:]
    assert names(run) == []


def test_a_full_disk_at_the_second_save_names_the_file_and_the_last_complete_checkpoint(
    ws, tmp_path, capsys, monkeypatch
):
    from transformers import TrainerState

    config, run = saving_config(ws, tmp_path), tmp_path / "out"
    calls = []
    real = TrainerState.save_to_json

    def save_to_json(self, path):
        calls.append(path)
        real(self, path)
        if len(calls) == 2:  # checkpoint-2's, written in part: write() names no file
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TrainerState, "save_to_json", save_to_json)
    assert main(["train", config]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"vaswani-tx train: error: {run / 'checkpoint-2' / 'trainer_state.json'}: No space left on device; "
        "checkpoint-2 was not written (the last complete one is checkpoint-1)"
    ), err[-2000:]
    assert names(run) == ["checkpoint-1"]


def test_torch_failing_to_write_the_final_model_is_exit_2_naming_the_file(ws, tmp_path, capsys, monkeypatch):
    config, run = run_config(ws, tmp_path), tmp_path / "out"
    fail_part_way(monkeypatch, torch, "save", RuntimeError(TORCH_WRITE_FAILURE))  # the final training_args.bin
    assert main(["train", config]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    # a test write succeeds there: the cause is unknown (EIO), the file is named, and nothing of the model kept
    assert err == (
        f"vaswani-tx train: error: {run / 'training_args.bin'}: Input/output error; not written, the earlier one is "
        "unchanged"
    )
    assert not (run / "model.safetensors").exists()


# ---- item 7: a resume with another model ----


def test_resume_with_another_model_config_names_the_fields_before_any_work(ws, tmp_path, capsys, monkeypatch):
    import vaswani_tx.training.recipe

    config, run = saving_config(ws, tmp_path, max_steps=1), tmp_path / "out"
    assert main(["train", config]) == 0
    values = yaml.safe_load(Path(config).read_text())
    model = json.loads(Path(values["model_config"]).read_text())
    bigger = tmp_path / "bigger.json"
    bigger.write_text(json.dumps({**model, "d_model": 36, "d_k": 12, "d_v": 12}))
    before = sorted(p.name for p in (run / "checkpoint-1").iterdir())

    def no_work(*args, **kwargs):
        pytest.fail("the data were read before the config was checked")

    monkeypatch.setattr(vaswani_tx.training.recipe, "_prepare_data", no_work)
    capsys.readouterr()
    assert main(["train", config, f"model_config={bigger}", "max_steps=2", "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"vaswani-tx train: error: cannot resume from {run / 'checkpoint-1'}: this run's model")
    for field in ("d_model: 24 in checkpoint-1, 36 in this run", "d_k: 8 in checkpoint-1, 12 in this run"):
        assert field in err, err
    assert "num_heads" not in err and "vocab_size" not in err
    assert sorted(p.name for p in (run / "checkpoint-1").iterdir()) == before and names(run) == ["checkpoint-1"]


def test_resume_with_another_tokenizer_of_the_same_size_names_the_vocabulary(
    ws, shared_data, tmp_path, capsys, monkeypatch
):
    import vaswani_tx.training.recipe
    from vaswani_tx.data.tokenization import load_tokenizer, train_tokenizer

    config = saving_config(ws, tmp_path, max_steps=1)
    assert main(["train", config]) == 0
    size = len(load_tokenizer(ws / "tok"))
    other = train_tokenizer([shared_data / "multi30k-en-de" / "val.de"], vocab_size=size, show_progress=False)
    assert len(other) == size
    other.save_pretrained(tmp_path / "other-tok")
    monkeypatch.setattr(vaswani_tx.training.recipe, "_prepare_data", lambda *a, **k: pytest.fail("data read"))
    capsys.readouterr()
    assert main(["train", config, f"tokenizer={tmp_path / 'other-tok'}", "max_steps=2", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "tokenizer_fingerprint: " in err and "in checkpoint-1" in err and "d_model" not in err, err
