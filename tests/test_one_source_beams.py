"""Beam search's bookkeeping in C++ (one_source_beams.py, kernels/one_source_beams.cpp), for one source and for a
batch: the same ids as the Python loops and transformers' for every setting those loops take, finished sources
leaving a batch as in Python, the cache reordering of the compiled step's slots the same copies, and the folders and
builds it is not used from.

Speed is measured by benchmarks/bench_translate.py (`--one-at-a-time`), never asserted here.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
import sys

import pytest
import torch
from transformers import LogitsProcessorList

from test_fast_decoding import ONE_SOURCE_SETTINGS, EndsAt, EndsAtPerSource, ends, eos_prone_model, screen_model
from test_int8_rows import in_a_fresh_process
from test_modeling import batch, tiny_model
from vaswani_tx import compile_step, compiled_decoding, fast_decoding, int8_rows, native, one_source_beams
from vaswani_tx.errors import UserInputError
from vaswani_tx.generation_vaswani import fairseq_generation_config

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) to build the library")


@pytest.fixture(scope="module")
def library_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("beams")
    one_source_beams.build(folder)
    return folder


@pytest.fixture
def paths(library_folder, monkeypatch):
    """A function that makes a call with the library loaded or set aside (`run(native, function, *args)`), and which
    loop each beam search took (`run.taken`)."""
    assert one_source_beams.load(library_folder)
    library = sys.modules[fast_decoding.BEAMS_MODULE]
    taken = []
    for name in ("one_source_search", "native_search"):
        original = getattr(fast_decoding, name)
        monkeypatch.setattr(fast_decoding, name, lambda *a, _n=name, _o=original, **k: taken.append(_n) or _o(*a, **k))

    def run(native: bool, function, *args, **kwargs):
        if native:
            monkeypatch.setitem(sys.modules, fast_decoding.BEAMS_MODULE, library)
        else:
            monkeypatch.delitem(sys.modules, fast_decoding.BEAMS_MODULE, raising=False)
        return function(*args, **kwargs)

    run.taken = taken
    return run


@pytest.mark.parametrize("settings", ONE_SOURCE_SETTINGS.values(), ids=ONE_SOURCE_SETTINGS.keys())
def test_the_library_gives_the_python_loops_and_transformers_ids(settings, paths):
    """Each of transformers' early-stopping rules, length penalties (GNMT's and transformers' form, negative),
    returned sequences, processors that read the rows' shape or the beams' ids, a decoder prefix."""
    for seed in range(6):
        model = eos_prone_model(seed)
        ids, mask = batch(seed=seed, lengths=(2 + 2 * seed,))
        kwargs = dict(input_ids=ids, attention_mask=mask, **settings)
        native = paths(True, model.generate, **kwargs)
        assert torch.equal(native, paths(False, model.generate, **kwargs)), seed
        assert torch.equal(native, model.generate(fast_decoding=False, **kwargs)), seed
    assert paths.taken == ["native_search", "one_source_search"] * 6


@pytest.mark.parametrize("vocab_size", [500, 64 * 70, 64 * 70 + 5])  # no blocks, whole blocks, a partial one
def test_exact_ties_and_each_top_k_path_go_as_in_python(vocab_size, paths):
    """bfloat16 logits (exact ties among the candidates are common): which go on, and in what order, is torch.topk's
    in both; vocabularies that take each of the 2k-best searches (`one_source_largest`, `largest`)."""
    model = tiny_model(seed=1, vocab_size=vocab_size).to(torch.bfloat16)
    for seed in range(12):
        ids, mask = batch(seed=seed, lengths=(3 + seed % 7,), vocab=min(vocab_size, 500))
        kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=6, max_new_tokens=12)
        native = paths(True, model.generate, **kwargs)
        assert torch.equal(native, paths(False, model.generate, **kwargs)), seed
    assert paths.taken.count("native_search") == 12


class MasksBlocks:
    """Sets whole blocks of 64 columns (and one score of every beam but the first) to -inf, and at the third step
    two scores to NaN (one of them a block's first): the library's own block maxima must choose as ATen's amax does
    (NaN propagates, an all -inf block has maximum -inf)."""

    def __init__(self, nan: bool):
        self.nan = nan

    def __call__(self, input_ids, scores):
        scores[:, 64:192] = -math.inf
        scores[1:, 300] = -math.inf
        if self.nan and input_ids.shape[1] == 3:
            scores[2, 77] = math.nan
            scores[4, 64 * 5] = math.nan  # a block's first column
        return scores

    def select_sources(self, sources):  # (its rows are positions in the batch, whichever sources go on)
        return self


@pytest.mark.parametrize("lengths", [(), (3, 6)], ids=["one source", "three sources"])
@pytest.mark.parametrize("nan", [False, True], ids=["masked blocks", "masked blocks and a NaN"])
def test_masked_and_nan_scores_choose_as_in_python(nan, lengths, paths):
    model = tiny_model(seed=2, vocab_size=64 * 70)
    for seed in range(4):
        ids, mask = batch(seed=seed, lengths=(4 + seed, *lengths), vocab=500)
        processors = LogitsProcessorList([MasksBlocks(nan)])
        kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=6, max_new_tokens=8, logits_processor=processors)
        native = paths(True, model.generate, **kwargs)
        assert torch.equal(native, paths(False, model.generate, **kwargs)), seed
    assert paths.taken.count("native_search") == 4


def test_sentences_ending_early_under_a_processor_that_reads_ids(paths):
    model = eos_prone_model(seed=3)
    for step in (1, 2, 5):
        ids, mask = batch(seed=step, lengths=(6,))
        kwargs = dict(
            input_ids=ids, attention_mask=mask, num_beams=4, logits_processor=LogitsProcessorList([EndsAt([step])])
        )
        native = paths(True, model.generate, **kwargs)
        assert torch.equal(native, paths(False, model.generate, **kwargs))
        assert torch.equal(native, model.generate(fast_decoding=False, **kwargs))


# --- a batch of sources (`native_search` over several: the library's `Beams`) ------------------------------------------

BATCH_SETTINGS = {name: settings for name, settings in ONE_SOURCE_SETTINGS.items() if name != "prefix"}


@pytest.mark.parametrize("settings", BATCH_SETTINGS.values(), ids=BATCH_SETTINGS.keys())
def test_a_batchs_bookkeeping_in_the_library_gives_the_python_loops_and_transformers_ids(settings, paths):
    """Six sources of different lengths a call, each of transformers' early-stopping rules, length penalties, returned
    sequences and row-local processors that read the beams' ids: the library's choices are the Python loop's
    (`beam_search`, its tensors over all sources) and transformers'."""
    outputs = []
    for seed in range(4):
        model = eos_prone_model(seed)
        ids, mask = batch(seed=seed, lengths=(7, 4, 6, 2, 5, 3))
        kwargs = dict(input_ids=ids, attention_mask=mask, **settings)
        native = paths(True, model.generate, **kwargs)
        assert torch.equal(native, paths(False, model.generate, **kwargs)), seed
        assert torch.equal(native, model.generate(fast_decoding=False, **kwargs)), seed
        outputs.append(native)
    assert paths.taken == ["native_search"] * 4
    if "min_new_tokens" not in settings:  # sentences that end at different steps
        assert len({end for output in outputs for end in ends(output)}) > 2


@pytest.mark.parametrize("settings", [dict(num_beams=4), dict(num_beams=3, num_return_sequences=2)])
def test_finished_sources_leave_the_librarys_batch_as_they_leave_pythons(settings, paths, monkeypatch):
    """Sources that end at different steps leave the decoder's batch and the processors (`EndsAtPerSource` follows
    them, as the paper's length cap does) at the steps the Python loop drops them; a processor that cannot follow
    (`EndsAt`) keeps the Python loop, which keeps every source's rows."""
    model = eos_prone_model(seed=1)
    ids, mask = batch(seed=2, lengths=(7, 4, 6, 2, 5, 3))
    selected = []  # (the call, the sources going on) at each selection

    def select(session, sources, rows=None, _original=fast_decoding.DecodingSession.select):
        selected.append((len(paths.taken), sources.tolist()))
        return _original(session, sources, rows)

    monkeypatch.setattr(fast_decoding.DecodingSession, "select", select)
    kwargs = dict(input_ids=ids, attention_mask=mask, **settings)
    following = LogitsProcessorList([EndsAtPerSource([9, 2, 6, 4, 30, 6])])
    native = paths(True, model.generate, logits_processor=following, **kwargs)
    in_library, selected[:] = list(selected), []
    python = paths(False, model.generate, logits_processor=following, **kwargs)
    assert torch.equal(native, python)
    assert torch.equal(native, model.generate(fast_decoding=False, logits_processor=following, **kwargs))
    assert len(set(ends(native))) > 2
    assert len(in_library) >= 2 and [sources for _, sources in in_library] == [sources for _, sources in selected]
    assert paths.taken == ["native_search"]

    fixed = LogitsProcessorList([EndsAt([9, 2, 6, 4, 30, 6])])
    native = paths(True, model.generate, logits_processor=fixed, **kwargs)
    assert torch.equal(native, model.generate(fast_decoding=False, logits_processor=fixed, **kwargs))
    assert paths.taken == ["native_search"]  # (the Python loop: no source leaves)


@pytest.mark.parametrize("vocab_size", [500, 64 * 70, 64 * 70 + 5])  # no blocks, whole blocks, a partial one
def test_a_batchs_exact_ties_and_each_top_k_path_go_as_in_python(vocab_size, paths):
    """bfloat16 logits (exact ties common): the batch's top-k over each source's rows picks as the Python loop's."""
    model = tiny_model(seed=1, vocab_size=vocab_size).to(torch.bfloat16)
    for seed in range(6):
        ids, mask = batch(seed=seed, lengths=(3 + seed % 7, 5, 2, 8), vocab=min(vocab_size, 500))
        kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=6, max_new_tokens=12)
        native = paths(True, model.generate, **kwargs)
        assert torch.equal(native, paths(False, model.generate, **kwargs)), seed
    assert paths.taken.count("native_search") == 6


def test_each_rows_top_k_is_torch_topks_ties_nans_and_all(paths):
    """The library's top-k of each row (`top_rows`: one pass where the answer is the only one, else torch.topk over
    those rows) gives torch.topk's values and indices, in its order: random rows, rows rounded to bfloat16 (exact
    ties), rows with a NaN, with -inf, all equal; k from 1 to past the one-pass limit (64)."""
    library = sys.modules[fast_decoding.BEAMS_MODULE]
    g = torch.Generator().manual_seed(0)
    for width, k in ((8, 4), (12, 4), (500, 8), (512, 8), (300, 64), (300, 65), (7, 7)):
        rows = torch.randn(40, width, generator=g)
        rows[10:20] = rows[10:20].bfloat16().float() * 0.01  # few distinct values: ties among the largest
        rows[20, 3] = math.nan
        rows[21, :] = math.nan
        rows[22, : width // 2] = -math.inf
        rows[23, :] = -math.inf
        rows[24, :] = 0.5
        rows[25, width - 1] = rows[25].max()  # the largest twice
        values, indices = library.top_rows(rows, k)
        expected_values, expected_indices = torch.topk(rows, k)
        assert torch.equal(indices, expected_indices), (width, k)
        torch.testing.assert_close(values, expected_values, rtol=0, atol=0, equal_nan=True)


# --- greedy search's int8 screen (`ScreenedArgmax`), its work after the int8 product in one call --------------------


@pytest.fixture(params=[False, True], ids=["torch's int8 product", "the int8 few-rows kernel"])
def rows_kernel(request, monkeypatch):
    """Whether greedy search's screen takes the int8 few-rows kernel's product (int8_rows.py, loaded from a folder it
    was built into; rows quantized to int8, `bounds` with rounded None) or torch's (rows rounded to bfloat16)."""
    if request.param:
        supported, why = int8_rows.cpu_supports()
        if not supported:
            pytest.skip(f"the int8 few-rows kernel does not run here: {why}")
        request.getfixturevalue("kernel_folder")  # built and loaded
    else:
        monkeypatch.setattr(fast_decoding, "rows_kernel_loaded", lambda: False)
    return request.param


def kernel_screen(model, rows_kernel: bool):
    """The model's screen, its product the int8 few-rows kernel's where `rows_kernel` (else torch's), and its W."""
    screen = fast_decoding.ScreenedArgmax.of(model, 1)
    if screen is None:
        pytest.skip(f"no int8 screen on this CPU (capability {torch.backends.cpu.get_cpu_capability()})")
    assert (screen.rows_kernel is not None) == rows_kernel
    return screen, model.lm_head.weight.detach()


def test_the_librarys_screen_chooses_as_pythons(paths, rows_kernel):
    """The same token as the Python screen and as the whole product's argmax for 1-7 rows at many scales, a near-tie,
    masked columns; None (every logit computed by the caller) for a row all masked, a NaN; flat rows (every column
    kept) each computed whole. Most calls keep one column a row (the library's answer without a product), the
    near-tie two."""
    screen, weight = kernel_screen(screen_model(seed=11), rows_kernel)
    g = torch.Generator().manual_seed(3)
    kept = []  # how many columns each trial's rows keep at most (the Python bound's count)
    for trial in range(60):
        hidden = torch.randn(1 + trial % 7, weight.shape[1], generator=g) * (0.25 + trial % 12)
        native = paths(True, screen, hidden)
        assert native is not None and torch.equal(native, paths(False, screen, hidden)), trial
        assert torch.equal(native, (hidden @ weight.t()).argmax(dim=1)), trial
        rounded, screened = screen.screened_logits(hidden)
        slack = screen.bounds(hidden, rounded, screened)
        kept.append(int((screened + slack >= (screened - slack).amax(dim=1, keepdim=True)).sum(dim=1).max()))
    assert 1 in kept and max(kept) > 1  # both the answer without a product and the product of the columns left
    hidden = torch.randn(3, weight.shape[1], generator=g) * 8
    best = int((hidden[0] @ weight.t()).argmax())
    with torch.no_grad():  # the runner-up a hair below the best: int8 cannot tell them apart, float32 can
        weight[best + 1 if best + 1 < weight.shape[0] else best - 1] = weight[best] * (1 - 1e-6)
    screen = fast_decoding.ScreenedArgmax(weight)
    assert int(paths(True, screen, hidden)[0]) == best

    def without_best(scores):
        scores[:, best] = -math.inf
        return scores

    masked = (hidden @ weight.t()).index_fill_(1, torch.tensor([best]), -math.inf)
    assert torch.equal(paths(True, screen, hidden, without_best), masked.argmax(dim=1))
    assert paths(True, screen, hidden, lambda scores: scores.fill_(-math.inf)) is None
    assert paths(True, screen, torch.full_like(hidden, math.nan)) is None
    # every column ties: more than the share left, which the Python screen gives to the caller and the library
    # computes, each row alone (its whole product: the first column)
    assert paths(False, screen, torch.zeros_like(hidden)) is None
    assert torch.equal(paths(True, screen, torch.zeros_like(hidden)), torch.zeros(3, dtype=torch.long))


def test_the_librarys_screen_settles_rows_of_one_column_and_serves_a_batchs_rows(paths, rows_kernel):
    """A batch's rows (40 and 300): the whole product's argmax, where random rows keep a few columns each, but
    different ones (300 rows: a union product past `max_share`, each row's own columns instead). A row that keeps
    one column is settled without a product: beside 39 peaked rows, a row of zeros keeps every column (all tie),
    which the Python screen gives to the caller (None) and the library computes (its argmax, column 0, as the whole
    product's)."""
    screen, weight = kernel_screen(screen_model(seed=13), rows_kernel)
    g = torch.Generator().manual_seed(5)
    for count in (40, 300):
        for scale in (0.5, 4.0, 16.0):
            hidden = torch.randn(count, weight.shape[1], generator=g) * scale
            assert torch.equal(paths(True, screen, hidden), (hidden @ weight.t()).argmax(dim=1)), (count, scale)
    # peaked rows: each a multiple of one row of W, so that most keep that column alone
    hidden = weight[torch.randint(0, weight.shape[0], (40,), generator=g)] * 40
    hidden[0] = 0.0
    rounded, screened = screen.screened_logits(hidden)
    slack = screen.bounds(hidden, rounded, screened)
    kept = (screened + slack >= (screened - slack).amax(dim=1, keepdim=True)).sum(dim=1)
    assert int(kept[0]) == weight.shape[0] and int((kept[1:] == 1).sum()) >= 30
    assert paths(False, screen, hidden) is None
    assert torch.equal(paths(True, screen, hidden), (hidden @ weight.t()).argmax(dim=1))


@pytest.mark.parametrize("settings", ["plain", "minimum length and suppressed tokens", "fairseq's cap"])
def test_greedy_search_through_the_librarys_screen_gives_transformers_ids(settings, paths, monkeypatch, rows_kernel):
    model = screen_model(seed=12)
    screen = fast_decoding.ScreenedArgmax.of(model, 1)
    if screen is None:
        pytest.skip(f"no int8 screen on this CPU (capability {torch.backends.cpu.get_cpu_capability()})")
    assert (screen.rows_kernel is not None) == rows_kernel
    kwargs = {
        "plain": dict(num_beams=1, max_new_tokens=12),
        "minimum length and suppressed tokens": dict(num_beams=1, max_new_tokens=12, min_new_tokens=6,
                                                     suppress_tokens=[7, 9]),
        "fairseq's cap": dict(generation_config=fairseq_generation_config(model.config, beam=1, max_len_a=1.0,
                                                                          max_len_b=2)),
    }[settings]  # fmt: skip
    chosen = []  # the rows of each of the library's choices
    choice = sys.modules[fast_decoding.BEAMS_MODULE].screened_choice
    monkeypatch.setattr(
        sys.modules[fast_decoding.BEAMS_MODULE], "screened_choice", lambda *a: chosen.append(len(a[0])) or choice(*a)
    )
    # one row; rows finishing at different steps; a batch of more rows than torch's int8 product serves
    for lengths in ((7,), (7, 4, 6), (7, 4, 6, 5, 7, 3, 6, 7, 2, 5, 4, 6)):
        ids, mask = batch(seed=4, lengths=lengths, vocab=model.config.vocab_size)
        native = paths(True, model.generate, input_ids=ids, attention_mask=mask, **kwargs)
        assert torch.equal(native, paths(False, model.generate, input_ids=ids, attention_mask=mask, **kwargs))
        assert torch.equal(native, model.generate(input_ids=ids, attention_mask=mask, fast_decoding=False, **kwargs))
    # the batch's 12 rows through the screen where its product is the int8 few-rows kernel's, else the whole product
    assert max(chosen) == (12 if rows_kernel else 3)


def test_the_slots_reordering_copies_what_pythons_does(paths):
    """`PositionSlots.select_rows` through the library: the same keys and values, for reorderings, fewer rows
    (finished sources) and more (the first step's copies), at several lengths, into the spare where it has room;
    and `PositionSlots.views` the same views."""
    g = torch.Generator().manual_seed(0)
    slots = {True: fast_decoding.PositionSlots(3), False: fast_decoding.PositionSlots(3)}
    rows = 6
    like = torch.zeros(1)
    for length in range(0, 20):
        for slot in slots.values():
            keys, values = paths(False, slot.views, rows, 1, 2, 4, 5, like)  # (this step's slot: the step writes it)
            library_views = paths(True, slot.views, rows, 1, 2, 4, 5, like)  # the same views through the library
            for a, b in zip((*keys, *values), (*library_views[0], *library_views[1])):
                assert (a.shape, a.stride(), a.data_ptr()) == (b.shape, b.stride(), b.data_ptr())
            torch.manual_seed(length)
            for tensor in (*keys, *values):
                tensor[-1].copy_(torch.randn(tensor[-1].shape))
            slot.length += 1
        new_rows = max(1, rows - 1) if length % 3 == 0 else rows + 3 if length % 5 == 1 else rows
        order = torch.randint(0, rows, (new_rows,), generator=g)
        for in_library, slot in slots.items():
            paths(in_library, slot.select_rows, order)
        rows = new_rows
        python, library = slots[False], slots[True]
        for a, b in ((python.keys, library.keys), (python.values, library.values)):
            assert a.shape == b.shape and torch.equal(a[:, : length + 1], b[:, : length + 1]), length


@pytest.mark.parametrize("depth", [64, 5], ids=["whole-lines-streamed", "partial-lines-memcpy"])
def test_a_batched_reordering_shared_between_threads_copies_what_pythons_does(paths, depth):
    """Copies of batched size (past `kStreamBytes`, 16 MiB: streaming stores where each (h, d) vector is whole
    64-byte lines, memcpy where it is not) shared between two threads by (layer, position): the same keys and
    values as the Python loop's index_select, for a beam reordering and for finished sources leaving."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        g = torch.Generator().manual_seed(1)
        layers, capacity, heads = 3, 24, 4
        rows = 700 if depth == 64 else 2_000  # 21 positions kept: 86 or 20 MB in all
        keys = torch.randn(layers, capacity, rows, heads, depth, generator=g)
        values = torch.randn(layers, capacity, rows, heads, depth, generator=g)
        slots = {}
        for in_library in (True, False):
            slot = slots[in_library] = fast_decoding.PositionSlots(layers)
            slot.keys, slot.values, slot.length = keys.clone(), values.clone(), 20
        for order in (torch.randint(0, rows, (rows,), generator=g), torch.arange(0, rows, 3)):
            for in_library, slot in slots.items():
                paths(in_library, slot.select_rows, order)
            python, library = slots[False], slots[True]
            for a, b in ((python.keys, library.keys), (python.values, library.values)):
                assert a.shape == b.shape and torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("groups", [1, 3], ids=["one-source", "three-sources"])
def test_followed_beams_decode_through_their_lineage_as_copied_ones(paths, groups):
    """Beam search's reordering followed without a copy (`PositionSlots.follow`), the library's step reading each
    row's earlier keys and values through its lineage (`RowsDecoder.session`): the same outputs, bit for bit, as the
    step on copied rows, over reorderings that repeat and drop beams of each source, and with three sources after
    the first has finished (its rows left in the buffers); then copied in order (`select_rows`), the same buffers."""
    paths(True, lambda: None)  # the library loaded for the rest of the test
    library = fast_decoding.beams_library()
    if not library.decoder_rows_supported():
        pytest.skip("the library's step needs AVX-512")
    model = eos_prone_model()
    config = model.config
    decoder = compiled_decoding.RowsDecoder.of(model)
    heads, d_k, d_v, layers = config.num_heads, config.d_k, config.d_v, config.num_decoder_layers
    g = torch.Generator().manual_seed(groups)
    k, source = 3, 5
    rows = groups * k
    cross_keys = [torch.randn(groups, heads, source, d_k, generator=g) for _ in range(layers)]
    cross_values = [torch.randn(groups, heads, source, d_v, generator=g) for _ in range(layers)]
    mask = torch.ones(groups, source, dtype=torch.long)
    mask[1:, -2:] = 0
    copied, followed = fast_decoding.PositionSlots(layers), fast_decoding.PositionSlots(layers)
    session = decoder.session(cross_keys, cross_values, mask)
    like = torch.zeros(1)
    with torch.inference_mode():
        for position in range(24):  # past the first growth of the buffers (16 positions)
            if position == 12 and groups > 1:  # the first source finished: its rows leave, kept in the buffers
                kept = torch.arange(k, rows)
                copied.select_rows(kept)
                assert followed.follow(kept) and followed.keys.shape[2] == rows
                groups, rows, mask = groups - 1, rows - k, mask[1:]
                cross_keys, cross_values = [c[1:] for c in cross_keys], [c[1:] for c in cross_values]
                session = decoder.session(cross_keys, cross_values, mask)
            tokens = torch.randint(4, config.vocab_size, (groups, k), generator=g)
            keys, values = copied.views(rows, groups, heads, d_k, d_v, like)
            expected = decoder(tokens, keys, values, cross_keys, cross_values, None, mask)
            followed.make_room(rows, heads, d_k, d_v, like)
            got = session.step(tokens, followed.keys, followed.values, followed.length, followed.lineage_for_step())
            assert torch.equal(got, expected), position
            copied.length += 1
            followed.length += 1
            # each row continues a beam of its own source: some repeated, some dropped
            order = torch.randint(0, k, (groups, k), generator=g) + torch.arange(groups)[:, None] * k
            copied.select_rows(order.view(-1))
            assert followed.follow(order.view(-1))
        # (the buffers grew at 16 positions: the rows that left were copied out then)
        assert followed.keys.shape[2] == rows
        held = followed.keys.shape[2]
        assert followed.lineage is not None and not followed.follow(torch.arange(held // 2))  # (half left: a copy)
        in_python = fast_decoding.PositionSlots(layers)  # the same copy by the Python loop's index_select
        in_python.keys, in_python.values = followed.keys.clone(), followed.values.clone()
        in_python.length, in_python.lineage = followed.length, followed.lineage.clone()
        paths(False, in_python.select_rows, torch.arange(rows))
        paths(True, followed.select_rows, torch.arange(rows))
        assert followed.lineage is None and in_python.lineage is None
        for slot in (followed, in_python):
            for a, b in ((copied.keys, slot.keys), (copied.values, slot.values)):
                assert torch.equal(a[:, : copied.length], b[:, : copied.length])
        # a lineage that names another source's row, or a row past the rows, is refused before any work
        followed.make_room(rows, heads, d_k, d_v, like)
        lineage = followed.lineage_for_step()
        lineage[0, 0] = rows if groups == 1 else k
        with pytest.raises(RuntimeError, match="lineage row"):
            session.step(tokens, followed.keys, followed.values, followed.length, lineage)
        # and so are buffers of another depth than the model's keys
        narrow = torch.zeros(*followed.keys.shape[:4], d_k - 1)
        with pytest.raises(RuntimeError, match="heads of"):
            session.step(tokens, narrow, followed.values, followed.length, None)


@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_a_batchs_step_takes_the_chosen_gemm_librarys_products(paths, monkeypatch, gemm):
    """Above 16 rows (a step in batches) the library's float32 products are torch's (oneMKL's) or, where oneDNN is the
    chosen GEMM library (other x86 CPUs than Intel's), oneDNN's inner product on the model's own weights with the ReLU
    as its post-op, as the compiled batched step's there: either way the eager step's outputs and slots to float32
    rounding, at 24 and 40 rows of three sources with padding, on one thread and on two; the step on per-layer views
    (`RowsDecoder.__call__`) the session's, bit for bit."""
    if gemm == "onednn" and not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    paths(True, lambda: None)  # the library loaded for the rest of the test
    if not fast_decoding.beams_library().decoder_rows_supported():
        pytest.skip("the library's step needs AVX-512")
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, gemm)
    model = eos_prone_model()
    decoder = compiled_decoding.RowsDecoder.of(model)
    assert decoder.onednn == (gemm == "onednn")
    config, eager = model.config, compile_step.DecoderStep(model)
    heads, d_k, d_v, layers = config.num_heads, config.d_k, config.d_v, config.num_decoder_layers
    threads = torch.get_num_threads()
    try:
        for count, (groups, k) in itertools.product((1, 2), ((3, 8), (4, 10))):
            torch.set_num_threads(count)
            g = torch.Generator().manual_seed(groups * k + count)
            rows, source = groups * k, 6
            cross_keys = [torch.randn(groups, heads, source, d_k, generator=g) for _ in range(layers)]
            cross_values = [torch.randn(groups, heads, source, d_v, generator=g) for _ in range(layers)]
            mask = torch.ones(groups, source, dtype=torch.long)
            mask[1:, -2:] = 0
            # (the sources are read for their shape: their keys and values are given)
            sources = torch.randn(groups, source, config.d_model, generator=g)
            session = decoder.session(cross_keys, cross_values, mask)
            ours, theirs = fast_decoding.PositionSlots(layers), fast_decoding.PositionSlots(layers)
            like = torch.zeros(1)
            with torch.inference_mode():
                for position in range(5):
                    tokens = torch.randint(4, config.vocab_size, (groups, k), generator=g)
                    keys, values = theirs.views(rows, groups, heads, d_k, d_v, like)
                    expected = eager(tokens, keys, values, cross_keys, cross_values, sources, mask)
                    # the same step on copies of per-layer views of our buffers (`RowsDecoder.__call__`)
                    views = [
                        tuple(t.clone() for t in part) for part in ours.views(rows, groups, heads, d_k, d_v, like)
                    ]
                    got = session.step(tokens, ours.keys, ours.values, ours.length, None)
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
                    # which takes the same products: the same outputs, bit for bit
                    assert torch.equal(decoder(tokens, *views, cross_keys, cross_values, sources, mask), got)
                    for mine, reference in ((ours.keys, theirs.keys), (ours.values, theirs.values)):
                        torch.testing.assert_close(mine[:, : position + 1], reference[:, : position + 1])
                    ours.length += 1
                    theirs.length += 1
    finally:
        torch.set_num_threads(threads)


def test_a_compiler_without_openmp_builds_the_library_without_it(tmp_path, monkeypatch):
    """`-fopenmp` refused (clang without libomp): the library is built again without the flag (its batched copies on
    one thread), not left out."""
    tried = []

    def compile_library(source, library, what, flags=(), python_module=None):
        tried.append(flags)
        if "-fopenmp" in flags:
            raise UserInputError(f"no {what}: clang++ failed (unsupported option '-fopenmp')")
        library.write_bytes(b"built")

    monkeypatch.setattr(native, "compile_library", compile_library)
    folder = one_source_beams.build(tmp_path)
    assert tried == [("-fopenmp",), ()]
    assert (folder / one_source_beams.LIBRARY).read_bytes() == b"built" and (
        folder / one_source_beams.MANIFEST
    ).is_file()


def test_the_manifest_names_what_the_library_was_built_for(library_folder):
    manifest = json.loads((library_folder / one_source_beams.FOLDER / one_source_beams.MANIFEST).read_text())
    library = library_folder / one_source_beams.FOLDER / one_source_beams.LIBRARY
    assert manifest == {**one_source_beams.manifest(), "library": compiled_decoding.file_sha256(library)}
    assert manifest["python"] == sys.implementation.cache_tag and manifest["torch"] == torch.__version__


def test_a_library_of_another_torch_python_or_source_or_truncated_is_one_line_and_the_python_loop(
    library_folder, tmp_path
):
    """Not loaded (in a fresh process, where nothing is loaded yet; none of these loads, so one process tries all):
    one logged line each, and beam search keeps its Python loop."""
    expected = {
        "torch": "built for torch 0.0.0",
        "python": "built for Python 0.0.0",
        "source": "another version of its source",
        "truncated": "not the one built (truncated or changed since)",
    }
    for case in expected:
        folder = tmp_path / case
        shutil.copytree(library_folder / one_source_beams.FOLDER, folder / one_source_beams.FOLDER)
        if case == "truncated":
            library = folder / one_source_beams.FOLDER / one_source_beams.LIBRARY
            library.write_bytes(library.read_bytes()[:5000])  # loading it would end the process (SIGBUS)
        else:
            manifest = folder / one_source_beams.FOLDER / one_source_beams.MANIFEST
            manifest.write_text(json.dumps({**json.loads(manifest.read_text()), case: "0.0.0"}))
    statement = (
        "from pathlib import Path; from vaswani_tx import one_source_beams as b, fast_decoding as f;"
        f"print([b.load(Path(sys.argv[1]) / case) for case in {list(expected)!r}], f.beams_library())"
    )
    printed, logged = in_a_fresh_process(statement, tmp_path)
    assert printed == "[False, False, False, False] None"
    lines = [line for line in logged if "beam-search library" in line]
    assert len(lines) == 4
    for line, (case, words) in zip(lines, expected.items()):
        assert case in line and words in line and "Python loop" in line, (case, line)


def test_a_failing_compiler_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "false")
    with pytest.raises(UserInputError, match="no beam-search library: false failed"):
        one_source_beams.build(tmp_path)
    assert not (tmp_path / one_source_beams.FOLDER).exists()


def test_a_second_build_of_the_same_source_is_a_copy(library_folder, tmp_path, monkeypatch):
    """Built once for this torch and compiler: the next folder's library is the cached one, no compiler run."""
    monkeypatch.setattr(native.subprocess, "run", lambda *a, **k: pytest.fail("compiled again"))
    one_source_beams.build(tmp_path)
    built = (folder / one_source_beams.FOLDER / one_source_beams.LIBRARY for folder in (library_folder, tmp_path))
    assert len({path.read_bytes() for path in built}) == 1
