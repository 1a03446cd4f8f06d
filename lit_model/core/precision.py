"""The five precision strings, what they mean for parameter dtype, and which a device runs correctly.

Both the Fabric setup and generation resolve ``--precision`` here once; everything after that reads the
resolved string.
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_model.core.errors import UsageError

PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
# precision -> (parameter dtype, autocast dtype or None)
PRECISION_DTYPES = {
    "32-true": (torch.float32, None),
    "16-true": (torch.float16, None),
    "bf16-true": (torch.bfloat16, None),
    "16-mixed": (torch.float32, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
}
DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def resolve_precision(precision: Optional[str], device_type: str, present: bool = True) -> str:
    """Validate ``precision``; ``None`` picks the cheapest one this device runs correctly and fast:
    bf16-true on GPUs with bfloat16, 16-mixed on older GPUs, 32-true on the CPU. ``present=False``: the device
    is not this machine's (a plan for another one), so a GPU is assumed to have bfloat16 (Ampere or newer)."""
    cuda_here = present and device_type == "cuda" and torch.cuda.is_available()
    if precision is None:
        if device_type == "cuda":
            return "bf16-true" if not cuda_here or torch.cuda.is_bf16_supported() else "16-mixed"
        # On the CPU, bf16 kernels measured 4-7x slower than fp32 here and RAM is rarely the limit.
        return "32-true"
    if precision not in PRECISIONS:
        raise UsageError(f"Unknown --precision {precision!r}. Choose one of: {', '.join(PRECISIONS)}.")
    if cuda_here and precision.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise UsageError(
            f"--precision {precision} needs a GPU with bfloat16 support (Ampere or newer); this one has none. "
            "Use --precision 16-mixed (or 32-true)."
        )
    if device_type == "cpu" and precision == "16-mixed":
        # fp16 autocast is not supported on CPU; Fabric would silently fall back, we say so up front.
        raise UsageError("--precision 16-mixed needs a CUDA GPU. On the CPU use bf16-mixed, bf16-true or 32-true.")
    return precision


def param_dtype(precision: str) -> torch.dtype:
    return PRECISION_DTYPES[precision][0]
