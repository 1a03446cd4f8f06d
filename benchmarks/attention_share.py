"""How much of a CPU training step is attention, and what the other attention kernels would cost.

    python benchmarks/attention_share.py      # ~3 minutes on 2 cores; writes benchmarks/results/attention_share.{md,csv}

What the user-level benchmark (vs_peers.py) cannot show: the share of one kernel in the step. Every implementation
it compares calls the same PyTorch kernel for causal attention on the CPU (``F.scaled_dot_product_attention``, the
flash kernel), so where that kernel is most of the step, no implementation can be much faster than another.

Step share: vs_peers.py's 5.26M model (4 layers, 256 wide, 4 heads of 64, vocab 4096) as lit-model builds it, in
one process: forward with lit-model's fused loss, backward, gradient clipping at 1.0 and lit-model's AdamW, random
tokens, torch's default threads; ``--steps`` steps under ``torch.profiler`` after a warm-up. attention_share is the
flash kernel's self CPU time (its forward and backward ops) over the whole step's self CPU time. ms_per_step is
timed without the profiler (median of three stretches of ``--steps`` steps). This is the model's step alone, not
the script (no data loading or logging), which vs_peers.py measures.

Kernels: the attention alone, (micro batch, 4 heads, T, 64) queries, keys and values as attention makes them (a
transposed view), forward and backward, best of ``--repeats``: the flash kernel (``is_causal=True``), PyTorch's math
kernel (``SDPBackend.MATH``) and the explicit form (``q @ k^T`` in the compute dtype, softmax in fp32, rounded back,
``@ v``), which keeps the T x T probabilities for backward and, in bf16, rounds the scores to bf16 before the
softmax (the flash kernel accumulates them in fp32).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile

from _tables import best_seconds, cpu_description, csv_text, markdown_table
from vs_peers import ARCH
from lit_model import GPT, Config
from lit_model.core.files import atomic_write
from lit_model.core.precision import param_dtype
from lit_model.train.optimizers import build_optimizer
from lit_model.methods.objective import CausalLM, mean_loss

RESULTS = Path(__file__).resolve().parent / "results"
ROWS = [(256, 1), (256, 8), (1024, 1), (1024, 8)]  # (block, micro batch)
PRECISIONS = ("32-true", "bf16-true")
HEADS, HEAD_SIZE = ARCH["n_head"], ARCH["n_embd"] // ARCH["n_head"]


def training_step(block: int, micro: int, precision: str):
    config = Config(name="peer-5m", block_size=block, **ARCH)
    torch.manual_seed(0)
    model = GPT(config).to(param_dtype(precision))
    optimizer = build_optimizer(model, "AdamW", learning_rate=1e-3, weight_decay=0.1, device_type="cpu",
                                param_dtype=param_dtype(precision))
    idx, targets = (torch.randint(0, ARCH["vocab_size"], (micro, block)) for _ in range(2))

    def step() -> None:
        mean_loss(CausalLM(), model, (idx, targets)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def step_share(block: int, micro: int, precision: str, steps: int) -> dict:
    step = training_step(block, micro, precision)
    for _ in range(3):
        step()
    stretches = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        stretches.append((time.perf_counter() - start) / steps)
    with profile() as profiler:
        for _ in range(steps):
            step()
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    attention = sum(event.self_cpu_time_total for event in events if "scaled_dot_product" in event.key)
    return {"block": block, "micro_batch": micro, "precision": precision,
            "ms_per_step": round(statistics.median(stretches) * 1e3, 2),
            "tokens_per_sec": round(micro * block / statistics.median(stretches)),
            "attention_share": round(attention / total, 3)}


def kernel_times(block: int, micro: int, precision: str, repeats: int) -> dict:
    dtype = param_dtype(precision)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(micro, block, HEADS, HEAD_SIZE, dtype=dtype, generator=generator).transpose(1, 2)
               .requires_grad_() for _ in range(3))
    upstream = torch.randn(micro, HEADS, block, HEAD_SIZE, dtype=dtype, generator=generator)
    above_diagonal = torch.ones(block, block, dtype=torch.bool).triu(1)

    def kernel(backend: SDPBackend):
        def run() -> None:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(upstream)
        return run

    def explicit() -> None:
        scores = (q @ k.transpose(-2, -1)).float().mul_(HEAD_SIZE ** -0.5).masked_fill_(above_diagonal, float("-inf"))
        (scores.softmax(-1).to(dtype) @ v).backward(upstream)

    return {"flash_ms": round(best_seconds(kernel(SDPBackend.FLASH_ATTENTION), repeats) * 1e3, 2),
            "math_ms": round(best_seconds(kernel(SDPBackend.MATH), repeats) * 1e3, 2),
            "explicit_ms": round(best_seconds(explicit, repeats) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    rows = []
    for block, micro in ROWS:
        for precision in PRECISIONS:
            row = {**step_share(block, micro, precision, args.steps), **kernel_times(block, micro, precision, args.repeats)}
            print(row, flush=True)
            rows.append(row)
    text = "\n\n".join([
        "# Attention's share of a CPU training step",
        "Regenerate: `python benchmarks/attention_share.py` (see its docstring for exactly what is measured).",
        f"CPU: {cpu_description()}; torch {torch.__version__}, {torch.get_num_threads()} threads.",
        "attention_share: the flash kernel's share of the step's self CPU time (the model's step in one process, "
        "vs_peers.py's 5.26M model, lit-model's code). flash_ms / math_ms / explicit_ms: the attention alone (4 heads "
        "of 64 over the micro batch), forward and backward, with each kernel.",
        markdown_table(rows),
    ]) + "\n"
    atomic_write(RESULTS / "attention_share.md", text)
    atomic_write(RESULTS / "attention_share.csv", csv_text(rows))
    print(text)


if __name__ == "__main__":
    main()
