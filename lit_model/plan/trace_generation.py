"""The exact trace of generation: generate/base.py's model, KV cache, prefill and last decoding step on fake
tensors (the method: ``trace.py``). Apart from the training trace, so that planning a generation imports no
training stack (lightning, ``train/``)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lit_model.core.config import Config
from lit_model.infer.decode import forward_last
from lit_model.infer.kv_cache import set_kv_cache
from lit_model.infer.sampling import sample
from lit_model.infer.score import score_positions
from lit_model.model.gpt import GPT, default_dtype
from lit_model.plan.modules import quantize_model_sim
from lit_model.plan.tracker import CPU, _cuda_kernels, _Ref, _Tracker, traced_policy

TRACED_TOP_P = 0.5  # the trace samples with nucleus filtering: of the sampling paths, the one that allocates the most


@dataclass
class GenerationTrace:
    """generate/base.py's model on one device: what each part of it holds (``resident``: "embed", "blocks.<i>",
    "norm_f", "lm_head" and "rope", the RoPE tables, -> category -> bytes; a weight shared by two parts counts in
    the first) and, per phase, what is in flight at that phase's peak beyond them (``transient``)."""

    resident: dict[str, dict[str, int]]
    transient: dict[str, dict[str, int]]
    seconds: float


def trace_generation(config: Config, prompt_length: int, max_new_tokens: int, batch_size: int, dtype: torch.dtype,
                     compute_dtype: torch.dtype, quantize: Optional[str], device_type: str,
                     score_length: int = 0) -> GenerationTrace:
    """Trace what generate/base.py runs (``decode.forward_last`` and ``sampling.sample``) on the model as
    ``load.load_model`` builds it (weights in ``dtype``, linear layers quantized with ``quantize``; RoPE
    tables for prompt + new positions) with its KV cache (``set_kv_cache``, in ``compute_dtype``): the prefill of
    the prompt, then the decoding step that peaks, the last one, whose attention reads the whole cache. Under
    autocast where ``compute_dtype`` is not ``dtype`` (bf16's on the CPU, which keeps fp16's bytes)."""
    start = time.perf_counter()
    total = prompt_length + max_new_tokens
    with FakeTensorMode():
        with default_dtype(dtype):
            model = GPT(config)
            model.max_seq_length = total
        model.set_kernel_policy(traced_policy(device_type))
        tracker = _Tracker(vocab_size=config.padded_vocab_size)
        if quantize is not None:
            quantize_model_sim(model, quantize, tracker)
        model.eval().requires_grad_(False)
        set_kv_cache(model, batch_size, total, compute_dtype)
        resident = _resident_bytes(model)
        prompt = torch.randint(0, config.padded_vocab_size, (batch_size, prompt_length))
        tracker.track_external(model, prompt)
        steps = {"prefill": lambda: sample(forward_last(model, prompt, torch.arange(prompt_length), prompt_length),
                                           temperature=1.0, top_p=TRACED_TOP_P),
                 "decode": lambda: sample(forward_last(model, prompt[:, -1:], torch.tensor([total - 1]), total),
                                          temperature=1.0, top_p=TRACED_TOP_P)}
        if score_length:
            rows = torch.arange(batch_size).repeat_interleave(score_length)
            positions = torch.arange(score_length).repeat(batch_size)
            scored = torch.randint(0, config.padded_vocab_size, (batch_size, score_length))
            steps = {"score": lambda: score_positions(model, scored, rows, positions, scored.flatten()), **steps}
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if compute_dtype != dtype
                    else contextlib.nullcontext())
        kernels = _cuda_kernels if device_type == "cuda" else contextlib.nullcontext
        transient = {}
        with torch.no_grad(), autocast, kernels():
            for phase, run in steps.items():
                with tracker:
                    tracker.reset_mod_stats()
                    run()
                    peak = tracker.get_tracker_snapshot("peak")[CPU]
                get = lambda ref: int(peak.get(ref, 0))  # noqa: E731
                transient[phase] = {"activations": get(_Ref.ACT) + get(_Ref.TEMP) + get(_Ref.OTH),
                                    "logits_loss": get(_Ref.LOGITS), "quantization": get(_Ref.QUANT)}
    return GenerationTrace(resident=resident, transient=transient, seconds=time.perf_counter() - start)


def _resident_bytes(model: GPT) -> dict[str, dict[str, int]]:
    """Each part's parameters and buffers by category: the KV cache, bitsandbytes' statistics, the rest."""
    parts: dict[str, nn.Module] = {"embed": model.embed, **{f"blocks.{i}": b for i, b in enumerate(model.blocks)},
                                   "norm_f": model.norm_f, "lm_head": model.lm_head}
    seen: set[int] = set()
    resident = {}
    for part, module in parts.items():
        categories = {"parameters": 0, "quantization": 0, "kv_cache": 0}
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            leaf = name.rsplit(".", 2)
            category = ("kv_cache" if leaf[-2:-1] == ["kv_cache"] else
                        "quantization" if leaf[-1] == "quant_statistics" else "parameters")
            categories[category] += tensor.numel() * tensor.element_size()
        resident[part] = categories
    resident["rope"] = {"parameters": sum(t.numel() * t.element_size() for t in (model.cos, model.sin)),
                        "quantization": 0, "kv_cache": 0}
    return resident
