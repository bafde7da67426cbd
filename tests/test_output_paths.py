"""Output paths that are not regular files (issue 83): only regular files are replaced whole; a character device, a
FIFO or a link to one is written where it is, with or without --force; `-o -` and `-o /dev/stdout` print; a link
to a regular file stays a link; no command puts a file or a folder where a device or a FIFO was."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import threading
from pathlib import Path

import pytest

from vaswani_tx.atomic import atomic_folder, write_text
from vaswani_tx.cli import main
from vaswani_tx.folders import refuse_to_replace

FAST = ["--num-beams", "1", "--max-length-offset", "2", "--quiet", "--device", "cpu"]
SENTENCES = ["Ein Hund läuft.", "Eine Frau liest."]


def translate(folder: Path, *options: str) -> int:
    return main(["translate", str(folder), *SENTENCES, *FAST, *options])


@pytest.fixture(scope="module")
def printed(tiny_translator) -> str:
    """What `translate` prints for SENTENCES without -o."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert translate(tiny_translator[0]) == 0
    assert out.getvalue().count("\n") == len(SENTENCES)
    return out.getvalue()


def is_char_device(path: str | Path) -> bool:
    return stat.S_ISCHR(os.lstat(path).st_mode)


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
def test_dev_null_is_written_not_replaced(tiny_translator, force, capsys):
    assert is_char_device("/dev/null")
    assert translate(tiny_translator[0], "-o", "/dev/null", *force) == 0, capsys.readouterr().err
    assert is_char_device("/dev/null")
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("force", [[], ["--force"]], ids=["", "force"])
def test_a_fifo_is_written_through_to_its_reader(tiny_translator, printed, tmp_path, force):
    fifo = tmp_path / "translations"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text(encoding="utf-8")), daemon=True)
    reader.start()
    assert translate(tiny_translator[0], "-o", str(fifo), *force) == 0
    reader.join(timeout=60)
    assert received == [printed]
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


def test_a_link_to_a_device_writes_through_the_link(tiny_translator, tmp_path):
    link = tmp_path / "out.txt"
    link.symlink_to("/dev/null")
    assert translate(tiny_translator[0], "-o", str(link), "--force") == 0
    assert link.is_symlink() and os.readlink(link) == "/dev/null" and is_char_device("/dev/null")


def test_a_link_to_a_regular_file_stays_a_link(tiny_translator, printed, tmp_path, capsys):
    (tmp_path / "real.txt").write_text("earlier\n", encoding="utf-8")
    link = tmp_path / "out.txt"
    link.symlink_to("real.txt")
    assert translate(tiny_translator[0], "-o", str(link)) == 2
    assert "already exists" in capsys.readouterr().err and (tmp_path / "real.txt").read_text() == "earlier\n"
    assert translate(tiny_translator[0], "-o", str(link), "--force") == 0
    assert link.is_symlink() and (tmp_path / "real.txt").read_text(encoding="utf-8") == printed


@pytest.mark.parametrize("output", ["-", "/dev/stdout"])
def test_dash_and_dev_stdout_print(tiny_translator, printed, output, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a file named "-" would be made here
    assert translate(tiny_translator[0], "-o", output, "--force") == 0
    assert capsys.readouterr().out == printed
    assert not (tmp_path / "-").exists() and Path("/dev/stdout").is_symlink()
    write_text(output, "one line\n")  # the writer every command uses
    assert capsys.readouterr().out == "one line\n"


def test_no_folder_is_put_where_a_device_or_a_fifo_is(tiny_translator, tmp_path, capsys):
    assert main(["attention", str(tiny_translator[0]), "--sentence", "Ein Hund.", "-o", "/dev/null", "--force"]) == 2
    assert "output folder /dev/null is a character device, not a folder" in capsys.readouterr().err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotADirectoryError, match="not a folder"), atomic_folder(fifo) as partial:
        (partial / "x").write_text("x")
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["fifo"]
    refuse_to_replace([fifo, "/dev/null", "-"], force=False)  # written, never replaced: nothing to refuse


def test_a_merge_writes_a_device_of_an_entrys_name_and_moves_the_rest(tmp_path):
    (tmp_path / "maps").mkdir()
    (tmp_path / "maps" / "a.png").symlink_to("/dev/null")
    with atomic_folder(tmp_path / "maps", merge=True) as partial:
        (partial / "a.png").write_bytes(b"a")
        (partial / "b.png").write_bytes(b"b")
    assert (tmp_path / "maps" / "a.png").is_symlink() and is_char_device("/dev/null")
    assert (tmp_path / "maps" / "b.png").read_bytes() == b"b"
