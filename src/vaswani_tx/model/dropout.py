"""Dropout (Section 5.4) with its masks drawn in bulk on CPUs where torch draws them one element at a time.

torch's `nn.functional.dropout` on the CPU draws its mask with `bernoulli_(1 - p)`, which uses oneMKL's parallel
generator on Intel CPUs only (ATen's `bernoulli_scalar_kernel` checks the vendor). On other CPUs (AMD, ARM) it
draws one double per element from the global Mersenne Twister, under its lock, on one thread: 3.1 ms for a mask of
2,048 x 256 on an AMD EPYC (2 threads), about a tenth of the main job's training step there. On those CPUs
`apply_dropout` below draws the mask as 32-bit integers, two from each 64-bit draw of the same generator (0.9 ms), kept
where they reach p's threshold: P(keep) = 1 - p to within 2^-32. The same generator: `torch.manual_seed`, the
Trainer's saved random state and its resumes reproduce a run as with torch's dropout. The masks differ from torch's,
as torch's own differ between Intel and AMD CPUs.

This file travels with saved weights for `trust_remote_code` (the model imports it): torch only.
"""

from __future__ import annotations

import functools
import platform

import torch
from torch import nn

INT32_VALUES = 2**32


@functools.cache
def torch_draws_one_at_a_time() -> bool:
    """Whether torch's CPU `bernoulli_` draws element by element here: without oneMKL, or on a CPU not Intel's."""
    if not torch.backends.mkl.is_available():
        return True
    return cpu_vendor() != "GenuineIntel"


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor string as the kernel reports it ("GenuineIntel", "AuthenticAMD", ...), "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return next((name for name in ("GenuineIntel", "AuthenticAMD") if name in platform.processor()), "")


def keep_threshold(p: float) -> int:
    """The int32 value from which a uniform int32 draw keeps its element: P(draw >= threshold) = 1 - p."""
    return -(INT32_VALUES // 2) + round(p * INT32_VALUES)


def apply_dropout(hidden: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """`nn.functional.dropout(hidden, p, training)`: each element zeroed with probability p, the rest scaled by
    1 / (1 - p); the mask drawn in bulk where torch would draw it element by element (see the module docstring)."""
    if not training or p == 0.0:
        return hidden
    if hidden.device.type != "cpu" or p >= 1.0 or not torch_draws_one_at_a_time():
        return nn.functional.dropout(hidden, p, True)
    draws = torch.empty((hidden.numel() + 1) // 2, dtype=torch.int64).random_(-(2**63), None)
    keep = draws.view(torch.int32)[: hidden.numel()].view(hidden.shape) >= keep_threshold(p)
    return hidden * keep.to(hidden.dtype).div_(1 - p)  # as torch's: the mask in the input's dtype, then scaled


class Dropout(nn.Dropout):
    """`nn.Dropout` through `apply_dropout` above (the same module and state; only how its mask is drawn differs)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.inplace:
            return super().forward(hidden)
        return apply_dropout(hidden, self.p, self.training)
