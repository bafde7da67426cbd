"""vaswani_tx: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a Hugging Face model.

Importing the package registers ``VaswaniConfig`` and the models with ``AutoConfig``, ``AutoModel``
and ``AutoModelForSeq2SeqLM``, and marks them for ``trust_remote_code`` saving: ``save_pretrained``
writes ``auto_map`` and copies the config and model files next to the weights, so a saved folder
loads in a process where this package is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForSeq2SeqLM

from .configuration_vaswani import VaswaniConfig
from .generation_vaswani import GNMTLengthPenalty, paper_generation_config
from .modeling_vaswani import VaswaniForConditionalGeneration, VaswaniModel, VaswaniPreTrainedModel

__version__ = "0.1.0"

AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig, exist_ok=True)
AutoModel.register(VaswaniConfig, VaswaniModel, exist_ok=True)
AutoModelForSeq2SeqLM.register(VaswaniConfig, VaswaniForConditionalGeneration, exist_ok=True)
VaswaniConfig.register_for_auto_class()
VaswaniModel.register_for_auto_class("AutoModel")
VaswaniForConditionalGeneration.register_for_auto_class("AutoModelForSeq2SeqLM")

__all__ = [
    "GNMTLengthPenalty",
    "VaswaniConfig",
    "VaswaniForConditionalGeneration",
    "VaswaniModel",
    "VaswaniPreTrainedModel",
    "paper_generation_config",
]
