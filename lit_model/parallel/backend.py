"""The Fabric strategy a run's ``ParallelDims`` ask for: the only place that names Fabric's strategy classes."""

from __future__ import annotations

import datetime

import torch
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy, Strategy

from lit_model.parallel.dims import ParallelDims
from lit_model.parallel.apply import Levers, parallelize
from lit_model.parallel.fsdp import fsdp_mesh


def fabric_strategy(dims: ParallelDims, levers: Levers, device_type: str, timeout: datetime.timedelta) -> Strategy:
    """One device as it is; DDP's replicas; or FSDP2 through ``ModelParallelStrategy`` (which, unlike Fabric's FSDP1
    strategy, also runs on the CPU with gloo), whose setup applies ``parallelize`` (the levers, then FSDP) with its
    mesh. Without FSDP the levers are applied before setup (``apply.parallelize_outside_strategy``)."""
    backend = "nccl" if device_type == "cuda" else "gloo"
    if dims.single:
        return SingleDeviceStrategy(device=torch.device("cuda:0" if device_type == "cuda" else "cpu"))
    if dims.ddp:
        # gradients as views into DDP's all-reduce buckets: one copy of them instead of two (PyTorch's
        # DistributedDataParallel docs, gradient_as_bucket_view); the optimizer and clipping read them as usual
        return DDPStrategy(process_group_backend=backend, timeout=timeout, gradient_as_bucket_view=True)
    return ModelParallelStrategy(
        parallelize_fn=lambda model, mesh: parallelize(model, dims, levers, fsdp_mesh(mesh, dims, device_type),
                                                       device_type),
        data_parallel_size=dims.dp_replicate * dims.dp_shard,
        tensor_parallel_size=dims.tp,
        process_group_backend=backend,
        timeout=timeout,
    )
