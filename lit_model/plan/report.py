"""A plan's report: ``Plan`` and ``Suggestion``, the plan of phases against the device's memory, its text and JSON,
and ``--plan``'s exit status. Shared by the training planner (``planner.py``, ``training.py``) and generation's
(``generation.py``); it imports nothing of the training stack."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Union

import torch

from lit_model.core.errors import UserError
from lit_model.core.units import detect_device_memory, format_bytes, parse_memory
from lit_model.plan.closed_form import CATEGORIES
from lit_model.run import Run


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
    # optimizer state CUDA must page to host memory for the run to fit (PagedAdamW8bit; fits says so then)
    paged_bytes: int = 0

    @property
    def headroom_bytes(self) -> Optional[int]:
        return None if self.device_memory is None else self.device_memory - self.peak_bytes

    @property
    def tensor_peak_bytes(self) -> int:
        """The peak without framework overhead: what torch.cuda.max_memory_allocated() would report."""
        return self.peak_bytes - self.by_category.get("overhead", 0)

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


def plan_of_phases(spec: Run, phases: dict[str, dict[str, int]], terms: dict[str, dict[str, int]],
                   device_memory: Optional[int], engine: str, notes: list[str], host: dict[str, int],
                   run: dict[str, Any], kind: type[Plan] = Plan) -> Plan:
    """The plan of ``spec``'s phases, their overhead included (``terms``: the CPU's overhead by term, per phase):
    the phase that peaks, and whether it fits ``device_memory``. ``run``: what was planned, for the report."""
    by_phase = {name: sum(cats.values()) for name, cats in phases.items()}
    peak_phase = max(by_phase, key=by_phase.get)
    peak = by_phase[peak_phase]
    fits = True if device_memory is None else peak <= device_memory
    return kind(
        peak_bytes=peak, by_category=dict(phases[peak_phase]), by_phase=by_phase, fits=fits, device_memory=device_memory,
        peak_phase=peak_phase, phase_categories=phases, engine=engine, device_type=spec.device_type,
        world_size=spec.world_size, run=run, host_bytes=host, notes=notes, planned=spec,
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


def check_plan_fits(plan: Plan) -> None:
    """``--plan``'s exit status, after the plan is printed: 1 (this error) when the run does not fit the device
    and no suggested flag change makes it fit, so a script can test a plan; 0 when it fits or a suggestion does."""
    if plan.fits or plan.suggestions:
        return
    raise UserError(
        f"This run does not fit in {format_bytes(plan.device_memory)} per device, and no combination of up to 3 "
        "flag changes makes it fit (see the plan above): it needs more or larger devices, or a smaller model."
    )


def _describe(plan: Plan) -> str:
    r = plan.run
    if "scored_length" in r:
        return (f"{r['model']} evaluation, {r['dtype']}{', ' + r['quantize'] if r['quantize'] else ''}, batch "
                f"{r['batch_size']}: requests of up to {r['scored_length']} tokens (the context)")
    if "prompt_length" in r:
        return (f"{r['model']} generation, {r['dtype']}{', ' + r['quantize'] if r['quantize'] else ''}, batch "
                f"{r['batch_size']}, prompt {r['prompt_length']} + {r['max_new_tokens']} new tokens")
    what = {"full": "full training", "lora": f"LoRA r={r.get('lora_r')} ({', '.join(r.get('lora_targets', []))})",
            "adapter": "LLaMA-Adapter"}[r["trainable"]]
    parts = [r["model"], what, r["precision"]]
    if r.get("quantize"):
        parts.append(r["quantize"])
    parts.append(f"micro batch {r['micro_batch_size']} x {r['seq_length']} tokens"
                 + (" (the data's longest sample)" if r.get("seq_length_source", "").startswith("the longest") else "")
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
    elif plan.paged_bytes:
        verdict += (f" -> FITS in {format_bytes(plan.device_memory)} with at least {format_bytes(plan.paged_bytes)} of "
                    f"the optimizer's state ({format_bytes(plan.by_category.get('optimizer_state', 0))}) paged to host memory")
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
