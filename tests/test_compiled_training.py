"""A compiled training step (`torch_compile: true` in a run config, the Trainer's `torch.compile` of the model)
gives the eager step's losses and weights on a tiny model, and `bf16: true` on the CPU (the Multi30k recipe's
autocast) runs the matrix multiplies in bfloat16 while weights, Adam and the saved model stay float32 (issue 21)."""

from __future__ import annotations

import json

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_tx.data.data import tokenize_pairs
from vaswani_tx.data.tokenization import train_tokenizer
from vaswani_tx.training.training import VaswaniTrainer


@pytest.fixture(scope="module")
def pairs_and_tokenizer(shared_data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("compiled")
    sides = {}
    for lang in ("en", "de"):
        lines = (shared_data / "multi30k-en-de" / f"val.{lang}").read_text(encoding="utf-8").splitlines()[:64]
        (folder / f"train.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
        sides[lang] = lines
    tokenizer = train_tokenizer([folder / "train.en", folder / "train.de"], "bpe", 400, show_progress=False)
    pairs = tokenize_pairs(Dataset.from_dict({"source": sides["en"], "target": sides["de"]}), tokenizer)
    return pairs, tokenizer


def _run(pairs, tokenizer, output_dir, compiled: bool = False, bf16: bool = False, seen_dtypes: set | None = None):
    torch.manual_seed(0)
    config = VaswaniConfig(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, num_heads=4, num_encoder_layers=1, num_decoder_layers=1
    )
    config.dropout = 0.0  # compiled and eager kernels draw dropout masks differently
    model = VaswaniForConditionalGeneration(config)
    if seen_dtypes is not None:  # what the position-wise maps compute in
        model.model.encoder.layers[0].feed_forward.register_forward_hook(
            lambda module, inputs, output: seen_dtypes.add(output.dtype)
        )
    args = Seq2SeqTrainingArguments(
        output_dir=str(output_dir),
        max_steps=3,
        learning_rate=1.0,
        warmup_steps=4,
        lr_scheduler_type="inverse_sqrt",
        label_smoothing_factor=0.1,
        adam_beta2=0.98,
        adam_epsilon=1e-9,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        seed=1,
        torch_compile=compiled,
        # only with compiled: TrainingArguments turns torch_compile on whenever a backend is named
        torch_compile_backend="inductor" if compiled else None,
        bf16=bf16,
    )
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=pairs,
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
        max_tokens=400,
    )
    trainer.train()
    assert (type(trainer.model_wrapped).__name__ == "OptimizedModule") == compiled
    trainer.save_model(str(output_dir))
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_compiled_and_eager_training_steps_agree(pairs_and_tokenizer, tmp_path):
    pairs, tokenizer = pairs_and_tokenizer
    eager = _run(pairs, tokenizer, tmp_path / "eager", compiled=False)
    compiled = _run(pairs, tokenizer, tmp_path / "compiled", compiled=True)
    assert len(eager) == len(compiled) == 3
    assert compiled == pytest.approx(eager, rel=1e-5, abs=1e-5)
    for name, tensor in load_file(tmp_path / "eager" / "model.safetensors").items():
        other = load_file(tmp_path / "compiled" / "model.safetensors")[name]
        torch.testing.assert_close(other, tensor, rtol=1e-4, atol=1e-5, msg=name)
    assert json.loads((tmp_path / "compiled" / "config.json").read_text())["model_type"] == "vaswani"


def test_bf16_on_the_cpu_autocasts_and_keeps_float32_weights(pairs_and_tokenizer, tmp_path):
    pairs, tokenizer = pairs_and_tokenizer
    float32_dtypes, bf16_dtypes = set(), set()
    float32 = _run(pairs, tokenizer, tmp_path / "float32", seen_dtypes=float32_dtypes)
    bf16 = _run(pairs, tokenizer, tmp_path / "bf16", bf16=True, seen_dtypes=bf16_dtypes)
    assert float32_dtypes == {torch.float32}
    assert bf16_dtypes == {torch.bfloat16}
    # bfloat16 keeps 8 bits of mantissa: the losses agree to a few parts in a thousand, not to float32's 1e-5
    assert bf16 == pytest.approx(float32, rel=2e-2)
    assert bf16 != float32
    saved = load_file(tmp_path / "bf16" / "model.safetensors")
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
