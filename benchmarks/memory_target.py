"""The memory target of the newer levers: lit-model-40m pretraining at 1,024 tokens, the best stack of the levers the
project had before offloading, stepping in backward and the lean optimizers against the stacks that use them; and
one stack training a model whose plain AdamW state alone is larger than the stack's whole peak.

    python benchmarks/memory_target.py            # ~30 minutes on 2 cores

Each row runs the real `pretrain/main.py` in a fresh process, measured as `memory_ladder.py` measures a rung (its
docstring says how: peak resident memory of the process from summary.json, tokens/s per second of CPU time with one
thread, the `--plan json` prediction and its tensors alone). The reference row is the previous best stack:
`--precision bf16-true --activation_checkpointing --micro_batch_size 1 --optimizer AdamW8bit`, the same global batch
of 4 sequences of 1,024 tokens. The verdict lines compare every stack with it: peak (measured, whole process; and
planned tensors, what a GPU would hold) and step time (the inverse of the tokens/s ratio).

The last row trains a 287M-parameter variant of lit-model-40m (24 layers, 1,024 wide; micro batch 1 so that it
runs in minutes on one thread) with the leanest stack; its column `adamw_state_mb` is what plain AdamW on fp32
weights keeps (two fp32 states, 8 bytes a parameter), to set beside that row's whole measured peak.
Results: benchmarks/results/memory_target{.csv,.md}.
"""

from __future__ import annotations

import argparse
import csv
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import yaml
from memory_ladder import COLUMNS, RESULTS, Rung, Table, add_ratios, run_rung, short_run_flags

from lit_model import GPT, Config
from lit_model.core.files import atomic_open, atomic_write

MODEL, SEQ, MICRO = "lit-model-40m", 1024, 4
AC = ["--precision", "bf16-true", "--activation_checkpointing"]
OFFLOAD = ["--activation_offloading", "disk"]
IN_BACKWARD = ["--optimizer_in_backward", "--grad_clip", "0"]  # no accumulation: the micro batch is the global batch
LARGE = {"name": "lit-model-40m-wide", "hf_type": "llama", "block_size": 1024, "vocab_size": 8192, "n_layer": 24,
         "n_embd": 1024, "n_head": 16, "n_query_groups": 8, "intermediate_size": 2752, "norm_eps": 1.0e-5,
         "tie_embeddings": True}
LEANEST = [*AC, *OFFLOAD, "--optimizer", "AdaLomo", "--grad_clip", "0"]


def rungs(large_config: Path) -> list[Rung]:
    return [
        Rung("previous best: bf16-true + AC + micro batch 1 + AdamW8bit", [*AC, "--micro_batch_size", "1", "--optimizer", "AdamW8bit"]),
        Rung("baseline: fp32, AdamW, micro batch 4"),
        Rung("+ offloading to disk, AdamW4bit", [*AC, *OFFLOAD, "--micro_batch_size", "1", "--optimizer", "AdamW4bit"]),
        Rung("bf16-true + AC + offloading + step in backward + AdamW4bit", [*AC, *OFFLOAD, *IN_BACKWARD, "--optimizer", "AdamW4bit"]),
        Rung("bf16-true + AC + offloading + step in backward + GaLore", [*AC, *OFFLOAD, *IN_BACKWARD, "--optimizer", "GaLore"]),
        Rung("bf16-true + AC + offloading + AdaLomo", LEANEST),
        Rung("bf16-true + AC + offloading + AdaLomo + MLP in 4 tiles", [*LEANEST, "--mlp_tiles", "4"]),
        Rung("bf16-true + selective AC + offloading + step in backward + AdamW4bit",
             ["--precision", "bf16-true", "--activation_checkpointing", "selective", *OFFLOAD, *IN_BACKWARD, "--optimizer", "AdamW4bit"]),
        Rung("287M model: bf16-true + AC + offloading + AdaLomo, micro batch 1",
             ["--model_config", str(large_config), *LEANEST, "--micro_batch_size", "1", "--global_batch_size", "1"]),
    ]


def parameters(fields: Optional[dict]) -> int:
    """The model's parameter count, from the model itself built on the meta device."""
    config = Config(**fields) if fields else Config.from_name(MODEL)
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(config).parameters())


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's two targets, stated from the measured rows."""
    ref, lines = rows[0], []
    for row in rows[2:-1]:
        if row["status"] != "ok" or ref["status"] != "ok":
            lines.append(f"- {row['lever']}: {row['status']} ({row['note'][:160]})")
            continue
        step = float(ref["tokens_per_sec"]) / float(row["tokens_per_sec"])
        lines.append(f"- {row['lever']}: measured peak {row['peak_vs_baseline']}x, planned tensors "
                     f"{row['plan_tensors_vs_baseline']}x, step time {step:.2f}x of the previous best "
                     f"(target: <= 0.5x peak at <= 1.5x step time: "
                     f"{'met' if float(row['plan_tensors_vs_baseline'] or 9) <= 0.5 and step <= 1.5 else 'not met'} in tensors, "
                     f"{'met' if float(row['peak_vs_baseline']) <= 0.5 and step <= 1.5 else 'not met'} in whole-process peak)")
    large = rows[-1]
    if large["status"] == "ok":
        state, peak = float(large["adamw_state_mb"]), float(large["peak_mb"])
        lines.append(f"- {large['lever']}: whole-process peak {peak:.0f} MB, while plain AdamW's state alone for this "
                     f"model is {state:.0f} MB ({state / peak:.2f}x the stack's peak): "
                     f"{'met' if state > peak else 'not met'}")
    else:
        lines.append(f"- {large['lever']}: {large['status']} ({large['note'][:160]})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per row (speed: steps 2..N-1)")
    parser.add_argument("--out_dir", type=Path, default=RESULTS)
    parser.add_argument("--only", help="measure only the rows whose name contains this text; the others are read from "
                        "the CSV in --out_dir (the header says which rows were measured when)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    base = ["--model_name", MODEL, *short_run_flags(args.steps, MICRO), "--override_max_seq_length", str(SEQ)]
    with tempfile.TemporaryDirectory(prefix="memory_target_") as tmp:
        work = Path(tmp)
        large_config = work / "large.yaml"
        large_config.write_text(yaml.safe_dump(LARGE))
        table = Table("memory_target", f"Memory target: pretraining {MODEL} at {SEQ} tokens on the CPU", base, rungs(large_config))
        kept = {}
        if args.only:
            with open(args.out_dir / "memory_target.csv", newline="") as f:
                kept = {r["lever"]: r for r in csv.DictReader(f) if args.only not in r["lever"]}
        rows = []
        for i, rung in enumerate(table.rungs, 1):
            if rung.lever in kept:
                rows.append(kept[rung.lever])
                continue
            row = run_rung(rung, table, work / f"row-{i:02d}")
            row["adamw_state_mb"] = f"{8 * parameters(LARGE if 'model_config' in ' '.join(rung.flags) else None) / 1e6:.1f}"
            rows.append(row)
            print(f"[{i}/{len(table.rungs)}] {rung.lever}: {row['status']}, peak {row['peak_mb']} MB, planned tensors "
                  f"{row['plan_tensors_mb']} MB, {row['tokens_per_sec']} tok/s, loss {row['loss']} ({row['wall_s']} s)",
                  flush=True)
    add_ratios(rows)
    columns = [*COLUMNS, "adamw_state_mb"]
    with atomic_open(args.out_dir / "memory_target.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(rows)
    command = "python benchmarks/memory_target.py" + ("" if args.steps == 5 else f" --steps {args.steps}")
    if args.only:  # the rows of the first invocation stay: say which were measured again, and when
        command += f"`, then the rows named '{args.only}' by `{command} --only '{args.only}'` ({time.strftime('%Y-%m-%d')})"
    lines = [f"# {table.title}", "",
             f"Generated by `{command}{'' if args.only else '`'} on {os.cpu_count()} CPU cores, {args.steps} optimizer steps a row, "
             f"{time.strftime('%Y-%m-%d')}; the docstring of benchmarks/memory_ladder.py says what each column measures. "
             "The ratios are to the first row, the best stack of the levers the project had before offloading, stepping "
             "in backward and the lean optimizers. Measured peaks are whole processes, about 0.55 GB of which is the "
             "runtime and the token data whatever the stack (the plan's CPU overhead), so the planned tensors are "
             "what a stack changes on a GPU.", "",
             f"Every row adds its flags to: `{' '.join(base)}`.", "", "## Verdicts", "", *verdicts(rows), "",
             "## Rows", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(f"`{r[c]}`" if c == "flags" else str(r[c]).replace("|", "/") for c in columns) + " |"
              for r in rows]
    atomic_write(args.out_dir / "memory_target.md", "\n".join(lines) + "\n")
    print("\n".join(verdicts(rows)))


if __name__ == "__main__":
    main()
