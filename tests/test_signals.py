"""Stops, hangs and honesty: a SIGTERM/SIGINT saves within seconds wherever it lands (between micro batches, between
evaluation batches) and the run resumes to exactly the uninterrupted losses; before training a signal ends the
script with one line; a stopped rank ends the others after --timeout; a rank blocked in a collective ends on a
signal; summary.json stays strict JSON."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, read_metrics
from lit_model.data.text import split_by_file

WIDE_CONFIG = """\
name: test-wide
block_size: 64
vocab_size: 512
n_layer: 4
n_embd: 256
n_head: 4
n_query_groups: 2
intermediate_size: 1024
"""


@pytest.fixture(scope="module")
def slow_setup(tiny_setup, tmp_path_factory) -> dict[str, Path]:
    """A wider model (~0.1 s per micro batch of one window on one CPU thread) and the tiny corpus with its validation
    file grown to ~260 windows, so a step of many micro batches, or one evaluation, takes several seconds."""
    root = tmp_path_factory.mktemp("slow")
    data = root / "data"
    data.mkdir()
    for path in tiny_setup["data"].iterdir():
        (data / path.name).write_text(path.read_text())
    _, (val_file,) = split_by_file(sorted(data.iterdir()), root=data)
    val_file.write_text(val_file.read_text() * 3)
    (root / "wide.yaml").write_text(WIDE_CONFIG)
    return {**tiny_setup, "data": data, "config": root / "wide.yaml"}


def train_args(setup: dict[str, Path], out_dir: Path, *extra: str) -> list[str]:
    return [
        "pretrain/main.py", "--model_config", setup["config"], "--tokenizer_dir", setup["tokenizer"],
        "--data_path", setup["data"], "--out_dir", out_dir, "--micro_batch_size", "1", "--eval_batch_size", "1",
        "--log_interval", "1", "--warmup_steps", "1", "--save_interval", "100", *extra,
    ]


def environment(setup: dict[str, Path]) -> dict[str, str]:
    # One thread per process: the timings below stay close to an idle machine's on a shared one.
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "LIT_MODEL_CACHE": str(setup["root"] / "cache")}
    env.pop("LIT_MODEL_DEBUG", None)
    return env


def start(setup: dict[str, Path], out_dir: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *map(str, train_args(setup, out_dir, *extra))], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=environment(setup),
    )


def read_until(proc: subprocess.Popen, prefix: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"no line starting with {prefix!r}; stderr: {proc.stderr.read()[-3000:]}")


def run_to_end(setup: dict[str, Path], out_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, *map(str, train_args(setup, out_dir, *extra))], cwd=ROOT, text=True,
                          capture_output=True, env=environment(setup), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def losses(out_dir: Path) -> list[tuple[str, str, str]]:
    return [(row["step"], row["train_loss"], row["val_loss"]) for row in read_metrics(out_dir)]


def signal_and_time_the_checkpoint(proc: subprocess.Popen, out_dir: Path, signum: int) -> float:
    """Send ``signum``; the seconds until a complete checkpoint directory exists."""
    sent = time.monotonic()
    proc.send_signal(signum)
    while not list((out_dir / "checkpoints").glob("step-*/state.pt")):
        assert proc.poll() is None or list((out_dir / "checkpoints").glob("step-*/state.pt")), proc.stderr.read()[-3000:]
        time.sleep(0.02)
    return time.monotonic() - sent


def check_stopped_run(proc: subprocess.Popen, out_dir: Path, step: int, latency: float, lines: list[str]) -> str:
    stdout, stderr = proc.communicate(timeout=120)
    stdout = "".join(lines) + stdout
    assert proc.returncode == 0, stderr[-3000:]
    assert latency < 5, f"the checkpoint appeared {latency:.1f} s after the signal"
    assert [p.name for p in (out_dir / "checkpoints").glob("step-*")] == [f"step-{step:08d}"]
    assert not (out_dir / "final").exists() and "Sample:" not in stdout
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["stopped"] is True and summary["steps"] == step
    assert f"Stopped by signal SIGTERM at step {step}/" in stdout
    assert summary["resume_command"].endswith("--resume auto") and summary["resume_command"] in stdout
    assert "Traceback" not in stderr
    return stdout


@pytest.mark.slow
def test_sigterm_between_micro_batches_abandons_the_step_saves_at_once_and_resumes_exactly(slow_setup, tmp_path):
    # A step is 48 micro batches (~5 s): the signal lands in the second step's accumulation.
    settings = ("--global_batch_size", "48", "--max_steps", "2", "--eval_interval", "1000", "--eval_iters", "4")
    full = tmp_path / "full"
    run_to_end(slow_setup, full, *settings)
    stopped = tmp_path / "stopped"
    proc = start(slow_setup, stopped, *settings)
    lines = read_until(proc, "step 1/2")
    time.sleep(0.5)
    latency = signal_and_time_the_checkpoint(proc, stopped, signal.SIGTERM)
    stdout = check_stopped_run(proc, stopped, 1, latency, lines)
    assert "evaluation is redone" not in stdout
    assert losses(stopped) == losses(full)[:1]

    resumed = run_to_end(slow_setup, stopped, *settings, "--resume", "auto")
    assert "Resumed from" in resumed.stdout and "at step 1" in resumed.stdout
    assert losses(stopped) == losses(full)
    assert (stopped / "final" / "model.safetensors").is_file()
    assert "stopped" not in json.loads((stopped / "summary.json").read_text())


@pytest.mark.slow
def test_sigterm_during_evaluation_saves_at_once_and_the_resumed_run_evaluates_that_step(slow_setup, tmp_path):
    # Steps of one micro batch (~0.1 s) and an evaluation of ~260 batches (several seconds) at steps 2 and 3.
    settings = ("--global_batch_size", "1", "--max_steps", "3", "--eval_interval", "2", "--eval_iters", "100000")
    full = tmp_path / "full"
    run_to_end(slow_setup, full, *settings)
    stopped = tmp_path / "stopped"
    proc = start(slow_setup, stopped, *settings)
    lines = read_until(proc, "step 1/3")
    time.sleep(1.0)
    latency = signal_and_time_the_checkpoint(proc, stopped, signal.SIGTERM)
    stdout = check_stopped_run(proc, stopped, 2, latency, lines)
    assert "(its evaluation is redone on resume)" in stdout
    assert losses(stopped) == losses(full)[:1]  # step 2's row waits for its evaluation

    run_to_end(slow_setup, stopped, *settings, "--resume", "auto")
    assert losses(stopped) == losses(full)
    assert (stopped / "final" / "model.safetensors").is_file()


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_before_training_ends_the_script_with_one_line(slow_setup, tmp_path, signum, code):
    # "Data:" comes before the model is built and rehearsed (a step, an evaluation batch, a save: ~1 s here).
    proc = start(slow_setup, tmp_path / "early", "--global_batch_size", "8", "--max_steps", "5")
    read_until(proc, "Data:")
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr[-3000:]
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == f"Stopped by {name} before training started: nothing was saved."
    assert "Traceback" not in stderr and "step 1/" not in stdout
    assert not list((tmp_path / "early").glob("checkpoints/step-*"))


def test_ctrl_c_while_the_script_imports_ends_it_without_a_traceback(tmp_path):
    # torch and lightning take seconds to import, before run_cli installs its handlers
    proc = subprocess.Popen([sys.executable, str(ROOT / "pretrain/main.py"), "--out_dir", str(tmp_path / "out")],
                            cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.0)  # inside the imports (~2.5 s), well after the interpreter started
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGINT, stderr[-3000:]  # as Ctrl-C ends any program (a shell shows 130)
    assert "Traceback" not in stderr and not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_signal_to_rank_0_before_training_ends_the_rank_it_started(slow_setup, tmp_path):
    proc = start(slow_setup, tmp_path / "early", "--devices", "2", "--strategy", "ddp", "--global_batch_size", "8",
                 "--max_steps", "5")
    read_until(proc, "Model:")  # both ranks are past the rendezvous
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)  # returns once rank 1, which holds the pipes too, has ended
    assert time.monotonic() - sent < 15
    assert proc.returncode == 143 and "Stopped by SIGTERM before training started" in stderr
    # Rank 0 passed the signal on: rank 1 stopped too, rather than report rank 0 as lost in its next collective.
    assert "error:" not in stderr and "Traceback" not in stderr


def test_the_first_signal_in_the_loop_asks_to_stop_and_a_second_aborts_at_once(capsys):
    from lit_model.core.errors import STOPS, run_cli

    before = signal.getsignal(signal.SIGINT)  # pytest's, or SIG_IGN in a job started in the background

    def entry() -> None:
        with STOPS.deferred():  # as in the fit loop
            os.kill(os.getpid(), signal.SIGINT)
            assert STOPS.requested == signal.SIGINT  # only asks the loop to stop at its next safe point
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("the second signal did not abort")

    with pytest.raises(SystemExit) as exit:
        run_cli(entry)
    assert exit.value.code == 130
    assert capsys.readouterr().err == "Aborted by a second SIGINT.\n"
    assert signal.getsignal(signal.SIGINT) is before  # run_cli put the handler it found back


def test_a_signal_while_the_model_is_built_on_the_meta_device_waits_for_the_device_mode_to_end(capsys):
    """A signal's exception raised while torch swaps its mode stack corrupts it ("trying to pop from empty mode
    stack"): STOPS.held() records the signal and raises it once the block is over."""
    import torch

    from lit_model.core.errors import STOPS, run_cli

    reached = []

    def entry() -> None:
        STOPS.where = "before training started: nothing was saved"
        with STOPS.held(), torch.device("meta"):
            os.kill(os.getpid(), signal.SIGINT)
            assert STOPS.requested == signal.SIGINT
            torch.empty(3)  # torch functions still go through the device mode
            reached.append(True)
        pytest.fail("the signal was not raised after the block")

    with pytest.raises(SystemExit) as exit:
        run_cli(entry)
    assert reached and exit.value.code == 130
    assert capsys.readouterr().err == "Stopped by SIGINT before training started: nothing was saved.\n"
    assert torch.empty(1).device.type == "cpu"  # the mode stack is intact
    with STOPS.held(), torch.device("meta"):  # the signal stayed with its run: later code in this process is not stopped
        torch.empty(3)


def test_summary_is_strict_json_with_null_for_a_loss_never_measured(tiny_setup, tmp_path, monkeypatch):
    from lightning.fabric import Fabric

    from lit_model.train.args import TrainArgs
    from lit_model.core.config import Config
    from lit_model.run import resolve_run
    from lit_model.train.loop import Progress, write_summary

    fabric = Fabric(accelerator="cpu", devices=1)
    args = TrainArgs(out_dir=tmp_path)
    progress = Progress()
    progress.last_train_loss = float("inf")
    summary = write_summary(fabric, resolve_run(args, Config.from_name("lit-model-5m")), progress, args, {"extra": 1})
    text = (tmp_path / "summary.json").read_text()
    written = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in summary.json"))
    assert written["val_loss"] is None and written["train_loss"] is None and written["extra"] == 1
    assert summary["train_loss"] == float("inf")  # the caller still gets the numbers
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]  # no temporary file left


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stop_seen_by_one_rank_stops_every_rank_at_the_same_step(tiny_setup, tmp_path):
    # Only rank 0 gets the signal, mid-step: it skips its remaining micro batches, rank 1 learns of the stop at the
    # step's agreement point before the gradient all-reduce, and both abandon the step and save step 1 together.
    # 128 micro batches per rank and step: over a second even on an idle machine.
    settings = ("--devices", "2", "--strategy", "ddp", "--global_batch_size", "256", "--max_steps", "3",
                "--eval_interval", "2", "--eval_iters", "4")
    full = tmp_path / "full"
    run_to_end(tiny_setup, full, *settings)
    stopped = tmp_path / "stopped"
    proc = start(tiny_setup, stopped, *settings)
    lines = read_until(proc, "step 1/3")
    time.sleep(0.2)
    latency = signal_and_time_the_checkpoint(proc, stopped, signal.SIGTERM)
    check_stopped_run(proc, stopped, 1, latency, lines)
    run_to_end(tiny_setup, stopped, *settings, "--resume", "auto")
    assert losses(stopped) == losses(full)


@pytest.mark.parametrize("argv", [
    ["pretrain/main.py", "--max_steps", "9"],
    ["pretrain/main.py", "--resume", "out/pretrain/checkpoints/step-00000004", "--max_steps", "9"],
    ["pretrain/main.py", "--resume=auto", "--max_steps", "9"],
])
def test_the_resume_command_is_the_same_command_with_resume_auto(argv):
    from lit_model.train.loop import resume_command

    assert resume_command(argv) == "python pretrain/main.py --max_steps 9 --resume auto"


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def start_two_ranks(setup: dict[str, Path], out_dir: Path, timeout: str) -> tuple[subprocess.Popen, int]:
    proc = start(setup, out_dir, "--devices", "2", "--strategy", "ddp", "--global_batch_size", "8",
                 "--micro_batch_size", "2", "--max_steps", "100000", "--eval_interval", "1000", "--timeout", timeout)
    read_until(proc, "step 2/")
    (rank_1,) = children(proc.pid)  # Fabric starts rank 1 as a child of rank 0
    return proc, rank_1


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_stopped_rank_ends_the_other_after_timeout_with_a_message(tiny_setup, tmp_path):
    # --timeout also bounds the start-up rendezvous: 20 s leaves room for rank 0's imports on a busy machine (10 s
    # did not, with a load of 5 on 2 cores)
    proc, rank_1 = start_two_ranks(tiny_setup, tmp_path / "stuck", "20")
    try:
        os.kill(rank_1, signal.SIGSTOP)
        stopped_at = time.monotonic()
        proc.wait(timeout=60)
        elapsed = time.monotonic() - stopped_at
    finally:
        os.kill(rank_1, signal.SIGKILL)  # it holds the pipes open
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 1, stderr[-3000:]
    assert 20 <= elapsed < 20 + 6, elapsed
    message = " ".join(stderr.split())
    assert "Rank 0 of 2 waited for the other processes" in message and "rank 1 stopped answering" in message
    assert "--timeout (20 s)" in message and "--resume auto" in message and "Traceback" not in stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("signals", [1, 2])
def test_sigterm_ends_a_rank_blocked_in_a_collective(tiny_setup, tmp_path, signals):
    """The handler cannot run while the main thread waits inside gloo: the watchdog ends the process STUCK_AFTER_S
    after a signal, or about a second after a second one."""
    from lit_model.core.errors import STUCK_AFTER_S

    proc, rank_1 = start_two_ranks(tiny_setup, tmp_path / "blocked", "600")
    try:
        os.kill(rank_1, signal.SIGSTOP)
        time.sleep(1)  # rank 0 reaches the next collective and waits for rank 1 there
        proc.send_signal(signal.SIGTERM)
        if signals == 2:
            time.sleep(1)
            proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        proc.wait(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        os.kill(rank_1, signal.SIGKILL)  # it holds the pipes open
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    expected = STUCK_AFTER_S if signals == 1 else 1
    assert expected - 0.5 <= elapsed < expected + 4, elapsed
    assert "rank 0: stopped by SIGTERM, but the process was blocked" in stderr and "Traceback" not in stderr
