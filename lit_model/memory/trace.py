"""Engine (a): the exact trace. Build the run's real GPT under ``FakeTensorMode`` (tensors have shapes and
dtypes but no storage, so a 70B model costs nothing), run forward + backward + optimizer step twice and an
evaluation forward under ``MemTracker``, and read the peak of live tensor bytes by category.

Rules learned the hard way (../shared/README.md): fake tensors live on device "cpu" (fake "cuda" tensors abort
the process); the model is built in its target dtype with ``torch.set_default_dtype`` (``.to(dtype)`` fails
under fake mode); stats are reset before each iteration and at least two are run (the first has no
optimizer state). What the trace cannot see is added by ``plan.py``: framework overhead, DDP buckets, FSDP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _ModState, _RefType, _TOTAL_KEY
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map_only

from lit_model.memory.modules import QuantLinearSim, apply_lora, quantize_model_sim
from lit_model.run import Run
from lit_model.ops import take_paths_of
from lit_model.training.optimizers import needs_create_graph

try:
    from torch._guards import active_fake_mode
except ImportError:  # pragma: no cover
    from torch._subclasses.fake_tensor import active_fake_mode  # type: ignore


class _Ref(_RefType):
    """MemTracker's categories plus two of ours. Values equal MemTracker's, so its internal keys match."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    LOGITS = "Logits"
    QUANT = "Quant"


_CATEGORY_REF = {"loss": _Ref.LOGITS, "quant": _Ref.QUANT}


class _Tracker(MemTracker):
    """MemTracker that files tensors created inside ``push_category(...)`` scopes under our categories, and
    keeps only the global peak (module-level peaks are not needed and cost time)."""

    def __init__(self) -> None:
        super().__init__()
        self._ref_class = _Ref
        self._scopes: list[str] = []

    def push_category(self, name: str) -> None:
        self._scopes.append(name)

    def pop_category(self) -> None:
        if self._scopes:
            self._scopes.pop()

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker's own version hooks every parameter, which fails on frozen ones (LoRA, QLoRA, freezing).
        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _Ref.GRAD)

        param_memory = 0
        for param in module.parameters():
            winfos = self._update_and_maybe_create_winfos(param, _Ref.PARAM)
            param_memory += sum(w.mem_consumed for w in winfos)
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _Ref.GRAD)
            if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(grad_hook),
                    # an optimizer stepping in backward may have freed the gradient already (its hook came first)
                    param.register_post_accumulate_grad_hook(lambda p: None if p.grad is None else grad_hook(p.grad)),
                )
        buffer_memory = 0
        for buffer in module.buffers():
            winfos = self._update_and_maybe_create_winfos(buffer, _Ref.BUFFER)
            buffer_memory += sum(w.mem_consumed for w in winfos)
        return param_memory, buffer_memory

    debug = False

    def _update_peak_stats(self, peak_state) -> None:  # global peak only
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)
                if self.debug:
                    self.peak_where = (sorted(self._mod_tracker.parents), self._mod_tracker.is_bw, list(self._scopes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        res = func(*args, **(kwargs or {}))
        if active_fake_mode() is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _Ref.OPT
            elif self._scopes:
                reftype = _CATEGORY_REF[self._scopes[-1]]
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _Ref.TEMP
            else:
                reftype = _Ref.ACT
            tree_map_only(torch.Tensor, partial(self._track, reftype), res)
            self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        return res


@dataclass
class TraceResult:
    phases: dict[str, dict[str, int]]  # phase -> category -> bytes at that phase's peak
    seconds: float
    notes: list[str] = field(default_factory=list)
    probes: dict[str, dict[str, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class _BlockQuantizedState:
    """What a block-quantized AdamW keeps per moment of a tensor: codes of ``code_bits`` per element and an fp32
    scale per ``block`` elements (plus a quantization map of ``qmap`` fp32 values) for a tensor of at least 4096
    elements (torchao: also a multiple of the block), else an unquantized moment (bitsandbytes: fp32; torchao:
    the parameter's dtype); torchao keeps a float32 step count per tensor."""

    code_bits: int
    block: int
    qmap: int = 0
    torchao: bool = False


# bitsandbytes' AdamW8bit (its qmaps, shared by all tensors, are left out), torchao's AdamW4bit and AdamWFp8
_BLOCK_QUANTIZED = {
    "adamw8bit": _BlockQuantizedState(8, 256), "pagedadamw8bit": _BlockQuantizedState(8, 256),
    "adamw4bit": _BlockQuantizedState(4, 128, qmap=16, torchao=True), "adamwfp8": _BlockQuantizedState(8, 256, torchao=True),
}


class _SimQuantizedAdam(torch.optim.Optimizer):
    """State of the sizes a block-quantized AdamW keeps (bitsandbytes' kernels and torchao's compiled step do not
    run under fake tensors); the step is in place, like theirs."""

    def __init__(self, params, layout: _BlockQuantizedState, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})
        self.layout = layout

    @torch.no_grad()
    def step(self, closure=None):
        layout = self.layout
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    n = p.numel()
                    quantized = n >= 4096 and (not layout.torchao or n % layout.block == 0)
                    for moment in ("exp_avg", "exp_avg_sq"):
                        if quantized:
                            state[moment] = torch.zeros(n * layout.code_bits // 8, dtype=torch.uint8, device=p.device)
                            state[moment + "_scale"] = torch.zeros(math.ceil(n / layout.block), dtype=torch.float32, device=p.device)
                            if layout.qmap:
                                state[moment + "_qmap"] = torch.zeros(layout.qmap, dtype=torch.float32, device=p.device)
                        else:
                            state[moment] = torch.zeros_like(p, dtype=p.dtype if layout.torchao else torch.float32)
                    if layout.torchao:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                p.add_(p.grad, alpha=-group["lr"])  # in place, like the fused kernel


def _build_optimizer(model: nn.Module, spec: Run, notes: list[str]) -> torch.optim.Optimizer:
    from lit_model.training.optimizers import InBackwardOptimizer, build_optimizer

    name = spec.optimizer
    if name.lower() in _BLOCK_QUANTIZED:
        layout = _BLOCK_QUANTIZED[name.lower()]
        params = [p for p in model.parameters() if p.requires_grad]
        notes.append(f"{name}'s step does not run on fake tensors: the trace keeps state of the sizes it allocates "
                     f"({layout.code_bits}-bit codes and an fp32 scale per {layout.block} elements for tensors of >= 4096)."
                     + (" torchao compiles that step with torch.compile, whose own memory is not counted (about 80 MB "
                        "more process memory on the CPU for lit-model-5m, benchmarks/memory_ladder.py)." if layout.torchao else ""))
        if spec.optimizer_in_backward:
            return InBackwardOptimizer([_SimQuantizedAdam([p], layout) for p in params])
        return _SimQuantizedAdam(params, layout)
    if name.lower() == "apollo":
        # APOLLO's step limits its update with a Python max() over a tensor, which fake tensors cannot answer; its
        # state is GaLore's (projected moments and the projection, plus one scalar per matrix), its projection a
        # random matrix where GaLore's SVD needs more temporary memory: GaLore's step stands in for it
        notes.append("APOLLO's step does not run on fake tensors: traced with GaLore's step, which keeps the same "
                     "projected state (APOLLO adds one scalar per matrix) and needs more temporary memory.")
        name = "GaLore"
    if name.lower() == "galore":
        notes.append(f"{spec.optimizer} recomputes each matrix's projection every 200 steps, one matrix at a time; "
                     "the traced steps do not include that recomputation.")
    # device_type "cuda" selects the fused AdamW a GPU run uses; fused AdamW also runs on (fake) CPU tensors.
    return build_optimizer(model, name, learning_rate=1e-4, device_type=spec.device_type, param_dtype=spec.param_dtype,
                           rank=spec.optimizer_rank, in_backward=spec.optimizer_in_backward)


@contextlib.contextmanager
def _cuda_dropout():
    """Dropout as CUDA runs it (``native_dropout``: a boolean mask is kept for backward). The CPU kernel keeps a
    noise tensor of the input's dtype instead, which would overstate a GPU run's LoRA dropout memory."""
    import torch.nn.functional as F

    original = F.dropout

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    F.dropout = dropout
    try:
        yield
    finally:
        F.dropout = original


def _apply_lora(model: nn.Module, spec: Run) -> None:
    """The project's LoRA (``lit_model.lora``) when it is there, else the stand-in with the same tensors."""
    try:
        from lit_model.lora import LoRAConfig
        from lit_model.lora import apply_lora as project_apply_lora
    except ImportError:  # pragma: no cover - before lit_model/lora.py existed
        apply_lora(model, spec.lora_r, spec.lora_alpha, spec.lora_dropout, spec.lora_targets)
        return
    targets = {t: t in spec.lora_targets for t in ("query", "key", "value", "projection", "mlp", "head")}
    project_apply_lora(model, LoRAConfig(r=spec.lora_r, alpha=spec.lora_alpha, dropout=spec.lora_dropout, **targets),
                       dtype=spec.param_dtype)


def _quant_state_bytes(model: nn.Module) -> int:
    return sum(m.quant_statistics.numel() for m in model.modules() if isinstance(m, QuantLinearSim))


def _map_categories(snap: dict, quant_state: int) -> dict[str, int]:
    get = lambda ref: int(snap.get(ref, 0))  # noqa: E731
    params = get(_Ref.PARAM) + get(_Ref.BUFFER) - quant_state
    return {
        "parameters": params,
        "gradients": get(_Ref.GRAD),
        "optimizer_state": get(_Ref.OPT),
        "activations": get(_Ref.ACT) + get(_Ref.TEMP) + get(_Ref.OTH),
        "logits_loss": get(_Ref.LOGITS),
        "quantization": get(_Ref.QUANT) + quant_state,
    }


def trace_training(spec: Run, phases: tuple[str, ...] = ("train_step", "evaluation")) -> TraceResult:
    """Peak tensor bytes of one rank of a single-device (or DDP) run, per phase and category."""
    if spec.strategy == "fsdp":
        raise NotImplementedError("FSDP sharding is planned analytically")
    start = time.perf_counter()
    notes: list[str] = []
    config = spec.config
    B, T = spec.micro_batch_size, spec.seq_len
    tracker = _Tracker()
    old_dtype = torch.get_default_dtype()
    # take_paths_of: the fake tensors live on the CPU; the model must take the planned device's code paths
    with FakeTensorMode(), take_paths_of(spec.device_type):
        from lit_model.model import GPT

        torch.set_default_dtype(spec.param_dtype)
        try:
            model = GPT(config)
            model.max_seq_length = T
        finally:
            torch.set_default_dtype(old_dtype)
        if spec.quantize is not None:  # as the finetune scripts: quantize while loading, then add the adapters
            quantize_model_sim(model, spec.quantize, tracker)
        if spec.trainable == "lora":
            _apply_lora(model, spec)
        elif spec.trainable == "adapter":
            from lit_model.adapter import AdapterConfig, apply_adapter

            apply_adapter(model, AdapterConfig(spec.adapter_prompt_length, spec.adapter_start_layer), dtype=spec.param_dtype)
        elif spec.freeze_layers is not None:
            from lit_model.training.loop import freeze_layers

            freeze_layers(model, spec.freeze_layers)
        model.activation_checkpointing_interval = spec.ac_interval
        model.loss_chunk_size = spec.loss_chunk_size
        model.train()
        optimizer = _build_optimizer(model, spec, notes)
        for moments in getattr(optimizer, "moments", ()):  # state an optimizer keeps outside `state` (AdaLomo's)
            for moment in moments.values():
                tracker._update_and_maybe_create_winfos(moment, _Ref.OPT)
        trainable = [p for p in model.parameters() if p.requires_grad]
        vocab = config.padded_vocab_size

        # Logits and loss (forward and the recomputation in backward) go to their own category ...
        original_loss_sum = model._loss_sum

        def loss_sum(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            tracker.push_category("loss")
            try:
                return original_loss_sum(x, targets)
            finally:
                tracker.pop_category()

        model._loss_sum = loss_sum
        # ... and so does the backward through the loss, until the gradient reaches the final norm's output.
        in_loss_backward = {"active": False}

        def end_loss_backward(grad: torch.Tensor) -> None:
            if in_loss_backward["active"]:
                in_loss_backward["active"] = False
                tracker.pop_category()

        probes: dict[str, dict[str, int]] = {}

        def norm_hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            if output.requires_grad:
                output.register_hook(end_loss_backward)
                # what the forward keeps, seen at the end of the blocks (for calibrating the analytic engine)
                snap = tracker.get_tracker_snapshot().get(torch.device("cpu"), {})
                probes["forward_end"] = _map_categories(snap, _quant_state_bytes(model))

        model.norm_f.register_forward_hook(norm_hook)

        autocast = (
            torch.autocast("cpu", dtype=torch.bfloat16) if spec.autocast_dtype is not None else contextlib.nullcontext()
        )
        x = torch.randint(0, vocab, (B, T))
        y = torch.randint(0, vocab, (B, T))
        tracker.track_external(x, y)
        micro_steps = min(spec.accumulation, 2)  # from the 2nd micro batch on, gradients are resident
        create_graph = needs_create_graph(optimizer)  # Sophia: the backward keeps its own graph for the Hessian
        model.loss_differentiable_twice = create_graph
        # as the fit loop: the fused attention kernels have no double backward
        attention = (lambda: sdpa_kernel([SDPBackend.MATH])) if create_graph else contextlib.nullcontext

        def train_step() -> None:
            for _ in range(micro_steps):
                tracker.reset_mod_stats()  # MemTracker refuses a second forward of the root module otherwise
                with autocast, attention():
                    loss = model(x, targets=y)
                in_loss_backward["active"] = True
                tracker.push_category("loss")
                with attention():
                    (loss / spec.accumulation).backward(create_graph=create_graph)
                end_loss_backward(None)  # type: ignore[arg-type]
                del loss
            if spec.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, spec.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        quant_state = _quant_state_bytes(model)
        results: dict[str, dict[str, int]] = {}
        dropout = _cuda_dropout if spec.device_type == "cuda" else contextlib.nullcontext
        with dropout(), tracker:  # iteration 1 creates the optimizer state
            tracker.reset_mod_stats()
            train_step()
        with dropout(), tracker:  # iteration 2: the steady state
            tracker.reset_mod_stats()
            train_step()
            results["train_step"] = _map_categories(tracker.get_tracker_snapshot("peak")[torch.device("cpu")], quant_state)
        if "evaluation" in phases:
            eb = spec.eval_batch
            xe, ye = torch.randint(0, vocab, (eb, T)), torch.randint(0, vocab, (eb, T))
            tracker.track_external(xe, ye)
            model.eval()
            with tracker, torch.no_grad():
                tracker.reset_mod_stats()
                with autocast:
                    model(xe, targets=ye)
                results["evaluation"] = _map_categories(tracker.get_tracker_snapshot("peak")[torch.device("cpu")], quant_state)
            model.train()
    return TraceResult(phases=results, seconds=time.perf_counter() - start, notes=notes, probes=probes)


# ---- deep models: trace a few layers, extrapolate exactly ------------------------------------------------------
def layer_period(run: Run) -> int:
    """The number of consecutive blocks after which the blocks' kinds repeat (local/global attention, blocks
    without RoPE, checkpointed blocks): every period of blocks holds the same memory."""
    config, period = run.config, 1
    if config.sliding_window_size is not None:
        period = config.full_attention_every or config.sliding_window_layer_stride
    for every in (config.nope_every, run.ac_interval):
        if every:
            period = math.lcm(period, every)
    return period


def depth_segments(run: Run) -> Optional[list[int]]:
    """The run's blocks as consecutive segments of one kind each (frozen or trained, with or without an
    adapter): their lengths. None when the kinds follow parameter-name patterns (--freeze_layers PATTERNS)."""
    n_layer = run.config.n_layer
    if run.trainable == "adapter":
        return [run.adapter_start_layer, n_layer - run.adapter_start_layer]
    if isinstance(run.freeze_layers, int):
        return [run.freeze_layers, n_layer - run.freeze_layers]
    return None if run.freeze_layers is not None else [n_layer]


def with_segments(run: Run, lengths: list[int]) -> Run:
    """The same run on a model whose segments have these lengths."""
    from lit_model.adapter import AdapterConfig

    changes: dict[str, Any] = {"config": dataclasses.replace(run.config, n_layer=sum(lengths))}
    if run.trainable == "adapter":
        changes["adapter"] = AdapterConfig(run.adapter_prompt_length, lengths[0])
    elif isinstance(run.freeze_layers, int):
        changes["freeze_layers"] = lengths[0]
    return run.replace(**changes)


def trace_by_layers(run: Run, phases: tuple[str, ...] = ("train_step", "evaluation")) -> Optional[TraceResult]:
    """The trace of a deep model from traces of shallow ones: a block's memory is the same in every period of
    blocks, so each category of each phase is linear in the number of periods of each segment. Trace the run
    with one period more than each segment's remainder, then with one more period in each segment in turn,
    and extrapolate. None when the run's blocks do not form segments (see depth_segments)."""
    segments = depth_segments(run)
    if segments is None:
        return None
    period = layer_period(run)
    # keeping each segment's length modulo the period keeps every block's kind (its index modulo the period)
    base = [min(length, length % period + period) for length in segments]
    start = time.perf_counter()
    reference = trace_training(with_segments(run, base), phases)
    result = {phase: dict(categories) for phase, categories in reference.phases.items()}
    traced_depths = [sum(base)]
    for index, (length, shallow) in enumerate(zip(segments, base)):
        periods = (length - shallow) // period
        if periods == 0:
            continue
        longer = base[:index] + [shallow + period] + base[index + 1:]
        traced_depths.append(sum(longer))
        step = trace_training(with_segments(run, longer), phases)
        for phase, categories in result.items():
            for category in categories:
                categories[category] += periods * (step.phases[phase][category] - reference.phases[phase][category])
    note = (f"Traced with {', '.join(map(str, traced_depths))} blocks and extrapolated to {run.config.n_layer} "
            f"(the blocks' kinds repeat every {period}).")
    return TraceResult(phases=result, seconds=time.perf_counter() - start, notes=reference.notes + [note])
