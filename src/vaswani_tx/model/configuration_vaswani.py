"""`VaswaniConfig`: the hyper-parameters of "Attention Is All You Need" (Vaswani et al., 2017), by the paper's names.

Defaults are the base model of Table 3 with the shared 37,000-token EN-DE vocabulary of Section 5.1.
HF's conventional names (`hidden_size`, `num_attention_heads`, `encoder_layers`, ...) are aliases of
the paper's, so the Trainer, pipelines and `generate()` find what they look for.

This file is copied next to saved weights for `trust_remote_code`: it imports only transformers and
`errors.py` (which `save_pretrained` copies with it). A bad value raises `UserInputError`, a `ValueError`.
"""

from __future__ import annotations

import copy

from transformers import AutoConfig, PreTrainedConfig

from .errors import UserInputError

POSITION_ENCODINGS = ("sinusoidal", "learned", "fairseq_sinusoidal")
ACTIVATION_FUNCTIONS = ("relu", "swish")


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
            `"fairseq_sinusoidal"` is for converted fairseq/FSMT checkpoints: frequencies
            10000^(-i/(D/2 - 1)) instead of 10000^(-i/(D/2)), positions counted from `pad_token_id + 1`
            (the sin-half/cos-half layout is removed by permuting weights at conversion, not by an option).
        max_position_embeddings: number of learned positions; used only with `position_encoding="learned"`
            (sinusoids work for any length).
        tie_word_embeddings: one matrix for source embedding, target embedding and the pre-softmax
            projection (Section 3.4). `False` unties the pre-softmax projection only.
        scale_embedding: multiply embeddings by sqrt(d_model) (Section 3.4).
        layer_norm_eps: LayerNorm epsilon. The paper gives none; 1e-5 is PyTorch's, fairseq's and Marian's.
        pad_token_id, bos_token_id, eos_token_id, decoder_start_token_id: special ids of the shared vocabulary
            (the package's tokenizers use `<pad>`=0, `<unk>`=1, `<s>`=2, `</s>`=3; the decoder starts from `<s>`);
            with separate vocabularies, ids of the target vocabulary.
        tokenizer_fingerprint: `vaswani_tx.data.tokenization.vocabulary_fingerprint` of the tokenizer the model was
            trained or converted with (written by `train()` and `vaswani-tx convert`), so that loading it with
            another model's tokenizer of the same size is refused; `None` checks sizes and special ids only.

    Computation, not maths:
        skip_padding: compute the position-wise maps only where a result depends on them (real source
            positions, target positions up to the last label); padded positions' outputs are then not
            meaningful (zero logits at unlabelled positions when the model computes its loss). `False`
            computes every position, as other implementations do. Real positions are the same either way.

    Options for converted checkpoints (`vaswani_tx.interop.convert`); each default is the paper's:
        attention_bias: biases on W^Q, W^K, W^V and W^O (Marian, fairseq, FSMT have them; the paper's have none).
        activation_function: `"relu"` (Equation 2) or `"swish"` (x * sigmoid(x), many OPUS-MT models).
        final_logits_bias: a fixed bias added to the logits after the pre-softmax projection (Marian's buffer).
        share_encoder_decoder_embeddings: `False` gives the decoder its own table of `decoder_vocab_size`
            rows (FSMT, some OPUS-MT models: separate source and target vocabularies); `tie_word_embeddings`
            then ties the pre-softmax projection to the decoder's table.
        decoder_vocab_size: size of the target vocabulary; only with `share_encoder_decoder_embeddings=False`.
        decoder_d_ff: the decoder's feed-forward size where it differs from the encoder's `d_ff` (fairseq's
            and FSMT's WMT19 models: 8192 in the encoder, 4096 in the decoder); `None` = `d_ff`.
    """

    model_type = "vaswani"
    # the decoding cache, as transformers >= 5.24 and earlier 5.x releases name it
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
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
    tokenizer_fingerprint: str | None = None
    attention_bias: bool = False
    activation_function: str = "relu"
    final_logits_bias: bool = False
    share_encoder_decoder_embeddings: bool = True
    decoder_vocab_size: int | None = None
    decoder_d_ff: int | None = None
    skip_padding: bool = True
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
                raise UserInputError(
                    f"VaswaniConfig: d_model={self.d_model} is not divisible by num_heads={self.num_heads}, "
                    f"so {unset} cannot default to d_model // num_heads; set {unset} explicitly or choose "
                    "num_heads dividing d_model."
                )
            self.d_k = self.d_k if self.d_k is not None else self.d_model // self.num_heads
            self.d_v = self.d_v if self.d_v is not None else self.d_model // self.num_heads
        self._validate()

    def _validate(self) -> None:
        """Raise `UserInputError` (a `ValueError`) naming the field, its value and what is allowed."""
        for name in (
            "vocab_size",
            "d_model",
            "d_ff",
            "num_heads",
            "num_encoder_layers",
            "num_decoder_layers",
            "max_position_embeddings",
            "d_k",
            "d_v",
            "decoder_d_ff",
        ):
            value = getattr(self, name)
            if value is None and name in ("d_k", "d_v", "decoder_d_ff"):
                continue
            if not _is_int(value) or value <= 0:
                raise UserInputError(f"VaswaniConfig: {name}={value!r} is not allowed; it must be a positive integer.")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise UserInputError(f"VaswaniConfig: {name}={value!r} is not allowed; it must be a float in [0, 1).")
        if self.position_encoding not in POSITION_ENCODINGS:
            raise UserInputError(
                f"VaswaniConfig: position_encoding={self.position_encoding!r} is not allowed; "
                f"choose one of {POSITION_ENCODINGS}."
            )
        if self.position_encoding != "learned" and self.d_model % 2:
            raise UserInputError(
                f"VaswaniConfig: d_model={self.d_model} must be even with sinusoidal positions "
                "(sin and cos alternate over the dimensions, Section 3.5)."
            )
        if self.position_encoding == "fairseq_sinusoidal" and (self.pad_token_id is None or self.d_model < 4):
            raise UserInputError(
                f"VaswaniConfig: position_encoding='fairseq_sinusoidal' needs pad_token_id (positions start at "
                f"pad_token_id + 1) and d_model >= 4; got pad_token_id={self.pad_token_id!r}, d_model={self.d_model}."
            )
        if self.activation_function not in ACTIVATION_FUNCTIONS:
            raise UserInputError(
                f"VaswaniConfig: activation_function={self.activation_function!r} is not allowed; "
                f"choose one of {ACTIVATION_FUNCTIONS}."
            )
        for name in ("attention_bias", "final_logits_bias", "share_encoder_decoder_embeddings", "skip_padding"):
            if not isinstance(getattr(self, name), bool):
                raise UserInputError(
                    f"VaswaniConfig: {name}={getattr(self, name)!r} is not allowed; it must be True or False."
                )
        if self.share_encoder_decoder_embeddings and self.decoder_vocab_size not in (None, self.vocab_size):
            raise UserInputError(
                f"VaswaniConfig: decoder_vocab_size={self.decoder_vocab_size!r} differs from vocab_size={self.vocab_size} "
                "but share_encoder_decoder_embeddings=True; set share_encoder_decoder_embeddings=False for a "
                "separate target vocabulary."
            )
        if not self.share_encoder_decoder_embeddings and (
            not _is_int(self.decoder_vocab_size) or self.decoder_vocab_size <= 0
        ):
            raise UserInputError(
                f"VaswaniConfig: decoder_vocab_size={self.decoder_vocab_size!r} is not allowed; with "
                "share_encoder_decoder_embeddings=False it must be the target vocabulary's size (a positive integer)."
            )
        if not isinstance(self.layer_norm_eps, (int, float)) or self.layer_norm_eps <= 0:
            raise UserInputError(
                f"VaswaniConfig: layer_norm_eps={self.layer_norm_eps!r} is not allowed; it must be > 0."
            )
        for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is None:
                continue
            if not _is_int(value) or not 0 <= value < self.target_vocab_size:
                size = "vocab_size" if self.share_encoder_decoder_embeddings else "decoder_vocab_size"
                raise UserInputError(
                    f"VaswaniConfig: {name}={value!r} is not allowed; it must be an id in [0, {size}={self.target_vocab_size})."
                )

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> VaswaniConfig:
        """One config serves both ends; `num_hidden_layers` names the decoder's stack, which is what generate()
        sizes its cache by. The decoder's view (`decoder=True`) holds the target side's sizes: a shallow copy with
        `vocab_size` = `decoder_vocab_size` and `d_ff` = `decoder_d_ff` where they differ, else this config
        itself. transformers' view of a flat encoder-decoder config deep-copies it and sets those two to None;
        generate() asks for it three times a call (0.13 ms each, 0.4 ms a call)."""
        if not decoder or encoder:
            return self
        vocab_size, d_ff = self.target_vocab_size, self.decoder_d_ff or self.d_ff
        if (vocab_size, d_ff) == (self.vocab_size, self.d_ff):
            return self
        view = copy.copy(self)
        view.vocab_size, view.d_ff = vocab_size, d_ff
        return view

    @property
    def target_vocab_size(self) -> int:
        """Rows of the decoder's embedding and of the logits: `vocab_size` unless the vocabularies are separate."""
        return self.vocab_size if self.share_encoder_decoder_embeddings else self.decoder_vocab_size


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


if __name__ == "vaswani_tx.model.configuration_vaswani":  # the package's copy; transformers registers a saved folder's
    AutoConfig.register(VaswaniConfig.model_type, VaswaniConfig, exist_ok=True)
    VaswaniConfig.register_for_auto_class()

__all__ = ["VaswaniConfig"]
