"""The parse run (paper Section 6.3): linearise a treebank's splits, train the model on them, parse the test
split, score it (``vaswani-tx parse run``).

The parser is the translation recipe (``vaswani_tx.training.recipe.train``) on linearised trees; what is the parser's own
comes in from here: the dev trees' bracketing F1 at each evaluation (a callback) and ``tree_leaves``, the one
generation field its decoding reads beside ``GenerationConfig``'s, saved with the model so that
``parse predict`` decodes it as it was trained. It sits on top of the rest: the trees and the scorer
(``vaswani_tx.parsing.parsing``), decoding into trees (``vaswani_tx.parsing.tree_decoding``), the run config and the run.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vaswani_tx.atomic import write_text
from vaswani_tx.data.tokenization import SPECIAL_TOKENS, load_tokenizer
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.parsing.parsing import (
    TREE_LEAVES,
    UNKNOWN_WORDS,
    Tree,
    bracket_f1,
    known_words,
    read_treebank,
    replace_rare_words,
    write_examples,
    write_trees,
)
from vaswani_tx.parsing.tree_decoding import DevBracketF1Callback, TreeConstraint, parse
from vaswani_tx.training.checkpoints import refuse_earlier_run
from vaswani_tx.training.params import load_model_config
from vaswani_tx.training.recipe import set_generation_defaults, train
from vaswani_tx.training.run_config import RecipeConfig, load_run_config

logger = logging.getLogger(__name__)

# The generation fields of a parser beside GenerationConfig's: the leaves of its target trees (TREE_LEAVES) and what
# a word outside the vocabulary becomes (UNKNOWN_WORDS).
PARSER_GENERATION_FIELDS = ("tree_leaves", "unknown_words")


def set_parser_generation_defaults(model, values: dict[str, Any]) -> None:
    """:func:`~vaswani_tx.training.recipe.set_generation_defaults` for a parser: ``values`` may also hold
    ``tree_leaves`` and ``unknown_words`` (what :func:`run_recipe` has the training run save)."""
    set_generation_defaults(model, values, PARSER_GENERATION_FIELDS)


def _check_constrainable(recipe: RecipeConfig, leaves: str, config: str | os.PathLike) -> None:
    """Refuse, before training, a run whose vocabulary constrained decoding cannot use (see
    :func:`~vaswani_tx.parsing.tree_decoding.parse`)."""
    if (Path(recipe.tokenizer) / "tokenizer.json").is_file():
        tokenizer = load_tokenizer(recipe.tokenizer)
        try:
            TreeConstraint(
                tokenizer.get_vocab(), tokenizer.eos_token_id, [], leaf_ids=[] if leaves == "words" else None
            )
        except UserInputError as err:
            raise UserInputError(f"tokenizer {recipe.tokenizer}: {err}") from None
    elif recipe.tokenizer_kind != "word":
        raise UserInputError(
            f"run config {config}: decoding constrained to trees (the default) needs a word-level vocabulary, "
            f"and this config trains a {recipe.tokenizer_kind} one: set tokenizer_kind: word, or give "
            "--unconstrained (the paper's plain beam search, repaired into trees)"
        )


def _known_words(recipe: RecipeConfig, train: Sequence[Tree]) -> set[str]:
    """The training words kept whole under ``unknown_words: classes``: those of the run's tokenizer when it
    exists (a resumed run, or one given), else those its word-level vocabulary will keep
    (:func:`~vaswani_tx.parsing.parsing.known_words`), so that what training sees as a class is what decoding
    (:func:`~vaswani_tx.parsing.tree_decoding.parse`) maps to one."""
    if (Path(recipe.tokenizer) / "tokenizer.json").is_file():
        return set(load_tokenizer(recipe.tokenizer).get_vocab())
    vocab_size = recipe.tokenizer_vocab_size or load_model_config(recipe.model_config).vocab_size
    copies = 2 if (recipe.generation or {}).get("tree_leaves", "XX") == "words" else 1  # source, and target leaves
    known = known_words(train, vocab_size, reserved=len(SPECIAL_TOKENS), copies=copies)
    words = {word for tree in train for word in tree.words()}
    logger.info(
        "unknown_words: classes: %d of the %d training words kept whole, the others by their shape (word_class)",
        len(known),
        len(words),
    )
    return known


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
    force: bool = False,
    callbacks: Sequence[Any] = (),
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
    bracketing F1 (greedy, :class:`~vaswani_tx.parsing.tree_decoding.DevBracketF1Callback`), drawn in ``curves.png``.
    ``callbacks`` are added to the Trainer's (the command's `ReturnFreedMemory`). ``constrained`` decodes with :class:`~vaswani_tx.parsing.tree_decoding.TreeConstraint` (see
    :func:`~vaswani_tx.parsing.tree_decoding.parse`). The target trees' leaves are ``XX`` or, with ``tree_leaves: words``
    in the config's ``generation:`` block (saved with the model), the words themselves. With
    ``unknown_words: classes`` there, the training words that the vocabulary cannot keep whole, and every
    word seen once, are written as their class (:func:`~vaswani_tx.parsing.parsing.word_class`), and decoding maps
    any word outside the vocabulary the same way.
    Under several processes every process trains and process 0 alone parses and scores. An ``output_dir``
    holding another run's results is refused, before any file is written, unless ``force`` (see
    :func:`~vaswani_tx.training.recipe.train`).
    """
    started = time.monotonic()

    recipe, arguments = load_run_config(config, overrides)
    leaves = (recipe.generation or {}).get("tree_leaves", "XX")
    if leaves not in TREE_LEAVES:
        raise UserInputError(f"run config {config}: generation: tree_leaves={leaves!r} is not one of {TREE_LEAVES}")
    unknown = (recipe.generation or {}).get("unknown_words", "unk")
    if unknown not in UNKNOWN_WORDS:
        raise UserInputError(
            f"run config {config}: generation: unknown_words={unknown!r} is not one of {UNKNOWN_WORDS}"
        )
    if constrained:  # found now, not after hours of training: the test parse needs whole bracket tokens
        _check_constrainable(recipe, leaves, config)
    refuse_earlier_run(recipe, arguments, force)  # before the linearised files are written
    test = read_treebank(test_trees)
    if not test:
        raise UserInputError(f"no trees in the test files {' '.join(map(str, test_trees))}")
    dev: list[Tree] = []
    known: set[str] | None = None
    with arguments.main_process_first(local=False, desc="treebank"):  # process 0 writes, the others wait
        for name, patterns, source, target in (
            ("train", train_trees, recipe.train_source, recipe.train_target),
            ("dev", dev_trees, recipe.dev_source, recipe.dev_target),
        ):
            if source is None or target is None:
                raise UserInputError(f"run config {config} must name {name}_source and {name}_target files to write")
            if arguments.process_index == 0:
                trees = read_treebank(patterns)
                if not trees:
                    raise UserInputError(f"no trees in the {name} files {' '.join(map(str, patterns))}")
                dev = trees if name == "dev" else dev
                if unknown == "classes":
                    known = _known_words(recipe, trees) if known is None else known
                    trees = [replace_rare_words(tree, known) for tree in trees]
                count = write_examples(trees, source, target, words=leaves == "words")
                logger.info("%s: %d trees -> %s, %s", name, count, source, target)
    callbacks = [
        *callbacks,
        *([DevBracketF1Callback(dev, constrained=constrained)] if arguments.eval_strategy != "no" else []),
    ]
    metrics = train(
        recipe, arguments, resume=resume, callbacks=callbacks, generation_fields=PARSER_GENERATION_FIELDS, force=force
    )
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
    write_text(output_dir / "parse_scores.json", json.dumps(scores, indent=1) + "\n")
    return {**metrics, "parse": scores}


__all__ = ["PARSER_GENERATION_FIELDS", "run_recipe", "set_parser_generation_defaults"]
