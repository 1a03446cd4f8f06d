"""Setup steps every training script runs in the same order: model placement, optimizer, data loaders, resume,
and a clean end of the processes. What needs the planner (--plan, the auto choices, the end-of-run sample) is the
recipes' (lit_model/recipes/common.py): training imports no planner."""

from __future__ import annotations

import heapq
import os
import pickle
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from torch.utils.data import DataLoader, Dataset

from lit_model.core.config import Config
from lit_model.core.errors import UserError
from lit_model.data.instruct import LengthGroupedSampler
from lit_model.data.text import GlobalBatchSampler
from lit_model.methods.lora import adapters_disabled
from lit_model.methods.grpo import GRPO
from lit_model.methods.objective import CausalLM, Objective
from lit_model.methods.preference import Preference
from lit_model.kernels.policy import kernel_policy
from lit_model.model.gpt import GPT
from lit_model.parallel.apply import parallelize_outside_strategy
from lit_model.train.args import TrainArgs
from lit_model.run import Run
from lit_model.train.loop import Progress
from lit_model.train.resumable import STATE_NAME, start_lineage
from lit_model.train.step import freeze_layers
from lit_model.train.optimizers import build_optimizer, needs_create_graph


def finish(fabric: Fabric) -> None:
    """With several processes, end them deliberately once all output is written: letting the interpreter
    tear down gloo sometimes aborts rank 0 after a successful run."""
    if fabric.world_size > 1:
        fabric.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def setup_model_and_optimizer(fabric: Fabric, model: GPT, run: Run, args: TrainArgs) -> tuple[nn.Module, Any]:
    frozen = freeze_layers(model, run.freeze_layers)
    if frozen:
        fabric.print(f"Frozen: {frozen:,} parameters ({args.freeze_layers})")
    model.set_kernel_policy(kernel_policy(run.device_type))  # after LoRA's layers, which take it too
    model = fabric.setup(parallelize_outside_strategy(model, run.parallel, run.levers))
    optimizer = build_optimizer(
        model,
        run.optimizer,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        device_type=run.device_type,
        param_dtype=run.param_dtype,
        rank=run.optimizer_rank,
        in_backward=run.optimizer_in_backward,
    )
    return model, fabric.setup_optimizers(optimizer)


def objective(run: Run, optimizer: Any) -> Objective:
    """What the run trains: the language-model loss (its loss chunk, packed samples' positions, a loss that the
    optimizer can differentiate again where it needs to: Sophia's Hessian), or a preference loss (``run.preference``),
    whose reference is the model with its adapters off or comes in the batches."""
    if run.grpo is not None:  # GRPO on rollouts; with beta > 0 its reference is the model with its adapters off
        return GRPO(run.grpo, run.loss_chunk_size, adapters_disabled if run.grpo.reference == "adapters" else None)
    if run.preference is None:
        return CausalLM(run.loss_chunk_size, needs_create_graph(optimizer), packed=run.packing)
    spec = run.preference
    return Preference(spec.loss, spec.beta, spec.simpo_gamma, run.loss_chunk_size,
                      reference=adapters_disabled if spec.reference == "adapters" else None,
                      pack_length=run.seq_len if run.packing else None,
                      precomputed_reference=spec.reference == "precomputed")


# What torch.load raises on a damaged file (a checkpoint without a manifest, an older version's, can be damaged too)
LOAD_ERRORS = (RuntimeError, ValueError, KeyError, EOFError, OSError, pickle.UnpicklingError)


def unloadable(path: Path, error: BaseException) -> UserError:
    """The message for a resumable state that ``torch.load`` could not read: one paragraph, not a traceback."""
    return UserError(f"{path} could not be loaded ({str(error).splitlines()[0] if str(error) else repr(error)}): "
                     "it is damaged, or its run differs from this one. Resume another checkpoint with --resume PATH, "
                     "or start over with --overwrite or another --out_dir.")


def resume_if_asked(
    fabric: Fabric, args: TrainArgs, model: nn.Module, optimizer: Any, progress: Progress, config: Config, strict: bool = True,
    check: Optional[Callable[[Path], None]] = None, base: Optional[Path] = None,
) -> None:
    """Resume the checkpoint ``--resume`` names (verified, and checked against this run's config, data order, the
    checkpoint ``base`` it started from and ``check``), or start a fresh lineage; rank 0 decides and every rank
    follows. ``strict=False``: the checkpoint may hold only some of the model's parameters (the trainable ones)."""
    outcome: Any = None
    if fabric.global_rank == 0:
        try:
            outcome = start_lineage(args, config, check, base)
        except UserError as error:
            outcome = error
    outcome = fabric.broadcast(outcome)
    if isinstance(outcome, UserError):
        raise outcome
    if outcome is None:
        return
    path = Path(outcome)
    state = {"model": model, "optimizer": optimizer, "run": progress}
    # Every file was verified against its manifest, the sharded state's DCP metadata included, so nothing read here
    # is a pickle someone planted; the rest loads with weights_only=True
    try:
        fabric.load(path / STATE_NAME, state, strict=strict, weights_only=True)
    except torch.OutOfMemoryError:
        raise
    except LOAD_ERRORS as error:
        raise unloadable(path / STATE_NAME, error) from None
    if state["run"] is not progress:  # a sharded (FSDP) checkpoint hands the progress back instead of restoring it
        progress.load_state_dict(state["run"])
    fabric.print(f"Resumed from {path} at step {progress.step} ({progress.tokens:,} tokens).")


def train_batches(
    fabric: Fabric, dataset: Dataset, run: Run, args: TrainArgs, start_step: int,
    collate_fn: Optional[Callable] = None, lengths: Optional[Sequence[int]] = None,
) -> Iterator[Any]:
    """An endless iterator of this rank's micro batches, starting at optimizer step ``start_step``.
    With ``lengths`` (samples of different lengths) each step's samples are grouped by length."""
    settings = (run.global_batch_size, run.micro_batch_size, fabric.global_rank, run.world_size)
    if lengths is None:
        sampler = GlobalBatchSampler(len(dataset), *settings, seed=args.seed, start_step=start_step)
    else:
        sampler = LengthGroupedSampler(lengths, *settings, seed=args.seed, start_step=start_step)
    workers = 2 if run.device_type == "cuda" else 0  # on CPU the cores are busy training
    # The loader draws its workers' base seed when iteration starts (in the first step): from its own generator,
    # not the global RNG that the loop reseeds per step for dropout, or a resumed run's dropout would differ
    loader = DataLoader(
        dataset, batch_sampler=sampler, num_workers=workers, pin_memory=fabric.device.type == "cuda",
        collate_fn=collate_fn, generator=torch.Generator().manual_seed(args.seed),
    )
    loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)
    return iter(loader)


def _collate(items: list[Any], collate_fn: Optional[Callable], device: torch.device) -> tuple[torch.Tensor, ...]:
    batch = collate_fn(items) if collate_fn is not None else [torch.stack(parts) for parts in zip(*items)]
    return tuple(part.to(device) for part in batch)


def val_batches(fabric: Fabric, dataset: Dataset, run: Run, args: TrainArgs, collate_fn: Optional[Callable] = None) -> list[Any]:
    """The same fixed evaluation windows for any world size, split evenly so every rank runs the same
    number of batches (no rank waits for another). ``collate_fn`` (default: stack) makes a batch of samples."""
    batch_size = run.eval_batch
    total = min(args.eval_iters * batch_size, len(dataset))
    per_rank = max(1, total // run.world_size)
    first = fabric.global_rank * per_rank
    indices = [(first + i) % len(dataset) for i in range(per_rank)]
    return [
        _collate([dataset[j] for j in indices[start : start + batch_size]], collate_fn, fabric.device)
        for start in range(0, per_rank, batch_size)
    ]


def longest_batch(fabric: Fabric, dataset: Dataset, run: Run, collate_fn: Optional[Callable] = None,
                  lengths: Optional[Sequence[int]] = None) -> tuple[torch.Tensor, ...]:
    """A micro batch of the longest samples (any, when all have one length): the rehearsal's worst case."""
    count = min(run.micro_batch_size, len(dataset))
    chosen = range(count) if lengths is None else heapq.nlargest(count, range(len(dataset)), key=lengths.__getitem__)
    return _collate([dataset[i] for i in chosen], collate_fn, fabric.device)
