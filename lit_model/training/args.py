"""The flags every training script shares (../shared/cli.md), as one dataclass each script extends.

``lit_model.cli.parse`` turns a dataclass into flat flags (``--micro_batch_size``, not
``--train.micro_batch_size``) that also load from ``--config file.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from lit_model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.training.fabric import DistributedSettings

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
        activation_checkpointing: recompute block activations in backward (one device, DDP and FSDP)
        activation_checkpointing_interval: with activation_checkpointing, recompute every k-th block only
        forward_prefetch: FSDP: gather the next block's parameters during the current block's forward
        backward_prefetch: FSDP: gather the previous block's parameters during backward
        timeout: seconds a process waits for the others in a collective before the run ends with a message
        micro_batch_size: samples per forward/backward; auto picks the largest that fits
        global_batch_size: samples per optimizer step over all ranks (gradient accumulation makes up the rest)
        override_max_seq_length: cap on sequence length; memory grows with it
        optimizer: AdamW, SGD, Lion, Sophia, Adafactor, AdamW8bit, PagedAdamW8bit, or a class path
        learning_rate: peak learning rate
        min_lr: learning rate at the end of the cosine decay
        warmup_steps: linear warmup steps
        weight_decay: decoupled weight decay (matrices only)
        grad_clip: clip the global gradient norm to this (0: off)
        max_steps: length of the run in optimizer steps
        max_tokens: length of the run in training tokens (overrides max_steps when given)
        log_interval: print and log a metrics row every N steps
        eval_interval: evaluate every N steps (and at the end)
        eval_iters: evaluation batches of eval_batch_size per evaluation (split over the ranks)
        eval_batch_size: evaluation micro batch (default: micro_batch_size)
        save_interval: write a resumable checkpoint every N steps (0: only at the end)
        keep_last: keep the newest N resumable checkpoints
        resume: auto (the newest checkpoint in out_dir) or a checkpoint path
        compile: torch.compile the model
        seed: full determinism on CPU for a given seed
        freeze_layers: keep these frozen: N (embedding + first N blocks) or parameter-name patterns
        empty_cache_interval: release cached allocator memory every N steps (0: never)
        loss_chunk_size: tokens per cross-entropy chunk, so full logits are never held at once (0: unchunked)
        overwrite: allow writing into an out_dir that holds another run
        device_memory: with --plan: plan for a CUDA GPU of this size, e.g. 24GB
        plan: print the predicted peak memory of this run and exit
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
    learning_rate: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_steps: Optional[int] = None
    max_tokens: Optional[int] = None
    log_interval: int = 10
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
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    overwrite: bool = False
    device_memory: Optional[str] = None
    plan: Optional[Literal["text", "json"]] = None
    plan_plot: Optional[Path] = None
    rehearse: bool = True
    oom_recovery: bool = True
