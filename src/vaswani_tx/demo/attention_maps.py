"""Attention maps like the paper's Figures 3-5: one PNG per attention kind and layer, one panel per head.

Encoder self-attention (source x source), decoder self-attention (target x target, causal) and
encoder-decoder attention (target x source) are read from the model's `output_attentions` (the eager
path of Equation 1) for one sentence pair; when no target is given, the model's own translation is used,
teacher-forced on exactly the tokens `generate()` produced.

This file also travels into the Spaces that `vaswani-tx demo --write-space` writes (with `demo.py` and
`errors.py`): it imports torch, matplotlib and those two only, the latter relatively.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from vaswani_tx.model.errors import UserInputError

KINDS = {
    "encoder": ("encoder_attentions", "encoder self-attention"),
    "decoder": ("decoder_attentions", "decoder self-attention"),
    "cross": ("cross_attentions", "encoder-decoder attention"),
}


def decoder_inputs_from_output(output_ids: torch.Tensor, eos_token_id: int | None) -> torch.Tensor:
    """The decoder's inputs that produced one `generate()` output row (1-D): the row up to its first end of
    sentence after the start token, without it, so that the padding after it (and a start token that is the
    padding id, as in converted Marian models) is never mistaken for the translation."""
    ends = (output_ids[1:] == eos_token_id).nonzero()
    return output_ids[: 1 + int(ends[0])] if len(ends) else output_ids


def attention_from_ids(model, tokenizer, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> dict:
    """`attention_weights` for one source and one decoder input, given as ids of shape (1, S) and (1, T)."""
    model.eval()
    input_ids, decoder_input_ids = input_ids.to(model.device), decoder_input_ids.to(model.device)
    with torch.no_grad():
        out = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, output_attentions=True)
    source_tokens = tokenizer.convert_ids_to_tokens(input_ids[0].tolist())
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


def attention_weights(model, tokenizer, source: str, target: str | None = None, truncate: bool = False) -> dict:
    """Per-kind tuples of (heads, query, key) weight tensors, with the token strings on each axis.

    The decoder reads `<s>` + target and predicts target + `</s>`; its axes show the tokens it reads. `truncate`
    cuts a source or target longer than the model's positions to fit (`max_position_embeddings`).
    """
    model.eval()
    cut = {"truncation": True, "max_length": model.config.max_position_embeddings} if truncate else {}
    encoded = tokenizer(source, return_tensors="pt", **cut).to(model.device)
    if target is None:
        generated = model.generate(**encoded)[0]
        decoder_input_ids = decoder_inputs_from_output(generated, model.config.eos_token_id)[None]
    else:
        labels = tokenizer(text_target=target, return_tensors="pt", **cut)["input_ids"].to(model.device)
        decoder_input_ids = model.prepare_decoder_input_ids_from_labels(labels)
    return attention_from_ids(model, tokenizer, encoded["input_ids"], decoder_input_ids)


def draw_map(ax, weights, queries: list[str], keys: list[str], title: str, fontsize: float = 7) -> object:
    """One (queries, keys) map on a matplotlib axis, the tokens on its axes; returns the image (for a colour bar)."""
    image = ax.imshow(weights.numpy(), cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_title(title, fontsize=9)
    ax.set_xticks(range(len(keys)), keys, rotation=90, fontsize=fontsize)
    ax.set_yticks(range(len(queries)), queries, fontsize=fontsize)
    return image


def heads_figure(heads, queries: list[str], keys: list[str], title: str, size: float | None = None, fontsize=7):
    """A matplotlib Figure with one panel per head of one layer, four a row (`heads`: (h, queries, keys)).
    `size` is a panel's side in inches (default: grows with the tokens). Built without pyplot, so it is
    safe in a server's threads and freed with its last reference."""
    from matplotlib.figure import Figure

    columns = min(4, heads.shape[0])
    rows = math.ceil(heads.shape[0] / columns)
    size = size or max(2.5, 0.28 * max(len(keys), len(queries)))
    fig = Figure(figsize=(size * columns, size * rows))
    grid = fig.subplots(rows, columns, squeeze=False)
    for head in range(rows * columns):
        ax = grid[head // columns][head % columns]
        if head >= heads.shape[0]:
            ax.axis("off")
            continue
        draw_map(ax, heads[head], queries, keys, f"head {head + 1}", fontsize)
    fig.suptitle(title, wrap=True)  # one head's panel is narrower than the title
    fig.tight_layout()
    return fig


def plot_attention_maps(
    model,
    tokenizer,
    source: str,
    output_dir: str | Path,
    target: str | None = None,
    kinds=tuple(KINDS),
    layers: list[int] | None = None,
    truncate: bool = False,
) -> list[Path]:
    """Write `{kind}-layer{n}.png` files (a grid of heads each) to `output_dir`; returns their paths (`truncate`:
    `attention_weights`')."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise UserInputError(f"unknown attention kind(s) {sorted(unknown)}; choose from {sorted(KINDS)}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    weights = attention_weights(model, tokenizer, source, target, truncate)
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
            fig = heads_figure(heads, maps["queries"], maps["keys"], f"{maps['title']}, layer {layer + 1}")
            path = output_dir / f"{kind}-layer{layer + 1}.png"
            fig.savefig(path, dpi=100)
            written.append(path)
    return written
