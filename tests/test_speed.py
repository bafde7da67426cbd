"""The decoding fast paths (work done once per source, not per step, the static-cache step, compiled or
not) and int8 inference.

Each fast path must give exactly what the plain computation gives; speed itself is measured by
benchmarks/bench_speed.py, never asserted here.
"""

from __future__ import annotations

import pytest
import torch

from test_modeling import batch, tiny_model  # the model tests' tiny odd-sized model and padded batch
from vaswani_tx import VaswaniForConditionalGeneration, modeling_vaswani, static_decoding
from vaswani_tx.quantization import Int8Linear, is_quantized_int8, quantize_int8


def test_encoder_decoder_keys_and_values_are_computed_once_per_source(monkeypatch):
    """With the (dynamic) cache, W^K and W^V of the encoder-decoder attention run over the source once,
    not once per step: the cache keeps them for all later positions."""
    calls = []
    original = modeling_vaswani.MultiHeadAttention.keys_values

    def counting(self, states, index=None):
        calls.append(self.is_causal)
        return original(self, states, index)

    monkeypatch.setattr(modeling_vaswani.MultiHeadAttention, "keys_values", counting)
    ids, mask = batch()
    model = tiny_model()
    model.generate(input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=6, min_new_tokens=6)
    layers = model.config.num_decoder_layers
    assert calls.count(False) == model.config.num_encoder_layers + layers  # encoder self-attention, cross once
    assert calls.count(True) == 6 * layers  # decoder self-attention: the new position, every step
    # That the cached path decodes as full forwards do: test_modeling's test_generate_with_cache_equals_without.


def test_beam_search_reordering_only_self_attention_equals_reordering_everything(monkeypatch):
    model = tiny_model(seed=3)
    ids, mask = batch(lengths=(8, 3, 5))
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        num_beams=4,
        num_return_sequences=2,
        max_new_tokens=12,
        output_scores=True,
        return_dict_in_generate=True,
    )
    fast = model.generate(**kwargs)
    monkeypatch.delattr(VaswaniForConditionalGeneration, "_reorder_cache")  # transformers' own: reorders both caches
    stock = model.generate(**kwargs)
    torch.testing.assert_close(fast.sequences, stock.sequences)
    torch.testing.assert_close(fast.sequences_scores, stock.sequences_scores)


def test_ids_outside_the_vocabulary_are_still_refused_while_decoding():
    model = tiny_model()
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"decoder_input_ids contains id 61"):
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.tensor([[2, 61]] * 3))


def test_int8_model_stays_close_to_float32_and_decodes_the_same():
    model = tiny_model(seed=5, d_model=32, num_heads=4, d_ff=64, num_decoder_layers=2)
    quantized = quantize_int8(model)
    assert is_quantized_int8(quantized) and not is_quantized_int8(model)  # a copy; the float model is untouched
    linears = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    assert not any(isinstance(m, torch.nn.Linear) for m in quantized.modules())
    assert len(linears) == 2 * (4 + 2) + 2 * (4 + 4 + 2) + 1  # every projection and FFN layer, and the pre-softmax one
    ids, mask = batch(lengths=(9, 6, 7))
    decoder_ids = torch.tensor([[2, 5, 9, 11]] * 3)
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        approximate = quantized(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
    error = (approximate - reference).abs()
    assert error.mean() < 0.03 * reference.std() and error.max() < 0.15 * reference.std()  # 8 bits: ~1% typical
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=8)
    torch.testing.assert_close(quantized.generate(**kwargs), model.generate(**kwargs))
    # The static-cache step runs int8 layers too (eagerly: Inductor does not freeze packed int8 weights).
    torch.testing.assert_close(quantized.generate(**kwargs, cache_implementation="static"), model.generate(**kwargs))


def test_int8_linear_equals_torch_dynamic_quantized_linear():
    """The shorter forward calls the same kernel with the same arguments: bit-identical outputs."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

    model = quantize_int8(tiny_model(seed=2))
    x = torch.randn(5, 3, 24)
    for module in (model.model.encoder.layers[0].self_attn.q_proj, model.lm_head):
        assert type(module) is Int8Linear
        stock = DynamicQuantizedLinear.forward(module, x)
        assert torch.equal(module(x), stock)


def test_int8_linear_scales_each_block_of_rows_apart(monkeypatch):
    """Past SCALE_ROWS rows a product is one call a block of rows, each quantized with its own scale: the same
    output as the blocks given one at a time, and a row's result does not change with an outlier in another block
    (one call's single scale would round it more coarsely)."""
    monkeypatch.setattr(Int8Linear, "SCALE_ROWS", 8)
    layer = quantize_int8(tiny_model(seed=2)).model.encoder.layers[0].self_attn.q_proj
    x = torch.randn(2, 11, layer.in_features)  # 22 rows: blocks of 8, 8 and 6, across the batch's sentences
    rows = x.reshape(-1, layer.in_features)
    blocks = [layer(rows[start : start + 8]) for start in (0, 8, 16)]  # each block in a call of its own
    out = layer(x)
    assert out.shape == (2, 11, layer.out_features)
    assert torch.equal(out.reshape(-1, layer.out_features), torch.cat(blocks))
    outlier = rows.clone()
    outlier[20] *= 1000  # in the last block
    assert torch.equal(layer(outlier)[:16], out.reshape(-1, layer.out_features)[:16])
    monkeypatch.setattr(Int8Linear, "SCALE_ROWS", 64)  # one call, one scale: the outlier coarsens every row
    assert not torch.equal(layer(outlier)[:16], layer(rows)[:16])


def test_int8_layers_take_onednn_from_where_it_is_faster_on_this_cpu(monkeypatch):
    """With AMX tiles every int8 layer takes oneDNN's kernel from MANY_ROWS rows; without them only the pre-softmax
    projection does, the attention and feed-forward layers from MANY_ROWS_WITHOUT_AMX (bench_int8_kernels.py)."""
    from vaswani_tx import quantization

    for instructions, layer_rows in (("AMX", Int8Linear.MANY_ROWS), ("AVX512-BF16", Int8Linear.MANY_ROWS_WITHOUT_AMX),
                                     (None, Int8Linear.MANY_ROWS_WITHOUT_AMX)):  # fmt: skip
        monkeypatch.setattr(quantization, "cpu_bf16_instructions", lambda instructions=instructions: instructions)
        model = quantize_int8(tiny_model(seed=2))
        assert model.lm_head.many_rows == Int8Linear.MANY_ROWS
        layers = [m for m in model.modules() if type(m) is Int8Linear and m is not model.lm_head]
        assert layers and all(layer.many_rows == layer_rows for layer in layers)
    layer = layers[0]
    if layer.many_rows_params is not None:  # below its own threshold a layer keeps fbgemm's kernel, bit for bit
        x = torch.randn(Int8Linear.MANY_ROWS, layer.in_features)
        fbgemm = layer._packed_params._packed_params
        assert torch.equal(layer(x), torch.ops.quantized.linear_dynamic(x, fbgemm, True))


def test_int8_quantizes_a_module_that_is_not_a_model():
    """quantize_int8 takes any module (bench_int8_kernels.py quantizes single layers): without a pre-softmax
    projection, every layer follows the CPU's rule for attention and feed-forward layers."""
    from vaswani_tx import quantization

    layers = quantize_int8(torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)))
    assert [type(layers[0]), type(layers[2])] == [Int8Linear, Int8Linear]
    without_amx = quantization.cpu_bf16_instructions() != "AMX"
    rows = Int8Linear.MANY_ROWS_WITHOUT_AMX if without_amx else Int8Linear.MANY_ROWS
    assert layers[0].many_rows == layers[2].many_rows == rows
    x = torch.randn(3, 16)
    torch.testing.assert_close(layers(x), torch.relu(x @ layers[0].weight().dequantize().t() + layers[0].bias())
                               @ layers[2].weight().dequantize().t() + layers[2].bias(), atol=0.05, rtol=0.05)  # fmt: skip


def test_int8_linear_takes_onednn_packing_from_many_rows():
    """From MANY_ROWS rows the same int8 weights go through oneDNN's packing: as close to float32 as fbgemm's
    result (the two may round an activation to int8 differently), and the stock kernel below it, bit for bit."""
    if "onednn" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch has no oneDNN quantized engine")
    engine, model = torch.backends.quantized.engine, tiny_model(seed=2)
    module = quantize_int8(model).lm_head
    assert module.many_rows_params is not None and torch.backends.quantized.engine == engine  # switched back
    kernel, fbgemm = torch.ops.quantized.linear_dynamic, module._packed_params._packed_params
    generator = torch.Generator().manual_seed(0)
    few = torch.randn(module.many_rows - 1, 24, generator=generator)
    many = torch.randn(2, module.many_rows // 2, 24, generator=generator)
    assert torch.equal(module(few), kernel(few, fbgemm, True))
    assert torch.equal(module(many), kernel(many, module.many_rows_params, True))
    with torch.no_grad():
        exact = model.lm_head(many)
    onednn_error, fbgemm_error = ((out - exact).abs().max() for out in (module(many), kernel(many, fbgemm, True)))
    assert onednn_error <= 1.5 * fbgemm_error + 1e-6


def test_int8_refuses_a_model_that_is_not_float32():
    with pytest.raises(ValueError, match="float32 model"):
        quantize_int8(tiny_model().to(torch.bfloat16))


# --- decoding with a static cache (static_decoding.py) --------------------------------------------------------------


def decode(model, cache_implementation=None, **overrides):
    ids, mask = batch(lengths=(8, 3, 5))
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        num_beams=1,
        max_new_tokens=10,
        output_scores=True,
        return_dict_in_generate=True,
        cache_implementation=cache_implementation,
    )
    kwargs.update(overrides)
    if kwargs["num_beams"] > 1:
        kwargs["num_return_sequences"] = 2
    return model.generate(**kwargs)


def assert_same_decoding(fast, reference):
    torch.testing.assert_close(fast.sequences, reference.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(fast.scores), torch.stack(reference.scores), rtol=1e-5, atol=1e-5)


def test_rows_per_source_finds_runs_of_identical_sources_and_nothing_else():
    states = torch.randn(3, 5, 4)
    mask = torch.ones(3, 5, dtype=torch.long)
    beams = states.repeat_interleave(4, dim=0)  # as generate() lays out 3 sources x 4 beams
    assert static_decoding.rows_per_source(beams, mask.repeat_interleave(4, dim=0)) == 4
    assert static_decoding.rows_per_source(beams, None) == 4
    assert static_decoding.rows_per_source(states, mask) == 1
    assert static_decoding.rows_per_source(states[:1].expand(6, 5, 4), None) == 6  # one source, six rows
    assert static_decoding.rows_per_source(beams.roll(1, dims=0), None) == 1  # runs out of step: shared nowhere
    masks = mask.repeat_interleave(4, dim=0)
    masks[5, -1] = 0  # same encoder output, another mask: not the same source
    assert static_decoding.rows_per_source(beams, masks) == 1
    assert static_decoding.rows_per_source(torch.cat([states[:1]] * 2 + [states[1:2]] * 3), None) == 1  # runs of 2, 3
    assert (
        static_decoding.rows_per_source(torch.cat([states[:1]] * 2 + [states[1:2]] * 4), None) == 2
    )  # 2, 2, 2: exact


def test_static_beam_search_computes_encoder_decoder_keys_once_per_source():
    """Beam search repeats each source once per beam; the static cache keeps its keys and values once
    per source (the beams attend to them as one block of queries), with the same result."""
    model = tiny_model(seed=4, tie_word_embeddings=False)
    fast = decode(model, "static", num_beams=3, disable_compile=True)  # 3 sources, 3 beams, 2 returned
    assert_same_decoding(fast, decode(model, num_beams=3))
    assert fast.past_key_values.cross_attention_cache.layers[0].keys.shape[0] == 3
    assert fast.past_key_values.self_attention_cache.layers[0].keys.shape[1] == 9  # position-major, one row per beam


@pytest.mark.filterwarnings("error:Compiling the static-cache decoding step failed")  # no silent eager fallback
def test_compiled_static_decoding_equals_eager_and_follows_the_weights():
    """Compiling freezes the weights into the graph: a changed weight and another model of the same
    shapes must each get a graph of their own, never a stale one."""
    model = tiny_model(seed=3)
    assert_same_decoding(decode(model, "static"), decode(model))
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # the tied matrix, in place: every logit changes
    assert_same_decoding(decode(model, "static"), decode(model))
    other = tiny_model(seed=4, tie_word_embeddings=False)
    assert_same_decoding(decode(other, "static", num_beams=3), decode(other, num_beams=3))
    assert model in static_decoding._COMPILED and other in static_decoding._COMPILED


def test_static_decoding_falls_back_to_the_eager_step_when_compiling_fails(monkeypatch):
    def failing_step(*arguments):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(static_decoding, "compiled_decode_step", lambda model: failing_step)
    model = tiny_model(seed=3)
    with pytest.warns(
        UserWarning, match=r"Compiling the static-cache decoding step failed \(no C\+\+ compiler found\)"
    ):
        fast = decode(model, "static")
    assert_same_decoding(fast, decode(model))


def test_static_cache_refuses_what_it_cannot_give():
    from transformers import StaticCache
    from transformers.cache_utils import EncoderDecoderCache

    model = tiny_model()
    ids, mask = batch()
    with pytest.raises(ValueError, match="output_attentions is not supported with a static cache"):
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=3,
            cache_implementation="static",
            output_attentions=True,
            return_dict_in_generate=True,
        )
    cache = EncoderDecoderCache(
        StaticCache(config=model.config, max_cache_len=2), StaticCache(config=model.config, max_cache_len=7)
    )
    with pytest.raises(ValueError, match="static cache holds 2 target positions"):
        model(
            input_ids=ids, attention_mask=mask, decoder_input_ids=torch.tensor([[2, 5, 9]] * 3), past_key_values=cache
        )
