"""Decoding that yields trees: beam search restricted to well-formed linearised parses (Section 6.3).

The paper decodes its parser with plain beam search (beam 21, alpha 0.3) and, as Vinyals et al. (2015),
repairs what is not a tree. :class:`TreeConstraint` makes repair unnecessary: at every step it forbids the
tokens that would leave the hypothesis unable to end as a tree over exactly the sentence's words, so every
finished hypothesis, in every beam, is one. With ``n`` the sentence's word count, a hypothesis may not

- close a bracket when none is open, or right after an opening one (a constituent holds at least one word);
- close its outermost bracket before all ``n`` leaves are placed (one top-level constituent, as PTB's trees
  below their root);
- open a bracket, or place a leaf, once all ``n`` leaves are placed;
- place a leaf outside every bracket, or write a token that is neither a bracket nor the leaf: ``XX``, or, for
  a parser whose leaves are the words themselves (``leaf_ids``), the sentence's next word and no other;
- end (``</s>``) while brackets are open or leaves are missing, or before it has begun;
- open a bracket when the tokens left under its length cap cannot close everything and place the rest
  of the leaves.

It is a transformers ``LogitsProcessor``: forbidden tokens get ``-inf`` before the beam's top-k. The state of
each hypothesis (open brackets, leaves placed) is recomputed from its tokens at each step, a few vectorised
operations over the batch, so beam reordering needs no bookkeeping.

:func:`parse` decodes sentences into trees with a saved parser, constrained or (the paper's way) repaired;
:class:`DevBracketF1Callback` scores the model being trained with it. The trees, the linearisation and the
scorer are ``vaswani_tx.parsing.parsing``; the run that trains a parser is ``vaswani_tx.parsing.parse_run``.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from transformers import LogitsProcessor

from vaswani_tx.engine.translation import Translator, load_translator
from vaswani_tx.model.errors import UserInputError
from vaswani_tx.parsing.parsing import (
    PLACEHOLDER,
    TREE_LEAVES,
    UNKNOWN_WORDS,
    Tree,
    bracket_f1,
    delinearize,
    word_class,
)
from vaswani_tx.training.checkpoints import TrainingClock

logger = logging.getLogger(__name__)

_OTHER, _OPEN, _CLOSE, _LEAF, _EOS = range(5)


class TreeConstraint(LogitsProcessor):
    """Only well-formed trees with exactly ``word_counts[i]`` leaves for sentence ``i`` (see the module docstring).

    Args:
        vocabulary: the tokenizer's ``get_vocab()``: tokens ``(LABEL`` open, ``)LABEL`` close, ``XX`` is the leaf.
            Each must be one token (a word-level target vocabulary, ``tokenizer_kind: word``).
        eos_token_id: the end-of-sentence id.
        word_counts: words per sentence (B,); rows of beams are matched to their sentence by position
            (generate() lays them out sentence-major).
        max_new_tokens: optional per-sentence cap on generated tokens, ``</s>`` included (B,), as
            :class:`~vaswani_tx.model.generation_vaswani.SourceLengthCap` applies it; openings that could not be
            closed in time are forbidden.
        prompt_length: tokens before the first generated one (the decoder start token: 1).
        leaf_ids: for a parser whose leaves are the words (``tree_leaves: words``), each sentence's token ids
            (one per word, ``</s>`` not included): the leaf at each position may only be the next word's id,
            and any token that is not a bracket or ``</s>`` counts as a leaf. That leaf is scored with the
            model's probability of writing *any* word there (log-sum-exp over the words): the words are given,
            so the choice is between placing the next word and a bracket, and a rare word's own low
            probability must not push the parse into brackets.
    """

    def __init__(
        self,
        vocabulary: dict[str, int],
        eos_token_id: int,
        word_counts: Sequence[int] | torch.Tensor,
        max_new_tokens: Sequence[int] | torch.Tensor | None = None,
        prompt_length: int = 1,
        leaf_ids: Sequence[Sequence[int]] | None = None,
    ):
        size = max(vocabulary.values()) + 1
        kinds = torch.full((size,), _OTHER, dtype=torch.long)
        for token, index in vocabulary.items():
            if token.startswith("(") and len(token) > 1:
                kinds[index] = _OPEN
            elif token.startswith(")") and len(token) > 1:
                kinds[index] = _CLOSE
            elif token == PLACEHOLDER or leaf_ids is not None:
                kinds[index] = _LEAF
        kinds[eos_token_id] = _EOS
        self.eos_index = eos_token_id
        wanted = [(_OPEN, "opening brackets such as (NP"), (_CLOSE, "closing brackets")]
        for kind, what in wanted + ([] if leaf_ids is not None else [(_LEAF, "XX")]):
            if not (kinds == kind).any():
                raise UserInputError(
                    f"the target vocabulary has no {what} as whole tokens: constrained decoding needs a "
                    "word-level parser vocabulary (tokenizer_kind: word), or decode with --unconstrained"
                )
        self.kinds = kinds
        self.word_counts = torch.as_tensor(word_counts, dtype=torch.long)
        self.max_new_tokens = None if max_new_tokens is None else torch.as_tensor(max_new_tokens, dtype=torch.long)
        self.prompt_length = prompt_length
        self.leaf_ids = None
        if leaf_ids is not None:
            if [len(ids) for ids in leaf_ids] != self.word_counts.tolist():
                raise UserInputError(
                    "leaf_ids must hold one token id per word of each sentence (a word-level vocabulary)"
                )
            width = max((len(ids) for ids in leaf_ids), default=0) or 1
            self.leaf_ids = torch.tensor([list(ids) + [eos_token_id] * (width - len(ids)) for ids in leaf_ids])

    def select_sources(self, sources: torch.Tensor) -> TreeConstraint:
        """This constraint for a subset of its sentences (beam search drops the finished ones from its rows)."""
        selected = copy.copy(self)
        selected.word_counts = self.word_counts[sources.to(self.word_counts.device)]
        if self.max_new_tokens is not None:
            selected.max_new_tokens = self.max_new_tokens[sources.to(self.max_new_tokens.device)]
        if self.leaf_ids is not None:
            selected.leaf_ids = self.leaf_ids[sources.to(self.leaf_ids.device)]
        return selected

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        device = scores.device
        kinds = self.kinds.to(device)
        rows = input_ids.shape[0]
        per_sentence = rows // self.word_counts.numel()
        words = self.word_counts.to(device).repeat_interleave(per_sentence)  # (rows,)
        generated = input_ids[:, self.prompt_length :]
        # ids beyond the table (a model larger than its tokenizer) count as "other"
        token_kinds = kinds[generated.clamp(max=kinds.numel() - 1)]
        token_kinds = torch.where(generated < kinds.numel(), token_kinds, _OTHER)
        depth = (token_kinds == _OPEN).sum(1) - (token_kinds == _CLOSE).sum(1)  # (rows,)
        leaves = (token_kinds == _LEAF).sum(1)
        steps = generated.shape[1]
        last = token_kinds[:, -1] if steps else torch.full((rows,), _OTHER, device=device)
        done = leaves >= words

        vocab_kinds = kinds[None, :]  # (1, size)
        allowed = torch.zeros(rows, kinds.numel(), dtype=torch.bool, device=device)
        can_open = ~done
        if self.max_new_tokens is not None:
            budget = self.max_new_tokens.to(device).repeat_interleave(per_sentence) - steps  # tokens left, </s> too
            # after this opening: the missing leaves, depth + 1 closings and </s>
            can_open &= 1 + (words - leaves) + (depth + 1) + 1 <= budget
        can_close = (depth > 0) & (last != _OPEN) & ~((depth == 1) & ~done)
        can_leaf = (depth > 0) & ~done
        can_end = (depth == 0) & done & (steps > 0)
        allowed |= (vocab_kinds == _OPEN) & can_open[:, None]
        allowed |= (vocab_kinds == _CLOSE) & can_close[:, None]
        if self.leaf_ids is None:
            allowed |= (vocab_kinds == _LEAF) & can_leaf[:, None]
        else:  # the next word, and only it, scored as the model's mass on placing any word here
            table = self.leaf_ids.to(device).repeat_interleave(per_sentence, dim=0)
            following = table.gather(1, leaves.clamp(max=table.shape[1] - 1)[:, None])[:, 0]
            row_index = torch.arange(rows, device=device)
            allowed[row_index, following] |= can_leaf
            width = min(scores.shape[1], kinds.numel())
            is_word = (kinds[:width] == _LEAF)[None, :]
            word_mass = scores[:, :width].masked_fill(~is_word, -float("inf")).logsumexp(1)
            scores = scores.clone()
            scores[row_index, following] = torch.where(can_leaf, word_mass, scores[row_index, following])
        allowed |= (vocab_kinds == _EOS) & can_end[:, None]
        # a row with nothing left (one that has ended, or a sentence longer than its cap allows) may only end
        allowed[:, self.eos_index] |= ~allowed.any(1)
        # the model's extra rows (embedding larger than the vocabulary) are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, scores.shape[1] - allowed.shape[1]))[:, : scores.shape[1]]
        return scores.masked_fill(~allowed, -float("inf"))


def _with_classes(sentences: Sequence[Sequence[str]], tokenizer) -> list[list[str]]:
    """Each word the tokenizer does not know replaced by its class, where the vocabulary has that class
    (``unknown_words: classes``; the word stays ``<unk>`` otherwise)."""
    vocabulary = tokenizer.get_vocab()
    mapped = []
    for words in sentences:
        # one id per word in a word-level vocabulary (the tokenizer's normaliser decides what it knows), </s> last
        ids = tokenizer(" ".join(words)).input_ids[:-1]
        if len(ids) != len(words):  # not one id per word: TreeConstraint names the problem
            mapped.append(list(words))
            continue
        mapped.append(
            [
                word_class(word) if index == tokenizer.unk_token_id and word_class(word) in vocabulary else word
                for word, index in zip(words, ids)
            ]
        )
    return mapped


def parse(
    model: str | os.PathLike | Any,
    sentences: Sequence[Sequence[str]],
    num_beams: int | None = None,
    batch_size: int = 32,
    tags: bool = False,
    constrained: bool = True,
    truncate: bool = False,
) -> list[Tree]:
    """Parse tokenised sentences (lists of words) with a saved parser; one tree per sentence.

    ``model`` is a model folder or a loaded :class:`~vaswani_tx.engine.translation.Translator`. Decoding uses the
    model's ``generation_config`` (Section 6.3's beam 21, alpha 0.3 and input + 300 when trained with
    ``configs/train/wsj-parse*.yaml``); ``num_beams`` overrides the beam only. ``constrained`` (the
    default) restricts every hypothesis to a well-formed tree over exactly the sentence's words
    (:class:`TreeConstraint`; it needs a word-level target vocabulary); ``constrained=False`` is the paper's
    plain beam search, whose output the repair (:func:`~vaswani_tx.parsing.parsing.delinearize`) makes a tree. The
    leaves are the model's ``tree_leaves`` (its generation config; ``"XX"`` when unset). A model trained with
    ``unknown_words: classes`` reads each word outside its vocabulary as that word's class
    (:func:`~vaswani_tx.parsing.parsing.word_class`); the trees keep the words themselves. A sentence longer than
    the model's positions is refused, naming it, unless ``truncate`` (`Translator.translate`'s).
    """
    translator = model if isinstance(model, Translator) else load_translator(model)
    tokenizer = translator.tokenizer
    generation_config = translator.model.generation_config
    leaves = getattr(generation_config, "tree_leaves", "XX")
    if leaves not in TREE_LEAVES:
        raise UserInputError(
            f"the model's generation config has tree_leaves={leaves!r}; expected one of {TREE_LEAVES}"
        )
    unknown = getattr(generation_config, "unknown_words", "unk")
    if unknown not in UNKNOWN_WORDS:
        raise UserInputError(
            f"the model's generation config has unknown_words={unknown!r}; expected one of {UNKNOWN_WORDS}"
        )
    lines = [" ".join(words) for words in sentences]
    if unknown == "classes":
        lines = [" ".join(words) for words in _with_classes(sentences, tokenizer)]
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
        truncate=truncate,
    )
    if leaves == "words":
        markers = {tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token}
        outputs = [" ".join(token for token in text.split() if token not in markers) for text in outputs]
    return [delinearize(text, words, tags) for text, words in zip(outputs, sentences)]


class DevBracketF1Callback(TrainingClock):
    """At each evaluation, parse the dev trees' sentences with the model being trained and log their EVALB
    bracketing F1 (``eval_bracket_f1``, with precision, recall and the training minutes so far) into the
    Trainer's log history, which ``curves.png`` draws against minutes.

    Greedy by default (``num_beams=1``): a dev F1 every evaluation should cost seconds, not the test
    set's beam 21. The minutes are wall-clock time in `train()` since it started or resumed, added to
    the last minutes logged before a resume.
    """

    def __init__(self, dev_trees: Sequence, constrained: bool = True, num_beams: int = 1, batch_size: int = 64):
        self.dev_trees = list(dev_trees)
        self.constrained = constrained
        self.num_beams = num_beams
        self.batch_size = batch_size
        super().__init__()

    def on_evaluate(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not state.is_world_process_zero or model is None or processing_class is None or not self.dev_trees:
            return
        was_training = model.training
        model.eval()
        sentences = [tree.words() for tree in self.dev_trees]
        predicted = parse(
            Translator(model, processing_class),
            sentences,
            num_beams=self.num_beams,
            batch_size=self.batch_size,
            constrained=self.constrained,
        )
        model.train(was_training)
        scores = bracket_f1(self.dev_trees, predicted)
        minutes = self.minutes()
        entry = {
            "eval_bracket_f1": round(scores["f1"], 2),
            "eval_bracket_precision": round(scores["precision"], 2),
            "eval_bracket_recall": round(scores["recall"], 2),
            "train_minutes": round(minutes, 2),
            "step": state.global_step,
        }
        state.log_history.append(entry)
        logger.info(
            "dev bracketing F1 %.2f (P %.2f, R %.2f) at step %d, %.1f training minutes",
            scores["f1"],
            scores["precision"],
            scores["recall"],
            state.global_step,
            minutes,
        )


__all__ = ["DevBracketF1Callback", "TreeConstraint", "parse"]
