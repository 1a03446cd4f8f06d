"""The plan of ``lit-model evaluate`` (its ``--plan`` and the starting size of ``--batch_size auto``): the weights,
the scoring pass of a batch of requests as long as the model's context (lm-eval's requests are cut to it), and a
generate_until batch with its KV cache, from the trace of generation (``trace_generation.py``, its "score" phase).
Like ``generation.py`` it imports nothing of the training stack."""

from __future__ import annotations

from typing import Optional, Union

import torch

from lit_model.core.config import Config
from lit_model.core.units import format_bytes
from lit_model.infer.score import AUTO_BATCH_SIZE, head_rows
from lit_model.parallel.dims import ParallelDims
from lit_model.plan import closed_form
from lit_model.plan.calibration import OVERHEAD
from lit_model.plan.generation import add_paged_pool, generation_phases, pipeline_note
from lit_model.plan.overhead import _finish_phases
from lit_model.plan.report import Plan, Suggestion, _resolve_memory, plan_of_phases
from lit_model.run import Run, render_flags, resolve_cpu_heap

GLIBC_MMAP_MAX = 32 << 20  # glibc's adaptive mmap threshold stops here: a block at least this large is always mapped


def plan_evaluation(config: Config, batch_size: int, dtype: Union[torch.dtype, str, None] = None,
                    quantize: Optional[str] = None, device_memory: Union[int, str, None] = None,
                    device_type: str = "cuda", detect: bool = True, devices: int = 1, suggest: bool = True) -> Plan:
    """Predicted peak memory of evaluating with ``batch_size``: the larger of the scoring pass (``batch_size`` rows
    of ``config.block_size`` tokens, every position scored, as a rolling window's are: the most a batch of requests
    can ask) and a generate_until batch (``batch_size`` prompts and their new tokens: a KV cache of ``block_size``
    positions each, the prefill of ``block_size`` - 1 tokens). The requests' own lengths are not known before lm-eval
    builds them, so the plan is their longest; shorter requests take less. ``dtype``, ``quantize``, ``devices``: as
    ``plan_generation``'s. ``suggest``: where it does not fit, look for flag changes that make it fit."""
    length = config.block_size
    staged = generation_phases(config, length - 1, 1, batch_size, dtype, quantize, device_type,
                               devices, score_length=length)
    spec = Run(config=config, precision="bf16-true", device_type=device_type, devices=devices, num_nodes=1,
               parallel=ParallelDims(dp_replicate=1, dp_shard=1), micro_batch_size=batch_size,
               global_batch_size=batch_size, seq_len=length, cpu_heap=resolve_cpu_heap(device_type, sets_heap=False))
    add_paged_pool(staged, config, batch_size, length, dtype, device_type)  # generate_until's engine
    phases, terms = _finish_phases(staged.phases, spec, generation=True)
    if device_type == "cpu":
        # the head's fp32 (rows, vocabulary) logits and logsumexp's exponentials of them: blocks glibc maps apart
        # from its heap when they are this large, and unmaps when freed, so none of them stays in the heap
        head_block = min(head_rows(config.padded_vocab_size), batch_size * length) * config.padded_vocab_size * 4
        mapped = int(OVERHEAD.cpu_generation_retention * 2 * head_block) if head_block >= GLIBC_MMAP_MAX else 0
        unretained = min(mapped, terms["score"]["allocator_retention"])
        terms["score"]["allocator_retention"] -= unretained
        phases["score"]["overhead"] -= unretained
        for name, categories in phases.items():  # lm-eval and what it imports (datasets, transformers, metrics)
            terms[name]["evaluation_libraries"] = OVERHEAD.cpu_evaluation_libraries
            categories["overhead"] += OVERHEAD.cpu_evaluation_libraries
    memory = _resolve_memory(device_memory, device_type, detect)
    summary = {"model": config.name, "parameters": closed_form.param_counts(config).total,
               "dtype": str(staged.dtype).replace("torch.", ""), "quantize": quantize, "batch_size": batch_size,
               "scored_length": length, "kv_cache_bytes": staged.kv_cache_bytes,
               "kv_cache_positions": length, "devices": devices}
    plan = plan_of_phases(spec, phases, terms, memory, "trace", [], {}, summary)
    plan.notes.append(f"score: {batch_size} request(s) of {length} tokens (the context, which lm-eval cuts requests "
                      "to), every position scored as in a rolling window; generate_until (prefill, decode): "
                      f"{batch_size} prompt(s) of equal length and their new tokens filling the context, a KV cache "
                      f"of {format_bytes(staged.kv_cache_bytes)} for {length} positions each, freed after generating.")
    if devices > 1:
        plan.notes.append(pipeline_note(staged, devices))
    if suggest and memory is not None and not plan.fits:
        plan.suggestions = _evaluation_suggestions(config, batch_size, staged.dtype, quantize, memory,
                                                   device_type, devices)
    return plan


def auto_batch_size(config: Config, dtype: Union[torch.dtype, str, None], quantize: Optional[str],
                    device_memory: Union[int, str, None], device_type: str, devices: int = 1) -> int:
    """``--batch_size auto``'s starting size: the largest power of two up to ``AUTO_BATCH_SIZE`` whose plan fits
    the device (1 where none does; the scorer still halves a batch that runs out of memory). The plans of 1 and 2
    rows give the bytes a row adds; the size they predict is then planned itself, and halved until it fits."""
    memory = _resolve_memory(device_memory, device_type, detect=True)
    if memory is None:
        return AUTO_BATCH_SIZE

    def peak(batch_size: int) -> int:
        return plan_evaluation(config, batch_size, dtype, quantize, memory, device_type,
                               devices=devices, suggest=False).peak_bytes

    one = peak(1)
    per_row = max(peak(2) - one, 1)
    size = 1
    while size * 2 <= min(AUTO_BATCH_SIZE, max((memory - one) // per_row + 1, 1)):
        size *= 2
    while size > 1 and peak(size) > memory:
        size //= 2
    return size


def _evaluation_suggestions(config: Config, batch_size: int, dtype: torch.dtype,
                            quantize: Optional[str], memory: int, device_type: str, devices: int) -> list[Suggestion]:
    """Flag changes that make the evaluation fit, cheapest first: a smaller --batch_size (the largest that fits:
    fewer rows at once, about as fast), weights in 16 bits or quantized, the blocks over twice the GPUs."""
    options: list[tuple[dict, float]] = []
    size = batch_size // 2
    while size > 1 and not plan_evaluation(config, size, dtype, quantize, memory, device_type, False,
                                           devices, suggest=False).fits:
        size //= 2
    if size >= 1:
        options.append(({"batch_size": size}, 1.0))
    if dtype == torch.float32:
        options.append(({"precision": "bf16-true"}, 1.0))
    if quantize is None and device_type == "cuda":  # bitsandbytes' kernels are CUDA's
        options += [({"quantize": "bnb.nf4"}, 1.5), ({"quantize": "bnb.int8"}, 2.0)]
    if device_type == "cuda":
        options.append(({"devices": devices * 2}, 1.0))
    out = []
    for changes, speed in options:
        plan = plan_evaluation(config, changes.get("batch_size", batch_size),
                               torch.bfloat16 if "precision" in changes else dtype, changes.get("quantize", quantize),
                               memory, device_type, False, changes.get("devices", devices), suggest=False)
        if plan.fits:
            out.append(Suggestion(changes=changes, flags=render_flags(changes), peak_bytes=plan.peak_bytes,
                                  speed_factor=speed, cost=speed, by_category=plan.by_category))
    return sorted(out, key=lambda s: s.cost)
