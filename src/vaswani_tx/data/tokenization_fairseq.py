"""The tokenizer of converted fairseq and FSMT models: Moses + BPE, with the target vocabulary for targets.

transformers' `FSMTTokenizer` (its port of fairseq's WMT19 tokenization) has two flaws for a converted
model: it has no eos token (only `sep_token`), so nothing that asks for `eos_token_id` finds `</s>`, and
`tokenizer(text_target=...)` encodes targets with the *source* vocabulary, so with separate source and
target dictionaries every label id is wrong (`Ein Mann .` -> `<unk> <unk> Ein </s>`). `FairseqTokenizer`
is `FSMTTokenizer` with `</s>` as eos token and a target mode that Moses-tokenizes in the target language
and looks tokens up in the target vocabulary, as fairseq's `dict.<target>.txt` does.

`moses_normalize` chooses the pre-processing: FSMT's (Unicode punctuation replaced, Moses punctuation
normalisation, non-printing characters removed, then Moses tokenization; the WMT19 models' own) or
fairseq's `--tokenizer moses` (Moses tokenization only), which converted fairseq checkpoints use.

Before either, U+FEFF, U+200B and U+2060 are dropped from the text (as `vocabulary.drop_format_characters` does),
as every tokenizer of the package does: FSMT's normalisation removes them, fairseq's does not.

vaswani_tx.data.tokenization registers `FairseqTokenizer` with `AutoTokenizer` for `VaswaniConfig` (converted
folders name it in tokenizer_config.json), so `AutoTokenizer.from_pretrained(folder)` finds it without remote code.

This file travels with converted model folders for `AutoTokenizer.from_pretrained(folder,
trust_remote_code=True)`: it imports transformers only (FSMTTokenizer itself needs sacremoses).
"""

from __future__ import annotations

from transformers.models.fsmt.tokenization_fsmt import FSMTTokenizer

# U+FEFF, U+200B, U+2060: vaswani_tx.model.vocabulary's FORMAT_CHARACTERS (this file travels alone)
_NO_FORMAT_CHARACTERS = {0xFEFF: None, 0x200B: None, 0x2060: None}


class FairseqTokenizer(FSMTTokenizer):
    """`FSMTTokenizer` with `eos_token="</s>"` and targets encoded with the target vocabulary (see the module
    docstring). Source and target ids are fairseq's: `<s>`=0, `<pad>`=1, `</s>`=2, `<unk>`=3, then the
    dictionary's tokens in order."""

    def __init__(self, *args, eos_token: str = "</s>", moses_normalize: bool = True, **kwargs):
        self._target_mode = False
        self.moses_normalize = moses_normalize
        super().__init__(*args, eos_token=eos_token, moses_normalize=moses_normalize, **kwargs)
        self.target_encoder = {token: index for index, token in self.decoder.items()}

    def _switch_to_target_mode(self):
        self._target_mode = True

    def _switch_to_input_mode(self):
        self._target_mode = False

    def _tokenize(self, text: str, lang: str | None = None, bypass_tokenizer: bool = False) -> list[str]:
        """Moses tokens (in the target language in target mode), each split into BPE pieces."""
        lang = self.tgt_lang if self._target_mode else self.src_lang
        text = text.translate(_NO_FORMAT_CHARACTERS)
        if self.do_lower_case:
            text = text.lower()
        if bypass_tokenizer:
            words = text.split()
        else:
            if self.moses_normalize:
                text = self.moses_pipeline(text, lang=lang)
            words = self.moses_tokenize(text, lang=lang)
        return [piece for word in words if word for piece in self.bpe(word).split(" ")]

    def _convert_token_to_id(self, token: str) -> int:
        vocab = self.target_encoder if self._target_mode and hasattr(self, "target_encoder") else self.encoder
        return vocab.get(token, vocab.get(self.unk_token))


FairseqTokenizer.register_for_auto_class("AutoTokenizer")  # save_pretrained copies this file for remote code
__all__ = ["FairseqTokenizer"]
