"""The report of a run that ran out of memory with nothing left to split: what the planner says took the memory,
the cheapest flag changes that fit, a memory snapshot on a GPU, and how to continue from the newest checkpoint.
The recipes hand ``out_of_memory_report`` to the fit loop (training imports no planner).
"""

from __future__ import annotations

from typing import Any

import torch

from lit_model.core.units import detect_device_memory, format_bytes, parse_memory
from lit_model.run import Run
from lit_model.plan.search import SUGGESTION_MARGIN, suggest_changes
from lit_model.plan.training import plan_run
from lit_model.train.resumable import lineage
from lit_model.train.snapshot import write_snapshot


def out_of_memory_report(run: Run, args: Any, device: torch.device, where: str, message: str) -> str:
    """What took the memory (the planner's categories for ``run``, the micro batch that failed), the three
    cheapest fixes with their predicted peaks, and a memory snapshot on GPU: one paragraph."""
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
