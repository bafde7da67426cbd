"""Section 5 recipe: schedule, label smoothing, resume after kill -9, 2 processes = 1, averaging, bad input.

Runs use a tiny model (d_model 24, 3 heads, one layer each side) on 160 Multi30k pairs with a
500-token vocabulary, so each training run takes seconds.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import vaswani_tx
from run_comparison import assert_same_run, losses
from vaswani_tx.model.configuration_vaswani import VaswaniConfig
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.training.checkpoints import (
    SAMPLER_STATE_NAME,
    CheckpointError,
    average_checkpoints,
    check_checkpoint,
    check_sampler_state,
    resume_checkpoint,
)
from vaswani_tx.training.params import load_model_config
from vaswani_tx.training.recipe import train
from vaswani_tx.training.run_config import ConfigError, load_run_config
from vaswani_tx.training.training import get_paper_schedule, label_smoothed_loss, paper_learning_rate

vaswani_tx.register_auto_classes()  # AutoModelForSeq2SeqLM reads averaged folders below

REPO = Path(__file__).resolve().parents[1]
PAIRS = 160


# ---- Section 5.3: the schedule ----


def _formula(step: int, d_model: int = 512, warmup: int = 4000) -> float:
    # equation (3), written out independently of the package
    return d_model ** (-0.5) * min(step ** (-0.5), step * warmup ** (-1.5))


def test_schedule_equals_the_formula_at_steps_1_4000_100000():
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([parameter], lr=1.0, betas=(0.9, 0.98), eps=1e-9)
    scheduler = get_paper_schedule(optimizer, d_model=512, warmup_steps=4000)
    seen = {}
    for update in range(1, 100_001):
        if update in (1, 4000, 100_000):
            seen[update] = optimizer.param_groups[0]["lr"]  # the rate this update uses
        optimizer.step()  # no gradient: a no-op that keeps the scheduler's call order honest
        scheduler.step()
    for step, lr in seen.items():
        assert lr == pytest.approx(_formula(step), rel=1e-12, abs=0), step
        assert paper_learning_rate(step, 512, 4000) == pytest.approx(_formula(step), rel=1e-12, abs=0)
    assert seen[4000] == pytest.approx(512**-0.5 * 4000**-0.5, rel=1e-12)  # the peak


def test_transformers_inverse_sqrt_schedule_is_one_update_behind():
    """Why get_paper_schedule exists: transformers' schedule gives the first update a rate of 0."""
    from transformers import get_inverse_sqrt_schedule

    parameter = torch.nn.Parameter(torch.zeros(1))
    peak = 512**-0.5 * 4000**-0.5
    optimizer = torch.optim.Adam([parameter], lr=peak)
    scheduler = get_inverse_sqrt_schedule(optimizer, num_warmup_steps=4000)
    assert optimizer.param_groups[0]["lr"] == 0.0 != _formula(1)
    optimizer.step()
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(_formula(1), rel=1e-12)  # update 2 gets step 1's


def test_schedule_rejects_step_zero():
    with pytest.raises(ValueError, match="step 1"):
        paper_learning_rate(0, 512)


# ---- Section 5.4: label smoothing ----


def _hand_label_smoothing(logits: list, labels: list, epsilon: float) -> float:
    total, count = 0.0, 0
    for row_logits, row_labels in zip(logits, labels, strict=True):
        for position_logits, label in zip(row_logits, row_labels, strict=True):
            if label == -100:
                continue
            log_z = math.log(sum(math.exp(v) for v in position_logits))
            log_p = [v - log_z for v in position_logits]
            vocab = len(log_p)
            target = [(1 - epsilon) * (k == label) + epsilon / vocab for k in range(vocab)]
            total += -sum(t * lp for t, lp in zip(target, log_p, strict=True))
            count += 1
    return total / count


def test_label_smoothing_equals_hand_computation_over_non_pad_tokens():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 4, 7, generator=generator, dtype=torch.float64)
    labels = torch.tensor([[3, 5, 1, -100], [6, -100, -100, -100]])
    expected = _hand_label_smoothing(logits.tolist(), labels.tolist(), 0.1)
    got = label_smoothed_loss(logits, labels, 0.1)
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # padding positions carry no weight: changing their logits changes nothing
    logits[1, 1:] += 100.0
    assert label_smoothed_loss(logits, labels, 0.1).item() == pytest.approx(expected, rel=1e-6)
    # normalised by the step's token count when the Trainer gives it
    assert label_smoothed_loss(logits, labels, 0.1, num_items_in_batch=10).item() == pytest.approx(
        expected * 4 / 10, rel=1e-6
    )


def _smoothing_args(output_dir):
    """Seq2SeqTrainingArguments that VaswaniTrainer accepts, with Section 5.4's label smoothing."""
    from transformers import Seq2SeqTrainingArguments

    return Seq2SeqTrainingArguments(
        output_dir=str(output_dir),
        label_smoothing_factor=0.1,
        warmup_steps=4,
        lr_scheduler_type="inverse_sqrt",
        use_cpu=True,
        report_to="none",
    )


def _padded_batch(model, *more: dict):
    """The collator the recipe uses (labels padded with -100) and a padded batch of two or more pairs."""
    from transformers import DataCollatorForSeq2Seq

    collator = DataCollatorForSeq2Seq(tokenizer=_PadOnly(), model=model, label_pad_token_id=-100)
    pairs = [{"input_ids": [5, 6, 7, 3], "labels": [8, 9, 10, 11, 3]}, {"input_ids": [12, 3], "labels": [13, 3]}]
    return collator, collator(pairs + list(more))


def test_trainer_loss_on_a_padded_batch_equals_hand_computation(tmp_path):
    from vaswani_tx.training.training import VaswaniTrainer

    config = _tiny_config(vocab_size=40)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).eval()
    collator, batch = _padded_batch(model)
    assert (batch["labels"] == -100).sum() == 3
    args = _smoothing_args(tmp_path)
    trainer = VaswaniTrainer(model=model, args=args, data_collator=collator, max_tokens=64)
    with torch.no_grad():
        loss = trainer.compute_loss(model, dict(batch))
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    expected = _hand_label_smoothing(logits.double().tolist(), batch["labels"].tolist(), 0.1)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


def test_loss_computed_in_the_model_equals_the_loss_on_its_logits_with_the_same_gradients(tmp_path):
    """VaswaniTrainer lets our model smooth its own loss at the labelled positions (labels kept in the inputs);
    the Trainer's route through the whole logits (LabelSmoothedCrossEntropy) must give the same loss and gradients,
    with the step's token count as the Trainer passes it under gradient accumulation."""
    from vaswani_tx.training.training import LabelSmoothedCrossEntropy, VaswaniTrainer

    config = _tiny_config(vocab_size=40)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(config).train()
    collator, batch = _padded_batch(model, {"input_ids": [14, 15, 16, 17, 18, 3], "labels": [19, 3]})
    args = _smoothing_args(tmp_path)
    in_model = VaswaniTrainer(model=model, args=args, data_collator=collator, max_tokens=64)
    on_logits = VaswaniTrainer(
        model=model,
        args=args,
        data_collator=collator,
        max_tokens=64,
        compute_loss_func=LabelSmoothedCrossEntropy(0.1),
    )
    assert in_model.loss_in_model and not on_logits.loss_in_model
    results = []
    for trainer in (in_model, on_logits):
        torch.manual_seed(1)  # the same dropout masks
        model.zero_grad()
        loss = trainer.compute_loss(model, dict(batch), num_items_in_batch=torch.tensor(13))
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((loss.item(), grads))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-5)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], rtol=1e-4, atol=1e-6, msg=name)


def test_label_smoothing_outside_0_1_is_refused_by_the_model():
    model = VaswaniForConditionalGeneration(_tiny_config(vocab_size=40))
    with pytest.raises(UserInputError, match="epsilon_ls"):
        model(input_ids=torch.tensor([[5, 3]]), labels=torch.tensor([[6, 3]]), epsilon_ls=1.0)


def test_freed_memory_goes_back_every_few_steps_and_after_each_evaluation(tmp_path):
    """glibc keeps the buffers of past batch shapes (ReturnFreedMemory's docstring); the trainer hands them back."""
    from types import SimpleNamespace

    from transformers import Seq2SeqTrainingArguments, TrainerControl

    from vaswani_tx.training.training import (
        M_MMAP_MAX,
        M_TRIM_THRESHOLD,
        ReturnFreedMemory,
        VaswaniTrainer,
        _glibc_malloc_trim,
        _glibc_mallopt,
    )

    if sys.platform.startswith("linux") and os.path.exists("/lib/x86_64-linux-gnu/libc.so.6"):
        assert _glibc_malloc_trim() is not None and _glibc_malloc_trim()(0) in (0, 1)
    callback, trims = ReturnFreedMemory(), []
    callback.trim = trims.append
    cpu = SimpleNamespace(device=torch.device("cpu"))
    for step in range(1, 12 * callback.every + 5):
        callback.on_step_end(cpu, SimpleNamespace(global_step=step), TrainerControl())
    assert len(trims) == 12
    callback.on_evaluate(cpu, SimpleNamespace(global_step=12 * callback.every + 4), TrainerControl())
    assert len(trims) == 13
    callback.on_step_end(SimpleNamespace(device=torch.device("meta")), SimpleNamespace(global_step=0), None)
    assert len(trims) == 13  # not a CPU run: nothing to do
    # While a CPU run trains, large buffers come from glibc's heaps (no fresh mappings, no automatic trimming);
    # glibc's default values come back at the end of training.
    options = []
    callback.mallopt = lambda parameter, value: options.append((parameter, value)) or 1
    callback.on_train_begin(SimpleNamespace(device=torch.device("meta")), None, None)
    assert options == []
    callback.on_train_begin(cpu, None, TrainerControl())
    assert options == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)]
    callback.on_train_end(cpu, None, TrainerControl())
    assert options[2:] == [(M_MMAP_MAX, 65536), (M_TRIM_THRESHOLD, 128 * 1024)] and len(trims) == 14
    if _glibc_mallopt() is not None:  # the real call accepts them (1: done)
        assert _glibc_mallopt()(M_MMAP_MAX, 65536) == 1 and _glibc_mallopt()(M_TRIM_THRESHOLD, 128 * 1024) == 1
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), warmup_steps=4, lr_scheduler_type="inverse_sqrt", use_cpu=True, report_to="none"
    )
    trainer = VaswaniTrainer(
        model=VaswaniForConditionalGeneration(_tiny_config(vocab_size=40)), args=args, max_tokens=64
    )
    # glibc's settings are the process's: the library's trainer leaves them alone, the command tunes them
    assert not any(isinstance(c, ReturnFreedMemory) for c in trainer.callback_handler.callbacks)


def test_the_train_command_tunes_its_own_process_allocator(tmp_path, monkeypatch):
    """`vaswani-tx train` owns its process, so it hands `ReturnFreedMemory` to the run (the library never adds it)."""
    from types import SimpleNamespace

    from vaswani_tx.cli import main
    from vaswani_tx.training import recipe, run_config
    from vaswani_tx.training.training import ReturnFreedMemory

    given = {}
    arguments = SimpleNamespace(process_index=0, output_dir=str(tmp_path))
    monkeypatch.setattr(run_config, "load_run_config", lambda *args, **kwargs: (SimpleNamespace(), arguments))
    monkeypatch.setattr(recipe, "train", lambda recipe, arguments, **kwargs: given.update(kwargs) or {})
    assert main(["train", str(tmp_path / "run.yaml")]) == 0
    assert [type(c) for c in given["callbacks"]] == [ReturnFreedMemory]


class _PadOnly:
    """The little of a tokenizer that DataCollatorForSeq2Seq needs to pad ids."""

    pad_token_id = 0
    padding_side = "right"

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        longest = max(len(f["input_ids"]) for f in features)
        ids = [f["input_ids"] + [0] * (longest - len(f["input_ids"])) for f in features]
        mask = [[1] * len(f["input_ids"]) + [0] * (longest - len(f["input_ids"])) for f in features]
        out = {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}
        if "labels" in features[0]:
            out["labels"] = torch.tensor([f["labels"] for f in features])
        return out


# ---- tiny runs ----


def _tiny_config(vocab_size: int, dropout: float = 0.1) -> VaswaniConfig:
    return VaswaniConfig(
        vocab_size=vocab_size,
        d_model=24,
        d_ff=48,
        num_heads=3,
        d_k=8,
        d_v=8,
        num_encoder_layers=1,
        num_decoder_layers=1,
        dropout=dropout,
    )


@pytest.fixture(scope="module")
def tiny_recipe(shared_data, tmp_path_factory) -> dict:
    """Corpus files, a tokenizer and a model config for tiny runs; returns a run-config dict."""
    from vaswani_tx.data.tokenization import train_tokenizer

    folder = tmp_path_factory.mktemp("tiny")
    for split, count in (("train", PAIRS), ("val", 12)):
        for lang in ("en", "de"):
            lines = (shared_data / "multi30k-en-de" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()
            (folder / f"{split}.{lang}").write_text("\n".join(lines[:count]) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([folder / "train.en", folder / "train.de"], "bpe", 500, show_progress=False)
    tokenizer.save_pretrained(folder / "tokenizer")
    for name, dropout in (("model.json", 0.1), ("model-nodropout.json", 0.0)):
        config = _tiny_config(len(tokenizer), dropout).to_dict()
        (folder / name).write_text(json.dumps(config), encoding="utf-8")
    return {
        "model_config": str(folder / "model.json"),
        "tokenizer": str(folder / "tokenizer"),
        "train_source": str(folder / "train.en"),
        "train_target": str(folder / "train.de"),
        "dev_source": str(folder / "val.en"),
        "dev_target": str(folder / "val.de"),
        "max_tokens": 160,
        "seed": 3,
        "learning_rate": 1.0,
        "lr_scheduler_type": "inverse_sqrt",
        "warmup_steps": 10,
        "optim": "adamw_torch",
        "adam_beta2": 0.98,
        "adam_epsilon": 1e-9,
        "max_grad_norm": 0.0,
        "label_smoothing_factor": 0.1,
        "logging_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "steps",
        "report_to": "none",
        "use_cpu": True,
        "disable_tqdm": True,
    }


def _write_config(path: Path, values: dict) -> Path:
    path.write_text("# test run config\n" + yaml.safe_dump(values), encoding="utf-8")
    return path


def _cli(*args: str, env_extra: dict | None = None, **kwargs) -> subprocess.Popen:
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        **(env_extra or {}),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "vaswani_tx.cli", *args],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def _finish(process: subprocess.Popen, timeout: float = 300) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output


def test_kill_9_then_resume_equals_an_uninterrupted_run_bit_for_bit(tiny_recipe, tmp_path):
    values = {**tiny_recipe, "max_steps": 40, "save_steps": 10, "save_total_limit": 3}
    whole = tmp_path / "whole"
    _finish(_cli("train", str(_write_config(tmp_path / "whole.yaml", {**values, "output_dir": str(whole)}))))

    broken = tmp_path / "broken"
    config = _write_config(tmp_path / "broken.yaml", {**values, "output_dir": str(broken)})
    process = _cli("train", str(config), "--resume")
    deadline = time.monotonic() + 240
    while not (broken / "checkpoint-10" / "trainer_state.json").is_file():
        assert process.poll() is None, process.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no checkpoint-10 within 240 s"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert not (broken / "model.safetensors").exists(), "the run had finished before the kill"
    killed_at = [p.name for p in broken.glob("checkpoint-*")]

    output = _finish(_cli("train", str(config), "--resume"))
    assert "resuming from" in output, output[-2000:]
    assert losses(broken) == losses(whole), f"checkpoints at the kill: {killed_at}"
    assert len(losses(whole)) == 40
    assert load_file(broken / "model.safetensors").keys() == load_file(whole / "model.safetensors").keys()
    for name, tensor in load_file(whole / "model.safetensors").items():
        assert torch.equal(load_file(broken / "model.safetensors")[name], tensor), name
    assert (whole / "curves.png").stat().st_size > 1000
    # the clock goes on from the minutes logged before the kill (curves.png draws dev BLEU against it)
    minutes = [e["train_minutes"] for e in json.loads((broken / "log_history.json").read_text()) if "loss" in e]
    assert len(minutes) == len(losses(broken)) and minutes == sorted(minutes) and minutes[0] >= 0


def _free_port() -> int:
    # a fixed port would collide with another test run on the same machine
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_processes_equal_one_process_with_the_same_global_batch(tiny_recipe, tmp_path):
    # no dropout: the two set-ups draw different random masks; everything else must agree
    values = {
        **tiny_recipe,
        "model_config": tiny_recipe["model_config"].replace("model.json", "model-nodropout.json"),
        "max_steps": 4,
        "save_strategy": "no",
    }
    one = tmp_path / "one"
    output = _finish(
        _cli(
            "train",
            str(
                _write_config(
                    tmp_path / "one.yaml", {**values, "output_dir": str(one), "gradient_accumulation_steps": 2}
                )
            ),
        )
    )
    assert "processes: 1, gradient accumulation: 2, max_tokens: 160" in output
    two = tmp_path / "two"
    config = _write_config(tmp_path / "two.yaml", {**values, "output_dir": str(two)})
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    # accelerate's torchrun launcher; the config's use_cpu makes the processes join over gloo
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--main_process_port",
            str(_free_port()),
            "-m",
            "vaswani_tx.cli",
            "train",
            str(config),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert process.returncode == 0, (process.stdout + process.stderr)[-3000:]
    assert "processes: 2, gradient accumulation: 1, max_tokens: 160" in process.stdout + process.stderr
    assert_same_run(one, two, [1, 2, 3, 4])
    weights_one = load_file(one / "model.safetensors")
    # and training moved the weights: equal because both trained the same way, not because neither did
    torch.manual_seed(3)
    initial = VaswaniForConditionalGeneration(_tiny_config(500, 0.0)).state_dict()
    assert not torch.allclose(initial["model.shared.weight"], weights_one["model.shared.weight"])


# ---- Section 6.1: checkpoint averaging ----


def _fake_run(folder: Path, steps=(1, 2, 3), config: VaswaniConfig | None = None) -> list[Path]:
    config = config or _tiny_config(40)
    made = []
    for step in steps:
        torch.manual_seed(step)
        model = VaswaniForConditionalGeneration(config)
        model.save_pretrained(folder / f"checkpoint-{step}")
        made.append(folder / f"checkpoint-{step}")
    return made


def test_average_of_3_checkpoints_is_the_mean_and_loads(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    checkpoints = _fake_run(tmp_path / "run")
    averaged = average_checkpoints(checkpoints, tmp_path / "avg")
    tensors = [load_file(c / "model.safetensors") for c in checkpoints]
    result = load_file(averaged / "model.safetensors")
    assert result.keys() == tensors[0].keys()
    for name in result:
        torch.testing.assert_close(
            result[name], (tensors[0][name] + tensors[1][name] + tensors[2][name]) / 3, rtol=1e-6, atol=1e-7, msg=name
        )
    model = AutoModelForSeq2SeqLM.from_pretrained(averaged)
    assert torch.equal(model.state_dict()["model.shared.weight"], result["model.shared.weight"])
    assert model.generation_config.num_beams == 4
    assert json.loads((averaged / "averaged_from.json").read_text())["checkpoints"] == [str(c) for c in checkpoints]


def test_average_checkpoints_command_takes_the_last_n(tmp_path):
    _fake_run(tmp_path / "run", steps=(5, 10, 20, 40))
    VaswaniForConditionalGeneration(_tiny_config(40)).save_pretrained(tmp_path / "run")  # a finished run's final model
    process = _cli("average-checkpoints", str(tmp_path / "run"), "--last", "2", "--output-dir", str(tmp_path / "avg"))
    output = _finish(process)
    assert "checkpoint-20, checkpoint-40" in output
    a = load_file(tmp_path / "run" / "checkpoint-20" / "model.safetensors")
    b = load_file(tmp_path / "run" / "checkpoint-40" / "model.safetensors")
    result = load_file(tmp_path / "avg" / "model.safetensors")
    torch.testing.assert_close(
        result["model.shared.weight"], (a["model.shared.weight"] + b["model.shared.weight"]) / 2
    )


def test_average_refuses_checkpoints_of_different_configs(tmp_path):
    first = _fake_run(tmp_path / "a", steps=(1,))
    wider = VaswaniConfig(**{**_tiny_config(40).to_dict(), "d_ff": 96})
    other = _fake_run(tmp_path / "b", steps=(2,), config=wider)
    with pytest.raises(CheckpointError, match=r"configs differ \(d_ff: 48 vs 96\)"):
        average_checkpoints(first + other, tmp_path / "avg")


# ---- bad input ----


def test_unknown_config_key_is_named(tiny_recipe, tmp_path):
    config = _write_config(tmp_path / "c.yaml", {**tiny_recipe, "output_dir": str(tmp_path / "o"), "warmup_step": 4})
    with pytest.raises(ConfigError, match=r"unknown key 'warmup_step'.*did you mean 'warmup_steps'"):
        load_run_config(config)
    with pytest.raises(ConfigError, match="unknown key 'bogus'"):
        load_run_config(_write_config(tmp_path / "d.yaml", {**tiny_recipe, "output_dir": "o"}), ["bogus=1"])


def test_missing_data_path_is_named(tiny_recipe, tmp_path):
    values = {**tiny_recipe, "output_dir": str(tmp_path / "o"), "train_source": str(tmp_path / "nowhere.en")}
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values))
    with pytest.raises(ConfigError, match=r"train_source: .*nowhere\.en does not exist"):
        train(recipe, arguments)


def test_tokenizer_that_does_not_match_the_model_is_refused(tiny_recipe, tmp_path):
    model_json = tmp_path / "wrong.json"
    model_json.write_text(json.dumps(_tiny_config(8000).to_dict()), encoding="utf-8")
    values = {**tiny_recipe, "output_dir": str(tmp_path / "o"), "model_config": str(model_json)}
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values))
    with pytest.raises(ValueError, match="vocab_size: config has 8000, tokenizer has 500"):
        train(recipe, arguments)


def test_truncated_or_corrupt_checkpoint_is_refused(tiny_recipe, tmp_path):
    values = {**tiny_recipe, "max_steps": 4, "save_steps": 2, "output_dir": str(tmp_path / "run")}
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values))
    train(recipe, arguments)
    newest, older = tmp_path / "run" / "checkpoint-4", tmp_path / "run" / "checkpoint-2"
    check_checkpoint(newest)

    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors is truncated or corrupt"):
        check_checkpoint(newest)
    with pytest.raises(CheckpointError, match="model.safetensors is truncated"):
        average_checkpoints([older, newest], tmp_path / "avg")
    # resuming skips the broken newest checkpoint and continues from the one before
    assert resume_checkpoint(tmp_path / "run", resume=True) == str(older)

    optimizer = older / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="optimizer.pt is truncated or corrupt"):
        check_checkpoint(older)
    (older / "trainer_state.json").unlink()
    with pytest.raises(CheckpointError, match="missing trainer_state.json"):
        check_checkpoint(older)
    # a run folder with checkpoints is not silently overwritten
    with pytest.raises(CheckpointError, match="pass --resume"):
        resume_checkpoint(tmp_path / "run", resume=False)
    # --resume with no complete checkpoint starts a new run, the unusable ones kept under another name
    files = {path.name: sorted(p.name for p in path.iterdir()) for path in (older, newest)}
    assert resume_checkpoint(tmp_path / "run", resume=True) is None
    assert not older.exists() and not newest.exists()
    assert {
        name: sorted(p.name for p in (tmp_path / "run" / f"incomplete-{name}").iterdir()) for name in files
    } == files


def test_resume_with_another_data_order_is_refused(tiny_recipe, tmp_path):
    values = {**tiny_recipe, "max_steps": 2, "save_steps": 2, "output_dir": str(tmp_path / "run")}
    train(*load_run_config(_write_config(tmp_path / "c.yaml", values)))
    saved = json.loads((tmp_path / "run" / "checkpoint-2" / SAMPLER_STATE_NAME).read_text(encoding="utf-8"))
    assert saved["seed"] == 3 and saved["max_tokens"] == 160 and saved["num_replicas"] == 1
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", {**values, "max_steps": 4, "data_seed": 5}))
    with pytest.raises(CheckpointError, match="trained with seed=3, this run has seed=5"):
        train(recipe, arguments, resume=True)
    # a checkpoint without a saved sampler state is not checked, and no sampler is built for it
    (tmp_path / "run" / "checkpoint-2" / SAMPLER_STATE_NAME).unlink()
    check_sampler_state(tmp_path / "run" / "checkpoint-2", lambda: pytest.fail("built a sampler needlessly"))


def test_tokens_per_step_sets_gradient_accumulation(tiny_recipe, tmp_path):
    values = {**tiny_recipe, "output_dir": str(tmp_path / "o"), "tokens_per_step": 25000, "max_tokens": 3125}
    _, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values), world_size=1)
    assert arguments.gradient_accumulation_steps == 8
    _, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values), world_size=8)
    assert arguments.gradient_accumulation_steps == 1
    with pytest.raises(ConfigError, match="not both"):
        load_run_config(_write_config(tmp_path / "c.yaml", {**values, "gradient_accumulation_steps": 2}))


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "configs" / "train").glob("*.yaml")))
def test_shipped_run_configs_load_and_start_with_their_command(name):
    path = REPO / "configs" / "train" / name
    command = "parse run" if name.startswith("wsj-parse") else "train"  # the parser's recipe writes its data first
    assert path.read_text(encoding="utf-8").startswith(f"# vaswani-tx {command} configs/train/{name}")
    # bf16 needs a GPU (or a CPU that supports it) to construct; every config asks for it where the machine has it
    gpu_only = {} if torch.cuda.is_available() else {"bf16": False, "use_cpu": True}
    assert yaml.safe_load(path.read_text(encoding="utf-8")).get("bf16", False) in ("auto", False)  # never plain true
    on_gpus = "wmt14" in name or name == "wsj-parse.yaml"
    recipe, arguments = load_run_config(path, gpu_only if on_gpus else {}, world_size=8 if on_gpus else 1)
    if "wmt14" in name:
        assert recipe.max_tokens * 8 * arguments.gradient_accumulation_steps == 25_000  # Section 5.1's step
        assert recipe.save_minutes == 10 and recipe.average_last == (5 if "base" in name else 20)
        assert arguments.max_steps == (100_000 if "base" in name else 300_000) and arguments.warmup_steps == 4000
        model = load_model_config(REPO / recipe.model_config)
        assert (
            model.dropout
            == {"wmt14-en-de-base.yaml": 0.1, "wmt14-en-de-big.yaml": 0.3, "wmt14-en-fr-big.yaml": 0.1}[name]
        )
        assert (model.vocab_size, recipe.tokenizer_kind) == (
            (32000, "wordpiece") if "en-fr" in name else (37000, "bpe")
        )
    assert (arguments.adam_beta1, arguments.adam_beta2, arguments.adam_epsilon) == (0.9, 0.98, 1e-9)
    assert arguments.max_grad_norm == 0 and arguments.weight_decay == 0
    assert arguments.label_smoothing_factor == 0.1
    assert (REPO / recipe.model_config).is_file()


def test_training_flops_equal_torch_flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    from vaswani_tx.training.params import training_flops

    config = VaswaniConfig(
        vocab_size=40,
        d_model=24,
        d_ff=48,
        num_heads=3,
        d_k=8,
        d_v=4,
        num_encoder_layers=2,
        num_decoder_layers=1,
        dropout=0.0,
    )
    config._attn_implementation = "eager"
    model = VaswaniForConditionalGeneration(config)
    source = torch.randint(4, 40, (2, 5))
    labels = torch.randint(4, 40, (2, 7))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=source, labels=labels).loss.backward()
    assert counter.get_total_flops() == training_flops(config, 2 * 5, 2 * 7, 5, 7)


def test_bf16_training_steps_stay_finite(tiny_recipe, tmp_path):
    # padded batches under autocast: the masks use bf16's minimum, so nothing overflows to inf or NaN
    values = {**tiny_recipe, "max_steps": 3, "save_strategy": "no", "bf16": True, "output_dir": str(tmp_path / "o")}
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values))
    train(recipe, arguments)
    logged = [loss for _, loss in losses(tmp_path / "o")]
    assert len(logged) == 3 and all(math.isfinite(loss) and loss > 0 for loss in logged)


def test_evaluation_logs_dev_loss_bleu_and_the_signature(tiny_recipe, tmp_path, caplog):
    values = {
        **tiny_recipe,
        "max_steps": 2,
        "save_strategy": "no",
        "eval_strategy": "steps",
        "eval_steps": 2,
        "predict_with_generate": True,
        "generation_num_beams": 2,
        "generation_max_length": 8,
        "dev_max_pairs": 6,
        "output_dir": str(tmp_path / "o"),
    }
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values))
    with caplog.at_level("INFO", logger="vaswani_tx"):
        metrics = train(recipe, arguments)
    history = json.loads((tmp_path / "o" / "log_history.json").read_text(encoding="utf-8"))
    evaluations = [entry for entry in history if "eval_sacrebleu" in entry]
    assert evaluations and evaluations[0]["step"] == 2 and math.isfinite(evaluations[0]["eval_loss"])
    assert {"eval_loss", "eval_sacrebleu", "eval_chrf"} <= metrics.keys()
    assert "sacreBLEU nrefs:1|case:mixed|eff:no|tok:13a" in caplog.text
    assert "attn_implementation: auto -> eager (on the CPU" in caplog.text  # the recipe says what it trained with


def test_timed_checkpoint_callback_asks_for_a_save_once_the_minutes_have_passed():
    from transformers import TrainerControl, TrainerState

    from vaswani_tx.training.checkpoints import TimedCheckpointCallback

    callback = TimedCheckpointCallback(minutes=10)
    control = TrainerControl()
    callback.on_step_end(None, TrainerState(), control)
    assert not control.should_save
    callback.last_save -= 10 * 60  # ten minutes later
    callback.on_step_end(None, TrainerState(), control)
    assert control.should_save
    callback.on_save(None, TrainerState(), TrainerControl())
    fresh = TrainerControl()
    callback.on_step_end(None, TrainerState(), fresh)
    assert not fresh.should_save


def test_resuming_a_finished_run_trains_no_further_step(tiny_recipe, tmp_path):
    values = {**tiny_recipe, "max_steps": 2, "save_steps": 2, "output_dir": str(tmp_path / "run")}
    recipe, arguments = load_run_config(_write_config(tmp_path / "c.yaml", values))
    train(recipe, arguments)
    before = load_file(tmp_path / "run" / "model.safetensors")
    metrics = train(recipe, arguments, resume=True)
    assert metrics["global_step"] == 2
    assert [p.name for p in (tmp_path / "run").glob("checkpoint-*")] == ["checkpoint-2"]
    assert [step for step, _ in losses(tmp_path / "run")] == [1, 2]
    after = load_file(tmp_path / "run" / "model.safetensors")
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())


def test_train_command_takes_overrides_before_or_after_resume(monkeypatch):
    from vaswani_tx import cli

    seen = []
    monkeypatch.setattr("vaswani_tx.cli.train.run", lambda args: seen.append((args.overrides, args.resume)) or 0)
    assert cli.main(["train", "c.yaml", "--resume", "max_steps=5", "seed=2"]) == 0
    assert cli.main(["train", "c.yaml", "max_steps=5", "--resume", "seed=2"]) == 0
    assert seen == [(["max_steps=5", "seed=2"], True)] * 2
    with pytest.raises(SystemExit):
        cli.main(["train", "c.yaml", "--resume", "max_steps=5", "--bogus"])


def test_curves_draw_dev_bleu_against_minutes_where_the_history_has_them(tmp_path):
    from vaswani_tx.training.recipe import _interpolate, plot_curves

    history = [{"loss": 5.0 - s / 100, "step": s, "train_minutes": s / 60} for s in range(10, 110, 10)]
    history += [
        {"eval_loss": 4.0, "eval_sacrebleu": b, "step": s, "train_minutes": s / 50} for s, b in ((50, 9), (100, 12))
    ]
    with_minutes = plot_curves(history, tmp_path / "minutes.png")
    without = plot_curves(
        [{k: v for k, v in e.items() if k != "train_minutes"} for e in history], tmp_path / "steps.png"
    )
    assert with_minutes.stat().st_size > 1000 and without.stat().st_size > 1000
    # the step axis over the minutes one: exact at the evaluations, continued beyond them (never NaN)
    to_steps = _interpolate([1.0, 2.0], [50, 100])
    assert list(to_steps([1.0, 1.5, 2.0, 0.0, 3.0])) == [50, 75, 100, 0, 150]
