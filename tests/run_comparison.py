"""Comparing two training runs' folders, as the tests of several processes against one do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file


def losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, training loss) of every logged step, from the run's log_history.json."""
    history = json.loads((run_dir / "log_history.json").read_text(encoding="utf-8"))
    return [(entry["step"], entry["loss"]) for entry in history if "loss" in entry]


def assert_same_run(one: Path, two: Path, steps: list[int]) -> None:
    """The same steps logged, losses and final weights equal to 1e-5."""
    one_losses, two_losses = losses(one), losses(two)
    assert [step for step, _ in one_losses] == [step for step, _ in two_losses] == steps
    for (_, a), (_, b) in zip(one_losses, two_losses, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5)
    weights_one, weights_two = load_file(one / "model.safetensors"), load_file(two / "model.safetensors")
    assert weights_one.keys() == weights_two.keys()
    for name, tensor in weights_one.items():
        torch.testing.assert_close(weights_two[name], tensor, rtol=1e-5, atol=1e-5, msg=name)
