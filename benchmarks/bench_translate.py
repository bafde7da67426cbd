"""Translating real test sets with a trained model: ours (through `translate` and through `pipeline`) against
CTranslate2 (`translate_batch` on the same weights, exported with `vaswani-tx export-ct2`), in one run.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_translate.py runs/multi30k-en-de/averaged \\
        [--data ../shared/data] [--threads 1 2] [--sets multi30k newstest2013] [--limit N] [--rounds 3] \\
        [--one-at-a-time] [--num-beams K]

Sets: Multi30k val (1,014 sentences, the main job's domain) and newstest2013 (3,000, WMT news: out of the main
job's domain, so its BLEU is low, but its sentences are long, which is what the timing needs).
Implementations, each in a fresh process (nothing warm), each decoding with the model's saved settings
(beam 4, alpha 0.6, source length + 50):
- translate:       `Translator.translate` (what `vaswani-tx translate MODEL -i FILE` runs), float32, on the model
                   saved afresh (the engine serves generate(): the default path);
- translate-hf:    the same through transformers' own loops (`use_engine=False`): what the engine buys;
- translate-stay:  the engine with every sentence kept in the batch to the end (a no-op logits processor of the
                   caller's, which the engine cannot follow row by row): what finished sentences leaving buys;
- translate-auto:  the same with `--dtype auto` (bfloat16 where the CPU has bf16 instructions);
- translate-int8:  the same with `--int8`;
- pipeline:        `pipeline("translation", model=MODEL, trust_remote_code=True)` on the whole list: its own batching,
                   longest first, 32 sentences a batch (its default; translate and ct2 get 4,096 padded tokens);
- ct2, ct2-int8:   CTranslate2 `translate_batch` with `ct2_decoding_options` (its length penalty is |Y|^alpha,
                   not the GNMT form: the one difference in settings), float32 and int8 (its best CPU types;
                   CTranslate2 offers no bfloat16 on CPU).
`--num-beams K`: every implementation decodes with beam K instead of the saved one (1: greedy search; the other
saved settings stay).
`--one-at-a-time`: each implementation is given the set a sentence per call (a service translating requests as they
come; one row a call, or the beam's rows), rather than the whole list to batch as it likes.
Per job: sentences/s and tokens/s (output subword tokens, counted with the model's tokenizer for every
implementation, over the translation time, model loading excluded), the first sentence's latency in a fresh
process (from the model loaded to the first translation back), the load time, the process' peak memory
(VmHWM), and the cased sacreBLEU of the output (13a). Results are appended to
benchmarks/results/translate.jsonl and printed as a table with the CPU's flags and the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_speed import machine as speed_machine  # this folder's: the same measurement processes
from bench_speed import peak_rss_mib, worker_env

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SETS = {
    "multi30k": ("multi30k-en-de/val.en", "multi30k-en-de/val.de"),
    "newstest2013": ("newstest2013-en-de/dev.en", "newstest2013-en-de/dev.de"),
}
IMPLEMENTATIONS = (
    "translate", "translate-hf", "translate-stay", "translate-auto", "translate-int8", "pipeline", "ct2", "ct2-int8"
)  # fmt: skip


def read_lines(path: Path, limit: int | None) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return lines[:limit] if limit else lines


# ---- one job, in its own process ------------------------------------------------------------------------


def load(job: dict):
    """The implementation's translate function, lines -> hypotheses, and the tokenizer that counts tokens."""
    import torch
    from transformers import AutoTokenizer

    import vaswani_tx

    vaswani_tx.register_auto_classes()  # the tokenizer's and model's classes, without trust_remote_code's prompt
    torch.set_num_threads(job["threads"])
    impl, model = job["impl"], job["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    beams = {} if job.get("num_beams") is None else {"num_beams": job["num_beams"]}
    if impl.startswith("translate"):
        from vaswani_tx.engine.translation import load_translator

        dtype = "auto" if impl == "translate-auto" else None
        translator = load_translator(model, device="cpu", dtype=dtype, int8=impl == "translate-int8")
        if impl == "translate-hf":
            beams["use_engine"] = False
        if impl == "translate-stay":
            beams["processors_for"] = lambda indices: [lambda input_ids, scores: scores]
        return (lambda lines: translator.translate(lines, progress=False, **beams)), tokenizer
    if impl == "pipeline":
        from transformers import pipeline

        translator = pipeline("translation", model=model, trust_remote_code=True, device="cpu")

        def translate(lines):
            if len(lines) == 1:  # a string, as a caller with one sentence gives it
                return [translator(lines[0], **beams)[0]["translation_text"]]
            return [out["translation_text"] for out in translator(lines, **beams)]

        return translate, tokenizer
    import ctranslate2

    from vaswani_tx.interop.export import ct2_decoding_options

    folder = job["ct2"]
    compute_type = "int8" if impl == "ct2-int8" else "float32"
    translator = ctranslate2.Translator(folder, device="cpu", compute_type=compute_type, intra_threads=job["threads"])

    def translate(lines):
        sources = [tokenizer.convert_ids_to_tokens(tokenizer(line).input_ids) for line in lines]
        options = ct2_decoding_options(folder, sources)
        if beams:
            options["beam_size"] = beams["num_beams"]
        results = translator.translate_batch(sources, max_batch_size=4096, batch_type="tokens", **options)
        ids = [tokenizer.convert_tokens_to_ids(r.hypotheses[0]) for r in results]
        return tokenizer.batch_decode(ids, skip_special_tokens=True)

    return translate, tokenizer


def worker(job: dict) -> None:
    start = time.perf_counter()
    translate, tokenizer = load(job)
    loaded = time.perf_counter()
    lines = read_lines(Path(job["source"]), job["limit"])
    first = translate(lines[:1])  # a fresh process' first sentence: every lazy set-up it needs included
    first_s = time.perf_counter() - loaded
    start_all = time.perf_counter()
    if job.get("one_at_a_time"):
        hypotheses = [hypothesis for line in lines for hypothesis in translate([line])]
    else:
        hypotheses = translate(lines)
    seconds = time.perf_counter() - start_all
    tokens = sum(len(tokenizer(h, add_special_tokens=False).input_ids) + 1 for h in hypotheses)  # + </s>
    import sacrebleu

    references = read_lines(Path(job["reference"]), job["limit"])
    print(
        json.dumps(
            {
                "load_s": round(loaded - start, 2),
                "first_sentence_s": round(first_s, 3),
                "first": first[0],
                "seconds": round(seconds, 2),
                "sentences_per_s": round(len(lines) / seconds, 2),
                "tokens_per_s": round(tokens / seconds, 1),
                "bleu": round(sacrebleu.corpus_bleu(hypotheses, [references]).score, 2),
                "peak_rss_mib": round(peak_rss_mib()),
            }
        )
    )


def run_job(job: dict) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        env=worker_env(job["threads"]),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"job {job['impl']} on {job['set']} failed:\n{done.stderr[-3000:]}")
    return {**job, **json.loads(done.stdout.strip().splitlines()[-1])}


# ---- the run ------------------------------------------------------------------------------------------------


def save_afresh(model_folder: str, tmp: Path) -> Path:
    """The model saved with this tree's code (what `trust_remote_code` runs: the pipeline's)."""
    from transformers import AutoTokenizer

    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration

    folder = tmp / "model"
    VaswaniForConditionalGeneration.from_pretrained(model_folder).save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_folder).save_pretrained(folder)
    return folder


def machine(threads: list[int]) -> dict:
    """bench_speed's description of the machine, with the CPU's vector and matrix flags and its bf16 instructions."""
    from vaswani_tx.engine.precision import cpu_bf16_instructions

    flags = []
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as cpuinfo:
        line = next(line for line in cpuinfo if line.startswith("flags"))
        flags = [f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma"))]
    return {**speed_machine(threads), "flags": flags, "bf16_instructions": cpu_bf16_instructions()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", nargs="?", help="a trained model folder (the main job's: runs/multi30k-en-de/averaged)"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--sets", nargs="+", default=list(SETS), choices=SETS)
    parser.add_argument("--impls", nargs="+", default=list(IMPLEMENTATIONS), choices=IMPLEMENTATIONS)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--limit", type=int, help="the first N sentences of each set only")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run each setting's implementations this many times, alternating"
    )
    parser.add_argument(
        "--one-at-a-time", action="store_true", help="give each implementation one sentence a call (a service's load)"
    )
    parser.add_argument("--num-beams", type=int, help="decode with this beam instead of the saved one (1: greedy)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if not args.model:
        parser.error("give the model folder")
    from vaswani_tx.interop.export import export_ct2

    about = machine(args.threads)
    print(json.dumps(about))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ct2 = Path(tmp) / "ct2"
        export_ct2(args.model, ct2)
        saved = save_afresh(args.model, Path(tmp))
        for name in args.sets:
            source, reference = (str(args.data / part) for part in SETS[name])
            for threads, round_ in ((t, r) for t in args.threads for r in range(args.rounds)):
                for impl in args.impls:  # the implementations of one setting back to back: load hits them alike
                    job = dict(
                        impl=impl,
                        set=name,
                        threads=threads,
                        model=str(saved),
                        ct2=str(ct2),
                        source=source,
                        reference=reference,
                        limit=args.limit,
                        one_at_a_time=args.one_at_a_time,
                        num_beams=args.num_beams,
                    )
                    row = run_job(job)
                    row["load_average"], row["round"] = round(os.getloadavg()[0], 2), round_
                    rows.append(row)
                    calls = (" one a call" if args.one_at_a_time else "") + (
                        f" beam {args.num_beams}" if args.num_beams else ""
                    )
                    print(
                        f"{name:13} {threads}t {impl:15}{calls} {row['sentences_per_s']:7.2f} sent/s "
                        f"{row['tokens_per_s']:8.1f} tok/s  first {row['first_sentence_s']:5.2f} s  "
                        f"load {row['load_s']:5.2f} s  "
                        f"{row['peak_rss_mib']:5d} MiB  BLEU {row['bleu']:5.2f}  (load avg {row['load_average']})",
                        flush=True,
                    )
    args.results.mkdir(parents=True, exist_ok=True)
    with open(args.results / "translate.jsonl", "a", encoding="utf-8") as out:
        out.write(json.dumps({"machine": about, "rows": rows}) + "\n")
    print_ratios(rows)


def print_ratios(rows: list[dict]) -> None:
    """Each implementation's sentences/s over CTranslate2's at the same precision, set and threads."""
    peer = {
        "translate": "ct2",
        "translate-hf": "ct2",
        "translate-stay": "ct2",
        "pipeline": "ct2",
        "translate-auto": "ct2-int8",
        "translate-int8": "ct2-int8",
    }
    runs: dict[tuple, list[dict]] = {}
    for row in rows:
        runs.setdefault((row["set"], row["threads"], row["impl"]), []).append(row)
    print(
        "\nratio to CTranslate2 (sentences/s; the median of the rounds' ratios, each round's in brackets; "
        "translate-auto and translate-int8 against CTranslate2 int8):"
    )
    for (name, threads, impl), mine in runs.items():
        theirs = runs.get((name, threads, peer.get(impl, "")))
        if theirs:
            ratios = [a["sentences_per_s"] / b["sentences_per_s"] for a, b in zip(mine, theirs)]
            rounds = ", ".join(f"{ratio:.2f}" for ratio in ratios)
            print(
                f"{name:13} {threads}t {impl:15} {statistics.median(ratios):.2f}x "
                f"{theirs[0]['impl']} [{rounds}]  (BLEU {mine[0]['bleu']:.2f} vs {theirs[0]['bleu']:.2f})"
            )


if __name__ == "__main__":
    main()
