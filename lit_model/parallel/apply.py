"""What changes a built model, applied from outside in one fixed order (as torchtitan's parallelize): tensor and
context parallelism (issue 46: not yet), activation checkpointing, activation offloading and the tiled MLP, compile,
then FSDP. The model (model/gpt.py) stays a plain module that knows none of them.

A lever wraps a module's forward by giving the module a subclass of its own class (FSDP's ``fully_shard`` does the
same): parameter names, state dicts and ``isinstance`` stay as they were, and the wrapper's ``with`` blocks close
when the forward raises (an out-of-memory that the step recovers from), which forward hooks would not.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from lit_model.core.classes import mixed_class
from lit_model.parallel.activations import ActivationOffloading, checkpointed, tiled
from lit_model.parallel.dims import ParallelDims
from lit_model.parallel.fsdp import shard_model


@dataclass(frozen=True)
class Levers:
    """The memory and speed levers applied to the model itself (the run's, ``Run.levers``)."""

    ac_interval: int = 0  # 0: no activation checkpointing; k: every k-th block (the first of each k)
    ac_selective: bool = False  # keep the matmul and attention outputs, recompute the element-wise ops
    mlp_tiles: int = 1  # > 1: each MLP runs (and is recomputed) in this many slices of the sequence
    compile: bool = False  # torch.compile block by block
    offload: Optional[str] = None  # where the blocks' saved tensors wait for backward: "cpu" (host memory) or "disk"
    offload_dir: Optional[Path] = None  # with offload "disk": the files' directory
    forward_prefetch: bool = True  # FSDP: gather the next block's parameters during this block's forward
    backward_prefetch: bool = True  # ... and the previous block's during this block's backward


class _Checkpointed:
    """A block whose activations are recomputed in backward (all of them, or with ``selective`` all but the matmul
    and attention outputs); without gradients it runs as it is."""

    selective = False

    def forward(self, *args: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return super().forward(*args)  # type: ignore[misc]
        return checkpointed(super().forward, *args, selective=self.selective)  # type: ignore[misc]


class _SelectivelyCheckpointed(_Checkpointed):
    selective = True


class _Offloaded:
    """A block whose saved tensors wait for backward in host memory or files (``offloading``), except the tables
    and masks every block shares (alive until the end of the forward anyway)."""

    offloading: ActivationOffloading

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, input_pos: Optional[torch.Tensor] = None,
                input_pos_maxp1: Optional[int] = None,
                document_masks: Optional[dict[Optional[int], torch.Tensor]] = None) -> torch.Tensor:
        args = (x, cos, sin, input_pos, input_pos_maxp1, document_masks)  # Block.forward's
        if not torch.is_grad_enabled():
            return super().forward(*args)  # type: ignore[misc]
        with self.offloading(resident=(cos, sin, *(document_masks or {}).values())):
            return super().forward(*args)  # type: ignore[misc]


class _Tiled:
    """An MLP computed ``tiles`` slices of the sequence at a time, each recomputed in backward (activations.tiled)."""

    tiles = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(1) == 1:  # decoding: one token
            return super().forward(x)  # type: ignore[misc]
        return tiled(super().forward, x, self.tiles)  # type: ignore[misc]


def wrap(module: nn.Module, wrapper: type, **state: Any) -> nn.Module:
    """``module`` with ``wrapper``'s forward around its own: its class becomes a subclass of both
    (``mixed_class``), and ``state`` its attributes."""
    module.__class__ = mixed_class(wrapper, type(module))
    for name, value in state.items():
        setattr(module, name, value)
    return module


def parallelize(model: nn.Module, dims: ParallelDims, levers: Levers, mesh: Optional[DeviceMesh] = None,
                device_type: str = "cpu") -> nn.Module:
    """Apply the levers to ``model``'s blocks in one order: activation checkpointing, offloading (around it, so that
    it sees what the checkpointed blocks keep: their inputs), the tiled MLP, compile; then, with a ``mesh``, FSDP
    (``device_type``: where its shards live). ``dims``: the layout (tensor and context parallelism land here)."""
    offloading = ActivationOffloading(levers.offload, levers.offload_dir) if levers.offload else None
    for i, block in enumerate(model.blocks):
        if levers.ac_interval and i % levers.ac_interval == 0:
            wrap(block, _SelectivelyCheckpointed if levers.ac_selective else _Checkpointed)
        if offloading is not None:
            wrap(block, _Offloaded, offloading=offloading)
        if levers.mlp_tiles > 1:
            wrap(block.mlp, _Tiled, tiles=levers.mlp_tiles)
        if levers.compile:
            # Block by block, in place (regional compilation, as torchtune and torchtitan do): every block compiles
            # to the same code once, and the fused loss stays eager. Compiling the whole model made inductor keep
            # every loss chunk's logits gradient at once (pythia-160m 8 x 1,024 on a GPU: +0.83 GB over eager).
            block.compile()
    if mesh is not None:
        shard_model(model, mesh, dims, device_type, levers.forward_prefetch, levers.backward_prefetch)
    return model


def parallelize_outside_strategy(model: nn.Module, dims: ParallelDims, levers: Levers) -> nn.Module:
    """What the run's Fabric strategy does not apply (backend.py): everything on one device and under DDP, which
    wraps the model afterwards; nothing under FSDP, whose strategy calls ``parallelize`` with its mesh."""
    return model if dims.fsdp else parallelize(model, dims, levers)


def offloading_of(model: nn.Module) -> Optional[ActivationOffloading]:
    """The offloader ``parallelize`` gave the model's blocks (the planner reads what it moved), if any."""
    return next((block.offloading for block in model.blocks if isinstance(block, _Offloaded)), None)
