"""Libraries of our own C++ built once into a model folder by `vaswani-tx compile`: the int8 few-rows kernel
(int8_rows.py) and beam search's bookkeeping for one source (one_source_beams.py). Both are built with the C++
compiler for this torch (`torch.utils.cpp_extension`'s headers and libraries) and loaded only where the manifest
beside them says they were built for this torch from this source."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path

import torch

from .atomic import atomic_folder
from .compiled_decoding import MANIFEST, cache_root, file_sha256
from .errors import UserInputError


def build_into(
    target: Path,
    source: Path,
    library: str,
    what: str,
    manifest: dict,
    flags: tuple[str, ...] = (),
    python_module: str | None = None,
) -> Path:
    """Compile `source` into `target`/`library` (the folder replaced whole: `compile_library`), beside a manifest of
    what it was built for (`manifest`) and the library's own sha256; returns `target`.

    With `-fopenmp`, so that torch's `at::parallel_for` in the library shares its loops between torch's threads (the
    process's one OpenMP runtime, torch's own libgomp); without the flag it compiles to a loop on one thread. A
    compiler without OpenMP (clang without libomp) builds the library without it: the same results, on one thread."""
    with atomic_folder(target) as out:
        try:
            compile_library(source, out / library, what, (*flags, "-fopenmp"), python_module)
        except UserInputError:
            compile_library(source, out / library, what, flags, python_module)
        built = {**manifest, "library": file_sha256(out / library)}
        (out / MANIFEST).write_text(json.dumps(built, indent=1) + "\n", encoding="utf-8")
    return target


def compile_library(
    source: Path, library: Path, what: str, flags: tuple[str, ...] = (), python_module: str | None = None
) -> None:
    """Compile `source` into the shared library `library`; with `python_module`, as the Python extension module of
    that name (pybind11's, as torch's extensions are).

    Raises:
        UserInputError: "no {what}: ..." where there is no C++ compiler or it failed (its first error line)."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise UserInputError(f"no {what}: it needs a C++ compiler (g++), and none was found")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    includes = [*cpp_extension.include_paths()]
    libraries = ["-lc10", "-ltorch_cpu", "-ltorch"]
    if python_module is not None:
        flags = (*flags, f"-DTORCH_EXTENSION_NAME={python_module}", "-DTORCH_API_INCLUDE_EXTENSION_H")
        includes.append(sysconfig.get_paths()["include"])
        libraries.append("-ltorch_python")
    command = [
        compiler, "-O3", "-std=c++20", "-shared", "-fPIC", *flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in includes), str(source), "-o", str(library),
        *(f"-L{path}" for path in cpp_extension.library_paths()), *libraries,
    ]  # fmt: skip
    # A library built before by the same command from the same source (another model's folder) is copied, not built
    # again (10-20 s each), as torch keeps its extensions' builds (~/.cache/torch_extensions).
    built_by = [[part for part in command if part != str(library)], file_sha256(source)]
    key = hashlib.sha256(json.dumps(built_by).encode()).hexdigest()
    cached = cache_folder() / f"{source.stem}-{key[:24]}.so"
    if cached.is_file():
        shutil.copyfile(cached, library)
        return
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines()[-1:]
        raise UserInputError(f"no {what}: {compiler} failed ({(lines or ['?'])[0][:300]})")
    try:  # into the cache whole or not at all; a cache that cannot be written is only a later build's loss
        cached.parent.mkdir(parents=True, exist_ok=True)
        partial = cached.with_name(f".{cached.name}.{os.getpid()}")
        shutil.copyfile(library, partial)
        os.replace(partial, cached)
    except OSError:
        pass


def cache_folder() -> Path:
    """Where built libraries are kept for the next build of the same: the per-user cache's `libraries`
    (`compiled_decoding.cache_root`: $VASWANI_TX_CACHE, else $XDG_CACHE_HOME/vaswani_tx)."""
    return cache_root() / "libraries"
