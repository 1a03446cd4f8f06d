"""Where torch.compile's training memory goes on a GPU: one forward and backward of a model in bf16, per variant.

    python benchmarks/compile_memory_gpu.py [MODEL BATCH SEQ [VARIANTS]]   # default: pythia-160m 8 1024, all four

Variants: ``eager``; ``compiled`` (``torch.compile(model)``, the whole model with its fused loss, what --compile did
until 2026-11-27); ``compiled_one_chunk`` (the same with the loss in one chunk); ``compiled_blocks`` (each block
compiled in place, the loss eager: what --compile does now). Per iteration (the first one compiles): the bytes alive
after the forward, the forward's peak and the step's peak above the memory before it (GiB), the reserved peak and
seconds. Results of a lent H200: benchmarks/results/compile_memory_gpu.txt. On a CPU only the timings mean anything.
"""
import json
import sys
import time
from typing import Callable

import torch

from lit_model.core.config import Config
from lit_model.methods.objective import CausalLM, mean_loss
from lit_model.model.gpt import GPT
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE

VARIANTS = ("eager", "compiled", "compiled_one_chunk", "compiled_blocks")
GiB = 2**30


def step_function(model: GPT, variant: str, x: torch.Tensor, y: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The forward of this variant, returning the loss."""
    objective = CausalLM(x.numel() if variant == "compiled_one_chunk" else DEFAULT_LOSS_CHUNK_SIZE)
    if variant in ("compiled", "compiled_one_chunk"):
        compiled = torch.compile(model)
        return lambda: mean_loss(objective, compiled, (x, y))
    if variant == "compiled_blocks":
        for block in model.blocks:
            block.compile()
    return lambda: mean_loss(objective, model, (x, y))


def measure(name: str, batch: int, seq: int, variant: str, device: str, iterations: int = 6) -> None:
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(Config.from_name(name)).to(torch.bfloat16)
    vocab = model.config.vocab_size
    x, y = (torch.randint(0, vocab, (batch, seq), device=device) for _ in range(2))
    forward = step_function(model, variant, x, y)
    cuda = device == "cuda"
    for iteration in range(iterations):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        loss = forward()
        after_forward = torch.cuda.memory_allocated() - base if cuda else 0
        forward_peak = torch.cuda.max_memory_allocated() - base if cuda else 0
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        row = {"saved_after_fwd": after_forward / GiB, "fwd_peak": forward_peak / GiB,
               "step_peak": (torch.cuda.max_memory_allocated() - base if cuda else 0) / GiB,
               "reserved": (torch.cuda.max_memory_reserved() if cuda else 0) / GiB, "s": time.perf_counter() - start}
        model.zero_grad(set_to_none=True)
        print(variant, iteration, json.dumps(row), flush=True)
    del model, loss, forward
    if cuda:
        torch.cuda.empty_cache()


def main() -> None:
    name, batch, seq = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3])) if len(sys.argv) > 3 else ("pythia-160m", 8, 1024)
    variants = sys.argv[4].split(",") if len(sys.argv) > 4 else VARIANTS
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for variant in variants:
        measure(name, batch, seq, variant, device)


if __name__ == "__main__":
    main()
