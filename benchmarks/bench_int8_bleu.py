"""BLEU cost and speed of int8 inference on Multi30k val: ours in float32 and int8 (`quantize_int8`),
and the CTranslate2 export (`export_ct2`) in float32 and int8, all on the trained model.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_int8_bleu.py \
        [--model runs/multi30k-en-de/averaged] [--data ../shared/data/multi30k-en-de] [--limit N] [--num-beams 4]

Ours decodes with `vaswani_tx.translation.Translator` (the paper's Section 6.1 settings from the saved
generation config: beam 4, GNMT length penalty 0.6, source length + 50; sentences in length order,
batches of 64), with the model passed in so that it can be quantized first. CTranslate2 decodes with
the options the export writes (`ct2_decoding_options`: beam 4, length penalty 0.6 in the |Y|^alpha
form, one length limit per batch), same batches. Scores are the package's sacreBLEU
(`vaswani_tx.evaluation.score`). Times are wall-clock seconds for the whole set with `--threads`
threads, on a shared machine: compare within one run. Appends to benchmarks/results/int8_bleu.jsonl
and prints a table (also appended to benchmarks/results/int8_bleu.out.txt). The model folder is only read.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"


def batches(tokenizer, sentences: list[str], batch_size: int) -> list[list[int]]:
    """The batches `vaswani_tx.translation.Translator` makes (length order, at most `batch_size` sentences)."""
    from vaswani_tx.translation import plan_batches

    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    return plan_batches(lengths, max_tokens=10**9, max_sentences=batch_size)


def translate_ct2(
    folder: Path, tokenizer, sentences: list[str], num_beams: int, batch_size: int, threads: int
) -> list[str]:
    import ctranslate2

    from vaswani_tx.export import ct2_decoding_options

    translator = ctranslate2.Translator(str(folder), device="cpu", inter_threads=1, intra_threads=threads)
    outputs = [""] * len(sentences)
    for indices in batches(tokenizer, sentences, batch_size):
        sources = [tokenizer.convert_ids_to_tokens(tokenizer(sentences[i])["input_ids"]) for i in indices]
        options = {**ct2_decoding_options(folder, sources), "beam_size": num_beams}
        results = translator.translate_batch(sources, **options)
        for i, result in zip(indices, results):
            ids = tokenizer.convert_tokens_to_ids(result.hypotheses[0])
            outputs[i] = tokenizer.decode(ids, skip_special_tokens=True).strip()
    return outputs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "runs" / "multi30k-en-de" / "averaged")
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "multi30k-en-de")
    parser.add_argument("--limit", type=int, default=None, help="first N val sentences only (default: all)")
    parser.add_argument("--num-beams", type=int, default=4, help="beam size (default 4, the paper's; 1 = greedy)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from vaswani_tx.evaluation import read_lines, score
    from vaswani_tx.export import export_ct2
    from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
    from vaswani_tx.quantization import quantize_int8
    from vaswani_tx.tokenization import load_tokenizer
    from vaswani_tx.translation import Translator

    torch.set_num_threads(args.threads)
    sources = read_lines(args.data / "val.en")[: args.limit]
    references = read_lines(args.data / "val.de")[: args.limit]
    tokenizer = load_tokenizer(args.model)
    float_model = VaswaniForConditionalGeneration.from_pretrained(args.model).eval()
    ours_options = {"lines": sources, "num_beams": args.num_beams, "max_tokens": 10**9, "batch_size": args.batch_size}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ct2 = {q: export_ct2(args.model, Path(tmp) / f"ct2-{q}", quantization=q) for q in (None, "int8")}
        runs = {
            "ours": lambda: Translator(float_model, tokenizer).translate(**ours_options),
            "ours-int8": lambda: Translator(quantize_int8(float_model), tokenizer).translate(**ours_options),
            "ct2": lambda: translate_ct2(ct2[None], tokenizer, sources, args.num_beams, args.batch_size, args.threads),
            "ct2-int8": lambda: translate_ct2(
                ct2["int8"], tokenizer, sources, args.num_beams, args.batch_size, args.threads
            ),
        }
        for name, run in runs.items():
            start = time.perf_counter()
            hypotheses = run()
            seconds = time.perf_counter() - start
            bleu = score(hypotheses, references, target_lang="de")
            rows.append(
                {
                    "model": name,
                    "sacrebleu": bleu["sacrebleu"],
                    "signature": bleu["sacrebleu_signature"],
                    "seconds": seconds,
                    "sentences": len(sources),
                    "num_beams": args.num_beams,
                    "threads": args.threads,
                    "model_dir": str(args.model),
                }
            )
            print(f"{name:10} BLEU {bleu['sacrebleu']:.2f}  {seconds:.1f} s", flush=True)
    base = {r["model"]: r for r in rows}
    lines = [
        f"# Multi30k val, {len(sources)} sentences, beam {args.num_beams}, {args.threads} thread(s), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"{'model':10} {'sacreBLEU':>9} {'vs float':>9} {'seconds':>8} {'speed vs ct2-int8':>18}",
    ]
    for r in rows:
        reference = "ours" if r["model"].startswith("ours") else "ct2"
        lines.append(
            f"{r['model']:10} {r['sacrebleu']:>9.2f} {r['sacrebleu'] - base[reference]['sacrebleu']:>+9.2f} "
            f"{r['seconds']:>8.1f} {base['ct2-int8']['seconds'] / r['seconds']:>17.2f}x"
        )
    lines.append(f"signature: {rows[0]['signature']}")
    text = "\n".join(lines)
    print(text)
    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / "int8_bleu.jsonl", "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(args.results / "int8_bleu.out.txt", "a") as f:
        f.write(text + "\n\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
