"""Figures for the vocabulary and batching work (Section 5.1), on the real files in ../shared/data.

    .venv/bin/python benchmarks/bench_data.py [--shared-data PATH]

Prints: tokenizer training time on Multi30k train and on newstest2013; tokens per sentence per side;
the unknown-token rate on newstest2013; the padding fraction of token-budget batches against randomly
ordered batches of the same sizes; and the pre-tokenisation comparison behind the choice documented
in ``vaswani_tx.data.tokenization``. Timings depend on the machine and its load; counts do not.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from vaswani_tx.data.data import TokenBudgetBatchSampler, iter_lines
from vaswani_tx.data.tokenization import (
    BYTE_TOKENS,
    SPECIAL_TOKENS,
    UNK_TOKEN_ID,
    build_normalizer,
    normalize,
    train_tokenizer,
)

REPO = Path(__file__).resolve().parents[1]


def lines(root: Path, name: str) -> list[str]:
    return list(iter_lines(root / name))


def timed_training(files: list[Path], kind: str, vocab_size: int | None):
    start = time.perf_counter()
    tokenizer = train_tokenizer(files, kind, vocab_size, show_progress=False)
    return tokenizer, time.perf_counter() - start


def lengths(tokenizer, text: list[str]) -> np.ndarray:
    return np.array([len(ids) for ids in tokenizer(text)["input_ids"]])


def unk_and_byte_rate(tokenizer, text: list[str]) -> tuple[float, float]:
    ids = [i for sequence in tokenizer(text, add_special_tokens=False)["input_ids"] for i in sequence]
    byte_ids = {tokenizer.convert_tokens_to_ids(token) for token in BYTE_TOKENS} - {None, UNK_TOKEN_ID}
    return ids.count(UNK_TOKEN_ID) / len(ids), sum(i in byte_ids for i in ids) / len(ids)


def padding_fractions(
    source: np.ndarray, target: np.ndarray, max_tokens: int, seed: int = 0
) -> tuple[float, float, int]:
    """Padding share of all token slots (both sides) for budget batches and for random batches of equal sizes."""
    batches = list(TokenBudgetBatchSampler(source, target, max_tokens, seed=seed))

    def pad_share(groups) -> float:
        slots = sum(len(g) * (source[g].max() + target[g].max()) for g in groups)
        return 1 - sum(source[g].sum() + target[g].sum() for g in groups) / slots

    order = np.random.default_rng(seed).permutation(np.concatenate(batches))
    sizes = np.cumsum([len(b) for b in batches])[:-1]
    return pad_share(batches), pad_share(np.split(order, sizes)), len(batches)


def candidate(kind: str) -> tuple[Tokenizer, trainers.Trainer]:
    """Pre-tokenisation candidates, all BPE with 8,000 tokens, for the comparison table."""
    if kind == "metaspace+NFC (chosen)":
        return None, None
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    trainer = trainers.BpeTrainer(
        vocab_size=8000, min_frequency=2, special_tokens=list(SPECIAL_TOKENS), show_progress=False
    )
    if kind == "metaspace+NFKC, no byte fallback":
        tokenizer.normalizer = normalizers.Sequence([normalizers.NFKC(), build_normalizer()])
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    elif kind == "byte-level (GPT-2)":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=8000,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
    elif kind == "punctuation split (Moses-like)":
        # word and punctuation split, subword-nmt's end-of-word marker; decoding joins words with spaces
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
        trainer = trainers.BpeTrainer(
            vocab_size=8000,
            min_frequency=2,
            special_tokens=list(SPECIAL_TOKENS),
            show_progress=False,
            end_of_word_suffix="</w>",
        )
        tokenizer.normalizer = build_normalizer()
        tokenizer.pre_tokenizer, tokenizer.decoder = pre_tokenizers.Whitespace(), decoders.BPEDecoder(suffix="</w>")
    return tokenizer, trainer


def pretokenisation_table(root: Path) -> None:
    train = [root / "multi30k-en-de/train.en", root / "multi30k-en-de/train.de"]
    evaluation = {
        name: lines(root, name)
        for name in ("multi30k-en-de/val.de", "newstest2013-en-de/dev.en", "newstest2013-en-de/dev.de")
    }
    print("\n## Pre-tokenisation candidates (BPE 8,000 learned on Multi30k train)")
    print("| candidate | file | round-trip failures | tokens/sentence | unk rate |")
    print("| --- | --- | ---: | ---: | ---: |")
    for kind in (
        "metaspace+NFC (chosen)",
        "metaspace+NFKC, no byte fallback",
        "byte-level (GPT-2)",
        "punctuation split (Moses-like)",
    ):
        tokenizer, trainer = candidate(kind)
        if tokenizer is None:
            chosen = train_tokenizer(train, "bpe", 8000, show_progress=False)
            encode = lambda text, t=chosen: [  # noqa: E731
                e.ids for e in t.backend_tokenizer.encode_batch(text, add_special_tokens=False)
            ]
            decode = lambda ids, t=chosen: t.backend_tokenizer.decode_batch(ids)  # noqa: E731
        else:
            tokenizer.train([str(path) for path in train], trainer)
            encode = lambda text, t=tokenizer: [e.ids for e in t.encode_batch(text)]  # noqa: E731
            decode = lambda ids, t=tokenizer: t.decode_batch(ids)  # noqa: E731
        for name, text in evaluation.items():
            ids = encode(text)
            # byte-level keeps the raw line; the others are judged against whitespace-collapsed text
            expected = text if kind.startswith("byte") else [" ".join(line.split()) for line in text]
            failures = sum(out != want for out, want in zip(decode(ids), expected))
            flat = [i for sequence in ids for i in sequence]
            print(
                f"| {kind} | {name} | {failures} / {len(text)} | {len(flat) / len(text):.1f} | {flat.count(UNK_TOKEN_ID) / len(flat):.4%} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shared-data",
        type=Path,
        default=Path(os.environ.get("VASWANI_SHARED_DATA", REPO.parent / "shared" / "data")),
    )
    root = parser.parse_args().shared_data
    print(f"# bench_data on {os.cpu_count()} CPU cores, data {root}")

    m30k_train = [root / "multi30k-en-de/train.en", root / "multi30k-en-de/train.de"]
    nt_de = [root / "newstest2013-en-de/dev.en", root / "newstest2013-en-de/dev.de"]
    nt_fr = [root / "newstest2013-en-fr/dev.en", root / "newstest2013-en-fr/dev.fr"]

    print("\n## Tokenizer training time (joint vocabulary on both sides; vocab_size requested -> learned)")
    print("| corpus | kind | requested | learned | seconds |")
    print("| --- | --- | ---: | ---: | ---: |")
    trained = {}
    for corpus, files in (
        ("Multi30k train EN-DE (58,000 lines)", m30k_train),
        ("newstest2013 EN-DE (6,000 lines)", nt_de),
        ("newstest2013 EN-FR (6,000 lines)", nt_fr),
    ):
        for kind, size in (("bpe", None), ("bpe", 8000), ("wordpiece", None), ("wordpiece", 8000)):
            tokenizer, seconds = timed_training(files, kind, size)
            trained[corpus, kind, size] = tokenizer
            requested = size or {"bpe": 37000, "wordpiece": 32000}[kind]
            print(f"| {corpus} | {kind} | {requested} | {len(tokenizer)} | {seconds:.2f} |")

    print(
        "\n## Tokens per sentence (including </s>) and unknown-token rate; vocabulary of 8,000 learned on Multi30k train"
    )
    print("| kind | file | tokens/sentence | unk rate | byte-fallback token rate |")
    print("| --- | --- | ---: | ---: | ---: |")
    for kind in ("bpe", "wordpiece"):
        tokenizer = trained["Multi30k train EN-DE (58,000 lines)", kind, 8000]
        for name in (
            "multi30k-en-de/val.en",
            "multi30k-en-de/val.de",
            "newstest2013-en-de/dev.en",
            "newstest2013-en-de/dev.de",
            "newstest2013-en-fr/dev.fr",
        ):
            text = lines(root, name)
            unk, byte = unk_and_byte_rate(tokenizer, text)
            print(f"| {kind} | {name} | {lengths(tokenizer, text).mean():.2f} | {unk:.4%} | {byte:.4%} |")
    print("\nIn-domain (vocabulary learned on newstest2013 itself, BPE 8,000):")
    for corpus, files in (("newstest2013 EN-DE (6,000 lines)", nt_de), ("newstest2013 EN-FR (6,000 lines)", nt_fr)):
        tokenizer = trained[corpus, "bpe", 8000]
        for path in files:
            text = list(iter_lines(path))
            print(f"  {path.parent.name}/{path.name}: {lengths(tokenizer, text).mean():.2f} tokens/sentence")

    print(
        "\n## Padding fraction: token-budget batches vs random batches of the same sizes (BPE 8,000 from Multi30k train)"
    )
    print("| data | max_tokens | batches | padding, token budget | padding, random order |")
    print("| --- | ---: | ---: | ---: | ---: |")
    tokenizer = trained["Multi30k train EN-DE (58,000 lines)", "bpe", 8000]
    for data_name, (src_name, tgt_name) in (
        ("Multi30k train", ("multi30k-en-de/train.en", "multi30k-en-de/train.de")),
        ("newstest2013 EN-DE", ("newstest2013-en-de/dev.en", "newstest2013-en-de/dev.de")),
    ):
        source, target = lengths(tokenizer, lines(root, src_name)), lengths(tokenizer, lines(root, tgt_name))
        for max_tokens in (1024, 4096, 25000):
            budget, random_order, count = padding_fractions(source, target, max_tokens)
            print(f"| {data_name} | {max_tokens} | {count} | {budget:.2%} | {random_order:.2%} |")

    pretokenisation_table(root)
    changed = {
        name: sum(normalize(line) != line for line in lines(root, name))
        for name in (
            "newstest2013-en-de/dev.en",
            "newstest2013-en-de/dev.de",
            "newstest2013-en-fr/dev.fr",
            "multi30k-en-de/train.de",
        )
    }
    print(f"\nLines the normalisation changes: {changed}")


if __name__ == "__main__":
    main()
