"""Learn one subword vocabulary shared by source and target language (paper Section 5.1).

The paper uses byte-pair encoding (BPE) with about 37,000 tokens for English-German and a 32,000
word-piece vocabulary for English-French. Give the training text of BOTH languages, one sentence per
line, and the learned tokenizer is written to --output-dir, ready for
`AutoTokenizer.from_pretrained(output_dir)` and for `vaswani-tx prepare-data --tokenizer output_dir`.

examples:
  vaswani-tx train-tokenizer train.en train.de --output-dir tok-ende
  vaswani-tx train-tokenizer train.en train.fr --kind wordpiece --output-dir tok-enfr
  vaswani-tx train-tokenizer --wmt14 en-de --output-dir tok-wmt14   (downloads WMT14 from the Hub)
"""

from __future__ import annotations

import argparse
import os
import time

from vaswani_tx.cli import fail


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help="plain UTF-8 text files, one sentence per line: both sides of the parallel corpus",
    )
    parser.add_argument(
        "--wmt14",
        metavar="SRC-TGT",
        help="learn from the WMT14 training set on the Hugging Face Hub instead of FILEs (en-de or en-fr)",
    )
    parser.add_argument(
        "-o",
        "--output-dir",
        required=True,
        metavar="DIR",
        help="folder to write the tokenizer to (created if missing; refused if it exists and is not empty)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace a non-empty output folder (whole, once the new one is written)"
    )
    parser.add_argument(
        "--kind",
        choices=("bpe", "wordpiece", "word"),
        default="bpe",
        help="bpe (paper's EN-DE), wordpiece (paper's EN-FR) or word (whole tokens, e.g. a parser's); default bpe",
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        help="number of tokens including special tokens; default 37000 for bpe, 32000 for wordpiece and word",
    )
    parser.add_argument("--min-frequency", type=int, default=2, help="never merge a pair seen fewer times (default 2)")
    parser.add_argument(
        "--limit-alphabet",
        type=int,
        default=1000,
        help="keep at most this many distinct characters; rarer ones become bytes (bpe) or <unk> (default 1000)",
    )
    parser.add_argument("--cache-dir", help="datasets cache folder for --wmt14 (default: the datasets default)")


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.atomic import atomic_folder
    from vaswani_tx.data.data import load_wmt14
    from vaswani_tx.data.tokenization import train_tokenizer
    from vaswani_tx.folders import check_writable, refuse_to_overwrite

    if bool(args.files) == bool(args.wmt14):
        return fail("train-tokenizer", "give either text FILEs or --wmt14 SRC-TGT (see --help)")
    for option in ("vocab_size", "min_frequency", "limit_alphabet"):
        value = getattr(args, option)
        if value is not None and value < 1:
            return fail("train-tokenizer", f"--{option.replace('_', '-')} must be >= 1, got {value}")
    for path in args.files:
        if not os.path.exists(path):
            raise FileNotFoundError(f"corpus file {path} does not exist")
        if os.path.isdir(path):
            raise IsADirectoryError(f"corpus file {path} is a folder; give text files, one sentence per line")
    refuse_to_overwrite(args.output_dir, args.force, inputs=args.files)
    check_writable(args.output_dir, "whole-dir")
    if args.wmt14:
        source_lang, _, target_lang = args.wmt14.partition("-")
        corpus = load_wmt14(
            source_lang, target_lang, "train", cache_dir=args.cache_dir, local_files="text FILEs (both sides)"
        )
    else:
        corpus = args.files
    start = time.perf_counter()
    tokenizer = train_tokenizer(
        corpus, args.kind, args.vocab_size, min_frequency=args.min_frequency, limit_alphabet=args.limit_alphabet
    )
    seconds = time.perf_counter() - start
    with atomic_folder(args.output_dir) as partial:  # takes the place of the output folder whole once written
        tokenizer.save_pretrained(partial)
    print(
        f"trained a {len(tokenizer)}-token {args.kind} vocabulary in {seconds:.1f} s; "
        f"<pad>={tokenizer.pad_token_id} <unk>={tokenizer.unk_token_id} "
        f"<s>={tokenizer.bos_token_id} </s>={tokenizer.eos_token_id}; saved to {args.output_dir}"
    )
    return 0
