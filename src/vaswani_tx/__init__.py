"""vaswani_tx: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a Hugging Face model.

``import vaswani_tx`` is light: it loads neither torch nor transformers (so ``vaswani-tx --help`` prints at
once). The classes below load on first use (``from vaswani_tx import VaswaniConfig``, ``vaswani_tx.VaswaniConfig``).
Using one of them, calling :func:`register_auto_classes`, or importing a module that defines them (as the
package's own modules do) registers ``VaswaniConfig`` and the models with ``AutoConfig``, ``AutoModel`` and
``AutoModelForSeq2SeqLM`` and the tokenizer of converted fairseq and FSMT models, ``FairseqTokenizer``, with
``AutoTokenizer``, and marks them for ``trust_remote_code`` saving: ``save_pretrained`` writes ``auto_map`` and
copies the config, model and tokenizer files next to the weights, so a saved folder loads in a process where this
package is not installed. ``import vaswani_tx`` alone registers nothing (that needs transformers, hence torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

# name -> the module that defines it
_CLASSES = {
    "VaswaniConfig": "model.configuration_vaswani",
    "VaswaniForConditionalGeneration": "model.modeling_vaswani",
    "VaswaniModel": "model.modeling_vaswani",
    "VaswaniPreTrainedModel": "model.modeling_vaswani",
    "GNMTLengthPenalty": "model.generation_vaswani",
    "paper_generation_config": "model.generation_vaswani",
    "FairseqTokenizer": "data.tokenization_fairseq",
    "decoding_dtype": "engine.precision",
    "train_tokenizer": "data.tokenization",
    "load_tokenizer": "data.tokenization",
}
# the modules whose import registers classes with transformers' Auto classes
_REGISTERING = ("model.configuration_vaswani", "model.modeling_vaswani", "data.tokenization")

if TYPE_CHECKING:
    from vaswani_tx.data.tokenization import load_tokenizer, train_tokenizer
    from vaswani_tx.data.tokenization_fairseq import FairseqTokenizer
    from vaswani_tx.engine.precision import decoding_dtype
    from vaswani_tx.model.configuration_vaswani import VaswaniConfig
    from vaswani_tx.model.generation_vaswani import GNMTLengthPenalty, paper_generation_config
    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel


def register_auto_classes() -> None:
    """Register the config, the models and `FairseqTokenizer` with transformers' Auto classes (each module
    registers its own classes when imported; this imports them all). Idempotent."""
    for module in _REGISTERING:
        importlib.import_module(f".{module}", __name__)


def __getattr__(name: str) -> Any:
    """The classes of `_CLASSES`, loaded on first use; loading one loads them all (`register_auto_classes`), so
    that every Auto class knows the package once any of them is used."""
    if name not in _CLASSES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    register_auto_classes()
    value = getattr(importlib.import_module(f".{_CLASSES[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "FairseqTokenizer",
    "GNMTLengthPenalty",
    "VaswaniConfig",
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "decoding_dtype",
    "load_tokenizer",
    "paper_generation_config",
    "register_auto_classes",
    "train_tokenizer",
]
