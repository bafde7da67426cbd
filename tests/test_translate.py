"""`vaswani-tx translate` / `evaluate` and `vaswani_tx.engine.translation`: batching, order, empty lines, bad input."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vaswani_tx import VaswaniConfig, VaswaniForConditionalGeneration
from vaswani_tx.cli import main as cli_main
from vaswani_tx.engine.translation import load_translator, one_line, plan_batches, translate

REPO = Path(__file__).resolve().parents[1]
LINES = [
    "Ein Hund läuft über die Wiese.",
    "",
    "Zwei Männer spielen Fußball in einem Park neben einem Fluss.",
    "   ",
    "Eine Frau liest.",
    "Ein Kind\u2028mit einem Ball.",  # U+2028 inside a line: still one line
    "Ein Mann.",
]


@pytest.fixture(scope="module")
def translator(tiny_translator):
    folder, _, _ = tiny_translator
    return load_translator(folder)


def greedy(translator, lines, **kwargs):
    # a random model never says </s>: a short cap (source + 4 tokens) keeps these tests fast
    return translator.translate(lines, num_beams=1, max_output_length_offset=4, **kwargs)


def test_plan_batches_covers_every_line_once_within_the_budget():
    lengths = [5, 1, 9, 9, 3, 30, 2, 7, 7, 4]
    for max_tokens, max_sentences in [(10, None), (20, 2), (1, None), (1000, 3), (1000, None)]:
        batches = plan_batches(lengths, max_tokens, max_sentences)
        assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
        for batch in batches:
            padded = max(lengths[i] for i in batch) * len(batch)
            assert padded <= max_tokens or len(batch) == 1  # an over-long line gets a batch of its own
            assert max_sentences is None or len(batch) <= max_sentences
        longest = [max(lengths[i] for i in batch) for batch in batches]
        assert longest == sorted(longest, reverse=True)  # longest first: out-of-memory shows at once
    with pytest.raises(ValueError, match="max_tokens"):
        plan_batches(lengths, 0)


def test_outputs_keep_input_order_and_line_count_whatever_the_batching(translator):
    one_by_one = greedy(translator, LINES, max_tokens=1)
    assert len(one_by_one) == len(LINES)
    assert one_by_one[1] == "" and one_by_one[3] == ""
    assert all(text for i, text in enumerate(one_by_one) if LINES[i].strip())
    assert greedy(translator, LINES) == one_by_one
    assert greedy(translator, LINES, max_tokens=40, batch_size=2) == one_by_one
    assert greedy(translator, LINES[::-1]) == one_by_one[::-1]


def test_translations_equal_generate_with_the_models_defaults(tiny_translator, translator):
    _, model, tokenizer = tiny_translator
    sentences = [line for line in LINES if line.strip()][:2]
    expected = []
    for sentence in sentences:  # beam 4, alpha 0.6 GNMT: the saved generation config (a short cap for speed)
        output = model.generate(**tokenizer([sentence], return_tensors="pt"), max_output_length_offset=4)
        expected.append(tokenizer.decode(output[0], skip_special_tokens=True).strip())
    assert translator.translate(sentences, max_output_length_offset=4) == expected
    assert translate(tiny_translator[0], sentences, max_output_length_offset=4) == expected


def test_one_line_never_lets_a_hypothesis_break_the_line_count():
    assert one_line(" a\nb\r\nc\u2028d\u0085e ") == "a b  c d e"


def test_bfloat16_decoding_loads_in_that_dtype(tiny_translator):
    bf16 = load_translator(tiny_translator[0], device="cpu", dtype="bfloat16")
    assert bf16.model.dtype == torch.bfloat16
    outputs = greedy(bf16, LINES)
    assert len(outputs) == len(LINES) and outputs[1] == ""
    with pytest.raises(ValueError, match="dtype 'float8'"):
        load_translator(tiny_translator[0], dtype="float8")


def test_translate_command_file_to_file_and_stdin_to_stdout(
    tiny_translator, translator, tmp_path, capsys, monkeypatch
):
    folder = str(tiny_translator[0])
    source = tmp_path / "in.de"
    source.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    expected = greedy(translator, LINES)
    assert (
        cli_main(
            [
                "translate",
                folder,
                "-i",
                str(source),
                "-o",
                str(tmp_path / "out.en"),
                "--num-beams",
                "1",
                "--max-length-offset",
                "4",
                "--max-tokens",
                "16",
                "--quiet",
            ]
        )
        == 0
    )
    assert (tmp_path / "out.en").read_text(encoding="utf-8") == "".join(line + "\n" for line in expected)

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(source.read_bytes()), encoding="utf-8"))
    capsys.readouterr()
    assert (
        cli_main(["translate", folder, "--num-beams", "1", "--max-length-offset", "4", "--batch-size", "3", "--quiet"])
        == 0
    )
    assert capsys.readouterr().out.split("\n")[:-1] == expected


CLEAN = ["A dog runs in the park.", "Two men are playing football."]
# a UTF-8 BOM at the start of a file, zero-width spaces and word joiners, a U+FEFF inside a line (issue 28)
DIRTY = ["\ufeffA dog runs in the park.", "Two\u200b men are\u2060 playing\ufeff football."]


def _older_tokenizer_folder(folder: Path, out: Path) -> Path:
    """A copy of a model folder whose tokenizer.json has no format-character step, as folders trained before it."""
    shutil.copytree(folder, out)
    spec = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    steps = spec["normalizer"]["normalizers"]
    spec["normalizer"]["normalizers"] = [step for step in steps if step.get("content") != ""]
    (out / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    return out


def test_a_bom_and_zero_width_characters_do_not_change_the_translation(tiny_translator, translator, tmp_path, capsys):
    from transformers import AutoTokenizer

    from vaswani_tx.engine.translation import Translator

    expected = greedy(translator, CLEAN)
    assert greedy(translator, DIRTY) == expected
    # a tokenizer saved before its normalizer dropped them, used as it is: Translator drops them from the text
    older = _older_tokenizer_folder(tiny_translator[0], tmp_path / "older")
    as_saved = AutoTokenizer.from_pretrained(older)
    assert as_saved(DIRTY[0])["input_ids"] != as_saved(CLEAN[0])["input_ids"]
    assert greedy(Translator(translator.model, as_saved), DIRTY) == expected
    # the command, from a file written with a BOM (as Windows editors do)
    source = tmp_path / "in.en"
    source.write_bytes(b"\xef\xbb\xbf" + "".join(line.lstrip("\ufeff") + "\n" for line in DIRTY).encode())
    argv = ["translate", str(older), "-i", str(source), "-o", str(tmp_path / "out.de"), "--num-beams", "1"]
    assert cli_main([*argv, "--max-length-offset", "4", "--quiet"]) == 0
    assert (tmp_path / "out.de").read_text(encoding="utf-8") == "".join(line + "\n" for line in expected)
    # a line of nothing but format characters is an empty line: an empty translation
    assert greedy(translator, ["\ufeff\u200b", CLEAN[0]]) == ["", expected[0]]


@pytest.fixture(scope="module")
def short_folder(tiny_translator, tmp_path_factory):
    """The tiny model made for 32 positions (max_position_embeddings=32), sinusoidal as the paper's."""
    _, model, tokenizer = tiny_translator
    short = VaswaniForConditionalGeneration(VaswaniConfig(**{**model.config.to_dict(), "max_position_embeddings": 32}))
    short.load_state_dict(model.state_dict())
    folder = tmp_path_factory.mktemp("short")
    short.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_line_longer_than_the_models_positions_is_refused_naming_it_or_cut(short_folder, tmp_path, capsys, caplog):
    long_line = " ".join(["Hund"] * 100)
    source = tmp_path / "in.de"
    source.write_text(f"Ein Hund.\n{long_line}\nEin Mann.\n", encoding="utf-8")
    fast = ["--num-beams", "1", "--max-length-offset", "2", "--quiet", "--device", "cpu"]
    for command in (
        ["translate", str(short_folder), "-i", str(source), "-o", str(tmp_path / "out.en")],
        ["evaluate", str(short_folder), "-s", str(source), "-r", str(source), "-o", str(tmp_path / "eval")],
        [
            "parse",
            "predict",
            str(short_folder),
            "--sentences",
            str(source),
            "--unconstrained",
            "-o",
            str(tmp_path / "t"),
        ],
    ):
        assert cli_main([*command, *fast[: 2 if command[0] == "parse" else None]]) == 2, command
        error = capsys.readouterr().err
        assert re.search(
            r"error: line 2 is \d{3} tokens long, more than this model's 32 positions .*--truncate", error
        )
    assert not (tmp_path / "out.en").exists() and not (tmp_path / "t").exists()
    with caplog.at_level("WARNING", logger="vaswani_tx.engine.translation"):
        assert cli_main(["translate", str(short_folder), "-i", str(source), *fast, "--truncate"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 3
    warnings = [r.getMessage() for r in caplog.records if r.name == "vaswani_tx.engine.translation"]
    assert len(warnings) == 1 and re.match(r"line 2 is \d{3} tokens long, .* cut to its first 32 tokens", warnings[0])


def test_attention_refuses_or_cuts_a_sentence_longer_than_the_positions(short_folder, tmp_path, capsys):
    sentence = " ".join(["Hund"] * 100)
    command = [
        "attention",
        str(short_folder),
        "--sentence",
        sentence,
        "-o",
        str(tmp_path / "maps"),
        "--kinds",
        "cross",
    ]
    assert cli_main(command) == 2
    assert re.search(r"error: --sentence is \d{3} tokens long", capsys.readouterr().err)
    assert not (tmp_path / "maps").exists()
    assert cli_main([*command, "--truncate"]) == 0
    assert "cut to its first 32 tokens (--truncate)" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "maps").iterdir()) == ["cross-layer1.png", "cross-layer2.png"]


def test_no_output_runs_past_the_positions_whatever_its_limit(short_folder):
    """A random model never says </s>: greedy and beam search stop at the 32 positions, not at a limit of 10^9
    tokens (whose (batch, length) buffer alone would not fit in memory)."""
    from vaswani_tx.engine import Translator

    model = VaswaniForConditionalGeneration.from_pretrained(short_folder).eval()
    engine = Translator(model)
    source = [[52, 118, 9, 3]]
    for beams in (1, 3):
        [result] = engine.translate_batch(source, beam_size=beams, max_decoding_length=10**9)
        assert 0 < len(result.hypotheses[0]) <= 32, beams
        ids = torch.tensor(source)
        output = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), num_beams=beams, max_new_tokens=10**9
        )
        assert output.shape[1] <= 33, beams  # the start token and at most 32 more


def test_beam_and_alpha_reach_generate(tiny_translator, translator, capsys):
    _, model, tokenizer = tiny_translator
    sentence = LINES[2]
    output = model.generate(**tokenizer([sentence], return_tensors="pt"), num_beams=3, length_penalty=1.5)
    assert (
        cli_main(
            ["translate", str(tiny_translator[0]), sentence, "--num-beams", "3", "--length-penalty", "1.5", "--quiet"]
        )
        == 0
    )
    assert capsys.readouterr().out == tokenizer.decode(output[0], skip_special_tokens=True).strip() + "\n"


def test_translate_in_a_fresh_process_pipes_stdin_to_stdout(tiny_translator, translator):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    source = "".join(line + "\n" for line in LINES).encode()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vaswani_tx.cli",
            "translate",
            str(tiny_translator[0]),
            "--num-beams",
            "1",
            "--max-length-offset",
            "4",
            "--device",
            "cpu",
        ],
        input=source,
        capture_output=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert done.stdout.decode().split("\n")[:-1] == greedy(translator, LINES)
    assert "Translating" in done.stderr.decode()  # the progress bar goes to stderr, not into the output


def test_non_utf8_input_is_refused_naming_the_line(tiny_translator, tmp_path, capsys):
    source = tmp_path / "latin1.de"
    source.write_bytes("Ein Hund.\nEine Stra\u00dfe.\n".encode("latin-1"))
    assert cli_main(["translate", str(tiny_translator[0]), "-i", str(source), "--quiet"]) == 2
    assert "latin1.de, line 2: not valid UTF-8 (byte 0xdf" in capsys.readouterr().err


def test_folders_that_are_not_a_usable_model_are_refused_clearly(tiny_translator, tmp_path, capsys):
    folder = tiny_translator[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="not a model folder: it has no config.json"):
        load_translator(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_translator(tmp_path / "missing")
    marian = tmp_path / "marian"
    marian.mkdir()
    (marian / "config.json").write_text(json.dumps({"model_type": "marian"}))
    with pytest.raises(ValueError, match="type 'marian', not a vaswani_tx model"):
        load_translator(marian)
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(folder / "config.json", no_weights)
    with pytest.raises(ValueError, match="no weights"):
        load_translator(no_weights)
    truncated = tmp_path / "truncated"
    shutil.copytree(folder, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="safetensors"):
        load_translator(truncated)
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(folder, no_tokenizer, ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*"))
    with pytest.raises(ValueError, match="no tokenizer"):
        load_translator(no_tokenizer)
    assert cli_main(["translate", str(empty), "Ein Hund."]) == 2
    assert "translate: error:" in capsys.readouterr().err


def test_a_tokenizer_that_does_not_fit_the_model_is_refused(tiny_translator, tmp_path):
    _, _, tokenizer = tiny_translator
    for name, overrides, message in [
        (
            "small",
            {"vocab_size": len(tokenizer) - 100},
            f"vocab_size: config has {len(tokenizer) - 100}, tokenizer has {len(tokenizer)}",
        ),
        ("eos", {"vocab_size": len(tokenizer), "eos_token_id": 4}, "eos_token_id: config has 4, tokenizer has 3"),
        ("large", {"vocab_size": len(tokenizer) + 100}, "100 embedding rows no token reaches"),
    ]:
        folder = tmp_path / name
        VaswaniForConditionalGeneration(
            VaswaniConfig(d_model=16, num_heads=2, d_ff=24, num_encoder_layers=1, num_decoder_layers=1, **overrides)
        ).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        with pytest.raises(ValueError, match=message):
            load_translator(folder)


@pytest.fixture(scope="module")
def test_set(tiny_translator, tmp_path_factory, shared_data):
    """The first 12 lines of Multi30k val, with the model's folder."""
    folder = tmp_path_factory.mktemp("test-set")
    for lang in ("en", "de"):
        lines = (shared_data / "multi30k-en-de" / f"val.{lang}").read_text(encoding="utf-8").splitlines()[:12]
        (folder / f"val.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return folder


def test_evaluate_translates_scores_and_saves(tiny_translator, translator, test_set, tmp_path, capsys):
    from vaswani_tx.metrics.evaluation import read_lines, score

    out = tmp_path / "eval"
    assert (
        cli_main(
            [
                "evaluate",
                str(tiny_translator[0]),
                "-s",
                str(test_set / "val.en"),
                "-r",
                str(test_set / "val.de"),
                "--num-beams",
                "1",
                "--max-length-offset",
                "4",
                "--output-dir",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    hypotheses = read_lines(out / "val.hyp.de")
    assert hypotheses == greedy(translator, read_lines(test_set / "val.en"))
    expected = score(hypotheses, read_lines(test_set / "val.de"), "de")
    saved = json.loads((out / "val.scores.json").read_text())
    assert saved["sacrebleu"] == pytest.approx(expected["sacrebleu"])
    assert saved["sacrebleu_signature"] == expected["sacrebleu_signature"]
    assert saved["num_beams"] == 1 and saved["target_lang"] == "de" and saved["sentences"] == 12
    assert f"{expected['sacrebleu']:6.2f}  nrefs:1|case:mixed|eff:no|tok:13a" in printed
    assert "tokenized BLEU" in printed and "chrF" in printed
    assert f"lowercased   {expected['sacrebleu_lowercase']:6.2f}  nrefs:1|case:lc|eff:no|tok:13a" in printed
    assert saved["sacrebleu_lowercase"] == pytest.approx(expected["sacrebleu_lowercase"])


def test_evaluate_refuses_misaligned_or_unlabelled_test_sets(tiny_translator, test_set, tmp_path, capsys):
    short = tmp_path / "short.de"
    short.write_text("Ein Hund.\n", encoding="utf-8")
    model = str(tiny_translator[0])
    assert cli_main(["evaluate", model, "-s", str(test_set / "val.en"), "-r", str(short)]) == 2
    err = capsys.readouterr().err
    assert "12 lines in source file" in err and f"1 lines in reference file {short}" in err
    unlabelled = tmp_path / "references.txt"
    shutil.copy(test_set / "val.de", unlabelled)
    assert (
        cli_main(
            ["evaluate", model, "-s", str(test_set / "val.en"), "-r", str(unlabelled), "--output-dir", str(tmp_path)]
        )
        == 2
    )
    assert "give --target-lang" in capsys.readouterr().err
    assert cli_main(["evaluate", model, "-s", str(test_set / "val.en")]) == 2
    assert "at least one --reference" in capsys.readouterr().err


def test_evaluate_takes_wmt14_through_datasets(tiny_translator, tmp_path, monkeypatch, capsys):
    import datasets

    calls = []

    def fake_load_wmt14(source_lang, target_lang, split, **kwargs):  # the hub is unreachable here: the call counts
        calls.append((source_lang, target_lang, split))
        return datasets.Dataset.from_dict(
            {"source": ["A dog runs.", "Two men."], "target": ["Ein Hund.", "Zwei Männer."]}
        )

    monkeypatch.setattr("vaswani_tx.data.data.load_wmt14", fake_load_wmt14)
    assert (
        cli_main(
            [
                "evaluate",
                str(tiny_translator[0]),
                "--wmt14",
                "en-de",
                "--num-beams",
                "1",
                "--max-length-offset",
                "2",
                "--output-dir",
                str(tmp_path),
                "--quiet",
            ]
        )
        == 0
    )
    assert calls == [("en", "de", "test")]
    assert len((tmp_path / "newstest2014.hyp.de").read_text(encoding="utf-8").splitlines()) == 2
    scores = json.loads((tmp_path / "newstest2014.scores.json").read_text())
    assert scores["test_set"] == "newstest2014"
    # greedy decoding records no length penalty (the model's alpha does not apply to it)
    assert (scores["num_beams"], scores["length_penalty"], scores["length_penalty_type"]) == (1, None, None)
    assert "newstest2014: 2 sentences, greedy (1 beam, no length penalty)" in capsys.readouterr().out


def test_evaluate_wmt14_without_a_network_names_evaluates_own_options(tiny_translator, tmp_path, monkeypatch, capsys):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'wmt/wmt14' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    argv = ["evaluate", str(tiny_translator[0]), "--wmt14", "en-de", "-o", str(tmp_path / "eval"), "--quiet"]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "-s/--source and -r/--reference files" in err
    assert "--tsv" not in err and "--source-file" not in err  # prepare-data's options, which evaluate has not


def test_evaluate_refuses_an_output_folder_named_like_a_hypothesis_file(tiny_translator, test_set, tmp_path, capsys):
    # -o is evaluate's output folder; `-o x.hyp.de` (translate's file, by habit) would become a folder
    for name in ("x.hyp.de", "test.de"):
        argv = ["evaluate", str(tiny_translator[0]), "-s", str(test_set / "val.en"), "-r", str(test_set / "val.de")]
        assert cli_main([*argv, "-o", str(tmp_path / name), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert "looks like a file name" in err and "vaswani-tx translate" in err
        assert not (tmp_path / name).exists()


def test_int8_decoding_goes_through_the_engines_int8_step(tiny_translator, capsys):
    int8 = load_translator(tiny_translator[0], int8=True)
    assert int8.engine.compute_type == "int8" and int8.model.dtype == torch.float32  # the model is untouched
    outputs = greedy(int8, LINES)
    assert len(outputs) == len(LINES) and outputs[1] == "" and all(outputs[i] for i in (0, 2, 4))
    with pytest.raises(ValueError, match="int8 decoding runs on the CPU from float32"):
        load_translator(tiny_translator[0], dtype="bfloat16", int8=True)
    assert (
        cli_main(
            [
                "translate",
                str(tiny_translator[0]),
                LINES[0],
                "--int8",
                "--num-beams",
                "1",
                "--max-length-offset",
                "4",
                "--quiet",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out == outputs[0] + "\n"
