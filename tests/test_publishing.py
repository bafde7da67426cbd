"""Publishing: the complete hub file set, the generated model card, a fresh-process load, push_to_hub offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_tx.interop.publishing import REQUIRED_FILES, check_hub_folder, render_model_card, save_for_hub

CARD = dict(
    repo="someone/vaswani-tiny-de-en",
    source_lang="de",
    target_lang="en",
    training_data="Multi30k Task 1 train (29,000 pairs), shared BPE vocabulary.",
    datasets=["bentrevett/multi30k"],
    results=[
        {
            "data": "Multi30k val",
            "name": "sacreBLEU",
            "score": 12.345,
            "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
        }
    ],
)


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_translator):
    _, model, tokenizer = tiny_translator
    return model, tokenizer


def test_complete_file_set_and_card(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    folder = save_for_hub(model, tokenizer, tmp_path / "out", **CARD)
    assert sorted(p.name for p in folder.iterdir()) == sorted(REQUIRED_FILES)
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModelForSeq2SeqLM"] and config["custom_pipelines"]["translation"]
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: translation")
    assert (
        "| Multi30k val | sacreBLEU | 12.35 | `nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0` |" in card
    )
    assert "Xavier-uniform" in card and "LayerNorm epsilon" in card and "$" not in card.split("```python")[0]
    assert (
        "beam 4, length penalty alpha 0.6 in the GNMT form ((5 + |Y|) / 6)^alpha; at most source length + 50" in card
    )


def test_card_lists_options_that_depart_from_the_paper(model_and_tokenizer):
    _, tokenizer = model_and_tokenizer
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=len(tokenizer),
            d_model=24,
            num_heads=3,
            d_ff=40,
            num_encoder_layers=1,
            num_decoder_layers=1,
            position_encoding="learned",
            tie_word_embeddings=False,
        )
    )
    model.generation_config.length_penalty_type = "hf"
    card = render_model_card(model, **{**CARD, "results": []})
    assert "`position_encoding='learned'`" in card and "`tie_word_embeddings=False`" in card
    assert "|Y|^alpha instead of the paper's GNMT form" in card and "Not measured for this model." in card


def test_published_folder_translates_in_a_fresh_process(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    folder = save_for_hub(model, tokenizer, tmp_path / "out", **CARD)
    batch = tokenizer(["Ein Hund läuft."], return_tensors="pt")
    expected = tokenizer.batch_decode(model.generate(**batch, max_new_tokens=6), skip_special_tokens=True)
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["vaswani_tx"] = None
        from transformers import pipeline
        translator = pipeline("translation", model={str(folder)!r}, trust_remote_code=True)
        print(json.dumps(translator(["Ein Hund läuft."], max_new_tokens=6)))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [{"translation_text": expected[0]}]


def test_incomplete_folder_is_named(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    folder = save_for_hub(model, tokenizer, tmp_path / "out", **CARD)
    (folder / "pipeline_vaswani.py").unlink()
    with pytest.raises(ValueError, match=r"not a complete vaswani_tx model folder: missing pipeline_vaswani.py"):
        check_hub_folder(folder)


def test_mismatched_tokenizer_is_refused(model_and_tokenizer, tmp_path):
    _, tokenizer = model_and_tokenizer
    other = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=len(tokenizer) + 7, d_model=24, num_heads=3, d_ff=40, num_encoder_layers=1, num_decoder_layers=1
        )
    )
    with pytest.raises(ValueError, match=r"vocab_size"):
        save_for_hub(other, tokenizer, tmp_path / "bad", **CARD)


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_ENDPOINT": "http://127.0.0.1:9"}])
def test_push_to_hub_without_network_fails_fast_with_a_clear_message(model_and_tokenizer, tmp_path, env):
    model, tokenizer = model_and_tokenizer
    script = textwrap.dedent(f"""
        import torch, vaswani_tx
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer
        vaswani_tx.register_auto_classes()
        from vaswani_tx.interop.publishing import push_to_hub
        model = AutoModelForSeq2SeqLM.from_pretrained({str(tmp_path / "src")!r})
        tokenizer = AutoTokenizer.from_pretrained({str(tmp_path / "src")!r})
        card = {{k: v for k, v in {CARD!r}.items() if k != "repo"}}
        try:
            push_to_hub(model, tokenizer, "someone/x", {str(tmp_path / "out")!r}, token="hf_fake", **card)
        except ConnectionError as err:
            print("ERROR:", err)
    """)
    model.save_pretrained(tmp_path / "src")
    tokenizer.save_pretrained(tmp_path / "src")
    run_env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**run_env, **env}, timeout=120
    )
    assert "ERROR: push_to_hub could not reach the Hugging Face Hub" in result.stdout, result.stderr[-2000:]
    assert f"The complete model folder is saved at {tmp_path / 'out'}" in result.stdout
    check_hub_folder(tmp_path / "out")
