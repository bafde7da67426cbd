"""The run: a resumable training run from a run config (Section 5), and its curves.

- :func:`train` runs a recipe (a :class:`~vaswani_tx.training.run_config.RecipeConfig` and the Trainer's arguments,
  from :func:`~vaswani_tx.training.run_config.load_run_config`): the tokenizer (trained when missing), the cleaned data,
  the model, and :class:`~vaswani_tx.training.training.VaswaniTrainer` with the checkpoint callbacks of
  ``vaswani_tx.training.checkpoints``; ``--resume`` continues from the last good checkpoint.
- :func:`set_generation_defaults` stores the run config's decoding settings in the model;
  :func:`plot_curves` draws the training and dev curves (``curves.png``).

A run of another task on the same model (the parser: ``vaswani_tx.parsing.parse_run``) passes in its callbacks and the
generation fields its decoding reads, so that the run stays the translation recipe's, with no parser field in it.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from matplotlib.figure import Figure
from transformers import (
    DataCollatorForSeq2Seq,
    Seq2SeqTrainingArguments,
    TrainerCallback,
    TrainerState,
    set_seed,
)

from vaswani_tx.atomic import atomic_file, atomic_folder
from vaswani_tx.data import data
from vaswani_tx.data.multi30k import provide_multi30k
from vaswani_tx.data.tokenization import (
    check_tokenizer_fits_model,
    load_tokenizer,
    train_tokenizer,
    vocabulary_fingerprint,
)
from vaswani_tx.engine.precision import training_attention
from vaswani_tx.folders import RunLock, check_writable, naming_failed_writes
from vaswani_tx.metrics.evaluation import make_compute_metrics
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.training.checkpoints import (
    TimedCheckpointCallback,
    TrainingClock,
    average_last_checkpoints,
    check_resume_config,
    check_sampler_state,
    complete_checkpoints,
    refuse_earlier_run,
    remove_earlier_results,
    remove_interrupted_saves,
    replaced_average,
    resume_checkpoint,
)
from vaswani_tx.training.params import load_model_config
from vaswani_tx.training.run_config import ConfigError, RecipeConfig, check_paths
from vaswani_tx.training.training import VaswaniTrainer

logger = logging.getLogger(__name__)


# ---- the run ----


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
            with atomic_folder(folder, merge=True) as partial:  # a run stopped here leaves no half tokenizer
                tokenizer.save_pretrained(partial)
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
                pairs = data.load_wmt14(
                    source_lang, target_lang, "train", local_files="train_source and train_target in the run config"
                )
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


def accelerate_flag(name: str) -> bool:
    """A yes/no setting `accelerate launch` passes its processes in the environment ("true"/"false")."""
    return os.environ.get(name, "false").lower() == "true"


def refuse_fsdp_sync_on_cpu(arguments) -> None:
    """An accelerate FSDP config with `fsdp_sync_module_states` (the repository's fsdp-8gpu.yaml) on the CPU, refused
    before any work: its parameters are initialised on an accelerator, and accelerate 1.16 raises a RuntimeError at
    the Trainer's start (1.15: "no available devices found"), after the tokenizer and data are made. Off, accelerate
    runs the processes as DDP there (`train` says so)."""
    if not accelerate_flag("ACCELERATE_USE_FSDP") or not accelerate_flag("FSDP_SYNC_MODULE_STATES"):
        return
    if arguments.use_cpu or not torch.accelerator.is_available():
        raise UserInputError(
            "the accelerate config asks for FSDP with fsdp_sync_module_states, which initialises the parameters on "
            "a GPU or other accelerator, and this run is on the CPU: set fsdp_sync_module_states: false in the "
            "config or pass `accelerate launch --fsdp_sync_module_states false` (on the CPU accelerate then runs DDP)"
        )


def train(
    recipe: RecipeConfig,
    arguments: Seq2SeqTrainingArguments,
    resume: bool = False,
    callbacks: Sequence[TrainerCallback] = (),
    generation_fields: Sequence[str] = (),
    force: bool = False,
) -> dict[str, Any]:
    """Run a recipe: tokenizer, data, model, :class:`VaswaniTrainer`; returns the final metrics.

    Writes to ``output_dir``: the checkpoints, the final model with its tokenizer, TensorBoard logs
    (when ``report_to`` asks and TensorBoard is installed), ``log_history.json`` and ``curves.png``; with
    ``callbacks`` are added to the Trainer's (the parser's dev F1, for one). ``generation_fields`` are keys the
    run config's ``generation:`` block may hold beyond ``GenerationConfig``'s (see
    :func:`set_generation_defaults`). With
    ``average_last`` > 1, the average of that many last complete checkpoints (Section 6.1; fewer when fewer
    were written) in ``output_dir/averaged``, rebuilt whenever `train` ends (a ``--resume`` of a finished
    run included) and put in place whole once complete: an ``averaged/`` already holding this exact average
    stays as it is (with the scores written beside it); one of other checkpoints is replaced whole. The metrics
    give its path as ``averaged`` and the checkpoints as ``averaged_from``.

    With ``multi30k``, the data are provided first: the local copy, or the Hub's downloaded into the clone
    (:func:`~vaswani_tx.data.multi30k.provide_multi30k`).

    A new run (nothing to resume) in an ``output_dir`` holding another run's results is refused unless
    ``force`` (`refuse_earlier_run`); with ``force`` they are replaced once this run has finished.

    The main process holds ``output_dir``'s :class:`~vaswani_tx.folders.RunLock` throughout: a second run on
    the same folder is refused (:class:`~vaswani_tx.folders.RunLockError`, naming the holder's PID).
    """
    if recipe.multi30k:
        # the local copy, or the Hub's written into the clone once (by the main process; the others wait): a
        # machine with neither stops here, before the tokenizer or any training
        with arguments.main_process_first(desc="Multi30k"):
            provide_multi30k()
    check_paths(recipe)
    check_writable(arguments.output_dir)  # a read-only output_dir is found before any data is read
    if arguments.process_index != 0:
        return _train(recipe, arguments, resume, callbacks, generation_fields, force)
    with RunLock(arguments.output_dir) as lock:
        if lock.took_over is not None:
            logger.warning("took over the lock of a run that is gone: %s", lock.took_over)
        remove_interrupted_saves(arguments.output_dir)
        earlier = refuse_earlier_run(recipe, arguments, force)
        metrics = _train(recipe, arguments, resume, callbacks, generation_fields, force)
        if recipe.average_last > 1 and complete_checkpoints(arguments.output_dir):
            averaged = Path(arguments.output_dir) / "averaged"
            stat = averaged.lstat() if averaged.is_dir() else None
            names_before = sorted(path.name for path in averaged.iterdir()) if stat else []
            averaged, chosen = average_last_checkpoints(arguments.output_dir, recipe.average_last)
            replaced_average(averaged, stat and (stat.st_ino, stat.st_mtime_ns), names_before)
            logger.info("averaged %s into %s (average_last, Section 6.1)", ", ".join(c.name for c in chosen), averaged)
            metrics["averaged"], metrics["averaged_from"] = str(averaged), [c.name for c in chosen]
        remove_earlier_results(arguments.output_dir, earlier)
        return metrics


def _train(
    recipe: RecipeConfig,
    arguments: Seq2SeqTrainingArguments,
    resume: bool,
    extra_callbacks: Sequence[TrainerCallback],
    generation_fields: Sequence[str],
    force: bool,
) -> dict[str, Any]:
    refuse_earlier_run(recipe, arguments, force)  # every process, so that all refuse together
    refuse_fsdp_sync_on_cpu(arguments)
    checkpoint = resume_checkpoint(arguments.output_dir, resume)
    config = load_model_config(recipe.model_config)
    if checkpoint is not None:  # the model's sizes before any work; its vocabulary once the tokenizer is read
        check_resume_config(checkpoint, config, recipe.model_config)
    tokenizer = _prepare_tokenizer(recipe, config, arguments)
    if checkpoint is not None:
        check_resume_config(checkpoint, config, f"{recipe.model_config} and tokenizer {recipe.tokenizer}")
    train_set, dev_set = _prepare_data(recipe, tokenizer, arguments)

    set_seed(arguments.seed)  # the initial weights; the Trainer reseeds for the data order and dropout
    model = VaswaniForConditionalGeneration(config)
    attention, why = training_attention(recipe.attn_implementation)
    model.set_attn_implementation(attention)  # for this run only: not saved with the model
    logger.info("attn_implementation: %s -> %s (%s)", recipe.attn_implementation, attention, why)
    if recipe.generation:
        set_generation_defaults(model, recipe.generation, generation_fields)
    # Lengths padded to a multiple of 8 (the token budget counts that padding): with the rows skip_padding rounds
    # (ROWS_MULTIPLE_BF16_CPU), a bounded set of matrix shapes; under CPU bf16 a process that meets ever new ones
    # slows down step after step (docs/training.md). GPUs' tensor cores also prefer multiples of 8.
    collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100, pad_to_multiple_of=8)
    callbacks = [TimedCheckpointCallback(recipe.save_minutes)] if recipe.save_minutes else []
    if not any(isinstance(c, TrainingClock) for c in extra_callbacks):  # the parser's F1 callback is one
        callbacks.append(TrainingClock())
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
    if accelerate_flag("ACCELERATE_USE_FSDP") and not trainer.is_fsdp_enabled:
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


def end_distributed() -> None:
    """Leave the process group ``accelerate launch`` set up, if any, before the process exits: a gloo group
    left to the interpreter's exit can abort it ("terminate called without an active exception")."""
    import torch.distributed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def set_generation_defaults(model, values: dict[str, Any], extra_fields: Sequence[str] = ()) -> None:
    """Replace fields of ``model.generation_config`` (the run config's ``generation:`` block); ``extra_fields``
    are the keys, beyond ``GenerationConfig``'s own, that a task's decoding reads from it (the parser's
    ``tree_leaves``: ``vaswani_tx.parsing.parse_run``).

    Checkpoints and the final model save it, so ``generate()`` and ``vaswani-tx translate`` decode with
    these defaults unchanged (e.g. Section 6.3's beam 21, alpha 0.3, input length + 300).

    Raises:
        ConfigError: a key that is neither a field of the model's generation config nor in ``extra_fields``,
            or invalid values.
    """
    generation_config = model.generation_config
    unknown = sorted(key for key in values if not hasattr(generation_config, key) and key not in extra_fields)
    if unknown:
        raise ConfigError(f"generation: {', '.join(unknown)} not a field of the model's GenerationConfig")
    unused = generation_config.update(**values)  # sets only the fields the config already has ...
    for key, value in unused.items():  # ... and returns the extra ones, set here
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
    """The final model and tokenizer in ``output_dir``, with ``log_history.json`` and ``curves.png``: written
    beside it and moved in, each file whole, so a run stopped while saving leaves the earlier files."""
    if not trainer.args.should_save:
        trainer.save_model()  # a process that writes nothing (it may take part in gathering the weights)
        return
    with atomic_folder(trainer.args.output_dir, merge=True) as partial, naming_failed_writes(partial):
        trainer.save_model(str(partial))
        if trainer.is_world_process_zero():
            history = trainer.state.log_history
            (partial / "log_history.json").write_text(json.dumps(history, indent=1) + "\n", encoding="utf-8")
            plot_curves(history, partial / "curves.png")


# ---- curves ----


def _interpolate(xs: Sequence[float], ys: Sequence[float]):
    """x -> y along the points (xs, ys), linear between them and continued along the end segments beyond them
    (a secondary axis' scale: matplotlib asks for values outside the points, and they must stay finite)."""
    import numpy as np

    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)

    def convert(values):
        values = np.asarray(values, dtype=float)
        if len(xs) < 2 or xs[-1] == xs[0]:
            return values
        first = (ys[1] - ys[0]) / (xs[1] - xs[0]) if xs[1] != xs[0] else 0.0
        last = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if xs[-1] != xs[-2] else 0.0
        inside = np.interp(values, xs, ys)
        below = ys[0] + (values - xs[0]) * first
        above = ys[-1] + (values - xs[-1]) * last
        return np.where(values < xs[0], below, np.where(values > xs[-1], above, inside))

    return convert


def plot_curves(log_history: Sequence[dict[str, Any]], path: str | os.PathLike) -> Path:
    """A PNG of the training and dev loss against the optimizer step, the dev sacreBLEU against training
    minutes (with the step on the upper axis; against the step for a history without minutes), and, for a
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
    # With generation (BLEU logged) Seq2SeqTrainer's dev loss is the model's plain cross-entropy; without, the
    # Trainer's loss, smoothed as in training.
    dev_loss = "dev loss (cross-entropy)" if bleu else "dev loss (label-smoothed)"
    for key, label in (("loss", "training loss (label-smoothed)"), ("eval_loss", dev_loss)):
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
        minutes = [e["train_minutes"] for e in log_history if "eval_sacrebleu" in e and "train_minutes" in e]
        if bleu and len(minutes) == len(bleu):  # against the clock: what a run within the hour reaches when
            bleu_axis.plot(minutes, bleu, marker="o", color="tab:green")
            bleu_axis.set_xlabel("training minutes (wall clock, evaluations included)")
            top = bleu_axis.secondary_xaxis(
                "top", functions=(_interpolate(minutes, bleu_steps), _interpolate(bleu_steps, minutes))
            )
            top.set_xlabel("optimizer step")
        else:  # a history from before the minutes were logged
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
    with atomic_file(path) as partial:
        figure.savefig(partial, dpi=100, format=path.suffix.lstrip(".") or "png")
    return path
