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

Some optimizers step *inside* backward (``steps_in_backward``): ``--optimizer_in_backward`` wraps one optimizer per
parameter (``InBackwardOptimizer``) and steps it from the parameter's post-accumulate-grad hook, freeing the
gradient at once; AdaLomo does so by itself. For them the loop's ``optimizer.step()`` only finishes the step, and
the learning rate must be set before the backward (the fit loop does).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from lit_model.core.errors import UsageError
from lit_model.run import DEFAULT_OPTIMIZER_RANK, MODEL_OPTIMIZERS, OPTIMIZERS, canonical_name
# Low-rank gradient projection of the blocks' matrices (GaLore, APOLLO): the rank, the steps between refreshes
# of the projection, and the scale of the projected-back update (GaLore's paper: 0.25; APOLLO's: 1 per channel)
LOW_RANK = {"GaLore": {"update_proj_gap": 200, "scale": 0.25, "projection_type": "std"},
            "APOLLO": {"update_proj_gap": 200, "scale": 1.0, "projection_type": "std", "scale_type": "channel"}}
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
    rank: int = DEFAULT_OPTIMIZER_RANK,
    in_backward: bool = False,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` (one of ``OPTIMIZERS`` or a class path such as ``torch.optim.RMSprop``).

    ``betas=None`` means each optimizer's usual default: (0.9, 0.95) for the AdamW family, (0.9, 0.99) for
    Lion, pytorch_optimizer's (0.96, 0.99) for Sophia. ``kwargs`` override every default. ``rank``: GaLore's and
    APOLLO's projection rank. ``in_backward``: one optimizer per parameter, stepped as its gradient is ready
    (``InBackwardOptimizer``).
    """
    extra = dict(kwargs or {})
    learning_rate = extra.pop("lr", learning_rate)
    weight_decay = extra.pop("weight_decay", weight_decay)
    canonical = canonical_name(name)
    check_steps_in_backward(name, in_backward, grad_clip=0.0)
    if canonical in MODEL_OPTIMIZERS:
        return _model_optimizer(model, canonical, learning_rate, weight_decay, betas, extra)
    groups = _param_groups(model, weight_decay, rank if canonical in LOW_RANK else None)

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        return _optimizer_for_groups(groups, name, canonical, learning_rate, betas, device_type, param_dtype, extra)

    if not in_backward:
        optimizer = build(groups)
    else:
        optimizer = InBackwardOptimizer([build([{**group, "params": [p]}]) for group in groups for p in group["params"]])
        if _is_hessian_optimizer(optimizer.optimizers[0]):
            raise _hessian_in_backward(name)
    if canonical in LOW_RANK:
        optimizer.register_load_state_dict_post_hook(_projections_to_parameter_devices)
    return optimizer


def _projections_to_parameter_devices(optimizer: torch.optim.Optimizer) -> None:
    """After a resume: load_state_dict moves the state's tensors to their parameter's device, but not those inside
    GaLore's projector objects (loaded on the CPU)."""
    for param, state in optimizer.state.items():
        projector = state.get("projector")
        matrix = getattr(projector, "ortho_matrix", None)
        if isinstance(matrix, tuple):
            projector.ortho_matrix = tuple(m.to(param.device) for m in matrix)
        elif matrix is not None:
            projector.ortho_matrix = matrix.to(param.device)


def _optimizer_for_groups(groups: list[dict[str, Any]], name: str, canonical: str | None, learning_rate: float,
                          betas: tuple[float, float] | None, device_type: str, param_dtype: torch.dtype,
                          extra: dict[str, Any]) -> torch.optim.Optimizer:
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
    if canonical in LOW_RANK:  # the settings reach the projected group through the defaults
        cls = _import_attr("pytorch_optimizer", canonical, "pip install pytorch_optimizer")
        # each projected matrix's state holds a GaLoreProjector (plain attributes: ints, a string, tensors): let a
        # resume's torch.load(weights_only=True) rebuild it, as it rebuilds tensors
        torch.serialization.add_safe_globals([_import_attr("pytorch_optimizer.optimizer.utils.galore", "GaLoreProjector",
                                                           "pip install pytorch_optimizer")])
        return _construct(cls, groups, learning_rate, {"betas": betas or ADAM_BETAS, **LOW_RANK[canonical], **extra})
    if canonical in ("AdamW4bit", "AdamWFp8"):
        cls = _torchao_optimizer(canonical, device_type)
        return _construct(cls, groups, learning_rate, {"betas": betas or ADAM_BETAS, **extra})
    if "." in name:
        cls = _optimizer_class(name)
        accepted = inspect.signature(cls.__init__).parameters
        if "weight_decay" not in accepted:
            groups = [{"params": g["params"]} for g in groups]
        defaults = {"betas": betas} if betas and "betas" in accepted else {}
        return _construct(cls, groups, learning_rate, {**defaults, **extra})
    raise _unknown_optimizer(name)


def _model_optimizer(model: nn.Module, name: str, learning_rate: float, weight_decay: float,
                     betas: tuple[float, float] | None, extra: dict[str, Any]) -> torch.optim.Optimizer:
    """Adam-mini (one second moment per attention head and per other tensor; it needs the model's names and
    heads) or AdaLomo (steps inside backward from hooks on the model's parameters)."""
    if name == "AdaLomo":
        cls = _import_attr("pytorch_optimizer", "AdaLOMO", "pip install pytorch_optimizer")
        return _construct_model(_adalomo_class(cls), model, learning_rate, {"weight_decay": weight_decay, **extra})
    cls = _import_attr("pytorch_optimizer", "AdamMini", "pip install pytorch_optimizer")
    config = getattr(model, "config", None)  # a GPT's; another model has no heads: one second moment per tensor
    heads = {"num_embeds": config.n_embd, "num_heads": config.n_head, "num_query_groups": config.n_query_groups} if config else {}
    optimizer = _construct_model(cls, model, learning_rate,
                                 {"betas": betas or ADAM_BETAS, "weight_decay": weight_decay, **heads, **extra})
    # pytorch_optimizer recognises Llama/GPT-2 names: teach it this model's, and its per-head size (head_size may
    # differ from n_embd / n_head); decay matrices and embeddings only, as every other optimizer here
    optimizer.embed_blocks = {"embed.weight", "lm_head.weight"}
    optimizer.qk_blocks = {"attn.query.weight", "attn.key.weight"} if config else set()
    parameters = dict(model.named_parameters())
    for group in optimizer.param_groups:
        if any(block in group["name"] for block in optimizer.qk_blocks):
            group["parameter_per_head"] = config.head_size * config.n_embd
        group["weight_decay"] = weight_decay if parameters[group["name"]].ndim >= 2 else 0.0
    return optimizer


def _construct_model(cls: type, model: nn.Module, lr: float, options: dict[str, Any]) -> Any:
    if not any(p.requires_grad for p in model.parameters()):
        raise UsageError("The model has no trainable parameters: unfreeze some before building the optimizer.")
    try:
        return cls(model, lr=lr, **options)
    except TypeError as error:
        raise UsageError(f"{cls.__module__}.{cls.__qualname__} rejected the optimizer arguments {sorted(options)}: "
                         f"{error}. Fix or remove the offending optimizer kwargs.") from error


def _follows_param_group(key: str) -> property:
    """An attribute AdaLOMO reads in its hooks (``self.lr``, ``self.weight_decay``) that follows the first param group
    once there is one (before, during its constructor, it holds the value given)."""

    def get(self: Any) -> Any:
        return self.param_groups[0][key] if "param_groups" in self.__dict__ else self.__dict__["_" + key]

    def set(self: Any, value: Any) -> None:
        self.__dict__["_" + key] = value

    return property(get, set)


def _adalomo_class(base: type) -> type:
    """pytorch_optimizer's AdaLOMO made drivable by the fit loop: its learning rate and weight decay follow the
    param group (the schedule and the rehearsal set them there, before the backward in which it steps), a step
    is counted in ``step()`` (its ``fused_backward`` counts before the backward), the loss is not scaled (the loop
    calls backward itself), and ``step()`` applies the update of the parameter whose gradient came last."""

    class AdaLomo(base):  # type: ignore[misc, valid-type]
        steps_in_backward = True

        def __init__(self, model: nn.Module, lr: float, **options: Any) -> None:
            super().__init__(model, lr=lr, **{"loss_scale": 0.0, **options})
            self.num_steps = 1  # the count during the first backward, as fused_backward would have it

        lr = _follows_param_group("lr")
        weight_decay = _follows_param_group("weight_decay")

        @property
        def moments(self) -> tuple[dict[str, torch.Tensor], ...]:  # its state, kept outside ``state``
            return self.exp_avg_sq, self.exp_avg_sq_row, self.exp_avg_sq_col

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            self.grad_func(0)
            self.num_steps += 1

        @contextlib.contextmanager
        def paused(self) -> Iterator[None]:
            """Backward frees the gradients without stepping (its gradient-norm pass does exactly that)."""
            self.gather_norm = True
            try:
                yield
                self.grad_func(0)
            finally:
                self.gather_norm, self.grad_norms = False, []

    return AdaLomo


class InBackwardOptimizer(torch.optim.Optimizer):
    """``--optimizer_in_backward``: one optimizer per trainable parameter, each stepped from its parameter's
    post-accumulate-grad hook, which then frees the gradient, so the gradients never all exist at once (as
    torchtune's optimizer-in-backward). ``step()`` and ``zero_grad()`` have nothing left to do.

    Its param groups *are* the per-parameter optimizers' groups (the same dicts: the loop's learning rate reaches
    them) and its ``state`` is the one dict they all keep their state in, so ``state_dict()`` / ``load_state_dict``
    are torch's own, in torch's format."""

    steps_in_backward = True

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        super().__init__([{"params": group["params"]} for group in groups], {})
        self.optimizers = optimizers
        self.stepping = True
        self._share()
        for optimizer in optimizers:
            for param in optimizer.param_groups[0]["params"]:
                param.register_post_accumulate_grad_hook(self._hook(optimizer))

    def _share(self) -> None:
        self.param_groups = [optimizer.param_groups[0] for optimizer in self.optimizers]
        for optimizer in self.optimizers:
            optimizer.state = self.state

    def _hook(self, optimizer: torch.optim.Optimizer) -> Callable[[torch.Tensor], None]:
        # Weak references: autograd keeps the hook as long as the parameter lives, and a strong one would keep this
        # optimizer, its state and through its groups every parameter alive after the run drops them (a cycle
        # through autograd's C++ side, which the garbage collector cannot see).
        this, own = weakref.ref(self), weakref.ref(optimizer)

        def step_and_free(param: torch.Tensor) -> None:
            owner, optimizer = this(), own()
            if owner is not None and optimizer is not None and owner.stepping:
                optimizer.step()
            param.grad = None

        return step_and_free

    def step(self, closure: Any = None) -> None:
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # new group dicts and a new state dict: share them again
        for optimizer, group in zip(self.optimizers, self.param_groups):
            optimizer.param_groups = [group]
        self._share()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backward frees the gradients without stepping (a resumed run's rehearsal)."""
        self.stepping = False
        try:
            yield
        finally:
            self.stepping = True


def steps_in_backward(optimizer: Any) -> bool:
    return getattr(getattr(optimizer, "optimizer", optimizer), "steps_in_backward", False)


def paused_in_backward(optimizer: Any) -> contextlib.AbstractContextManager:
    """A context in which an optimizer that steps in backward does not step (others: nothing changes)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
    return inner.paused() if steps_in_backward(inner) else contextlib.nullcontext()


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
    if canonical_name(name) is not None:
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


def check_steps_in_backward(name: str, in_backward: bool, grad_clip: Optional[float]) -> None:
    """The flag combinations an optimizer that steps inside backward cannot serve (the run-level ones, one process
    and no gradient accumulation, are checked in ``resolve_run``)."""
    canonical = canonical_name(name)
    if in_backward and canonical in MODEL_OPTIMIZERS:
        reason = "steps inside backward by itself" if canonical == "AdaLomo" else "is built from the whole model, not one parameter at a time"
        raise UsageError(f"--optimizer {canonical} {reason}: drop --optimizer_in_backward.")
    if in_backward and canonical == "Sophia":
        raise _hessian_in_backward(canonical)
    if (in_backward or canonical == "AdaLomo") and grad_clip is not None and grad_clip > 0:  # one the user gave
        what = "--optimizer_in_backward" if in_backward else "--optimizer AdaLomo"
        raise UsageError(f"{what} steps each parameter as soon as its gradient is ready, before the global gradient "
                         f"norm that --grad_clip {grad_clip:g} clips to is known: add --grad_clip 0.")


def _hessian_in_backward(name: str) -> UsageError:
    return UsageError(f"--optimizer {name} differentiates the gradients a second time inside step(), which needs every "
                      "gradient at once: drop --optimizer_in_backward or choose another optimizer.")


def _param_groups(model: nn.Module, weight_decay: float, rank: int | None = None) -> list[dict[str, Any]]:
    """Weight decay for matrices and embeddings, none for biases and norms. With ``rank`` (GaLore, APOLLO), the
    blocks' matrices whose smaller side exceeds it form a group of their own with the low-rank settings (the
    embedding and the head keep full state, as in GaLore's paper; a smaller matrix would save nothing)."""
    decay, no_decay, projected = [], [], []
    for name, param in model.named_parameters():  # named_parameters() yields a tied parameter once
        if not param.requires_grad:
            continue
        if rank is not None and param.ndim == 2 and "blocks." in name and min(param.shape) > rank:
            projected.append(param)
        else:
            (decay if param.ndim >= 2 else no_decay).append(param)
    if not decay and not no_decay and not projected:
        raise UsageError("The model has no trainable parameters: unfreeze some before building the optimizer.")
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if projected:
        groups.insert(0, {"params": projected, "weight_decay": weight_decay, "rank": rank})
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


def _torchao_optimizer(name: str, device_type: str) -> type:
    """torchao's AdamW with 4-bit or FP8 moments (block-wise scaled, for tensors of >= 4096 elements)."""
    cls = _import_attr("torchao.optim", name, "pip install torchao")
    if name == "AdamWFp8" and device_type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        raise UsageError(
            f"--optimizer AdamWFp8 keeps its moments in float8, which this GPU (compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))}) does not support: it needs 8.9 or newer (Ada, "
            "Hopper). Use --optimizer AdamW4bit or AdamW8bit instead."
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
    set_group_values(optimizer, lr=lr)


def set_group_values(optimizer: torch.optim.Optimizer, **values: float) -> None:
    """Set ``lr``, ``weight_decay``... in every param group that has the key (``lr`` always), in place where
    the group holds a tensor (torchao's optimizers keep the learning rate as one and refuse a float)."""
    for group in optimizer.param_groups:
        for key, value in values.items():
            if isinstance(group.get(key), torch.Tensor):
                group[key].fill_(value)
            elif key in group or key == "lr":
                group[key] = value


def state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """The plain tensors an optimizer's state holds: a quantized tensor subclass (torchao's low-bit moments) by its
    inner tensors, an object (GaLore's projector) by the tensors it holds, and the moments an optimizer keeps
    outside ``state`` (AdaLomo's ``moments``) too."""
    pending: list[Any] = [*optimizer.state.values(), *getattr(optimizer, "moments", ())]
    while pending:
        value = pending.pop()
        if is_traceable_wrapper_subclass(value):
            names, _ = value.__tensor_flatten__()
            pending.extend(getattr(value, name) for name in names)
        elif isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple)):
            pending.extend(value)
        elif hasattr(value, "__dict__"):
            pending.extend(vars(value).values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by the tensors of the optimizer's state (``state_tensors``; a tensor shared between parameters, such
    as bitsandbytes' quantization map, counted once)."""
    tensors = {id(t): t for t in state_tensors(optimizer)}
    return sum(t.numel() * t.element_size() for t in tensors.values())
