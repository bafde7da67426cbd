"""`vaswani-tx train CONFIG --dry-run` (issue 21): what a run will do, from the config alone, in closed form."""

from __future__ import annotations

from pathlib import Path

import pytest

from vaswani_tx.cli import main
from vaswani_tx.training.params import load_model_config, training_flops
from vaswani_tx.training.plan import run_plan
from vaswani_tx.training.run_config import ConfigError, load_run_config

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "train" / "multi30k-en-de.yaml"


@pytest.fixture
def dev_files(tmp_path):
    (tmp_path / "dev.en").write_text("a b c\nd e f g h\n\n", encoding="utf-8")  # 4 words a line on average
    (tmp_path / "dev.de").write_text("x\ny\n\n", encoding="utf-8")
    return [f"dev_source={tmp_path / 'dev.en'}", f"dev_target={tmp_path / 'dev.de'}", f"output_dir={tmp_path / 'run'}"]


def test_the_plan_is_the_closed_form(dev_files, tmp_path):
    overrides = [*dev_files, "max_tokens=1000", "tokens_per_step=2500", "max_steps=300", "warmup_steps=50"]
    overrides += ["learning_rate=2.0", "save_steps=40", "save_total_limit=3", "average_last=4", "save_minutes=10"]
    recipe, arguments = load_run_config(CONFIG, overrides, world_size=2)
    plan = run_plan(recipe, arguments, processes=2)
    config = load_model_config(REPO / recipe.model_config)
    assert plan["gradient_accumulation_steps"] == 2  # ceil(2500 / (1000 * 2))
    assert plan["tokens_per_step"] == 2 * 2 * 1000 and plan["processes"] == 2
    assert plan["peak_learning_rate"] == pytest.approx(2.0 * config.d_model**-0.5 * 50**-0.5)
    assert plan["sentence_length"] == 4.0
    flops = training_flops(config, plan["tokens_per_step"], plan["tokens_per_step"], 4.0, 4.0)
    assert plan["flops_per_step"] == flops and plan["flops_total"] == 300 * flops
    assert (plan["checkpoints"], plan["save_total_limit"], plan["average_last"]) == (7, 3, 4)


def test_dry_run_prints_the_plan_and_trains_nothing(dev_files, tmp_path, capsys):
    assert main(["train", str(CONFIG), *dev_files, "max_steps=300", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for words in ("processes: 1", "tokens per step: up to 2,048", "steps: 300", "schedule peak", "FLOPs per step"):
        assert words in out, (words, out)
    assert "a checkpoint every 100 steps (3 in all)" in out and "averaged into" in out
    assert not (tmp_path / "run").exists()


def test_tokens_per_step_out_of_reach_is_refused_with_both_numbers(dev_files, capsys):
    with pytest.raises(ConfigError, match=r"tokens_per_step=3000 cannot be reached with 2 process.*8192"):
        load_run_config(CONFIG, [*dev_files, "max_tokens=4096", "tokens_per_step=3000"], world_size=2)
    assert main(["train", str(CONFIG), *dev_files, "max_tokens=4096", "tokens_per_step=5000", "--dry-run"]) == 0
    assert "gradient accumulation: 2" in capsys.readouterr().out  # ceil(5000 / 4096) on one process
    assert main(["train", str(CONFIG), *dev_files, "max_tokens=4096", "tokens_per_step=3000", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "tokens_per_step=3000" in err and "4096" in err


def test_overrides_keep_yes_and_no_as_words():
    from vaswani_tx.training.run_config import parse_overrides

    assert parse_overrides(["eval_strategy=no", "fp16=true", "save_strategy=No", "max_steps=10", "x="]) == {
        "eval_strategy": "no",
        "fp16": True,
        "save_strategy": "No",
        "max_steps": 10,
        "x": None,
    }


@pytest.mark.parametrize("name", ["wmt14-en-de-base", "wmt14-en-de-big", "wsj-parse"])
def test_dry_run_plans_a_gpu_config_on_any_machine(name, monkeypatch, capsys):
    """bf16 (and tf32) need a GPU that has them when the Trainer's arguments are built; a plan computes and asks
    no device (issue 28: "Your setup doesn't support bf16/gpu" on a CPU machine). Files an earlier step makes
    (a parse run's data) are listed, not a reason to stop."""
    monkeypatch.chdir(REPO)  # the shipped configs' paths are relative to the repository root
    assert main(["train", f"configs/train/{name}.yaml", "--dry-run"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "precision: bf16" in out and "tokens per step: up to 25,000" in out
    if name == "wsj-parse":
        assert "FLOPs per step: unknown until dev_source exists" in out
        assert "not there yet: dev_source runs/wsj-parse/data/dev.words" in out
    recipe, arguments = load_run_config(REPO / "configs" / "train" / f"{name}.yaml", check_device=False)
    assert arguments.bf16 and run_plan(recipe, arguments)["precision"] == "bf16"


def test_dry_run_still_refuses_a_missing_model_config(dev_files, tmp_path, capsys):
    assert main(["train", str(CONFIG), *dev_files, f"model_config={tmp_path / 'none.json'}", "--dry-run"]) == 2
    assert "model_config" in capsys.readouterr().err
