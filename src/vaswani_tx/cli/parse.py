"""Constituency parsing with the same model (paper Section 6.3): train, parse and score with EVALB's F1.

  run CONFIG --train T.. --dev D.. --test E.. [--resume] [--unconstrained] [key=value ...]
      linearise the treebank splits into the files the run config names, train (as `vaswani-tx train`,
      logging the dev set's bracketing F1 at each evaluation), parse the test trees' sentences and score
      them; writes test.gold, test.parsed, parse_scores.json and curves.png
  predict MODEL (--sentences FILE | --trees FILE..) [-o FILE] [--num-beams N] [--unconstrained]
      parse tokenised sentences (one per line, words separated by spaces; FILE - reads standard input) or
      the sentences of treebank files (then also scored against them); prints or writes one tree per line
  score GOLD PRED [--max-length 40]
      labelled bracketing precision, recall and F1 (EVALB COLLINS.prm) of two treebank files

Treebank arguments are paths or quoted globs of Penn Treebank files (.mrg or one tree per line).
Decoding defaults come from the model's generation_config: Section 6.3's beam 21, alpha 0.3 and
input length + 300 for a model trained with configs/train/wsj-parse*.yaml. Decoding is constrained to
trees by default: every hypothesis is a well-formed tree with exactly one leaf per word (no repair needed;
the model needs a word-level vocabulary, tokenizer_kind: word). --unconstrained is the paper's plain beam
search, whose output is repaired into a tree.

examples:
  D=../shared/data/treebank-sample/combined
  vaswani-tx parse run configs/train/wsj-parse-cpu.yaml --train "$D/wsj_00*.mrg" "$D/wsj_01[0-5]?.mrg" \\
      --dev "$D/wsj_016?.mrg" --test "$D/wsj_017?.mrg"
  vaswani-tx parse predict runs/wsj-parse-cpu/averaged --trees "$D/wsj_017?.mrg" -o parsed.txt
  echo "The stock rose 5 % yesterday ." | vaswani-tx parse predict runs/wsj-parse-cpu/averaged --sentences -
  vaswani-tx parse score runs/wsj-parse-cpu/test.gold runs/wsj-parse-cpu/test.parsed
"""

from __future__ import annotations

import argparse

from vaswani_tx.cli import fail

UNCONSTRAINED_HELP = (
    "plain beam search, as the paper, repaired into a tree afterwards (default: constrained decoding, every "
    "hypothesis a well-formed tree with one leaf per word)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.set_defaults(overrides=[])
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    run_parser = sub.add_parser("run", help="linearise a treebank split, train, parse the test split, score")
    run_parser.add_argument("config", help="run config (YAML), e.g. configs/train/wsj-parse-cpu.yaml")
    run_parser.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="override a config key, e.g. max_steps=100"
    )
    run_parser.add_argument(
        "--train", nargs="+", required=True, metavar="TREES", help="training treebank files or globs"
    )
    run_parser.add_argument(
        "--dev", nargs="+", required=True, metavar="TREES", help="development treebank files or globs"
    )
    run_parser.add_argument(
        "--test", nargs="+", required=True, metavar="TREES", help="test treebank files or globs (parsed and scored)"
    )
    run_parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in output_dir")
    run_parser.add_argument(
        "--force",
        action="store_true",
        help="start a new run in an output_dir holding another run's results (see train)",
    )
    run_parser.add_argument(
        "--num-beams", type=int, help="beam size for the test set (default: the model's generation config)"
    )
    run_parser.add_argument("--max-length", type=int, help="score only test sentences of at most this many words")
    run_parser.add_argument("--unconstrained", action="store_true", help=UNCONSTRAINED_HELP)

    predict = sub.add_parser("predict", help="parse sentences with a trained model")
    predict.add_argument("model", help="a model folder with its tokenizer")
    source = predict.add_mutually_exclusive_group(required=True)
    source.add_argument("--sentences", help="file of tokenised sentences, one per line (- for standard input)")
    source.add_argument(
        "--trees", nargs="+", metavar="TREES", help="treebank files or globs: parse their sentences and score"
    )
    predict.add_argument(
        "-o", "--output", metavar="FILE", help="write the trees here, one per line (default: print them)"
    )
    predict.add_argument(
        "--force", action="store_true", help="replace an existing --output file (once all are parsed)"
    )
    predict.add_argument("--num-beams", type=int, help="beam size (default: the model's generation config)")
    predict.add_argument("--batch-size", type=int, default=32, help="sentences per generate() call (default 32)")
    predict.add_argument("--unconstrained", action="store_true", help=UNCONSTRAINED_HELP)
    predict.add_argument(
        "--truncate",
        action="store_true",
        help="cut a sentence longer than the model's positions to fit, with a warning (default: refuse it)",
    )

    score = sub.add_parser("score", help="EVALB bracketing scores of predicted trees against gold trees")
    score.add_argument("gold", help="gold treebank file")
    score.add_argument("predicted", help="predicted treebank file, same sentences in the same order")
    score.add_argument("--max-length", type=int, help="score only sentences of at most this many words (EVALB: 40)")


def _move_overrides(args: argparse.Namespace) -> None:
    """``--test T.. max_steps=10``: the options' nargs="+" took the key=value items; give them back."""
    import re

    for name in ("train", "dev", "test"):
        values = getattr(args, name)
        keep = [value for value in values if not re.match(r"^\w+=", value)]
        args.overrides = [*args.overrides, *(value for value in values if value not in keep)]
        setattr(args, name, keep)


def _print_scores(scores: dict) -> None:
    print(
        f"bracketing F1 {scores['f1']:.2f}  precision {scores['precision']:.2f}  recall {scores['recall']:.2f}  "
        f"exact match {scores['exact_match']:.2f}  ({scores['sentences']} sentences, "
        f"{scores['matched_brackets']}/{scores['gold_brackets']} gold brackets found, "
        f"{scores['predicted_brackets']} predicted; EVALB COLLINS.prm conventions)"
    )


def run(args: argparse.Namespace) -> int:
    import json
    import logging
    import sys

    from vaswani_tx.metrics.evaluation import read_lines
    from vaswani_tx.model.errors import UserInputError
    from vaswani_tx.parsing import parsing
    from vaswani_tx.parsing.parse_run import run_recipe
    from vaswani_tx.parsing.tree_decoding import parse
    from vaswani_tx.training.recipe import end_distributed
    from vaswani_tx.training.training import ReturnFreedMemory

    for option in ("num_beams", "batch_size", "max_length"):
        value = getattr(args, option, None)
        if value is not None and value < 1:
            return fail("parse", f"--{option.replace('_', '-')} must be >= 1, got {value}")
    if args.action == "run":
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
        _move_overrides(args)
        try:
            metrics = run_recipe(
                args.config,
                args.train,
                args.dev,
                args.test,
                args.overrides,
                resume=args.resume,
                force=args.force,
                callbacks=[ReturnFreedMemory()],  # the command owns its process: glibc's settings are its own
                num_beams=args.num_beams,
                max_length=args.max_length,
                constrained=not args.unconstrained,
            )
        finally:
            end_distributed()
        if "parse" in metrics:
            print(json.dumps(metrics, indent=1))
            scores = metrics["parse"]
            _print_scores(scores)
            if "f1_40" in scores:
                print(f"bracketing F1 of sentences of <= 40 words {scores['f1_40']:.2f}")
            print(
                f"{'constrained' if scores['constrained'] else 'unconstrained'} beam {scores['num_beams']}; "
                f"{scores['seconds'] / 60:.1f} minutes for training and parsing"
            )
    elif args.action == "predict":
        gold = parsing.read_treebank(args.trees) if args.trees else None
        if args.output:
            from vaswani_tx.folders import check_writable, refuse_to_replace

            check_writable(args.output, "file")
            refuse_to_replace([args.output], args.force)
        if gold:
            sentences = [tree.words() for tree in gold]
        elif args.sentences == "-":
            sentences = [line.split() for line in sys.stdin.read().splitlines()]
        else:
            sentences = [line.split() for line in read_lines(args.sentences)]
        if not any(sentences):
            raise UserInputError(f"{args.sentences or 'the treebank'} holds no sentence to parse")
        if not all(sentences):
            blank = next(number for number, words in enumerate(sentences, start=1) if not words)
            raise UserInputError(f"{args.sentences}, line {blank}: empty; give one tokenised sentence per line")
        trees = parse(
            args.model,
            sentences,
            num_beams=args.num_beams,
            batch_size=args.batch_size,
            constrained=not args.unconstrained,
            truncate=args.truncate,
        )
        if args.output:
            parsing.write_trees(trees, args.output)
        else:
            print("".join(f"{tree}\n" for tree in trees), end="")
        if gold:
            _print_scores(parsing.bracket_f1(gold, trees))
    else:
        gold = parsing.read_treebank(args.gold)
        predicted = parsing.read_treebank(args.predicted)
        if len(gold) != len(predicted):
            raise UserInputError(f"{args.gold} has {len(gold)} trees but {args.predicted} has {len(predicted)}")
        _print_scores(parsing.bracket_f1(gold, predicted, max_length=args.max_length))
    return 0
