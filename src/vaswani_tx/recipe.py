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
from transformers import (
    DataCollatorForSeq2Seq,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    TrainerState,
    set_seed,
)

from vaswani_tx import data
from vaswani_tx.checkpoints import (
    SamplerStateCallback,
    TimedCheckpointCallback,
    average_last_checkpoints,
    check_sampler_state,
    checkpoint_folders,
    complete_checkpoints,
    resume_checkpoint,
)
from vaswani_tx.evaluation import make_compute_metrics
from vaswani_tx.folders import RunLock, check_writable, folder_kind
from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.params import load_model_config, training_flops
from vaswani_tx.text_io import iter_lines
from vaswani_tx.tokenization import (
    check_tokenizer_fits_model,
    load_tokenizer,
    train_tokenizer,
    vocabulary_fingerprint,
)
from vaswani_tx.training import VaswaniTrainer, paper_learning_rate

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
    wmt14: str | None = None  # ... or "en-de" / "en-fr": WMT14 from the Hugging Face Hub ...
    train_dataset: str | None = None  # ... or a `vaswani-tx prepare-data` output folder (encoded with `tokenizer`)
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
    average_last: int = 5  # checkpoints `train` averages into output_dir/averaged (Section 6.1: 5 base, 20 big)
    generation: dict[str, Any] | None = None  # decoding defaults saved in the model's generation_config


RECIPE_FIELDS = tuple(f.name for f in fields(RecipeConfig))


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the key or path."""


# numbers of the recipe and of Seq2SeqTrainingArguments checked before any work: (kind, smallest allowed value,
# whether 0 is excluded); None is always allowed where the field's default is None
_RECIPE_NUMBERS = {
    "tokenizer_vocab_size": (int, 1),
    "max_tokens": (int, 1),
    "eval_max_tokens": (int, 1),
    "tokens_per_step": (int, 1),
    "save_minutes": (float, 0, True),
    "dev_max_pairs": (int, 1),
    "max_words": (int, 1),
    "max_length_ratio": (float, 0, True),
    "average_last": (int, 0),
}
_ARGUMENT_RANGES = {
    "learning_rate": (0, True),
    "num_train_epochs": (0, True),
    "gradient_accumulation_steps": (1,),
    "per_device_train_batch_size": (1,),
    "per_device_eval_batch_size": (1,),
    "warmup_steps": (0,),
    "logging_steps": (0, True),
    "save_steps": (0, True),
    "eval_steps": (0, True),
    "save_total_limit": (1,),
    "weight_decay": (0,),
    "label_smoothing_factor": (0,),
    "max_grad_norm": (0,),
}


def _number(key: str, value: Any, kind: type, path: Path) -> int | float:
    """`value` as a number of `kind` (a YAML string such as "1e-3" included), or a ConfigError naming key and value."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value) if kind is float or not value.strip().lstrip("+-").isdigit() else int(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not math.isfinite(number):
        raise ConfigError(f"{path}: {key}={value!r} is not a number")
    if kind is int and not float(number).is_integer():
        raise ConfigError(f"{path}: {key}={value!r} is not a whole number")
    return int(number) if kind is int else number


def _check_range(key: str, number: int | float, rule: tuple, path: Path) -> None:
    least, exclusive = rule[0], len(rule) > 1 and rule[1]
    if number < least or (exclusive and number == least):
        raise ConfigError(f"{path}: {key}={number!r} must be {'>' if exclusive else '>='} {least}")


def _check_numbers(values: dict[str, Any], path: Path) -> None:
    """Refuse a number field holding text or a value out of range, naming the field and the value (in place:
    numbers written as YAML strings such as "1e-3" become numbers)."""
    for key, (kind, *rule) in _RECIPE_NUMBERS.items():
        if values.get(key) is not None:
            values[key] = _number(key, values[key], kind, path)
            _check_range(key, values[key], tuple(rule), path)
    for field in fields(Seq2SeqTrainingArguments):
        default = field.default
        if field.name not in values or values[field.name] is None:
            continue
        if field.name not in _ARGUMENT_RANGES and (isinstance(default, bool) or not isinstance(default, (int, float))):
            continue
        kind = float if isinstance(default, float) else int if isinstance(default, int) else float
        if field.name in ("logging_steps", "save_steps", "eval_steps", "warmup_steps"):
            kind = float  # a whole number of steps or, below 1, a fraction of the run
        number = _number(field.name, values[field.name], kind, path)
        if kind is float and float(number).is_integer() and not isinstance(default, float):
            number = int(number)
        values[field.name] = number
        if field.name in _ARGUMENT_RANGES:
            _check_range(field.name, number, _ARGUMENT_RANGES[field.name], path)
    max_steps = values.get("max_steps")
    if max_steps is not None and max_steps != -1 and max_steps <= 0:
        raise ConfigError(f"{path}: max_steps={max_steps!r} must be > 0 (or -1: train num_train_epochs epochs)")


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["max_steps=10", "fp16=true", "eval_strategy=no"]`` -> ``{"max_steps": 10, "fp16": True, "eval_strategy":
    "no"}`` (values read as YAML, except that yes/no/on/off stay words: only true/false are booleans)."""
    values = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        # YAML 1.1 reads yes/no/on/off as booleans; here they stay words (`eval_strategy=no` means "no")
        word = raw.strip().lower() in ("yes", "no", "on", "off", "y", "n")
        values[key.strip()] = raw.strip() if word else yaml.safe_load(raw) if raw.strip() else None
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
    _check_numbers(values, path)
    recipe_values = {k: v for k, v in values.items() if k in RECIPE_FIELDS}
    for required in ("model_config", "tokenizer", "dev_source", "dev_target"):
        if recipe_values.get(required) is None:
            raise ConfigError(f"run config {path} needs {required!r}")
    recipe = RecipeConfig(**recipe_values)
    given = [bool(recipe.train_source), bool(recipe.wmt14), bool(recipe.train_dataset)]
    if sum(given) != 1 or bool(recipe.train_source) != bool(recipe.train_target):
        raise ConfigError(
            f"run config {path}: give train_source with train_target, wmt14, or train_dataset (one of the three)"
        )
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
        if recipe.tokens_per_step < recipe.max_tokens * world_size:
            raise ConfigError(
                f"tokens_per_step={recipe.tokens_per_step} cannot be reached with {world_size} process(es): one "
                f"batch each of max_tokens={recipe.max_tokens} is already {recipe.max_tokens * world_size} tokens "
                f"a step; give tokens_per_step >= {recipe.max_tokens * world_size} or a smaller max_tokens"
            )
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
    `vaswani_tx.params.training_flops` of that many source and target tokens at ``sentence_length``
    tokens per sentence, the mean words per line of ``dev_source`` (subwords make real sentences a little
    longer); FLOPs of the run are that times ``max_steps``. Checkpoints: every ``save_steps`` (and every
    ``save_minutes``), the last ``save_total_limit`` kept, ``average_last`` averaged at the end.
    """
    _check_paths(recipe)
    config = load_model_config(recipe.model_config)
    processes = processes or max(1, arguments.world_size)
    accumulation = arguments.gradient_accumulation_steps
    tokens = processes * accumulation * recipe.max_tokens
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
        "sentence_length": round(length, 2),
        "flops_per_step": flops,
        "flops_total": flops * steps if steps else None,
        "save_strategy": save,
        "save_steps": arguments.save_steps if save == "steps" else None,
        "checkpoints": steps // int(arguments.save_steps) if steps and save == "steps" else None,
        "save_minutes": recipe.save_minutes,
        "save_total_limit": arguments.save_total_limit,
        "average_last": recipe.average_last,
        "output_dir": arguments.output_dir,
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
        + (f"; for the run: {plan['flops_total']:.3e}" if plan["flops_total"] else ""),
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
    return "\n".join(lines)


def _check_paths(recipe: RecipeConfig) -> None:
    keys = (
        ["model_config", "dev_source", "dev_target"]
        + (["train_source", "train_target"] if recipe.train_source else [])
        + (["train_dataset"] if recipe.train_dataset else [])
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
            if recipe.train_dataset:
                raise ConfigError(
                    f"tokenizer {folder} does not exist: give the tokenizer {recipe.train_dataset} was encoded with "
                    "(`vaswani-tx prepare-data --tokenizer`)"
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
    config.tokenizer_fingerprint = vocabulary_fingerprint(tokenizer)  # saved with every checkpoint
    return tokenizer


def _load_prepared(folder: str, tokenizer):
    """A `vaswani-tx prepare-data` output folder (cleaned and encoded already), checked against the tokenizer:
    the one it was encoded with (its `vaswani_data.json`), or at least one whose ids cover it."""
    import datasets

    try:
        dataset = datasets.load_from_disk(folder)
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(
            f"train_dataset: {folder} is not a `vaswani-tx prepare-data` output folder ({err})"
        ) from None
    missing = {"input_ids", "labels"} - set(getattr(dataset, "column_names", ()))
    if not isinstance(dataset, datasets.Dataset) or missing:
        raise ConfigError(f"train_dataset: {folder} has no {', '.join(sorted(missing)) or 'single dataset'}")
    if dataset.num_rows == 0:
        raise ConfigError(f"train_dataset: {folder} holds no pairs")
    import pyarrow.compute as pc

    largest = max(
        pc.max(pc.list_flatten(dataset.data.column(column))).as_py() or 0 for column in ("input_ids", "labels")
    )
    if largest >= len(tokenizer):
        raise ConfigError(
            f"train_dataset: {folder} holds token id {largest}, beyond the tokenizer's {len(tokenizer)} tokens: "
            "it was encoded with another tokenizer"
        )
    record = Path(folder) / data.PREPARED_DATA_RECORD
    if record.is_file():
        encoded_with = json.loads(record.read_text(encoding="utf-8"))
        fingerprint = vocabulary_fingerprint(tokenizer)
        if encoded_with.get("tokenizer_fingerprint") != fingerprint:
            raise ConfigError(
                f"train_dataset: {folder} was encoded with the tokenizer {encoded_with.get('tokenizer')} "
                f"({encoded_with.get('tokenizer_fingerprint')}), not with this run's tokenizer "
                f"({fingerprint}): give that tokenizer, or prepare the data again with this one"
            )
    logger.info("training pairs: %d from %s (prepared by `vaswani-tx prepare-data`)", dataset.num_rows, folder)
    return dataset


def _prepare_data(recipe: RecipeConfig, tokenizer, arguments: Seq2SeqTrainingArguments):
    with arguments.main_process_first(desc="data"):
        if recipe.train_dataset:
            train = _load_prepared(recipe.train_dataset, tokenizer)
        else:
            if recipe.wmt14:
                source_lang, _, target_lang = recipe.wmt14.partition("-")
                pairs = data.load_wmt14(source_lang, target_lang, "train")
            else:
                pairs = data.read_parallel_files(recipe.train_source, recipe.train_target)
            pairs, report = data.clean_pairs(
                pairs, max_words=recipe.max_words, max_length_ratio=recipe.max_length_ratio
            )
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


def train(
    recipe: RecipeConfig,
    arguments: Seq2SeqTrainingArguments,
    resume: bool = False,
    callbacks: Sequence[TrainerCallback] = (),
) -> dict[str, Any]:
    """Run a recipe: tokenizer, data, model, :class:`VaswaniTrainer`; returns the final metrics.

    Writes to ``output_dir``: the checkpoints, the final model with its tokenizer, TensorBoard logs
    (when ``report_to`` asks and TensorBoard is installed), ``log_history.json`` and ``curves.png``; with
    ``callbacks`` are added to the Trainer's (the parser's dev F1, for one). With
    ``average_last`` > 1, the average of that many last complete checkpoints (Section 6.1; fewer when fewer
    were written) in ``output_dir/averaged``, rewritten whenever `train` ends (a ``--resume`` of a finished
    run included); the metrics give its path as ``averaged`` and the checkpoints as ``averaged_from``.

    The main process holds ``output_dir``'s :class:`~vaswani_tx.folders.RunLock` throughout: a second run on
    the same folder is refused (:class:`~vaswani_tx.folders.RunLockError`, naming the holder's PID).
    """
    _check_paths(recipe)
    check_writable(arguments.output_dir)  # a read-only output_dir is found before any data is read
    if arguments.process_index != 0:
        return _train(recipe, arguments, resume, callbacks)
    with RunLock(arguments.output_dir) as lock:
        if lock.took_over is not None:
            logger.warning("took over the lock of a run that is gone: %s", lock.took_over)
        metrics = _train(recipe, arguments, resume, callbacks)
        if recipe.average_last > 1 and complete_checkpoints(arguments.output_dir):
            averaged, chosen = average_last_checkpoints(arguments.output_dir, recipe.average_last)
            logger.info("averaged %s into %s (average_last, Section 6.1)", ", ".join(c.name for c in chosen), averaged)
            metrics["averaged"], metrics["averaged_from"] = str(averaged), [c.name for c in chosen]
        return metrics


def _train(
    recipe: RecipeConfig, arguments: Seq2SeqTrainingArguments, resume: bool, extra_callbacks: Sequence[TrainerCallback]
) -> dict[str, Any]:
    kind = folder_kind(arguments.output_dir)
    if Path(arguments.output_dir).resolve() == Path(recipe.tokenizer).resolve():
        kind = None  # the run's own tokenizer, trained into output_dir by an earlier start of this run
    if kind is not None and not checkpoint_folders(arguments.output_dir):
        # a model, tokenizer or dataset folder, or a run finished without checkpoints: nothing to resume, all to lose
        raise ConfigError(
            f"output_dir {arguments.output_dir} already holds {kind} and no checkpoint to resume from; "
            "give another output_dir"
        )
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
    callbacks += list(extra_callbacks)
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
    if world > 1:  # which of accelerate's set-ups shares the work (FSDP: parameters and optimizer state sharded)
        logger.info("distributed: %s over %s", "FSDP" if trainer.is_fsdp_enabled else "DDP", arguments.device.type)
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not trainer.is_fsdp_enabled:
        # accelerate turns FSDP on for GPUs and other accelerators only; on the CPU it runs plain DDP
        logger.warning(
            "the accelerate config asks for FSDP, but accelerate enables FSDP on GPUs and other accelerators only: "
            "on %s this run is DDP (every process holds the whole model and optimizer state)",
            arguments.device.type,
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


# The parser's target format (vaswani_tx.parsing): saved with its decoding defaults so that `parse predict`
# decodes a model as it was trained.
PARSER_GENERATION_FIELDS = ("tree_leaves",)


def end_distributed() -> None:
    """Leave the process group ``accelerate launch`` set up, if any, before the process exits: a gloo group
    left to the interpreter's exit can abort it ("terminate called without an active exception")."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def set_generation_defaults(model, values: dict[str, Any]) -> None:
    """Replace fields of ``model.generation_config`` (the run config's ``generation:`` block, which may also
    name the parser's ``tree_leaves``).

    Checkpoints and the final model save it, so ``generate()`` and ``vaswani-tx translate`` decode with
    these defaults unchanged (e.g. Section 6.3's beam 21, alpha 0.3, input length + 300).

    Raises:
        ConfigError: a key that is not a field of the model's generation config, or invalid values.
    """
    generation_config = model.generation_config
    unknown = sorted(
        key for key in values if not hasattr(generation_config, key) and key not in PARSER_GENERATION_FIELDS
    )
    if unknown:
        raise ConfigError(f"generation: {', '.join(unknown)} not a field of the model's GenerationConfig")
    unused = generation_config.update(**values)  # sets only the fields the config already has ...
    for key, value in unused.items():  # ... and returns the parser's own, set here
        setattr(generation_config, key, value)
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
    """A PNG of the training loss, the dev loss and the dev sacreBLEU against the optimizer step, and, for a
    parser, its dev bracketing F1 against training minutes."""

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        return [p[0] for p in points], [p[1] for p in points]

    # a Figure of its own, not pyplot's: no backend to select, no global figure list to close it from
    parser_f1 = [entry for entry in log_history if "eval_bracket_f1" in entry]
    bleu_steps, bleu = series("eval_sacrebleu")
    # a panel for each measure the run logged: a parser logs F1, not BLEU (a translation run with no BLEU
    # during training keeps its empty BLEU panel, as before, so its curves stay where readers look for them)
    panels = 1 + (not parser_f1 or bool(bleu)) + bool(parser_f1)
    figure = Figure(figsize=(5.5 * panels, 4))
    axes = list(figure.subplots(1, panels)) if panels > 1 else [figure.subplots(1, 1)]
    loss_axis = axes.pop(0)
    for key, label in (("loss", "training loss (label-smoothed)"), ("eval_loss", "dev loss (label-smoothed)")):
        steps, values = series(key)
        if steps:
            loss_axis.plot(steps, values, marker="o" if key == "eval_loss" else None, label=label)
    loss_axis.set_xlabel("optimizer step")
    loss_axis.set_ylabel("loss (nats per target token)")
    if loss_axis.lines:  # a run too short to log a loss draws empty axes, without a legend of nothing
        loss_axis.legend()
    loss_axis.grid(alpha=0.3)
    if not parser_f1 or bleu:
        bleu_axis = axes.pop(0)
        bleu_axis.plot(bleu_steps, bleu, marker="o", color="tab:green")
        bleu_axis.set_xlabel("optimizer step")
        bleu_axis.set_ylabel("dev sacreBLEU")
        bleu_axis.grid(alpha=0.3)
    if parser_f1:  # the parser's dev bracketing F1 against wall-clock training minutes (Section 6.3)
        axis = axes.pop(0)
        axis.plot(
            [e["train_minutes"] for e in parser_f1],
            [e["eval_bracket_f1"] for e in parser_f1],
            marker="o",
            color="tab:red",
        )
        axis.set_xlabel("training minutes")
        axis.set_ylabel("dev bracketing F1 (EVALB, greedy)")
        axis.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=100)
    return path
