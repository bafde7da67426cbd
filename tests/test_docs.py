"""The README and the guides: every relative link and anchor resolves, every `vaswani-tx` command they name
exists (its `--help` runs), they hold what is true now (no dates, commits or earlier figures) in the field's words,
within their line budgets; and one version throughout."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "model_card.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
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


# ---- reference, not history ----

REFERENCE = [ROOT / "README.md", ROOT / "model_card.md", *sorted((ROOT / "docs").glob("*.md"))]
DATE = re.compile(r"\b(19|20)\d\d-[01]\d-[0-3]\d\b")
# a commit hash: 7-40 hex digits holding both a digit and a letter (so neither "1234567" nor "defaced" counts)
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
EARLIER = re.compile(r"\bwas \d[\d.,]*x|\ba stop later\b|\btoday's\b|\bthe run before\b", re.IGNORECASE)
PRIVATE = re.compile(
    r"a sentence a call|\bthe screen\b|the few-rows step|held-aside half|issue 29's bar", re.IGNORECASE
)


def _hits(pattern: re.Pattern, documents) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}:{number}: {match[0]!r}"
        for path in documents
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        for match in pattern.finditer(line)
    ]


def test_the_history_patterns_catch_what_they_are_for_and_nothing_else():
    assert DATE.search("measured 2026-11-26 on") and not DATE.search("lines 1-507, 2,048 tokens, 1e-9")
    assert COMMIT.search("a fresh clone of commit 26215c4") and COMMIT.search("at 59a16c2b")
    assert not COMMIT.search("1234567 2048000 defaced facade 0.63-1.05x sha256 e5a3-f2")
    assert EARLIER.search("It was 1.02x before") and EARLIER.search("Today's suite")
    assert not EARLIER.search("the runs before the split; 1.02x faster")


def test_the_readme_model_card_and_guides_hold_no_dates_commits_or_earlier_figures():
    """History (a run's date and commit, what a figure was) goes to benchmarks/results/LOG.md and *.jsonl only."""
    found = _hits(DATE, REFERENCE) + _hits(COMMIT, REFERENCE) + _hits(EARLIER, REFERENCE)
    assert not found, "history in the reference documents (move it to benchmarks/results/LOG.md):\n" + "\n".join(found)


def _docstrings_and_cli_text() -> list[tuple[str, str]]:
    """Every docstring under src/, and every string of the CLI modules (their help texts)."""
    texts = []
    for path in sorted((ROOT / "src" / "vaswani_tx").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        name = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                texts.append((name, ast.get_docstring(node) or ""))
            elif path.parent.name == "cli" and isinstance(node, ast.Constant) and isinstance(node.value, str):
                texts.append((name, node.value))
    return texts


def test_no_private_words_in_the_documents_docstrings_or_cli_help():
    """The field's usual words: a single sentence per request, batch size, throughput, held-out half (the
    source's comments and the tests' docstrings too: a newcomer reads them)."""
    found = _hits(PRIVATE, REFERENCE + sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").glob("*.py")))
    found += [f"{name}: {match[0]!r}" for name, text in _docstrings_and_cli_text() for match in PRIVATE.finditer(text)]
    found = [hit for hit in found if not hit.startswith("tests/test_docs.py")]  # the pattern itself
    assert not found, "words a reader cannot know:\n" + "\n".join(found)


# ---- sizes and versions ----


def test_the_readme_and_guides_keep_to_their_budgets():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 180, f"README.md: {len(readme)} lines, at most 180"
    long = [number for number, line in enumerate(readme, 1) if len(line) > 500]
    assert not long, f"README.md: lines over 500 characters: {long}"
    lines = {path.name: len(path.read_text(encoding="utf-8").splitlines()) for path in (ROOT / "docs").glob("*.md")}
    assert lines["decoding.md"] <= 250 and lines["benchmarks.md"] <= 200, lines
    assert sum(lines.values()) <= 1400, f"docs/: {sum(lines.values())} lines in all, at most 1,400 ({lines})"


def test_one_version_in_pyproject_package_changelog_and_citation():
    import vaswani_tx

    pyproject = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(encoding="utf-8"), re.M)[1]
    changelog = re.search(r"^- \*\*([^*]+)\*\*", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)[1]
    citation = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert pyproject == vaswani_tx.__version__ == changelog == str(citation["version"])
    assert citation["cff-version"] == "1.2.0" and "Attention Is All You Need" in str(citation["preferred-citation"])
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]
