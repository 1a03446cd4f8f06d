"""The one Fabric setup every training script uses: accelerator, precision and the strategy of the run's layout
(parallel/backend.py; under FSDP its setup applies the levers, parallel/apply.py), the allocator and heap settings.

FSDP is FSDP2 (``fully_shard`` per transformer block) through Fabric's ``ModelParallelStrategy``: it runs
on GPUs and, with gloo, on the CPU, which Fabric's FSDP1 strategy refuses.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric import Fabric
from lightning.fabric.plugins import TorchCheckpointIO

from lit_model.core.errors import STOPS, UserError
from lit_model.parallel.backend import fabric_strategy
from lit_model.run import ALLOC_CONF_VARIABLES, Run


@dataclass
class DistributedSettings:
    """The memory levers that decide how the model is placed; shared by every training script."""

    devices: Union[int, Literal["auto"]] = 1
    num_nodes: int = 1
    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    sharding_strategy: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] = "FULL_SHARD"
    cpu_offload: bool = False
    activation_checkpointing: Union[bool, Literal["selective"]] = False
    activation_checkpointing_interval: int = 1  # with activation_checkpointing: every k-th block
    forward_prefetch: bool = True
    backward_prefetch: bool = True
    # Long enough for the longest legitimate wait of one rank for the others: rank 0 writing a large checkpoint or
    # final/ while the others wait at a barrier (minutes for billions of parameters). Torch's gloo default.
    timeout: float = 1800.0


def accelerator_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class StateIO(TorchCheckpointIO):
    """Fabric's writer and reader of the resumable state on one process or DDP (FSDP writes its shards with
    PyTorch DCP). Lightning's default serializes the whole state into memory and stages it in $TMPDIR; this
    writes straight into the checkpoint's temporary directory, and loads with weights_only=True, never
    unpickling code."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        with open(path, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())

    def load_checkpoint(self, path: Any, map_location: Any = "cpu", weights_only: Optional[bool] = None) -> dict[str, Any]:
        # on the CPU first, as Lightning's default does: every DDP rank would otherwise load onto the saving GPU
        return torch.load(path, map_location=map_location, weights_only=True)


def set_cuda_allocator(run: Run) -> None:
    """Give the CUDA caching allocator the run's settings (expandable segments unless the user set
    PYTORCH_CUDA_ALLOC_CONF): before anything touches the GPU, and in the environment, so the processes Fabric
    launches read it too."""
    if run.cuda_alloc_conf is not None and not any(v in os.environ for v in ALLOC_CONF_VARIABLES):
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = run.cuda_alloc_conf


def set_cpu_heap(run: Run) -> None:
    """Give glibc's heap the run's settings (``Run.heap_settings``): in this process, which each rank's
    process also runs, before the model is built."""
    if not run.heap_settings:
        return
    libc = ctypes.CDLL("libc.so.6")
    for name, code, value in run.heap_settings:
        if libc.mallopt(code, value) != 1:
            raise RuntimeError(f"glibc refused mallopt({name}, {value})")


def setup_fabric(run: Run) -> Fabric:
    """Build (not launch) the Fabric for this run."""
    set_cuda_allocator(run)
    set_cpu_heap(run)
    timeout = datetime.timedelta(seconds=run.timeout)
    if run.device_type == "cpu" and run.devices > 1 and "OMP_NUM_THREADS" not in os.environ:
        # The processes share the cores: more threads than cores makes every step many times slower.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // run.devices))
    strategy = fabric_strategy(run.parallel, run.levers, run.device_type, timeout)
    return Fabric(
        accelerator=run.device_type,
        devices=run.devices,
        num_nodes=run.num_nodes,
        strategy=strategy,
        precision=run.precision,
        plugins=[] if run.parallel.fsdp else [StateIO()],  # FSDP writes and reads its shards with DCP
    )


# What gloo and NCCL say when a collective waited past the timeout, or when a peer left while it waited
COLLECTIVE_FAILURE = re.compile(r"timed out|timeout|connection (closed|reset) by peer|pair closure", re.IGNORECASE)


class CollectiveTimeout(UserError):
    """A collective that waited past --timeout: seen by the ranks that waited, so each one reports it."""

    every_rank = True


def launch(fabric: Fabric, run: Run, function: Callable[..., Any], *args: Any) -> Any:
    """``fabric.launch(function, *args)`` on every rank; a collective that timed out (or lost its peer) ends the
    rank with one paragraph instead of a traceback."""
    STOPS.where = "before training started: nothing was saved"  # until the fit loop defers stops

    def on_rank(fabric: Fabric, *args: Any) -> Any:
        STOPS.rank = fabric.global_rank if fabric.world_size > 1 else None
        return function(fabric, *args)

    try:
        return fabric.launch(on_rank, *args)
    except RuntimeError as error:
        if fabric.world_size == 1 or not COLLECTIVE_FAILURE.search(str(error)):
            raise
        rank, world_size = fabric.global_rank, fabric.world_size
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[-1])  # without gloo's source location
        others = f"rank {1 - rank}" if world_size == 2 else f"one of the other {world_size - 1} ranks"
        raise CollectiveTimeout(
            f"Rank {rank} of {world_size} waited for the other processes (in a collective operation or the start-up "
            f"rendezvous) until it failed "
            f"({reason}): {others} stopped answering (stopped, hung or died) or left. "
            f"The wait is bounded by --timeout ({run.timeout:g} s). Check that every process runs (and why one "
            "stopped), then continue from the newest checkpoint with --resume auto; raise --timeout if a rank "
            "legitimately needs longer (e.g. writing a large checkpoint)."
        ) from None
