import math

import pytest
import torch
from torch import nn

from lit_model.core.errors import UsageError
from lit_model.train.optimizers import (
    OPTIMIZERS,
    build_optimizer,
    hessian_step,
    lr_at,
    needs_create_graph,
    optimizer_state_bytes,
    set_lr,
)

# Learning rates that suit each optimizer's update scale on the toy problem (Lion's sign update is large,
# SophiaH's update is clipped to lr * p with p = 0.01).
LEARNING_RATES = {"Lion": 1e-3, "Sophia": 1e-1, "torch.optim.RMSprop": 1e-3, "pytorch_optimizer.CAME": 1e-3}


def mlp(hidden: int = 512) -> nn.Module:
    # hidden=512 makes the first weight 4096 elements, so bitsandbytes keeps 8-bit state for it
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.LayerNorm(hidden), nn.Linear(hidden, 1))


def regression_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=generator)
    return x, (x @ torch.randn(8, 1, generator=generator)).tanh()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    x, y = regression_data()
    losses = []
    for _ in range(steps):
        loss = ((model(x) - y) ** 2).mean()
        losses.append(loss.item())
        loss.backward(create_graph=needs_create_graph(optimizer, this_step=True))
        hessian_step(optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


# torchao's optimizers compile their step for each tensor shape first (seconds each on the CPU)
TORCHAO = ("AdamW4bit", "AdamWFp8")


@pytest.mark.filterwarnings("ignore::UserWarning")  # create_graph reference-cycle and bnb paged-on-CPU warnings
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in TORCHAO else n
                                  for n in (*OPTIMIZERS, "torch.optim.RMSprop", "pytorch_optimizer.CAME")])
def test_every_optimizer_lowers_the_loss(name: str) -> None:
    model = mlp()
    optimizer = build_optimizer(model, name, LEARNING_RATES.get(name, 1e-2))
    losses = train(model, optimizer, steps=15)
    assert all(math.isfinite(loss) for loss in losses)
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_sophia_needs_the_graph_and_estimates_the_hessian() -> None:
    model = mlp(hidden=16)
    optimizer = build_optimizer(model, "Sophia", 1e-1)
    assert type(optimizer).__name__ == "SophiaH" and optimizer.update_period == 10
    assert needs_create_graph(optimizer)
    assert not needs_create_graph(build_optimizer(model, "AdamW", 1e-3))
    # the Hessian is refreshed on steps 0, 10, 20, ...: only those need the double-backward graph
    due = []
    for _ in range(12):
        due.append(needs_create_graph(optimizer, this_step=True))
        train(model, optimizer, steps=1)
    assert due == [True] + [False] * 9 + [True, False]
    hessian_moments = [optimizer.state[p]["hessian_moment"] for p in model.parameters()]
    assert all(moment.abs().sum() > 0 for moment in hessian_moments)

    x, y = regression_data()
    ((model(x) - y) ** 2).mean().backward()
    hessian_step(optimizer)  # step 12 does not refresh the Hessian, so a plain backward is fine
    optimizer.zero_grad(set_to_none=True)
    fresh = build_optimizer(mlp(hidden=16), "Sophia", 1e-1)
    params = [p for group in fresh.param_groups for p in group["params"]]
    sum(p.sum() ** 2 for p in params).backward()  # a refresh step without create_graph
    with pytest.raises(UsageError, match="create_graph=True"):
        hessian_step(fresh)


def test_weight_decay_groups() -> None:
    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = nn.Embedding(10, 4)
            self.frozen = nn.Linear(4, 4)
            self.frozen.requires_grad_(False)
            self.proj = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 10, bias=False)
            self.head.weight = self.embedding.weight  # tied

    model = Tiny()
    optimizer = build_optimizer(model, "AdamW", 1e-3, weight_decay=0.1)
    groups = {group["weight_decay"]: {id(p) for p in group["params"]} for group in optimizer.param_groups}
    assert groups[0.1] == {id(model.embedding.weight), id(model.proj.weight)}
    assert groups[0.0] == {id(model.proj.bias), id(model.norm.weight), id(model.norm.bias)}
    assert sum(len(group["params"]) for group in optimizer.param_groups) == 5  # tied once, frozen excluded


def test_kwargs_override_defaults() -> None:
    optimizer = build_optimizer(mlp(hidden=4), "SGD", 1e-2, kwargs={"momentum": 0.8})
    assert optimizer.param_groups[0]["momentum"] == 0.8 and optimizer.param_groups[0]["nesterov"] is False
    assert build_optimizer(mlp(hidden=4), "SGD", 1e-2).param_groups[0]["momentum"] == 0.9
    lion = build_optimizer(mlp(hidden=4), "Lion", 3e-4)
    assert lion.param_groups[0]["betas"] == (0.9, 0.99) and lion.param_groups[0]["lr"] == 3e-4
    with pytest.raises(UsageError, match="optimizer kwargs"):
        build_optimizer(mlp(hidden=4), "SGD", 1e-2, kwargs={"no_such_option": 1})


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_adamw8bit_state_is_uint8_and_smaller() -> None:
    model = nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 1))  # 8192-element matrix
    states = {}
    for name in ("AdamW", "AdamW8bit", "PagedAdamW8bit"):
        optimizer = build_optimizer(model, name, 1e-3)
        model(torch.randn(4, 128)).sum().backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)
        states[name] = optimizer_state_bytes(optimizer)
        if name != "AdamW":
            state = optimizer.state[model[0].weight]
            assert state["state1"].dtype == torch.uint8 and state["state2"].dtype == torch.uint8
    assert states["AdamW8bit"] < states["AdamW"] / 2 and states["PagedAdamW8bit"] < states["AdamW"] / 2
    n = sum(p.numel() for p in model.parameters())
    assert 2 * 4 * n <= states["AdamW"] <= 2 * 4 * n + 8 * 4  # exp_avg + exp_avg_sq (+ step scalars)


def test_bitsandbytes_unsupported_device_type() -> None:
    with pytest.raises(UsageError, match="AdamW8bit"):
        build_optimizer(mlp(hidden=4), "PagedAdamW8bit", 1e-3, device_type="mps")


@pytest.mark.parametrize("kwargs", [None, {"fused": False}])  # the foreach path is the one that NaNs at 1e-8
def test_adamw_16_true_does_not_nan(kwargs: dict | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()  # dead ReLUs: zero grads
    optimizer = build_optimizer(model, "AdamW", 1e-3, param_dtype=torch.float16, kwargs=kwargs)
    assert optimizer.param_groups[0]["eps"] == 1e-4
    x, y = torch.randn(32, 8).half(), torch.randn(32, 1).half()
    for _ in range(3):
        ((model(x) - y) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert not any(p.isnan().any() for p in model.parameters())
    explicit = build_optimizer(model, "AdamW", 1e-3, param_dtype=torch.float16, kwargs={"eps": 1e-3})
    assert explicit.param_groups[0]["eps"] == 1e-3


def test_unknown_optimizer() -> None:
    with pytest.raises(UsageError, match="AdamW") as error:
        build_optimizer(mlp(hidden=4), "Adamm", 1e-3)
    assert "torch.optim.RMSprop" in str(error.value)
    with pytest.raises(UsageError, match="Cannot import"):
        build_optimizer(mlp(hidden=4), "torch.optim.NoSuchOptimizer", 1e-3)


def test_lr_schedule() -> None:
    lr, warmup, max_steps, min_lr = 1e-3, 10, 100, 1e-5
    lrs = [lr_at(step, lr, warmup, max_steps, min_lr) for step in range(120)]
    assert lrs[0] == pytest.approx(lr / warmup)
    assert all(a < b for a, b in zip(lrs[:warmup], lrs[1:warmup]))
    assert lrs[warmup - 1] == pytest.approx(lr) and lrs[warmup] == pytest.approx(lr) and max(lrs) == pytest.approx(lr)
    assert all(a > b for a, b in zip(lrs[warmup : max_steps + 1], lrs[warmup + 1 : max_steps + 1]))
    assert lrs[max_steps] == pytest.approx(min_lr) and set(lrs[max_steps:]) == {min_lr}
    assert lr_at(55, lr, warmup, max_steps, min_lr) == pytest.approx((lr + min_lr) / 2)  # cosine midpoint

    optimizer = build_optimizer(mlp(hidden=4), "AdamW", lr)
    set_lr(optimizer, 5e-4)
    assert [group["lr"] for group in optimizer.param_groups] == [5e-4, 5e-4]


def test_a_run_holds_the_optimizer_as_spelled_in_the_list():
    """--optimizer is matched case-insensitively once, when the run is resolved; every comparison downstream (the
    planner, the checks) reads that spelling, and a class path stays as given."""
    from lit_model.core.config import Config
    from lit_model.run import resolve_run
    from lit_model.train.args import TrainArgs

    config = Config.from_name("lit-model-5m")
    for flag, resolved in (("adamw8bit", "AdamW8bit"), ("ADALOMO", "AdaLomo"), ("torch.optim.RMSprop", "torch.optim.RMSprop")):
        run = resolve_run(TrainArgs(optimizer=flag, micro_batch_size=2, global_batch_size=2), config, "full", "cpu",
                          present=False)
        assert run.optimizer == resolved and run.replace(micro_batch_size=1).optimizer == resolved
    assert resolve_run(TrainArgs(optimizer="adalomo", micro_batch_size=2, global_batch_size=2), config, "full", "cpu",
                       present=False).steps_in_backward
