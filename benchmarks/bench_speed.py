"""Training and decoding speed of our Transformer against Hugging Face MarianMT and CTranslate2, in one run.

    PYTHONPATH=src .venv/bin/python benchmarks/bench_speed.py [--threads 1] [--repeats 3] [--new-tokens 32]

Both models have the paper's base shape (d_model 512, 6+6 layers, 8 heads, d_ff 2048, one shared
vocabulary of 37,000, ReLU, sinusoidal positions, scaled embeddings), random weights, float32.
MarianMT is `MarianMTModel` with that config; both go through the same transformers `generate()`.

Measured, each in a fresh process with warm-up excluded:
- training tokens/s: forward, backward and an Adam step on batches of 16 and 32 sentences of 8 to
  32 tokens per side; tokens = non-pad source + target tokens; plain cross-entropy for both; ours
  also with `skip_padding=False` ("ours-full"), which computes the padded positions as Marian does;
- decoding tokens/s: greedy and beam 4 at batch 1 and 32 (`--batches`), exactly `--new-tokens` new tokens per
  sentence (min = max), for ours (the default path: `generate()` served by the engine, vaswani_tx.engine),
  "ours-hf" (transformers' own loops, `use_engine=False`), "ours-bf16" (`--dtype auto`: bfloat16 where the CPU has
  bf16 instructions), "ours-int8" (the engine's int8 step), MarianMT, and CTranslate2 fed with each model (ours
  through `export_ct2`, Marian through CTranslate2's own Marian loader), float32 and int8;
- peak memory: the process' peak resident set size (model loaded, then the runs);
- a fresh process' first call: the model's load time ("load s") and its first `generate` / `translate_batch`
  call ("1st s", the warm-up run of `--new-tokens` tokens), each measurement being a new process.
Each figure is the median over `--repeats` timed runs (times `--rounds`), with min and max; the
implementations of one setting run back to back, and `--rounds` repeats the whole plan, so that load
from other processes on the machine hits all of them. Ratios are taken within
one run. Results are appended to benchmarks/results/speed.jsonl (with the machine's description)
and speed.out.txt, and plotted to benchmarks/results/speed.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
BASE = dict(vocab_size=37000, d_model=512, d_ff=2048, num_heads=8, num_encoder_layers=6, num_decoder_layers=6)
PAD, UNK, BOS, EOS = 0, 1, 2, 3
MARIAN_PAD = BASE["vocab_size"] - 1  # transformers' Marian keeps <pad> last, and CTranslate2's loader drops it
MAX_LENGTH = 32


# ---- the two models, saved once per run --------------------------------------------------------


def vocabulary(marian: bool = False) -> list[str]:
    """Our id order; Marian's has <pad> last (and an unused token at 0), so ids 1 .. V-2 are the same words in both."""
    words = [f"w{i}" for i in range(4, BASE["vocab_size"])]
    if marian:
        return ["<unused>", "<unk>", "<s>", "</s>"] + words[:-1] + ["<pad>"]
    return ["<pad>", "<unk>", "<s>", "</s>"] + words


def build_models(root: Path) -> dict[str, Path]:
    """Random base models (ours with a word-level tokenizer, Marian) and their CTranslate2 conversions."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import MarianConfig, MarianMTModel, PreTrainedTokenizerFast

    from vaswani_tx.interop.export import export_ct2
    from vaswani_tx.model.configuration_vaswani import VaswaniConfig
    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration

    torch.manual_seed(0)
    paths = {
        name: root / name for name in ("ours", "marian", "ct2-ours", "ct2-ours-int8", "ct2-marian", "ct2-marian-int8")
    }
    ours = VaswaniForConditionalGeneration(VaswaniConfig(**BASE))
    ours.save_pretrained(paths["ours"])
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocabulary())}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS)])
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(paths["ours"])
    export_ct2(paths["ours"], paths["ct2-ours"])
    export_ct2(paths["ours"], paths["ct2-ours-int8"], quantization="int8")
    marian = MarianMTModel(marian_config(MarianConfig)).eval()
    marian.save_pretrained(paths["marian"])
    for name, quantization in (("ct2-marian", None), ("ct2-marian-int8", "int8")):
        convert_marian_ct2(marian, paths[name], quantization)
    return paths


def marian_config(MarianConfig):
    return MarianConfig(
        vocab_size=BASE["vocab_size"],
        decoder_vocab_size=BASE["vocab_size"],
        d_model=BASE["d_model"],
        encoder_layers=BASE["num_encoder_layers"],
        decoder_layers=BASE["num_decoder_layers"],
        encoder_attention_heads=BASE["num_heads"],
        decoder_attention_heads=BASE["num_heads"],
        encoder_ffn_dim=BASE["d_ff"],
        decoder_ffn_dim=BASE["d_ff"],
        activation_function="relu",
        max_position_embeddings=512,
        scale_embedding=True,
        share_encoder_decoder_embeddings=True,
        pad_token_id=MARIAN_PAD,
        eos_token_id=EOS,
        decoder_start_token_id=MARIAN_PAD,
        forced_eos_token_id=None,
        dropout=0.1,
        attention_dropout=0.0,
        activation_dropout=0.0,
    )


def convert_marian_ct2(marian, out: Path, quantization: str | None) -> None:
    """CTranslate2's own MarianMT loader on the model; a stand-in tokenizer gives it the vocabulary
    (a real Marian tokenizer needs SentencePiece files that a random model does not have)."""
    from ctranslate2.converters.transformers import MarianMTLoader

    class Vocabulary:
        eos_token, unk_token, pad_token = "</s>", "<unk>", "<pad>"

        def get_vocab(self):
            return {t: i for i, t in enumerate(vocabulary(marian=True))}

    loader, tokenizer = MarianMTLoader(), Vocabulary()
    spec = loader.get_model_spec(marian)
    loader.set_config(spec.config, marian, tokenizer)
    loader.set_vocabulary(spec, loader.get_vocabulary(marian, tokenizer))
    spec.validate()
    spec.optimize(quantization=quantization)
    out.mkdir(parents=True, exist_ok=True)
    spec.save(str(out))


# ---- one measurement, in its own process -------------------------------------------------------


def batches(batch_size: int, count: int, seed: int = 0):
    """`count` (source, target) id batches, lengths 8..32 per side, padded with <pad>, each ending in </s>."""
    import torch

    g = torch.Generator().manual_seed(seed + batch_size)
    out = []
    for _ in range(count):
        sides = []
        for _side in range(2):
            lengths = torch.randint(8, MAX_LENGTH + 1, (batch_size,), generator=g)
            ids = torch.full((batch_size, int(lengths.max())), PAD)
            for row, n in enumerate(lengths.tolist()):
                ids[row, : n - 1] = torch.randint(
                    4, MARIAN_PAD, (n - 1,), generator=g
                )  # words both vocabularies share
                ids[row, n - 1] = EOS
            sides.append(ids)
        out.append(tuple(sides))
    return out


def pad_for(model: str, ids):
    return ids.masked_fill(ids == PAD, MARIAN_PAD) if model == "marian" else ids


def load_torch_model(kind: str, paths: dict[str, str], train: bool):
    if kind == "marian":
        from transformers import MarianMTModel

        model = MarianMTModel.from_pretrained(paths["marian"])
    else:
        from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration

        # "ours-full" computes padded positions too (skip_padding=False): what skipping them buys.
        kwargs = dict(skip_padding=kind != "ours-full")
        if kind == "ours-bf16":  # --dtype auto: bfloat16 where the CPU has bf16 instructions, else float32; loaded
            from vaswani_tx.engine.precision import (
                decoding_dtype,  # so, as translate does, with the folder's step for it
            )

            kwargs["dtype"] = decoding_dtype("auto")
        model = VaswaniForConditionalGeneration.from_pretrained(paths["ours"], **kwargs)
    return model.train(train)


def measure_training(job: dict, paths: dict[str, str]) -> list[float]:
    import torch

    model = load_torch_model(job["model"], paths, train=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)  # Section 5.3
    speeds = []
    for step, (source, target) in enumerate(batches(job["batch"], job["repeats"] + 1)):
        labels = target.masked_fill(target == PAD, -100)
        tokens = int((source != PAD).sum() + (target != PAD).sum())
        mask = (source != PAD).long()
        source = pad_for(job["model"], source)
        start = time.perf_counter()
        loss = model(input_ids=source, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:  # the first step is warm-up
            speeds.append(tokens / (time.perf_counter() - start))
    return speeds


def measure_decoding(job: dict, paths: dict[str, str]) -> list[float]:
    import torch

    source = batches(job["batch"], 1, seed=1)[0][0]
    new_tokens, beams = job["new_tokens"], job["beams"]
    loading = time.perf_counter()
    if job["model"].startswith("ct2"):
        import ctranslate2

        translator = ctranslate2.Translator(
            paths[job["model"]], device="cpu", inter_threads=1, intra_threads=job["threads"]
        )
        words = vocabulary()
        tokens = [[words[i] for i in row.tolist() if i != PAD] for row in source]

        def decode():
            result = translator.translate_batch(
                tokens,
                beam_size=beams,
                max_decoding_length=new_tokens,
                min_decoding_length=new_tokens,
                max_batch_size=0,
            )
            assert all(len(r.hypotheses[0]) == new_tokens for r in result)
    else:
        model = load_torch_model(job["model"], paths, train=False)
        mask = (source != PAD).long()
        source = pad_for(job["model"], source)

        extra = {}
        if job["model"] == "ours-hf":  # transformers' own greedy and beam search loops
            extra = {"use_engine": False}
        if job["model"] == "ours-int8":  # the engine's int8 step, made once (the weights quantized)
            from vaswani_tx.engine import Translator

            extra = {"translator": Translator(model, compute_type="int8")}

        def decode():
            with torch.inference_mode():
                out = model.generate(
                    input_ids=source,
                    attention_mask=mask,
                    num_beams=beams,
                    do_sample=False,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    **extra,
                )
            assert out.shape[1] == new_tokens + 1

    start = time.perf_counter()
    job["load_s"] = round(start - loading, 2)
    decode()  # warm-up: a fresh process' first call
    job["warmup_s"] = round(time.perf_counter() - start, 2)
    speeds = []
    for _ in range(job["repeats"]):
        start = time.perf_counter()
        decode()
        speeds.append(job["batch"] * new_tokens / (time.perf_counter() - start))
    return speeds


def worker(job: dict) -> None:
    import torch

    torch.set_num_threads(job["threads"])
    torch.manual_seed(0)
    paths = job["paths"]
    speeds = measure_training(job, paths) if job["task"] == "train" else measure_decoding(job, paths)
    print(
        json.dumps(
            {**{k: v for k, v in job.items() if k != "paths"}, "tokens_per_s": speeds, "peak_rss_mib": peak_rss_mib()}
        )
    )


def peak_rss_mib() -> float:
    """This process' peak resident memory. VmHWM, not getrusage's ru_maxrss, which execve keeps from the parent."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def worker_env(threads: int) -> dict:
    """A measurement process' environment: `threads` threads for torch, OpenMP and MKL; no warnings or logs."""
    return {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "TRANSFORMERS_VERBOSITY": "error",
        "PYTHONWARNINGS": "ignore",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_job(job: dict) -> dict:
    done = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(job)],
        env=worker_env(job["threads"]),
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise RuntimeError(f"measurement {job} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    speeds = result["tokens_per_s"]
    result.update(median=statistics.median(speeds), low=min(speeds), high=max(speeds))
    return result


# ---- the run ------------------------------------------------------------------------------------


def machine(threads: int) -> dict:
    import ctranslate2
    import torch
    import transformers

    cpu = platform.processor()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as cpuinfo:
        cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ctranslate2": ctranslate2.__version__,
        "python": platform.python_version(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def plan(args) -> list[dict]:
    """Measurements in run order: the compared implementations of one setting run back to back."""
    common = {"threads": args.threads, "repeats": args.repeats, "new_tokens": args.new_tokens}
    jobs = []
    if "train" in args.tasks:
        for batch in (16, 32):
            jobs += [
                {**common, "task": "train", "batch": batch, "beams": 0, "model": m, "repeats": args.train_repeats}
                for m in ("ours", "ours-full", "marian")
                if m in args.models
            ]
    for task, beams in (("greedy", 1), ("beam4", 4)):
        if task not in args.tasks:
            continue
        for batch in args.batches:
            jobs += [
                {**common, "task": task, "batch": batch, "beams": beams, "model": m}
                for m in MODELS
                if m in args.models and m != "ours-full"
            ]
    return jobs


MODELS = (
    "ours",
    "ours-hf",
    "ours-full",
    "marian",
    "ours-bf16",
    "ours-int8",
    "ct2-ours",
    "ct2-marian",
    "ct2-ours-int8",
    "ct2-marian-int8",
)
RATIOS = {
    "ours": "ct2-ours",
    "ours-hf": "ct2-ours",
    "ours-full": "marian",
    "marian": "ct2-ours",
    "ours-bf16": "ct2-ours-int8",
    "ours-int8": "ct2-ours-int8",
    "ct2-ours": "ct2-marian",
    "ct2-ours-int8": "ct2-marian-int8",
}


def merge_rounds(results: list[dict]) -> list[dict]:
    """One entry per (task, batch, model): the runs of every round together, the highest peak memory."""
    merged: dict[tuple, dict] = {}
    for r in results:
        key = (r["task"], r["batch"], r["model"])
        if key not in merged:
            merged[key] = {**r, "tokens_per_s": [], "rounds": 0, "peak_rss_mib": 0.0}
        m = merged[key]
        m["tokens_per_s"] += r["tokens_per_s"]
        m["rounds"] += 1
        m["peak_rss_mib"] = max(m["peak_rss_mib"], r["peak_rss_mib"])
    for m in merged.values():
        m.pop("round", None)
        m.update(median=statistics.median(m["tokens_per_s"]), low=min(m["tokens_per_s"]), high=max(m["tokens_per_s"]))
    return list(merged.values())


def table(results: list[dict]) -> str:
    by_key = {(r["task"], r["batch"], r["model"]): r for r in results}
    lines = [
        f"{'task':7} {'batch':>5} {'model':16} {'tokens/s median':>15} {'[min, max]':>20} {'peak MiB':>9} "
        f"{'load s':>6} {'1st s':>6}  ratio"
    ]
    for r in results:
        reference = RATIOS.get(r["model"])
        ratio = ""
        if reference and (r["task"], r["batch"], reference) in by_key:
            ratio = f"{r['median'] / by_key[(r['task'], r['batch'], reference)]['median']:.2f}x {reference}"
        spread = f"[{r['low']:.1f}, {r['high']:.1f}]"
        lines.append(
            f"{r['task']:7} {r['batch']:>5} {r['model']:16} {r['median']:>15.1f} {spread:>20} {r['peak_rss_mib']:>9.0f} "
            f"{r.get('load_s', float('nan')):>6.2f} {r.get('warmup_s', float('nan')):>6.2f}  {ratio}"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys((r["task"], r["batch"]) for r in results))
    models = list(dict.fromkeys(r["model"] for r in results))
    figure, axes = plt.subplots(1, len(settings), figsize=(3.2 * len(settings), 4), squeeze=False)
    for axis, setting in zip(axes[0], settings):
        rows = [r for r in results if (r["task"], r["batch"]) == setting]
        names = [r["model"] for r in rows]
        medians = [r["median"] for r in rows]
        errors = [[r["median"] - r["low"] for r in rows], [r["high"] - r["median"] for r in rows]]
        axis.bar(range(len(rows)), medians, yerr=errors, capsize=3, color=[f"C{models.index(n)}" for n in names])
        axis.set_xticks(range(len(rows)), names, rotation=60, ha="right", fontsize=7)
        axis.set_title(f"{setting[0]}, batch {setting[1]}", fontsize=9)
    axes[0][0].set_ylabel("tokens / s (median, min-max)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help="torch/CTranslate2 threads per measurement (default 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed decoding runs per measurement (default 3)")
    parser.add_argument(
        "--train-repeats", type=int, default=3, help="timed training steps per measurement (default 3)"
    )
    parser.add_argument(
        "--new-tokens", type=int, default=32, help="new tokens per sentence when decoding (default 32)"
    )
    parser.add_argument(
        "--tasks", nargs="+", default=["train", "greedy", "beam4"], choices=["train", "greedy", "beam4"]
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the whole plan this many times, interleaved; medians over all runs (default 1)",
    )
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS, help="default: all")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32], help="decoding batch sizes (default 1 32)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for speed.jsonl/.out.txt/.png")
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0

    args.results.mkdir(parents=True, exist_ok=True)
    description = machine(args.threads)
    print(json.dumps(description))
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: str(v) for k, v in build_models(Path(tmp)).items()}
        for round_ in range(args.rounds):
            for job in plan(args):
                result = run_job({**job, "paths": paths})
                print(
                    f"{result['task']:7} b{result['batch']:<3} {result['model']:16} {result['median']:9.1f} tok/s "
                    f"[{result['low']:.1f}, {result['high']:.1f}] peak {result['peak_rss_mib']:.0f} MiB",
                    flush=True,
                )
                results.append({**result, "round": round_})
    results = merge_rounds(results)
    description["load_average_end"] = os.getloadavg()
    with open(args.results / "speed.jsonl", "a") as f:
        for result in results:
            f.write(json.dumps({"machine": description, **result}) + "\n")
    text = f"# {json.dumps(description)}\n{table(results)}\n"
    with open(args.results / "speed.out.txt", "a") as f:
        f.write(text + "\n")
    plot(results, args.results / "speed.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
