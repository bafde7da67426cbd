"""Checkpoint conversion in and out (issue 10): Marian, FSMT and fairseq to vaswani_tx, and ours back to Marian.

Every source model is built here with random weights (random biases and logits bias too, so that no option
can pass by adding zeros) and tiny sizes; its tokenizer files are built from a dozen sentences.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re

import numpy
import pytest
import torch
from transformers import (
    AutoTokenizer,
    FSMTConfig,
    FSMTForConditionalGeneration,
    MarianConfig,
    MarianMTModel,
    pipeline,
)

from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_tx.cli import main
from vaswani_tx.data.tokenization import check_tokenizer_fits_model, vocabulary_fingerprint
from vaswani_tx.interop.convert import (
    CheckpointError,
    ConversionError,
    convert,
    fairseq_to_vaswani,
    marian_to_vaswani,
)
from vaswani_tx.interop.export import vaswani_to_marian
from vaswani_tx.training.params import num_parameters_closed_form

EN = [
    "a dog runs in the park .",
    "two men play football .",
    "the woman reads a book .",
    "children eat apples .",
    "a cat sleeps on the sofa .",
    "the man rides a bike .",
    "people walk in the street .",
    "a girl sings a song .",
]
DE = [
    "ein hund läuft im park .",
    "zwei männer spielen fußball .",
    "die frau liest ein buch .",
    "kinder essen äpfel .",
    "eine katze schläft auf dem sofa .",
    "der mann fährt fahrrad .",
    "leute gehen auf der straße .",
    "ein mädchen singt ein lied .",
]
SIZES = dict(
    d_model=24,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=3,
    decoder_attention_heads=3,
    encoder_ffn_dim=40,
    decoder_ffn_dim=40,
    max_position_embeddings=64,
    dropout=0.0,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on shared cores the threads' handshakes cost
    more than the matrix products (measured: 1,000 24x40 linears, 15 s with 2 threads under load, 0.07 s with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _randomize(model: torch.nn.Module) -> None:
    """Non-zero biases everywhere (the random init leaves them at zero), so attention_bias is exercised."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("bias"):
                tensor.normal_(0.0, 0.1)


def _batch(vocab: int, first: int):
    ids = torch.randint(first, vocab, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


# --- Marian ---------------------------------------------------------------------------------------------------


def _spm(lines: list[str], folder, name: str) -> list[str]:
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=40,
        model_type="bpe",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (folder / name).write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    return [piece for piece in pieces if piece not in ("<unk>", "<s>", "</s>")]


def _marian_folder(folder, share: bool, activation: str) -> MarianMTModel:
    """A saved random MarianMTModel with MarianTokenizer files: `</s>`=0, `<unk>`=1, pieces, `<pad>` last."""
    folder.mkdir()
    vocabularies = []
    for name, lines in (("source.spm", EN + (DE if share else [])), ("target.spm", DE + (EN if share else []))):
        vocabularies.append(
            {token: i for i, token in enumerate(["</s>", "<unk>", *_spm(lines, folder, name), "<pad>"])}
        )
    if share:
        merged = dict(vocabularies[0])
        for token in vocabularies[1]:
            merged.setdefault(token, len(merged))
        merged["<pad>"] = merged.pop("<pad>")
        vocabularies = [{token: i for i, token in enumerate(merged)}] * 2
    (folder / "vocab.json").write_text(json.dumps(vocabularies[0]), encoding="utf-8")
    if not share:
        (folder / "target_vocab.json").write_text(json.dumps(vocabularies[1]), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "MarianTokenizer",
                "source_lang": "en",
                "target_lang": "de",
                "separate_vocabs": not share,
            }
        ),
        encoding="utf-8",
    )
    source_size, target_size = len(vocabularies[0]), len(vocabularies[1])
    torch.manual_seed(0)
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=source_size,
            decoder_vocab_size=target_size,
            activation_function=activation,
            pad_token_id=target_size - 1,
            eos_token_id=0,
            decoder_start_token_id=target_size - 1,
            share_encoder_decoder_embeddings=share,
            **SIZES,
        )
    ).eval()
    _randomize(marian)
    marian.generation_config.update(num_beams=2, max_length=12, bad_words_ids=[[target_size - 1]])
    marian.save_pretrained(folder)
    return marian


@pytest.fixture(scope="module", params=[(True, "relu"), (False, "swish")], ids=["shared-relu", "separate-swish"])
def marian_pair(request, tmp_path_factory):
    share, activation = request.param
    root = tmp_path_factory.mktemp("marian")
    marian = _marian_folder(root / "source", share, activation)
    convert(root / "source", root / "converted")
    return marian, root


def _assert_same_translations(source_model, folder, texts):
    """Logits to 1e-5, and identical greedy and beam outputs through generate and the pipeline."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ours = VaswaniForConditionalGeneration.from_pretrained(folder).eval()
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    labels = tokenizer(text_target=texts, return_tensors="pt", padding=True).input_ids
    decoder_input_ids = ours.prepare_decoder_input_ids_from_labels(labels)[:, :5]
    with torch.no_grad():
        expected = source_model(**batch, decoder_input_ids=decoder_input_ids, use_cache=False).logits
        got = ours(**batch, decoder_input_ids=decoder_input_ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for beams in (1, 3):
        expected_ids = source_model.generate(**batch, num_beams=beams, max_new_tokens=8)
        got_ids = ours.generate(**batch, num_beams=beams, max_new_tokens=8)
        assert got_ids.tolist() == expected_ids.tolist(), f"num_beams={beams}"
    translator = pipeline("translation", model=str(folder), trust_remote_code=True)
    for text in texts[:2]:
        expected_ids = source_model.generate(**tokenizer(text, return_tensors="pt"))
        expected_text = tokenizer.decode(expected_ids[0], skip_special_tokens=True)
        assert translator(text) == [{"translation_text": expected_text}]


def test_marian_converts_exactly(marian_pair):
    marian, root = marian_pair
    folder = root / "converted"
    config = VaswaniConfig.from_pretrained(folder)
    share = marian.config.share_encoder_decoder_embeddings
    assert config.attention_bias and config.final_logits_bias
    assert config.activation_function == ("relu" if share else "swish")
    assert (
        config.share_encoder_decoder_embeddings == share
        and config.target_vocab_size == marian.config.decoder_vocab_size
    )
    assert config.decoder_start_token_id == config.pad_token_id == marian.config.pad_token_id  # Marian starts with pad
    generation = json.loads((folder / "generation_config.json").read_text())
    assert generation["num_beams"] == 2 and generation["max_length"] == 12 and generation["bad_words_ids"]
    assert generation["length_penalty_type"] == "hf" and generation["max_output_length_offset"] is None
    assert {"model.safetensors", "modeling_vaswani.py", "pipeline_vaswani.py", "vocab.json"} <= {
        p.name for p in folder.iterdir()
    }
    assert type(AutoTokenizer.from_pretrained(folder)).__name__ == "MarianTokenizer"
    _assert_same_translations(marian, folder, EN[:3])


def test_marian_targets_are_encoded_with_the_target_vocabulary(marian_pair):
    """Labels from `tokenizer(text_target=...)` are the target SentencePiece pieces looked up in the target
    vocabulary, which with separate vocabularies is not the source one."""
    import sentencepiece as spm

    marian, root = marian_pair
    folder = root / "converted"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    check_tokenizer_fits_model(tokenizer, VaswaniConfig.from_pretrained(folder))
    share = marian.config.share_encoder_decoder_embeddings
    vocab = json.loads((folder / ("vocab.json" if share else "target_vocab.json")).read_text(encoding="utf-8"))
    pieces = spm.SentencePieceProcessor(model_file=str(folder / "target.spm"))
    for text in DE:
        expected = [vocab.get(piece, vocab["<unk>"]) for piece in pieces.encode(text, out_type=str)] + [vocab["</s>"]]
        assert tokenizer(text_target=text).input_ids == expected
    if not share:
        assert any(tokenizer(text).input_ids != tokenizer(text_target=text).input_ids for text in DE)


def test_converted_model_fine_tunes_with_the_recipe_and_saves(marian_pair, tmp_path):
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainingArguments

    from vaswani_tx.data.data import tokenize_pairs
    from vaswani_tx.training.training import VaswaniTrainer

    marian, root = marian_pair
    folder = root / "converted"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = VaswaniForConditionalGeneration.from_pretrained(folder)
    before = model.model.encoder.layers[0].self_attn.q_proj.bias.clone()
    pairs = Dataset.from_dict({"source": EN, "target": DE})
    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        learning_rate=1.0,
        warmup_steps=2,
        lr_scheduler_type="inverse_sqrt",
        label_smoothing_factor=0.1,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
    )
    trainer = VaswaniTrainer(
        model=model,
        args=args,
        train_dataset=tokenize_pairs(pairs, tokenizer),
        data_collator=DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=-100),
        processing_class=tokenizer,
        max_tokens=64,
    )
    result = trainer.train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert not torch.equal(before, model.model.encoder.layers[0].self_attn.q_proj.bias)
    trainer.save_model(str(tmp_path / "tuned"))
    reloaded = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "tuned").eval()
    ids, mask = _batch(model.config.vocab_size, 1)
    target = torch.full((3, 1), model.config.decoder_start_token_id)
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits,
            model.eval()(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits,
        )


# --- FSMT and fairseq --------------------------------------------------------------------------------------------

LETTERS = sorted(set("".join(EN + DE).replace(" ", "")))


def _fairseq_dictionary(folder, lang: str) -> list[str]:
    """fairseq's `dict.<lang>.txt` (`token count`) over single letters, `@@` marking a continued word."""
    tokens = [*(f"{c}@@" for c in LETTERS), *LETTERS, "th@@", "th"]
    (folder / f"dict.{lang}.txt").write_text(
        "".join(f"{t} {100 - i}\n" for i, t in enumerate(tokens)), encoding="utf-8"
    )
    return ["<s>", "<pad>", "</s>", "<unk>", *tokens]


def _fsmt_model(src_size: int, tgt_size: int, tie: bool) -> FSMTForConditionalGeneration:
    torch.manual_seed(0)
    fsmt = FSMTForConditionalGeneration(
        FSMTConfig(
            langs=["en", "de"],
            src_vocab_size=src_size,
            tgt_vocab_size=tgt_size,
            tie_word_embeddings=tie,
            **{**SIZES, "encoder_ffn_dim": 48},  # a wider encoder FFN, as in the WMT19 models (8192 / 4096)
        )
    ).eval()
    _randomize(fsmt)
    return fsmt


def _write_fairseq(
    fsmt: FSMTForConditionalGeneration, path, *, layout: str = "args", legacy: bool = False, **settings
):
    """A fairseq checkpoint from FSMT's weights: transformers' documented fairseq-to-FSMT key mapping run
    backwards (drop the `model.` prefix; add the `version` and `_float_tensor` entries FSMT drops)."""
    c = fsmt.config
    model = {}
    for key, value in fsmt.state_dict().items():
        if "embed_positions" in key:
            continue
        model[key.removeprefix("model.")] = value.clone()
    if legacy:  # fairseq < 0.7: one in_proj for q, k, v and encoder layer_norms.0/1
        for key in [k for k in model if k.endswith("q_proj.weight") or k.endswith("q_proj.bias")]:
            kind = key.rsplit(".", 1)[1]
            base = key.rsplit(".", 2)[0]
            model[f"{base}.in_proj_{kind}"] = torch.cat(
                [model.pop(f"{base}.{p}.{kind}") for p in ("q_proj", "k_proj", "v_proj")]
            )
        for key in list(model):
            renamed = re.sub(r"^(encoder\.layers\.\d+)\.self_attn_layer_norm", r"\1.layer_norms.0", key)
            renamed = re.sub(r"^(encoder\.layers\.\d+)\.final_layer_norm", r"\1.layer_norms.1", renamed)
            model[renamed] = model.pop(key)
        model["decoder.embed_out"] = model.pop("decoder.output_projection.weight")
    for stack in ("encoder", "decoder"):
        model[f"{stack}.version"] = torch.tensor([3.0])
        model[f"{stack}.embed_positions._float_tensor"] = torch.tensor([1.0])
    values = dict(
        arch="transformer_wmt_en_de",
        source_lang="en",
        target_lang="de",
        encoder_embed_dim=c.d_model,
        decoder_embed_dim=c.d_model,
        encoder_ffn_embed_dim=c.encoder_ffn_dim,
        decoder_ffn_embed_dim=c.decoder_ffn_dim,
        encoder_layers=c.encoder_layers,
        decoder_layers=c.decoder_layers,
        encoder_attention_heads=c.encoder_attention_heads,
        decoder_attention_heads=c.decoder_attention_heads,
        encoder_normalize_before=False,
        decoder_normalize_before=False,
        encoder_learned_pos=False,
        decoder_learned_pos=False,
        share_all_embeddings=c.tie_word_embeddings,
        share_decoder_input_output_embed=c.tie_word_embeddings,
        no_scale_embedding=False,
        activation_fn="relu",
        dropout=0.1,
        attention_dropout=0.0,
        max_source_positions=1024,
        max_target_positions=1024,
    )
    values.update(settings)
    checkpoint = {
        "model": model,
        "optimizer_history": [
            {
                "criterion_name": "LabelSmoothedCrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "num_updates": 300000,
            }
        ],
        "extra_state": {"epoch": 40, "val_loss": numpy.float64(3.9)},
        "last_optimizer_state": None,
    }
    if layout == "args":
        checkpoint["args"] = argparse.Namespace(**values)
    else:  # fairseq >= 0.10: a plain-dict cfg with model and task sections
        task = {
            "_name": "translation",
            "source_lang": values.pop("source_lang"),
            "target_lang": values.pop("target_lang"),
        }
        checkpoint["cfg"] = {"model": {"_name": values.pop("arch"), **values}, "task": task, "common": {"seed": 1}}
    torch.save(checkpoint, path)


@pytest.fixture(scope="module")
def fairseq_folder(tmp_path_factory):
    """fairseq files beside a separate-vocabulary FSMT model whose weights the checkpoint holds."""
    folder = tmp_path_factory.mktemp("fairseq")
    size = len(_fairseq_dictionary(folder, "en"))
    _fairseq_dictionary(folder, "de")
    (folder / "bpecodes").write_text("#version: 0.2\nt h 500\n", encoding="utf-8")
    fsmt = _fsmt_model(size, size, tie=False)
    _write_fairseq(fsmt, folder / "checkpoint_best.pt")
    return folder, fsmt


def test_fsmt_converts_exactly(fairseq_folder, tmp_path):
    source, fsmt = fairseq_folder
    # The FSMT folder's tokenizer is the one transformers' FSMT port writes: fairseq's dictionaries with `</w>` ends.
    from vaswani_tx.interop.convert import _fairseq_tokenizer

    (tmp_path / "fsmt").mkdir()
    _fairseq_tokenizer(source / "checkpoint_best.pt", {"source_lang": "en", "target_lang": "de"}, tmp_path / "fsmt")
    tokenizer_config = json.loads((tmp_path / "fsmt" / "tokenizer_config.json").read_text())
    del tokenizer_config["moses_normalize"]
    tokenizer_config["tokenizer_class"] = "FSMTTokenizer"
    (tmp_path / "fsmt" / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    assert AutoTokenizer.from_pretrained(tmp_path / "fsmt").eos_token_id is None  # FSMT's own has no eos token
    fsmt.generation_config.update(num_beams=2, max_length=12)
    fsmt.save_pretrained(tmp_path / "fsmt")
    convert(tmp_path / "fsmt", tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert type(tokenizer).__name__ == "FairseqTokenizer" and tokenizer.moses_normalize  # FSMT's pre-processing
    check_tokenizer_fits_model(tokenizer, VaswaniConfig.from_pretrained(tmp_path / "out"))
    config = VaswaniConfig.from_pretrained(tmp_path / "out")
    assert config.position_encoding == "fairseq_sinusoidal" and config.attention_bias
    assert not config.share_encoder_decoder_embeddings and not config.tie_word_embeddings
    assert (config.d_ff, config.decoder_d_ff) == (48, 40)
    assert (config.pad_token_id, config.eos_token_id, config.decoder_start_token_id) == (1, 2, 2)
    _assert_same_translations(fsmt, tmp_path / "out", EN[:3])


@pytest.mark.parametrize(
    "layout,legacy",
    [("args", False), ("cfg", False), ("args", True)],
    ids=["args-namespace", "cfg-dict", "fairseq-0.6-in_proj"],
)
def test_fairseq_checkpoint_gives_the_fsmt_logits(fairseq_folder, tmp_path, layout, legacy):
    source, fsmt = fairseq_folder
    for name in ("dict.en.txt", "dict.de.txt", "bpecodes"):
        (tmp_path / name).write_bytes((source / name).read_bytes())
    _write_fairseq(fsmt, tmp_path / "model.pt", layout=layout, legacy=legacy)
    model, settings = fairseq_to_vaswani(tmp_path / "model.pt")
    assert settings["arch"] == "transformer_wmt_en_de"
    ids, mask = _batch(fsmt.config.src_vocab_size, 4)
    target = torch.randint(4, fsmt.config.tgt_vocab_size, (3, 6))
    target[:, 0] = 2
    with torch.no_grad():
        expected = fsmt(input_ids=ids, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits
        got = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    if layout == "args" and not legacy:  # the command on the folder: a complete model folder with FSMT's tokenizer
        assert main(["convert", str(tmp_path), str(tmp_path / "out")]) == 0
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
        assert type(tokenizer).__name__ == "FairseqTokenizer" and tokenizer.eos_token_id == 2
        assert tokenizer.convert_ids_to_tokens(tokenizer("the")["input_ids"]) == ["th", "e</w>", "</s>"]
        generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
        assert (generation["num_beams"], generation["early_stopping"]) == (5, True)
        assert (generation["max_len_a"], generation["max_len_b"], generation["length_penalty"]) == (0.0, 200, 1.0)


def test_shared_fairseq_vocabulary_ties_all_three_tables(tmp_path):
    size = len(_fairseq_dictionary(tmp_path, "en"))
    _fairseq_dictionary(tmp_path, "de")
    fsmt = _fsmt_model(size, size, tie=True)
    _write_fairseq(fsmt, tmp_path / "model.pt")
    model, _ = fairseq_to_vaswani(tmp_path / "model.pt")
    assert model.config.share_encoder_decoder_embeddings and model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.shared.weight.data_ptr()
    ids, mask = _batch(size, 4)
    target = torch.randint(4, size, (3, 4))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits,
            fsmt(input_ids=ids, attention_mask=mask, decoder_input_ids=target, use_cache=False).logits,
            rtol=0,
            atol=1e-5,
        )


# --- Ours -> Marian -> ours ------------------------------------------------------------------------------------


def test_round_trip_through_marian(tmp_path, caplog, capsys):
    from vaswani_tx.data.tokenization import train_tokenizer

    corpus = tmp_path / "text.txt"
    corpus.write_text("\n".join(EN + DE) + "\n", encoding="utf-8")
    tokenizer = train_tokenizer([corpus], vocab_size=300, show_progress=False)
    torch.manual_seed(0)
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=len(tokenizer),
            d_model=24,
            num_heads=3,
            d_ff=40,
            num_encoder_layers=2,
            num_decoder_layers=2,
        )
    ).eval()
    model.generation_config.update(num_beams=3, length_penalty=2.5)  # a run config's, GNMT form, source + 50
    model.save_pretrained(tmp_path / "ours")
    tokenizer.save_pretrained(tmp_path / "ours")
    with caplog.at_level("WARNING", logger="vaswani_tx.interop.export"):
        assert main(["export-marian", str(tmp_path / "ours"), str(tmp_path / "marian")]) == 0
    # MarianMT applies |Y|^alpha: the export says so, and records our form for the way back
    assert any("|Y|^2.5, not the GNMT" in record.getMessage() for record in caplog.records)
    exported = json.loads((tmp_path / "marian" / "generation_config.json").read_text())
    assert (exported["length_penalty"], exported["length_penalty_type"], exported["max_output_length_offset"]) == (
        2.5,
        "gnmt",
        50,
    )

    marian = MarianMTModel.from_pretrained(tmp_path / "marian").eval()
    assert marian.lm_head.weight.data_ptr() == marian.model.shared.weight.data_ptr()
    ids, mask = _batch(len(tokenizer), 4)
    target = torch.randint(4, len(tokenizer), (3, 7))
    with torch.no_grad():
        ours_logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits
        torch.testing.assert_close(
            marian(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits, ours_logits, rtol=0, atol=1e-5
        )
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "marian"), str(tmp_path / "back")]) == 0
    assert "length penalty alpha 2.5 in the GNMT form ((5 + |Y|) / 6)^alpha; at most source length + 50" in (
        capsys.readouterr().out
    )
    back = VaswaniForConditionalGeneration.from_pretrained(tmp_path / "back").eval()
    # GNMT stays GNMT both ways: the model converted back decodes as the one exported
    for field in ("num_beams", "length_penalty", "length_penalty_type", "max_output_length_offset"):
        assert getattr(back.generation_config, field) == getattr(model.generation_config, field), field
    with torch.no_grad():
        assert torch.equal(
            back.generate(input_ids=ids, attention_mask=mask, max_output_length_offset=6),
            model.generate(input_ids=ids, attention_mask=mask, max_output_length_offset=6),
        )
    # conversion records the tokenizer's fingerprint; every other field comes back as it was
    unrecorded = {"custom_pipelines": None, "tokenizer_fingerprint": None}
    assert back.config.to_diff_dict() | unrecorded == model.config.to_diff_dict() | unrecorded
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids, attention_mask=mask, decoder_input_ids=target).logits, ours_logits)
    back_tokenizer = AutoTokenizer.from_pretrained(tmp_path / "back")
    assert back_tokenizer("a dog").input_ids == tokenizer("a dog").input_ids
    assert back.config.tokenizer_fingerprint == vocabulary_fingerprint(back_tokenizer)


def test_options_marian_cannot_hold_are_refused():
    model = VaswaniForConditionalGeneration(
        VaswaniConfig(
            vocab_size=30, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1, d_k=4
        )
    )
    with pytest.raises(ConversionError, match=r"d_k=4 with num_heads=2"):
        vaswani_to_marian(model)
    model.config.position_encoding = "learned"
    with pytest.raises(ConversionError, match="position_encoding='learned'"):
        vaswani_to_marian(model)


# --- Bad input ------------------------------------------------------------------------------------------------


def test_folder_of_another_model_type_is_refused(tmp_path, capsys):
    (tmp_path / "bart").mkdir()
    (tmp_path / "bart" / "config.json").write_text(json.dumps({"model_type": "bart"}), encoding="utf-8")
    with pytest.raises(ConversionError, match="model_type='bart'"):
        convert(tmp_path / "bart", tmp_path / "out")
    assert main(["convert", str(tmp_path / "bart"), str(tmp_path / "out")]) == 2
    assert "error:" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_unrepresentable_marian_config_is_refused_before_writing(tmp_path):
    marian = MarianMTModel(
        MarianConfig(
            vocab_size=20,
            pad_token_id=19,
            decoder_start_token_id=19,
            eos_token_id=0,
            **{**SIZES, "decoder_attention_heads": 2},
        )
    )
    with pytest.raises(ConversionError, match="encoder_attention_heads=3 differs from decoder_attention_heads=2"):
        marian_to_vaswani(marian)
    marian.config.activation_function = "gelu"
    marian.config.decoder_attention_heads = 3
    with pytest.raises(ConversionError, match="activation_function='gelu'"):
        marian_to_vaswani(marian)


@pytest.fixture
def small_fairseq(tmp_path):
    size = len(_fairseq_dictionary(tmp_path, "en"))
    _fairseq_dictionary(tmp_path, "de")
    return tmp_path, _fsmt_model(size, size, tie=True)


def test_fairseq_architectures_are_decided_by_their_settings_not_their_names(small_fairseq):
    folder, fsmt = small_fairseq
    for arch in ("transformer_iwslt_de_en", "transformer_wmt_en_de_big", "my_own_post_ln_transformer"):
        _write_fairseq(fsmt, folder / "model.pt", arch=arch)
        model, settings = fairseq_to_vaswani(folder / "model.pt")
        assert settings["arch"] == arch and model.config.num_heads == 3  # the recorded heads, not the preset's
    _write_fairseq(fsmt, folder / "model.pt", arch="my_own", encoder_attention_heads=None)
    with pytest.raises(CheckpointError, match="architecture 'my_own' records no encoder_attention_heads"):
        fairseq_to_vaswani(folder / "model.pt")
    _write_fairseq(fsmt, folder / "model.pt", arch="bart_base", layernorm_embedding=True)
    with pytest.raises(ConversionError, match=r"\(bart_base\): layernorm_embedding=True cannot be represented"):
        fairseq_to_vaswani(folder / "model.pt")


def test_unrepresentable_fairseq_flags_are_named(small_fairseq):
    folder, fsmt = small_fairseq
    _write_fairseq(fsmt, folder / "model.pt", encoder_normalize_before=True)
    with pytest.raises(ConversionError, match="encoder_normalize_before=True cannot be represented: a pre-LN encoder"):
        fairseq_to_vaswani(folder / "model.pt")
    _write_fairseq(fsmt, folder / "model.pt", layernorm_embedding=True)
    with pytest.raises(ConversionError, match="layernorm_embedding=True"):
        convert(folder, folder / "out")
    assert not (folder / "out").exists()


def test_languages_fairseq_did_not_record_come_from_the_dictionary_sizes(tmp_path):
    """fairseq-train without --source-lang/--target-lang infers them from its data folder and records None."""
    source_size = len(_fairseq_dictionary(tmp_path, "en"))
    (tmp_path / "dict.de.txt").write_text(
        (tmp_path / "dict.en.txt").read_text(encoding="utf-8") + "extra 1\n", encoding="utf-8"
    )
    _write_fairseq(_fsmt_model(source_size, source_size + 1, tie=False), tmp_path / "model.pt", layout="cfg")
    checkpoint = torch.load(tmp_path / "model.pt", weights_only=False)
    checkpoint["cfg"]["task"].update(source_lang=None, target_lang=None)
    torch.save(checkpoint, tmp_path / "model.pt")
    _, settings = fairseq_to_vaswani(tmp_path / "model.pt")
    assert (settings["source_lang"], settings["target_lang"]) == ("en", "de")
    (tmp_path / "dict.de.txt").write_text((tmp_path / "dict.en.txt").read_text(encoding="utf-8"), encoding="utf-8")
    _write_fairseq(
        _fsmt_model(source_size, source_size, tie=True), tmp_path / "model.pt", source_lang=None, target_lang=None
    )
    with pytest.raises(ConversionError, match=r"not recorded .* \(dict\.de\.txt, dict\.en\.txt\)"):
        fairseq_to_vaswani(tmp_path / "model.pt")


def test_truncated_checkpoint_is_refused_naming_the_file(small_fairseq):
    folder, fsmt = small_fairseq
    _write_fairseq(fsmt, folder / "model.pt")
    data = (folder / "model.pt").read_bytes()
    (folder / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.pt: not a readable torch checkpoint, truncated or corrupt"):
        fairseq_to_vaswani(folder / "model.pt")
    (folder / "model.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        fairseq_to_vaswani(folder / "model.pt")


def test_dictionary_of_another_size_is_refused(small_fairseq):
    folder, fsmt = small_fairseq
    _write_fairseq(fsmt, folder / "model.pt")
    lines = (folder / "dict.de.txt").read_text(encoding="utf-8").splitlines()
    (folder / "dict.de.txt").write_text("\n".join(lines[:-1]) + "\n", encoding="utf-8")
    with pytest.raises(
        ConversionError, match=r"dict\.de\.txt: \d+ tokens .* but decoder\.embed_tokens\.weight has \d+ rows"
    ):
        fairseq_to_vaswani(folder / "model.pt")


class _Exploit:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_pickle_importing_outside_the_allow_list_is_refused_and_nothing_runs(small_fairseq):
    folder, fsmt = small_fairseq
    marker = folder / "pwned"
    torch.save(
        {"model": {"encoder.embed_tokens.weight": torch.zeros(2, 2)}, "args": _Exploit(marker)}, folder / "model.pt"
    )
    with pytest.raises(CheckpointError, match=r"refused to unpickle.*system"):
        fairseq_to_vaswani(folder / "model.pt")
    assert not marker.exists()
    assert main(["convert", str(folder / "model.pt"), str(folder / "out")]) == 2
    assert not marker.exists() and not (folder / "out").exists()


# --- The options themselves ------------------------------------------------------------------------------------


def test_options_are_off_by_default_and_the_default_model_is_the_papers():
    config = VaswaniConfig(vocab_size=30, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=1, num_decoder_layers=1)
    assert (
        config.attention_bias,
        config.activation_function,
        config.final_logits_bias,
        config.share_encoder_decoder_embeddings,
        config.decoder_vocab_size,
    ) == (False, "relu", False, True, None)
    model = VaswaniForConditionalGeneration(config)
    assert all(
        not name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias", "out_proj.bias"))
        for name, _ in model.named_parameters()
    )
    assert not hasattr(model, "final_logits_bias") and config.target_vocab_size == 30


def test_options_count_and_validate():
    config = VaswaniConfig(
        vocab_size=30,
        decoder_vocab_size=20,
        share_encoder_decoder_embeddings=False,
        tie_word_embeddings=False,
        attention_bias=True,
        d_model=16,
        num_heads=2,
        d_ff=32,
        decoder_d_ff=24,
        num_encoder_layers=1,
        num_decoder_layers=2,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=0,
        decoder_start_token_id=2,
    )
    model = VaswaniForConditionalGeneration(config)
    assert sum(p.numel() for p in model.parameters()) == num_parameters_closed_form(config)
    assert model.lm_head.weight.shape == (20, 16) and model.model.decoder.embeddings.embed_tokens.weight.shape == (
        20,
        16,
    )
    with pytest.raises(ValueError, match="activation_function='gelu' is not allowed"):
        VaswaniConfig(activation_function="gelu")
    with pytest.raises(ValueError, match="decoder_vocab_size=20 differs from vocab_size=30"):
        VaswaniConfig(vocab_size=30, decoder_vocab_size=20)
    with pytest.raises(ValueError, match="decoder_vocab_size=None is not allowed"):
        VaswaniConfig(share_encoder_decoder_embeddings=False)
    with pytest.raises(ValueError, match=r"eos_token_id=25 .* \[0, decoder_vocab_size=20\)"):
        VaswaniConfig(vocab_size=30, decoder_vocab_size=20, share_encoder_decoder_embeddings=False, eos_token_id=25)


def test_fairseq_sinusoids_are_fsmts_permuted_and_start_after_padding():
    from transformers.models.fsmt.modeling_fsmt import SinusoidalPositionalEmbedding

    from vaswani_tx.interop.convert import marian_hidden_permutation
    from vaswani_tx.model.modeling_vaswani import SinusoidalPositionalEncoding, fairseq_sinusoidal_table

    theirs = SinusoidalPositionalEmbedding.get_embedding(40, 24, padding_idx=None)
    ours = fairseq_sinusoidal_table(40, 24)
    assert torch.equal(ours[:, marian_hidden_permutation(24)], theirs)
    encoding = SinusoidalPositionalEncoding(24, fairseq_sinusoidal_table, first_position=2)
    assert torch.equal(encoding(3, 1, like=ours), ours[3:6])


def test_model_card_lists_the_options_and_what_needs_them(marian_pair):
    from vaswani_tx.interop.publishing import render_model_card

    _, root = marian_pair
    model = VaswaniForConditionalGeneration.from_pretrained(root / "converted")
    card = render_model_card(
        model,
        repo="me/opus-mt-en-de-vaswani",
        source_lang="en",
        target_lang="de",
        training_data="OPUS (converted from MarianMT)",
    )
    assert "| `attention_bias` | `False` | `True` | Marian (OPUS-MT), FSMT and fairseq" in card
    assert "`final_logits_bias=True`: a fixed bias is added to the logits." in card


def test_translate_command_reads_a_converted_marian_folder(marian_pair, tmp_path, capsys):
    """The converted folder is a normal model folder for `vaswani-tx translate` (its own tokenizer and
    generation config: Marian's beams and max_length)."""
    from vaswani_tx.cli import main as cli_main

    marian, root = marian_pair
    tokenizer = AutoTokenizer.from_pretrained(root / "converted")
    expected = []
    for text in EN[:3]:
        ids = marian.generate(**tokenizer(text, return_tensors="pt"))
        expected.append(tokenizer.decode(ids[0], skip_special_tokens=True).strip())
    source = tmp_path / "in.en"
    source.write_text("\n".join([EN[0], "", EN[1], EN[2]]) + "\n", encoding="utf-8")
    assert cli_main(["translate", str(root / "converted"), "-i", str(source), "--device", "cpu", "--quiet"]) == 0
    assert capsys.readouterr().out == "\n".join([expected[0], "", expected[1], expected[2]]) + "\n"
