"""This CPU's dense matmul peak, and what fraction of it a training run achieves.

    python benchmarks/matmul_peak.py                                # the peak, fp32 and bf16
    python benchmarks/matmul_peak.py --tokens_per_sec 5000 --block 256 --precision bf16-true

The peak: torch.mm on square matrices (4096 by default), torch's default threads, best of --repeats timed calls
after a warm-up one: 2 n^3 FLOP per call. A training step's FLOP per token: 6 N + 12 n_layer n_embd T (the PaLM
paper's count: N the parameters that multiply (all but the embedding table; the output head included), T the
sequence length; the attention term counts the full T x T scores, as if nothing were skipped under the causal
mask). vs_peers.py reports lit-model's pretraining rows with it.
"""

from __future__ import annotations

import argparse
import time

FORMULA = ("Achieved training FLOP/s = tokens/s x (6 N + 12 n_layer n_embd T): N the parameters that multiply (all "
           "but the embedding table and the norms, the output head included: 4,210,688 for the 5.26M model), T the block size; "
           "the attention term counts the full T x T scores (PaLM's count), whatever the causal mask lets a kernel skip.")
DEFAULT_ARCH = dict(vocab_size=4096, n_layer=4, n_embd=256, n_head=4, n_query_groups=4, intermediate_size=688)


def matmul_peak(precision: str = "32-true", size: int = 4096, repeats: int = 5) -> float:
    """The best FLOP/s of torch.mm on two size x size matrices of the precision's dtype."""
    import torch

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def matmul_parameters(vocab_size: int, n_layer: int, n_embd: int, n_head: int, n_query_groups: int,
                      intermediate_size: int, **_: object) -> int:
    """The weights of a Llama-style model's matrix products: attention (query, key, value, output), the MLP's three
    matrices, and the untied output head."""
    head = n_embd // n_head
    attention = n_embd * head * (2 * n_head + 2 * n_query_groups)
    return n_layer * (attention + 3 * n_embd * intermediate_size) + vocab_size * n_embd


def training_flops_per_token(block: int, **arch: object) -> float:
    return 6 * matmul_parameters(**arch) + 12 * int(arch["n_layer"]) * int(arch["n_embd"]) * block


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens_per_sec", type=float, help="a run's training tokens/s, to report against the peak")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    args = parser.parse_args()
    peaks = {p: matmul_peak(p, args.size, args.repeats) for p in ("32-true", "bf16-true")}
    for precision, peak in peaks.items():
        print(f"torch.mm {args.size} x {args.size}, {precision}: {peak / 1e9:,.1f} GFLOP/s (best of {args.repeats})")
    if args.tokens_per_sec:
        achieved = args.tokens_per_sec * training_flops_per_token(args.block, **DEFAULT_ARCH)
        print(f"{FORMULA}\n{args.tokens_per_sec:,.0f} tokens/s at block {args.block}: {achieved / 1e9:,.1f} GFLOP/s, "
              f"{achieved / peaks[args.precision]:.3f} of the {args.precision} peak")


if __name__ == "__main__":
    main()
