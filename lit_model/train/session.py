"""Setup steps every training script runs in the same order: Fabric, model placement, optimizer, data
loaders, resume, and a clean end of the processes."""

from __future__ import annotations

import gc
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
from lit_model.model.gpt import GPT
from lit_model.train.args import TrainArgs
from lit_model.run import Run
from lit_model.train.fabric import configure_model
from lit_model.train.loop import Progress
from lit_model.train.resumable import STATE_NAME, start_lineage
from lit_model.train.step import freeze_layers, release_cached_memory
from lit_model.train.optimizers import build_optimizer


def print_plan(run: Run, args: TrainArgs) -> None:
    """``--plan``: the predicted peak memory of this exact run, without starting Fabric or loading weights;
    ``--plan_plot`` also draws it. Exit status 1 when it does not fit and no suggestion makes it fit."""
    from lit_model.plan import check_plan_fits, plan_run, plot_plan

    plan = plan_run(run, args.device_memory)
    print(plan.to_json() if args.plan == "json" else plan.to_text())
    if args.plan_plot is not None:
        print(f"Plot: {plot_plan(plan, args.plan_plot)}", file=sys.stderr)
    check_plan_fits(plan)


def memory_budget(fabric: Fabric, run: Run, args: TrainArgs) -> int:
    """The memory one process of this run may plan with: --device_memory, else this device's (on the CPU, a share)."""
    from lit_model.plan import detect_device_memory, parse_memory

    if args.device_memory:
        return parse_memory(args.device_memory)
    budget = detect_device_memory(run.device_type, fabric.device.index or 0)
    return budget // run.devices if run.device_type == "cpu" else budget  # the processes on one machine share it


def choose_loss_chunk_size(fabric: Fabric, run: Run, args: TrainArgs) -> Run:
    """``--loss_chunk_size auto``: the run with the largest loss chunk whose logits fit what the rest of the step
    leaves (memory.plan.max_loss_chunk_size); every rank takes the smallest any rank found."""
    if not run.loss_chunk_auto:
        return run
    from lit_model.plan import max_loss_chunk_size

    found = max_loss_chunk_size(run, memory_budget(fabric, run, args))
    if run.world_size > 1:
        found = int(fabric.all_reduce(torch.tensor(found, device=fabric.device), reduce_op="min").item())
    fabric.print(f"--loss_chunk_size auto: {found} tokens per cross-entropy chunk")
    return run.replace(loss_chunk_size=found, loss_chunk_auto=False)


def choose_micro_batch_size(fabric: Fabric, run: Run, args: TrainArgs) -> Run:
    """``--micro_batch_size auto``: the run with the largest micro batch that divides the per-rank batch and whose
    predicted peak fits this device with a 10 % margin, so gradient accumulation keeps the global batch. Every
    rank takes the smallest any rank found; the rehearsal then confirms it with a real step on the longest batch."""
    if not run.micro_batch_auto:
        return run
    from lit_model.plan import format_bytes, max_micro_batch_size

    budget = memory_budget(fabric, run, args)
    fabric.print(f"--micro_batch_size auto: planning micro batches for {format_bytes(budget)} per process...", flush=True)
    found = max_micro_batch_size(run, budget)
    found = int(fabric.all_reduce(torch.tensor(found, device=fabric.device), reduce_op="min").item()) if run.world_size > 1 else found
    if found == 0:
        raise UserError(
            f"--micro_batch_size auto: not even a micro batch of 1 is predicted to fit in {format_bytes(budget)} per "
            "process. Run the same command with --plan text to see what takes the memory and which flag changes "
            "make it fit."
        )
    fabric.print(f"--micro_batch_size auto: {found} (the largest predicted to fit {format_bytes(budget)} with a 10 % margin; "
                 f"global batch {run.global_batch_size})")
    return run.replace(micro_batch_size=found, micro_batch_auto=False)


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
    configure_model(model, run)
    if run.compile:
        # Block by block, in place (regional compilation, as torchtune and torchtitan do): every block compiles to the
        # same code once, and the fused loss stays eager. Compiling the whole model made inductor keep every loss
        # chunk's logits gradient at once (pythia-160m 8 x 1,024 on a GPU: +0.83 GB over eager; blocks: eager's).
        for block in model.blocks:
            block.compile()
    model = fabric.setup(model)
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


def resume_if_asked(
    fabric: Fabric, args: TrainArgs, model: nn.Module, optimizer: Any, progress: Progress, config: Config, strict: bool = True,
    check: Optional[Callable[[Path], None]] = None,
) -> None:
    """Resume the checkpoint ``--resume`` names (verified, and checked against this run's config, data order and
    ``check``), or start a fresh lineage; rank 0 decides and every rank follows. ``strict=False``: the checkpoint
    may hold only some of the model's parameters (the trainable ones)."""
    outcome: Any = None
    if fabric.global_rank == 0:
        try:
            outcome = start_lineage(args, config, check)
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
    except (RuntimeError, ValueError, KeyError, EOFError, OSError, pickle.UnpicklingError) as error:
        # A checkpoint without a manifest (an older version's) can be damaged too: a message, not a traceback
        raise UserError(f"{path / STATE_NAME} could not be loaded ({str(error).splitlines()[0] if str(error) else repr(error)}): "
                        "it is damaged, or its run differs from this one. Resume another checkpoint with --resume PATH, "
                        "or start over with --overwrite or another --out_dir.") from None
    if state["run"] is not progress:  # a sharded (FSDP) checkpoint hands the progress back instead of restoring it
        progress.load_state_dict(state["run"])
    fabric.print(f"Resumed from {path} at step {progress.step} ({progress.tokens:,} tokens).")


def train_batches(
    fabric: Fabric, dataset: Dataset, run: Run, args: TrainArgs, start_step: int,
    collate_fn: Optional[Callable] = None, lengths: Optional[Sequence[int]] = None,
) -> Iterator[Any]:
    """An endless iterator of this rank's micro batches, starting at optimizer step ``start_step``.
    With ``lengths`` (samples of different lengths) each step's samples are grouped by length."""
    from lit_model.data.instruct import LengthGroupedSampler
    from lit_model.data.text import GlobalBatchSampler

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


def sample_text(fabric: Fabric, final_dir: Path, tokenizer: Any, prompt: str, max_new_tokens: int = 60) -> str:
    """A short sample from the saved model, on rank 0 (a separate CPU copy, so FSDP shards don't matter); a note
    instead when the planner says the copy would not fit the memory free now (the run is saved: no OOM at the end)."""
    from lit_model.infer.generation import generate
    from lit_model.plan import detect_device_memory, format_bytes, plan_generation

    if fabric.global_rank != 0:
        return ""
    config = Config.from_checkpoint(final_dir)
    prompt_ids = tokenizer.encode(prompt)[-(config.block_size // 2) :]
    new_tokens = min(max_new_tokens, config.block_size - len(prompt_ids))
    need = plan_generation(config, len(prompt_ids), new_tokens, dtype=torch.float32, device_type="cpu",
                           detect=False).tensor_peak_bytes
    # The scripts have dropped the trained model and its optimizer (their reference cycles go with gc.collect), and
    # glibc keeps the heap the run freed (activations, a LoRA merge's copy of the base weights): give it back
    # first, or the fp32 copy comes on top of it (measured: +2.2 GB for a 1.1B QLoRA run)
    gc.collect()
    release_cached_memory(torch.device("cpu"))
    free = detect_device_memory("cpu")
    if need > free:
        return (f"[no sample: generating from {final_dir} in fp32 takes about {format_bytes(need)} and "
                f"{format_bytes(free)} is free; `python generate/base.py --checkpoint_dir {final_dir} --precision "
                "bf16-true` (or --quantize bnb.nf4) samples it in less]")
    model = GPT.from_checkpoint(final_dir, device="cpu", dtype=torch.float32)
    result = generate(
        model, prompt_ids, new_tokens, temperature=0.8, top_k=50, eos_ids=tokenizer.eos_ids,
        generator=torch.Generator().manual_seed(0),
    )
    return tokenizer.decode(result.tokens[0])
