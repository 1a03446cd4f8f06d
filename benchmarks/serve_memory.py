"""How many sequences a KV cache of a given size holds at once: the paged cache (infer/paged.py, scheduled by
infer/batching.py) against a cache reserved per request, for the same pool bytes and the same mixed-length requests.

    python benchmarks/serve_memory.py [--model pythia-14m] [--requests 256] [--pool_sequences 8] [--seed 0] [--context 2048] [--vocab_size 4096]

The pool is ``--pool_sequences`` x the model's context x the bytes per position in bf16 (a cache reserved at the
context length for each request holds exactly that many sequences). Requests draw a prompt of 16-512 tokens and
max_tokens of 16-256 (uniform, ``--seed``), decode greedily without an eos (each runs its whole max_tokens), and are
all queued at once. Measured on the real engine, every step: the running sequences, while requests are waiting for
blocks (so the pool, not the queue, limits the batch). Compared with two reservations of the same bytes: the context
length per request (what a static cache of the model's length holds), and each request's own prompt + max_tokens
(what a cache sized to the request holds, every request reserving its whole length up front; over the same request
mix, the mean). Run for the bf16 and the int8 pools (the int8 pool: the same bytes, twice the blocks less its scales).

Results: benchmarks/results/serve_memory.md and .csv.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from lit_model import GPT, Config  # noqa: E402
from lit_model.infer.batching import Engine, Request  # noqa: E402
from lit_model.infer.engine import Sampling  # noqa: E402
from lit_model.infer.load import Precision  # noqa: E402
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, PoolSpec, block_bytes  # noqa: E402

FP32 = Precision("32-true", torch.float32, autocast=None)  # the model computes in fp32 (fast on any CPU), the pool stores bf16 / int8


def draw_requests(count: int, seed: int, vocab: int) -> list[Request]:
    g = torch.Generator().manual_seed(seed)

    def uniform(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=g))

    return [Request(str(i), tuple(torch.randint(1, vocab, (uniform(16, 512),), generator=g).tolist()),
                    uniform(16, 256), Sampling(temperature=0)) for i in range(count)]


def measure(model: GPT, requests: list[Request], pool: PoolSpec) -> dict[str, float]:
    """Run every request to its end; the running sequences at each step where some were waiting."""
    engine = Engine(model, FP32, pool, max_batch=len(requests))
    for request in requests:
        engine.add(request)
    limited: list[int] = []
    start = time.perf_counter()
    while engine.has_work():
        waiting_before = engine.stats().waiting
        engine.step()
        if waiting_before and engine.stats().waiting:
            limited.append(engine.stats().running)
    assert engine.stats().free_blocks == pool.num_blocks and limited, "the pool never limited the batch: queue more"
    return {"mean_running": statistics.mean(limited), "max_running": max(limited),
            "preemptions": engine.stats().preemptions, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="pythia-14m")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--pool_sequences", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=2048, help="the model's context (what a static cache holds)")
    parser.add_argument("--vocab_size", type=int, default=4096,
                        help="a small head: the counts depend on the pool, not on how fast a step runs")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = replace(Config.from_name(args.model), block_size=args.context, vocab_size=args.vocab_size,
                     padded_vocab_size=args.vocab_size)
    with torch.device("cpu"):
        model = GPT(config)
    model.init_weights()
    model.eval()
    context = config.block_size
    per_position = block_bytes(config, DEFAULT_BLOCK_SIZE, "bf16", torch.bfloat16) / DEFAULT_BLOCK_SIZE
    pool_bytes = int(args.pool_sequences * context * per_position)
    requests = draw_requests(args.requests, args.seed, config.vocab_size)
    own_lengths = [len(r.prompt_ids) + r.max_new_tokens for r in requests]
    reserved_context = pool_bytes // int(context * per_position)
    reserved_own = pool_bytes / (statistics.mean(own_lengths) * per_position)
    rows = []
    for kv_dtype in ("bf16", "int8"):
        blocks = pool_bytes // block_bytes(config, DEFAULT_BLOCK_SIZE, kv_dtype, torch.bfloat16)
        result = measure(model, requests, PoolSpec(blocks, DEFAULT_BLOCK_SIZE, kv_dtype))
        rows.append({"kv_dtype": kv_dtype, "pool_MiB": round(pool_bytes / 2**20, 1), "blocks": blocks,
                     "reserved_at_context": reserved_context, "reserved_at_own_length": round(reserved_own, 1),
                     "paged_mean": round(result["mean_running"], 1), "paged_max": result["max_running"],
                     "x_context": round(result["mean_running"] / reserved_context, 2),
                     "x_own_length": round(result["mean_running"] / reserved_own, 2),
                     "preemptions": result["preemptions"], "seconds": round(result["seconds"], 1)})
        print(rows[-1], flush=True)
    write(rows, args, config, statistics.mean(own_lengths))


def write(rows: list[dict], args: argparse.Namespace, config: Config, mean_length: float) -> None:
    out = HERE / "results"
    with open(out / "serve_memory.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    cpu = platform.processor() or platform.machine()
    lines = [
        "# Concurrent sequences per pool: paged KV cache vs a cache reserved per request",
        "",
        f"Generated by `python benchmarks/serve_memory.py --model {args.model} --requests {args.requests} "
        f"--pool_sequences {args.pool_sequences} --seed {args.seed} --context {args.context} --vocab_size {args.vocab_size}` (CPU: {cpu}; the counts do not depend on "
        "the machine). See the script's docstring for what is measured.",
        "",
        f"{config.name}'s shape with a vocabulary of {config.vocab_size}: context {config.block_size} tokens; {args.requests} requests, prompt 16-512 and max_tokens "
        f"16-256 tokens drawn uniformly (mean prompt + max_tokens {mean_length:.0f} tokens); blocks of "
        f"{DEFAULT_BLOCK_SIZE} positions. 'paged': the mean number of running sequences over the steps where "
        "requests were waiting for blocks.",
        "",
        "| cache | pool MiB | blocks | reserved at the context | reserved at each request's length | paged (mean) "
        "| paged (max) | paged / reserved at context | paged / reserved at own length | preemptions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['kv_dtype']} | {r['pool_MiB']} | {r['blocks']} | {r['reserved_at_context']} | "
                     f"{r['reserved_at_own_length']} | {r['paged_mean']} | {r['paged_max']} | {r['x_context']}x | "
                     f"{r['x_own_length']}x | {r['preemptions']} |")
    if len(rows) == 2:
        lines += ["", f"The int8 pool holds {rows[1]['paged_mean'] / rows[0]['paged_mean']:.2f}x the bf16 pool's "
                  "sequences in the same bytes."]
    (out / "serve_memory.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
