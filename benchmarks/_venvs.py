"""Separate virtual environments for the peers the benchmarks compare lit-model with, made on first use.

Each gets the CPU build of torch pinned first (torch==2.13.0, the one lit-model's own environment runs), so the
peer's own torch requirement installs nothing more and every implementation runs the same kernels.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCH = "torch==2.13.0"
LITGPT_VERSION = "0.5.13"
LITGPT_VENV = HERE / ".venv-litgpt"


def venv_python(venv: Path, packages: list[str]) -> str:
    """The interpreter of ``venv``, created with ``packages`` installed (after the pinned torch) if it is not there."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        try:
            install(str(python), packages)
        except BaseException:  # a half-made venv would be taken as ready next time
            shutil.rmtree(venv, ignore_errors=True)
            raise
    return str(python)


def install(python: str, packages: list[str]) -> None:
    subprocess.run([python, "-m", "pip", "install", "-q", TORCH, *packages], check=True)
    # A package that requires torchvision (litdata does) gets the registry's build, made for the CUDA torch: with
    # the CPU torch its operators do not load and any import of it fails, which takes down torchmetrics and with
    # it lightning. None of the benchmarked commands uses it: it goes.
    broken = subprocess.run([python, "-c", "import torchvision"], capture_output=True).returncode != 0
    if broken and subprocess.run([python, "-m", "pip", "show", "-q", "torchvision"], capture_output=True).returncode == 0:
        subprocess.run([python, "-m", "pip", "uninstall", "-q", "-y", "torchvision"], check=True)


def litgpt_python(extra: tuple[str, ...] = ()) -> str:
    """benchmarks/.venv-litgpt with litgpt pinned; ``extra``: what some of its commands need besides (litdata for
    ``litgpt pretrain``'s TextFiles), installed into an existing venv when missing."""
    python = venv_python(LITGPT_VENV, [f"litgpt=={LITGPT_VERSION}", *extra])
    missing = [p for p in extra if subprocess.run([python, "-m", "pip", "show", "-q", p], capture_output=True).returncode]
    if missing:
        install(python, missing)
    return python
