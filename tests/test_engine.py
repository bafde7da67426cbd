"""The decoding engine (vaswani_tx.engine): transformers' ids, faster, and nothing shared between calls.

Float32 decoding must give the ids of transformers' own loops (`generate(use_engine=False)`); int8 and bfloat16
the ids of transformers' loops over a model that computes the same products (the plain PyTorch step of that
precision). Speed is measured by benchmarks/bench_translate.py, never asserted here.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from test_modeling import EOS, batch, tiny_model
from vaswani_tx.engine import Translator
from vaswani_tx.engine.step import int8_product
from vaswani_tx.interop.convert import fairseq_generation_config


@pytest.fixture(autouse=True)
def engine_serves(monkeypatch, request):
    """Every generate() call of these tests that does not ask for transformers' loops (`use_engine=False`) is the
    engine's, unless the test is about what the engine declines."""
    import vaswani_tx.engine as engine

    if "declines" in request.node.name:
        return
    original = engine.serve

    def must_serve(*args):
        decoded = original(*args)
        assert decoded is not None, "the engine declined"
        return decoded

    monkeypatch.setattr(engine, "serve", must_serve)


SETTINGS = [
    dict(num_beams=1),
    dict(num_beams=4),  # the paper's: GNMT length penalty 0.6, source length + 50, early stopping
    dict(num_beams=3, early_stopping=False),
    dict(num_beams=3, early_stopping="never", length_penalty=1.2),
    dict(num_beams=2, length_penalty_type="hf", length_penalty=1.0),
    dict(num_beams=4, max_new_tokens=5),
    dict(num_beams=1, min_new_tokens=4, max_new_tokens=9),
    dict(num_beams=5, suppress_tokens=[5, 6], no_repeat_ngram_size=2),
]


def eos_prone(seed: int = 0):
    """A tiny model whose </s> is likely enough that sentences end at different steps (sources leave the batch)."""
    model = tiny_model(seed=seed)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3.0
    return model


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_gives_transformers_ids_in_batches_and_one_sentence_at_a_time(settings, seed):
    model = eos_prone(seed)
    ids, mask = batch(seed=seed + 1, lengths=(7, 4, 6, 2, 9))
    expected = model.generate(input_ids=ids, attention_mask=mask, use_engine=False, **settings)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **settings), expected)
    for row in range(ids.shape[0]):
        one = ids[row : row + 1, : int(mask[row].sum())]
        expected = model.generate(input_ids=one, use_engine=False, **settings)
        assert torch.equal(model.generate(input_ids=one, **settings), expected)


def test_fairseqs_cap_and_forced_eos_score_as_transformers():
    model = eos_prone(3)
    model.generation_config = fairseq_generation_config(model.config, beam=3, max_len_b=4)
    ids, mask = batch(seed=4, lengths=(5, 3, 8))
    expected = model.generate(input_ids=ids, attention_mask=mask, use_engine=False)
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask), expected)


def test_a_callers_processor_is_applied_and_keeps_every_row():
    """A processor the engine does not know may read rows by their place in the batch: no row leaves early, and
    the ids are transformers'."""

    class NoFive:
        def __call__(self, input_ids, scores):
            return scores.index_fill(1, torch.tensor([5]), -float("inf"))

    model = eos_prone(1)
    ids, mask = batch(seed=2, lengths=(6, 3))
    for beams in (1, 3):
        kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=beams, logits_processor=[NoFive()])
        out = model.generate(**kwargs)
        assert torch.equal(out, model.generate(use_engine=False, **kwargs)) and not (out[:, 1:] == 5).any()


def test_the_engine_declines_what_it_cannot_serve_and_transformers_loops_decode_it():
    """Scores returned, sampling, a decoder prefix: transformers' loops decode them, as without the engine."""
    model = eos_prone(2)
    ids, mask = batch(seed=3)
    scored = model.generate(input_ids=ids, attention_mask=mask, num_beams=3, output_scores=True,
                            return_dict_in_generate=True)  # fmt: skip
    assert scored.sequences_scores is not None
    assert torch.equal(scored.sequences, model.generate(input_ids=ids, attention_mask=mask, num_beams=3))
    torch.manual_seed(0)
    sampled = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=5)
    torch.manual_seed(0)
    assert torch.equal(sampled, model.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=5,
                                               use_engine=False))  # fmt: skip
    prefix = torch.tensor([[2, 7]] * 3)
    out = model.generate(input_ids=ids, attention_mask=mask, decoder_input_ids=prefix, max_new_tokens=4)
    assert torch.equal(out[:, :2], prefix)


def with_products(model: nn.Module, product) -> nn.Module:
    """A copy of `model` whose decoder's linear maps and pre-softmax projection are `product(layer)`: the plain
    PyTorch model of another precision, for transformers' loops to decode."""
    twin = copy.deepcopy(model)
    decoder = twin.get_decoder()
    for module in list(decoder.modules()):
        for child, layer in list(module.named_children()):
            if isinstance(layer, nn.Linear):
                setattr(module, child, product(layer))
    twin.lm_head = product(twin.lm_head)
    return twin


@pytest.mark.parametrize("beams", [1, 4])
def test_int8_gives_the_ids_of_transformers_loops_over_the_same_int8_products(beams):
    model = eos_prone(4)
    ids, mask = batch(seed=5, lengths=(7, 4, 6))
    reference = with_products(model, int8_product)
    expected = reference.generate(input_ids=ids, attention_mask=mask, num_beams=beams, use_engine=False)
    int8 = Translator(model, compute_type="int8")
    assert torch.equal(int8.generate(ids, mask, num_beams=beams), expected)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))  # the model is untouched


@pytest.mark.parametrize("beams", [1, 3])
def test_bfloat16_gives_the_ids_of_transformers_loops_over_the_bfloat16_model(beams):
    float32 = eos_prone(5)
    model = copy.deepcopy(float32).to(torch.bfloat16)
    ids, mask = batch(seed=6, lengths=(5, 7))
    expected = model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, use_engine=False)
    assert Translator(model).compute_type == "bfloat16"
    assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, num_beams=beams), expected)
    copied = Translator(float32, compute_type="bfloat16")  # a bfloat16 copy: the same path, the same ids
    assert torch.equal(copied.generate(ids, mask, num_beams=beams), expected)
    assert next(float32.parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="int8 decoding runs on the CPU from float32 weights"):
        Translator(model, compute_type="int8")


def test_translate_batch_returns_each_sources_best_hypothesis():
    model = eos_prone(6)
    ids, mask = batch(seed=7, lengths=(6, 3))
    sources = [ids[row, : int(mask[row].sum())].tolist() for row in range(2)]
    results = Translator(model).translate_batch(sources, beam_size=3, max_decoding_length=7)
    generated = model.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=7)
    for result, row in zip(results, generated.tolist()):
        assert result.hypotheses == [[t for t in row[1:] if t not in (0, 2, 3)]]
    with pytest.raises(ValueError, match="at least one source"):
        Translator(model).translate_batch([])


def test_two_threads_and_two_models_each_get_what_they_get_alone():
    """Nothing is shared between calls: two threads through one model, two threads through one int8 translator, and
    a float32 and an int8 translator of two models in one process, each give the single-threaded result."""
    model, other = eos_prone(7), eos_prone(8)
    int8 = Translator(other, compute_type="int8")
    inputs = [batch(seed=s, lengths=lengths) for s, lengths in ((8, (7, 3)), (9, (5, 6, 2)))]
    alone = [model.generate(input_ids=i, attention_mask=m, num_beams=3) for i, m in inputs]
    alone_int8 = int8.generate(*inputs[0], num_beams=2)
    results: dict = {}

    def run(key, call):
        results[key] = [call() for _ in range(3)]

    alone_int8_other = int8.generate(*inputs[1], num_beams=2)
    threads = [
        threading.Thread(
            target=run, args=(n, lambda i=i, m=m: model.generate(input_ids=i, attention_mask=m, num_beams=3))
        )
        for n, (i, m) in enumerate(inputs)
    ] + [  # one int8 translator shared by two threads
        threading.Thread(target=run, args=("int8", lambda: int8.generate(*inputs[0], num_beams=2))),
        threading.Thread(target=run, args=("int8-other", lambda: int8.generate(*inputs[1], num_beams=2))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for n in range(2):
        assert all(torch.equal(out, alone[n]) for out in results[n])
    assert all(torch.equal(out, alone_int8) for out in results["int8"])
    assert all(torch.equal(out, alone_int8_other) for out in results["int8-other"])


def test_a_saved_model_decodes_the_engines_ids_where_vaswani_tx_is_not_installed(tmp_path):
    """Loaded with trust_remote_code where the package cannot be imported, generate() is transformers' loops over
    the saved files alone: the same ids as the engine, greedy and beam with the GNMT penalty and the length cap."""
    model = eos_prone(9)
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    ids, mask = batch(seed=10, lengths=(6, 3, 8))
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    expected = [model.generate(input_ids=ids, attention_mask=mask, num_beams=beams) for beams in (1, 4)]
    code = f"""
import importlib.abc, importlib.util, sys, torch
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vaswani_tx" or name.startswith("vaswani_tx."):
            raise ModuleNotFoundError(name)
sys.meta_path.insert(0, NotInstalled())
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "vaswani_tx" else real(name, *a)
from transformers import AutoModelForSeq2SeqLM
model = AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}, trust_remote_code=True)
assert "vaswani_tx" not in sys.modules and not type(model).__module__.startswith("vaswani_tx")
inputs = torch.load({str(tmp_path / "inputs.pt")!r})
outs = [model.generate(input_ids=inputs["ids"], attention_mask=inputs["mask"], num_beams=b) for b in (1, 4)]
torch.save(outs, {str(tmp_path / "outs.pt")!r})
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    outs = torch.load(tmp_path / "outs.pt")
    assert all(torch.equal(out, want) for out, want in zip(outs, expected))


def test_ids_outside_the_vocabulary_are_refused_before_decoding():
    model = tiny_model()
    ids, mask = batch()
    ids[0, 0] = 61
    with pytest.raises(ValueError, match=r"input_ids contains id 61"):
        model.generate(input_ids=ids, attention_mask=mask)
