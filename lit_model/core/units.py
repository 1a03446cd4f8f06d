"""Memory sizes: parsing ``--device_memory 24GB``, formatting, and how much memory this machine has."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from lit_model.core.errors import UsageError

# Decimal (SI) units are powers of 10, binary (IEC) units powers of 2 -- exactly as their names say.
# Note: a GPU sold as "24GB" (RTX 3090/4090) has 24 GiB = 25.8e9 bytes; `24GB` here means 24e9 bytes, i.e.
# a conservative plan for that card. Pass `24GiB` to plan for the full card.
_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
    "t": 10**12, "tb": 10**12, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_memory(text: str | int | float) -> int:
    """Bytes in ``text``: ``"24GB"`` = 24 * 10**9, ``"24GiB"`` = 24 * 2**30, ``"512MB"``, ``"1.5TB"``, ``"8e9"``.

    KB/MB/GB/TB (and K/M/G/T) are decimal, KiB/MiB/GiB/TiB binary; a bare number is bytes. Case and spaces
    are ignored. Raises ``UsageError`` for anything else or a size that is not positive.
    """
    if isinstance(text, bool):
        raise UsageError(f"Memory size {text!r} is not a size: use e.g. 24GB, 24GiB or 512MB.")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _PATTERN.match(str(text))
        if match is None or match.group(2).lower() not in _UNITS:
            raise UsageError(
                f"Cannot read the memory size {text!r}. Write a number with a unit: 24GB (= 24e9 bytes), "
                "24GiB (= 24 * 2^30 bytes), 512MB or 80GB; KB/MB/GB/TB are decimal, KiB/MiB/GiB/TiB binary."
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    size = int(round(value * _UNITS[unit]))
    if size <= 0:
        raise UsageError(f"Memory size {text!r} must be larger than zero.")
    return size


def format_bytes(n: float, unit: str = "GB") -> str:
    """``format_bytes(21.3e9) == "21.30 GB"``: decimal units, matching what --device_memory accepts."""
    scale = {"GB": 10**9, "MB": 10**6, "GiB": 2**30, "MiB": 2**20}[unit]
    if unit.startswith("G") and abs(n) < 0.1 * scale:
        return format_bytes(n, "MB" if unit == "GB" else "MiB")
    return f"{n / scale:,.2f} {unit}"


def _cgroup_limit() -> Optional[int]:
    """The memory this process may still use under a cgroup limit (containers), if there is one."""
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            raw = Path(limit_path).read_text().strip()
            if raw == "max" or int(raw) >= 2**60:
                return None
            return int(raw) - int(Path(usage_path).read_text().strip())
        except (OSError, ValueError):
            continue
    return None


def detect_device_memory(device_type: Optional[str] = None, device_index: int = 0) -> int:
    """Total memory of the GPU (``torch.cuda.get_device_properties().total_memory``), or on the CPU the
    memory available to a new process now (psutil's ``available``, capped by a cgroup limit)."""
    import torch

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("No CUDA GPU here to measure: pass --device_memory (e.g. 24GB) to plan for one.")
        return int(torch.cuda.get_device_properties(device_index).total_memory)
    import psutil

    available = int(psutil.virtual_memory().available)
    limit = _cgroup_limit()
    return min(available, limit) if limit is not None else available


def peak_rss_bytes() -> int:
    """This process's peak resident memory. Linux's VmHWM, not getrusage's ru_maxrss: the latter survives
    execve, so a process started by a large parent (pytest, a launcher) would report the parent's peak."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024
