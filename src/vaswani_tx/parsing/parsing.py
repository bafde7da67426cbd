"""English constituency parsing with the same model (paper Section 6.3): treebank data, linearisation, repair, scoring.

The paper trains "a 4-layer transformer with d_model = 1024 on the Wall Street Journal (WSJ) portion of
the Penn Treebank, about 40K training sentences" and reads the parse off as a sequence, the set-up of
Vinyals et al. (2015), "Grammar as a Foreign Language": source = the sentence's words, target = its
linearised tree. This module holds every step between a treebank and an F1 that needs no model (it imports
no torch); decoding sentences into trees is ``vaswani_tx.parsing.tree_decoding``, the run (linearise, train, parse,
score) ``vaswani_tx.parsing.parse_run``:

- :func:`read_treebank` reads Penn Treebank bracketed files, ``.mrg`` (a tree over several lines) or one
  tree per line, and names file, line and column of anything that is not a tree.
- :func:`normalize_tree` (EVALB's preprocessing; see ``metrics/vaswani_parseval``) strips empty
  elements (``-NONE-``) and the constituents they leave empty, function tags and indices
  (``NP-SBJ-1`` -> ``NP``) and the unlabelled outer bracket.
- :func:`linearize` writes a normalised tree as tokens, :func:`delinearize` reads tokens back into a
  tree with the sentence's words, repairing whatever a model may generate.
- :func:`bracket_f1` is the EVALB scorer (``COLLINS.prm``: punctuation and root ignored, ADVP = PRT);
  the same code is the ``vaswani_parseval`` evaluate module (``evaluation.load_metric("vaswani_parseval")``).
- :func:`write_examples` and :func:`write_trees` write the line-aligned training files and EVALB's input.
- :func:`word_class`, :func:`known_words` and :func:`replace_rare_words`: rare and unseen words as classes
  of their shape (``unknown_words: classes``), so that a word outside the vocabulary still tells the model
  that it is capitalised, a number or ends in ``-ing``.

The target sequence (Vinyals et al., 2015, Section 2): ``(S (NP XX XX )NP (VP XX (NP XX )NP )VP XX )S``
for ``(S (NP (DT The) (NN dog)) (VP (VBZ chased) (NP (PRP it))) (. .))``. Each constituent opens with
``(LABEL`` and closes with ``)LABEL``, and every word is the placeholder ``XX``:

- *Words are not in the target*: the source already holds them and EVALB requires the parse to keep them
  unchanged, so writing them again only lets the model misspell them; with one ``XX`` per word the
  word count of a generated tree is checkable, and the repair step puts the source words back in order.
- *POS tags are replaced by* ``XX`` (as Vinyals et al.): EVALB F1, the paper's figure, does not score
  tags, and one leaf token keeps targets short (about 3.5 tokens per word on the sample). ``tags=True``
  keeps the tags as the leaf tokens instead, for a parser that should also tag.
- *Closing brackets carry their label* (as Vinyals et al.): the label is redundant, but it tells the
  decoder which constituent it is closing; :func:`delinearize` ignores it.

The repair (Vinyals et al.: "add or remove brackets and XX to make the tree well formed") never raises:
a closing bracket with nothing open is dropped, brackets still open at the end are closed, leaf tokens
beyond the sentence's length are dropped and missing ones are appended to the last top-level constituent,
constituents left without words are removed, and several top-level pieces are joined under an
unlabelled root (which the scorer ignores, like PTB's own root). Any token that is not a bracket is
read as a leaf, so a sequence of random tokens still yields a tree over exactly the sentence's words.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path

from vaswani_tx.atomic import write_text
from vaswani_tx.metrics.vaswani_parseval.vaswani_parseval import (
    ROOT_LABELS,
    Tree,
    TreebankFormatError,
    bracket_scores,
    normalize_tree,
    parse_tree,
    read_trees,
)

__all__ = [
    "PLACEHOLDER",
    "TREE_LEAVES",
    "UNKNOWN_WORDS",
    "Tree",
    "TreebankFormatError",
    "bracket_f1",
    "delinearize",
    "linearize",
    "normalize_tree",
    "parse_tree",
    "read_treebank",
    "known_words",
    "read_trees",
    "replace_rare_words",
    "replace_tags",
    "tree_to_example",
    "word_class",
    "write_examples",
    "write_trees",
]

logger = logging.getLogger(__name__)

PLACEHOLDER = "XX"  # Vinyals et al. (2015): every POS tag, and so every word, becomes XX in the target
# The leaves of a target tree, saved as `tree_leaves` in a parser's generation config: "XX" (Vinyals et al.) or
# "words", the sentence's own words, which the decoder then reads back as it writes the tree: where it is in the
# sentence is in its input, not a count of XX it must keep, and it can match its last word against the source.
TREE_LEAVES = ("XX", "words")
# What a word outside the vocabulary becomes, saved as `unknown_words` in a parser's generation config: "unk" (the
# tokenizer's <unk>, one id for every such word) or "classes" (word_class: one id per shape of word, learned from
# the training words too rare to keep whole, as the Berkeley parser's unknown-word signatures).
UNKNOWN_WORDS = ("unk", "classes")

# Suffixes that mark a part of speech in English (Petrov et al.'s Berkeley parser signatures), longest first
_SUFFIXES = ("ment", "ness", "ing", "ion", "ity", "ble", "ive", "ous", "est", "ed", "ly", "er", "al", "ic", "s", "y")


def expand_paths(patterns: Iterable[str | os.PathLike]) -> list[Path]:
    """Files named by paths or glob patterns, each pattern's matches sorted; a pattern matching nothing is an error."""
    files: list[Path] = []
    for pattern in patterns:
        pattern = str(pattern)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        if not matches:
            raise FileNotFoundError(f"no treebank file matches {pattern!r}")
        for match in matches:
            if not Path(match).is_file():
                raise FileNotFoundError(f"treebank file {match} does not exist")
            files.append(Path(match))
    return files


def read_treebank(patterns: str | os.PathLike | Iterable[str | os.PathLike], normalize: bool = True) -> list[Tree]:
    """The trees of Penn Treebank files (``.mrg`` or one tree per line), in file order.

    ``patterns`` are paths or globs (``"wsj/2[0-1]/*.mrg"``). With ``normalize`` each tree goes through
    :func:`normalize_tree`; trees left with no word (only empty elements) are dropped with a warning.

    Raises:
        TreebankFormatError: ``file:line:column: problem`` for malformed brackets (a ``ValueError``);
            also for bytes that are not UTF-8.
        FileNotFoundError: a path or pattern that names no file.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    trees: list[Tree] = []
    for path in expand_paths(patterns):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise TreebankFormatError(f"{path}:{line}: byte 0x{raw[err.start]:02x} is not UTF-8") from None
        for tree in read_trees(text, source=str(path)):
            if normalize:
                normalized = normalize_tree(tree)
                if not normalized.children:
                    logger.warning(
                        "%s:%s: tree has no words once empty elements are removed; skipped", path, tree.line
                    )
                    continue
                tree = normalized
            trees.append(tree)
    return trees


def replace_tags(tree: Tree, tag: str = PLACEHOLDER) -> Tree:
    """A copy of ``tree`` with every POS tag replaced by ``tag`` (what :func:`delinearize` returns by default)."""
    if tree.is_preterminal:
        return Tree(tag, tree.children, tree.line)
    return Tree(tree.label, [replace_tags(child, tag) for child in tree.children], tree.line)


def linearize(tree: Tree, tags: bool = False, words: bool = False) -> list[str]:
    """The target tokens of a (normalised) tree: ``(LABEL`` ... ``)LABEL``, one leaf token per word.

    Leaf tokens are :data:`PLACEHOLDER`, with ``tags`` the POS tags, or with ``words`` the words themselves
    (``(S (NP The dog )NP (VP barked )VP . )S``: see :data:`TREE_LEAVES`). A root (``""``, ``TOP``,
    ``ROOT``) is not written: :func:`delinearize` restores an unlabelled one where it is needed.
    """
    tokens: list[str] = []

    def walk(node: Tree) -> None:
        if node.is_preterminal:
            tokens.append(node.children[0] if words else node.label if tags else PLACEHOLDER)
            return
        tokens.append("(" + node.label)
        for child in node.children:
            walk(child)
        tokens.append(")" + node.label)

    for child in tree.children if tree.label in ROOT_LABELS else [tree]:
        walk(child)
    return tokens


def tree_to_example(tree: Tree, tags: bool = False, words: bool = False) -> tuple[str, str]:
    """``(source, target)`` strings of a normalised tree: its words and its linearisation, space-separated."""
    return " ".join(tree.words()), " ".join(linearize(tree, tags, words))


_BRACKET_CHARACTERS = re.compile(r"[()]")


def delinearize(tokens: Sequence[str] | str, words: Sequence[str], tags: bool = False) -> Tree:
    """A well-formed tree over exactly ``words`` from any token sequence (the repair; see the module docstring).

    ``tokens`` may be a string (split on whitespace). Leaf tokens become ``(XX word)``, or with ``tags``
    ``(TOKEN word)``. Never raises for any tokens and words; for a sentence with no words the result is
    an empty root ``Tree("", [])``. ``delinearize(linearize(t), t.words()) == replace_tags(t)`` for every
    normalised tree ``t``, and ``== t`` with ``tags=True`` on both sides.
    """
    if isinstance(tokens, str):
        tokens = tokens.split()
    words = list(words)
    root = Tree("", [])
    stack = [root]
    leaves = 0
    for token in tokens:
        if token.startswith("("):
            label = _BRACKET_CHARACTERS.sub("", token)
            if label:  # a bare "(" names no constituent: dropped
                node = Tree(label, [])
                stack[-1].children.append(node)
                stack.append(node)
        elif token.startswith(")"):
            if len(stack) > 1:  # a ")" with nothing open is dropped
                stack.pop()
        elif leaves < len(words):  # leaves beyond the sentence's length are dropped
            tag = token if tags and not _BRACKET_CHARACTERS.search(token) else PLACEHOLDER
            stack[-1].children.append(Tree(tag, [words[leaves]]))
            leaves += 1
    if leaves < len(words):  # too few leaves: the rest of the words join the last top-level constituent
        last = root.children[-1] if root.children else None
        top = last if last is not None and not last.is_preterminal else root
        top.children.extend(Tree(PLACEHOLDER, [word]) for word in words[leaves:])
    root = _prune(root) or Tree("", [])
    if len(root.children) == 1 and not root.children[0].is_preterminal:
        return root.children[0]
    return root


def _prune(node: Tree) -> Tree | None:
    """``node`` without constituents that cover no word (None when nothing is left)."""
    if node.is_preterminal:
        return node
    kept = [child for child in (_prune(c) for c in node.children) if child is not None]
    return Tree(node.label, kept) if kept else None


def word_class(word: str) -> str:
    """The class of a word kept out of the vocabulary: its shape, as the Berkeley parser's unknown-word
    signatures (Petrov et al., 2006): ``<unk-CAP-DIG-DASH-ing>`` names the case (an initial capital ``CAP``,
    a capital inside ``MIXCAP``, lower case only ``LOW``), digits (``DIG``), a hyphen (``DASH``) and an English
    suffix marking a part of speech; ``<unk-OTHER>`` is a word with none of these (symbols). Never a bracket
    token, never a word of the treebank (it starts with ``<``), and never the tokenizer's own ``<unk>``."""
    features = []
    if word[:1].isupper():
        features.append("CAP")
    elif any(character.isupper() for character in word):
        features.append("MIXCAP")
    elif any(character.islower() for character in word):
        features.append("LOW")
    digits = any(character.isdigit() for character in word)
    if digits:
        features.append("DIG")
    if "-" in word:
        features.append("DASH")
    lowered = word.lower()
    suffix = next((s for s in _SUFFIXES if len(lowered) > len(s) + 1 and lowered.endswith(s)), None)
    if suffix and not digits:
        features.append(suffix)
    return "<unk-" + "-".join(features or ["OTHER"]) + ">"


def known_words(
    trees: Sequence[Tree], vocab_size: int, reserved: int, min_count: int = 2, copies: int = 1
) -> set[str]:
    """The training words a word-level vocabulary of ``vocab_size`` (``reserved`` of them special tokens) keeps whole once the others are :func:`word_class` classes: the most frequent (ties by spelling)
    seen at least ``min_count`` times, as many as fit beside the trees' bracket tokens and the classes of the
    words left out, so that the vocabulary learned from the written files is exactly ``vocab_size`` when the
    corpus has that many tokens. The words seen fewer times always become classes: they are what the model learns
    the classes from, as it will meet unseen words. ``copies``: how often the files hold each word (2 when the
    target's leaves are the words too), for the vocabulary trainer's own ``min_count``."""
    counts = Counter(word for tree in trees for word in tree.words())
    brackets = Counter(token for tree in trees for token in linearize(tree) if token != PLACEHOLDER)
    slots = reserved + sum(1 for count in brackets.values() if count >= min_count)
    ranked = sorted((word for word, count in counts.items() if count >= min_count), key=lambda w: (-counts[w], w))
    rare = [word for word, count in counts.items() if count < min_count]
    kept = len(ranked)
    while True:
        classes: Counter[str] = Counter()
        for word in (*ranked[kept:], *rare):
            classes[word_class(word)] += counts[word] * copies
        room = vocab_size - slots - sum(1 for count in classes.values() if count >= min_count)
        if kept <= room:
            return set(ranked[:kept])
        kept = max(room, 0)


def replace_rare_words(tree: Tree, known: Collection[str]) -> Tree:
    """``tree`` with every word not in ``known`` replaced by its :func:`word_class` (tags and brackets kept)."""
    if tree.is_preterminal:
        word = tree.children[0]
        return Tree(tree.label, [word if word in known else word_class(word)], tree.line)
    return Tree(tree.label, [replace_rare_words(child, known) for child in tree.children], tree.line)


def write_examples(
    trees: Sequence[Tree],
    source_path: str | os.PathLike,
    target_path: str | os.PathLike,
    tags: bool = False,
    words: bool = False,
) -> int:
    """Write line-aligned source (words) and target (linearised tree) files; returns the number of lines."""
    sources, targets = zip(*(tree_to_example(tree, tags, words) for tree in trees)) if trees else ((), ())
    for path, lines in ((source_path, sources), (target_path, targets)):
        write_text(path, "".join(line + "\n" for line in lines))
    return len(trees)


def bracket_f1(
    gold_trees: Sequence[Tree | str], predicted_trees: Sequence[Tree | str], max_length: int | None = None
) -> dict[str, float | int]:
    """Labelled bracketing precision, recall, F1 (EVALB ``COLLINS.prm``), exact match and counts.

    Trees may be :class:`Tree` objects or bracketed strings; both sides are normalised first. Returns
    ``precision``, ``recall``, ``f1``, ``exact_match``, ``no_crossing`` (percentages, 0-100),
    ``average_crossing``, ``matched_brackets``, ``gold_brackets``, ``predicted_brackets``, ``sentences``.
    ``max_length=40`` gives EVALB's ``len<=40`` figures.
    """
    return bracket_scores(gold_trees, predicted_trees, max_length=max_length)


def write_trees(trees: Iterable[Tree], path: str | os.PathLike) -> None:
    """One tree per line (EVALB's input format), whole or not at all (`vaswani_tx.atomic.write_text`)."""
    write_text(path, "".join(f"{tree}\n" for tree in trees))
