"""The `vaswani_bleu` metric against independent figures.

sacreBLEU and chrF must equal what the `sacrebleu` command line prints for the same files; the
paper's tokenized BLEU (Section 6.1, Table 2) must equal a BLEU counted here from scratch, with
multi-bleu.perl's formula, on text tokenized here with sacremoses and compound-split here.
The known system output is newstest2013's German reference with every 5th word dropped.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import sacremoses

from vaswani_tx.metrics.evaluation import (
    METRIC_PATH,
    load_metric,
    make_compute_metrics,
    read_lines,
    score,
    score_files,
)
from vaswani_tx.metrics.vaswani_bleu.vaswani_bleu import split_compounds

SACREBLEU_CLI = Path(sys.executable).with_name("sacrebleu")


def drop_every_fifth_word(line: str) -> str:
    return " ".join(word for i, word in enumerate(line.split(" "), start=1) if i % 5)


@pytest.fixture(scope="module")
def newstest_files(shared_data: Path, tmp_path_factory) -> tuple[Path, Path]:
    reference = shared_data / "newstest2013-en-de" / "dev.de"
    hypothesis = tmp_path_factory.mktemp("hyp") / "dropped.de"
    lines = reference.read_text(encoding="utf-8").split("\n")[:-1]
    hypothesis.write_text("".join(drop_every_fifth_word(line) + "\n" for line in lines), encoding="utf-8")
    return hypothesis, reference


@pytest.fixture(scope="module")
def module_scores(newstest_files) -> dict:
    hypothesis, reference = newstest_files
    return score_files(hypothesis, reference, target_lang="de")


@pytest.fixture(scope="module")
def cli_scores(newstest_files) -> dict:
    hypothesis, reference = newstest_files
    out = subprocess.run(
        [
            str(SACREBLEU_CLI),
            str(reference),
            "-i",
            str(hypothesis),
            "-l",
            "en-de",
            "-m",
            "bleu",
            "chrf",
            "-w",
            "6",
            "-f",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {entry["name"]: entry for entry in json.loads(out)}


def test_sacrebleu_equals_command_line(module_scores, cli_scores):
    assert module_scores["sacrebleu_signature"] == cli_scores["BLEU"]["signature"]
    assert round(module_scores["sacrebleu"], 6) == cli_scores["BLEU"]["score"]
    # dropping 1 word in 5 must cost a lot but not everything: guards against scoring the reference with itself
    assert 40 < module_scores["sacrebleu"] < 70


def test_lowercased_sacrebleu_equals_command_line_with_lc(module_scores, newstest_files):
    hypothesis, reference = newstest_files
    argv = [str(SACREBLEU_CLI), str(reference), "-i", str(hypothesis), "-l", "en-de", "-lc", "-w", "6", "-f", "json"]
    expected = json.loads(subprocess.run(argv, capture_output=True, text=True, check=True).stdout)
    assert module_scores["sacrebleu_lowercase_signature"] == expected["signature"]
    assert "case:lc" in expected["signature"]
    assert round(module_scores["sacrebleu_lowercase"], 6) == expected["score"]
    # the hypotheses differ from the references in words, not in case: lowercasing changes little, and only upwards
    assert module_scores["sacrebleu"] <= module_scores["sacrebleu_lowercase"] < module_scores["sacrebleu"] + 2


def test_chrf_equals_command_line(module_scores, cli_scores):
    assert module_scores["chrf_signature"] == cli_scores["chrF2"]["signature"]
    assert round(module_scores["chrf"], 6) == cli_scores["chrF2"]["score"]


# --- an independent tokenized BLEU ------------------------------------------------------------


MOSES_DE_PUNCT = sacremoses.MosesPunctNormalizer(lang="de")
MOSES_DE = sacremoses.MosesTokenizer(lang="de")


def paper_tokenize(line: str) -> str:
    """get_ende_bleu.sh's steps: replace-unicode-punctuation, tokenizer.perl -l de, ##AT## compound split."""
    line = MOSES_DE_PUNCT.replace_unicode_punct(line)
    line = MOSES_DE.tokenize(line, return_str=True, escape=True)
    return re.sub(r"(\S)-(\S)", r"\1 ##AT##-##AT## \2", line)


def reference_multi_bleu(hypotheses: list[str], references: list[str]) -> float:
    """multi-bleu.perl for one reference: corpus-level clipped n-gram precisions 1-4, geometric mean, BP."""
    matches = [0, 0, 0, 0]
    totals = [0, 0, 0, 0]
    c = r = 0
    for hyp, ref in zip(hypotheses, references):
        h, t = hyp.split(), ref.split()
        c, r = c + len(h), r + len(t)
        for n in range(1, 5):
            hyp_grams = Counter(" ".join(h[i : i + n]) for i in range(len(h) - n + 1))
            ref_grams = Counter(" ".join(t[i : i + n]) for i in range(len(t) - n + 1))
            totals[n - 1] += sum(hyp_grams.values())
            matches[n - 1] += sum((hyp_grams & ref_grams).values())
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity_penalty = min(1.0, math.exp(1 - r / c))
    return 100 * brevity_penalty * math.exp(log_precision)


def test_tokenized_bleu_equals_independent_count(newstest_files, module_scores):
    hypothesis, reference = newstest_files
    hyps = [paper_tokenize(line) for line in read_lines(hypothesis)]
    refs = [paper_tokenize(line) for line in read_lines(reference)]
    expected = reference_multi_bleu(hyps, refs)
    assert module_scores["tokenized_bleu"] == pytest.approx(expected, rel=1e-12)
    assert module_scores["tokenized_bleu_hyp_len"] == sum(len(h.split()) for h in hyps)
    assert module_scores["tokenized_bleu_ref_len"] == sum(len(r.split()) for r in refs)
    assert "compound-split:yes" in module_scores["tokenized_bleu_signature"]
    # the two BLEUs are different measurements of the same output
    assert module_scores["tokenized_bleu"] != pytest.approx(module_scores["sacrebleu"], abs=0.1)


def test_tokenized_bleu_hand_case():
    # 5 tokens vs the reference's 6: unigrams 5/5, bigrams 3/4, trigrams 2/3, 4-grams 1/2
    out = score(["a b c d f"], ["a b c d e f"], target_lang="en")
    assert out["tokenized_bleu_precisions"] == pytest.approx([100, 75, 200 / 3, 50])
    assert out["tokenized_bleu_brevity_penalty"] == pytest.approx(math.exp(1 - 6 / 5))
    assert out["tokenized_bleu"] == pytest.approx(100 * math.exp(1 - 6 / 5) * (1 * 0.75 * (2 / 3) * 0.5) ** 0.25)
    # multi-bleu.perl has no smoothing: one n-gram order without a match gives 0
    assert score(["a x b y"], ["a b c d"], target_lang="en")["tokenized_bleu"] == 0.0


def test_compound_splitting_hand_case():
    assert split_compounds("die Rich-Text-Format Datei") == "die Rich ##AT##-##AT## Text ##AT##-##AT## Format Datei"
    # Perl's s///g and re.sub both resume after a match, so the middle "b" is not split again
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_compounds("ein - Strich") == "ein - Strich"

    hyp, ref = ["Das E-Mail-Konto ."], ["Das E-Mail-Konto ."]
    split = score(hyp, ref, target_lang="de")
    unsplit = score(hyp, ref, target_lang="de", compound_splitting=False)
    assert (split["tokenized_bleu_hyp_len"], unsplit["tokenized_bleu_hyp_len"]) == (7, 3)
    assert "compound-split:no" in unsplit["tokenized_bleu_signature"]
    # off by default for other target languages
    assert "compound-split:no" in score(hyp, ref, target_lang="fr")["tokenized_bleu_signature"]


def test_multiple_references_per_hypothesis():
    out = score(["the cat sat on the mat"], [["a cat sat on a mat", "the cat sat on the mat"]], target_lang="en")
    assert out["sacrebleu"] == pytest.approx(100)
    assert out["tokenized_bleu"] == pytest.approx(100)
    assert out["sacrebleu_signature"].startswith("nrefs:2|")


# --- bad input ------------------------------------------------------------------------------


def test_length_mismatch_names_both_counts():
    with pytest.raises(ValueError, match="3 hypotheses, 2 references"):
        score(["a", "b", "c"], ["a", "b"], target_lang="de")


def test_file_line_count_mismatch_names_both_counts(tmp_path):
    hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
    hyp.write_text("a\nb\nc\n", encoding="utf-8")
    ref.write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"3 lines in hypothesis file .*hyp\.de, 2 lines in reference file .*ref\.de"):
        score_files(hyp, ref, target_lang="de")


def test_non_utf8_file_names_file_and_line(tmp_path):
    hyp, ref = tmp_path / "latin1.de", tmp_path / "ref.de"
    hyp.write_bytes("gut\nschön\n".encode("latin-1"))
    ref.write_text("gut\nschön\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"latin1\.de, line 2: not valid UTF-8 \(byte 0xf6 at column 4\)"):
        score_files(hyp, ref, target_lang="de")


def test_target_lang_is_required():
    with pytest.raises(ValueError, match="target_lang is required"):
        load_metric().compute(predictions=["a"], references=["a"])


def test_read_lines_splits_on_newline_only(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_bytes("eins\u2028zwei \r\n\ndrei\n".encode("utf-8"))
    assert read_lines(path) == ["eins\u2028zwei", "", "drei"]


# --- loading and the Trainer hook -----------------------------------------------------------


def test_evaluate_load_offline_from_package_path():
    # A fresh process with the hub switched off and every socket connect refused.
    code = (
        "import json, socket, evaluate\n"
        "def refuse(*args, **kwargs):\n"
        "    raise OSError('network used')\n"
        "socket.socket.connect = refuse\n"
        "from vaswani_tx.metrics.evaluation import METRIC_PATH, load_metric\n"
        "by_file = evaluate.load(str(METRIC_PATH), keep_in_memory=True)\n"
        "by_folder = evaluate.load(str(METRIC_PATH.parent), keep_in_memory=True)\n"
        "args = dict(predictions=['Das ist gut .'], references=['Das ist gut .'], target_lang='de')\n"
        "print(json.dumps([m.compute(**args)['sacrebleu'] for m in (by_file, by_folder, load_metric())]))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == pytest.approx([100.0, 100.0, 100.0])
    assert METRIC_PATH.is_file() and METRIC_PATH.name == "vaswani_bleu.py"


class WordTokenizer:
    """The slice of a tokenizer `make_compute_metrics` uses: pad id and batch_decode with skip_special_tokens."""

    pad_token_id = 0
    vocab = {0: "<pad>", 1: "</s>", 2: "Das", 3: "ist", 4: "gut", 5: "."}

    def batch_decode(self, ids, skip_special_tokens):
        assert skip_special_tokens
        return [" ".join(self.vocab[int(i)] for i in row if int(i) > 1) for row in ids]


def test_make_compute_metrics_on_fake_eval_prediction():
    from transformers import EvalPrediction

    compute_metrics = make_compute_metrics(WordTokenizer(), target_lang="de")
    generated = np.array([[2, 3, 4, 5, 1], [2, 3, 5, 1, -100]])  # -100: padding across batches
    labels = np.array([[2, 3, 4, 5, 1], [2, 3, 4, 5, 1]])
    labels[1, 4] = -100
    metrics = compute_metrics(EvalPrediction(predictions=generated, label_ids=labels))
    assert set(metrics) == {"sacrebleu", "chrf", "tokenized_bleu"}
    expected = score(["Das ist gut .", "Das ist ."], ["Das ist gut .", "Das ist gut ."], target_lang="de")
    assert metrics == {key: pytest.approx(expected[key]) for key in metrics}
    assert 0 < metrics["sacrebleu"] < 100

    with pytest.raises(ValueError, match="predict_with_generate=True"):
        compute_metrics(EvalPrediction(predictions=np.zeros((2, 5, 6), dtype=np.float32), label_ids=labels))


def test_evaluation_imports_no_model_or_training_code():
    import ast

    import vaswani_tx.metrics.evaluation

    tree = ast.parse(Path(vaswani_tx.metrics.evaluation.__file__).read_text(encoding="utf-8"))
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if "modeling" in name or "training" in name}, imported
