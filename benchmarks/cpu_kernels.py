"""lit-model's CPU kernel settings as users meet them: the real scripts, the same run with one setting changed.

    python benchmarks/cpu_kernels.py        # ~15 minutes on 2 cores; writes benchmarks/results/cpu_kernels.{md,csv}

Each row runs one command line twice per round, once with each of two settings of an environment variable, for
``--repeats`` rounds (the two alternate, so both meet the same moments of a shared machine); the table has medians:

- fp32 linear maps, ``LIT_MODEL_FP32_LINEAR``: ``blas`` (PyTorch's MKL) against lit-model's default, ``auto``
  (oneDNN on x86 CPUs other than Intel's, where MKL runs its slower code; BLAS on Intel's): 32-true LoRA
  fine-tuning and pretraining.
- oneDNN's kernel caches, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` and ``LRU_CACHE_CAPACITY``: 1024 each (oneDNN's and
  ideep's default) against lit-model's cap (``ops.ONEDNN_CACHE_CAPACITY``): LoRA fine-tuning, bf16-true (PyTorch's
  own bf16 products are oneDNN's) and 32-true.

Everything else is lit-model's default, with torch's default threads (OMP_NUM_THREADS and MKL_NUM_THREADS removed).
The model: Llama-style, 2 layers, 768 wide, 12 heads, MLP 3072, block 1024, with benchmarks/vs_peers.py's tokenizer
(byte-level BPE, vocab 4096) and corpus (made there if missing). Pretraining: micro batch 4 x 512 tokens. LoRA:
from 2 steps of that pretraining, on the default data (Python standard library functions, 64 to 576 tokens each,
each batch padded to a multiple of 64: row counts change from step to step), micro batch 4, r 8 on the query and
value maps. tokens/s and peak RSS are each run's summary.json (``tokens_per_sec``, ``peak_memory_bytes``: the
process's VmHWM); plan is the peak of ``--plan json`` for the same command line (the same for both settings).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from _tables import cpu_description, csv_text, markdown_table
from vs_peers import ARCH, CORPUS, ROOT, TOKENIZER, WORK, prep, quiet_run, write_corpus, write_yaml
from lit_model.core.files import atomic_write
from lit_model.kernels.ops import FP32_LINEAR_ENV, ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_VARIABLES

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = {**ARCH, "name": "kernels-768", "hf_type": "llama", "block_size": 1024, "n_layer": 2, "n_embd": 768,
         "n_head": 12, "n_query_groups": 12, "intermediate_size": 3072}
SETTINGS = (FP32_LINEAR_ENV, *ONEDNN_CACHE_VARIABLES, "OMP_NUM_THREADS", "MKL_NUM_THREADS")
UNCAPPED = {variable: "1024" for variable in ONEDNN_CACHE_VARIABLES}


@dataclass(frozen=True)
class Row:
    name: str
    script: str  # "pretrain" or "lora"
    precision: str
    setting: str  # what the two sides differ in
    other: tuple[str, dict[str, str]]  # the label and environment of the side that is not lit-model's default
    default: str  # the label of lit-model's default side (the environment without SETTINGS)


ROWS = (
    Row("lora-32-true", "lora", "32-true", FP32_LINEAR_ENV, ("blas", {FP32_LINEAR_ENV: "blas"}), "auto"),
    Row("pretrain-32-true", "pretrain", "32-true", FP32_LINEAR_ENV, ("blas", {FP32_LINEAR_ENV: "blas"}), "auto"),
    Row("lora-bf16-true", "lora", "bf16-true", "oneDNN cache capacity", ("1024", UNCAPPED), str(ONEDNN_CACHE_CAPACITY)),
    Row("lora-32-true", "lora", "32-true", "oneDNN cache capacity", ("1024", UNCAPPED), str(ONEDNN_CACHE_CAPACITY)),
)


def default_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    return env


def prepare() -> tuple[Path, Path]:
    """The model's YAML and the fine-tuning base (2 steps of pretraining), made once in benchmarks/.peers/."""
    WORK.mkdir(exist_ok=True)
    write_corpus()
    if not (TOKENIZER / "tokenizer.json").exists():
        prep(sys.executable, "tokenizer", CORPUS, ARCH["vocab_size"], TOKENIZER)
    model = WORK / "kernels-768.yaml"
    if not model.exists():
        write_yaml(model, MODEL)
    base = WORK / "kernels-768-base"
    if not (base / "final" / "model_config.yaml").exists():
        quiet_run(pretrain_argv(model, base, "32-true", steps=2), default_env(), ROOT)
    return model, base / "final"


def pretrain_argv(model: Path, out: Path, precision: str, steps: int) -> list[str]:
    return [sys.executable, "pretrain/main.py", "--model_config", str(model), "--tokenizer_dir", str(TOKENIZER),
            "--data_path", str(CORPUS), "--override_max_seq_length", "512", *loop_flags(out, precision, steps)]


def loop_flags(out: Path, precision: str, steps: int) -> list[str]:
    return ["--precision", precision, "--micro_batch_size", "4", "--global_batch_size", "4", "--max_steps", str(steps),
            "--log_interval", "10", "--eval_interval", str(steps), "--eval_iters", "1", "--save_interval", "0",
            "--out_dir", str(out), "--overwrite", "true"]


def argv_for(row: Row, model: Path, base: Path, out: Path, steps: int) -> list[str]:
    if row.script == "pretrain":
        return pretrain_argv(model, out, row.precision, steps)
    return [sys.executable, "finetune/lora.py", "--checkpoint_dir", str(base), *loop_flags(out, row.precision, steps)]


def run_once(argv: list[str], env: dict[str, str], log: Path) -> tuple[float, int]:
    """(tokens/s, peak RSS bytes) from the run's summary.json."""
    with open(log, "w") as handle:
        done = subprocess.run(argv, env=env, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed; its output is in {log}")
    out = Path(argv[argv.index("--out_dir") + 1])
    summary = json.loads((out / "summary.json").read_text())
    return summary["tokens_per_sec"], summary["peak_memory_bytes"]


def plan_peak(argv: list[str]) -> int:
    done = subprocess.run([*argv, "--plan", "json"], env=default_env(), cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)["peak_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--rows", nargs="*", type=int, help="row indices (default: all)")
    args = parser.parse_args()
    model, base = prepare()
    rows = [ROWS[i] for i in args.rows] if args.rows else list(ROWS)
    table = []
    with tempfile.TemporaryDirectory(prefix="cpu_kernels-") as tmp:
        for row in rows:
            argv = argv_for(row, model, base, Path(tmp) / "run", args.steps)
            sides = {row.other[0]: {**default_env(), **row.other[1]}, row.default: default_env()}
            runs: dict[str, list[tuple[float, int]]] = {label: [] for label in sides}
            for repeat in range(args.repeats):
                for label, env in sides.items():
                    started = time.time()
                    runs[label].append(run_once(argv, env, Path(tmp) / "run.log"))
                    print(f"{row.name} {row.setting}={label} (round {repeat + 1}): {runs[label][-1][0]:.0f} tokens/s, "
                          f"{runs[label][-1][1] / 2**20:.0f} MiB, {time.time() - started:.0f} s", flush=True)
            speed = {label: statistics.median(r[0] for r in results) for label, results in runs.items()}
            rss = {label: statistics.median(r[1] for r in results) for label, results in runs.items()}
            other, default = row.other[0], row.default
            table.append({
                "row": row.name, "setting": row.setting, "other": other, "default": default,
                "tokens/s other": f"{speed[other]:.0f}", "tokens/s default": f"{speed[default]:.0f}",
                "speed ratio": f"{speed[default] / speed[other]:.2f}",
                "peak RSS MiB other": f"{rss[other] / 2**20:.0f}", "peak RSS MiB default": f"{rss[default] / 2**20:.0f}",
                "RSS ratio": f"{rss[default] / rss[other]:.2f}", "plan MiB": f"{plan_peak(argv) / 2**20:.0f}",
                "runs (tokens/s)": " / ".join(f"{label} " + ", ".join(f"{r[0]:.0f}" for r in runs[label]) for label in runs),
            })
    command = f"python benchmarks/cpu_kernels.py --steps {args.steps} --repeats {args.repeats}" + (
        f" --rows {' '.join(map(str, args.rows))}" if args.rows else "")
    report = "\n".join([
        "# lit-model's CPU kernel settings at the user level", "",
        f"Generated by `{command}` (see its docstring) on {time.strftime('%Y-%m-%d')}: {cpu_description()}, torch "
        f"{torch.__version__}. Ratios: lit-model's default side over the other (medians of {args.repeats} interleaved "
        f"runs, {args.steps} steps each).", "", markdown_table(table), "",
    ])
    atomic_write(RESULTS / "cpu_kernels.md", report)
    atomic_write(RESULTS / "cpu_kernels.csv", csv_text(table))
    print(report)


if __name__ == "__main__":
    main()
