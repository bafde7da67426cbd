"""`vaswani_parseval`: labelled bracketing precision, recall and F1 with EVALB's conventions (paper Section 6.3).

An ``evaluate`` metric module that loads offline from the installed package
(``vaswani_tx.metrics.evaluation.load_metric(name="vaswani_parseval")``, or ``evaluate.load(<path of this file>)``).
``evaluate`` copies this one file into its module cache and imports it from there, so it imports only
``evaluate`` and ``datasets``; the tree reader, the normalisation and the scorer all live here, and
``vaswani_tx.parsing.parsing`` imports them from this file (one copy of the code). Where ``vaswani_tx`` is
installed, its errors for bad trees are ``vaswani_tx.model.errors.UserInputError`` (the CLI's exit 2); without
it, plain ``ValueError``.

Scoring follows EVALB (Sekine and Collins, 1997) with the ``COLLINS.prm`` parameters that every WSJ
section-23 figure since Collins (1997), the paper's Table 4 included, was computed with:

* a bracket is ``(label, start, end)`` over word positions; preterminals (POS tags) are not brackets;
* the root is not a bracket: an outermost node labelled ``""`` (PTB's ``( (S ...) )``), ``TOP`` or ``ROOT``;
* punctuation is deleted before spans are counted: every word whose *gold* POS tag is one of
  ``'' `` . : ,`` (``DELETE_LABEL``) is removed from both trees (EVALB's 2006 fix uses the gold tag for
  both sides), and a bracket left spanning no word is dropped;
* ``ADVP`` and ``PRT`` are the same label (``EQ_LABEL ADVP PRT``);
* brackets are a multiset: a unary chain ``(NP (NP ...))`` is two brackets, matched one to one;
* complete match (exact match) is a sentence whose gold and predicted brackets are equal as multisets;
  crossing counts the predicted brackets that cross some gold bracket;
* optionally only sentences of at most ``max_length`` words (EVALB's ``CUTOFF_LEN``, 40 in the
  ``len<=40`` summary) are scored; length counts punctuation, as EVALB does.

Before scoring, both trees are normalised with :func:`normalize_tree` (idempotent, so normalised input
is unchanged): empty elements (``-NONE-`` leaves) and the constituents they leave empty are removed,
and function tags and indices are stripped (``NP-SBJ-1`` -> ``NP``, ``NP=2`` -> ``NP``), the usual
preprocessing of every WSJ parser evaluation. Labels that are whole ``-XXX-`` tokens (``-LRB-``,
``-NONE-``) are kept as they are.

Differences from the C program: a sentence whose gold and predicted words differ in number raises
``UserInputError`` (a ``ValueError``) naming it (EVALB skips it and counts an error, which would let a broken
parser score well); predicted POS tags are not scored (tagging accuracy is not reported: parsers in the style
of Vinyals et al. (2015) predict no tags).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence

import datasets
import evaluate

# Bad trees are user input inside vaswani_tx; evaluate's own copy of this file needs no vaswani_tx (its scan
# for required packages reads unindented imports only).
try:
    from vaswani_tx.model.errors import UserInputError
except ImportError:
    UserInputError = ValueError

_CITATION = """\
@inproceedings{vaswani2017attention,
  title={Attention Is All You Need},
  author={Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion and Gomez, Aidan N and Kaiser, Lukasz and Polosukhin, Illia},
  booktitle={Advances in Neural Information Processing Systems},
  year={2017}
}
@misc{sekine1997evalb,
  title={{EVALB} Bracket Scoring Program},
  author={Sekine, Satoshi and Collins, Michael},
  year={1997},
  url={https://nlp.cs.nyu.edu/evalb/}
}
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions: predicted trees, each a bracketed string such as ``(S (NP (XX The) (XX dog)) (VP (XX barks)))``.
    references: gold trees, same format (Penn Treebank ``( (S ...) )`` with function tags and ``-NONE-`` is fine).
    max_length: score only sentences of at most this many words (EVALB's CUTOFF_LEN); ``None`` scores all.
Returns:
    precision, recall, f1, exact_match (percentages, 0-100 as EVALB prints them), average_crossing,
    no_crossing (percentage of sentences), matched_brackets, gold_brackets, predicted_brackets, sentences.
"""

PUNCTUATION_TAGS = frozenset({"''", "``", ".", ":", ","})  # COLLINS.prm DELETE_LABEL for words
ROOT_LABELS = frozenset({"", "TOP", "ROOT"})  # COLLINS.prm DELETE_LABEL TOP; PTB leaves the root unlabelled
EQUIVALENT_LABELS = {"PRT": "ADVP"}  # COLLINS.prm EQ_LABEL ADVP PRT
EMPTY_ELEMENT_TAG = "-NONE-"


class TreebankFormatError(UserInputError):
    """Bracketed text that is not a tree; the message starts with ``source:line:column``."""


class Tree:
    """A constituent: a label and its children, each a ``Tree`` or (for a preterminal) one word string.

    ``line`` is where the tree's opening bracket was read (1-based), or ``None`` for a tree built in code.
    Equality compares labels and children only.
    """

    __slots__ = ("label", "children", "line")

    def __init__(self, label: str, children: Sequence[Tree | str], line: int | None = None) -> None:
        self.label = label
        self.children = list(children)
        self.line = line

    @property
    def is_preterminal(self) -> bool:
        return len(self.children) == 1 and isinstance(self.children[0], str)

    def preterminals(self) -> Iterator[Tree]:
        """The ``(TAG word)`` nodes, left to right."""
        if self.is_preterminal:
            yield self
            return
        for child in self.children:
            if isinstance(child, Tree):
                yield from child.preterminals()

    def words(self) -> list[str]:
        return [node.children[0] for node in self.preterminals()]

    def tags(self) -> list[str]:
        return [node.label for node in self.preterminals()]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Tree):
            return NotImplemented
        return self.label == other.label and self.children == other.children

    __hash__ = None  # mutable

    def __repr__(self) -> str:
        return f"Tree({str(self)!r})"

    def __str__(self) -> str:
        """One line of Penn Treebank brackets; an unlabelled root prints as ``( (S ...))``."""
        inner = " ".join(str(child) for child in self.children)
        return f"({self.label} {inner})" if self.label or not inner else f"( {inner})"


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def iter_trees(text: str, source: str = "<string>") -> Iterator[Tree]:
    """The trees of bracketed text: ``.mrg`` files (trees over several lines) and one-tree-per-line alike.

    Each top-level ``( ... )`` is one tree; ``((S`` without a space is read like ``( (S``.

    Raises:
        TreebankFormatError: ``source:line:column: what is wrong`` for a closing bracket with nothing
            open, a bracket left open at the end (its opening line), text outside any bracket, a
            constituent with no children, or a word beside constituents or beside another word.
    """
    # stack of [label, children, line, column]; label None until the first token after "(" is seen
    stack: list[list] = []
    line, line_start, scanned = 1, 0, 0  # line number and start offset of the text up to `scanned`

    def where(offset: int) -> tuple[int, int]:
        nonlocal line, line_start, scanned
        newlines = text.count("\n", scanned, offset)
        if newlines:
            line += newlines
            line_start = text.rindex("\n", scanned, offset) + 1
        scanned = offset
        return line, offset - line_start + 1

    def fail(offset: int, message: str) -> TreebankFormatError:
        return TreebankFormatError(f"{source}:{':'.join(map(str, where(offset)))}: {message}")

    for match in _TOKEN.finditer(text):
        token, offset = match.group(), match.start()
        if token == "(":
            if stack and stack[-1][0] is None:
                stack[-1][0] = ""  # "( (" : an unlabelled node
            stack.append([None, [], *where(offset)])
        elif token == ")":
            if not stack:
                raise fail(offset, "')' closes no open bracket")
            label, children, opened_line, opened_column = stack.pop()
            opened = f"opened at line {opened_line} column {opened_column}"
            if not children:
                raise fail(offset, f"constituent {label or '()'!s} {opened} has no children")
            words = [child for child in children if isinstance(child, str)]
            if words and (len(children) > 1):
                raise fail(
                    offset,
                    f"({label} ...) {opened} mixes the word {words[0]!r} with other children: "
                    "a word must be a preterminal's only child",
                )
            tree = Tree(label or "", children, opened_line)
            if stack:
                stack[-1][1].append(tree)
            else:
                yield tree
        else:
            if not stack:
                raise fail(offset, f"{token!r} is outside any bracket")
            if stack[-1][0] is None:
                stack[-1][0] = token
            else:
                stack[-1][1].append(token)
    if stack:
        _, _, opened_line, opened_column = stack[0]
        raise TreebankFormatError(
            f"{source}:{opened_line}:{opened_column}: '(' opened here is never closed (the text ends first)"
        )


def read_trees(text: str, source: str = "<string>") -> list[Tree]:
    """All trees of bracketed text (see :func:`iter_trees`)."""
    return list(iter_trees(text, source))


def parse_tree(text: str) -> Tree:
    """Exactly one tree from a string; raises :class:`TreebankFormatError` otherwise."""
    trees = read_trees(text)
    if len(trees) != 1:
        raise TreebankFormatError(f"<string>:1:1: expected one tree, found {len(trees)}")
    return trees[0]


_FUNCTION_TAG = re.compile(r"^([^-=]+)[-=].*$")


def strip_function_tags(label: str) -> str:
    """``NP-SBJ-1`` -> ``NP``, ``NP=2`` -> ``NP``, ``PP-LOC`` -> ``PP``; ``-LRB-``, ``-NONE-`` unchanged."""
    if label.startswith("-") and label.endswith("-"):
        return label
    match = _FUNCTION_TAG.match(label)
    return match.group(1) if match else label


def normalize_tree(tree: Tree) -> Tree:
    """The tree parsers are trained and scored on (idempotent; the input is not modified).

    1. ``(-NONE- *T*-1)`` empty elements are removed, then every constituent left with no words;
    2. function tags and indices are stripped from constituent labels (POS tags too: ``NN`` stays ``NN``);
    3. an outer root (label ``""``, ``TOP`` or ``ROOT``) with exactly one constituent below it is removed,
       so the tree's top is the sentence's own constituent (``S``, ``NP``, ``FRAG`` ...); a root over a
       bare ``(TAG word)`` or over several constituents stays.

    A tree that is nothing but empty elements comes back as an empty root ``Tree("", [])``.
    """
    cleaned = _without_empty_elements(tree)
    if cleaned is None:
        return Tree("", [], tree.line)
    only = cleaned.children[0] if len(cleaned.children) == 1 else None
    if cleaned.label in ROOT_LABELS and isinstance(only, Tree) and not only.is_preterminal:
        cleaned = only
    cleaned.line = tree.line
    return cleaned


def _without_empty_elements(tree: Tree) -> Tree | None:
    if tree.is_preterminal:
        return None if tree.label == EMPTY_ELEMENT_TAG else Tree(tree.label, tree.children, tree.line)
    kept = [child for child in (_without_empty_elements(c) for c in tree.children if isinstance(c, Tree)) if child]
    if not kept:
        return None
    label = tree.label if tree.label in ROOT_LABELS else strip_function_tags(tree.label)
    return Tree(label, kept, tree.line)


def _brackets(tree: Tree, deleted: set[int], is_root: bool = True) -> Counter:
    """Multiset of (label, start, end) over word positions with ``deleted`` positions removed."""
    brackets: Counter = Counter()
    position = 0  # index into all words
    kept = 0  # index into kept words

    def walk(node: Tree, root: bool) -> None:
        nonlocal position, kept
        if node.is_preterminal:
            if position not in deleted:
                kept += 1
            position += 1
            return
        start = kept
        for child in node.children:
            if isinstance(child, Tree):
                walk(child, False)
        if kept > start and not (root and node.label in ROOT_LABELS):
            brackets[(EQUIVALENT_LABELS.get(node.label, node.label), start, kept)] += 1

    walk(tree, is_root)
    return brackets


def _crossing(predicted: Counter, gold: Counter) -> int:
    spans = {(start, end) for _, start, end in gold}
    count = 0
    for (_, start, end), times in predicted.items():
        if any(s < start < e < end or start < s < end < e for s, e in spans):
            count += times
    return count


def sentence_brackets(gold: Tree, predicted: Tree, index: int = 0) -> tuple[Counter, Counter, int]:
    """Both normalised trees' bracket multisets and the sentence length (EVALB's, punctuation included)."""
    gold, predicted = normalize_tree(gold), normalize_tree(predicted)
    gold_tags, predicted_words = gold.tags(), predicted.words()
    if len(gold_tags) != len(predicted_words):
        raise UserInputError(
            f"sentence {index + 1}: the gold tree has {len(gold_tags)} words, the predicted tree "
            f"{len(predicted_words)}; trees must cover the same words"
        )
    deleted = {i for i, tag in enumerate(gold_tags) if tag in PUNCTUATION_TAGS}
    return _brackets(gold, deleted), _brackets(predicted, deleted), len(gold_tags)


def bracket_scores(
    gold_trees: Sequence[Tree | str], predicted_trees: Sequence[Tree | str], max_length: int | None = None
) -> dict[str, float | int]:
    """Corpus labelled bracketing scores (EVALB ``COLLINS.prm``; see the module docstring).

    Trees may be :class:`Tree` objects or bracketed strings. Percentages are 0-100.

    Raises:
        UserInputError: the two lists differ in length, or a sentence's trees differ in word count.
    """
    if len(gold_trees) != len(predicted_trees):
        raise UserInputError(f"{len(gold_trees)} gold trees but {len(predicted_trees)} predicted trees")
    matched = gold_total = predicted_total = exact = crossing = no_crossing = sentences = 0
    for index, (gold, predicted) in enumerate(zip(gold_trees, predicted_trees)):
        gold = parse_tree(gold) if isinstance(gold, str) else gold
        predicted = parse_tree(predicted) if isinstance(predicted, str) else predicted
        gold_brackets, predicted_brackets, length = sentence_brackets(gold, predicted, index)
        if max_length is not None and length > max_length:
            continue
        sentences += 1
        matched += sum((gold_brackets & predicted_brackets).values())
        gold_total += sum(gold_brackets.values())
        predicted_total += sum(predicted_brackets.values())
        exact += gold_brackets == predicted_brackets
        crossed = _crossing(predicted_brackets, gold_brackets)
        crossing += crossed
        no_crossing += crossed == 0
    precision = 100.0 * matched / predicted_total if predicted_total else 0.0
    recall = 100.0 * matched / gold_total if gold_total else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "exact_match": 100.0 * exact / sentences if sentences else 0.0,
        "average_crossing": crossing / sentences if sentences else 0.0,
        "no_crossing": 100.0 * no_crossing / sentences if sentences else 0.0,
        "matched_brackets": matched,
        "gold_brackets": gold_total,
        "predicted_brackets": predicted_total,
        "sentences": sentences,
    }


@evaluate.utils.file_utils.add_start_docstrings(__doc__, _KWARGS_DESCRIPTION)
class VaswaniParseval(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
            codebase_urls=["https://nlp.cs.nyu.edu/evalb/"],
            reference_urls=["https://arxiv.org/abs/1706.03762"],
        )

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add predicted and gold trees as strings (``Tree`` objects are converted)."""
        if predictions is not None and references is not None and len(predictions) != len(references):
            raise ValueError(f"{len(references)} gold trees but {len(predictions)} predicted trees")
        predictions = None if predictions is None else [str(tree) for tree in predictions]
        references = None if references is None else [str(tree) for tree in references]
        super().add_batch(predictions=predictions, references=references, **kwargs)

    def _compute(self, predictions, references, max_length=None):
        return bracket_scores(references, predictions, max_length=max_length)
