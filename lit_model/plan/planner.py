"""The planner: predicted peak memory of a run per rank, by category and phase, against the device's memory,
with the cheapest flag changes that make it fit.

    from lit_model.core.units import parse_memory
    from lit_model.plan import plan_training
    plan = plan_training(Config.from_name("Llama-2-7b-hf"), args, trainable="lora", device_memory=parse_memory("24GB"))
    print(plan.to_text())          # or plan.to_json()
    if not plan.fits:
        args = plan.suggestions[0].apply(args)

Tensor bytes come from the exact trace (``trace.py``) or the closed-form model (``closed_form.py``, engine
"analytic"); the framework overhead on top of them from ``calibration.OVERHEAD``.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import torch

from lit_model.io.checkpoint import WEIGHTS_NAME
from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.infer.load import pipeline_stages
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.plan import closed_form
from lit_model.plan.closed_form import CATEGORIES
from lit_model.plan.calibration import (DEVICE_COUNTS, OVERHEAD, QUALITY_PENALTY, SPEED, cpu_optimizer_library_bytes,
                                         quantized_step_bytes)
from lit_model.core.precision import PRECISION_DTYPES, resolve_precision
from lit_model.parallel.dims import ParallelDims, resolve_parallel_dims
from lit_model.run import (CPU_HEAP_TOP_PAD, Run, canonical_name, changed_flags, check_optimizer_run, render_flags,
                           resolve_cpu_heap, resolve_run)
from lit_model.plan.trace import (
    GenerationTrace, TraceFailed, TraceResult, depth_segments, optimizer_state_ratio, trace_by_layers,
    trace_generation, trace_training,
)
from lit_model.core.units import detect_device_memory, format_bytes, parse_memory
from lit_model.kernels.ops import onednn_kernel_cache_bytes

PHASES = ("train_step", "evaluation", "checkpoint_save")
MLP_TILES_FROM = 2048  # suggest --mlp_tiles for sequences this long: below, the MLP's activations are rarely the issue
# the closed form (closed_form.py) against the trace: each phase's tensors within this share (tests/test_memory_plan.py,
# test_trace_agrees_with_analytic): where it plans a run the trace cannot, it is rounded up by as much
CLOSED_FORM_MARGIN = 0.05
SUGGESTION_MARGIN = 0.02  # a suggestion must fit with this share of the device to spare
WHOLE_TRACE_LAYERS = 8  # deeper models are traced at a few blocks and extrapolated (equal to the whole trace)
MAX_TRACE_LAYERS = 48  # ... and where their blocks do not repeat (--freeze_layers patterns) traced whole up to this
MAX_TRACE_PARAMETERS = 15e9  # depth and size (a 32-layer 7B traces whole in 10-25 s here), else planned analytically
TRACE_PARTS = {"forward": "forward pass", "backward": "backward pass", "optimizer": "optimizer step",  # TraceFailed.part
               "evaluation": "evaluation pass"}


# ---- results -----------------------------------------------------------------------------------------------
@dataclass
class Suggestion:
    """A set of flag changes, the predicted peak with them, and their predicted cost in step time."""

    changes: dict[str, Any]  # flag names (the training args' attribute names) -> new values
    flags: list[str]  # the same as command-line flags
    peak_bytes: int
    speed_factor: float  # predicted step time relative to the current run (>1: slower)
    cost: float  # speed_factor x quality penalties: what the ranking uses
    by_category: dict[str, int]
    notes: list[str] = field(default_factory=list)
    run: Optional[Run] = field(default=None, repr=False, compare=False)  # the run with the changes made

    def apply(self, settings: Any) -> Any:
        """A copy of ``settings`` (TrainArgs or any object with these attributes) with the changes made."""
        new = copy.copy(settings)
        for name, value in self.changes.items():
            setattr(new, name, value)
        return new

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name != "run"}


@dataclass
class Plan:
    peak_bytes: int  # per rank, in the peak phase, overhead included
    by_category: dict[str, int]  # the peak phase's bytes by category; they add up to peak_bytes
    by_phase: dict[str, int]  # each phase's peak
    fits: bool
    device_memory: Optional[int]
    suggestions: list[Suggestion] = field(default_factory=list)
    peak_phase: str = "train_step"
    phase_categories: dict[str, dict[str, int]] = field(default_factory=dict)
    engine: str = "analytic"
    device_type: str = "cuda"
    world_size: int = 1
    run: dict[str, Any] = field(default_factory=dict)  # what was planned (model, precision, batch, ...)
    host_bytes: dict[str, int] = field(default_factory=dict)  # CPU memory outside the device (GPU runs)
    overhead_terms: dict[str, int] = field(default_factory=dict)  # CPU: the peak phase's overhead by term
    notes: list[str] = field(default_factory=list)
    planned: Optional[Run] = field(default=None, repr=False, compare=False)  # the run this plan is for

    @property
    def headroom_bytes(self) -> Optional[int]:
        return None if self.device_memory is None else self.device_memory - self.peak_bytes

    @property
    def tensor_peak_bytes(self) -> int:
        """The peak without framework overhead: what torch.cuda.max_memory_allocated() would report."""
        return self.peak_bytes - self.by_category.get("overhead", 0)

    def replan(self, suggestion: Suggestion, engine: str = "auto") -> "Plan":
        """Plan the suggested run (same device memory)."""
        if suggestion.run is None:
            raise ValueError("Only training plans can be re-planned with a suggestion.")
        return plan_run(suggestion.run, self.device_memory, engine=engine, detect=False)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self) if f.name not in ("planned", "suggestions")}
        data["suggestions"] = [s.to_dict() for s in self.suggestions]
        data["headroom_bytes"] = self.headroom_bytes
        data["tensor_peak_bytes"] = self.tensor_peak_bytes
        data["units"] = "bytes (per rank)"
        return data

    def to_json(self, indent: Optional[int] = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def to_text(self) -> str:
        return _format_text(self)


# ---- overhead --------------------------------------------------------------------------------------------
CPU_SAMPLE_NEW_TOKENS = 100  # the sample at the end of a run (recipes/common.py sample_text): at most this many new tokens


def cpu_overhead_terms(categories: dict[str, int], world_size: int = 1, dequantized: int = 0,
                       gradients_persist: bool = False, gathered: int = 0, adapters: bool = False,
                       new_shapes: bool = False, optimizer_library: int = 0, generation: bool = False,
                       transient_high: int = 0, compiled_trainable_bytes: Optional[int] = None,
                       compiled_decode_parameters: Optional[int] = None, cpu_heap: str = "glibc") -> dict[str, int]:
    """What a CPU training process holds besides these tensor bytes, by term (see calibration.py): the
    imported runtime, the training data, and the heap glibc keeps from freed transient tensors (``dequantized``:
    the weights a quantized model dequantizes and frees in each pass, when the phase runs the model; ``gathered``:
    what FSDP's all-gathers allocate and free in that pass). ``gradients_persist``: the gradients live in buffers
    allocated once (DDP's buckets; each gradient autograd makes is copied in and freed at once), so the step frees no
    gradient-sized heap for glibc to keep. ``adapters``: a LoRA or adapter fine-tune (a term of its own).
    ``new_shapes``: the products change shape from step to step (a mixture of experts' routed rows in 16 bits, on
    oneDNN), so oneDNN's kernel caches fill up: counted full (``ops.onednn_kernel_cache_bytes``).
    ``optimizer_library``: what the optimizer's library adds to the process (``calibration.cpu_optimizer_library_bytes``).
    ``generation``: a generation process (generate/base.py), whose runtime is its own and which reads no training
    data. ``transient_high``: the most transient bytes (activations, logits, gradients) of any stretch of the phase
    (its forward, backward, optimizer step): glibc keeps heap from what was freed before the peak too, where the peak
    falls in a stretch that holds fewer (an 8-bit optimizer's step, after the activations are freed), at its own rate.
    ``compiled_trainable_bytes``: the trainable parameters' bytes when the blocks run torch.compile's code
    (--compile), else None: the compiler's own memory and the heap its kernels leave, which in a LoRA or adapter
    fine-tune takes the place of the eager run's (and does not grow with the activations, which the compiled
    adapters save fewer of). ``compiled_decode_parameters``: a generation process's parameter count when it compiles
    its decode step (generate --compile), else None. ``cpu_heap``: how glibc's heap behaves in the process
    (``Run.cpu_heap``): where the run sets it ("lit_model"), what a trim leaves at the heap's top
    (``run.CPU_HEAP_TOP_PAD``) is counted whole; where the user's mmap threshold returns freed blocks at once
    ("returns_freed"), little is retained."""
    gradients = 0 if gradients_persist else categories.get("gradients", 0)
    transient = categories.get("activations", 0) + categories.get("logits_loss", 0) + gradients + gathered
    after_backward = transient_high + gathered > transient
    transient = max(transient, transient_high + gathered)
    if cpu_heap == "returns_freed":
        retained = OVERHEAD.cpu_allocator_retention_mmap * (transient + dequantized)
    elif generation:
        retained = OVERHEAD.cpu_generation_retention * transient
    else:
        rate = OVERHEAD.cpu_allocator_retention_after_backward if after_backward else OVERHEAD.cpu_allocator_retention
        retained = rate * transient + OVERHEAD.cpu_allocator_retention_dequantized * dequantized
    if generation:
        terms = {"runtime": OVERHEAD.cpu_generation_runtime, "allocator_retention": int(retained)}
        if compiled_decode_parameters is not None:
            terms["compiled_code"] = int(OVERHEAD.cpu_generation_compile_runtime
                                         + OVERHEAD.cpu_generation_compile_per_parameter * compiled_decode_parameters)
        return terms
    terms = {
        "runtime": OVERHEAD.cpu_runtime + (OVERHEAD.cpu_distributed if world_size > 1 else 0),
        "data": OVERHEAD.cpu_data,
        "allocator_retention": int(retained),
    }
    if cpu_heap == "lit_model":
        terms["heap_top_pad"] = CPU_HEAP_TOP_PAD
    if adapters:
        terms["adapter_fine_tuning"] = OVERHEAD.cpu_adapter_fine_tuning
    if new_shapes:
        terms["kernel_cache"] = onednn_kernel_cache_bytes()
    if optimizer_library:
        terms["optimizer_library"] = optimizer_library
    if compiled_trainable_bytes is not None:
        # an adapter fine-tune's compiled blocks save fewer activations than its eager ones (calibration.py), so
        # only a full training's compiler grows with them
        activations = 0 if adapters else categories.get("activations", 0) + categories.get("logits_loss", 0)
        compiler = (OVERHEAD.cpu_compile_runtime + OVERHEAD.cpu_compile_per_parameter_byte * compiled_trainable_bytes
                    + OVERHEAD.cpu_compile_per_activation_byte * activations)
        terms["compiled_code"] = int(max(compiler - terms.get("adapter_fine_tuning", 0), 0))
    return terms


def dequantized_bytes(spec: Run) -> int:
    """The weights a quantized run dequantizes (to the compute dtype) in one pass through the model: every
    block's linear layers (the head stays unquantized)."""
    if spec.quantize is None:
        return 0
    counts = closed_form.param_counts(spec.config)
    return counts.block_linear_weights * counts.n_layer * spec.param_bytes


def gathered_bytes(spec: Run) -> int:
    """What FSDP's all-gathers allocate and free on a rank in one pass through the model (calibration.py):
    ``cpu_fsdp_gather_copies`` x the unsharded parameters."""
    if not spec.parallel.fsdp:
        return 0
    return int(OVERHEAD.cpu_fsdp_gather_copies * closed_form.param_counts(spec.config).total * spec.param_bytes)


def cuda_overhead_bytes(categories: dict[str, int], world_size: int = 1, cuda_alloc_conf: Optional[str] = None,
                        step_fresh: int = 0) -> int:
    """What a CUDA rank holds besides a phase's tensor bytes (see calibration.py): the context, cuBLAS's workspaces,
    NCCL's buffers, and the caching allocator's reserve, which follows its settings (``Run.cuda_alloc_conf``);
    ``step_fresh`` is what is mapped anew on top of that reserve: an optimizer step's temporaries
    (``cuda_step_fresh_bytes``) or a compiled decoding step's own memory (``Overhead.cuda_compiled_decode``). The
    CPU's overhead is ``cpu_overhead_terms``."""
    # the weights are allocated once, at load, and pack without gaps: the reserve follows the other tensors
    moving = sum(size for category, size in categories.items() if category not in ("overhead", "parameters", "logits_loss"))
    fixed = OVERHEAD.cuda_context + OVERHEAD.cuda_workspaces + (OVERHEAD.cuda_nccl_buffers if world_size > 1 else 0)
    settings = (cuda_alloc_conf or "").replace(" ", "").lower()
    expandable = "expandable_segments:true" in settings and "max_split_size_mb" not in settings
    fragmentation = OVERHEAD.cuda_fragmentation_expandable if expandable else OVERHEAD.cuda_fragmentation
    logits = OVERHEAD.cuda_logits_reserve * categories.get("logits_loss", 0)
    return int(fixed + fragmentation * moving + logits + step_fresh)


def cuda_step_fresh_bytes(spec: Run) -> int:
    """CUDA: the temporaries an optimizer step makes for the largest trainable tensor (a rank's shard under FSDP),
    which the caching allocator cannot place in the gaps the freed activations leave (calibration.py,
    ``cuda_step_fresh_copies``); 0 for steps that make none."""
    if spec.device_type != "cuda":
        return 0
    largest = max(closed_form.model_bytes(spec).trainable_tensors, default=0)
    if spec.parallel.fsdp:
        largest = math.ceil(largest / spec.world_size)
    return int(OVERHEAD.cuda_step_fresh_copies * quantized_step_bytes(spec.optimizer, largest, spec.param_bytes, "cuda"))


def _sample_phase(spec: Run) -> dict[str, int]:
    """CPU: rank 0 reloads final/ in fp32 for the sample at the end, after the scripts dropped the trained model and
    its optimizer state (recipes/common.py sample_text): the tensors of generate/base.py's plan alone."""
    new_tokens = min(CPU_SAMPLE_NEW_TOKENS, spec.config.block_size // 2)  # prompt and new tokens within the context
    prompt = min(spec.seq_len, spec.config.block_size - new_tokens)
    generation = plan_generation(spec.config, max(prompt, 1), new_tokens, dtype=torch.float32,
                                 device_type="cpu", detect=False).phase_categories["prefill"]
    return {c: generation.get(c, 0) for c in CATEGORIES if c != "overhead"}


def _gradients_in_buckets(spec: Run) -> bool:
    """DDP's gradients are views into its buckets, allocated once when it wraps the model (they persist)."""
    return spec.parallel.ddp


def _cpu_churn(phase: str, spec: Run) -> dict[str, Any]:
    """``cpu_overhead_terms``' keywords for a phase of this run: the phases that run the model (the step and the
    evaluation) dequantize and all-gather weights; the save and the sample do not."""
    runs_model = phase in ("train_step", "evaluation")
    return {"dequantized": dequantized_bytes(spec) if runs_model else 0,
            "gathered": gathered_bytes(spec) if runs_model else 0,
            "gradients_persist": _gradients_in_buckets(spec), "adapters": spec.trainable in ("lora", "adapter"),
            "new_shapes": bool(spec.config.n_expert) and spec.compute_bytes == 2,  # fp32 experts stay on BLAS
            "optimizer_library": cpu_optimizer_library_bytes(spec.optimizer,
                                                             lambda: closed_form.model_bytes(spec).trainable),
            "compiled_trainable_bytes": (closed_form.model_bytes(spec).trainable * spec.param_bytes if spec.compile
                                         else None)}


def _cpu_terms(phase: str, spec: Run, generation: bool, transient_highs: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """``cpu_overhead_terms``' keywords for a phase of a training run (``transient_highs``: the trace's most transient
    bytes of any stretch of each phase), or of a generation process."""
    if generation:
        return {"generation": True, "cpu_heap": spec.cpu_heap,
                "compiled_decode_parameters": closed_form.param_counts(spec.config).total if spec.compile else None}
    return {**_cpu_churn(phase, spec), "transient_high": (transient_highs or {}).get(phase, 0), "cpu_heap": spec.cpu_heap}


def _finish_phases(phases: dict[str, dict[str, int]], spec: Run, generation: bool = False,
                   transient_highs: Optional[dict[str, int]] = None) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Each phase's categories with its overhead added, and (CPU) that overhead by term, per phase."""
    out, terms = {}, {}
    for name, cats in phases.items():
        cats = {c: int(cats.get(c, 0)) for c in CATEGORIES}
        if spec.device_type == "cpu":
            terms[name] = cpu_overhead_terms(cats, spec.world_size, **_cpu_terms(name, spec, generation, transient_highs))
            cats["overhead"] = sum(terms[name].values())
        else:
            fresh = cuda_step_fresh_bytes(spec) if name == "train_step" and not generation else 0
            if generation and spec.compile:  # the compiled decode step's own memory, on top of the prefill's reserve
                fresh += int(OVERHEAD.cuda_compiled_decode + OVERHEAD.cuda_compiled_decode_kv_copies * cats["kv_cache"])
            cats["overhead"] = cuda_overhead_bytes(cats, spec.world_size, spec.cuda_alloc_conf, fresh)
        out[name] = cats
    return out, terms


# ---- engines ---------------------------------------------------------------------------------------------
def _not_traceable(spec: Run) -> Optional[str]:
    """Why the trace cannot plan this run (None: it can)."""
    if not _traced_whole(spec) and not _traced_by_layers(spec):
        return (f"its blocks differ by parameter-name patterns (--freeze_layers) and it is too large to trace whole "
                f"(over {MAX_TRACE_LAYERS} blocks or {MAX_TRACE_PARAMETERS / 1e9:.0f}B parameters)")
    return None


def _traced_whole(spec: Run) -> bool:
    return (spec.config.n_layer <= MAX_TRACE_LAYERS
            and closed_form.param_counts(spec.config).total <= MAX_TRACE_PARAMETERS)


def _traced_by_layers(spec: Run) -> bool:
    return spec.config.n_layer > WHOLE_TRACE_LAYERS and depth_segments(spec) is not None


def _traceable(spec: Run) -> bool:
    return _not_traceable(spec) is None


Phases = dict[str, dict[str, int]]


def _tensor_phases(spec: Run, engine: str, notes: list[str]) -> tuple[Phases, str, dict[str, int], dict[str, int]]:
    """Tensor bytes per phase (no overhead) from the chosen engine ("trace" and "auto": the trace wherever it can plan
    the run, else the closed form rounded up), the engine used, the bytes the run keeps outside the device (offloaded activations, FSDP's offloaded
    shards), and (traced) each phase's most transient bytes in any of its stretches (``cpu_overhead_terms``)."""
    if engine not in ("auto", "trace", "analytic"):
        raise ValueError(f"engine={engine!r}: use 'auto', 'trace' or 'analytic'")
    if engine in ("auto", "trace"):
        if not _traceable(spec):
            return (*_closed_form_instead(spec, _not_traceable(spec), notes), {})
        try:
            result = _trace_in_fresh_process(spec) if _needs_fresh_process(spec) else _trace_tensors(spec)
            if result is None:
                return (*_closed_form_instead(spec, "the shallow traces of this run differ in the order of their "
                                              "forward, backward and optimizer stretches (an optimizer stepping in "
                                              "backward)", notes), {})
        except Exception as error:  # an op without a fake-tensor implementation
            where, cause = ((f" in the {TRACE_PARTS[error.part]}", str(error)) if isinstance(error, TraceFailed)
                            else ("", f"{type(error).__name__}: {error}"))
            phases, used, host = _closed_form_instead(spec, f"the exact trace failed{where} ({cause[:160]})", notes)
            if canonical_name(spec.optimizer) is None:  # a class path
                _bound_optimizer_state(spec, phases, notes)
            return phases, used, host, {}
        notes.extend(result.notes)
        traced = {name: dict(cats) for name, cats in result.phases.items()}
        if result.values_read:
            traced["train_step"]["optimizer_state"] += _stand_in_margin(spec, result.values_read, notes)
        if _gradients_in_buckets(spec):
            buckets = _trainable_bytes(spec)
            for cats in traced.values():
                cats["gradients"] = max(cats.get("gradients", 0), buckets)
        traced["checkpoint_save"]["checkpoint"] = closed_form.checkpoint_gather_bytes(spec)
        freed = ("activations", "logits_loss") + (() if _gradients_in_buckets(spec) else ("gradients",))
        highs = {phase: max(sum(cats.get(c, 0) for c in freed) for cats in stretches.values())
                 for phase, stretches in result.regions.items() if stretches}
        return traced, "trace", result.host_bytes, highs
    if spec.optimizer == "Sophia":
        notes.append("Sophia: Hessian steps keep the backward graph and use the math attention kernel (estimate).")
    return (*_analytic_phases(spec), {})


def _trace_tensors(spec: Run) -> Optional[TraceResult]:
    """The trace of a traceable run: whole, or from shallow traces (None where those differ in their stretches)."""
    result = trace_by_layers(spec) if _traced_by_layers(spec) else None
    if result is None and not _traced_whole(spec):
        return None
    return result or trace_training(spec)


def _needs_fresh_process(spec: Run) -> bool:
    """The trace shards an FSDP run over a fake process group of its own, which a process that already belongs to a
    process group (the ranks of a run planning --micro_batch_size auto, or an OOM report) cannot make."""
    return spec.parallel.fsdp and torch.distributed.is_available() and torch.distributed.is_initialized()


def _trace_in_fresh_process(spec: Run) -> Optional[TraceResult]:
    """``_trace_tensors`` in a newly started Python process (seconds of imports), its result sent back over a pipe."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_trace_tensors, spec).result()


def _trainable_bytes(spec: Run) -> int:
    return closed_form.model_bytes(spec).trainable * spec.param_bytes


def _stand_in_margin(spec: Run, values_read: int, notes: list[str]) -> int:
    """The step read tensor values, which the trace answered with stand-ins (trace._Tracker._stand_in). lit-model's
    own optimizers read only counts that decide nothing about memory (tests/test_memory_plan.py compares their traced
    state with a real step's); for a class path the plan cannot know, so it rounds the optimizer's memory up by the
    trainable parameters' size: room for a branch the stand-ins skipped that takes a copy of them."""
    if canonical_name(spec.optimizer) is not None:
        return 0
    margin = _trainable_bytes(spec)
    notes.append(f"{spec.optimizer} read {values_read} tensor value(s) during the step (.item()), which the trace "
                 f"answered with stand-ins (1, or False): its state is traced exactly, but a branch that depends on "
                 f"those values may allocate otherwise, so its memory is rounded up by {format_bytes(margin)} (the "
                 "trainable parameters' size).")
    return margin


def _bound_optimizer_state(spec: Run, phases: Phases, notes: list[str]) -> None:
    """The closed form plans a class path as AdamW (two moments): for one whose step the trace could not run, its
    state per trainable byte is measured on a small real model instead (never below the closed form's), and its
    step's temporaries are bounded by the trainable parameters' size."""
    trainable = _trainable_bytes(spec)
    try:
        state = int(optimizer_state_ratio(spec) * trainable)
    except Exception as error:  # a step that needs more than gradients (a closure, a second backward)
        notes.append(f"{spec.optimizer}'s state could not be measured either ({type(error).__name__}); planned as "
                     "AdamW's two moments, which is low for an optimizer that keeps more.")
        return
    for name, categories in phases.items():
        categories["optimizer_state"] = max(categories["optimizer_state"], state) + (trainable if name == "train_step" else 0)
    notes.append(f"{spec.optimizer}'s state measured on a small real model and scaled: {format_bytes(state)} (an upper "
                 f"bound where its state is factored); its step's temporaries bounded by the trainable parameters' "
                 f"size ({format_bytes(trainable)}).")


def _closed_form_instead(spec: Run, why: str, notes: list[str]) -> tuple[Phases, str, dict[str, int]]:
    """The closed form's phases where the trace cannot plan the run, rounded up: every tensor but the parameters (whose
    sizes it knows exactly) by ``CLOSED_FORM_MARGIN``, how far the tests let it stray from the trace."""
    phases, used, host = _analytic_phases(spec)
    for categories in phases.values():
        for category, size in categories.items():
            if category != "parameters":
                categories[category] = math.ceil(size * (1 + CLOSED_FORM_MARGIN))
    notes.append(f"Planned by the closed form, because {why}: a model of the same step that the tests keep within "
                 f"{CLOSED_FORM_MARGIN:.0%} of the trace, so its tensors other than the weights are rounded up by as much.")
    return phases, used, host


def _analytic_phases(spec: Run) -> tuple[Phases, str, dict[str, int]]:
    return closed_form.training_phases(spec), "analytic", _analytic_host_bytes(spec)


def _analytic_host_bytes(spec: Run) -> dict[str, int]:
    if spec.activation_offloading is None:
        return {}
    return {f"activation_offloading_{spec.activation_offloading}": int(closed_form.activations(spec).offloaded)}


def _run_summary(spec: Run) -> dict[str, Any]:
    config = spec.config
    summary = {
        "model": config.name,
        "parameters": closed_form.param_counts(config).total,
        "trainable": spec.trainable,
        "precision": spec.precision,
        "micro_batch_size": spec.micro_batch_size,
        "global_batch_size": spec.global_batch_size,
        "accumulation_steps": spec.accumulation,
        "seq_length": spec.seq_len,
        "world_size": spec.world_size,
        "strategy": spec.parallel.strategy_name,
        "sharding_strategy": spec.parallel.sharding_strategy if spec.parallel.fsdp else None,
        "cpu_offload": spec.parallel.cpu_offload,
        "activation_checkpointing_interval": spec.ac_interval,
        "activation_checkpointing_selective": spec.ac_selective,
        "activation_offloading": spec.activation_offloading,
        "mlp_tiles": spec.mlp_tiles,
        "optimizer": spec.optimizer,
        "optimizer_in_backward": spec.optimizer_in_backward,
        "quantize": spec.quantize,
        "loss_chunk_size": spec.loss_chunk_size,
    }
    if spec.trainable == "lora":
        summary.update(lora_r=spec.lora_r, lora_targets=list(spec.lora_targets))
    return summary


def lora_merge_bytes(spec: Run) -> int:
    """Host memory of a LoRA run's final save on rank 0 (``lora.save_merged_checkpoint``): the base checkpoint read
    whole as stored (its file's size; without one, bf16 as downloaded checkpoints mostly are), and the largest
    adapted weight twice in fp32 while the adapter is added to it."""
    stored = spec.checkpoint_dir / WEIGHTS_NAME if spec.checkpoint_dir is not None else None
    on_disk = stored is not None and stored.is_file()
    base = stored.stat().st_size if on_disk else closed_form.param_counts(spec.config).total * 2
    config = spec.config
    largest = config.n_embd * max(config.intermediate_size, config.n_head * config.head_size)
    return base + 2 * 4 * largest


def _assemble(spec: Run, phases: dict[str, dict[str, int]], device_memory: Optional[int], engine: str,
              notes: list[str], offloaded: Optional[dict[str, int]] = None, generation: bool = False,
              transient_highs: Optional[dict[str, int]] = None) -> Plan:
    """The plan of these tensor phases: each phase's overhead added, and for a training run on the CPU the phases
    of its end (the LoRA merge while saving, the sample). ``generation``: the phases of a generation process.
    ``transient_highs``: see ``_tensor_phases``."""
    merge = lora_merge_bytes(spec) if spec.trainable == "lora" and not generation else 0
    if spec.device_type == "cpu" and "checkpoint_save" in phases:  # the merge and the sample are in this process
        save = phases["checkpoint_save"]
        phases = {**phases, "checkpoint_save": {**save, "checkpoint": save.get("checkpoint", 0) + merge},
                  "sample": _sample_phase(spec)}
    phases, terms = _finish_phases(phases, spec, generation, transient_highs)
    by_phase = {name: sum(cats.values()) for name, cats in phases.items()}
    if device_memory is not None and by_phase.get("sample", 0) > device_memory:  # recipes/common.py sample_text skips it
        notes.append(f"The sample at the end of the run is skipped: reloading final/ in fp32 would take "
                     f"{format_bytes(by_phase.pop('sample'))}.")
        del phases["sample"]
    peak_phase = max(by_phase, key=by_phase.get)
    peak = by_phase[peak_phase]
    fits = True if device_memory is None else peak <= device_memory
    host = dict(offloaded or {})
    if spec.device_type == "cuda":
        host["checkpoint_save_rank0"] = closed_form.host_checkpoint_bytes(spec) + merge
    return Plan(
        peak_bytes=peak, by_category=dict(phases[peak_phase]), by_phase=by_phase, fits=fits, device_memory=device_memory,
        peak_phase=peak_phase, phase_categories=phases, engine=engine, device_type=spec.device_type,
        world_size=spec.world_size, run=_run_summary(spec), host_bytes=host, notes=notes, planned=spec,
        overhead_terms=terms.get(peak_phase, {}),
    )


def _resolve_memory(device_memory: Union[int, str, None], device_type: str, detect: bool) -> Optional[int]:
    if device_memory is not None:
        return parse_memory(device_memory) if isinstance(device_memory, str) else int(device_memory)
    if not detect:
        return None
    if device_type == "cuda" and not torch.cuda.is_available():
        return None
    return detect_device_memory(device_type)


def plan_spec(spec: Run, device_memory: Optional[int] = None, engine: str = "analytic") -> Plan:
    """Plan a resolved ``Run`` (no suggestions): the inner loop of the suggestion search, which skips a run that
    cannot be (a UsageError)."""
    check_optimizer_run(spec)
    notes: list[str] = []
    phases, used, offloaded, highs = _tensor_phases(spec, engine, notes)
    return _assemble(spec, phases, device_memory, used, notes, offloaded, transient_highs=highs)


# ---- public API ------------------------------------------------------------------------------------------
def plan_training(
    config: Config,
    settings: Any,
    trainable: str = "full",
    quantize: Optional[str] = None,
    device_memory: Union[int, str, None] = None,
    device_type: str = "cuda",
    world_size: Optional[int] = None,
    *,
    engine: str = "auto",
    suggest: bool = True,
    max_suggestions: int = 5,
    detect: bool = True,
) -> Plan:
    """Predicted peak memory per rank of training ``config`` with ``settings`` (a script's parsed flags: a
    TrainArgs), resolved by ``lit_model.run.resolve_run`` as the script resolves them, for a device that need
    not be this machine's. The other arguments are ``plan_run``'s and ``resolve_run``'s."""
    if device_type not in ("cuda", "cpu"):
        raise UsageError(f"device_type={device_type!r}: plan for 'cuda' or 'cpu'.")
    run = resolve_run(settings, config, trainable, device_type, present=False, world_size=world_size, quantize=quantize)
    return plan_run(run, device_memory, engine=engine, suggest=suggest, max_suggestions=max_suggestions, detect=detect)


def plan_run(
    run: Run,
    device_memory: Union[int, str, None] = None,
    *,
    engine: str = "auto",
    suggest: bool = True,
    max_suggestions: int = 5,
    detect: bool = True,
) -> Plan:
    """Predicted peak memory per rank of a resolved run. device_memory: bytes or "24GB"; None detects it when
    planning for this machine's device type (``detect``), else the plan has no verdict (fits=True). engine: "trace"
    or its alias "auto" (exact, seconds; the closed form, rounded up and with a note, where the trace cannot plan the
    run) or "analytic" (the closed form alone, milliseconds). ``--micro_batch_size auto`` is planned with the micro
    batch it would pick."""
    memory = _resolve_memory(device_memory, run.device_type, detect)
    notes: list[str] = []
    if run.micro_batch_auto:
        best = max_micro_batch_size(run, memory, confirm_with_trace=False if engine == "analytic" else None) if memory else 1
        run = run.replace(micro_batch_size=max(best, 1), micro_batch_auto=False)
        notes.append(f"--micro_batch_size auto: {max(best, 1)} (the largest that fits with a 10 % margin)"
                     if best else "--micro_batch_size auto: not even 1 fits; planned with 1.")
    if run.loss_chunk_auto:
        chunk = max_loss_chunk_size(run, memory) if memory else DEFAULT_LOSS_CHUNK_SIZE
        run = run.replace(loss_chunk_size=chunk, loss_chunk_auto=False)
        notes.append(f"--loss_chunk_size auto: {chunk} tokens (the largest whose logits fit with a 10 % margin)")
    phases, used, offloaded, highs = _tensor_phases(run, engine, notes)
    plan = _assemble(run, phases, memory, used, notes, offloaded, transient_highs=highs)
    if memory is None:
        plan.notes.append("No device memory given or detected: pass --device_memory (e.g. 24GB) for a verdict.")
    if run.compile:
        plan.notes.append("--compile (each block compiled) is not traced: these are the eager run's tensors, which the "
                          "compiled runs matched or stayed below on a GPU (pretraining pythia-160m: 1 % less allocated; "
                          "LoRA and QLoRA 15-21 % less, which keeps fewer activations; "
                          "benchmarks/results/plan_accuracy_gpu.md); on the CPU the compiler and its code add the "
                          "compiled_code term (an estimate from five runs).")
    if run.config.n_expert and run.device_type == "cpu" and run.compute_bytes == 2:
        plan.notes.append("Half-precision matmuls on the CPU make a kernel for every new expert row count, so the "
                          "process grows over the first steps until oneDNN's capped kernel caches are full: the "
                          "kernel cache term counts them full (benchmarks/results/moe_plan.md).")
    if run.optimizer == "PagedAdamW8bit" and run.device_type == "cuda":
        plan.notes.append("PagedAdamW8bit's state is counted in GPU memory, where it lives until the GPU runs short; "
                          "then CUDA pages it to host memory, so the run may fit below this figure (more slowly).")
    if run.device_type == "cuda":
        plan.notes.append(f"GPU overhead: CUDA context {format_bytes(OVERHEAD.cuda_context)}, cuBLAS workspaces "
                          f"{format_bytes(OVERHEAD.cuda_workspaces)} and the caching allocator's reserve "
                          f"({OVERHEAD.cuda_fragmentation:.0%} of the tensors other than the weights, "
                          f"{OVERHEAD.cuda_fragmentation_expandable:.0%} with expandable segments), measured on one H200 "
                          "(torch 2.11) and rounded up; other GPUs and drivers differ by a few hundred MB "
                          "(benchmarks/results/plan_accuracy_gpu.md).")
        fresh = cuda_step_fresh_bytes(run)
        if fresh:
            plan.notes.append(f"{run.optimizer}'s compiled step makes {format_bytes(fresh)} of temporaries for the "
                              "largest parameter after backward, which the allocator maps anew: counted on top of the "
                              "reserve (an estimate from one H200 run).")
    else:
        terms = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for name, value in plan.overhead_terms.items())
        plan.notes.append(f"CPU overhead per process: {terms} (measured on whole runs here and rounded up; the data term "
                          "is an estimate for the default data, the allocator's for glibc's default settings).")
    if run.parallel.fsdp and run.device_type == "cuda":
        plan.notes.append(
            f"The final checkpoint gathers the full weights into rank 0's CPU memory: "
            f"{format_bytes(plan.host_bytes.get('checkpoint_save_rank0', 0))} of host RAM."
        )
    if suggest and memory is not None and not plan.fits:
        plan.suggestions = suggest_changes(run, memory, max_suggestions, engine=engine)
        if not plan.suggestions:
            plan.notes.append("No combination of up to 3 flag changes fits this device.")
    return plan


def check_plan_fits(plan: Plan) -> None:
    """``--plan``'s exit status, after the plan is printed: 1 (this error) when the run does not fit the device
    and no suggested flag change makes it fit, so a script can test a plan; 0 when it fits or a suggestion does."""
    if plan.fits or plan.suggestions:
        return
    raise UserError(
        f"This run does not fit in {format_bytes(plan.device_memory)} per device, and no combination of up to 3 "
        "flag changes makes it fit (see the plan above): it needs more or larger devices, or a smaller model."
    )


def max_micro_batch_size(
    run: Run,
    budget_bytes: Union[int, str, None] = None,
    margin: float = 0.1,
    confirm_with_trace: Optional[bool] = None,
) -> int:
    """The largest micro batch whose predicted peak is at most ``budget_bytes * (1 - margin)`` and that divides
    the per-rank batch (``global_batch_size / world_size``), so gradient accumulation keeps the global batch.
    0 when not even 1 fits. With the exact trace (``confirm_with_trace=None``: every run the trace can plan): each phase traced at micro batches 1 and 2 and extended along that line, which never
    under-estimates (activations grow linearly with the micro batch, chunked logits less), then the choice
    settled by tracing it and the next larger ones. Otherwise a binary search on the closed form."""
    budget = _resolve_memory(budget_bytes, run.device_type, detect=True)
    if budget is None:
        raise UsageError("max_micro_batch_size needs a memory budget: pass budget_bytes (e.g. '24GB').")
    limit = budget * (1.0 - margin)
    base = run.replace(micro_batch_size=1, micro_batch_auto=False)
    per_rank = base.per_rank_batch
    candidates = [m for m in range(1, per_rank + 1) if per_rank % m == 0]

    traced: dict[int, dict[str, int]] = {}

    def phases(m: int, engine: str) -> dict[str, int]:
        if engine == "trace" and m in traced:
            return traced[m]
        by_phase = plan_spec(base.replace(micro_batch_size=m), budget, engine).by_phase
        if engine == "trace":
            traced[m] = by_phase
        return by_phase

    def fits(m: int, engine: str) -> bool:
        return max(phases(m, engine).values()) <= limit

    if confirm_with_trace is None:
        confirm_with_trace = _traceable(base)
    if confirm_with_trace:
        one = phases(1, "trace")
        two = phases(2, "trace") if per_rank > 1 else one
        line = lambda m: max(one[p] + (m - 1) * (two[p] - one[p]) for p in one)  # noqa: E731
        best = max((i for i, m in enumerate(candidates) if line(m) <= limit), default=-1)
        while best >= 0 and not fits(candidates[best], "trace"):  # should the line ever be below the trace
            best -= 1
        if best < 0:
            return 0
        while best + 1 < len(candidates) and fits(candidates[best + 1], "trace"):
            best += 1
        return candidates[best]
    lo, hi, best = 0, len(candidates) - 1, -1
    while lo <= hi:  # peak grows with the micro batch
        mid = (lo + hi) // 2
        if fits(candidates[mid], "analytic"):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return candidates[best] if best >= 0 else 0


def max_loss_chunk_size(run: Run, budget_bytes: Union[int, str, None] = None, margin: float = 0.1) -> int:
    """``--loss_chunk_size auto``: the largest chunk of tokens (the default times a power of two, up to the micro
    batch's tokens) whose predicted peak stays within ``budget_bytes * (1 - margin)``; the default when no larger one
    does. Larger chunks mean fewer, larger head matmuls (faster on a GPU) and more logits alive at once. On the CPU
    the default: cache-sized chunks are the fastest there (loss.py)."""
    if run.device_type == "cpu":
        return DEFAULT_LOSS_CHUNK_SIZE
    budget = _resolve_memory(budget_bytes, run.device_type, detect=True)
    if budget is None:
        raise UsageError("max_loss_chunk_size needs a memory budget: pass budget_bytes (e.g. '24GB').")
    tokens = run.micro_batch_size * run.seq_len
    best, chunk = DEFAULT_LOSS_CHUNK_SIZE, 2 * DEFAULT_LOSS_CHUNK_SIZE
    while chunk <= tokens:  # the peak grows with the chunk
        if plan_spec(run.replace(loss_chunk_size=chunk, loss_chunk_auto=False), budget, "auto").peak_bytes > budget * (1 - margin):
            break
        best, chunk = chunk, 2 * chunk
    return best


# ---- suggestions -----------------------------------------------------------------------------------------
@dataclass
class _Option:
    key: str  # one option per key in a combination
    changes: dict[str, Any]  # Run fields -> new values, or the LAYOUT_FLAGS (see _changed_run)
    speed: float
    penalty: float = 1.0
    note: str = ""


# Option changes that are flags of the parallel layout, not Run fields; an option with one names "strategy" too
LAYOUT_FLAGS = ("strategy", "cpu_offload")


def _changed_run(run: Run, changes: dict[str, Any]) -> Run:
    """``run`` with an option combination's ``changes``: the layout flags among them lay out its devices anew."""
    changed = run.replace(**{name: value for name, value in changes.items() if name not in LAYOUT_FLAGS})
    if "strategy" not in changes:
        return changed
    return changed.replace(parallel=resolve_parallel_dims(
        changes["strategy"], changed.devices, changed.num_nodes, changes.get("cpu_offload", run.parallel.cpu_offload),
        run.parallel.sharding_strategy))


def _speed(name: str, device_type: str) -> float:
    return SPEED[name]["cuda" if device_type == "cuda" else "cpu"]


def _options(run: Run) -> list[_Option]:
    dev = run.device_type
    options: list[_Option] = []
    if run.ac_interval != 1 or run.ac_selective:
        options.append(_Option("activation_checkpointing", {"ac_interval": 1, "ac_selective": False},
                               _speed("activation_checkpointing", dev)))
    if run.ac_interval == 0:
        options.append(_Option("activation_checkpointing", {"ac_interval": 1, "ac_selective": True},
                               _speed("activation_checkpointing_selective", dev),
                               note="keeps the matmul and attention outputs, recomputes the element-wise ops"))
    # offloading: to host memory from a GPU, to files from the CPU's RAM (not with Sophia's second backward or
    # torch.compile, see train/args.py)
    if run.activation_offloading is None and run.optimizer != "Sophia" and not run.compile:
        target = "cpu" if dev == "cuda" else "disk"
        options.append(_Option("activation_offloading", {"activation_offloading": target},
                               _speed(f"activation_offloading_{target}", dev),
                               note="saved activations wait in host memory" if target == "cpu" else
                               "saved activations wait in files under OUT_DIR/activations (--offload_dir)"))
    if run.mlp_tiles == 1 and run.seq_len >= MLP_TILES_FROM:
        options.append(_Option("mlp_tiles", {"mlp_tiles": 4}, _speed("mlp_tiles", dev),
                               note="the MLP in 4 sequence tiles, recomputed in backward"))
    if run.precision in ("32-true", "bf16-mixed", "16-mixed"):
        speed = _speed("precision_bf16_true_from_32" if run.precision == "32-true" else "precision_bf16_true_from_mixed", dev)
        options.append(_Option("precision", {"precision": "bf16-true"}, speed, QUALITY_PENALTY["precision"],
                               "weights and optimizer state in bfloat16"))
    per_rank = run.per_rank_batch
    smaller = [m for m in range(run.micro_batch_size - 1, 0, -1) if per_rank % m == 0][:4]
    for m in smaller:
        halvings = math.log2(run.micro_batch_size / m)
        options.append(_Option("micro_batch_size", {"micro_batch_size": m}, _speed("halve_micro_batch", dev) ** halvings,
                               note=f"{per_rank // m} accumulation steps keep the global batch of {run.global_batch_size}"))
    if run.optimizer in ("AdamW", "PagedAdamW8bit"):
        options.append(_Option("optimizer", {"optimizer": "AdamW8bit"}, _speed("optimizer_8bit", dev),
                               QUALITY_PENALTY["optimizer"], "needs bitsandbytes"))
    if run.optimizer in ("AdamW", "AdamW8bit", "PagedAdamW8bit"):
        options.append(_Option("optimizer", {"optimizer": "AdamW4bit"}, _speed("optimizer_4bit", dev),
                               QUALITY_PENALTY["optimizer_4bit"], "AdamW with 4-bit moments; needs torchao"))
        if run.trainable == "full":
            options.append(_Option("optimizer", {"optimizer": "GaLore"}, _speed("optimizer_galore", dev),
                                   QUALITY_PENALTY["optimizer_low_rank"],
                                   f"AdamW state of the blocks' matrices projected to rank {run.optimizer_rank}"))
    if not run.steps_in_backward:  # refused where it cannot serve (accumulation, several processes): see check_optimizer_run
        clip = {"grad_clip": 0.0} if run.grad_clip > 0 else {}
        options.append(_Option("optimizer_in_backward", {"optimizer_in_backward": True, **clip},
                               _speed("optimizer_in_backward", dev), QUALITY_PENALTY["grad_clip"] if clip else 1.0,
                               "each gradient freed as soon as its parameter steps" + ("; no gradient clipping" if clip else "")))
    if run.trainable in ("lora", "adapter") and run.quantize is None:
        options.append(_Option("quantize", {"quantize": "bnb.nf4"}, _speed("quantize_nf4", dev),
                               QUALITY_PENALTY["quantize"], "frozen base weights in 4 bits (QLoRA); needs bitsandbytes"))
    if run.loss_chunk_size == 0 or run.loss_chunk_size > DEFAULT_LOSS_CHUNK_SIZE:
        options.append(_Option("loss_chunk_size", {"loss_chunk_size": DEFAULT_LOSS_CHUNK_SIZE}, 1.0,
                               note=f"the default: logits of {DEFAULT_LOSS_CHUNK_SIZE} tokens at a time"))
    if dev == "cuda":  # on the CPU, "offloading" and more processes use the same RAM
        if not run.parallel.cpu_offload:
            options.append(_Option("cpu_offload", {"cpu_offload": True, "strategy": "fsdp"}, _speed("cpu_offload", dev),
                                   note="parameters, gradients and optimizer state in CPU memory (FSDP)"))
        if run.world_size > 1 and not run.parallel.fsdp:
            options.append(_Option("strategy", {"strategy": "fsdp"}, _speed("fsdp_per_doubling", dev),
                                   note=f"parameters, gradients and optimizer state sharded over the {run.world_size} GPUs"))
        for n in DEVICE_COUNTS:  # GPUs per node
            total = n * run.num_nodes
            if n > run.devices and run.global_batch_size % (total * run.micro_batch_size) == 0:
                options.append(_Option(
                    "devices", {"devices": n, "strategy": "fsdp"},
                    _speed("fsdp_per_doubling", dev) ** math.log2(total / run.world_size), QUALITY_PENALTY["devices"],
                    f"needs {total} GPUs; parameters, gradients and optimizer state sharded over them"))
    for t in (run.seq_len // 2, run.seq_len // 4):
        if t >= 64:
            options.append(_Option("override_max_seq_length", {"seq_len": t}, _speed("crop_sequence", dev),
                                   QUALITY_PENALTY["override_max_seq_length"], f"samples longer than {t} tokens are cut"))
    return options


def suggest_changes(run: Run, device_memory: int, limit: int = 5, max_changes: int = 3,
                    engine: str = "auto") -> list[Suggestion]:
    """The cheapest combinations of up to ``max_changes`` flag changes that fit, ranked by predicted slowdown (times
    a penalty for changes that alter what is trained; see calibration.py). Each is a changed run; its flags are the
    difference of the two runs. The closed form screens every combination (microseconds each), letting through what
    it puts within its tested margin of the budget (``CLOSED_FORM_MARGIN``), so that its errors drop no combination
    the trace would fit; each one offered is then planned by ``engine`` (the trace: a second or two, see
    _tensor_phases), whose figures it shows, and dropped if that plan does not fit."""
    options = _options(run)
    budget = device_memory * (1.0 - SUGGESTION_MARGIN)
    screen = budget if engine == "analytic" else budget * (1.0 + CLOSED_FORM_MARGIN)
    fitting: list[tuple[float, int, tuple[int, ...], Plan, float]] = []
    for size in range(1, max_changes + 1):
        for combo in itertools.combinations(range(len(options)), size):
            keys = [options[i].key for i in combo]
            if len(set(keys)) < len(keys):
                continue
            changes: dict[str, Any] = {}
            speed, penalty = 1.0, 1.0
            for i in combo:
                changes.update(options[i].changes)
                speed *= options[i].speed
                penalty *= options[i].penalty
            try:
                plan = plan_spec(_changed_run(run, changes), device_memory, "analytic")
            except UsageError:
                continue
            if plan.peak_bytes <= screen:
                fitting.append((speed * penalty, size, combo, plan, speed))
    fitting.sort(key=lambda f: (f[0], f[1], f[3].peak_bytes))
    chosen: list[tuple[float, int, tuple[int, ...], Plan, float]] = []
    confirmations = 0
    for cost, size, combo, plan, speed in fitting:
        if any(set(c[2]) <= set(combo) and c[0] <= cost for c in chosen):
            continue  # dominated: a subset already fits at no higher cost
        if engine != "analytic":
            if confirmations >= 2 * limit:  # each a trace of seconds to minutes: a plan must come back in time
                break
            confirmations += 1
            plan = plan_spec(plan.planned, device_memory, engine)
            if plan.peak_bytes > budget:
                continue
        chosen.append((cost, size, combo, plan, speed))
        if len(chosen) >= limit:
            break
    suggestions = []
    for cost, _, combo, plan, speed in chosen:
        changed = plan.planned
        flags = changed_flags(run, changed)
        notes = [options[i].note for i in combo if options[i].note]
        suggestions.append(Suggestion(changes=flags, flags=render_flags(flags), peak_bytes=plan.peak_bytes,
                                      speed_factor=round(speed, 3), cost=round(cost, 3), by_category=plan.by_category,
                                      notes=notes, run=changed))
    return suggestions


# ---- generation ------------------------------------------------------------------------------------------
def plan_generation(
    config: Config,
    prompt_length: int,
    max_new_tokens: int,
    batch_size: int = 1,
    dtype: Union[torch.dtype, str, None] = None,
    quantize: Optional[str] = None,
    device_memory: Union[int, str, None] = None,
    device_type: str = "cuda",
    detect: bool = True,
    devices: int = 1,
    compile: bool = False,
) -> Plan:
    """Predicted peak memory of ``generate/base.py``, traced (``trace.trace_generation``): weights (quantized
    linears packed), the KV cache for exactly prompt + new positions (not block_size), the prefill's and the
    decoding step's activations and logits, sampling included. ``dtype``: a torch dtype or a --precision string
    (default bf16 on CUDA, fp32 on the CPU). ``devices``: the GPUs ``--devices`` splits the blocks over
    (generation.pipeline_stages); the plan is the fullest one's, each GPU holding its parts and the bytes the trace
    had in flight at its peak. ``compile``: the decode step is compiled (--compile): on the CPU the compiler and its
    code add a term; the tensors are the eager step's (the last step reads the whole cache either way)."""
    compute_dtype = dtype
    if isinstance(dtype, str) or dtype is None:
        precision = resolve_precision(dtype, device_type, present=False)
        dtype, compute_dtype = PRECISION_DTYPES[precision]
        compute_dtype = compute_dtype or dtype  # -mixed: generation keeps the cache in the autocast dtype
    total = prompt_length + max_new_tokens
    if total > config.block_size:
        raise UsageError(f"Prompt plus new tokens ({total}) exceed {config.name}'s context of {config.block_size} tokens.")
    traced = _generation_trace(config, prompt_length, max_new_tokens, batch_size, dtype, compute_dtype, quantize, device_type)
    stages = {**pipeline_stages(config, devices), "rope": 0}  # the RoPE tables live with the embedding
    phases: dict[str, dict[str, int]] = {}
    fullest, fullest_bytes = 0, -1
    for stage in range(devices):
        parts = [part for part, where in stages.items() if where == stage]
        runs_blocks = any(part.startswith("blocks.") for part in parts)
        head_here = stages["lm_head"] == stage
        stage_phases = {}
        for phase, in_flight in traced.transient.items():
            categories = {c: 0 for c in CATEGORIES}
            for part in parts:
                for category, size in traced.resident[part].items():
                    categories[category] += size
            if head_here:
                for category in ("activations", "quantization", "logits_loss"):
                    categories[category] += in_flight[category]
            elif runs_blocks:  # the trace's peak in flight bounds every moment's, wherever in the model it fell
                categories["activations"] += in_flight["activations"] + in_flight["logits_loss"]
                categories["quantization"] += in_flight["quantization"]
            stage_phases[phase] = categories
        if quantize is not None and runs_blocks:
            # load_weights streams one block at a time in ``dtype`` and quantizes it before the next: at the last,
            # every other part is resident and one block's linear weights wait unquantized (no KV cache yet)
            load = {c: 0 if c == "kv_cache" else sum(traced.resident[part].get(c, 0) for part in parts) for c in CATEGORIES}
            load["quantization"] += staged_block_bytes(config, dtype)
            stage_phases = {"load": load, **stage_phases}
        stage_bytes = max(sum(cats.values()) for cats in stage_phases.values())
        if stage_bytes > fullest_bytes:
            phases, fullest, fullest_bytes = stage_phases, stage, stage_bytes
    B = batch_size
    kv = sum(part["kv_cache"] for part in traced.resident.values())
    spec = Run(config=config, precision="bf16-true", device_type=device_type, devices=devices, num_nodes=1,
               parallel=ParallelDims(dp_replicate=1, dp_shard=1),
               micro_batch_size=B, global_batch_size=B, seq_len=total, compile=compile,
               cpu_heap=resolve_cpu_heap(device_type, sets_heap=False))
    memory = _resolve_memory(device_memory, device_type, detect)
    plan = _assemble(spec, phases, memory, "trace", [], generation=True)
    plan.run = {"model": config.name, "parameters": closed_form.param_counts(config).total,
                "dtype": str(dtype).replace("torch.", ""), "quantize": quantize, "batch_size": B,
                "prompt_length": prompt_length, "max_new_tokens": max_new_tokens,
                "kv_cache_bytes": kv, "kv_cache_positions": total, "devices": devices}
    plan.host_bytes = {}
    plan.notes.append(f"KV cache: {format_bytes(kv)} for {total} positions (prompt + new tokens), allocated once.")
    if devices > 1:
        held = sorted(int(part.split(".")[1]) for part, where in stages.items() if where == fullest and part.startswith("blocks."))
        plan.notes.append(f"--devices {devices}: consecutive blocks on consecutive GPUs; this is GPU {fullest}'s memory "
                          f"({f'blocks {held[0]}-{held[-1]}' if held else 'no blocks'}"
                          + (", the embedding" if stages["embed"] == fullest else "")
                          + (", the head" if stages["lm_head"] == fullest else "") + "), the fullest of them.")
    if compile:
        plan.notes.append("--compile: the decode step's tensors are the eager step's (not traced compiled); on the CPU "
                          "the compiler and its code add the compiled_code term (measured on five runs here)."
                          if device_type == "cpu" else
                          f"--compile: the decode step's tensors are the eager step's (not traced compiled); the compiled "
                          f"step's own memory is counted as a copy of the KV cache and "
                          f"{format_bytes(OVERHEAD.cuda_compiled_decode)} of reserve in the overhead (an estimate from one "
                          "H200 run, rounded up; benchmarks/results/plan_accuracy_gpu.md).")
    if memory is not None and not plan.fits:
        plan.suggestions = _generation_suggestions(config, prompt_length, max_new_tokens, batch_size, dtype, quantize,
                                                   memory, device_type, devices, compile)
    return plan


def _generation_suggestions(config, prompt_length, max_new_tokens, batch_size, dtype, quantize, memory, device_type, devices,
                            compile):
    options = []
    if quantize is None:
        options += [({"quantize": "bnb.nf4"}, 1.5), ({"quantize": "bnb.int8"}, 2.0)]
    if dtype == torch.float32:
        options.append(({"precision": "bf16-true"}, 1.0))
    if batch_size > 1:
        options.append(({"num_samples": max(1, batch_size // 2)}, 1.0))
    out = []
    for changes, speed in options:
        q = changes.get("quantize", quantize)
        dt = torch.bfloat16 if "precision" in changes else dtype
        b = changes.get("num_samples", batch_size)
        p = plan_generation(config, prompt_length, max_new_tokens, b, dt, q, memory, device_type, detect=False, devices=devices,
                            compile=compile)
        if p.fits:
            out.append(Suggestion(changes=changes, flags=render_flags(changes), peak_bytes=p.peak_bytes, speed_factor=speed,
                                  cost=speed, by_category=p.by_category))
    return sorted(out, key=lambda s: s.cost)


def staged_block_bytes(config: Config, dtype: torch.dtype) -> int:
    """One block's linear weights in the checkpoint's load dtype: what a quantized load holds unquantized at once."""
    return closed_form.param_counts(config).block_linear_weights * dtype.itemsize


_GENERATION_TRACES: dict[tuple, GenerationTrace] = {}


def _generation_trace(config: Config, *args: Any) -> GenerationTrace:
    """``trace_generation``, once per configuration and arguments: a training plan on the CPU plans its final
    sample with it, once for each of the many runs its suggestion search screens."""
    key = (repr(config), *args)
    if key not in _GENERATION_TRACES:
        _GENERATION_TRACES[key] = trace_generation(config, *args)
    return _GENERATION_TRACES[key]


# ---- text ------------------------------------------------------------------------------------------------
def _describe(plan: Plan) -> str:
    r = plan.run
    if "prompt_length" in r:
        return (f"{r['model']} generation, {r['dtype']}{', ' + r['quantize'] if r['quantize'] else ''}, batch "
                f"{r['batch_size']}, prompt {r['prompt_length']} + {r['max_new_tokens']} new tokens")
    what = {"full": "full training", "lora": f"LoRA r={r.get('lora_r')} ({', '.join(r.get('lora_targets', []))})",
            "adapter": "LLaMA-Adapter"}[r["trainable"]]
    parts = [r["model"], what, r["precision"]]
    if r.get("quantize"):
        parts.append(r["quantize"])
    parts.append(f"micro batch {r['micro_batch_size']} x {r['seq_length']} tokens"
                 + (f" ({r['accumulation_steps']} accumulation steps)" if r["accumulation_steps"] > 1 else ""))
    if r["activation_checkpointing_interval"]:
        parts.append(("selective " if r.get("activation_checkpointing_selective") else "") + "activation checkpointing"
                     + (f" every {r['activation_checkpointing_interval']} blocks"
                        if r["activation_checkpointing_interval"] > 1 else ""))
    if r.get("activation_offloading"):
        parts.append(f"activations offloaded to {'host memory' if r['activation_offloading'] == 'cpu' else 'disk'}")
    if r.get("mlp_tiles", 1) > 1:
        parts.append(f"MLP in {r['mlp_tiles']} tiles")
    parts.append(f"{r['optimizer']}" + (" stepped in backward" if r.get("optimizer_in_backward") else ""))
    unit = "GPU" if plan.device_type == "cuda" else "process"
    ranks = f"{r['world_size']} {unit}{('es' if unit == 'process' else 's') if r['world_size'] > 1 else ''}"
    parts.append(ranks + (f" ({r['strategy']}{', CPU offload' if r['cpu_offload'] else ''})" if r["world_size"] > 1 or r["cpu_offload"] else ""))
    return ", ".join(parts)


def _format_text(plan: Plan) -> str:
    lines = [f"Memory plan (per rank): {_describe(plan)}",
             f"engine: {plan.engine} ({'exact tensor trace' if plan.engine == 'trace' else 'closed-form model'}) + overhead; device: {plan.device_type}", ""]
    phases = list(plan.phase_categories)
    header = f"{'':18s}" + "".join(f"{p:>17s}" for p in phases)
    lines.append(header)
    for cat in CATEGORIES:
        values = [plan.phase_categories[p].get(cat, 0) for p in phases]
        if not any(values):
            continue
        lines.append(f"{cat:18s}" + "".join(f"{format_bytes(v):>17s}" for v in values))
    lines.append(f"{'total':18s}" + "".join(f"{format_bytes(plan.by_phase[p]):>17s}" for p in phases))
    lines.append("")
    verdict = f"peak: {format_bytes(plan.peak_bytes)} in {plan.peak_phase}"
    if plan.device_memory is None:
        verdict += " (no device memory to compare with)"
    elif plan.fits:
        verdict += f" -> FITS in {format_bytes(plan.device_memory)} ({format_bytes(plan.headroom_bytes)} to spare)"
    else:
        verdict += f" -> DOES NOT FIT in {format_bytes(plan.device_memory)} ({format_bytes(-plan.headroom_bytes)} over)"
    lines.append(verdict)
    for key, value in plan.host_bytes.items():
        lines.append(f"host memory, {key.replace('_', ' ')}: {format_bytes(value)}")
    if plan.suggestions:
        lines += ["", "Changes that make it fit (cheapest first; step time relative to this run):"]
        for i, s in enumerate(plan.suggestions, 1):
            note = f"  [{'; '.join(s.notes)}]" if s.notes else ""
            lines.append(f"{i:2d}. {' '.join(s.flags):60s} peak {format_bytes(s.peak_bytes):>10s}  step time x{s.speed_factor:.2f}{note}")
    if plan.notes:
        lines += [""] + [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
