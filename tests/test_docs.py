"""The README and the guides: every relative link and anchor resolves, and every `vaswani-tx` command they name
exists (its `--help` runs)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "model_card.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    found = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: path.name)
def test_every_relative_link_and_anchor_resolves(document):
    broken = []
    for target in LINK.findall(document.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        path = (document.parent / file).resolve() if file else document
        if not path.exists() or anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{document.name}: links that do not resolve: {broken}"


def test_every_command_the_readme_and_guides_name_exists():
    named = set()
    for document in DOCUMENTS:
        # (not a path's: `VASWANI_TX=.venv/bin/vaswani-tx bash ...` names the program, then runs a script)
        named.update(re.findall(r"(?<![/\w])vaswani-tx ([a-z][a-z0-9-]+)", document.read_text(encoding="utf-8")))
    for command in sorted(named):
        done = subprocess.run(
            [sys.executable, "-m", "vaswani_tx.cli", command, "--help"], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"vaswani-tx {command} --help: {done.stderr[-500:]}"
