"""Frozen low-bit base weights with bitsandbytes: ``--quantize bnb.nf4 | bnb.nf4-dq | bnb.fp4 | bnb.int8``.

Used by generation and by QLoRA fine-tuning: ``quantize_linear`` turns one ``nn.Linear`` into its frozen
bitsandbytes counterpart (LoRA wraps the result and trains only its own adapter weights), ``quantize_model``
does it for every plain ``nn.Linear`` of a model (never the embedding, the head only on request), and
``load_weights`` streams a checkpoint into a meta-device model part by part, casting each tensor straight to
its final dtype and quantizing each part as soon as it arrives, so neither a full-precision copy of the
model nor a copy in the checkpoint's stored dtype is ever in memory.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from lit_model.core.errors import UsageError
from lit_model.io.checkpoint import load_model_weights
from lit_model.model.gpt import plain_linear

QUANTIZE_MODES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8")

BNB_4BIT_BLOCKSIZE = 64  # bitsandbytes' default for Linear4bit
BNB_DQ_BLOCKSIZE = 256  # second-level blocks of the double-quantized absmax


def quantized_weight_bytes(in_features: int, out_features: int, mode: str) -> tuple[int, int]:
    """The memory contract of bitsandbytes' linear layers (classes of their own library, so stated here):
    (packed weight bytes, quantization-state bytes) that bitsandbytes 0.50 holds for an (out, in) weight."""
    numel = in_features * out_features
    if mode == "bnb.int8":
        return numel, out_features * 4  # int8 weight, fp32 row scales
    blocks = math.ceil(numel / BNB_4BIT_BLOCKSIZE)
    packed = (numel + 1) // 2
    if mode == "bnb.nf4-dq":
        # uint8 absmax, fp32 second-level absmax, 256-entry second-level code, 16-entry code, fp32 offset
        state = blocks + math.ceil(blocks / BNB_DQ_BLOCKSIZE) * 4 + 256 * 4 + 16 * 4 + 4
    else:
        state = blocks * 4 + 16 * 4  # fp32 absmax per block, 16-entry code
    return packed, state


def import_bitsandbytes() -> Any:
    try:
        # Its CPU backend logs a harmless warning about an optional kernel package on every import, and
        # LLM.int8() one per forward about casting bf16/fp32 activations to fp16 (the CPU runs int8 in any dtype)
        for name in ("bitsandbytes.backends.cpu.ops", "bitsandbytes.autograd._functions"):
            logging.getLogger(name).setLevel(logging.ERROR)
        import bitsandbytes
    except ImportError:
        raise UsageError(
            "--quantize needs the bitsandbytes package, which is not installed. Run `pip install bitsandbytes` "
            "(or `pip install lit-model[quantize]`), or drop --quantize."
        ) from None
    return bitsandbytes


def check_quantize(mode: Optional[str], device_type: str, dtype: torch.dtype, mixed: bool = False) -> None:
    """Raise ``UsageError`` naming what works if ``mode`` cannot run on this device in this dtype."""
    if mode is None:
        return
    if mode not in QUANTIZE_MODES:
        raise UsageError(f"Unknown --quantize {mode!r}. Choose one of: {', '.join(QUANTIZE_MODES)}, or leave it out.")
    if device_type not in ("cpu", "cuda"):
        raise UsageError(f"--quantize {mode} runs on CUDA GPUs and on the CPU, not on {device_type!r}.")
    if mixed:
        raise UsageError(
            f"--quantize {mode} computes in the precision's parameter dtype, so it needs a '-true' precision: "
            "use --precision bf16-true, 16-true or 32-true with it."
        )
    if mode == "bnb.int8" and device_type == "cuda" and dtype != torch.float16:
        raise UsageError(
            f"--quantize bnb.int8 computes in float16 on CUDA, not in {str(dtype).replace('torch.', '')}. Use "
            "--precision 16-true with it, or a 4-bit mode (bnb.nf4, bnb.nf4-dq, bnb.fp4), which also run in bf16."
        )
    import_bitsandbytes()


def is_quantized(module: nn.Module) -> bool:
    bnb = import_bitsandbytes()
    return isinstance(module, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))


def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """A bitsandbytes linear layer's (out, in) weight, dequantized into a new tensor (DoRA's weight norm)."""
    bnb = import_bitsandbytes()
    weight = module.weight
    if isinstance(module, bnb.nn.Linear4bit):
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state)
    # LLM.int8(): the int8 rows times their scales, which the layer's first forward moves into its state
    scales = weight.SCB if getattr(weight, "SCB", None) is not None else module.state.SCB
    return bnb.functional.int8_vectorwise_dequant(weight.data, scales)


def quantize_linear(linear: nn.Linear, mode: str, compute_dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A frozen bitsandbytes copy of ``linear``, quantized on the device its weight lives on.

    ``compute_dtype`` (default: the weight's dtype) is the dtype activations are multiplied in.
    """
    if mode not in QUANTIZE_MODES:
        raise UsageError(f"Unknown --quantize {mode!r}. Choose one of: {', '.join(QUANTIZE_MODES)}.")
    bnb = import_bitsandbytes()
    weight, bias = linear.weight.detach(), linear.bias
    if weight.device.type == "meta":
        raise ValueError("quantize_linear needs the layer's weights loaded: it quantizes them where they are.")
    device = weight.device
    compute_dtype = compute_dtype or weight.dtype
    has_bias = bias is not None
    if mode == "bnb.int8":
        new: nn.Module = bnb.nn.Linear8bitLt(
            linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=False, device="meta"
        )
        param = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    else:
        quant_type, double_quant = ("nf4" if mode.startswith("bnb.nf4") else "fp4"), mode.endswith("-dq")
        new = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=has_bias, compute_dtype=compute_dtype,
            compress_statistics=double_quant, quant_type=quant_type, device="meta",
        )
        param = bnb.nn.Params4bit(
            weight, requires_grad=False, compress_statistics=double_quant, quant_type=quant_type, module=new
        )
    new.weight = param._quantize(device)  # replaces the data by the quantized tensor on `device`
    if mode != "bnb.int8" and getattr(new, "support_avx512bf16_for_cpu", False):
        # bitsandbytes' packed CPU inference layout needs in_features % blocksize == 0 and out_features % 32 == 0
        fits = linear.in_features % new.weight.blocksize == 0 and linear.out_features % 32 == 0
        new.support_avx512bf16_for_cpu = fits
    if has_bias:
        new.bias = nn.Parameter(bias.detach().to(compute_dtype), requires_grad=False)
    new.train(linear.training)
    return new


def quantize_model(
    model: nn.Module,
    mode: str,
    compute_dtype: Optional[torch.dtype] = None,
    skip: Sequence[str] = ("lm_head",),
) -> nn.Module:
    """Replace every plain linear layer of ``model`` (``model.plain_linear``; in place) except those named in ``skip``.

    Only plain layers are replaced, so a LoRA layer that wraps a base linear layer keeps
    its adapter and gets a quantized base. Embeddings are never quantized.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if plain_linear(module) and name not in skip and name.split(".")[-1] not in skip
    ]
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantize_linear(module, mode, compute_dtype))
    return model


def quantized_nbytes(module: nn.Module) -> int:
    """Bytes held by a module's parameters, buffers and bitsandbytes quantization state."""
    total = 0
    for tensor in [*module.parameters(), *module.buffers()]:
        total += tensor.numel() * tensor.element_size()
        state = getattr(tensor, "quant_state", None)
        if state is not None:
            total += sum(t.numel() * t.element_size() for t in state.as_dict(packed=True).values())
        for extra in ("SCB",):
            if getattr(tensor, extra, None) is not None:
                total += getattr(tensor, extra).numel() * getattr(tensor, extra).element_size()
    for sub in module.modules():  # Linear8bitLt keeps its row scales in `state` after the first forward
        state = getattr(sub, "state", None)
        if state is not None and getattr(state, "SCB", None) is not None and getattr(sub.weight, "SCB", None) is None:
            total += state.SCB.numel() * state.SCB.element_size()
    return total


def load_weights(
    model: nn.Module,
    checkpoint_dir: str | Path,
    dtype: torch.dtype,
    devices: Optional[dict[str, torch.device]] = None,
    quantize: Optional[str] = None,
    skip: Sequence[str] = ("lm_head",),
    column_major: frozenset[str] = frozenset(),
) -> nn.Module:
    """Stream a checkpoint into ``model`` (built on the meta device) part by part (checkpoint.py), quantizing
    each part's linear layers as soon as it arrives, before the next part is read; the matrices named in
    ``column_major`` are read in that layout."""
    tied = bool(getattr(model.config, "tie_embeddings", False))

    def quantize_part(part_name: str, part: nn.Module) -> None:
        if quantize is None or part_name in skip or (tied and part_name == "lm_head"):
            return
        if plain_linear(part):
            parent_name, _, child = part_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, quantize_linear(part, quantize, dtype))
        else:
            quantize_model(part, quantize, dtype, skip=skip)

    load_model_weights(model, checkpoint_dir, dtype=dtype, devices=devices, on_part=quantize_part,
                       column_major=column_major)
    return model