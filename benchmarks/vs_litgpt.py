"""lit-model vs litgpt on the same tiny Llama-style model, side by side in one run: training tokens/s and
peak RSS, and greedy decode tokens/s.

    python benchmarks/vs_litgpt.py            # installs litgpt into benchmarks/.venv-litgpt first

Training (benchmarks/_train_worker.py): Fabric, micro batch 4 x 512 tokens, 4 layers, 256 wide, vocab 8192,
untied head; each implementation's step as its pretrain script takes it: lit-model's fused chunked
cross-entropy inside the model and its optimizer factory's AdamW (fused), litgpt's full logits then
chunked_cross_entropy and AdamW as its pretrain.py builds it (fused only on CUDA). Both eager and compiled
(litgpt's pretrain.py compiles); each row's ratios are to litgpt run the same way. Generation (benchmarks/_generate_worker.py): 32
prompt tokens, 256 new, greedy, KV cache, timed at each streamed token (decode rate and median step rate).
Runs alternate between implementations, each in a fresh process, `--repeats` times; tables report medians and
ratios to litgpt, and the machine's load average before and after (other jobs on a shared machine slow both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Optional

from _tables import csv_text, markdown_table
from _venvs import LITGPT_VERSION, litgpt_python
from lit_model.core.files import atomic_write

HERE = Path(__file__).resolve().parent
BENCHMARKS = {  # name: (worker, speed metrics, variants as extra worker flags (both implementations run each), what)
    "train": ("_train_worker.py", ["tokens_per_sec"], [[], ["--compile"]],
              "Step level, not user level: the training step alone in a worker process, eager and compiled, which the whole-script comparison (benchmarks/vs_peers.py, results/vs_peers.md) cannot separate. "
              "Each implementation takes its training step as its pretrain script does: lit-model's fused chunked "
              "cross-entropy and its optimizer factory's AdamW (fused), litgpt's full logits then "
              "chunked_cross_entropy and AdamW as its pretrain.py builds it (fused only on CUDA). Both run eager "
              "and compiled (litgpt's pretrain.py always compiles); each row's ratios are to litgpt run the same "
              "way. Tiny Llama-style model: 4 layers, 256 wide, vocab 8192, micro batch 4 x 512 tokens."),
    "generate": ("_generate_worker.py", ["decode_tokens_per_sec", "step_tokens_per_sec"], [[]],
                 "Greedy decoding with a KV cache: 32 prompt tokens, 256 new."),
}


def run(python: str, worker: str, impl: str, precision: str, flags: list[str], threads: Optional[int]) -> dict:
    command = [python, str(HERE / worker), "--impl", impl, "--precision", precision, *flags]
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)} if impl == "lit_model" else dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env, cwd=HERE).stdout
    return json.loads(out.strip().splitlines()[-1])


def benchmark(name: str, litgpt: str, precisions: list[str], repeats: int, threads: Optional[int]) -> list[dict]:
    worker, metrics, flag_variants, _ = BENCHMARKS[name]
    variants = [(impl, python, flags) for flags in flag_variants
                for impl, python in (("litgpt", litgpt), ("lit_model", sys.executable))]
    rows = []
    for precision in precisions:
        results: dict[str, list[dict]] = {}
        for _ in range(repeats):
            for impl, python, flags in variants:
                label = " ".join([impl, *flags])
                results.setdefault(label, []).append(run(python, worker, impl, precision, flags, threads))
        median = {label: {key: statistics.median(r[key] for r in runs) for key in (*metrics, "peak_rss_bytes")}
                  for label, runs in results.items()}
        for label, values in median.items():
            base = median[" ".join(["litgpt", *label.split()[1:]])]  # litgpt run the same way
            row = {"precision": precision, "implementation": label}
            for i, metric in enumerate(metrics):  # the first metric's ratio keeps its historical column name
                row[metric] = round(values[metric], 1)
                row["speed_vs_litgpt" if i == 0 else f"{metric.removesuffix('_tokens_per_sec')}_speed_vs_litgpt"] = (
                    round(values[metric] / base[metric], 3))
            row["peak_rss_mb"] = round(values["peak_rss_bytes"] / 2**20)
            row["rss_vs_litgpt"] = round(values["peak_rss_bytes"] / base["peak_rss_bytes"], 3)
            rows.append(row)
    return rows


def write_table(name: str, rows: list[dict], repeats: int, threads: Optional[int], load: tuple[float, float]) -> str:
    table = markdown_table(rows)
    flag = f" --threads {threads}" if threads else ""
    threads_text = "torch's default (one per core)" if not threads else (
        f"{threads} (OMP_NUM_THREADS and MKL_NUM_THREADS, for both implementations: where other jobs share the "
        "cores, a thread per core makes every parallel kernel wait for a descheduled thread, which measures the "
        "load, not the code)")
    results = HERE / "results"
    results.mkdir(exist_ok=True)
    atomic_write(results / f"{name}_vs_litgpt.csv", csv_text(rows))
    atomic_write(results / f"{name}_vs_litgpt.md",
        f"# {name}: lit-model vs litgpt {LITGPT_VERSION} (CPU, {os.cpu_count()} cores, median of {repeats})\n\n"
        f"Regenerate: `python benchmarks/vs_litgpt.py --only {name}{flag}`\n\n"
        f"{BENCHMARKS[name][3]}\n\n"
        f"Threads per process: {threads_text}.\n\n"
        f"Taken on a {os.cpu_count()}-core machine shared with other jobs (1-minute load average {load[0]:.1f} "
        f"before, {load[1]:.1f} after): absolute speeds move with their load; the ratios come from runs that "
        "alternate between the implementations.\n\n"
        f"{table}\n"
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precisions", nargs="+", default=["32-true", "bf16-true"])
    parser.add_argument("--only", choices=list(BENCHMARKS), nargs="+", default=list(BENCHMARKS))
    # Where other jobs share the cores, a thread per core makes every parallel kernel wait for a descheduled
    # thread (decoding a tiny model ran 60x slower here at 2 threads than at 1): one thread measures the code.
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads per run (default: torch's)")
    args = parser.parse_args()
    litgpt = litgpt_python()
    for name in args.only:
        before = os.getloadavg()[0]
        rows = benchmark(name, litgpt, args.precisions, args.repeats, args.threads)
        print(f"\n{name}\n" + write_table(name, rows, args.repeats, args.threads, (before, os.getloadavg()[0])))


if __name__ == "__main__":
    main()
