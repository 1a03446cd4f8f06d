"""The searches over a training run's flags, each plan from ``planner.plan_spec``: the largest micro batch and loss
chunk that fit (``--micro_batch_size auto``, ``--loss_chunk_size auto``), and the cheapest flag changes that make a
run fit (``suggest_changes``: the options, their speed and quality costs from ``calibration.py``)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

from lit_model.core.errors import UsageError
from lit_model.core.units import format_bytes
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.parallel.dims import resolve_parallel_dims
from lit_model.plan.calibration import DEVICE_COUNTS, QUALITY_PENALTY, SPEED
from lit_model.plan.planner import CLOSED_FORM_MARGIN, _traceable, pageable_bytes, plan_spec
from lit_model.plan.report import Plan, Suggestion, _resolve_memory
from lit_model.run import (BITSANDBYTES_OPTIMIZERS, WHOLE_MATRIX_OPTIMIZERS, Run, changed_flags, render_flags,
                           steps_in_backward)

MLP_TILES_FROM = 2048  # suggest --mlp_tiles for sequences this long: below, the MLP's activations are rarely the issue
SUGGESTION_MARGIN = 0.02  # a suggestion must fit with this share of the device to spare


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


def _give_way(run: Run, changes: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``changes`` with what the user gave that they cannot work with changed too, and a note for each: a fix is
    offered even where one of the user's flags blocks it (check_optimizer_run, train/args.py's combinations); what the
    combination itself changes is never undone (a combination in conflict with itself is skipped). FSDP
    (--cpu_offload, --strategy fsdp) steps sharded parameters, which bitsandbytes' and the whole-matrix optimizers
    cannot, and averages gradients before any step, which a step in backward comes before; accumulated micro batches
    cannot be stepped in backward either; torch.compile does not trace offloading's hooks."""
    changed = _changed_run(run, changes)
    extra: dict[str, Any] = {}
    notes: list[str] = []
    if ("optimizer" not in changes and changed.parallel.fsdp
            and changed.optimizer in (*BITSANDBYTES_OPTIMIZERS, *WHOLE_MATRIX_OPTIMIZERS)):
        extra["optimizer"] = "AdamW"
        notes.append(f"--optimizer AdamW: FSDP's sharded parameters cannot be stepped by {changed.optimizer}")
    accumulates = changed.accumulation > 1 or changed.parallel.fsdp or changed.world_size > 1
    if ("optimizer_in_backward" not in changes and accumulates
            and steps_in_backward(extra.get("optimizer", changed.optimizer), changed.optimizer_in_backward)):
        if changed.optimizer_in_backward:
            extra["optimizer_in_backward"] = False
        if changed.optimizer == "AdaLomo" and "optimizer" not in changes:
            extra["optimizer"] = "AdamW"
        notes.append("the optimizer steps after backward, once "
                     + ("FSDP averaged the gradients" if changed.parallel.fsdp or changed.world_size > 1
                        else "the micro batches' gradients are accumulated"))
    if "compile" not in changes and changed.compile and changed.activation_offloading is not None:
        extra["compile"] = False
        notes.append("no --compile: it does not trace offloading's hooks")
    return {**changes, **extra}, notes


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
    if run.activation_offloading is None and run.optimizer != "Sophia":  # with --compile: see _give_way
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
    fitting: list[tuple[float, int, tuple[int, ...], Plan, float, list[str]]] = []
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
            changes, gave_way = _give_way(run, changes)
            try:
                plan = plan_spec(_changed_run(run, changes), device_memory, "analytic")
            except UsageError:
                continue
            if plan.peak_bytes - pageable_bytes(plan) <= screen:  # PagedAdamW8bit: fits with its state paged
                fitting.append((speed * penalty, size, combo, plan, speed, gave_way))
    # the changes that fit the device whole first, then those that fit with paged optimizer state (slower)
    fitting.sort(key=lambda f: (f[3].peak_bytes > screen, f[0], f[1], f[3].peak_bytes))
    chosen: list[tuple[float, int, tuple[int, ...], Plan, float, list[str]]] = []
    confirmations = 0
    for cost, size, combo, plan, speed, gave_way in fitting:
        if any(set(c[2]) <= set(combo) and c[0] <= cost for c in chosen):
            continue  # dominated: a subset already fits at no higher cost
        if engine != "analytic":
            if confirmations >= 2 * limit:  # each a trace of seconds to minutes: a plan must come back in time
                break
            confirmations += 1
            plan = plan_spec(plan.planned, device_memory, engine)
            if plan.peak_bytes - pageable_bytes(plan) > budget:
                continue
        chosen.append((cost, size, combo, plan, speed, gave_way))
        if len(chosen) >= limit:
            break
    suggestions = []
    for cost, _, combo, plan, speed, gave_way in chosen:
        changed = plan.planned
        flags = changed_flags(run, changed)
        notes = [options[i].note for i in combo if options[i].note] + gave_way
        if plan.peak_bytes > budget:
            notes.append(f"fits with at least {format_bytes(plan.peak_bytes - budget)} of PagedAdamW8bit's state paged "
                         "to host memory (slower)")
        suggestions.append(Suggestion(changes=flags, flags=render_flags(flags), peak_bytes=plan.peak_bytes,
                                      speed_factor=round(speed, 3), cost=round(cost, 3), by_category=plan.by_category,
                                      notes=notes, run=changed))
    return suggestions


