"""The training step: forward and backward over a step's samples in micro batches (redone in smaller ones when
the device runs out of memory, see recovery.py), the optimizer update, evaluation, and freezing layers. This is the
code the planner traces on fake tensors (plan/trace.py), so it imports nothing of the planner or the fit loop.
"""

from __future__ import annotations

import contextlib
import ctypes
import fnmatch
import gc
import sys
import warnings
from typing import Any, Callable, Iterator, NamedTuple, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.distributed.fsdp import FSDPModule
from torch.nn.attention import SDPBackend, sdpa_kernel

from lit_model.core.errors import STOPS, UsageError, UserError
from lit_model.methods.objective import LossSums, Objective
from lit_model.train.optimizers import hessian_step, needs_create_graph, steps_in_backward
from lit_model.train.recovery import (
    StepOutOfMemory, any_rank, catch_out_of_memory, raise_if_any_rank_failed, simulated_memory_cap,
    split_batches,
)


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


def release_cached_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    elif sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back to the OS


class StepStopped(Exception):
    """Raised on every rank when any rank was asked to stop before the step's gradients were complete: the step is
    abandoned (nothing applied) and the run saves the last completed step."""


def stop_requested() -> bool:
    """A SIGTERM/SIGINT arrived while the fit loop defers stops (errors.STOPS), on this process."""
    return STOPS.requested is not None


# ---- evaluation ----------------------------------------------------------------------------------
def sums_vector(sums: LossSums, names: tuple[str, ...]) -> torch.Tensor:
    """[loss, count, *the metrics named]: what the ranks add up in one all-reduce."""
    return torch.stack([sums.loss.detach().float(), sums.count.float(), *(sums.metrics[n].float() for n in names)])


def means(vector: torch.Tensor, names: tuple[str, ...]) -> dict[str, float]:
    """``{"loss": ..., name: ...}``: the sums of ``sums_vector`` (added over batches and ranks) over their count."""
    values = (vector[[0, *range(2, vector.numel())]] / vector[1].clamp(min=1)).tolist()
    return dict(zip(("loss", *names), values))


def evaluate(fabric: Fabric, model: nn.Module, objective: Objective, batches: list[Any]) -> Optional[dict[str, float]]:
    """The mean loss (``"loss"``) and the objective's metrics over the same number of batches on every rank (no rank
    waits for another), or None when a stop request cut it short. Before each batch the ranks agree on stopping (one
    4-byte all-reduce with several processes: evaluation is not the hot path, and under FSDP a rank cannot skip a
    forward alone)."""
    total = evaluation_sums(fabric, model, objective, batches)
    return None if total is None else means(total, objective.metric_names)


@torch.no_grad()
def evaluation_sums(fabric: Fabric, model: nn.Module, objective: Objective, batches: list[Any]) -> Optional[torch.Tensor]:
    """The objective's ``sums_vector`` added over ``batches`` and all ranks (None: a stop cut it short)."""
    model.eval()
    total = torch.zeros(2 + len(objective.metric_names), device=fabric.device)
    try:
        for batch in batches:
            if any_rank(fabric, stop_requested()):
                return None
            total += sums_vector(objective.loss_sum(model, batch), objective.metric_names)
    finally:
        model.train()
    return fabric.all_reduce(total, reduce_op="sum")


# ---- the training step ---------------------------------------------------------------------------
def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # Fabric's wrapper (--compile compiles the blocks in place)


class StepSums(NamedTuple):
    """One rank's sums over a step's micro batches: the loss, its count, the tokens (``Objective.tokens``) and the
    objective's metrics (``LossSums.metrics``)."""

    loss: torch.Tensor
    count: torch.Tensor
    tokens: torch.Tensor
    metrics: dict[str, torch.Tensor]


class TrainStep:
    """One optimizer step's forward and backward passes over the step's samples, in micro batches. When the
    device runs out of memory (every rank learns it, see recovery.py), the step's memory is freed and the same
    samples are redone in micro batches half as large; the smaller size is kept for the rest of the run.
    The loss is the mean over every target token of the step on all ranks, so the gradients do not depend on
    how the samples are split (up to float summation order)."""

    def __init__(self, fabric: Fabric, model: nn.Module, optimizer: Any, objective: Objective, micro_batch_size: int,
                 recover: bool, report: Callable[[int, str, str], str]) -> None:
        self.fabric, self.model, self.optimizer, self.objective = fabric, model, optimizer, objective
        # An optimizer that steps in backward has stepped part of the parameters when backward runs out of memory:
        # the step cannot be redone in smaller micro batches (nor could they be accumulated)
        recover = recover and not steps_in_backward(optimizer)
        self.micro_batch_size, self.recover, self.report = micro_batch_size, recover, report
        self.create_graph = needs_create_graph(optimizer)
        if self.create_graph and not objective.differentiable_twice:
            raise ValueError("this optimizer differentiates the gradients again: hand in an objective built for it")
        # The first micro batch of a step from which a rank asked to stop may skip the rest alone (then waits for
        # the others at the step's agreement point): any on one process; under DDP any but the first, whose forward
        # may broadcast buffers or rebuild gradient buckets (the later no-sync forwards and backwards, and the last
        # forward, start no collective); under FSDP none, since every forward gathers parameters from all ranks.
        alone = fabric.world_size == 1 or not isinstance(unwrap(model), FSDPModule)  # one process or DDP
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

    def accumulate(self, batches: list[tuple[torch.Tensor, ...]]) -> StepSums:
        """Forward and backward over ``batches``; returns this rank's summed loss, its count (the objective's: target
        tokens for a language model, pairs for a preference loss), its tokens and its metrics' sums.
        The ranks agree on out-of-memory and stop requests before each backward that syncs gradients (DDP: the last
        micro batch's all-reduce, the accumulation micro batches start no collective, so a rank that fails there, or
        is asked to stop where it may skip alone, goes there early and waits; FSDP: every micro batch's
        reduce-scatter), and on out-of-memory again after it. So a stop costs no collective of its own: between
        micro batches it is a local check."""
        fabric = self.fabric
        chunks = split_batches(batches, self.micro_batch_size)
        counts = [self.objective.count(chunk) for chunk in chunks]
        local_count = sum(counts)
        all_count = fabric.all_reduce(local_count.float(), reduce_op="sum") if fabric.world_size > 1 else local_count.float()
        scale = fabric.world_size / all_count.clamp(min=1)  # the ranks average their gradients
        loss_sum = torch.zeros((), device=fabric.device)
        metrics = {name: torch.zeros((), device=fabric.device) for name in self.objective.metric_names}
        failures: list[str] = []
        last = len(chunks) - 1
        for index, chunk in enumerate(chunks):
            sync = index == last or self.syncs_every_micro_batch
            if self.first_skippable is not None and index >= self.first_skippable and stop_requested():
                self.agree(failures)  # raises StepStopped on every rank
            with fabric.no_backward_sync(self.model, enabled=not sync), self.twice_differentiable():
                with catch_out_of_memory(failures), simulated_memory_cap(self.model, self.optimizer):
                    loss, _, chunk_metrics = self.objective.loss_sum(self.model, chunk)
                    if not sync:
                        fabric.backward(loss * scale, create_graph=self.create_graph)
                if failures or sync:
                    self.agree(failures)
                if sync:
                    with catch_out_of_memory(failures):
                        fabric.backward(loss * scale, create_graph=self.create_graph)
                    raise_if_any_rank_failed(fabric, failures)
            loss_sum += loss.detach()
            for name in metrics:
                metrics[name] += chunk_metrics[name]
        return StepSums(loss_sum, local_count, sum(self.objective.tokens(chunk) for chunk in chunks), metrics)

    def update(self, grad_clip: float) -> None:
        """The optimizer step after ``__call__``: gradients clipped to ``grad_clip`` (0: not clipped), stepped, freed."""
        if grad_clip > 0:
            self.fabric.clip_gradients(self.model, self.optimizer, max_norm=grad_clip, error_if_nonfinite=False)
        if self.create_graph:
            hessian_step(self.optimizer)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self, batches: list[tuple[torch.Tensor, ...]], where: str) -> StepSums:
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
