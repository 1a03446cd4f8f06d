"""Out-of-memory handling in the fit loop: in-step recovery (the same update as the unsplit step), the report
when nothing is left to split, the rehearsal (changes nothing) and --micro_batch_size auto (keeps the global
batch). Out-of-memory is caused on the CPU with the simulated memory cap (lit_model/train/recovery.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import read_metrics
from lit_model import GPT, Config
from lit_model.core.errors import UserError
from lit_model.methods.objective import CausalLM
from lit_model.train.recovery import SIMULATED_CAP_ENV
from test_pretrain import pretrain

TINY = dict(name="t", block_size=64, vocab_size=512, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128)
# The tiny model's parameters: 0.57 MB, gradients 0.56 MB, AdamW state 1.12 MB, saved activations 0.53 MB
# per window of 64 tokens. A fresh step of 2 micro batches of 4 passes 3 MB in its second forward; of 4 of 2 it does not.
CAP = "3MB"


@pytest.fixture()
def fabric():
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric.seed_everything(0)
    return fabric


def make_step(fabric, micro_batch_size: int, recover: bool = True, optimizer_name: str = "AdamW"):
    from lit_model.train.step import TrainStep
    from lit_model.train.optimizers import build_optimizer, needs_create_graph

    torch.manual_seed(0)
    model = GPT(Config(**TINY))
    model.init_weights()
    model, optimizer = fabric.setup(model, build_optimizer(model, optimizer_name, learning_rate=1e-2, weight_decay=0.1, device_type="cpu"))
    reports = []

    def report(micro: int, where: str, message: str) -> str:
        reports.append((micro, where, message))
        return f"report {micro} {where}"

    return model, optimizer, TrainStep(fabric, model, optimizer, CausalLM(differentiable_twice=needs_create_graph(optimizer)),
                                       micro_batch_size, recover, report), reports


def step_batches(masked: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two micro batches of 4; with ``masked``, each sample has a different number of target tokens."""
    generator = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 512, (4, 64), generator=generator)
        targets = ids.roll(-1, 1)
        if masked:
            for row in range(4):
                targets[row, : 10 + 12 * row] = -100
        batches.append((ids, targets))
    return batches


@pytest.mark.parametrize("masked", [False, True])
def test_recovery_gives_the_same_gradients_as_the_unsplit_step(fabric, monkeypatch, masked):
    model, _, step, _ = make_step(fabric, 4)
    loss, _, tokens, _ = step(step_batches(masked), "at step 1")
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}

    monkeypatch.setenv(SIMULATED_CAP_ENV, CAP)
    model, _, step, reports = make_step(fabric, 4)
    split_loss, _, split_tokens, _ = step(step_batches(masked), "at step 1")
    assert step.micro_batch_size == 2 and not reports  # split once, kept
    assert split_tokens == tokens and torch.allclose(split_loss, loss, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


def test_report_when_even_one_sample_does_not_fit(fabric, monkeypatch):
    monkeypatch.setenv(SIMULATED_CAP_ENV, "100KB")
    model, _, step, reports = make_step(fabric, 4)
    with pytest.raises(UserError, match="report 1 at step 3"):
        step(step_batches(False), "at step 3")
    assert [micro for micro, _, _ in reports] == [1] and "Simulated out of memory" in reports[0][2]
    assert all(p.grad is None for p in model.parameters())  # the failed step's memory was freed

    monkeypatch.setenv(SIMULATED_CAP_ENV, CAP)
    _, _, step, reports = make_step(fabric, 4, recover=False)
    with pytest.raises(UserError):
        step(step_batches(False), "at step 1")
    assert reports[0][0] == 4  # --oom_recovery false: no split


def test_out_of_memory_report_names_categories_and_fixes(tmp_path):
    from lit_model.train.args import TrainArgs
    from lit_model.plan.oom_report import out_of_memory_report

    from lit_model.run import resolve_run

    args = TrainArgs(micro_batch_size=1, global_batch_size=8, device_memory="24GB", out_dir=tmp_path)
    (tmp_path / "checkpoints" / "step-6").mkdir(parents=True)  # the report cites only a checkpoint that exists
    run = resolve_run(args, Config.from_name("lit-model-40m"), device_type="cpu")
    text = out_of_memory_report(run, args, torch.device("cpu"), "at step 7", "CUDA out of memory")
    assert "Out of memory at step 7 even with micro batch 1 (CUDA out of memory)" in text
    assert "optimizer_state" in text and "parameters" in text
    assert "1) --" in text and "3) --" in text and "predicted peak" in text and "--resume auto" in text


@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "Sophia", "Adafactor"])
def test_rehearsal_changes_nothing(fabric, tmp_path, name):
    from lit_model.train.loop import rehearse

    model, optimizer, step, _ = make_step(fabric, 4, optimizer_name=name)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    batches = step_batches(False)
    state = {"model": model, "optimizer": optimizer}
    rehearse(fabric, step, batches[0], batches, state, Config(**TINY), tmp_path, None, fresh=True)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not optimizer.optimizer.state and all(p.grad is None for p in model.parameters())
    assert [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] == groups
    assert not any((tmp_path / "checkpoints").iterdir())  # the rehearsal's checkpoint was removed


def test_the_rehearsal_refuses_a_disk_without_room_for_final(fabric, tmp_path, monkeypatch):
    """A Llama-2-7B LoRA run on a GPU machine trained, then failed its final save on a full disk: the rehearsal checks
    the room for the weights first, before any training."""
    from lit_model.core.errors import UserError
    from lit_model.train import loop

    model, optimizer, step, _ = make_step(fabric, 4)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    batches = step_batches(False)
    state = {"model": model, "optimizer": optimizer}
    monkeypatch.setattr(loop, "free_disk_bytes", lambda path: weights - 1)
    with pytest.raises(UserError, match="needs at least .* nothing was trained yet"):
        loop.rehearse(fabric, step, batches[0], batches, state, Config(**TINY), tmp_path, None, fresh=True)
    assert not (tmp_path / "checkpoints").exists()
    monkeypatch.setattr(loop, "free_disk_bytes", lambda path: weights)
    loop.rehearse(fabric, step, batches[0], batches, state, Config(**TINY), tmp_path, None, fresh=True)


def test_pretrain_recovers_with_the_same_losses(tiny_setup, tmp_path, monkeypatch):
    # SGD: its momentum (0.56 MB) is small enough that micro batches of 2 fit next to it where 4 do not fit at all.
    reference = pretrain(tiny_setup, tmp_path / "reference", "--optimizer", "SGD")  # micro batch 2, global 8
    assert reference.returncode == 0, reference.stderr
    # 3.1 MB: the rehearsal's batch of 8 windows fails whole and in 2 micro batches of 4 (the second forward holds
    # gradients); micro batches of 2 fit, also next to the optimizer state.
    monkeypatch.setenv(SIMULATED_CAP_ENV, "3.1MB")
    proc = pretrain(tiny_setup, tmp_path / "split", "--micro_batch_size", "8", "--optimizer", "SGD")
    assert proc.returncode == 0, proc.stderr
    assert "Out of memory in the rehearsal step on the longest batch with micro batch 8" in proc.stdout
    assert "with micro batch 4" in proc.stdout and "micro batches of 2" in proc.stdout and "at step" not in proc.stdout
    assert "Rehearsal passed" in proc.stdout
    ref_rows, rows = read_metrics(tmp_path / "reference"), read_metrics(tmp_path / "split")
    assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref_rows]  # the global batch is unchanged
    for ref, row in zip(ref_rows, rows):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=2e-4)


def test_pretrain_out_of_memory_report_and_exit(tiny_setup, tmp_path, monkeypatch):
    monkeypatch.setenv(SIMULATED_CAP_ENV, "100KB")
    proc = pretrain(tiny_setup, tmp_path / "run")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    message = " ".join(proc.stderr.split())
    assert "Out of memory in the rehearsal step" in message and "Fixes, cheapest first: 1) --" in message, message
    assert "Out of memory in the rehearsal step on the longest batch with micro batch 2" in proc.stdout


def test_the_reported_fixes_fit_when_applied(tiny_setup, tmp_path, monkeypatch):
    import re

    # micro batch 1 holds 3.0 MB once the optimizer state exists: step 2 cannot fit 2.8 MB
    monkeypatch.setenv(SIMULATED_CAP_ENV, "2.8MB")
    proc = pretrain(tiny_setup, tmp_path / "run")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 1 and "Out of memory at step 2 even with micro batch 1" in message, message
    fixes = re.findall(r"\d\) ((?:--\S+(?: (?!--)\S+)? ?)+) \(predicted peak", message)
    # on the CPU the 8-bit and 4-bit optimizers' libraries outweigh what they save on a model this small
    assert fixes, message
    for number, fix in enumerate(fixes):
        proc = pretrain(tiny_setup, tmp_path / f"fix{number}", *fix.split())
        assert proc.returncode == 0, f"{fix}: {proc.stderr}"
        assert "Out of memory" not in proc.stdout, fix


def test_plan_plot(tiny_setup, tmp_path):
    proc = pretrain(tiny_setup, tmp_path / "run", "--plan", "json", "--plan_plot", tmp_path / "plan.png")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["peak_bytes"] > 0 and (tmp_path / "plan.png").stat().st_size > 1000
    assert not (tmp_path / "run").exists()  # a plan trains nothing


def test_rehearsal_keeps_the_losses(tiny_setup, tmp_path):
    with_rehearsal = pretrain(tiny_setup, tmp_path / "a")
    without = pretrain(tiny_setup, tmp_path / "b", "--rehearse", "false")
    assert with_rehearsal.returncode == 0 and without.returncode == 0, with_rehearsal.stderr + without.stderr
    assert "Rehearsal passed" in with_rehearsal.stdout and "Rehearsal" not in without.stdout
    assert read_metrics(tmp_path / "a") != [] and [r["train_loss"] for r in read_metrics(tmp_path / "a")] == [
        r["train_loss"] for r in read_metrics(tmp_path / "b")]


def test_auto_micro_batch_size_keeps_the_global_batch(tiny_setup, tmp_path, monkeypatch):
    from lit_model.plan.search import max_micro_batch_size
    from lit_model.run import resolve_run
    from lit_model.train.args import TrainArgs

    from lit_model.plan.training import plan_training

    # the script's cache: the CPU runtime it plans with is the one measured and kept there (plan/overhead.py)
    monkeypatch.setenv("LIT_MODEL_CACHE", str(tiny_setup["root"] / "cache"))
    config = Config.from_file(tiny_setup["config"])
    peaks = [plan_training(config, TrainArgs(micro_batch_size=m, global_batch_size=8), device_type="cpu", engine="analytic",
                           suggest=False, detect=False).peak_bytes for m in (2, 4)]
    budget = str(int(sum(peaks) / 2 / 0.9))  # between micro batch 2 and 4, after the 10 % margin
    settings = TrainArgs(micro_batch_size="auto", global_batch_size=8)
    expected = max_micro_batch_size(resolve_run(settings, config, device_type="cpu"), budget)
    assert expected == 2
    proc = pretrain(tiny_setup, tmp_path / "run", "--micro_batch_size", "auto", "--device_memory", budget)
    assert proc.returncode == 0, proc.stderr
    assert f"--micro_batch_size auto: {expected} " in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["micro_batch_size"] == expected and summary["global_batch_size"] == 8
    assert summary["tokens"] == 6 * 8 * 64


@pytest.mark.multiprocess
@pytest.mark.slow
def test_two_processes_recover_together(tiny_setup, tmp_path, monkeypatch):
    reference = pretrain(tiny_setup, tmp_path / "reference", "--devices", "2", "--strategy", "ddp")
    assert reference.returncode == 0, reference.stderr
    monkeypatch.setenv(SIMULATED_CAP_ENV, "3.6MB")  # micro batch 4 fits until the optimizer state exists
    proc = pretrain(tiny_setup, tmp_path / "split", "--devices", "2", "--strategy", "ddp", "--micro_batch_size", "4",
                    "--rehearse", "false")
    assert proc.returncode == 0, proc.stderr
    assert "Out of memory at step 2 with micro batch 4" in proc.stdout
    for ref, row in zip(read_metrics(tmp_path / "reference"), read_metrics(tmp_path / "split")):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=2e-4)

    monkeypatch.setenv(SIMULATED_CAP_ENV, "100KB")  # nothing fits: every rank stops with the report, none hangs
    proc = pretrain(tiny_setup, tmp_path / "none", "--devices", "2", "--strategy", "ddp", timeout=120)
    assert proc.returncode == 1 and "Fixes, cheapest first" in " ".join(proc.stderr.split())


@pytest.mark.multiprocess
@pytest.mark.slow
def test_auto_micro_batch_size_with_fsdp_on_two_processes(tiny_setup, tmp_path, monkeypatch):
    from lit_model.plan.search import max_micro_batch_size
    from lit_model.run import resolve_run
    from lit_model.train.args import TrainArgs

    config = Config.from_file(tiny_setup["config"])
    settings = TrainArgs(micro_batch_size="auto", global_batch_size=8, devices=2, strategy="fsdp")
    expected = max_micro_batch_size(resolve_run(settings, config, device_type="cpu"), "1GB")
    monkeypatch.setenv(SIMULATED_CAP_ENV, "3MB")  # and the rehearsal confirms it, halving what does not fit
    proc = pretrain(tiny_setup, tmp_path / "run", "--devices", "2", "--strategy", "fsdp", "--micro_batch_size", "auto",
                    "--device_memory", "1GB")
    assert proc.returncode == 0, proc.stderr
    assert f"--micro_batch_size auto: {expected} " in proc.stdout and "Rehearsal passed" in proc.stdout
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["global_batch_size"] == 8 and summary["tokens"] == 6 * 8 * 64
    assert summary["micro_batch_size"] <= expected
