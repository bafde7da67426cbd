"""Scoring translations: the package's ``vaswani_bleu`` metric, ``compute_metrics`` for ``Seq2SeqTrainer``, and file scoring.

Every score comes from one ``evaluate`` module shipped inside the package
(``metrics/vaswani_bleu/vaswani_bleu.py``), loaded from its file path so ``evaluate`` never looks at
the hub. It reports two BLEUs that must not be compared with each other:

* ``sacrebleu``: detokenized corpus BLEU with sacreBLEU's signature, the figure to report today;
* ``tokenized_bleu``: the paper's Table 2 figure (Section 6.1), BLEU on Moses-tokenized text with
  EN-DE compounds split as ``##AT##-##AT##``; it counts different tokens, by an output-dependent margin.

This module imports neither the model nor training code: scoring needs only text.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from os import PathLike
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from vaswani_tx.model.errors import UserInputError
from vaswani_tx.text_io import decode_lines, iter_lines

if TYPE_CHECKING:
    import evaluate
    from transformers import EvalPrediction, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

METRIC_PATH: Path = Path(__file__).resolve().parent / "vaswani_bleu" / "vaswani_bleu.py"
"""The metric module file: ``evaluate.load(str(METRIC_PATH))`` works offline."""

METRIC_NAMES = ("vaswani_bleu", "vaswani_parseval")  # translation (Section 6.1), parsing (Section 6.3)

# The numeric results, the ones a Trainer can log; signatures are strings and are logged instead.
TRAINER_METRIC_KEYS = ("sacrebleu", "chrf", "tokenized_bleu")


def load_metric(name: str = "vaswani_bleu", **kwargs: Any) -> evaluate.EvaluationModule:
    """``evaluate.load`` of one of the package's metric modules (``METRIC_NAMES``); kwargs go to ``evaluate.load``.

    ``"vaswani_bleu"`` scores translations; ``"vaswani_parseval"`` scores parse trees (EVALB bracketing F1).

    The path is a file that exists, so ``evaluate`` takes its local branch and never contacts the hub.
    Predictions are kept in memory by default: nothing here needs ``evaluate``'s on-disk cache.
    """
    import evaluate

    if name not in METRIC_NAMES:
        raise ValueError(f"unknown metric {name!r}; the package ships {', '.join(METRIC_NAMES)}")
    path = METRIC_PATH.parent.parent / name / f"{name}.py"
    if not path.is_file():
        raise FileNotFoundError(f"metric module missing from the installed package: {path}")
    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(str(path), **kwargs)


def score(
    hypotheses: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    target_lang: str,
    compound_splitting: bool | None = None,
    metric: evaluate.EvaluationModule | None = None,
) -> dict[str, Any]:
    """All of the metric's results for lists of strings (see the metric module for the keys)."""
    metric = metric if metric is not None else load_metric()
    return metric.compute(
        predictions=list(hypotheses),
        references=list(references),
        target_lang=target_lang,
        compound_splitting=compound_splitting,
    )


def read_lines(path: str | PathLike[str]) -> list[str]:
    """Lines of a UTF-8 text file, read as the ``sacrebleu`` command line reads them.

    Lines end at ``\\n`` only (``vaswani_tx.text_io``: ``str.splitlines`` would also break at U+2028
    and friends and misalign a corpus); trailing whitespace, ``\\r`` included, is stripped. Bytes that
    are not UTF-8 raise ``CorpusError`` (a ``UserInputError``) naming the file, the line and the byte.
    """
    return [line.rstrip() for line in iter_lines(path)]


def read_text(path: str | PathLike[str] | None) -> list[str]:
    """``read_lines`` of a file, or of standard input for ``None`` or ``"-"`` (as the ``sacrebleu`` command)."""
    if path is None or str(path) == "-":
        return [line.rstrip() for line in decode_lines(sys.stdin.buffer, "<stdin>")]
    return read_lines(path)


def read_references(
    reference_files: Sequence[str | PathLike[str]], line_count: int, aligned_with: str
) -> list[list[str]]:
    """The references of each sentence, from one file per reference position (``read_text``).

    Every file must have ``line_count`` lines, the count of ``aligned_with`` (e.g. ``"source file
    test.en"``); a different count raises ``UserInputError`` naming both files and counts.
    """
    streams = []
    for reference_file in reference_files:
        stream = read_text(reference_file)
        if len(stream) != line_count:
            raise UserInputError(
                f"line counts differ: {line_count} lines in {aligned_with}, {len(stream)} lines in reference file {reference_file}"
            )
        streams.append(stream)
    return [list(refs) for refs in zip(*streams)]


def score_files(
    hypothesis_file: str | PathLike[str],
    reference_files: str | PathLike[str] | Sequence[str | PathLike[str]],
    target_lang: str,
    compound_splitting: bool | None = None,
) -> dict[str, Any]:
    """Score a hypothesis file against one reference file or several (one reference per file).

    Files are line-aligned UTF-8 text; a different line count raises ``UserInputError`` naming both counts.
    """
    if isinstance(reference_files, (str, PathLike)):
        reference_files = [reference_files]
    hypotheses = read_lines(hypothesis_file)
    references = read_references(reference_files, len(hypotheses), f"hypothesis file {hypothesis_file}")
    return score(hypotheses, references, target_lang, compound_splitting)


def make_compute_metrics(
    tokenizer: PreTrainedTokenizerBase,
    target_lang: str,
    compound_splitting: bool | None = None,
) -> Callable[[EvalPrediction], dict[str, float]]:
    """A ``compute_metrics`` for ``Seq2SeqTrainer(..., args=Seq2SeqTrainingArguments(predict_with_generate=True))``.

    It decodes the generated ids and the labels (``-100`` padding becomes the pad id, special tokens
    are skipped) and returns ``sacrebleu``, ``chrf`` and ``tokenized_bleu``; the Trainer logs them as
    ``eval_sacrebleu`` etc. The signatures go to this module's logger once, since a Trainer logs numbers only.
    """
    if tokenizer.pad_token_id is None:
        raise UserInputError("the tokenizer has no pad token: -100 label padding cannot be decoded")
    metric = load_metric()
    signatures_logged = False

    def compute_metrics(eval_prediction: EvalPrediction) -> dict[str, float]:
        nonlocal signatures_logged
        generated = eval_prediction.predictions
        if isinstance(generated, tuple):
            generated = generated[0]
        generated = np.asarray(generated)
        if generated.ndim != 2 or not np.issubdtype(generated.dtype, np.integer):
            raise UserInputError(
                f"compute_metrics expects generated token ids (2-D integers), got shape {generated.shape} "
                f"dtype {generated.dtype}: set predict_with_generate=True in Seq2SeqTrainingArguments"
            )
        labels = np.asarray(eval_prediction.label_ids)
        hypotheses = tokenizer.batch_decode(_unmask(generated, tokenizer.pad_token_id), skip_special_tokens=True)
        references = tokenizer.batch_decode(_unmask(labels, tokenizer.pad_token_id), skip_special_tokens=True)
        results = score(
            [h.strip() for h in hypotheses], [r.strip() for r in references], target_lang, compound_splitting, metric
        )
        if not signatures_logged:
            logger.info(
                "sacreBLEU %s | chrF %s | tokenized BLEU %s",
                results["sacrebleu_signature"],
                results["chrf_signature"],
                results["tokenized_bleu_signature"],
            )
            signatures_logged = True
        return {key: float(results[key]) for key in TRAINER_METRIC_KEYS}

    return compute_metrics


def _unmask(ids: np.ndarray, pad_token_id: int) -> np.ndarray:
    # The Trainer pads labels, and generations gathered across batches, with -100, which no tokenizer can decode.
    return np.where(ids == -100, pad_token_id, ids)
