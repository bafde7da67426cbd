"""Section 6.1 decoding on top of transformers' `generate()`: beam 4, length penalty alpha = 0.6 in the
GNMT form, and a maximum output length of each source's length + 50.

`generate()` has beam search, early stopping and logits processors; what it lacks is the GNMT length
penalty (`GNMTLengthPenalty`) and a maximum length per sentence rather than per batch
(`SourceLengthCap`). `VaswaniGenerationMixin` adds both to `generate()`, and answers transformers' hooks
for a static cache (`cache_implementation="static"`) with static_decoding.py's cache and compiled step.
No second beam search: everything else is transformers'.

Where this departs from the paper (pinned by a test): beam search uses `generate()`'s early stopping,
a sentence stops once `num_beams` hypotheses have ended, the closest `generate()` comes to "terminate
early when possible" (Section 6.1).

`generate()` refuses impossible arguments (a beam of 0, an empty batch, a negative length offset, ...) with a
`UserInputError` (a ValueError) naming the argument, before transformers' own code would fail on them with an
error about something else (a division by zero, a reduction of an empty tensor).

This file travels with saved weights for `trust_remote_code` (the model imports it): torch,
transformers, errors.py, fast_decoding.py and static_decoding.py only.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import inspect
import math

import torch
from torch import nn
from transformers import GenerationConfig, GenerationMixin
from transformers.generation import logits_process
from transformers.generation.logits_process import LogitsProcessor, LogitsProcessorList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutput

from .compiled_decoding import encoder_for, one_call
from .errors import UserInputError, check_token_ids
from .fast_decoding import (
    beam_search,
    fast_decoding_applies,
    greedy_search,
    release_replaced,
    requested,
    unpacked_onednn_products,
)
from .static_decoding import (
    CACHE_FIELD,
    StaticDecodingCache,
    StaticDecodingStep,
    is_static_cache,
    rows_per_source,
)


def signature_kept(function):
    """`function` with its signature computed once, as `__signature__` (which `inspect.signature` returns as it is).
    generate() reads the signatures of the model's forward, its encoder's and decoder's and of the decoding method
    at every call, 8 reads of some 33 us each, 10 us once kept: 0.16-0.20 ms less a sentence at a sentence a call
    (0.7%, the main job's model on an AMD EPYC, one or two threads)."""
    function.__signature__ = inspect.signature(function)
    return function


def decoding_cache(past_key_values=None, cache=None):
    """The decoding cache a caller passed to forward, under the old name or the new one (`cache`, from
    transformers 5.24 on; never both): the model takes either and writes outputs under the installed release's
    name (CACHE_FIELD), so one saved model decodes with old and new releases. A transformers StaticCache made by
    hand becomes a `StaticDecodingCache` (decoded eagerly), whose layers the model's attention can read."""
    if past_key_values is not None and cache is not None:
        raise ValueError("Pass the decoding cache as `cache` or as `past_key_values`, not both.")
    cache = cache if cache is not None else past_key_values
    if is_static_cache(cache) and not isinstance(cache, StaticDecodingCache):
        return StaticDecodingCache.from_cache(cache, compile=False)
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

    # Scores stay as they are, or only </s> stays finite: greedy search may screen its argmax (fast_decoding.py).
    screens_argmax = True
    # It reads the rows' number and length, not their ids (`reads_shape_only`, fast_decoding.py).
    reads_ids = False

    def __init__(self, max_tokens: torch.Tensor, eos_token_id: int, score_forced_eos: bool = False):
        self.max_tokens = max_tokens
        self.eos_token_id = eos_token_id
        self.score_forced_eos = score_forced_eos
        self.prompt_length: int | None = None
        self.earliest: int | None = None  # the smallest limit: before it no step needs a tensor operation

    def select_sources(self, sources: torch.Tensor) -> SourceLengthCap:
        """This cap for a subset of its sources (beam search drops the finished ones from its rows)."""
        selected = copy.copy(self)
        selected.max_tokens = self.max_tokens[sources.to(self.max_tokens.device)]
        selected.earliest = None
        return selected

    def as_column_mask(self, prompt_len: int):
        """This cap for one source as a column mask of beam search's loop in C++ (fast_decoding.py's
        `column_masks`): from the length where the next token is the last allowed, every column but </s>; None for
        several sources."""
        if self.max_tokens.numel() != 1:
            return None
        prompt_length = prompt_len if self.prompt_length is None else self.prompt_length
        # generated + 1 >= limit, generated = cur_len - prompt_length
        from_len = int(self.max_tokens.reshape(-1)[0]) + prompt_length - 1
        return [self.eos_token_id], from_len, None, True, self.score_forced_eos  # (None: to the end)

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


def fairseq_generation_config(config, beam: int = 5, max_len_a: float = 0.0, max_len_b: int = 200) -> GenerationConfig:
    """fairseq-generate's decoding (fairseq 0.12 `SequenceGenerator` defaults): beam 5, scores divided by
    length^1 (eos counted), a sentence done once `beam` hypotheses have ended (early stopping), `</s>` not
    allowed first (`min_len=1`), `<pad>` never, and at most `max_len_a * source length + max_len_b` tokens
    (source `</s>` counted, capped at `max_position_embeddings - 1`) before `</s>` is forced and scored with
    its own log-probability."""
    return GenerationConfig(
        num_beams=beam,
        length_penalty=1.0,
        length_penalty_type="hf",
        max_output_length_offset=None,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
        early_stopping=True,
        min_new_tokens=1,
        suppress_tokens=[config.pad_token_id],
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id,
    )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_generate_arguments(config: GenerationConfig, kwargs: dict, inputs: torch.Tensor | None) -> None:
    """Refuse `generate()` arguments no decoding can follow (each given or from the generation config), naming the
    argument, its value and what is allowed: `num_beams` and `num_return_sequences` must be whole numbers >= 1,
    `length_penalty` a finite number, `max_output_length_offset` a whole number (negative: shorter than the source;
    `generate` checks that every source keeps at least one token), `max_len_b` a whole number >= 0 and `max_len_a`
    a number >= 0 (or None); the batch (`inputs`, `input_ids` or `inputs_embeds`) must hold at least one sequence
    of at least one position, and ids are integers.

    Raises:
        UserInputError: the first argument that cannot be used."""

    def value(name: str):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    for name in ("num_beams", "num_return_sequences"):
        given = value(name)
        if given is not None and (not _is_int(given) or given < 1):
            raise UserInputError(f"generate(): {name}={given!r} is not allowed; it must be a whole number >= 1.")
    penalty = value("length_penalty")
    if penalty is not None and (
        isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty)
    ):
        raise UserInputError(f"generate(): length_penalty={penalty!r} is not allowed; it must be a finite number.")
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
    log-probability (see `fairseq_generation_config`); it replaces `max_output_length_offset`."""

    @torch.no_grad()
    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config: GenerationConfig | None = None,
        logits_processor: LogitsProcessorList | None = None,
        **kwargs,
    ):
        """`GenerationMixin.generate` with the GNMT length penalty and a maximum output length per source.
        Passing `max_length` or `max_new_tokens` replaces the latter with that global limit."""
        config = generation_config if generation_config is not None else self.generation_config
        check_generate_arguments(config, kwargs, inputs)
        fast = kwargs.pop("fast_decoding", None)
        # a sentence a call with settings met before: generate()'s set-up as it was made then (`PreparedCall`)
        key = prepared_call_key(self, inputs, generation_config, logits_processor, kwargs, fast)
        cap = None
        penalty_type = kwargs.pop("length_penalty_type", getattr(config, "length_penalty_type", "hf"))
        offset_given = kwargs.get("max_output_length_offset") is not None
        cap_given = kwargs.get("max_len_b") is not None
        offset = kwargs.pop("max_output_length_offset", getattr(config, "max_output_length_offset", None))
        max_len_a = kwargs.pop("max_len_a", getattr(config, "max_len_a", None))
        max_len_b = kwargs.pop("max_len_b", getattr(config, "max_len_b", None))
        if offset_given and not cap_given:  # a caller's offset replaces the config's fairseq cap
            max_len_b = None
        static = kwargs.get("cache_implementation", config.cache_implementation) == "static"
        for name in ("output_attentions", "output_hidden_states"):
            if static and kwargs.get(name, getattr(config, name, False)):
                raise ValueError(
                    f"{name} is not supported with a static cache (cache_implementation='static'), which keeps "
                    "the encoder-decoder attention once per source; decode with the default dynamic cache instead."
                )
        if penalty_type not in ("gnmt", "hf"):
            raise UserInputError(
                f"length_penalty_type={penalty_type!r} is not allowed; choose 'gnmt' (the paper's) or 'hf'."
            )
        if penalty_type == "gnmt":
            kwargs["length_penalty"] = GNMTLengthPenalty(kwargs.get("length_penalty", config.length_penalty))

        explicit_limit = any(kwargs.get(k) is not None for k in ("max_length", "max_new_tokens"))
        if generation_config is not None:  # a caller's own config counts as explicit where it sets a limit
            explicit_limit = explicit_limit or (
                generation_config.max_new_tokens is not None
                or (generation_config.max_length is not None and generation_config.max_length != 20)
            )
        source_lengths = self._source_lengths(
            inputs if inputs is not None else kwargs.get("input_ids"), kwargs.get("attention_mask")
        )
        fairseq_cap = max_len_b is not None
        if (offset is not None or fairseq_cap) and not explicit_limit and source_lengths is not None:
            if fairseq_cap:  # fairseq's max_len, then one more step for the forced </s>
                tokens = (float(max_len_a or 0.0) * source_lengths.double() + int(max_len_b)).long()
                limits = tokens.clamp(max=self.config.max_position_embeddings - 1) + 1
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
            prefix = kwargs["decoder_input_ids"].shape[1] if kwargs.get("decoder_input_ids") is not None else 1
            kwargs["max_length"] = prefix + int(limits.max())
            cap = SourceLengthCap(limits, self.config.eos_token_id, score_forced_eos=fairseq_cap)
            logits_processor = LogitsProcessorList([*(logits_processor or []), cap])
        if key is not None:
            prepared = self.__dict__.get("_prepared_calls", {}).get(key)
            if prepared is not None and prepared.holds(self, cap):
                with one_call(self):
                    return prepared(
                        self, kwargs["input_ids"], kwargs.get("attention_mask"), cap, kwargs.get("max_length")
                    )
        with requested(fast), capturing(key) as captured, one_call(self):
            result = super().generate(
                inputs, generation_config=generation_config, logits_processor=logits_processor, **kwargs
            )
        if captured:
            PreparedCall.keep(self, key, captured, cap)
        return result

    def _prepare_text_encoder_decoder_kwargs_for_generation(
        self, inputs_tensor: torch.Tensor, model_kwargs: dict, model_input_name: str | None, generation_config
    ) -> dict:
        """transformers' encoder pass (Section 3.1's stack, once per call), its products through oneDNN where that is
        the faster GEMM of this CPU (`unpacked_onednn_products`: x86 CPUs other than Intel's, many source tokens).
        One source without padding (a sentence a call) goes through the folder's compiled encoder where it has one
        that fits (`encoder_for`: `vaswani-tx compile`), the same output to float32 rounding."""
        self.__dict__.pop("_encoded_source", None)
        compiled = self._compiled_encoder(inputs_tensor, model_kwargs, model_input_name, generation_config)
        if compiled is not None:
            check_token_ids(inputs_tensor, self.config.vocab_size, "input_ids")
            release_replaced(self, compiled)  # where its own packed copy serves, the plain pages go back to the file
            encoded = self.__dict__["_encoded_source"] = compiled(inputs_tensor)  # its memory keys for the session
            model_kwargs["encoder_outputs"] = BaseModelOutput(last_hidden_state=encoded.hidden)
            return model_kwargs
        with unpacked_onednn_products(self.get_encoder(), int(inputs_tensor.numel())):
            return super()._prepare_text_encoder_decoder_kwargs_for_generation(
                inputs_tensor, model_kwargs, model_input_name, generation_config
            )

    def _compiled_encoder(self, inputs_tensor, model_kwargs: dict, model_input_name, generation_config):
        """`encoder_for`'s compiled encoder where this encoder pass is a plain one it can make: the source's ids and
        at most their mask, no attentions or hidden states asked for, no device map."""
        if model_input_name not in (None, "input_ids") or generation_config.output_attentions:
            return None
        if generation_config.output_hidden_states or hasattr(self, "hf_device_map"):
            return None
        if any(
            key not in ENCODER_PASS_PLAIN and not key.startswith(("decoder_", "cross_attn")) for key in model_kwargs
        ):
            return None
        return encoder_for(self, inputs_tensor, model_kwargs.get("attention_mask"))

    @signature_kept
    def _sample(
        self,
        input_ids,
        logits_processor,
        stopping_criteria,
        generation_config,
        synced_gpus=False,
        streamer=None,
        **model_kwargs,
    ):
        """Greedy search through fast_decoding.py's loop where it applies (the same ids, faster); sampling and
        anything that asks for more than the sequences through transformers' `_sample`."""
        if fast_decoding_applies(self, generation_config, model_kwargs, streamer, synced_gpus):
            captured(greedy_search, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
            return greedy_search(self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
        return super()._sample(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, streamer, **model_kwargs
        )

    @signature_kept
    def _beam_search(
        self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False, **model_kwargs
    ):
        """Beam search through fast_decoding.py's loop where it applies, else transformers' `_beam_search`."""
        if fast_decoding_applies(self, generation_config, model_kwargs, None, synced_gpus):
            captured(beam_search, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
            return beam_search(self, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs)
        return super()._beam_search(
            input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus, **model_kwargs
        )

    def _prepare_cache_for_generation(self, generation_config: GenerationConfig, model_kwargs: dict, *args, **kwargs):
        """transformers' cache, except that a static one becomes a `StaticDecodingCache`, which keeps the
        encoder-decoder keys once per source and carries whether its decoding step is compiled
        (`disable_compile` in the generation config)."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_FIELD)
        if is_static_cache(cache) and not isinstance(cache, StaticDecodingCache):
            encoder_outputs = model_kwargs.get("encoder_outputs")
            rows = 1
            if encoder_outputs is not None:  # expanded for beams by now: the beams of a source share its keys
                rows = rows_per_source(encoder_outputs[0], model_kwargs.get("attention_mask"))
            model_kwargs[CACHE_FIELD] = StaticDecodingCache.from_cache(
                cache, compile=not generation_config.disable_compile, rows_per_source=rows
            )

    def __call__(self, *args, **kwargs):
        """`nn.Module`'s call, except that a decoding step with a `StaticDecodingCache` that compiles runs
        static_decoding.py's compiled step (`StaticDecodingStep`), which hands back to the model's forward what
        it does not cover. Here rather than in transformers' `get_compiled_call`, which beam search never asks."""
        cache = kwargs.get(CACHE_FIELD, kwargs.get("past_key_values"))
        if isinstance(cache, StaticDecodingCache) and cache.compile:
            return StaticDecodingStep(self)(**kwargs)
        return nn.Module.__call__(self, *args, **kwargs)

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config: GenerationConfig) -> bool:
        """Never compile the whole forward (transformers would, on GPU, with a static cache): the static-cache
        path compiles its own decoding step (`__call__`), and forward's input checks would break the graph."""
        return False

    def create_masks_for_generate(self, config=None, inputs_embeds=None, attention_mask=None, **kwargs):
        """The decoder's mask as it was given (2D or None): the model builds its own additive masks, over the
        positions a cache holds, rather than read the 4D ones transformers makes for compilable caches."""
        return attention_mask

    def _source_lengths(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Source lengths in tokens, end-of-sentence included, from the attention mask or the padding."""
        if attention_mask is not None:
            return attention_mask.sum(-1).long()
        if input_ids is not None and input_ids.dtype == torch.long:
            return input_ids.ne(self.config.pad_token_id).sum(-1).long()
        return None


# --- a sentence a call: generate()'s set-up once per settings -----------------------------------------------------

# The processors generate() makes from a generation config that act the same for every source of a call without a
# decoder prefix: they read the generation config and the decoder's rows only (not the source, not the length limit).
# A call that meets any other gets transformers' whole set-up each time.
SAME_FOR_EVERY_SOURCE = (
    logits_process.MinLengthLogitsProcessor,
    logits_process.MinNewTokensLengthLogitsProcessor,
    logits_process.NoBadWordsLogitsProcessor,
    logits_process.SuppressTokensLogitsProcessor,
    logits_process.SuppressTokensAtBeginLogitsProcessor,
    logits_process.NoRepeatNGramLogitsProcessor,
    logits_process.RepetitionPenaltyLogitsProcessor,
    logits_process.ForcedBOSTokenLogitsProcessor,
    logits_process.InfNanRemoveLogitsProcessor,
    logits_process.LogitNormalization,
)
# Kept for the length limit of each call (a copy with that limit): `ForcedEOSTokenLogitsProcessor`, the criteria's own.
WITH_THE_LIMIT = (logits_process.ForcedEOSTokenLogitsProcessor, MaxLengthCriteria)
PREPARED_CALLS_KEPT = 8  # settings a model keeps (a service asks for one or two)
# model_kwargs an encoder pass may hold and still be a plain one (what it reads of them: the mask; the rest is the
# decoder's): `_compiled_encoder`
ENCODER_PASS_PLAIN = {"attention_mask", "use_cache", "past_key_values", "cache_position"}
# The model inputs the fast loops are given by generate() (its cache, empty, is the loops' to ignore)
MODEL_INPUTS_PREPARED = {"attention_mask", "encoder_outputs", CACHE_FIELD, "past_key_values", "use_cache"}
_PLAIN = (bool, int, float, str, type(None))

_CAPTURE: contextvars.ContextVar = contextvars.ContextVar("prepared_call_capture", default=None)


def prepared_call_key(model, inputs, generation_config, logits_processor, kwargs: dict, fast) -> tuple | None:
    """The settings of a `generate()` call that `PreparedCall` can serve, as a key, or None: one source on the CPU
    as `input_ids` (and its `attention_mask`), every other argument a plain value (numbers, strings, None, lists and
    dicts of them: `_plain`), the model's own generation config, no processors of the caller's and fast decoding not
    refused."""
    ids = kwargs.get("input_ids")
    if inputs is not None or generation_config is not None or logits_processor is not None or fast is False:
        return None
    if type(ids) is not torch.Tensor or ids.dim() != 2 or ids.shape[0] != 1 or ids.device.type != "cpu":
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and (type(mask) is not torch.Tensor or mask.shape != ids.shape):
        return None
    settings = []
    for name, value in kwargs.items():
        if name not in ("input_ids", "attention_mask"):
            if not _plain(value, exact=True):
                return None
            settings.append((name, _frozen(value)))
    return (ids.dtype, mask is None, model.training, fast, tuple(sorted(settings, key=lambda item: item[0])))


@contextlib.contextmanager
def capturing(key):
    """While transformers' generate() runs for a call with a `prepared_call_key`: what it hands the fast loop
    (`captured`), as a list of at most one entry."""
    if key is None:
        yield None
        return
    found: list = []
    token = _CAPTURE.set(found)
    try:
        yield found
    finally:
        _CAPTURE.reset(token)


def captured(search, input_ids, logits_processor, stopping_criteria, generation_config, model_kwargs) -> None:
    """Note what generate() made for this call, where a `capturing` block asks."""
    found = _CAPTURE.get()
    if found is not None and not found:
        shape = tuple(input_ids.shape)
        found.append((search, shape, logits_processor, stopping_criteria, generation_config, set(model_kwargs)))


def _plain(value, exact: bool = False) -> bool:
    """Whether `value` is numbers, strings, None and lists, tuples and dicts of them (`exact`: of those types
    themselves, not subclasses such as `GNMTLengthPenalty`)."""
    if type(value) in (list, tuple):
        return all(_plain(item, exact) for item in value)
    if type(value) is dict:
        return all(_plain(key, exact) and _plain(item, exact) for key, item in value.items())
    return type(value) in _PLAIN or (not exact and isinstance(value, (int, float, str)))


def _frozen(value):
    """A plain value (`_plain`) as a key: its type beside it (True is not 1 here), lists and dicts as tuples."""
    if type(value) in (list, tuple):
        return (type(value), tuple(map(_frozen, value)))
    if type(value) is dict:
        return (dict, tuple((_frozen(key), _frozen(item)) for key, item in value.items()))
    return (type(value), value)


class PreparedCall:
    """generate()'s set-up for one source, made once per settings and kept by the model: a sentence a call (a
    service, `translate` line by line) gets the same generation config, processors and stopping criteria
    as the first call with those settings got from transformers' `generate()`, their length limit the call's own,
    and the same encoder pass, decoder prefix and search. transformers' set-up (the generation config's deep copy and
    checks, the processors' and criteria's making, the cache's) is some 1.4 ms of a 13 ms sentence on 2 cores (int8,
    one thread; docs/speed.md). Kept while the model's generation config and the config's special tokens are those
    they were (compared at each call); any other call, or a setting outside `SAME_FOR_EVERY_SOURCE`, gets
    transformers' whole set-up."""

    def __init__(self, model, found, cap) -> None:
        self.search, _, processors, criteria, self.generation_config, _ = found
        self.processors, self.criteria = list(processors), list(criteria)
        self.cap_at = next((i for i, p in enumerate(self.processors) if p is cap), None)
        self.config_object = model.generation_config
        self.config_values = copy.deepcopy(model.generation_config.__dict__)
        self.model_config = _special_tokens(model)

    @classmethod
    def keep(cls, model, key, found: list, cap) -> None:
        """Keep the call's set-up for its settings where every part of it is the same for every source."""
        search, shape, processors, criteria, generation_config, inputs = found[0]
        rows = max(generation_config.num_beams, generation_config.num_return_sequences)
        limit = generation_config.max_length
        if shape != (rows, 1) or not inputs <= MODEL_INPUTS_PREPARED or hasattr(model, "hf_device_map"):
            return
        if any(p is not cap and type(p) not in SAME_FOR_EVERY_SOURCE + WITH_THE_LIMIT for p in processors):
            return
        if any(type(c) not in (MaxLengthCriteria, EosTokenCriteria) for c in criteria):
            return
        if any(type(x) in WITH_THE_LIMIT and x.max_length != limit for x in (*processors, *criteria)):
            return
        if not _plain(model.generation_config.__dict__):
            return
        calls = model.__dict__.setdefault("_prepared_calls", {})
        while len(calls) >= PREPARED_CALLS_KEPT:
            calls.pop(next(iter(calls)))
        calls[key] = cls(model, found[0], cap)

    def holds(self, model, cap) -> bool:
        """Whether the model's generation config and special tokens are still those of the set-up."""
        if model.generation_config is not self.config_object or (cap is None) != (self.cap_at is None):
            return False
        try:
            return (
                model.generation_config.__dict__ == self.config_values and _special_tokens(model) == self.model_config
            )
        except RuntimeError:  # a tensor set since (compared element by element)
            return False

    def __call__(self, model, input_ids: torch.Tensor, attention_mask, cap, max_length: int | None):
        config = copy.copy(self.generation_config)  # the call's own limit
        if cap is not None:
            config.max_length = max_length
        processors = [_limited(p, config.max_length) for p in self.processors]
        if cap is not None:
            processors[self.cap_at] = cap
        criteria = [_limited(c, config.max_length) for c in self.criteria]
        # the encoder pass, decoder prefix and beams by the methods generate() makes them with
        model_kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        model_kwargs = model._prepare_text_encoder_decoder_kwargs_for_generation(
            input_ids, model_kwargs, "input_ids", config
        )
        decoder_ids, model_kwargs = model._prepare_decoder_input_ids_for_generation(
            1, "input_ids", model_kwargs, config._decoder_start_token_tensor, input_ids.device
        )
        decoder_ids, model_kwargs = model._expand_inputs_for_generation(
            max(config.num_beams, config.num_return_sequences), True, decoder_ids, **model_kwargs
        )
        model_kwargs["use_cache"] = config.use_cache
        return self.search(
            model, decoder_ids, LogitsProcessorList(processors), StoppingCriteriaList(criteria), config, model_kwargs
        )


def _limited(part, max_length: int):
    """A processor or criterion with the call's length limit (a copy), or the part itself where it has none."""
    if type(part) not in WITH_THE_LIMIT:
        return part
    part = copy.copy(part)
    part.max_length = max_length
    return part


def _special_tokens(model) -> tuple:
    config = model.config
    return (config.eos_token_id, config.pad_token_id, config.decoder_start_token_id, config.max_position_embeddings)
