"""--optimizer_in_backward and the lean optimizers (GaLore, APOLLO, AdamMini, AdaLomo, torchao's AdamW4bit and
AdamWFp8): the same update as the ordinary step, less memory measured and planned, checkpoints that round-trip
(torch.load with weights_only=True), a rehearsal that changes nothing, and the combinations they refuse."""

from __future__ import annotations

import io
import math
import shutil

import pytest
import torch

from lit_model import GPT, Config
from lit_model.core.errors import UsageError
from lit_model.plan.training import plan_training
from lit_model.plan.closed_form import model_bytes, optimizer_state_bytes as planned_state_bytes
from lit_model.run import resolve_run
from lit_model.train.args import TrainArgs, check_args
from lit_model.train.optimizers import build_optimizer, lr_at, needs_create_graph, optimizer_state_bytes, set_lr
from lit_model.methods.objective import CausalLM, mean_loss
from test_pretrain import losses, pretrain

TINY = dict(name="t", block_size=64, vocab_size=512, n_layer=2, n_embd=64, n_head=4, n_query_groups=2, intermediate_size=128)
RANK = 16  # below the tiny model's matrix sides (64, 128), so GaLore and APOLLO project every block matrix
LEAN = ["GaLore", "APOLLO", "AdamMini", "AdaLomo", pytest.param("AdamW4bit", marks=pytest.mark.slow),
        pytest.param("AdamWFp8", marks=pytest.mark.slow)]  # torchao compiles its step per tensor shape (seconds)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # torchao's compile warnings


def tiny_model(**overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**{**TINY, **overrides}))
    model.init_weights()
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(step))
    return ids, ids.roll(-1, 1)


def train(model: GPT, optimizer, steps: range, repeat: bool = False) -> list[float]:
    """The fit loop's order: the step's learning rate (warmup, then cosine: a new rate every step) before
    backward, then step() and zero_grad(). Random tokens, a new batch each step (``repeat``: the first again,
    which the model can learn)."""
    result = []
    for step in steps:
        set_lr(optimizer, lr_at(step, 1e-2, 2, 10, 1e-3))
        ids, targets = batch(0 if repeat else step)
        loss = mean_loss(CausalLM(), model, (ids, targets))
        result.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return result


def train_args(**overrides) -> TrainArgs:
    fields = dict(precision="32-true", micro_batch_size=4, global_batch_size=4, override_max_seq_length=64,
                  optimizer="AdamW", optimizer_rank=RANK, grad_clip=0.0, max_steps=1, loss_chunk_size=0)
    return TrainArgs(**{**fields, **overrides})


def plan(**overrides):
    return plan_training(Config(**TINY), train_args(**overrides), device_type="cpu", engine="trace", suggest=False,
                         detect=False)


# ---- --optimizer_in_backward -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["AdamW", "SGD", "GaLore"])
@pytest.mark.parametrize("tied", [False, True])
def test_in_backward_gives_the_parameters_of_the_ordinary_step(name, tied):
    ordinary, in_backward = tiny_model(tie_embeddings=tied), tiny_model(tie_embeddings=tied)
    train(ordinary, build_optimizer(ordinary, name, 1e-2, rank=RANK), range(4))
    train(in_backward, build_optimizer(in_backward, name, 1e-2, rank=RANK, in_backward=True), range(4))
    for (key, expected), actual in zip(ordinary.state_dict().items(), in_backward.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=key)
    assert all(p.grad is None for p in in_backward.parameters())


def live_gradient_high_water(model: GPT, optimizer) -> int:
    """Bytes of the gradients alive when each new one arrives (before it is accumulated), at most, over a step."""
    params = [p for p in model.parameters() if p.requires_grad]
    high = [0]

    def arrived(grad: torch.Tensor) -> None:
        alive = sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)
        high[0] = max(high[0], alive + grad.numel() * grad.element_size())

    handles = [p.register_hook(arrived) for p in params]
    train(model, optimizer, range(1))
    for handle in handles:
        handle.remove()
    return high[0]


def test_in_backward_frees_each_gradient_measured_and_planned():
    largest = max(p.numel() * 4 for p in tiny_model().parameters())
    everything = sum(p.numel() * 4 for p in tiny_model().parameters())
    model = tiny_model()
    ordinary = live_gradient_high_water(model, build_optimizer(model, "AdamW", 1e-2))
    model = tiny_model()
    in_backward = live_gradient_high_water(model, build_optimizer(model, "AdamW", 1e-2, in_backward=True))
    assert ordinary == everything and in_backward == largest  # measured: all gradients at once vs one at a time

    # planned: the trace runs the same hooks, so it sees the gradients freed as they go (a short sequence, so that
    # the peak is in backward, where the gradients are, not at the logits)
    short = dict(micro_batch_size=1, global_batch_size=1, override_max_seq_length=8, loss_chunk_size=128)
    planned_ordinary = plan(**short).phase_categories["train_step"]
    planned = plan(optimizer_in_backward=True, **short).phase_categories["train_step"]
    assert planned_ordinary["gradients"] >= everything - largest and planned["gradients"] <= largest
    assert planned["optimizer_state"] == planned_ordinary["optimizer_state"]
    assert sum(planned.values()) < sum(planned_ordinary.values())


def test_in_backward_state_round_trips():
    """save -> torch.load(weights_only=True) -> load into a fresh model and optimizer gives the same next step."""
    model = tiny_model()
    optimizer = build_optimizer(model, "AdamW", 1e-2, in_backward=True)
    train(model, optimizer, range(2))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert len(saved["optimizer"]["param_groups"]) == len(list(model.parameters()))  # torch's format, one group each
    resumed = tiny_model()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = build_optimizer(resumed, "AdamW", 1e-2, in_backward=True)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    train(model, optimizer, range(2, 4))
    train(resumed, resumed_optimizer, range(2, 4))  # the loaded state must be the one the hooks step
    for expected, actual in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("flags, match", [
    (dict(grad_clip=1.0), "add --grad_clip 0"),
    (dict(optimizer="Sophia"), "second time"),
    (dict(optimizer="AdamMini"), "whole model"),
    (dict(optimizer="AdaLomo"), "by itself"),
])
def test_in_backward_refuses_flags(flags, match):
    with pytest.raises(UsageError, match=match):
        check_args(train_args(optimizer_in_backward=True, max_steps=1, **flags))


@pytest.mark.parametrize("optimizer, in_backward", [("AdamW", True), ("AdaLomo", False)])
def test_grad_clip_default_gives_way_to_a_step_in_backward(optimizer, in_backward, capsys):
    """--grad_clip's default (1.0) gives way, with a note, where the optimizer steps inside backward; one the user
    gave is refused (test_in_backward_refuses_flags); other runs keep clipping at 1.0."""
    args = train_args(optimizer=optimizer, optimizer_in_backward=in_backward, grad_clip=None)
    check_args(args)
    assert "the gradients are not clipped" in capsys.readouterr().err
    assert resolve_run(args, Config(**TINY), device_type="cpu").grad_clip == 0.0
    plain = train_args(grad_clip=None)
    check_args(plain)
    assert "clipped" not in capsys.readouterr().err
    assert resolve_run(plain, Config(**TINY), device_type="cpu").grad_clip == 1.0


@pytest.mark.parametrize("flags, match", [
    (dict(micro_batch_size=2), "cannot be accumulated"),
    (dict(micro_batch_size="auto"), "cannot be accumulated"),
    (dict(devices=2, global_batch_size=8), "one device"),
    (dict(cpu_offload=True), "one device"),
])
def test_in_backward_refuses_runs(flags, match):
    with pytest.raises(UsageError, match=match):
        resolve_run(train_args(optimizer_in_backward=True, **flags), Config(**TINY), device_type="cpu")
    resolve_run(train_args(**flags), Config(**TINY), device_type="cpu")  # fine without it


def test_plan_suggests_the_in_backward_step_and_lean_optimizers():
    """Llama-2-7B full training in bf16 (55 GB) on a 48 GB GPU: AdamW8bit, AdamW4bit, GaLore and the step in backward
    (with --grad_clip 0) are among the cheapest fixes; with gradient accumulation the step in backward is not."""
    llama = Config.from_name("Llama-2-7b-hf")
    settings = dict(precision="bf16-true", override_max_seq_length=2048, grad_clip=1.0)
    flags = [" ".join(s.flags) for s in plan_training(llama, train_args(micro_batch_size=1, global_batch_size=1, **settings),
                                                         device_memory="48GB", engine="analytic").suggestions]
    assert {"--optimizer AdamW4bit", "--optimizer GaLore"} <= set(flags)
    assert any("--optimizer_in_backward --grad_clip 0.0" in f for f in flags), flags
    accumulating = plan_training(llama, train_args(micro_batch_size=1, global_batch_size=2, **settings),
                                 device_memory="48GB", engine="analytic")
    assert accumulating.suggestions and not any("in_backward" in " ".join(s.flags) for s in accumulating.suggestions)


def test_in_backward_refuses_a_hessian_class_path():
    with pytest.raises(UsageError, match="second time"):
        build_optimizer(tiny_model(), "pytorch_optimizer.SophiaH", 1e-2, in_backward=True)


# ---- the rehearsal ---------------------------------------------------------------------------------------
def fabric_step(name: str, in_backward: bool):
    from lightning.fabric import Fabric

    from lit_model.train.step import TrainStep

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = tiny_model()
    model, optimizer = fabric.setup(model, build_optimizer(model, name, 1e-2, rank=RANK, in_backward=in_backward))
    return fabric, model, optimizer, TrainStep(fabric, model, optimizer, CausalLM(differentiable_twice=needs_create_graph(optimizer)), 4,
                                                True, lambda *a: "report")


@pytest.mark.parametrize("name, in_backward", [("AdamW", True), ("GaLore", False), ("APOLLO", False),
                                                ("AdamMini", False), ("AdaLomo", False)])
@pytest.mark.parametrize("fresh", [True, False])
def test_rehearsal_changes_nothing(tmp_path, name, in_backward, fresh):
    from lit_model.train.loop import rehearse

    fabric, model, optimizer, step = fabric_step(name, in_backward)
    # stepped in backward (in_backward, AdaLomo), a step that ran out of memory cannot be redone in smaller micro batches
    assert step.recover == (not in_backward and name != "AdaLomo")
    if not fresh:  # a resumed run: state exists, and the rehearsal must not step it
        train(model, optimizer, range(2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    rehearse(fabric, step, batch(7), [batch(8)], {"model": model, "optimizer": optimizer}, Config(**TINY), tmp_path,
             None, fresh=fresh)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
    after = io.BytesIO()
    torch.save(optimizer.state_dict(), after)
    assert after.getvalue() == buffer.getvalue()  # the state and the param groups, byte for byte


def test_in_backward_out_of_memory_ends_the_run_without_a_split(monkeypatch):
    from lit_model.core.errors import UserError
    from lit_model.train.recovery import SIMULATED_CAP_ENV

    _, model, _, step = fabric_step("AdamW", in_backward=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setenv(SIMULATED_CAP_ENV, "1MB")  # the forward's saved activations pass it
    with pytest.raises(UserError, match="report"):
        step([batch(0)], "at step 1")
    assert step.micro_batch_size == 4  # not halved: the step could not be redone in halves
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # it failed before any backward


# ---- the lean optimizers ---------------------------------------------------------------------------------
def expected_state_bytes(name: str, model: GPT) -> int:
    """What each keeps, from its algorithm (fp32 model): AdamW's two moments (and a step count) per tensor, less
    what each saves."""
    shapes = [p.shape for p in model.parameters()]
    total = 0
    for shape in shapes:
        n = math.prod(shape)
        if name == "AdamW":
            total += 8 * n + 4
        elif name in ("GaLore", "APOLLO"):
            if len(shape) == 2 and min(shape) > RANK and n != 512 * 64:  # the blocks' matrices, not embedding/head
                total += 4 * (2 * RANK * max(shape) + RANK * min(shape)) + (4 if name == "APOLLO" else 0)
            else:
                total += 8 * n
        elif name == "AdaLomo":
            total += 4 * (sum(shape) if len(shape) == 2 else n)
        elif name == "AdamW4bit":
            total += (2 * (n // 2 + 4 * (n // 128) + 4 * 16) if n >= 4096 and n % 128 == 0 else 8 * n) + 4
        elif name == "AdamWFp8":
            total += (2 * (n + 4 * (n // 256)) if n >= 4096 and n % 256 == 0 else 8 * n) + 4
    return total


@pytest.mark.parametrize("name", LEAN)
def test_lean_optimizer_trains_with_less_state(name):
    model = tiny_model()
    optimizer = build_optimizer(model, name, 1e-2, rank=RANK)
    loss = train(model, optimizer, range(8), repeat=True)
    assert loss[-1] < loss[0] - 0.1, loss
    measured = optimizer_state_bytes(optimizer)
    adamw_model = tiny_model()
    adamw = build_optimizer(adamw_model, "AdamW", 1e-2)
    train(adamw_model, adamw, range(1))
    assert optimizer_state_bytes(adamw) == expected_state_bytes("AdamW", adamw_model)
    if name == "AdamMini":  # an fp32 first moment per element; second moments per head / tensor, full for embedding and head
        embedding = 2 * 512 * 64  # untied: embedding and head
        n = sum(p.numel() for p in model.parameters())
        assert 4 * (n + embedding) <= measured <= 4 * (n + embedding) + 64 * len(list(model.parameters()))
    else:
        assert measured == expected_state_bytes(name, model)
    assert measured < optimizer_state_bytes(adamw)

    # --plan: the trace steps the optimizer (or one with its state's sizes) on fake tensors; the evaluation phase
    # holds only the persistent state. The analytic engine (suggestions) is never below it by more than rounding.
    args = dict(optimizer=name, grad_clip=0.0) if name == "AdaLomo" else dict(optimizer=name)
    traced = plan(**args)
    assert traced.engine == "trace"
    assert traced.phase_categories["evaluation"]["optimizer_state"] == pytest.approx(measured, rel=0.01)
    run = resolve_run(train_args(**args), Config(**TINY), device_type="cpu")
    mb = model_bytes(run)
    assert planned_state_bytes(run, mb.trainable_tensors, mb.block_matrices) >= 0.98 * measured


@pytest.mark.parametrize("name", LEAN)
def test_lean_optimizer_state_round_trips(name):
    model = tiny_model()
    optimizer = build_optimizer(model, name, 1e-2, rank=RANK)
    train(model, optimizer, range(2))
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # GaLore's projector objects are allowed explicitly
    resumed = tiny_model()
    resumed.load_state_dict(saved["model"])
    resumed_optimizer = build_optimizer(resumed, name, 1e-2, rank=RANK)
    resumed_optimizer.load_state_dict(saved["optimizer"])
    expected, actual = train(model, optimizer, range(2, 4)), train(resumed, resumed_optimizer, range(2, 4))
    assert actual == expected
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)


def test_lean_optimizers_refuse_fsdp():
    with pytest.raises(UsageError, match="whole matrices"):
        resolve_run(train_args(optimizer="GaLore", cpu_offload=True), Config(**TINY), device_type="cpu")
    for name in ("AdamW8bit", "PagedAdamW8bit"):  # bitsandbytes' kernels take plain tensors, not DTensor shards
        with pytest.raises(UsageError, match="use --optimizer AdamW4bit"):
            resolve_run(train_args(optimizer=name, cpu_offload=True), Config(**TINY), device_type="cpu")


def test_adamw_fp8_names_the_fix_on_an_old_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(UsageError, match="AdamW4bit"):
        build_optimizer(tiny_model(), "AdamWFp8", 1e-2, device_type="cuda")


# ---- the scripts ---------------------------------------------------------------------------------------
@pytest.mark.slow
def test_pretrain_in_backward_matches_and_resumes_exactly(tiny_setup, tmp_path):
    flags = ("--micro_batch_size", "8", "--save_interval", "2", "--keep_last", "10")
    ordinary = pretrain(tiny_setup, tmp_path / "ordinary", *flags, "--grad_clip", "0")
    assert ordinary.returncode == 0, ordinary.stderr
    full = tmp_path / "full"
    proc = pretrain(tiny_setup, full, *flags, "--optimizer_in_backward")  # --grad_clip's default gives way, noted
    assert proc.returncode == 0, proc.stderr
    assert "Rehearsal passed" in proc.stdout and "the gradients are not clipped" in proc.stderr
    assert losses(full) == losses(tmp_path / "ordinary")  # the same update, to the 4 printed decimals
    interrupted = tmp_path / "interrupted"
    shutil.copytree(full, interrupted)
    for path in ("checkpoints/step-00000004", "checkpoints/step-00000006", "final"):
        shutil.rmtree(interrupted / path)
    (interrupted / "summary.json").unlink()
    proc = pretrain(tiny_setup, interrupted, *flags, "--optimizer_in_backward", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "at step 2" in proc.stdout and losses(interrupted) == losses(full)

    refused = pretrain(tiny_setup, tmp_path / "refused", *flags, "--optimizer_in_backward", "--grad_clip", "1")
    assert refused.returncode == 2 and "--grad_clip 0" in refused.stderr and "Traceback" not in refused.stderr
    refused = pretrain(tiny_setup, tmp_path / "refused", "--optimizer_in_backward")  # micro batch 2 of 8
    assert refused.returncode == 2 and "cannot be accumulated" in refused.stderr and "Traceback" not in refused.stderr


@pytest.mark.slow
def test_pretrain_galore_resumes_exactly(tiny_setup, tmp_path):
    flags = ("--optimizer", "GaLore", "--optimizer_rank", "16", "--save_interval", "2", "--keep_last", "10")
    full = tmp_path / "full"
    proc = pretrain(tiny_setup, full, *flags)
    assert proc.returncode == 0, proc.stderr
    interrupted = tmp_path / "interrupted"
    shutil.copytree(full, interrupted)
    for path in ("checkpoints/step-00000006", "final"):
        shutil.rmtree(interrupted / path)
    (interrupted / "summary.json").unlink()
    proc = pretrain(tiny_setup, interrupted, *flags, "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "at step 4" in proc.stdout and losses(interrupted) == losses(full)
