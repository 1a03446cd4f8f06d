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
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_model.checkpoint import MANIFEST_NAME, verify_checkpoint_dir, write_manifest
from lit_model.config import Config
from lit_model.errors import STOPS, UsageError, UserError
from lit_model.files import atomic_open, atomic_write, disk_full_error, fsync_directory, is_disk_full
from lit_model.memory.units import format_bytes, peak_rss_bytes
from lit_model.ops import onednn_fp32_linear
from lit_model.run import Run
from lit_model.training.args import TrainArgs
from lit_model.training.loggers import open_loggers
from lit_model.training.optimizers import (
    hessian_step, lr_at, needs_create_graph, paused_in_backward, set_group_values, set_lr, steps_in_backward,
)
from lit_model.training.recovery import (
    StepOutOfMemory, any_rank, catch_out_of_memory, count_targets, out_of_memory_report, raise_if_any_rank_failed,
    simulated_memory_cap, split_batches, start_memory_history,
)

CHECKPOINTS = "checkpoints"
STATE_NAME = "state.pt"
LINEAGE_NAME = "lineage.json"
DATA_ORDER_NAME = "data_order.json"
DATA_ORDER_FLAGS = ("data_path", "global_batch_size", "seed", "override_max_seq_length", "val_split_fraction", "packing")


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


class Progress:
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


def batch_loss(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The model's mean loss on ``(input_ids, targets)``, or on packed samples ``(input_ids, targets, positions)``."""
    input_ids, targets, *positions = batch
    return model(input_ids, targets=targets, positions=positions[0] if positions else None)


# ---- evaluation ----------------------------------------------------------------------------------
def evaluate(fabric: Fabric, model: nn.Module, batches: list[Any]) -> Optional[float]:
    """Mean loss over the same number of batches on every rank (no rank waits for another), or None when a stop
    request cut it short. Before each batch the ranks agree on stopping (one 4-byte all-reduce with several
    processes: evaluation is not the hot path, and under FSDP a rank cannot skip a forward alone)."""
    sums = evaluation_sums(fabric, model, batches)
    return None if sums is None else (sums[0] / sums[1].clamp(min=1)).item()


@torch.no_grad()
def evaluation_sums(fabric: Fabric, model: nn.Module, batches: list[Any]) -> Optional[torch.Tensor]:
    """The summed token loss and the token count over ``batches`` on all ranks (None: a stop cut it short)."""
    model.eval()
    total = torch.zeros(2, device=fabric.device)
    try:
        for batch in batches:
            if any_rank(fabric, stop_requested()):
                return None
            loss = batch_loss(model, batch)
            count = count_targets(batch[1])
            total += torch.stack([loss.float() * count, count.float()])
    finally:
        model.train()
    return fabric.all_reduce(total, reduce_op="sum")


# ---- checkpoints ---------------------------------------------------------------------------------
# A run's resumable checkpoints are one lineage: checkpoints/lineage.json lists them in the order written (rewritten
# atomically after each save), the last is the one `--resume auto` takes. A fresh run removes the previous run's,
# a resume moves aside what does not lead to the checkpoint it resumes, and pruning drops the oldest written.
def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Every step-N directory in out_dir/checkpoints, by step (whatever lineage it belongs to)."""
    found = [p for p in (out_dir / CHECKPOINTS).glob("step-*") if re.fullmatch(r"step-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def lineage(out_dir: Path) -> list[Path]:
    """The current run's checkpoints, oldest written first; by step for a directory an older version wrote."""
    path = out_dir / CHECKPOINTS / LINEAGE_NAME
    if not path.is_file():
        return checkpoint_dirs(out_dir)
    try:
        names = json.loads(path.read_text())["checkpoints"]
        if not all(isinstance(n, str) and re.fullmatch(r"step-\d+", n) for n in names):
            raise ValueError(f"unexpected entries {names!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{path} is damaged ({error}). Delete it to resume the newest step-N checkpoint by step "
                        "number, or start over with --overwrite.") from None
    return [out_dir / CHECKPOINTS / name for name in names]


def write_lineage(out_dir: Path, checkpoints: list[Path]) -> None:
    atomic_write(out_dir / CHECKPOINTS / LINEAGE_NAME, json.dumps({"checkpoints": [p.name for p in checkpoints]}) + "\n")


def data_order(args: TrainArgs) -> dict[str, Any]:
    """The flags that decide which samples each step sees: a resumed run must have the same, or it would go on
    training on other samples than the checkpoint's run without a word."""
    order = {name: getattr(args, name) for name in DATA_ORDER_FLAGS if hasattr(args, name)}
    if order.get("data_path") is not None:
        order["data_path"] = str(Path(order["data_path"]).resolve())
    return order


def write_state(fabric: Fabric, directory: Path, state: dict[str, Any], config: Config, filter: Optional[dict[str, Any]] = None,
                order: Optional[dict[str, Any]] = None) -> None:
    """The model config, the data order and the resumable state into a fresh ``directory`` (every rank takes
    part), then its manifest; a failure removes the directory."""
    try:
        if fabric.global_rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            config.save(directory)
            if order is not None:
                atomic_write(directory / DATA_ORDER_NAME, json.dumps(order, indent=1) + "\n")
        fabric.barrier()
        fabric.save(directory / STATE_NAME, state, filter=filter)
        fabric.barrier()
        if fabric.global_rank == 0:
            write_manifest(directory)
    except BaseException as error:
        if fabric.global_rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        if is_disk_full(error):
            raise disk_full_error(directory.parent, "the resumable checkpoint") from None
        raise


def save_resumable(fabric: Fabric, args: TrainArgs, state: dict[str, Any], config: Config, step: int,
                   filter: Optional[dict[str, Any]] = None) -> Path:
    """Write into a temporary directory inside out_dir and rename it in, then add it to the lineage, so a crash
    mid-save leaves the last good one. The model config and the data order go beside the state so a resume can
    check them before loading anything large. ``filter`` (Fabric's ``save(filter=...)``) keeps part of a state,
    e.g. only the trainable parameters. ``--keep_last`` prunes the oldest written."""
    out_dir = args.out_dir
    final = out_dir / CHECKPOINTS / f"step-{step:08d}"
    tmp = final.with_name(f".{final.name}.tmp")
    write_state(fabric, tmp, state, config, filter, data_order(args))
    if fabric.global_rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # only a save killed before its lineage update leaves one
        os.replace(tmp, final)
        fsync_directory(final.parent)
        written = [p for p in lineage(out_dir) if p != final] + [final]
        kept = written[-args.keep_last:] if args.keep_last > 0 else written
        write_lineage(out_dir, kept)
        for old in written[: len(written) - len(kept)]:
            shutil.rmtree(old, ignore_errors=True)
    fabric.barrier()
    return final


def check_resumable_state(path: Path) -> None:
    """A resumable checkpoint is there and matches its manifest. A sharded (FSDP) state's DCP metadata is a
    pickle: without a manifest to prove it is the one written with it, it is not loaded."""
    if not path.is_dir():
        raise UserError(f"{path} is missing.")
    if not (path / STATE_NAME).exists():
        raise UserError(f"{path} holds no {STATE_NAME}: it is not a resumable checkpoint (final/ is not; "
                        f"resume from {path.parent / CHECKPOINTS} or with --resume auto).")
    if not verify_checkpoint_dir(path) and (path / STATE_NAME).is_dir():
        raise UserError(f"{path} is a sharded checkpoint without {MANIFEST_NAME} (written by an older version or by "
                        "hand): its metadata is a pickle that cannot be verified, so it is not loaded. Start over with "
                        "--overwrite or another --out_dir.")


def choose_resume(out_dir: Path, resume: Optional[Union[str, Path]]) -> Optional[Path]:
    """The checkpoint ``--resume`` asks for, verified. ``auto``: the newest good one of the lineage, each
    damaged or missing newer one named in a warning (None: nothing to resume)."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_NAME).exists():
            raise UsageError(f"--resume {path}: no checkpoint there (expected {path / STATE_NAME}). Use --resume auto.")
        check_resumable_state(path)
        return path
    candidates = lineage(out_dir)
    for path in reversed(candidates):
        try:
            check_resumable_state(path)
            return path
        except UserError as error:
            print(f"Warning: --resume auto skips {path.name}: {error}", file=sys.stderr, flush=True)
    if candidates:
        raise UserError(f"--resume auto: none of the checkpoints in {out_dir / CHECKPOINTS} is usable (see the warnings "
                        "above). Start over with --overwrite, or resume a copy you trust with --resume PATH.")
    return None


def check_resume_matches(path: Path, config: Config, args: TrainArgs) -> None:
    """The checkpoint belongs to a run of this model on this data order."""
    if Config.from_checkpoint(path) != config:
        raise UsageError(
            f"Checkpoint {path} was written for another model config; resuming it into this one would mix two "
            "runs. Use the same --model_name/--model_config, or start over with --overwrite or a new --out_dir."
        )
    saved_path = path / DATA_ORDER_NAME
    if not saved_path.is_file():  # an older version's checkpoint
        return
    try:
        saved = json.loads(saved_path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{saved_path} is damaged ({error}); resume another checkpoint.") from None
    ours = data_order(args)
    differ = [f"--{k} {ours.get(k)} (the checkpoint's run: {saved.get(k)})" for k in sorted(set(ours) | set(saved))
              if ours.get(k) != saved.get(k)]
    if differ:
        raise UsageError(
            f"--resume {path}: {'; '.join(differ)}. These decide which samples each step sees, so the resumed run "
            "would train on other data than the run it continues. Resume with that run's values, or start over with "
            "--overwrite or another --out_dir."
        )


def start_lineage(args: TrainArgs, config: Config, check: Optional[Callable[[Path], None]] = None) -> Optional[Path]:
    """On rank 0 before training: the checkpoint to resume (None: a fresh run), checked against this run
    (``check`` adds a caller's check), and out_dir/checkpoints made its lineage. A fresh run removes the previous
    run's checkpoints (check_out_dir let it only with --overwrite); a resume moves every checkpoint that does
    not lead to the one it resumes (a branch abandoned by an explicit --resume, damaged ones) into
    checkpoints/abandoned-<time>/. Each says which."""
    out_dir, directory = args.out_dir, args.out_dir / CHECKPOINTS
    for stale in directory.glob(".*.tmp"):  # what a save killed midway left; never a checkpoint
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    path = choose_resume(out_dir, args.resume)
    if path is None:
        if args.resume is not None:
            print(f"--resume {args.resume}: no checkpoint in {out_dir} yet, starting fresh.", flush=True)
        old = checkpoint_dirs(out_dir)
        if args.overwrite and directory.is_dir() and any(directory.iterdir()):
            shutil.rmtree(directory)
            if old:
                print(f"--overwrite: removed the previous run's checkpoints in {directory} ({', '.join(p.name for p in old)}).",
                      flush=True)
        (directory / LINEAGE_NAME).unlink(missing_ok=True)  # a previous run's, whose checkpoints are gone
        return None
    check_resume_matches(path, config, args)
    if check is not None:
        check(path)
    inside = path.resolve().parent == directory.resolve()
    written = lineage(out_dir)
    names = [p.name for p in written]
    kept = written[: names.index(path.name) + 1] if inside and path.name in names else ([directory / path.name] if inside else [])
    kept = [p for p in kept if p.is_dir()]
    aside = [p for p in checkpoint_dirs(out_dir) if p not in kept]
    if aside:
        target = Path(tempfile.mkdtemp(prefix=time.strftime("abandoned-%Y%m%d-%H%M%S-"), dir=directory))
        for old in aside:
            os.replace(old, target / old.name)
        print(f"Resuming {path}: moved the checkpoints that do not lead to it ({', '.join(p.name for p in aside)}) to {target}.",
              flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    write_lineage(out_dir, kept)
    return path


def check_out_dir(out_dir: Path, args: TrainArgs) -> None:
    """Refuse to mix two runs in one directory unless asked to resume or overwrite. Each script calls it before
    any process starts (Fabric's other ranks re-run it before they join, so rank 0 has written nothing yet); the
    directory is created only when training starts writing, so bad inputs found before that leave nothing."""
    holds_run = any((out_dir / name).exists() for name in ("metrics.csv", "summary.json", "final")) or bool(checkpoint_dirs(out_dir))
    if holds_run and args.resume is None and not args.overwrite:
        raise UsageError(
            f"{out_dir} already holds a run. Continue it with --resume auto, start over with --overwrite, or "
            "pick another --out_dir."
        )


# ---- logging -------------------------------------------------------------------------------------
class MetricsWriter:
    COLUMNS = ["step", "tokens", "train_loss", "val_loss", "learning_rate", "tokens_per_sec", "peak_memory_bytes"]

    def __init__(self, path: Path, enabled: bool, resume_step: int) -> None:
        self.path, self.enabled = path, enabled
        if not enabled:
            return
        rows = []
        if resume_step > 0 and path.exists():  # drop rows logged after the checkpoint we resume from
            with open(path, newline="") as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with atomic_open(path, "w", newline="") as f:  # a kill mid-rewrite keeps the old history
            writer = csv.DictWriter(f, self.COLUMNS)
            writer.writeheader()
            writer.writerows(rows)

    def write(self, row: dict[str, Any]) -> None:
        if self.enabled:
            with open(self.path, "a", newline="") as f:
                csv.DictWriter(f, self.COLUMNS).writerow({k: row.get(k, "") for k in self.COLUMNS})


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


# ---- the training step ---------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # Fabric's wrapper (--compile compiles the blocks in place)


class TrainStep:
    """One optimizer step's forward and backward passes over the step's samples, in micro batches. When the
    device runs out of memory (every rank learns it, see recovery.py), the step's memory is freed and the same
    samples are redone in micro batches half as large; the smaller size is kept for the rest of the run.
    The loss is the mean over every target token of the step on all ranks, so the gradients do not depend on
    how the samples are split (up to float summation order)."""

    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: Any, micro_batch_size: int, recover: bool,
                 report: Callable[[int, str, str], str]) -> None:
        self.fabric, self.model, self.optimizer = fabric, model, optimizer
        # An optimizer that steps in backward has stepped part of the parameters when backward runs out of memory:
        # the step cannot be redone in smaller micro batches (nor could they be accumulated)
        recover = recover and not steps_in_backward(optimizer)
        self.micro_batch_size, self.recover, self.report = micro_batch_size, recover, report
        self.create_graph = needs_create_graph(optimizer)
        unwrap(model).loss_differentiable_twice = self.create_graph
        # The first micro batch of a step from which a rank asked to stop may skip the rest alone (then waits for
        # the others at the step's agreement point): any on one process; under DDP any but the first, whose forward
        # may broadcast buffers or rebuild gradient buckets (the later no-sync forwards and backwards, and the last
        # forward, start no collective); under FSDP none, since every forward gathers parameters from all ranks.
        alone = fabric.world_size == 1 or isinstance(fabric.strategy, DDPStrategy)
        self.first_skippable = (0 if fabric.world_size == 1 else 1) if alone else None
        # FSDP reduce-scatters every micro batch's gradients into the shards, as torchtune's distributed recipes
        # do: skipping it until the last one would keep every gradient unsharded in between (a Llama-2-7B on 8
        # GPUs: 13.5 GB a rank instead of 1.7). DDP's buckets are full-size either way: it syncs once a step.
        self.syncs_every_micro_batch = isinstance(unwrap(model), FSDPModule)

    @contextlib.contextmanager
    def twice_differentiable(self) -> Iterator[None]:
        """Around forward and backward of Hessian-based optimizers, which differentiate twice: the math attention
        kernel (the fused ones have no double backward), and without torch's warning that backward with
        create_graph=True makes a reference cycle between a parameter and its gradient: ``update`` breaks it
        every step (``zero_grad(set_to_none=True)``), so the warning would only alarm the user."""
        if not self.create_graph:
            yield
            return
        with sdpa_kernel([SDPBackend.MATH]), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Using backward\(\) with create_graph=True", category=UserWarning)
            yield

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

    def accumulate(self, batches: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward and backward over ``batches``; returns this rank's summed token loss and its token count.
        The ranks agree on out-of-memory and stop requests before each backward that syncs gradients (DDP: the last
        micro batch's all-reduce, the accumulation micro batches start no collective, so a rank that fails there, or
        is asked to stop where it may skip alone, goes there early and waits; FSDP: every micro batch's
        reduce-scatter), and on out-of-memory again after it. So a stop costs no collective of its own: between
        micro batches it is a local check."""
        fabric = self.fabric
        chunks = split_batches(batches, self.micro_batch_size)
        counts = [count_targets(chunk[1]) for chunk in chunks]
        local_tokens = sum(counts)
        all_tokens = fabric.all_reduce(local_tokens.float(), reduce_op="sum") if fabric.world_size > 1 else local_tokens.float()
        scale = fabric.world_size / all_tokens.clamp(min=1)  # the ranks average their gradients
        loss_sum = torch.zeros((), device=fabric.device)
        failures: list[str] = []
        last = len(chunks) - 1
        for index, (chunk, count) in enumerate(zip(chunks, counts)):
            sync = index == last or self.syncs_every_micro_batch
            if self.first_skippable is not None and index >= self.first_skippable and stop_requested():
                self.agree(failures)  # raises StepStopped on every rank
            with fabric.no_backward_sync(self.model, enabled=not sync), self.twice_differentiable():
                with catch_out_of_memory(failures), simulated_memory_cap(self.model, self.optimizer):
                    loss = batch_loss(self.model, chunk) * count
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

    def update(self, grad_clip: float) -> None:
        """The optimizer step after ``__call__``: gradients clipped to ``grad_clip`` (0: not clipped), stepped, freed."""
        if grad_clip > 0:
            self.fabric.clip_gradients(self.model, self.optimizer, max_norm=grad_clip, error_if_nonfinite=False)
        if self.create_graph:
            hessian_step(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self, batches: list[tuple[torch.Tensor, ...]], where: str) -> tuple[torch.Tensor, torch.Tensor]:
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
    evaluate(fabric, model, [max(val_batches, key=lambda b: b[0].numel())])
    tmp = out_dir / CHECKPOINTS / ".rehearsal.tmp"
    write_state(fabric, tmp, state, config, save_filter)
    if fabric.global_rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    if fresh:
        inner.load_state_dict(saved)
    fabric.print(
        f"Rehearsal passed in {time.perf_counter() - start:.1f} s: a step on the longest batch "
        f"({batch[0].shape[0]} x {batch[0].shape[1]} tokens), the largest evaluation batch and a checkpoint save; "
        f"peak memory so far {format_bytes(peak_memory_bytes(fabric.device))}.", flush=True,
    )


# ---- the loop ------------------------------------------------------------------------------------
def fit(
    fabric: Fabric,
    run: Run,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    train_batches: Iterator[Any],
    val_batches: list[Any],
    args: TrainArgs,
    max_steps: int,
    progress: Progress,
    save_filter: Optional[dict[str, Any]] = None,
    rehearsal_batch: Optional[tuple[torch.Tensor, ...]] = None,
) -> tuple[Progress, Run]:
    """Train ``run`` until ``max_steps`` optimizer steps; evaluate, log, checkpoint and honour stop signals.
    ``save_filter`` selects what the resumable checkpoints hold (see ``save_resumable``). With ``--rehearse``,
    ``rehearsal_batch`` (a micro batch of the longest samples) is rehearsed first. Returns the progress and the
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
        return out_of_memory_report(run.replace(micro_batch_size=micro_batch_size), args, fabric.device, where, message)

    train_step = TrainStep(fabric, model, optimizer, run.micro_batch_size, args.oom_recovery, report)
    # The data position is progress.step: the sampler is a pure function of the step, so it needs no state.
    state = {"model": model, "optimizer": optimizer, "run": progress}
    if args.rehearse and rehearsal_batch is not None:
        rehearse(fabric, train_step, rehearsal_batch, val_batches, state, config, out_dir, save_filter, progress.step == 0)
    metrics = MetricsWriter(out_dir / "metrics.csv", fabric.global_rank == 0, progress.step)
    window_start, window_tokens = time.perf_counter(), 0
    fit_start = time.perf_counter() - progress.fit_seconds
    steps_at_start = progress.step
    saved: Optional[tuple[int, Path]] = None  # the step and path of the checkpoint this run wrote last
    stopped = False
    # The rate step progress.step ran with: what the row of an evaluation redone on resume reports.
    lr = lr_at(max(progress.step - 1, 0), args.learning_rate, args.warmup_steps, max_steps, args.min_lr)
    model.train()
    with STOPS.deferred(), open_loggers(args, fabric.global_rank == 0, progress.step) as log_row:
        while progress.step < max_steps or progress.evaluation_due:
            if not progress.evaluation_due:  # else: resumed from a stop during this step's evaluation
                torch.manual_seed(args.seed + 1_000_003 * progress.step + 7919 * fabric.global_rank)
                lr = lr_at(progress.step, args.learning_rate, args.warmup_steps, max_steps, args.min_lr)
                set_lr(optimizer, lr)
                try:
                    step_loss, step_tokens = train_step([next(train_batches) for _ in range(run.accumulation)],
                                                        f"at step {progress.step + 1}")
                except StepStopped:  # nothing of this step was applied
                    optimizer.zero_grad(set_to_none=True)
                    stopped = True
                    break
                train_step.update(run.grad_clip)
                progress.step += 1

                reduced = fabric.all_reduce(torch.stack([step_loss.float(), step_tokens.float()]), reduce_op="sum")
                progress.last_train_loss = reduced[0].item() / max(reduced[1].item(), 1)
                progress.tokens += int(reduced[1].item())
                window_tokens += int(reduced[1].item())
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
                val_loss = evaluate(fabric, model, val_batches)
                progress.evaluation_due = val_loss is None
                if progress.evaluation_due:
                    stopped = True
                    break
                progress.last_val_loss = val_loss
                row["val_loss"] = f"{progress.last_val_loss:.4f}"
            if progress.step % args.log_interval == 0 or is_last or "val_loss" in row:
                now = time.perf_counter()
                progress.fit_seconds = now - fit_start
                tokens_per_sec = window_tokens / max(now - window_start, 1e-9)
                peak = fabric.all_reduce(torch.tensor(peak_memory_bytes(fabric.device), device=fabric.device), reduce_op="max")
                row.update(
                    step=progress.step, tokens=progress.tokens, train_loss=f"{progress.last_train_loss:.4f}", learning_rate=f"{lr:.3e}",
                    tokens_per_sec=f"{tokens_per_sec:.0f}", peak_memory_bytes=int(peak.item()),
                )
                metrics.write(row)
                log_row(row)
                done = progress.step - steps_at_start
                eta = (max_steps - progress.step) * progress.fit_seconds / max(done, 1) if done else 0
                val = f" | val {progress.last_val_loss:.4f}" if "val_loss" in row else ""
                fabric.print(
                    f"step {progress.step}/{max_steps} | loss {progress.last_train_loss:.4f}{val} | {tokens_per_sec:,.0f} tok/s | "
                    f"peak {format_bytes(peak.item())} | ETA {format_duration(eta)}",
                    flush=True,
                )
                window_start, window_tokens = now, 0
            stopped = any_rank(fabric, stop_requested())
            if (args.save_interval and progress.step % args.save_interval == 0) or is_last or stopped:
                progress.fit_seconds = time.perf_counter() - fit_start
                with STOPS.patience():  # the other ranks wait while rank 0 writes: let the save finish
                    saved = progress.step, save_resumable(fabric, args, state, config, progress.step, save_filter)
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
            saved = progress.step, save_resumable(fabric, args, state, run.config, progress.step, save_filter)
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
        "strategy": run.strategy,
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

    from lit_model.checkpoint import save_checkpoint_dir

    module = getattr(model, "module", model)
    if isinstance(fabric.strategy, ModelParallelStrategy):  # FSDP
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state_dict = get_model_state_dict(module, options=options)
    else:
        state_dict = {k: v.detach().to("cpu") for k, v in module.state_dict().items()}
    if fabric.global_rank == 0:
        save_checkpoint_dir(state_dict, config, final_dir, tokenizer_dir=tokenizer_dir, overwrite=True, write_extra=write_extra)
    fabric.barrier()
