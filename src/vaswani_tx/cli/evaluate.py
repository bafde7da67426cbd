"""Translate a test set with a saved model and score it: sacreBLEU and chrF with their signatures, and
the paper's tokenized BLEU (Section 6.1), each labelled: the two BLEUs count different tokens and are
not comparable. Hypotheses and all scores are saved (DIR/NAME.hyp.LANG, DIR/NAME.scores.json); existing
ones are refused before decoding, or with --force replaced once both new files are complete.

The test set is a pair of line-aligned files (several --reference files for several references each)
or WMT14 from the Hugging Face Hub as `datasets` loads it (newstest2014 is split `test`, newstest2013
`validation`, the paper's dev set).

examples:
  vaswani-tx evaluate runs/multi30k-en-de/averaged --source val.en --reference val.de
  vaswani-tx evaluate MODEL --wmt14 en-de --split test --output-dir eval/base
  vaswani-tx evaluate MODEL -s newstest2013.en -r newstest2013.de --num-beams 1 --device cuda
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from vaswani_tx.cli import fail
from vaswani_tx.cli.translate import add_decoding_arguments, check_decoding_arguments, decoding_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "model", help="a model folder with its tokenizer (train, average-checkpoints or save_pretrained output)"
    )
    test_set = parser.add_argument_group("test set (files, or --wmt14)")
    test_set.add_argument("-s", "--source", metavar="FILE", help="UTF-8 source sentences, one per line")
    test_set.add_argument(
        "-r",
        "--reference",
        metavar="FILE",
        action="append",
        help="UTF-8 references, line-aligned with --source (repeat for several references)",
    )
    test_set.add_argument(
        "--wmt14", metavar="SRC-TGT", help="WMT14 from the Hub through `datasets`, e.g. en-de or en-fr"
    )
    test_set.add_argument(
        "--split",
        default="test",
        choices=["test", "validation"],
        help="WMT14 split: test = newstest2014 (default), validation = newstest2013",
    )
    scoring = parser.add_argument_group("scoring")
    scoring.add_argument(
        "--target-lang", help="target language code (default: the reference file's suffix, or --wmt14's)"
    )
    scoring.add_argument(
        "--compound-splitting",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split hyphenated compounds as ##AT##-##AT## for tokenized BLEU (default: for German only)",
    )
    parser.add_argument(
        "-o",
        "--output-dir",
        metavar="DIR",
        default="evaluation",
        help="where hypotheses and scores are saved (default: ./evaluation)",
    )
    parser.add_argument(
        "--name", help="test set name in file names (default: the source file's stem, or newstest2014/2013)"
    )
    parser.add_argument(
        "--force", action="store_true", help="replace existing hypotheses and scores of this name (once both are done)"
    )
    add_decoding_arguments(parser)


def _test_set(args: argparse.Namespace) -> tuple[str, str, list[str], list[list[str]]]:
    """(name, target language, sources, references per sentence) from the arguments."""
    from vaswani_tx.metrics.evaluation import read_references, read_text
    from vaswani_tx.model.errors import UserInputError

    if bool(args.wmt14) == bool(args.source):
        raise UserInputError("give either --source and --reference files or --wmt14 SRC-TGT")
    if args.wmt14:
        from vaswani_tx.data.data import load_wmt14

        source_lang, _, target_lang = args.wmt14.partition("-")
        data = load_wmt14(
            source_lang,
            target_lang,
            split=args.split,
            local_files="-s/--source and -r/--reference files (the test set as plain text, one sentence a line)",
        )
        name = {"test": "newstest2014", "validation": "newstest2013"}[args.split]
        return name, args.target_lang or target_lang, list(data["source"]), [[t] for t in data["target"]]
    if not args.reference:
        raise UserInputError("--source needs at least one --reference file to score against")
    sources = read_text(args.source)
    references = read_references(args.reference, len(sources), f"source file {args.source}")
    target_lang = args.target_lang or Path(args.reference[0]).suffix.lstrip(".")
    if not (target_lang.isalpha() and len(target_lang) == 2):  # ISO 639-1, as sacreBLEU and Moses take it
        raise UserInputError(f"cannot tell the target language from {args.reference[0]}: give --target-lang (e.g. de)")
    name = args.name or Path(args.source).stem
    return name, target_lang, sources, references


def run(args: argparse.Namespace) -> int:
    from vaswani_tx.atomic import atomic_file
    from vaswani_tx.engine.settings import as_generate_reads
    from vaswani_tx.engine.translation import load_translator
    from vaswani_tx.folders import check_writable, refuse_to_replace
    from vaswani_tx.metrics.evaluation import score
    from vaswani_tx.model.errors import UserInputError

    problem = check_decoding_arguments(args)
    if problem:
        return fail("evaluate", problem)
    check_writable(args.output_dir)  # before any decoding: an unwritable folder would lose it all
    name, target_lang, sources, references = _test_set(args)
    if not sources:
        raise UserInputError("the test set is empty")
    if not any(line.strip() for line in sources):
        raise UserInputError(f"the test set's {len(sources)} source lines are all blank: nothing to translate")
    output_dir = Path(args.output_dir)
    if not output_dir.is_dir() and (".hyp" in output_dir.name or output_dir.suffix == f".{target_lang}"):
        raise UserInputError(
            f"-o/--output-dir is the folder evaluate writes NAME.hyp.{target_lang} and NAME.scores.json into, and "
            f"{output_dir} looks like a file name: give a folder (-o eval), or write one file of translations "
            f"with `vaswani-tx translate MODEL -i SOURCE -o {output_dir}`"
        )
    hypothesis_file = output_dir / f"{name}.hyp.{target_lang}"
    scores_file = output_dir / f"{name}.scores.json"
    refuse_to_replace([hypothesis_file, scores_file], args.force)
    translator = load_translator(args.model, device=args.device, dtype=args.dtype, int8=args.int8)
    options = decoding_options(args)
    start = time.perf_counter()
    hypotheses = translator.translate(sources, **options)
    seconds = time.perf_counter() - start
    results = score(hypotheses, references, target_lang, args.compound_splitting)

    generation = as_generate_reads(translator.model.generation_config)
    beams = options["num_beams"] or generation.num_beams
    greedy = beams == 1  # greedy search has no length penalty: none is recorded
    alpha = options["length_penalty"] if options["length_penalty"] is not None else generation.length_penalty
    settings = {
        "model": str(args.model),
        "test_set": name,
        "sentences": len(sources),
        "target_lang": target_lang,
        "num_beams": beams,
        "length_penalty": None if greedy else alpha,
        "length_penalty_type": None if greedy else getattr(generation, "length_penalty_type", "hf"),
        "max_output_length_offset": args.max_length_offset
        if args.max_length_offset is not None
        else getattr(generation, "max_output_length_offset", None),
        "device": str(translator.device),
        "dtype": str(translator.model.dtype).removeprefix("torch."),
        "int8": args.int8,
        "truncate": args.truncate,
        "decoding_seconds": round(seconds, 2),
        "hypotheses": str(hypothesis_file),
    }
    # both written in full before either replaces anything: a full disk or a Ctrl-C leaves the earlier pair
    with atomic_file(hypothesis_file) as hypotheses_partial, atomic_file(scores_file) as scores_partial:
        hypotheses_partial.write_text("".join(f"{line}\n" for line in hypotheses), encoding="utf-8")
        scores_partial.write_text(
            json.dumps({**settings, **results}, indent=1, default=float) + "\n", encoding="utf-8"
        )
    print(
        f"{name}: {len(sources)} sentences, "
        + ("greedy (1 beam, no length penalty)" if greedy else f"{beams} beams, alpha {alpha}")
        + f", {seconds:.1f} s"
    )
    print(f"sacreBLEU      {results['sacrebleu']:6.2f}  {results['sacrebleu_signature']}")
    print(
        f"  lowercased   {results['sacrebleu_lowercase']:6.2f}  {results['sacrebleu_lowercase_signature']}  "
        "(Multi30k papers score lowercased text)"
    )
    print(f"chrF           {results['chrf']:6.2f}  {results['chrf_signature']}")
    print(
        f"tokenized BLEU {results['tokenized_bleu']:6.2f}  {results['tokenized_bleu_signature']}  "
        "(the paper's Table 2 kind; not comparable with sacreBLEU)"
    )
    print(f"hypotheses: {hypothesis_file}\nscores: {scores_file}")
    return 0
