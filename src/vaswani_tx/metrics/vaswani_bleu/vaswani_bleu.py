"""`vaswani_bleu`: detokenized sacreBLEU, chrF and the paper's tokenized BLEU, side by side.

An ``evaluate`` metric module that loads offline from the installed package
(``vaswani_tx.metrics.evaluation.load_metric()``, or ``evaluate.load(<path of this file>)``). It imports only
``evaluate``, ``datasets``, ``sacrebleu`` and ``sacremoses``, because ``evaluate`` copies this one file
into its module cache and imports it from there.

Four scores, each labelled by its key and never to be compared with another:

``sacrebleu`` / ``sacrebleu_signature``
    Corpus BLEU on detokenized text with sacreBLEU's own tokenizer (13a for most languages), the figure
    the field reports today. Equal to what the ``sacrebleu`` command line prints for the same files.
``sacrebleu_lowercase`` / ``sacrebleu_lowercase_signature``
    The same on lowercased text (``sacrebleu -lc``, ``case:lc`` in the signature): the figure of the
    Multi30k literature, which scores lowercased, tokenized text.
``chrf`` / ``chrf_signature``
    sacreBLEU's chrF (character n-gram F-score, beta 2), also equal to the command line's figure.
``tokenized_bleu`` / ``tokenized_bleu_signature`` (+ ``_precisions``, ``_brevity_penalty``, ``_hyp_len``, ``_ref_len``)
    The BLEU of the paper's Table 2 (Section 6.1): tensor2tensor's ``get_ende_bleu.sh`` recipe, i.e.
    Moses ``replace-unicode-punctuation.perl``, Moses ``tokenizer.perl -l <lang>``, for EN-DE the
    compound splitting ``s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g``, then ``multi-bleu.perl`` on the tokens.

Why the two BLEUs must not be compared: they count different tokens. Moses tokenization and
``##AT##-##AT##`` compound splitting turn one hyphenated compound into three tokens, two of which
(``##AT##-##AT##`` and the split parts) are almost free matches, and Moses escapes and splits
punctuation differently from 13a. The gap between the two depends on the output and the reference
(Post, 2018), so a tokenized 27.3 (Table 2) is not a sacreBLEU 27.3, nor a fixed offset from one.

Departures from the recipe, both deliberate:

* Moses is the Python port ``sacremoses`` (its tokenizer and punctuation tables are line-by-line
  ports of ``tokenizer.perl`` and ``replace-unicode-punctuation.perl``), not the Perl scripts.
* The recipe ran ``replace-unicode-punctuation.perl`` on the hypothesis only, because its reference
  file came pre-tokenized. Here hypothesis and reference go through the same steps, so a hypothesis
  equal to its reference scores 100.

``multi-bleu.perl``'s arithmetic is kept exactly: whitespace tokens, case-sensitive, clipped n-gram
counts (max over references), 1- to 4-grams, corpus totals, the closest reference length (the shorter
one on a tie), brevity penalty ``exp(1 - r/c)`` when ``c < r``, no smoothing (a zero precision gives 0).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from importlib.metadata import version

import datasets
import evaluate
import sacrebleu
import sacremoses

_CITATION = """\
@inproceedings{vaswani2017attention,
  title={Attention Is All You Need},
  author={Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion and Gomez, Aidan N and Kaiser, Lukasz and Polosukhin, Illia},
  booktitle={Advances in Neural Information Processing Systems},
  year={2017}
}
@inproceedings{post-2018-call,
  title={A Call for Clarity in Reporting {BLEU} Scores},
  author={Post, Matt},
  booktitle={Proceedings of the Third Conference on Machine Translation: Research Papers},
  year={2018}
}
@inproceedings{popovic-2015-chrf,
  title={chr{F}: character n-gram {F}-score for automatic {MT} evaluation},
  author={Popovi{\\'c}, Maja},
  booktitle={Proceedings of the Tenth Workshop on Statistical Machine Translation},
  year={2015}
}
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (list of str): detokenized hypotheses, one per segment.
    references (list of str, or list of list of str): one reference per hypothesis, or a list of
        references per hypothesis (the same number for every hypothesis, as sacreBLEU requires).
    target_lang (str): ISO 639-1 code of the target language ("de", "fr", ...). Selects the Moses
        tokenizer's rules and sacreBLEU's default tokenizer. Required.
    compound_splitting (bool, optional): split hyphenated compounds as ``##AT##-##AT##`` before the
        tokenized BLEU. Defaults to ``target_lang == "de"``, as the paper's EN-DE numbers did.
Returns:
    sacrebleu (float): detokenized corpus BLEU, 0-100; sacrebleu_signature (str).
    sacrebleu_lowercase (float): the same, case-insensitive; sacrebleu_lowercase_signature (str).
    chrf (float): chrF2, 0-100; chrf_signature (str).
    tokenized_bleu (float): the paper's tokenized BLEU, 0-100; tokenized_bleu_signature (str) names
        the recipe; tokenized_bleu_precisions (list of 4 floats, 0-100), tokenized_bleu_brevity_penalty,
        tokenized_bleu_hyp_len and tokenized_bleu_ref_len (token counts) detail it.
Examples:
    >>> metric = evaluate.load("/path/to/vaswani_bleu.py")
    >>> out = metric.compute(predictions=["Das ist gut ."], references=["Das ist gut ."], target_lang="de")
    >>> round(out["sacrebleu"], 1), round(out["tokenized_bleu"], 1)
    (100.0, 100.0)
"""

# tensor2tensor's get_ende_bleu.sh: perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'. re.sub, like
# Perl's /g, takes non-overlapping matches left to right, so "a-b-c" becomes "a ##AT##-##AT## b-c".
_COMPOUND_HYPHEN = re.compile(r"(\S)-(\S)")
MAX_NGRAM_ORDER = 4


def split_compounds(tokenized_line: str) -> str:
    """Rewrite ``x-y`` as ``x ##AT##-##AT## y``, as the paper's EN-DE evaluation did (Section 6.1)."""
    return _COMPOUND_HYPHEN.sub(r"\1 ##AT##-##AT## \2", tokenized_line)


class PaperTokenizer:
    """Moses punctuation replacement and tokenization (``sacremoses``), then optional compound splitting."""

    def __init__(self, lang: str, compound_splitting: bool):
        self.lang = lang
        self.compound_splitting = compound_splitting
        self._punct = sacremoses.MosesPunctNormalizer(lang=lang)
        self._tokenizer = sacremoses.MosesTokenizer(lang=lang)

    def __call__(self, line: str) -> str:
        line = self._punct.replace_unicode_punct(line)
        # tokenizer.perl's defaults: escape XML characters (&quot; &apos; ...), no aggressive hyphen split.
        line = self._tokenizer.tokenize(line, return_str=True, escape=True, aggressive_dash_splits=False)
        return split_compounds(line) if self.compound_splitting else line

    def signature(self) -> str:
        return (
            f"paper-tokenized|tok:moses-{self.lang}(sacremoses-{version('sacremoses')})|"
            f"unicode-punct:replaced|compound-split:{'yes' if self.compound_splitting else 'no'}|"
            "case:mixed|multi-bleu|not-comparable-to-sacrebleu"
        )


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))


def multi_bleu(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict:
    """Corpus BLEU of already tokenized text with ``multi-bleu.perl``'s arithmetic (see the module docstring).

    ``references[i]`` holds the references of ``hypotheses[i]``. Returns BLEU and precisions on 0-100.
    An empty hypothesis corpus (where multi-bleu.perl divides by zero) scores 0.
    """
    correct = [0] * MAX_NGRAM_ORDER
    total = [0] * MAX_NGRAM_ORDER
    hyp_len = ref_len = 0
    for hypothesis, refs in zip(hypotheses, references, strict=True):
        hyp_tokens = hypothesis.split()
        ref_tokens = [ref.split() for ref in refs]
        hyp_len += len(hyp_tokens)
        # closest reference length; on a tie the shorter one (multi-bleu.perl's rule)
        ref_len += min((abs(len(r) - len(hyp_tokens)), len(r)) for r in ref_tokens)[1]
        for n in range(1, MAX_NGRAM_ORDER + 1):
            hyp_counts = _ngrams(hyp_tokens, n)
            max_ref_counts: Counter = Counter()
            for r in ref_tokens:
                max_ref_counts |= _ngrams(r, n)  # | keeps the max count per n-gram
            total[n - 1] += sum(hyp_counts.values())
            correct[n - 1] += sum(min(c, max_ref_counts[g]) for g, c in hyp_counts.items())
    precisions = [c / t if t else 0.0 for c, t in zip(correct, total)]
    if hyp_len == 0:
        brevity_penalty = bleu = 0.0
    else:
        brevity_penalty = math.exp(1 - ref_len / hyp_len) if hyp_len < ref_len else 1.0
        # multi-bleu.perl's log(0) is -9999999999, so any zero precision gives BLEU 0
        bleu = brevity_penalty * math.exp(sum(map(math.log, precisions)) / MAX_NGRAM_ORDER) if min(precisions) else 0.0
    return {
        "bleu": 100 * bleu,
        "precisions": [100 * p for p in precisions],
        "brevity_penalty": brevity_penalty,
        "hyp_len": hyp_len,
        "ref_len": ref_len,
    }


def _as_reference_lists(references: Sequence) -> list[list[str]]:
    return [[ref] if isinstance(ref, str) else list(ref) for ref in references]


@evaluate.utils.file_utils.add_start_docstrings(__doc__, _KWARGS_DESCRIPTION)
class VaswaniBleu(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=__doc__,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Value("string"),
                    "references": datasets.Sequence(datasets.Value("string")),
                }
            ),
            codebase_urls=["https://github.com/mjpost/sacrebleu", "https://pypi.org/project/sacremoses/"],
            reference_urls=["https://arxiv.org/abs/1706.03762", "https://aclanthology.org/W18-6319"],
        )

    def add_batch(self, *, predictions=None, references=None, **kwargs):
        """Add hypotheses and their references; a single reference may be given as a plain string."""
        # Checked here, before evaluate's own encoding, so the message names both counts plainly.
        if predictions is not None and references is not None and len(predictions) != len(references):
            raise ValueError(
                f"hypotheses and references differ in length: {len(predictions)} hypotheses, "
                f"{len(references)} references"
            )
        if references is not None:
            references = _as_reference_lists(references)
        super().add_batch(predictions=predictions, references=references, **kwargs)

    def _compute(self, predictions, references, target_lang=None, compound_splitting=None):
        if not target_lang:
            raise ValueError("target_lang is required (ISO 639-1 code such as 'de'): Moses tokenization depends on it")
        if compound_splitting is None:
            compound_splitting = target_lang == "de"
        num_refs = {len(refs) for refs in references}
        if len(num_refs) > 1 or 0 in num_refs:
            raise ValueError(
                f"every hypothesis needs the same number (at least one) of references; got counts {sorted(num_refs)}"
            )
        # sacreBLEU takes one stream per reference position.
        ref_streams = [list(stream) for stream in zip(*references)]

        bleu = sacrebleu.metrics.BLEU(trg_lang=target_lang)
        bleu_score = bleu.corpus_score(predictions, ref_streams)
        lowercase = sacrebleu.metrics.BLEU(trg_lang=target_lang, lowercase=True)
        lowercase_score = lowercase.corpus_score(predictions, ref_streams)
        chrf = sacrebleu.metrics.CHRF()
        chrf_score = chrf.corpus_score(predictions, ref_streams)

        tokenize = PaperTokenizer(target_lang, compound_splitting)
        tokenized = multi_bleu(
            [tokenize(h) for h in predictions], [[tokenize(r) for r in refs] for refs in references]
        )
        return {
            "sacrebleu": bleu_score.score,
            "sacrebleu_signature": str(bleu.get_signature()),
            "sacrebleu_lowercase": lowercase_score.score,
            "sacrebleu_lowercase_signature": str(lowercase.get_signature()),
            "chrf": chrf_score.score,
            "chrf_signature": str(chrf.get_signature()),
            "tokenized_bleu": tokenized["bleu"],
            "tokenized_bleu_signature": tokenize.signature(),
            "tokenized_bleu_precisions": tokenized["precisions"],
            "tokenized_bleu_brevity_penalty": tokenized["brevity_penalty"],
            "tokenized_bleu_hyp_len": tokenized["hyp_len"],
            "tokenized_bleu_ref_len": tokenized["ref_len"],
        }
