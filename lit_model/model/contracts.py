"""Memory contracts: what each module class of the model holds, published beside its own code.

A module class states, as a ``memory_contract`` classmethod (no model is built: the planner's closed form runs in
microseconds, for 70B configs and inside its suggestion searches), its parameters' element counts or the bytes
it keeps for backward and holds in flight, from the config and a ``Step``: the shape and dtypes of its input, the
device's kernels and the adapters' settings. ``lit_model/plan/closed_form.py`` only adds them up; torch's own
classes that the model uses get theirs in ``gpt.TORCH_CONTRACTS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Step:
    """What a module's memory depends on beyond the config: its input's shape and dtypes, the device (its kernels)
    and the adapters (LoRA) of the run."""

    batch: int  # micro batch of this forward
    seq_len: int
    param_bytes: int  # the residual stream's dtype (the parameters')
    compute_bytes: int  # the matmul outputs' (autocast's dtype under -mixed, else the parameters')
    autocast: bool
    attention_dtype: torch.dtype  # the dtype attention computes in
    device_type: str
    norm_tokens: int  # tokens of the training micro batch: the norms' kernel choice is made for it
    packing: bool = False
    mlp_tiles: int = 1
    lora_names: frozenset[str] = frozenset()  # block-relative names of the linears LoRA adapts (experts: also as MLPs)
    lora_r: int = 0
    lora_dropout: float = 0.0
    lora_dora: bool = False

    @property
    def lora_keeps_input(self) -> bool:
        """Whether a LoRA branch keeps its input itself (kept once however many branches read it): without dropout,
        or with the CPU's dropout without autocast (kernels/ops.dropout_linear keeps the input and a boolean mask)."""
        return self.lora_dropout == 0 or (self.device_type == "cpu" and not self.autocast)


@dataclass(frozen=True)
class Saved:
    """Bytes a module keeps for backward (per token, per sample growing with T^2, per layer) and whether its output
    requires grad."""

    per_token: float = 0.0
    per_sample_t2: float = 0.0
    per_layer: float = 0.0
    out_requires_grad: bool = False
    transient_per_token: float = 0.0  # extra bytes in flight during its backward
    transient_floor: float = 0.0  # in flight during its backward instead of (not on top of) the block's transient
    selective_per_token: float = 0.0  # kept per token under selective checkpointing
    input_per_token: float = 0.0  # its input, kept once however many sibling layers read it too


@dataclass(frozen=True)
class ParamCounts:
    """Element counts of the model's parts (tied weights counted once)."""

    embed: int
    head: int  # 0 when tied to the embedding
    norm_f: int
    block_linear: dict[str, tuple[int, int, bool]] = field(hash=False)  # name -> (in, out, bias) per block
    block_norm_sizes: list[int] = field(hash=False)  # element counts of the norm weights (+ biases) of one block
    n_layer: int

    @property
    def block_norms(self) -> int:
        return sum(self.block_norm_sizes)

    @property
    def block_linear_weights(self) -> int:
        return sum(i * o for i, o, _ in self.block_linear.values())

    @property
    def block_biases(self) -> int:
        return sum(o for _, o, b in self.block_linear.values() if b)

    @property
    def per_block(self) -> int:
        return self.block_linear_weights + self.block_biases + self.block_norms

    @property
    def total(self) -> int:
        return self.embed + self.head + self.norm_f + self.n_layer * self.per_block
