"""Writing results whole or not at all: what every command uses to write a file or a folder.

A result is written under a temporary name beside its target, unique to the process
(``.NAME.PID.RANDOM.partial``), and moved into place only once it is complete, so that a run that fails (a full
disk), crashes or is stopped (Ctrl-C, SIGTERM) leaves whatever the target held before as it was, and two
processes writing one target never share a temporary file.

- :func:`atomic_file` yields a temporary path to write (flushed to disk, then ``os.replace``-d over the target);
  :func:`write_text` and :func:`write_bytes` are the one-call forms.
- :func:`atomic_folder` yields a temporary folder to fill, then swaps it in whole: the old folder is renamed
  aside, the new one renamed in, the old one removed (on failure the old one is put back). ``merge=True``
  moves the files in one by one instead, each whole, keeping the rest of the target (a run folder, a hub clone);
  ``keep_unchanged=True`` leaves the target as it is when it already holds these exact files (what was put
  beside them stays valid).
- Only regular files are replaced. A target that is not one, followed through its links (a character device such
  as ``/dev/null`` or a terminal, a FIFO, a socket), is written where it is (:func:`written_in_place`): replacing
  it would put a regular file where the device or the pipe was. A link to a regular file keeps its place; the file
  it points to is replaced. ``-``, ``/dev/stdout`` and ``/dev/stderr`` name Python's own streams (as gawk reads
  them): what is written goes to ``sys.stdout`` or ``sys.stderr``, and a shell's ``>>`` keeps what it appends to.
- :func:`sigterm_as_interrupt` turns SIGTERM into ``KeyboardInterrupt`` (Python's default SIGTERM kills the
  process without running a ``finally``), so the clean-up above runs for it as for Ctrl-C.

An ``OSError`` while writing (and the I/O errors of safetensors and tokenizers, which name an ``os error``) is
raised again as an ``OSError`` naming the target, not the temporary file, and saying that nothing was replaced.
A process killed outright (``kill -9``, a power cut) can leave a ``.NAME.PID...partial`` beside the target; the
target itself is still whole. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import filecmp
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

STREAMS = {"-": "stdout", "/dev/stdout": "stdout", "/dev/stderr": "stderr"}  # names of sys.stdout and sys.stderr
_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's io::Error (safetensors, tokenizers) names an errno
_WRITE_ERRORS = {errno.EFBIG, errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}


def _temporary_name(target: Path, suffix: str) -> Path:
    return target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}{suffix}")


def _named(error: BaseException, temporary: Path, target: Path, existed: bool) -> OSError | None:
    """The OSError to raise for `error` raised while writing `temporary` for `target`, naming the target; None
    when `error` is about something else (an input file, a message of our own) and goes on as it is."""
    if isinstance(error, OSError):
        if error.errno is None or error.strerror is None:
            return None
        name = None if error.filename is None else os.fsdecode(error.filename)
        if name is not None and not name.startswith(str(temporary)):
            return None  # a file the writer read, not the one it wrote
        number = error.errno
        where = target if name is None else Path(name.replace(str(temporary), str(target), 1))
    else:
        found = _RUST_OS_ERROR.search(str(error))
        if found is None or int(found[1]) not in _WRITE_ERRORS:  # a file it failed to read keeps its own message
            return None
        number, where = int(found[1]), target
    kept = "the earlier one is unchanged" if existed else "nothing was left behind"
    return OSError(number, f"{os.strerror(number)}; not written, {kept}", str(where))


def _make_parent(target: Path) -> list[Path]:
    """Create the folders above `target` that are missing; returns them, deepest first (removed again on failure)."""
    missing = []
    for folder in target.parents:
        if folder.exists():
            break
        missing.append(folder)
    target.parent.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            break


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_folder(folder: Path) -> None:
    """The data of every file under `folder`, then the folder entries, on disk (so a power cut after the rename
    finds complete files, not empty ones); a file system that cannot fsync a folder is let be."""
    for path in [*folder.rglob("*"), folder]:
        if path.is_symlink():
            continue
        try:
            _fsync(path)
        except OSError as err:
            if not path.is_dir() or err.errno not in (errno.EINVAL, errno.EBADF, errno.EISDIR):
                raise


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the few renames of a swap; delivered to their handlers right after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {}
    for number in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(number)
        if handler is not None:  # None: set outside Python, left alone
            previous[number] = handler
            signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        if received:
            signal.raise_signal(received[0])


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _swap(new: Path, target: Path) -> None:
    """Put the complete `new` (a folder or a file) at `target`, replacing what is there whole; a failure puts
    the old one back."""
    with _signals_deferred():
        if not os.path.lexists(target):
            try:
                os.rename(new, target)
                return
            except OSError as err:  # created meanwhile by another process: replace it as below
                if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
        aside = _temporary_name(target, ".old")
        os.rename(target, aside)
        try:
            os.rename(new, target)
        except BaseException:
            os.rename(aside, target)
            raise
        _remove(aside)


def _holds_same_files(new: Path, target: Path) -> bool:
    """Whether `target` holds every file of `new` with the same bytes (it may hold more)."""
    if not target.is_dir():
        return False
    for path in new.rglob("*"):
        if path.is_dir():
            continue
        other = target / path.relative_to(new)
        if not other.is_file() or not filecmp.cmp(path, other, shallow=False):
            return False
    return True


def written_in_place(target: str | os.PathLike) -> bool:
    """Whether `target` is written where it is rather than replaced: one of `STREAMS`, or an existing file that,
    followed through its links, is neither a regular file nor a folder (a device, a FIFO, a socket)."""
    if str(target) in STREAMS:
        return True
    try:
        mode = os.stat(target).st_mode
    except OSError:  # missing, or a link to nothing: a regular file will be made
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextlib.contextmanager
def atomic_file(target: str | os.PathLike) -> Iterator[Path]:
    """``with atomic_file(path) as temporary:`` write `temporary` (a path beside `path`, unique to this process);
    when the block ends without an exception it replaces `path` at once. On any exception (Ctrl-C and SIGTERM
    under :func:`sigterm_as_interrupt` included) the temporary file is removed and `path` is as it was.

    A `path` that is a link to a regular file stays a link: the file it points to is replaced. A `path` that is
    not a regular file (:func:`written_in_place`) is yielded itself, to be written directly."""
    if written_in_place(target):
        try:
            yield Path(target)
        except OSError as err:  # a write to a device names no file (/dev/full: "No space left on device")
            if err.filename is None and err.errno is not None and err.strerror is not None:
                raise OSError(err.errno, err.strerror, str(target)) from err
            raise
        return
    target = Path(os.path.realpath(target)) if os.path.islink(target) else Path(target)
    created = _make_parent(target)
    existed = target.exists()
    temporary = _temporary_name(target, ".partial")
    try:
        # created with the mode a new file gets (the umask's), not mkstemp's 0600
        os.close(os.open(temporary, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
        yield temporary
        if existed:
            shutil.copymode(target, temporary)
        _fsync(temporary)
        os.replace(temporary, target)
    except BaseException as err:
        temporary.unlink(missing_ok=True)
        _remove_empty(created)
        named = _named(err, temporary, target, existed)
        if named is not None:
            raise named from err
        raise


def write_bytes(target: str | os.PathLike, data: bytes) -> Path:
    """Write `data` to `target` whole or not at all (see :func:`atomic_file`), or to the stream `target` names
    (`STREAMS`: ``-`` is standard output); returns `target` as a Path."""
    stream = STREAMS.get(str(target))
    if stream is not None:
        stream = getattr(sys, stream)
        stream.flush()  # what was printed before comes first
        stream.buffer.write(data)
        stream.buffer.flush()
        return Path(target)
    with atomic_file(target) as temporary:
        temporary.write_bytes(data)
    return Path(target)


def write_text(target: str | os.PathLike, text: str, encoding: str = "utf-8") -> Path:
    """Write `text` to `target` whole or not at all (see :func:`atomic_file`), or to the stream `target` names
    (`STREAMS`, in the stream's own encoding, as print() does); returns `target` as a Path."""
    stream = STREAMS.get(str(target))
    if stream is not None:
        stream = getattr(sys, stream)
        stream.write(text)
        stream.flush()
        return Path(target)
    return write_bytes(target, text.encode(encoding))


@contextlib.contextmanager
def atomic_folder(target: str | os.PathLike, merge: bool = False, keep_unchanged: bool = False) -> Iterator[Path]:
    """``with atomic_folder(folder) as temporary:`` fill `temporary` (a new folder beside `folder`, unique to this
    process); when the block ends without an exception it takes the place of `folder` whole (what `folder` held
    is gone). On any exception `temporary` is removed and `folder` is as it was.

    ``merge=True``: an existing `folder` keeps what it holds; each entry of `temporary` replaces its namesake
    there, each whole. ``keep_unchanged=True``: an existing `folder` that already holds every file of
    `temporary`, byte for byte, is left as it is (with whatever else it holds). An existing empty `folder` is
    filled rather than replaced (it may be the current folder or a mount point). When `folder` is filled (merged
    into, or empty), `temporary` is a hidden folder inside it, so only `folder` itself need be writable."""
    target = Path(target)
    if written_in_place(target):  # renamed aside and removed by a swap: never
        raise NotADirectoryError(errno.ENOTDIR, "not a folder, and not replaced by one", str(target))
    created = _make_parent(target)
    existed = target.exists()
    # filled in place (an empty folder may be the current folder or a mount point): built inside it, beside the
    # files it will replace, so that only the folder itself need be writable
    fill = target.is_dir() and (merge or not any(target.iterdir()))
    temporary = target / _temporary_name(target, ".partial").name if fill else _temporary_name(target, ".partial")
    try:
        os.mkdir(temporary, 0o777)
        yield temporary
        _fsync_folder(temporary)
        if keep_unchanged and _holds_same_files(temporary, target):
            return
        if fill:
            entries = sorted(temporary.iterdir())
            # a device or FIFO of an entry's name is written, not replaced; before the renames, with signals live
            # (a FIFO's open waits for its reader)
            in_place = [entry for entry in entries if written_in_place(target / entry.name)]
            for entry in in_place:
                if entry.is_dir():
                    raise NotADirectoryError(
                        errno.ENOTDIR, "not a folder, and not replaced by one", str(target / entry.name)
                    )
                with open(entry, "rb") as source, open(target / entry.name, "wb") as destination:
                    shutil.copyfileobj(source, destination)
            with _signals_deferred():
                for entry in entries:
                    if entry in in_place:
                        continue
                    if entry.is_dir():
                        _swap(entry, target / entry.name)
                    else:
                        os.replace(entry, target / entry.name)
        else:
            _swap(temporary, target)
    except BaseException as err:
        shutil.rmtree(temporary, ignore_errors=True)
        _remove_empty(created)
        named = _named(err, temporary, target, existed)
        if named is not None:
            raise named from err
        raise
    finally:
        if os.path.lexists(temporary):  # left by a swap that kept the target (keep_unchanged) or a merge
            shutil.rmtree(temporary, ignore_errors=True)


@contextlib.contextmanager
def sigterm_as_interrupt(received: list[int] | None = None) -> Iterator[None]:
    """Inside the block SIGTERM raises ``KeyboardInterrupt`` (and is appended to `received`), so that clean-ups
    run as for Ctrl-C; the previous handler is restored after. Outside the main thread it does nothing (Python
    runs signal handlers there only).

    Python runs a handler between any two bytecodes, so the signal may land inside a weakref callback or a
    ``__del__`` (an import's module-lock callback, a tensor freed), where an exception is printed as "Exception
    ignored in ..." and dropped: the process would go on as if never stopped. Such a dropped interrupt is not
    printed; SIGTERM is sent to the main thread again a moment later, until it lands where it can stop the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    ours: list[KeyboardInterrupt] = []  # the interrupts this block raised, to know them when one is dropped
    again: list[threading.Timer] = []

    def interrupt(signum, frame):
        if received is not None and not again:  # a signal sent again is the same stop, counted once
            received.append(signum)
        ours.append(KeyboardInterrupt(f"signal {signal.Signals(signum).name}"))
        raise ours[-1]

    def dropped(unraisable) -> None:
        if not any(unraisable.exc_value is error for error in ours):
            return previous_hook(unraisable)
        resend = threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, signal.SIGTERM))
        resend.daemon = True
        again.append(resend)
        resend.start()

    previous_hook, sys.unraisablehook = sys.unraisablehook, dropped
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        for resend in again:  # a signal sent again after the block would meet the previous handler
            resend.cancel()
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        sys.unraisablehook = previous_hook


__all__ = [
    "STREAMS",
    "atomic_file",
    "atomic_folder",
    "sigterm_as_interrupt",
    "write_bytes",
    "write_text",
    "written_in_place",
]
