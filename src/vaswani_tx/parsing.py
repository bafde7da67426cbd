"""English constituency parsing with the same model (paper Section 6.3): treebank data, repair, scoring, recipe.

The paper trains "a 4-layer transformer with d_model = 1024 on the Wall Street Journal (WSJ) portion of
the Penn Treebank, about 40K training sentences" and reads the parse off as a sequence, the set-up of
Vinyals et al. (2015), "Grammar as a Foreign Language": source = the sentence's words, target = its
linearised tree. This module holds every step between a treebank and an F1:

- :func:`read_treebank` reads Penn Treebank bracketed files, ``.mrg`` (a tree over several lines) or one
  tree per line, and names file, line and column of anything that is not a tree.
- :func:`normalize_tree` (EVALB's preprocessing; see ``metrics/vaswani_parseval``) strips empty
  elements (``-NONE-``) and the constituents they leave empty, function tags and indices
  (``NP-SBJ-1`` -> ``NP``) and the unlabelled outer bracket.
- :func:`linearize` writes a normalised tree as tokens, :func:`delinearize` reads tokens back into a
  tree with the sentence's words, repairing whatever a model may generate.
- :func:`bracket_f1` is the EVALB scorer (``COLLINS.prm``: punctuation and root ignored, ADVP = PRT);
  the same code is the ``vaswani_parseval`` evaluate module (``evaluation.load_metric("vaswani_parseval")``).
- :func:`parse` decodes sentences with a saved model; :func:`run_recipe` (``vaswani-tx parse run``)
  linearises a training split, trains with :func:`vaswani_tx.recipe.train`, parses a test split and scores it.

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
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

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
    "Tree",
    "TreebankFormatError",
    "bracket_f1",
    "delinearize",
    "linearize",
    "normalize_tree",
    "parse",
    "parse_tree",
    "read_treebank",
    "read_trees",
    "replace_tags",
    "run_recipe",
    "tree_to_example",
    "write_examples",
]

logger = logging.getLogger(__name__)

PLACEHOLDER = "XX"  # Vinyals et al. (2015): every POS tag, and so every word, becomes XX in the target
# The leaves of a target tree, saved as `tree_leaves` in a parser's generation config: "XX" (Vinyals et al.) or
# "words", the sentence's own words, which the decoder then reads back as it writes the tree: where it is in the
# sentence is in its input, not a count of XX it must keep, and it can match its last word against the source.
TREE_LEAVES = ("XX", "words")


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
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
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


def parse(
    model: str | os.PathLike | Any,
    sentences: Sequence[Sequence[str]],
    num_beams: int | None = None,
    batch_size: int = 32,
    tags: bool = False,
    constrained: bool = True,
) -> list[Tree]:
    """Parse tokenised sentences (lists of words) with a saved parser; one tree per sentence.

    ``model`` is a model folder or a loaded :class:`~vaswani_tx.translation.Translator`. Decoding uses the
    model's ``generation_config`` (Section 6.3's beam 21, alpha 0.3 and input + 300 when trained with
    ``configs/train/wsj-parse*.yaml``); ``num_beams`` overrides the beam only. ``constrained`` (the
    default) restricts every hypothesis to a well-formed tree over exactly the sentence's words
    (:class:`~vaswani_tx.tree_decoding.TreeConstraint`; it needs a word-level target vocabulary);
    ``constrained=False`` is the paper's plain beam search, whose output the repair (:func:`delinearize`)
    makes a tree. The leaves are the model's ``tree_leaves`` (its generation config; ``"XX"`` when unset).
    """
    from vaswani_tx.translation import Translator, load_translator
    from vaswani_tx.tree_decoding import TreeConstraint

    translator = model if isinstance(model, Translator) else load_translator(model)
    lines = [" ".join(words) for words in sentences]
    tokenizer = translator.tokenizer
    leaves = getattr(translator.model.generation_config, "tree_leaves", "XX")
    if leaves not in TREE_LEAVES:
        raise ValueError(f"the model's generation config has tree_leaves={leaves!r}; expected one of {TREE_LEAVES}")
    processors_for = None
    if constrained:
        vocabulary = tokenizer.get_vocab()
        offset = getattr(translator.model.generation_config, "max_output_length_offset", None)
        # refuses a vocabulary without whole brackets before any decoding
        TreeConstraint(vocabulary, tokenizer.eos_token_id, [], leaf_ids=[] if leaves == "words" else None)

        def processors_for(indices: list[int]) -> list:
            # the tokens each source has (</s> included) are what SourceLengthCap adds the offset to
            sources = [tokenizer(lines[i]).input_ids for i in indices]
            return [
                TreeConstraint(
                    vocabulary,
                    tokenizer.eos_token_id,
                    [len(sentences[i]) for i in indices],
                    max_new_tokens=None if offset is None else [len(ids) + int(offset) for ids in sources],
                    leaf_ids=[ids[:-1] for ids in sources] if leaves == "words" else None,
                )
            ]

    # word leaves keep <unk> (a rare word is still a leaf); only the sequence markers are dropped
    outputs = translator.translate(
        lines,
        num_beams=num_beams,
        batch_size=batch_size,
        processors_for=processors_for,
        skip_special_tokens=leaves == "XX",
    )
    if leaves == "words":
        markers = {tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token}
        outputs = [" ".join(token for token in text.split() if token not in markers) for text in outputs]
    return [delinearize(text, words, tags) for text, words in zip(outputs, sentences)]


def _check_constrainable(recipe: Any, leaves: str, config: str | os.PathLike) -> None:
    """Refuse, before training, a run whose vocabulary constrained decoding cannot use (see :func:`parse`)."""
    from vaswani_tx.tokenization import load_tokenizer
    from vaswani_tx.tree_decoding import TreeConstraint

    if (Path(recipe.tokenizer) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(recipe.tokenizer)
        try:
            TreeConstraint(
                tokenizer.get_vocab(), tokenizer.eos_token_id, [], leaf_ids=[] if leaves == "words" else None
            )
        except ValueError as err:
            raise ValueError(f"tokenizer {recipe.tokenizer}: {err}") from None
    elif recipe.tokenizer_kind != "word":
        raise ValueError(
            f"run config {config}: decoding constrained to trees (the default) needs a word-level vocabulary, "
            f"and this config trains a {recipe.tokenizer_kind} one: set tokenizer_kind: word, or give "
            "--unconstrained (the paper's plain beam search, repaired into trees)"
        )


def write_trees(trees: Iterable[Tree], path: str | os.PathLike) -> None:
    """One tree per line (EVALB's input format)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("".join(f"{tree}\n" for tree in trees), encoding="utf-8")


def run_recipe(
    config: str | os.PathLike,
    train_trees: Sequence[str],
    dev_trees: Sequence[str],
    test_trees: Sequence[str],
    overrides: Sequence[str] = (),
    resume: bool = False,
    num_beams: int | None = None,
    max_length: int | None = None,
    constrained: bool = True,
) -> dict[str, Any]:
    """Section 6.3 end to end: linearise the splits, train, parse the test trees, score them.

    The run config (``configs/train/wsj-parse*.yaml``) is an ordinary training config whose
    ``train_source``/``train_target``/``dev_source``/``dev_target`` are the files this writes from
    ``train_trees``/``dev_trees`` (paths or globs of treebank files). After training, the final model in
    ``output_dir`` (or, with ``average_last`` > 1 and enough checkpoints, their average in
    ``output_dir/averaged``, Section 6.1) parses the test trees' words. Written to ``output_dir``:
    ``test.gold`` and ``test.parsed`` (one normalised tree per line) and ``parse_scores.json``: precision,
    recall, F1 and exact match of all test sentences and F1 of those of at most 40 words (``f1_40``), or only
    of sentences up to ``max_length`` words. While training, each evaluation also logs the dev trees'
    bracketing F1 (greedy, :class:`~vaswani_tx.tree_decoding.DevBracketF1Callback`), drawn in ``curves.png``.
    ``constrained`` decodes with :class:`~vaswani_tx.tree_decoding.TreeConstraint` (see :func:`parse`). The
    target trees' leaves are ``XX`` or, with ``tree_leaves: words`` in the config's ``generation:`` block
    (saved with the model), the words themselves.
    Under several processes every process trains and process 0 alone parses and scores.
    """
    from vaswani_tx.recipe import load_run_config, train
    from vaswani_tx.tree_decoding import DevBracketF1Callback

    started = time.monotonic()

    recipe, arguments = load_run_config(config, overrides)
    leaves = (recipe.generation or {}).get("tree_leaves", "XX")
    if leaves not in TREE_LEAVES:
        raise ValueError(f"run config {config}: generation: tree_leaves={leaves!r} is not one of {TREE_LEAVES}")
    if constrained:  # found now, not after hours of training: the test parse needs whole bracket tokens
        _check_constrainable(recipe, leaves, config)
    test = read_treebank(test_trees)
    if not test:
        raise ValueError(f"no trees in the test files {' '.join(map(str, test_trees))}")
    dev: list[Tree] = []
    with arguments.main_process_first(local=False, desc="treebank"):  # process 0 writes, the others wait
        for name, patterns, source, target in (
            ("train", train_trees, recipe.train_source, recipe.train_target),
            ("dev", dev_trees, recipe.dev_source, recipe.dev_target),
        ):
            if source is None or target is None:
                raise ValueError(f"run config {config} must name {name}_source and {name}_target files to write")
            if arguments.process_index == 0:
                trees = read_treebank(patterns)
                if not trees:
                    raise ValueError(f"no trees in the {name} files {' '.join(map(str, patterns))}")
                count = write_examples(trees, source, target, words=leaves == "words")
                logger.info("%s: %d trees -> %s, %s", name, count, source, target)
                dev = trees if name == "dev" else dev
    callbacks = [DevBracketF1Callback(dev, constrained=constrained)] if arguments.eval_strategy != "no" else []
    metrics = train(recipe, arguments, resume=resume, callbacks=callbacks)
    if arguments.process_index != 0:
        return metrics
    model_dir = Path(metrics.get("averaged", arguments.output_dir))  # train() averaged the last checkpoints
    parse_started = time.monotonic()
    predicted = parse(model_dir, [tree.words() for tree in test], num_beams=num_beams, constrained=constrained)
    parse_seconds = round(time.monotonic() - parse_started, 1)
    output_dir = Path(arguments.output_dir)
    write_trees(test, output_dir / "test.gold")
    write_trees(predicted, output_dir / "test.parsed")
    if num_beams is None:
        from transformers import GenerationConfig

        num_beams = GenerationConfig.from_pretrained(model_dir).num_beams
    scores = {
        "model": str(model_dir),
        "test_trees": len(test),
        "num_beams": num_beams,
        "constrained": constrained,
        "parse_seconds": parse_seconds,
        **bracket_f1(test, predicted, max_length=max_length),
    }
    if max_length is None:
        scores["f1_40"] = bracket_f1(test, predicted, max_length=40)["f1"]
    scores["seconds"] = round(time.monotonic() - started, 1)  # this call: training, averaging and parsing
    (output_dir / "parse_scores.json").write_text(json.dumps(scores, indent=1) + "\n", encoding="utf-8")
    return {**metrics, "parse": scores}
