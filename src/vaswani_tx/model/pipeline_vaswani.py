"""`pipeline("translation", model=folder, trust_remote_code=True)` for saved vaswani_tx models.

transformers 5 removed the built-in translation task (`pipeline("translation")` raises KeyError). A
model can still declare its own pipeline: `save_pretrained` writes
`config.custom_pipelines = {"translation": {"impl": "pipeline_vaswani.VaswaniTranslationPipeline", ...}}`
and copies this file next to the weights, so the hub route works with or without the package:

    pipeline("translation", model="path/or/repo", trust_remote_code=True)("Ein Hund läuft.")
    # [{'translation_text': 'A dog runs.'}]

With the package installed the class can also be passed directly:
`pipeline("translation", model=folder, pipeline_class=VaswaniTranslationPipeline)`, or built around a
model object with `VaswaniTranslationPipeline(model=model, tokenizer=tokenizer)`.

Like every command, the pipeline refuses a tokenizer that does not fit the model
(`vocabulary.check_tokenizer_fits_model`: sizes, special ids, and the fingerprint of the tokenizer the model was
trained or converted with, so another model's tokenizer of the same size is refused rather than decoded into
gibberish), drops U+FEFF, U+200B and U+2060 from the text (`vocabulary.drop_format_characters`), and warns about
an input longer than the positions the model was made for (`max_position_embeddings`).

This file is copied next to saved weights: it imports only transformers and the files that travel with it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from transformers import Pipeline

from .errors import UserInputError
from .vocabulary import check_tokenizer_fits_model, drop_format_characters

logger = logging.getLogger(__name__)

TASK = "translation"
# A list's batches, as `vaswani-tx translate` plans them: at most this many padded source tokens (`max_tokens`)
MAX_TOKENS = 4096
CUSTOM_PIPELINES = {
    TASK: {
        "impl": "pipeline_vaswani.VaswaniTranslationPipeline",
        "pt": ["AutoModelForSeq2SeqLM"],
        "type": "text",
    }
}


class VaswaniTranslationPipeline(Pipeline):
    """Translate a string or a list of strings with `model.generate` (the model's decoding defaults, Section 6.1).

    Generation keyword arguments (`num_beams`, `length_penalty`, `max_new_tokens`, `length_penalty_type`,
    `max_output_length_offset`, ...) pass through to `generate`, at construction or per call. Returns one
    `{"translation_text": ...}` per input, in input order. A list is translated as `vaswani-tx translate` and
    CTranslate2's `translate_batch` do: sorted by length and cut into batches (padded on the right) of at most
    `max_tokens` padded source tokens (4,096 where no `batch_size` is given) and at most `batch_size` sentences, so
    that little of each batch is padding (`plan_batches`).
    """

    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _pipeline_calls_generate = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.tokenizer is None:
            raise UserInputError("the translation pipeline needs the model's tokenizer: pass tokenizer=...")
        check_tokenizer_fits_model(self.tokenizer, self.model.config)

    def _sanitize_parameters(self, truncation=None, clean_up_tokenization_spaces=None, **generate_kwargs):
        preprocess_params = {} if truncation is None else {"truncation": truncation}
        postprocess_params = {}
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        return preprocess_params, generate_kwargs, postprocess_params

    def __call__(self, inputs, max_tokens: int | None = None, **kwargs):
        if isinstance(inputs, str):
            return super().__call__(inputs, **kwargs)
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(text, str) for text in inputs):
            raise TypeError("The translation pipeline takes a string or a list of strings.")
        texts = list(inputs)
        if not texts:
            return []
        batch_size = kwargs.pop("batch_size", None)
        kwargs.pop("num_workers", None)  # (no DataLoader: the list is tokenized at once)
        if batch_size is None:
            batch_size = self._batch_size
        if max_tokens is None and batch_size is None:
            max_tokens = MAX_TOKENS
        # the call's parameters over those given at construction, as transformers' `Pipeline.__call__` merges them
        kept = (self._preprocess_params, self._forward_params, self._postprocess_params)
        preprocess_params, forward_params, postprocess_params = (
            {**before, **given} for before, given in zip(kept, self._sanitize_parameters(**kwargs))
        )
        # The whole list tokenized in one call, each batch padded from its ids and decoded at once, as `translate`
        # does: transformers' list path tokenizes, collates and post-processes a sentence at a time, about 0.1 ms a
        # sentence (Multi30k val in batches, greedy, one thread: 3.71 against 3.62 s a pass, docs/speed.md).
        encoded = self.tokenizer(
            [drop_format_characters(text) for text in texts], truncation=preprocess_params.get("truncation", False)
        )["input_ids"]
        for text, ids in zip(texts, encoded):
            self._warn_if_long(text, len(ids))
        results = [None] * len(texts)
        # In input order a batch is as long as its longest sentence (Multi30k val, 32 sentences a batch: 1.05-1.1x
        # faster sorted; batches of 4,096 tokens rather than 32 sentences another 1.1-1.3x, docs/speed.md)
        for batch in plan_batches(
            [len(ids) for ids in encoded], sys.maxsize if max_tokens is None else max_tokens, batch_size
        ):
            model_inputs = self.tokenizer.pad(
                {"input_ids": [encoded[index] for index in batch]}, padding_side="right", return_tensors="pt"
            )
            translated = self.postprocess(self.forward(model_inputs, **forward_params), **postprocess_params)
            for index, result in zip(batch, translated):
                results[index] = result
        return results

    def preprocess(self, text: str, truncation: bool = False):
        inputs = self.tokenizer(drop_format_characters(text), return_tensors="pt", truncation=truncation)
        self._warn_if_long(text, inputs["input_ids"].shape[1])
        return inputs

    def _warn_if_long(self, text: str, length: int) -> None:
        positions = self.model.config.max_position_embeddings
        if length > positions:
            logger.warning(
                "an input of %d tokens (%r...) is longer than the %d positions the model was made for "
                "(max_position_embeddings): its translation may stop early; split it into sentences",
                length,
                text[:40],
                positions,
            )

    def _forward(self, model_inputs, **generate_kwargs):
        model_inputs.pop("token_type_ids", None)
        output_ids = self.model.generate(**model_inputs, **self._prepare_generate_kwargs(generate_kwargs))
        return {"output_ids": output_ids}

    def postprocess(self, model_outputs, clean_up_tokenization_spaces: bool = False):
        return [
            {
                "translation_text": self.tokenizer.decode(
                    ids, skip_special_tokens=True, clean_up_tokenization_spaces=clean_up_tokenization_spaces
                )
            }
            for ids in model_outputs["output_ids"]
        ]


def plan_batches(lengths: Sequence[int], max_tokens: int, max_sentences: int | None = None) -> list[list[int]]:
    """Group indices into batches of at most ``max_tokens`` padded source tokens, longest first.

    Sorting by length keeps padding small; the longest batch comes first so that running out of
    memory shows at once rather than after an hour. A sentence longer than the budget gets a batch of
    its own (decoding never drops a line, unlike training's sampler). Ties keep input order.
    """
    if max_tokens < 1:
        raise UserInputError(f"max_tokens must be at least 1, got {max_tokens}")
    if max_sentences is not None and max_sentences < 1:
        raise UserInputError(f"max_sentences (batch size) must be at least 1, got {max_sentences}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        # lengths only fall along the order, so the batch's first sentence is its longest
        longest = lengths[current[0]] if current else lengths[index]
        full = max_sentences is not None and len(current) >= max_sentences
        if current and (full or longest * (len(current) + 1) > max_tokens):
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


__all__ = ["CUSTOM_PIPELINES", "MAX_TOKENS", "TASK", "VaswaniTranslationPipeline", "plan_batches"]
