"""Out-of-memory handling inside the fit loop: a training step that splits its micro batch and redoes the
same samples when the device runs out of memory, the agreement of all ranks on that, the report printed when
nothing is left to split, and an injectable memory cap that lets the CPU tests cause a real
``torch.OutOfMemoryError`` at a chosen size.

The simulated cap: with ``LIT_MODEL_SIMULATED_MEMORY_CAP=4MB`` every training forward counts the bytes of the
step's tensors -- parameters, gradients and optimizer state held at that moment, plus the activations the forward
saves for backward -- and raises ``torch.OutOfMemoryError`` once they pass the cap. The activations grow with the
micro batch, so halving it fits, as on a GPU; the framework's own overhead is not simulated.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from lightning.fabric import Fabric

from lit_model.data.instruct import IGNORE_INDEX
from lit_model.run import Run
from lit_model.training.optimizers import state_tensors

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
    from lit_model.memory.units import parse_memory

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


def count_targets(targets: torch.Tensor) -> torch.Tensor:
    return (targets != IGNORE_INDEX).sum()


def start_memory_history(device: torch.device) -> None:
    """On a GPU, record allocations so that an out-of-memory report can write a snapshot."""
    if device.type == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=100_000)


def write_snapshot(device: torch.device, out_dir: Path) -> Optional[Path]:
    if device.type != "cuda":
        return None
    path = out_dir / f"oom_snapshot_{int(time.time())}.pickle"
    torch.cuda.memory._dump_snapshot(str(path))
    return path


def out_of_memory_report(run: Run, args: Any, device: torch.device, where: str, message: str) -> str:
    """What took the memory (the planner's categories for ``run``, the micro batch that failed), the three
    cheapest fixes with their predicted peaks, and a memory snapshot on GPU: one paragraph."""
    from lit_model.memory.plan import SUGGESTION_MARGIN, plan_run, suggest_changes
    from lit_model.memory.units import detect_device_memory, format_bytes, parse_memory
    from lit_model.training.loop import lineage  # loop imports this module: import at call time

    out_dir, micro_batch_size = args.out_dir, run.micro_batch_size
    plan = plan_run(run, suggest=False, detect=False)
    memory = parse_memory(args.device_memory) if args.device_memory else detect_device_memory(run.device_type, device.index or 0)
    # It ran out, so the real budget is below this run's peak even where the plan thought it fits: ask for a
    # quarter less tensor memory (the framework overhead stays).
    budget = min(memory, int((plan.peak_bytes - plan.tensor_peak_bytes // 4) / (1 - SUGGESTION_MARGIN)))
    fixes = suggest_changes(run, budget, limit=3)
    categories = ", ".join(f"{name} {format_bytes(size)}" for name, size in sorted(plan.by_category.items(), key=lambda kv: -kv[1]) if size)
    fix_text = "; ".join(f"{i + 1}) {' '.join(s.flags)} (predicted peak {format_bytes(s.peak_bytes)}, speed x{s.speed_factor})"
                         for i, s in enumerate(fixes)) or "none of up to 3 flag changes fits: use more devices"
    snapshot = write_snapshot(device, out_dir)
    saved = [path for path in lineage(out_dir) if path.is_dir()]  # what --resume auto would take
    if saved:
        resume = f"The newest checkpoint is {saved[-1]}: continue with the new flags and --resume auto."
    else:  # cite only what exists: before the first save there is nothing to resume
        resume = f"No checkpoint was saved yet in {out_dir}: start again with the new flags and --overwrite."
    # stepped in backward, the step cannot be redone in smaller micro batches (TrainStep does not try)
    attempt = "with" if run.steps_in_backward else "even with"
    return (
        f"Out of memory {where} {attempt} micro batch {micro_batch_size} ({message}). Predicted memory "
        f"per rank: {categories} (peak {format_bytes(plan.peak_bytes)}). Fixes, cheapest first: {fix_text}. "
        + (f"Memory snapshot: {snapshot} (open it at https://pytorch.org/memory_viz). " if snapshot else "")
        + (f"An optimizer stepping in backward ({run.optimizer}"
           f"{', --optimizer_in_backward' if run.optimizer_in_backward else ''}) cannot redo a step in smaller micro "
           "batches: parameters it stepped before the failure would step twice. " if run.steps_in_backward else "")
        + resume
    )
