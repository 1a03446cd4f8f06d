"""Optimizer construction, learning-rate schedule and optimizer-state accounting for the fit loops.

``build_optimizer`` gives weight decay to matrices and embeddings (``ndim >= 2``) and none to biases and
norm weights; frozen parameters get no state and tied parameters are counted once.

Sophia (``pytorch_optimizer.SophiaH``) estimates the Hessian diagonal with Hutchinson's method *inside*
``step()``, every ``update_period`` steps (default 10), by differentiating the gradients a second time.
So the gradients must carry a graph on those steps. The order of calls in a fit loop is::

    create_graph = needs_create_graph(optimizer)        # True for SophiaH / AdaHessian
    fabric.backward(loss, create_graph=create_graph)    # every micro-batch
    set_lr(optimizer, lr_at(step, ...))                 # gradient clipping may also go here
    hessian_step(optimizer)                             # checks the graph is there before step()
    optimizer.step()                                    # SophiaH computes the Hessian estimate here
    optimizer.zero_grad(set_to_none=True)               # frees the graph held by .grad

``needs_create_graph(optimizer, this_step=True)`` is True only when the coming ``step()`` refreshes the
Hessian, which skips the double-backward cost on the other steps (ask it again every step, before backward).
"""

from __future__ import annotations

import importlib
import inspect
import math
from typing import Any

import torch
from torch import nn

from lit_model.errors import UsageError

OPTIMIZERS = ("AdamW", "SGD", "Lion", "Sophia", "Adafactor", "AdamW8bit", "PagedAdamW8bit")
ADAM_BETAS = (0.9, 0.95)
# pytorch_optimizer classes that run a Hutchinson Hessian estimate inside step()
_HESSIAN_OPTIMIZERS = ("SophiaH", "AdaHessian")


def build_optimizer(
    model: nn.Module,
    name: str,
    learning_rate: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] | None = None,
    device_type: str = "cpu",
    param_dtype: torch.dtype = torch.float32,
    kwargs: dict[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` (one of ``OPTIMIZERS`` or a class path such as ``torch.optim.RMSprop``).

    ``betas=None`` means each optimizer's usual default: (0.9, 0.95) for the AdamW family, (0.9, 0.99) for
    Lion, pytorch_optimizer's (0.96, 0.99) for Sophia. ``kwargs`` override every default.
    """
    extra = dict(kwargs or {})
    learning_rate = extra.pop("lr", learning_rate)
    weight_decay = extra.pop("weight_decay", weight_decay)
    groups = _param_groups(model, weight_decay)
    canonical = {n.lower(): n for n in OPTIMIZERS}.get(name.lower())

    if canonical == "AdamW":
        # Fused kernels where this torch has them for the device (CUDA; CPU since torch 2.4), else foreach.
        defaults: dict[str, Any] = {"betas": betas or ADAM_BETAS}
        if "fused" not in extra and "foreach" not in extra:
            defaults["fused" if _fused_supported(device_type) else "foreach"] = True
        # In 16-true the (foreach) Adam step runs in float16, where eps=1e-8 rounds to 0: a gradient that is
        # exactly zero (e.g. a dead ReLU unit) then gives 0 / (sqrt(0) + 0) = NaN. 1e-4 is representable.
        if param_dtype == torch.float16 or any(p.dtype == torch.float16 for g in groups for p in g["params"]):
            defaults["eps"] = 1e-4
        return _construct(torch.optim.AdamW, groups, learning_rate, {**defaults, **extra})
    if canonical == "SGD":
        return _construct(torch.optim.SGD, groups, learning_rate, {"momentum": 0.9, "nesterov": False, **extra})
    if canonical == "Lion":
        cls = _import_attr("pytorch_optimizer", "Lion", "pip install pytorch_optimizer")
        return _construct(cls, groups, learning_rate, {"betas": betas or (0.9, 0.99), **extra})
    if canonical == "Sophia":
        cls = _import_attr("pytorch_optimizer", "SophiaH", "pip install pytorch_optimizer")
        defaults = {"update_period": 10, **({"betas": betas} if betas else {})}
        return _construct(cls, groups, learning_rate, {**defaults, **extra})
    if canonical == "Adafactor":
        cls = getattr(torch.optim, "Adafactor", None)  # in torch since 2.5
        cls = cls or _import_attr("pytorch_optimizer", "AdaFactor", "pip install pytorch_optimizer")
        return _construct(cls, groups, learning_rate, extra)
    if canonical in ("AdamW8bit", "PagedAdamW8bit"):
        cls = _bitsandbytes_optimizer(canonical, device_type)
        return _construct(cls, groups, learning_rate, {"betas": betas or ADAM_BETAS, **extra})
    if "." in name:
        cls = _optimizer_class(name)
        accepted = inspect.signature(cls.__init__).parameters
        if "weight_decay" not in accepted:
            groups = [{"params": g["params"]} for g in groups]
        defaults = {"betas": betas} if betas and "betas" in accepted else {}
        return _construct(cls, groups, learning_rate, {**defaults, **extra})
    raise _unknown_optimizer(name)


def _unknown_optimizer(name: str) -> UsageError:
    return UsageError(
        f"Unknown optimizer {name!r}. Use one of {', '.join(OPTIMIZERS)}, or the import path of an optimizer"
        " class such as `torch.optim.RMSprop` or `pytorch_optimizer.CAME`."
    )


def check_optimizer(name: str, learning_rate: float, weight_decay: float) -> None:
    """Refuse, before anything starts, an optimizer the fit loop cannot drive. The loop calls ``step()`` without
    a closure, on dense gradients: a class path is built over a small parameter and stepped once that way,
    which fails for e.g. torch.optim.LBFGS (needs a closure) and SparseAdam (sparse gradients only). The names
    in ``OPTIMIZERS`` are known to work and are checked when built (their packages, the device)."""
    if name.lower() in {n.lower() for n in OPTIMIZERS}:
        return
    if "." not in name:
        raise _unknown_optimizer(name)
    probe = nn.Linear(2, 2)
    try:  # built as the loop builds it: weight-decay groups, then one step
        optimizer = build_optimizer(probe, name, learning_rate=learning_rate, weight_decay=weight_decay)
        if _is_hessian_optimizer(optimizer):  # steps on the gradients' graph, which needs a real backward
            return
        for parameter in probe.parameters():
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
    except UsageError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever the class raises, the loop would hit at setup or step 1
        raise UsageError(
            f"--optimizer {name} cannot serve this training loop, which builds it with parameter groups and "
            f"calls step() without a closure on dense gradients ({type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}). "
            f"Use one of {', '.join(OPTIMIZERS)}, or a class that steps that way, e.g. torch.optim.Adam, NAdam, "
            "RAdam, RMSprop, Adagrad, Adamax or Adadelta."
        ) from None


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for _, param in model.named_parameters():  # named_parameters() yields a tied parameter once
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay:
        raise UsageError("The model has no trainable parameters: unfreeze some before building the optimizer.")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _construct(cls: type, groups: list[dict[str, Any]], lr: float, options: dict[str, Any]) -> Any:
    try:
        return cls(groups, lr=lr, **options)
    except TypeError as error:
        raise UsageError(
            f"{cls.__module__}.{cls.__qualname__} rejected the optimizer arguments {sorted(options)}: {error}."
            " Fix or remove the offending optimizer kwargs."
        ) from error


def _fused_supported(device_type: str) -> bool:
    try:  # torch 2.13 lists cpu, cuda, mps, xpu, ... (CPU fused AdamW handles fp32/fp64/fp16/bf16)
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:  # private helper moved: only CUDA is certain to have fused AdamW
        return device_type == "cuda"
    return device_type in _get_fused_kernels_supported_devices()


def _import_attr(module: str, attr: str, install: str) -> Any:
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as error:
        raise UsageError(f"This optimizer needs the `{module}` package: run `{install}`, or use AdamW.") from error


def _bitsandbytes_optimizer(name: str, device_type: str) -> type:
    cls = _import_attr("bitsandbytes.optim", name, "pip install bitsandbytes")
    import bitsandbytes

    # Paging (unified memory) is CUDA-only; bitsandbytes falls back to ordinary buffers on CPU.
    paged = name.startswith("Paged")
    supported = {"cuda", "cpu"} if paged else getattr(bitsandbytes, "supported_torch_devices", {"cuda"})
    if device_type not in supported:
        raise UsageError(
            f"bitsandbytes' {name} does not run on device type {device_type!r} (supported: {sorted(supported)})."
            f" Use {'AdamW8bit' if paged else 'AdamW or Adafactor'} instead."
        )
    return cls


def _optimizer_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise UsageError(
            f"Cannot import optimizer class {path!r} ({error}). Give a full class path such as"
            f" `torch.optim.RMSprop`, install its package, or use one of {', '.join(OPTIMIZERS)}."
        ) from error
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UsageError(f"{path!r} is not a torch.optim.Optimizer subclass: give an optimizer class path.")
    return cls


def _is_hessian_optimizer(optimizer: torch.optim.Optimizer) -> bool:
    flagged = getattr(optimizer, "requires_create_graph", False) is True  # opt-in flag for other classes
    return flagged or any(klass.__name__ in _HESSIAN_OPTIMIZERS for klass in type(optimizer).__mro__)


def _hessian_due(optimizer: torch.optim.Optimizer) -> bool:  # does the coming step() refresh the Hessian?
    step = optimizer.param_groups[0].get("step", 0)
    return int(step) % int(getattr(optimizer, "update_period", 1)) == 0


def needs_create_graph(optimizer: torch.optim.Optimizer, this_step: bool = False) -> bool:
    """Whether backward needs ``create_graph=True``; ``this_step=True``: only for the coming ``step()``."""
    if not _is_hessian_optimizer(optimizer):
        return False
    return _hessian_due(optimizer) if this_step else True


def hessian_step(optimizer: torch.optim.Optimizer) -> None:
    """Call before ``optimizer.step()``. SophiaH estimates the Hessian inside ``step()`` from the gradients'
    graph, so this only checks that the graph exists, turning autograd's cryptic error into a UsageError."""
    if not (_is_hessian_optimizer(optimizer) and _hessian_due(optimizer)):
        return
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if grads and all(grad.grad_fn is None for grad in grads):
        raise UsageError(
            f"{type(optimizer).__name__} estimates the Hessian from the gradients' graph on this step: call"
            " backward(create_graph=True) whenever needs_create_graph(optimizer) is True."
        )


def lr_at(step: int, learning_rate: float, warmup_steps: int, max_steps: int, min_lr: float = 0.0) -> float:
    """Linear warmup ``lr * (step + 1) / warmup_steps``, then cosine decay to ``min_lr`` at ``max_steps``."""
    if step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - warmup_steps)
    return min_lr + 0.5 * (learning_rate - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors in ``optimizer.state`` (a tensor shared between parameters, such as
    bitsandbytes' quantization map, counted once)."""
    tensors: dict[int, torch.Tensor] = {}
    pending: list[Any] = list(optimizer.state.values())
    while pending:
        value = pending.pop()
        if isinstance(value, torch.Tensor):
            tensors[id(value)] = value
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
    return sum(t.numel() * t.element_size() for t in tensors.values())
