"""Engine (a): the exact trace. Build the run's real GPT under ``FakeTensorMode`` (tensors have shapes and
dtypes but no storage, so a 70B model costs nothing), adapt it as the scripts do (LoRA, adapter, freezing; the
bitsandbytes layers as stand-ins of the same tensors, see modules.py), set it up with a one-process Fabric of the
run's precision and run the fit loop's own step (``TrainStep``: micro batches, loss scaling, backward, the
optimizer update) twice and its evaluation once under ``MemTracker``; read the peak of live tensor bytes by
category, and the state left after the step (what a checkpoint is saved from). FSDP runs are sharded by the
scripts' own ``parallelize`` (levers, then FSDP) over PyTorch's fake process group, so this process holds one rank's share (HYBRID_SHARD
and cpu_offload included). The model carries no switch for the planner.

Rules learned the hard way (../shared/README.md): fake tensors live on device "cpu" (fake "cuda" tensors abort
in autograd), so the model is handed the planned device's ``KernelPolicy`` (``traced_policy``); the model is built in
its target dtype with ``torch.set_default_dtype`` (``.to(dtype)`` cannot swap fake parameters); at least two
steps run (the first has no optimizer state). What the trace cannot see is added by ``planner.py`` and ``overhead.py``:
the process's runtime and allocator overhead, DDP buckets, the full state dict FSDP gathers when saving. The tracker
(``tracker.py``) and generation's trace (``trace_generation.py``) stand apart, without the training stack.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.plugins.precision import HalfPrecision
from lightning.fabric.strategies import SingleDeviceStrategy
from lightning.fabric.strategies.model_parallel import _FSDPNoSync
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from lit_model.methods.adapter import AdapterConfig, apply_adapter
from lit_model.methods.lora import apply_lora
from lit_model.model.gpt import GPT, default_dtype
from lit_model.parallel.apply import offloading_of, parallelize
from lit_model.parallel.fsdp import fsdp_mesh
from lit_model.plan.calibration import quantized_step_bytes
from lit_model.plan.modules import QuantLinearSim, quantize_model_sim
from lit_model.plan.tracker import CPU, _cuda_kernels, _Ref, _Tracker, traced_policy
from lit_model.run import Run
from lit_model.train.optimizers import InBackwardOptimizer, build_optimizer
from lit_model.train.session import objective as session_objective
from lit_model.train.step import TrainStep, evaluation_sums, freeze_layers


class TraceFailed(RuntimeError):
    """An op of the traced run that fake tensors cannot run; ``part``: forward, backward, optimizer or evaluation."""

    def __init__(self, part: str, cause: Union[Exception, str]) -> None:
        super().__init__(cause if isinstance(cause, str) else f"{type(cause).__name__}: {str(cause)[:200]}")
        self.part = part

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:  # crosses from a fresh process (planner._trace_tensors)
        return TraceFailed, (self.part, str(self))


@dataclass
class TraceResult:
    phases: dict[str, dict[str, int]]  # phase -> category -> bytes at that phase's peak
    seconds: float
    notes: list[str] = field(default_factory=list)
    probes: dict[str, dict[str, int]] = field(default_factory=dict)
    host_bytes: dict[str, int] = field(default_factory=dict)  # what the run keeps outside the device at most
    # phase -> stretch of forward, backward or optimizer ops ("3:backward") -> category -> bytes at its peak
    regions: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    values_read: int = 0  # tensor values the traced step read, answered by stand-ins (_Tracker._stand_in)


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
    run under fake tensors); the step is in place, like theirs. ``step_bytes``: the temporaries its real step
    allocates for a tensor of n elements (``calibration.quantized_step_bytes``), allocated and freed
    here while each tensor steps."""

    def __init__(self, params, layout: _BlockQuantizedState, lr: float = 1e-3,
                 step_bytes: Callable[[int], int] = lambda numel: 0) -> None:
        super().__init__(params, {"lr": lr})
        self.layout = layout
        self.step_bytes = step_bytes

    @torch.no_grad()
    def step(self, closure=None):
        layout = self.layout
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                # under FSDP, torchao's state is of this rank's shard (bitsandbytes' is refused: check_optimizer_run)
                local = p.to_local() if isinstance(p, DTensor) else p
                n = local.numel()
                if not state:
                    quantized = n >= 4096 and (not layout.torchao or n % layout.block == 0)
                    for moment in ("exp_avg", "exp_avg_sq"):
                        if quantized:
                            state[moment] = torch.zeros(n * layout.code_bits // 8, dtype=torch.uint8, device=p.device)
                            state[moment + "_scale"] = torch.zeros(math.ceil(n / layout.block), dtype=torch.float32, device=p.device)
                            if layout.qmap:
                                state[moment + "_qmap"] = torch.zeros(layout.qmap, dtype=torch.float32, device=p.device)
                        else:
                            state[moment] = torch.zeros_like(local, dtype=p.dtype if layout.torchao else torch.float32)
                    if layout.torchao:
                        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                temporaries = torch.empty(self.step_bytes(n), dtype=torch.uint8, device=p.device)
                p.add_(p.grad, alpha=-group["lr"])  # in place, like the fused kernel
                del temporaries


def _build_optimizer(model: nn.Module, run: Run, notes: list[str]) -> torch.optim.Optimizer:
    name = run.optimizer
    if name.lower() in _BLOCK_QUANTIZED:
        layout = _BLOCK_QUANTIZED[name.lower()]
        params = [p for p in model.parameters() if p.requires_grad]
        notes.append(f"{name}'s step does not run on fake tensors: the trace keeps state of the sizes it allocates "
                     f"({layout.code_bits}-bit codes and an fp32 scale per {layout.block} elements for tensors of >= 4096)."
                     + (" torchao compiles that step with torch.compile, whose own memory is not counted (about 80 MB "
                        "more process memory on the CPU for lit-model-5m, benchmarks/memory_ladder.py)." if layout.torchao else ""))
        step_bytes = partial(quantized_step_bytes, name, param_bytes=run.param_bytes, device_type=run.device_type)
        if run.optimizer_in_backward:
            return InBackwardOptimizer([_SimQuantizedAdam([p], layout, step_bytes=step_bytes) for p in params])
        return _SimQuantizedAdam(params, layout, step_bytes=step_bytes)
    if name.lower() == "apollo":
        # APOLLO's step limits its update with a Python max() over a tensor, which fake tensors cannot answer; its
        # state is GaLore's (projected moments and the projection, plus one scalar per matrix), its projection a
        # random matrix where GaLore's SVD needs more temporary memory: GaLore's step stands in for it
        notes.append("APOLLO's step does not run on fake tensors: traced with GaLore's step, which keeps the same "
                     "projected state (APOLLO adds one scalar per matrix) and needs more temporary memory.")
        name = "GaLore"
    if name.lower() == "galore":
        notes.append(f"{run.optimizer} recomputes each matrix's projection every 200 steps, one matrix at a time; "
                     "the traced steps do not include that recomputation.")
    # device_type "cuda" selects the fused AdamW a GPU run uses; fused AdamW also runs on (fake) CPU tensors.
    return build_optimizer(model, name, learning_rate=1e-4, device_type=run.device_type, param_dtype=run.param_dtype,
                           rank=run.optimizer_rank, in_backward=run.optimizer_in_backward)


def _adapt(model: GPT, run: Run, tracker: "_Tracker") -> None:
    """What the scripts do to the model before Fabric sets it up: quantize while loading (bitsandbytes' layers as
    stand-ins of the same tensors), then LoRA or the adapter, or freezing."""
    if run.quantize is not None:
        quantize_model_sim(model, run.quantize, tracker)
    if run.trainable == "lora":
        apply_lora(model, run.lora)
    elif run.trainable == "adapter":
        apply_adapter(model, run.adapter)
    else:
        freeze_layers(model, run.freeze_layers)


def _tied_shapes(model: nn.Module) -> frozenset[tuple[int, ...]]:
    """Shapes of the parameters that sit in two places of the model (a head tied to the embedding)."""
    uses: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        uses[id(param)] = uses.get(id(param), 0) + 1
    return frozenset(tuple(p.shape) for p in model.parameters() if uses[id(p)] > 1)


def _quant_state_bytes(model: nn.Module) -> int:
    return sum(m.quant_statistics.numel() for m in model.modules() if isinstance(m, QuantLinearSim))


class _BuiltInDtype(HalfPrecision):
    """16-bit "true" precision for a model built in its dtype: ``.to(dtype)`` cannot swap fake parameters."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module


class _TraceFabric(Fabric):
    """One CPU process (the fake tensors live on the CPU) whose ``no_backward_sync`` is Fabric's ModelParallelStrategy's
    (the single-device strategy's would do nothing): the step decides when FSDP reduces (TrainStep)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool = True) -> Any:
        return _FSDPNoSync(module._forward_module, enabled)


def _trace_fabric(run: Run) -> Fabric:
    """The run's precision on the CPU: fp16 autocast does not run there; bf16's does and keeps the same bytes."""
    strategy = SingleDeviceStrategy(CPU)
    if run.precision in ("16-true", "bf16-true"):
        return _TraceFabric(accelerator="cpu", devices=1, strategy=strategy, plugins=[_BuiltInDtype(run.precision)])
    precision = "bf16-mixed" if run.precision == "16-mixed" else run.precision
    return _TraceFabric(accelerator="cpu", devices=1, strategy=strategy, precision=precision)


@contextlib.contextmanager
def _fake_process_group(run: Run) -> Iterator[Optional[DeviceMesh]]:
    """For FSDP, the run's ranks as PyTorch's fake process group (collectives that move nothing) and the mesh the
    scripts shard over (``fsdp_mesh`` of Fabric's mesh; HYBRID_SHARD's is two-dimensional), so that this one
    process holds exactly one rank's shards; None for the other strategies. Made before the fake tensors: a mesh
    reads its ranks from a real tensor."""
    if not run.parallel.fsdp:
        yield None
        return
    if dist.is_initialized():  # planner._trace_tensors traces such a run in a fresh process
        raise RuntimeError("this process already belongs to a process group: trace the FSDP run in a fresh process")
    dist.init_process_group("fake", rank=0, world_size=run.world_size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (run.world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
        yield fsdp_mesh(mesh, run.parallel, "cpu")
    finally:
        dist.destroy_process_group()


def _local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of this rank's part of each tensor (a DTensor's local shard)."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return sum(t.numel() * t.element_size() for t in local)


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


def trace_training(run: Run, phases: tuple[str, ...] = ("train_step", "evaluation")) -> TraceResult:
    """Peak tensor bytes of one rank, per phase and category: the fit loop's own step (``TrainStep``: its micro
    batches, loss scaling, backward and optimizer update) and evaluation (``evaluation_sums``) on the run's model,
    set up by a one-process Fabric with the run's precision; under FSDP the model is sharded by the scripts'
    ``parallelize`` over a fake process group of the run's ranks."""
    with _fake_process_group(run) as mesh:
        return _trace(run, phases, mesh)


def _trace(run: Run, phases: tuple[str, ...], mesh: Optional[DeviceMesh]) -> TraceResult:
    start = time.perf_counter()
    notes: list[str] = []
    config = run.config
    B, T = run.micro_batch_size, run.seq_len
    fabric = _trace_fabric(run)
    with FakeTensorMode():
        with default_dtype(run.param_dtype):
            model = GPT(config)
            model.max_seq_length = T
        tracker = _Tracker(vocab_size=config.padded_vocab_size, tied_shapes=_tied_shapes(model))
        _adapt(model, run, tracker)
        model.set_kernel_policy(traced_policy(run.device_type))
        quant_state = _quant_state_bytes(model)  # a buffer: FSDP does not shard it
        # the levers as training applies them (compile's memory is the calibration's), then FSDP's shards over the fake
        # mesh, on the CPU where the fake tensors live
        model = parallelize(model, run.parallel, replace(run.levers, compile=False), mesh, "cpu")
        offloading = offloading_of(model)  # the fake tensors it drops: their bytes are host memory
        # FSDP's cpu_offload: the shards (and their gradients and the optimizer state) live in host memory, where
        # the optimizer steps; the fake tensors all live on the CPU, so their bytes are taken off the device's below
        shards = grad_shards = 0
        if run.parallel.cpu_offload:
            trained = [p for p in model.parameters() if p.requires_grad]
            shards, grad_shards = _local_bytes(model.parameters()), _local_bytes(trained)
            tracker.keep_gradients_on_host(trained)
        model = fabric.setup(model, move_to_device=False)  # built on its (fake) device: nothing to move
        inner = _build_optimizer(model, run, notes)
        for moments in getattr(inner, "moments", ()):  # state an optimizer keeps outside `state` (AdaLomo's)
            for moment in moments.values():
                tracker._update_and_maybe_create_winfos(moment, _Ref.OPT)
        optimizer = fabric.setup_optimizers(inner)
        objective = session_objective(run, optimizer)
        step = TrainStep(fabric, model, optimizer, objective, B, recover=False, report=lambda *_: "")
        vocab = config.padded_vocab_size
        micro_steps = min(run.accumulation, 2)  # from the 2nd micro batch on, gradients are resident
        samples = objective.example_batch(B * micro_steps, run.seq_len, vocab)
        tracker.track_external(*samples)
        results: dict[str, dict[str, int]] = {}
        regions: dict[str, dict[str, dict[str, int]]] = {}
        kernels = _cuda_kernels if run.device_type == "cuda" else contextlib.nullcontext
        try:
            for iteration in range(2):  # the first creates the optimizer state, the second is the steady state
                with kernels(), tracker:
                    tracker.reset_mod_stats()
                    step([samples], "in the plan")
                    step.update(run.grad_clip)
                    if iteration:
                        results["train_step"] = _map_categories(tracker.get_tracker_snapshot("peak")[CPU], quant_state)
                        regions["train_step"] = _map_regions(tracker, quant_state)
        except Exception as error:  # an op fake tensors cannot run; an optimizer step that raised leaves _in_opt set
            raise TraceFailed(tracker.failed_in or tracker._mode(), error) from error
        # what a checkpoint is saved from: the state left after a step (the optimizer's, DDP's buckets)
        results["checkpoint_save"] = _map_categories(tracker.get_tracker_snapshot()[CPU], quant_state)
        optimizer_state = results["checkpoint_save"]["optimizer_state"]
        host = {f"activation_offloading_{run.activation_offloading}": offloading.peak_bytes} if offloading else {}
        if "evaluation" in phases:
            batch = objective.example_batch(run.eval_batch, run.seq_len, vocab)
            tracker.track_external(*batch)
            try:
                with kernels(), tracker:
                    tracker.reset_mod_stats()
                    evaluation_sums(fabric, model, objective, [batch])
                    results["evaluation"] = _map_categories(tracker.get_tracker_snapshot("peak")[CPU], quant_state)
                    regions["evaluation"] = _map_regions(tracker, quant_state)
            except Exception as error:  # the evaluation's own ops (its loss sums) can fail where the step's did not
                raise TraceFailed("evaluation", error) from error
    if run.parallel.cpu_offload:
        # Taking the resident shards and optimizer state off every moment's total bounds the device's peak from
        # above (the optimizer's temporaries stay counted); the gradient shards were filed as host memory as they came.
        for categories in [*results.values(), *(c for stretch in regions.values() for c in stretch.values())]:
            categories["parameters"] -= shards
            categories["optimizer_state"] = max(categories["optimizer_state"] - optimizer_state, 0)
        host["cpu_offload"] = shards + grad_shards + optimizer_state
    regions["checkpoint_save"] = {"0:saved": dict(results["checkpoint_save"])}
    return TraceResult(phases=results, seconds=time.perf_counter() - start, notes=notes, host_bytes=host,
                       regions=regions, values_read=tracker.values_read)


def _map_regions(tracker: _Tracker, quant_state: int) -> dict[str, dict[str, int]]:
    return {key: _map_categories(snap, quant_state) for key, snap in tracker.region_peaks.items()}


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
    changes: dict[str, Any] = {"config": dataclasses.replace(run.config, n_layer=sum(lengths))}
    if run.trainable == "adapter":
        changes["adapter"] = AdapterConfig(run.adapter_prompt_length, lengths[0])
    elif isinstance(run.freeze_layers, int):
        changes["freeze_layers"] = lengths[0]
    return run.replace(**changes)


def trace_by_layers(run: Run, phases: tuple[str, ...] = ("train_step", "evaluation")) -> Optional[TraceResult]:
    """The trace of a deep model from traces of shallow ones. A block's memory is the same in every period of
    blocks, so within each stretch of forward, backward or optimizer ops of a step the memory at the stretch's peak
    is linear in the number of periods of each segment (forward only grows; backward frees a block's activations
    and adds its gradients at the same rate in every period, so its peak stays at the stretch's start or end):
    trace the run with two periods more than each segment's remainder, then with one more period in each segment
    in turn, extrapolate each stretch's peak and take the largest. Which stretch peaks can change with the depth
    (the end of forward in a deep model, the backward in a shallow one), so the phases' peaks are not extrapolated
    themselves. None when the run's blocks do not form segments (see depth_segments), or when the shallow traces
    do not have the same stretches (an optimizer stepping inside backward, per parameter)."""
    segments = depth_segments(run)
    if segments is None:
        return None
    period = layer_period(run)
    # keeping each segment's length modulo the period keeps every block's kind (its index modulo the period); two
    # periods at least so that the first and the last block of a segment differ, as in the deep model. Under FSDP
    # three: a middle block's backward also holds the previous block's reduce-scatter buffer (FSDP2 keeps one in
    # flight), which neither end block does; from two blocks that buffer would be extrapolated once per period.
    periods_kept = 3 if run.parallel.fsdp else 2
    base = [min(length, length % period + periods_kept * period) for length in segments]
    start = time.perf_counter()
    reference = trace_training(with_segments(run, base), phases)
    regions = {phase: {key: dict(categories) for key, categories in stretches.items()}
               for phase, stretches in reference.regions.items()}
    host = dict(reference.host_bytes)
    traced_depths = [sum(base)]
    for index, (length, shallow) in enumerate(zip(segments, base)):
        periods = (length - shallow) // period
        if periods == 0:
            continue
        longer = base[:index] + [shallow + period] + base[index + 1:]
        traced_depths.append(sum(longer))
        step = trace_training(with_segments(run, longer), phases)
        if {p: set(r) for p, r in step.regions.items()} != {p: set(r) for p, r in reference.regions.items()}:
            return None
        for phase, stretches in regions.items():
            for key, categories in stretches.items():
                for category in categories:
                    categories[category] += periods * (step.regions[phase][key][category]
                                                       - reference.regions[phase][key][category])
        for key in host:
            host[key] += periods * (step.host_bytes[key] - reference.host_bytes[key])
    result = {phase: max(stretches.values(), key=lambda c: sum(c.values())) for phase, stretches in regions.items()}
    note = (f"Traced with {', '.join(map(str, traced_depths))} blocks and extrapolated to {run.config.n_layer} "
            f"(the blocks' kinds repeat every {period}).")
    return TraceResult(phases=result, seconds=time.perf_counter() - start, notes=reference.notes + [note], host_bytes=host,
                       regions=regions, values_read=reference.values_read)


def optimizer_state_ratio(run: Run) -> float:
    """State bytes per trainable byte of the run's optimizer, measured: two real steps (random gradients) of a small
    model of linear layers and a norm in the run's parameter dtype, on the CPU. For a step that fake tensors cannot
    run. Per-element state comes out exact; factored or per-tensor state is a larger share of small tensors than of
    a model's, so the ratio bounds it from above."""
    torch.manual_seed(0)
    with default_dtype(run.param_dtype):
        model = nn.Sequential(nn.Linear(64, 256), nn.LayerNorm(256), nn.Linear(256, 64))
    optimizer = build_optimizer(model, run.optimizer, learning_rate=1e-4, device_type="cpu", param_dtype=run.param_dtype)
    for _ in range(2):
        for param in model.parameters():
            param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer_state_bytes(optimizer) / sum(p.numel() * p.element_size() for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The bytes of a (real) optimizer's state tensors, each storage once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for values in optimizer.state.values()
                for t in values.values() if isinstance(t, torch.Tensor)}
    return sum(storages.values())

