"""The default decoding loops (fast_decoding.py) against transformers' own (`generate(fast_decoding=False)`):
the same ids, for every setting the default path takes; transformers' loops where something more is asked.

Speed is measured by benchmarks/bench_speed.py and bench_translate.py, never asserted here.
"""

from __future__ import annotations

import copy
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    GenerationConfig,
    GenerationMixin,
    LogitsProcessor,
    LogitsProcessorList,
    MaxTimeCriteria,
    StoppingCriteria,
    StoppingCriteriaList,
)

from test_modeling import EOS, batch, tiny_model  # the model tests' tiny odd-sized model and padded batch
from vaswani_tx import compiled_decoding, fast_decoding
from vaswani_tx.errors import UserInputError
from vaswani_tx.generation_vaswani import PreparedCall, fairseq_generation_config
from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.quantization import quantize_int8


@pytest.fixture(autouse=True)
def python_loops(monkeypatch):
    """This file's tests are of the Python loops: beam search's bookkeeping in C++ (test_one_source_beams.py's library,
    which takes a call's whole loop where it is loaded) is set aside where an earlier test loaded it. That file
    tests the library's against these loops."""
    monkeypatch.delitem(sys.modules, fast_decoding.BEAMS_MODULE, raising=False)


def both(model, **kwargs):
    """(the default path's output, transformers' loops' output) for the same call."""
    return model.generate(**kwargs), model.generate(fast_decoding=False, **kwargs)


@pytest.fixture(params=["mkl", "onednn"])
def gemm(request, monkeypatch):
    """Each GEMM library the loops can choose (`gemm_backend`): oneMKL's products, or oneDNN's on packed weights."""
    if request.param == "onednn" and not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, request.param)
    return request.param


@pytest.fixture
def loops(monkeypatch):
    """Which of fast_decoding's loops ran, in order."""
    ran = []
    for name in ("greedy_search", "beam_search"):
        original = getattr(fast_decoding, name)

        def counting(*args, _name=name, _original=original, **kwargs):
            ran.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(f"vaswani_tx.generation_vaswani.{name}", counting)
    return ran


class EndsAt(LogitsProcessor):
    """Makes </s> likely for source i's rows (all its beams) at its `steps[i]`-th new token and after: sentences
    that end at different steps, from a random model that would otherwise run to the length cap."""

    def __init__(self, steps, start: int = 1):
        self.steps, self.start = torch.tensor(steps), start

    def __call__(self, input_ids, scores):
        rows = self.steps.repeat_interleave(input_ids.shape[0] // len(self.steps))
        boost = (input_ids.shape[1] - self.start + 1 >= rows).float() * 4.0
        return scores + boost[:, None] * (torch.arange(scores.shape[1]) == EOS)


class EndsAtPerSource(EndsAt):
    """`EndsAt` that beam search can follow when finished sources leave its rows (`select_sources`)."""

    def select_sources(self, sources):
        return EndsAtPerSource(self.steps[sources].tolist(), self.start)


def eos_prone_model(seed: int = 0):
    """A tiny model with Marian's fixed logit bias (the packed projection adds it), a little raised on </s>."""
    model = tiny_model(seed=seed, final_logits_bias=True)
    model.final_logits_bias[0, EOS] = 0.5
    return model


def ends(output: torch.Tensor) -> list[int]:
    return [int((row == EOS).nonzero()[0]) if (row == EOS).any() else row.numel() for row in output]


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=1),
        dict(num_beams=4),  # the paper's: GNMT length penalty 0.6, source length + 50, early stopping
        dict(num_beams=3, num_return_sequences=2, length_penalty=1.3, length_penalty_type="hf"),
        dict(num_beams=4, early_stopping=False, max_output_length_offset=5),
        dict(num_beams=1, min_new_tokens=9, max_new_tokens=9),
        dict(num_beams=4, min_new_tokens=9, max_new_tokens=9),
        dict(num_beams=2, no_repeat_ngram_size=2, repetition_penalty=1.5),  # processors run as they are
    ],
    ids=["greedy", "beam-paper", "beam-returns-2", "beam-no-early-stop", "greedy-min", "beam-min", "processors"],
)
def test_the_default_loops_give_transformers_ids(settings, loops, gemm):
    for seed in (0, 4):
        model = eos_prone_model(seed)
        ids, mask = batch(seed=seed, lengths=(7, 4, 6, 2))
        ending = LogitsProcessorList([EndsAtPerSource([3, 7, 5, 12])])
        fast, stock = both(model, input_ids=ids, attention_mask=mask, logits_processor=ending, **settings)
        assert torch.equal(fast, stock)
        assert "min_new_tokens" in settings or len(set(ends(fast))) > 1  # sentences of several lengths
    assert loops == ["greedy_search" if settings["num_beams"] == 1 else "beam_search"] * 2


def test_greedy_search_drops_finished_sentences_and_pads_them_as_transformers_does(loops):
    model = eos_prone_model(seed=1)
    ids, mask = batch(seed=2, lengths=(7, 4, 6, 2, 5, 3))
    ending = LogitsProcessorList([EndsAt([9, 2, 6, 4, 30, 6])])
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=1, logits_processor=ending)
    assert torch.equal(fast, stock)
    assert len(set(ends(fast))) > 3  # sentences ended at several different steps: the batch shrank more than once


def greedy_rows_processed(ending, monkeypatch):
    """Greedy search over six sentences ending at steps 9, 2, 6, 4, 30 and 6 (`ending`'s processor): the default
    path's ids, transformers' loops' ids, and the rows the default path's processors saw at each step."""
    model = eos_prone_model(seed=1)
    ids, mask = batch(seed=2, lengths=(7, 4, 6, 2, 5, 3))
    rows = []
    original = fast_decoding.process
    monkeypatch.setattr(
        fast_decoding, "process", lambda p, i, scores, c: rows.append(scores.shape[0]) or original(p, i, scores, c)
    )
    processors = LogitsProcessorList([ending([9, 2, 6, 4, 30, 6])])
    fast = model.generate(input_ids=ids, attention_mask=mask, num_beams=1, logits_processor=processors)
    seen = list(rows)
    stock = model.generate(
        input_ids=ids, attention_mask=mask, num_beams=1, logits_processor=processors, fast_decoding=False
    )
    return fast, stock, seen


@pytest.mark.parametrize("ending", [EndsAtPerSource, EndsAt])
def test_greedy_searchs_processors_and_argmax_see_the_rows_still_decoded_where_they_can_follow(
    ending, loops, monkeypatch
):
    """Finished rows are padded, so where every processor is row-local or has `select_sources` the processors and
    the argmax take the unfinished rows only; a processor without it (`EndsAt`) sees every row. Either way
    transformers' ids."""
    fast, stock, seen = greedy_rows_processed(ending, monkeypatch)
    assert torch.equal(fast, stock) and len(set(ends(fast))) > 3
    if ending is EndsAtPerSource:
        assert seen[0] == 6 and seen[-1] < 3 and seen == sorted(seen, reverse=True)
    else:
        assert set(seen) == {6}


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_finished_rows_leave_greedy_searchs_batch_once_they_are_a_share_of_it(share, loops, monkeypatch):
    """Finished rows leave the decoder's batch once they are `LEAVE_SHARE` of the rows it computes (each leaving
    copies every kept row's keys and values); until then they are computed and padded. Transformers' ids either
    way. Six sentences ending at steps 2, 4, 6, 6, 9 and 30: with a share of a half, the batch goes from 6 rows to
    2 at step 7 (4 finished of 6; 1 of 6 and 2 of 6 were too few) and to 1 at step 10; with none, at every end."""
    monkeypatch.setattr(fast_decoding, "LEAVE_SHARE", share)
    fast, stock, seen = greedy_rows_processed(EndsAtPerSource, monkeypatch)
    assert torch.equal(fast, stock) and sorted(set(ends(fast))) == [2, 4, 6, 9, 30]
    if share:
        assert seen == [6] * 6 + [2] * 3 + [1] * 21
    else:
        assert seen == [6] * 2 + [5] * 2 + [4] * 2 + [2] * 3 + [1] * 21


def test_a_decoder_prefix_the_fairseq_cap_and_suppressed_tokens(loops):
    model = eos_prone_model(seed=2)
    ids, mask = batch(seed=3)
    prefix = torch.tensor([[2, 7], [2, 9], [2, 11]])
    fast, stock = both(model, input_ids=ids, attention_mask=mask, decoder_input_ids=prefix, num_beams=3)
    assert torch.equal(fast, stock) and torch.equal(fast[:, :2], prefix)
    config = fairseq_generation_config(model.config, beam=3, max_len_a=1.0, max_len_b=2)
    fast, stock = both(model, input_ids=ids, attention_mask=mask, generation_config=config)
    assert torch.equal(fast, stock)
    assert loops == ["beam_search"] * 2


def test_beam_search_decodes_its_first_step_once_per_source(monkeypatch, loops):
    """All k beams of a source start from the same prefix: the first step is decoded for one row per source and
    its keys, values and logits copied to the k beams; the ids stay transformers'. A prefix whose beams differ
    cannot come from generate(), which repeats each row k times."""
    rows = []
    hidden = fast_decoding.DecodingSession.hidden
    monkeypatch.setattr(
        fast_decoding.DecodingSession,
        "hidden",
        lambda self, tokens: rows.append(tokens.shape[0]) or hidden(self, tokens),
    )
    model = eos_prone_model(seed=3)
    ids, mask = batch(seed=5, lengths=(7, 4, 6, 2))
    for prefix in (None, torch.tensor([[2, 7], [2, 9], [2, 11], [2, 5]])):
        rows.clear()
        extra = {} if prefix is None else {"decoder_input_ids": prefix}
        ending = LogitsProcessorList([EndsAtPerSource([3, 7, 5, 12])])
        fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=4, logits_processor=ending, **extra)
        assert torch.equal(fast, stock)
        assert rows[0] == 4 and rows[1] == 16  # one row per source, then 4 beams each
    assert loops == ["beam_search"] * 2


def test_beam_searchs_first_step_takes_the_projection_packed_for_the_beams(monkeypatch, gemm, loops):
    """oneMKL packs W for one number of rows, the beams': the first step's one row a source goes through that packing,
    repeated for its beams, rather than through the plain W; oneDNN's packing takes any number of rows, so the first
    step projects one row a source. The ids stay transformers', also for one source at a time."""
    # (where the beam-search library is loaded in this process, a call of a few rows would take its product on the
    # plain W instead: `projection_library`, tested in test_compiled_decoding.py)
    monkeypatch.setattr(fast_decoding, "projection_library", lambda weight, rows: None)
    products = []  # (whose product, its rows), in order
    packed = fast_decoding.PackedProjection.__call__
    monkeypatch.setattr(
        fast_decoding.PackedProjection, "__call__", lambda self, hidden, *a, **k: products.append(
            ("packed", hidden.reshape(-1, hidden.shape[-1]).shape[0])) or packed(self, hidden, *a, **k)
    )  # fmt: skip
    mm = torch.mm
    monkeypatch.setattr(
        fast_decoding.torch, "mm", lambda *a, **k: products.append(("plain", a[0].shape[0])) or mm(*a, **k)
    )
    model = eos_prone_model(seed=4)
    for lengths in ((7, 4, 6, 2), (5,)):
        ids, mask = batch(seed=6, lengths=lengths)
        products.clear()
        fast = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8)
        # (later steps of fewer rows, once sources have finished, take the plain W where oneMKL packed it)
        assert products[:2] == [("packed", len(lengths) * (4 if gemm == "mkl" else 1)), ("packed", len(lengths) * 4)]
        stock = model.generate(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=8, fast_decoding=False)
        assert torch.equal(fast, stock)
    assert loops == ["beam_search"] * 2


def test_the_packed_projection_follows_the_weights(gemm):
    """The pre-softmax matrix is packed once per model and number of rows; a change to the weights (an optimizer
    step, a loaded state dict) packs again rather than decode with the old ones."""
    model = eos_prone_model()
    ids, mask = batch()
    model.generate(input_ids=ids, attention_mask=mask, num_beams=1)
    packed = fast_decoding.PackedProjection.of(model, ids.shape[0])
    if packed is None:
        pytest.skip("torch without oneMKL: the projection is not packed")
    assert fast_decoding.PackedProjection.of(model, ids.shape[0]) is packed  # kept
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: the same tensor, a new version
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=1)
    assert torch.equal(fast, stock)
    assert fast_decoding.PackedProjection.of(model, ids.shape[0]) is not packed
    hidden = torch.randn(ids.shape[0], model.config.d_model)
    torch.testing.assert_close(fast_decoding.PackedProjection.of(model, ids.shape[0])(hidden), model.lm_head(hidden))


@pytest.mark.parametrize("rows", [3, 5, 8, 12])
def test_below_pack_all_rows_a_share_of_the_projection_is_packed(rows, monkeypatch):
    """Below PACK_ALL_ROWS rows the packed copy of a W above PACK_WHOLE_BYTES holds only W's first
    PACK_FEW_ROWS_SHARE (less memory for a smaller gain); the logits are the whole product either way, in the
    caller's buffer where one is given."""
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")
    monkeypatch.setattr(fast_decoding, "PACK_WHOLE_BYTES", 0)  # the tiny model's W stands for a large one
    model = eos_prone_model()
    if not fast_decoding.can_pack(model.lm_head.weight):
        pytest.skip("torch without oneMKL: the projection is not packed")
    vocabulary = model.lm_head.weight.shape[0]
    packed = fast_decoding.PackedProjection(model.lm_head.weight, rows)
    share = 1.0 if rows >= fast_decoding.PACK_ALL_ROWS else fast_decoding.PACK_FEW_ROWS_SHARE
    assert packed.split == math.ceil(vocabulary * share)
    hidden = torch.randn(rows, model.config.d_model)
    expected = hidden @ model.lm_head.weight.t()
    torch.testing.assert_close(packed(hidden), expected)
    out = torch.full((rows, vocabulary), float("nan"))
    logits = fast_decoding.Projection(model.lm_head.weight, packed)(hidden)
    torch.testing.assert_close(logits, expected)
    if packed.split < vocabulary:
        assert packed(hidden, out=out).data_ptr() == out.data_ptr()
        torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("rows", [3, 5])
def test_a_small_projection_is_packed_whole_at_few_rows(rows, monkeypatch):
    """A W of at most PACK_WHOLE_BYTES is packed whole below PACK_ALL_ROWS rows too (its quarter saves little memory
    and costs a sixth of the product), one W above it only in part; the logits are x W^T either way."""
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")
    model = eos_prone_model()
    weight = model.lm_head.weight
    if not fast_decoding.can_pack(weight):
        pytest.skip("torch without oneMKL: the projection is not packed")
    size = weight.numel() * weight.element_size()
    hidden = torch.randn(rows, model.config.d_model)
    for bound, whole in ((size, True), (size - 1, False)):
        monkeypatch.setattr(fast_decoding, "PACK_WHOLE_BYTES", bound)
        packed = fast_decoding.PackedProjection(weight, rows)
        assert packed.whole is whole
        torch.testing.assert_close(packed(hidden), hidden @ weight.t())


def test_onednn_packs_the_whole_projection_once_for_any_number_of_rows(monkeypatch):
    """oneDNN's inner product takes any number of rows on one packing of all of W (the rest of W would otherwise
    take oneMKL's product, the slow one where oneDNN is chosen): logits within float32 rounding of the layer's."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    model = eos_prone_model()
    packed = fast_decoding.PackedProjection.of(model, 4)
    assert packed.split == model.lm_head.weight.shape[0] and packed.whole
    for rows in (1, 2, 3, 4, 9):
        assert fast_decoding.PackedProjection.of(model, rows) is packed
        hidden = torch.randn(rows, model.config.d_model)
        torch.testing.assert_close(
            fast_decoding.Projection(model.lm_head.weight, packed)(hidden), model.lm_head(hidden)
        )
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")  # another choice packs for oneMKL again
    assert fast_decoding.PackedProjection.of(model, 4).backend == "mkl"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednns_packing_in_parts_gives_the_whole_packings_logits_and_transformers_ids(dtype, monkeypatch, loops):
    """W packed for oneDNN in parts of rows (`PACK_PART_BYTES`: each part's file pages given back once it is packed,
    so that W and its packed copy are not resident together): the same logits as the whole packing, bit for bit, a few
    rows at once and many a block at a time with their log-softmax; and transformers' ids through it."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    model = tiny_model(seed=0, vocab_size=64 * 5 + 7, final_logits_bias=True).to(dtype)  # 6 parts, the last partial
    weight = model.lm_head.weight
    whole = fast_decoding.PackedProjection(weight, 4)
    monkeypatch.setattr(fast_decoding, "PACK_PART_BYTES", 64 * weight.shape[1] * weight.element_size())
    given_back = []  # each part's rows as it is packed, then W whole (the pages at the parts' edges)
    monkeypatch.setattr(fast_decoding, "release_file_pages", lambda t: given_back.append((t.data_ptr(), t.shape[0])))
    parts = fast_decoding.PackedProjection(weight, 4)
    assert len(whole.parts) == 1 and len(parts.parts) == -(-weight.shape[0] // 64) > 1
    row = weight.shape[1] * weight.element_size()
    starts = range(0, weight.shape[0], 64)
    expected = [(weight.data_ptr() + s * row, min(64, weight.shape[0] - s)) for s in starts]
    assert given_back == expected + [(weight.data_ptr(), weight.shape[0])]
    g = torch.Generator().manual_seed(0)
    for rows in (1, 4, 9, 300):
        hidden = torch.randn(rows, model.config.d_model, generator=g).to(dtype)
        assert torch.equal(parts(hidden), whole(hidden)), rows
        out = [torch.empty(rows, weight.shape[0]) for _ in range(2)]
        assert torch.equal(parts(hidden, out=out[0], log_softmax=True), whole(hidden, out=out[1], log_softmax=True))
    if dtype == torch.float32:
        fast_decoding._PACKED.pop(model, None)
        ids, mask = batch(seed=3, lengths=(7, 4, 6))
        for num_beams in (1, 4):
            fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=num_beams, max_new_tokens=10)
            assert torch.equal(fast, stock), num_beams
        assert len(fast_decoding._PACKED[model].parts) > 1


def test_a_bfloat16_projection_is_packed_for_onednn_whichever_library_is_chosen(monkeypatch):
    """A bfloat16 model's pre-softmax W is packed for oneDNN's product (oneMKL packs float32 only), whichever GEMM
    library is chosen for float32. Its logits come as float32 (what the loops read), a few rows at once or many a
    block at a time into the call's buffer, with their log-softmax where asked, and are the product of the bfloat16
    rows and W to bfloat16 rounding: as close to it as the layer's own (here closer: a row's largest logit rounds
    to 0.5 in the layer's)."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    model = eos_prone_model().to(torch.bfloat16)
    weight = model.lm_head.weight

    def check(projection, rows):
        hidden = torch.randn(rows, model.config.d_model).bfloat16()
        exact = hidden.float() @ weight.float().t()
        logits = projection(hidden).clone()
        assert logits.dtype == torch.float32 and logits.shape == exact.shape
        torch.testing.assert_close(logits, exact, rtol=2**-7, atol=2**-5)
        own = model.project(hidden).float()
        assert (logits - exact).abs().max() <= (own - exact).abs().max()
        torch.testing.assert_close(projection(hidden, log_softmax=True), torch.log_softmax(logits, -1), rtol=0, atol=0)

    for library in ("mkl", "onednn"):
        monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, library)
        projection = fast_decoding.Projection.of(model, 4)
        assert projection.packed is not None and projection.packed.backend == "onednn"
        assert fast_decoding.PackedProjection.of(model, 9) is projection.packed  # kept: any rows
        for rows in (1, 4, 9):
            check(projection, rows)
    monkeypatch.setattr(fast_decoding, "ONEDNN_BLOCK_BYTES", 3 * weight.shape[0] * 4)  # blocks of 3 rows
    monkeypatch.setattr(fast_decoding, "FRESH_BYTES", 0)  # every call into the kept buffer
    check(fast_decoding.Projection.of(model, 8), 8)
    assert fast_decoding.Projection.of(model, 8, pack=False) is None  # greedy's screen: the model's own product


def test_onednn_projects_many_rows_a_block_at_a_time_into_the_kept_buffer(monkeypatch):
    """Logits above FRESH_BYTES come from oneDNN's product a block of rows at a time, into the call's buffer (never a
    fresh tensor that size), raw or through the log-softmax beam search asks for; beam search's ids stay
    transformers' own. Sizes shrunk so that the tiny model's rows take that path."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    model = tiny_model(seed=4)  # no fixed logit bias: the log-softmax is taken block by block
    weight = model.lm_head.weight
    row_bytes = weight.shape[0] * weight.element_size()
    monkeypatch.setattr(fast_decoding, "FRESH_BYTES", 3 * row_bytes)
    monkeypatch.setattr(fast_decoding, "ONEDNN_BLOCK_BYTES", 2 * row_bytes)
    blocks = []
    original = fast_decoding.onednn_linear

    def counting(rows, packed, bias):
        if packed is projection.packed.packed:  # the projection's products, not the decoder layers'
            blocks.append(rows.shape[0])
        return original(rows, packed, bias)

    monkeypatch.setattr(fast_decoding, "onednn_linear", counting)
    projection = fast_decoding.Projection.of(model, 12)
    assert projection.packed is not None and projection.packed.backend == "onednn"
    hidden = torch.randn(7, model.config.d_model)
    logits = projection(hidden)
    assert blocks == [2, 2, 2, 1] and logits.data_ptr() == projection.buffer.data_ptr()
    torch.testing.assert_close(logits, model.lm_head(hidden))
    log_probs = projection(hidden, log_softmax=True)
    assert log_probs.data_ptr() == projection.buffer.data_ptr()
    torch.testing.assert_close(log_probs, model.lm_head(hidden).log_softmax(-1))
    blocks.clear()
    assert projection(hidden[:3]).data_ptr() != projection.buffer.data_ptr() and blocks == [3]  # small: one product
    ids, mask = batch(lengths=(7, 4, 6, 5))
    ending = LogitsProcessorList([EndsAtPerSource([3, 6, 2, 5])])
    blocks.clear()
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=3, logits_processor=ending)
    assert torch.equal(fast, stock)
    assert blocks.count(2) >= 6 and max(blocks) <= 3  # 12 rows: six blocks a step; up to 3 rows: one product


def test_an_own_pre_softmax_layer_projects_many_rows_a_block_at_a_time(monkeypatch):
    """Where the loops cannot compute the projection themselves (int8 layers, a bias), the model's own `project`
    gives logits above FRESH_BYTES a block of rows at a time, into the call's buffer (never a fresh tensor that
    size), raw or through the log-softmax beam search asks for; small calls are one product as before, and beam
    search's ids stay transformers' own. Sizes shrunk so that the tiny model's rows take that path."""
    int8 = quantize_int8(tiny_model(seed=4))
    vocabulary = int8.config.vocab_size
    monkeypatch.setattr(fast_decoding, "FRESH_BYTES", 3 * vocabulary * 4)
    monkeypatch.setattr(fast_decoding, "ONEDNN_BLOCK_BYTES", 2 * vocabulary * 4)
    blocks = []

    def counting(model):
        original = model.project

        def project(hidden):
            blocks.append(hidden.reshape(-1, hidden.shape[-1]).shape[0])
            return original(hidden)

        monkeypatch.setattr(model, "project", project)

    counting(int8)
    projection = fast_decoding.OwnProjection(int8)
    hidden = torch.randn(7, int8.config.d_model)
    with torch.no_grad():
        expected = torch.cat([int8.lm_head(hidden[start : start + 2]) for start in range(0, 7, 2)])
        blocks.clear()
        logits = projection(hidden)
        assert blocks == [2, 2, 2, 1] and logits.data_ptr() == projection.buffer.data_ptr()
        torch.testing.assert_close(logits, expected, rtol=0, atol=0)  # each block: the layer's own output
        log_probs = projection(hidden, log_softmax=True)
        assert log_probs.data_ptr() == projection.buffer.data_ptr()
        torch.testing.assert_close(log_probs, expected.log_softmax(-1))
        blocks.clear()
        small = projection(hidden[:3])
        assert small.data_ptr() != projection.buffer.data_ptr() and blocks == [3]  # small: one product, as before
        torch.testing.assert_close(small, int8.lm_head(hidden[:3]), rtol=0, atol=0)

    # A float32 pre-softmax layer with a bias: the loops leave it to the model, and its blocks are the same maths.
    model = tiny_model(seed=4)
    head = torch.nn.Linear(model.config.d_model, vocabulary)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_(0, 0.5)
    model.lm_head = head
    counting(model)
    ids, mask = batch(lengths=(7, 4, 6, 5))
    ending = LogitsProcessorList([EndsAtPerSource([3, 6, 2, 5])])
    blocks.clear()
    fast = model.generate(input_ids=ids, attention_mask=mask, num_beams=3, logits_processor=ending)
    assert blocks.count(2) >= 6 and max(blocks) <= 3  # 12 rows: six blocks a step; up to 3 rows: one product
    stock = model.generate(
        input_ids=ids, attention_mask=mask, num_beams=3, logits_processor=ending, fast_decoding=False
    )
    assert torch.equal(fast, stock)


def test_the_encoder_runs_through_onednn_where_it_is_chosen(monkeypatch):
    """generate()'s encoder pass (and the compiled step's encoder-decoder keys and values) take oneDNN's product on
    the weights as they are where oneDNN is chosen and the batch holds enough tokens; the layers' own forward is
    back afterwards, and nothing changes with gradients on or oneMKL chosen."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    model = tiny_model(seed=2)
    ids, mask = batch(lengths=(7, 4, 6))
    encoder_layers = {id(m.weight) for m in model.get_encoder().modules() if type(m) is torch.nn.Linear}
    seen = []
    original = fast_decoding.onednn_linear

    def spying(rows, weight, bias, then="none"):
        seen.append(id(weight))
        return original(rows, weight, bias, then)

    monkeypatch.setattr(fast_decoding, "onednn_linear", spying)
    monkeypatch.setattr(fast_decoding, "UNPACKED_ONEDNN_MIN_ROWS", ids.numel())
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")
    expected = model.generate(input_ids=ids, attention_mask=mask, num_beams=2, fast_decoding=False)
    assert not seen
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=2)
    assert encoder_layers <= set(seen)
    assert torch.equal(fast, stock) and torch.equal(stock, expected)
    assert all("forward" not in vars(m) for m in model.modules())
    seen.clear()
    model.generate(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], num_beams=2, fast_decoding=False)
    assert not encoder_layers & set(seen)  # fewer tokens than the threshold: oneMKL's product
    with torch.enable_grad(), fast_decoding.unpacked_onednn_products(model.get_encoder(), 10**6):
        assert all("forward" not in vars(m) for m in model.modules())


def test_the_encoders_relu_is_applied_as_onednn_writes_w1s_product(monkeypatch):
    """Where the encoder's products are oneDNN's, each feed-forward network's max(0, .) is applied as oneDNN writes
    x W1 + b1 (`ReLUFeedForward`): the same values as the network's own forward, every encoder layer's taken, the
    ids of transformers' loops; not where a ReLU does not follow at once (SiLU, activation dropout in training)."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    model = tiny_model(seed=3)
    ids, mask = batch(lengths=(7, 4, 6))
    monkeypatch.setattr(fast_decoding, "UNPACKED_ONEDNN_MIN_ROWS", ids.numel())
    fused = []
    original = fast_decoding.onednn_linear

    def spying(rows, weight, bias, then="none"):
        if then == "relu":
            fused.append(id(weight))
        return original(rows, weight, bias, then)

    monkeypatch.setattr(fast_decoding, "onednn_linear", spying)
    encoder = model.get_encoder()
    first_layers = [id(layer.feed_forward.w_1.weight) for layer in encoder.layers]
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=2)
    assert torch.equal(fast, stock) and set(fused) == set(first_layers)  # (both calls' encoder passes)
    ffn = encoder.layers[0].feed_forward
    hidden = torch.randn(5, 3, model.config.d_model)
    with torch.no_grad():
        assert torch.equal(fast_decoding.ReLUFeedForward(ffn)(hidden), ffn(hidden))
        ffn.activation = torch.nn.functional.silu
        with fast_decoding.unpacked_onednn_products(encoder, 10**6):
            assert "forward" not in vars(ffn) and "forward" in vars(encoder.layers[1].feed_forward)
        ffn.activation, ffn.activation_dropout.p = torch.relu, 0.1
        model.train()
        with fast_decoding.unpacked_onednn_products(encoder, 10**6):
            assert "forward" not in vars(ffn) and "forward" in vars(encoder.layers[1].feed_forward)
        model.eval()  # dropout off while not training: fused again
        with fast_decoding.unpacked_onednn_products(encoder, 10**6):
            assert "forward" in vars(ffn)
    assert all("forward" not in vars(m) for m in model.modules())


def test_onednn_runs_the_decoders_linear_layers_on_packed_weights(monkeypatch):
    """`PackedLinears` replaces the product of each float32 `nn.Linear` of the decoder while installed (every step
    of a call that packs, whatever its rows), and only then: the same outputs to float32 rounding, the layers' own
    forward back afterwards, a new
    packing after the weights change, none for an int8 model (its layers are quantized) or where oneMKL is chosen."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    model = eos_prone_model()
    linears = fast_decoding.PackedLinears.of(model)
    layers = [module for module in model.get_decoder().modules() if type(module) is torch.nn.Linear]
    assert [module for module, _ in linears.layers] == layers and fast_decoding.PackedLinears.of(model) is linears
    layer = model.get_decoder().layers[0].feed_forward.w_1
    for rows in (1, 2, 5):
        hidden = torch.randn(rows, 1, layer.in_features)
        expected = torch.nn.functional.linear(hidden, layer.weight, layer.bias)
        with linears.installed():
            assert "forward" in vars(layer)
            torch.testing.assert_close(layer(hidden), expected)
        assert "forward" not in vars(layer)
    with pytest.raises(RuntimeError, match="inside"), linears.installed():
        raise RuntimeError("inside")
    assert all("forward" not in vars(module) for module in layers)  # restored after an error too
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert fast_decoding.PackedLinears.of(model) is not linears
    assert fast_decoding.PackedLinears.of(quantize_int8(eos_prone_model())) is None
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")
    assert fast_decoding.PackedLinears.of(model) is None


def resident_bytes(path) -> int:
    """This process' resident bytes of its mappings of the file `path` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps", encoding="utf-8", errors="replace") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header: range, perms, ..., path
                inside = fields[-1] == str(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def in_memory_filesystem(path) -> bool:
    """Whether `path` is on tmpfs or ramfs, whose files are memory themselves: nothing to give back to."""
    best, kind = "", ""
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            fields = line.split()
            if str(path).startswith(fields[1]) and len(fields[1]) > len(best):
                best, kind = fields[1], fields[2]
    return kind in ("tmpfs", "ramfs")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(2) and /proc: Linux only")
def test_a_tensor_mapped_from_a_file_gives_its_pages_back(tmp_path):
    """`release_file_pages`: a tensor read through a private mapping of a file (as `from_pretrained` leaves the
    weights) leaves memory, and reading it again gives the same values; a tensor made in memory is left alone."""
    import numpy as np

    path = tmp_path / "weights.bin"
    values = torch.randn(2**21)  # 8 MB
    with open(path, "wb") as file:
        file.write(values.numpy().tobytes())
        file.flush()
        os.fsync(file.fileno())  # written back: clean pages, which the kernel can drop at once
    mapped = torch.from_numpy(np.memmap(path, dtype=np.float32, mode="c"))  # MAP_PRIVATE, as safetensors maps
    assert torch.equal(mapped, values)  # every page read
    before = resident_bytes(path)
    released = fast_decoding.release_file_pages(mapped)
    assert released >= values.numel() * 4 - 2 * compiled_decoding.PAGE
    if not in_memory_filesystem(tmp_path):
        assert before - resident_bytes(path) >= 0.9 * released
    assert torch.equal(mapped, values)  # read back from the file
    in_memory = values.clone()
    assert fast_decoding.release_file_pages(in_memory) == 0 and torch.equal(in_memory, values)
    assert fast_decoding.release_file_pages(mapped[:, None].expand(-1, 2)) == 0  # not contiguous: left alone


def test_a_call_that_packs_reads_only_the_packed_weights_and_gives_the_plain_ones_back(tmp_path, monkeypatch):
    """Once W and the decoder's layers are packed for oneDNN, each one's plain pages are given back (one layer at a
    time), and every step of the call reads the packed copies only, beam search's first step of one row a source
    included: the plain weights' values no longer matter (here made NaN behind the packing's back), and the ids
    stay transformers' own."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    # (a W the beam-search library's few-rows product reads, `projection_library`, stays unpacked: not this test's)
    monkeypatch.setattr(fast_decoding, "projection_library", lambda weight, rows: None)
    given_back = []
    monkeypatch.setattr(fast_decoding, "release_file_pages", lambda tensor: given_back.append(tensor) or 0)
    tiny_model().save_pretrained(tmp_path)
    model = VaswaniForConditionalGeneration.from_pretrained(tmp_path).eval()
    layers = [module for module in model.get_decoder().modules() if type(module) is torch.nn.Linear]
    ids, mask = batch(lengths=(7,))
    settings = dict(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=6)
    expected = model.generate(fast_decoding=False, **settings)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # one thread: packs from 2 rows (`min_rows`), not 1
    assert torch.equal(model.generate(**settings), expected)
    assert [id(t) for t in given_back] == [id(model.lm_head.weight)] + [id(module.weight) for module in layers]
    with torch.no_grad():
        for module in layers:
            module.weight.data.fill_(math.nan)  # `.data`: the weight's version stays, so the packing is kept
    assert torch.equal(model.generate(**settings), expected)
    assert len(given_back) == len(layers) + 1  # nothing packed or given back again


def test_the_gemm_library_follows_the_cpu_vendor(monkeypatch):
    """auto: oneMKL on Intel CPUs and where the vendor is unknown, oneDNN on other x86 CPUs (CTranslate2's rule);
    the variable chooses; anything else is refused naming it."""
    monkeypatch.delenv(compiled_decoding.GEMM_VARIABLE, raising=False)
    monkeypatch.setattr(compiled_decoding.platform, "machine", lambda: "x86_64")
    onednn = "onednn" if compiled_decoding.onednn_linear_available() else "mkl"
    for vendor, expected in (("GenuineIntel", "mkl"), ("AuthenticAMD", onednn), ("HygonGenuine", onednn), ("", "mkl")):
        monkeypatch.setattr(compiled_decoding, "cpu_vendor", lambda vendor=vendor: vendor)
        assert compiled_decoding.gemm_backend() == expected
    monkeypatch.setattr(compiled_decoding.platform, "machine", lambda: "aarch64")
    assert compiled_decoding.gemm_backend() == "mkl"  # ARM: torch's own product (its oneDNN/ACL already)
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    assert compiled_decoding.gemm_backend() == onednn
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")
    monkeypatch.setattr(compiled_decoding, "cpu_vendor", lambda: "AuthenticAMD")
    assert compiled_decoding.gemm_backend() == "mkl"
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, "fast")
    with pytest.raises(UserInputError, match="VASWANI_TX_GEMM='fast'"):
        compiled_decoding.gemm_backend()


def test_int8_and_bfloat16_models_take_the_default_loops_unpacked(loops):
    ids, mask = batch()
    int8 = quantize_int8(eos_prone_model())
    fast, stock = both(int8, input_ids=ids, attention_mask=mask, num_beams=2)
    assert torch.equal(fast, stock)
    bf16 = eos_prone_model().to(torch.bfloat16)
    fast, stock = both(bf16, input_ids=ids, attention_mask=mask, num_beams=1)
    assert torch.equal(fast, stock)
    assert loops == ["beam_search", "greedy_search"]


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=2, output_scores=True, return_dict_in_generate=True),
        dict(num_beams=1, do_sample=True),
        dict(num_beams=1, fast_decoding=False),
        dict(num_beams=2, cache_implementation="static", disable_compile=True),
    ],
    ids=["scores", "sampling", "asked-not-to", "static-cache"],
)
def test_anything_more_than_the_sequences_runs_transformers_loops(settings, loops):
    model = eos_prone_model()
    ids, mask = batch()
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, **settings)
    assert loops == []


def test_a_saved_generation_config_can_turn_the_default_loops_off(loops, tmp_path):
    model = eos_prone_model()
    model.generation_config.fast_decoding = False
    ids, mask = batch()
    model.generate(input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=3)
    assert loops == []


class StopAfter(StoppingCriteria):
    """A caller's own criterion: rows whose last token is `token` are done."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("num_beams", [1, 3])
def test_a_callers_stopping_criteria_are_asked_as_transformers_asks_them(num_beams, loops):
    model = eos_prone_model(seed=5)
    ids, mask = batch(seed=5, lengths=(7, 4, 6, 5))
    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=num_beams, fast_decoding=False)
    token = int(plain[0, 3])  # a token the first sentence produces
    criteria = StoppingCriteriaList([StopAfter(token)])
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=num_beams, stopping_criteria=criteria)
    assert torch.equal(fast, stock) and fast.shape[1] < plain.shape[1]


@pytest.mark.parametrize("ending", [EndsAtPerSource, EndsAt])
@pytest.mark.parametrize("settings", [dict(num_beams=4), dict(num_beams=3, num_return_sequences=2)])
def test_finished_sources_leave_beam_searchs_bookkeeping_where_the_processors_can_follow(
    ending, settings, loops, monkeypatch
):
    """The log-softmax and top-k run over the sources still decoded where every processor is row-local or has
    `select_sources` (here the paper's SourceLengthCap and `EndsAtPerSource`); a processor without it (`EndsAt`)
    keeps every source's rows. Either way transformers' ids, in the sources' order."""
    model = eos_prone_model(seed=1)
    ids, mask = batch(seed=2, lengths=(7, 4, 6, 2, 5, 3))
    rows = []
    original = fast_decoding.top_k_continuations

    def counting(model, log_probs, *args):
        rows.append(log_probs.shape[0])  # the bookkeeping's sources this step
        return original(model, log_probs, *args)

    monkeypatch.setattr(fast_decoding, "top_k_continuations", counting)
    processors = LogitsProcessorList([ending([9, 2, 6, 4, 30, 6])])
    fast = model.generate(input_ids=ids, attention_mask=mask, logits_processor=processors, **settings)
    bookkeeping, rows[:] = list(rows), []
    stock = model.generate(
        input_ids=ids, attention_mask=mask, logits_processor=processors, fast_decoding=False, **settings
    )
    assert torch.equal(fast, stock)
    assert len(set(ends(fast))) > 2
    if ending is EndsAtPerSource:
        assert bookkeeping[0] == 6 and bookkeeping[-1] < 6 and bookkeeping == sorted(bookkeeping, reverse=True)
    else:
        assert set(bookkeeping) == {6}


def test_the_caches_reordered_keys_are_whole_buffers_in_reused_allocations():
    """After beam search's reordering (and a selection of the sentences not finished), the self-attention's keys and
    values of the next step are the whole buffer, not a prefix of a larger one (the batched products read a whole
    one several times faster); the copies hold the same rows, and buffers growing a position a step reuse the
    spare allocations rather than taking new ones."""
    torch.manual_seed(0)
    cache = fast_decoding.GrowingKeysValues(2)
    rows, heads, depth = 6, 2, 4
    written = [[torch.randn(rows, heads, 1, depth) for _ in range(2)] for _ in range(3)]  # 3 steps, 2 layers
    for step in written:
        for layer, key in enumerate(step):
            cache.update(key, key + 1, layer)
    assert cache.keys[0].shape[2] == 16  # the first step's capacity: the prefix is a strided view

    expected = [torch.cat([step[layer] for step in written], dim=2) for layer in range(2)]
    allocations = set()
    for position, order in enumerate([[5, 4, 3, 2, 1, 0], [0, 0, 1, 1, 2, 2], [3, 1, 4, 5, 0, 2], [1, 2, 3]]):
        order = torch.tensor(order)
        cache.select_rows(order)
        expected = [keys[order] for keys in expected]
        new = torch.randn(len(order), heads, 1, depth)
        for layer in range(2):
            keys, values = cache.update(new, new + 1, layer)
            expected[layer] = torch.cat([expected[layer], new], dim=2)
            assert keys.is_contiguous() and values.is_contiguous()
            assert keys.data_ptr() == cache.keys[layer].data_ptr() and keys.shape == cache.keys[layer].shape
            torch.testing.assert_close(keys, expected[layer], rtol=0, atol=0)
            torch.testing.assert_close(values, expected[layer] + 1, rtol=0, atol=0)
            if position:
                allocations.add((keys._base if keys._base is not None else keys).data_ptr())
    # 4 buffers and the spare, then the same allocations for fewer rows and one more position
    assert len(allocations) <= 5


def test_kept_buffers_lend_each_buffer_to_one_owner_until_it_is_gone_or_given_back():
    """`KeptBuffers`: a request takes the smallest free buffer that holds it, never one lent to a living owner;
    a buffer is free again once its owner is gone or gives it back; free buffers too small for a request make way
    for its new one beyond KEEP."""

    class Owner:
        pass

    kept = fast_decoding.KeptBuffers()
    first, second = Owner(), Owner()
    a = kept.take(first, 100, torch.float32, torch.device("cpu"))
    b = kept.take(second, 50, torch.float32, torch.device("cpu"))
    assert a.shape == (100,) and b.shape == (50,) and a.data_ptr() != b.data_ptr()
    assert kept.take(Owner(), 10, torch.float32, torch.device("cpu")).data_ptr() not in (a.data_ptr(), b.data_ptr())
    del second  # its buffer is free: the smallest that holds 40 (the unnamed owner's 10 do not)
    assert kept.take(first, 40, torch.float32, torch.device("cpu")).data_ptr() == b.data_ptr()
    assert kept.take(Owner(), 40, torch.int64, torch.device("cpu")).data_ptr() != b.data_ptr()  # another dtype
    kept.give(a[10:])  # a view of a buffer gives the whole buffer back
    assert kept.take(first, 80, torch.float32, torch.device("cpu")).data_ptr() == a.data_ptr()
    count = len(kept.lent)
    kept.give(a)
    for size in range(2, 2 + 3 * fast_decoding.KeptBuffers.KEEP):  # each larger than every free buffer
        kept.give(kept.take(first, 1000 * size, torch.float32, torch.device("cpu")))
    assert count <= len(kept.lent) <= max(count, fast_decoding.KeptBuffers.KEEP)
    count = len(kept.lent)
    kept.take(first, 10, torch.float32, torch.device("meta"))  # off the CPU: not kept
    assert len(kept.lent) == count


def test_a_calls_slots_and_logits_reuse_the_buffers_of_the_call_before(monkeypatch):
    """The self-attention slots (`PositionSlots`) and the logits' buffer (`Projection`) of a call take the buffers a
    finished call of the same model used (`KeptBuffers`), written over with this call's own values: no new
    allocation for a call no larger, and beam search's ids stay transformers' own after a larger call."""
    layers, heads, depth, like = 2, 2, 4, torch.zeros(1)
    kept = fast_decoding.KeptBuffers()

    def decode(rows: int, orders) -> tuple[set, list]:
        slots = fast_decoding.PositionSlots(layers, kept)
        written = []
        for order in [None, None, *orders]:
            if order is not None:
                slots.select_rows(torch.tensor(order))
                written = [w[:, order] for w in written]
                rows = len(order)
            keys, _ = slots.views(rows, 1, heads, depth, depth, like)
            new = torch.randn(layers, 1, rows, heads, depth)
            for layer in range(layers):
                keys[layer][-1:] = new[layer]
            slots.length += 1
            written = [torch.cat([w, n]) for w, n in zip(written, new)] if written else list(new)
        for layer in range(layers):
            torch.testing.assert_close(slots.keys[layer, : slots.length], written[layer], rtol=0, atol=0)
        return {buffer.data_ptr() for buffer, _ in kept.lent}

    torch.manual_seed(0)
    first = decode(6, [[5, 4, 3, 2, 1, 0], [0, 0, 1, 1, 2, 2], None])
    assert decode(4, [[3, 2, 1, 0], [1, 1, 0, 0], None]) == first  # fewer rows: the same buffers

    model = tiny_model(seed=4)
    model.requires_grad_(False)  # as the loops run it (inference mode): oneMKL's product into a buffer takes no grad
    row_bytes = model.config.vocab_size * 4
    monkeypatch.setattr(fast_decoding, "FRESH_BYTES", 3 * row_bytes)  # the tiny model's logits into the buffer
    monkeypatch.setattr(fast_decoding, "ONEDNN_BLOCK_BYTES", 2 * row_bytes)
    projection = fast_decoding.Projection.of(model, 12)
    hidden = torch.randn(7, model.config.d_model)
    torch.testing.assert_close(projection(hidden), model.lm_head(hidden))
    buffer = projection.buffer.data_ptr()
    del projection
    projection = fast_decoding.Projection.of(model, 12)
    torch.testing.assert_close(projection(hidden[:5] * 2), model.lm_head(hidden[:5] * 2))
    assert projection.buffer.data_ptr() == buffer
    del projection
    ids, mask = batch(lengths=(7, 4, 6, 5))
    ending = LogitsProcessorList([EndsAtPerSource([3, 6, 2, 5])])
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=3, logits_processor=ending)
    assert torch.equal(fast, stock)
    fast, stock = both(model, input_ids=ids[:2], attention_mask=mask[:2], num_beams=2)
    assert torch.equal(fast, stock)


def test_the_compiled_steps_slots_reorder_every_layer_in_one_copy_and_stay_contiguous_views():
    """The compiled step's self-attention slots (`PositionSlots`): each layer's written prefix plus this step's slot
    is a contiguous view of the one tensor for all layers; after a reordering (beams repeated, fewer rows) the
    views hold the chosen rows' written positions, a step writes its slot in place, and a step with no reordering
    before it grows the tensor with the positions kept."""
    torch.manual_seed(0)
    layers, heads, d_k, d_v = 3, 2, 4, 5
    slots = fast_decoding.PositionSlots(layers)
    like = torch.zeros(1)
    expected_keys = [torch.empty(0, 6, heads, d_k) for _ in range(layers)]
    expected_values = [torch.empty(0, 6, heads, d_v) for _ in range(layers)]

    def step(rows: int) -> None:  # what the compiled step does: write this position's slot in every view
        keys, values = slots.views(rows, 1, heads, d_k, d_v, like)
        for layer in range(layers):
            assert keys[layer].shape == (slots.length + 1, 1, rows, heads, d_k) and keys[layer].is_contiguous()
            assert values[layer].is_contiguous()
            new_key, new_value = torch.randn(1, 1, rows, heads, d_k), torch.randn(1, 1, rows, heads, d_v)
            keys[layer][-1:], values[layer][-1:] = new_key, new_value
            expected_keys[layer] = torch.cat([expected_keys[layer], new_key[:, 0]])
            expected_values[layer] = torch.cat([expected_values[layer], new_value[:, 0]])
        slots.length += 1
        for layer in range(layers):
            torch.testing.assert_close(slots.keys[layer, : slots.length], expected_keys[layer], rtol=0, atol=0)
            torch.testing.assert_close(slots.values[layer, : slots.length], expected_values[layer], rtol=0, atol=0)

    for _ in range(3):
        step(6)
    for order in ([5, 4, 3, 2, 1, 0], [0, 0, 1, 1, 2, 2], None, [3, 1, 4], None, None, [2, 2, 0], None):
        if order is not None:
            slots.select_rows(torch.tensor(order))
            expected_keys = [keys[:, order] for keys in expected_keys]
            expected_values = [values[:, order] for values in expected_values]
            assert slots.keys.shape[1] == slots.length + 1  # the written positions and the next step's slot
        step(len(expected_keys[0][0]))
    assert slots.keys.shape[1] >= 16  # the last step, with no reordering before it, grew the copy (exact size)


def test_the_output_is_an_ordinary_tensor_outside_inference_mode():
    model = eos_prone_model()
    ids, mask = batch()
    output = model.generate(input_ids=ids, attention_mask=mask, num_beams=2)
    assert not output.is_inference()
    output[:, 0] = 0  # in place, as callers do with generate()'s output


# whole blocks of 64 a beam; a partial last block; too few scores for blocks (torch.topk over the sums)
@pytest.mark.parametrize("width", [1024, 2000 + 37, 500])
def test_the_block_top_k_of_beams_plus_their_scores_gives_transformers_sums_at_its_indices(width):
    """Beam search's top-k over a source's beams x V log-probabilities plus each beam's score: the values of
    transformers' whole-tensor sum at the same indices, without writing the sum."""
    g = torch.Generator().manual_seed(width)
    beams = 6
    log_probs = torch.randn(4, beams, width, generator=g).log_softmax(-1)
    beam_scores = -3 * torch.rand(4, beams, generator=g)
    log_probs[1, :, :-3] = -math.inf  # every beam all but masked: the best sums in the partial last block
    log_probs[2, 0, 100:110] = log_probs[2, 0].max() + 1  # exact ties at the top of one beam
    beam_scores[3, 2:] = -1e9  # beams that cannot go on (the first step's)
    summed = (log_probs + beam_scores[:, :, None]).view(4, -1)  # transformers' accumulated log-probabilities
    for k in (2, 12, 40):
        values, indices = fast_decoding.largest(log_probs, k, beam_scores)
        expected_values, expected_indices = torch.topk(summed, k)
        assert torch.equal(values, expected_values)
        assert torch.equal(summed.gather(1, indices), values)  # bit for bit the sums transformers computes
        assert torch.equal(indices[[0, 3]], expected_indices[[0, 3]])  # untied sources: the same indices
        assert all(len(set(row.tolist())) == k for row in indices)


@pytest.mark.parametrize("width", [8000, 8003, 100, 200])
def test_the_block_argmax_is_torchs_first_maximum(width, monkeypatch):
    """`argmax_rows` (greedy search's choice over many rows) gives torch.argmax's index: the first of equal maxima,
    within a block and across blocks, a NaN the largest, a row of -inf its first column, a partial last block."""
    monkeypatch.setattr(fast_decoding, "BLOCK_ARGMAX_MIN", 0)  # the blocks for any rows
    torch.manual_seed(width)
    scores = torch.randn(40, width)
    scores[1, 3] = scores[1, width - 1] = 50.0  # equal maxima in the first and the last block
    scores[2, 10] = scores[2, 11] = 50.0  # within one block
    scores[3, width // 2] = scores[3, width - 2] = float("nan")
    scores[4] = float("-inf")
    scores[5, width - 1] = 50.0  # the last column (of a partial block where the width has one)
    scores[6] = torch.randint(0, 3, (width,)).float()  # many ties
    assert torch.equal(fast_decoding.argmax_rows(scores), torch.argmax(scores, dim=-1))
    assert torch.equal(fast_decoding.argmax_rows(scores[:1]), torch.argmax(scores[:1], dim=-1))


@pytest.mark.parametrize("width", [4096, 6 * 1000 + 37])  # whole blocks of 64; a partial last block
def test_the_block_top_k_gives_torch_topks_values_at_its_indices(width):
    g = torch.Generator().manual_seed(width)
    scores = torch.randn(5, width, generator=g)
    scores[1, :-3] = -math.inf  # a row all but masked (the length cap forcing </s>), its best in the partial block
    scores[2, 100:110] = 7.0  # exact ties at the top
    scores[3, -1] = 9.0  # the best score in the last column
    for k in (1, 8, 12):
        values, indices = fast_decoding.largest(scores, k)
        expected_values, expected_indices = torch.topk(scores, k)
        assert torch.equal(values, expected_values)
        assert torch.equal(scores.gather(1, indices), values)  # each value where it says
        untied = [0, 3, 4]  # rows without ties among their k best: the same indices too
        assert torch.equal(indices[untied], expected_indices[untied])
        assert all(len(set(row.tolist())) == k for row in indices)  # no column twice


@pytest.mark.parametrize("width", [64 * 125, 64 * 70 + 5, 500])  # whole blocks, a partial one, too few for blocks
def test_one_sources_block_top_k_is_the_block_top_ks_choice_and_order(width):
    """`one_source_largest` (one source's beams, Python lists) gives `largest`'s values and indices in its order,
    exact ties included: bfloat16 scores, beams at -1e9 (beam search's first step), a row all but masked."""
    g = torch.Generator().manual_seed(width)
    for trial in range(40):
        beams = 1 + trial % 6
        scores = torch.randn(beams, width, generator=g).log_softmax(-1)
        if trial % 2:
            scores = scores.bfloat16().float()  # exact ties, as a bfloat16 model's
        shift = torch.randn(beams, generator=g) * 3
        if trial % 5 == 0:
            shift[1:] = -1e9
        if trial % 7 == 0:
            scores[0, :-3] = -math.inf
        values, indices = fast_decoding.largest(scores[None], 2 * beams, shift[None])
        assert fast_decoding.one_source_largest(scores, 2 * beams, shift) == (values[0].tolist(), indices[0].tolist())


def test_beam_search_over_a_vocabulary_large_enough_for_the_block_top_k(loops):
    model = tiny_model(seed=3, vocab_size=2000)  # 4 beams x 2,000 scores a source: the block path
    ids, mask = batch(seed=4, lengths=(7, 4, 6), vocab=2000)
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12)
    assert torch.equal(fast, stock)
    assert loops == ["beam_search"]


# --- one source a call ------------------------------------------------------------------------------------------


@pytest.fixture
def library_set_aside(monkeypatch):
    """The Python paths where a C++ library would take over: the beam-search library (`python_loops`), and torch's
    int8 product in greedy search's screen, where an earlier test loaded the int8 few-rows kernel
    (test_int8_rows.py's tests take that one)."""
    monkeypatch.setattr(fast_decoding, "rows_kernel_loaded", lambda: False)


@pytest.fixture
def one_source(monkeypatch, library_set_aside):
    """How many calls beam search handed to `one_source_search` (one source: its bookkeeping in Python)."""
    calls = []
    original = fast_decoding.one_source_search

    def counting(*args, **kwargs):
        calls.append(args[1].shape[0])
        return original(*args, **kwargs)

    monkeypatch.setattr(fast_decoding, "one_source_search", counting)
    return calls


# One source a call, each of transformers' early-stopping rules, length penalties, returned sequences, and processors
# that read only the rows' shape (the length cap) or the beams' ids (test_one_source_beams.py takes them too).
ONE_SOURCE_SETTINGS = {
    "paper": dict(num_beams=4),  # GNMT length penalty 0.6, source length + 50 (SourceLengthCap), early stopping
    "returns-3": dict(
        num_beams=3, num_return_sequences=3, length_penalty=1.3, length_penalty_type="hf", max_output_length_offset=6
    ),
    "no-early-stop": dict(num_beams=4, early_stopping=False, max_output_length_offset=4),
    "never": dict(
        num_beams=3, early_stopping="never", length_penalty=1.0, length_penalty_type="hf", max_output_length_offset=6
    ),
    "negative-penalty": dict(num_beams=5, length_penalty=-1.0, length_penalty_type="hf", max_output_length_offset=6),
    "min-max": dict(num_beams=4, min_new_tokens=9, max_new_tokens=9),
    "processors": dict(num_beams=2, no_repeat_ngram_size=2, repetition_penalty=1.5),  # processors that read ids
    "prefix": dict(num_beams=3, decoder_input_ids=torch.tensor([[2, 7, 9]]), max_output_length_offset=8),
}


@pytest.mark.parametrize("settings", ONE_SOURCE_SETTINGS.values(), ids=ONE_SOURCE_SETTINGS.keys())
def test_one_sources_beam_search_keeps_its_books_in_python_and_gives_transformers_ids(settings, one_source):
    """A sentence a call (a service's load, the pipeline given a string): beam search's bookkeeping over the 2k
    candidates runs in Python (`one_source_search`), with transformers' float32 scores and choices. The same ids for
    each of transformers' early-stopping rules, length penalties, returned sequences, and processors that read only
    the rows' shape (the length cap) or the beams' ids; sentences of several lengths."""
    outputs = []
    for seed in range(6):
        model = eos_prone_model(seed)
        ids, mask = batch(seed=seed, lengths=(2 + 2 * seed,))
        fast, stock = both(model, input_ids=ids, attention_mask=mask, **settings)
        assert torch.equal(fast, stock), seed
        outputs.append(fast)
    assert one_source == [settings["num_beams"]] * 6
    if "min_new_tokens" not in settings:
        assert len({ends(output)[0] for output in outputs}) > 2


def test_one_sources_beam_search_with_a_processor_that_reads_ids_and_sentences_ending_early(one_source):
    model = eos_prone_model(seed=3)
    for step in (1, 2, 5):
        ids, mask = batch(seed=step, lengths=(6,))
        ending = LogitsProcessorList([EndsAt([step])])  # reads the ids' shape only, but does not say so: given ids
        fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=4, logits_processor=ending)
        assert torch.equal(fast, stock)
    assert one_source == [4] * 3


def test_a_callers_stopping_criteria_keep_one_source_on_the_tensor_bookkeeping(one_source, loops):
    """A criterion of the caller's is asked over all 2k candidates, as transformers asks it: the tensor loop."""
    model = eos_prone_model(seed=5)
    ids, mask = batch(seed=5, lengths=(7,))
    plain = model.generate(input_ids=ids, attention_mask=mask, num_beams=3, fast_decoding=False)
    criteria = StoppingCriteriaList([StopAfter(int(plain[0, 3]))])
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=3, stopping_criteria=criteria)
    assert torch.equal(fast, stock) and fast.shape[1] < plain.shape[1]
    assert loops == ["beam_search"] and one_source == []


def test_one_sources_choices_among_exact_ties_are_torch_topks(monkeypatch):
    """bfloat16 logits make exact ties among the candidates common (a few hundred distinct values near a row's
    largest): which of them go on, and in what order, is torch.topk's, as in the tensor bookkeeping."""
    model = tiny_model(seed=1, vocab_size=500).to(torch.bfloat16)
    sources = [batch(seed=seed, lengths=(3 + seed % 7,)) for seed in range(30)]  # a stable sort differs on one

    def outputs():
        settings = dict(num_beams=6, max_new_tokens=12)
        return [model.generate(input_ids=ids, attention_mask=mask, **settings) for ids, mask in sources]

    one_source = outputs()
    monkeypatch.setattr(fast_decoding, "one_source_applies", lambda *args: False)
    assert all(torch.equal(a, b) for a, b in zip(one_source, outputs()))


def test_one_sources_float32_quotients_round_as_torchs():
    """Python's floats are doubles: the bookkeeping's scores divided by the length penalty round to float32 as
    torch divides a float32 tensor by a Python number."""
    torch.manual_seed(0)
    scores = torch.randn(2000) * 20
    for divisor in (((5 + 7) / 6) ** 2.5, ((5 + 13) / 6) ** 0.6, 3.0, 11**1.3):
        quotients = (scores / divisor).tolist()
        assert [fast_decoding._divided(score, divisor) for score in scores.tolist()] == quotients


# --- greedy search's int8 screen ---------------------------------------------------------------------------------


def screen_model(seed: int = 5):
    """A tiny model whose vocabulary is large enough for the screen, its width a multiple of 16."""
    return tiny_model(seed=seed, vocab_size=fast_decoding.SCREEN_MIN_VOCABULARY + 37, d_model=32, num_heads=4)


def screened_argmax(model):
    screen = fast_decoding.ScreenedArgmax.of(model, 1)
    if screen is None:
        pytest.skip(f"no int8 screen on this CPU (capability {torch.backends.cpu.get_cpu_capability()})")
    return screen


@pytest.mark.parametrize("rows", [1, 2, 5, fast_decoding.SCREEN_MAX_ROWS])
def test_the_screened_argmax_is_the_whole_products(rows, library_set_aside):
    """Only the columns that can hold a row's maximum are computed in float32; their argmax is the whole product's,
    near-ties (a column a hair above another), masked columns and all of the vocabulary included."""
    model = screen_model()
    screen = screened_argmax(model)
    weight = model.lm_head.weight.detach()
    g = torch.Generator().manual_seed(rows)
    for trial in range(20):
        hidden = torch.randn(rows, weight.shape[1], generator=g) * (1 + trial)
        expected = (hidden @ weight.t()).argmax(dim=1)
        assert torch.equal(screen(hidden), expected)
    # a near-tie: the runner-up's row a hair away from the best's, which int8 cannot tell apart
    hidden = torch.randn(rows, weight.shape[1], generator=g) * 8
    best = int((hidden[0] @ weight.t()).argmax())
    other = best + 1 if best + 1 < weight.shape[0] else best - 1
    with torch.no_grad():
        weight[other] = weight[best] * (1 - 1e-6)
    screen = fast_decoding.ScreenedArgmax(weight)  # a new copy for the changed W
    assert int(screen(hidden)[0]) == int((hidden[0] @ weight.t()).argmax()) == best

    # masked columns: the processors' -inf, the best column among them
    def mask(scores):
        scores[:, best] = -math.inf
        return scores

    masked = hidden @ weight.t()
    masked[:, best] = -math.inf
    assert torch.equal(screen(hidden, mask), masked.argmax(dim=1))
    # nothing left to choose from, or not a number: the caller computes every logit
    assert screen(hidden, lambda scores: scores.fill_(-math.inf)) is None
    assert screen(torch.full_like(hidden, math.nan)) is None


def test_more_rows_than_torchs_int8_product_serves_get_no_screen_and_no_copy(library_set_aside):
    """Past `SCREEN_MAX_ROWS` rows only the int8 few-rows kernel's product with the library's choice beats float32's
    (`SCREEN_MAX_ROWS_KERNEL`): without them, a batch's greedy call gets no screen, and no int8 copy of W is made for
    it (a quarter of W's bytes, which the call would not read)."""
    model = screen_model(seed=14)
    assert fast_decoding.ScreenedArgmax.of(model, fast_decoding.SCREEN_MAX_ROWS + 1) is None
    assert model not in fast_decoding._SCREENS
    screened_argmax(model)  # the few rows' screen made (skipped on a CPU without the int8 product), then still none
    assert fast_decoding.ScreenedArgmax.of(model, fast_decoding.SCREEN_MAX_ROWS + 1) is None


def test_the_int8_products_rounding_is_within_the_screens_bound(library_set_aside):
    """The screen rests on torch's weight-only int8 product rounding as the bound says (float32 sums, one bfloat16
    rounding of the result); checked once per copy, and here on more columns and scales than that check."""
    screen = screened_argmax(screen_model())
    assert fast_decoding._rounding_within_bound(screen, columns=screen.weight.shape[0])
    g = torch.Generator().manual_seed(0)
    for scale in (1e-3, 1.0, 1e3):
        rows = torch.randn(3, screen.weight.shape[1], generator=g) * scale
        rounded = rows.to(torch.bfloat16)
        screened = torch._weight_int8pack_mm(rounded, screen.quantized, screen.scales).float()
        exact = rows.double() @ screen.weight.detach().double().t()
        assert bool(((screened.double() - exact).abs() <= screen.bounds(rows, rounded, screened).double()).all())


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=1, max_new_tokens=12),
        dict(num_beams=1, max_new_tokens=12, min_new_tokens=6, suppress_tokens=[7, 9]),
        "fairseq's cap",  # the source length + 2 (SourceLengthCap): rows end at different steps, at their cap
    ],
)
def test_greedy_search_through_the_screen_gives_transformers_ids(settings, loops, monkeypatch, library_set_aside):
    model = screen_model()
    screened_argmax(model)
    if settings == "fairseq's cap":
        settings = dict(generation_config=fairseq_generation_config(model.config, beam=1, max_len_a=1.0, max_len_b=2))
    calls = []
    original = fast_decoding.ScreenedArgmax.__call__

    def counting(self, *args, **kwargs):
        chosen = original(self, *args, **kwargs)
        calls.append(chosen is not None)
        return chosen

    monkeypatch.setattr(fast_decoding.ScreenedArgmax, "__call__", counting)
    vocab = model.config.vocab_size
    for lengths in ((7,), (7, 4, 6)):  # one row; rows finishing at different steps
        ids, mask = batch(seed=4, lengths=lengths, vocab=vocab)
        fast, stock = both(model, input_ids=ids, attention_mask=mask, **settings)
        assert torch.equal(fast, stock)
    assert calls and all(calls)  # every step chose through the screen
    assert loops == ["greedy_search", "greedy_search"]


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=1, max_new_tokens=12),
        dict(num_beams=1, max_new_tokens=12, min_new_tokens=6, suppress_tokens=[7, 9]),
        dict(num_beams=1, max_new_tokens=12, decoder_input_ids=torch.tensor([[2, 7, 9]])),  # a prompt of 3 tokens
        "fairseq's cap",
        "every logit",  # the screen leaves too many columns at every step
    ],
)
def test_one_sources_greedy_search_gives_transformers_ids(settings, loops, monkeypatch, library_set_aside):
    """One source through the screen (a sentence a call): `one_source_greedy`, transformers' ids; several sources
    keep the batched loop."""
    model = screen_model(seed=8)
    screened_argmax(model)
    if settings == "fairseq's cap":
        settings = dict(generation_config=fairseq_generation_config(model.config, beam=1, max_len_a=1.0, max_len_b=2))
    elif settings == "every logit":
        monkeypatch.setattr(fast_decoding, "SCREEN_MAX_SHARE", 0.0)
        settings = dict(num_beams=1, max_new_tokens=10)
    calls = []
    original = fast_decoding.one_source_greedy
    monkeypatch.setattr(fast_decoding, "one_source_greedy", lambda *a, **k: calls.append(1) or original(*a, **k))
    vocab = model.config.vocab_size
    for seed in (4, 5, 6):
        ids, mask = batch(seed=seed, lengths=(7,), vocab=vocab)
        fast, stock = both(model, input_ids=ids, attention_mask=mask, **settings)
        assert torch.equal(fast, stock)
    assert len(calls) == 3
    if "decoder_input_ids" not in settings:
        ids, mask = batch(seed=4, lengths=(7, 4, 6), vocab=vocab)
        fast, stock = both(model, input_ids=ids, attention_mask=mask, **settings)
        assert torch.equal(fast, stock) and len(calls) == 3


@pytest.mark.parametrize("precision", ["int8", "bfloat16"])
def test_one_source_without_a_screen_goes_through_one_source_greedy(precision, loops, monkeypatch, library_set_aside):
    """An int8 or bfloat16 model has no int8 screen: one source (a sentence a call) still takes `one_source_greedy`,
    every logit a step, with transformers' ids (also with a minimum length and suppressed tokens); several sources
    keep the batched loop."""
    model = quantize_int8(eos_prone_model()) if precision == "int8" else eos_prone_model().to(torch.bfloat16)
    assert fast_decoding.ScreenedArgmax.of(model, 1) is None
    screens = []
    original = fast_decoding.one_source_greedy
    monkeypatch.setattr(
        fast_decoding,
        "one_source_greedy",
        lambda session, screen, *a: screens.append(screen) or original(session, screen, *a),
    )
    for seed, settings in ((4, {}), (5, dict(min_new_tokens=4, suppress_tokens=[7, 9]))):
        ids, mask = batch(seed=seed, lengths=(7,), vocab=model.config.vocab_size)
        fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=10, **settings)
        assert torch.equal(fast, stock)
    assert screens == [None, None]
    ids, mask = batch(seed=4, lengths=(7, 4, 6), vocab=model.config.vocab_size)
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=10)
    assert torch.equal(fast, stock) and len(screens) == 2


def test_a_torch_whose_int8_product_rounds_beyond_the_bound_gets_no_screen(monkeypatch, loops, library_set_aside):
    model = screen_model(seed=6)
    screened_argmax(model)
    fast_decoding._SCREENS.pop(model, None)
    product = torch._weight_int8pack_mm
    monkeypatch.setattr(torch, "_weight_int8pack_mm", lambda *args: product(*args) * 2)
    assert fast_decoding.ScreenedArgmax.of(model, 1) is None
    ids, mask = batch(seed=4, lengths=(7,), vocab=model.config.vocab_size)
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=8)
    assert torch.equal(fast, stock)


def test_the_screen_follows_the_weights(loops, library_set_aside):
    """One int8 copy per model, made again when W changes (an optimizer step, a loaded state dict)."""
    model = screen_model(seed=7)
    screen = screened_argmax(model)
    assert fast_decoding.ScreenedArgmax.of(model, 2) is screen  # kept
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # in place: the same tensor, a new version
    ids, mask = batch(seed=4, lengths=(7,), vocab=model.config.vocab_size)
    fast, stock = both(model, input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=8)
    assert torch.equal(fast, stock)
    assert fast_decoding.ScreenedArgmax.of(model, 1) is not screen
    assert fast_decoding.ScreenedArgmax.of(model, fast_decoding.SCREEN_MAX_ROWS + 1) is None  # packed there instead


# --- a sentence a call: generate()'s set-up made once per settings (`PreparedCall`) -------------------------------


@pytest.fixture
def set_ups(monkeypatch):
    """How many one-source calls got transformers' whole set-up, and how many the kept one (`PreparedCall`)."""
    counts = {"transformers": 0, "kept": 0}
    stock, kept = GenerationMixin.generate, PreparedCall.__call__

    def counting_stock(self, *args, **kwargs):
        counts["transformers"] += fast_decoding._REQUEST.get() is not False  # not `generate(fast_decoding=False)`
        return stock(self, *args, **kwargs)

    def counting_kept(self, *args, **kwargs):
        counts["kept"] += 1
        return kept(self, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", counting_stock)
    monkeypatch.setattr(PreparedCall, "__call__", counting_kept)
    return counts


PREPARED_SETTINGS = {
    **{name: settings for name, settings in ONE_SOURCE_SETTINGS.items() if name != "prefix"},
    "greedy": dict(num_beams=1),
    "greedy-min": dict(num_beams=1, min_new_tokens=6, max_new_tokens=9),
    "fairseq-cap": dict(num_beams=3, max_len_a=0.5, max_len_b=3),
    "bad-words-forced-eos": dict(num_beams=2, bad_words_ids=[[7], [9, 11]], forced_eos_token_id=EOS, max_length=9),
}


@pytest.mark.parametrize("settings", PREPARED_SETTINGS.values(), ids=PREPARED_SETTINGS.keys())
def test_a_sentence_a_call_reuses_generates_set_up_and_gives_the_same_ids(settings, set_ups):
    """Sources of several lengths a call each, with the same settings: transformers' set-up once, then the kept one
    with each source's own length limit; the ids of transformers' loops every time."""
    model = eos_prone_model(seed=2)
    lengths = set()
    for seed in range(5):
        ids, mask = batch(seed=seed, lengths=(2 + 3 * seed,))
        fast, stock = both(model, input_ids=ids, attention_mask=mask, **settings)
        assert torch.equal(fast, stock), (ids.shape, fast, stock)
        lengths.add(fast.shape[1])
    assert set_ups == {"transformers": 1, "kept": 4}
    if "max_output_length_offset" in settings or "max_len_b" in settings:  # each its own limit: some reach it
        assert len(lengths) > 2


def test_a_changed_generation_config_is_set_up_again(set_ups):
    """The model's generation config changed (a field set, a list changed in place, the config replaced): the next
    call is set up again by transformers, with the new settings."""
    model = eos_prone_model(seed=4)
    ids, mask = batch(seed=4, lengths=(6,))
    model.generation_config.bad_words_ids = [[5]]

    def check():
        fast, stock = both(model, input_ids=ids, attention_mask=mask)
        assert torch.equal(fast, stock)
        return fast

    first = check()
    assert torch.equal(check(), first) and set_ups == {"transformers": 1, "kept": 1}
    model.generation_config.num_beams = 2
    check()
    model.generation_config.bad_words_ids.append([int(first[0, 1])])  # in place: the first call's first token
    banned = check()
    assert int(banned[0, 1]) != int(first[0, 1])
    model.generation_config = copy.deepcopy(model.generation_config)
    check()
    assert set_ups == {"transformers": 4, "kept": 1}


@pytest.mark.parametrize(
    "call",
    [
        dict(logits_processor=LogitsProcessorList([EndsAt([3])])),  # a caller's processors
        dict(decoder_input_ids=torch.tensor([[2, 7]])),  # a tensor argument
        dict(fast_decoding=False),
        dict(
            generation_config=GenerationConfig(num_beams=2, max_length=9, decoder_start_token_id=2, eos_token_id=EOS)
        ),
        dict(encoder_no_repeat_ngram_size=2),  # a processor that reads the source
        dict(stopping_criteria=StoppingCriteriaList([MaxTimeCriteria(60.0)])),
    ],
    ids=["processors", "prefix", "not-fast", "own-config", "reads-source", "criteria"],
)
def test_calls_that_differ_from_source_to_source_get_transformers_set_up_each_time(call):
    model = eos_prone_model(seed=6)
    for seed in range(3):
        ids, mask = batch(seed=seed, lengths=(5 + seed,))
        model.generate(input_ids=ids, attention_mask=mask, num_beams=2, **call)
    assert not model.__dict__.get("_prepared_calls")


def test_a_batch_of_sources_is_not_kept():
    model = eos_prone_model(seed=6)
    ids, mask = batch(seed=1)
    model.generate(input_ids=ids, attention_mask=mask)
    assert not model.__dict__.get("_prepared_calls")


# --- glibc's thresholds, raised at a process' first call in batches ------------------------------------------------

MAPPED_AFTER = """
import ctypes, os, platform, sys
sys.path.insert(0, {tests!r})
libc = ctypes.CDLL("libc.so.6")

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]

libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def mapped(size):  # whether glibc maps a block of `size` bytes of its own rather than taking it from its heap
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    grew = libc.mallinfo2().hblkhd > before
    libc.free(block)
    return grew

from test_modeling import batch, tiny_model
model = tiny_model(seed=0)
ids, mask = batch(seed=0, lengths={lengths})
model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=3)
print(mapped(20 * 2**20))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.parametrize(
    "lengths, variable, raised",
    [((5, 3), None, True), ((5,), None, False), ((5, 3), "MALLOC_TRIM_THRESHOLD_", False)],
    ids=["in batches", "a sentence a call", "the user's own thresholds"],
)
def test_a_first_call_in_batches_raises_glibcs_thresholds_unless_the_user_set_them(lengths, variable, raised):
    """After a call in batches, glibc serves a 20 MiB block from its heap (its mmap threshold raised to 32 MiB, as
    it raises it itself once such a block is freed), so that a batch's temporaries are not mapped and faulted in
    afresh at every step; not after a sentence a call, nor where the user set glibc's thresholds."""
    env = {key: value for key, value in os.environ.items() if key not in fast_decoding.MALLOC_VARIABLES}
    env.pop("GLIBC_TUNABLES", None)
    if variable is not None:
        env[variable] = str(128 * 1024)
    code = MAPPED_AFTER.format(tests=str(Path(__file__).parent), lengths=lengths)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(not raised)
