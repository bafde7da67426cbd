"""Section 6.1 decoding on top of transformers' `generate()`: beam 4, length penalty alpha = 0.6 in the
GNMT form, and a maximum output length of each source's length + 50.

`generate()` has beam search, early stopping and logits processors; what it lacks is the GNMT length
penalty (`GNMTLengthPenalty`) and a maximum length per sentence rather than per batch
(`SourceLengthCap`). `VaswaniGenerationMixin` adds both to `generate()` through its public extension points (a
length penalty, a logits processor). Where vaswani_tx is installed, `generate()` then hands the call to its
decoding engine (`vaswani_tx.engine.serve`), which makes transformers' choices faster or declines; elsewhere (a
saved folder loaded with `trust_remote_code`) transformers' own loops decode, with the same ids.

Where this departs from the paper (pinned by a test): beam search uses `generate()`'s early stopping,
a sentence stops once `num_beams` hypotheses have ended, the closest `generate()` comes to "terminate
early when possible" (Section 6.1).

`generate()` refuses impossible arguments of its own (an empty batch, a length offset that leaves a source no
token, ...) with a `UserInputError` (a ValueError) naming the argument, before torch would fail on them with an
error about something else (a reduction of an empty tensor); the engine checks its search's (a beam of 0).

This file travels with saved weights for `trust_remote_code` (the model imports it): torch, transformers and
errors.py only.
"""

from __future__ import annotations

import copy
import importlib.util
import logging

import torch
from transformers import GenerationConfig, GenerationMixin
from transformers.cache_utils import StaticLayer
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.modeling_outputs import Seq2SeqLMOutput

from .configuration_vaswani import _is_int
from .errors import UserInputError

logger = logging.getLogger(__name__)

# The decoding cache's name in model outputs: `cache` from transformers 5.24 on, `past_key_values` before.
CACHE_FIELD = "cache" if "cache" in Seq2SeqLMOutput.__dataclass_fields__ else "past_key_values"


def decoding_cache(past_key_values=None, cache=None):
    """The decoding cache a caller passed to forward, under the old name or the new one (`cache`, from
    transformers 5.24 on; never both): the model takes either and writes outputs under the installed release's
    name (CACHE_FIELD), so one saved model decodes with old and new releases."""
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the decoding cache as `cache` or as `past_key_values`, not both.")
    cache = cache if cache is not None else past_key_values
    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", [])
    if any(isinstance(layer, StaticLayer) for layer in layers):
        raise UserInputError(
            "cache_implementation='static' is not supported: the model's attention reads every position a cache "
            "holds; decode with the default dynamic cache"
        )
    return cache


class GNMTLengthPenalty(float):
    """The length penalty the paper used (Section 6.1, from Wu et al. 2016): lp(Y) = ((5 + |Y|) / 6)^alpha.

    transformers' beam search divides a hypothesis' log-probability by `length ** length_penalty`.
    This float subclass is alpha everywhere except in that one power, where it yields the GNMT form:
    `length ** GNMTLengthPenalty(alpha) == ((5 + length) / 6) ** alpha`.
    """

    def __rpow__(self, length):
        return ((5.0 + length) / 6.0) ** float(self)

    def __repr__(self) -> str:
        return f"GNMTLengthPenalty({float(self)!r})"


class SourceLengthCap(LogitsProcessor):
    """Per-sentence maximum output length: "input length + 50" (Section 6.1), not one global maximum.

    `max_tokens` (B,) holds each source's limit in output tokens, end-of-sentence included; at the
    last allowed position only `eos_token_id` remains possible, with log-probability 0 or, with
    `score_forced_eos` (fairseq's way), its own. Rows of beams or of several returned sequences per
    source are matched to their source by position (they are laid out source-major).
    """

    def __init__(self, max_tokens: torch.Tensor, eos_token_id: int, score_forced_eos: bool = False):
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.score_forced_eos = score_forced_eos
        self.prompt_length: int | None = None
        self.earliest: int | None = None  # the smallest limit: before it no step needs a tensor operation

    def select_sources(self, sources: torch.Tensor) -> SourceLengthCap:
        """This cap for a subset of its sources (the engine's searches drop finished sources from the batch)."""
        selected = copy.copy(self)
        selected.max_tokens = self.max_tokens[sources.to(self.max_tokens.device)]
        selected.earliest = None
        return selected

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]  # the decoder start token (and any forced prefix)
        generated = input_ids.shape[1] - self.prompt_length
        if self.earliest is None:
            self.earliest = int(self.max_tokens.min())
        if generated + 1 < self.earliest:  # no row at its limit yet: most steps
            return scores
        limits = self.max_tokens.to(scores.device).repeat_interleave(input_ids.shape[0] // self.max_tokens.numel())
        at_limit = (generated + 1 >= limits).nonzero().squeeze(1)  # rows whose next token is the last one allowed
        if at_limit.numel() == 0:  # most steps: nothing to change, and no (rows, V) tensor written
            return scores
        eos = scores[at_limit, self.eos_token_id] if self.score_forced_eos else 0.0
        capped = scores.clone()
        capped[at_limit] = -float("inf")
        capped[at_limit, self.eos_token_id] = eos
        return capped


def paper_generation_config(config) -> GenerationConfig:
    """Section 6.1 decoding: beam size 4, length penalty alpha = 0.6 (GNMT form), maximum output length
    input length + 50, early stopping. `length_penalty_type="hf"` selects transformers' `|Y|^alpha`."""
    return GenerationConfig(
        num_beams=4,
        length_penalty=0.6,
        length_penalty_type="gnmt",
        max_output_length_offset=50,
        early_stopping=True,
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def check_generate_arguments(config: GenerationConfig, kwargs: dict, inputs: torch.Tensor | None) -> None:
    """Refuse the arguments of the caps below that no decoding can follow (each given or from the generation
    config), naming the argument, its value and what is allowed: `max_output_length_offset` a whole number
    (negative: shorter than the source; `generate` checks that every source keeps at least one token), `max_len_b`
    a whole number >= 0 and `max_len_a` a number >= 0 (or None); the batch (`inputs`, `input_ids` or
    `inputs_embeds`) must hold at least one sequence of at least one position, and ids are integers. (The engine
    checks the search's own settings, `num_beams` and the like.)

    Raises:
        UserInputError: the first argument that cannot be used."""

    def value(name: str):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    offset = value("max_output_length_offset")
    if offset is not None and not _is_int(offset):
        raise UserInputError(
            f"generate(): max_output_length_offset={offset!r} is not allowed; it must be a whole number (or None)."
        )
    given = value("max_len_b")
    if given is not None and (not _is_int(given) or given < 0):
        raise UserInputError(
            f"generate(): max_len_b={given!r} is not allowed; it must be a whole number >= 0 (or None)."
        )
    given = value("max_len_a")
    if given is not None and (isinstance(given, bool) or not isinstance(given, (int, float)) or not given >= 0):
        raise UserInputError(f"generate(): max_len_a={given!r} is not allowed; it must be a number >= 0 (or None).")
    batches = {"inputs": inputs, "input_ids": kwargs.get("input_ids"), "inputs_embeds": kwargs.get("inputs_embeds")}
    for name, batch in batches.items():
        if not isinstance(batch, torch.Tensor) or batch.dim() < 2:
            continue
        if 0 in batch.shape[:2]:
            what = "an empty batch" if batch.shape[0] == 0 else "sequences without a single position"
            raise UserInputError(
                f"generate(): {name} has shape {tuple(batch.shape)}, {what}; give at least one sequence of at least "
                "one token (its end-of-sentence token counts)."
            )
        if batch.dim() == 2 and batch.is_floating_point():
            raise UserInputError(
                f"generate(): {name} holds {batch.dtype} values; token ids are integers (torch.long)."
            )


class VaswaniGenerationMixin(GenerationMixin):
    """`GenerationMixin` with the two Section 6.1 settings it lacks, read from the generation config
    or passed to `generate()`: `length_penalty_type` ("gnmt", the paper's, or "hf") and
    `max_output_length_offset` (each source's length plus this many tokens; None: no such cap). Or, for
    converted fairseq models, fairseq's cap: `max_len_b` (not None) and `max_len_a` give each source at most
    `int(max_len_a * source length + max_len_b)` tokens before a forced `</s>` scored with its own
    log-probability (vaswani_tx.interop.convert's `fairseq_generation_config`); it replaces `max_output_length_offset`."""

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        **kwargs,
    ):
        """`GenerationMixin.generate` with the GNMT length penalty and a maximum output length per source.
        Passing `max_length` or `max_new_tokens` replaces the latter with that global limit. Every output is at
        most `max_position_embeddings` tokens long, the positions the model was made for. Padded `input_ids`
        without an `attention_mask` are masked where they hold `pad_token_id`, as the pipeline's are."""
        config = generation_config if generation_config is not None else self.generation_config
        check_generate_arguments(config, kwargs, inputs)
        translator = kwargs.pop("translator", None)  # an engine `Translator` of another precision (int8)
        use_engine = kwargs.pop("use_engine", True)  # False: transformers' own loops, whatever is installed
        penalty_type = kwargs.pop("length_penalty_type", getattr(config, "length_penalty_type", "hf"))
        offset_given = kwargs.get("max_output_length_offset") is not None
        cap_given = kwargs.get("max_len_b") is not None
        offset = kwargs.pop("max_output_length_offset", getattr(config, "max_output_length_offset", None))
        max_len_a = kwargs.pop("max_len_a", getattr(config, "max_len_a", None))
        max_len_b = kwargs.pop("max_len_b", getattr(config, "max_len_b", None))
        if offset_given and not cap_given:  # a caller's offset replaces the config's fairseq cap
            max_len_b = None
        if penalty_type not in ("gnmt", "hf"):
            raise UserInputError(
                f"length_penalty_type={penalty_type!r} is not allowed; choose 'gnmt' (the paper's) or 'hf'."
            )
        if penalty_type == "gnmt":  # alpha unset: transformers' default, 1.0
            alpha = kwargs.get("length_penalty", config.length_penalty)
            kwargs["length_penalty"] = GNMTLengthPenalty(1.0 if alpha is None else alpha)
        ids, pad = (inputs if inputs is not None else kwargs.get("input_ids")), self.config.pad_token_id
        ids = ids if isinstance(ids, torch.Tensor) and ids.dtype == torch.long else None
        if kwargs.get("attention_mask") is None and ids is not None and pad is not None and bool(ids.eq(pad).any()):
            logger.warning(
                "generate(): input_ids hold padding (pad_token_id=%d) and no attention_mask was given; the padding "
                "is masked. Pass the tokenizer's attention_mask to silence this.",
                pad,
            )
            kwargs["attention_mask"] = ids.ne(pad).long()

        explicit_limit = any(kwargs.get(k) is not None for k in ("max_length", "max_new_tokens"))
        if generation_config is not None:  # a caller's own config counts as explicit where it sets a limit
            explicit_limit = explicit_limit or (
                generation_config.max_new_tokens is not None
                or (generation_config.max_length is not None and generation_config.max_length != 20)
            )
        mask = kwargs.get("attention_mask")
        source_lengths = mask.sum(-1).long() if mask is not None else None
        if source_lengths is None and ids is not None:
            source_lengths = torch.full(ids.shape[:1], ids.shape[1], device=ids.device)
        fairseq_cap = max_len_b is not None
        prefix = kwargs["decoder_input_ids"].shape[1] if kwargs.get("decoder_input_ids") is not None else 1
        positions = self.config.max_position_embeddings
        if (offset is not None or fairseq_cap) and not explicit_limit and source_lengths is not None:
            if fairseq_cap:  # fairseq's max_len, then one more step for the forced </s>
                tokens = (float(max_len_a or 0.0) * source_lengths.double() + int(max_len_b)).long()
                limits = tokens.clamp(max=positions - 1) + 1
            else:
                limits = source_lengths + int(offset)  # (B,)
                if int(limits.min()) < 1:
                    row = int(limits.argmin())
                    raise UserInputError(
                        f"generate(): max_output_length_offset={offset} leaves source {row} ({int(source_lengths[row])} "
                        "tokens) no output token: each source may produce its length + the offset, at least 1."
                    )
            # As max_length (decoder prefix + longest cap), not max_new_tokens: a saved generation config
            # that carries a max_length (Seq2SeqTrainer's evaluation writes its defaults into the model's)
            # would otherwise clash with it and make generate() warn.
            kwargs["max_length"] = prefix + int(limits.max())
            cap = SourceLengthCap(limits, self.config.eos_token_id, score_forced_eos=fairseq_cap)
            logits_processor = LogitsProcessorList([*(logits_processor or []), cap])
        # Nothing runs unbounded: no output past the positions the model was made for, whatever limit was asked.
        new_tokens = kwargs.get("max_new_tokens", config.max_new_tokens)
        if new_tokens is not None and prefix + new_tokens > positions:
            kwargs["max_new_tokens"] = max(positions - prefix, 1)
        elif new_tokens is None and (kwargs.get("max_length") or config.max_length or 0) > positions:
            kwargs["max_length"] = positions
        # The one bridge to the package: its engine, where vaswani_tx is installed (a saved folder's copy of this
        # file, loaded with trust_remote_code elsewhere, decodes with transformers' loops, to the same ids).
        serve = None
        if use_engine and importlib.util.find_spec("vaswani_tx") is not None:
            try:
                from vaswani_tx.engine import serve
            except ImportError:  # a module of that name that is not this package: transformers' loops
                serve = None
        decoded = (
            None if serve is None else serve(self, translator, inputs, generation_config, logits_processor, kwargs)
        )
        if decoded is not None:
            return decoded
        return super().generate(
            inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs
        )
