"""The framework's memory on top of a plan's tensor bytes, by backend: a CPU process's terms (the runtime, the data,
what glibc's heap keeps), a CUDA rank's (the context, the workspaces, the caching allocator's reserve); the
constants behind them live in ``calibration.py``. It imports nothing of the training stack."""

from __future__ import annotations

import functools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from lit_model.core.errors import UserError
from lit_model.core.files import atomic_write
from lit_model.data.cache import cache_root, file_lock
from lit_model.kernels.ops import onednn_kernel_cache_bytes
from lit_model.plan import closed_form
from lit_model.plan.calibration import OVERHEAD, cpu_optimizer_library_bytes, quantized_step_bytes
from lit_model.plan.closed_form import CATEGORIES
from lit_model.run import CPU_HEAP_TOP_PAD, Run


# A fresh interpreter that imports what the training scripts import and runs two AdamW steps of a one-block model in
# float32 and two in bfloat16 (which pages in the kernels a step uses), then prints its resident bytes: the runtime of
# a CPU training process, measured where it will run rather than assumed, the same for either dtype (so a plan, and a
# suggested change of --precision, never counts one dtype's kernels less than a run may page in: bf16's add ~15 MiB); and what importing bitsandbytes adds to that
# (its 8-bit optimizers' library term). Named by string, not imported: the plan sits
# below the recipes (and must not load them into a process that only plans).
_RUNTIME_PROBE = """
import sys, torch, lit_model.recipes.pretrain, lit_model.recipes.finetune
from lit_model import GPT, Config
from lit_model.methods.objective import CausalLM, mean_loss
for dtype in (torch.float32, torch.bfloat16):
    torch.set_default_dtype(dtype)
    model = GPT(Config(name="probe", block_size=64, vocab_size=128, n_layer=1, n_embd=64, n_head=4, n_query_groups=2,
                       intermediate_size=128))
    model.init_weights()
    optimizer, tokens = torch.optim.AdamW(model.parameters()), torch.randint(0, 128, (2, 64))
    for _ in range(2):
        mean_loss(CausalLM(), model, (tokens, tokens)).backward()
        optimizer.step()
        optimizer.zero_grad()
rss = lambda: next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmRSS"))
runtime = rss()
try:
    import bitsandbytes
except ImportError:  # then no run here uses its optimizers
    pass
print(runtime, rss() - runtime)
"""


def _probe() -> tuple[int, int]:
    """``_RUNTIME_PROBE``'s two numbers, measured once per interpreter, torch and lit-model installation and kept in
    the cache ($LIT_MODEL_CACHE/runtime_probe.json: every process planning with that cache plans with the same value,
    where a measurement per process would differ by a few MiB and turn a plan's verdicts on small runs)."""
    return _probe_cached(cache_root() / "runtime_probe.json")


@functools.lru_cache(maxsize=None)
def _probe_cached(path: Path) -> tuple[int, int]:
    """``_probe`` with the cache file ``path``; ``Overhead.cpu_runtime`` and ``Overhead.cpu_bitsandbytes_import``
    where it cannot run (no /proc, a failed import, a cache that cannot be written)."""
    fallback = (OVERHEAD.cpu_runtime, OVERHEAD.cpu_bitsandbytes_import)
    key = f"{sys.executable} {sys.version} torch {torch.__version__} {Path(__file__).resolve().parents[1]}"
    try:
        with file_lock(path.with_suffix(".lock")):
            known = json.loads(path.read_text()) if path.is_file() else {}
            known = known if isinstance(known, dict) else {}
            if isinstance(known.get(key), list) and len(known[key]) == 2:
                return tuple(int(v) for v in known[key])
            out = subprocess.run([sys.executable, "-c", _RUNTIME_PROBE], capture_output=True, text=True, timeout=300)
            measured = tuple(int(word) for word in out.stdout.split()[-2:]) if out.returncode == 0 else None
            if measured is None or len(measured) != 2:
                return fallback
            atomic_write(path, json.dumps({**known, key: list(measured)}))
            return measured
    except (OSError, ValueError, UserError, subprocess.TimeoutExpired):
        return fallback


def cpu_runtime_bytes() -> int:
    """A CPU training process's runtime: the libraries the scripts import and the kernels of a step (either dtype)."""
    return _probe()[0]


def bitsandbytes_import_bytes() -> int:
    """What importing bitsandbytes adds to a CPU training process (its 8-bit optimizers' library)."""
    return _probe()[1]


def transient_bytes(categories: dict[str, int], gradients_persist: bool = False, gathered: int = 0,
                    transient_high: int = 0) -> int:
    """A phase's transient bytes (its activations, logits and gradients, and what FSDP's all-gathers free), or its
    most transient bytes of any stretch (``transient_high``) where that is more: see ``cpu_overhead_terms``."""
    gradients = 0 if gradients_persist else categories.get("gradients", 0)
    plain = categories.get("activations", 0) + categories.get("logits_loss", 0) + gradients + gathered
    return max(plain, transient_high + gathered)


def cpu_overhead_terms(categories: dict[str, int], world_size: int = 1, dequantized: int = 0,
                       gradients_persist: bool = False, gathered: int = 0,
                       adapter_step_transient: Optional[int] = None,
                       new_shapes: bool = False, optimizer_library: int = 0, generation: bool = False,
                       transient_high: int = 0, compiled_trainable_bytes: Optional[int] = None,
                       compiled_decode_parameters: Optional[int] = None, cpu_heap: str = "glibc",
                       runtime: int = OVERHEAD.cpu_runtime) -> dict[str, int]:
    """What a CPU training process holds besides these tensor bytes, by term (see calibration.py): the
    imported runtime, the training data, and the heap glibc keeps from freed transient tensors (``dequantized``:
    the weights a quantized model dequantizes and frees in each pass, when the phase runs the model; ``gathered``:
    what FSDP's all-gathers allocate and free in that pass). ``gradients_persist``: the gradients live in buffers
    allocated once (DDP's buckets; each gradient autograd makes is copied in and freed at once), so the step frees no
    gradient-sized heap for glibc to keep. ``adapter_step_transient``: a LoRA or adapter fine-tune's training step's
    transient bytes (a term of its own, which that step bounds), None for other runs.
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
    (``Run.heap_mode``): where the run sets it ("lit_model", "lit_model_sharded"), what a trim leaves at the heap's
    top (``run.CPU_HEAP_TOP_PAD``) is counted whole; where freed blocks go back at once (the user's mmap threshold,
    "returns_freed", or an FSDP run's, "lit_model_sharded"), little is retained. ``runtime``: the training process's runtime (``cpu_runtime_bytes``)."""
    plain = transient_bytes(categories, gradients_persist, gathered)
    transient = transient_bytes(categories, gradients_persist, gathered, transient_high)
    after_backward = transient > plain
    if cpu_heap in ("returns_freed", "lit_model_sharded"):
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
        "runtime": runtime + (OVERHEAD.cpu_distributed if world_size > 1 else 0),
        "data": OVERHEAD.cpu_data,
        "allocator_retention": int(retained),
    }
    if cpu_heap in ("lit_model", "lit_model_sharded"):
        terms["heap_top_pad"] = CPU_HEAP_TOP_PAD
    if adapter_step_transient is not None:
        # freed heap: at most what the step's transient tensors leave; what the phase allocates next (a LoRA save's
        # reads of the base checkpoint) reuses it
        kept = min(OVERHEAD.cpu_adapter_fine_tuning, OVERHEAD.cpu_adapter_fine_tuning_rate * adapter_step_transient)
        terms["adapter_fine_tuning"] = int(max(kept - categories.get("checkpoint", 0), 0))
    if new_shapes:
        terms["kernel_cache"] = onednn_kernel_cache_bytes()
    if optimizer_library:
        terms["optimizer_library"] = optimizer_library
    if compiled_trainable_bytes is not None:
        # an adapter fine-tune's compiled blocks save fewer activations than its eager ones (calibration.py), so
        # only a full training's compiler grows with them
        adapters = adapter_step_transient is not None
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


def _gradients_in_buckets(spec: Run) -> bool:
    """DDP's gradients are views into its buckets, allocated once when it wraps the model (they persist)."""
    return spec.parallel.ddp


def _cpu_churn(phase: str, spec: Run, step_transient: int) -> dict[str, Any]:
    """``cpu_overhead_terms``' keywords for a phase of this run: the phases that run the model (the step and the
    evaluation) dequantize and all-gather weights; the save and the sample do not. The sample gives back the heap
    glibc kept (recipes/common.py sample_text trims it before reloading final/), so the heap an adapter fine-tune
    keeps (``adapters``) is gone by then: counted, it planned LoRA SmolLM2-135M bf16-true runs of lora.py and dpo.py,
    which peak sampling, 14 % over (benchmarks/results/plan_accuracy_preference.md); and the save, which reads the
    base checkpoint into that freed heap, then peaked 12 % over (cpu_overhead_terms). ``step_transient``: the
    training step's transient bytes, which bound that heap."""
    runs_model = phase in ("train_step", "evaluation")
    return {"dequantized": dequantized_bytes(spec) if runs_model else 0,
            "gathered": gathered_bytes(spec) if runs_model else 0,
            "gradients_persist": _gradients_in_buckets(spec),
            "adapter_step_transient": (step_transient if spec.trainable in ("lora", "adapter") and phase != "sample"
                                       else None),
            "new_shapes": bool(spec.config.n_expert) and spec.compute_bytes == 2,  # fp32 experts stay on BLAS
            "optimizer_library": cpu_optimizer_library_bytes(spec.optimizer,
                                                             lambda: closed_form.model_bytes(spec).trainable,
                                                             bitsandbytes_import_bytes),
            "compiled_trainable_bytes": (closed_form.model_bytes(spec).trainable * spec.param_bytes if spec.compile
                                         else None)}


def recomputed_transient_bytes(spec: Run) -> int:
    """CPU, activation checkpointing: the heap a checkpointed step passes through. Each block's forward frees what it
    does not keep, and its recompute in backward allocates it all again between the gradients that block makes (which
    stay until the optimizer step): glibc cannot give those activations' blocks back from under the gradients, so the
    heap reaches about the height the step without checkpointing reaches (calibration.py,
    cpu_allocator_retention_after_backward): the activations and logits the same step would keep without it. Counted
    where the blocks' weights train (a LoRA or adapter backward makes no gradients of the blocks' weights to pin the
    heap: an adapter SmolLM2-135M run checkpointing every 2nd block was planned +25 % with it, issue 50)."""
    plain = closed_form.activations(spec.replace(ac_interval=0, ac_selective=False))
    return int(plain.kept + plain.loss_forward)


def _cpu_terms(phase: str, spec: Run, generation: bool, transient_highs: Optional[dict[str, int]] = None,
               step_transient: int = 0) -> dict[str, Any]:
    """``cpu_overhead_terms``' keywords for a phase of a training run (``transient_highs``: the trace's most transient
    bytes of any stretch of each phase; ``step_transient``: the training step's transient bytes), or of a generation
    process."""
    if generation:
        return {"generation": True, "cpu_heap": spec.cpu_heap,
                "compiled_decode_parameters": closed_form.param_counts(spec.config).total if spec.compile else None}
    high = (transient_highs or {}).get(phase, 0)
    if phase == "train_step" and spec.ac_interval and spec.trainable == "full":
        high = max(high, recomputed_transient_bytes(spec))
    return {**_cpu_churn(phase, spec, step_transient), "transient_high": high, "cpu_heap": spec.heap_mode,
            "runtime": cpu_runtime_bytes()}


def _finish_phases(phases: dict[str, dict[str, int]], spec: Run, generation: bool = False,
                   transient_highs: Optional[dict[str, int]] = None) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Each phase's categories with its overhead added, and (CPU) that overhead by term, per phase."""
    out, terms = {}, {}
    step_transient = transient_bytes(phases.get("train_step", {}), _gradients_in_buckets(spec),
                                     transient_high=(transient_highs or {}).get("train_step", 0))
    if spec.ac_interval and "train_step" in phases:  # the recompute allocates the blocks' activations again
        step_transient = max(step_transient, recomputed_transient_bytes(spec))
    for name, cats in phases.items():
        cats = {c: int(cats.get(c, 0)) for c in CATEGORIES}
        if spec.device_type == "cpu":
            terms[name] = cpu_overhead_terms(cats, spec.world_size,
                                             **_cpu_terms(name, spec, generation, transient_highs, step_transient))
            cats["overhead"] = sum(terms[name].values())
        else:
            fresh = cuda_step_fresh_bytes(spec) if name == "train_step" and not generation else 0
            if generation and spec.compile:  # the compiled decode step's own memory, on top of the prefill's reserve
                fresh += int(OVERHEAD.cuda_compiled_decode + OVERHEAD.cuda_compiled_decode_kv_copies * cats["kv_cache"])
            cats["overhead"] = cuda_overhead_bytes(cats, spec.world_size, spec.cuda_alloc_conf, fresh)
        out[name] = cats
    return out, terms

