"""The plan of a generation (generate/base.py, chat): ``plan_generation`` and its suggestions, from the trace of
generation (``trace_generation.py``). It imports nothing of the training stack (lightning, ``train/``, the training
trace), so that generate and chat import it at no cost to their start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lit_model.core.config import Config
from lit_model.core.errors import UsageError
from lit_model.core.precision import PRECISION_DTYPES, resolve_precision
from lit_model.core.units import format_bytes
from lit_model.infer.load import pipeline_stages
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, blocks_for, read_bytes
from lit_model.parallel.dims import ParallelDims
from lit_model.plan import closed_form
from lit_model.plan.calibration import OVERHEAD
from lit_model.plan.closed_form import CATEGORIES
from lit_model.plan.overhead import _finish_phases
from lit_model.plan.report import Plan, Suggestion, _resolve_memory, plan_of_phases
from lit_model.plan.trace_generation import GenerationTrace, trace_generation
from lit_model.run import Run, render_flags, resolve_cpu_heap


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
    paged: bool = False,
) -> Plan:
    """Predicted peak memory of ``generate/base.py``, traced (``trace_generation.py``): weights (quantized
    linears packed), the KV cache for exactly prompt + new positions (not block_size), the prefill's and the
    decoding step's activations and logits, sampling included. ``dtype``: a torch dtype or a --precision string
    (default bf16 on CUDA, fp32 on the CPU). ``devices``: the GPUs ``--devices`` splits the blocks over
    (``load.pipeline_stages``); the plan is the fullest one's, each GPU holding its parts and the bytes the trace
    had in flight at its peak. ``compile``: the decode step is compiled (--compile): on the CPU the compiler and its
    code add a term; the tensors are the eager step's (the last step reads the whole cache either way). ``paged``: the
    tokens decode in the engine's paged pool (several prompts, chat): ``add_paged_pool``."""
    total = prompt_length + max_new_tokens
    staged = generation_phases(config, prompt_length, max_new_tokens, batch_size, dtype, quantize, device_type, devices)
    if paged:
        add_paged_pool(staged, config, batch_size, total, dtype, device_type)
    phases, kv, dtype = staged.phases, staged.kv_cache_bytes, staged.dtype
    B = batch_size
    spec = Run(config=config, precision="bf16-true", device_type=device_type, devices=devices, num_nodes=1,
               parallel=ParallelDims(dp_replicate=1, dp_shard=1),
               micro_batch_size=B, global_batch_size=B, seq_len=total, compile=compile,
               cpu_heap=resolve_cpu_heap(device_type, sets_heap=False))
    memory = _resolve_memory(device_memory, device_type, detect)
    phases, terms = _finish_phases(phases, spec, generation=True)
    summary = {"model": config.name, "parameters": closed_form.param_counts(config).total,
               "dtype": str(dtype).replace("torch.", ""), "quantize": quantize, "batch_size": B,
               "prompt_length": prompt_length, "max_new_tokens": max_new_tokens,
               "kv_cache_bytes": kv, "kv_cache_positions": total, "devices": devices}
    plan = plan_of_phases(spec, phases, terms, memory, "trace", [], {}, summary)
    plan.notes.append(f"KV cache: {format_bytes(kv)} for {total} positions (prompt + new tokens), allocated once.")
    if devices > 1:
        plan.notes.append(pipeline_note(staged, devices))
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


@dataclass(frozen=True)
class StagedPhases:
    """A traced generation split over ``--devices``: the fullest device's tensor bytes per phase by category
    (no overhead yet), which device that is, where each part of the model goes, and the whole KV cache's bytes."""

    phases: dict[str, dict[str, int]]
    fullest: int
    stages: dict[str, int]
    kv_cache_bytes: int
    dtype: torch.dtype  # the weights' (a --precision string resolved)


def add_paged_pool(staged: StagedPhases, config: Config, batch_size: int, positions: int,
                   dtype: Union[torch.dtype, str, None], device_type: str) -> None:
    """What decoding in the engine's paged pool adds to the traced contiguous cache of ``positions`` per sequence: the
    pool's rounding up to whole blocks, and a decoding step's gather of one layer's cache at a time (``paged.read_bytes``)."""
    pool_positions = blocks_for(positions, DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE
    rounding = staged.kv_cache_bytes * (pool_positions - positions) // positions
    read = read_bytes(config, batch_size, pool_positions, "auto", generation_dtypes(dtype, device_type)[1])
    for category, size in (("kv_cache", rounding), ("activations", read)):
        staged.phases["decode"][category] += size


def generation_dtypes(dtype: Union[torch.dtype, str, None], device_type: str) -> tuple[torch.dtype, torch.dtype]:
    """The weights' and the computation's (and KV cache's) dtypes of a --precision string, or of a weights' dtype."""
    if not (isinstance(dtype, str) or dtype is None):
        return dtype, dtype
    weights, autocast = PRECISION_DTYPES[resolve_precision(dtype, device_type, present=False)]
    return weights, autocast or weights  # -mixed: generation keeps the cache in the autocast dtype


def generation_phases(config: Config, prompt_length: int, max_new_tokens: int, batch_size: int,
                      dtype: Union[torch.dtype, str, None], quantize: Optional[str], device_type: str, devices: int,
                      score_length: int = 0) -> StagedPhases:
    """``plan_generation``'s tensor bytes: the trace (``trace_generation``) spread over the devices' parts; with
    ``score_length`` evaluate's scoring phase too (held with no KV cache: evaluate frees it after generating)."""
    dtype, compute_dtype = generation_dtypes(dtype, device_type)
    total = prompt_length + max_new_tokens
    if total > config.block_size:
        raise UsageError(f"Prompt plus new tokens ({total}) exceed {config.name}'s context of {config.block_size} tokens.")
    traced = _generation_trace(config, prompt_length, max_new_tokens, batch_size, dtype, compute_dtype, quantize,
                               device_type, score_length)
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
                    categories[category] += 0 if phase == "score" and category == "kv_cache" else size
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
    kv = sum(part["kv_cache"] for part in traced.resident.values())
    return StagedPhases(phases, fullest, stages, kv, dtype)


def pipeline_note(staged: StagedPhases, devices: int) -> str:
    stages, fullest = staged.stages, staged.fullest
    held = sorted(int(part.split(".")[1]) for part, where in stages.items() if where == fullest and part.startswith("blocks."))
    return (f"--devices {devices}: consecutive blocks on consecutive GPUs; this is GPU {fullest}'s memory "
            f"({f'blocks {held[0]}-{held[-1]}' if held else 'no blocks'}"
            + (", the embedding" if stages["embed"] == fullest else "")
            + (", the head" if stages["lm_head"] == fullest else "") + "), the fullest of them.")


def _generation_suggestions(config: Config, prompt_length: int, max_new_tokens: int, batch_size: int,
                            dtype: torch.dtype, quantize: Optional[str], memory: int, device_type: str, devices: int,
                            compile: bool) -> list[Suggestion]:
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

