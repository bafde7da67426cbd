"""Attention maps like the paper's Figures 3-5: one PNG per attention kind and layer, one panel per head.

Encoder self-attention (source x source), decoder self-attention (target x target, causal) and
encoder-decoder attention (target x source) are read from the model's `output_attentions` (the eager
path of Equation 1) for one sentence pair; when no target is given, the model's own translation is used.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from vaswani_tx.errors import UserInputError

KINDS = {
    "encoder": ("encoder_attentions", "encoder self-attention"),
    "decoder": ("decoder_attentions", "decoder self-attention"),
    "cross": ("cross_attentions", "encoder-decoder attention"),
}


def attention_weights(model, tokenizer, source: str, target: str | None = None) -> dict:
    """Per-kind tuples of (heads, query, key) weight tensors, with the token strings on each axis.

    The decoder reads `<s>` + target and predicts target + `</s>`; its axes show the tokens it reads.
    """
    model.eval()
    encoded = tokenizer(source, return_tensors="pt").to(model.device)
    if target is None:
        generated = model.generate(**encoded)[0]
        target_ids = generated[generated != model.config.pad_token_id]
        decoder_input_ids = target_ids[None, :-1] if target_ids[-1] == model.config.eos_token_id else target_ids[None]
    else:
        labels = tokenizer(text_target=target, return_tensors="pt")["input_ids"].to(model.device)
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    with torch.no_grad():
        out = model(**encoded, decoder_input_ids=decoder_input_ids, output_attentions=True)
    source_tokens = tokenizer.convert_ids_to_tokens(encoded["input_ids"][0].tolist())
    target_tokens = tokenizer.convert_ids_to_tokens(decoder_input_ids[0].tolist())
    axes = {
        "encoder": (source_tokens, source_tokens),
        "decoder": (target_tokens, target_tokens),
        "cross": (target_tokens, source_tokens),
    }
    return {
        kind: {
            "layers": [w[0].float().cpu() for w in getattr(out, field)],
            "queries": axes[kind][0],
            "keys": axes[kind][1],
            "title": title,
        }
        for kind, (field, title) in KINDS.items()
    }


def plot_attention_maps(
    model,
    tokenizer,
    source: str,
    output_dir: str | Path,
    target: str | None = None,
    kinds=tuple(KINDS),
    layers: list[int] | None = None,
) -> list[Path]:
    """Write `{kind}-layer{n}.png` files (a grid of heads each) to `output_dir`; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise UserInputError(f"unknown attention kind(s) {sorted(unknown)}; choose from {sorted(KINDS)}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    weights = attention_weights(model, tokenizer, source, target)
    written = []
    for kind in kinds:
        maps = weights[kind]
        chosen = range(len(maps["layers"])) if layers is None else layers
        for layer in chosen:
            if not 0 <= layer < len(maps["layers"]):
                raise UserInputError(
                    f"layer {layer} does not exist: the {kind} stack has {len(maps['layers'])} layers"
                )
            heads = maps["layers"][layer]  # (h, queries, keys)
            columns = min(4, heads.shape[0])
            rows = math.ceil(heads.shape[0] / columns)
            size = max(2.5, 0.28 * max(len(maps["keys"]), len(maps["queries"])))
            fig, grid = plt.subplots(rows, columns, figsize=(size * columns, size * rows), squeeze=False)
            for head in range(rows * columns):
                ax = grid[head // columns][head % columns]
                if head >= heads.shape[0]:
                    ax.axis("off")
                    continue
                ax.imshow(heads[head].numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
                ax.set_title(f"head {head + 1}", fontsize=9)
                ax.set_xticks(range(len(maps["keys"])), maps["keys"], rotation=90, fontsize=7)
                ax.set_yticks(range(len(maps["queries"])), maps["queries"], fontsize=7)
            fig.suptitle(f"{maps['title']}, layer {layer + 1}")
            fig.tight_layout()
            path = output_dir / f"{kind}-layer{layer + 1}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(path)
    return written
