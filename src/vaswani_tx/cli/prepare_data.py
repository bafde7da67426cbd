"""Read a parallel corpus, clean it, encode it with a trained tokenizer and save it for training.

Section 5.1 of the paper: WMT 2014 English-German / English-French sentence pairs, encoded with a
shared subword vocabulary. Give ONE input: two line-aligned files (--source/--target, line
i of one translates line i of the other), a TSV file (source<TAB>target per line), a JSONL file, or
--wmt14 to download WMT14 from the Hugging Face Hub. The cleaning rules and how many pairs each one
removed are printed. The result (columns input_ids, attention_mask, labels, each ending in </s>) is
written with `datasets`' save_to_disk; read it back with `datasets.load_from_disk(output_dir)`.
Tokenisation is cached: running the same command again reuses the cached encoding.

examples:
  vaswani-tx prepare-data --source train.en --target train.de --tokenizer tok-ende --output-dir data-ende
  vaswani-tx prepare-data --tsv pairs.tsv --tokenizer tok-ende --output-dir data-ende --max-tokens 4096
  vaswani-tx prepare-data --wmt14 en-de --split validation --tokenizer tok-ende --output-dir newstest2013
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    source = parser.add_argument_group("input (give exactly one)")
    source.add_argument(
        "--source",
        "--source-file",
        dest="source_file",
        metavar="FILE",
        help="source-language text, one sentence per line (needs --target)",
    )
    source.add_argument(
        "--target", "--target-file", dest="target_file", metavar="FILE", help="target-language text, line-aligned"
    )
    source.add_argument("--tsv", metavar="FILE", help="file with one 'source<TAB>target' pair per line")
    source.add_argument("--jsonl", metavar="FILE", help='file with one {"source": ..., "target": ...} object per line')
    source.add_argument(
        "--wmt14", metavar="SRC-TGT", help="WMT14 from the Hugging Face Hub: en-de, de-en, en-fr or fr-en"
    )
    source.add_argument(
        "--split", default="train", help="with --wmt14: train, validation (newstest2013) or test (newstest2014)"
    )
    source.add_argument(
        "--source-key", default="source", help="with --jsonl: field holding the source text (default source)"
    )
    source.add_argument(
        "--target-key", default="target", help="with --jsonl: field holding the target text (default target)"
    )

    parser.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="folder written by `vaswani-tx train-tokenizer`"
    )
    parser.add_argument(
        "-o",
        "--output-dir",
        required=True,
        metavar="DIR",
        help="folder to save the encoded dataset to (refused if it exists and is not empty)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty output folder (whole, once the new one is written)"
    )

    cleaning = parser.add_argument_group("cleaning (words = whitespace-separated)")
    cleaning.add_argument(
        "--min-words", type=int, default=1, help="drop pairs with a side shorter than this (default 1)"
    )
    cleaning.add_argument(
        "--max-words",
        type=int,
        default=250,
        help="drop pairs with a side longer than this; 0 = no limit (default 250)",
    )
    cleaning.add_argument(
        "--max-length-ratio",
        type=float,
        default=3.0,
        help="drop pairs whose longer side has more than this many times the words of the shorter; 0 = off (default 3)",
    )
    cleaning.add_argument(
        "--keep-duplicates", action="store_true", help="keep repeated identical pairs (default: keep the first only)"
    )

    parser.add_argument("--num-proc", type=int, help="processes for tokenisation (default 1)")
    parser.add_argument("--cache-dir", help="datasets cache folder (default: the datasets default)")
    parser.add_argument(
        "--max-tokens",
        type=int,
        help="also report how many token-budget batches of at most this many source and target tokens the data makes",
    )


def _load(args: argparse.Namespace):
    from vaswani_tx.data import data

    if args.source_file:
        return data.read_parallel_files(args.source_file, args.target_file, cache_dir=args.cache_dir)
    if args.tsv:
        return data.read_tsv(args.tsv, cache_dir=args.cache_dir)
    if args.jsonl:
        return data.read_jsonl(
            args.jsonl, source_key=args.source_key, target_key=args.target_key, cache_dir=args.cache_dir
        )
    source_lang, _, target_lang = args.wmt14.partition("-")
    return data.load_wmt14(
        source_lang,
        target_lang,
        args.split,
        cache_dir=args.cache_dir,
        num_proc=args.num_proc,
        local_files="--source with --target, --tsv or --jsonl",
    )


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.data import data
    from vaswani_tx.data.tokenization import load_tokenizer, vocabulary_fingerprint

    given = [name for name in ("source_file", "tsv", "jsonl", "wmt14") if getattr(args, name)]
    if len(given) != 1 or bool(args.source_file) != bool(args.target_file):
        return fail("prepare-data", "give exactly one input: --source with --target, --tsv, --jsonl or --wmt14")
    from vaswani_tx.atomic import atomic_folder
    from vaswani_tx.folders import check_writable, refuse_to_overwrite

    for option in ("max_tokens", "num_proc"):
        value = getattr(args, option)
        if value is not None and value < 1:
            return fail("prepare-data", f"--{option.replace('_', '-')} must be >= 1, got {value}")
    for option in ("min_words", "max_words", "max_length_ratio"):
        if getattr(args, option) < 0:
            return fail("prepare-data", f"--{option.replace('_', '-')} must be >= 0, got {getattr(args, option)}")
    for path in (args.source_file, args.target_file, args.tsv, args.jsonl):
        if path and os.path.isdir(path):
            raise IsADirectoryError(f"corpus file {path} is a folder; give a text file")
    inputs = [path for path in (args.source_file, args.target_file, args.tsv, args.jsonl, args.tokenizer) if path]
    refuse_to_overwrite(args.output_dir, args.force, inputs=inputs)
    check_writable(args.output_dir, "whole-dir")
    tokenizer = load_tokenizer(args.tokenizer)
    pairs, report = data.clean_pairs(
        _load(args),
        min_words=args.min_words,
        max_words=args.max_words or None,
        max_length_ratio=args.max_length_ratio or None,
        deduplicate=not args.keep_duplicates,
    )
    print(report)
    encoded = data.tokenize_pairs(pairs, tokenizer, num_proc=args.num_proc)
    source_lengths = data.sequence_lengths(encoded, "input_ids")
    target_lengths = data.sequence_lengths(encoded, "labels")
    print(
        f"tokens per sentence (with </s>): source {source_lengths.mean():.1f}, target {target_lengths.mean():.1f}; "
        f"longest: source {source_lengths.max()}, target {target_lengths.max()}"
    )
    if args.max_tokens is not None:
        sampler = data.TokenBudgetBatchSampler(source_lengths, target_lengths, args.max_tokens)
        print(
            f"max_tokens={args.max_tokens}: {len(sampler)} batches; {sampler.num_oversized} pairs too long for the budget"
        )
    record = {
        "tokenizer": str(Path(args.tokenizer).resolve()),
        "tokenizer_fingerprint": vocabulary_fingerprint(tokenizer),
    }
    with atomic_folder(args.output_dir) as partial:  # takes the place of the output folder whole once written
        encoded.save_to_disk(str(partial))
        (partial / data.PREPARED_DATA_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"saved {encoded.num_rows} pairs to {args.output_dir}")
    return 0
