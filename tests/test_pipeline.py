"""pipeline("translation", ..., trust_remote_code=True): the route transformers 5 leaves for translation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from transformers import pipeline

from vaswani_tx.model.errors import UserInputError
from vaswani_tx.model.pipeline_vaswani import VaswaniTranslationPipeline

SENTENCES = ["Ein Hund läuft über die Wiese.", "Zwei Männer spielen Fußball.", "Eine Frau liest."]


@pytest.fixture(scope="module")
def saved_model(tiny_translator):
    return tiny_translator


def generate_texts(model, tokenizer, texts, **kwargs):
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    output = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    return tokenizer.batch_decode(output, skip_special_tokens=True)


def test_saved_folder_declares_the_pipeline(saved_model):
    folder, _, _ = saved_model
    config = json.loads((folder / "config.json").read_text())
    assert config["custom_pipelines"]["translation"]["impl"] == "pipeline_vaswani.VaswaniTranslationPipeline"
    assert (folder / "pipeline_vaswani.py").is_file()


def test_remote_code_pipeline_equals_generate(saved_model):
    folder, model, tokenizer = saved_model
    translator = pipeline("translation", model=str(folder), trust_remote_code=True)
    assert type(translator).__name__ == "VaswaniTranslationPipeline"
    expected = generate_texts(model, tokenizer, SENTENCES[:1], max_new_tokens=8)
    assert translator(SENTENCES[0], max_new_tokens=8) == [{"translation_text": expected[0]}]
    # Lists, batching and generation kwargs at construction or per call; one result per input, in order.
    expected = [generate_texts(model, tokenizer, [s], num_beams=2, max_new_tokens=6)[0] for s in SENTENCES]
    results = translator(SENTENCES, batch_size=2, num_beams=2, max_new_tokens=6)
    assert [r["translation_text"] for r in results] == expected


def test_a_list_is_translated_longest_first_in_batches_and_returned_in_input_order(saved_model, monkeypatch):
    """A list goes to generate() longest first, in batches of `batch_size` sentences (32 where none is given), and
    comes back in input order with each sentence's own translation."""
    _, model, tokenizer = saved_model
    texts = ["Eine Frau.", SENTENCES[0], "Ein Hund läuft über die große grüne Wiese zum Fluss.", SENTENCES[1], "Ja."]
    expected = [generate_texts(model, tokenizer, [text], num_beams=2, max_new_tokens=6)[0] for text in texts]
    lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
    translator = VaswaniTranslationPipeline(model=model, tokenizer=tokenizer, num_beams=2, max_new_tokens=6)
    batches = []
    original = model.generate

    def recording(*args, **kwargs):
        batches.append(kwargs["input_ids"].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "generate", recording)
    assert [r["translation_text"] for r in translator(texts)] == expected
    assert batches == [(5, max(lengths))]  # five sentences: one batch of the default 32
    batches.clear()
    assert [r["translation_text"] for r in translator(texts, batch_size=2)] == expected
    assert [shape[0] for shape in batches] == [2, 2, 1]
    assert [shape[1] for shape in batches] == sorted(lengths, reverse=True)[::2]  # longest first: little padding
    assert translator([]) == []
    with pytest.raises(UserInputError, match="batch_size must be at least 1"):
        translator(texts, batch_size=0)


def test_a_list_is_truncated_post_processed_and_refused_as_a_string_is(saved_model, monkeypatch, caplog):
    """A list's sentences get a string's post-processing and truncation; an input longer than the model's
    positions is refused, naming it, or with truncation=True cut to them with a warning."""
    _, model, tokenizer = saved_model
    translator = VaswaniTranslationPipeline(model=model, tokenizer=tokenizer, max_new_tokens=5)
    expected = [translator(text, clean_up_tokenization_spaces=True)[0] for text in SENTENCES]
    assert translator(SENTENCES, clean_up_tokenization_spaces=True) == expected
    monkeypatch.setattr(tokenizer, "model_max_length", 4)
    lengths = []
    monkeypatch.setattr(model, "generate", lambda input_ids, **kwargs: lengths.append(input_ids.shape[1]) or input_ids)
    translator(SENTENCES, truncation=True)
    assert lengths and max(lengths) <= 4
    monkeypatch.undo()
    monkeypatch.setattr(model.config, "max_position_embeddings", 5)
    with pytest.raises(UserInputError, match=r"the input .* tokens long, more than this model's 5 positions"):
        translator(["Ja.", SENTENCES[0]], max_new_tokens=2)
    with caplog.at_level("WARNING"):
        cut = translator(["Ja.", SENTENCES[0]], max_new_tokens=2, truncation=True)
    assert len(cut) == 2 and "is cut to the model's 5 positions" in caplog.text and "'Ja.'" not in caplog.text


def test_pipeline_uses_the_papers_decoding_defaults(saved_model):
    folder, model, tokenizer = saved_model
    translator = pipeline("translation", model=str(folder), pipeline_class=VaswaniTranslationPipeline)
    expected = generate_texts(model, tokenizer, SENTENCES[:2])  # beam 4, GNMT penalty, source length + 50
    assert [r["translation_text"] for r in translator(SENTENCES[:2])] == expected


def test_pipeline_class_around_a_model_object(saved_model):
    _, model, tokenizer = saved_model
    translator = VaswaniTranslationPipeline(model=model, tokenizer=tokenizer, max_new_tokens=5)
    assert translator(SENTENCES[2]) == [
        {"translation_text": generate_texts(model, tokenizer, SENTENCES[2:], max_new_tokens=5)[0]}
    ]
    with pytest.raises(TypeError, match="a string or a list of strings"):
        translator(42)


def test_routes_that_cannot_work_say_which_does(saved_model):
    folder, _, _ = saved_model
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        pipeline("translation", model=str(folder))


def test_remote_code_pipeline_without_the_package(saved_model, tmp_path):
    folder, model, tokenizer = saved_model
    expected = [generate_texts(model, tokenizer, [s], max_new_tokens=7)[0] for s in SENTENCES]
    script = textwrap.dedent(f"""
        import json, sys
        sys.modules["vaswani_tx"] = None  # as in a process where the package is not installed
        from transformers import pipeline
        translator = pipeline("translation", model={str(folder)!r}, trust_remote_code=True)
        print(json.dumps([r["translation_text"] for r in translator({SENTENCES!r}, max_new_tokens=7)]))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_pipeline_drops_a_bom_and_zero_width_characters(saved_model):
    folder, _, _ = saved_model
    translator = pipeline("translation", model=str(folder), trust_remote_code=True)
    clean = translator("Ein Hund läuft über die Wiese.", max_new_tokens=6)
    assert translator("\ufeffEin Hund\u200b läuft über\u2060 die Wiese.", max_new_tokens=6) == clean


def test_pipeline_refuses_another_models_tokenizer_of_the_same_size(saved_model, tmp_path):
    """The check every command runs (sizes, special ids, the recorded fingerprint), on every pipeline route."""
    import shutil

    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    from vaswani_tx.model.vocabulary import vocabulary_fingerprint

    folder, _, tokenizer = saved_model
    model_folder = tmp_path / "model"
    shutil.copytree(folder, model_folder)
    config = json.loads((model_folder / "config.json").read_text(encoding="utf-8"))
    config["tokenizer_fingerprint"] = vocabulary_fingerprint(tokenizer)  # as train() and convert record it
    (model_folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    assert pipeline("translation", model=str(model_folder), trust_remote_code=True)("Ein Hund.", max_new_tokens=3)

    spec = json.loads((model_folder / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = spec["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[300:302]  # another vocabulary of the same size and special ids
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (model_folder / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_fingerprint.*another model"):
        pipeline("translation", model=str(model_folder), trust_remote_code=True)
    model = AutoModelForSeq2SeqLM.from_pretrained(str(model_folder), trust_remote_code=True)
    with pytest.raises(ValueError, match="tokenizer_fingerprint"):
        VaswaniTranslationPipeline(model=model, tokenizer=AutoTokenizer.from_pretrained(str(model_folder)))
