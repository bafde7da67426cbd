"""Reading fairseq translation checkpoints without fairseq and without running the pickle's code.

A fairseq checkpoint (`checkpoint_best.pt`, `model.pt`) is a torch pickle holding `model` (the state
dict), the training settings (`args`, an `argparse.Namespace`, in checkpoints before fairseq 0.10;
`cfg`, a plain dict, after) and training state. A pickle can import and call anything, so it is read
with torch's restricted unpickler (`torch.load(weights_only=True)`), which rebuilds tensors and plain
containers only; allowed beyond those are `argparse.Namespace` and numpy scalars and their dtypes
(fairseq keeps losses as numpy floats in `extra_state`), which hold data and run no code. Anything
else the file tries to import is refused before it is imported.

`dict.<lang>.txt` files list one `token count` per line; fairseq puts its four specials first:
`<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3.
"""

from __future__ import annotations

import argparse
import os
import pickle
from pathlib import Path
from typing import Any

from vaswani_tx.folders import CheckpointError
from vaswani_tx.text_io import iter_lines

FAIRSEQ_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>")

# What the checkpoint's settings omit, by architecture: the heads of fairseq's transformer presets (the only
# setting the weights cannot tell) and the t2t preset's pre-LN. Whether a checkpoint converts is decided by its settings and weights (see
# convert.py), never by this table: an architecture not named here converts when its settings record the heads.
ARCHITECTURE_DEFAULTS: dict[str, dict[str, Any]] = {
    "transformer": {"encoder_attention_heads": 8, "decoder_attention_heads": 8},
    "transformer_iwslt_de_en": {"encoder_attention_heads": 4, "decoder_attention_heads": 4},
    "transformer_wmt_en_de": {"encoder_attention_heads": 8, "decoder_attention_heads": 8},
    "transformer_vaswani_wmt_en_de_big": {"encoder_attention_heads": 16, "decoder_attention_heads": 16},
    "transformer_vaswani_wmt_en_fr_big": {"encoder_attention_heads": 16, "decoder_attention_heads": 16},
    "transformer_wmt_en_de_big": {"encoder_attention_heads": 16, "decoder_attention_heads": 16},
    "transformer_wmt_en_de_big_t2t": {
        "encoder_attention_heads": 16,
        "decoder_attention_heads": 16,
        "encoder_normalize_before": True,  # pre-LN: refused unless the settings say otherwise
        "decoder_normalize_before": True,
    },
}


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's top-level dict, read with torch's restricted unpickler (see the module docstring).

    Raises:
        CheckpointError: the file is truncated or corrupt, is not a checkpoint, or its pickle imports
            something outside the allow-list (named in the message; nothing of it was imported or run).
    """
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with torch.serialization.safe_globals(_allowed_globals()):
            checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if "unsupported global" not in str(err).lower():  # not a refused import: the bytes themselves are bad
            raise CheckpointError(
                f"{path}: not a readable torch checkpoint, truncated or corrupt ({_first_line(err)})"
            ) from None
        raise CheckpointError(
            f"{path}: refused to unpickle: it needs an object outside the allow-list of tensors, plain containers "
            f"and argparse.Namespace, so it was not loaded and none of its code ran ({_first_line(err)})"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError) as err:
        raise CheckpointError(
            f"{path}: not a readable torch checkpoint, truncated or corrupt ({_first_line(err)})"
        ) from None
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("model"), dict):
        raise CheckpointError(f"{path}: not a fairseq checkpoint (no 'model' state dict at the top level)")
    return checkpoint


def _allowed_globals() -> list:
    """argparse.Namespace, and numpy's scalar constructor and dtypes under their numpy 1 and 2 names."""
    import numpy

    scalar = numpy._core.multiarray.scalar if hasattr(numpy, "_core") else numpy.core.multiarray.scalar
    dtypes = [type(numpy.dtype(name)) for name in ("float16", "float32", "float64", "int32", "int64", "bool")]
    return [
        argparse.Namespace,
        numpy.dtype,
        *dtypes,
        (scalar, "numpy.core.multiarray.scalar"),
        (scalar, "numpy._core.multiarray.scalar"),
    ]


def checkpoint_settings(checkpoint: dict[str, Any], path: str | os.PathLike = "checkpoint") -> dict[str, Any]:
    """The model and task settings as one flat dict, from `args` (Namespace) or `cfg` (dict of sections),
    with `arch` filled in and the heads from `ARCHITECTURE_DEFAULTS` where the settings omit them."""
    args = checkpoint.get("args")
    cfg = checkpoint.get("cfg")
    if isinstance(args, argparse.Namespace):
        settings = dict(vars(args))
    elif isinstance(cfg, dict) and isinstance(cfg.get("model"), (dict, argparse.Namespace)):
        model = cfg["model"]
        model = vars(model) if isinstance(model, argparse.Namespace) else model
        task = cfg.get("task") or {}
        # a model section's None (fairseq 0.12 copies source_lang=None into it) does not hide the task's value
        settings = {**task, **{key: value for key, value in model.items() if value is not None or key not in task}}
        settings.setdefault("arch", settings.get("_name"))
    else:
        raise CheckpointError(
            f"{path}: has neither fairseq 'args' (argparse.Namespace) nor 'cfg' with a 'model' section"
        )
    arch = settings.get("arch")
    settings = {**ARCHITECTURE_DEFAULTS.get(arch, {}), **settings}
    for field in ("encoder_attention_heads", "decoder_attention_heads"):
        if settings.get(field) is None:
            raise CheckpointError(
                f"{path}: architecture {arch!r} records no {field} and has no known default; "
                f"known: {', '.join(ARCHITECTURE_DEFAULTS)}"
            )
    return settings


def read_dictionary(path: str | os.PathLike) -> list[str]:
    """Tokens by id: fairseq's four specials, then one token per line of `dict.<lang>.txt` (`token count [flag]`)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(
            f"{path}: dictionary file not found (fairseq writes dict.<lang>.txt beside the checkpoint)"
        )
    tokens = list(FAIRSEQ_SPECIALS)
    for number, line in enumerate(iter_lines(path), 1):
        if not line.strip():
            continue
        parts = line.rstrip().rsplit(" ", 2 if line.rstrip().endswith("#fairseq:overwrite") else 1)
        if len(parts) < 2 or not parts[1].lstrip("-").isdigit():
            raise CheckpointError(f"{path}:{number}: expected 'token count', got {line!r}")
        tokens.append(parts[0])
    return tokens


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    useful = [line for line in lines if "unsupported global" in line.lower()]
    return (useful or lines or [type(err).__name__])[0]


__all__ = ["CheckpointError", "ARCHITECTURE_DEFAULTS", "checkpoint_settings", "load_checkpoint", "read_dictionary"]
