"""Compile a saved model's decoding steps ahead of time (AOTInductor): MODEL/compiled, compiled-few, -int8, -bf16,
compiled-few-bf16, compiled-few-int8, the encoder of one source (MODEL/compiled-encoder), the int8 few-rows kernel
(MODEL/kernels) and beam search's bookkeeping for one source (MODEL/beam-search).

Once compiled, every later process that loads the folder (`from_pretrained`, `pipeline("translation")`,
`vaswani-tx translate` and `evaluate`) decodes through it with no flag and no compilation wait, where it
fits: float32 on the CPU, the same torch version and CPU instruction set, the same weights. Anything else
decodes eagerly, with one line saying why, and the same results. It holds no copy of the weights.
Calls of a few rows (up to 8 sources x beams: a sentence at a time, greedy or with a small beam) decode through
the float32 model's few-rows step (MODEL/compiled-few), 1.4-1.7x faster there: its products read a copy of the
decoder's weights packed for them (MODEL/compiled-few/weights.safetensors, the decoder layers' size), which serves
these weights only (a model changed since decodes through MODEL/compiled). The bfloat16 model has one too
(MODEL/compiled-few-bf16, up to 6 rows), where it has a bfloat16 step. A call of one source without padding is
encoded by the float32 model's compiled encoder (MODEL/compiled-encoder: its products oneMKL's on the model's own
weights where oneMKL is the CPU's GEMM library, else compiled the same way, its packed weights the encoder's size and
the encoder-decoder keys' and values'), about twice as fast as the eager encoder there; it also gives each decoder
layer's encoder-decoder keys and values, which the decoding then takes.
The int8 model's step (MODEL/compiled-int8) serves `translate --int8` and `quantize_int8` the same way; its
int8 products are the model's own layers, so its translations are the eager int8 path's to int8 rounding. On a CPU
with AVX512-VNNI, the int8 products of up to 16 rows are those of an int8 kernel built here with g++
(MODEL/kernels, about 10 s; int8_rows.py), in both paths, and the int8 model's few-rows step
(MODEL/compiled-few-int8) calls it from the library without Python: a sentence a call in int8 about 2x faster.
The float32 model's greedy search takes it too, for its int8 screen of the pre-softmax product (fast_decoding.py's
`ScreenedArgmax`: 2.5x faster than torch's int8 product there). On a
CPU with bf16 instructions (where `--dtype auto` picks bfloat16) the bfloat16 model's step (MODEL/compiled-bf16)
serves `--dtype auto` and `from_pretrained(MODEL, dtype=torch.bfloat16)`; Inductor keeps its fused elementwise
work in float32 between bfloat16 tensors, so its translations differ from the eager bfloat16 path's at that rounding.
Beam search over one source (a sentence a call: a service, the pipeline given a string) keeps its books in a C++
library built here with g++ (MODEL/beam-search, about 17 s; one_source_beams.py): the same choices as its Python
loop in one call a step, loaded by `from_pretrained` where it was built for this torch and Python, for every
precision.
Takes 20-60 s for each step of the base model or the main job's (60 s with Inductor's cache cold), a few steps at
a time in processes of their own, one per core (--jobs): on 2 cores about two thirds of the time of one after
another (the main job's model: 123 s against 179). Run it again after changing the weights or torch.

examples:
  vaswani-tx compile runs/multi30k-en-de/averaged
  vaswani-tx compile runs/multi30k-en-de/averaged --no-int8 --no-bf16 --no-few-rows   # the float32 step only
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", help="saved model folder (config.json, weights); the steps go into MODEL/compiled*")
    parser.add_argument(
        "--no-int8",
        dest="int8",
        action="store_false",
        help="do not compile the int8 model's steps (MODEL/compiled-int8, compiled-few-int8 and the int8 kernel in "
        "MODEL/kernels, for --int8 and float32 greedy search's screen) as well",
    )
    parser.add_argument(
        "--no-bf16",
        dest="bf16",
        action="store_false",
        help="do not compile the bfloat16 model's step (MODEL/compiled-bf16, for --dtype auto where the CPU has bf16 "
        "instructions) as well",
    )
    parser.add_argument(
        "--no-few-rows",
        dest="few_rows",
        action="store_false",
        help="do not compile the few-rows steps (MODEL/compiled-few and, with the bfloat16 step, "
        "MODEL/compiled-few-bf16: for calls of a few rows, a sentence at a time, greedy or with a small beam) "
        "nor the encoder of one source (MODEL/compiled-encoder) as well",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        help="how many processes compile the steps at once (default: one per core, at most one per step: about two "
        "thirds of the time on 2 cores); 1 compiles them one after another in this process",
    )


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vaswani_tx.compile_step import compile_decoder_steps
    from vaswani_tx.errors import UserInputError
    from vaswani_tx.modeling_vaswani import VaswaniForConditionalGeneration
    from vaswani_tx.translation import check_model_folder

    if args.jobs is not None and args.jobs < 1:
        raise UserInputError(f"--jobs must be >= 1, got {args.jobs}")
    check_model_folder(Path(args.model))
    model = VaswaniForConditionalGeneration.from_pretrained(args.model)
    for line in compile_decoder_steps(
        model, args.model, int8=args.int8, bf16=args.bf16, few_rows=args.few_rows, jobs=args.jobs
    ):
        print(line, flush=True)  # as each is written: the others take minutes
    return 0
