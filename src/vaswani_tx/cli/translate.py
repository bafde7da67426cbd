"""Translate with a trained model folder and, given references, score it (paper Section 6.1 decoding).

Decoding uses the model's generation config (the paper's beam 4, length penalty 0.6, at most source
length + 50 tokens) unless --num-beams is given. With --reference the output is scored with sacreBLEU,
chrF and the paper's tokenized BLEU, and each signature is printed next to its score.

examples:
  vaswani-tx translate runs/multi30k-en-de/averaged "A man rides a bike." "Two dogs play in the snow."
  vaswani-tx translate MODEL --source val.en --reference val.de --target-lang de --output hyp.de
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="a model folder with its tokenizer (e.g. the output of average-checkpoints)")
    parser.add_argument("sentences", nargs="*", help="sentences to translate (or use --source)")
    parser.add_argument("--source", help="file of source sentences, one per line")
    parser.add_argument("--reference", help="file of reference translations, line-aligned with --source: score the output")
    parser.add_argument("--target-lang", default="de", help="target language code for scoring (default de)")
    parser.add_argument("--output", help="write the translations to this file")
    parser.add_argument("--num-beams", type=int, help="beam size (default: the model's generation config, the paper's 4)")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per generate() call (default 64)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vaswani_tx.evaluation import read_lines, score
    from vaswani_tx.training import translate

    if bool(args.sentences) == bool(args.source):
        raise SystemExit("translate: give sentences or --source FILE (one of the two)")
    if args.reference and not args.source:
        raise SystemExit("translate: --reference needs --source")
    sources = read_lines(args.source) if args.source else list(args.sentences)
    try:
        hypotheses = translate(args.model, sources, num_beams=args.num_beams, batch_size=args.batch_size)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"translate: {err}") from None
    if args.output:
        Path(args.output).write_text("".join(h + "\n" for h in hypotheses), encoding="utf-8")
    if args.reference:
        references = read_lines(args.reference)
        if len(references) != len(hypotheses):
            raise SystemExit(f"translate: {len(hypotheses)} source lines but {len(references)} reference lines")
        results = score(hypotheses, references, args.target_lang)
        print(f"sacreBLEU {results['sacrebleu']:.2f}  {results['sacrebleu_signature']}")
        print(f"chrF      {results['chrf']:.2f}  {results['chrf_signature']}")
        print(f"tokenized BLEU {results['tokenized_bleu']:.2f}  {results['tokenized_bleu_signature']}")
    else:
        for source, hypothesis in zip(sources, hypotheses):
            print(f"{source}\n  -> {hypothesis}")
    return 0
