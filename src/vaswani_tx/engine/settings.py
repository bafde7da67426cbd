"""A generation config's decoding settings as `generate()` reads them, and in one line for people.

transformers 5's `GenerationConfig` leaves every field a checkpoint does not set None (OPUS-MT's
generation_config.json sets no `length_penalty`, a plain `save_pretrained` no `num_beams`), and `generate()` fills
those from `GenerationConfig._get_default_generation_params()` when it runs, as the class docstring says: beam 1,
alpha 1.0, `max_length` 20, no early stopping. Whatever reads or prints a config's settings (the engine, `convert`,
`evaluate`, the model card, the exports) reads them through `as_generate_reads`, so that it says what decoding does.

This file also travels into the Spaces `vaswani-tx demo --write-space` writes: it imports transformers only.
"""

from __future__ import annotations

import copy

from transformers import GenerationConfig


def as_generate_reads(config: GenerationConfig) -> GenerationConfig:
    """A copy of `config` whose None fields hold what `generate()` uses for them (transformers' defaults)."""
    resolved = copy.deepcopy(config)
    resolved.update(**GenerationConfig._get_default_generation_params(), defaults_only=True)
    return resolved


def describe_generation(config: GenerationConfig) -> str:
    """How `config` decodes, in one line: beam size, alpha and the length penalty's form, the output cap."""
    default_length = config.max_length is None and config.max_new_tokens is None
    config = as_generate_reads(config)
    gnmt = getattr(config, "length_penalty_type", "hf") == "gnmt"
    form = "GNMT form ((5 + |Y|) / 6)^alpha" if gnmt else "transformers' form |Y|^alpha, as MarianMT and FSMT decode"
    offset = getattr(config, "max_output_length_offset", None)
    if offset is not None:
        cap = f"at most source length + {offset} tokens"
    elif getattr(config, "max_len_b", None) is not None:
        cap = f"at most {getattr(config, 'max_len_a', None) or 0:g} * source length + {config.max_len_b} tokens (fairseq's)"
    elif config.max_new_tokens is not None:
        cap = f"at most max_new_tokens={config.max_new_tokens} tokens"
    elif default_length:  # transformers then gives max_length 20 new tokens, not 20 in all
        cap = f"at most {config.max_length} new tokens (max_length unset: transformers' default)"
    else:
        cap = f"at most max_length={config.max_length} tokens"
    if config.num_beams == 1:
        return f"greedy search (beam 1, no length penalty); {cap}"
    stop = {True: "early stopping", False: "no early stopping", "never": "early_stopping='never'"}
    return (
        f"beam {config.num_beams}, length penalty alpha {config.length_penalty:g} in the {form}; {cap}; "
        f"{stop[config.early_stopping]}"
    )


__all__ = ["as_generate_reads", "describe_generation"]
