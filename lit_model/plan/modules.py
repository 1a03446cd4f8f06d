"""The stand-in the planner builds into a model to trace memory: a bitsandbytes-shaped quantized linear whose
tensors have exactly the sizes of the real ones (the trace uses ``lit_model.methods.lora`` and ``lit_model.methods.adapter``
themselves), and the names of the layers LoRA adapts, for the closed-form engine.

``QuantLinearSim`` is used only under ``FakeTensorMode``: bitsandbytes' kernels have no fake implementation, so it reproduces what bitsandbytes 0.50 holds (packed 4-bit weight, absmax per 64-weight
block, double-quantized statistics; int8 weight + row scales) and what it allocates (the weight dequantized to
the compute dtype in forward and again in backward, keeping only the packed weight for backward). It is an
``nn.Linear`` subclass so that ``lit_model.methods.lora.apply_lora`` adapts it as it adapts bitsandbytes layers.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from lit_model.methods.quantize import quantized_weight_bytes
from lit_model.model.gpt import plain_linear

LORA_TARGETS = ("query", "key", "value", "projection", "mlp", "head")


def lora_target_names(config, targets: Iterable[str]) -> list[str]:
    """Names (relative to a block) of the linear layers LoRA wraps for these targets."""
    targets = set(targets)
    unknown = targets - set(LORA_TARGETS)
    if unknown:
        raise ValueError(f"Unknown LoRA targets {sorted(unknown)}; use {LORA_TARGETS}")
    names = []
    if "query" in targets:
        names.append("attn.query")
    if "key" in targets:
        names.append("attn.key")
    if "value" in targets:
        names.append("attn.value")
    if "projection" in targets:
        names.append("attn.proj")
    if "mlp" in targets:
        if config.mlp_class_name == "GptNeoxMLP":
            names += ["mlp.fc", "mlp.proj"]
        elif config.mlp_class_name == "LLaMAMoE":  # every expert
            names += [f"mlp.experts.{e}.{n}" for e in range(config.n_expert) for n in ("fc_1", "fc_2", "proj")]
        else:
            names += ["mlp.fc_1", "mlp.fc_2", "mlp.proj"]
    return names


# ---- quantized linear (fake-mode only) ----------------------------------------------------------------
class _DequantMatmul(torch.autograd.Function):
    """y = x @ dequant(W).T, saving only the packed weight (as bitsandbytes' MatMul4Bit does)."""

    @staticmethod
    def forward(ctx, x, packed, out_features, in_features, tracker):
        ctx.save_for_backward(packed)
        ctx.shape, ctx.tracker = (out_features, in_features), tracker
        with _quant_scope(tracker):  # only the dequantized weight is "quantization" memory
            weight = torch.empty(out_features, in_features, dtype=x.dtype, device=x.device)
        y = x @ weight.t()
        del weight
        return y

    @staticmethod
    def backward(ctx, grad):
        with _quant_scope(ctx.tracker):
            weight = torch.empty(ctx.shape, dtype=grad.dtype, device=grad.device)
        grad_x = grad @ weight
        del weight
        return grad_x, None, None, None, None


class _quant_scope:
    def __init__(self, tracker) -> None:
        self.tracker = tracker

    def __enter__(self) -> None:
        if self.tracker is not None:
            self.tracker.push_category("quant")

    def __exit__(self, *exc) -> None:
        if self.tracker is not None:
            self.tracker.pop_category()


class QuantLinearSim(nn.Linear):
    """An ``nn.Linear`` look-alike (so ``lit_model.methods.lora.apply_lora`` can adapt it, as it adapts bitsandbytes
    layers) whose ``weight`` is the packed quantized weight (uint8, frozen)."""

    def __init__(self, linear: nn.Linear, mode: str, tracker=None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.mode, self.tracker = linear.in_features, linear.out_features, mode, tracker
        packed, state = self.memory_contract(linear.in_features, linear.out_features, mode)
        device = linear.weight.device
        self.weight = nn.Parameter(torch.empty(packed, dtype=torch.uint8, device=device), requires_grad=False)
        self.register_buffer("quant_statistics", torch.empty(state, dtype=torch.uint8, device=device))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.compute_dtype = linear.weight.dtype

    @staticmethod
    def memory_contract(in_features: int, out_features: int, mode: str) -> tuple[int, int]:
        """(packed weight bytes, quantization-state bytes): bitsandbytes' layers' own."""
        return quantized_weight_bytes(in_features, out_features, mode)

    def dequantized_weight(self) -> torch.Tensor:
        """What ``lit_model.methods.quantize.dequantized_weight`` makes of a bitsandbytes layer: a new (out, in) tensor."""
        return torch.empty(self.out_features, self.in_features, dtype=self.compute_dtype, device=self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _DequantMatmul.apply(x, self.weight, self.out_features, self.in_features, self.tracker)
        return y if self.bias is None else y + self.bias


def quantize_model_sim(model: nn.Module, mode: str, tracker=None, skip: tuple[str, ...] = ("lm_head",)) -> list[QuantLinearSim]:
    """Replace plain ``nn.Linear`` layers like ``lit_model.methods.quantize.quantize_model`` does (LoRA bases included)."""
    targets = [
        (name, module) for name, module in model.named_modules()
        if plain_linear(module) and name not in skip and name.split(".")[-1] not in skip
    ]
    created = []
    for name, module in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        sim = QuantLinearSim(module, mode, tracker)
        setattr(parent, child, sim)
        created.append(sim)
    return created
