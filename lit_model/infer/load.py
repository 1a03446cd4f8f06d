"""Loading a checkpoint for inference: the devices (consecutive blocks on consecutive GPUs, a pipeline), the
precision, and the model built on the meta device and filled part by part on them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

from lit_model.core.config import Config
from lit_model.core.errors import UsageError
from lit_model.core.precision import param_dtype, resolve_precision
from lit_model.io.checkpoint import model_parts
from lit_model.kernels.ops import decoding_column_major
from lit_model.kernels.policy import kernel_policy
from lit_model.methods.adapter import load_saved_adapter
from lit_model.methods.lora import load_saved_lora
from lit_model.methods.quantize import QUANTIZE_MODES, check_quantize, load_weights
from lit_model.model.gpt import GPT, plain_linear
from lit_model.run import resolve_devices as run_devices

DEFAULT_CHECKPOINT = Path("out/pretrain/final")  # what `python pretrain/main.py` writes


def resolve_devices(devices: int) -> list[torch.device]:
    """``--devices N``: N CUDA GPUs running consecutive blocks (a pipeline), or the one CPU; the count is checked
    as every script checks it (``run.resolve_devices``)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    count = run_devices(devices, device_type)
    if device_type == "cpu" and count > 1:
        raise UsageError(
            f"--devices {count} splits the model over several GPUs, and none is available: on the CPU "
            "generation runs on one device. Pass --devices 1."
        )
    return [torch.device(device_type, i) for i in range(count)] if device_type == "cuda" else [torch.device("cpu")]


@dataclass
class Precision:
    name: str  # the resolved --precision string
    dtype: torch.dtype  # parameters (and the KV cache without autocast)
    autocast: Optional[torch.dtype]  # "-mixed": compute dtype under torch.autocast

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast or self.dtype

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast)


def resolve_generation_precision(
    precision: Optional[str], device_type: str, quantize: Optional[str], planning: bool = False
) -> Precision:
    """``planning``: for a device that need not be here (a CUDA plan assumes bfloat16 support) and without
    bitsandbytes installed, so only the --quantize name is checked."""
    if precision is None and quantize == "bnb.int8" and device_type == "cuda":
        precision = "16-true"  # LLM.int8() computes in float16 on CUDA
    name = resolve_precision(precision, device_type, present=not planning)
    autocast = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(name)
    if not planning:
        check_quantize(quantize, device_type, param_dtype(name), mixed=autocast is not None)
    elif quantize is not None and quantize not in QUANTIZE_MODES:
        raise UsageError(f"Unknown --quantize {quantize!r}. Choose one of: {', '.join(QUANTIZE_MODES)}, or drop it.")
    return Precision(name, param_dtype(name), autocast)


def pipeline_stages(config: Config, n_devices: int) -> dict[str, int]:
    """Which of ``n_devices`` each part of the model goes on (the planner plans the same split): consecutive
    blocks on consecutive devices; the embedding on the first, the final norm and head on the last (a tied head
    stays with the embedding it shares its weight with)."""
    stages = {"embed": 0, "norm_f": n_devices - 1, "lm_head": 0 if config.tie_embeddings else n_devices - 1}
    for i in range(config.n_layer):
        stages[f"blocks.{i}"] = i * n_devices // config.n_layer
    return stages


def device_map(config: Config, devices: Sequence[torch.device]) -> dict[str, torch.device]:
    return {part: devices[stage] for part, stage in pipeline_stages(config, len(devices)).items()}


def load_model(
    checkpoint_dir: str | Path,
    devices: Sequence[torch.device | str] = ("cpu",),
    dtype: torch.dtype = torch.float32,
    quantize: Optional[str] = None,
    max_seq_length: Optional[int] = None,
    decoding: bool = False,
) -> GPT:
    """The checkpoint's model, built on the meta device and filled part by part: every tensor goes straight to its
    final dtype and device, and with ``quantize`` each block is quantized before the next one is read.
    ``max_seq_length`` (default: the block size) sizes the RoPE tables. ``decoding`` (a model only to generate with):
    the weights in the layout decoding multiplies fastest (``column_major_weights``); fine-tuning, which trains them
    (and shards them under FSDP), keeps them row-major."""
    devices = [torch.device(d) for d in devices]
    config = Config.from_checkpoint(checkpoint_dir)
    model = GPT.on_meta(config)
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length  # cheap on meta: the real tables are built once, below
    parts = device_map(config, devices)
    column_major = column_major_weights(model, dtype, parts) if decoding and quantize is None else frozenset()
    load_weights(model, checkpoint_dir, dtype, parts, quantize, column_major=column_major)
    load_saved_adapter(model, checkpoint_dir)  # a LLaMA-Adapter checkpoint carries its prefixes beside the weights
    load_saved_lora(model, checkpoint_dir)  # an unmerged LoRA (lora.yaml with merged: false), over the base weights
    if len(set(parts.values())) > 1:
        hop_devices(model)
    model.reset_rope_cache(devices[0])
    model.set_kernel_policy(kernel_policy(torch.device(devices[0]).type))
    return model.eval().requires_grad_(False)


def hop_devices(model: GPT) -> None:
    """A model spread over devices (``device_map``) runs ``GPT.forward`` (scoring, evaluate's) as on one: each block
    on another device than the part before it, the final norm and the head move their tensor inputs to their own
    device first. ``decode.forward_last`` moves them itself; the hooks then find them in place."""

    def to(device: torch.device):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            move = lambda value: value.to(device) if isinstance(value, torch.Tensor) else value  # noqa: E731
            return tuple(map(move, args)), {key: move(value) for key, value in kwargs.items()}

        return hook

    previous = model.embed.weight.device
    for module in [*model.blocks, model.norm_f, model.lm_head]:
        device = next(module.parameters()).device
        if device != previous:
            module.register_forward_pre_hook(to(device), with_kwargs=True)
        previous = device


def column_major_weights(model: GPT, dtype: torch.dtype, parts: dict[str, torch.device]) -> frozenset[str]:
    """The linear weights that decoding multiplies fastest stored column-major (``ops.decoding_column_major``),
    by their checkpoint names; a head tied to the embedding keeps the table's rows."""
    names = set()
    for part_name, part in model_parts(model):  # the parts load_model_weights reads, each to its device
        device = parts.get(part_name, torch.device("cpu"))
        for name, module in part.named_modules(prefix=part_name):
            tied_head = name == "lm_head" and model.config.tie_embeddings
            if plain_linear(module) and not tied_head and decoding_column_major(module.weight.shape, dtype, device):
                names.add(f"{name}.weight")
    return frozenset(names)
