"""The run config: a ``configs/train/*.yaml`` file read into our fields and the Trainer's arguments, checked.

:class:`RecipeConfig` holds the run config's own keys; every other key is a ``Seq2SeqTrainingArguments`` field.
:func:`load_run_config` reads both (with ``key=value`` overrides, :func:`parse_overrides`) and raises
:class:`ConfigError` naming any key or number it cannot use; :func:`check_paths`, any file it names that is not
there. Both run before any data is read: a typo found after an hour of tokenizer training costs the hour. The
run itself is ``vaswani_tx.training.recipe``; what it will do and cost, ``vaswani_tx.training.plan``.
"""

from __future__ import annotations

import difflib
import importlib.util
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from transformers import Seq2SeqTrainingArguments

from vaswani_tx.model.errors import UserInputError

logger = logging.getLogger(__name__)


@dataclass
class RecipeConfig:
    """The run config's own fields; every other key of the YAML is a ``Seq2SeqTrainingArguments`` field.

    Paths are relative to the working directory (the repository root for the shipped configs).
    """

    model_config: str  # configs/model/*.json or a model folder
    tokenizer: str  # a tokenizer folder; trained from the training text first when missing
    dev_source: str | None = None  # required, except with multi30k (its val files by default)
    dev_target: str | None = None
    train_source: str | None = None  # line-aligned training files ...
    train_target: str | None = None
    wmt14: str | None = None  # ... or "en-de" / "en-fr": WMT14 from the Hugging Face Hub ...
    multi30k: str | None = None  # ... or "en-de" / "de-en": Multi30k, a local copy or the Hub's (data.multi30k) ...
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
    max_words: int | None = 250  # cleaning of the training pairs (vaswani_tx.data.data.clean_pairs)
    max_length_ratio: float | None = 3.0
    average_last: int = 5  # checkpoints `train` averages into output_dir/averaged (Section 6.1: 5 base, 20 big)
    generation: dict[str, Any] | None = None  # decoding defaults saved in the model's generation_config
    attn_implementation: str = "auto"  # eager or sdpa while training; auto: eager on the CPU, sdpa on a GPU


RECIPE_FIELDS = tuple(f.name for f in fields(RecipeConfig))
ATTENTION_CHOICES = ("auto", "eager", "sdpa")  # attn_implementation (precision.py's training_attention)
# Seq2SeqTrainingArguments fields that ask the machine (bf16 and tf32 need a GPU that has them) when constructed
DEVICE_FIELDS = ("bf16", "fp16", "bf16_full_eval", "fp16_full_eval", "tf32")


class ConfigError(UserInputError):
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
    path: str | os.PathLike,
    overrides: Sequence[str] | dict[str, Any] = (),
    world_size: int | None = None,
    check_device: bool = True,
) -> tuple[RecipeConfig, Seq2SeqTrainingArguments]:
    """Read a YAML run config (and ``key=value`` overrides) into our fields and the Trainer's arguments.

    A key that is neither a :class:`RecipeConfig` field nor a ``Seq2SeqTrainingArguments`` field is an
    error naming it (and the closest known key). ``tokens_per_step`` sets ``gradient_accumulation_steps``
    to ``ceil(tokens_per_step / (max_tokens * world_size))``; giving both is an error.
    ``report_to: [tensorboard]`` is dropped with a warning when TensorBoard is not installed.

    ``check_device=False`` reads a config for another machine (``train --dry-run``): the fields of
    :data:`DEVICE_FIELDS` (``bf16: true`` needs a GPU with bf16, ``tf32`` an Ampere one) are set on the
    arguments after they are built instead of being checked against this machine's devices.
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
    required = ("model_config", "tokenizer") + (() if recipe_values.get("multi30k") else ("dev_source", "dev_target"))
    for key in required:
        if recipe_values.get(key) is None:
            raise ConfigError(f"run config {path} needs {key!r}")
    recipe = RecipeConfig(**recipe_values)
    given = [bool(recipe.train_source), bool(recipe.wmt14), bool(recipe.train_dataset), bool(recipe.multi30k)]
    if sum(given) != 1 or bool(recipe.train_source) != bool(recipe.train_target):
        raise ConfigError(
            f"run config {path}: give train_source with train_target, wmt14, multi30k, or train_dataset (one of them)"
        )
    if recipe.multi30k:
        _multi30k_paths(recipe, path)
    if recipe.attn_implementation not in ATTENTION_CHOICES:
        raise ConfigError(
            f"run config {path}: attn_implementation must be one of {', '.join(ATTENTION_CHOICES)}, "
            f"got {recipe.attn_implementation!r}"
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
    if "bf16" in argument_values:  # true, false, or auto: on where this machine has fast bf16 (precision.py)
        from vaswani_tx.engine.precision import resolve_bf16_setting

        argument_values["bf16"] = resolve_bf16_setting(argument_values["bf16"], f"run config {path}")
    withheld = {} if check_device else {k: argument_values.pop(k) for k in DEVICE_FIELDS if k in argument_values}
    try:
        arguments = Seq2SeqTrainingArguments(**argument_values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"run config {path}: {err}") from err
    for key, value in withheld.items():
        setattr(arguments, key, value)
    return recipe, arguments


def _multi30k_paths(recipe: RecipeConfig, path: Path) -> None:
    """Point the training files (and the dev files, when not given) at Multi30k's folder: the local copy, or where
    `train` downloads it (`vaswani_tx.data.multi30k`; nothing is downloaded here, so a dry run stays offline)."""
    from vaswani_tx.data.multi30k import multi30k_folder

    source, _, target = recipe.multi30k.partition("-")
    if {source, target} != {"en", "de"}:
        raise ConfigError(f"run config {path}: multi30k must be en-de or de-en, got {recipe.multi30k!r}")
    if (recipe.source_lang, recipe.target_lang) != (source, target):
        raise ConfigError(
            f"run config {path}: multi30k: {recipe.multi30k} but source_lang {recipe.source_lang!r} and "
            f"target_lang {recipe.target_lang!r}"
        )
    folder = multi30k_folder()
    recipe.train_source, recipe.train_target = (str(folder / f"train.{lang}") for lang in (source, target))
    if recipe.dev_source is None and recipe.dev_target is None:
        recipe.dev_source, recipe.dev_target = (str(folder / f"val.{lang}") for lang in (source, target))
    elif recipe.dev_source is None or recipe.dev_target is None:
        raise ConfigError(f"run config {path}: give dev_source with dev_target, or neither (multi30k's val)")


def missing_paths(recipe: RecipeConfig) -> dict[str, str]:
    """The files and folders the run config names that are not there: key -> path (the model config, dev files,
    training data; not the tokenizer, which `train` makes when missing)."""
    keys = (
        ["model_config", "dev_source", "dev_target"]
        + (["train_source", "train_target"] if recipe.train_source else [])
        + (["train_dataset"] if recipe.train_dataset else [])
    )
    return {key: getattr(recipe, key) for key in keys if not Path(getattr(recipe, key)).exists()}


def check_paths(recipe: RecipeConfig) -> None:
    """Refuse a run config whose model config, dev files or training data do not exist (before any work)."""
    for key, value in missing_paths(recipe).items():
        raise ConfigError(f"{key}: {value} does not exist (paths are relative to {Path.cwd()})")


__all__ = [
    "DEVICE_FIELDS",
    "RECIPE_FIELDS",
    "ConfigError",
    "RecipeConfig",
    "check_paths",
    "load_run_config",
    "missing_paths",
    "parse_overrides",
]
