"""The flags every training script shares (../shared/cli.md), as one dataclass each script extends.

``lit_model.recipes.cli.parse`` turns a dataclass into flat flags (``--micro_batch_size``, not
``--train.micro_batch_size``) that also load from ``--config file.yaml``.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from lit_model.data.sources import check_data_flags
from lit_model.core.errors import UsageError
from lit_model.core.files import check_out_dir_path
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.core.units import parse_memory
from lit_model.run import DEFAULT_OPTIMIZER_RANK, canonical_name, steps_in_backward
from lit_model.train.fabric import DistributedSettings
from lit_model.train.loggers import check_logger_servers, check_loggers
from lit_model.train.optimizers import check_optimizer, check_steps_in_backward

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"]


@dataclass
class TrainArgs(DistributedSettings):
    """Flags shared by pretrain/ and finetune/.

    Args:
        out_dir: where checkpoints, logs, metrics.csv and summary.json go
        data_path: training data (file or directory); omitted: the built-in default that needs no download
        precision: Fabric precision; default: the cheapest one the device runs correctly
        devices: processes per node (GPUs, or CPU processes with gloo)
        num_nodes: number of machines
        strategy: auto (single device / DDP / FSDP when offloading), ddp or fsdp
        sharding_strategy: FSDP sharding: FULL_SHARD, SHARD_GRAD_OP (no re-gather in backward) or HYBRID_SHARD
        cpu_offload: keep parameters, gradients and optimizer state in CPU memory (through FSDP)
        activation_checkpointing: recompute block activations in backward (one device, DDP and FSDP): true (all of
            them), selective (keep the matmul and attention outputs, recompute the element-wise ops) or false
        activation_checkpointing_interval: with activation_checkpointing, recompute every k-th block only
        activation_offloading: move the blocks' saved activations out of device memory until backward: cpu (pinned
            host memory; GPU runs) or disk (files in offload_dir); with activation_checkpointing only the
            checkpointed blocks' inputs move
        offload_dir: with --activation_offloading disk: where the files go (default: OUT_DIR/activations)
        mlp_tiles: compute each MLP in this many slices of the sequence, each recomputed in backward, so only one
            slice's intermediate activations exist at a time (long context; 1: off)
        forward_prefetch: FSDP: gather the next block's parameters during the current block's forward
        backward_prefetch: FSDP: gather the previous block's parameters during backward
        timeout: seconds a process waits for the others in a collective before the run ends with a message
        micro_batch_size: samples per forward/backward; auto picks the largest that fits
        global_batch_size: samples per optimizer step over all ranks (gradient accumulation makes up the rest)
        override_max_seq_length: cap on sequence length; memory grows with it
        optimizer: AdamW, SGD, Lion, Sophia, Adafactor, AdamW8bit and PagedAdamW8bit (bitsandbytes), AdamW4bit and
            AdamWFp8 (torchao: AdamW with 4-bit / float8 moments), GaLore and APOLLO (low-rank projected AdamW
            state of the blocks' matrices), AdamMini (one second moment per head / tensor), AdaLomo (factored second
            moment, no first, steps inside backward), or a class path
        optimizer_rank: GaLore, APOLLO: rank of the gradient projection; matrices with a side this small or smaller
            keep full state
        optimizer_in_backward: step each parameter as soon as its gradient is ready and free the gradient, so the
            gradients never all exist at once; one process, micro batch = global batch, no --grad_clip, and an
            out-of-memory inside a step ends the run (the step cannot be redone in smaller micro batches)
        learning_rate: peak learning rate
        min_lr: learning rate at the end of the cosine decay
        warmup_steps: linear warmup steps
        weight_decay: decoupled weight decay (matrices only)
        grad_clip: clip the global gradient norm to this (0: off); default 1.0, or 0 where the optimizer steps
            inside backward (--optimizer_in_backward, AdaLomo), before the global norm exists
        max_steps: length of the run in optimizer steps
        max_tokens: length of the run in training tokens (overrides max_steps when given)
        log_interval: print and log a metrics row every N steps
        logger: where the rows go besides out_dir/metrics.csv (always written): csv, tensorboard, wandb, mlflow,
            several joined by commas (csv,tensorboard) or added with --logger+ NAME, under out_dir/logs; wandb runs
            offline when WANDB_MODE=offline or without an API key (WANDB_API_KEY or `wandb login`); mlflow uses
            $MLFLOW_TRACKING_URI when set, else a file store in out_dir/logs/mlflow
        eval_interval: evaluate every N steps (and at the end)
        eval_iters: evaluation batches of eval_batch_size per evaluation (split over the ranks)
        eval_batch_size: evaluation micro batch (default: micro_batch_size)
        save_interval: write a resumable checkpoint every N steps (0: only at the end)
        keep_last: keep the newest N resumable checkpoints
        resume: auto (the newest checkpoint in out_dir) or a checkpoint path
        compile: torch.compile each transformer block (the loss stays eager)
        seed: full determinism on CPU for a given seed
        freeze_layers: keep these frozen: N (embedding + first N blocks) or parameter-name patterns
        empty_cache_interval: release cached allocator memory every N steps (0: never)
        loss_chunk_size: tokens per cross-entropy chunk, so full logits are never held at once (0: unchunked; auto:
            the largest chunk whose logits fit the memory the rest of the step leaves)
        overwrite: allow writing into an out_dir that holds another run
        device_memory: with --plan: plan for a CUDA GPU of this size, e.g. 24GB
        plan: print the predicted peak memory of this run and exit without training; exit status 1 when it does
            not fit the device and no suggested flag change makes it fit, else 0
        plan_plot: with --plan: also write a PNG of peak memory by category for this run and each suggestion
        rehearse: before training, run one step on the longest batch, one evaluation batch and a checkpoint save
            (a fresh run's rehearsal changes nothing), so an out-of-memory shows in the first minute
        oom_recovery: on out-of-memory inside a step, redo the step's samples in micro batches half as large
            (same global batch); when even 1 does not fit, stop with a report of what took the memory
    """

    out_dir: Path = Path("out/pretrain")
    data_path: Optional[Path] = None
    precision: Optional[Precision] = None
    micro_batch_size: Union[int, Literal["auto"]] = 8
    global_batch_size: int = 32
    override_max_seq_length: Optional[int] = None
    optimizer: str = "AdamW"
    optimizer_rank: int = DEFAULT_OPTIMIZER_RANK
    optimizer_in_backward: bool = False
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: Optional[float] = None
    max_steps: Optional[int] = None
    max_tokens: Optional[int] = None
    log_interval: int = 10
    logger: Union[str, list[str]] = "csv"
    eval_interval: int = 100
    eval_iters: int = 20
    eval_batch_size: Optional[int] = None
    save_interval: int = 200
    keep_last: int = 2
    resume: Optional[Union[Literal["auto"], Path]] = None
    compile: bool = False
    seed: int = 1337
    freeze_layers: Optional[Union[int, list[str]]] = None
    empty_cache_interval: int = 0
    loss_chunk_size: Union[int, Literal["auto"]] = DEFAULT_LOSS_CHUNK_SIZE
    activation_offloading: Optional[Literal["cpu", "disk"]] = None
    offload_dir: Optional[Path] = None
    mlp_tiles: int = 1
    overwrite: bool = False
    device_memory: Optional[str] = None
    plan: Optional[Literal["text", "json"]] = None
    plan_plot: Optional[Path] = None
    rehearse: bool = True
    oom_recovery: bool = True


# Flag -> the smallest value that means something; a flag left out (None) or "auto" is not checked. The
# subclasses' flags are here too, so every script's numbers are checked in one place before anything starts.
AT_LEAST: dict[str, int] = {
    "devices": 1, "micro_batch_size": 1, "global_batch_size": 1, "eval_batch_size": 1, "num_nodes": 1, "log_interval": 1, "eval_interval": 1,
    "eval_iters": 1, "keep_last": 1, "max_steps": 1, "max_tokens": 1, "override_max_seq_length": 1,
    "activation_checkpointing_interval": 1, "adapter_prompt_length": 1, "mlp_tiles": 1, "optimizer_rank": 1,
    "warmup_steps": 0, "save_interval": 0, "empty_cache_interval": 0, "loss_chunk_size": 0, "seed": 0,
    "adapter_start_layer": 0, "weight_decay": 0, "grad_clip": 0, "min_lr": 0,
}
MEANING = {
    "log_interval": "steps between logged rows", "eval_interval": "steps between evaluations",
    "save_interval": "steps between checkpoints, 0: only at the end", "keep_last": "checkpoints kept",
    "empty_cache_interval": "0: never", "loss_chunk_size": "0: unchunked", "grad_clip": "0: off",
}
MAX_SEED = 2**32 - 1  # numpy's and Fabric's seed range


def check_args(args: TrainArgs) -> None:
    """Every training flag's value and the combinations that cannot work, checked once at the start of each
    training script's main, before anything is written or any process is launched: a bad value stops there
    with the fix, not after N processes start or after the first step."""
    for flag, least in AT_LEAST.items():
        value = getattr(args, flag, None)
        if value not in (None, "auto") and not value >= least:  # also catches NaN
            meaning = f" ({MEANING[flag]})" if flag in MEANING else ""
            raise UsageError(f"--{flag} {value} must be at least {least}{meaning}.")
    if not args.learning_rate > 0:
        raise UsageError(f"--learning_rate {args.learning_rate} must be positive, e.g. 3e-4.")
    if not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout}: give the collective timeout in seconds, more than 0 (default 1800).")
    if args.min_lr > args.learning_rate:
        raise UsageError(f"--min_lr {args.min_lr} is above --learning_rate {args.learning_rate}: the schedule decays "
                         "from the learning rate down to min_lr. Lower --min_lr.")
    if args.seed > MAX_SEED:
        raise UsageError(f"--seed {args.seed} must be between 0 and {MAX_SEED}.")
    fraction = getattr(args, "val_split_fraction", None)  # fine-tuning only
    if fraction is not None and not 0 < fraction < 1:
        raise UsageError(f"--val_split_fraction {fraction} must be between 0 and 1 (exclusive), e.g. 0.05.")
    if (kind := getattr(args, "data_kind", None)) is not None:  # scripts that take --data
        check_data_flags(args.data, args.data_path, getattr(args, "data_fields", None), kind)
    if args.max_steps is None and args.max_tokens is None:
        raise UsageError("Give the run a length: --max_steps N or --max_tokens N.")
    if isinstance(args.freeze_layers, int) and args.freeze_layers < 0:
        raise UsageError(f"--freeze_layers {args.freeze_layers} must be at least 0 (the number of frozen blocks).")
    if isinstance(args.freeze_layers, list) and not args.freeze_layers:
        raise UsageError("--freeze_layers [] names no parameter: give patterns such as '[blocks.[0-3].*]', or drop it.")
    check_activation_flags(args)
    check_optimizer(args.optimizer, args.learning_rate, args.weight_decay)
    check_steps_in_backward(args.optimizer, args.optimizer_in_backward, args.grad_clip)
    if args.grad_clip is None and steps_in_backward(args.optimizer, args.optimizer_in_backward):
        print(f"Note: {'--optimizer_in_backward' if args.optimizer_in_backward else '--optimizer AdaLomo'} steps each "
              "parameter before the global gradient norm exists, so the gradients are not clipped (--grad_clip "
              "defaults to 0 here, not 1.0).", file=sys.stderr)
    check_loggers(args.logger)
    if args.device_memory is not None:
        parse_memory(args.device_memory)
    check_plan_flags(args)
    if args.plan is None:  # a plan writes nothing into out_dir, and logs nowhere
        check_out_dir_path(args.out_dir)
        check_logger_servers(args.logger)
        if args.resume is not None and args.overwrite:
            raise UsageError(
                f"--resume {args.resume} continues the run in {args.out_dir}, --overwrite starts a new one there: "
                "choose one of them."
            )


def check_activation_flags(args: TrainArgs) -> None:
    if args.offload_dir is not None and args.activation_offloading != "disk":
        raise UsageError(f"--offload_dir {args.offload_dir} is where --activation_offloading disk writes its files: add "
                         "--activation_offloading disk, or drop --offload_dir.")
    if args.offload_dir is not None and Path(args.offload_dir).exists() and not Path(args.offload_dir).is_dir():
        raise UsageError(f"--offload_dir {args.offload_dir} is a file, not a directory. Pick another --offload_dir.")
    if args.activation_offloading is not None and canonical_name(args.optimizer) == "Sophia":
        raise UsageError(f"--activation_offloading {args.activation_offloading} brings saved tensors back detached from "
                         "the graph, so Sophia's second backward (its Hessian) cannot run through them: use another "
                         "--optimizer, or drop --activation_offloading.")
    if args.activation_offloading is not None and args.compile:
        raise UsageError(f"--activation_offloading {args.activation_offloading} moves saved tensors through autograd "
                         "hooks that torch.compile does not trace: use one of --activation_offloading and --compile.")


def check_plan_flags(args: TrainArgs) -> None:
    if args.plan_plot is None:
        return
    if args.plan is None:
        raise UsageError("--plan_plot draws the memory plan: add --plan text (or json), or drop --plan_plot.")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plan_plot needs matplotlib: run `pip install matplotlib` (or `pip install -e .[plot]`), "
                         "or drop --plan_plot.")
    path = Path(args.plan_plot)
    if path.is_dir() or not path.parent.is_dir():
        raise UsageError(f"--plan_plot {path}: give a file name in an existing directory, e.g. plan.png.")
