"""The memory planner on a mixture of experts, against measured CPU runs. One command:

    python benchmarks/moe_plan.py        # 4 runs x 2 routings (~5 minutes on 2 cores)

Each run is plan_accuracy.py's measured worker (a fresh process; its docstring says exactly what is measured)
on MODEL below, with the router as trained (``random``: near-balanced) and with every token sent to experts
0..k-1 (``first_k``: the router's logits biased by +100), the routing the planner's trace assumes because it
needs the most memory (lit_model.model.gpt.expert_tokens). Predicted: ``plan_training(..., device_type="cpu")``'s
train-step peak without its overhead category, from the trace and from the analytic model. Writes
benchmarks/results/moe_plan.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import RESULTS, job_config, run_worker, settings_for, worker  # noqa: E402
from lit_model.core.files import atomic_write

MODEL = dict(name="moe-bench", block_size=256, vocab_size=8192, padded_vocab_size=8192, n_layer=4, n_embd=256, n_head=4,
             n_query_groups=2, intermediate_size=512, mlp_class_name="LLaMAMoE", n_expert=8, n_expert_per_token=2)
# precision, trainable, LoRA on every expert, activation checkpointing, micro batch, sequence length
RUNS = [("32-true", "full", False, False, 4, 256), ("bf16-true", "full", False, False, 4, 256),
        ("32-true", "lora", True, False, 4, 256), ("32-true", "full", False, True, 4, 256)]

NOTES = """## What the rows say

- **The trace follows the router.** Under fake tensors `expert_tokens` sends every token to experts 0..k-1. The saved
  activations of the experts add up to k rows per token whatever the routing; what one expert has in flight in its
  forward and backward grows with its rows, at most one per token. So this routing needs the most memory, and its
  `first_k` measurement is the one the trace must match. Before this change the trace failed on `aten.nonzero`
  (the router's data-dependent `torch.where`) and every MoE plan fell back to the analytic estimate.
- **fp32:** the random router measures at most `first_k` (-0.7 % without activation checkpointing, -3.7 % with
  it), and 5 steps measure the same as 2.
- **bf16 on the CPU:** the random router measures more than `first_k`, and the gap grows over the first steps.
  This memory is not tensors. Every expert gets a new row count each step, and oneDNN (PyTorch's kernels for bf16
  products on the CPU) makes and keeps a kernel for each new shape, about 0.7 MB each, in two caches (oneDNN's
  primitive cache and ideep's: `ONEDNN_PRIMITIVE_CACHE_CAPACITY`, `LRU_CACHE_CAPACITY`, 1,024 each by default).
  The table's bf16 row was measured with those defaults: 276.3 MB after 2 steps, 329.2 after 5, and (by hand)
  419.2 after 20, still growing. lit-model now caps both caches at 256 (lit_model/kernels/ops.py; the scripts and the
  worker set it): 260.1 MB after 2 steps, 299.1 after 5, 301.2 after 20, 301.7 after 40, so the growth stops
  once the caches are full. The plan counts them full (its `kernel_cache` term: 256 x 1 MiB, the measured 0.7 MB
  a kernel rounded up), so the whole plan stays above the process however many steps run. The by-hand figures are
  plan_accuracy's `run_worker` on this model with `"precision": "bf16-true", "routing": "random", "steps": N`
  (uncapped: the two variables set to 1024); 2 shared cores, a few minutes each.
- `python pretrain/main.py --model_config moe-bench.yaml --micro_batch_size 4 --global_batch_size 4 --plan json`
  (MODEL as YAML, the data flags left at their defaults) plans row 1 with engine `trace` and `tensor_peak_bytes`
  355688968 (the trace column). Its `peak_bytes` of 932 MB, with the process overhead, is above the process's
  measured peak of 695 MB.
"""


class FirstK(nn.Module):
    """The router's linear layer with +100 on experts 0..k-1: every token chooses them."""

    def __init__(self, gate: nn.Linear, k: int) -> None:
        super().__init__()
        self.gate = gate
        self.register_buffer("bias", torch.tensor([100.0] * k + [0.0] * (gate.out_features - k)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) + self.bias.to(x.dtype)


def route_to_first_k() -> None:
    from lit_model.model.gpt import LLaMAMoE

    init = LLaMAMoE.__init__

    def first_k_init(self: LLaMAMoE, config) -> None:
        init(self, config)
        self.gate = FirstK(self.gate, config.n_expert_per_token)

    LLaMAMoE.__init__ = first_k_init


def predict(job: dict) -> dict[str, float]:
    from lit_model.plan.training import plan_training

    settings = settings_for(job["precision"], job["micro_batch"], job["seq_len"], job["ac"], lora_mlp=job["lora_mlp"])
    out = {}
    for engine in ("trace", "analytic"):
        plan = plan_training(job_config(job), settings, trainable=job["trainable"], device_type="cpu", engine=engine,
                             suggest=False, detect=False)
        assert plan.engine == engine, plan.notes
        out[engine] = sum(v for k, v in plan.phase_categories["train_step"].items() if k != "overhead")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        job = json.loads(args.worker)
        if job["routing"] == "first_k":
            route_to_first_k()
        print(json.dumps(worker(job)))
        return
    lines = [
        "# Memory planner on a mixture of experts (CPU)", "", "Generated by `python benchmarks/moe_plan.py` (see its "
        "docstring). Model: " + ", ".join(f"{k}={v}" for k, v in MODEL.items()) + ". Measured: VmHWM minus the RSS "
        "before the model is built (plan_accuracy.py's worker, 2 training steps). Error = (predicted - measured) / "
        "measured `first_k`, the routing the trace assumes (a random routing keeps fewer tensors; in bf16 it measures "
        "more, which is not tensors, see below).", "",
        "| precision | trainable | AC | micro batch | seq len | measured random MB | random, 5 steps MB | measured "
        "first_k MB | trace MB | analytic MB | error trace | error analytic |", "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for precision, trainable, lora_mlp, ac, micro, seq_len in RUNS:
        job = {"config": MODEL, "precision": precision, "trainable": trainable, "lora_mlp": lora_mlp, "ac": ac,
               "micro_batch": micro, "seq_len": seq_len}
        measured = {r: run_worker({**job, "routing": r}, __file__)["measured"] for r in ("random", "first_k")}
        five_steps = run_worker({**job, "routing": "random", "steps": 5}, __file__)["measured"]
        pred = predict(job)
        first_k = measured["first_k"]
        row = (f"| {precision} | {trainable}{' (every expert)' if lora_mlp else ''} | {'on' if ac else 'off'} | {micro} "
               f"| {seq_len} | {measured['random'] / 1e6:.1f} | {five_steps / 1e6:.1f} | {measured['first_k'] / 1e6:.1f} "
               f"| {pred['trace'] / 1e6:.1f} | "
               f"{pred['analytic'] / 1e6:.1f} | {100 * (pred['trace'] - first_k) / first_k:+.1f} % | "
               f"{100 * (pred['analytic'] - first_k) / first_k:+.1f} % |")
        print(row, flush=True)
        lines.append(row)
    lines += ["", NOTES]
    atomic_write(RESULTS / "moe_plan.md", "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
