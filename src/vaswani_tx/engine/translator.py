"""The engine's one entry: `Translator`, in CTranslate2's shape, which the model's `generate()` hands over to.

    from vaswani_tx.engine import Translator
    translator = Translator("runs/multi30k-en-de/averaged", compute_type="int8")
    results = translator.translate_batch([[52, 1183, 9, 3]], beam_size=4)
    results[0].hypotheses[0]  # the best translation's ids, without <s> and </s>

A `Translator` holds a model and the decoder step of one precision (`compute_type`: "float32", "bfloat16" or
"int8"; "default" is the model's own dtype). `translate_batch` and `generate` read the model's generation config
(Section 6.1: beam 4, GNMT length penalty 0.6, source length + 50 tokens), as `model.generate()` does, since both
go through it: `generate()` resolves the settings (model/generation_vaswani.py) and hands the call to `serve`
here, which decodes it with greedy or beam search (search.py) or declines (None) where it cannot make
transformers' choices (sampling, scores returned, a decoder prefix, a streamer, a processor or criterion it does
not know): transformers' loops then decode it, with the same ids.
"""

from __future__ import annotations

import copy
import logging
import math
import os
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig
from transformers.generation import logits_process

from vaswani_tx.model.errors import UserInputError

from .search import Processors, beam_search, greedy_search
from .settings import as_generate_reads
from .step import DecoderStep

logger = logging.getLogger(__name__)

# generate() arguments the engine reads (beside the generation config's fields, which any call may set)
MODEL_INPUTS = {"input_ids", "attention_mask", "use_cache"}
# Generation-config fields and the values with which the engine makes transformers' choices (None: unset, which
# transformers reads as its default).
SUPPORTED = {
    "do_sample": (False, None),
    "num_return_sequences": (1, None),
    "output_scores": (False, None),
    "output_logits": (False, None),
    "output_attentions": (False, None),
    "output_hidden_states": (False, None),
    "return_dict_in_generate": (False, None),
    "guidance_scale": (None, 1, 1.0),
    "sequence_bias": (None,),
    "encoder_repetition_penalty": (None, 1.0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "exponential_decay_length_penalty": (None,),
    "remove_invalid_values": (False, None),
    "renormalize_logits": (False, None),
    "cache_implementation": (None,),
    "watermarking_config": (None,),
    "assistant_model": (None,),
    "prompt_lookup_num_tokens": (None,),
    "num_beam_groups": (1, None),
    "diversity_penalty": (0.0, None),
    "constraints": (None,),
    "force_words_ids": (None,),
    "low_memory": (None, False),
}
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
CONFIG_FIELDS = frozenset(vars(GenerationConfig()))  # what a generate() keyword may set in the generation config


@dataclass
class TranslationResult:
    """One source's translations, best first (CTranslate2's `TranslationResult`): token ids, without the decoder's
    start token, `</s>` and padding."""

    hypotheses: list[list[int]] = field(default_factory=list)


class Translator:
    """A model and its decoder step of one precision, kept for many calls. The float32 and bfloat16 steps read the
    model's own tensors (a model of the other dtype is copied into this one's, once); the int8 step holds its own
    int8 copy of the decoder's linear maps, beside the model's float32 encoder."""

    def __init__(self, model_or_folder, compute_type: str = "default", device: str | torch.device | None = None):
        if isinstance(model_or_folder, (str, os.PathLike)):
            from transformers import AutoModelForSeq2SeqLM

            model_or_folder = AutoModelForSeq2SeqLM.from_pretrained(model_or_folder)
        self.model = model_or_folder if device is None else model_or_folder.to(device)
        own = DTYPES.get(next(self.model.parameters()).dtype)
        self.compute_type = own if compute_type in ("default", None) else compute_type
        if self.compute_type is None:
            raise ValueError(f"the engine decodes float32, bfloat16 and int8; this model is {self.model.dtype}")
        if self.compute_type == "int8" and (self.model.device.type != "cpu" or own != "float32"):
            raise ValueError(f"int8 decoding runs on the CPU from float32 weights; this model is {self.model.dtype} "
                             f"on {self.model.device}")  # fmt: skip
        if self.compute_type in ("float32", "bfloat16") and self.compute_type != own:
            # a copy of the whole model in that dtype, the encoder too: one path per precision (the model's own)
            self.model = copy.deepcopy(self.model).to(getattr(torch, self.compute_type))
        self.step = DecoderStep(self.model, self.compute_type)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        """`model.generate(...)` decoded by this translator's step: the same arguments and output."""
        return self.model.generate(input_ids=input_ids, attention_mask=attention_mask, translator=self, **kwargs)

    def translate_batch(
        self,
        source: list[list[int]],
        beam_size: int | None = None,
        length_penalty: float | None = None,
        max_decoding_length: int | None = None,
        min_decoding_length: int = 0,
    ) -> list[TranslationResult]:
        """Translate a batch of sources (lists of token ids, each ending with `</s>` as the tokenizer makes them).
        Unset settings are the generation config's; `max_decoding_length` replaces its per-source cap."""
        config = self.model.config
        if not source or any(len(ids) == 0 for ids in source):
            raise ValueError("translate_batch: give at least one source, each of at least one token")
        longest = max(len(ids) for ids in source)
        input_ids = torch.full((len(source), longest), config.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, ids in enumerate(source):
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention_mask[row, : len(ids)] = 1
        settings = {"num_beams": beam_size, "length_penalty": length_penalty, "max_new_tokens": max_decoding_length}
        settings = {name: value for name, value in settings.items() if value is not None}
        if min_decoding_length:
            settings["min_new_tokens"] = min_decoding_length
        out = self.generate(input_ids.to(self.model.device), attention_mask.to(self.model.device), **settings)
        special = {config.pad_token_id, config.eos_token_id, config.decoder_start_token_id}
        return [TranslationResult([[t for t in row.tolist()[1:] if t not in special]]) for row in out]


def processors_for(config: GenerationConfig, eos: list[int], max_length: int, caller: list) -> list:
    """The logits processors transformers' `generate()` makes from `config` (those the engine supports, in its
    order), then the caller's; a caller's processor of the same type takes the place of the config's."""
    made = []
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        made.append(logits_process.RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        made.append(logits_process.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        made.append(logits_process.NoBadWordsLogitsProcessor(config.bad_words_ids, eos))
    if config.min_length:
        made.append(logits_process.MinLengthLogitsProcessor(config.min_length, eos))
    if config.min_new_tokens:
        made.append(logits_process.MinNewTokensLengthLogitsProcessor(1, config.min_new_tokens, eos))
    if config.forced_bos_token_id is not None:
        made.append(logits_process.ForcedBOSTokenLogitsProcessor(config.forced_bos_token_id))
    if config.forced_eos_token_id is not None:
        made.append(logits_process.ForcedEOSTokenLogitsProcessor(max_length, config.forced_eos_token_id))
    if config.suppress_tokens is not None:
        made.append(logits_process.SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        begin = 1 if config.forced_bos_token_id is None else 2
        made.append(logits_process.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, begin))
    merged = [next((mine for mine in caller if type(mine) is type(own)), own) for own in made]
    return merged + [mine for mine in caller if mine not in merged]


def check_search_arguments(config: GenerationConfig) -> None:
    """Refuse settings no search can follow, naming the argument and what is allowed, where transformers' loops
    would fail on something else (a division by zero for `num_beams=0`): `num_beams` and `num_return_sequences`
    whole numbers >= 1, `length_penalty` a finite number."""
    for name in ("num_beams", "num_return_sequences"):
        given = getattr(config, name, None)
        if given is not None and (isinstance(given, bool) or not isinstance(given, int) or given < 1):
            raise UserInputError(f"generate(): {name}={given!r} is not allowed; it must be a whole number >= 1.")
    penalty = config.length_penalty
    if penalty is not None and (
        isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not math.isfinite(penalty)
    ):
        shown = float(penalty) if isinstance(penalty, float) else penalty  # not the GNMT wrapper's repr
        raise UserInputError(f"generate(): length_penalty={shown!r} is not allowed; it must be a finite number.")


def serve(model, translator: Translator | None, inputs, generation_config, logits_processor, kwargs: dict):
    """Decode a `generate()` call whose settings the model has resolved (its GNMT length penalty and per-source
    cap are in `generation_config`/`kwargs` and `logits_processor`), or None where transformers' loops must:
    greedy or beam search, no sampling, only the sequences returned, no decoder prefix, a model in eval mode;
    never more output tokens than the model's positions (`max_position_embeddings`).
    With `translator`, its step (int8, bfloat16); else a float32 or bfloat16 step over the model's own weights."""
    # transformers' order: the config's fields, its defaults where those are None, then the call's arguments
    config = as_generate_reads(generation_config if generation_config is not None else model.generation_config)
    config.update(**{name: value for name, value in kwargs.items() if name in CONFIG_FIELDS})
    check_search_arguments(config)
    lengths = (kwargs.get("max_length"), getattr(generation_config, "max_length", None))
    length_unset = all(length is None for length in (*lengths, model.generation_config.max_length))
    decoded = _search(model, translator, config, length_unset, inputs, logits_processor, kwargs)
    if decoded is None and translator is not None and translator.compute_type != "float32":
        logger.warning(
            "generate(): these settings need transformers' loops, which decode the model in its own dtype, "
            "not the %s translator's step",
            translator.compute_type,
        )
    return decoded


def _search(
    model,
    translator: Translator | None,
    config: GenerationConfig,
    length_unset: bool,
    inputs,
    logits_processor,
    kwargs,
):
    input_ids = kwargs.get("input_ids", inputs)
    stopping = kwargs.get("stopping_criteria")
    if (
        not isinstance(input_ids, torch.Tensor)
        or input_ids.dim() != 2
        or input_ids.dtype != torch.long
        or model.training
        or (stopping is not None and len(stopping) > 0)
        or kwargs.get("streamer") is not None
        or any(name not in MODEL_INPUTS and name not in CONFIG_FIELDS for name in kwargs)
    ):
        return None
    if any(getattr(config, name, None) not in allowed for name, allowed in SUPPORTED.items()):
        return None
    if translator is None:
        if DTYPES.get(next(model.parameters()).dtype) is None:
            return None
        translator = Translator(model)
    eos = config.eos_token_id if config.eos_token_id is not None else model.config.eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    pad = config.pad_token_id if config.pad_token_id is not None else eos[0]
    start = config.decoder_start_token_id if config.decoder_start_token_id is not None else config.bos_token_id
    positions = model.config.max_position_embeddings
    if config.max_new_tokens is not None:
        max_length = config.max_new_tokens + 1
    elif length_unset:  # transformers: its default's 20 new tokens, within the positions
        max_length = min(config.max_length + 1, positions)
    else:
        max_length = config.max_length
    # Never past the positions the model was made for: each output token (</s> too) is read at one, the start
    # token at the first. A huge max_new_tokens would otherwise allocate and decode that many steps.
    max_length = min(max_length, positions + 1)
    processors = Processors(processors_for(config, eos, max_length, list(logits_processor or [])))
    attention_mask = kwargs.get("attention_mask")
    if attention_mask is not None and attention_mask.device.type == "cpu" and bool(attention_mask.all()):
        # Nothing is padding (a single sentence): the same attention as without a mask, minus building one and
        # adding it to every score (about 0.1 ms of a sentence's 1 ms encoder; asked only where it costs no sync)
        attention_mask = None
    with torch.inference_mode():
        memory = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        beams = config.num_beams
        step = translator.step.start(memory, attention_mask, input_ids.shape[0] * beams)
        first = torch.full((input_ids.shape[0],), start, dtype=torch.long, device=input_ids.device)
        if beams == 1:
            return greedy_search(step, first, processors, max_length, eos, pad)
        fill = pad if config.pad_token_id else eos[0]  # transformers' beam search pads with </s> where pad is 0
        return beam_search(
            step, first, processors, max_length, eos, fill, beams, config.length_penalty, config.early_stopping
        )
