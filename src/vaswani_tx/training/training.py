"""The paper's training procedure (Section 5) on ``Seq2SeqTrainer``: batches, schedule, loss, trainer.

- :class:`TokenBudgetSeq2SeqTrainer` batches by tokens instead of sentences (Section 5.1: "each training
  batch contained ... approximately 25000 source tokens and 25000 target tokens").
- :func:`get_paper_schedule` is the learning rate of Section 5.3 (equation 3); :func:`label_smoothed_loss`
  the label smoothing of Section 5.4; :class:`VaswaniTrainer` puts both, Adam (0.9, 0.98, 1e-9) and the
  token budget together.

A run config is ``vaswani_tx.training.run_config``, the run itself ``vaswani_tx.training.recipe``; checkpoints, resuming and averaging
(Section 6.1) are ``vaswani_tx.training.checkpoints``; decoding a saved model is ``vaswani_tx.engine.translation``.

Departures, each for a stated reason: the schedule is evaluated at ``updates_done + 1`` so the first
update uses step 1 (a plain ``LambdaLR`` would use step 0, rate 0); the loss is normalised by the
target tokens of the whole optimizer step rather than per batch, so accumulation and data parallelism
equal one large batch; smoothing spreads ``epsilon`` over the whole vocabulary (Szegedy et al., the
paper's reference [36]) rather than over the ``V - 1`` wrong tokens as tensor2tensor does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import inspect
import json
import shutil
from functools import partial
from pathlib import Path

import datasets
import torch
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader
from transformers import Seq2SeqTrainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints, seed_worker

from vaswani_tx.data.data import TokenBudgetBatchSampler
from vaswani_tx.folders import failed_write
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.training.checkpoints import (
    SAMPLER_STATE_NAME,
    complete_checkpoints,
    publish_checkpoint,
    remove_interrupted_saves,
    staging_folder,
)


class TokenBudgetSeq2SeqTrainer(Seq2SeqTrainer):
    """A ``Seq2SeqTrainer`` whose batches hold at most ``max_tokens`` source and target tokens each.

    Training batches come from :class:`~vaswani_tx.data.data.TokenBudgetBatchSampler` (shuffled per epoch
    from ``args.data_seed`` or ``args.seed``, one disjoint equal share per process); evaluation
    batches, when ``eval_max_tokens`` is given, are length-sorted under that budget without shuffling,
    which wastes the least padding. ``per_device_*_batch_size`` is then unused. ``predict`` keeps
    the sentence-count batches so that its outputs stay in dataset order. Works with any seq2seq model
    whose dataset has ``input_ids`` and ``labels`` columns.

    Checkpoints are built beside their names and moved in whole, with the sampler's state (`_save_checkpoint`).

    Per-device budget: with ``P`` processes and ``G`` gradient-accumulation steps an optimizer step
    sees up to ``P * G * max_tokens`` tokens per side; the paper's 25,000 on 8 GPUs is about 3,125 each.
    """

    def __init__(self, *args, max_tokens: int, eval_max_tokens: int | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if max_tokens <= 0:
            raise UserInputError(f"max_tokens must be a positive number of tokens per batch, got {max_tokens!r}")
        self.max_tokens = max_tokens
        self.eval_max_tokens = eval_max_tokens
        self.train_sampler: TokenBudgetBatchSampler | None = None
        self._staging: Path | None = None  # while a checkpoint is saved: where (see _save_checkpoint)

    def train_sampler_state(self) -> dict[str, int] | None:
        """The training sampler's ``state_dict()``, or ``None`` before training built it."""
        return None if self.train_sampler is None else self.train_sampler.state_dict()

    def _token_budget_dataloader(
        self, dataset: datasets.Dataset, max_tokens: int, description: str, shuffle: bool
    ) -> DataLoader:
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
            # training batches split alike for P processes and for one accumulating P batches (the same steps)
            accumulation=self.args.gradient_accumulation_steps if shuffle else 1,
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
            worker_init_fn=partial(
                seed_worker, num_workers=self.args.dataloader_num_workers, rank=self.args.process_index
            ),
        )
        dataloader = self.accelerator.prepare(dataloader)
        # The sampler already gives each process its share; accelerate's BatchSamplerShard would shard
        # it again, so make that wrapper a passthrough (as Trainer does for BatchRebalanceSampler).
        wrapper = getattr(dataloader, "batch_sampler", None)
        if wrapper is not None and getattr(wrapper, "batch_sampler", None) is sampler:
            wrapper.num_processes, wrapper.process_index = 1, 0
        return dataloader

    # ---- checkpoints written whole ----

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, built beside its name and moved there whole once every file is written.

        transformers 5.25 writes ``checkpoint-<step>`` in place, file by file, so a run stopped meanwhile leaves a
        folder with a checkpoint's name and part of its files, and it has no public hook between writing the files
        and naming the folder. (It staged checkpoints before and dropped it: a process renamed the folder while
        others still wrote into it, transformers#27925, #36076.) This override and `_get_output_dir`, which points
        the Trainer's own save at the staging folder while it runs, are the only private overrides here.

        Every process writes its files into ``.checkpoint-<step>.partial`` (`staging_folder`, one name for all);
        once all have, the process that saves (`should_save`) adds the sampler state, moves the folder to its name
        (`publish_checkpoint`) and applies ``save_total_limit`` (the Trainer's rotation saw the staging folder
        only). On any failure the staging folder goes; a write that failed is raised as the ``OSError`` naming its
        file and cause (`failed_write`).
        """
        run_dir = Path(super()._get_output_dir(trial))
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        staging, saves = staging_folder(run_dir, self.state.global_step), self.args.should_save
        if saves:
            remove_interrupted_saves(run_dir)  # what a killed save left, this step's included
        self.accelerator.wait_for_everyone()  # no process writes into a folder still being removed
        self._staging = staging
        try:
            super()._save_checkpoint(model, trial)
            self.accelerator.wait_for_everyone()  # every process's files (its RNG state) are in
            if saves:
                self._publish(staging / name, run_dir / name)
        except BaseException as err:
            found = failed_write(err, staging) if isinstance(err, Exception) and staging.is_dir() else None
            if saves:
                shutil.rmtree(staging, ignore_errors=True)
            if found is None:
                raise
            number, file, cause = found
            shown = run_dir / name / file.relative_to(staging / name) if file.is_relative_to(staging / name) else file
            complete = complete_checkpoints(run_dir, warn=lambda line: None, for_resume=True)
            last = f"the last complete one is {complete[-1].name}" if complete else "there is no complete one yet"
            raise OSError(number, f"{cause}; {name} was not written ({last})", str(shown)) from err
        finally:
            self._staging = None

    def _get_output_dir(self, trial) -> str:
        return str(self._staging) if self._staging is not None else super()._get_output_dir(trial)

    def _publish(self, built: Path, final: Path) -> None:
        # the sampler state lets a resume refuse other data, seed or budget, which would replay another batch order
        sampler = self.train_sampler_state()
        if sampler is not None:
            (built / SAMPLER_STATE_NAME).write_text(json.dumps(sampler, indent=1) + "\n", encoding="utf-8")
        best = self.state.best_model_checkpoint
        if best is not None and Path(best).parent == built.parent:  # the Trainer named the staged folder
            self.state.best_model_checkpoint = str(final)
            self.state.save_to_json(str(built / TRAINER_STATE_NAME))
        publish_checkpoint(built, final)
        shutil.rmtree(built.parent)
        rotate_checkpoints(
            output_dir=str(final.parent),
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,  # as the Trainer rotates
        )

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
        raise UserInputError(f"warmup_steps must be >= 1, got {warmup_steps}")
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


def check_smoothing(epsilon: float, name: str = "label smoothing epsilon") -> float:
    """`epsilon` if it is a label smoothing value (Section 5.4's epsilon_ls, in [0, 1)); else a UserInputError naming
    it as `name`."""
    if not 0.0 <= epsilon < 1.0:
        raise UserInputError(f"{name} must be in [0, 1), got {epsilon}")
    return epsilon


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
    check_smoothing(epsilon)
    keep = labels.ne(ignore_index)  # (B, T)
    # Only labelled rows: the softmax over V at padded positions would be computed only to be thrown away.
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
        self.epsilon = check_smoothing(epsilon)

    def __call__(self, outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        return label_smoothed_loss(logits, labels.to(logits.device), self.epsilon, num_items_in_batch)


# ---- the Trainer ----


def _glibc_malloc_trim():
    """glibc's `malloc_trim`, or None where the C library is not glibc (macOS, musl, Windows)."""
    return _glibc_function("malloc_trim", [ctypes.c_size_t])


def _glibc_mallopt():
    """glibc's `mallopt`, or None where the C library is not glibc."""
    return _glibc_function("mallopt", [ctypes.c_int, ctypes.c_int])


def _glibc_function(name: str, argtypes: list):
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        function = getattr(libc, name)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: mallopt's parameter numbers are glibc's)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, ctypes.c_int
    return function


# mallopt's parameters and glibc's defaults for them (malloc.h, malloc/malloc.c)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
DEFAULT_TRIM_THRESHOLD, DEFAULT_MMAP_MAX = 128 * 1024, 65536
KEEP_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int: no automatic trimming below 2 GB at the heap's top


class ReturnFreedMemory(TrainerCallback):
    """For a command that owns its process, never added by the library (glibc's settings are process-wide):
    glibc's allocator for a CPU training run (under glibc): every buffer from its heaps, none from a fresh
    mapping, while the run trains; and the memory the heaps hold free handed back to the system every `every`
    steps and after each evaluation (`malloc_trim`).

    Fresh mappings: glibc serves a request above its mmap threshold (at most 32 MB) with a mapping of its own,
    unmapped again when freed, so every step's large tensors (the logits and the loss's buffers of 2,048 x 8,000,
    65 MB each in float32) fault all their pages in afresh: 88,000 page faults a step in the Multi30k recipe on
    2 cores (`/usr/bin/time`: 514 million in a full run, 1,061 s of system time against 5,085 s of user time).
    While training, `mallopt` turns glibc's mappings off (`M_MMAP_MAX` 0) and its automatic trimming of the
    heap's top (`M_TRIM_THRESHOLD`), so freed buffers are reused as they are; at the end of training both take
    glibc's default values again. One thing does not come back: setting either with `mallopt` ends glibc's dynamic
    mmap threshold (raised to the size of each mapped buffer freed) for the rest of the process, so a later large
    buffer is mapped afresh whatever came before (more page faults, less memory held). The first 400 steps of the recipe: 167.6 against 201.0 s (system time 18 against 69 s,
    8.3 against 35.9 million page faults, peak resident memory 1.75 against 1.50 GB). A full run of the recipe on an AMD EPYC kept
    its faults down but was not faster: its steps slow down as it goes for another reason (docs/training.md).

    Trimming: token-budget batches change shape every step, and glibc keeps the freed buffers of past shapes in
    its heaps, fragmented, instead of returning them. The Multi30k recipe (2 cores, bf16) grew to 3.4 GB resident
    in its first 400 steps and still growing (a long lever run reached 4.8 GB); trimmed every 10 steps it stays at
    2.0-2.4 GB from step 100 on (every 50: 2.5-2.8 GB and rising), 1.7-2.8 GB over 1,450 steps of a full run, in
    the same time within the runs' noise (279 against 272-276 s for 400 steps; a call takes about 50 ms). Only
    free memory is returned: no effect on the results. (A long run's steps slowing down had another cause, the
    number of matrix shapes under bf16: docs/training.md, "Steps that slow down".)"""

    def __init__(self, every: int = 10):
        self.every = every
        self.trim = _glibc_malloc_trim()
        self.mallopt = _glibc_mallopt()

    def _applies(self, args) -> bool:
        return args.device.type == "cpu"

    def _trim(self, args) -> None:
        if self.trim is not None and self._applies(args):
            self.trim(0)

    def on_train_begin(self, args, state, control, **kwargs):
        if self.mallopt is not None and self._applies(args):
            self.mallopt(M_MMAP_MAX, 0)
            self.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD)
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self.mallopt is not None and self._applies(args):
            self.mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX)
            self.mallopt(M_TRIM_THRESHOLD, DEFAULT_TRIM_THRESHOLD)
            self._trim(args)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self._trim(args)
        return control

    def on_evaluate(self, args, state, control, **kwargs):
        self._trim(args)
        return control


def takes_label_smoothing(model) -> bool:
    """Whether `model`'s forward computes a label-smoothed loss itself (an `epsilon_ls` argument, as ours)."""
    model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper
    forward = getattr(model, "forward", None)
    return forward is not None and "epsilon_ls" in inspect.signature(forward).parameters


class VaswaniTrainer(TokenBudgetSeq2SeqTrainer):
    """Section 5 on ``Seq2SeqTrainer``: token-budget batches, the paper's schedule, label smoothing.

    - Optimizer: the Trainer's own, from ``optim``/``adam_beta1``/``adam_beta2``/``adam_epsilon``/
      ``weight_decay``; the configs set Adam with beta1 0.9, beta2 0.98, eps 1e-9 and no weight decay
      (``adamw_torch`` with ``weight_decay: 0`` is Adam), as Section 5.3.
    - Schedule: :func:`get_paper_schedule` with ``warmup_steps`` (must be a whole number of steps)
      and the model's ``d_model``; ``lr_scheduler_type`` must say ``inverse_sqrt``, the family it
      belongs to, so that a config asking for another schedule fails instead of being ignored.
    - Loss: cross-entropy against targets smoothed by ``label_smoothing_factor`` over non-pad target
      tokens, normalised by the optimizer step's token count (so accumulation and several processes
      equal one large batch); with ``label_smoothing_factor: 0`` it is plain token-level cross-entropy.
      Our model computes it in its forward (``epsilon_ls``, ``num_items_in_batch``) from the logits of
      labelled positions only; another model's logits go through :class:`LabelSmoothedCrossEntropy`, the
      same loss, as does any ``compute_loss_func`` given.
    - No gradient clipping unless ``max_grad_norm`` > 0 (the paper has none; the configs set 0).
    - It changes nothing outside itself: :class:`ReturnFreedMemory`, which tunes glibc's allocator for the whole
      process, is added by the commands (`vaswani-tx train`, `vaswani-tx parse run`), which own their process.
    """

    def __init__(self, *args, **kwargs) -> None:
        training_args = kwargs.get("args") if "args" in kwargs else args[1]
        if str(getattr(training_args.lr_scheduler_type, "value", training_args.lr_scheduler_type)) != "inverse_sqrt":
            raise UserInputError(
                f"lr_scheduler_type={training_args.lr_scheduler_type!r}: VaswaniTrainer always uses the paper's "
                "inverse-square-root schedule (Section 5.3); set lr_scheduler_type: inverse_sqrt"
            )
        warmup = training_args.warmup_steps
        if warmup < 1 or warmup != int(warmup):
            raise UserInputError(f"warmup_steps must be a whole number of steps >= 1 (the paper's 4000), got {warmup}")
        epsilon = training_args.label_smoothing_factor
        check_smoothing(epsilon, "label_smoothing_factor")
        model = kwargs.get("model", args[0] if args else None)
        # A model whose forward smooths its own loss (ours) computes it from the logits of labelled positions only,
        # and keeps the labels, so it also skips the targets' padding; any other model gets the loss on its logits.
        self.loss_in_model = "compute_loss_func" not in kwargs and takes_label_smoothing(model)
        if not self.loss_in_model:
            kwargs.setdefault("compute_loss_func", LabelSmoothedCrossEntropy(epsilon))
        super().__init__(*args, **kwargs)
        # The Trainer builds its own LabelSmoother from label_smoothing_factor; ours replaces it.
        self.label_smoother = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.loss_in_model and "labels" in inputs:
            inputs = {**inputs, "epsilon_ls": self.args.label_smoothing_factor}
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
        if self.lr_scheduler is None:
            optimizer = self.optimizer if optimizer is None else optimizer
            d_model = self.accelerator.unwrap_model(self.model).config.d_model
            self.lr_scheduler = get_paper_schedule(optimizer, d_model, int(self.args.warmup_steps))
            self._created_lr_scheduler = True
        return self.lr_scheduler
