"""Frozen low-bit base weights with bitsandbytes: ``--quantize bnb.nf4 | bnb.nf4-dq | bnb.fp4 | bnb.int8``.

Used by generation and by QLoRA fine-tuning: ``quantize_linear`` turns one ``nn.Linear`` into its frozen
bitsandbytes counterpart (LoRA wraps the result and trains only its own adapter weights), ``quantize_model``
does it for every plain ``nn.Linear`` of a model (never the embedding, the head only on request), and
``load_weights`` streams a checkpoint into a meta-device model part by part, casting each tensor straight to
its final dtype and quantizing each part as soon as it arrives, so neither a full-precision copy of the
model nor a copy in the checkpoint's stored dtype is ever in memory.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from lit_model.errors import UsageError, UserError

QUANTIZE_MODES = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8")


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
    """Replace every plain ``nn.Linear`` of ``model`` (in place) except those named in ``skip``.

    Only exact ``nn.Linear`` instances are replaced, so a LoRA layer that wraps a base ``nn.Linear`` keeps
    its adapter and gets a quantized base. Embeddings are never quantized.
    """
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name not in skip and name.split(".")[-1] not in skip
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
) -> nn.Module:
    """Stream ``model.safetensors`` into ``model`` (built on the meta device), one top-level part at a time.

    Each tensor is read, cast to ``dtype`` and moved to its part's device (``devices`` maps a part name such
    as ``"blocks.3"`` or ``"embed"`` to a device; default CPU); with ``quantize`` every part's linear layers are
    quantized before the next part is read. Names and shapes are checked before anything is read.
    """
    from lit_model.checkpoint import WEIGHTS_NAME, check_checkpoint_dir, check_state_dict

    path = check_checkpoint_dir(checkpoint_dir) / WEIGHTS_NAME
    devices = devices or {}
    tied = bool(getattr(model.config, "tie_embeddings", False))
    with SafetensorsReader(path) as file:
        shapes = {name: torch.empty(shape, device="meta") for name, shape in file.shapes.items()}
        check_state_dict(model, shapes, source=str(path))
        for part_name, part in _parts(model):
            prefix, device = part_name + ".", torch.device(devices.get(part_name, "cpu"))
            state: dict[str, torch.Tensor] = {}
            for name in file.shapes:
                if name.startswith(prefix):
                    tensor = file.read(name)
                    tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
                    state[name[len(prefix):]] = tensor.to(device)
            if tied and part_name == "lm_head":
                state["weight"] = model.embed.weight
            if not state:
                continue
            part.load_state_dict(state, strict=True, assign=True)
            del state
            if quantize is None or part_name in skip or (tied and part_name == "lm_head"):
                continue
            if type(part) is nn.Linear:
                parent_name, _, child = part_name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, child, quantize_linear(part, quantize, dtype))
            else:
                quantize_model(part, quantize, dtype, skip=skip)
    return model


class SafetensorsReader:
    """Reads one tensor of a .safetensors file at a time with plain file reads: unlike a memory map, the
    file's pages never count towards the process's memory, so peak RSS shows only the tensors kept."""

    DTYPES = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file = open(self.path, "rb")
            (length,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(length))
            header.pop("__metadata__", None)
            self.entries = {name: (self.DTYPES[e["dtype"]], e["shape"], *e["data_offsets"]) for name, e in header.items()}
        except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
            raise UserError(f"Could not read {self.path}: {error!r}. The file is damaged; re-create or re-convert it.") from None
        self.base = 8 + length
        self.shapes = {name: tuple(entry[1]) for name, entry in self.entries.items()}

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, start, end = self.entries[name]
        tensor = torch.empty(shape, dtype=dtype)
        buffer = tensor.reshape(-1).view(torch.uint8).numpy()
        self.file.seek(self.base + start)
        if end - start != buffer.nbytes or self.file.readinto(memoryview(buffer)) != buffer.nbytes:
            raise UserError(f"{self.path} is truncated or damaged at tensor {name!r}; re-create or re-convert it.")
        return tensor

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def _parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children, with ModuleLists split into their items ("blocks.0", "blocks.1", ...)."""
    parts = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            parts.extend((f"{name}.{i}", item) for i, item in enumerate(child))
        else:
            parts.append((name, child))
    return parts
