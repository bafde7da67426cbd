"""Checks every command makes on its folders before any heavy work, and the lock `train` holds on its run folder.

- :func:`folder_kind` says what a folder holds (a vaswani_tx model, another library's model, a training
  run, a checkpoint, a tokenizer, a CTranslate2 export), so a command can name what it was given.
- :func:`refuse_to_overwrite` refuses an output folder that already holds something, unless ``--force`` (which
  replaces it whole once the new one is written: never a folder that holds the command's inputs).
- :func:`refuse_to_replace` refuses output files that exist already, unless ``--force``.
- :func:`check_writable` finds an unusable output location (under a file, read-only, an existing folder
  where a file is wanted) before any decoding or training, by writing a probe file there.
- :class:`RunLock` is the lock ``train`` holds on ``output_dir`` while it writes it: a second run on the
  same folder is refused, naming the process that holds it; a lock left by a killed run is taken over.
- :func:`failed_write` and :func:`naming_failed_writes` name the file and the cause of a write that failed
  (torch's writer says neither: "[enforce fail at inline_container.cc:672] ...").

Its refusals are :class:`~vaswani_tx.model.errors.UserInputError` (a missing or unwritable location: the ``OSError``
that names it). Standard library only: a command's checks never wait on torch or transformers.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import stat
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from vaswani_tx.atomic import STREAMS, written_in_place
from vaswani_tx.model.errors import UserInputError

LOCK_NAME = ".vaswani-train.lock"


def folder_kind(path: str | os.PathLike) -> str | None:
    """What `path` holds, in words ("a vaswani_tx model folder", "a marian model folder", "a training run
    folder (checkpoint-<step> folders)", ...), or None when it is none of the folders this package writes."""
    path = Path(path)
    if not path.is_dir():
        return None
    if (path / "model.bin").is_file() and not (path / "trainer_state.json").is_file():
        return "a CTranslate2 model folder"  # which has a config.json of its own
    if (path / "config.json").is_file():
        try:
            model_type = json.loads((path / "config.json").read_text(encoding="utf-8")).get("model_type")
        except (ValueError, UnicodeDecodeError, AttributeError, OSError):
            model_type = None
        if (path / "trainer_state.json").is_file():
            return "a training checkpoint folder"
        if model_type == "vaswani":
            return "a vaswani_tx model folder"
        return f"a {model_type} model folder" if model_type else "a model folder (config.json)"
    if any(p.is_dir() and p.name.startswith("checkpoint-") for p in path.iterdir()):
        return "a training run folder (checkpoint-<step> folders)"
    if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file():
        return "a tokenizer folder"
    if (path / "dataset_info.json").is_file() or (path / "state.json").is_file():
        return "a dataset folder"
    return None


def what_is(path: str | os.PathLike) -> str:
    """What kind of file `path` is, through its links, in words: "a file", "a character device", "a FIFO", ..."""
    mode = os.stat(path).st_mode
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))
    kinds += ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "a file")


def require_vaswani_model(path: str | os.PathLike) -> None:
    """Refuse a folder that is not a vaswani_tx model, naming what it is and, for another library's
    translation model, the command that takes it (``vaswani-tx convert``)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not path.is_dir():
        raise UserInputError(f"{path} is a file, not a model folder")
    if not (path / "config.json").is_file():
        kind = folder_kind(path)
        raise UserInputError(
            f"{path} is not a model folder: it has no config.json" + (f" (it is {kind})" if kind else "")
        )
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise UserInputError(f"{path / 'config.json'} is not a valid JSON config ({err})") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type != "vaswani":
        raise UserInputError(
            f"{path} holds a model of type {model_type!r}, not a vaswani_tx model ('vaswani'): "
            f"convert it first (`vaswani-tx convert {path} OUT`)"
        )


def _within(path: str | os.PathLike, folder: Path) -> bool:
    path, folder = Path(path).resolve(), folder.resolve()
    return path == folder or folder in path.parents


def refuse_to_overwrite(
    path: str | os.PathLike, force: bool, option: str = "--force", inputs: Sequence[str | os.PathLike] = ()
) -> None:
    """Refuse `path` as an output folder when it exists and is not empty (naming what it holds), unless `force`.

    With `force` the new folder replaces `path` whole once written (`vaswani_tx.atomic.atomic_folder`), so a
    `path` that is or holds one of the command's `inputs`, or the current folder, is refused all the same."""
    path = Path(path)
    if not path.exists():
        return
    if not path.is_dir():
        raise UserInputError(f"output folder {path} exists and is {what_is(path)}, not a folder")
    if not any(path.iterdir()):
        return
    if force:
        for held in (*inputs, Path.cwd()):
            if _within(held, path):
                what = "the current folder" if held == Path.cwd() else f"{held}, which this command reads"
                raise UserInputError(
                    f"output folder {path} is or holds {what}; {option} would replace it whole: give another folder"
                )
        return
    kind = folder_kind(path)
    raise FileExistsError(
        f"output folder {path} already exists and is {kind or 'not empty'}; nothing was written: "
        f"give another folder, or pass {option} to overwrite it"
    )


def refuse_to_replace(paths: Sequence[str | os.PathLike], force: bool, option: str = "--force") -> None:
    """Refuse output files that already exist (naming them), unless `force`; with `force` each is replaced only
    once its new content is complete (`vaswani_tx.atomic`). A device, a FIFO or a stream is written, never
    replaced (`vaswani_tx.atomic.written_in_place`), and so never refused."""
    existing = [str(path) for path in paths if os.path.lexists(path) and not written_in_place(path)]
    if existing and not force:
        some = "output file " + existing[0] if len(existing) == 1 else "output files " + ", ".join(existing)
        raise FileExistsError(
            f"{some} already {'exists' if len(existing) == 1 else 'exist'}; nothing was written: give another "
            f"name, or pass {option} to replace {'it' if len(existing) == 1 else 'them'}"
        )


def check_writable(path: str | os.PathLike, kind: str = "dir") -> None:
    """Refuse an output location before any work: `kind` "dir" for a folder that files are written into
    (created later if missing), "whole-dir" for a folder written whole (built beside it, then swapped in: its
    parent must be writable, or the folder itself when it is empty), "file" for a file (written beside it, then
    moved in). Writes and removes a probe file in the nearest existing folder."""
    if kind == "file" and written_in_place(path):  # a device, FIFO or stream: written where it is
        if str(path) not in STREAMS and not os.access(path, os.W_OK):
            raise PermissionError(f"cannot write {path}: {what_is(path)} this user may not write")
        return
    path = Path(path)
    if kind == "file" and path.is_dir():
        raise UserInputError(f"output file {path} is a folder; give a file name")
    if kind != "file" and path.exists() and not path.is_dir():
        raise UserInputError(f"output folder {path} is {what_is(path)}, not a folder")
    if kind == "whole-dir" and path.is_dir() and not any(path.iterdir()):
        kind = "dir"  # an empty folder is filled in place
    probe_in = path if kind == "dir" else path.parent
    while not probe_in.exists():
        probe_in = probe_in.parent
    if not probe_in.is_dir():
        raise UserInputError(f"cannot write {path}: {probe_in} is a file, not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=probe_in, prefix=".vaswani-probe-"):
            pass
    except OSError as err:
        raise PermissionError(f"cannot write {path}: {probe_in} is not writable ({err.strerror})") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class RunLockError(UserInputError, RuntimeError):  # a RuntimeError before UserInputError existed: still one
    """Another live process holds the run folder."""


class RunLock:
    """``with RunLock(output_dir):`` holds ``output_dir/.vaswani-train.lock`` (PID and host) while training.

    Taken with an exclusive create, so two processes cannot both hold it; a lock whose process is gone
    (a run killed with kill -9 or a power cut, on this host) is taken over with a warning line."""

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.took_over: dict | None = None

    def _holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError, OSError):
            return {}  # being written, or garbage: judged by its age below

    def acquire(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        me = {"pid": os.getpid(), "host": socket.gethostname()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:
                    continue  # released meanwhile
                pid, host = holder.get("pid"), holder.get("host")
                if isinstance(pid, int) and (host != me["host"] or _alive(pid)):
                    where = "" if host == me["host"] else f" on host {host}"
                    raise RunLockError(
                        f"{self.folder} is being written by another `vaswani-tx train` (process {pid}{where}; "
                        f"lock file {self.path}); wait for it to finish, stop it, or give another output_dir"
                    ) from None
                if not isinstance(pid, int):
                    try:  # a lock being written right now is fresh; an unreadable old one is stale
                        if time.time() - self.path.stat().st_mtime < 5:
                            time.sleep(0.5)
                            continue
                    except FileNotFoundError:
                        continue
                if self._holder() != holder:
                    continue  # another process took it over meanwhile: judge the new holder
                self.took_over = holder
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                json.dump(me, file)
            return
        raise RunLockError(f"could not take the lock {self.path}; remove it if no `vaswani-tx train` runs on it")

    def release(self) -> None:
        holder = self._holder()
        if holder and holder.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CheckpointError(UserInputError):
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


# ---- what a failed write was ----

_TORCH_WRITER = re.compile(r"inline_container|PytorchStreamWriter")  # torch.save's zip writer (caffe2 serialize)
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error (safetensors, tokenizers) gives an errno


def _probe_write(folder: Path, size: int = 1 << 20) -> int | None:
    """The errno with which writing ``size`` bytes in ``folder`` fails now, or None when it succeeds."""
    probe = folder / f".write-probe.{os.getpid()}"
    try:
        with open(probe, "wb") as file:
            file.write(bytes(size))
            file.flush()
            os.fsync(file.fileno())
    except OSError as err:
        return err.errno
    finally:
        probe.unlink(missing_ok=True)
    return None


def failed_write(error: BaseException, folder: str | os.PathLike) -> tuple[int, Path, str] | None:
    """For ``error``, raised while files were written under ``folder``: ``(errno, file, cause)`` when it is a write
    that failed (a full disk, a quota, a refused permission), else None (it goes on as it is).

    ``torch.save`` reports a failed write as a RuntimeError without the file or the cause ("[enforce fail at
    inline_container.cc:672] . unexpected pos 576 vs 534"), safetensors with an ``(os error N)`` and no file, and
    ``write()`` with an errno and no file: the file is then the one written last under ``folder`` (the writers
    create their file before they write it), and torch's cause the error with which a test write there fails now
    (EIO with torch's message when that one succeeds, as under a file size limit above its size)."""
    folder = Path(folder)
    if isinstance(error, OSError):
        if error.errno is None or error.strerror is None:
            return None  # a message of ours
        number, file = error.errno, error.filename
        if file is not None and not Path(os.fsdecode(file)).resolve().is_relative_to(folder.resolve()):
            return None  # a file read, not written here
    elif isinstance(error, RuntimeError) and _TORCH_WRITER.search(str(error)):
        number, file = _probe_write(folder), None
        if number is None:
            return (
                errno.EIO,
                _newest_file(folder),
                f"the write failed (torch: {error}), though a test write there succeeds",
            )
    elif (found := _RUST_OS_ERROR.search(str(error))) is not None:
        number, file = int(found[1]), None
    else:
        return None
    return number, Path(os.fsdecode(file)) if file is not None else _newest_file(folder), os.strerror(number)


def _newest_file(folder: Path) -> Path:
    files = [path for path in folder.rglob("*") if path.is_file()]
    return max(files, key=lambda path: path.stat().st_mtime_ns) if files else folder


@contextlib.contextmanager
def naming_failed_writes(folder: str | os.PathLike) -> Iterator[None]:
    """Inside the block, a write under ``folder`` that fails is raised as the ``OSError`` that names its file and
    cause (see :func:`failed_write`), so that ``atomic_folder`` and the CLI report it as such (exit 2)."""
    try:
        yield
    except Exception as err:
        found = failed_write(err, folder)
        if found is None or (isinstance(err, OSError) and err.filename is not None):  # atomic_folder names those
            raise
        number, file, cause = found
        raise OSError(number, cause, str(file)) from err
