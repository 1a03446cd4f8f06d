"""Shared fixtures: a tiny corpus, tokenizer and model config, so training tests take seconds."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import runpy
import signal
import subprocess
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY_CONFIG = """\
name: test-tiny
block_size: 64
vocab_size: 512
n_layer: 2
n_embd: 64
n_head: 4
n_query_groups: 2
intermediate_size: 128
"""


@pytest.fixture(autouse=True)
def _keep_sigint_handler():
    """Scripts run in-process (directly, through ``lit-model`` or the tutorial's commands) set SIGINT to its default
    action while they import; give every test the test process's own handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    """A 5-file corpus, a 512-token BPE tokenizer trained on it, and a ~140k-parameter model config."""
    from lit_model.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("tiny")
    data = root / "data"
    data.mkdir()
    sources = [STDLIB / f"{name}.py" for name in ("textwrap", "shlex", "fnmatch", "argparse", "string")]
    for source in sources:
        (data / f"{source.stem}.txt").write_text(source.read_text())
    train_bpe(sources, 512, root / "tokenizer")
    (root / "tiny.yaml").write_text(TINY_CONFIG)
    return {"root": root, "data": data, "tokenizer": root / "tokenizer", "config": root / "tiny.yaml"}


def run_script(script: str, *args: str, cache: Path | None = None, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LIT_MODEL_DEBUG", None)
    if cache is not None:
        env["LIT_MODEL_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, **popen,
    )


def run_captured(call: Callable[[], Any], args: list[str]) -> subprocess.CompletedProcess:
    """Run ``call`` in this process as a command line would: (exit status, stdout, stderr). An exception that
    escapes it (what a user would see as a traceback) comes back as exit status -1 with the traceback on stderr."""
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            call()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:  # noqa: BLE001 - what escapes the command is the failure under test
            traceback.print_exc()
            code = -1
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def run_script_inprocess(script: str, *args: str, cache: Path | None = None, monkeypatch=None) -> subprocess.CompletedProcess:
    """``run_script`` without a new interpreter (~50 ms instead of ~3 s): runs ``script`` as ``__main__`` with
    ``args`` as its command line (see ``run_captured``). Needs pytest's ``monkeypatch`` for the cache."""
    if cache is not None:
        monkeypatch.setenv("LIT_MODEL_CACHE", str(cache))
    argv = sys.argv
    sys.argv = [str(ROOT / script), *map(str, args)]
    try:
        return run_captured(lambda: runpy.run_path(str(ROOT / script), run_name="__main__"), list(sys.argv))
    finally:
        sys.argv = argv


def read_metrics(out_dir: Path) -> list[dict[str, str]]:
    with open(out_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))
