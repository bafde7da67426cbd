"""Refusing a bad checkpoint before loading it: one error type, and a check of safetensors files.

Light on purpose (json only): training (resume, averaging), translation (any model folder) and the
fairseq reader all refuse checkpoints through it without pulling in each other's imports.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder or file that is missing files, truncated, corrupt, unsafe to read or incompatible;
    the message names it."""


def check_safetensors(path: str | os.PathLike) -> None:
    """Refuse a safetensors file whose header does not parse or whose tensors do not fill the file exactly
    (a copy or download cut short)."""
    path = Path(path)
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            header_length = int.from_bytes(handle.read(8), "little")
            if size < 8 or 8 + header_length > size:
                raise ValueError("the header runs past the end of the file")
            header = json.loads(handle.read(header_length))
        end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is not a readable safetensors file ({err})") from None
    if 8 + header_length + end != size:
        raise CheckpointError(
            f"{path} is truncated or corrupt: its header describes {8 + header_length + end} bytes, the file has {size}"
        )


__all__ = ["CheckpointError", "check_safetensors"]
