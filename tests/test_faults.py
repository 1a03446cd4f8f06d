"""Fault injection around checkpoints: a save killed or failing midway, a metrics rewrite killed midway, damaged
and truncated checkpoints (with the fallback of --resume auto), one lineage after --overwrite and after an
explicit --resume, a data order that changed, a planted pickle that must not run, and nothing of the user's
replaced without --overwrite."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from conftest import ROOT, read_metrics, run_script, run_script_inprocess
from lit_model import GPT, Config
from lit_model.io.checkpoint import MANIFEST_NAME, WEIGHTS_NAME, lit_state_dict, save_checkpoint_dir
from lit_model.core.errors import UsageError, UserError
from lit_model.train import session
from lit_model.train.args import TrainArgs
from lit_model.run import resolve_run
from lit_model.train.fabric import StateIO, setup_fabric
from lit_model.train.loop import MetricsWriter, Progress
from lit_model.train.resumable import CHECKPOINTS, LINEAGE_NAME, STATE_NAME, lineage, save_resumable, start_lineage
from lit_model.methods.load import load_gpt
from lit_model.methods.objective import CausalLM, mean_loss

CONFIG = Config(name="faults", block_size=16, vocab_size=32, n_layer=1, n_embd=8, n_head=2)


def names(paths: list[Path]) -> list[str]:
    return [p.name for p in paths]


def step(n: int) -> str:
    return f"step-{n:08d}"


@pytest.fixture()
def run(tmp_path):
    """A real single-process Fabric, a tiny model with AdamW state, and a save function for any step."""
    fabric = setup_fabric(resolve_run(TrainArgs(precision="32-true"), CONFIG))
    torch.manual_seed(0)
    model = GPT(CONFIG)
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mean_loss(CausalLM(), model, (torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))).backward()
    optimizer.step()
    progress = Progress()
    args = TrainArgs(out_dir=tmp_path / "out", keep_last=0, seed=7, global_batch_size=8)
    args.out_dir.mkdir()

    def save(n: int, **changes) -> Path:
        progress.step = n
        for name, value in changes.items():
            setattr(args, name, value)
        return save_resumable(fabric, args, {"model": model, "optimizer": optimizer, "run": progress}, CONFIG, n)

    return {"fabric": fabric, "model": model, "optimizer": optimizer, "args": args, "save": save}


def with_args(args: TrainArgs, **changes) -> TrainArgs:
    return TrainArgs(**{**vars(args), **changes})


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_failing_save_leaves_the_last_good_checkpoint_and_no_temporary_directory(run, monkeypatch):
    out = run["args"].out_dir
    run["save"](2)

    def full_disk(self, checkpoint, path, storage_options=None):
        Path(path).write_bytes(b"half a state")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StateIO, "save_checkpoint", full_disk)
    with pytest.raises(UserError, match="is full .* so the resumable checkpoint was not written"):
        run["save"](4)
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == [LINEAGE_NAME, step(2)]
    assert names(lineage(out)) == [step(2)]
    assert start_lineage(with_args(run["args"], resume="auto"), CONFIG) == out / CHECKPOINTS / step(2)


def test_saves_never_stage_through_tmpdir(run, monkeypatch, tmp_path):
    # A $TMPDIR that cannot take a file (missing, full or read-only): the state goes straight into out_dir.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-tmpdir"))
    path = run["save"](2)
    assert sorted(p.name for p in path.iterdir()) == ["data_order.json", MANIFEST_NAME, "model_config.yaml", STATE_NAME]
    saved = torch.load(path / STATE_NAME, weights_only=True)
    torch.testing.assert_close(saved["model"]["embed.weight"], run["model"].embed.weight)
    assert saved["run"]["step"] == 2


def test_lineage_after_overwrite_and_pruning_keeps_the_newest_written(run, capsys):
    out, args = run["args"].out_dir, run["args"]
    for n in (10, 12):  # an older run's checkpoints, with higher step numbers than the new run will reach
        run["save"](n)
    fresh = with_args(args, overwrite=True, keep_last=2)
    assert start_lineage(fresh, CONFIG) is None
    assert f"--overwrite: removed the previous run's checkpoints in {out / CHECKPOINTS} ({step(10)}, {step(12)})" in capsys.readouterr().out
    run["args"].keep_last = 2
    for n in (2, 4, 6):
        run["save"](n)
    assert names(sorted((out / CHECKPOINTS).glob("step-*"))) == [step(4), step(6)]
    assert start_lineage(with_args(args, resume="auto"), CONFIG) == out / CHECKPOINTS / step(6)


def test_an_explicit_resume_abandons_the_later_branch(run, capsys):
    out, args = run["args"].out_dir, run["args"]
    for n in (2, 4, 6, 8, 10, 12):
        run["save"](n)
    assert start_lineage(with_args(args, resume=out / CHECKPOINTS / step(8)), CONFIG) == out / CHECKPOINTS / step(8)
    message = capsys.readouterr().out
    (aside,) = (out / CHECKPOINTS).glob("abandoned-*")
    assert f"moved the checkpoints that do not lead to it ({step(10)}, {step(12)}) to {aside}" in message
    assert names(sorted(aside.iterdir())) == [step(10), step(12)]
    run["save"](9)  # the resumed run saves once, then is killed
    assert names(lineage(out)) == [step(2), step(4), step(6), step(8), step(9)]
    assert start_lineage(with_args(args, resume="auto"), CONFIG) == out / CHECKPOINTS / step(9)


def test_resume_auto_falls_back_past_damaged_checkpoints(run, capsys):
    out, args = run["args"].out_dir, run["args"]
    for n in (2, 4, 6):
        run["save"](n)
    flip_byte(out / CHECKPOINTS / step(6) / STATE_NAME)
    (out / CHECKPOINTS / step(4) / STATE_NAME).write_bytes(b"")  # truncated to nothing
    with pytest.raises(UserError, match=rf"{out / CHECKPOINTS / step(6) / STATE_NAME} is damaged: its SHA-256"):
        start_lineage(with_args(args, resume=out / CHECKPOINTS / step(6)), CONFIG)
    assert start_lineage(with_args(args, resume="auto"), CONFIG) == out / CHECKPOINTS / step(2)
    err = " ".join(capsys.readouterr().err.split())
    assert f"--resume auto skips {step(6)}: {out / CHECKPOINTS / step(6) / STATE_NAME} is damaged: its SHA-256" in err
    assert f"--resume auto skips {step(4)}: {out / CHECKPOINTS / step(4) / STATE_NAME} is damaged: 0 bytes" in err
    assert names(lineage(out)) == [step(2)]
    (model_config := out / CHECKPOINTS / step(2) / "model_config.yaml").write_text("n_layer: [garbled")
    with pytest.raises(UserError, match=rf"none of the checkpoints in {out / CHECKPOINTS} is usable"):
        start_lineage(with_args(args, resume="auto"), CONFIG)
    assert f"{model_config} is damaged" in " ".join(capsys.readouterr().err.split())


def test_resume_loads_with_weights_only_and_refuses_another_data_order(run, tmp_path):
    fabric, args = run["fabric"], run["args"]
    run["save"](2, data_path=tmp_path / "corpus")
    model, progress = GPT(CONFIG), Progress()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for change, flag in (({"seed": 8}, "--seed 8 (the checkpoint's run: 7)"),
                         ({"global_batch_size": 16}, "--global_batch_size 16 (the checkpoint's run: 8)"),
                         ({"data_path": tmp_path / "other"}, f"--data_path {tmp_path / 'other'} (the checkpoint's run: {tmp_path / 'corpus'})")):
        with pytest.raises(UsageError, match="start over with --overwrite or another --out_dir") as error:
            session.resume_if_asked(fabric, with_args(args, resume="auto", **change), model, optimizer, progress, CONFIG)
        assert flag in str(error.value)
    assert progress.step == 0
    session.resume_if_asked(fabric, with_args(args, resume="auto"), model, optimizer, progress, CONFIG)
    assert progress.step == 2
    torch.testing.assert_close(model.embed.weight, run["model"].embed.weight)
    torch.testing.assert_close(optimizer.state_dict()["state"][0]["exp_avg"], run["optimizer"].state_dict()["state"][0]["exp_avg"])


def test_a_damaged_checkpoint_without_manifest_is_a_message_not_a_traceback(run, capsys):
    args = run["args"]
    path = run["save"](2)
    (path / MANIFEST_NAME).unlink()  # as an older version wrote it
    (path / STATE_NAME).write_bytes((path / STATE_NAME).read_bytes()[:1000])
    model = GPT(CONFIG)
    with pytest.raises(UserError, match=rf"{path / STATE_NAME} could not be loaded \(.+\): it is damaged"):
        session.resume_if_asked(run["fabric"], with_args(args, resume="auto"), model, torch.optim.AdamW(model.parameters()),
                                Progress(), CONFIG)
    assert f"Note: {path} has no {MANIFEST_NAME}" in capsys.readouterr().err


KILL_IN_METRICS_REWRITE = """
import csv, os, signal, sys
from pathlib import Path
from lit_model.train.loop import MetricsWriter
def killed(self, rows):
    for row in rows:
        self.writerow(row)
        os.kill(os.getpid(), signal.SIGKILL)  # after the first row of the rewrite
csv.DictWriter.writerows = killed
MetricsWriter(Path(sys.argv[1]), True, resume_step=2)
"""


@pytest.mark.slow
def test_a_metrics_rewrite_killed_midway_keeps_the_history(tmp_path):
    path = tmp_path / "metrics.csv"
    writer = MetricsWriter(path, True, resume_step=0)
    for n in (1, 2, 3):
        writer.write({"step": n, "tokens": 64 * n, "train_loss": f"{4 - n / 10:.4f}"})
    before = path.read_bytes()
    proc = subprocess.run([sys.executable, "-c", KILL_IN_METRICS_REWRITE, str(path)], cwd=ROOT, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert path.read_bytes() == before
    MetricsWriter(path, True, resume_step=2)  # the next resume rewrites it whole
    assert [row["step"] for row in read_metrics(tmp_path)] == ["1", "2"]


KILL_IN_SAVE = """
import os, runpy, signal, sys, tempfile
from lit_model.train.fabric import StateIO
tempfile.tempdir = sys.argv[1]  # a $TMPDIR that cannot take a file: nothing may be staged there
def save(self, checkpoint, path, storage_options=None):
    if "step-00000004" in str(path):
        open(path, "wb").write(b"the first bytes of a state")
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, checkpoint, path, storage_options)
original, StateIO.save_checkpoint = StateIO.save_checkpoint, save
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_run_killed_while_saving_resumes_from_the_last_good_checkpoint(tiny_setup, tmp_path):
    out = tmp_path / "run"
    args = ["--model_config", tiny_setup["config"], "--tokenizer_dir", tiny_setup["tokenizer"], "--data_path",
            tiny_setup["data"], "--out_dir", out, "--micro_batch_size", "2", "--global_batch_size", "8", "--eval_iters",
            "1", "--max_steps", "6", "--log_interval", "1", "--eval_interval", "100", "--save_interval", "2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIT_MODEL_CACHE": str(tiny_setup["root"] / "cache")}
    killed = subprocess.run([sys.executable, "-c", KILL_IN_SAVE, str(tmp_path / "no-tmpdir"), str(ROOT / "pretrain/main.py"),
                             *map(str, args)], cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert names(lineage(out)) == [step(2)] and (out / CHECKPOINTS / f".{step(4)}.tmp").is_dir()
    resumed = run_script("pretrain/main.py", *args, "--resume", "auto", cache=tiny_setup["root"] / "cache")
    assert resumed.returncode == 0, resumed.stderr
    assert f"Resumed from {out / CHECKPOINTS / step(2)} at step 2" in resumed.stdout
    assert names(lineage(out)) == [step(4), step(6)]
    assert sorted(p.name for p in (out / CHECKPOINTS).iterdir()) == [LINEAGE_NAME, step(4), step(6)]
    assert [int(r["step"]) for r in read_metrics(out)] == [1, 2, 3, 4, 5, 6]


class Planted:
    """A pickle that, when loaded, creates a marker file (what a planted shell command would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.multiprocess
def test_a_planted_pickle_in_a_sharded_checkpoint_never_runs(tiny_setup, tmp_path):
    out, marker = tmp_path / "fsdp", tmp_path / "marker"
    args = ["--model_config", tiny_setup["config"], "--tokenizer_dir", tiny_setup["tokenizer"], "--data_path",
            tiny_setup["data"], "--out_dir", out, "--micro_batch_size", "2", "--global_batch_size", "8", "--eval_iters",
            "1", "--log_interval", "1", "--eval_interval", "100", "--save_interval", "2", "--devices", "2",
            "--strategy", "fsdp", "--rehearse", "false"]
    cache = tiny_setup["root"] / "cache"
    first = run_script("pretrain/main.py", *args, "--max_steps", "2", cache=cache)
    assert first.returncode == 0, first.stderr
    resumed = run_script("pretrain/main.py", *args, "--max_steps", "4", "--resume", "auto", cache=cache)
    assert resumed.returncode == 0 and f"Resumed from {out / CHECKPOINTS / step(2)} at step 2" in resumed.stdout, resumed.stderr
    state = out / CHECKPOINTS / step(4) / STATE_NAME
    assert state.is_dir() and (state / ".metadata").is_file() and (state.parent / MANIFEST_NAME).is_file()
    planted = pickle.dumps(Planted(marker))  # padded to the original size: only the hash can tell
    (state / ".metadata").write_bytes(planted + b"\0" * ((state / ".metadata").stat().st_size - len(planted)))
    proc = run_script("pretrain/main.py", *args, "--max_steps", "6", "--resume", state.parent, cache=cache)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{state / '.metadata'} is damaged: its SHA-256 differs" in " ".join(proc.stderr.split())
    (state.parent / MANIFEST_NAME).unlink()  # no manifest: a sharded state is refused rather than unpickled
    proc = run_script("pretrain/main.py", *args, "--max_steps", "6", "--resume", state.parent, cache=cache)
    assert proc.returncode == 1 and "sharded checkpoint without manifest.json" in " ".join(proc.stderr.split()), proc.stderr
    assert not marker.exists()


def test_generate_refuses_a_damaged_final_checkpoint(tiny_setup, tmp_path, monkeypatch):
    config = Config.from_file(tiny_setup["config"])
    final = save_checkpoint_dir(lit_state_dict(GPT(config), config), config, tmp_path / "final", tiny_setup["tokenizer"])
    flip_byte(final / WEIGHTS_NAME)
    proc = run_script_inprocess("generate/base.py", "--checkpoint_dir", final, "--prompt", "def f():",
                                "--max_new_tokens", "4", monkeypatch=monkeypatch)
    assert proc.returncode == 1 and proc.stdout == "", proc.stderr
    assert f"{final / WEIGHTS_NAME} is damaged: its SHA-256 differs" in " ".join(proc.stderr.split())


def test_lora_merge_replaces_a_non_empty_out_dir_only_with_overwrite(tmp_path, capsys):
    from safetensors.torch import save_file

    from lit_model.core.errors import run_cli
    from lit_model.methods.lora import LORA_WEIGHTS, LoRAConfig, apply_lora
    from lit_model.methods.lora import cli as lora_cli
    from lit_model.recipes.finetune import gather_trainable

    model = GPT(CONFIG)
    model.init_weights()
    save_checkpoint_dir(lit_state_dict(model, CONFIG), CONFIG, tmp_path / "ckpt")
    lora = LoRAConfig(r=2, alpha=4)
    apply_lora(model, lora)
    save_file(gather_trainable(model), str(tmp_path / "ckpt" / LORA_WEIGHTS))
    lora.save(tmp_path / "ckpt")
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    command = ["merge", "--checkpoint_dir", str(tmp_path / "ckpt"), "--out_dir", str(users)]
    with pytest.raises(SystemExit) as exit:
        run_cli(lora_cli, command)
    assert exit.value.code == 1 and "--overwrite" in capsys.readouterr().err
    assert [p.name for p in users.iterdir()] == ["thesis.tex"] and (users / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "users"]
    run_cli(lora_cli, [*command, "--overwrite"])
    assert not (users / "thesis.tex").exists() and LoRAConfig.from_dir(users).merged
    load_gpt(users)
