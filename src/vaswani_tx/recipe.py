"""The run recipe: a ``configs/train/*.yaml`` run config, and a resumable training run from it (Section 5).

- :class:`RecipeConfig` holds the run config's own keys; every other key is a ``Seq2SeqTrainingArguments``
  field. :func:`load_run_config` reads both (with ``key=value`` overrides, :func:`parse_overrides`) and
  raises :class:`ConfigError` naming any key or path it cannot use.
- :func:`train` runs a recipe: the tokenizer (trained when missing), the cleaned data, the model, and
  :class:`~vaswani_tx.training.VaswaniTrainer` with the checkpoint callbacks of
  ``vaswani_tx.checkpoints``; ``--resume`` continues from the last good checkpoint.
- :func:`set_generation_defaults` stores the run config's decoding settings in the model;
  :func:`plot_curves` draws the training and dev curves (``curves.png``).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from matplotlib.figure import Figure
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments, TrainerState, set_seed

from vaswani_tx import data
from vaswani_tx.checkpoints import (
    SamplerStateCallback,
    TimedCheckpointCallback,
    check_sampler_state,
    resume_checkpoint,
)
from vaswani_tx.evaluation import make_compute_metrics
from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.params import load_model_config
from vaswani_tx.tokenization import check_tokenizer_fits_model, load_tokenizer, train_tokenizer
from vaswani_tx.training import VaswaniTrainer

logger = logging.getLogger(__name__)


# ---- run configs ----


@dataclass
class RecipeConfig:
    """The run config's own fields; every other key of the YAML is a ``Seq2SeqTrainingArguments`` field.

    Paths are relative to the working directory (the repository root for the shipped configs).
    """

    model_config: str  # configs/model/*.json or a model folder
    tokenizer: str  # a tokenizer folder; trained from the training text first when missing
    dev_source: str
    dev_target: str
    train_source: str | None = None  # line-aligned training files ...
    train_target: str | None = None
    wmt14: str | None = None  # ... or "en-de" / "en-fr": WMT14 from the Hugging Face Hub
    source_lang: str = "en"
    target_lang: str = "de"
    tokenizer_kind: str = "bpe"  # used only when the tokenizer is trained here
    tokenizer_vocab_size: int | None = None  # default: the model config's vocab_size
    max_tokens: int = 4096  # per process and batch, source and target each (Section 5.1)
    eval_max_tokens: int | None = None
    tokens_per_step: int | None = None  # sets gradient_accumulation_steps (Section 5.1: ~25,000)
    save_minutes: float | None = None  # also checkpoint every so many minutes (Section 6.1: 10)
    dev_max_pairs: int | None = None  # evaluate during training on the first N dev pairs only
    max_words: int | None = 250  # cleaning of the training pairs (vaswani_tx.data.clean_pairs)
    max_length_ratio: float | None = 3.0
    average_last: int = 5  # checkpoints to average at the end (Section 6: 5 base, 20 big)
    generation: dict[str, Any] | None = None  # decoding defaults saved in the model's generation_config


RECIPE_FIELDS = tuple(f.name for f in fields(RecipeConfig))


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the key or path."""


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["max_steps=10", "fp16=true"]`` -> ``{"max_steps": 10, "fp16": True}`` (values read as YAML)."""
    values = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        values[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
    return values


def load_run_config(
    path: str | os.PathLike, overrides: Sequence[str] | dict[str, Any] = (), world_size: int | None = None
) -> tuple[RecipeConfig, Seq2SeqTrainingArguments]:
    """Read a YAML run config (and ``key=value`` overrides) into our fields and the Trainer's arguments.

    A key that is neither a :class:`RecipeConfig` field nor a ``Seq2SeqTrainingArguments`` field is an
    error naming it (and the closest known key). ``tokens_per_step`` sets ``gradient_accumulation_steps``
    to ``ceil(tokens_per_step / (max_tokens * world_size))``; giving both is an error.
    ``report_to: [tensorboard]`` is dropped with a warning when TensorBoard is not installed.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"run config {path} does not exist")
    try:
        values = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"run config {path} is not valid YAML: {err}") from None
    if not isinstance(values, dict):
        raise ConfigError(f"run config {path} must be a mapping of key: value, got {type(values).__name__}")
    values.update(parse_overrides(overrides) if not isinstance(overrides, dict) else overrides)

    argument_fields = {f.name for f in fields(Seq2SeqTrainingArguments) if f.init}
    known = set(RECIPE_FIELDS) | argument_fields
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"unknown key {key!r} in {path}: no Seq2SeqTrainingArguments field and no recipe field "
                f"({', '.join(RECIPE_FIELDS)}) has that name{hint}"
            )
    recipe_values = {k: v for k, v in values.items() if k in RECIPE_FIELDS}
    for required in ("model_config", "tokenizer", "dev_source", "dev_target"):
        if recipe_values.get(required) is None:
            raise ConfigError(f"run config {path} needs {required!r}")
    recipe = RecipeConfig(**recipe_values)
    if bool(recipe.train_source) == bool(recipe.wmt14) or bool(recipe.train_source) != bool(recipe.train_target):
        raise ConfigError(f"run config {path}: give train_source with train_target, or wmt14 (one of the two)")
    if recipe.max_tokens <= 0:
        raise ConfigError(f"max_tokens must be > 0, got {recipe.max_tokens}")
    if recipe.generation is not None and not isinstance(recipe.generation, dict):
        raise ConfigError(f"run config {path}: generation must be a mapping of GenerationConfig fields")

    argument_values = {k: v for k, v in values.items() if k in argument_fields}
    if "output_dir" not in argument_values:
        raise ConfigError(f"run config {path} needs 'output_dir'")
    if recipe.tokens_per_step is not None:
        if "gradient_accumulation_steps" in argument_values:
            raise ConfigError("give tokens_per_step or gradient_accumulation_steps, not both")
        world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        argument_values["gradient_accumulation_steps"] = max(
            1, math.ceil(recipe.tokens_per_step / (recipe.max_tokens * world_size))
        )
    report_to = argument_values.get("report_to")
    if (
        report_to
        and "tensorboard" in ([report_to] if isinstance(report_to, str) else report_to)
        and importlib.util.find_spec("tensorboard") is None
        and importlib.util.find_spec("tensorboardX") is None
    ):
        logger.warning("TensorBoard is not installed: training without TensorBoard logs (pip install tensorboard)")
        kept = [r for r in ([report_to] if isinstance(report_to, str) else report_to) if r != "tensorboard"]
        argument_values["report_to"] = kept or "none"
    try:
        arguments = Seq2SeqTrainingArguments(**argument_values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"run config {path}: {err}") from err
    return recipe, arguments


# ---- the run ----


def _check_paths(recipe: RecipeConfig) -> None:
    keys = ["model_config", "dev_source", "dev_target"] + (
        ["train_source", "train_target"] if recipe.train_source else []
    )
    for key in keys:
        value = getattr(recipe, key)
        if not Path(value).exists():
            raise ConfigError(f"{key}: {value} does not exist (paths are relative to {Path.cwd()})")


def _prepare_tokenizer(recipe: RecipeConfig, config, arguments: Seq2SeqTrainingArguments):
    folder = Path(recipe.tokenizer)
    with arguments.main_process_first(desc="tokenizer"):
        if not (folder / "tokenizer.json").is_file():
            if recipe.wmt14:
                raise ConfigError(
                    f"tokenizer {folder} does not exist: create it first with `vaswani-tx train-tokenizer --wmt14 ...`"
                )
            vocab_size = recipe.tokenizer_vocab_size or config.vocab_size
            logger.info(
                "training a %s vocabulary of %d on %s and %s",
                recipe.tokenizer_kind,
                vocab_size,
                recipe.train_source,
                recipe.train_target,
            )
            tokenizer = train_tokenizer(
                [recipe.train_source, recipe.train_target], recipe.tokenizer_kind, vocab_size, show_progress=False
            )
            tokenizer.save_pretrained(folder)
        tokenizer = load_tokenizer(folder)
    check_tokenizer_fits_model(tokenizer, config)
    return tokenizer


def _prepare_data(recipe: RecipeConfig, tokenizer, arguments: Seq2SeqTrainingArguments):
    with arguments.main_process_first(desc="data"):
        if recipe.wmt14:
            source_lang, _, target_lang = recipe.wmt14.partition("-")
            pairs = data.load_wmt14(source_lang, target_lang, "train")
        else:
            pairs = data.read_parallel_files(recipe.train_source, recipe.train_target)
        pairs, report = data.clean_pairs(pairs, max_words=recipe.max_words, max_length_ratio=recipe.max_length_ratio)
        logger.info("training pairs:\n%s", report)
        train = data.tokenize_pairs(pairs, tokenizer)
        dev = data.tokenize_pairs(data.read_parallel_files(recipe.dev_source, recipe.dev_target), tokenizer)
    if recipe.dev_max_pairs is not None:
        dev = dev.select(range(min(recipe.dev_max_pairs, dev.num_rows)))
    return train, dev


def _sampler_state(trainer: VaswaniTrainer) -> dict[str, int]:
    """The state of the training sampler ``trainer`` builds, as far as a resume must agree with it."""
    return data.TokenBudgetBatchSampler.from_dataset(
        trainer.train_dataset,
        trainer.max_tokens,
        seed=trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed,
        num_replicas=max(1, trainer.args.world_size),
        rank=trainer.args.process_index,
    ).state_dict()


def train(recipe: RecipeConfig, arguments: Seq2SeqTrainingArguments, resume: bool = False) -> dict[str, Any]:
    """Run a recipe: tokenizer, data, model, :class:`VaswaniTrainer`; returns the final metrics.

    Writes to ``output_dir``: the checkpoints, the final model with its tokenizer, TensorBoard logs
    (when ``report_to`` asks and TensorBoard is installed), ``log_history.json`` and ``curves.png``.
    """
    _check_paths(recipe)
    checkpoint = resume_checkpoint(arguments.output_dir, resume)
    config = load_model_config(recipe.model_config)
    tokenizer = _prepare_tokenizer(recipe, config, arguments)
    train_set, dev_set = _prepare_data(recipe, tokenizer, arguments)

    set_seed(arguments.seed)  # the initial weights; the Trainer reseeds for the data order and dropout
    model = VaswaniForConditionalGeneration(config)
    if recipe.generation:
        set_generation_defaults(model, recipe.generation)
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100)
    callbacks = [TimedCheckpointCallback(recipe.save_minutes)] if recipe.save_minutes else []
    trainer = VaswaniTrainer(
        model=model,
        args=arguments,
        train_dataset=train_set,
        eval_dataset=dev_set,
        data_collator=collator,
        processing_class=tokenizer,
        # without generation the Trainer's predictions are logits: dev loss only
        compute_metrics=make_compute_metrics(tokenizer, target_lang=recipe.target_lang)
        if arguments.predict_with_generate
        else None,
        callbacks=callbacks,
        max_tokens=recipe.max_tokens,
        eval_max_tokens=recipe.eval_max_tokens,
    )
    trainer.add_callback(SamplerStateCallback(trainer))
    if checkpoint is not None and _reached_max_steps(checkpoint, arguments):
        # The Trainer would take one more step before checking max_steps; a finished run stays finished.
        logger.info("%s already reached max_steps=%d: nothing left to train", checkpoint, arguments.max_steps)
        return _finish_from_checkpoint(trainer, checkpoint)
    world = max(1, arguments.world_size)
    logger.info(
        "processes: %d, gradient accumulation: %d, max_tokens: %d per batch: up to %d source and %d target "
        "tokens per optimizer step (the paper: about 25,000 each)",
        world,
        arguments.gradient_accumulation_steps,
        recipe.max_tokens,
        *(world * arguments.gradient_accumulation_steps * recipe.max_tokens,) * 2,
    )
    if checkpoint is not None:
        check_sampler_state(checkpoint, partial(_sampler_state, trainer))
        logger.info("resuming from %s", checkpoint)
    result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = dict(result.metrics)
    if arguments.eval_strategy != "no":
        final = _last_evaluation(trainer.state.log_history, trainer.state.global_step)
        metrics.update(final if final else trainer.evaluate())
    _save_final(trainer)
    return metrics


def set_generation_defaults(model, values: dict[str, Any]) -> None:
    """Replace fields of ``model.generation_config`` (the run config's ``generation:`` block).

    Checkpoints and the final model save it, so ``generate()`` and ``vaswani-tx translate`` decode with
    these defaults unchanged (e.g. Section 6.3's beam 21, alpha 0.3, input length + 300).

    Raises:
        ConfigError: a key that is not a field of the model's generation config, or invalid values.
    """
    generation_config = model.generation_config
    unknown = sorted(key for key in values if not hasattr(generation_config, key))
    if unknown:
        raise ConfigError(f"generation: {', '.join(unknown)} not a field of the model's GenerationConfig")
    generation_config.update(**values)
    try:
        generation_config.validate(strict=True)
    except ValueError as err:
        raise ConfigError(f"generation: {err}") from None


def _reached_max_steps(checkpoint: str, arguments: Seq2SeqTrainingArguments) -> bool:
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    return arguments.max_steps > 0 and state["global_step"] >= arguments.max_steps


def _last_evaluation(log_history: Sequence[dict[str, Any]], step: int) -> dict[str, Any]:
    final = [entry for entry in log_history if "eval_loss" in entry and entry["step"] == step]
    return {key: value for key, value in final[-1].items() if key.startswith("eval_")} if final else {}


def _finish_from_checkpoint(trainer: VaswaniTrainer, checkpoint: str) -> dict[str, Any]:
    trainer.model.load_state_dict(VaswaniForConditionalGeneration.from_pretrained(checkpoint).state_dict())
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    metrics = {
        "global_step": trainer.state.global_step,
        **_last_evaluation(trainer.state.log_history, trainer.state.global_step),
    }
    _save_final(trainer)
    return metrics


def _save_final(trainer: VaswaniTrainer) -> None:
    """The final model and tokenizer in ``output_dir``, with ``log_history.json`` and ``curves.png``."""
    trainer.save_model()
    if trainer.is_world_process_zero():
        output_dir = Path(trainer.args.output_dir)
        history = trainer.state.log_history
        (output_dir / "log_history.json").write_text(json.dumps(history, indent=1) + "\n", encoding="utf-8")
        plot_curves(history, output_dir / "curves.png")


# ---- curves ----


def plot_curves(log_history: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """A PNG of the training loss, the dev loss and the dev sacreBLEU against the optimizer step."""

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        return [p[0] for p in points], [p[1] for p in points]

    # a Figure of its own, not pyplot's: no backend to select, no global figure list to close it from
    figure = Figure(figsize=(11, 4))
    loss_axis, bleu_axis = figure.subplots(1, 2)
    for key, label in (("loss", "training loss (label-smoothed)"), ("eval_loss", "dev loss (label-smoothed)")):
        steps, values = series(key)
        if steps:
            loss_axis.plot(steps, values, marker="o" if key == "eval_loss" else None, label=label)
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss (nats per target token)")
    loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    steps, values = series("eval_sacrebleu")
    bleu_axis.plot(steps, values, marker="o", color="tab:green")
    bleu_axis.set_xlabel("optimizer step")
    bleu_axis.set_ylabel("dev sacreBLEU")
    bleu_axis.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path
