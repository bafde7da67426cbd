"""Nothing native is ever loaded from a model folder (the hub's promise: weights are data; code runs only with
`trust_remote_code`, and then only Python).

A downloaded folder can hold anything, manifests included: anyone can recompute their digests. So a library is
planted in every place where earlier versions kept native code in the folder (beam-search/, kernels/, compiled*/,
each behind a manifest naming this torch and Python), and loading and translating the folder must never run it.
The planted library writes a marker file as it is loaded (a constructor), so a test that loaded it would see the
file.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *path = getenv("VASWANI_PLANTED_MARKER");
    FILE *marker = path ? fopen(path, "a") : NULL;
    if (marker) { fputs("the planted library ran\n", marker); fclose(marker); }
}
"""

# Where versions before 0.2 wrote native code into a model folder (`vaswani-tx compile`), with the library's name.
PLACES = {
    "beam-search": "vaswani_tx_beams.so",
    "kernels": "int8_rows.so",
    **{
        folder: "decoder_step.pt2"
        for folder in (
            "compiled",
            "compiled-int8",
            "compiled-bf16",
            "compiled-few",
            "compiled-few-bf16",
            "compiled-few-int8",
            "compiled-encoder",
        )  # fmt: skip
    },
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def planted_library(tmp_path_factory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the planted library")
    folder = tmp_path_factory.mktemp("planted")
    (folder / "planted.c").write_text(PLANTED)
    subprocess.run(
        [compiler, "-shared", "-fPIC", str(folder / "planted.c"), "-o", str(folder / "planted.so")], check=True
    )
    return folder / "planted.so"


def plant(folder: Path, library: Path) -> None:
    """`library` in every place of `folder` that once held native code, behind a manifest that fits here."""
    import torch

    manifest = {"torch": torch.__version__, "python": sys.implementation.cache_tag, "library": sha256(library)}
    for place, name in PLACES.items():
        (folder / place).mkdir()
        if name.endswith(".pt2"):  # an AOTInductor package: a zip whose shared library the loader opens
            with zipfile.ZipFile(folder / place / name, "w") as package:
                package.write(library, "model/data/aotinductor/model/model.so")
        else:
            shutil.copyfile(library, folder / place / name)
        (folder / place / "manifest.json").write_text(json.dumps(manifest))


def test_the_planted_library_runs_when_loaded(planted_library, tmp_path, monkeypatch):
    """The test's own check: loading the planted library does write the marker, so a test below that finds no
    marker saw a library that was never loaded."""
    marker = tmp_path / "marker"
    code = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    env = {**os.environ, "VASWANI_PLANTED_MARKER": str(marker)}
    subprocess.run([sys.executable, "-c", code, str(planted_library)], check=True, env=env)
    assert marker.read_text() == "the planted library ran\n"


def test_loading_and_translating_a_folder_never_runs_a_library_planted_in_it(
    planted_library, tiny_translator, tmp_path
):
    """from_pretrained with and without trust_remote_code, generate (greedy, beam), the engine's int8 step, and
    `vaswani-tx translate` and `translate --int8`, each in a fresh process where nothing is loaded yet: the planted
    libraries are never loaded, and the model translates as it does from a clean folder."""
    source, _, _ = tiny_translator
    folder = tmp_path / "model"
    shutil.copytree(source, folder)
    plant(folder, planted_library)
    marker = tmp_path / "marker"
    env = {**os.environ, "VASWANI_PLANTED_MARKER": str(marker)}
    code = """
import sys, torch
from transformers import AutoModelForSeq2SeqLM
from vaswani_tx import VaswaniForConditionalGeneration
from vaswani_tx.engine import Translator
ids = torch.tensor([[5, 6, 7, 8, 3]])
outs = []
for kwargs in ({}, {"trust_remote_code": True}):
    model = AutoModelForSeq2SeqLM.from_pretrained(sys.argv[1], **kwargs)
    outs += [model.generate(input_ids=ids, num_beams=1, max_new_tokens=5), model.generate(input_ids=ids, num_beams=3, max_new_tokens=5)]
int8 = Translator(VaswaniForConditionalGeneration.from_pretrained(sys.argv[1]), compute_type="int8")
outs.append(int8.generate(ids, num_beams=2, max_new_tokens=5))
print([out.tolist() for out in outs])
"""
    clean = tmp_path / "clean"
    shutil.copytree(source, clean)
    runs = {}
    for where in (folder, clean):
        done = subprocess.run(
            [sys.executable, "-c", code, str(where)], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs[where] = done.stdout
    assert runs[folder] == runs[clean]
    cli = [sys.executable, "-m", "vaswani_tx.cli"]
    for extra in ([], ["--int8"], ["--num-beams", "1"]):
        done = subprocess.run(
            [*cli, "translate", *extra, str(folder), "A dog runs."], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
    assert not marker.exists(), "a library planted in the model folder was loaded"
