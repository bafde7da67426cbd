"""Greedy search and beam search over a call's `Decoding` (step.py), for any batch size (a single sentence is a batch of one).

Both make transformers' choices (`GenerationMixin._sample` without sampling, `_beam_search`), step for step, from
the same float32 scores, so that the ids are transformers' own (tested against its loops):
- greedy search takes the argmax of the processed logits;
- beam search adds each beam's log-softmax to its running score, keeps the 2k best continuations of a source,
  the k best that do not end as running beams, and those that end (with `</s>` or at the length limit) among the
  finished hypotheses, ranked by score / lp(length) (the length penalty: transformers' |Y|^alpha, or the GNMT form
  the paper used, Section 6.1), with transformers' early-stopping rule.

What differs is the work, not the choices: a finished sentence leaves the batch (greedy search: at its `</s>`; beam
search: once its hypotheses can no longer change), where every logits processor can follow (`can_leave`).
Logits processors are transformers' own classes, applied one way: to the raw logits in greedy search, to the
log-probabilities in beam search, as transformers applies them.
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process

from .step import Decoding

# Processors that treat each row on its own: a row that leaves the batch changes nothing for the others.
ROW_WISE = (
    logits_process.MinLengthLogitsProcessor,
    logits_process.MinNewTokensLengthLogitsProcessor,
    logits_process.SuppressTokensLogitsProcessor,
    logits_process.SuppressTokensAtBeginLogitsProcessor,
    logits_process.ForcedBOSTokenLogitsProcessor,
    logits_process.ForcedEOSTokenLogitsProcessor,
    logits_process.NoRepeatNGramLogitsProcessor,
    logits_process.NoBadWordsLogitsProcessor,
    logits_process.RepetitionPenaltyLogitsProcessor,
)


class Processors:
    """A call's logits processors, kept for the sources still in the batch."""

    def __init__(self, processors: list):
        self.processors = list(processors)
        self.can_leave = all(isinstance(p, ROW_WISE) or hasattr(p, "select_sources") for p in self.processors)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for processor in self.processors:
            scores = processor(input_ids, scores)
        return scores

    def keep(self, sources: torch.Tensor) -> None:
        self.processors = [p.select_sources(sources) if hasattr(p, "select_sources") else p for p in self.processors]


def greedy_search(
    step: Decoding, start: torch.Tensor, processors: Processors, max_length: int, eos: list[int], pad: int
) -> torch.Tensor:
    """The argmax of the processed logits a step, until every row has ended with `</s>` or `max_length` is reached
    (transformers' `_sample` without sampling). `start` (B,): the decoder's first token per row. Returns (B, length),
    rows that ended earlier filled with `pad`."""
    batch = start.shape[0]
    sequences = torch.full((batch, max_length), pad, dtype=torch.long, device=start.device)
    sequences[:, 0] = start
    rows = torch.arange(batch, device=start.device)  # the rows still decoding (all of them where none can leave)
    unfinished = torch.ones(batch, dtype=torch.bool, device=start.device)
    eos_ids = torch.tensor(eos, device=start.device)
    length = 1
    while length < max_length:
        ids = sequences[rows, :length]
        scores = processors(ids, step(ids[:, -1], length - 1))
        tokens = torch.where(unfinished[rows], scores.argmax(dim=-1), pad)
        sequences[rows, length] = tokens
        length += 1
        unfinished[rows] &= ~torch.isin(tokens, eos_ids)
        if not bool(unfinished.any()):
            break
        if processors.can_leave and not bool(unfinished[rows].all()):
            going_on = unfinished[rows].nonzero().squeeze(1)
            step.keep_sources(going_on)
            processors.keep(going_on)
            rows = rows[going_on]
    return sequences[:, :length]


class Beams:
    """Beam search's state for the sources still decoding (transformers' `_beam_search` tensors, by source)."""

    def __init__(self, start: torch.Tensor, beams: int, max_length: int, fill: int):
        sources, device = start.shape[0], start.device
        self.running = torch.full((sources, beams, max_length), fill, dtype=torch.long, device=device)
        self.running[:, :, 0] = start[:, None]
        self.finished = self.running.clone()  # the finished hypotheses, best first
        self.running_scores = torch.zeros(sources, beams, device=device)
        self.running_scores[:, 1:] = -1.0e9  # at the first step only the first beam's continuations count
        self.scores = torch.full((sources, beams), -1.0e9, device=device)
        self.done = torch.zeros(sources, beams, dtype=torch.bool, device=device)  # transformers' is_sent_finished
        self.lengths = torch.zeros(sources, beams, dtype=torch.long, device=device)  # tokens each hypothesis made
        self.improvable = torch.ones(sources, 1, dtype=torch.bool, device=device)
        self.sources = torch.arange(sources, device=device)  # where each row of the state came from
        self.best = self.finished[:, 0].clone()  # each source's best hypothesis, once it has left
        self.best_lengths = torch.zeros(sources, dtype=torch.long, device=device)

    def keep(self, staying: torch.Tensor) -> None:
        """Only the sources `staying` (indices into the state) go on; the others' best hypotheses are final."""
        self.best[self.sources] = self.finished[:, 0]
        self.best_lengths[self.sources] = self.lengths[:, 0]
        for name in ("running", "finished", "running_scores", "scores", "done", "lengths", "improvable", "sources"):
            setattr(self, name, getattr(self, name)[staying])


def gather(tensor: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """tensor[s, indices[s, j], ...] for each source s: (S, k, ...) by (S, j) -> (S, j, ...)."""
    shape = indices.shape + tensor.shape[2:]
    return tensor.gather(1, indices.reshape(*indices.shape, *[1] * (tensor.dim() - 2)).expand(shape))


def beam_search(
    step: Decoding,
    start: torch.Tensor,
    processors: Processors,
    max_length: int,
    eos: list[int],
    fill: int,
    beams: int,
    length_penalty: float,
    early_stopping: bool | str,
) -> torch.Tensor:
    """Beam search with `beams` beams per source, as transformers' `_beam_search` (its comments there say why
    each step is as it is). `start` (B,): each source's first decoder token; `fill` pads the hypotheses.
    Returns the best hypothesis per source, (B, 1 + the longest's length)."""
    device = start.device
    state = Beams(start, beams, max_length, fill)
    kept = max(2, 1 + len(eos)) * beams  # continuations kept per source: enough that `beams` of them go on
    top_beams = torch.arange(kept, device=device) < beams
    eos_ids = torch.tensor(eos, device=device)
    length, prompt = 1, 1
    while True:
        count = state.running.shape[0]
        ids = state.running[:, :, :length].reshape(count * beams, length)
        log_probs = processors(ids, torch.log_softmax(step(ids[:, -1], length - 1), dim=-1))
        vocabulary = log_probs.shape[-1]
        log_probs = log_probs.view(count, beams, vocabulary) + state.running_scores[:, :, None]
        top_scores, top_indices = torch.topk(log_probs.view(count, beams * vocabulary), k=kept)
        parents, tokens = top_indices // vocabulary, top_indices % vocabulary
        candidates = gather(state.running, parents)
        candidates[:, :, length] = tokens
        ends = torch.isin(tokens, eos_ids) | (length + 1 >= max_length)  # the stopping criteria
        # the best `beams` continuations that do not end go on
        going_on = top_scores + ends.to(torch.float32) * -1.0e9
        chosen = torch.topk(going_on, k=beams)[1]
        state.running, state.running_scores = gather(candidates, chosen), gather(going_on, chosen)
        rows = (torch.arange(count, device=device) * beams)[:, None] + gather(parents, chosen)
        step.reorder(rows.reshape(-1))
        # those that end join the finished hypotheses where they rank among the `beams` best, by score / lp(length)
        just_done = ends & top_beams[None, :]
        scores = top_scores / ((length + 1 - prompt) ** length_penalty)
        scores += (torch.all(state.done, dim=-1, keepdim=True) & (early_stopping is True)).to(torch.float32) * -1.0e9
        scores += (~state.improvable).to(torch.float32) * -1.0e9
        scores += (~just_done) * -1.0e9
        scores = torch.cat((state.scores, scores), dim=1)
        best = torch.topk(scores, k=beams)[1]
        state.finished = gather(torch.cat((state.finished, candidates), dim=1), best)
        state.scores = gather(scores, best)
        state.done = gather(torch.cat((state.done, just_done), dim=1), best)
        made = torch.full_like(tokens, length + 1 - prompt)
        state.lengths = gather(torch.cat((state.lengths, made), dim=1), best)
        length += 1
        # transformers' early-stopping heuristic: can a running beam still beat the worst finished hypothesis?
        hypothetical = max_length - prompt if early_stopping == "never" and length_penalty > 0.0 else length - prompt
        best_possible = state.running_scores[:, :1] / (hypothetical**length_penalty)
        worst = torch.where(state.done, torch.min(state.scores, dim=1, keepdim=True)[0], -1.0e9)
        state.improvable &= torch.any(best_possible > worst, dim=-1, keepdim=True)
        # a source whose hypotheses can no longer change: all finished, and (unless early stopping) no improvement
        settled = torch.all(state.done, dim=-1) & ((early_stopping is True) | ~state.improvable[:, 0])
        if bool(settled.all()) or bool(ends.all()):
            break
        if processors.can_leave and bool(settled.any()):
            staying = (~settled).nonzero().squeeze(1)
            state.keep(staying)
            step.keep_sources(staying)
            processors.keep(staying)
    state.keep(state.sources[:0])
    longest = int(state.best_lengths.max())
    return state.best[:, : prompt + longest]
