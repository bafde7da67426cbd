"""Beam search's bookkeeping for one source in C++: `kernels/one_source_beams.cpp`, built once into a model folder.

At a sentence a call the decoder's step is a fraction of a millisecond, and `one_source_search`'s Python around it
(the 2k best continuations, the kept hypotheses, the length penalty, the early-stop test, the next tokens) took as
long again. The library does all of that in one call a step, with the same choices (fast_decoding.py's
`one_source_search` says how they are made; `native_search` there drives it).

    vaswani-tx compile MODEL         # builds MODEL/beam-search/ beside the compiled steps (about 30 s, g++)
    from_pretrained(MODEL)           # loads it where its manifest fits; a sentence a call then decodes through it

It is loaded where its manifest matches this torch, this Python and this source; anywhere else beam search keeps
its Python loop (one logged line), with the same results.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

import torch

from . import native
from .atomic import atomic_folder
from .fast_decoding import BEAMS_MODULE

logger = logging.getLogger(__name__)

FOLDER = "beam-search"
MODULE = BEAMS_MODULE
LIBRARY = MODULE + ".so"
MANIFEST = "manifest.json"
SOURCE = Path(__file__).with_name("kernels") / "one_source_beams.cpp"


def _manifest() -> dict:
    return {"torch": torch.__version__, "python": sys.implementation.cache_tag, "source": native.source_digest(SOURCE)}


def build(folder: str | os.PathLike) -> Path:
    """Compile the library into `folder`/beam-search (replaced whole); returns that folder.

    Raises:
        UserInputError: no C++ compiler could build it."""
    with atomic_folder(Path(folder) / FOLDER) as out:
        native.compile_library(SOURCE, out / LIBRARY, "beam-search library", python_module=MODULE)
        manifest = {**_manifest(), "library": native.library_digest(out / LIBRARY)}
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    return Path(folder) / FOLDER


def load(folder: str | os.PathLike) -> bool:
    """Whether beam search over one source can go through the library now: `folder`/beam-search holds one that fits
    (this torch, this Python, this source), loaded into this process at the first such folder, or one was loaded
    before. A folder with none says nothing; one that does not fit logs one line."""
    if MODULE in sys.modules:
        return True
    where = Path(folder) / FOLDER
    if not (where / MANIFEST).is_file():
        return False
    try:
        manifest = json.loads((where / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        logger.warning("%s: not using the beam-search library: its manifest is unreadable (%s)", where, error)
        return False
    here = _manifest()
    problem = next(
        (
            f"it was built for {what} {manifest.get(key)}, this is {here[key]}"
            for key, what in (("torch", "torch"), ("python", "Python"))
            if manifest.get(key) != here[key]
        ),
        "it was built from another version of its source" if manifest.get("source") != here["source"] else None,
    )
    if problem is None:
        try:
            if manifest.get("library") != native.library_digest(where / LIBRARY):
                problem = "its library is not the one built (truncated or changed since)"
            else:
                spec = importlib.util.spec_from_file_location(MODULE, where / LIBRARY)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                sys.modules[MODULE] = module  # where fast_decoding.py looks for it
        except (ImportError, OSError) as error:
            problem = f"its library does not load ({str(error).strip().splitlines()[0][:200]})"
    if problem is not None:
        logger.warning("%s: not using the beam-search library: %s; beam search's Python loop instead", where, problem)
        return False
    return True
