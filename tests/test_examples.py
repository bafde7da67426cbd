"""The examples run: fine-tuning a saved model for a few steps on the shared Multi30k files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForSeq2SeqLM

from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_tx.data.tokenization import train_tokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_finetune_example_trains_evaluates_and_saves(tmp_path, shared_data):
    corpus = tmp_path / "data"
    corpus.mkdir()
    for split, count in (("train", 400), ("val", 16)):
        for lang in ("de", "en"):
            lines = (
                (shared_data / "multi30k-en-de" / f"{split}.{lang}").read_text(encoding="utf-8").splitlines()[:count]
            )
            (corpus / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([corpus / "train.de", corpus / "train.en"], vocab_size=600, show_progress=False)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=len(tokenizer), d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1, num_decoder_layers=1
        )
    )
    model.save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")

    result = load_example("finetune").main(
        [
            str(tmp_path / "base"),
            "--train-source",
            str(corpus / "train.de"),
            "--train-target",
            str(corpus / "train.en"),
            "--dev-source",
            str(corpus / "val.de"),
            "--dev-target",
            str(corpus / "val.en"),
            "--target-lang",
            "en",
            "--output-dir",
            str(tmp_path / "out"),
            "--max-steps",
            "12",
            "--batch-size",
            "16",
            "--learning-rate",
            "3e-3",
            "--num-beams",
            "1",
        ]
    )
    assert result["after"]["eval_loss"] < result["before"]["eval_loss"]
    assert {"eval_sacrebleu", "eval_chrf", "eval_tokenized_bleu"} <= result["after"].keys()
    reloaded = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out")
    assert isinstance(reloaded, VaswaniForConditionalGeneration)
    assert (tmp_path / "out" / "pipeline_vaswani.py").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
