"""What a run will do and cost, from its run config alone: ``vaswani-tx train --dry-run``.

Beside ``vaswani_tx.training.params`` (parameters and FLOPs of a model config): the same closed forms, scaled to a run's
processes, token budget and steps, so a config can be checked before hours of GPU time go into it. Nothing here
reads the training data or builds the model, and nothing asks the machine: a config for 8 GPUs in bf16 is planned
on a laptop (load it with ``load_run_config(..., check_device=False)``), and files a run would make or fetch
first (a parse run's data) are listed as missing rather than stopping the plan.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import Seq2SeqTrainingArguments

from vaswani_tx.text_io import iter_lines
from vaswani_tx.training.params import load_model_config, training_flops
from vaswani_tx.training.run_config import ConfigError, RecipeConfig, missing_paths
from vaswani_tx.training.training import paper_learning_rate


def run_plan(
    recipe: RecipeConfig, arguments: Seq2SeqTrainingArguments, processes: int | None = None
) -> dict[str, Any]:
    """What `train` will do, computed from the run config alone (no data read): ``vaswani-tx train --dry-run``.

    ``processes`` defaults to the processes there are (``accelerate launch`` sets them); give the number a
    config was loaded for (``load_run_config(..., world_size=8)``) to plan a run elsewhere.

    Closed forms, each side of a step counted alike (the token budget is per side):
    ``tokens_per_step = processes * gradient_accumulation_steps * max_tokens`` (an upper bound: batches are
    filled up to ``max_tokens``); the schedule's peak, at ``warmup_steps``, is
    ``learning_rate * d_model^-0.5 * warmup_steps^-0.5`` (Section 5.3, equation 3); FLOPs per step are
    `vaswani_tx.training.params.training_flops` of that many source and target tokens at ``sentence_length``
    tokens per sentence, the mean words per line of ``dev_source`` (subwords make real sentences a little
    longer; while ``dev_source`` does not exist yet both are None); FLOPs of the run are that times
    ``max_steps``. Checkpoints: every ``save_steps`` (and every ``save_minutes``), the last ``save_total_limit``
    kept, ``average_last`` averaged at the end. ``missing``: the paths the config names that are not there
    (key -> path); only a missing model config stops the plan (ConfigError).
    """
    missing = missing_paths(recipe)
    if "model_config" in missing:
        raise ConfigError(f"model_config: {recipe.model_config} does not exist (paths are relative to {Path.cwd()})")
    config = load_model_config(recipe.model_config)
    processes = processes or max(1, arguments.world_size)
    accumulation = arguments.gradient_accumulation_steps
    tokens = processes * accumulation * recipe.max_tokens
    length = flops = None
    if "dev_source" not in missing:
        lines = [len(line.split()) for line in iter_lines(recipe.dev_source) if line.strip()]
        length = sum(lines) / len(lines) if lines else 0.0
        flops = training_flops(config, tokens, tokens, length, length)
    steps = arguments.max_steps if arguments.max_steps > 0 else None
    warmup = arguments.warmup_steps
    peak = arguments.learning_rate * paper_learning_rate(warmup, config.d_model, warmup) if warmup > 0 else None
    save = str(getattr(arguments.save_strategy, "value", arguments.save_strategy))
    return {
        "processes": processes,
        "gradient_accumulation_steps": accumulation,
        "max_tokens": recipe.max_tokens,
        "tokens_per_step": tokens,
        "max_steps": steps,
        "num_train_epochs": None if steps else arguments.num_train_epochs,
        "warmup_steps": warmup,
        "peak_learning_rate": peak,
        "sentence_length": None if length is None else round(length, 2),
        "flops_per_step": flops,
        "flops_total": flops * steps if steps and flops is not None else None,
        "precision": "bf16" if arguments.bf16 else "fp16" if arguments.fp16 else "float32",
        "save_strategy": save,
        "save_steps": arguments.save_steps if save == "steps" else None,
        "checkpoints": steps // int(arguments.save_steps) if steps and save == "steps" else None,
        "save_minutes": recipe.save_minutes,
        "save_total_limit": arguments.save_total_limit,
        "average_last": recipe.average_last,
        "output_dir": arguments.output_dir,
        "missing": missing,
    }


def describe_plan(plan: dict[str, Any]) -> str:
    """`run_plan` as the lines `vaswani-tx train --dry-run` prints."""
    steps = f"{plan['max_steps']:,}" if plan["max_steps"] else f"{plan['num_train_epochs']} epochs"
    lines = [
        f"processes: {plan['processes']}; gradient accumulation: {plan['gradient_accumulation_steps']}; "
        f"max_tokens: {plan['max_tokens']:,} per batch and side",
        f"tokens per step: up to {plan['tokens_per_step']:,} source and as many target (the paper: about 25,000 each)",
        f"steps: {steps}; warmup: {plan['warmup_steps']:,} steps"
        + (
            f", schedule peak {plan['peak_learning_rate']:.3e} at step {plan['warmup_steps']:,}"
            if plan["peak_learning_rate"]
            else ""
        ),
        f"FLOPs per step: {plan['flops_per_step']:.3e} at {plan['sentence_length']} tokens per sentence"
        + (f"; for the run: {plan['flops_total']:.3e}" if plan["flops_total"] else "")
        if plan["flops_per_step"] is not None
        else "FLOPs per step: unknown until dev_source exists (its mean sentence length sets them)",
        f"precision: {plan['precision']}",
    ]
    if plan["save_strategy"] == "steps":
        saves = f"a checkpoint every {plan['save_steps']:,} steps" + (
            f" ({plan['checkpoints']} in all)" if plan["checkpoints"] is not None else ""
        )
    else:
        saves = f"checkpoints: save_strategy {plan['save_strategy']}"
    if plan["save_minutes"]:
        saves += f", and every {plan['save_minutes']:g} minutes"
    if plan["save_total_limit"]:
        saves += f"; the last {plan['save_total_limit']} kept"
    if plan["average_last"] > 1:
        saves += f"; the last {plan['average_last']} averaged into {plan['output_dir']}/averaged"
    lines.append(saves)
    for key, path in plan["missing"].items():
        lines.append(f"not there yet: {key} {path} (a run stops on it unless an earlier step makes it)")
    return "\n".join(lines)


__all__ = ["describe_plan", "run_plan"]
