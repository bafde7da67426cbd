"""Where a training step's time goes on the CPU: the main job's model (`configs/model/small-cpu.json`) on batches
shaped like its Multi30k token-budget batches (issue 21).

    .venv/bin/python benchmarks/profile_train_step.py [--steps 10] [--tokens 2048] [--length 14] [--compile] [--bf16]
        [--attn eager|sdpa] [--loss-on-logits] [--torch-dropout]

Random token ids (the vocabulary of the model config) in sentences of `--length` tokens, `--tokens` per side per
batch, as `VaswaniTrainer` builds them; one step is forward, the label-smoothed loss (Section 5.4), backward and
Adam (Section 5.3), as `VaswaniTrainer` runs it: the attention `attn_implementation: auto` picks on the CPU (eager)
and the loss computed by the model (`epsilon_ls`); `--attn sdpa` and `--loss-on-logits` (the Trainer's route
through the whole logits, `label_smoothed_loss`) measure the alternatives, and `--torch-dropout` torch's own dropout
masks where the model draws them in bulk (dropout.py: CPUs other than Intel's). Prints the wall time of each phase and `torch.profiler`'s operators by self CPU time. Times
depend on the machine and its load: print `uptime` beside them.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from vaswani_tx import VaswaniForConditionalGeneration
from vaswani_tx.model import dropout
from vaswani_tx.training.params import load_model_config
from vaswani_tx.training.training import label_smoothed_loss

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "configs" / "model" / "small-cpu.json"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--length", type=int, default=14)
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model first (as the run config's torch_compile)"
    )
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="forward and loss under CPU autocast to bfloat16 (as the run config's bf16: true); weights stay float32",
    )
    parser.add_argument("--attn", choices=("eager", "sdpa"), default="eager", help="the attention implementation")
    parser.add_argument(
        "--loss-on-logits",
        action="store_true",
        help="the label-smoothed loss on the model's whole logits (LabelSmoothedCrossEntropy's route)",
    )
    parser.add_argument(
        "--torch-dropout",
        action="store_true",
        help="torch's dropout masks (bernoulli_) even where the model draws them in bulk (vaswani_tx/dropout.py)",
    )
    args = parser.parse_args()
    if args.torch_dropout:
        dropout.torch_draws_one_at_a_time = lambda: False

    torch.manual_seed(0)
    config = load_model_config(args.config)
    model = VaswaniForConditionalGeneration(config).train()
    model.set_attn_implementation(args.attn)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    forward_model = torch.compile(model) if args.compile else model  # compiled on the first warm-up step
    sentences = args.tokens // args.length
    source = torch.randint(4, config.vocab_size, (sentences, args.length))
    labels = torch.randint(4, config.vocab_size, (sentences, args.length))
    decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels=labels)
    phases = {"forward + loss": 0.0, "backward": 0.0, "optimizer": 0.0}

    def step(timed: bool) -> None:
        started = time.perf_counter()
        with record_function("forward + loss"), torch.autocast("cpu", torch.bfloat16, enabled=args.bf16):
            # as the Trainer calls it with a label smoother: labels popped, the collator's decoder inputs
            if args.loss_on_logits:
                logits = forward_model(input_ids=source, decoder_input_ids=decoder_input_ids).logits
                loss = label_smoothed_loss(logits, labels, 0.1)
            else:
                inputs = {"input_ids": source, "decoder_input_ids": decoder_input_ids, "labels": labels}
                loss = forward_model(**inputs, epsilon_ls=0.1, num_items_in_batch=labels.numel()).loss
        forward = time.perf_counter()
        with record_function("backward"):
            loss.backward()
        backward = time.perf_counter()
        with record_function("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if timed:
            phases["forward + loss"] += forward - started
            phases["backward"] += backward - forward
            phases["optimizer"] += time.perf_counter() - backward

    for _ in range(3):  # allocator and thread pools warm
        step(False)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step(True)
    total = sum(phases.values())
    print(
        f"{config.d_model=} {config.num_encoder_layers=} {config.vocab_size=}; {sentences} sentences x {args.length} tokens"
    )
    compiled = ("compiled" if args.compile else "eager") + (", bf16 autocast" if args.bf16 else ", float32")
    compiled += f", {args.attn} attention, loss " + ("on the whole logits" if args.loss_on_logits else "in the model")
    compiled += ", dropout masks " + ("in bulk" if dropout.torch_draws_one_at_a_time() else "by torch")
    print(f"{compiled}; threads {torch.get_num_threads()}; mean step {total / args.steps * 1000:.0f} ms")
    for name, seconds in phases.items():
        print(f"  {name:15s} {seconds / args.steps * 1000:7.1f} ms  {100 * seconds / total:5.1f}%")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))


if __name__ == "__main__":
    main()
