"""The decoding step compiled ahead of time (compiled_decoding.py, `vaswani-tx compile`): loaded by
`from_pretrained` where it fits, the same ids as transformers' loops and the eager step, and a one-line note
and the eager path for an artifact made for another torch, CPU or set of weights, or one that is truncated.

Each compilation takes 10-20 s, so one tiny model is compiled once for the module.
Speed is measured by benchmarks/bench_speed.py and bench_translate.py, never asserted here.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import LogitsProcessorList

from test_fast_decoding import EndsAt, EndsAtPerSource, ends, eos_prone_model
from test_modeling import batch, tiny_model
from vaswani_tx import compile_step, compiled_decoding, fast_decoding, int8_rows, one_source_beams, quantization
from vaswani_tx.cli import main
from vaswani_tx.compile_step import compile_decoder_step
from vaswani_tx.compiled_decoding import ENCODER_FOLDER, FOLDER, MANIFEST, PACKAGE, native_folder
from vaswani_tx.errors import UserInputError
from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
from vaswani_tx.precision import bf16_is_fast
from vaswani_tx.quantization import quantize_int8


@pytest.fixture(scope="module")
def compiled_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled-model")
    eos_prone_model(seed=0).save_pretrained(folder)
    # two processes (`compiled_apart`) on any machine: every test of the steps below tests that path too
    saved = sorted(path.name for path in folder.iterdir())
    assert main(["compile", str(folder), "--jobs", "2"]) == 0
    # into the per-user cache (keyed by the package, torch, the CPU and the weights), never the model folder
    assert sorted(path.name for path in folder.iterdir()) == saved
    assert native_folder(folder).parent == compiled_decoding.cache_root() / "models"
    return folder


def note_steps(patch, note) -> None:
    """`note(step)` at each decoder step a compiled session takes, with the `CompiledStep` that serves it (its
    compiled library, or the beam-search library's step: `RowsDecoder`), and once for a whole beam search that the
    library runs in one call (`library_search`: its steps are that step's); `patch`: a monkeypatch."""
    original = fast_decoding.CompiledSession.hidden
    patch.setattr(
        fast_decoding.CompiledSession, "hidden", lambda self, tokens: note(self.compiled) or original(self, tokens)
    )
    whole_search = fast_decoding.library_search

    def noted_search(session, *args):
        whole = whole_search(session, *args)
        if whole is not None:
            note(session.compiled)
        return whole

    patch.setattr(fast_decoding, "library_search", noted_search)


@pytest.fixture
def steps(monkeypatch):
    """How many steps went through the compiled library, which here serves calls of any number of rows (where
    oneDNN is chosen, calls of several rows otherwise decode eagerly on packed weights: `packs_beat_compiled`)."""
    monkeypatch.setattr(fast_decoding, "packs_beat_compiled", lambda model, rows: False)
    ran = []
    note_steps(monkeypatch, lambda step: ran.append(1))
    return ran


def ending_calls(ending, settings: dict):
    """generate()'s arguments for two batches whose sources end at different steps (`ending`), with `settings`."""
    for seed in (0, 4):
        ids, mask = batch(seed=seed, lengths=(7, 4, 6, 2))
        processors = LogitsProcessorList([ending([3, 7, 5, 12])])
        yield dict(input_ids=ids, attention_mask=mask, logits_processor=processors, **settings)


def eager_twin(folder):
    model = VaswaniForConditionalGeneration.from_pretrained(folder)
    model._compiled_step, model._compiled_folder = None, None  # (no folder: no compiled encoder either)
    return model


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=1),
        dict(num_beams=4),
        dict(num_beams=3, num_return_sequences=2, length_penalty=1.3, length_penalty_type="hf"),
        dict(num_beams=4, early_stopping=False, max_output_length_offset=5),
        dict(num_beams=1, min_new_tokens=9, max_new_tokens=9),
        dict(num_beams=4, min_new_tokens=9, max_new_tokens=9),
        dict(num_beams=2, no_repeat_ngram_size=2, repetition_penalty=1.5),
    ],
    ids=["greedy", "beam-paper", "beam-returns-2", "beam-no-early-stop", "greedy-min", "beam-min", "processors"],
)
# EndsAt keeps every source in beam search's bookkeeping; EndsAtPerSource lets finished ones leave it (its
# log-softmax then overwrites the logits). Either way finished sources leave the compiled step's batch.
@pytest.mark.parametrize("ending", [EndsAt, EndsAtPerSource])
def test_the_compiled_step_gives_the_eager_and_transformers_ids(compiled_folder, settings, ending, steps):
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    assert model._compiled_step is not None
    eager = eager_twin(compiled_folder)
    for kwargs in ending_calls(ending, settings):
        compiled = model.generate(**kwargs)
        assert torch.equal(compiled, eager.generate(**kwargs))
        assert torch.equal(compiled, model.generate(fast_decoding=False, **kwargs))
        assert "min_new_tokens" in settings or len(set(ends(compiled))) > 1  # sources left the batch at several steps
    assert steps  # the library decoded (the eager twin and transformers checked it)


def test_compile_builds_the_beam_search_library_and_from_pretrained_loads_it(compiled_folder):
    """`vaswani-tx compile` builds one_source_beams.py's library into the folder; a model loaded from the folder in a
    fresh process loads it, and a sentence a call decodes through it (`native_search`) to the Python loop's ids."""
    assert (native_folder(compiled_folder) / one_source_beams.FOLDER / one_source_beams.LIBRARY).is_file()
    code = """if True:
        import sys, torch
        from test_modeling import batch
        from vaswani_tx import fast_decoding
        from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
        model = VaswaniForConditionalGeneration.from_pretrained(sys.argv[1])
        library = fast_decoding.beams_library()
        assert library is not None
        ids, mask = batch(seed=2, lengths=(7,))
        taken = []
        native = fast_decoding.native_search
        fast_decoding.native_search = lambda *a: taken.append(1) or native(*a)
        ours = model.generate(input_ids=ids, attention_mask=mask, num_beams=4)
        del sys.modules[fast_decoding.BEAMS_MODULE]
        assert taken and torch.equal(ours, model.generate(input_ids=ids, attention_mask=mask, num_beams=4))
        print("ok")
    """
    tests = str(Path(__file__).parent)
    done = subprocess.run(
        [sys.executable, "-c", code, str(compiled_folder)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": tests},
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_what_the_step_does_not_cover_decodes_eagerly(compiled_folder, steps):
    """A decoder prefix of several tokens, a model in float16 (no step has that dtype): the eager step, same ids."""
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    ids, mask = batch(seed=3)
    prefix = torch.tensor([[2, 7], [2, 9], [2, 11]])
    out = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=prefix, num_beams=3)
    assert torch.equal(out, eager.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=prefix, num_beams=3))
    model.to(torch.float16)
    model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=4)
    assert steps == []


def test_the_steps_encoder_decoder_attention_is_sums_of_products_not_batched_matrix_products():
    """A source's k beams against its S keys are thousands of tiny products a step, which Inductor's loops run faster
    than batched GEMM calls: exported, the encoder-decoder attention is element-wise products and sums
    (`broadcast_attention`), and only the self-attention's one query a row (which Inductor turns into loops itself)
    is a matrix product; its output is the eager attention's to float32 rounding."""
    from torch.export import export

    from vaswani_tx.compile_step import DecoderStep, _example
    from vaswani_tx.modeling_vaswani import broadcast_attention, scaled_dot_product_attention

    model = eos_prone_model(seed=0).eval()
    with torch.no_grad():
        program = export(DecoderStep(model), _example(model), strict=False)
    products = [
        node
        for node in program.graph.nodes
        if node.target in (torch.ops.aten.bmm.default, torch.ops.aten.matmul.default)
    ]
    assert len(products) == 2 * model.config.num_decoder_layers  # q K^T and the weights times V of the self-attention

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(3, 4, length, 8, generator=generator) for length in (6, 5, 5))
    mask = torch.zeros(3, 1, 1, 5).masked_fill(torch.tensor([False, False, False, True, True]), -1e9)
    attention = model.get_decoder().layers[0].cross_attn
    for out, eager in zip(
        broadcast_attention(attention, query, key, value, mask, 0.35),
        scaled_dot_product_attention(attention, query, key, value, mask, 0.35),
    ):
        assert out.shape == eager.shape and torch.allclose(out, eager, atol=1e-6)


def test_the_step_reads_the_models_own_weights(compiled_folder, steps):
    """No copy of the weights in the library: a change in place is decoded with at once, and tensors replaced
    by `load_state_dict(assign=True)` are bound again."""
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    ids, mask = batch(seed=5)
    with torch.no_grad():
        for m in (model, eager):
            m.model.decoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)
    assert torch.equal(
        model.generate(input_ids=ids, attention_mask=mask), eager.generate(input_ids=ids, attention_mask=mask)
    )
    other = eos_prone_model(seed=7)
    for m in (model, eager):
        m.load_state_dict(other.state_dict(), assign=True)
        m.tie_weights()
    assert torch.equal(
        model.generate(input_ids=ids, attention_mask=mask), eager.generate(input_ids=ids, attention_mask=mask)
    )
    assert steps


def test_the_models_tensors_are_read_where_they_were_found_while_the_modules_hold_them():
    """`held_tensors` (what `CompiledStep.usable` reads at every call) is `step_tensors`, the walk, after any change
    to the modules: a module, parameter or buffer replaced, removed or set where it was None; a change in place
    leaves the same tensors (their fingerprints tell it)."""
    import copy

    from vaswani_tx.compiled_decoding import held_tensors, step_tensors, tensor_fingerprint

    model = eos_prone_model()

    def same() -> bool:
        held, walked = held_tensors(model), step_tensors(model)
        return list(held) == list(walked) and all(a is b for a, b in zip(held.values(), walked.values()))

    layer = model.model.decoder.layers[0]
    changes = [
        lambda: setattr(layer.feed_forward, "w_1", torch.nn.Linear(layer.feed_forward.w_1.in_features, 7)),
        lambda: setattr(layer.self_attn.q_proj, "weight", torch.nn.Parameter(layer.self_attn.q_proj.weight + 1)),
        lambda: model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True),
        lambda: layer.self_attn_norm.register_buffer("extra", None),
        lambda: setattr(layer.self_attn_norm, "extra", torch.ones(3)),
        lambda: delattr(layer.self_attn_norm, "extra"),
        lambda: delattr(layer.feed_forward.w_1, "bias"),
        lambda: setattr(model.model.decoder.layers, "0", copy.deepcopy(layer)),
    ]
    assert same()
    for change in changes:
        before = held_tensors(model)
        change()
        assert same()
        assert held_tensors(model) is not before  # found again
    before = held_tensors(model)
    fingerprints = [tensor_fingerprint(t) for t in before.values()]
    with torch.no_grad():
        model.model.decoder.layers[1].feed_forward.w_2.weight.mul_(2)
    assert held_tensors(model) is before and same()
    assert [tensor_fingerprint(t) for t in before.values()] != fingerprints


@pytest.fixture
def few_rows_calls(monkeypatch):
    """The rows of each call of a compiled step: few-rows step's (True) or the other's (False)."""
    calls = []
    note_steps(monkeypatch, lambda step: calls.append(step.few_rows is not None))
    return calls


def without_rows_decoder(patch) -> None:
    """The library's few-rows step set aside (`patch`: a monkeypatch): the compiled few-rows step does its work."""
    patch.setattr(compiled_decoding.RowsDecoder, "of", classmethod(lambda cls, model: None))


@pytest.fixture(params=["library", "compiled"])
def few_rows_work(request, monkeypatch):
    """Who does the float32 few-rows step's work: the beam-search library's `decoder_rows` (`RowsDecoder`, where the
    folder's library loaded, as `vaswani-tx compile` builds it) or the compiled step itself (the library set aside)."""
    if request.param == "compiled":
        without_rows_decoder(monkeypatch)
    return request.param


def test_calls_of_a_few_rows_decode_through_the_few_rows_step(compiled_folder, few_rows_calls, few_rows_work):
    """`vaswani-tx compile` writes the few-rows step (`compiled-few`: its own copy of the weights packed for Inductor's
    kernels, in a safetensors file beside a package that holds none), which decodes calls of up to `FEW_ROWS_MAX`
    rows (sources x beams) and gives the eager ids; calls of more rows go through the other step. Where the
    beam-search library loaded, the library's step does its work on the model's own weights (`RowsDecoder`), and its
    copy of the weights is not loaded."""
    few = native_folder(compiled_folder) / compiled_decoding.FEW_ROWS_FOLDER
    manifest = json.loads((few / MANIFEST).read_text())
    assert (
        manifest["few_rows"] == compiled_decoding.FEW_ROWS_MAX and (few / compiled_decoding.FEW_ROWS_WEIGHTS).is_file()
    )
    assert_holds_no_weights(few / PACKAGE)
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    assert "few_rows" not in model._compiled_steps  # loaded at the first call that needs it
    cases = [((7,), 1), ((7,), 4), ((5, 3), 3), ((6, 4, 2), 1), ((7, 4, 6, 2), 2), ((7, 4, 6, 2), 3), ((7,) * 9, 1)]
    assert_few_rows_decode_there(model, eager, cases, compiled_decoding.FEW_ROWS_MAX, few_rows_calls)
    step = model._compiled_steps["few_rows"]
    assert (step.rows_decoder is not None) == (few_rows_work == "library") and (step.own is None) == (
        step.rows_decoder is not None
    )


def step_inputs(model, groups: int, rows: int, written: int, source: int, seed: int) -> tuple:
    """A few-rows step's inputs (`DecoderStep`'s): random slots with `written` positions so far and a slot for this one,
    random encoder-decoder keys and values, the later sources' last positions padding."""
    config, generator = model.config, torch.Generator().manual_seed(seed)
    layers, heads = config.num_decoder_layers, config.num_heads

    def random(*shape):
        return torch.randn(*shape, generator=generator)

    tokens = torch.randint(4, config.vocab_size, (groups, rows), generator=generator)
    self_keys = tuple(random(written + 1, groups, rows, heads, config.d_k) for _ in range(layers))
    self_values = tuple(random(written + 1, groups, rows, heads, config.d_v) for _ in range(layers))
    cross_keys = tuple(random(groups, heads, source, config.d_k) for _ in range(layers))
    cross_values = tuple(random(groups, heads, source, config.d_v) for _ in range(layers))
    mask = torch.ones(groups, source, dtype=torch.long)
    for g in range(1, groups):
        mask[g, source - g :] = 0
    return tokens, self_keys, self_values, cross_keys, cross_values, random(groups, source, config.d_model), mask


def test_the_librarys_decoder_step_is_the_compiled_few_rows_steps_function(compiled_folder, monkeypatch):
    """The library's step (`RowsDecoder`) and the compiled few-rows step, given the same inputs, give the same outputs
    and write the same keys and values into the slot of this position, to float32 rounding: one to eight rows, of one
    source or several with padding, at the first position and later ones."""
    library = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    with monkeypatch.context() as patch:
        without_rows_decoder(patch)
        compiled = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
        reference = compiled_decoding.step_for_rows(compiled, 4)
    ours = compiled_decoding.step_for_rows(library, 4)
    assert ours.rows_decoder is not None and reference.rows_decoder is None
    for seed, (groups, rows, written, source) in enumerate(
        [(1, 1, 0, 7), (1, 4, 3, 9), (2, 3, 5, 6), (1, 8, 2, 20), (4, 2, 1, 5), (1, 6, 30, 33)]
    ):
        inputs = step_inputs(library, groups, rows, written, source, seed)
        copies = [tuple(tuple(t.clone() for t in part) if isinstance(part, tuple) else part for part in inputs)
                  for _ in range(2)]  # fmt: skip
        with torch.inference_mode():
            got, expected = ours(*copies[0]), reference(*copies[1])
        assert got.shape == (groups * rows, library.config.d_model)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for mine, theirs in zip(copies[0][1] + copies[0][2], copies[1][1] + copies[1][2]):  # the slots written
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_the_librarys_decoder_step_is_the_eager_steps_for_a_converted_models_biases(compiled_folder):
    """A converted model's attention biases (Marian, fairseq: `attention_bias`) and unscaled embeddings: the library's
    step gives the eager step's outputs (`DecoderStep` run by the model's own modules). Its feed-forward products are
    large enough (1,024 x 64) for their columns to be shared between two threads: the same sums as on one."""
    VaswaniForConditionalGeneration.from_pretrained(compiled_folder)  # (loads the folder's library)
    model = tiny_model(seed=3, attention_bias=True, scale_embedding=False, d_model=64, d_ff=1024, num_heads=4)
    decoder = compiled_decoding.RowsDecoder.of(model)
    assert decoder is not None
    for seed, (groups, rows, written, source) in enumerate([(1, 4, 2, 7), (3, 2, 0, 5)]):
        inputs = step_inputs(model, groups, rows, written, source, seed)
        copies = [tuple(tuple(t.clone() for t in part) if isinstance(part, tuple) else part for part in inputs)
                  for _ in range(2)]  # fmt: skip
        with torch.inference_mode():
            got, expected = decoder(*copies[0]), compile_step.DecoderStep(model)(*copies[1])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        threads = torch.get_num_threads()
        try:  # the products' columns shared between threads: the same sums on one thread and on two
            for count in (1, 2):
                torch.set_num_threads(count)
                with torch.inference_mode():
                    assert torch.equal(decoder(*step_inputs(model, groups, rows, written, source, seed)), got)
        finally:
            torch.set_num_threads(threads)


def test_the_librarys_decoder_step_takes_relu_models_only(compiled_folder):
    """Another activation than the paper's ReLU (a converted OPUS-MT model's swish) keeps the compiled step; so does a
    model whose weights are not plain float32 tensors on the CPU."""
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    assert compiled_decoding.RowsDecoder.of(model) is not None
    model.config.activation_function = "swish"
    assert compiled_decoding.RowsDecoder.of(model) is None
    model.config.activation_function = "relu"
    model.model.decoder.layers[0].feed_forward.w_1.weight.data = (
        model.model.decoder.layers[0].feed_forward.w_1.weight.data.t().contiguous().t()
    )
    assert compiled_decoding.RowsDecoder.of(model) is None
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)  # an embedding matrix of another layout
    embedding = model.get_decoder().embeddings.embed_tokens.weight
    embedding.data = embedding.data.t().contiguous().t()
    assert compiled_decoding.RowsDecoder.of(model) is None


def step_copies(inputs: tuple) -> list[tuple]:
    """Two copies of a step's inputs, each with slots of its own to write."""
    return [tuple(tuple(t.clone() for t in part) if isinstance(part, tuple) else part for part in inputs)
            for _ in range(2)]  # fmt: skip


@pytest.mark.skipif(not int8_rows.cpu_supports()[0], reason="a CPU without AVX512-VNNI: no int8 few-rows kernel")
def test_the_librarys_int8_decoder_step_is_the_compiled_int8_few_rows_steps_function(compiled_folder, monkeypatch):
    """An int8 model's few-rows step goes through the library's `decoder_rows_int8` (`RowsDecoder` on the int8 layers'
    kernel buffers): given the compiled int8 few-rows step's inputs, the same outputs and the same keys and values
    written into this position's slot. Both make each product a call of the int8 few-rows kernel; their attention and
    norms sum in other orders, and an activation that lands on the other side of a rounding boundary moves its
    product by one quantization step, hence a tolerance above float32 rounding's."""
    model, _ = int8_twins(compiled_folder)
    with monkeypatch.context() as patch:
        without_rows_decoder(patch)
        compiled, _ = int8_twins(compiled_folder)
        reference = compiled_decoding.step_for_rows(compiled, 4)
    ours = compiled_decoding.step_for_rows(model, 4)
    assert ours.manifest.get("rows_kernel") and ours.rows_decoder is not None and reference.rows_decoder is None
    assert ours.rows_decoder.quantized  # the int8 layers' scales and sums, two a product
    for seed, (groups, rows, written, source) in enumerate([(1, 1, 0, 7), (1, 4, 3, 9), (2, 3, 5, 6), (1, 8, 2, 20)]):
        copies = step_copies(step_inputs(model, groups, rows, written, source, seed))
        with torch.inference_mode():
            got, expected = ours(*copies[0]), reference(*copies[1])
        assert got.shape == (groups * rows, model.config.d_model)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=2e-3)
        for mine, theirs in zip(copies[0][1] + copies[0][2], copies[1][1] + copies[1][2]):
            torch.testing.assert_close(mine, theirs, rtol=1e-3, atol=2e-3)


@pytest.mark.parametrize("converted", [False, True], ids=["paper", "biases"])
def test_the_librarys_encoder_is_the_encoder_pass(compiled_folder, converted):
    """The library's encoder (`RowsEncoder`, `encoder_rows`) gives `EncoderPass`'s outputs for one source: the encoder
    output and each decoder layer's encoder-decoder keys and values, to float32 rounding, for the paper's model and a
    converted one's biases and unscaled embeddings; and, for the int8 model, the eager int8 layers' (the same kernel
    at these rows) to the quantization's rounding."""
    VaswaniForConditionalGeneration.from_pretrained(compiled_folder)  # (loads the folder's library)
    settings = dict(attention_bias=True, scale_embedding=False, d_model=64, d_ff=256, num_heads=4) if converted else {}
    model = tiny_model(seed=3, **settings)
    for int8 in (False, True):
        if int8:
            if not int8_rows.load(compiled_folder):  # (a CPU without AVX512-VNNI: no int8 few-rows kernel)
                continue
            model = quantize_int8(model)
            quantization.use_rows_kernel(model)
        encoder = compiled_decoding.RowsEncoder.of(model)
        assert encoder is not None and bool(encoder.quantized) == int8
        for seed, length in enumerate((1, 7, 19)):
            ids = torch.randint(4, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
            with torch.inference_mode():
                got = encoder(ids)
                expected = compile_step.EncoderPass(model)(model.get_input_embeddings()(ids))
            close = dict(rtol=1e-3, atol=2e-3) if int8 else dict(rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got.hidden, expected[0], **close)
            assert len(got.keys) == len(got.values) == model.config.num_decoder_layers
            for mine, theirs in zip([t for pair in zip(got.keys, got.values) for t in pair], expected[1:]):
                assert mine.is_contiguous() and mine.shape == theirs.shape
                torch.testing.assert_close(mine, theirs, **close)


@pytest.mark.skipif(not int8_rows.cpu_supports()[0], reason="a CPU without AVX512-VNNI: no int8 few-rows kernel")
def test_an_int8_sentence_a_call_is_encoded_by_the_library_while_the_weights_are_those_it_read(compiled_folder):
    """`translate --int8` a sentence a call: generate() encodes the one unpadded source through the library's encoder
    (the int8 model has no compiled one), with the ids of the eager int8 encoder (here the same kernel at these rows);
    once a weight changes in place it is made again from the model's tensors, and a padded batch goes eagerly."""
    model, _ = int8_twins(compiled_folder)
    eager, _ = int8_twins(compiled_folder)
    eager._compiled_folder = None  # (no folder: the eager encoder)
    ids, mask = batch(seed=3, lengths=(7,))
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12)
    assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
    encoder = model._compiled_steps["encoder"]
    assert type(encoder) is compiled_decoding.RowsEncoder
    with torch.no_grad():
        for twin in (model, eager):
            twin.model.encoder.layers[0].self_attn_norm.weight.mul_(0.5)
    assert not encoder.usable(model)
    assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
    assert model._compiled_steps["encoder"] is not encoder and model._compiled_steps["encoder"].usable(model)
    padded, padded_mask = batch(seed=3, lengths=(7, 4))
    assert compiled_decoding.encoder_for(model, padded, padded_mask) is None


@pytest.mark.skipif(not int8_rows.cpu_supports()[0], reason="a CPU without AVX512-VNNI: no int8 few-rows kernel")
def test_an_int8_projection_of_a_few_rows_is_the_layers_own_product(compiled_folder):
    """The int8 model's pre-softmax projection in a decoding session calls the int8 few-rows kernel straight where the
    layer would call it (`OwnProjection`): the logits of `project`, and their log-softmax; more rows than the kernel
    takes go through the layer. With Marian's fixed bias (this model's) and without."""
    model, _ = int8_twins(compiled_folder)
    layer = model.get_output_embeddings()
    for bias in (True, False):
        model.config.final_logits_bias = bias
        projection = fast_decoding.OwnProjection(model)
        assert projection.few_rows is not None and (projection.final_bias is not None) == bias
        for rows in (1, 4, layer.rows_kernel_elements // layer.in_features, 40):
            hidden = torch.randn(rows, 1, model.config.d_model, generator=torch.Generator().manual_seed(rows))
            with torch.inference_mode():
                expected = model.project(hidden).float()
                assert torch.equal(projection(hidden), expected)
                torch.testing.assert_close(projection(hidden, log_softmax=True), torch.log_softmax(expected, -1))


def with_library_projection(folder, patch):
    """The folder's model, its beam-search library and its float32 pre-softmax W, with the conditions of the
    library's few-rows projection set on any machine (`projection_library`: oneDNN chosen, a last-level cache twice
    W's size); `patch`: a monkeypatch. Skips the test on a CPU without AVX-512."""
    model = VaswaniForConditionalGeneration.from_pretrained(folder)  # (loads the folder's library)
    library = sys.modules.get(compiled_decoding.BEAMS_MODULE)
    if library is None or not library.decoder_rows_supported():
        pytest.skip("a CPU without AVX-512: no few-rows step or products")
    weight = fast_decoding.projection_weight(model, bfloat16=True)
    patch.setenv(compiled_decoding.GEMM_VARIABLE, "onednn")
    patch.setattr(fast_decoding, "last_level_cache_bytes", lambda: 2 * weight.numel() * weight.element_size())
    return model, library, weight


def test_a_float32_projection_of_a_few_rows_is_the_librarys_where_w_fits_the_cache(compiled_folder, monkeypatch):
    """Where oneDNN is the chosen library and the float32 W takes at most half the last-level cache, a call of up to
    `ROWS_PROJECTION_MAX_ROWS` rows projects through the library's few-rows product on the model's own W (nothing
    packed): W's product to float32 rounding, and its log-softmax; a sentence a call gives the eager model's ids
    through it. A call of more rows, a W past half the cache, or oneMKL's CPUs keep the packed products."""
    model, library, weight = with_library_projection(compiled_folder, monkeypatch)
    size = weight.numel() * weight.element_size()
    most = fast_decoding.ROWS_PROJECTION_MAX_ROWS
    for rows in (1, 4, most):
        projection = fast_decoding.Projection.of(model, rows)
        assert projection.library is library and projection.packed is None
        hidden = torch.randn(rows, 1, model.config.d_model, generator=torch.Generator().manual_seed(rows))
        with torch.inference_mode():
            expected = (hidden.reshape(rows, -1) @ weight.t()).view(rows, 1, -1)
            torch.testing.assert_close(projection(hidden), expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(projection(hidden, log_softmax=True), torch.log_softmax(expected, -1))
    assert fast_decoding.Projection.of(model, most + 1).library is None
    with monkeypatch.context() as patch:
        patch.setattr(fast_decoding, "last_level_cache_bytes", lambda: 2 * size - 1)
        assert fast_decoding.Projection.of(model, 4).library is None
    with monkeypatch.context() as patch:
        patch.setenv(compiled_decoding.GEMM_VARIABLE, "mkl")
        assert fast_decoding.Projection.of(model, 4).library is None
    projected = []
    original = library.rows_projection
    monkeypatch.setattr(library, "rows_projection", lambda *args: projected.append(1) or original(*args))
    monkeypatch.setattr(fast_decoding, "library_search", lambda *args: None)  # (the loop's steps, through Python)
    eager = eager_twin(compiled_folder)
    for seed, beams in ((1, 1), (2, 4), (3, 5)):
        ids, mask = batch(seed=seed, lengths=(7,))
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=beams)
        projected.clear()
        assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
        assert projected or beams == 1  # (greedy's float32 argmax may go through its int8 screen instead)


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_beams=4),  # the paper's: the source-length cap, </s> forced at 0
        dict(num_beams=3, num_return_sequences=2, length_penalty=1.3, length_penalty_type="hf"),
        dict(num_beams=4, early_stopping=False, max_output_length_offset=5),
        dict(num_beams=4, min_new_tokens=6, suppress_tokens=[5, 9, 10_000], max_output_length_offset=9),
        dict(num_beams=5, min_length=4, max_new_tokens=7),
        # fairseq's cap: </s> forced with its own log-probability, after at most 4 tokens; <pad> never, </s> not first
        dict(num_beams=4, max_len_a=0.0, max_len_b=4, min_new_tokens=1, suppress_tokens=[0], length_penalty=1.0),
    ],
    ids=["paper", "returns-2", "no-early-stop", "min-new-suppress", "min-length", "fairseq-cap"],
)
def test_a_sentences_whole_beam_search_is_one_library_call_with_the_python_loops_ids(
    compiled_folder, monkeypatch, settings
):
    """Where the step and the projection are the library's (a sentence a call, float32, W within the cache), the
    whole of `native_search`'s loop is one call of the library (`RowsSession.search`: the first step decoded once for
    the k beams, their keys and values followed through lineages, the processors as column masks): the ids of that
    loop through Python and of the eager model, for the paper's settings, several returned sequences, minimum lengths,
    suppressed tokens (one outside the vocabulary) and a cap that forces </s> at 0 or with its own score. A processor
    that is not a column mask (one that reads the beams' ids) keeps the loop in Python, with the same ids."""
    model, _, _ = with_library_projection(compiled_folder, monkeypatch)
    searched, original = [], fast_decoding.library_search

    def noted(*args):
        whole = original(*args)
        searched.append(whole is not None)
        return whole

    eager = eager_twin(compiled_folder)
    for seed in range(5):
        ids, mask = batch(seed=seed, lengths=(3 + 2 * seed,))
        kwargs = dict(input_ids=ids, attention_mask=mask, **settings)
        searched.clear()
        monkeypatch.setattr(fast_decoding, "library_search", noted)
        whole = model.generate(**kwargs)
        assert searched == [True], seed
        monkeypatch.setattr(fast_decoding, "library_search", lambda *args: None)
        assert torch.equal(whole, model.generate(**kwargs)), seed
        assert torch.equal(whole, eager.generate(**kwargs)), seed
        if seed == 0:  # a processor that reads the beams' ids: the loop stays in Python
            reads_ids = dict(kwargs, no_repeat_ngram_size=2)
            expected = eager.generate(**reads_ids)
            searched.clear()
            monkeypatch.setattr(fast_decoding, "library_search", noted)
            assert torch.equal(model.generate(**reads_ids), expected)
            assert searched == [False]


@pytest.mark.parametrize("settings", [dict(num_beams=1), dict(num_beams=4)], ids=["greedy", "beam"])
def test_a_call_down_to_a_few_rows_goes_on_through_the_few_rows_step(
    compiled_folder, settings, few_rows_calls, monkeypatch
):
    """A call of more rows than the few-rows step takes starts on the other step; once its finished sources have left
    and at most `FEW_ROWS_MAX` rows remain, it goes on through the few-rows step, with the eager ids."""
    monkeypatch.setattr(fast_decoding, "packs_beat_compiled", lambda model, rows: False)  # (as `steps` does)
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    beams = settings["num_beams"]
    for seed in (0, 4):
        lengths = (7, 4, 6, 2) if beams > 1 else (7, 4, 6, 2, 5, 3, 7, 4, 6, 2)
        ids, mask = batch(seed=seed, lengths=lengths)
        ending = [3, 7, 5, 12] if beams > 1 else [3, 7, 5, 12, 4, 6, 3, 9, 5, 12]
        kwargs = dict(
            input_ids=ids, attention_mask=mask, logits_processor=LogitsProcessorList([EndsAtPerSource(ending)])
        )
        few_rows_calls.clear()
        assert torch.equal(model.generate(**kwargs, **settings), eager.generate(**kwargs, **settings))
        assert len(lengths) * beams > compiled_decoding.FEW_ROWS_MAX
        assert few_rows_calls[0] is False and few_rows_calls[-1] is True and few_rows_calls == sorted(few_rows_calls)


@pytest.fixture
def encoder_calls(monkeypatch):
    """The shape of each source the compiled encoder encodes, where it is taken for a float32 model on any CPU (on
    oneDNN's, the library's encoder is: `library_encodes`, tested below)."""
    monkeypatch.setattr(compiled_decoding, "library_encodes", lambda: False)
    calls = []
    original = compiled_decoding.CompiledEncoder.__call__
    monkeypatch.setattr(
        compiled_decoding.CompiledEncoder,
        "__call__",
        lambda self, ids: calls.append(tuple(ids.shape)) or original(self, ids),
    )
    return calls


def one_source(length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = batch(seed=seed, lengths=(length,))
    return ids, mask


@pytest.mark.parametrize("encoder", ["compiled", "library"])
def test_one_source_a_call_is_encoded_by_the_compiled_encoder(compiled_folder, encoder_calls, monkeypatch, encoder):
    """`vaswani-tx compile` writes the encoder of one source (`compiled-encoder`: a package that holds no weights, its
    products oneMKL's on the model's own or Inductor's on a packed copy, by the CPU's GEMM library: the test below).
    One unpadded source a call (its mask all ones, or none) is encoded there: the eager encoder's output to float32
    rounding at every length, and generate()'s ids, greedy and beam, the eager model's. Where the library encodes
    instead (`library_encodes`: oneDNN's CPUs), the beam-search library's `RowsEncoder` does, to the same rounding
    and ids, sources of more than 16 tokens too."""
    if encoder == "library":
        if not compiled_decoding.RowsEncoder.of(VaswaniForConditionalGeneration.from_pretrained(compiled_folder)):
            pytest.skip("no library encoder on this CPU (AVX-512)")
        monkeypatch.setattr(compiled_decoding, "library_encodes", lambda: True)
        original = compiled_decoding.RowsEncoder.__call__
        monkeypatch.setattr(
            compiled_decoding.RowsEncoder,
            "__call__",
            lambda self, ids: encoder_calls.append(tuple(ids.shape)) or original(self, ids),
        )
    encoder_folder = native_folder(compiled_folder) / compiled_decoding.ENCODER_FOLDER
    manifest = json.loads((encoder_folder / MANIFEST).read_text())
    assert manifest["part"] == "encoder" and (encoder_folder / compiled_decoding.FEW_ROWS_WEIGHTS).is_file()
    assert_holds_no_weights(encoder_folder / PACKAGE)
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    assert "encoder" not in model._compiled_steps  # loaded at the first call that needs it
    for length in (1, 2, 7, 23):
        ids, mask = one_source(length, seed=length)
        with torch.no_grad():
            taken = compiled_decoding.encoder_for(model, ids, mask)
            kind = compiled_decoding.RowsEncoder if encoder == "library" else compiled_decoding.CompiledEncoder
            assert type(taken) is kind
            encoded = taken(ids)
            expected = eager.get_encoder()(input_ids=ids).last_hidden_state
            torch.testing.assert_close(encoded.hidden, expected, rtol=1e-5, atol=1e-5)
            for layer, keys, values in zip(eager.get_decoder().layers, encoded.keys, encoded.values, strict=True):
                for got, want in zip((keys, values), layer.cross_attn.keys_values(expected)):
                    assert got.is_contiguous()
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        for settings in (dict(num_beams=1), dict(num_beams=3), dict(num_beams=2, min_new_tokens=4)):
            for given_mask in (mask, None):
                encoder_calls.clear()
                out = model.generate(input_ids=ids, attention_mask=given_mask, max_new_tokens=12, **settings)
                assert torch.equal(
                    out, eager.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, **settings)
                )
                assert encoder_calls == [(1, length)]


@pytest.mark.parametrize("gemm", ["mkl", "onednn"])
def test_the_compiled_encoders_products_are_the_cpus_gemm_librarys(compiled_folder, tmp_path, monkeypatch, gemm):
    """Where oneMKL is the CPU's GEMM library (`VASWANI_TX_GEMM`, Intel's CPUs by default), the compiled encoder's
    products are oneMKL's on the model's own weights: no packed copy (its weights file holds the positions' table
    only), and the model's pages are not given back, since its products read them. Where oneDNN is, they are
    Inductor's C++ template on a packed copy of the encoder's weights and the encoder-decoder keys' and values', whose
    plain pages go back once. Either gives the eager encoder's output and generate()'s eager ids."""
    monkeypatch.setattr(compiled_decoding, "library_encodes", lambda: False)  # (the compiled encoder on either CPU)
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, gemm)
    if compiled_decoding.gemm_backend() != gemm:
        pytest.skip("torch without oneDNN's inner product")
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    model.save_pretrained(tmp_path)
    compile_step.compile_encoder(model, native_folder(tmp_path))
    encoder_folder = native_folder(tmp_path) / ENCODER_FOLDER
    manifest = json.loads((encoder_folder / MANIFEST).read_text())
    assert manifest["gemm"] == gemm and manifest["weights_packed"] is (gemm == "onednn")
    assert_holds_no_weights(encoder_folder / PACKAGE)
    config = model.config
    # the encoder's products' weights and the encoder-decoder keys' and values', in bytes
    weighed = 4 * config.d_model * (config.num_encoder_layers * (4 * config.d_model + 2 * config.d_ff)
                                    + config.num_decoder_layers * 2 * config.d_model)  # fmt: skip
    table = 4 * config.max_position_embeddings * config.d_model
    own = (encoder_folder / compiled_decoding.FEW_ROWS_WEIGHTS).stat().st_size
    assert own > table + weighed if gemm == "onednn" else own < table + weighed // 4
    released = []
    monkeypatch.setattr(fast_decoding, "release_file_pages", lambda tensor: released.append(tensor.data_ptr()) or 0)
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    eager = eager_twin(compiled_folder)
    for length in (3, 11):
        ids, mask = one_source(length, seed=length + 1)
        with torch.no_grad():
            encoded = compiled_decoding.encoder_for(loaded, ids, mask)(ids)
            expected = eager.get_encoder()(input_ids=ids).last_hidden_state
        torch.testing.assert_close(encoded.hidden, expected, rtol=1e-5, atol=1e-5)
        for settings in (dict(num_beams=1), dict(num_beams=3)):
            out = loaded.generate(input_ids=ids, max_new_tokens=12, **settings)
            assert torch.equal(out, eager.generate(input_ids=ids, max_new_tokens=12, **settings))
    encoder_tensors = {name for name, source in manifest["constants"].items() if source == name}
    tensors = compiled_decoding.step_tensors(loaded)
    given_back = {name for name in encoder_tensors if tensors[name].data_ptr() in released}
    assert given_back == (encoder_tensors if gemm == "onednn" else set())


def test_the_compiled_encoder_embeds_with_the_encoders_own_table(tmp_path):
    """A model whose source and target have tables of their own (`share_encoder_decoder_embeddings=False`: FSMT, some
    OPUS-MT models): the compiled encoder looks the source up in the source table, not the decoder's."""
    from test_modeling import tiny_model

    model = tiny_model(seed=2, share_encoder_decoder_embeddings=False, decoder_vocab_size=70)
    assert model.get_encoder().embeddings.embed_tokens.weight is not model.get_decoder().embeddings.embed_tokens.weight
    model.save_pretrained(tmp_path)
    compile_step.compile_encoder(model, tmp_path)
    loaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    ids, mask = one_source(8, seed=6)
    with torch.no_grad():
        encoded = compiled_decoding.encoder_for(loaded, ids, mask)(ids)
        expected = model.get_encoder()(input_ids=ids).last_hidden_state
    torch.testing.assert_close(encoded.hidden, expected, rtol=1e-5, atol=1e-5)


def test_the_session_takes_the_compiled_encoders_keys_and_values_of_the_same_source(compiled_folder, monkeypatch):
    """The compiled encoder gives each decoder layer's encoder-decoder keys and values with the encoder output; the
    decoding session of the same call takes them (no `keys_values` of its own), and only where its encoder output is
    the very one they came from: a call given another encoder output computes its own."""
    from vaswani_tx.modeling_vaswani import MultiHeadAttention

    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    computed = []
    original = MultiHeadAttention.keys_values
    monkeypatch.setattr(MultiHeadAttention, "keys_values", lambda *a, **k: computed.append(1) or original(*a, **k))
    ids, mask = one_source(9, seed=3)
    for beams in (1, 4):
        computed.clear()
        out = model.generate(input_ids=ids, attention_mask=mask, num_beams=beams)
        assert computed == [] and "_encoded_source" not in model.__dict__  # taken, and no longer kept
        expected = eager.generate(input_ids=ids, attention_mask=mask, num_beams=beams)
        assert torch.equal(out, expected) and computed  # (the eager twin computes them)
    other_ids = one_source(9, seed=4)[0]
    with torch.no_grad():  # kept from an encoder pass, then a call with an encoder output of its own
        model._prepare_text_encoder_decoder_kwargs_for_generation(ids, {}, "input_ids", model.generation_config)
        other = model.get_encoder()(input_ids=other_ids)
    computed.clear()
    out = model.generate(input_ids=other_ids, encoder_outputs=other, num_beams=2)
    assert len(computed) == model.config.num_decoder_layers
    assert torch.equal(out, eager.generate(input_ids=other_ids, num_beams=2))


def test_what_the_compiled_encoder_does_not_cover_is_encoded_eagerly(compiled_folder, encoder_calls, caplog):
    """Several sources, a padded one, attentions asked for, a source longer than the encoder's positions, gradients on,
    training mode, weights changed in place, a bfloat16 model: the eager encoder (no line said), the same ids."""
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    eager = eager_twin(compiled_folder)
    ids, mask = one_source(7)
    compiled = compiled_decoding.encoder_for(model, ids, mask)
    assert compiled is None  # gradients on (outside generate())
    with torch.no_grad():
        compiled = compiled_decoding.encoder_for(model, ids, mask)
        assert compiled is not None
        model.train()
        assert compiled_decoding.encoder_for(model, ids, mask) is None
        model.eval()
    several, several_mask = batch(seed=2, lengths=(7, 4))
    padded, padded_mask = batch(seed=2, lengths=(7, 4))
    cases = [
        (several, several_mask, {}),
        (padded[1:], padded_mask[1:], {}),  # one source with padding
        (ids, mask, dict(output_attentions=True, return_dict_in_generate=True)),
    ]
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        for source, source_mask, settings in cases:
            out = model.generate(input_ids=source, attention_mask=source_mask, num_beams=2, **settings)
            expected = eager.generate(input_ids=source, attention_mask=source_mask, num_beams=2, **settings)
            if settings:
                out, expected = out.sequences, expected.sequences
            assert torch.equal(out, expected)
        model._compiled_steps["encoder"].rows = 6  # as if compiled for 6 positions: a 7-token source is longer
        assert torch.equal(model.generate(input_ids=ids), eager.generate(input_ids=ids))
        model._compiled_steps["encoder"].rows = model.config.max_position_embeddings
        with torch.no_grad():
            for twin in (model, eager):  # the weights changed in place: a copy of other weights no longer serves
                twin.get_encoder().layers[0].feed_forward.w_2.bias += 0.5
        assert torch.equal(model.generate(input_ids=ids, num_beams=2), eager.generate(input_ids=ids, num_beams=2))
        model.to(torch.bfloat16)
        model.generate(input_ids=ids, max_new_tokens=3)
    assert encoder_calls == [] and not [record for record in caplog.records if "encoder" in record.getMessage()]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda folder: edit_manifest(folder, ENCODER_FOLDER, torch="2.0.0"), "made with torch 2.0.0"),
        (lambda folder: edit_manifest(folder, ENCODER_FOLDER, weights="00000000"), "made for other weights"),
        (lambda folder: truncate(native_folder(folder) / ENCODER_FOLDER / PACKAGE), "not the one built"),
        (lambda folder: flip_a_byte(native_folder(folder) / ENCODER_FOLDER / PACKAGE), "not the one built"),
    ],
    ids=["other-torch", "other-weights", "truncated", "changed-bytes"],
)
def test_a_compiled_encoder_that_does_not_fit_is_one_line_and_the_eager_encoder(
    compiled_folder, tmp_path, caplog, encoder_calls, damage, message
):
    folder = copy_of(compiled_folder, tmp_path)
    damage(folder)
    model = VaswaniForConditionalGeneration.from_pretrained(folder)
    ids, mask = one_source(9)
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        for _ in range(2):  # said once
            out = model.generate(input_ids=ids, attention_mask=mask, num_beams=2)
            assert torch.equal(out, eager_twin(folder).generate(input_ids=ids, attention_mask=mask, num_beams=2))
    notes = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.compiled_decoding"]
    assert len(notes) == 1 and message in notes[0] and "\n" not in notes[0], notes
    assert "not using the compiled encoder" in notes[0] and "encoding eagerly" in notes[0]
    assert encoder_calls == [] and model._compiled_step is not None  # the decoding steps still serve


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:5000])


def flip_a_byte(path: Path) -> None:
    """The same size, one byte changed in the middle (a corrupt copy that a size check would take)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def assert_holds_no_weights(package_path):
    with zipfile.ZipFile(package_path) as package:
        assert not [name for name in package.namelist() if "/data/weights/" in name]


def assert_few_rows_decode_there(model, eager, cases, bound: int, calls: list):
    """Each case, (source lengths, beams), gives the eager model's ids, through the few-rows step where its rows
    (sources x beams) are at most `bound` and the other step otherwise."""
    for lengths, beams in cases:
        calls.clear()
        ids, mask = batch(seed=4, lengths=lengths)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=beams)
        assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
        rows = len(lengths) * beams
        # a call of more rows starts on the other step and may end on the few-rows one (`CompiledSession.fewer_rows`)
        assert calls and calls[0] == (rows <= bound) and calls == sorted(calls), (rows, lengths)


def test_the_few_rows_step_serves_only_the_weights_it_was_compiled_from(
    compiled_folder, tmp_path, few_rows_calls, monkeypatch
):
    """Its weights are a copy: a model whose weights changed in place (or were replaced) decodes through the other
    step, which reads the model's own; a copy of the model (`copy.deepcopy`) binds its own few-rows step; a folder
    compiled without it (`--no-few-rows`), or whose copy of the weights is damaged, decodes through the other."""
    import copy

    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    ids, mask = batch(seed=5, lengths=(6, 3))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=3)  # 6 rows
    twin = copy.deepcopy(model)
    changed = eager_twin(compiled_folder)
    with torch.no_grad():
        for m in (model, changed):
            m.model.decoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)
    assert torch.equal(model.generate(**kwargs), changed.generate(**kwargs))
    assert few_rows_calls and not any(few_rows_calls)
    few_rows_calls.clear()
    other = copy.deepcopy(twin)
    assert torch.equal(twin.generate(**kwargs), eager_twin(compiled_folder).generate(**kwargs))
    assert few_rows_calls and all(few_rows_calls)
    with torch.no_grad():  # a copy changed before its first call: the CRC says so, once while it stays unchanged
        other.model.decoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)
    checks = []
    original_fingerprint = compiled_decoding.weights_fingerprint
    monkeypatch.setattr(
        compiled_decoding, "weights_fingerprint", lambda m: checks.append(1) or original_fingerprint(m)
    )
    few_rows_calls.clear()
    for _ in range(2):
        assert torch.equal(other.generate(**kwargs), changed.generate(**kwargs))
    assert few_rows_calls and not any(few_rows_calls) and len(checks) == 1

    # (the library's step reads the model's own weights, not the copy: set aside for the copy's cases)
    without_rows_decoder(monkeypatch)
    folder = copy_of(compiled_folder, tmp_path)
    weights = native_folder(folder) / compiled_decoding.FEW_ROWS_FOLDER / compiled_decoding.FEW_ROWS_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])
    damaged = VaswaniForConditionalGeneration.from_pretrained(folder)
    few_rows_calls.clear()
    assert torch.equal(damaged.generate(**kwargs), eager_twin(compiled_folder).generate(**kwargs))
    assert few_rows_calls and not any(few_rows_calls) and damaged._compiled_steps["few_rows"] is None
    shutil.rmtree(native_folder(folder) / compiled_decoding.FEW_ROWS_FOLDER)
    plain = VaswaniForConditionalGeneration.from_pretrained(folder)
    few_rows_calls.clear()
    plain.generate(**kwargs)
    assert few_rows_calls and not any(few_rows_calls)


def test_a_call_takes_the_weights_fingerprints_once_and_the_next_call_sees_a_change(
    compiled_folder, encoder_calls, few_rows_calls, monkeypatch
):
    """A sentence a call asks the compiled encoder and the few-rows step whether the model's weights are still theirs;
    within one generate() call the fingerprints are taken once (`one_call`), through the prepared set-up of a
    sentence a call too, and dropped when the call ends, even by an error. A weight changed in place between two
    calls is seen by the next: it encodes and decodes eagerly, with the changed model's ids. The first call gives the
    encoder's plain pages back where it reads a packed copy of its own, then loads the few-rows step, whose CRC reads
    them again and gives each back again (`GIVEN_BACK`); no later call gives back any."""
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    changed = eager_twin(compiled_folder)
    released = []

    def giving_back(tensor):  # as where the weights lie in a file mapping (a tiny model's may span no whole page)
        released.append(tensor.data_ptr())
        compiled_decoding.GIVEN_BACK.add(tensor.data_ptr())
        return 4096

    for module in (fast_decoding, compiled_decoding):
        monkeypatch.setattr(module, "release_file_pages", giving_back)
    monkeypatch.setattr(compiled_decoding, "GIVEN_BACK", set())
    taken = []
    original = compiled_decoding.held_tensors
    monkeypatch.setattr(compiled_decoding, "held_tensors", lambda m: taken.append(1) or original(m))
    for seed in range(3):  # the first call makes the prepared set-up (`PreparedCall`), the others take it
        ids, _ = one_source(5, seed=seed)
        taken.clear(), encoder_calls.clear(), few_rows_calls.clear()
        out = model.generate(input_ids=ids, max_new_tokens=10, num_beams=2)
        assert torch.equal(out, changed.generate(input_ids=ids, max_new_tokens=10, num_beams=2))
        assert encoder_calls == [(1, 5)] and few_rows_calls and all(few_rows_calls)
        assert len(taken) == 1 and compiled_decoding.CALL_VERSIONS not in model.__dict__
        if seed == 0:
            tensors = compiled_decoding.step_tensors(model)
            encoder = model._compiled_steps["encoder"].manifest["constants"]
            pointers = {tensors[name].data_ptr() for name, source in encoder.items() if source == name}
            # (where the encoder's products read the model's own weights, oneMKL's CPUs, it gives none back)
            given = 2 if model._compiled_steps["encoder"].manifest["weights_packed"] else 0
            assert pointers and all(released.count(pointer) == given for pointer in pointers)
            released.clear()
    assert not released
    with pytest.raises(ValueError):  # (ids beyond the vocabulary: refused within the call)
        model.generate(input_ids=torch.full((1, 4), 10**6), max_new_tokens=10, num_beams=2)
    assert compiled_decoding.CALL_VERSIONS not in model.__dict__
    with torch.no_grad():
        for m in (model, changed):
            m.model.decoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)
            m.model.encoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)
    encoder_calls.clear(), few_rows_calls.clear()
    out = model.generate(input_ids=ids, max_new_tokens=10, num_beams=2)
    assert torch.equal(out, changed.generate(input_ids=ids, max_new_tokens=10, num_beams=2))
    assert not encoder_calls and not any(few_rows_calls)


def test_a_copy_of_the_model_decodes_through_a_step_of_its_own_and_int8_through_the_int8_step(compiled_folder, steps):
    """`copy.deepcopy` of a model with a compiled step (the library itself cannot be copied): the copy loads its own
    and binds it to the copy's tensors, leaving the original's alone; `quantize_int8`'s copy, as the docstring's
    `quantize_int8(from_pretrained(folder))` makes it, goes without the float32 step and loads the int8 one."""
    import copy

    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    ids, mask = batch(seed=5)
    expected = eager_twin(compiled_folder).generate(input_ids=ids, attention_mask=mask)
    twin = copy.deepcopy(model)
    assert twin._compiled_step is not None and twin._compiled_step.runner is not model._compiled_step.runner
    with torch.no_grad():
        twin.model.decoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)  # the copy's own weights, not the original's
    changed = eager_twin(compiled_folder)
    with torch.no_grad():
        changed.model.decoder.layers[0].feed_forward.w_1.weight.mul_(-1.5)
    assert torch.equal(
        twin.generate(input_ids=ids, attention_mask=mask), changed.generate(input_ids=ids, attention_mask=mask)
    )
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask), expected)
    assert len(steps) >= 2
    int8 = quantize_int8(model)
    assert int8._compiled_step.int8 is not None and model._compiled_step.int8 is None  # the folder's int8 step
    assert int8._compiled_step.runner is not model._compiled_step.runner
    assert int8.generate(input_ids=ids, attention_mask=mask).shape[0] == ids.shape[0]


def int8_twins(folder):
    """The folder's model quantized (`quantize_int8`, which loads the folder's int8 step) and an eager twin."""
    model = quantize_int8(VaswaniForConditionalGeneration.from_pretrained(folder))
    eager = quantize_int8(VaswaniForConditionalGeneration.from_pretrained(folder))
    eager._compiled_step = None
    return model, eager


@pytest.mark.parametrize("settings", [dict(num_beams=1), dict(num_beams=4), dict(num_beams=3, num_return_sequences=2)])
def test_the_int8_step_gives_the_eager_int8_ids(compiled_folder, settings, steps):
    """`vaswani-tx compile` also compiles the int8 model's step (`compiled-int8`), which calls the model's own int8
    layers (`vaswani_tx::int8_linear`) from the compiled attention, norms and residuals: `quantize_int8` (and so
    `translate --int8`) loads it, in place or on a copy, and it decodes what the eager int8 path decodes."""
    assert (native_folder(compiled_folder) / compiled_decoding.INT8_FOLDER / PACKAGE).is_file()
    model, eager = int8_twins(compiled_folder)
    assert model._compiled_step.manifest["precision"] == "int8"
    in_place = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    quantize_int8(in_place, inplace=True)
    assert in_place._compiled_step.int8 == [module for _, module in compiled_decoding.int8_layers(in_place)]
    for kwargs in ending_calls(EndsAtPerSource, settings):
        compiled = model.generate(**kwargs)
        assert torch.equal(compiled, eager.generate(**kwargs))
        assert torch.equal(in_place.generate(**kwargs), compiled)
        assert len(set(ends(compiled))) > 1  # sources left the batch at several steps
    assert steps


def test_the_int8_step_follows_the_models_int8_layers(compiled_folder, tmp_path, caplog, steps):
    """Two int8 models decode through their own layers, whichever ran last (the operator reads the layers of the
    step that runs); layers quantized again are bound again; a step made for other int8 layers (another set of
    quantized layers) is one line and the eager int8 path; a float32 model never loads the int8 step."""
    model, eager = int8_twins(compiled_folder)
    ids, mask = batch(seed=5)
    other = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    with torch.no_grad():
        other.model.decoder.layers[1].feed_forward.w_2.weight.mul_(-2.0)
    other = quantize_int8(other)
    other_eager = copy_model_without_step(other)
    for first, second in ((model, other), (other, model)):
        first.generate(input_ids=ids, attention_mask=mask, num_beams=2)
        second.generate(input_ids=ids, attention_mask=mask, num_beams=2)
    assert torch.equal(
        other.generate(input_ids=ids, attention_mask=mask), other_eager.generate(input_ids=ids, attention_mask=mask)
    )
    assert torch.equal(
        model.generate(input_ids=ids, attention_mask=mask), eager.generate(input_ids=ids, attention_mask=mask)
    )
    assert not torch.equal(
        other.generate(input_ids=ids, attention_mask=mask), model.generate(input_ids=ids, attention_mask=mask)
    )
    # the layers replaced by a quantization of other weights (same names and sizes): bound again
    layers = dict(compiled_decoding.int8_layers(other))
    for name, _ in compiled_decoding.int8_layers(model):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layers[name])
    steps.clear()
    assert torch.equal(
        model.generate(input_ids=ids, attention_mask=mask), other_eager.generate(input_ids=ids, attention_mask=mask)
    )
    assert steps
    folder = copy_of(compiled_folder, tmp_path)
    path = native_folder(folder) / compiled_decoding.INT8_FOLDER / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["int8_layers"] = manifest["int8_layers"][1:]
    path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        refused = quantize_int8(VaswaniForConditionalGeneration.from_pretrained(folder))
    notes = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.compiled_decoding"]
    assert len(notes) == 1 and "made for other int8 layers" in notes[0] and "decoding eagerly" in notes[0], notes
    assert refused._compiled_step is None
    assert torch.equal(
        refused.generate(input_ids=ids, attention_mask=mask), eager.generate(input_ids=ids, attention_mask=mask)
    )
    shutil.rmtree(native_folder(folder) / FOLDER)
    assert VaswaniForConditionalGeneration.from_pretrained(folder)._compiled_step is None


@pytest.mark.skipif(not int8_rows.cpu_supports()[0], reason="a CPU without AVX512-VNNI: no int8 few-rows kernel")
def test_int8_calls_of_a_few_rows_decode_through_the_kernels_step(compiled_folder, monkeypatch):
    """`vaswani-tx compile` builds the int8 few-rows kernel (`kernels/`) and the int8 model's few-rows step
    (`compiled-few-int8`), whose products are the kernel's calls on the layers' buffers: a call of up to
    `FEW_ROWS_MAX_INT8` rows decodes through it (one source, greedy and beam 6; four sources, beam 4), with the eager
    int8 path's ids, whose layers take the same kernel at those rows; a call of more rows through the other int8
    step. A layer's kernel buffers are not among the weights a step's fingerprint covers."""
    assert (native_folder(compiled_folder) / int8_rows.FOLDER / int8_rows.LIBRARY).is_file()
    assert (native_folder(compiled_folder) / compiled_decoding.FEW_ROWS_INT8_FOLDER / PACKAGE).is_file()
    model, eager = int8_twins(compiled_folder)
    assert all("rows_packed" in module._buffers for _, module in compiled_decoding.int8_layers(model))
    kernel_steps = []
    note_steps(monkeypatch, lambda step: kernel_steps.append(bool(step.manifest.get("rows_kernel"))))
    ids, mask = batch(seed=3, lengths=(7,))
    for settings in (dict(num_beams=1), dict(num_beams=6)):
        assert torch.equal(
            model.generate(input_ids=ids, attention_mask=mask, **settings),
            eager.generate(input_ids=ids, attention_mask=mask, **settings),
        )
    for kwargs in ending_calls(EndsAtPerSource, dict(num_beams=4)):  # 4 sources x 4 beams: 16 rows
        assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
    assert kernel_steps and all(kernel_steps)
    kernel_steps.clear()
    ids, mask = batch(seed=3, lengths=(7, 4, 6, 2, 5))
    model.generate(input_ids=ids, attention_mask=mask, num_beams=4)  # 20 rows (the kernel's step once 16 are left)
    assert kernel_steps and not kernel_steps[0] and kernel_steps == sorted(kernel_steps)
    fingerprint = compiled_decoding.weights_fingerprint(eager)
    for _, module in compiled_decoding.int8_layers(eager):
        for name in compiled_decoding.ROWS_BUFFERS:
            module._buffers.pop(name, None)
    assert compiled_decoding.weights_fingerprint(eager) == fingerprint


@pytest.mark.skipif(not int8_rows.cpu_supports()[0], reason="a CPU without AVX512-VNNI: no int8 few-rows kernel")
@pytest.mark.parametrize("instructions", ["AMX", "AVX512-BF16"], ids=["amx", "without-amx"])
def test_an_int8_batchs_step_is_the_librarys_where_every_layer_takes_the_kernel(
    compiled_folder, monkeypatch, instructions
):
    """Where the CPU has no AMX tiles every int8 layer takes the int8 few-rows kernel at any number of rows
    (int8_rows.py's `rows_limit`), and the int8 batched step's work goes through the beam-search library's step, on
    the same kernel (`int8_batched_on_library`), with the lineages for beam search's reordering; with AMX tiles it is
    the compiled int8 step's. Either way the eager int8 path's ids, greedy and beam search, sources leaving at
    several steps."""
    monkeypatch.setattr(fast_decoding, "packs_beat_compiled", lambda model, rows: False)
    monkeypatch.setattr(int8_rows, "cpu_bf16_instructions", lambda: instructions)
    model, eager = int8_twins(compiled_folder)
    library = instructions != "AMX"
    assert compiled_decoding.int8_batched_on_library(model) == library
    served = []
    note_steps(monkeypatch, lambda step: served.append((step.few_rows, step.rows_decoder is not None)))
    for settings in (dict(num_beams=1), dict(num_beams=4), dict(num_beams=3, num_return_sequences=2)):
        for seed in (0, 4):  # 20 sources: past the few-rows step's rows
            ids, mask = batch(seed=seed, lengths=(7, 4, 6, 2, 5) * 4)
            processors = LogitsProcessorList([EndsAtPerSource([3, 7, 5, 12, 9] * 4)])
            kwargs = dict(input_ids=ids, attention_mask=mask, logits_processor=processors, **settings)
            compiled = model.generate(**kwargs)
            assert torch.equal(compiled, eager.generate(**kwargs))
            assert len(set(ends(compiled))) > 1
    batched = [on_library for few_rows, on_library in served if few_rows is None]
    assert batched and all(on_library == library for on_library in batched)


@pytest.mark.skipif(not int8_rows.cpu_supports()[0], reason="a CPU without AVX512-VNNI: no int8 few-rows kernel")
@pytest.mark.parametrize("instructions", ["AMX", "AVX512-BF16"], ids=["amx", "without-amx"])
def test_an_int8_batch_is_encoded_a_source_at_a_time_by_the_library(compiled_folder, monkeypatch, instructions):
    """Without AMX tiles an int8 model's batch of right-padded sources is encoded by the library's encoder a source at a
    time (`SourcesApart`): at each source's own positions the eager int8 encoder's output, keys and values (to float32
    rounding), zeros at the padding, and generate() gives the eager int8 path's ids. With AMX tiles, or sources padded
    on the left, the eager encoder."""
    monkeypatch.setattr(int8_rows, "cpu_bf16_instructions", lambda: instructions)
    model, _ = int8_twins(compiled_folder)
    eager, _ = int8_twins(compiled_folder)
    eager._compiled_folder = None  # (no folder: the eager encoder, and no step)
    eager._compiled_step = None
    ids, mask = batch(seed=6, lengths=(7, 3, 5, 2))
    with torch.inference_mode():
        encoder = compiled_decoding.encoder_for(model, ids, mask)
        if instructions == "AMX":
            assert encoder is None
            return
        assert type(encoder) is compiled_decoding.SourcesApart
        encoded = encoder(ids)
        hidden = eager.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        for i, length in enumerate(mask.sum(1).tolist()):
            torch.testing.assert_close(encoded.hidden[i, :length], hidden[i, :length], rtol=1e-4, atol=1e-4)
            assert not encoded.hidden[i, length:].any()
            for index, layer in enumerate(eager.get_decoder().layers):
                keys, values = layer.cross_attn.keys_values(hidden[i : i + 1, :length])
                torch.testing.assert_close(encoded.keys[index][i : i + 1, :, :length], keys, rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(encoded.values[index][i : i + 1, :, :length], values, rtol=1e-4, atol=1e-4)
        left = torch.stack([row.roll(int(n), 0) for row, n in zip(mask, (mask.shape[1] - mask.sum(1)).tolist())])
        assert compiled_decoding.encoder_for(model, ids, left) is None
    calls = []
    original = compiled_decoding.SourcesApart.__call__
    monkeypatch.setattr(
        compiled_decoding.SourcesApart, "__call__", lambda self, x: calls.append(1) or original(self, x)
    )
    for settings in (dict(num_beams=1), dict(num_beams=4)):
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, **settings)
        assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
    assert len(calls) == 2


@pytest.mark.skipif(not bf16_is_fast("cpu")[0], reason="a CPU without bf16 instructions: no bfloat16 step")
def test_a_bfloat16_model_decodes_through_the_bfloat16_step(compiled_folder, tmp_path, caplog, steps):
    """Where the CPU has bf16 instructions `vaswani-tx compile` also writes the bfloat16 model's step (`compiled-bf16`),
    which `from_pretrained(folder, dtype=torch.bfloat16)` (and `--dtype auto`) loads; on this tiny model it gives the
    eager bfloat16 path's ids. Without it (a folder compiled before, or `--no-bf16`), the float32 step's one line."""
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder, dtype=torch.bfloat16)
    assert model._compiled_step.manifest["precision"] == "bfloat16" and model._compiled_step.dtype == torch.bfloat16
    eager = VaswaniForConditionalGeneration.from_pretrained(compiled_folder, dtype=torch.bfloat16)
    eager._compiled_step = None
    for seed, beams in ((0, 1), (4, 4), (5, 3)):
        ids, mask = batch(seed=seed, lengths=(7, 4, 6, 2))
        kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=beams, max_new_tokens=12)
        assert torch.equal(model.generate(**kwargs), eager.generate(**kwargs))
    assert steps
    folder = copy_of(compiled_folder, tmp_path)
    shutil.rmtree(native_folder(folder) / compiled_decoding.BF16_FOLDER)
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        assert VaswaniForConditionalGeneration.from_pretrained(folder, dtype=torch.bfloat16)._compiled_step is None
    notes = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.compiled_decoding"]
    assert len(notes) == 1 and "it is for float32 on the CPU, and the model is torch.bfloat16" in notes[0], notes


@pytest.mark.skipif(not bf16_is_fast("cpu")[0], reason="a CPU without bf16 instructions: no bfloat16 step")
def test_a_bfloat16_models_calls_of_a_few_rows_decode_through_its_few_rows_step(compiled_folder, few_rows_calls):
    """Beside the bfloat16 step `vaswani-tx compile` writes the bfloat16 model's few-rows step (`compiled-few-bf16`:
    its weights packed in bfloat16, apart from its package), which decodes that model's calls of up to
    `FEW_ROWS_MAX_BF16` rows (loaded at the first), the rest going through the bfloat16 step. On this tiny model it
    gives the eager bfloat16 path's ids. A float32 model never loads it, nor a bfloat16 one the float32 one's."""
    few = native_folder(compiled_folder) / compiled_decoding.FEW_ROWS_BF16_FOLDER
    manifest = json.loads((few / MANIFEST).read_text())
    assert manifest["precision"] == "bfloat16" and manifest["few_rows"] == compiled_decoding.FEW_ROWS_MAX_BF16
    assert (few / compiled_decoding.FEW_ROWS_WEIGHTS).is_file()
    assert_holds_no_weights(few / PACKAGE)
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder, dtype=torch.bfloat16)
    eager = VaswaniForConditionalGeneration.from_pretrained(compiled_folder, dtype=torch.bfloat16)
    eager._compiled_step = None
    assert not [key for key in model._compiled_steps if key.startswith("few_rows")]
    cases = [((7,), 1), ((7,), 4), ((5, 3), 3), ((6, 4, 2), 1), ((7,) * 7, 1), ((7, 4, 6, 2), 2)]
    assert_few_rows_decode_there(model, eager, cases, compiled_decoding.FEW_ROWS_MAX_BF16, few_rows_calls)
    assert set(model._compiled_steps) == {"bfloat16", "few_rows:bfloat16"}
    assert model._compiled_steps["few_rows:bfloat16"].dtype == torch.bfloat16
    fp32 = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    ids, mask = batch(seed=4, lengths=(7,))
    fp32.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, num_beams=4)
    assert set(fp32._compiled_steps) == {"float32", "few_rows", "encoder"}


@pytest.mark.skipif(not bf16_is_fast("cpu")[0], reason="a CPU without bf16 instructions: no bfloat16 step")
def test_a_model_converted_after_loading_decodes_through_the_step_for_its_new_dtype(
    compiled_folder, tmp_path, caplog, steps
):
    """`from_pretrained(folder)` then `.to(torch.bfloat16)`: the next generate() loads the folder's bfloat16 step,
    with the ids of the model loaded in bfloat16; `.float()` goes back to the float32 step, with the float32 ids,
    and converting again loads nothing more. A folder without a bfloat16 step: its one line, once, and the eager
    path. A step set to None by hand stays so."""
    ids, mask = batch(seed=4, lengths=(7, 4, 6, 2))
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=4, max_new_tokens=12)
    in_bf16 = VaswaniForConditionalGeneration.from_pretrained(compiled_folder, dtype=torch.bfloat16).generate(**kwargs)
    in_fp32 = eager_twin(compiled_folder).generate(**kwargs)
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    loads = []
    original = compiled_decoding.load_compiled_step
    with pytest.MonkeyPatch.context() as patch:
        # (the few-rows steps load too, once the call is down to a few rows: `CompiledSession.fewer_rows`)
        patch.setattr(
            compiled_decoding,
            "load_compiled_step",
            lambda *a, **k: loads.append(k.get("few_rows")) or original(*a, **k),
        )
        for dtype, expected, precision in ((torch.bfloat16, in_bf16, "bfloat16"), (torch.float32, in_fp32, "float32")):
            for _ in range(2):
                model.to(dtype)
                steps.clear()
                assert torch.equal(model.generate(**kwargs), expected) and steps
                assert model._compiled_step.manifest.get("precision", "float32") == precision
    assert loads.count(None) == 1  # the bfloat16 step, once; the float32 one was loaded by from_pretrained

    folder = copy_of(compiled_folder, tmp_path)
    shutil.rmtree(native_folder(folder) / compiled_decoding.BF16_FOLDER)
    model = VaswaniForConditionalGeneration.from_pretrained(folder).to(torch.bfloat16)
    # (the float32 model converted back above refused its few-rows step, whose weights those rounded ones are not)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        for _ in range(2):
            steps.clear()
            assert torch.equal(model.generate(**kwargs), in_bf16) and not steps
    notes = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.compiled_decoding"]
    assert len(notes) == 1 and "it is for float32 on the CPU, and the model is torch.bfloat16" in notes[0], notes
    model = VaswaniForConditionalGeneration.from_pretrained(compiled_folder)
    model._compiled_step = None
    steps.clear()
    assert torch.equal(model.generate(**kwargs), in_fp32) and not steps


def copy_model_without_step(model):
    import copy

    twin = copy.deepcopy(model)
    twin._compiled_step = None
    return twin


def test_a_pickled_model_loads_its_step_again_or_decodes_eagerly(compiled_folder, tmp_path, steps, caplog):
    """`torch.save` of the whole model: the step is loaded again from its package on unpickling; where the package
    is gone, one logged line and the eager path, with the same ids."""
    model = VaswaniForConditionalGeneration.from_pretrained(copy_of(compiled_folder, tmp_path))
    ids, mask = batch(seed=5)
    expected = eager_twin(compiled_folder).generate(input_ids=ids, attention_mask=mask)
    torch.save(model, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert torch.equal(loaded.generate(input_ids=ids, attention_mask=mask), expected) and steps
    shutil.rmtree(native_folder(tmp_path / "model") / FOLDER)
    steps.clear()
    with caplog.at_level(logging.WARNING):
        gone = torch.load(tmp_path / "whole.pt", weights_only=False)
    assert "decoding eagerly" in caplog.text and gone._compiled_step.runner is None
    assert torch.equal(gone.generate(input_ids=ids, attention_mask=mask), expected) and not steps


def copy_of(folder, tmp_path):
    """A copy of `folder` and of the per-user cache (its compiled steps are kept there, `native_folder`), which this
    test may damage: the test's own cache from here on (`own_cache` restores the module's)."""
    target = tmp_path / "model"
    shutil.copytree(folder, target)
    shutil.copytree(compiled_decoding.cache_root(), tmp_path / "cache")
    os.environ["VASWANI_TX_CACHE"] = str(tmp_path / "cache")
    return target


@pytest.fixture(autouse=True)
def own_cache():
    """Each test's changes to the cache's place (`copy_of`) end with it."""
    before = os.environ.get("VASWANI_TX_CACHE")
    yield
    os.environ["VASWANI_TX_CACHE"] = before


def edit_manifest(folder, part: str = FOLDER, **changes):
    path = native_folder(folder) / part / MANIFEST
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: edit_manifest(f, torch="2.0.0"), "made with torch 2.0.0"),
        (lambda f: edit_manifest(f, cpu_capability="NO AVX"), "made for a CPU with NO AVX"),
        (lambda f: edit_manifest(f, gemm="elsewhere"), "its products are elsewhere's"),
        (lambda f: edit_manifest(f, weights="00000000"), "made for other weights"),
        (lambda f: truncate(native_folder(f) / FOLDER / PACKAGE), "not the one built"),
        (lambda f: flip_a_byte(native_folder(f) / FOLDER / PACKAGE), "not the one built"),
        (lambda f: (native_folder(f) / FOLDER / MANIFEST).write_text("{"), "manifest cannot be read"),
    ],
    ids=["other-torch", "other-cpu", "other-gemm", "other-weights", "truncated", "changed-bytes", "corrupt-manifest"],
)
def test_an_artifact_that_does_not_fit_is_one_line_and_the_eager_path(
    compiled_folder, tmp_path, caplog, damage, message
):
    folder = copy_of(compiled_folder, tmp_path)
    damage(folder)
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        model = VaswaniForConditionalGeneration.from_pretrained(folder)
    notes = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.compiled_decoding"]
    assert len(notes) == 1 and message in notes[0] and "\n" not in notes[0], notes
    assert "decoding eagerly" in notes[0] and "vaswani-tx compile" in notes[0]
    assert model._compiled_step is None
    ids, mask = batch(seed=1)
    expected = eager_twin(folder).generate(input_ids=ids, attention_mask=mask, num_beams=2)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, num_beams=2), expected)


def test_the_other_gemm_librarys_step(tmp_path, monkeypatch, caplog):
    """The step compiled with the other GEMM library than this machine's choice (oneDNN's products on the model's own
    weights, or oneMKL's): the manifest says which, it gives the eager and transformers' ids, and a process that
    chooses the other library decodes eagerly after one line saying so. Where oneDNN is chosen, calls of 2 to 63 rows
    on one thread decode eagerly on packed weights, and calls of one row or of 64 and more, or on more threads,
    through the step."""
    if not compiled_decoding.onednn_linear_available():
        pytest.skip("torch without oneDNN's inner product")
    here = compiled_decoding.gemm_backend()
    other = "mkl" if here == "onednn" else "onednn"
    folder = tmp_path / "model"
    eos_prone_model(seed=2).save_pretrained(folder)
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, other)
    compile_decoder_step(VaswaniForConditionalGeneration.from_pretrained(folder), native_folder(folder))
    assert json.loads((native_folder(folder) / FOLDER / MANIFEST).read_text())["gemm"] == other
    model = VaswaniForConditionalGeneration.from_pretrained(folder)
    eager = eager_twin(folder)
    ran = []
    note_steps(monkeypatch, lambda step: ran.append(1))
    threads = torch.get_num_threads()
    try:
        for rows, beams, torch_threads in ((1, 1, 1), (1, 3, 1), (4, 1, 1), (4, 2, 1), (4, 16, 1), (4, 2, 2)):
            torch.set_num_threads(torch_threads)
            ids, mask = batch(seed=rows + beams, lengths=(7, 4, 6, 2)[:rows])
            kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=beams, max_new_tokens=12)
            ran.clear()
            out = model.generate(**kwargs)
            assert torch.equal(out, eager.generate(**kwargs)) and torch.equal(
                out, model.generate(fast_decoding=False, **kwargs)
            )
            few = 1 < rows * beams < fast_decoding.PACKS_MAX_ROWS
            assert bool(ran) == (other == "mkl" or not few or torch_threads > 1)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setenv(compiled_decoding.GEMM_VARIABLE, here)
    with caplog.at_level(logging.WARNING, logger="vaswani_tx.compiled_decoding"):
        assert VaswaniForConditionalGeneration.from_pretrained(folder)._compiled_step is None
    notes = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.compiled_decoding"]
    names = compiled_decoding.GEMM_NAMES
    assert (
        len(notes) == 1 and f"its products are {names[other]}'s, and {names[here]}'s are the ones chosen" in notes[0]
    )


def test_compile_command_refuses_what_it_cannot_compile(tmp_path, capsys):
    assert main(["compile", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
    eos_prone_model().save_pretrained(tmp_path / "model")
    assert main(["compile", str(tmp_path / "model"), "--jobs", "0"]) == 2
    assert "--jobs must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(UserInputError, match="float32, bfloat16 and int8"):
        compile_decoder_step(eos_prone_model().to(torch.float16), tmp_path)
    assert not (tmp_path / FOLDER).exists()


def test_compiles_parts_are_shared_out_evenly_the_timed_one_alone():
    """`vaswani-tx compile`'s parts in groups of about equal time, one a process (`shared_out`), this process'
    holding the float32 step; the part whose compiling times kernels is compiled after the others, alone."""
    seconds = compile_step.PART_SECONDS
    shared = [part for part in seconds if part not in compile_step.TIMED_PARTS]
    assert compile_step.TIMED_PARTS == ("bfloat16-few",)
    for jobs in (2, 3, len(shared)):
        groups = compile_step.shared_out(shared, jobs)
        assert sorted(part for group in groups for part in group) == sorted(shared) and len(groups) == jobs
        assert "float32" in groups[0] and all(group == sorted(group, key=list(seconds).index) for group in groups)
        loads = [sum(seconds[part] for part in group) for group in groups]
        assert max(loads) - min(loads) <= max(seconds[part] for part in shared)
    assert compile_step.shared_out(shared, 2) == [
        ["float32", "float32-few", "bfloat16"],
        ["float32-encoder", "beams", "int8"],
    ]


def test_a_compiling_process_rebuilds_the_model_as_it_is(tmp_path):
    """The model a compiling process reads (`write_model`, `read_model`) is the caller's as it is, not its folder's:
    the same config, weights and fingerprints, in evaluation mode."""
    model = eos_prone_model(seed=3)
    with torch.no_grad():
        model.get_decoder().layers[0].feed_forward.w_1.bias += 1.0  # changed since any save
    compile_step.write_model(model, tmp_path / "model.pt")
    again = compile_step.read_model(tmp_path / "model.pt")
    assert not again.training and again.config.to_dict() == model.config.to_dict()
    assert compiled_decoding.weights_fingerprint(again) == compiled_decoding.weights_fingerprint(model)
    assert compiled_decoding.architecture_fingerprint(again.config) == compiled_decoding.architecture_fingerprint(
        model.config
    )
    assert again.get_output_embeddings().weight is again.get_input_embeddings().weight  # one matrix (Section 3.4)
    state = model.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in again.state_dict().items())


@pytest.mark.parametrize(
    "other, error, words",
    [
        (
            "print(json.dumps({'line': 'wrote the int8 step'})); print('not a message', flush=True); "
            "print(json.dumps({'error': 'no C++ compiler', 'user': True})); sys.exit(2)",
            UserInputError,
            "no C\\+\\+ compiler",
        ),
        ("sys.exit(9)", RuntimeError, "exit code 9"),
        ("print(json.dumps({'line': 'wrote the int8 step'}))", None, None),
    ],
    ids=["user-error", "killed", "lines"],
)
def test_a_compiling_processs_lines_and_errors_reach_the_caller(tmp_path, monkeypatch, other, error, words):
    """`compiled_apart` passes on the other processes' lines as they come and raises the first error once its own
    parts are done: a `UserInputError` as itself, a process that ended without a word as a RuntimeError naming its
    exit code."""
    monkeypatch.setattr(
        compile_step, "compiling_command", lambda: [sys.executable, "-c", f"import json, sys; {other}"]
    )
    monkeypatch.setattr(compile_step, "compiled_part", lambda model, folder, part: iter([f"wrote {part} here"]))
    lines = []
    parts = compile_step.compiled_apart(eos_prone_model(), tmp_path, ["float32", "int8"], 2)
    if error is None:
        lines = list(parts)
    else:
        with pytest.raises(error, match=words):
            lines.extend(parts)
    assert lines[0].startswith("compiling 2 parts in 2 processes") and "wrote float32 here" in lines
    assert ("wrote the int8 step" in lines) == (error is not RuntimeError)
    assert ("not a message" in lines) == (error is UserInputError)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler (g++) to build the library")
def test_a_stopped_compiling_process_leaves_nothing_partial(tmp_path):
    """A compiling process stopped mid-part (SIGTERM: `compiled_apart` stopping the others on an error or Ctrl-C)
    removes its partial folder and exits 130, without a traceback."""
    model_file, folder = tmp_path / "model.pt", tmp_path / "model"
    compile_step.write_model(eos_prone_model(), model_file)
    folder.mkdir()
    environment = {**compile_step.compiling_environment(), "VASWANI_TX_CACHE": str(tmp_path / "cache")}  # g++ runs
    process = subprocess.Popen(
        [*compile_step.compiling_command(), str(model_file), str(folder), "beams"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not any(folder.iterdir()):  # the library's partial folder: g++ is at work
            assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
            time.sleep(0.02)
        process.terminate()
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130 and out == "" and "Traceback" not in err, err
    assert list(folder.iterdir()) == []
