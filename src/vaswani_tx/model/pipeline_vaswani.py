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
gibberish), drops U+FEFF, U+200B and U+2060 from the text (`vocabulary.drop_format_characters`), and refuses an
input longer than the positions the model was made for (`max_position_embeddings`), or with `truncation=True` cuts
it to them with a warning.

This file is copied next to saved weights: it imports only transformers and the files that travel with it.
"""

from __future__ import annotations

import logging

from transformers import Pipeline

from .errors import UserInputError, check_source_length
from .vocabulary import check_tokenizer_fits_model, drop_format_characters

logger = logging.getLogger(__name__)

TASK = "translation"
BATCH_SIZE = 32  # sentences in a batch of a list, where neither the pipeline nor the call gives `batch_size`
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
    `max_output_length_offset`, ...) pass through to `generate`, at construction or per call. A string gives
    `[{"translation_text": ...}]`; a list one `{"translation_text": ...}` per string, in input order, translated
    longest first in batches of `batch_size` sentences (32 where none is given).
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

    def __call__(self, inputs, **kwargs):
        if isinstance(inputs, str):
            return super().__call__(inputs, **kwargs)
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(text, str) for text in inputs):
            raise TypeError("The translation pipeline takes a string or a list of strings.")
        if kwargs.get("batch_size") is None and self._batch_size is None:
            kwargs["batch_size"] = BATCH_SIZE
        if kwargs["batch_size"] is not None and kwargs["batch_size"] < 1:
            raise UserInputError(f"batch_size must be at least 1, got {kwargs['batch_size']}")
        # longest first: a batch of sentences of about one length pads little (Multi30k val: 1.05-1.1x faster)
        order = sorted(range(len(inputs)), key=lambda index: -len(inputs[index]))
        results = [None] * len(inputs)
        for index, result in zip(order, super().__call__([inputs[i] for i in order], **kwargs) if inputs else []):
            results[index] = result[0]  # each input's list of one translation
        return results

    def preprocess(self, text: str, truncation: bool = False):
        text = drop_format_characters(text)
        inputs = self.tokenizer(text, return_tensors="pt", truncation=truncation)
        positions, length = self.model.config.max_position_embeddings, inputs["input_ids"].shape[1]
        if truncation and length > positions:  # the tokenizer's own limit may be longer than the model's
            logger.warning(
                "an input of %d tokens (%r...) is cut to the model's %d positions", length, text[:40], positions
            )
            inputs = self.tokenizer(text, return_tensors="pt", truncation=True, max_length=positions)
        what = f"the input {text[:40]!r}..."
        check_source_length(inputs["input_ids"].shape[1], self.model.config, what, "split it or pass truncation=True")
        return inputs

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


__all__ = ["BATCH_SIZE", "CUSTOM_PIPELINES", "TASK", "VaswaniTranslationPipeline"]
