"""LLaMA-Adapter: a learned prefix per upper block, attended to through a zero-initialised gate.

In each block from ``start_layer`` on, ``prompt_length`` learned vectors go through the block's own key and
value projections; every query also attends to them (without a causal mask), and the result is added to the
attention output multiplied by a per-head gate that starts at zero, so training starts from exactly the base
model (Zhang et al., 2023, https://arxiv.org/abs/2303.16199). Only the prefixes and gates train.

The prefix cannot be folded into the base weights, so a checkpoint directory carries it beside them
(``adapter.safetensors`` + ``adapter.yaml``); ``load_saved_adapter`` attaches it whenever such a directory is
loaded (``load_gpt``, ``generation.load_model``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml

from lit_model.core.errors import UsageError, UserError
from lit_model.core.config import Config
from lit_model.core.files import dataclass_from_yaml
from lit_model.io.checkpoint import check_adapter_weights, read_safetensors
from lit_model.model.contracts import Saved, Step
from lit_model.model.gpt import CausalSelfAttention

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter.yaml"


@dataclass
class AdapterConfig:
    prompt_length: int = 10
    start_layer: int = 2

    def check(self, n_layer: int) -> None:
        if self.prompt_length < 1:
            raise UsageError(f"--adapter_prompt_length {self.prompt_length} must be at least 1 (10 is usual).")
        if not 0 <= self.start_layer < n_layer:
            raise UsageError(
                f"--adapter_start_layer {self.start_layer}: the model has {n_layer} blocks, so use 0..{n_layer - 1}."
            )

    def save(self, directory: Path) -> None:
        (Path(directory) / ADAPTER_CONFIG).write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def from_dir(cls, directory: Path) -> "AdapterConfig":
        return dataclass_from_yaml(cls, Path(directory) / ADAPTER_CONFIG, "the adapter's prompt_length and start_layer")


class AdapterAttention(CausalSelfAttention):
    """Causal self-attention plus gated attention over a learned prefix (set by ``apply_adapter``)."""

    adapter_prefix: nn.Parameter  # (prompt_length, n_embd)
    adapter_gate: nn.Parameter  # (n_head,), zero at the start
    adapter_enabled = True  # False: the base attention alone (lora.adapters_disabled: a preference run's reference)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        y = super().attend(q, k, v, mask)
        if not self.adapter_enabled:
            return y
        B, hs, n_kv = q.size(0), self.config.head_size, self.config.n_query_groups
        prefix = self.adapter_prefix.to(q.dtype)
        P = prefix.size(0)
        ak = self.key(prefix).view(1, P, n_kv, hs).transpose(1, 2).expand(B, -1, -1, -1)
        av = self.value(prefix).view(1, P, n_kv, hs).transpose(1, 2).expand(B, -1, -1, -1)
        ay = F.scaled_dot_product_attention(q, ak, av, scale=self.scale, enable_gqa=n_kv != q.size(1))
        gate = self.adapter_gate.to(ay.dtype).view(1, -1, 1, 1)
        return y + (gate * ay).transpose(1, 2)

    # ---- memory contract (model/contracts.py) ------------------------------------------------
    @staticmethod
    def parameter_sizes(config: Config, prompt_length: int) -> list[int]:
        """The prefix and the gate."""
        return [prompt_length * config.n_embd, config.n_head]

    @classmethod
    def attend_contract(cls, config: Config, step: Step, layer: int, qkv_rg: bool) -> Saved:
        """Every query also attends to the trainable prefix (SDPA keeping q, its output and logsumexp); the gate
        keeps that output. The attention output now requires grad."""
        core = super().attend_contract(config, step, layer, qkv_rg)
        prefix = config.n_head * config.head_size * step.compute_bytes + config.n_head * 4
        q = 0.0 if qkv_rg else config.n_head * config.head_size * step.compute_bytes
        return replace(core, per_token=core.per_token + q + prefix, out_requires_grad=True,
                       selective_per_token=core.selective_per_token + prefix)


def apply_adapter(model: nn.Module, config: AdapterConfig, dtype: Optional[torch.dtype] = None) -> int:
    """Add the prefixes and gates to ``model``'s upper blocks and freeze everything else; returns the number of
    trainable parameters."""
    config.check(len(model.blocks))
    dtype = dtype or model.embed.weight.dtype
    model.requires_grad_(False)
    for block in list(model.blocks)[config.start_layer :]:
        attn = block.attn
        device = attn.proj.bias.device if attn.proj.bias is not None else attn.proj.weight.device
        attn.__class__ = AdapterAttention
        attn.adapter_prefix = nn.Parameter(torch.empty(config.prompt_length, model.config.n_embd, device=device, dtype=dtype))
        nn.init.normal_(attn.adapter_prefix, std=0.02)
        attn.adapter_gate = nn.Parameter(torch.zeros(model.config.n_head, device=device, dtype=dtype))
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def load_saved_adapter(model: nn.Module, checkpoint_dir: Path) -> bool:
    """If ``checkpoint_dir`` carries an adapter, attach it to ``model`` (frozen, eval use); returns whether it did."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / ADAPTER_CONFIG).is_file():
        return False
    if not (checkpoint_dir / ADAPTER_WEIGHTS).is_file():
        raise UserError(f"{checkpoint_dir} has {ADAPTER_CONFIG} but no {ADAPTER_WEIGHTS}: copy the adapter weights there.")
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    apply_adapter(model, AdapterConfig.from_dir(checkpoint_dir), dtype=model.embed.weight.dtype)
    weights = read_safetensors(checkpoint_dir / ADAPTER_WEIGHTS)
    expected = {n: p.shape for n, p in model.named_parameters() if n.endswith((".adapter_prefix", ".adapter_gate"))}
    check_adapter_weights(checkpoint_dir / ADAPTER_WEIGHTS, weights, expected, ADAPTER_CONFIG)
    for name, tensor in weights.items():  # each copied to its block's device
        model.get_parameter(name).data.copy_(tensor)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(trainable.get(name, False))
    return True
