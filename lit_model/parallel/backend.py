"""The Fabric strategy a run's ``ParallelDims`` ask for: the only place that names Fabric's strategy classes."""

from __future__ import annotations

import datetime

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy

from lit_model.parallel.dims import ParallelDims
from lit_model.parallel.fsdp import fsdp_mesh, shard_model


def fabric_strategy(dims: ParallelDims, device_type: str, timeout: datetime.timedelta, forward_prefetch: bool,
                    backward_prefetch: bool) -> Strategy:
    """One device as it is; DDP's replicas; or FSDP2 through ``ModelParallelStrategy`` (which, unlike Fabric's FSDP1
    strategy, also runs on the CPU with gloo). ``forward_prefetch`` / ``backward_prefetch``: FSDP's, per block."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if dims.single:
        return SingleDeviceStrategy(device=torch.device("cuda:0" if device_type == "cuda" else "cpu"))
    if dims.ddp:
        # gradients as views into DDP's all-reduce buckets: one copy of them instead of two (PyTorch's
        # DistributedDataParallel docs, gradient_as_bucket_view); the optimizer and clipping read them as usual
        return DDPStrategy(process_group_backend=backend, timeout=timeout, gradient_as_bucket_view=True)
    return ModelParallelStrategy(
        parallelize_fn=lambda model, mesh: shard_model(model, fsdp_mesh(mesh, dims, device_type), dims, device_type,
                                                       forward_prefetch, backward_prefetch),
        data_parallel_size=dims.dp_replicate * dims.dp_shard,
        tensor_parallel_size=dims.tp,
        process_group_backend=backend,
        timeout=timeout,
    )
