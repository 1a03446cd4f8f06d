"""The fit loop shared by pretrain/ and finetune/: the rehearsal, the steps (step.py), evaluation, logging,
resumable checkpoints (resumable.py), signals and the summary. A script builds model, optimizer and data, then calls
``fit``.

Determinism: every optimizer step reseeds the RNG from (seed, step, rank), so a resumed run draws exactly
the random numbers (dropout) an uninterrupted run would, without storing RNG state.
"""

from __future__ import annotations

import copy
import csv
import json
import math
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.distributed.fsdp import FSDPModule

from lit_model.core.config import Config
from lit_model.core.errors import STOPS, UserError
from lit_model.core.files import atomic_open, atomic_write
from lit_model.core.meter import Meter
from lit_model.core.units import format_bytes, peak_rss_bytes
from lit_model.io.checkpoint import save_checkpoint_dir
from lit_model.kernels.ops import onednn_fp32_linear
from lit_model.methods.objective import LossSums, Objective
from lit_model.run import Run
from lit_model.train.args import TrainArgs
from lit_model.train.loggers import open_loggers
from lit_model.train.snapshot import start_memory_history
from lit_model.train.optimizers import lr_at, paused_in_backward, set_group_values, set_lr
from lit_model.train.recovery import any_rank
from lit_model.train.resumable import CHECKPOINTS, save_resumable, write_state
from lit_model.train.step import (StepStopped, TrainStep, evaluate, means, release_cached_memory, stop_requested,
                                  sums_vector)


def seed_step(device: torch.device, seed: int) -> None:
    """Seed what a step draws at random (dropout), so that a resumed run redoes each step as it first ran: the CPU's
    generator and the training device's. ``torch.manual_seed`` seeds every backend's too, at ~70 us a call on the CPU
    (a quarter of a percent of a small model's step)."""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # this rank's device: Fabric made it the current one
    elif device.type != "cpu":
        torch.manual_seed(seed)


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    return peak_rss_bytes()


class Progress:
    """Progress of a run. A plain class, not a dataclass: Fabric copies dataclasses while unwrapping the
    state it saves and loads, so a dataclass would not be restored in place."""

    def __init__(self) -> None:
        self.step = 0  # optimizer steps done
        self.tokens = 0  # training tokens seen (all ranks, excluding padding/ignored)
        self.fit_seconds = 0.0
        self.train_seconds = 0.0  # of fit_seconds: the steps' forward, backward and update (no data, evaluation, save)
        self.rollout_tokens = 0  # GRPO: prompt + completion tokens of the training rollouts (this rank's)
        self.rollout_seconds = 0.0  # GRPO: their seconds (generation, rewards, batch), also within fit_seconds
        self.last_train_loss = float("nan")
        self.last_val_loss = float("nan")
        # A stop interrupted the evaluation of step ``step``: the resumed run evaluates and logs that step first.
        self.evaluation_due = False
        self.stopped = False  # this process stopped on a signal (set after its last save: no checkpoint holds True)

    # Fabric saves and restores objects with these two methods.
    def state_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        vars(self).update(state)


# ---- logging -------------------------------------------------------------------------------------
# GRPO's split of a logged window's time: its rollouts' prompt + completion tokens over the rollouts' seconds and over
# the training's (forward, backward, update); step_seconds, the window's wall time, also holds evaluation and logging
ROLLOUT_COLUMNS = ("rollout_tokens", "rollout_seconds", "train_seconds", "step_seconds", "rollout_tokens_per_sec",
                   "train_tokens_per_sec")


def rollout_rates(tokens: int, rollout_seconds: float, train_seconds: float) -> dict[str, float]:
    """The rollouts' tokens, the seconds of both phases and each phase's tokens/s (the same tokens for both: those
    the rollouts generated from, which the training then runs forward and backward)."""
    return {"rollout_tokens": tokens, "rollout_seconds": rollout_seconds, "train_seconds": train_seconds,
            "rollout_tokens_per_sec": tokens / max(rollout_seconds, 1e-9),
            "train_tokens_per_sec": tokens / max(train_seconds, 1e-9)}


class MetricsWriter:
    COLUMNS = ["step", "tokens", "train_loss", "val_loss", "learning_rate", "tokens_per_sec", "peak_memory_bytes"]

    def __init__(self, path: Path, enabled: bool, resume_step: int, metric_names: tuple[str, ...] = (),
                 extra_columns: tuple[str, ...] = ()) -> None:
        """``metric_names``: the objective's, logged after the loss columns for training and, prefixed ``val_``,
        for evaluation; ``extra_columns`` (ROLLOUT_COLUMNS) last."""
        self.path, self.enabled = path, enabled
        self.columns = [*self.COLUMNS[:4], *metric_names, *(f"val_{name}" for name in metric_names), *self.COLUMNS[4:],
                        *extra_columns]
        if not enabled:
            return
        rows = []
        if resume_step > 0 and path.exists():  # drop rows logged after the checkpoint we resume from
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with atomic_open(path, "w", newline="") as f:  # a kill mid-rewrite keeps the old history
            writer = csv.DictWriter(f, self.columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.columns).writerow({k: row.get(k, "") for k in self.columns})


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def free_disk_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def check_room_for_final(fabric: Fabric, out_dir: Path, weight_bytes: int) -> None:
    """final/ is written after the last step: a disk without room for the model's weights (as they are held now: a
    lower bound of what final/ stores) would fail the save at the end of the run, after all the training."""
    free = fabric.broadcast(free_disk_bytes(out_dir) if fabric.global_rank == 0 else 0)
    if free < weight_bytes:
        raise UserError(f"{out_dir} is on a disk with {free / 1e9:.1f} GB free, but final/, written after the last step, "
                        f"needs at least {weight_bytes / 1e9:.1f} GB for the model's weights. Free space on that disk or "
                        "choose an --out_dir on a larger one; nothing was trained yet.")


def rehearse(fabric: Fabric, train_step: TrainStep, batch: tuple[torch.Tensor, ...], val_batches: list[Any],
             state: dict[str, Any], config: Config, out_dir: Path, save_filter: Optional[dict[str, Any]], fresh: bool) -> None:
    """The run's memory-hungriest moments once, before the main loop: a step on the longest batch, the largest
    evaluation batch and a checkpoint save (and room on the disk for final/), so an out-of-memory or a full disk
    shows in the first minute, not after hours.
    A ``fresh`` run's rehearsal changes nothing: its optimizer step has learning rate and weight decay 0 (set before
    the backward, where an optimizer that steps in backward steps), and the optimizer's state and param groups are
    restored afterwards from a copy taken before (a fresh optimizer's state is empty, or small). A resumed run
    skips the optimizer step (its loaded state already holds that memory): in backward, it only frees gradients."""
    start = time.perf_counter()
    model, optimizer = train_step.model, train_step.optimizer
    check_room_for_final(fabric, out_dir, sum(p.numel() * p.element_size() for p in model.parameters()))
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
    if fresh:
        saved = copy.deepcopy(inner.state_dict())
        set_group_values(inner, lr=0.0, weight_decay=0.0)
        train_step([batch], "in the rehearsal step on the longest batch")
        optimizer.step()
    else:
        with paused_in_backward(inner):
            train_step([batch], "in the rehearsal step on the longest batch")
    optimizer.zero_grad(set_to_none=True)
    evaluate(fabric, model, train_step.objective, [max(val_batches, key=lambda b: b[0].numel())])
    tmp = out_dir / CHECKPOINTS / ".rehearsal.tmp"
    write_state(fabric, tmp, state, config, save_filter)
    if fabric.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if fresh:
        inner.load_state_dict(saved)
    fabric.print(
        f"Rehearsal passed in {time.perf_counter() - start:.1f} s: a step on the longest batch "
        f"({' x '.join(map(str, batch[0].shape))} tokens), the largest evaluation batch and a checkpoint save; "
        f"peak memory so far {format_bytes(peak_memory_bytes(fabric.device))}.", flush=True,
    )


# ---- the loop ------------------------------------------------------------------------------------
# (the run with the micro batch that failed, the parsed arguments, the device, where, the error's message) -> the
# paragraph a run that ran out of memory ends with
OutOfMemoryReport = Callable[[Run, Any, torch.device, str, str], str]


def fit(
    fabric: Fabric,
    run: Run,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    objective: Objective,
    train_batches: Iterator[Any],
    val_batches: list[Any],
    args: TrainArgs,
    max_steps: int,
    progress: Progress,
    oom_report: OutOfMemoryReport,
    save_filter: Optional[dict[str, Any]] = None,
    rehearsal_batch: Optional[tuple[torch.Tensor, ...]] = None,
    rollout_meter: Optional[Meter] = None,
) -> tuple[Progress, Run]:
    """Train ``run`` until ``max_steps`` optimizer steps of ``objective``; evaluate, log, checkpoint and honour stop
    signals.
    ``oom_report`` writes the paragraph a step that ran out of memory ends with (the recipes hand in the planner's,
    ``lit_model.plan.oom_report``). ``save_filter`` selects what the resumable checkpoints hold (see
    ``save_resumable``). With ``--rehearse``,
    ``rehearsal_batch`` (a micro batch of the longest samples) is rehearsed first. ``rollout_meter``: what
    ``train_batches``' rollouts (GRPO) add to it is logged beside the training's own time (ROLLOUT_COLUMNS, and the
    step line). Returns the progress and the
    run as it ended: with the smaller micro batch that out-of-memory recovery fell back to, if it did.

    A SIGTERM/SIGINT during the loop stops it within a micro batch or an evaluation batch (see TrainStep and
    evaluate for how the ranks agree): a step that was not complete is abandoned, an evaluation cut short is
    redone by the resumed run, and the last completed step is saved. The run then writes a summary marked
    ``"stopped": true``, prints the command that continues it and returns with ``progress.stopped`` set: the caller
    writes no final/."""
    config, out_dir = run.config, args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    start_memory_history(fabric.device)

    def report(micro_batch_size: int, where: str, message: str) -> str:
        return oom_report(run.replace(micro_batch_size=micro_batch_size), args, fabric.device, where, message)

    train_step = TrainStep(fabric, model, optimizer, objective, run.micro_batch_size, args.oom_recovery, report)
    # The data position is progress.step: the sampler is a pure function of the step, so it needs no state.
    state = {"model": model, "optimizer": optimizer, "run": progress}
    if args.rehearse and rehearsal_batch is not None:
        rehearse(fabric, train_step, rehearsal_batch, val_batches, state, config, out_dir, save_filter, progress.step == 0)
    names = objective.metric_names
    metrics = MetricsWriter(out_dir / "metrics.csv", fabric.global_rank == 0, progress.step, names,
                            ROLLOUT_COLUMNS if rollout_meter is not None else ())
    train_metrics: dict[str, float] = {}  # the last step's means of the objective's metrics
    window_start, window_tokens = time.perf_counter(), 0
    window_train_seconds, window_rollout = 0.0, Meter()  # the logged window's training time and rollouts
    fit_start = time.perf_counter() - progress.fit_seconds
    steps_at_start = progress.step
    saved: Optional[tuple[int, Path]] = None  # the step and path of the checkpoint this run wrote last
    stopped = False
    # The rate step progress.step ran with: what the row of an evaluation redone on resume reports.
    lr = lr_at(max(progress.step - 1, 0), args.learning_rate, args.warmup_steps, max_steps, args.min_lr)
    model.train()
    # the loggers open before stops are deferred: a stop while one starts (a slow server) ends the run at once
    with open_loggers(args, fabric.global_rank == 0, progress.step) as log_row, STOPS.deferred():
        while progress.step < max_steps or progress.evaluation_due:
            if not progress.evaluation_due:  # else: resumed from a stop during this step's evaluation
                seed_step(fabric.device, args.seed + 1_000_003 * progress.step + 7919 * fabric.global_rank)
                lr = lr_at(progress.step, args.learning_rate, args.warmup_steps, max_steps, args.min_lr)
                set_lr(optimizer, lr)
                try:
                    batches = [next(train_batches) for _ in range(run.accumulation)]  # GRPO: the step's rollouts
                    compute_start = time.perf_counter()
                    sums = train_step(batches, f"at step {progress.step + 1}")
                except StepStopped:  # nothing of this step was applied
                    optimizer.zero_grad(set_to_none=True)
                    stopped = True
                    break
                train_step.update(run.grad_clip)
                progress.step += 1
                seconds = time.perf_counter() - compute_start
                progress.train_seconds += seconds
                window_train_seconds += seconds
                if rollout_meter is not None:
                    rollout_tokens, rollout_seconds = rollout_meter.take()
                    window_rollout.add(rollout_tokens, rollout_seconds)
                    progress.rollout_tokens += rollout_tokens
                    progress.rollout_seconds += rollout_seconds

                vector = torch.cat([sums_vector(LossSums(sums.loss, sums.count, sums.metrics), names),
                                    sums.tokens.float().view(1)])
                reduced = fabric.all_reduce(vector, reduce_op="sum")
                train_metrics = means(reduced[:-1], names)
                progress.last_train_loss = train_metrics.pop("loss")
                progress.tokens += int(reduced[-1].item())
                window_tokens += int(reduced[-1].item())
                if not math.isfinite(progress.last_train_loss):
                    raise UserError(
                        f"The training loss became {progress.last_train_loss} at step {progress.step}. Lower --learning_rate, "
                        "keep --grad_clip on, or use --precision bf16-true/32-true instead of 16-true; resume from the "
                        f"last checkpoint in {out_dir / CHECKPOINTS} with --resume auto."
                    )
                if args.empty_cache_interval and progress.step % args.empty_cache_interval == 0:
                    release_cached_memory(fabric.device)

            is_last = progress.step >= max_steps
            row: dict[str, Any] = {}
            if progress.step % args.eval_interval == 0 or is_last or progress.evaluation_due:
                val = evaluate(fabric, model, objective, val_batches)
                progress.evaluation_due = val is None
                if progress.evaluation_due:
                    stopped = True
                    break
                progress.last_val_loss = val.pop("loss")
                row["val_loss"] = f"{progress.last_val_loss:.4f}"
                row.update({f"val_{name}": f"{value:.4f}" for name, value in val.items()})
            if progress.step % args.log_interval == 0 or is_last or "val_loss" in row:
                now = time.perf_counter()
                progress.fit_seconds = now - fit_start
                tokens_per_sec = window_tokens / max(now - window_start, 1e-9)
                peak = fabric.all_reduce(torch.tensor(peak_memory_bytes(fabric.device), device=fabric.device), reduce_op="max")
                row.update(
                    step=progress.step, tokens=progress.tokens, train_loss=f"{progress.last_train_loss:.4f}", learning_rate=f"{lr:.3e}",
                    tokens_per_sec=f"{tokens_per_sec:.0f}", peak_memory_bytes=int(peak.item()),
                    **{name: f"{value:.4f}" for name, value in train_metrics.items()},
                )
                phases = ""
                if rollout_meter is not None:
                    rates = rollout_rates(*window_rollout.take(), window_train_seconds)
                    row.update({k: f"{v:.4f}" if k.endswith("seconds") else f"{v:.0f}" for k, v in rates.items()},
                               step_seconds=f"{now - window_start:.4f}")
                    phases = (f" | rollout {rates['rollout_tokens']} tok in {rates['rollout_seconds']:.2f} s, "
                              f"{rates['rollout_tokens_per_sec']:,.0f} tok/s | train {rates['train_seconds']:.2f} s, "
                              f"{rates['train_tokens_per_sec']:,.0f} tok/s")
                metrics.write(row)
                log_row(row)
                done = progress.step - steps_at_start
                eta = (max_steps - progress.step) * progress.fit_seconds / max(done, 1) if done else 0
                val_text = f" | val {progress.last_val_loss:.4f}" if "val_loss" in row else ""
                logged = "".join(f" | {name} {value:.3f}" for name, value in train_metrics.items())
                fabric.print(
                    f"step {progress.step}/{max_steps} | loss {progress.last_train_loss:.4f}{val_text}{logged} | "
                    f"{tokens_per_sec:,.0f} tok/s{phases} | "
                    f"peak {format_bytes(peak.item())} | ETA {format_duration(eta)}",
                    flush=True,
                )
                window_start, window_tokens, window_train_seconds = now, 0, 0.0
            stopped = any_rank(fabric, stop_requested())
            if (args.save_interval and progress.step % args.save_interval == 0) or is_last or stopped:
                progress.fit_seconds = time.perf_counter() - fit_start
                with STOPS.patience():  # the other ranks wait while rank 0 writes: let the save finish
                    saved = progress.step, save_resumable(fabric, args, state, config, progress.step, save_filter, run.checkpoint_dir)
            if stopped:
                break
        progress.fit_seconds = time.perf_counter() - fit_start
        run = run.replace(micro_batch_size=train_step.micro_batch_size)  # after any out-of-memory split
        if stopped:
            stop_run(fabric, run, progress, args, max_steps, state, save_filter, saved)
    if not stopped:  # a signal from here on ends the process at once: training is over and saved
        STOPS.where = (f"after training, before final/ was complete: the last checkpoint is in {out_dir / CHECKPOINTS}; "
                       "the same command with --resume auto writes final/")
    return progress, run


def stop_run(fabric: Fabric, run: Run, progress: Progress, args: TrainArgs, max_steps: int, state: dict[str, Any],
             save_filter: Optional[dict[str, Any]], saved: Optional[tuple[int, Path]]) -> None:
    """After a stop: the last completed step's checkpoint (unless this run just wrote it), a summary marked stopped,
    and the command that continues the run. ``progress.stopped`` is set after the save, so no checkpoint holds it."""
    if saved is None or saved[0] != progress.step:
        with STOPS.patience():
            saved = progress.step, save_resumable(fabric, args, state, run.config, progress.step, save_filter, run.checkpoint_dir)
    progress.stopped = True
    command = resume_command(sys.argv)
    write_summary(fabric, run, progress, args, {"stopped": True, "resume_command": command})
    redo = " (its evaluation is redone on resume)" if progress.evaluation_due else ""
    fabric.print(
        f"Stopped by signal {STOPS.signal_name if stop_requested() else '(on another rank)'} at step {progress.step}/{max_steps}"
        f"{redo}; saved {saved[1]}; no final/ written. Continue with the same command plus --resume auto:\n  {command}",
        flush=True,
    )


def resume_command(argv: list[str]) -> str:
    """The command that started this process, with ``--resume auto`` in place of any --resume: ``python SCRIPT ...``
    for a script, ``lit-model COMMAND ...`` for the installed command."""
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    start = ["python", argv[0]] if argv[0].endswith(".py") else [Path(argv[0]).name]
    return shlex.join([*start, *kept, "--resume", "auto"])


def write_summary(fabric: Fabric, run: Run, progress: Progress, args: TrainArgs, extra: dict[str, Any]) -> dict[str, Any]:
    peak = torch.tensor(peak_memory_bytes(fabric.device), device=fabric.device, dtype=torch.float64)
    peak_max = fabric.all_reduce(peak, reduce_op="max").item()
    peak_sum = fabric.all_reduce(peak, reduce_op="sum").item()
    summary = {
        "tokens_per_sec": progress.tokens / max(progress.fit_seconds, 1e-9),
        "peak_memory_bytes": int(peak_max),
        "peak_memory_bytes_all_ranks": int(peak_sum),
        "train_loss": progress.last_train_loss,
        "val_loss": progress.last_val_loss,
        "steps": progress.step,
        "tokens": progress.tokens,
        "wall_time_s": progress.fit_seconds,
        "micro_batch_size": run.micro_batch_size,
        "global_batch_size": run.global_batch_size,
        "precision": run.precision,
        "devices": run.world_size,
        "strategy": run.parallel.strategy_name,
        **extra,
    }
    if run.device_type == "cpu":  # which kernel ran the fp32 linear maps (LIT_MODEL_FP32_LINEAR): runs compare by it
        summary["fp32_linear"] = "onednn" if onednn_fp32_linear() else "blas"
    if fabric.global_rank == 0:  # strict JSON: a loss that is not a number (never evaluated, diverged) is null
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
        atomic_write(args.out_dir / "summary.json", json.dumps(finite, indent=2, allow_nan=False) + "\n")
    return summary


def save_final(fabric: Fabric, model: nn.Module, config: Config, final_dir: Path, tokenizer_dir: Optional[Path],
               write_extra: Optional[Callable[[Path], None]] = None) -> None:
    """Gather the full weights (FSDP shards included) on rank 0 and write a checkpoint directory atomically, with
    what ``write_extra(tmp_dir)`` adds. It replaces out_dir/final: check_out_dir let this run own out_dir."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    module = getattr(model, "module", model)
    if isinstance(module, FSDPModule):
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(module, options=options)
    else:
        state_dict = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
    if fabric.global_rank == 0:
        save_checkpoint_dir(state_dict, config, final_dir, tokenizer_dir=tokenizer_dir, overwrite=True, write_extra=write_extra)
    fabric.barrier()
