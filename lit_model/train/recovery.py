"""Out-of-memory handling inside the training step (step.py): splitting a step's samples into smaller micro
batches, the agreement of all ranks on an out-of-memory error, and an injectable memory cap that lets the CPU tests
cause a real ``torch.OutOfMemoryError`` at a chosen size. What the user is told when nothing is left to split is
lit_model/plan/oom_report.py's.

The simulated cap: with ``LIT_MODEL_SIMULATED_MEMORY_CAP=4MB`` every training forward counts the bytes of the
step's tensors -- parameters, gradients and optimizer state held at that moment, plus the activations the forward
saves for backward -- and raises ``torch.OutOfMemoryError`` once they pass the cap. The activations grow with the
micro batch, so halving it fits, as on a GPU; the framework's own overhead is not simulated.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from typing import Any, Iterator

import torch
from lightning.fabric import Fabric

from lit_model.core.units import parse_memory
from lit_model.train.optimizers import state_tensors

SIMULATED_CAP_ENV = "LIT_MODEL_SIMULATED_MEMORY_CAP"


def _storages(tensors: Iterator[torch.Tensor]) -> dict[int, int]:
    """data pointer -> bytes of each distinct storage (FSDP's DTensors: the local shard)."""
    found = {}
    for tensor in tensors:
        storage = getattr(tensor, "_local_tensor", tensor).untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    return found


def step_tensors(model: torch.nn.Module, optimizer: Any) -> dict[int, int]:
    """The storages a training step holds besides its activations: parameters, gradients, optimizer state."""
    inner = getattr(optimizer, "optimizer", optimizer)
    grads = (p.grad for p in model.parameters() if p.grad is not None)
    return _storages(itertools.chain(model.parameters(), grads, state_tensors(inner)))


@contextlib.contextmanager
def simulated_memory_cap(model: torch.nn.Module, optimizer: Any) -> Iterator[None]:
    """Raise ``torch.OutOfMemoryError`` when the step's tensors (parameters, gradients, optimizer state and the
    activations saved for backward in this context) pass the cap; a no-op unless the environment variable is set."""
    cap = os.environ.get(SIMULATED_CAP_ENV)
    if not cap:
        yield
        return

    limit = parse_memory(cap)
    held = step_tensors(model, optimizer)
    total = sum(held.values())

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in held:
            held[storage.data_ptr()] = storage.nbytes()
            total += storage.nbytes()
            if total > limit:
                raise torch.OutOfMemoryError(f"Simulated out of memory: the step's tensors passed {cap} ({SIMULATED_CAP_ENV})")
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def split_batches(batches: list[tuple[torch.Tensor, ...]], micro_batch_size: int) -> list[tuple[torch.Tensor, ...]]:
    """The step's samples in micro batches of at most ``micro_batch_size`` rows, in the same order (each batch's
    parts, e.g. input ids, targets and the positions of packed samples, split alike)."""
    return [rows for batch in batches for rows in zip(*(part.split(micro_batch_size) for part in batch))]


def any_rank(fabric: Fabric, flag: bool) -> bool:
    if fabric.world_size == 1:
        return flag
    return bool(fabric.all_reduce(torch.tensor(float(flag), device=fabric.device), reduce_op="max").item())


class StepOutOfMemory(Exception):
    """Raised on every rank when any rank ran out of memory in a step (so all take the same decision)."""


@contextlib.contextmanager
def catch_out_of_memory(failures: list[str]) -> Iterator[None]:
    """Record an out-of-memory error (its first line) in ``failures`` instead of raising it."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        failures.append(str(error).strip().splitlines()[0] if str(error).strip() else "out of memory")


def raise_if_any_rank_failed(fabric: Fabric, failures: list[str]) -> None:
    """Every rank learns whether any rank ran out of memory and, if so, all raise ``StepOutOfMemory`` together.
    Every rank must call it at the same points of the step (it is a collective with several ranks)."""
    if any_rank(fabric, bool(failures)):
        raise StepOutOfMemory(failures[0] if failures else "another rank ran out of memory")

