"""What the training recipes share: starting a run or printing its plan (``--plan``), the ``auto`` choices of the
micro batch and the loss chunk, and the sample at the end of a run (skipped when the planner says it would not
fit): the planner's uses, which training itself does not import."""

from __future__ import annotations

import contextlib
import gc
import sys
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.fabric import Fabric

from lit_model.core.config import Config
from lit_model.core.errors import UserError
from lit_model.core.units import detect_device_memory, format_bytes, parse_memory
from lit_model.infer.engine import Generator, Sampling
from lit_model.infer.load import Precision
from lit_model.methods.load import load_gpt
from lit_model.plan.generation import plan_generation
from lit_model.plan.plot import plot_plan
from lit_model.plan.report import check_plan_fits
from lit_model.plan.search import max_loss_chunk_size, max_micro_batch_size
from lit_model.plan.training import plan_run
from lit_model.run import Run
from lit_model.train import session
from lit_model.train.args import TrainArgs
from lit_model.train.fabric import launch, setup_fabric
from lit_model.train.resumable import check_out_dir, holds_out_dir_lock, out_dir_lock
from lit_model.train.step import release_cached_memory


def plan_or_train(run: Run, args: TrainArgs, train: Callable[[Fabric, Run, Any], None]) -> None:
    """What every training recipe does with its resolved run: ``--plan`` prints the plan; otherwise the output
    directory is locked (by the first process) and checked, the processes start and each runs
    ``train(fabric, run, args)``."""
    if args.plan is not None:
        return print_plan(run, args)
    # the lock first: a second run on this out_dir must not pass the check while the first has written nothing yet
    with out_dir_lock(args.out_dir) if holds_out_dir_lock() else contextlib.nullcontext():
        check_out_dir(args.out_dir, args)
        fabric = setup_fabric(run)
        launch(fabric, run, train, run, args)
    session.finish(fabric)


def print_plan(run: Run, args: TrainArgs) -> None:
    """``--plan``: the predicted peak memory of this exact run, without starting Fabric or loading weights;
    ``--plan_plot`` also draws it. Exit status 1 when it does not fit and no suggestion makes it fit."""
    plan = plan_run(run, args.device_memory)
    print(plan.to_json() if args.plan == "json" else plan.to_text())
    if args.plan_plot is not None:
        print(f"Plot: {plot_plan(plan, args.plan_plot)}", file=sys.stderr)
    check_plan_fits(plan)


def memory_budget(fabric: Fabric, run: Run, args: TrainArgs) -> int:
    """The memory one process of this run may plan with: --device_memory, else this device's (on the CPU, a share)."""
    if args.device_memory:
        return parse_memory(args.device_memory)
    budget = detect_device_memory(run.device_type, fabric.device.index or 0)
    return budget // run.devices if run.device_type == "cpu" else budget  # the processes on one machine share it


def choose_loss_chunk_size(fabric: Fabric, run: Run, args: TrainArgs) -> Run:
    """``--loss_chunk_size auto``: the run with the largest loss chunk whose logits fit what the rest of the step
    leaves (plan.planner.max_loss_chunk_size); every rank takes the smallest any rank found."""
    if not run.loss_chunk_auto:
        return run
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


def sample_text(fabric: Fabric, final_dir: Path, tokenizer: Any, prompt: str, max_new_tokens: int = 60) -> str:
    """A short sample from the saved model, on rank 0 (a separate CPU copy, so FSDP shards don't matter); a note
    instead when the planner says the copy would not fit the memory free now (the run is saved: no OOM at the end)."""
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
    model = load_gpt(final_dir, device="cpu", dtype=torch.float32)
    fp32 = Precision("32-true", torch.float32, autocast=None)
    result = Generator(model, fp32, Sampling(temperature=0.8, top_k=50, seed=0)).generate(
        prompt_ids, new_tokens, eos_ids=tokenizer.eos_ids)
    return tokenizer.decode(result.tokens[0])
