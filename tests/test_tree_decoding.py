"""Constrained decoding for the parser (issue 20): every hypothesis is a well-formed tree over exactly the
sentence's words, whatever the scores; without the constraint, decoding is what it was."""

from __future__ import annotations

import math

import pytest
import torch

from vaswani_tx.engine.translation import load_translator
from vaswani_tx.parsing.parsing import delinearize
from vaswani_tx.parsing.tree_decoding import TreeConstraint, parse

# a word-level parser vocabulary: specials, brackets, the leaf, and words that must never be generated
TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "(S", ")S", "(NP", ")NP", "(VP", ")VP", "XX", "dog", "runs", "the", "."]
VOCAB = {token: index for index, token in enumerate(TOKENS)}
EOS = VOCAB["</s>"]


def well_formed(tokens: list[str], words: int, leaves_are: list[str] | None = None) -> bool:
    """One top-level constituent, balanced brackets, no empty constituent, `words` leaves: XX, or the words
    `leaves_are` in order."""
    stack: list[int] = []  # children so far of each open constituent
    closed, leaves = False, 0
    for token in tokens:
        if token.startswith("(") and not closed:
            stack.append(0)
        elif token.startswith(")") and stack and stack[-1] > 0:
            stack.pop()
            if stack:
                stack[-1] += 1
            else:
                closed = True
        elif stack and leaves < words and token == ("XX" if leaves_are is None else leaves_are[leaves]):
            stack[-1] += 1
            leaves += 1
        else:
            return False
    return closed and not stack and leaves == words


def beam_search(processor: TreeConstraint, generator: torch.Generator, beams: int, steps: int) -> list[list[str]]:
    """A short beam search on random scores: every finished hypothesis (ended with </s>), start token dropped."""
    sequences, totals, finished = [[VOCAB["<s>"]]], torch.zeros(1), []
    for _ in range(steps):
        scores = torch.randn(len(sequences), len(TOKENS), generator=generator).mul(3).log_softmax(-1)
        scores = processor(torch.tensor(sequences), scores)
        candidates = (totals[:, None] + scores).flatten()
        kept, kept_totals = [], []
        for value, flat in zip(*candidates.topk(2 * beams)):
            if math.isinf(value):
                break
            row, token = divmod(int(flat), len(TOKENS))
            if token == EOS:
                finished.append([TOKENS[t] for t in sequences[row][1:]])
            elif len(kept) < beams:
                kept.append(sequences[row] + [token])
                kept_totals.append(float(value))
        if not kept:
            break
        sequences, totals = kept, torch.tensor(kept_totals)
    return finished


def test_random_scores_through_a_beam_search_always_give_trees_over_the_words():
    generator = torch.Generator().manual_seed(0)
    for seed in range(500):
        words = 1 + seed % 7
        budget = words + 3 + seed % 11  # tokens allowed, </s> included: from the least a tree needs upwards
        processor = TreeConstraint(VOCAB, EOS, [words], max_new_tokens=[budget])
        finished = beam_search(processor, generator, beams=1 + seed % 4, steps=budget)
        assert finished, f"seed {seed}: no hypothesis ended within {budget} tokens"
        for tokens in finished:
            assert well_formed(tokens, words), (seed, words, tokens)
            assert len(tokens) + 1 <= budget


def test_with_word_leaves_each_leaf_is_the_next_word():
    generator = torch.Generator().manual_seed(1)
    words = ["the", "dog", "runs", "."]
    for seed in range(200):
        sentence = [words[(seed + i) % 4] for i in range(1 + seed % 6)]
        budget = len(sentence) + 3 + seed % 9
        ids = [[VOCAB[word] for word in sentence]]
        processor = TreeConstraint(VOCAB, EOS, [len(sentence)], max_new_tokens=[budget], leaf_ids=ids)
        finished = beam_search(processor, generator, beams=1 + seed % 3, steps=budget)
        assert finished, seed
        for tokens in finished:
            assert well_formed(tokens, len(sentence), leaves_are=sentence), (seed, sentence, tokens)
    with pytest.raises(ValueError, match="one token id per word"):
        TreeConstraint(VOCAB, EOS, [3], leaf_ids=[[11, 12]])


def test_rows_of_beams_follow_their_sentence_and_each_rule_holds():
    processor = TreeConstraint(VOCAB, EOS, [1, 2])
    ids = torch.tensor(
        [
            [2, 4, 10],  # sentence 0 (1 word): "(S XX": all words placed, only closing
            [2, 4, 10],  # sentence 0, second beam: the same
            [2, 4, 10],  # sentence 1 (2 words): one more leaf, or a closing? not the last bracket
            [2, 4, 6],  # sentence 1: "(S (NP": right after an opening, no closing
        ]
    )
    allowed = processor(ids, torch.zeros(4, len(TOKENS))).isfinite()
    named = [{TOKENS[i] for i in row.nonzero().flatten().tolist()} for row in allowed]
    assert named[0] == named[1] == {")S", ")NP", ")VP"}
    assert named[2] == {"(S", "(NP", "(VP", "XX"}  # closing the only open bracket would leave a word out
    assert named[3] == {"(S", "(NP", "(VP", "XX"}
    start = processor(torch.tensor([[2], [2]]), torch.zeros(2, len(TOKENS))).isfinite()
    assert {TOKENS[i] for i in start[0].nonzero().flatten().tolist()} == {"(S", "(NP", "(VP"}  # no leaf, no </s>


def test_a_vocabulary_without_whole_brackets_is_refused():
    with pytest.raises(ValueError, match="word-level parser vocabulary.*--unconstrained"):
        TreeConstraint({"<pad>": 0, "</s>": 1, "▁(": 2, "NP": 3, "XX": 4}, 1, [3])


@pytest.fixture(scope="module")
def tiny_parser(tmp_path_factory):
    """A random tiny model with a word-level vocabulary: what it generates is arbitrary, as needed here."""
    from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
    from vaswani_tx.data.tokenization import train_tokenizer

    folder = tmp_path_factory.mktemp("parser")
    text = folder / "corpus.txt"
    text.write_text(" ".join(TOKENS[4:]) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([text], "word", 100, min_frequency=1, show_progress=False)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=len(tokenizer), d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1
        )
    )
    model.generation_config.max_output_length_offset = 12
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    return folder / "model"


SENTENCES = [["the", "dog", "runs", "."], ["the", "dog"], ["runs"], ["the", "dog", "the", "dog", "runs", "."]]


@pytest.mark.parametrize("num_beams", [1, 4])
def test_a_random_model_parses_into_trees_over_the_words(tiny_parser, num_beams):
    translator = load_translator(tiny_parser)
    lines = [" ".join(words) for words in SENTENCES]
    plain = translator.translate(lines, num_beams=num_beams)
    assert not all(well_formed(t.split(), len(s)) for t, s in zip(plain, SENTENCES))  # the constraint has work

    def processors_for(indices):  # as parse() builds them: words per sentence, cap = source tokens + 12
        words = [len(SENTENCES[i]) for i in indices]
        return [
            TreeConstraint(translator.tokenizer.get_vocab(), EOS, words, max_new_tokens=[n + 1 + 12 for n in words])
        ]

    constrained = translator.translate(lines, num_beams=num_beams, processors_for=processors_for)
    for text, words in zip(constrained, SENTENCES):
        assert well_formed(text.split(), len(words)), (words, text)
    trees = parse(translator, SENTENCES, num_beams=num_beams)
    assert [str(tree) for tree in trees] == [str(delinearize(t, w)) for t, w in zip(constrained, SENTENCES)]
    assert [tree.words() for tree in trees] == SENTENCES
    unconstrained = parse(tiny_parser, SENTENCES, num_beams=num_beams, constrained=False)  # today's decoding
    assert [str(tree) for tree in unconstrained] == [str(delinearize(t, w)) for t, w in zip(plain, SENTENCES)]
