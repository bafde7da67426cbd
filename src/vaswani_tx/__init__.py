"""vaswani_tx: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) as a Hugging Face model.

Importing the package registers ``VaswaniConfig`` and the models with ``AutoConfig``, ``AutoModel``
and ``AutoModelForSeq2SeqLM``.
"""

__version__ = "0.1.0"
