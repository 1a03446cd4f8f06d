"""The memory ladder: every out-of-memory lever of lit-model, alone and stacked, measured on one model and data.

    python benchmarks/memory_ladder.py                          # lit-model-5m on the CPU (~25 minutes on 2 cores)
    python benchmarks/memory_ladder.py --model lit-model-40m    # the same ladder on the 40M model (slower)
    python benchmarks/memory_ladder.py --quick                  # 4 rungs into a temporary directory, a smoke check
    python benchmarks/memory_ladder.py --only bf16-true,SGD     # just these rungs (baseline always runs)

Every rung runs the real script (pretrain/main.py, finetune/full.py, finetune/lora.py) in a fresh process for a
few optimizer steps with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then returns freed blocks above 64 KiB to the OS
at once, so resident memory tracks live tensors) and reads what the run wrote:

- ``peak_mb``: ``summary.json``'s ``peak_memory_bytes``, the process's peak resident memory (VmHWM) on the CPU,
  the largest rank's with several processes (``peak_all_ranks_mb``: their sum). It is the whole process: Python,
  torch's kernels, the token data and the tensors, so the ratios are smaller than on a GPU, where only tensors count;
- ``tokens_per_sec``: training tokens per second of *CPU time* of the run's processes over the steady steps (all
  but the first, which allocates and compiles, and the last, which evaluates and saves). Each process runs one
  thread (``OMP_NUM_THREADS=1``) and the benchmark samples the CPU time of the process tree whenever a step's row
  appears in ``metrics.csv``. On a machine shared with other jobs, wall-clock tokens/s moved up to 4x between
  identical runs; CPU time is what the run itself spent, about the speed on one dedicated core (still up to a fifth
  off when other jobs share the cores' caches; for several processes: per core they use together, so communication
  overhead shows, parallel speed-up does not);
- ``loss``: the training loss of the last step;
- ``plan_mb``: the same command with ``--plan json`` (the planner's predicted peak; it starts no training), and
  ``plan_tensors_mb``: the tensors alone in that prediction (``tensor_peak_bytes``: without the process's runtime;
  with the 8- and 4-bit optimizers it holds the fp32 copies their CPU steps make, calibration.CPU_QUANTIZED_STEP_COPIES),
  which is what a technique changes on a GPU; ``plan_tensors_vs_baseline`` is its ratio.

Ratios are against the table's first row (the baseline) measured in the same invocation; the pretraining table
ends with the baseline run again, which shows how much the machine's load moved the numbers in between. Fine-tuning
rungs start from a checkpoint that a 2-step pretrain run writes first. Results: benchmarks/results/memory_ladder[_finetune]
{.csv,.md,.png} (with ``_<model>`` after ``memory_ladder`` for another --model).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from _tables import cpu_description
from lit_model.core.files import atomic_open, atomic_write

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
COLUMNS = ["lever", "flags", "status", "processes", "peak_mb", "peak_vs_baseline", "peak_all_ranks_mb", "plan_mb",
           "plan_tensors_mb", "plan_tensors_vs_baseline", "tokens_per_sec", "speed_vs_baseline", "loss", "wall_s", "note"]
# Runs per model: the shapes every rung starts from (micro batch = global batch: no accumulation in the baseline)
MODELS = {"lit-model-5m": {"micro": 8, "seq": 512, "ft_micro": 4}, "lit-model-40m": {"micro": 4, "seq": 512, "ft_micro": 2}}


@dataclass
class Rung:
    lever: str
    flags: list[str] = field(default_factory=list)
    script: str = "pretrain/main.py"
    note: str = ""  # what the run's output does not show (a library's warning the script silences)


@dataclass
class Table:
    name: str  # file stem under benchmarks/results
    title: str
    base_flags: list[str]
    rungs: list[Rung]  # rungs[0] is the baseline
    checkpoint: Optional[Path] = None  # fine-tuning: --checkpoint_dir, a temporary directory kept out of the results


def pretrain_rungs(model: str) -> list[Rung]:
    micro, seq = MODELS[model]["micro"], MODELS[model]["seq"]
    micro_rungs = [Rung(f"micro batch {m} x {micro // m} accumulation", ["--micro_batch_size", str(m)])
                   for m in sorted({micro // 2, micro // 4, 1}, reverse=True)]
    # The same global batch over n processes: each rank runs micro/n samples, as when a run moves to n GPUs.
    # DDP (replicated weights) beside FSDP (sharded) separates what sharding saves from what the smaller batch saves.
    spread = [Rung(f"{strategy.upper()} {n} processes" + (" + cpu_offload" if offload else ""),
                   ["--devices", str(n), "--strategy", strategy, "--micro_batch_size", str(max(micro // n, 1))]
                   + (["--cpu_offload"] if offload else []))
              for strategy, n, offload in (("ddp", 2, False), ("fsdp", 2, False), ("fsdp", 2, True), ("fsdp", 4, False),
                                           ("fsdp", 4, True))]
    ac = ["--activation_checkpointing"]
    offload = ["--activation_offloading", "disk"]  # on the CPU the files are the only place to move them to
    tiles = 4
    best = ["--precision", "bf16-true", *ac, "--micro_batch_size", "1", "--optimizer", "AdamW8bit"]
    in_backward = ["--optimizer_in_backward", "--grad_clip", "0"]  # the micro batch is the global batch here
    return [
        Rung("baseline"),
        *micro_rungs,
        Rung(f"seq length {seq // 2}", ["--override_max_seq_length", str(seq // 2)]),
        Rung(f"seq length {seq // 4}", ["--override_max_seq_length", str(seq // 4)]),
        *[Rung(p, ["--precision", p]) for p in ("bf16-mixed", "bf16-true", "16-true", "16-mixed")],
        Rung("activation checkpointing every block", ac),
        Rung("activation checkpointing every 2nd block", ac + ["--activation_checkpointing_interval", "2"]),
        Rung("selective activation checkpointing", ["--activation_checkpointing", "selective"]),
        Rung("activation offloading to disk", offload),
        Rung("activation checkpointing + offloading to disk", ac + offload),
        Rung(f"MLP in {tiles} sequence tiles", ["--mlp_tiles", str(tiles)]),
        Rung("unchunked cross-entropy", ["--loss_chunk_size", "0"]),
        *[Rung(o, ["--optimizer", o]) for o in ("SGD", "Lion", "Sophia", "Adafactor", "AdamW8bit")],
        Rung("PagedAdamW8bit", ["--optimizer", "PagedAdamW8bit"], note="bitsandbytes on the CPU: 'Paged optimizers are not "
             "supported on CPU. Falling back to non-paged optimizer behavior.' (paging needs CUDA unified memory)"),
        Rung("optimizer step in backward", in_backward),
        *[Rung(o, ["--optimizer", o]) for o in ("GaLore", "APOLLO", "AdamMini", "AdamW4bit", "AdamWFp8")],
        Rung("AdaLomo", ["--optimizer", "AdaLomo", "--grad_clip", "0"]),
        Rung("freeze embedding + 2 blocks", ["--freeze_layers", "2"]),
        Rung("empty cache every step", ["--empty_cache_interval", "1"]),
        Rung("torch.compile", ["--compile"]),
        *spread,
        Rung("stack: bf16-true + AC", ["--precision", "bf16-true", *ac]),
        Rung(f"stack: bf16-true + AC + micro batch {max(micro // 4, 1)}",
             ["--precision", "bf16-true", *ac, "--micro_batch_size", str(max(micro // 4, 1))]),
        Rung("stack: bf16-true + AC + micro batch 1 + AdamW8bit", best),
        Rung("stack + activation offloading to disk", best + offload),
        Rung(f"stack + MLP in {tiles} tiles", best + ["--mlp_tiles", str(tiles)]),
        Rung("stack with selective instead of full AC",
             ["--precision", "bf16-true", "--activation_checkpointing", "selective", "--micro_batch_size", "1",
              "--optimizer", "AdamW8bit"]),
        Rung("stack: bf16-true + AC + micro batch 1 + AdamW4bit",
             ["--precision", "bf16-true", *ac, "--micro_batch_size", "1", "--optimizer", "AdamW4bit"]),
        # stepping in backward rules out accumulation: the stack keeps the micro batch at the global batch
        Rung("stack: bf16-true + AC + step in backward", ["--precision", "bf16-true", *ac, *in_backward]),
        Rung("stack: bf16-true + AC + step in backward + AdamW4bit",
             ["--precision", "bf16-true", *ac, *in_backward, "--optimizer", "AdamW4bit"]),
        Rung("stack: bf16-true + AC + step in backward + GaLore",
             ["--precision", "bf16-true", *ac, *in_backward, "--optimizer", "GaLore"]),
        Rung("stack: bf16-true + AC + offloading to disk + AdaLomo",
             ["--precision", "bf16-true", *ac, *offload, "--optimizer", "AdaLomo", "--grad_clip", "0"]),
        Rung("baseline again (measurement noise)"),
    ]


def finetune_rungs() -> list[Rung]:
    return [
        Rung("full fine-tune", [], "finetune/full.py"),
        Rung("full + freeze embedding + 2 blocks", ["--freeze_layers", "2"], "finetune/full.py"),
        Rung("full + optimizer step in backward", ["--optimizer_in_backward", "--grad_clip", "0"], "finetune/full.py"),
        Rung("full + GaLore", ["--optimizer", "GaLore"], "finetune/full.py"),
        Rung("LoRA", [], "finetune/lora.py"),
        Rung("LoRA + packing", ["--packing", "true"], "finetune/lora.py"),
        Rung("DoRA", ["--lora_dora", "true"], "finetune/lora.py"),
        Rung("QLoRA bnb.nf4", ["--quantize", "bnb.nf4"], "finetune/lora.py"),
        Rung("QLoRA bnb.nf4 + bf16-true", ["--quantize", "bnb.nf4", "--precision", "bf16-true"], "finetune/lora.py"),
    ]


def short_run_flags(steps: int, micro: int) -> list[str]:
    """A few steps, one evaluation batch at the end, no intermediate checkpoints, a metrics row per step."""
    return ["--max_steps", str(steps), "--micro_batch_size", str(micro), "--global_batch_size", str(micro),
            "--eval_iters", "1", "--eval_interval", "1000", "--save_interval", "0", "--log_interval", "1"]


def child_env() -> dict[str, str]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("LIT_MODEL_DEBUG", None)  # failures should end with the one-paragraph message we record
    return env


def script_command(script: str, flags: list[str]) -> list[str]:
    return [sys.executable, str(ROOT / script), *flags]


def error_message(output: str) -> str:
    """The script's one-paragraph error (it starts with 'error:'), else the last line of output."""
    lines = output.strip().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("error:"):
            return " ".join(part.strip() for part in lines[i:])[len("error:"):].strip()
    return lines[-1].strip() if lines else "no output"


def plan_of(cmd: list[str]) -> Optional[dict]:
    out = subprocess.run([*cmd, "--plan", "json"], capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=600)
    start = out.stdout.find("{")
    if out.returncode != 0 or start < 0:
        return None
    return json.loads(out.stdout[start:])


def tree_cpu_seconds(root: int) -> float:
    """User + system CPU time of process ``root`` and all its descendants (the ranks Fabric starts), from /proc."""
    parent, cpu = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        pid = int(entry.name)
        parent[pid], cpu[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    tree, frontier = set(), {root}
    while frontier:
        tree |= frontier
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier and pid not in tree}
    return sum(cpu.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def metrics_rows(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("peak_memory_bytes")]  # complete rows only


def run_measured(cmd: list[str], out_dir: Path) -> tuple[subprocess.CompletedProcess, list[float]]:
    """Run ``cmd``; also return the process tree's CPU seconds at the moment each metrics row (step) appeared."""
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, text=True, env=child_env(), cwd=ROOT)
        cpu_at_row: list[float] = []
        deadline = time.monotonic() + 1800
        while proc.poll() is None and time.monotonic() < deadline:
            rows = len(metrics_rows(out_dir))
            if rows > len(cpu_at_row):
                cpu_at_row += [tree_cpu_seconds(proc.pid)] * (rows - len(cpu_at_row))
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout.read(), stderr.read()), cpu_at_row


def cpu_tokens_per_sec(rows: list[dict], cpu_at_row: list[float]) -> Optional[float]:
    """Tokens of steps 2..N-1 over the CPU seconds they took (row k appears when step k is logged)."""
    if len(rows) < 3 or len(cpu_at_row) < len(rows) - 1:
        return None
    tokens = int(rows[-2]["tokens"]) - int(rows[0]["tokens"])
    seconds = cpu_at_row[len(rows) - 2] - cpu_at_row[0]
    return tokens / seconds if seconds > 0 else None


def status_of(returncode: int, message: str) -> str:
    # The scripts refuse what a device cannot run (exit status 2) with a message that says so
    if returncode == 2 and ("needs a CUDA GPU" in message or "does not run on device" in message):
        return "not supported on this device"
    return "failed"


def run_rung(rung: Rung, table: Table, out_dir: Path) -> dict:
    checkpoint = ["--checkpoint_dir", str(table.checkpoint)] if table.checkpoint else []
    cmd = script_command(rung.script, [*checkpoint, *table.base_flags, *rung.flags])
    start = time.perf_counter()
    out, cpu_at_row = run_measured([*cmd, "--out_dir", str(out_dir)], out_dir)
    wall = time.perf_counter() - start
    row = {"lever": rung.lever, "flags": " ".join([rung.script, *rung.flags]), "wall_s": f"{wall:.0f}", "note": rung.note,
           "plan_mb": "", "plan_tensors_mb": "", "processes": "", "peak_mb": "", "peak_all_ranks_mb": "",
           "tokens_per_sec": "", "loss": ""}
    plan = plan_of(cmd)
    if plan is not None:
        row["plan_mb"], row["plan_tensors_mb"] = f"{plan['peak_bytes'] / 1e6:.1f}", f"{plan['tensor_peak_bytes'] / 1e6:.1f}"
    summary_path = out_dir / "summary.json"
    if out.returncode != 0 or not summary_path.exists():
        message = error_message(out.stdout + "\n" + out.stderr)
        return {**row, "status": status_of(out.returncode, message), "note": message}
    summary = json.loads(summary_path.read_text())
    speed = cpu_tokens_per_sec(metrics_rows(out_dir), cpu_at_row)
    if speed is None:
        return {**row, "status": "failed", "note": "too few metrics rows to measure the speed (need --steps >= 3)"}
    row.update(status="ok", processes=str(summary["devices"]), peak_mb=f"{summary['peak_memory_bytes'] / 1e6:.1f}",
               peak_all_ranks_mb=f"{summary['peak_memory_bytes_all_ranks'] / 1e6:.1f}",
               tokens_per_sec=f"{speed:.0f}", loss=f"{summary['train_loss']:.4f}")
    if "padding_fraction" in summary:  # fine-tuning: the share of padding tokens in its micro batches
        row["note"] = f"padding {summary['padding_fraction']:.1%} of the tokens"
    wanted = rung.flags[rung.flags.index("--precision") + 1] if "--precision" in rung.flags else None
    if wanted and summary["precision"] != wanted:
        row["note"] = f"ran as {summary['precision']}"
    return row


def add_ratios(rows: list[dict]) -> None:
    base = rows[0]
    for row in rows:
        ok = row["status"] == "ok" and base["status"] == "ok"
        row["peak_vs_baseline"] = f"{float(row['peak_mb']) / float(base['peak_mb']):.2f}" if ok else ""
        row["speed_vs_baseline"] = f"{float(row['tokens_per_sec']) / float(base['tokens_per_sec']):.2f}" if ok else ""
        planned = row["plan_tensors_mb"] and base["plan_tensors_mb"]
        row["plan_tensors_vs_baseline"] = f"{float(row['plan_tensors_mb']) / float(base['plan_tensors_mb']):.2f}" if planned else ""


def run_table(table: Table, work: Path, only: Optional[set[str]]) -> list[dict]:
    rungs = [r for i, r in enumerate(table.rungs) if i == 0 or only is None or r.lever in only]
    rows = []
    for i, rung in enumerate(rungs, 1):
        slug = f"{table.name}-{i:02d}"
        row = run_rung(rung, table, work / slug)
        rows.append(row)
        base = rows[0]
        ratio = (f" ({float(row['peak_mb']) / float(base['peak_mb']):.2f}x), {row['tokens_per_sec']} tok/s "
                 f"({float(row['tokens_per_sec']) / float(base['tokens_per_sec']):.2f}x), loss {row['loss']}"
                 if row["status"] == "ok" and base["status"] == "ok" else "")
        print(f"[{table.name} {i}/{len(rungs)}] {rung.lever}: {row['status']}"
              + (f", peak {row['peak_mb']} MB{ratio}" if row["status"] == "ok" else f": {row['note'][:200]}")
              + f" ({row['wall_s']} s)", flush=True)
    add_ratios(rows)
    return rows


def write_table(table: Table, rows: list[dict], out_dir: Path, header: str) -> None:
    with atomic_open(out_dir / f"{table.name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    base = " ".join(table.base_flags) + (" --checkpoint_dir <the final/ of a 2-step pretrain run>" if table.checkpoint else "")
    lines = [f"# {table.title}", "", header, "", f"Every rung adds its flags to: `{base}`.", "",
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row in rows:
        cells = [f"`{row[c]}`" if c == "flags" else str(row[c]).replace("|", "/") for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    atomic_write(out_dir / f"{table.name}.md", "\n".join(lines) + "\n")
    plot_table(table, rows, out_dir / f"{table.name}.png")


def plot_table(table: Table, rows: list[dict], path: Path) -> None:
    """Per rung: the measured peak of the process (annotated with the speed ratio) and, thinner, the planned
    tensors alone, which is what the rung changes on a GPU."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.36 * len(rows) + 1.6))
    rows = rows[::-1]  # barh draws bottom-up; the baseline goes on top
    ys = range(len(rows))
    peaks = [float(r["peak_mb"]) if r["status"] == "ok" else 0.0 for r in rows]
    tensors = [float(r["plan_tensors_mb"]) if r["status"] == "ok" and r["plan_tensors_mb"] else 0.0 for r in rows]
    ax.barh([y + 0.17 for y in ys], peaks, height=0.42, color="#4c72b0", label="measured peak of the process")
    ax.barh([y - 0.23 for y in ys], tensors, height=0.3, color="#dd8452", label="planned tensors alone (what a GPU holds)")
    for y, row in zip(ys, rows):
        text = f" {row['peak_mb']} MB, speed {row['speed_vs_baseline']}x" if row["status"] == "ok" else f" {row['status']}"
        ax.text(peaks[y], y + 0.17, text, va="center", fontsize=7)
        if tensors[y]:
            ax.text(tensors[y], y - 0.23, f" {row['plan_tensors_mb']} MB", va="center", fontsize=6, color="#8c4a1c")
    if rows[-1]["status"] == "ok":
        ax.axvline(float(rows[-1]["peak_mb"]), color="k", linewidth=0.8, linestyle=":")
    ax.set_yticks(list(ys), [r["lever"] for r in rows], fontsize=7)
    ax.set_xlim(0, max(peaks) * 1.45 if max(peaks) else 1)
    ax.set_xlabel("MB (largest process; dotted: the baseline's measured peak)")
    ax.set_title(table.title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(rows: list[dict]) -> None:
    print(f"{'lever':52s} {'status':8s} {'peak MB':>9s} {'x':>5s} {'plan MB':>8s} {'tensors':>8s} {'x':>5s} {'tok/s':>6s} "
          f"{'x':>5s} {'loss':>7s}")
    for r in rows:
        print(f"{r['lever'][:52]:52s} {r['status'][:8]:8s} {r['peak_mb']:>9s} {r['peak_vs_baseline']:>5s} {r['plan_mb']:>8s} "
              f"{r['plan_tensors_mb']:>8s} {r['plan_tensors_vs_baseline']:>5s} {r['tokens_per_sec']:>6s} "
              f"{r['speed_vs_baseline']:>5s} {r['loss']:>7s}")


def make_checkpoint(model: str, work: Path) -> Path:
    """A 2-step pretrain run: fine-tuning needs weights, a config and a tokenizer, not a good model."""
    out = work / "checkpoint"
    cmd = script_command("pretrain/main.py", ["--model_name", model, *short_run_flags(2, 1), "--out_dir", str(out)])
    done = subprocess.run(cmd, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"the pretrain run that makes the fine-tuning checkpoint failed:\n{done.stderr[-3000:]}")
    return out / "final"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="lit-model-5m")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per rung")
    parser.add_argument("--quick", action="store_true", help="4 pretraining rungs into a temporary directory")
    parser.add_argument("--only", help="comma-separated lever names to run (the baseline always runs)")
    parser.add_argument("--out_dir", type=Path, help="default: benchmarks/results (--quick: a temporary directory)")
    args = parser.parse_args()
    out_dir = args.out_dir or (Path(tempfile.gettempdir()) / "memory_ladder_quick" if args.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    shapes = MODELS[args.model]
    stem = "memory_ladder" if args.model == "lit-model-5m" else f"memory_ladder_{args.model}"
    base = ["--model_name", args.model, *short_run_flags(args.steps, shapes["micro"]), "--override_max_seq_length", str(shapes["seq"])]
    pretrain = Table(stem, f"Memory ladder: pretraining {args.model} on the CPU", base, pretrain_rungs(args.model))
    tables = [pretrain]
    if args.quick:
        keep = {"baseline", "bf16-true", "activation checkpointing every block", f"micro batch {shapes['micro'] // 4} x 4 accumulation"}
        pretrain.rungs = [r for r in pretrain.rungs if r.lever in keep]
    only = set(args.only.split(",")) if args.only else None
    command = "python benchmarks/memory_ladder.py" + ("" if args.model == "lit-model-5m" else f" --model {args.model}")
    command += "" if args.steps == parser.get_default("steps") else f" --steps {args.steps}"
    command += f" --only '{args.only}'" if args.only else ""
    header = (f"Generated by `{command}` "
              f"on this CPU ({cpu_description()}), {args.steps} optimizer steps per "
              f"rung, {time.strftime('%Y-%m-%d')}; the script's docstring says exactly what each column measures. "
              "peak_mb is the whole process's peak resident memory (Python, torch's kernels, the token data and the "
              "tensors), so a lever's ratio is smaller than it would be on a GPU, where only tensors count; plan_mb is "
              "the `--plan json` prediction of the same command and plan_tensors_mb its tensors alone (what a GPU would "
              "hold, less the CUDA context and allocator cache, except that the 8- and 4-bit optimizers' CPU steps make "
              "fp32 copies of each tensor they step, which bitsandbytes' GPU kernels do not). tokens_per_sec is per second of CPU time, one thread per "
              "process: on a machine shared with other jobs wall-clock speed moved up to 4x with their load, CPU time "
              "much less, but they still share the cores and their caches, and the same rung measured in two "
              "invocations differed by up to about a fifth, so read speed ratios between 0.8 and 1.2 as no measurable "
              "difference (the pretraining table's "
              "last row repeats the baseline). With several processes it is per core used, so it shows their "
              "communication overhead, not a parallel speed-up. Rows that are not `ok` hold the script's own message "
              "in `note`.")
    with tempfile.TemporaryDirectory(prefix="memory_ladder_") as tmp:
        work = Path(tmp)
        if not args.quick:
            checkpoint = make_checkpoint(args.model, work)
            tables.append(Table(f"{stem}_finetune", f"Memory ladder: fine-tuning {args.model} on the CPU",
                                short_run_flags(args.steps, shapes["ft_micro"]), finetune_rungs(), checkpoint))
        for table in tables:
            rows = run_table(table, work, only)
            write_table(table, rows, out_dir, header)
            print(f"\n{table.title}")
            print_table(rows)
            print()
    print(f"Results in {out_dir}")


if __name__ == "__main__":
    main()
