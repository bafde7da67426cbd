"""vaswani_tx: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a Hugging Face model.

Importing the package registers ``VaswaniConfig`` and the models with ``AutoConfig``, ``AutoModel``
and ``AutoModelForSeq2SeqLM`` and the tokenizer of converted fairseq and FSMT models, ``FairseqTokenizer``,
with ``AutoTokenizer``, and marks them for ``trust_remote_code`` saving: ``save_pretrained`` writes
``auto_map`` and copies the config, model and tokenizer files next to the weights, so a saved folder
loads in a process where this package is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM, AutoTokenizer

from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import GNMTLengthPenalty, paper_generation_config
from .modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel
from .tokenization_fairseq import FairseqTokenizer

__version__ = "0.1.0"

AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig, exist_ok=True)
AutoModel.register(VaswaniConfig, VaswaniModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(VaswaniConfig, VaswaniForConditionalGeneration, exist_ok=True)
VaswaniConfig.register_for_auto_class()
VaswaniModel.register_for_auto_class("AutoModel")
VaswaniForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")
# Converted fairseq and FSMT folders name FairseqTokenizer (and carry its file for trust_remote_code): with the
# package imported, AutoTokenizer.from_pretrained(folder) finds the package's own class without remote code.
AutoTokenizer.register(VaswaniConfig, tokenizer_class=FairseqTokenizer, exist_ok=True)
FairseqTokenizer.register_for_auto_class("AutoTokenizer")

__all__ = [
    "FairseqTokenizer",
    "GNMTLengthPenalty",
    "VaswaniConfig",
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "paper_generation_config",
]
