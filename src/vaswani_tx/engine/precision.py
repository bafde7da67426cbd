"""What the hardware makes fast: bf16 (`bf16: auto` in run configs, `--dtype auto` for decoding) and the attention
kernel to train with (`attn_implementation: auto`).

On a CPU, bfloat16 is fast only with bf16 instructions (AVX512-BF16, or AMX's tile multiply): oneDNN then
multiplies bf16 matrices natively, about twice as fast as float32 (AMX: more). Without them it emulates
bf16 by converting to float32 and back, which is slower than float32 itself. So "auto" means bf16 on a CPU
with those instructions or a GPU that has bf16, float32 everywhere else, and says which and why.
"""

from __future__ import annotations

import logging

import torch

from vaswani_tx.model.errors import UserInputError

logger = logging.getLogger(__name__)


def cpu_bf16_instructions() -> str | None:
    """This CPU's bf16 instructions that torch uses ("AMX" or "AVX512-BF16"), None where it has neither."""
    cpu = torch.cpu
    if getattr(cpu, "_is_amx_tile_supported", lambda: False)():
        return "AMX"
    if getattr(cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "AVX512-BF16"
    return None


def bf16_is_fast(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """(whether bf16 is the faster choice on `device`, why, in words for a log line)."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return True, f"{torch.cuda.get_device_name(device)} supports bf16"
        return False, "this GPU has no bf16 support"
    if device.type != "cpu":
        return False, f"bf16 is not chosen automatically on {device.type}"
    instructions = cpu_bf16_instructions()
    if instructions:
        return (
            True,
            f"this CPU has {instructions} instructions (torch capability {torch.backends.cpu.get_cpu_capability()})",
        )
    return False, (
        "this CPU has no bf16 instructions (AVX512-BF16 or AMX): bf16 would be emulated, slower than float32"
    )


def training_device() -> torch.device:
    """Where the Trainer will train: the GPU if there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_bf16_setting(value, where: str = "run config") -> bool:
    """A run config's `bf16` (true, false or "auto") as the Trainer's boolean, logging what "auto" chose and why,
    and warning when bf16 is asked for on a CPU that would only emulate it."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        fast, why = bf16_is_fast(training_device())
        logger.info("%s: bf16: auto -> %s (%s)", where, "on" if fast else "off (float32)", why)
        return fast
    if not isinstance(value, bool):
        raise UserInputError(f"{where}: bf16 must be true, false or auto, got {value!r}")
    if value and training_device().type == "cpu" and cpu_bf16_instructions() is None:
        logger.warning(
            "%s: bf16: true on a CPU without bf16 instructions: emulated, slower than float32 "
            "(bf16: auto chooses float32 here)",
            where,
        )
    return value


def training_attention(value: str = "auto", device: str | torch.device | None = None) -> tuple[str, str]:
    """The attention implementation to train with and why: a run config's `attn_implementation` ("auto", "eager"
    or "sdpa"). "auto" is "eager" on the CPU, where our Equation 1 (two batched products and a softmax) trains
    faster than torch's SDPA kernels, whose CPU backward took about 10x their forward (a 120-step run of the
    Multi30k recipe: 1.2-1.3x faster; docs/training.md), and "sdpa" on a GPU. Both compute the same function."""
    device = torch.device(training_device() if device is None else device)
    if value != "auto":
        return value, "asked for in the run config"
    if device.type == "cpu":
        return "eager", "on the CPU, SDPA's backward is slower than Equation 1's two products and softmax"
    return "sdpa", f"on {device.type}, SDPA's fused kernels"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoding_dtype(dtype: str | torch.dtype | None = "auto", device: str | torch.device = "cpu") -> torch.dtype | None:
    """The dtype to decode in: "auto" is bfloat16 where `bf16_is_fast(device)`, float32 elsewhere; a name in DTYPES
    or a torch.dtype as given; None keeps the saved weights' dtype. For `from_pretrained` users:
    `from_pretrained(folder, dtype=vaswani_tx.decoding_dtype("auto"))` (transformers' own `dtype="auto"` means the
    dtype the weights were saved in)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        chosen = dtype
    elif dtype == "auto":
        fast, why = bf16_is_fast(device)
        chosen = torch.bfloat16 if fast else torch.float32
        logger.info("dtype auto -> %s (%s)", str(chosen).replace("torch.", ""), why)
    elif dtype in DTYPES:
        chosen = DTYPES[dtype]
    else:
        raise UserInputError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    if chosen == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_bf16_instructions() is None:
        logger.warning(
            "bfloat16 on a CPU without bf16 instructions: emulated, slower than float32 (--dtype auto "
            "chooses float32 here)"
        )
    return chosen


__all__ = [
    "DTYPES",
    "bf16_is_fast",
    "cpu_bf16_instructions",
    "decoding_dtype",
    "resolve_bf16_setting",
    "training_attention",
]
