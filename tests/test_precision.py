"""bf16 where the hardware has it (precision.py): `bf16: auto` in run configs, `--dtype auto` for decoding, and a
one-line warning where bf16 is asked for on a CPU that would only emulate it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from vaswani_tx.engine import precision
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.training.run_config import load_run_config

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(params=["AMX", None], ids=["cpu-with-bf16", "cpu-without-bf16"])
def cpu(request, monkeypatch):
    """This CPU as one with bf16 instructions, and as one without (CI machines may have either)."""
    monkeypatch.setattr(precision, "cpu_bf16_instructions", lambda: request.param)
    monkeypatch.setattr(precision, "training_device", lambda: torch.device("cpu"))
    return request.param


def test_auto_is_bf16_exactly_where_the_cpu_has_bf16_instructions(cpu, caplog):
    with caplog.at_level(logging.INFO, logger="vaswani_tx.engine.precision"):
        chosen = precision.decoding_dtype("auto", "cpu")
    assert chosen == (torch.bfloat16 if cpu else torch.float32)
    assert ("AMX" if cpu else "no bf16 instructions") in caplog.text  # says which and why


def test_the_run_configs_say_auto_and_the_log_says_what_it_chose(cpu, caplog):
    with caplog.at_level(logging.INFO, logger="vaswani_tx.engine.precision"):
        _, arguments = load_run_config(REPO / "configs/train/multi30k-en-de.yaml")
    assert arguments.bf16 is bool(cpu)
    assert "bf16: auto -> " + ("on" if cpu else "off (float32)") in caplog.text
    for config in (REPO / "configs/train").glob("*.yaml"):
        assert "bf16: true" not in config.read_text(), config  # every recipe chooses by the machine


def test_bf16_asked_for_on_a_cpu_without_it_is_one_warning_not_an_error(monkeypatch, caplog):
    monkeypatch.setattr(precision, "cpu_bf16_instructions", lambda: None)
    monkeypatch.setattr(precision, "training_device", lambda: torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.engine.precision"):
        assert precision.decoding_dtype("bfloat16", "cpu") == torch.bfloat16
        assert precision.resolve_bf16_setting(True) is True
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and all("emulated" in r.getMessage() and "\n" not in r.getMessage() for r in warnings)


@pytest.mark.parametrize("value", ["fast", 1, "yes"])
def test_other_bf16_values_are_refused(value):
    with pytest.raises(UserInputError, match="bf16 must be true, false or auto"):
        precision.resolve_bf16_setting(value)
    with pytest.raises(UserInputError, match="is not one of auto, float32"):
        precision.decoding_dtype("bf16")


def test_translate_dtype_auto_says_what_it_chose(tiny_translator, cpu, capsys):
    from vaswani_tx.cli import main as cli_main

    folder = str(tiny_translator[0])
    argv = ["translate", folder, "Ein Hund.", "--num-beams", "1", "--max-length-offset", "3", "--quiet"]
    assert cli_main([*argv, "--dtype", "auto"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vaswani-tx translate: dtype auto -> ")
    assert ("bfloat16" if cpu else "float32 (this CPU has no bf16 instructions") in err


def test_training_attention_auto_is_eager_on_the_cpu_and_sdpa_on_a_gpu():
    assert precision.training_attention("auto", "cpu")[0] == "eager"
    assert precision.training_attention("auto", "cuda")[0] == "sdpa"
    for asked in ("eager", "sdpa"):  # a run config's explicit choice stands on every device
        assert precision.training_attention(asked, "cpu")[0] == asked
        assert precision.training_attention(asked, "cuda")[0] == asked


def test_an_unknown_attention_implementation_is_refused_before_work(tmp_path):
    text = (REPO / "configs/train/multi30k-en-de.yaml").read_text(encoding="utf-8")
    (tmp_path / "c.yaml").write_text(text + "attn_implementation: flash\n", encoding="utf-8")
    with pytest.raises(UserInputError, match="attn_implementation must be one of auto, eager, sdpa, got 'flash'"):
        load_run_config(tmp_path / "c.yaml")
