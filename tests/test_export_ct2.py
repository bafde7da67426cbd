"""CTranslate2 export: the converted model decodes exactly as ours does (greedy), and the command's errors."""

from __future__ import annotations

import json

import pytest
import torch

from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_tx.cli import main as cli_main
from vaswani_tx.interop.export import DECODING_FILE, build_ct2_spec, ct2_decoding_options, export_ct2

ctranslate2 = pytest.importorskip("ctranslate2")


@pytest.fixture(scope="module")
def sentences(shared_data):
    return (shared_data / "multi30k-en-de" / "val.en").read_text(encoding="utf-8").splitlines()[:6]


def our_greedy_tokens(model, tokenizer, sentences, max_new_tokens):
    encoded = tokenizer(sentences, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**encoded, num_beams=1, max_new_tokens=max_new_tokens)
    tokens = []
    for row in out[:, 1:].tolist():  # drop the decoder start token
        row = row[: row.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in row else row
        tokens.append(tokenizer.convert_ids_to_tokens(row))
    return tokens


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_converted_model_gives_our_greedy_output(tiny_translator, sentences, tmp_path, quantization):
    folder, model, tokenizer = tiny_translator
    out = export_ct2(folder, tmp_path / "ct2", quantization=quantization)
    translator = ctranslate2.Translator(str(out), device="cpu")
    sources = [tokenizer.convert_ids_to_tokens(tokenizer(s)["input_ids"]) for s in sentences]
    assert all(source[-1] == "</s>" for source in sources)
    results = translator.translate_batch(sources, beam_size=1, max_decoding_length=12)
    converted = [r.hypotheses[0] for r in results]
    if quantization is None:
        assert converted == our_greedy_tokens(model, tokenizer, sentences, max_new_tokens=12)
    else:  # int8 weights: a valid translation of the same length limit, not the same tokens
        assert all(0 < len(tokens) <= 12 for tokens in converted)
        assert json.loads((out / "config.json").read_text())["layer_norm_epsilon"] == model.config.layer_norm_eps


def test_paper_decoding_defaults_travel_with_the_export(tiny_translator, tmp_path):
    folder, _, _ = tiny_translator
    out = export_ct2(folder, tmp_path / "ct2")
    saved = json.loads((out / DECODING_FILE).read_text())
    assert (saved["beam_size"], saved["length_penalty"], saved["max_output_length_offset"]) == (4, 0.6, 50)
    assert ct2_decoding_options(out, [["a", "b", "</s>"], ["c", "</s>"]]) == {
        "beam_size": 4,
        "length_penalty": 0.6,
        "max_decoding_length": 53,
    }


def test_shapes_ctranslate2_cannot_hold_are_refused():
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=20, d_model=24, num_heads=3, d_k=6, d_v=10, d_ff=32, num_encoder_layers=1, num_decoder_layers=1
        )
    )
    with pytest.raises(ValueError, match="d_k = d_v = d_model / num_heads"):
        build_ct2_spec(model, [f"t{i}" for i in range(20)])
    with pytest.raises(ValueError, match="tokenizer has 3 tokens but the model's vocab_size is 20"):
        build_ct2_spec(
            VaswaniForConditionalGeneration(
                VaswaniConfig(
                    vocab_size=20, d_model=24, num_heads=3, d_ff=32, num_encoder_layers=1, num_decoder_layers=1
                )
            ),
            ["a", "b", "c"],
        )


def test_export_command(tiny_translator, tmp_path, capsys):
    folder, _, _ = tiny_translator
    assert cli_main(["export-ct2", str(folder), str(tmp_path / "int8"), "--quantization", "int8"]) == 0
    assert "wrote CTranslate2 model" in capsys.readouterr().out
    assert (tmp_path / "int8" / "model.bin").is_file()
    assert cli_main(["export-ct2", str(folder), str(tmp_path / "int8")]) == 2
    assert "already exists and is a CTranslate2 model folder" in capsys.readouterr().err
    assert cli_main(["export-ct2", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
