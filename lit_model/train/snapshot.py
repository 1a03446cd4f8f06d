"""GPU memory snapshots: allocations recorded from the start of a run, so that an out-of-memory report can write
what was allocated where (open it at https://pytorch.org/memory_viz)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import torch


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
