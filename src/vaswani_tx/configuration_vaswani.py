"""`VaswaniConfig`: the hyper-parameters of "Attention Is All You Need" (Vaswani et al., 2017), by the paper's names.

Defaults are the base model of Table 3 with the shared 37,000-token EN-DE vocabulary of Section 5.1.
HF's conventional names (`hidden_size`, `num_attention_heads`, `encoder_layers`, ...) are aliases of
the paper's, so the Trainer, pipelines and `generate()` find what they look for.

This file is copied next to saved weights for `trust_remote_code`: it imports only transformers.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

POSITION_ENCODINGS = ("sinusoidal", "learned")


class VaswaniConfig(PreTrainedConfig):
    r"""
    Configuration of the Transformer (Vaswani et al., 2017). Every value is the paper's unless noted.

    Args:
        vocab_size: size of the one vocabulary shared by source and target (Section 5.1: ~37,000 BPE for EN-DE).
        d_model: model width (Section 3.1; 512 base, 1024 big).
        d_ff: inner size of the position-wise feed-forward network (Section 3.3; 2048 base, 4096 big).
        num_heads: parallel attention heads h (Section 3.2.2).
        d_k, d_v: per-head query/key and value sizes; default `d_model // num_heads` and may differ
            from it (Table 3 rows A and B).
        num_encoder_layers, num_decoder_layers: N for each stack (Section 3.1).
        dropout: P_drop on each sub-layer output and on embeddings + positions (Section 5.4).
        attention_dropout: dropout on attention weights. 0 as in the paper (the tensor2tensor code had it as an option).
        activation_dropout: dropout after the FFN's ReLU. 0 as in the paper.
        position_encoding: `"sinusoidal"` (Section 3.5) or `"learned"` (Table 3 row E).
        max_position_embeddings: number of learned positions; used only with `position_encoding="learned"`
            (sinusoids work for any length).
        tie_word_embeddings: one matrix for source embedding, target embedding and the pre-softmax
            projection (Section 3.4). `False` unties the pre-softmax projection only.
        scale_embedding: multiply embeddings by sqrt(d_model) (Section 3.4).
        layer_norm_eps: LayerNorm epsilon. The paper gives none; 1e-5 is PyTorch's, fairseq's and Marian's.
        pad_token_id, bos_token_id, eos_token_id, decoder_start_token_id: special ids of the shared vocabulary
            (the package's tokenizers use `<pad>`=0, `<unk>`=1, `<s>`=2, `</s>`=3; the decoder starts from `<s>`).
    """

    model_type = "vaswani"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "num_heads",
        "encoder_attention_heads": "num_heads",
        "decoder_attention_heads": "num_heads",
        "intermediate_size": "d_ff",
        "encoder_ffn_dim": "d_ff",
        "decoder_ffn_dim": "d_ff",
        "encoder_layers": "num_encoder_layers",
        "decoder_layers": "num_decoder_layers",
        # generate() sizes the decoder's cache from num_hidden_layers, so it names the decoder stack.
        "num_hidden_layers": "num_decoder_layers",
    }

    vocab_size: int = 37000
    d_model: int = 512
    d_ff: int = 2048
    num_heads: int = 8
    d_k: int | None = None
    d_v: int | None = None
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    position_encoding: str = "sinusoidal"
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = True
    scale_embedding: bool = True
    layer_norm_eps: float = 1e-5
    pad_token_id: int | None = 0
    bos_token_id: int | None = 2
    eos_token_id: int | None = 3
    decoder_start_token_id: int | None = 2
    is_encoder_decoder: bool = True
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        # d_k, d_v default to d_model / h (Section 3.2.2); fill them before validating so the
        # divisibility error can name what is wrong.
        if self.d_k is None or self.d_v is None:
            if not _is_int(self.d_model) or not _is_int(self.num_heads) or self.num_heads <= 0:
                self._validate()  # reports the bad d_model / num_heads
            if self.d_model % self.num_heads:
                unset = " and ".join(name for name in ("d_k", "d_v") if getattr(self, name) is None)
                raise ValueError(
                    f"VaswaniConfig: d_model={self.d_model} is not divisible by num_heads={self.num_heads}, "
                    f"so {unset} cannot default to d_model // num_heads; set {unset} explicitly or choose "
                    "num_heads dividing d_model."
                )
            self.d_k = self.d_k if self.d_k is not None else self.d_model // self.num_heads
            self.d_v = self.d_v if self.d_v is not None else self.d_model // self.num_heads
        self._validate()

    def _validate(self) -> None:
        """Raise `ValueError` naming the field, its value and what is allowed."""
        for name in ("vocab_size", "d_model", "d_ff", "num_heads", "num_encoder_layers", "num_decoder_layers",
                     "max_position_embeddings", "d_k", "d_v"):
            value = getattr(self, name)
            if value is None and name in ("d_k", "d_v"):
                continue
            if not _is_int(value) or value <= 0:
                raise ValueError(f"VaswaniConfig: {name}={value!r} is not allowed; it must be a positive integer.")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"VaswaniConfig: {name}={value!r} is not allowed; it must be a float in [0, 1).")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(
                f"VaswaniConfig: position_encoding={self.position_encoding!r} is not allowed; "
                f"choose one of {POSITION_ENCODINGS}."
            )
        if self.position_encoding == "sinusoidal" and self.d_model % 2:
            raise ValueError(
                f"VaswaniConfig: d_model={self.d_model} must be even with sinusoidal positions "
                "(sin and cos alternate over the dimensions, Section 3.5)."
            )
        if not isinstance(self.layer_norm_eps, (int, float)) or self.layer_norm_eps <= 0:
            raise ValueError(f"VaswaniConfig: layer_norm_eps={self.layer_norm_eps!r} is not allowed; it must be > 0.")
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value) or not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"VaswaniConfig: {name}={value!r} is not allowed; it must be an id in [0, vocab_size={self.vocab_size})."
                )

    def num_parameters_closed_form(self) -> int:
        """Trainable parameters, from the sizes alone (Sections 3.2-3.5); checked against the built model in tests."""
        d, h = self.d_model, self.num_heads
        attention = d * h * self.d_k * 2 + d * h * self.d_v + h * self.d_v * d  # W^Q, W^K, W^V, W^O: no biases
        ffn = d * self.d_ff + self.d_ff + self.d_ff * d + d  # W1, b1, W2, b2
        norm = 2 * d
        encoder = self.num_encoder_layers * (attention + ffn + 2 * norm)
        decoder = self.num_decoder_layers * (2 * attention + ffn + 3 * norm)
        embeddings = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        positions = 2 * self.max_position_embeddings * d if self.position_encoding == "learned" else 0
        return encoder + decoder + embeddings + positions


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


__all__ = ["VaswaniConfig"]
