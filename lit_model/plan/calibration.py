"""Every calibration constant of the memory planner, in one place.

Two kinds of numbers live here:

* ``OVERHEAD``: memory that is not a tensor of the model (CUDA context, library workspaces, the caching
  allocator's fragmentation, the CPU process itself). The planner adds it to the exact tensor bytes.
* ``SPEED``: relative step-time factors of the memory levers, used to rank the suggestions.

Every number says where it comes from. ``(estimate)`` marks the ones not measured on this project's own
runs yet; the GPU ones are meant to be calibrated when a GPU is lent (see ``calibrate_on_gpu`` at the end
of this file for the recipe).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

GB = 10**9
MB = 10**6
MiB = 2**20


@dataclass(frozen=True)
class Overhead:
    """Memory outside the model's tensors, per rank."""

    # CUDA: the context (driver state, kernels of torch/cuBLAS/cuDNN/NCCL loaded lazily). It is not part of
    # torch.cuda.max_memory_reserved() but it is taken from the device's total memory. Measured 718 MB on an H200
    # (torch 2.11, CUDA 13, after initialisation and one bf16 matrix product: benchmarks/plan_accuracy_gpu.py);
    # public figures for A100/H100 with CUDA 12 are 300-600 MB. Rounded up to 768 MiB: other GPUs and drivers differ.
    cuda_context: int = 768 * MiB
    # CUDA: cuBLAS/cuBLASLt workspaces, which PyTorch takes through its caching allocator (so they are in
    # max_memory_allocated() though no model tensor is): the H200 runs allocated 55-131 MB more than their traced
    # tensors (benchmarks/results/plan_accuracy_gpu.md), 128 MiB covers them. NCCL buffers when distributed (estimate).
    cuda_workspaces: int = 128 * MiB
    cuda_nccl_buffers: int = 200 * MB  # per rank with world_size > 1 (estimate: NCCL_BUFFSIZE 4 MiB x channels)
    # CUDA: memory the caching allocator reserves beyond what is allocated (fragmentation, its rounding, freed
    # blocks it keeps), as a fraction of a phase's tensor bytes other than the weights (loaded once, they pack
    # without gaps; gradients, optimizer state, activations, logits and the KV cache come and go). With expandable
    # segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, the training scripts' default on CUDA,
    # train/fabric.py; a segment grows in 2 MiB pages instead of a new cudaMalloc per size that does not fit,
    # pytorch/pytorch#96995) the H200 runs reserved 2-22 % of those bytes beyond their allocated peak (pretraining,
    # full, LoRA, QLoRA and adapter runs; as a share of the activations alone it ranged 2-74 %): 0.12, which with
    # the two terms above leaves no run under-planned (benchmarks/results/plan_accuracy_gpu.md). Without expandable
    # segments gaps grow with varying activation sizes (estimate: 0.20). With max_split_size_mb set as well, reserved
    # memory can grow without bound (pytorch/pytorch#123548): then 0.20 too.
    cuda_fragmentation: float = 0.20
    cuda_fragmentation_expandable: float = 0.12
    # CUDA: a step that makes temporaries of a whole parameter (torchao's compiled AdamW4bit step,
    # quantized_step_bytes) runs after backward has freed the activations, whose blocks lie between the gradients
    # made meanwhile: too small for the largest parameter's temporaries, which the allocator maps anew on top of the
    # reserve. On the H200, pythia-160m bf16 8 x 1,024 with AdamW4bit reserved 1.27 GB above its allocated peak, where
    # the reserve term above gives 0.47 GB; the largest parameter's (50,304 x 768) step temporaries are 1.04 GB.
    # Counted in full for the training step (benchmarks/results/plan_accuracy_gpu.md; one run: an estimate).
    cuda_step_fresh_copies: float = 1.0
    # CUDA: the loss's vocabulary-wide blocks (logits, their fp32 copy and gradient; large only with whole-sequence
    # logits, --loss_chunk_size 0) are the largest transient tensors and come after the activations: the reserve
    # counts them whole instead of at the fraction above. torchtune's Llama-2-7B LoRA settings (micro batch 2 x 1,304,
    # activation checkpointing, whole-sequence logits) reserved 0.61 GB above the allocated peak on the H200, where
    # the fraction above gave 0.31 GB (with the workspaces) on 0.67 GB of logits and 0.79 GB of other moving tensors.
    cuda_logits_reserve: float = 1.0
    # CUDA, generate --compile (the decode step compiled once, after the eager prefill): on the H200, Qwen2.5-0.5B bf16,
    # a 3,000-token prompt, 200 new tokens x 2 samples, allocated 0.11 GB and reserved 0.33 GB more than the eager run
    # (1.45 / 1.75 against 1.34 / 1.42 GB) on 0.08 GB of KV cache, on top of the prefill's reserve: planned as a copy
    # of the KV cache (inductor can copy a buffer it writes in place) and a fixed reserve, the excess rounded up, in
    # every phase. One run: an estimate (larger models and caches unmeasured).
    cuda_compiled_decode: int = 288 * MiB
    cuda_compiled_decode_kv_copies: float = 1.0
    # CPU, per process: what a training process holds besides the model's tensors, in named terms (overhead.py
    # cpu_overhead_terms). Measured on whole runs of the real scripts (benchmarks/plan_accuracy.py; VmRSS
    # sampled every 10 ms with the phase on the main thread's stack: pythia-70m, pretrain/main.py).
    # runtime: the libraries a script imports (torch, lightning and what it imports, numpy, tokenizers, lit_model's
    # training modules) and the kernels a step pages in. It grows with every import the code gains (373 MiB of VmRSS
    # at the start of training when it was measured first; 436 after the imports alone on 2026-11-29, when Lightning's
    # torchmetrics imported transformers, and the plans of small runs were 60-100 MiB under: issue 50), so the plan
    # measures it (overhead.cpu_runtime_bytes: a fresh interpreter's VmRSS after those imports and two steps of a tiny
    # model, 454 MiB in fp32 and 470 in bf16 here, 2026-11-29). This value stands in where that cannot run. What a
    # step adds beyond its tensors is retained heap: cpu_allocator_retention counts it.
    cpu_runtime: int = 470 * MiB
    # ... and what importing bitsandbytes adds to it (CPU_OPTIMIZER_LIBRARY), where the probe cannot run: 40 MiB here
    cpu_bitsandbytes_import: int = 40 * MiB
    # --compile on the CPU (each block compiled by inductor): the compiler, its generated code and the heap its kernels
    # leave, beyond the eager run. pretrain/main.py, 32-true, 6 steps, glibc's defaults, compiled minus eager peak RSS:
    # lit-model-5m 4 x 128 +128 MiB, pythia-70m 4 x 128 +173 and 8 x 256 +241, pythia-160m 4 x 128 +217; least
    # squares 118 MiB + 0.14 x the trained parameters' bytes + 0.17 x the activations' (and logits'), rounded up to the
    # terms below (which plan those runs +0.1 %, +1.3 %, +5.1 % and +1.7 %; bf16-true did not compile there, see
    # errors.compile_failure). A LoRA fine-tune (pythia-70m 4 x 256, benchmarks/plan_accuracy.py) held no more compiled
    # than eager (1,017 against 1,040 MiB): the compiled kernels leave less of the heap that cpu_adapter_fine_tuning
    # counts, so that term is subtracted from this one, and the activation term is left out of an adapter fine-tune:
    # its compiled blocks save fewer activations than eager ones (on an H100, LoRA TinyLlama-1.1B 2 x 1,024 allocated
    # 4.75 against 5.59 GB, QLoRA SmolLM2-360M 2.10 against 2.67; benchmarks/results/plan_accuracy_gpu.md). An
    # estimate from five configurations.
    cpu_compile_runtime: int = 128 * MiB
    cpu_compile_per_parameter_byte: float = 0.15
    cpu_compile_per_activation_byte: float = 0.20
    # generate/base.py's runtime: it imports neither Lightning nor the training code (228 MiB of VmRSS after its
    # imports). Whole runs at glibc's defaults (peak RSS from wait4) held 322-335 MiB beyond the traced tensor peak:
    # the 5.26M model of benchmarks/vs_peers.py, pythia-70m and pythia-160m, 32-true and bf16-true, prompts of 6 and
    # 120 tokens, 1 and 4 samples (benchmarks/plan_accuracy.py --generation). Rounded up.
    cpu_generation_runtime: int = 336 * MiB
    # ... and the prefill's transient tensors (activations, logits) stay in its heap: a prompt of 1,500 tokens
    # (pythia-160m, 32-true) held 377 MiB beyond the tensor peak, on 57 MiB of traced transients. All of them.
    cpu_generation_retention: float = 1.0
    # generate/base.py --compile (the decode step compiled once, inductor's C++ kernels): whole runs, 12-line prompt,
    # 100 new tokens, compiled minus eager peak RSS: lit-model-5m +120 MiB (32-true) / +121 (bf16-true), pythia-70m
    # +128 (32-true), pythia-160m +149 (32-true) / +156 (bf16-true) (2026-11-27, AMD EPYC). It follows the parameter
    # count, not the bytes (bf16 as much as fp32): ~117 MiB + ~0.22 bytes a parameter, rounded up to the terms below.
    cpu_generation_compile_runtime: int = 124 * MiB
    # lit-model evaluate: lm-eval and what it imports and builds beyond generate's runtime (datasets, transformers,
    # the tasks' metrics, the requests). With 256 MiB the plan is above each of 8 whole runs' peak RSS at glibc's
    # defaults (a 2-layer 64-wide model and pythia-14m, batch sizes 4 and 16, requests of 128 and 512 tokens, three
    # local tasks: multiple choice, rolling, generation) by 4.8-32.9 %, by 4.8-16.2 % where the requests fill the
    # context as the plan assumes (benchmarks/results/evaluate_plan.md, 2026-11-29, Intel Xeon, one thread).
    cpu_evaluation_libraries: int = 256 * MiB
    cpu_generation_compile_per_parameter: float = 0.25
    # a second process adds this per rank: the gloo process group, DDP's reducer or FSDP's bookkeeping, and the heap
    # they leave. Measured first at glibc's defaults (lit-model-5m 32-true, two DDP ranks 709-712 MB each against
    # 606-664 MB in one process: 96 MiB); with the heap settings the scripts now give a CPU run (run.CPU_HEAP),
    # pretrain/main.py two DDP ranks against one process (2026-11-29, issue 50): lit-model-5m 32-true mb4 x 256 670
    # against 658 MiB, pythia-70m bf16-true mb2 x 128 1,174 against 1,060, which the other terms (DDP's buckets, the
    # retained heap) leave 0 and 22 MiB of to explain; 96 MiB planned small 2-process runs 20-30 % over. Rounded up.
    cpu_distributed: int = 32 * MiB
    # FSDP: each block's parameters are all-gathered (and freed after use) in forward and again in backward: that
    # many times the unsharded parameters count as transient bytes of a pass through the model, kept at
    # cpu_allocator_retention's rate. Fitted with the terms below to whole runs of 2 ranks (benchmarks/plan_accuracy.py:
    # pythia-70m bf16-true pretraining, a rank 1,143-1,208 MiB where one process of the same run holds 989-1,042;
    # pythia-160m 32-true LoRA, 2,219-2,293 MiB).
    cpu_fsdp_gather_copies: float = 2.0
    # A LoRA or adapter fine-tune held ~100-130 MiB more than the other terms and its traced tensors account for, in
    # every such run of the grid (benchmarks/plan_accuracy.py, 10 runs: LoRA, QLoRA and adapter, 70M to 1.1B
    # parameters, 32-true and bf16-true), independent of the model's size; a full fine-tune of the same model did not
    # (pythia-70m and lit-model-5m, 32-true, mb4 x 256: 40-60 MiB less than pretraining it). It is freed heap that
    # glibc keeps: with MALLOC_MMAP_THRESHOLD_=65536, LoRA pythia-70m 32-true mb4 x 256 peaked at 891 MiB, its traced
    # tensors plus runtime and data to 2 MiB (1,029 at the defaults). Where such a run peaks in training it holds
    # 125-152 MiB beyond those on 132-198 MiB of transient tensors (0.77-0.95 of them; pretraining 0.06-0.35); where
    # it peaks saving or sampling after training, 43-206 MiB that the phase's own tensors do not explain: heap kept
    # from training (2026-11-26 grid). The mechanism (benchmarks/results/heap_reuse.md): glibc before 2.38 does not
    # give a freed block of PyTorch's posix_memalign(64) allocations to a later request of the same size (only to
    # smaller ones), so a step's tensors of one shape take new heap each time one is freed before the next is made:
    # the vs_peers GRPO LoRA step (5.26M parameters, 8 x 200 tokens) with 134 MB of tensors alive at most grew the
    # heap by 246 MB (by 22 MB where blocks of 1 MiB or more are mapped apart). Why a full fine-tune's order of
    # allocations keeps less is not isolated, so the term stays a measured constant, rounded up, bounded by
    # cpu_adapter_fine_tuning_rate of the step's transient bytes (a step cannot leave more freed heap than it
    # allocates: small runs were planned 18-35 % over with the whole constant, plan_accuracy_random-5/-6). Not in
    # the sample's phase: the sample trims the heap first (overhead._cpu_churn); a LoRA save's reads of the base
    # checkpoint reuse it (overhead.cpu_overhead_terms).
    # Ruled out: MKL's buffer cache (MKL_DISABLE_FAST_MM=1), bitsandbytes' import
    # (full.py imports it too), glibc's per-thread arenas (MALLOC_ARENA_MAX=1 or 2: 1,048-1,088 MiB against
    # 1,032-1,063 at the default, same run).
    cpu_adapter_fine_tuning: int = 128 * MiB
    # ... at most this fraction of the training step's transient bytes: the grid's runs held 0.77-0.95 of theirs
    # beyond the other terms (above), the GRPO step 0.84 (246 MB of heap for 134 MB of tensors); rounded up
    cpu_adapter_fine_tuning_rate: float = 0.95
    # data: the token cache's pages (a read-only memmap that the unigram baseline reads whole: 18 MiB for the
    # stdlib's 8.6M tokens), what tokenizing left in the heap (18 MiB cached, ~90 MiB when the corpus is
    # tokenized in the same run) and the instruction records of a fine-tune; 48 MiB (estimate: the default data;
    # a corpus of N tokens holds at least 2N bytes, 4N with a vocabulary over 65,536 tokens).
    cpu_data: int = 48 * MiB
    # glibc at its default settings keeps freed heap blocks (mmap threshold adapts up to 32 MiB): peak RSS ran
    # above the traced tensor peak by this fraction of the transient bytes (activations, logits, gradients of a
    # step). With MALLOC_MMAP_THRESHOLD_ <= 1 MiB freed blocks go back at once: ~2.5 % (old step-only grid).
    # 0.20 fitted the grid's pretraining runs but left LoRA pythia-70m 32-true mb4 x 256 at -6.2 % (its step held
    # 211 MB more than with MALLOC_MMAP_THRESHOLD_=65536, on 197 MB of transient tensors). How much a run keeps varies
    # from run to run (the same command: full SmolLM2-360M 32-true 6,754-6,990 MiB, LoRA pythia-70m 1,054-1,121): 0.40,
    # with the terms above, fitted to three whole runs of the grid (2026-11-26), plans every one of those 62
    # measurements within -3.5 % to +9.8 % (median +2.3 %). benchmarks/results/plan_accuracy.md is a later grid of three
    # runs per configuration: medians within -3.1 % to +9.1 %; in one run of the 60 the plan was 5.3 % under the peak
    # (full pythia-160m 32-true, 3,324 MiB; 3,032 and 3,040 in the other two).
    # DDP's gradients are left out of the transient bytes (allocated once in its buckets; plan.cpu_overhead_terms).
    # The training scripts now set glibc's heap (run.CPU_HEAP); the grid re-measured with those settings (2026-11-28)
    # kept every plan at or above its median peak (worst -0.1 %) with these terms and the 16 MiB pad, 23/27 within
    # 10 %: the four above are fine-tunes that keep less heap with the settings. Kept, not re-fitted.
    cpu_allocator_retention: float = 0.40
    # ... where the peak falls in a later stretch of the step than its most transient bytes (an 8-bit optimizer's step
    # after backward freed the activations), the heap backward left is what glibc keeps, and it kept more: pythia-70m
    # bf16-true mb8 x 256 with AdamW8bit held 189-195 MiB beyond its tensors and other terms on 298 MiB of backward's
    # transient bytes (0.63-0.65), and 214-250 MiB on 320 (0.67-0.78) once attention by blocks kept its probabilities
    # (benchmarks/plan_accuracy.py, 2026-11-28). Rounded up from those runs; the 32-true runs of the quantized optimizers
    # keep less (their plans, +0.9 % to +1.4 % at 0.40, are +6.6 % to +7.9 % with this).
    # Activation checkpointing on the CPU saves the process much less than its tensors (pythia-70m 32-true mb8 x 256:
    # 1,871-1,994 MiB with checkpointing, 2,147 without, where the traced tensor peaks are 1,079 and 1,350 MiB): the
    # recompute allocates each block's activations again between the gradients backward keeps, and the step's peak
    # (its optimizer stretch) holds 277-336 MiB of heap beyond the other terms, as much as the step without
    # checkpointing (278 MiB on its 544 MiB of activations and logits). Planned as the un-checkpointed step's
    # activations kept at this after-backward rate (overhead.recomputed_transient_bytes; issue 50).
    cpu_allocator_retention_after_backward: float = 0.80
    cpu_allocator_retention_mmap: float = 0.025
    # A quantized model dequantizes each frozen weight into a new tensor in forward and again in backward and frees
    # it at once; at default settings glibc keeps part of that churn. Fraction of one pass's dequantized bytes
    # (benchmarks/plan_accuracy.py, QLoRA nf4, bf16; step peak at default settings minus the same step with
    # MALLOC_MMAP_THRESHOLD_=65536): SmolLM2-135M mb2 x 256 0.33, TinyLlama-1.1B mb1 x 128 0.10-0.26; one
    # TinyLlama run of eight held 0.7 (2.9 GB; not reproduced). Rounded up from the other seven.
    cpu_allocator_retention_dequantized: float = 0.35


OVERHEAD = Overhead()

# CPU: the block-quantized optimizers step one tensor at a time, in fp32 temporaries of the whole tensor: the peak
# resident memory of a step above the memory before it, in fp32 copies of the tensor stepped, measured on one
# parameter of 4096 x 4096 and one of 8192 x 4096 (exactly proportional; bitsandbytes 0.50.2, torchao 0.18):
# bitsandbytes' AdamW8bit 5.0 for an fp32 parameter and 6.0 for a bf16 one (it widens the parameter too), torchao's
# AdamW4bit (its compiled step) 6.75 in either, AdamWFp8 none. On a GPU bitsandbytes' kernels update in place;
# torchao's step is the same compiled graph (Triton kernels instead of C++): counted with the CPU's copies, an
# estimate that the H200's AdamW4bit run bears out (Overhead.cuda_step_fresh_copies).
CPU_QUANTIZED_STEP_COPIES: dict[str, tuple[float, float]] = {  # optimizer -> (fp32 parameters, 16-bit parameters)
    "adamw8bit": (5.0, 6.0), "pagedadamw8bit": (5.0, 6.0), "adamw4bit": (6.75, 6.75), "adamwfp8": (0.0, 0.0),
}

# ... and what loading them adds to a CPU process, beyond those temporaries (whole runs of pretrain/main.py,
# pythia-70m mb4 x 128, 32-true and bf16-true, against the same run with AdamW, at glibc's defaults, rounded up):
# bitsandbytes 118-127 MB when importing it alone took 120 MB of resident memory, so its term is that import, measured
# (overhead.cpu_runtime_bytes's probe): by 2026-11-29 the scripts' own imports (transformers, through Lightning's
# torchmetrics) had loaded most of what it loads, it added 40 MiB, and a constant of 128 MiB planned a 2-process
# lit-model-5m AdamW8bit run +27 % (issue 50). torchao's AdamWFp8 64-82 MB and AdamW4bit
# 215-252 MB (torch.compile's inductor and a compiled step for each shape of tensor). AdamW4bit's runs kept more
# heap the more parameters they step (32-true, mb4 x 128, beyond its state and step temporaries): lit-model-5m ~93 MB,
# pythia-70m ~310 MB, pythia-160m 523 MB at the median of two runs (3,406 and 3,670 MB): 96 MiB + 0.7 x the trainable
# parameters' fp32 bytes, which plans those runs -1.1 %, +3.9 % (bf16-true +2.5 %) and +1.7 % (against the higher run
# -2.0 %): an estimate fitted to three models.
CPU_OPTIMIZER_LIBRARY: dict[str, int] = {"adamw4bit": 96 * MiB, "adamwfp8": 96 * MiB}
BITSANDBYTES_CPU_OPTIMIZERS = ("adamw8bit", "pagedadamw8bit")
CPU_OPTIMIZER_HEAP_PER_FP32_BYTE: dict[str, float] = {"adamw4bit": 0.7}
TORCHAO_OPTIMIZERS = ("adamw4bit", "adamwfp8")


def cpu_optimizer_library_bytes(optimizer: str, trainable_numel: Callable[[], int],
                                bitsandbytes_import: Callable[[], int]) -> int:
    """What the optimizer's library and its step leave in a CPU process beyond the tensors (0 for torch's own).
    ``trainable_numel`` is asked only for an optimizer whose heap grows with the model (plans run this per phase),
    ``bitsandbytes_import`` (the resident bytes importing bitsandbytes adds, measured) only for its optimizers."""
    name = optimizer.lower()
    if name in BITSANDBYTES_CPU_OPTIMIZERS:
        return bitsandbytes_import()
    heap = CPU_OPTIMIZER_HEAP_PER_FP32_BYTE.get(name)
    return CPU_OPTIMIZER_LIBRARY.get(name, 0) + (int(heap * 4 * trainable_numel()) if heap else 0)


def quantized_step_bytes(optimizer: str, numel: int, param_bytes: int, device_type: str) -> int:
    """The temporaries of a block-quantized optimizer's step on one tensor of ``numel`` elements (0 for others, and
    for bitsandbytes' in-place GPU kernels)."""
    copies = CPU_QUANTIZED_STEP_COPIES.get(optimizer.lower())
    if copies is None or (device_type != "cpu" and optimizer.lower() not in TORCHAO_OPTIMIZERS):
        return 0
    return math.ceil(copies[0 if param_bytes == 4 else 1] * 4 * numel)


# ---- speed -------------------------------------------------------------------------------------------
# Step-time factor of each lever relative to the run without it (>1: slower), for the same global batch.
# "cpu" values were measured with `python benchmarks/plan_accuracy.py --speed` (lit-model-40m, fp32, micro
# batch 4 x 256 tokens, 2 shared cores, one run each: about +-10 % noise; benchmarks/results/
# plan_accuracy.speed.csv); "cuda" values are estimates from the usual accounting (forward ~1/3 of a step,
# bf16 tensor cores ~2-3x fp32) and public reports, to be measured when a GPU is lent.
SPEED: dict[str, dict[str, float]] = {
    # One extra forward of every checkpointed block: 4/3 when forward is 1/3 of the step.
    "activation_checkpointing": {"cuda": 1.33, "cpu": 1.25},
    # The levers below, "cpu": the whole-run ladder (benchmarks/results/memory_ladder.md, lit-model-5m, fp32,
    # micro batch 8 x 512 tokens, CPU-time tokens/s against the baseline in the same invocation, +-20 % noise):
    # selective 0.93x, disk offloading 1.00x, AC + disk 0.89x, MLP in 4 tiles 0.97x. An earlier step-only
    # measurement (micro batch 4 x 256, load ~7) gave 1.2, 1.75 and 2.9 for the same levers: small tiles of a small
    # model are slower, and files cost more when the page cache is short. The factors below are the ladder's,
    # rounded towards slower, so no lever is ranked as free.
    # Selective checkpointing (activations.py): only the element-wise ops are recomputed. GPU (estimate):
    # torchtitan reports op-level SAC at a few % over no AC.
    "activation_checkpointing_selective": {"cuda": 1.1, "cpu": 1.1},
    # Offloading saved activations: to pinned host memory on a side stream (GPU, estimate: the copies overlap the
    # forward, the way back in backward does not), to files (disk; lit-model-40m at 4 x 1,024 tokens in
    # benchmarks/results/memory_target.md: 0.91x with AdamW4bit against AdamW8bit).
    "activation_offloading_cpu": {"cuda": 1.2, "cpu": 1.2},  # CPU: refused (nothing to move to); not suggested
    "activation_offloading_disk": {"cuda": 2.0, "cpu": 1.15},
    # --mlp_tiles 4: every MLP's forward runs twice (GPU, estimate: the MLP is about 2/3 of a block's matmuls).
    "mlp_tiles": {"cuda": 1.25, "cpu": 1.1},
    # fp32 -> bf16-true: tensor cores on GPU (estimate 0.5). On this CPU (bf16 matmul support) measured 0.93;
    # lit_model/core/precision.py reports 4-7x slower bf16 on other CPUs, so treat the CPU value as machine-specific.
    "precision_bf16_true_from_32": {"cuda": 0.5, "cpu": 0.93},
    # bf16-mixed -> bf16-true: no fp32 master weights / casts (estimate).
    "precision_bf16_true_from_mixed": {"cuda": 0.85, "cpu": 1.0},
    # Halving the micro batch (global batch kept by accumulation): less parallel work per kernel.
    "halve_micro_batch": {"cuda": 1.12, "cpu": 1.34},
    # bitsandbytes 8-bit AdamW: the optimizer step is a small part of a step (estimate on GPU, measured CPU).
    "optimizer_8bit": {"cuda": 1.02, "cpu": 1.25},
    # torchao's 4-bit AdamW, GaLore (rank 128; its SVD every 200 steps is not in a short run) and the optimizer step
    # inside backward (one small optimizer step per parameter). CPU: lit-model-5m pretraining, fp32, micro batch 8 x
    # 512, against AdamW in the same invocation of benchmarks/memory_ladder.py (CPU-time tokens/s 0.98, 1.01 and
    # 1.05 of AdamW's in the committed ladder; 0.87, 0.98 and 0.96 in an earlier run; full fine-tuning with GaLore
    # 0.92), all inside that benchmark's +-20 % noise: the slower figures are kept. GPU: estimates (torchao reports
    # its low-bit AdamW close to AdamW's speed; GaLore's paper a small overhead).
    "optimizer_4bit": {"cuda": 1.05, "cpu": 1.15},
    "optimizer_galore": {"cuda": 1.1, "cpu": 1.05},
    "optimizer_in_backward": {"cuda": 1.02, "cpu": 1.04},
    # 4-bit base weights: dequantization in every forward/backward matmul. litgpt's resource table
    # (Llama-2-7B LoRA, A100): 2.36 min -> 3.68 min per 1k iterations = 1.56. CPU: LoRA vs QLoRA, measured.
    "quantize_nf4": {"cuda": 1.56, "cpu": 1.10},
    # FSDP CPU offload: parameters, gradients and optimizer state cross PCIe every step (estimate 2.5-4x).
    "cpu_offload": {"cuda": 3.0, "cpu": 1.3},  # CPU: not suggested (the same RAM); estimate
    # Sharding over N GPUs: all-gathers and reduce-scatters per step; per-GPU step time of the same per-GPU
    # micro batch (estimate; litgpt's 2xA100 LoRA table shows 1.5-2.5x for PCIe-bound small models).
    "fsdp_per_doubling": {"cuda": 1.15, "cpu": 1.4},
    # Cropping sequences: fewer tokens per step (faster), but the data changes; ranked with a penalty.
    "crop_sequence": {"cuda": 1.0, "cpu": 1.0},
}

# Changes that alter what is trained (not only how) are ranked as if this much slower, so that a lever that
# keeps the run's meaning wins over one that changes it.
QUALITY_PENALTY: dict[str, float] = {
    "override_max_seq_length": 2.0,  # long samples are cut: the model never sees their end
    "quantize": 1.15,  # frozen base weights are approximated in 4 bits
    "precision": 1.05,  # bf16 weights/optimizer state round small updates
    "optimizer": 1.05,  # 8-bit optimizer state
    "optimizer_4bit": 1.1,  # 4-bit optimizer state (torchao reports 4-bit AdamW close to AdamW on fine-tuning)
    "optimizer_low_rank": 1.2,  # GaLore: the blocks' updates confined to a rank-r subspace between refreshes
    "grad_clip": 1.05,  # --optimizer_in_backward needs --grad_clip 0: no clipping of the global gradient norm
    "devices": 1.5,  # needs more GPUs: a cost, not a slowdown
}

# Suggestions that need N GPUs try these counts.
DEVICE_COUNTS = (2, 4, 8)
# Host <-> GPU bytes per second that paged optimizer state moves at: PCIe 4.0 x16's usual practical rate, an assumption
# (not measured here) behind the paged verdict's slowdown estimate
PCIE_BYTES_PER_S = 25 * GB


def calibrate_on_gpu() -> str:  # pragma: no cover - documentation
    """How to calibrate ``OVERHEAD`` when a GPU is lent:

    1. ``nvidia-smi --query-gpu=memory.used`` right after ``torch.cuda.init()`` + one matmul: cuda_context.
    2. Run ``benchmarks/plan_accuracy.py`` configurations on the GPU, comparing ``plan.by_category`` without
       ``overhead`` against ``torch.cuda.max_memory_allocated()`` (must agree to ~1 %: the trace is exact)
       and ``max_memory_reserved() - max_memory_allocated()`` against ``cuda_fragmentation`` x transient.
    3. Time each lever on Llama-3.2-1B / lit-model-40m for the ``SPEED["..."]["cuda"]`` entries.
    """
    return calibrate_on_gpu.__doc__ or ""
