"""Skipping padding: the same maths at fewer positions (an engineering choice, not the paper's).

Padding is a third of a typical batch of sentences, and the matrix products at padded positions, most
of the model's work, would be thrown away: no real query attends to a padded key, and with causal
attention no earlier target position sees a later one. The position-wise maps of Section 3 (W^Q, W^K,
W^V, W^O, the FFN, the pre-softmax projection) therefore run only at the positions that can affect a
result, which is the same maths for every real position. Padded source positions and target positions
after the last label (or the last 1 of `decoder_attention_mask`) hold no meaningful values: zero
projections there, and zero logits at unlabelled positions when the model computes its loss. Which
positions those are is decided once per forward (`PaddingPlan`); `skip_padding=False` in the config
computes every position, as other libraries do.

This file travels with saved weights for `trust_remote_code` (the model imports it): torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PaddingPlan:
    """The positions that can affect a result, decided once per forward (`config.skip_padding`): each a flat
    index into (B, L), or None for all of them:
    - `source`: real source positions;
    - `target`: target positions up to the last label (or the last 1 of the decoder's mask);
    - `labelled`: target positions with a label, where the loss needs logits.
    A row with nothing real is computed whole, as without skipping (a fully padded source then still
    gets uniform attention over its padding).
    """

    source: torch.Tensor | None = None
    target: torch.Tensor | None = None
    labelled: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        config,
        source_mask: torch.Tensor | None = None,
        target_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        target_length: int | None = None,
    ) -> PaddingPlan:
        """The plan for a batch: masks (B, L) are 1 for real tokens; `labels` (B, T) are -100 where unlabelled.
        Without `config.skip_padding`, the empty plan: every position is computed."""
        if not config.skip_padding:
            return cls()
        target = labelled = None
        multiple = rows_multiple()
        ends = None  # (B,): target positions at and after ends[b] need no output
        if labels is not None:
            has_label = labels.ne(-100)
            labelled = real_positions(has_label, multiple)
            ends = prefix_lengths(has_label)
        if target_mask is not None:
            mask_ends = prefix_lengths(target_mask)
            ends = mask_ends if ends is None else torch.minimum(ends, mask_ends)
        if ends is not None:
            length = (
                target_length
                if target_length is not None
                else (labels if labels is not None else target_mask).shape[1]
            )
            target = real_positions(torch.arange(length, device=ends.device)[None, :] < ends[:, None], multiple)
        return cls(source=real_positions(source_mask, multiple), target=target, labelled=labelled)


def at_positions(function, hidden_states: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """`function` (a position-wise map: a Linear, the FFN) applied only at the flat positions `index`
    of hidden_states (B, L, D_in), zeros elsewhere; (B, L, D_out). All of them when `index` is None."""
    if index is None:
        return function(hidden_states)
    batch, length, width = hidden_states.shape
    picked = function(hidden_states.reshape(batch * length, width).index_select(0, index))  # (N, D_out)
    return scatter_positions(picked, index, batch, length)


def scatter_positions(picked: torch.Tensor, index: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """Rows `picked` (N, D) put back at the flat positions `index` of a (B, L, D) tensor of zeros."""
    # In place into the zeros: `index_copy` would copy the whole (B, L, D) tensor first (the int8 base model's
    # encoder at batch 32, one thread: 113 against 128 ms a call; the same values and gradients)
    return picked.new_zeros(batch * length, picked.shape[-1]).index_copy_(0, index, picked).view(batch, length, -1)


# Under bf16 autocast on the CPU, oneDNN generates a kernel for each matrix shape it meets, and a process that has
# met many of them runs every step slower (a training run's steps from 0.6 to 0.85 s over its first 500 with batches
# of ever new sizes; flat with the same 20 sizes: docs/training.md). The rows computed are rounded up to a multiple
# of this (padding positions added, computed as without skipping), which bounds the shapes a run can meet.
ROWS_MULTIPLE_BF16_CPU = 64


def rows_multiple() -> int:
    """The multiple of rows `real_positions` rounds up to here: `ROWS_MULTIPLE_BF16_CPU` under CPU bf16 autocast."""
    if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16:
        return ROWS_MULTIPLE_BF16_CPU
    return 1


def real_positions(mask: torch.Tensor | None, multiple: int = 1) -> torch.Tensor | None:
    """Flat indices into (B, L) of the positions where `mask` (B, L) is nonzero: the positions to
    compute. A row with none is computed whole. None when that is every position. With `multiple`,
    as many other positions as round their number up to a multiple of it (fewer where (B, L) has no more)."""
    if mask is None:
        return None
    keep = mask.bool()
    keep = keep | ~keep.any(1, keepdim=True)
    if bool(keep.all()):
        return None
    flat = keep.reshape(-1)
    index = flat.nonzero().squeeze(1)
    wanted = min(flat.numel(), -(-index.numel() // multiple) * multiple)
    if wanted == flat.numel():
        return None
    if wanted > index.numel():
        extra = (~flat).nonzero().squeeze(1)[: wanted - index.numel()]
        index = torch.cat((index, extra)).sort().values
    return index


def prefix_lengths(mask: torch.Tensor) -> torch.Tensor:
    """(B,): one past the last nonzero position of each row of `mask` (B, L); 0 for a row of zeros."""
    ones = mask.bool()
    return torch.where(ones.any(1), ones.shape[1] - ones.flip(1).int().argmax(1), 0)


__all__ = [
    "ROWS_MULTIPLE_BF16_CPU",
    "PaddingPlan",
    "at_positions",
    "prefix_lengths",
    "real_positions",
    "rows_multiple",
    "scatter_positions",
]
