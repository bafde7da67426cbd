"""Fast decoding: one engine behind `Translator` (translator.py), greedy and beam search for any batch size
(search.py) over a decoder step of one precision (step.py). The model's `generate()` hands its calls here where
vaswani_tx is installed; docs/decoding.md says which path serves which call."""

from .translator import TranslationResult, Translator, serve

__all__ = ["TranslationResult", "Translator", "serve"]
