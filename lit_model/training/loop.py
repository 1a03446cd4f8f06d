"""The fit loop pieces shared by pretrain/ and finetune/: accumulation, evaluation, logging, checkpoints,
resume, signals. A script builds model, optimizer and data, then calls ``fit``.

Determinism: every optimizer step reseeds the RNG from (seed, step, rank), so a resumed run draws exactly
the random numbers (dropout) an uninterrupted run would, without storing RNG state.
"""

from __future__ import annotations

import contextlib
import copy
import csv
import ctypes
import fnmatch
import gc
import json
import math
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_model.config import Config
from lit_model.errors import STOPS, UsageError, UserError
from lit_model.files import atomic_write
from lit_model.memory.units import peak_rss_bytes
from lit_model.training.args import TrainArgs
from lit_model.training.optimizers import lr_at, set_lr
from lit_model.training.recovery import (
    StepOutOfMemory, any_rank, catch_out_of_memory, count_targets, out_of_memory_report, raise_if_any_rank_failed,
    simulated_memory_cap, split_batches, start_memory_history,
)

CHECKPOINTS = "checkpoints"
STATE_NAME = "state.pt"


def freeze_layers(model: nn.Module, spec: Optional[Union[int, list[str]]]) -> int:
    """Freeze the embedding and the first N blocks, or every parameter matching a name pattern.
    Returns the number of frozen parameters."""
    if spec is None:
        return 0
    if isinstance(spec, int):
        n_layer = len(model.blocks)
        if not 0 <= spec <= n_layer:
            raise UsageError(f"--freeze_layers {spec}: the model has {n_layer} blocks; use 0..{n_layer}.")
        patterns = ["embed.*"] + [f"blocks.{i}.*" for i in range(spec)]
    else:
        patterns = list(spec)
    frozen = 0
    matched = set()
    for name, parameter in model.named_parameters():
        for pattern in patterns:
            if fnmatch.fnmatch(name, pattern):
                parameter.requires_grad_(False)
                frozen += parameter.numel()
                matched.add(pattern)
                break
    unmatched = [p for p in patterns if p not in matched]
    if unmatched:
        raise UsageError(
            f"--freeze_layers patterns {unmatched} match no parameter. Names look like 'embed.weight', "
            "'blocks.0.attn.query.weight'; patterns use shell wildcards, e.g. 'blocks.[0-3].*'."
        )
    return frozen


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device)
    return peak_rss_bytes()


def release_cached_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back to the OS


class RunState:
    """Progress of a run. A plain class, not a dataclass: Fabric copies dataclasses while unwrapping the
    state it saves and loads, so a dataclass would not be restored in place."""

    def __init__(self) -> None:
        self.step = 0  # optimizer steps done
        self.tokens = 0  # training tokens seen (all ranks, excluding padding/ignored)
        self.fit_seconds = 0.0
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


class StepStopped(Exception):
    """Raised on every rank when any rank was asked to stop before the step's gradients were complete: the step is
    abandoned (nothing applied) and the run saves the last completed step."""


def stop_requested() -> bool:
    """A SIGTERM/SIGINT arrived while the fit loop defers stops (errors.STOPS), on this process."""
    return STOPS.requested is not None


# ---- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, batches: list[Any]) -> Optional[float]:
    """Mean loss over the same number of batches on every rank (no rank waits for another), or None when a stop
    request cut it short. Before each batch the ranks agree on stopping (one 4-byte all-reduce with several
    processes: evaluation is not the hot path, and under FSDP a rank cannot skip a forward alone)."""
    model.eval()
    total = torch.zeros(2, device=fabric.device)
    try:
        for input_ids, targets in batches:
            if any_rank(fabric, stop_requested()):
                return None
            loss = model(input_ids, targets=targets)
            count = count_targets(targets)
            total += torch.stack([loss.float() * count, count.float()])
    finally:
        model.train()
    total = fabric.all_reduce(total, reduce_op="sum")
    return (total[0] / total[1].clamp(min=1)).item()


# ---- checkpoints ---------------------------------------------------------------------------------
def checkpoint_dirs(out_dir: Path) -> list[Path]:
    found = [p for p in (out_dir / CHECKPOINTS).glob("step-*") if re.fullmatch(r"step-\d+", p.name)]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def write_state(fabric: Fabric, directory: Path, state: dict[str, Any], config: Config, filter: Optional[dict[str, Any]] = None) -> None:
    """The model config and the resumable state into a fresh ``directory`` (every rank takes part)."""
    if fabric.global_rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        config.save(directory)
    fabric.barrier()
    fabric.save(directory / STATE_NAME, state, filter=filter)
    fabric.barrier()


def save_resumable(
    fabric: Fabric, out_dir: Path, state: dict[str, Any], config: Config, step: int, keep_last: int,
    filter: Optional[dict[str, Any]] = None,
) -> Path:
    """Write into a temporary directory and rename it in, so a crash mid-save leaves the last good one.
    The model config goes beside the state so a resume can check it before loading anything large.
    ``filter`` (Fabric's ``save(filter=...)``) keeps part of a state, e.g. only the trainable parameters."""
    final = out_dir / CHECKPOINTS / f"step-{step:08d}"
    tmp = final.with_name(f".{final.name}.tmp")
    write_state(fabric, tmp, state, config, filter)
    if fabric.global_rank == 0:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in checkpoint_dirs(out_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    fabric.barrier()
    return final


def find_resume_path(out_dir: Path, resume: Optional[Union[str, Path]]) -> Optional[Path]:
    if resume is None:
        return None
    if resume == "auto":
        found = checkpoint_dirs(out_dir)
        return found[-1] if found else None
    path = Path(resume)
    if path.is_dir() and (path / STATE_NAME).exists():
        return path
    raise UsageError(f"--resume {path}: no checkpoint there (expected {path / STATE_NAME}). Use --resume auto.")


def check_out_dir(out_dir: Path, args: TrainArgs) -> None:
    """Refuse to mix two runs in one directory unless asked to resume or overwrite."""
    holds_run = (out_dir / "metrics.csv").exists() or bool(checkpoint_dirs(out_dir))
    if holds_run and args.resume is None and not args.overwrite:
        raise UsageError(
            f"{out_dir} already holds a run. Continue it with --resume auto, start over with --overwrite, or "
            "pick another --out_dir."
        )
    out_dir.mkdir(parents=True, exist_ok=True)


# ---- logging -------------------------------------------------------------------------------------
class MetricsWriter:
    COLUMNS = ["step", "tokens", "train_loss", "val_loss", "learning_rate", "tokens_per_sec", "peak_memory_bytes"]

    def __init__(self, path: Path, enabled: bool, resume_step: int) -> None:
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        if resume_step == 0 or not path.exists():
            with open(path, "w", newline="") as f:
                csv.writer(f).writerow(self.COLUMNS)
        else:  # drop rows logged after the checkpoint we resume from
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
            with open(path, "w", newline="") as f:
                writer = csv.DictWriter(f, self.COLUMNS)
                writer.writeheader()
                writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.COLUMNS).writerow({k: row.get(k, "") for k in self.COLUMNS})


def format_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ---- the training step ---------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    module = getattr(model, "module", model)  # Fabric's wrapper
    return getattr(module, "_orig_mod", module)  # torch.compile's


class TrainStep:
    """One optimizer step's forward and backward passes over the step's samples, in micro batches. When the
    device runs out of memory (every rank learns it, see recovery.py), the step's memory is freed and the same
    samples are redone in micro batches half as large; the smaller size is kept for the rest of the run.
    The loss is the mean over every target token of the step on all ranks, so the gradients do not depend on
    how the samples are split (up to float summation order)."""

    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: Any, micro_batch_size: int, recover: bool,
                 report: Callable[[int, str, str], str]) -> None:
        from lit_model.training.optimizers import needs_create_graph

        self.fabric, self.model, self.optimizer = fabric, model, optimizer
        self.micro_batch_size, self.recover, self.report = micro_batch_size, recover, report
        self.create_graph = needs_create_graph(optimizer)
        unwrap(model).loss_differentiable_twice = self.create_graph
        # The first micro batch of a step from which a rank asked to stop may skip the rest alone (then waits for
        # the others at the step's agreement point): any on one process; under DDP any but the first, whose forward
        # may broadcast buffers or rebuild gradient buckets (the later no-sync forwards and backwards, and the last
        # forward, start no collective); under FSDP none, since every forward gathers parameters from all ranks.
        alone = fabric.world_size == 1 or isinstance(fabric.strategy, DDPStrategy)
        self.first_skippable = (0 if fabric.world_size == 1 else 1) if alone else None

    def attention_backend(self) -> Any:
        # Hessian-based optimizers differentiate twice; the fused attention kernels have no double backward.
        return sdpa_kernel([SDPBackend.MATH]) if self.create_graph else contextlib.nullcontext()

    def agree(self, failures: list[str]) -> None:
        """Every rank learns, in one collective, whether any rank ran out of memory or was asked to stop, and all
        raise ``StepStopped`` (a stop wins: the step would be abandoned anyway) or ``StepOutOfMemory`` together."""
        out_of_memory, stop = bool(failures), stop_requested()
        if self.fabric.world_size > 1:
            flags = torch.tensor([float(out_of_memory), float(stop)], device=self.fabric.device)
            out_of_memory, stop = (bool(flag) for flag in self.fabric.all_reduce(flags, reduce_op="max").tolist())
        if stop:
            raise StepStopped()
        if out_of_memory:
            raise StepOutOfMemory(failures[0] if failures else "another rank ran out of memory")

    def accumulate(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over ``batches``; returns this rank's summed token loss and its token count.
        The ranks agree on out-of-memory and stop requests before the last micro batch's backward (its gradient
        all-reduce; the accumulation micro batches start no collective, so a rank that fails there, or is asked to
        stop where it may skip alone, goes there early and waits), and on out-of-memory again after it. So a stop
        costs no collective of its own: between micro batches it is a local check."""
        fabric = self.fabric
        chunks = split_batches(batches, self.micro_batch_size)
        counts = [count_targets(targets) for _, targets in chunks]
        local_tokens = sum(counts)
        all_tokens = fabric.all_reduce(local_tokens.float(), reduce_op="sum") if fabric.world_size > 1 else local_tokens.float()
        scale = fabric.world_size / all_tokens.clamp(min=1)  # the ranks average their gradients
        loss_sum = torch.zeros((), device=fabric.device)
        failures: list[str] = []
        last = len(chunks) - 1
        for index, ((input_ids, targets), count) in enumerate(zip(chunks, counts)):
            sync = index == last
            if self.first_skippable is not None and index >= self.first_skippable and stop_requested():
                self.agree(failures)  # raises StepStopped on every rank
            with fabric.no_backward_sync(self.model, enabled=not sync), self.attention_backend():
                with catch_out_of_memory(failures), simulated_memory_cap(self.model, self.optimizer):
                    loss = self.model(input_ids, targets=targets) * count
                    if not sync:
                        fabric.backward(loss * scale, create_graph=self.create_graph)
                if failures or sync:
                    self.agree(failures)
                if sync:
                    with catch_out_of_memory(failures):
                        fabric.backward(loss * scale, create_graph=self.create_graph)
                    raise_if_any_rank_failed(fabric, failures)
            loss_sum += loss.detach()
        return loss_sum, local_tokens

    def __call__(self, batches: list[tuple[torch.Tensor, torch.Tensor]], where: str) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            try:
                return self.accumulate(batches)
            except StepOutOfMemory as error:
                message = str(error)
            self.optimizer.zero_grad(set_to_none=True)
            release_cached_memory(self.fabric.device)
            if not self.recover or self.micro_batch_size == 1:
                raise UserError(self.report(self.micro_batch_size, where, message))
            old, self.micro_batch_size = self.micro_batch_size, (self.micro_batch_size + 1) // 2
            self.fabric.print(
                f"Out of memory {where} with micro batch {old} ({message}): redoing the same samples in micro batches "
                f"of {self.micro_batch_size} (the global batch is unchanged) and keeping that size.", flush=True,
            )


def rehearse(fabric: Fabric, train_step: TrainStep, batch: tuple[torch.Tensor, torch.Tensor], val_batches: list[Any],
             state: dict[str, Any], config: Config, out_dir: Path, save_filter: Optional[dict[str, Any]]) -> None:
    """The run's memory-hungriest moments once, before the main loop: a step on the longest batch, the largest
    evaluation batch and a checkpoint save, so an out-of-memory shows in the first minute, not after hours.
    A fresh run's rehearsal changes nothing: its optimizer step has learning rate and weight decay 0, and the
    optimizer state it creates is dropped afterwards. A resumed run skips the optimizer step (its loaded state
    already holds that memory)."""
    start = time.perf_counter()
    model, optimizer = train_step.model, train_step.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)  # Fabric's wrapper
    fresh = not inner.state
    saved_groups = copy.deepcopy([{k: v for k, v in group.items() if k != "params"} for group in inner.param_groups])
    train_step([batch], "in the rehearsal step on the longest batch")
    if fresh:
        for group in inner.param_groups:
            group["lr"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    evaluate(fabric, model, [max(val_batches, key=lambda b: b[0].numel())])
    tmp = out_dir / CHECKPOINTS / ".rehearsal.tmp"
    write_state(fabric, tmp, state, config, save_filter)
    if fabric.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if fresh:
        inner.state.clear()
        for group, saved in zip(inner.param_groups, saved_groups):  # also drops keys the step added ("step")
            params = group["params"]
            group.clear()
            group.update(saved, params=params)
    fabric.print(
        f"Rehearsal passed in {time.perf_counter() - start:.1f} s: a step on the longest batch "
        f"({batch[0].shape[0]} x {batch[0].shape[1]} tokens), the largest evaluation batch and a checkpoint save; "
        f"peak memory so far {format_bytes(peak_memory_bytes(fabric.device))}.", flush=True,
    )


# ---- the loop ------------------------------------------------------------------------------------
def fit(
    fabric: Fabric,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_batches: Iterator[Any],
    val_batches: list[Any],
    args: TrainArgs,
    max_steps: int,
    accumulation: int,
    run: RunState,
    config: Config,
    save_filter: Optional[dict[str, Any]] = None,
    rehearsal_batch: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    trainable: str = "full",
) -> RunState:
    """Train until ``max_steps`` optimizer steps; evaluate, log, checkpoint and honour stop signals.
    ``save_filter`` selects what the resumable checkpoints hold (see ``save_resumable``). With ``--rehearse``,
    ``rehearsal_batch`` (a micro batch of the longest samples) is rehearsed first. ``trainable`` (full, lora,
    adapter) is what an out-of-memory report plans with.

    A SIGTERM/SIGINT during the loop stops it within a micro batch or an evaluation batch (see TrainStep and
    evaluate for how the ranks agree): a step that was not complete is abandoned, an evaluation cut short is
    redone by the resumed run, and the last completed step is saved. The run then writes a summary marked
    ``"stopped": true``, prints the command that continues it and returns with ``run.stopped`` set: the caller
    writes no final/."""
    from lit_model.training.optimizers import hessian_step

    out_dir = args.out_dir
    start_memory_history(fabric.device)

    def report(micro_batch_size: int, where: str, message: str) -> str:
        return out_of_memory_report(config, args, trainable, fabric.device, fabric.world_size, micro_batch_size,
                                    where, message, out_dir)

    train_step = TrainStep(fabric, model, optimizer, int(args.micro_batch_size), args.oom_recovery, report)
    # The data position is run.step: the sampler is a pure function of the step, so it needs no state.
    state = {"model": model, "optimizer": optimizer, "run": run}
    if args.rehearse and rehearsal_batch is not None:
        rehearse(fabric, train_step, rehearsal_batch, val_batches, state, config, out_dir, save_filter)
    metrics = MetricsWriter(out_dir / "metrics.csv", fabric.global_rank == 0, run.step)
    window_start, window_tokens = time.perf_counter(), 0
    fit_start = time.perf_counter() - run.fit_seconds
    steps_at_start = run.step
    saved: Optional[tuple[int, Path]] = None  # the step and path of the checkpoint this run wrote last
    stopped = False
    # The rate step run.step ran with: what the row of an evaluation redone on resume reports.
    lr = lr_at(max(run.step - 1, 0), args.learning_rate, args.warmup_steps, max_steps, args.min_lr)
    model.train()
    with STOPS.deferred():
        while run.step < max_steps or run.evaluation_due:
            if not run.evaluation_due:  # else: resumed from a stop during this step's evaluation
                torch.manual_seed(args.seed + 1_000_003 * run.step + 7919 * fabric.global_rank)
                lr = lr_at(run.step, args.learning_rate, args.warmup_steps, max_steps, args.min_lr)
                set_lr(optimizer, lr)
                try:
                    step_loss, step_tokens = train_step([next(train_batches) for _ in range(accumulation)],
                                                        f"at step {run.step + 1}")
                except StepStopped:  # nothing of this step was applied
                    optimizer.zero_grad(set_to_none=True)
                    stopped = True
                    break
                if args.grad_clip > 0:
                    fabric.clip_gradients(model, optimizer, max_norm=args.grad_clip, error_if_nonfinite=False)
                if train_step.create_graph:
                    hessian_step(optimizer)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                run.step += 1

                reduced = fabric.all_reduce(torch.stack([step_loss.float(), step_tokens.float()]), reduce_op="sum")
                run.last_train_loss = reduced[0].item() / max(reduced[1].item(), 1)
                run.tokens += int(reduced[1].item())
                window_tokens += int(reduced[1].item())
                if not math.isfinite(run.last_train_loss):
                    raise UserError(
                        f"The training loss became {run.last_train_loss} at step {run.step}. Lower --learning_rate, "
                        "keep --grad_clip on, or use --precision bf16-true/32-true instead of 16-true; resume from the "
                        f"last checkpoint in {out_dir / CHECKPOINTS} with --resume auto."
                    )
                if args.empty_cache_interval and run.step % args.empty_cache_interval == 0:
                    release_cached_memory(fabric.device)

            is_last = run.step >= max_steps
            row: dict[str, Any] = {}
            if run.step % args.eval_interval == 0 or is_last or run.evaluation_due:
                val_loss = evaluate(fabric, model, val_batches)
                run.evaluation_due = val_loss is None
                if run.evaluation_due:
                    stopped = True
                    break
                run.last_val_loss = val_loss
                row["val_loss"] = f"{run.last_val_loss:.4f}"
            if run.step % args.log_interval == 0 or is_last or "val_loss" in row:
                now = time.perf_counter()
                run.fit_seconds = now - fit_start
                tokens_per_sec = window_tokens / max(now - window_start, 1e-9)
                peak = fabric.all_reduce(torch.tensor(peak_memory_bytes(fabric.device), device=fabric.device), reduce_op="max")
                row.update(
                    step=run.step, tokens=run.tokens, train_loss=f"{run.last_train_loss:.4f}", learning_rate=f"{lr:.3e}",
                    tokens_per_sec=f"{tokens_per_sec:.0f}", peak_memory_bytes=int(peak.item()),
                )
                metrics.write(row)
                done = run.step - steps_at_start
                eta = (max_steps - run.step) * run.fit_seconds / max(done, 1) if done else 0
                val = f" | val {run.last_val_loss:.4f}" if "val_loss" in row else ""
                fabric.print(
                    f"step {run.step}/{max_steps} | loss {run.last_train_loss:.4f}{val} | {tokens_per_sec:,.0f} tok/s | "
                    f"peak {format_bytes(peak.item())} | ETA {format_duration(eta)}",
                    flush=True,
                )
                window_start, window_tokens = now, 0
            stopped = any_rank(fabric, stop_requested())
            if (args.save_interval and run.step % args.save_interval == 0) or is_last or stopped:
                run.fit_seconds = time.perf_counter() - fit_start
                with STOPS.patience():  # the other ranks wait while rank 0 writes: let the save finish
                    saved = run.step, save_resumable(fabric, out_dir, state, config, run.step, args.keep_last, save_filter)
            if stopped:
                break
        run.fit_seconds = time.perf_counter() - fit_start
        args.micro_batch_size = train_step.micro_batch_size  # what the summary reports, after any out-of-memory split
        if stopped:
            stop_run(fabric, run, args, max_steps, state, config, save_filter, saved)
    if not stopped:  # a signal from here on ends the process at once: training is over and saved
        STOPS.where = (f"after training, before final/ was complete: the last checkpoint is in {out_dir / CHECKPOINTS}; "
                       "the same command with --resume auto writes final/")
    return run


def stop_run(fabric: Fabric, run: RunState, args: TrainArgs, max_steps: int, state: dict[str, Any], config: Config,
             save_filter: Optional[dict[str, Any]], saved: Optional[tuple[int, Path]]) -> None:
    """After a stop: the last completed step's checkpoint (unless this run just wrote it), a summary marked stopped,
    and the command that continues the run. ``run.stopped`` is set after the save, so no checkpoint holds it."""
    if saved is None or saved[0] != run.step:
        with STOPS.patience():
            saved = run.step, save_resumable(fabric, args.out_dir, state, config, run.step, args.keep_last, save_filter)
    run.stopped = True
    command = resume_command(sys.argv)
    write_summary(fabric, args.out_dir, run, args, {"stopped": True, "resume_command": command})
    redo = " (its evaluation is redone on resume)" if run.evaluation_due else ""
    fabric.print(
        f"Stopped by signal {STOPS.signal_name if stop_requested() else '(on another rank)'} at step {run.step}/{max_steps}"
        f"{redo}; saved {saved[1]}; no final/ written. Continue with the same command plus --resume auto:\n  {command}",
        flush=True,
    )


def resume_command(argv: list[str]) -> str:
    """The command that started this process, with ``--resume auto`` in place of any --resume."""
    kept, skip = [], False
    for arg in argv[1:]:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            kept.append(arg)
    return shlex.join(["python", argv[0], *kept, "--resume", "auto"])


def write_summary(fabric: Fabric, out_dir: Path, run: RunState, args: TrainArgs, extra: dict[str, Any]) -> dict[str, Any]:
    peak = torch.tensor(peak_memory_bytes(fabric.device), device=fabric.device, dtype=torch.float64)
    peak_max = fabric.all_reduce(peak, reduce_op="max").item()
    peak_sum = fabric.all_reduce(peak, reduce_op="sum").item()
    summary = {
        "tokens_per_sec": run.tokens / max(run.fit_seconds, 1e-9),
        "peak_memory_bytes": int(peak_max),
        "peak_memory_bytes_all_ranks": int(peak_sum),
        "train_loss": run.last_train_loss,
        "val_loss": run.last_val_loss,
        "steps": run.step,
        "tokens": run.tokens,
        "wall_time_s": run.fit_seconds,
        "micro_batch_size": args.micro_batch_size,
        "global_batch_size": args.global_batch_size,
        "precision": fabric.precision_name,
        "devices": fabric.world_size,
        "strategy": fabric.strategy_name,
        **extra,
    }
    if fabric.global_rank == 0:  # strict JSON: a loss that is not a number (never evaluated, diverged) is null
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in summary.items()}
        atomic_write(out_dir / "summary.json", json.dumps(finite, indent=2, allow_nan=False) + "\n")
    return summary


def save_final(fabric: Fabric, model: nn.Module, config: Config, final_dir: Path, tokenizer_dir: Optional[Path]) -> None:
    """Gather the full weights (FSDP shards included) on rank 0 and write a checkpoint directory atomically."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from lit_model.checkpoint import save_checkpoint_dir

    module = getattr(model, "module", model)
    if fabric.strategy_name == "fsdp":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(module, options=options)
    else:
        state_dict = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
    if fabric.global_rank == 0:
        save_checkpoint_dir(state_dict, config, final_dir, tokenizer_dir=tokenizer_dir)
    fabric.barrier()
