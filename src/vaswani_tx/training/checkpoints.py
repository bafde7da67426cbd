"""Checkpoints: refusing a bad one, resuming a run from the last good one, averaging several (Section 6.1).

- :class:`CheckpointError` and :func:`check_safetensors` (vaswani_tx.folders's, where the translator finds them too)
  refuse a truncated or corrupt model folder.
- :func:`checkpoint_folders` lists a run's ``checkpoint-<step>`` folders, :func:`check_checkpoint`
  refuses an incomplete one, :func:`resume_checkpoint` picks the one to resume from.
- :func:`staging_folder` and :func:`publish_checkpoint` build each checkpoint beside its name and move it in
  whole (the trainer's save, ``vaswani_tx.training.training``), so that a ``checkpoint-<step>`` folder is always
  complete; :func:`remove_interrupted_saves` clears what a killed save left.
- :func:`check_resume_config` refuses a resume whose model config differs from the checkpoint's, and
  :func:`check_sampler_state` one whose data order would differ from the sampler state each checkpoint holds;
  :class:`TimedCheckpointCallback` also saves every few minutes (the paper: every 10 minutes, Section 6.1).
- :func:`average_checkpoints` averages the weights of the last checkpoints (Section 6.1: the last 5 for
  the base models, the last 20 for the big ones).

It imports neither the Trainer nor datasets, so that the translator, which needs only the first two
names, does not load them.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import SAFE_WEIGHTS_NAME

from vaswani_tx.atomic import atomic_folder
from vaswani_tx.data.tokenization import check_tokenizer_fits_model, load_tokenizer
from vaswani_tx.folders import CheckpointError, check_safetensors, folder_kind
from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.training.run_config import ConfigError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, Seq2SeqTrainingArguments

    from vaswani_tx.training.run_config import RecipeConfig

logger = logging.getLogger(__name__)


# ---- a run's checkpoint folders ----


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


def resume_checkpoint(output_dir: str | os.PathLike, resume: bool) -> str | None:
    """The checkpoint to resume from: the last complete one when ``resume`` (None: a new run; unusable checkpoint
    folders are then renamed ``incomplete-checkpoint-N``, their files kept); refuses to start over an existing run."""
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
    # Saves move checkpoints in whole (publish_checkpoint); one damaged since, or left half written by a version
    # that wrote in place, is skipped for the one before.
    problems = []
    for folder in reversed(existing):
        try:
            check_checkpoint(folder)
        except CheckpointError as err:
            logger.warning("skipping %s: %s", folder.name, err)
            problems.append(str(err))
            continue
        return str(folder)
    # No complete checkpoint: a new run, as --resume promises. The unusable folders keep their files under another
    # name, so that nothing is lost and no later average or rotation takes them for this run's checkpoints.
    for folder in existing:
        aside = folder.with_name(f"incomplete-{folder.name}")
        while aside.exists():
            aside = aside.with_name(aside.name + "+")
        try:
            folder.rename(aside)
        except FileNotFoundError:  # another process of this run moved it first
            continue
        logger.warning("moved %s, which cannot be resumed, to %s", folder.name, aside.name)
    logger.warning("no complete checkpoint in %s (%s): starting a new run", output_dir, "; ".join(problems))
    return None


# ---- a checkpoint written whole ----

_INTERRUPTED_SAVE = f".{PREFIX_CHECKPOINT_DIR}-*.partial"  # staging_folder's, and atomic_folder's beside a checkpoint


def staging_folder(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` is built before it takes its name: ``.checkpoint-<step>.partial`` in the
    run folder (hidden, so that nothing takes it for a run's result; the same name in every process, which all
    write their files there)."""
    return Path(run_dir) / f".{PREFIX_CHECKPOINT_DIR}-{step}.partial"


def remove_interrupted_saves(run_dir: str | os.PathLike) -> None:
    """Remove what saves that were interrupted (a kill, a power cut) left in ``run_dir``, with a line for each:
    never a checkpoint, since a checkpoint takes its name only once complete."""
    for folder in sorted(Path(run_dir).glob(_INTERRUPTED_SAVE)):
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("removed %s, left by a checkpoint save that was interrupted", folder)


def publish_checkpoint(built: str | os.PathLike, final: str | os.PathLike) -> None:
    """Move the complete checkpoint folder ``built`` to its name ``final``, its files on disk first (``atomic_folder``:
    a power cut after the move finds them whole). A folder already at ``final`` is replaced whole: the same step
    saved again by a run resumed from an earlier checkpoint, the later one having been unusable."""
    built, final = Path(built), Path(final)
    if final.exists():
        logger.warning("replacing %s with the checkpoint of the same step this run has just written", final)
    with atomic_folder(final) as temporary:
        for entry in built.iterdir():
            os.rename(entry, temporary / entry.name)


# ---- a resume with the run's own model ----

# what config.json holds besides the model
_NOT_THE_MODEL = frozenset(
    ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures")  # saving's records
    + ("auto_map", "custom_pipelines")  # the code files saved beside the weights
    + ("use_cache",)  # the Trainer turns it off to train
)


def check_resume_config(checkpoint: str | os.PathLike, config: PretrainedConfig, source: str = "model_config") -> None:
    """Refuse to resume from ``checkpoint`` with a model config other than the one it was trained with (the
    Trainer would fail on the weights' shapes, or go on with another model than the one the checkpoints hold,
    which averaging then refuses). ``config`` is the config the run builds (from ``source``); its
    ``tokenizer_fingerprint`` is compared once it is set (the vocabulary).

    Raises:
        CheckpointError: each field that differs, with its value in the checkpoint and in this run.
    """
    saved = json.loads((Path(checkpoint) / "config.json").read_text(encoding="utf-8"))
    ours = json.loads(config.to_json_string(use_diff=True))  # as save_pretrained writes it
    differ = [
        key
        for key in sorted(saved.keys() | ours.keys())
        if key not in _NOT_THE_MODEL
        and saved.get(key) != ours.get(key)
        and not (key == "tokenizer_fingerprint" and None in (saved.get(key), ours.get(key)))
    ]
    if differ:
        name = Path(checkpoint).name
        details = "; ".join(f"{key}: {saved.get(key)!r} in {name}, {ours.get(key)!r} in this run" for key in differ)
        raise CheckpointError(
            f"cannot resume from {checkpoint}: this run's model ({source}) differs from the one its checkpoints "
            f"hold ({details}); nothing was changed: give the config (and tokenizer) the run was started with, or "
            "another output_dir for a new run"
        )


# ---- the data order across a resume ----


SAMPLER_STATE_NAME = "sampler_state.json"


def check_sampler_state(checkpoint: str | os.PathLike, run_state: Callable[[], Mapping[str, int]]) -> None:
    """Refuse to resume from ``checkpoint`` when the sampler state it saved differs from this run's.

    ``run_state`` returns the ``state_dict()`` of the training sampler this run would build; it is called
    only when the checkpoint holds a ``sampler_state.json`` (see :class:`SamplerStateCallback`), since
    building a sampler reads the lengths of the whole training set.

    Raises:
        CheckpointError: a seed, ``max_tokens``, number of pairs or of processes that differs (the batch
            order would differ), naming it with both values.
    """
    saved_file = Path(checkpoint) / SAMPLER_STATE_NAME
    if not saved_file.is_file():
        return
    saved = json.loads(saved_file.read_text(encoding="utf-8"))
    sampler = run_state()
    for key in ("seed", "max_tokens", "num_pairs", "num_replicas"):
        if saved[key] != sampler[key]:
            raise CheckpointError(
                f"cannot resume from {checkpoint}: it was trained with {key}={saved[key]}, this run has "
                f"{key}={sampler[key]} (the batch order would differ)"
            )


# ---- checkpoints every few minutes ----


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


class TrainingClock(TrainerCallback):
    """Wall-clock training minutes (`train_minutes`) in every entry of the log history, so that curves can be
    drawn against time, the budget a CPU run is held to. Counted from `train()`'s start, evaluations and
    checkpoint writing included, and added to the last minutes logged before a resume (time spent stopped is
    not counted)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.before = 0.0

    def on_train_begin(self, args, state, control, **kwargs):
        self.started = time.monotonic()
        self.before = max((e["train_minutes"] for e in state.log_history if "train_minutes" in e), default=0.0)

    def minutes(self) -> float:
        return self.before + (time.monotonic() - self.started) / 60

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.log_history:  # the entry the Trainer has just appended for these logs
            state.log_history[-1]["train_minutes"] = round(self.minutes(), 2)


# ---- Section 6.1: checkpoint averaging ----


def _comparable_config(folder: Path) -> dict[str, Any]:
    values = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    for volatile in ("transformers_version", "_name_or_path", "dtype", "torch_dtype"):
        values.pop(volatile, None)
    return values


def average_checkpoints(checkpoints: Sequence[str | os.PathLike], output_dir: str | os.PathLike) -> Path:
    """Average the weights of several checkpoints into one model folder (Section 6.1).

    "For the base models, we used a single model obtained by averaging the last 5 checkpoints ...
    For the big models, we averaged the last 20 checkpoints." Each tensor is summed in float64 and
    divided by the count, then cast back to its dtype. The folder written holds the averaged
    ``model.safetensors``, the config and generation config of the last checkpoint, its tokenizer
    when it has one, the model's code files (``save_pretrained``) and ``averaged_from.json``. The folder is built
    beside ``output_dir`` and takes its place whole once complete (an interrupted run leaves the earlier one);
    an ``output_dir`` that already holds this exact average is left as it is, with anything beside it.

    Raises:
        CheckpointError: fewer than one checkpoint, a truncated one, or checkpoints whose configs,
            tensor names, shapes or dtypes differ (each difference named).
    """
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
            raise CheckpointError(
                f"cannot average: {folder} and {folders[0]} hold different tensors ({', '.join(odd[:5])})"
            )
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
    tokenizer = load_tokenizer(folders[-1]) if (folders[-1] / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        check_tokenizer_fits_model(tokenizer, model.config)  # the one check wherever a tokenizer meets a model
    output_dir = Path(output_dir)
    with atomic_folder(output_dir, keep_unchanged=True) as partial:
        model.save_pretrained(partial)
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        (partial / "averaged_from.json").write_text(
            json.dumps({"checkpoints": [str(f) for f in folders]}, indent=1) + "\n", encoding="utf-8"
        )
    return output_dir


def complete_checkpoints(
    run_dir: str | os.PathLike, warn: Callable[[str], Any] = logger.warning, for_resume: bool = False
) -> list[Path]:
    """The run's checkpoint folders whose model is complete (config and weights; ``for_resume``: the
    optimizer, scheduler and RNG files too), oldest first. One left incomplete by a run killed while saving
    it is skipped, as ``train --resume`` skips it, and ``warn`` is called with a line that says so."""
    complete = []
    for folder in checkpoint_folders(run_dir):
        try:
            check_checkpoint(folder, for_resume=for_resume)
            complete.append(folder)
        except CheckpointError as err:
            warn(f"skipping {folder.name}: {err}")
    return complete


def average_last_checkpoints(
    run_dir: str | os.PathLike,
    last: int,
    output_dir: str | os.PathLike | None = None,
    warn: Callable[[str], Any] = logger.warning,
) -> tuple[Path, list[Path]]:
    """Average a run's last ``last`` complete checkpoints (Section 6.1: 5 for base models, 20 for big) into
    ``output_dir`` (default ``run_dir/averaged``); returns that folder and the checkpoints averaged (fewer
    than ``last`` when the run has fewer). Incomplete checkpoints are skipped (see `complete_checkpoints`).

    Raises:
        CheckpointError: ``run_dir`` holds no complete checkpoint, or the checkpoints cannot be averaged.
    """
    if last < 1:
        raise CheckpointError(f"the number of checkpoints to average must be >= 1, got {last}")
    chosen = complete_checkpoints(run_dir, warn)[-last:]
    if not chosen:
        raise CheckpointError(f"{run_dir} holds no complete checkpoint-<step> folder")
    output_dir = Path(run_dir) / "averaged" if output_dir is None else Path(output_dir)
    return average_checkpoints(chosen, output_dir), chosen


# ---- what a run folder holds before a run ----


def _own_entry(entry: Path, inputs: Sequence[Path], output_dir: Path) -> bool:
    """Whether an entry of ``output_dir`` belongs to the run about to start rather than to an earlier one: hidden
    (the lock, temporary files), TensorBoard's ``runs``, one of the run's inputs (its tokenizer, its data files,
    as the parse run writes them) or a folder holding one; with the tokenizer in ``output_dir`` itself, its files."""
    if entry.name.startswith(".") or entry.name == "runs":
        return True
    if output_dir in inputs and entry.name.startswith(("tokenizer", "special_tokens_map")):
        return True
    resolved = entry.resolve()
    return any(resolved == path or resolved in path.parents for path in inputs)


def earlier_results(recipe: RecipeConfig, arguments: Seq2SeqTrainingArguments) -> dict[str, tuple]:
    """What ``output_dir`` holds from another run, when this run starts afresh (no checkpoint to resume from):
    entry name -> (inode, modification time), to tell later which ones the new run wrote again. Empty when the
    run can resume (``output_dir`` holds checkpoints, which `resume_checkpoint` judges) or the folder is empty
    but for the run's own entries (see `_own_entry`)."""
    output_dir = Path(arguments.output_dir)
    if not output_dir.is_dir() or checkpoint_folders(output_dir):
        return {}
    named = (recipe.tokenizer, recipe.train_source, recipe.train_target, recipe.dev_source, recipe.dev_target)
    inputs = [Path(path).resolve() for path in (*named, recipe.train_dataset) if path]
    found = {}
    for entry in sorted(output_dir.iterdir()):
        if not _own_entry(entry, inputs, output_dir.resolve()):
            stat = entry.lstat()
            found[entry.name] = (stat.st_ino, stat.st_mtime_ns)
    return found


def refuse_earlier_run(recipe: RecipeConfig, arguments: Seq2SeqTrainingArguments, force: bool) -> dict[str, tuple]:
    """Refuse a new run (nothing to resume) in an ``output_dir`` holding another run's results (an ``averaged``
    model and its scores, a final model, curves: `earlier_results`), unless ``force``; returns them.

    With ``force`` they are replaced once the new run has finished: ``averaged/`` and the final model by the new
    run's, and what the new run does not write again is removed then (`remove_earlier_results`), so no score of
    the earlier weights stays beside the new ones."""
    earlier = earlier_results(recipe, arguments)
    if earlier and not force:
        output_dir = Path(arguments.output_dir)
        # an average and scores first: what the user would lose
        names = sorted(earlier, key=lambda name: (name != "averaged" and "scores" not in name, name))
        shown = ", ".join(name + "/" * (output_dir / name).is_dir() for name in names[:6])
        shown += f", ... ({len(names)} in all)" if len(names) > 6 else ""
        kind = folder_kind(output_dir)
        raise ConfigError(
            f"output_dir {output_dir} already holds {shown}{f' ({kind})' if kind else ''}, another run's results, "
            "and no checkpoint to resume from; nothing was written: give another output_dir, or pass --force to "
            "start a new run there (what it holds is replaced once the new run has finished)"
        )
    return earlier


def remove_earlier_results(output_dir: str | os.PathLike, earlier: dict[str, tuple]) -> None:
    """Remove the entries `refuse_earlier_run` found (with ``force``) that the finished run did not write again."""
    for name, identity in earlier.items():
        entry = Path(output_dir) / name
        try:
            stat = entry.lstat()
        except FileNotFoundError:
            continue
        if (stat.st_ino, stat.st_mtime_ns) != identity:
            continue  # written again by this run
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
        logger.info("removed %s, left by the run this one replaced (--force)", entry)


def replaced_average(averaged: Path, before: tuple | None, names_before: list[str]) -> None:
    """Say which files went with an earlier ``averaged/`` that a resumed run replaced with a new average."""
    if before is None or not averaged.is_dir():
        return
    stat = averaged.lstat()
    gone = [name for name in names_before if not (averaged / name).exists()]
    if (stat.st_ino, stat.st_mtime_ns) != before and gone:
        logger.warning(
            "%s now holds the average of later checkpoints; %s, written beside the earlier average, went with it",
            averaged,
            ", ".join(gone),
        )


__all__ = [
    "CheckpointError",
    "complete_checkpoints",
    "average_last_checkpoints",
    "check_safetensors",
    "checkpoint_folders",
    "check_checkpoint",
    "resume_checkpoint",
    "SAMPLER_STATE_NAME",
    "check_sampler_state",
    "check_resume_config",
    "staging_folder",
    "publish_checkpoint",
    "remove_interrupted_saves",
    "TimedCheckpointCallback",
    "average_checkpoints",
]
