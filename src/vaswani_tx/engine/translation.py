"""Translating text and files with a saved model, the paper's way (Section 6.1), as fast as batching allows.

The library side of ``vaswani-tx translate`` and ``vaswani-tx evaluate``:

* ``load_translator(folder, device, dtype)`` loads any ``from_pretrained`` folder of this package (a
  training run's output, an averaged checkpoint, a hub download) with its tokenizer, and refuses with
  a clear message a folder that is not a model, a model of another type, truncated weights or a
  tokenizer whose ids do not fit the model.
* ``Translator.translate(lines)`` decodes with the model's ``generation_config`` (beam 4, length
  penalty alpha 0.6 in the GNMT form, at most source length + 50 tokens), any of which can be
  overridden. Lines are batched by a token budget in length order, as Marian and fairseq do, so
  little compute goes to padding, and come back in input order. Empty lines stay empty (the model
  never sees them) and every output is one line: the count and order of lines never change.
  U+FEFF, U+200B and U+2060 are dropped from each line first (``vocabulary.drop_format_characters``,
  for every tokenizer, converted ones and those trained before their normalizer dropped them), and a
  line longer than the positions the model was made for (``max_position_embeddings``) is refused before
  any decoding, naming its number and length (``model.errors.check_source_length``, the demo page's
  check), or cut to fit with a warning (``truncate=True``, ``--truncate``).
* ``read_text(path)`` (``vaswani_tx.metrics.evaluation``'s) reads a file or standard input as the ``sacrebleu`` command does (lines end at
  ``\\n`` only; non-UTF-8 input is refused naming the line).

This module imports the model, not the training code.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vaswani_tx.atomic import write_text
from vaswani_tx.data.tokenization import check_tokenizer_fits_model, drop_format_characters_in
from vaswani_tx.folders import check_safetensors
from vaswani_tx.metrics.evaluation import read_text
from vaswani_tx.model.errors import UserInputError, check_source_length
from vaswani_tx.model.vocabulary import drop_format_characters

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
TOO_LONG = "split it into sentences, or pass --truncate (truncate=True) to cut it to fit"

# Characters str.splitlines() treats as line ends: a hypothesis holding one would shift every later line.
_LINE_BREAKS = re.compile("[\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]")


# A batch's budget, as Marian's and fairseq's: at most this many padded source tokens (`max_tokens`)
MAX_TOKENS = 4096


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


def one_line(text: str) -> str:
    """A hypothesis as exactly one output line: inner line breaks become spaces, outer whitespace goes."""
    return _LINE_BREAKS.sub(" ", text).strip()


def check_model_folder(folder: Path) -> None:
    """Refuse a folder that is not a loadable vaswani_tx model (missing, no config, another model type, no
    or truncated weights), naming the problem; a model of another type names `vaswani-tx convert`."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise UserInputError(
            f"{folder} is not a model folder: it has no config.json (give the output of save_pretrained, "
            "`vaswani-tx train` or `vaswani-tx average-checkpoints`)"
        )
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as err:
        raise UserInputError(f"{config_file} is not a valid JSON config ({err})") from None
    if model_type != "vaswani":
        raise UserInputError(
            f"{folder} holds a model of type {model_type!r}, not a vaswani_tx model ('vaswani'): "
            f"convert it first (`vaswani-tx convert {folder} OUT`)"
        )
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise UserInputError(f"{folder} has a config but no weights ({' or '.join(WEIGHT_FILES)})")
    if (folder / WEIGHT_FILES[0]).is_file():
        check_safetensors(folder / WEIGHT_FILES[0])  # CheckpointError, a UserInputError, for truncated weights


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` or ``"auto"``: the GPU when there is one, else the CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError as err:  # torch's word for a string that names no device
        raise UserInputError(f"unknown device {device!r} ({err})") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise UserInputError(f"device {device!r}: no CUDA GPU is available here; use --device cpu (or auto)")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise UserInputError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    if resolved.type == "mps" and not torch.backends.mps.is_available():
        raise UserInputError(f"device {device!r}: MPS is not available here; use --device cpu (or auto)")
    return resolved


@dataclass
class Translator:
    """A model and its tokenizer, ready to translate lines in batches (see the module docstring). `engine`: the
    decoding engine's translator of another precision than the model's (`int8`), which decodes every batch."""

    model: Any
    tokenizer: Any
    engine: Any = None

    @property
    def device(self) -> torch.device:
        return self.model.device

    def translate(
        self,
        lines: Sequence[str],
        *,
        num_beams: int | None = None,
        length_penalty: float | None = None,
        max_tokens: int = MAX_TOKENS,
        batch_size: int | None = None,
        progress: bool = False,
        processors_for: Callable[[list[int]], list[Any]] | None = None,
        skip_special_tokens: bool = True,
        truncate: bool = False,
        **generate_kwargs: Any,
    ) -> list[str]:
        """One translation per line, in input order; empty or blank lines give empty lines.

        ``num_beams`` and ``length_penalty`` (alpha) default to the model's generation config (the
        paper's 4 and 0.6); other keyword arguments go to ``generate``. ``max_tokens`` bounds the
        padded source tokens of a batch (memory grows with it times the beam), ``batch_size`` its
        sentences. ``progress`` shows a tqdm bar on standard error, counted in lines.
        ``processors_for(indices)`` gives extra ``LogitsProcessor``s for the batch of ``lines[i]`` for
        ``i`` in ``indices``, in batch order (per-sentence constraints such as the parser's trees).
        ``skip_special_tokens=False`` keeps every token in the text, ``<unk>`` and the markers included.
        A line of more tokens than the model's positions (``max_position_embeddings``, ``</s>`` counted) is refused
        before any decoding, naming it (`UserInputError`); ``truncate=True`` cuts it to fit instead, with a warning.
        """
        from tqdm.auto import tqdm

        if num_beams is not None:
            generate_kwargs["num_beams"] = num_beams
        if length_penalty is not None:
            generate_kwargs["length_penalty"] = length_penalty
        outputs = [""] * len(lines)
        lines = [drop_format_characters(line) for line in lines]
        todo = [i for i, line in enumerate(lines) if line.strip()]
        if not todo:  # nothing but empty or blank lines: as many empty lines out
            return outputs
        encoded = self.tokenizer([lines[i] for i in todo], add_special_tokens=True)["input_ids"]
        self._fit_lengths(lines, todo, encoded, truncate)
        batches = plan_batches([len(ids) for ids in encoded], max_tokens, batch_size)
        bar = tqdm(total=len(lines), unit="line", desc="Translating", disable=not progress, file=sys.stderr)
        bar.update(len(lines) - len(todo))
        with torch.inference_mode():
            for batch in batches:
                if len(batch) == 1 and "attention_mask" in self.tokenizer.model_input_names:
                    # nothing to pad (a single sentence: the tokenizer's pad costs 0.1-0.2 ms), the same tensors
                    ids = torch.tensor([encoded[batch[0]]])
                    padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
                else:
                    padded = self.tokenizer.pad(
                        {"input_ids": [encoded[b] for b in batch]}, padding_side="right", return_tensors="pt"
                    )
                if processors_for is not None:
                    generate_kwargs["logits_processor"] = processors_for([todo[b] for b in batch])
                generated = self.model.generate(
                    input_ids=padded["input_ids"].to(self.device),
                    attention_mask=padded["attention_mask"].to(self.device),
                    translator=self.engine,
                    **generate_kwargs,
                )
                texts = self.tokenizer.batch_decode(generated, skip_special_tokens=skip_special_tokens)
                for b, text in zip(batch, texts):
                    outputs[todo[b]] = one_line(text)
                bar.update(len(batch))
        bar.close()
        return outputs

    def _fit_lengths(self, lines: Sequence[str], todo: list[int], encoded: list[list[int]], truncate: bool) -> None:
        """Refuse a line longer than the model's positions (`check_source_length`), or with `truncate` cut it to
        fit as its tokenizer cuts (its end-of-sentence kept), one warning a line."""
        config = self.model.config
        for row, (index, ids) in enumerate(zip(todo, encoded)):
            if not truncate:
                check_source_length(len(ids), config, f"line {index + 1}", TOO_LONG)
            elif len(ids) > config.max_position_embeddings:
                logger.warning(
                    "line %d is %d tokens long, more than the model's %d positions (max_position_embeddings): "
                    "cut to its first %d tokens (--truncate)",
                    index + 1,
                    len(ids),
                    config.max_position_embeddings,
                    config.max_position_embeddings,
                )
                limit = config.max_position_embeddings
                encoded[row] = self.tokenizer(lines[index], truncation=True, max_length=limit)["input_ids"]


def load_translator(
    folder: str | os.PathLike,
    device: str | torch.device | None = "cpu",
    dtype: str | torch.dtype | None = None,
    int8: bool = False,
) -> Translator:
    """Load a saved model folder and its tokenizer for translation (``device="auto"`` picks the GPU if any).

    ``int8`` decodes with int8 products for every linear map (the engine's int8 step, ``vaswani_tx.engine``).

    Raises:
        FileNotFoundError: the folder does not exist.
        UserInputError: not a model folder, a model of another type, truncated weights, no usable
            tokenizer, a tokenizer that does not fit the model, or a device or dtype this machine cannot
            use; each message names the problem.
    """
    from transformers import AutoTokenizer

    from vaswani_tx.engine.precision import decoding_dtype  # "auto": bfloat16 where the device has fast bf16
    from vaswani_tx.model.modeling_vaswani import VaswaniForConditionalGeneration

    folder = Path(folder)
    check_model_folder(folder)
    try:
        tokenizer = drop_format_characters_in(AutoTokenizer.from_pretrained(folder))
    except (OSError, ValueError, TypeError) as err:  # transformers' words for tokenizer files it cannot read
        raise UserInputError(
            f"{folder} holds no tokenizer that AutoTokenizer can load ({err}); save the tokenizer next to "
            "the weights (tokenizer.save_pretrained(folder))"
        ) from err
    device = resolve_device(device)
    if int8 and (device.type != "cpu" or dtype not in (None, "float32", torch.float32)):
        raise UserInputError(f"int8 decoding runs on the CPU from float32 weights, not on {device} in {dtype}")
    model = VaswaniForConditionalGeneration.from_pretrained(folder, dtype=decoding_dtype(dtype, device))
    try:
        check_tokenizer_fits_model(tokenizer, model.config)
    except UserInputError as err:
        raise UserInputError(f"{folder}: {err}") from None
    model = model.to(device).eval()
    if int8:
        from vaswani_tx.engine import Translator as Engine

        return Translator(model, tokenizer, Engine(model, compute_type="int8"))
    return Translator(model, tokenizer)


def translate(
    model_dir: str | os.PathLike,
    sentences: Sequence[str],
    num_beams: int | None = None,
    batch_size: int | None = None,
    **kwargs: Any,
) -> list[str]:
    """Translate ``sentences`` with a saved model folder: ``load_translator(model_dir).translate(...)``."""
    return load_translator(model_dir).translate(sentences, num_beams=num_beams, batch_size=batch_size, **kwargs)


def write_lines(lines: Iterable[str], path: str | os.PathLike | None) -> None:
    """Write one line each to a file, whole or not at all (`vaswani_tx.atomic.write_text`: a failed or
    interrupted run leaves what the file held before; a device or FIFO is written directly), or to standard
    output for ``None``, ``"-"`` or ``/dev/stdout``."""
    write_text("-" if path is None else path, "".join(f"{line}\n" for line in lines))


__all__ = [
    "Translator",
    "check_model_folder",
    "load_translator",
    "one_line",
    "plan_batches",
    "read_text",
    "translate",
    "write_lines",
]
