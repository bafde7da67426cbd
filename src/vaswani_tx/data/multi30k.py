"""Multi30k Task 1 (English-German image captions) as line-aligned files: a local copy, or the Hub's.

A run config with ``multi30k: en-de`` (the main job's, ``configs/train/multi30k-en-de.yaml``) trains on
``train.en``/``train.de`` and evaluates on ``val.en``/``val.de`` of one folder, chosen by :func:`multi30k_folder`:

1. ``$VASWANI_SHARED_DATA/multi30k-en-de`` when that variable is set, else ``../shared/data/multi30k-en-de``
   (relative to the working directory, as every path of a run config), when that folder is there;
2. otherwise :data:`DOWNLOAD_FOLDER`, ``runs/data/multi30k-en-de`` inside the clone, which
   :func:`provide_multi30k` writes once from the Hugging Face Hub's ``bentrevett/multi30k`` (its splits train,
   validation and test, columns ``en`` and ``de``; the download itself stays in the datasets cache).

The files are written into a temporary folder and renamed into place once all six are complete, so a download
that is stopped or fails leaves nothing that a later run would take for the data.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vaswani_tx.atomic import atomic_folder
from vaswani_tx.model.errors import UserInputError

logger = logging.getLogger(__name__)

HUB_PATH = "bentrevett/multi30k"
FOLDER_NAME = "multi30k-en-de"
DOWNLOAD_FOLDER = Path("runs/data") / FOLDER_NAME
# the Hub's split -> the file names of the local copy (the Multi30k repository's)
SPLITS = {"train": "train", "validation": "val", "test": "test"}
LANGUAGES = ("en", "de")


def shared_folder() -> Path:
    """Where a local copy is looked for: ``$VASWANI_SHARED_DATA/multi30k-en-de`` or ``../shared/data/...``."""
    return Path(os.environ.get("VASWANI_SHARED_DATA", "../shared/data")) / FOLDER_NAME


def multi30k_folder() -> Path:
    """The folder a run reads: the local copy when it is there, else :data:`DOWNLOAD_FOLDER` (which may not
    exist yet: :func:`provide_multi30k` writes it). Looks, downloads nothing."""
    shared = shared_folder()
    return shared if shared.is_dir() else DOWNLOAD_FOLDER


def _complete(folder: Path) -> bool:
    return all((folder / f"{name}.{lang}").is_file() for name in SPLITS.values() for lang in LANGUAGES)


def provide_multi30k(hub_path: str | None = None) -> Path:
    """The folder of :func:`multi30k_folder`, downloaded from the Hub first when it is neither a local copy nor a
    complete earlier download; says in the log which it is.

    ``hub_path`` is the dataset's Hub id, :data:`HUB_PATH` by default (the tests give a local folder in its layout).

    Raises:
        UserInputError: no local copy and the Hub cannot be reached (one line giving both ways to provide it).
    """
    hub_path = hub_path or HUB_PATH
    folder = multi30k_folder()
    if folder != DOWNLOAD_FOLDER:
        logger.info("Multi30k: the local copy in %s", folder)
        return folder
    if _complete(folder):
        logger.info("Multi30k: %s (downloaded earlier from the Hugging Face Hub, %s)", folder, hub_path)
        return folder
    logger.info(
        "Multi30k: no local copy at %s; downloading %s from the Hugging Face Hub into %s",
        shared_folder(),
        hub_path,
        folder,
    )
    _download(hub_path, folder)
    logger.info("Multi30k: wrote %s", ", ".join(sorted(path.name for path in folder.iterdir())))
    return folder


def _download(hub_path: str, folder: Path) -> None:
    import datasets

    try:
        splits = datasets.load_dataset(hub_path)
    except (ConnectionError, datasets.exceptions.DatasetNotFoundError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserInputError(
            f"Multi30k is not at {shared_folder()} and could not be downloaded from the Hugging Face Hub "
            f"({hub_path}: {reason}). Either put its train.en, train.de, val.en and val.de in {shared_folder()} "
            f"(VASWANI_SHARED_DATA names the folder that holds {FOLDER_NAME}/), or connect to the internet with "
            f"HF_HUB_OFFLINE unset so that it is downloaded into {folder}"
        ) from None
    missing = [split for split in SPLITS if split not in splits]
    if missing:
        raise UserInputError(f"{hub_path} has no split {', '.join(missing)} (it has {', '.join(splits)})")
    # a file beside the target that is renamed into place once all six are written: a stopped download leaves
    # only a hidden `.multi30k-en-de.*.partial`, which no run reads
    with atomic_folder(folder) as partial:
        for split, name in SPLITS.items():
            rows = splits[split]
            absent = [lang for lang in LANGUAGES if lang not in rows.column_names]
            if absent or rows.num_rows == 0:
                raise UserInputError(f"{hub_path} split {split}: no column {absent} or no rows")
            for lang in LANGUAGES:
                # one sentence a line: a line break inside a sentence would shift every line after it
                lines = (text.replace("\r", " ").replace("\n", " ") for text in rows[lang])
                (partial / f"{name}.{lang}").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


__all__ = ["DOWNLOAD_FOLDER", "HUB_PATH", "multi30k_folder", "provide_multi30k", "shared_folder"]
