"""The training planner's engine: a resolved run's tensor bytes per phase from the exact trace (``trace.py``), run
whole, by a few blocks and extrapolated, or in a fresh process, or, where the trace cannot plan the run, from the
closed form (``closed_form.py``) rounded up; then the phases of the run's end (the LoRA merge, the sample) and the
framework overhead (``overhead.py``) added: ``plan_spec``. ``training.py`` (``plan_run``) and ``search.py`` build
on it.
"""

from __future__ import annotations

import math
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Optional

import torch

from lit_model.core.units import format_bytes
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, blocks_for, read_bytes
from lit_model.plan.calibration import PCIE_BYTES_PER_S
from lit_model.io.checkpoint import WEIGHTS_NAME
from lit_model.plan import closed_form
from lit_model.plan.closed_form import CATEGORIES
from lit_model.plan.generation import generation_dtypes, plan_generation
from lit_model.plan.overhead import _finish_phases, _gradients_in_buckets
from lit_model.plan.report import Plan, plan_of_phases
from lit_model.plan.trace import (TraceFailed, TraceResult, depth_segments, optimizer_state_ratio, trace_by_layers,
                                  trace_training)
from lit_model.run import Run, canonical_name, check_optimizer_run

# the closed form (closed_form.py) against the trace: each phase's tensors within this share (tests/test_memory_plan.py,
# test_trace_agrees_with_analytic): where it plans a run the trace cannot, it is rounded up by as much
CLOSED_FORM_MARGIN = 0.05
WHOLE_TRACE_LAYERS = 8  # deeper models are traced at a few blocks and extrapolated (equal to the whole trace)
MAX_TRACE_LAYERS = 48  # ... and where their blocks do not repeat (--freeze_layers patterns) traced whole up to this
MAX_TRACE_PARAMETERS = 15e9  # depth and size (a 32-layer 7B traces whole in 10-25 s here), else planned analytically
TRACE_PARTS = {"forward": "forward pass", "backward": "backward pass", "optimizer": "optimizer step",  # TraceFailed.part
               "evaluation": "evaluation pass"}
CPU_SAMPLE_NEW_TOKENS = 100  # the sample at the end of a run (recipes/common.py sample_text): at most this many new tokens


def _sample_phase(spec: Run) -> dict[str, int]:
    """CPU: rank 0 reloads final/ in fp32 for the sample at the end, after the scripts dropped the trained model and
    its optimizer state (recipes/common.py sample_text): the tensors of generate/base.py's plan alone."""
    new_tokens = min(CPU_SAMPLE_NEW_TOKENS, spec.config.block_size // 2)  # prompt and new tokens within the context
    prompt = min(spec.seq_len, spec.config.block_size - new_tokens)
    generation = plan_generation(spec.config, max(prompt, 1), new_tokens, dtype=torch.float32,
                                 device_type="cpu", detect=False).phase_categories["prefill"]
    return {c: generation.get(c, 0) for c in CATEGORIES if c != "overhead"}


def _rollout_phase(spec: Run, after_step: dict[str, int]) -> dict[str, int]:
    """GRPO (``spec.grpo``): R completions (``GRPOSpec.rollout_rows``: whole groups, as many as a micro batch
    holds) generated between steps with the training weights: what a step leaves (the weights, the optimizer state)
    plus generate/base.py's plan of that batch without its weights: the KV cache of R x (the longest prompt +
    --max_new_tokens) positions and the prefill's or a decoding step's activations, whichever is larger. The cache
    is removed before the step (infer/rollout.py)."""
    grpo = spec.grpo
    rows = grpo.rollout_rows(spec.micro_batch_size)
    prompt = max(spec.seq_len - grpo.max_new_tokens, 1)
    generation = plan_generation(spec.config, prompt, grpo.max_new_tokens, rows, spec.precision,
                                 spec.quantize, device_type=spec.device_type, detect=False).phase_categories
    kept = ("parameters", "quantization", "optimizer_state")
    largest = max(generation.values(), key=lambda c: sum(v for k, v in c.items() if k not in (*kept, "overhead")))
    phase = {c: after_step.get(c, 0) if c in kept else largest.get(c, 0) for c in CATEGORIES if c != "overhead"}
    # the engine's paged pool rounds each sequence up to whole blocks, and a decoding step gathers a layer's cache
    positions = blocks_for(spec.seq_len, DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
    phase["kv_cache"] += phase["kv_cache"] * (positions - spec.seq_len) // spec.seq_len
    phase["activations"] += read_bytes(spec.config, rows, positions, "auto",
                                       generation_dtypes(spec.precision, spec.device_type)[1])
    return phase


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
        "seq_length_source": spec.seq_len_source or "--override_max_seq_length, else the model's context",
        "packing": spec.packing,
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
              notes: list[str], offloaded: Optional[dict[str, int]] = None,
              transient_highs: Optional[dict[str, int]] = None, kind: type[Plan] = Plan) -> Plan:
    """The plan of a training run's tensor phases: each phase's overhead added, and on the CPU the phases of the
    run's end (the LoRA merge while saving, the sample). ``transient_highs``: see ``_tensor_phases``. ``kind``: the
    class of the plan; ``plan_run`` hands out ``training.TrainingPlan``s, which re-plan through the search above
    this module."""
    merge = lora_merge_bytes(spec) if spec.trainable == "lora" else 0
    if spec.device_type == "cpu" and "checkpoint_save" in phases:  # the merge and the sample are in this process
        save = phases["checkpoint_save"]
        # the merge reads the base after the checkpoint's copies are freed: glibc keeps those for it to fill, unless
        # freed blocks go back at once (an FSDP process's heap, or the user's threshold), where only the larger counts
        returned = spec.heap_mode in ("returns_freed", "lit_model_sharded")
        checkpoint = max(save.get("checkpoint", 0), merge) if returned else save.get("checkpoint", 0) + merge
        phases = {**phases, "checkpoint_save": {**save, "checkpoint": checkpoint}, "sample": _sample_phase(spec)}
    if spec.grpo is not None and "checkpoint_save" in phases:
        phases = {**phases, "rollout": _rollout_phase(spec, phases["checkpoint_save"])}
    phases, terms = _finish_phases(phases, spec, transient_highs=transient_highs)
    sample = sum(phases.get("sample", {}).values())
    if device_memory is not None and sample > device_memory:  # recipes/common.py sample_text skips it
        notes.append(f"The sample at the end of the run is skipped: reloading final/ in fp32 would take "
                     f"{format_bytes(sample)}.")
        del phases["sample"]
    host = dict(offloaded or {})
    if spec.device_type == "cuda":
        host["checkpoint_save_rank0"] = closed_form.host_checkpoint_bytes(spec) + merge
    plan = plan_of_phases(spec, phases, terms, device_memory, engine, notes, host, _run_summary(spec), kind)
    if pageable_bytes(plan):
        _page_optimizer_state(plan)
    return plan


def _page_optimizer_state(plan: Plan) -> None:
    """PagedAdamW8bit keeps its state in CUDA managed memory, which pages to host memory when the GPU runs short: a
    run over the device by at most its state fits, with that much of it paged (and slower: the paged part crosses
    PCIe to be stepped and back every step)."""
    state = pageable_bytes(plan)
    over = -plan.headroom_bytes if plan.device_memory is not None else 0
    if 0 < over <= state:
        plan.paged_bytes, plan.fits = over, True
        seconds = 2 * over / PCIE_BYTES_PER_S
        plan.notes.append(f"PagedAdamW8bit's state lives in CUDA managed memory: the run fits with at least "
                          f"{format_bytes(over)} of it paged to host memory (that much more host RAM), which crosses PCIe "
                          f"to be stepped and back every step: about {seconds:.1f} s more per step at "
                          f"{PCIE_BYTES_PER_S / 1e9:.0f} GB/s (an estimate, not measured).")
    else:
        plan.notes.append("PagedAdamW8bit's state is counted in GPU memory, where it lives until the GPU runs short; "
                          "then CUDA pages it to host memory" + (" (here it would not suffice: the rest of the run is "
                                                                 "over the device too)." if over > state else "."))


def pageable_bytes(plan: Plan) -> int:
    """What of the plan's peak CUDA may page to host memory rather than run out: PagedAdamW8bit's state."""
    if plan.planned is None or plan.planned.optimizer != "PagedAdamW8bit" or plan.device_type != "cuda":
        return 0
    return plan.by_category.get("optimizer_state", 0)


def plan_spec(spec: Run, device_memory: Optional[int] = None, engine: str = "analytic") -> Plan:
    """Plan a resolved ``Run`` (no suggestions): the inner loop of the suggestion search, which skips a run that
    cannot be (a UsageError)."""
    check_optimizer_run(spec)
    notes: list[str] = []
    phases, used, offloaded, highs = _tensor_phases(spec, engine, notes)
    return _assemble(spec, phases, device_memory, used, notes, offloaded, transient_highs=highs)


