"""How close is the memory planner to reality? One command:

    python benchmarks/plan_accuracy.py            # the CPU grid + the published GPU figures (~10 minutes)
    python benchmarks/plan_accuracy.py --quick    # 4 configurations, to see that it works
    python benchmarks/plan_accuracy.py --speed    # CPU step-time factors of the memory levers (calibration.SPEED)

What is measured, per configuration, in a fresh Python process started with ``MALLOC_MMAP_THRESHOLD_=65536``
(glibc then returns freed blocks above 64 KiB to the OS at once, so resident memory tracks live tensors):

1. import torch and lit_model (model, LoRA, optimizers);
2. warm up: one training step of a 1-block copy of the same configuration (same shapes, dtype and kernels),
   then free it. This puts one-time runtime costs -- the kernels' code pages, OpenMP threads, oneDNN's JIT
   kernels, ~100-110 MB here, reported as ``runtime_init_mb`` -- into the baseline: they are part of the
   planner's CPU process overhead (calibration.OVERHEAD.cpu_process_baseline), not of the model's tensors;
3. ``baseline`` = VmRSS from /proc/self/status; then reset the process's peak RSS
   (``echo 5 > /proc/self/clear_refs`` sets VmHWM to the current RSS); this is before the model is built;
4. build the model directly in the run's dtype (``torch.set_default_dtype``), apply LoRA (lit_model.lora, r=8,
   query+value, dropout 0.05) / activation checkpointing, build the optimizer with
   ``lit_model.training.optimizers.build_optimizer`` (fused AdamW) and run 2 training steps as
   ``lit_model/training/loop.py`` does (forward with targets, backward, gradient clipping at 1.0,
   ``optimizer.step()``, ``zero_grad(set_to_none=True)``);
5. ``measured`` = VmHWM - baseline: the peak resident memory building and training the model added.

``predicted`` is ``plan_training(..., device_type="cpu")``'s train-step peak *without* its overhead category
(the process baseline it would add is subtracted in the measurement), from the exact trace and from the
analytic model. Results go to benchmarks/results/plan_accuracy.{csv,md,png}; the .md also compares the
planner with published GPU figures (litgpt, torchtune) at stated sequence lengths.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

# model, precision, trainable, activation checkpointing, micro batch, sequence length
GRID = [
    *[("lit-model-5m", p, t, ac, 4, 256) for p in ("32-true", "bf16-true") for t in ("full", "lora") for ac in (False, True)],
    ("lit-model-5m", "32-true", "full", False, 1, 512),
    ("lit-model-5m", "bf16-true", "lora", False, 1, 512),
    ("lit-model-5m", "32-true", "lora", True, 8, 128),
    ("lit-model-5m", "bf16-true", "full", False, 8, 128),
    *[("lit-model-40m", p, t, ac, 2, 256) for p in ("32-true", "bf16-true") for t in ("full", "lora") for ac in (False, True)],
    ("lit-model-40m", "32-true", "full", False, 1, 512),
    ("lit-model-40m", "bf16-true", "lora", True, 1, 512),
    ("lit-model-40m", "32-true", "lora", False, 4, 128),
    ("lit-model-40m", "bf16-true", "full", True, 4, 128),
]
QUICK = [GRID[0], GRID[3], GRID[16], GRID[19]]

# Published GPU figures (../shared/README.md). Sequence lengths are not given with them: litgpt's resource
# table says the longest Alpaca sample is 1304 tokens for Llama 2 and 1044 for phi-1.5 (batches are padded to
# their longest sample, so a run's peak comes from its longest batch); torchtune's Alpaca recipes were assumed
# to see the same 1304-token samples. litgpt reports torch.cuda.max_memory_allocated() (GB = 1e9), torchtune
# "peak memory reserved".
PUBLISHED = [
    # label, model, trainable, precision, quantize, micro batch, seq len, AC, lora targets, published GB, metric
    ("litgpt Llama-2-7B LoRA bf16-true mb1", "Llama-2-7b-hf", "lora", "bf16-true", None, 1, 1304, False, ("query", "value"), 21.30, "allocated"),
    ("litgpt Llama-2-7B LoRA bf16-true mb2", "Llama-2-7b-hf", "lora", "bf16-true", None, 2, 1304, False, ("query", "value"), 29.07, "allocated"),
    ("litgpt Llama-2-7B QLoRA bnb.nf4 mb1", "Llama-2-7b-hf", "lora", "bf16-true", "bnb.nf4", 1, 1304, False, ("query", "value"), 14.14, "allocated"),
    ("litgpt phi-1.5 LoRA bf16-true mb1", "phi-1_5", "lora", "bf16-true", None, 1, 1044, False, ("query", "value"), 4.82, "allocated"),
    ("torchtune Llama-2-7B LoRA (bs 2, AC)", "Llama-2-7b-hf", "lora", "bf16-true", None, 2, 1304, True, ("query", "value"), 15.57, "reserved"),
    ("torchtune Llama-2-7B QLoRA (bs 2, AC)", "Llama-2-7b-hf", "lora", "bf16-true", "bnb.nf4", 2, 1304, True,
     ("query", "key", "value", "projection", "mlp"), 9.29, "reserved"),
]


def rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def rss_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---- the measured run (in a fresh process) ---------------------------------------------------------------
def _build_and_train(job: dict, n_layer: Optional[int], steps: int) -> list[float]:
    import torch

    from lit_model import Config, GPT
    from lit_model.lora import LoRAConfig, apply_lora
    from lit_model.training.optimizers import build_optimizer

    dtype = {"32-true": torch.float32, "bf16-true": torch.bfloat16}[job["precision"]]
    config = Config.from_name(job["model"]) if n_layer is None else Config.from_name(job["model"], n_layer=n_layer)
    torch.set_default_dtype(dtype)
    try:
        model = GPT(config)
    finally:
        torch.set_default_dtype(torch.float32)
    model.max_seq_length = job["seq_len"]
    if job.get("quantize"):
        from lit_model.quantize import quantize_model

        quantize_model(model, job["quantize"], dtype)
    if job["trainable"] == "lora":
        apply_lora(model, LoRAConfig(r=8, alpha=16, dropout=0.05), dtype=dtype)
    model.activation_checkpointing_interval = 1 if job["ac"] else 0
    model.train()
    optimizer = build_optimizer(model, job.get("optimizer", "AdamW"), 1e-4, weight_decay=0.1, device_type="cpu", param_dtype=dtype)
    trainable = [p for p in model.parameters() if p.requires_grad]
    x = torch.randint(0, config.vocab_size, (job["micro_batch"], job["seq_len"]))
    y = torch.randint(0, config.vocab_size, (job["micro_batch"], job["seq_len"]))
    times = []
    for _ in range(steps):  # as lit_model/training/loop.py: forward with targets, backward, clip, step, zero_grad
        start = time.perf_counter()
        loss = model(x, targets=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        del loss
        times.append(time.perf_counter() - start)
    return times


def worker(job: dict) -> dict:
    import gc

    import torch

    import lit_model.lora  # noqa: F401  (every import before the first baseline)
    import lit_model.training.optimizers  # noqa: F401

    torch.manual_seed(0)
    after_imports = rss_now()
    # Warm-up: one step of a 1-block copy of the same run (same shapes and kernels), so that one-time runtime
    # costs -- code pages of the kernels, OpenMP threads, oneDNN's JIT kernels -- are in the baseline.
    _build_and_train(job, n_layer=1, steps=1)
    gc.collect()
    baseline = rss_now()
    reset_peak()
    times = _build_and_train(job, n_layer=None, steps=job.get("steps", 2))
    peak = rss_peak()
    return {"after_imports_rss": after_imports, "baseline_rss": baseline, "peak_rss": peak, "measured": peak - baseline,
            "runtime_init": baseline - after_imports, "step_seconds": min(times)}


def run_worker(job: dict) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1"}
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True,
                         env=env, cwd=ROOT, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"worker failed for {job}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- predictions -------------------------------------------------------------------------------------------
def settings_for(precision: str, micro: int, seq_len: int, ac: bool, **lora_flags: object) -> Any:
    """The flags of this run, as the training scripts parse them (the default loss chunk; LoRA flags as
    finetune/lora.py's attributes)."""
    from lit_model.training.args import TrainArgs

    settings = TrainArgs(precision=precision, micro_batch_size=micro, global_batch_size=micro, override_max_seq_length=seq_len,
                         activation_checkpointing=ac, optimizer="AdamW", grad_clip=1.0)
    for name, value in lora_flags.items():
        setattr(settings, name, value)
    return settings


def predict(model: str, precision: str, trainable: str, ac: bool, micro: int, seq_len: int) -> dict:
    from lit_model import Config
    from lit_model.memory import plan_training

    config = Config.from_name(model)
    out = {}
    for engine in ("trace", "analytic"):
        plan = plan_training(config, settings_for(precision, micro, seq_len, ac), trainable=trainable, device_type="cpu",
                             engine=engine, suggest=False, detect=False)
        cats = plan.phase_categories["train_step"]
        out[engine] = sum(v for k, v in cats.items() if k != "overhead")
        out[f"{engine}_categories"] = {k: v for k, v in cats.items() if k != "overhead"}
    return out


def published_rows() -> list[dict]:
    from lit_model import Config
    from lit_model.memory import plan_training
    from lit_model.memory.calibration import OVERHEAD

    rows = []
    for label, model, trainable, precision, quantize, micro, seq_len, ac, targets, published, metric in PUBLISHED:
        flags = {f"lora_{t}": (t in targets) for t in ("query", "key", "value", "projection", "mlp", "head")}
        settings = settings_for(precision, micro, seq_len, ac, lora_r=8, lora_alpha=16.0, lora_dropout=0.05, **flags)
        plan = plan_training(Config.from_name(model), settings, trainable=trainable, quantize=quantize, device_type="cuda",
                             device_memory="80GB", engine="auto", suggest=False)
        cats = plan.phase_categories[plan.peak_phase]
        allocated = plan.tensor_peak_bytes
        reserved = allocated + cats["overhead"] - OVERHEAD.cuda_context  # tensors + fragmentation + workspaces
        predicted = allocated if metric == "allocated" else reserved
        note = ""
        config = Config.from_name(model)
        if label.startswith("litgpt") and quantize:
            # bitsandbytes 0.41 (litgpt's run) kept each 4-bit layer's input for backward; 0.50 keeps only the weight
            extra = config.n_layer * micro * seq_len * (2 * config.n_embd + config.intermediate_size) * 2
            note = (f"litgpt ran bitsandbytes 0.41, whose MatMul4Bit kept every 4-bit layer's input for backward "
                    f"(0.50, used here, keeps only the packed weight): +{extra / 1e9:.2f} GB at this length -> "
                    f"{(predicted + extra) / 1e9:.2f} GB ({100 * ((predicted + extra) / 1e9 - published) / published:+.1f} %)")
        elif label.startswith("torchtune") and quantize:
            note = ("torchtune logs 9.13 GB reserved right after model init (weights loaded in bf16, then quantized; the "
                    "caching allocator keeps the freed blocks), so this figure is load-time reservation a steady-state "
                    "plan does not see; lit-model's loader quantizes block by block")
        elif label.startswith("torchtune"):
            note = "torchtune computed full-sequence fp32 logits (lit-model chunks the loss)"
        elif label.startswith("litgpt"):
            note = "litgpt 2023 computed the full logits and fused q/k/v LoRA; lit-model chunks the loss"
        rows.append({
            "note": note,
            "figure": label, "seq_len": seq_len, "metric": metric, "published_gb": published,
            "predicted_gb": round(predicted / 1e9, 2), "error_pct": round(100 * (predicted / 1e9 - published) / published, 1),
            "predicted_allocated_gb": round(allocated / 1e9, 2), "predicted_reserved_gb": round(reserved / 1e9, 2),
            "predicted_device_total_gb": round(plan.peak_bytes / 1e9, 2), "engine": plan.engine,
        })
    return rows


# ---- reporting ---------------------------------------------------------------------------------------------
def write_results(rows: list[dict], published: list[dict], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    columns = ["model", "precision", "trainable", "activation_checkpointing", "micro_batch", "seq_len", "baseline_rss_mb",
               "runtime_init_mb", "measured_mb", "predicted_trace_mb", "predicted_analytic_mb", "error_trace_pct", "error_analytic_pct",
               "step_seconds"]
    with open(out_dir / "plan_accuracy.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows({k: r[k] for k in columns} for r in rows)
    worst_trace = max(abs(r["error_trace_pct"]) for r in rows)
    worst_analytic = max(abs(r["error_analytic_pct"]) for r in rows)
    within = sum(abs(r["error_trace_pct"]) <= 10 for r in rows)
    lines = [
        "# Memory planner accuracy",
        "",
        "Generated by `python benchmarks/plan_accuracy.py` (see its docstring for exactly what is measured).",
        "",
        "Measured: peak resident memory (VmHWM) of a fresh CPU process over building the model and 2 training steps, "
        "minus its RSS before the model is built (after imports and a warm-up step of a 1-block copy of the run, which "
        "loads kernels and thread pools: `runtime_init_mb` in the CSV), with `MALLOC_MMAP_THRESHOLD_=65536`. Predicted: the planner's "
        "train-step peak without its overhead category (`plan_training(..., device_type=\"cpu\")`), from the exact "
        "trace and from the analytic model. Error = (predicted - measured) / measured.",
        "",
        f"**{within}/{len(rows)} configurations within 10 % (trace); max |error|: trace {worst_trace:.1f} %, "
        f"analytic {worst_analytic:.1f} %.**",
        "",
        "| model | precision | trainable | AC | micro batch | seq len | measured MB | trace MB | analytic MB | error trace | error analytic |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['precision']} | {r['trainable']} | {'on' if r['activation_checkpointing'] else 'off'} | "
            f"{r['micro_batch']} | {r['seq_len']} | {r['measured_mb']:.1f} | {r['predicted_trace_mb']:.1f} | "
            f"{r['predicted_analytic_mb']:.1f} | {r['error_trace_pct']:+.1f} % | {r['error_analytic_pct']:+.1f} % |"
        )
    if published:
        lines += [
            "",
            "## Published GPU figures",
            "",
            "Predictions for lit-model's implementation of the same run on a GPU (`device_type=\"cuda\"`). The anchors' "
            "sequence lengths are not published with the figures; the length assumed is in the table (litgpt: the "
            "longest Alpaca sample for the model's tokenizer, from litgpt's resource table). litgpt reports "
            "`max_memory_allocated` (compared with the predicted tensor peak); torchtune reports peak *reserved* memory "
            "(compared with tensors + the planner's fragmentation and workspace estimates, without the CUDA context). "
            "Implementations differ (litgpt 2023 computed full logits and fused q/k/v LoRA; torchtune's QLoRA leaves "
            "unadapted layers unquantized, lit-model quantizes every linear layer but the head), so these are sanity "
            "bands, not a calibration.",
            "",
            "| figure | assumed seq len | metric | published GB | predicted GB | error | predicted allocated / reserved / device total GB | note |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for p in published:
            lines.append(
                f"| {p['figure']} | {p['seq_len']} | {p['metric']} | {p['published_gb']:.2f} | {p['predicted_gb']:.2f} | "
                f"{p['error_pct']:+.1f} % | {p['predicted_allocated_gb']:.2f} / {p['predicted_reserved_gb']:.2f} / "
                f"{p['predicted_device_total_gb']:.2f} | {p['note']} |"
            )
    (out_dir / "plan_accuracy.md").write_text("\n".join(lines) + "\n")
    plot_accuracy(rows, out_dir / "plan_accuracy.png")


def plot_accuracy(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    measured = [r["measured_mb"] for r in rows]
    for engine, marker in (("trace", "o"), ("analytic", "x")):
        ax.scatter(measured, [r[f"predicted_{engine}_mb"] for r in rows], marker=marker, label=f"predicted ({engine})")
    top = max(measured + [r["predicted_trace_mb"] for r in rows]) * 1.1
    low = min(measured) * 0.8
    ax.plot([low, top], [low, top], "k-", linewidth=1, label="y = x")
    ax.plot([low, top], [low * 1.1, top * 1.1], "k:", linewidth=0.8, label="±10 %")
    ax.plot([low, top], [low * 0.9, top * 0.9], "k:", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured peak RSS of the training step (MB)")
    ax.set_ylabel("predicted peak (MB)")
    ax.set_title("Memory planner vs measured (CPU, lit-model-5m / 40m)", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'model':14s} {'precision':9s} {'train':5s} {'AC':3s} {'mb':>3s} {'T':>5s} {'measured':>10s} {'trace':>10s} {'analytic':>10s} {'err tr':>7s} {'err an':>7s}")
    for r in rows:
        print(f"{r['model']:14s} {r['precision']:9s} {r['trainable']:5s} {'on' if r['activation_checkpointing'] else 'off':3s} "
              f"{r['micro_batch']:3d} {r['seq_len']:5d} {r['measured_mb']:10.1f} {r['predicted_trace_mb']:10.1f} "
              f"{r['predicted_analytic_mb']:10.1f} {r['error_trace_pct']:+6.1f}% {r['error_analytic_pct']:+6.1f}%")


def accuracy(grid: list[tuple], with_published: bool, out_dir: Path) -> list[dict]:
    rows = []
    for model, precision, trainable, ac, micro, seq_len in grid:
        job = {"model": model, "precision": precision, "trainable": trainable, "ac": ac, "micro_batch": micro, "seq_len": seq_len}
        measured = run_worker(job)
        pred = predict(model, precision, trainable, ac, micro, seq_len)
        row = {
            "model": model, "precision": precision, "trainable": trainable, "activation_checkpointing": ac,
            "micro_batch": micro, "seq_len": seq_len,
            "baseline_rss_mb": round(measured["baseline_rss"] / 1e6, 1),
            "runtime_init_mb": round(measured["runtime_init"] / 1e6, 1), "measured_mb": round(measured["measured"] / 1e6, 2),
            "predicted_trace_mb": round(pred["trace"] / 1e6, 2), "predicted_analytic_mb": round(pred["analytic"] / 1e6, 2),
            "error_trace_pct": round(100 * (pred["trace"] - measured["measured"]) / measured["measured"], 2),
            "error_analytic_pct": round(100 * (pred["analytic"] - measured["measured"]) / measured["measured"], 2),
            "step_seconds": round(measured["step_seconds"], 2),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    published = published_rows() if with_published else []
    write_results(rows, published, out_dir)
    print()
    print_table(rows)
    for p in published:
        print(f"{p['figure']:42s} T={p['seq_len']:5d} {p['metric']:9s} published {p['published_gb']:6.2f} GB  predicted "
              f"{p['predicted_gb']:6.2f} GB  ({p['error_pct']:+.1f} %)")
    return rows


# ---- speed factors ---------------------------------------------------------------------------------------
def speed(out_dir: Path, steps: int = 3) -> None:
    """Median step time of lit-model-40m (mb 4, T 256, fp32, full) and of each lever, on this CPU."""
    base = {"model": "lit-model-40m", "precision": "32-true", "trainable": "full", "ac": False, "micro_batch": 4, "seq_len": 256,
            "steps": steps + 1}
    # lever -> (the run with it, the run it is compared with)
    lora = {"trainable": "lora"}
    variants = {
        "activation_checkpointing": ({"ac": True}, {}),
        "precision_bf16_true_from_32": ({"precision": "bf16-true"}, {}),
        "halve_micro_batch": ({"micro_batch": 2, "accumulate": 2}, {}),
        "optimizer_8bit": ({"optimizer": "AdamW8bit"}, {}),
        "quantize_nf4": ({**lora, "quantize": "bnb.nf4"}, lora),
    }
    times: dict[str, float] = {}

    def step_time(change: dict) -> float:
        key = json.dumps(change, sort_keys=True)
        if key not in times:
            job = {**base, **change}
            accumulate = job.pop("accumulate", 1)
            times[key] = run_worker(job)["step_seconds"] * accumulate
            print(change, times[key], flush=True)
        return times[key]

    rows = []
    for name, (change, reference) in variants.items():
        with_lever, without = step_time(change), step_time(reference)
        rows.append({"lever": name, "step_seconds": round(with_lever, 3), "reference_seconds": round(without, 3),
                     "factor": round(with_lever / without, 3)})
    with open(out_dir / "plan_accuracy.speed.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["lever", "step_seconds", "reference_seconds", "factor"])
        writer.writeheader()
        writer.writerows(rows)
    print(json.dumps(rows, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="4 configurations, no published figures")
    parser.add_argument("--speed", action="store_true", help="measure the CPU step-time factors of the levers")
    parser.add_argument("--no-published", action="store_true", help="skip the published GPU figures (~1 minute of tracing)")
    parser.add_argument("--out_dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.speed:
        speed(args.out_dir)
        return
    accuracy(QUICK if args.quick else GRID, not (args.quick or args.no_published), args.out_dir)


if __name__ == "__main__":
    main()
