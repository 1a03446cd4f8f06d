"""FSDP2 (``fully_shard`` per transformer block, then the root) over the mesh the run's ``ParallelDims`` give.

The training scripts apply it through Fabric's ``ModelParallelStrategy`` (backend.py); the planner's trace applies
the same over PyTorch's fake process group.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from lit_model.parallel.dims import ParallelDims


def fsdp_mesh(mesh: DeviceMesh, dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh FSDP shards over: Fabric's data-parallel dimension, or for HYBRID_SHARD a two-dimensional mesh
    (replicas across the nodes, shards within a node)."""
    if dims.hybrid:
        return init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard), mesh_dim_names=("replicate", "shard"))
    return mesh["data_parallel"]


def shard_model(model: nn.Module, mesh: DeviceMesh, dims: ParallelDims, device_type: str, forward_prefetch: bool,
                backward_prefetch: bool) -> nn.Module:
    """FSDP2 over ``mesh`` (``fsdp_mesh``): one shard group per transformer block, then the root (embedding, final
    norm, head)."""
    kwargs = {"mesh": mesh, "reshard_after_forward": dims.reshards_after_forward}
    if dims.cpu_offload:
        # Pinned host memory needs a GPU; without one plain pageable memory still works (tests on CPU).
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device_type == "cuda")
    blocks = list(model.blocks)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # FSDP shards bitsandbytes' packed 4-bit weights like any tensor, but their quantization statistics live on the
    # module, outside the parameters it moves: put them where the gathered weights will be used
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    for module in model.modules():
        if getattr(module, "quant_state", None) is not None:
            module.quant_state.to(device)
    if forward_prefetch or backward_prefetch:
        for current, following in zip(blocks, blocks[1:]):
            if forward_prefetch:
                current.set_modules_to_forward_prefetch([following])
            if backward_prefetch:
                following.set_modules_to_backward_prefetch([current])
    return model
