"""The paper's training recipe (Section 5) on ``Seq2SeqTrainer``, and checkpoint averaging (Section 6.1).

- :class:`TokenBudgetSeq2SeqTrainer` batches by tokens instead of sentences (Section 5.1: "each training
  batch contained ... approximately 25000 source tokens and 25000 target tokens").
- :func:`get_paper_schedule` is the learning rate of Section 5.3 (equation 3); :func:`label_smoothed_loss`
  the label smoothing of Section 5.4; :class:`VaswaniTrainer` puts both, Adam (0.9, 0.98, 1e-9) and the
  token budget together.
- :func:`load_run_config` reads a ``configs/train/*.yaml`` run config; :func:`train` runs it, resumably.
- :func:`average_checkpoints` averages the last checkpoints (Section 6.1); :func:`training_flops` counts
  a step's cost; :func:`plot_curves` draws the curves. Decoding a saved model is ``vaswani_tx.translation``.

Departures, each for a stated reason: the schedule is evaluated at ``updates_done + 1`` so the first
update uses step 1 (a plain ``LambdaLR`` would use step 0, rate 0); the loss is normalised by the
target tokens of the whole optimizer step rather than per batch, so accumulation and data parallelism
equal one large batch; smoothing spreads ``epsilon`` over the whole vocabulary (Szegedy et al., the
paper's reference [36]) rather than over the ``V - 1`` wrong tokens as tensor2tensor does.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import logging
import math
import os
import re
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import torch
import yaml
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, seed_worker
from transformers.utils import SAFE_WEIGHTS_NAME

from vaswani_tx.checkpoints import CheckpointError, check_safetensors
from vaswani_tx.data import TokenBudgetBatchSampler

logger = logging.getLogger(__name__)


class TokenBudgetSeq2SeqTrainer(Seq2SeqTrainer):
    """A ``Seq2SeqTrainer`` whose batches hold at most ``max_tokens`` source and target tokens each.

    Training batches come from :class:`~vaswani_tx.data.TokenBudgetBatchSampler` (shuffled per epoch
    from ``args.data_seed`` or ``args.seed``, one disjoint equal share per process); evaluation
    batches, when ``eval_max_tokens`` is given, are length-sorted under that budget without shuffling,
    which wastes the least padding. ``per_device_*_batch_size`` is then unused. ``predict`` keeps
    the sentence-count batches so that its outputs stay in dataset order. Works with any seq2seq model
    whose dataset has ``input_ids`` and ``labels`` columns.

    Per-device budget: with ``P`` processes and ``G`` gradient-accumulation steps an optimizer step
    sees up to ``P * G * max_tokens`` tokens per side; the paper's 25,000 on 8 GPUs is about 3,125 each.
    """

    def __init__(self, *args, max_tokens: int, eval_max_tokens: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive number of tokens per batch, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens
        self.train_sampler: TokenBudgetBatchSampler | None = None

    def train_sampler_state(self) -> dict[str, int] | None:
        """The training sampler's ``state_dict()``, or ``None`` before training built it."""
        return None if self.train_sampler is None else self.train_sampler.state_dict()

    def _token_budget_dataloader(self, dataset: datasets.Dataset, max_tokens: int, description: str, shuffle: bool) -> DataLoader:
        dataset = self._remove_unused_columns(dataset, description=description)
        sampler = TokenBudgetBatchSampler.from_dataset(
            dataset,
            max_tokens,
            shuffle=shuffle,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            num_replicas=max(1, self.args.world_size),
            rank=self.args.process_index,
            # the budget must hold after the collator's own padding
            pad_to_multiple_of=getattr(self.data_collator, "pad_to_multiple_of", None),
        )
        if shuffle:
            self.train_sampler = sampler
        dataloader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=self.data_collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers,
            prefetch_factor=self.args.dataloader_prefetch_factor,
            worker_init_fn=partial(seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index),
        )
        dataloader = self.accelerator.prepare(dataloader)
        # The sampler already gives each process its share; accelerate's BatchSamplerShard would shard
        # it again, so make that wrapper a passthrough (as Trainer does for BatchRebalanceSampler).
        wrapper = getattr(dataloader, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes, wrapper.process_index = 1, 0
        return dataloader

    def get_train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        return self._token_budget_dataloader(self.train_dataset, self.max_tokens, "Training", shuffle=True)

    def get_eval_dataloader(self, eval_dataset: str | datasets.Dataset | None = None) -> DataLoader:
        if self.eval_max_tokens is None:
            return super().get_eval_dataloader(eval_dataset)
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        return self._token_budget_dataloader(dataset, self.eval_max_tokens, "Evaluation", shuffle=False)


# ---- Section 5.3: optimizer and learning-rate schedule ----


def paper_learning_rate(step: int, d_model: int, warmup_steps: int = 4000) -> float:
    """Section 5.3, equation (3): ``lrate = d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)``.

    ``step`` counts optimizer updates from 1 (the first update uses step 1).
    """
    if step < 1:
        raise ValueError(f"the schedule is defined from step 1 (the first update), got step={step}")
    if warmup_steps < 1:
        raise ValueError(f"warmup_steps must be >= 1, got {warmup_steps}")
    return d_model**-0.5 * min(step**-0.5, step * warmup_steps**-1.5)


def get_paper_schedule(optimizer: torch.optim.Optimizer, d_model: int, warmup_steps: int = 4000) -> LambdaLR:
    """The Section 5.3 schedule as a ``LambdaLR`` that multiplies each group's initial ``lr``.

    With initial ``lr`` 1.0 (the configs' ``learning_rate: 1.0``) the update number ``k`` uses exactly
    :func:`paper_learning_rate` ``(k)``; another ``learning_rate`` scales the curve (tensor2tensor's
    ``learning_rate`` constant). transformers' ``get_inverse_sqrt_schedule`` has the same shape but
    is one step behind: ``LambdaLR`` evaluates its lambda at the number of updates already taken, so
    its first update gets ``0 / warmup = 0`` and update ``k`` gets the paper's rate of ``k - 1``
    (``tests/test_training.py`` pins both facts). Hence the ``+ 1`` below.
    """
    return LambdaLR(optimizer, partial(_paper_lr_lambda, d_model=d_model, warmup_steps=warmup_steps))


def _paper_lr_lambda(updates_done: int, *, d_model: int, warmup_steps: int) -> float:
    return paper_learning_rate(updates_done + 1, d_model, warmup_steps)


# ---- Section 5.4: label smoothing ----


def label_smoothed_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    epsilon: float,
    num_items_in_batch: int | torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Cross-entropy against ``(1 - epsilon) * one_hot(label) + epsilon / V`` (Section 5.4, Szegedy et al.).

    Only target positions whose label is not ``ignore_index`` (the collator's label padding) count:
    the loss is their sum divided by ``num_items_in_batch`` (the Trainer's count of such tokens over
    every micro-batch of the optimizer step and, with ``average_tokens_across_devices``, every
    process), or by this batch's count when it is ``None``. Summing then dividing by the step's total
    makes gradient accumulation and data parallelism give the gradient of one big batch.

    logits: (B, T, V); labels: (B, T). Computed in float32 whatever the logits' dtype.
    """
    if not 0.0 <= epsilon < 1.0:
        raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
    keep = labels.ne(ignore_index)  # (B, T)
    # Only labelled rows: the softmax over V at padded positions would be a third of the work, thrown away.
    log_probs = torch.log_softmax(logits[keep].float(), dim=-1)  # (N, V)
    nll = -log_probs.gather(-1, labels[keep].unsqueeze(-1)).squeeze(-1)  # (N,)
    uniform = -log_probs.mean(dim=-1)  # (N,): cross-entropy against 1/V everywhere
    total = ((1.0 - epsilon) * nll + epsilon * uniform).sum()
    denominator = keep.sum() if num_items_in_batch is None else num_items_in_batch
    if torch.is_tensor(denominator):
        denominator = denominator.to(total.device)
    return total / denominator


class LabelSmoothedCrossEntropy:
    """``compute_loss_func`` for the Trainer: :func:`label_smoothed_loss` on the model's logits."""

    def __init__(self, epsilon: float) -> None:
        if not 0.0 <= epsilon < 1.0:
            raise ValueError(f"label smoothing epsilon must be in [0, 1), got {epsilon}")
        self.epsilon = epsilon

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return label_smoothed_loss(logits, labels.to(logits.device), self.epsilon, num_items_in_batch)


# ---- the Trainer ----


class VaswaniTrainer(TokenBudgetSeq2SeqTrainer):
    """Section 5 on ``Seq2SeqTrainer``: token-budget batches, the paper's schedule, label smoothing.

    - Optimizer: the Trainer's own, from ``optim``/``adam_beta1``/``adam_beta2``/``adam_epsilon``/
      ``weight_decay``; the configs set Adam with beta1 0.9, beta2 0.98, eps 1e-9 and no weight decay
      (``adamw_torch`` with ``weight_decay: 0`` is Adam), as Section 5.3.
    - Schedule: :func:`get_paper_schedule` with ``warmup_steps`` (must be a whole number of steps)
      and the model's ``d_model``; ``lr_scheduler_type`` must say ``inverse_sqrt``, the family it
      belongs to, so that a config asking for another schedule fails instead of being ignored.
    - Loss: :class:`LabelSmoothedCrossEntropy` with ``label_smoothing_factor`` over non-pad target
      tokens, normalised by the optimizer step's token count (so accumulation and several processes
      equal one large batch); with ``label_smoothing_factor: 0`` it is plain token-level cross-entropy.
    - No gradient clipping unless ``max_grad_norm`` > 0 (the paper has none; the configs set 0).
    """

    def __init__(self, *args, **kwargs) -> None:
        training_args = kwargs.get("args") if "args" in kwargs else args[1]
        if str(getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)) != "inverse_sqrt":
            raise ValueError(
                f"lr_scheduler_type={training_args.lr_scheduler_type!r}: VaswaniTrainer always uses the paper's "
                "inverse-square-root schedule (Section 5.3); set lr_scheduler_type: inverse_sqrt"
            )
        warmup = training_args.warmup_steps
        if warmup < 1 or warmup != int(warmup):
            raise ValueError(f"warmup_steps must be a whole number of steps >= 1 (the paper's 4000), got {warmup}")
        epsilon = training_args.label_smoothing_factor
        kwargs.setdefault("compute_loss_func", LabelSmoothedCrossEntropy(epsilon))
        super().__init__(*args, **kwargs)
        # The Trainer builds its own LabelSmoother from label_smoothing_factor; ours replaces it.
        self.label_smoother = None

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            d_model = self.accelerator.unwrap_model(self.model).config.d_model
            self.lr_scheduler = get_paper_schedule(optimizer, d_model, int(self.args.warmup_steps))
            self._created_lr_scheduler = True
        return self.lr_scheduler


# ---- callbacks ----


class TimedCheckpointCallback(TrainerCallback):
    """Save a checkpoint every ``minutes`` of training as well (the paper wrote one every 10 minutes, Section 6.1).

    With several processes rank 0's clock decides and the decision is broadcast, so every rank saves
    together (saving has collective steps; ranks that disagreed would hang).
    """

    def __init__(self, minutes: float) -> None:
        if minutes <= 0:
            raise ValueError(f"save_minutes must be > 0, got {minutes}")
        self.seconds = minutes * 60.0
        self.last_save = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        due = time.monotonic() - self.last_save >= self.seconds
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([int(due)], device=args.device)
            torch.distributed.broadcast(flag, src=0)
            due = bool(flag.item())
        if due:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self.last_save = time.monotonic()
        return control


class SamplerStateCallback(TrainerCallback):
    """Write the token-budget sampler's state into each checkpoint (``sampler_state.json``).

    The Trainer resumes mid-epoch by replaying the epoch's batch order, which the sampler derives from
    ``(seed, epoch)`` alone; this file lets a resume refuse data, seed or budget that differ from the
    checkpoint's, which would otherwise replay a different order silently.
    """

    def __init__(self, trainer: TokenBudgetSeq2SeqTrainer) -> None:
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        sampler = self.trainer.train_sampler_state()
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if sampler is not None and args.process_index == 0 and folder.is_dir():
            (folder / SAMPLER_STATE_NAME).write_text(json.dumps(sampler, indent=1) + "\n", encoding="utf-8")
        return control


SAMPLER_STATE_NAME = "sampler_state.json"


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
    if report_to and "tensorboard" in ([report_to] if isinstance(report_to, str) else report_to):
        if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
            logger.warning("TensorBoard is not installed: training without TensorBoard logs (pip install tensorboard)")
            kept = [r for r in ([report_to] if isinstance(report_to, str) else report_to) if r != "tensorboard"]
            argument_values["report_to"] = kept or "none"
    try:
        arguments = Seq2SeqTrainingArguments(**argument_values)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"run config {path}: {err}") from err
    return recipe, arguments


# ---- checkpoints ----


_RESUME_FILES = ("trainer_state.json", "optimizer.pt", "scheduler.pt")


def checkpoint_folders(run_dir: str | os.PathLike) -> list[Path]:
    """The Trainer's ``checkpoint-<step>`` folders of a run, oldest (lowest step) first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CheckpointError(f"run folder {run_dir} does not exist")
    found = [p for p in run_dir.iterdir() if p.is_dir() and re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.rsplit("-", 1)[1]))


def check_checkpoint(folder: str | os.PathLike, for_resume: bool = True) -> None:
    """Refuse a checkpoint folder that is incomplete or truncated, before the Trainer trips over it.

    Checks that the config parses, that ``model.safetensors`` has a readable header whose tensors fill
    the file exactly, and, ``for_resume``, that the trainer state parses and that the optimizer,
    scheduler and RNG files are complete zip archives (``torch.save``'s format; every member's CRC is read).
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} does not exist")
    needed = ["config.json", SAFE_WEIGHTS_NAME, *(_RESUME_FILES if for_resume else ())]
    missing = [name for name in needed if not (folder / name).is_file()]
    if for_resume and not any(folder.glob("rng_state*.pth")):
        missing.append("rng_state.pth")
    if missing:
        raise CheckpointError(f"checkpoint {folder} is incomplete: missing {', '.join(missing)}")
    for name in ("config.json", *(("trainer_state.json",) if for_resume else ())):
        try:
            json.loads((folder / name).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"checkpoint {folder}: {name} is corrupt ({err})") from None
    check_safetensors(folder / SAFE_WEIGHTS_NAME)
    if for_resume:
        for path in [folder / "optimizer.pt", folder / "scheduler.pt", *sorted(folder.glob("rng_state*.pth"))]:
            try:
                with zipfile.ZipFile(path) as archive:
                    bad = archive.testzip()
            except (zipfile.BadZipFile, OSError, EOFError) as err:
                raise CheckpointError(f"checkpoint {folder}: {path.name} is truncated or corrupt ({err})") from None
            if bad is not None:
                raise CheckpointError(f"checkpoint {folder}: {path.name} is corrupt (bad CRC in {bad})")


def _comparable_config(folder: Path) -> dict[str, Any]:
    values = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        values.pop(volatile, None)
    return values


def average_checkpoints(
    checkpoints: Sequence[str | os.PathLike], output_dir: str | os.PathLike
) -> Path:
    """Average the weights of several checkpoints into one model folder (Section 6.1).

    "For the base models, we used a single model obtained by averaging the last 5 checkpoints ...
    For the big models, we averaged the last 20 checkpoints." Each tensor is summed in float64 and
    divided by the count, then cast back to its dtype. The folder written holds the averaged
    ``model.safetensors``, the config and generation config of the last checkpoint, its tokenizer
    when it has one, the model's code files (``save_pretrained``) and ``averaged_from.json``.

    Raises:
        CheckpointError: fewer than one checkpoint, a truncated one, or checkpoints whose configs,
            tensor names, shapes or dtypes differ (each difference named).
    """
    from safetensors.torch import load_file

    from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration

    folders = [Path(c) for c in checkpoints]
    if not folders:
        raise CheckpointError("no checkpoints to average")
    for folder in folders:
        check_checkpoint(folder, for_resume=False)
    reference_config = _comparable_config(folders[0])
    for folder in folders[1:]:
        config = _comparable_config(folder)
        differ = sorted(k for k in reference_config.keys() | config.keys() if reference_config.get(k) != config.get(k))
        if differ:
            details = "; ".join(f"{k}: {reference_config.get(k)!r} vs {config.get(k)!r}" for k in differ)
            raise CheckpointError(f"cannot average {folders[0]} and {folder}: their configs differ ({details})")

    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for folder in folders:
        tensors = load_file(folder / SAFE_WEIGHTS_NAME)
        if not total:
            total = {name: tensor.to(torch.float64) for name, tensor in tensors.items()}
            dtypes = {name: tensor.dtype for name, tensor in tensors.items()}
            continue
        if tensors.keys() != total.keys():
            odd = sorted(tensors.keys() ^ total.keys())
            raise CheckpointError(f"cannot average: {folder} and {folders[0]} hold different tensors ({', '.join(odd[:5])})")
        for name, tensor in tensors.items():
            if tensor.shape != total[name].shape or tensor.dtype != dtypes[name]:
                raise CheckpointError(
                    f"cannot average: tensor {name} is {tuple(tensor.shape)} {tensor.dtype} in {folder} but "
                    f"{tuple(total[name].shape)} {dtypes[name]} in {folders[0]}"
                )
            total[name] += tensor.to(torch.float64)
    averaged = {name: (tensor / len(folders)).to(dtypes[name]) for name, tensor in total.items()}

    model = VaswaniForConditionalGeneration.from_pretrained(folders[-1])
    missing, unexpected = model.load_state_dict(averaged, strict=False)
    # save_pretrained stores a tied matrix once; its other names share that storage and need no tensor
    parameters = dict(model.named_parameters(remove_duplicate=False))
    stored = {parameters[name].data_ptr() for name in averaged if name in parameters}
    untied = [name for name in missing if name not in parameters or parameters[name].data_ptr() not in stored]
    if unexpected or untied:
        raise CheckpointError(f"averaged weights do not fit the model: missing {untied}, unexpected {unexpected}")
    output_dir = Path(output_dir)
    model.save_pretrained(output_dir)
    if (folders[-1] / "tokenizer.json").is_file():
        from vaswani_tx.tokenization import load_tokenizer

        load_tokenizer(folders[-1]).save_pretrained(output_dir)
    (output_dir / "averaged_from.json").write_text(
        json.dumps({"checkpoints": [str(f) for f in folders]}, indent=1) + "\n", encoding="utf-8"
    )
    return output_dir


# ---- curves ----


def plot_curves(log_history: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """A PNG of the training loss, the dev loss and the dev sacreBLEU against the optimizer step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(key: str) -> tuple[list[int], list[float]]:
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        return [p[0] for p in points], [p[1] for p in points]

    figure, (loss_axis, bleu_axis) = plt.subplots(1, 2, figsize=(11, 4))
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
    plt.close(figure)
    return path


# ---- the recipe ----


def _check_paths(recipe: RecipeConfig) -> None:
    keys = ["model_config", "dev_source", "dev_target"] + (["train_source", "train_target"] if recipe.train_source else [])
    for key in keys:
        value = getattr(recipe, key)
        if not Path(value).exists():
            raise ConfigError(f"{key}: {value} does not exist (paths are relative to {Path.cwd()})")


def _prepare_tokenizer(recipe: RecipeConfig, config, arguments: Seq2SeqTrainingArguments):
    from vaswani_tx.tokenization import check_tokenizer_matches_config, load_tokenizer, train_tokenizer

    folder = Path(recipe.tokenizer)
    with arguments.main_process_first(desc="tokenizer"):
        if not (folder / "tokenizer.json").is_file():
            if recipe.wmt14:
                raise ConfigError(f"tokenizer {folder} does not exist: create it first with `vaswani-tx train-tokenizer --wmt14 ...`")
            vocab_size = recipe.tokenizer_vocab_size or config.vocab_size
            logger.info("training a %s vocabulary of %d on %s and %s", recipe.tokenizer_kind, vocab_size,
                        recipe.train_source, recipe.train_target)
            tokenizer = train_tokenizer([recipe.train_source, recipe.train_target], recipe.tokenizer_kind,
                                        vocab_size, show_progress=False)
            tokenizer.save_pretrained(folder)
        tokenizer = load_tokenizer(folder)
    check_tokenizer_matches_config(tokenizer, config)
    return tokenizer


def _prepare_data(recipe: RecipeConfig, tokenizer, arguments: Seq2SeqTrainingArguments):
    from vaswani_tx import data

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


def resume_checkpoint(output_dir: str | os.PathLike, resume: bool) -> str | None:
    """The checkpoint to resume from: the last one when ``resume``; refuses to start over an existing run."""
    output_dir = Path(output_dir)
    existing = checkpoint_folders(output_dir) if output_dir.is_dir() else []
    if not resume:
        if existing:
            raise CheckpointError(
                f"{output_dir} already holds {existing[-1].name}: pass --resume to continue that run, "
                "or give another output_dir"
            )
        return None
    if not existing:
        logger.info("no checkpoint in %s: starting a new run", output_dir)
        return None
    # A run killed while writing a checkpoint leaves that one incomplete: fall back to the one before.
    problems = []
    for folder in reversed(existing):
        try:
            check_checkpoint(folder)
        except CheckpointError as err:
            logger.warning("skipping %s: %s", folder.name, err)
            problems.append(str(err))
            continue
        return str(folder)
    raise CheckpointError(f"no usable checkpoint in {output_dir} to resume from: {'; '.join(problems)}")


def _check_sampler_state(checkpoint: str, trainer: VaswaniTrainer) -> None:
    saved_file = Path(checkpoint) / SAMPLER_STATE_NAME
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text(encoding="utf-8"))
    sampler = TokenBudgetBatchSampler.from_dataset(
        trainer.train_dataset, trainer.max_tokens,
        seed=trainer.args.data_seed if trainer.args.data_seed is not None else trainer.args.seed,
        num_replicas=max(1, trainer.args.world_size), rank=trainer.args.process_index,
    ).state_dict()
    for key in ("seed", "max_tokens", "num_pairs", "num_replicas"):
        if saved[key] != sampler[key]:
            raise CheckpointError(
                f"cannot resume from {checkpoint}: it was trained with {key}={saved[key]}, this run has "
                f"{key}={sampler[key]} (the batch order would differ)"
            )


def train(recipe: RecipeConfig, arguments: Seq2SeqTrainingArguments, resume: bool = False) -> dict[str, Any]:
    """Run a recipe: tokenizer, data, model, :class:`VaswaniTrainer`; returns the final metrics.

    Writes to ``output_dir``: the checkpoints, the final model with its tokenizer, TensorBoard logs
    (when ``report_to`` asks and TensorBoard is installed), ``log_history.json`` and ``curves.png``.
    """
    from transformers import DataCollatorForSeq2Seq, set_seed

    from vaswani_tx.evaluation import make_compute_metrics
    from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
    from vaswani_tx.params import load_model_config

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
        compute_metrics=make_compute_metrics(tokenizer, target_lang=recipe.target_lang) if arguments.predict_with_generate else None,
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
        world, arguments.gradient_accumulation_steps, recipe.max_tokens,
        *(world * arguments.gradient_accumulation_steps * recipe.max_tokens,) * 2,
    )
    if checkpoint is not None:
        _check_sampler_state(checkpoint, trainer)
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
    from transformers import TrainerState

    from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration

    trainer.model.load_state_dict(VaswaniForConditionalGeneration.from_pretrained(checkpoint).state_dict())
    trainer.state = TrainerState.load_from_json(str(Path(checkpoint) / "trainer_state.json"))
    metrics = {"global_step": trainer.state.global_step, **_last_evaluation(trainer.state.log_history, trainer.state.global_step)}
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


# ---- cost ----


def training_flops(config, source_tokens: float, target_tokens: float, source_length: float, target_length: float) -> float:
    """Matrix-multiply FLOPs of one training step: forward and backward (3x forward), 2 FLOPs per multiply-add.

    Counts every projection, the feed-forward layers, the attention scores and weighted sums (which grow
    with ``source_length``/``target_length``, the mean padded sentence lengths) and the pre-softmax
    projection; embedding lookups, softmax, LayerNorm and the loss are element-wise and left out.
    ``tests/test_training.py`` checks it against ``torch.utils.flop_counter``. The paper gives no count
    of its own, only GPU time times an assumed sustained rate (Table 2: 3.3e18 base, 2.3e19 big).
    """
    d, d_ff, h, d_k, d_v = config.d_model, config.d_ff, config.num_heads, config.d_k, config.d_v
    projections = d * h * (2 * d_k + d_v) + h * d_v * d  # Q, K, V and the output projection, per token
    encoder = config.num_encoder_layers * (projections + 2 * d * d_ff + h * source_length * (d_k + d_v))
    decoder_per_target = config.num_decoder_layers * (
        projections + 2 * d * d_ff + h * target_length * (d_k + d_v)  # self-attention and feed-forward
        + d * h * d_k + h * d_v * d + h * source_length * (d_k + d_v)  # encoder-decoder attention: Q, O, scores
    ) + d * config.vocab_size
    decoder_per_source = config.num_decoder_layers * d * h * (d_k + d_v)  # its K and V, from the encoder output
    multiply_adds = source_tokens * (encoder + decoder_per_source) + target_tokens * decoder_per_target
    return 3 * 2 * multiply_adds
