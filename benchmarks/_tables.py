"""The results tables of the benchmarks that report a list of rows (one Markdown table and one CSV, same columns),
the processor their figures are of, and the best-of timing of one call."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable


def markdown_table(rows: list[dict]) -> str:
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows])


def csv_text(rows: list[dict]) -> str:
    header = list(rows[0])
    return "\n".join([",".join(header)] + [",".join(str(row[h]) for h in header) for row in rows]) + "\n"


def cpu_description() -> str:
    """The processor's name and the matrix instruction sets torch's kernels use (AVX-512, AMX): tokens/s and
    their ratios are of this machine."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "unknown")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    matrix = [flag for flag in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if flag in flags]
    return f"{name}, {os.cpu_count()} cores, {', '.join(matrix) or 'no AVX2'}"


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn``, after one untimed call (which allocates and picks kernels)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
