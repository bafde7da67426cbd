"""The model: the paper's claims (Section 3, Table 3), the Hugging Face contract, and bad input.

Tiny odd sizes (d_model 24, 3 heads, d_k != d_v) catch shape bugs that square sizes hide.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

import vaswani_tx
from vaswani_tx import GNMTLengthPenalty, VaswaniConfig, VaswaniForConditionalGeneration, VaswaniModel
from vaswani_tx.interop.export import vaswani_to_marian
from vaswani_tx.metrics.paper import (
    ALL_MODEL_CONFIGS,
    PAPER_VOCAB_SIZE,
    TABLE3,
    TOLERANCE_MILLIONS,
    model_config_overrides,
)
from vaswani_tx.model.modeling_vaswani import sinusoidal_table
from vaswani_tx.training.params import count_parameters, load_model_config, num_parameters_closed_form

REPO = Path(__file__).resolve().parents[1]
PAD, BOS, EOS = 0, 2, 3


def tiny_config(**overrides) -> VaswaniConfig:
    values = dict(
        vocab_size=61, d_model=24, d_ff=40, num_heads=3, num_encoder_layers=2, num_decoder_layers=3, dropout=0.0
    )
    values.update(overrides)
    return VaswaniConfig(**values)


def tiny_model(seed: int = 0, attn_implementation: str | None = None, **overrides) -> VaswaniForConditionalGeneration:
    torch.manual_seed(seed)
    model = VaswaniForConditionalGeneration(tiny_config(**overrides))
    if attn_implementation:
        model.set_attn_implementation(attn_implementation)
    return model.eval()


def batch(seed: int = 1, lengths=(7, 4, 6), vocab: int = 61) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded source ids ending in </s>, and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), max(lengths)), PAD)
    for row, n in enumerate(lengths):
        ids[row, : n - 1] = torch.randint(4, vocab, (n - 1,), generator=g)
        ids[row, n - 1] = EOS
    return ids, ids.ne(PAD).long()


# --- Section 3.5: positional encoding ------------------------------------------------------------------------------


def test_positional_encoding_equals_closed_form():
    d_model, length = 24, 300
    table = sinusoidal_table(length, d_model)
    for pos in (0, 1, 17, 299):
        for i in range(d_model // 2):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-6)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_encoder_embedding_output_is_scaled_embedding_plus_positions():
    model = tiny_model()
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3], output_hidden_states=True)
    expected = math.sqrt(24) * model.model.shared.weight[ids] + sinusoidal_table(ids.shape[1], 24)
    torch.testing.assert_close(out.encoder_hidden_states[0], expected, rtol=0, atol=1e-6)
    assert len(out.encoder_hidden_states) == 2 + 1 and len(out.decoder_hidden_states) == 3 + 1
    torch.testing.assert_close(out.encoder_hidden_states[-1], out.encoder_last_hidden_state)


def test_positions_extrapolate_beyond_any_table_and_survive_dtype_and_reload(tmp_path):
    model = tiny_model()
    long_ids = torch.randint(4, 61, (1, 1500))  # longer than max_position_embeddings=1024
    hidden = model.model.encoder(long_ids, output_hidden_states=True).hidden_states[0]
    expected = math.sqrt(24) * model.model.shared.weight[long_ids] + sinusoidal_table(1500, 24)
    torch.testing.assert_close(hidden, expected, rtol=0, atol=1e-5)

    model.save_pretrained(tmp_path)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path).to(torch.bfloat16).eval()
    ids, _ = batch()
    hidden = reloaded.model.encoder(ids, output_hidden_states=True).hidden_states[0]
    embed = reloaded.model.shared.weight[ids] * math.sqrt(24)
    expected = embed + sinusoidal_table(ids.shape[1], 24).to(torch.bfloat16)
    assert hidden.dtype == torch.bfloat16
    torch.testing.assert_close(hidden, expected, rtol=0, atol=0)


def test_learned_positions_row_e_and_their_length_limit():
    model = tiny_model(position_encoding="learned", max_position_embeddings=10)
    table = model.model.encoder.embeddings.embed_positions.weight
    ids = torch.randint(4, 61, (1, 6))
    hidden = model.model.encoder(ids, output_hidden_states=True).hidden_states[0]
    torch.testing.assert_close(hidden, math.sqrt(24) * model.model.shared.weight[ids] + table[:6])
    with pytest.raises(ValueError, match=r"11 positions is longer than max_position_embeddings=10"):
        model(input_ids=torch.randint(4, 61, (1, 11)), decoder_input_ids=ids)


# --- Section 3.1 / 3.2: post-LN, no leak from the future, padding ---------------------------------------------------


def test_post_layer_norm_order_and_no_final_stack_norm():
    model = tiny_model()
    layer = model.model.encoder.layers[0]
    x = torch.randn(2, 5, 24)
    attended, _ = layer.self_attn(x)
    h = torch.nn.functional.layer_norm(x + attended, (24,), layer.self_attn_norm.weight, layer.self_attn_norm.bias)
    ffn = layer.feed_forward.w_2(torch.relu(layer.feed_forward.w_1(h)))
    expected = torch.nn.functional.layer_norm(
        h + ffn, (24,), layer.feed_forward_norm.weight, layer.feed_forward_norm.bias
    )
    torch.testing.assert_close(layer(x)[0], expected)
    names = [n for n, _ in model.named_modules()]
    assert not any(n.endswith(("encoder.layer_norm", "decoder.layer_norm", "layernorm_embedding")) for n in names)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * 2 + 3 * 3  # two per encoder layer, three per decoder layer, nothing else


def test_no_attention_biases_and_relu_ffn():
    model = tiny_model(d_k=5, d_v=7)
    attention = model.model.decoder.layers[0].cross_attn
    assert attention.q_proj.weight.shape == (3 * 5, 24) and attention.v_proj.weight.shape == (3 * 7, 24)
    assert attention.out_proj.weight.shape == (24, 3 * 7)
    assert all(p.bias is None for p in (attention.q_proj, attention.k_proj, attention.v_proj, attention.out_proj))
    ffn = model.model.encoder.layers[0].feed_forward
    x = torch.randn(4, 24)
    torch.testing.assert_close(ffn(x), ffn.w_2(torch.clamp(ffn.w_1(x), min=0)))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_no_leak_from_future_decoder_tokens(attn):
    model = tiny_model(attn_implementation=attn)
    ids, mask = batch()
    target = torch.randint(4, 61, (3, 9))
    changed = target.clone()
    t = 4
    changed[:, t + 1 :] = torch.randint(4, 61, (3, 9 - t - 1))
    a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    b = model(input_ids=ids, attention_mask=mask, decoder_input_ids=changed).logits
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_source_padding_does_not_change_real_positions(attn):
    model = tiny_model(attn_implementation=attn)
    ids, mask = batch(lengths=(5,))
    padded = torch.cat([ids, torch.full((1, 4), PAD)], 1)
    target = torch.randint(4, 61, (1, 6))
    a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target)
    b = model(input_ids=padded, attention_mask=padded.ne(PAD).long(), decoder_input_ids=target)
    torch.testing.assert_close(a.encoder_last_hidden_state, b.encoder_last_hidden_state[:, :5], rtol=0, atol=1e-5)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_mask_of_ones_is_no_mask_to_the_encoder(attn):
    """A source without padding (a single sentence): no mask gives the output of the masked path (a mask of zeros
    added to every score) to the last bit, and the same attention weights, so the engine drops a mask of ones."""
    from vaswani_tx.model.skip_padding import PaddingPlan

    model = tiny_model(attn_implementation=attn)
    ids, mask = batch(lengths=(6, 6))
    encoder = model.get_encoder()
    masked_path = PaddingPlan.build(model.config, source_mask=mask)  # passed in: the mask is used as given
    with torch.no_grad():
        a = encoder(input_ids=ids, attention_mask=mask, output_attentions=True)
        b = encoder(input_ids=ids, attention_mask=mask, output_attentions=True, padding=masked_path)
        c = encoder(input_ids=ids, output_attentions=True)
    assert torch.equal(a.last_hidden_state, b.last_hidden_state)
    assert torch.equal(a.last_hidden_state, c.last_hidden_state)
    for x, y in zip(a.attentions, b.attentions):
        assert torch.equal(x, y)
    with torch.no_grad():  # without the weights: the SDPA kernel where the model takes it
        plain = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        assert torch.equal(plain, encoder(input_ids=ids, attention_mask=mask, padding=masked_path).last_hidden_state)


def padded_training_batch():
    """Source padding, target padding after the last label, a label masked mid-sentence, a row with no
    real source and a row with no labels at all."""
    ids, mask = batch(lengths=(7, 4, 6, 2))
    mask[3] = 0
    target = torch.randint(4, 61, (4, 8), generator=torch.Generator().manual_seed(5))
    labels = target.clone()
    labels[1, 5:] = -100
    labels[2, 2] = -100
    labels[2, 6:] = -100
    labels[3] = -100
    return ids, mask, labels


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_skipping_padding_changes_nothing_that_counts(attn):
    """`skip_padding` computes only real source positions and target positions up to the last label:
    loss, gradients, labelled logits and real encoder outputs equal those of computing everything."""
    skip, full = tiny_model(attn_implementation=attn), tiny_model(attn_implementation=attn, skip_padding=False)
    assert skip.config.skip_padding and not full.config.skip_padding
    ids, mask, labels = padded_training_batch()
    outputs = []
    for model in (skip, full):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        outputs.append(out)
    a, b = outputs
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=1e-6)
    labelled = labels.ne(-100)
    torch.testing.assert_close(a.logits[labelled], b.logits[labelled], rtol=0, atol=1e-5)
    skipped = ~labelled & labelled.any(1, keepdim=True)  # a row with no label at all is computed whole
    assert skipped.any() and (a.logits[skipped] == 0).all()  # documented: not computed
    real = mask.bool()
    real[3] = True  # a row with no real token is computed whole
    torch.testing.assert_close(a.encoder_last_hidden_state[real], b.encoder_last_hidden_state[real], rtol=0, atol=1e-5)
    for (name, p), q in zip(skip.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_rows_rounded_up_under_cpu_bf16_add_padding_positions_and_change_nothing_that_counts(monkeypatch):
    """Under CPU bf16 autocast the positions computed are rounded up to a multiple of ROWS_MULTIPLE_BF16_CPU with
    padding positions (a bounded set of matrix shapes); forced here in float32 to a multiple of 4, the loss and
    gradients stay those of computing everything."""
    from vaswani_tx.model import skip_padding

    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    assert skip_padding.real_positions(mask).tolist() == [0, 1, 2, 5]
    rounded = skip_padding.real_positions(mask, 3).tolist()
    assert len(rounded) == 6 and {0, 1, 2, 5} <= set(rounded) and rounded == sorted(set(rounded))
    assert skip_padding.real_positions(mask, 16) is None  # rounded up to every position
    assert skip_padding.rows_multiple() == 1
    with torch.autocast("cpu", torch.bfloat16):
        assert skip_padding.rows_multiple() == skip_padding.ROWS_MULTIPLE_BF16_CPU == 64
    monkeypatch.setattr(skip_padding, "rows_multiple", lambda: 4)
    skip, full = tiny_model(), tiny_model(skip_padding=False)
    ids, mask, labels = padded_training_batch()
    plan = skip_padding.PaddingPlan.build(skip.config, mask, None, labels, target_length=labels.shape[1])
    assert all(index is None or index.numel() % 4 == 0 for index in (plan.source, plan.target, plan.labelled))
    losses = []
    for model in (skip, full):
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, epsilon_ls=0.1).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=1e-6)
    for (name, p), q in zip(skip.named_parameters(), full.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_eager_and_sdpa_attention_train_the_same_function():
    """`attn_implementation: auto` trains with Equation 1 written out on the CPU: the loss and every gradient are
    SDPA's on a padded batch (padding in sources and targets, the decoder's causal mask)."""
    ids, mask, labels = padded_training_batch()
    results = {}
    for implementation in ("sdpa", "eager"):
        model = tiny_model(attn_implementation=implementation)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels, epsilon_ls=0.1).loss
        loss.backward()
        results[implementation] = loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}
    (sdpa_loss, sdpa_grads), (eager_loss, eager_grads) = results["sdpa"], results["eager"]
    assert eager_loss == pytest.approx(sdpa_loss, rel=1e-6)
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(eager_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_skipping_padding_follows_the_decoder_mask_and_leaves_decoding_alone():
    skip, full = tiny_model(), tiny_model(skip_padding=False)
    ids, mask = batch()
    target = torch.randint(4, 61, (3, 6))
    target_mask = torch.ones_like(target)
    target_mask[0, 3:] = 0
    target_mask[2, 1] = 0  # a hole before the last 1: still computed (later positions may attend to it)
    a = skip(input_ids=ids, attention_mask=mask, decoder_input_ids=target, decoder_attention_mask=target_mask).logits
    b = full(input_ids=ids, attention_mask=mask, decoder_input_ids=target, decoder_attention_mask=target_mask).logits
    torch.testing.assert_close(a[target_mask.bool()], b[target_mask.bool()], rtol=0, atol=1e-5)
    torch.testing.assert_close(a[2], b[2], rtol=0, atol=1e-5)
    assert torch.equal(
        skip.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6),
        full.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6),
    )


def test_skip_padding_must_be_a_bool():
    with pytest.raises(ValueError, match="skip_padding='yes' is not allowed"):
        tiny_config(skip_padding="yes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_fully_padded_row_gives_no_nan(dtype, attn):
    model = tiny_model(attn_implementation=attn).to(dtype)
    ids, mask = batch()
    mask[1] = 0  # a row with nothing to attend to
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :4], output_attentions=attn == "eager")
    assert torch.isfinite(out.logits).all()
    assert torch.isfinite(out.encoder_last_hidden_state).all()


@pytest.mark.parametrize("overrides", [{}, {"d_k": 5, "d_v": 7}, {"num_heads": 1, "d_k": 24, "d_v": 24}])
def test_sdpa_equals_eager(overrides):
    eager, sdpa = (
        tiny_model(attn_implementation="eager", **overrides),
        tiny_model(attn_implementation="sdpa", **overrides),
    )
    ids, mask = batch()
    target = torch.randint(4, 61, (3, 6))
    a = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    b = sdpa(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_output_attentions_returns_weights_of_each_kind():
    model = tiny_model()  # sdpa by default; asking for weights uses the eager path
    ids, mask = batch()
    out = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :5], output_attentions=True)
    assert [w.shape for w in out.encoder_attentions] == [(3, 3, 7, 7)] * 2
    assert [w.shape for w in out.decoder_attentions] == [(3, 3, 5, 5)] * 3
    assert [w.shape for w in out.cross_attentions] == [(3, 3, 5, 7)] * 3
    torch.testing.assert_close(out.cross_attentions[0].sum(-1), torch.ones(3, 3, 5))
    assert out.cross_attentions[0][1, :, :, 4:].abs().max() == 0  # row 1 has 4 real source tokens
    assert torch.triu(out.decoder_attentions[0][0, 0], diagonal=1).abs().max() == 0  # causal


# --- Section 3.4: one shared matrix -------------------------------------------------------------------------------


def test_one_matrix_for_source_target_and_pre_softmax(tmp_path):
    model = tiny_model()
    shared = model.model.shared.weight
    assert model.model.encoder.embeddings.embed_tokens.weight is shared
    assert model.model.decoder.embeddings.embed_tokens.weight is shared
    assert model.lm_head.weight is shared
    assert sum(p.numel() for p in model.parameters()) == num_parameters_closed_form(model.config)
    model.save_pretrained(tmp_path)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert (
        reloaded.lm_head.weight
        is reloaded.model.shared.weight
        is reloaded.model.encoder.embeddings.embed_tokens.weight
    )

    model.resize_token_embeddings(70)
    assert model.config.vocab_size == 70 and model.model.shared.weight.shape == (70, 24)
    shared = model.model.shared.weight
    assert model.lm_head.weight is shared and model.model.decoder.embeddings.embed_tokens.weight is shared
    assert model(input_ids=torch.tensor([[65, 3]]), decoder_input_ids=torch.tensor([[2, 69]])).logits.shape[-1] == 70


def test_the_decoders_text_config_holds_the_target_sides_sizes():
    """`get_text_config(decoder=True)` (what generate() sizes its cache by): the decoder's stack, vocabulary and
    feed-forward size; this config itself where they are its own (no copy at each call)."""
    from transformers import DynamicCache

    sizes = dict(vocab_size=40, d_model=16, d_ff=32, num_heads=2, num_encoder_layers=1, num_decoder_layers=3)
    config = VaswaniConfig(**sizes)
    assert config.get_text_config(decoder=True) is config and config.get_text_config() is config
    assert config.get_text_config(encoder=True) is config
    assert len(DynamicCache(config=config.get_text_config(decoder=True)).layers) == 3
    separate = VaswaniConfig(**sizes, share_encoder_decoder_embeddings=False, decoder_vocab_size=30, decoder_d_ff=64)
    view = separate.get_text_config(decoder=True)
    assert (view.vocab_size, view.d_ff, view.num_hidden_layers) == (30, 64, 3)
    assert (separate.vocab_size, separate.d_ff) == (40, 32)  # the config itself unchanged


def test_generate_still_refuses_unknown_arguments():
    """An argument neither the engine nor the model takes: transformers' loops refuse it, by the model's signature."""
    model = tiny_model()
    ids, mask = batch()
    with pytest.raises(ValueError, match="not used by the model"):
        model.generate(input_ids=ids, attention_mask=mask, num_beams=2, max_new_tokens=3, bogus_argument=1)


def test_untied_pre_softmax_projection_option(tmp_path):
    model = tiny_model(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.model.shared.weight
    assert model.model.encoder.embeddings.embed_tokens.weight is model.model.shared.weight
    assert sum(p.numel() for p in model.parameters()) == num_parameters_closed_form(model.config)
    model.save_pretrained(tmp_path)
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path).eval()
    ids, _ = batch()
    torch.testing.assert_close(
        model(input_ids=ids, decoder_input_ids=ids).logits,
        reloaded(input_ids=ids, decoder_input_ids=ids).logits,
        rtol=0,
        atol=0,
    )


def test_initialisation_is_the_documented_one():
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(tiny_config(vocab_size=4000, d_model=64, num_heads=4, d_ff=256))
    assert model.model.shared.weight.std().item() == pytest.approx(64**-0.5, rel=0.05)
    w = model.model.encoder.layers[0].feed_forward.w_1.weight  # Xavier-uniform bound sqrt(6 / (fan_in + fan_out))
    assert w.abs().max().item() <= math.sqrt(6 / (64 + 256)) and w.abs().max().item() > 0.9 * math.sqrt(6 / 320)
    assert model.model.encoder.layers[0].feed_forward.w_1.bias.abs().max() == 0


# --- Table 3: parameter counts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("row", TABLE3, ids=[r.name for r in TABLE3])
def test_table3_parameter_counts(row):
    config = VaswaniConfig(**model_config_overrides(row))
    built = count_parameters(config)
    assert built == num_parameters_closed_form(config)
    if row.params_millions is not None:
        assert abs(built / 1e6 - row.params_millions) <= TOLERANCE_MILLIONS


def test_closed_form_matches_spec_reference_counts():
    base = VaswaniConfig(vocab_size=PAPER_VOCAB_SIZE)
    big = VaswaniConfig(vocab_size=PAPER_VOCAB_SIZE, d_model=1024, d_ff=4096, num_heads=16, dropout=0.3)
    assert num_parameters_closed_form(base) / 1e6 == pytest.approx(63.1, abs=0.1)
    assert num_parameters_closed_form(big) / 1e6 == pytest.approx(214.2, abs=0.1)


def test_configs_folder_matches_the_paper_table():
    for row in ALL_MODEL_CONFIGS:
        config = load_model_config(REPO / "configs" / "model" / f"{row.name}.json")
        expected = VaswaniConfig(**model_config_overrides(row))
        assert config.to_dict() == expected.to_dict(), row.name
    assert len(list((REPO / "configs" / "model").glob("*.json"))) == len(ALL_MODEL_CONFIGS)


def test_params_command_prints_every_config():
    from vaswani_tx.cli import main

    assert (
        main(["params", str(REPO / "configs" / "model" / "base.json"), str(REPO / "configs" / "model" / "big.json")])
        == 0
    )


# --- MarianMTModel equivalence: no silent departure --------------------------------------------------------------


def test_logits_equal_marian_with_permuted_weights():
    model = tiny_model(num_encoder_layers=2, num_decoder_layers=2)
    marian = vaswani_to_marian(model)  # the package's exporter: weights permuted to Marian's sin/cos layout
    assert marian.lm_head.weight.data_ptr() == marian.model.shared.weight.data_ptr()
    ids, mask = batch()
    target = torch.randint(4, 61, (3, 8))
    ours = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    theirs = marian(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# --- Generation: Section 6.1 defaults ----------------------------------------------------------------------------


def test_generation_defaults_are_the_papers(tmp_path):
    model = tiny_model()
    g = model.generation_config
    assert (g.num_beams, g.length_penalty, g.early_stopping) == (4, 0.6, True)
    assert g.length_penalty_type == "gnmt" and g.max_output_length_offset == 50
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "generation_config.json").read_text())
    assert saved["length_penalty_type"] == "gnmt" and saved["max_output_length_offset"] == 50
    assert "max_length" not in saved
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path)
    assert reloaded.generation_config.max_output_length_offset == 50


def test_gnmt_length_penalty_form():
    alpha = GNMTLengthPenalty(0.6)
    assert float(alpha) == 0.6 and alpha > 0.0
    for length in (1, 7, 30):
        assert length**alpha == pytest.approx(((5 + length) / 6) ** 0.6)


def never_ending(model: VaswaniForConditionalGeneration) -> VaswaniForConditionalGeneration:
    """Make </s> the least likely token everywhere: the last decoder LayerNorm outputs a constant vector v,
    and </s>'s row of the (tied) output matrix points against it."""
    with torch.no_grad():
        norm = model.model.decoder.layers[-1].feed_forward_norm
        norm.weight.zero_()
        norm.bias.copy_(torch.linspace(-1, 1, 24))
        model.model.shared.weight[EOS] = -5 * norm.bias
    return model


@pytest.mark.parametrize("num_beams", [1, 4])
def test_output_length_cap_is_source_length_plus_50_per_example(num_beams):
    model = never_ending(tiny_model())
    ids, mask = batch(lengths=(7, 3, 5))
    out = model.generate(input_ids=ids, attention_mask=mask, num_beams=num_beams)
    for row, n in enumerate((7, 3, 5)):
        tokens = out[row, 1:].tolist()  # drop the decoder start token
        assert tokens.index(EOS) + 1 == n + 50  # exactly the cap, </s> being the last allowed token
    assert out.shape[1] == 1 + 7 + 50


def logits_position_by_position(model, ids, mask, targets, cache, first: int = 1) -> torch.Tensor:
    """The logits of each target position from forwards through `cache`: the first `first` positions in one call
    (a prefill), then one new position per call, as decoding runs."""
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    steps = [(0, first)] + [(t, t + 1) for t in range(first, targets.shape[1])]
    logits = []
    for start, end in steps:
        output = model(
            encoder_outputs=encoder_outputs,
            attention_mask=mask,
            decoder_input_ids=targets[:, start:end],
            past_key_values=cache,
            use_cache=True,
        )
        logits.append(output.logits)
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("cache_kind, first", [("dynamic", 1), ("dynamic", 3), ("static", 1)])
def test_one_forward_gives_the_same_logits_without_a_cache_and_with_the_dynamic_one(cache_kind, first):
    """Training (whole targets, no cache) and the dynamic cache run the same layer code: the logits of every
    position agree whichever way they were reached. A static cache, whose layers hold unwritten positions the
    model's attention would read, is refused with a message naming it."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import EncoderDecoderCache

    model = tiny_model(seed=2)
    ids, mask = batch()
    targets = torch.cat(
        [torch.full((3, 1), BOS), torch.randint(4, 61, (3, 6), generator=torch.Generator().manual_seed(3))], 1
    )
    with torch.no_grad():
        whole = model(input_ids=ids, attention_mask=mask, decoder_input_ids=targets, use_cache=False).logits
        if cache_kind == "dynamic":
            cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        else:
            cache = EncoderDecoderCache(
                StaticCache(config=model.config, max_cache_len=targets.shape[1]),
                StaticCache(config=model.config, max_cache_len=ids.shape[1]),
            )
        if cache_kind == "static":
            with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
                logits_position_by_position(model, ids, mask, targets, cache, first)
            return
        stepped = logits_position_by_position(model, ids, mask, targets, cache, first)
    torch.testing.assert_close(stepped, whole, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_gives_the_same_with_the_dynamic_cache_the_static_one_and_none(num_beams):
    """generate(): the same tokens and scores, greedy and beam, with each cache (the static one eagerly here; its
    compiled step: test_speed.py) and without one."""
    model = tiny_model(seed=4, tie_word_embeddings=False)  # a random model that repeats itself less than most
    ids, mask = batch(lengths=(8, 3, 5))
    kwargs = dict(
        input_ids=ids,
        attention_mask=mask,
        num_beams=num_beams,
        num_return_sequences=min(num_beams, 2),
        max_new_tokens=10,
        output_scores=True,
        return_dict_in_generate=True,
    )
    reference = model.generate(**kwargs)
    assert len(set(reference.sequences[:, 1:].flatten().tolist())) > 3
    other = model.generate(**kwargs, use_cache=False)
    torch.testing.assert_close(other.sequences, reference.sequences, rtol=0, atol=0)
    torch.testing.assert_close(torch.stack(other.scores), torch.stack(reference.scores), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cache_implementation='static' is not supported"):
        model.generate(**kwargs, cache_implementation="static")


@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_with_cache_equals_without(num_beams):
    model = tiny_model()
    ids, mask = batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, num_beams=num_beams, max_new_tokens=12)
    torch.testing.assert_close(model.generate(**kwargs, use_cache=True), model.generate(**kwargs, use_cache=False))


def test_each_cached_decoding_step_sees_the_whole_prefix():
    """The logits generate() acts on at each step equal one forward over the prefix it had then. A random model
    often picks the same tokens whatever it sees, so equal outputs alone would not show that the cache reaches
    forward (transformers 5.24 renamed generate()'s `past_key_values` argument to `cache`; a forward that dropped
    it decoded each new token without its prefix)."""
    model = tiny_model()
    ids, mask = batch()
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        num_beams=1,
        max_new_tokens=8,
        output_logits=True,
        return_dict_in_generate=True,
    )
    stepped = torch.stack(out.logits, dim=1)  # (B, steps, V)
    with torch.no_grad():
        full = model(
            input_ids=ids, attention_mask=mask, decoder_input_ids=out.sequences[:, :-1], use_cache=False
        ).logits
    torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-4)


def test_beam_scores_use_the_gnmt_penalty():
    model = tiny_model()
    ids, mask = batch(lengths=(6,))
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        num_beams=3,
        max_new_tokens=6,
        output_scores=True,
        return_dict_in_generate=True,
    )
    sequence = out.sequences[0]
    # Rescore the returned hypothesis by hand: sum of log-probabilities over its generated tokens.
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=sequence[None, :-1]).logits[0]
    logprobs = torch.log_softmax(logits, -1).gather(1, sequence[1:, None]).squeeze(1)
    length = int((sequence[1:] != PAD).sum()) if EOS in sequence.tolist() else len(sequence) - 1
    total = logprobs[:length].sum()
    expected = total / ((5 + length) / 6) ** 0.6
    assert out.sequences_scores[0].item() == pytest.approx(expected.item(), abs=1e-4)
    hf_form = model.generate(
        input_ids=ids,
        attention_mask=mask,
        num_beams=3,
        max_new_tokens=6,
        length_penalty_type="hf",
        output_scores=True,
        return_dict_in_generate=True,
    )
    if torch.equal(hf_form.sequences[0], sequence):
        assert hf_form.sequences_scores[0].item() == pytest.approx((total / length**0.6).item(), abs=1e-4)


def test_source_cap_holds_without_warning_when_the_generation_config_carries_a_max_length():
    # Seq2SeqTrainer's evaluation writes transformers' defaults (max_length=20, ...) into the model's
    # generation config, and a model saved after training keeps them.
    import logging

    model = never_ending(tiny_model())
    model.generation_config.max_length = 20
    ids, mask = batch(lengths=(7, 3))
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("transformers").addHandler(handler)
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, num_beams=1)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert out.shape[1] == 1 + 7 + 50
    assert [r.getMessage() for r in records if "max_length" in r.getMessage()] == []


@pytest.mark.parametrize("use_engine", [True, False])
@pytest.mark.parametrize("limit", [{}, {"max_new_tokens": 10**6}, {"max_length": 10**6}])
def test_no_output_runs_past_the_positions_the_model_was_made_for(use_engine, limit):
    """Nothing runs unbounded: the per-source cap (source + 50) and any explicit limit stop at
    max_position_embeddings, in the engine and in transformers' loops (issue 83: a 5,000-word line ran 300 s)."""
    model = never_ending(tiny_model(max_position_embeddings=16))
    ids, mask = batch(lengths=(7, 3, 5))
    for beams in (1, 3):
        out = model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, use_engine=use_engine, **limit)
        assert out.shape[1] == 16


@pytest.mark.parametrize("use_engine", [True, False])
def test_padded_input_ids_without_a_mask_are_masked_with_one_warning(use_engine, caplog):
    """generate() on a padded batch without attention_mask masks pad_token_id (as the pipeline does), with one
    warning, and gives the ids of the explicit mask; an unpadded batch needs no mask and gets no warning."""
    model = tiny_model()
    ids, mask = batch(lengths=(7, 3, 5))
    for beams in (1, 3):
        expected = model.generate(input_ids=ids, attention_mask=mask, num_beams=beams, use_engine=use_engine)
        caplog.clear()
        with caplog.at_level("WARNING"):
            out = model.generate(input_ids=ids, num_beams=beams, use_engine=use_engine)
        assert torch.equal(out, expected)
        warned = [r.getMessage() for r in caplog.records if "attention_mask" in r.getMessage()]
        assert len(warned) == 1 and "pad_token_id=0" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING"):
        model.generate(input_ids=ids[:1], use_engine=use_engine)
    assert not [r for r in caplog.records if "attention_mask" in r.getMessage()]


def test_an_unset_alpha_is_read_as_transformers_default_in_the_gnmt_form():
    """A generation config that sets no length_penalty (transformers 5 leaves it None) decodes with alpha 1.0."""
    model = tiny_model()
    ids, mask = batch()
    model.generation_config.length_penalty = None
    unset = model.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6)
    model.generation_config.length_penalty = 1.0
    assert torch.equal(unset, model.generate(input_ids=ids, attention_mask=mask, num_beams=3, max_new_tokens=6))


def test_explicit_max_new_tokens_replaces_the_source_cap():
    model = never_ending(tiny_model())
    ids, mask = batch()
    assert model.generate(input_ids=ids, attention_mask=mask, num_beams=1, max_new_tokens=5).shape[1] == 1 + 5


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"num_beams": 0}, r"num_beams=0 is not allowed; it must be a whole number >= 1"),
        ({"num_beams": 2.5}, r"num_beams=2.5 is not allowed"),
        ({"num_return_sequences": 0}, r"num_return_sequences=0 is not allowed"),
        ({"length_penalty": float("nan")}, r"length_penalty=nan is not allowed; it must be a finite number"),
        ({"max_output_length_offset": 1.5}, r"max_output_length_offset=1.5 is not allowed; it must be a whole"),
        ({"max_output_length_offset": -7}, r"max_output_length_offset=-7 leaves source 1 \(4 tokens\) no output"),
        ({"max_len_b": -1}, r"max_len_b=-1 is not allowed"),
        ({"input_ids": torch.zeros(0, 4, dtype=torch.long)}, r"input_ids has shape \(0, 4\), an empty batch"),
        ({"input_ids": torch.zeros(2, 0, dtype=torch.long)}, r"input_ids has shape \(2, 0\), sequences without"),
        ({"input_ids": torch.ones(1, 4)}, r"input_ids holds torch.float32 values; token ids are integers"),
    ],
)
def test_generate_refuses_impossible_arguments_naming_them(arguments, message):
    """A ValueError naming the argument, where transformers would fail on something else (ZeroDivisionError for
    num_beams=0, a reduction error for an empty batch, issue 28)."""
    ids, mask = batch()
    kwargs = {"input_ids": ids, "attention_mask": mask, **arguments}
    if kwargs["input_ids"] is not ids:
        kwargs.pop("attention_mask")
    with pytest.raises(ValueError, match=message):
        tiny_model().generate(**kwargs)


# --- HF contract: Auto classes, save/load, remote code, gradient checkpointing ----------------------------------------


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"d_model": None}, ["d_model: config has 512, the weights have 24"]),
        ({"vocab_size": None}, ["vocab_size: config has 37000, the weights have 61"]),
        ({"num_encoder_layers": None}, ["num_encoder_layers: config has 6, the weights have 2"]),
        ({"num_decoder_layers": 2}, ["num_decoder_layers: config has 2, the weights have 3"]),
        ({"d_ff": 48}, ["d_ff: config has 48, the weights have 40"]),
        ({"d_k": 6}, ["num_heads * d_k: config has 18, the weights have 24"]),
    ],
)
def test_a_config_json_that_does_not_fit_the_weights_names_the_field(tmp_path, changes, words):
    """A field missing from config.json takes the base model's default; wrong or missing, the load is refused with
    a ValueError naming the field and both values (transformers: a bare RuntimeError for sizes, random layers for a
    layer count), on every route: from_pretrained, the Auto classes, the commands (exit 2)."""
    from transformers import AutoModelForSeq2SeqLM

    from vaswani_tx.cli import main

    tiny_model().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    for key, value in changes.items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for load in (VaswaniForConditionalGeneration.from_pretrained, AutoModelForSeq2SeqLM.from_pretrained):
        with pytest.raises(ValueError, match="the weights do not fit the config") as raised:
            load(tmp_path)
        assert all(word in str(raised.value) for word in words), str(raised.value)
    assert main(["export-marian", str(tmp_path), str(tmp_path / "marian")]) == 2
    assert not (tmp_path / "marian").exists()


def test_the_package_imports_without_torch_and_the_classes_register_on_use():
    """`import vaswani_tx` loads no torch (so `vaswani-tx --help` is instant); using a class registers the Auto
    classes, as importing the package did before."""
    script = textwrap.dedent("""
        import sys
        import vaswani_tx
        assert "torch" not in sys.modules and "transformers" not in sys.modules, "import vaswani_tx loaded torch"
        from transformers import AutoConfig, AutoModelForSeq2SeqLM
        from vaswani_tx import VaswaniConfig
        config = VaswaniConfig(vocab_size=61, d_model=24, d_ff=40, num_heads=3, num_encoder_layers=1, num_decoder_layers=1)
        model = AutoModelForSeq2SeqLM.from_config(config)
        assert type(model).__name__ == "VaswaniForConditionalGeneration", type(model)
        assert type(AutoConfig.for_model("vaswani")) is VaswaniConfig
        print("ok")
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_auto_classes_are_registered(tmp_path):
    values = {k: v for k, v in tiny_config().to_diff_dict().items() if k != "model_type"}
    config = AutoConfig.for_model("vaswani", **values)
    assert isinstance(config, VaswaniConfig)
    assert isinstance(AutoModelForSeq2SeqLM.from_config(config), VaswaniForConditionalGeneration)
    assert isinstance(AutoModel.from_config(config), VaswaniModel)
    model = tiny_model()
    model.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [
        "config.json",
        "configuration_vaswani.py",
        "dropout.py",  # Section 5.4's dropout, its masks drawn in bulk where torch draws them one by one
        "errors.py",  # UserInputError, raised by the config and the model
        "generation_config.json",
        "generation_vaswani.py",
        "model.safetensors",
        "modeling_vaswani.py",
        "pipeline_vaswani.py",
        "skip_padding.py",
        "vocabulary.py",  # the tokenizer-fits-model check and the text normalisation the pipeline runs
    ]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["auto_map"]["AutoModelForSeq2SeqLM"] == "modeling_vaswani.VaswaniForConditionalGeneration"
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    ids, mask = batch()
    torch.testing.assert_close(
        model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits,
        reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits,
        rtol=0,
        atol=0,
    )


def test_trust_remote_code_load_without_the_package(tmp_path):
    model = tiny_model()
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    ids, mask = batch()
    expected = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
    torch.save({"ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    script = textwrap.dedent(f"""
        import sys
        sys.modules["vaswani_tx"] = None  # importing vaswani_tx now fails, as in a process without the package
        try:
            import vaswani_tx
            raise SystemExit("vaswani_tx should not be importable here")
        except ImportError:
            pass
        import torch
        from transformers import AutoModelForSeq2SeqLM
        model = AutoModelForSeq2SeqLM.from_pretrained({str(folder)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        inputs = torch.load({str(tmp_path / "inputs.pt")!r})
        logits = model(input_ids=inputs["ids"], attention_mask=inputs["mask"], decoder_input_ids=inputs["ids"]).logits
        torch.save(logits, {str(tmp_path / "logits.pt")!r})
        print(model.generation_config.length_penalty_type, model.generate(input_ids=inputs["ids"][:1], max_new_tokens=3).shape)
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gnmt" in result.stdout
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=0)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids, mask = batch()
    labels = torch.randint(4, 61, (3, 6))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model().train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads.append(model.model.encoder.layers[0].self_attn.q_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_loss_ignores_minus_100_and_shifts_labels_right():
    model = tiny_model()
    ids, mask = batch()
    labels = torch.randint(4, 61, (3, 5))
    labels[1, 3:] = -100
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    decoder_input_ids = torch.cat([torch.full((3, 1), BOS), labels[:, :-1].clamp(min=0)], 1)
    decoder_input_ids[1, 4] = PAD
    logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_input_ids).logits
    keep = labels != -100
    expected = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(out.loss, expected)


def test_dropout_is_where_the_paper_puts_it():
    model = tiny_model(dropout=0.5).train()
    ids, mask = batch()
    torch.manual_seed(0)
    a = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
    torch.manual_seed(1)
    b = model(input_ids=ids, attention_mask=mask, decoder_input_ids=ids).logits
    assert not torch.allclose(a, b)
    dropouts = {
        n.rsplit(".", 1)[0] for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p == 0.5
    }
    assert "model.encoder.embeddings" in dropouts and "model.decoder.embeddings" in dropouts
    assert "model.encoder.layers.0" in dropouts and "model.decoder.layers.2" in dropouts


# --- Bad input ---------------------------------------------------------------------------------------------------


def test_ids_outside_the_vocabulary_are_refused():
    model = tiny_model()
    ids, mask = batch()
    bad = ids.clone()
    bad[0, 0] = 75
    with pytest.raises(ValueError, match=r"id 75 \(largest 75.*vocab_size=61"):
        model(input_ids=bad, attention_mask=mask, decoder_input_ids=ids)
    bad[0, 0] = -3
    with pytest.raises(ValueError, match=r"input_ids contains id -3.*vocab_size=61"):
        model(input_ids=bad, attention_mask=mask, decoder_input_ids=ids)
    with pytest.raises(ValueError, match=r"decoder_input_ids contains id 61"):
        model(input_ids=ids, decoder_input_ids=torch.tensor([[2, 61]]).expand(3, 2))
    with pytest.raises(ValueError, match=r"labels contains id 99"):
        model(input_ids=ids, labels=torch.tensor([[5, 99, -100]]).expand(3, 3))


def test_missing_decoder_inputs_and_labels_is_refused():
    with pytest.raises(ValueError, match=r"Pass decoder_input_ids .* or labels"):
        tiny_model()(input_ids=batch()[0])


def test_mask_shape_must_match_ids():
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"attention_mask has shape \(3, 6\) but input_ids has shape \(3, 7\)"):
        tiny_model()(input_ids=ids, attention_mask=mask[:, :6], decoder_input_ids=ids)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 25, "num_heads": 3, "d_k": None}, r"d_model=25 is not divisible by num_heads=3"),
        ({"d_ff": 0}, r"d_ff=0 is not allowed; it must be a positive integer"),
        ({"num_heads": -2}, r"num_heads=-2 is not allowed"),
        ({"dropout": 1.0}, r"dropout=1.0 is not allowed; it must be a float in \[0, 1\)"),
        ({"attention_dropout": -0.1}, r"attention_dropout=-0.1 is not allowed"),
        ({"position_encoding": "rotary"}, r"position_encoding='rotary' is not allowed; choose one of"),
        ({"eos_token_id": 61}, r"eos_token_id=61 is not allowed; it must be an id in \[0, vocab_size=61\)"),
        ({"pad_token_id": -1}, r"pad_token_id=-1 is not allowed"),
        ({"d_model": 21, "num_heads": 3}, r"d_model=21 must be even with sinusoidal positions"),
    ],
)
def test_bad_config_values_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**overrides)


def test_hf_conventional_names_map_onto_the_papers():
    config = VaswaniConfig(
        hidden_size=48, num_attention_heads=6, encoder_layers=3, decoder_layers=4, encoder_ffn_dim=96
    )
    assert (config.d_model, config.num_heads, config.num_encoder_layers, config.num_decoder_layers, config.d_ff) == (
        48,
        6,
        3,
        4,
        96,
    )
    assert config.d_k == config.d_v == 8 and config.num_hidden_layers == 4 and config.hidden_size == 48


def test_package_version_and_exports():
    assert vaswani_tx.__version__
    assert vaswani_tx.VaswaniConfig.model_type == "vaswani"
