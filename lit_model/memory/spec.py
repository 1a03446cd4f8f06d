"""``RunSpec``: everything about a run that decides its memory, resolved once from a config and the
training flags (a ``TrainArgs`` or any object with the same attribute names), so the exact trace and the
analytic model read the same numbers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from lit_model.config import Config, sequence_length
from lit_model.data.text import check_batch_sizes
from lit_model.errors import UsageError
from lit_model.loss import DEFAULT_LOSS_CHUNK_SIZE

from lit_model.memory.modules import DEFAULT_LORA_TARGETS, LORA_TARGETS

DTYPE_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
PRECISION_DTYPES = {
    "32-true": (torch.float32, None),
    "16-true": (torch.float16, None),
    "bf16-true": (torch.bfloat16, None),
    "16-mixed": (torch.float32, torch.float16),
    "bf16-mixed": (torch.float32, torch.bfloat16),
}
TRAINABLE = ("full", "lora", "adapter")
QUANTIZE = ("bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8")


@dataclass
class RunSpec:
    config: Config
    precision: str
    micro_batch_size: int
    seq_len: int
    global_batch_size: int
    world_size: int = 1
    strategy: str = "single"  # single | ddp | fsdp
    sharding_strategy: str = "FULL_SHARD"
    num_nodes: int = 1
    cpu_offload: bool = False
    ac_interval: int = 0  # 0: no activation checkpointing; k: every k-th block
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE
    optimizer: str = "AdamW"
    trainable: str = "full"
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    adapter_prompt_length: int = 10
    adapter_start_layer: int = 1
    quantize: Optional[str] = None
    freeze_layers: Optional[Union[int, list[str]]] = None
    eval_batch_size: Optional[int] = None
    grad_clip: float = 1.0
    device_type: str = "cuda"

    @property
    def param_dtype(self) -> torch.dtype:
        return PRECISION_DTYPES[self.precision][0]

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return PRECISION_DTYPES[self.precision][1]

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes of a matmul output element: the autocast dtype under -mixed, else the parameter dtype."""
        return DTYPE_BYTES[self.autocast_dtype or self.param_dtype]

    @property
    def accumulation(self) -> int:
        return max(1, self.global_batch_size // (self.world_size * self.micro_batch_size))

    @property
    def per_rank_batch(self) -> int:
        return max(1, self.global_batch_size // self.world_size)

    @property
    def eval_batch(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    def replace(self, **changes: Any) -> "RunSpec":
        return dataclasses.replace(self, **changes)


def resolve_precision(precision: Optional[str], device_type: str) -> str:
    """Like ``lit_model.precision.resolve_precision`` but for a device that may not be here: a CUDA plan
    assumes a GPU with bfloat16 (Ampere or newer)."""
    if precision is None:
        return "bf16-true" if device_type == "cuda" else "32-true"
    if precision not in PRECISION_DTYPES:
        raise UsageError(f"Unknown --precision {precision!r}. Choose one of: {', '.join(PRECISION_DTYPES)}.")
    return precision


def _get(settings: Any, name: str, default: Any) -> Any:
    value = getattr(settings, name, default) if settings is not None else default
    return default if value is None and default is not None else value


def lora_targets_from(settings: Any) -> tuple[str, ...]:
    flags = {t: _get(settings, f"lora_{t}", None) for t in LORA_TARGETS}
    if all(v is None for v in flags.values()):
        return DEFAULT_LORA_TARGETS
    return tuple(t for t, v in flags.items() if v)


def make_spec(
    config: Config,
    settings: Any = None,
    trainable: str = "full",
    lora_r: Optional[int] = None,
    quantize: Optional[str] = None,
    device_type: str = "cuda",
    world_size: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
) -> RunSpec:
    """Read the memory-relevant flags from ``settings`` (missing attributes take TrainArgs' defaults)."""
    if trainable not in TRAINABLE:
        raise UsageError(f"trainable={trainable!r}: use one of {TRAINABLE}.")
    quantize = quantize if quantize is not None else _get(settings, "quantize", None)
    if quantize is not None and quantize not in QUANTIZE:
        raise UsageError(f"Unknown --quantize {quantize!r}. Choose one of: {', '.join(QUANTIZE)}, or leave it out.")
    if quantize is not None and trainable == "full":
        raise UsageError(
            f"--quantize {quantize} freezes the base weights in low precision, so it works with LoRA/adapter "
            "fine-tuning (finetune/lora.py, finetune/adapter.py), not with full fine-tuning or pretraining."
        )
    precision = resolve_precision(_get(settings, "precision", None), device_type)
    devices = _get(settings, "devices", 1)
    if devices == "auto":  # as lit_model.training.fabric.resolve_devices
        devices = torch.cuda.device_count() if device_type == "cuda" and torch.cuda.is_available() else 1
    devices = int(devices)
    num_nodes = int(_get(settings, "num_nodes", 1))
    world_size = world_size if world_size is not None else devices * num_nodes
    cpu_offload = bool(_get(settings, "cpu_offload", False))
    strategy = _get(settings, "strategy", "auto")
    if strategy == "auto":
        strategy = "fsdp" if cpu_offload else ("ddp" if world_size > 1 else "single")
    if strategy == "ddp" and world_size == 1:
        strategy = "single"
    micro = micro_batch_size if micro_batch_size is not None else _get(settings, "micro_batch_size", 8)
    if micro == "auto":
        micro = 1  # the caller resolves "auto" with max_micro_batch_size
    micro = int(micro)
    global_batch = int(_get(settings, "global_batch_size", micro * world_size))
    check_batch_sizes(global_batch, micro, world_size)  # what training would refuse, the plan refuses too
    seq_len = sequence_length(config, _get(settings, "override_max_seq_length", None))  # as training refuses
    ac = bool(_get(settings, "activation_checkpointing", False))
    interval = int(_get(settings, "activation_checkpointing_interval", 1)) if ac else 0
    adapter_start = _get(settings, "adapter_start_layer", None)
    adapter_start = config.n_layer // 2 if adapter_start is None else int(adapter_start)  # finetune/adapter.py's default
    if micro < 1 or seq_len < 1 or world_size < 1:
        raise UsageError("micro_batch_size, sequence length and world size must be positive.")
    return RunSpec(
        config=config,
        precision=precision,
        micro_batch_size=micro,
        seq_len=seq_len,
        global_batch_size=global_batch,
        world_size=world_size,
        strategy=strategy,
        sharding_strategy=_get(settings, "sharding_strategy", "FULL_SHARD"),
        num_nodes=num_nodes,
        cpu_offload=cpu_offload,
        ac_interval=max(interval, 0),
        loss_chunk_size=int(_get(settings, "loss_chunk_size", DEFAULT_LOSS_CHUNK_SIZE)),
        optimizer=_get(settings, "optimizer", "AdamW"),
        trainable=trainable,
        lora_r=int(lora_r if lora_r is not None else _get(settings, "lora_r", 8)),
        lora_alpha=float(_get(settings, "lora_alpha", 16.0)),
        lora_dropout=float(_get(settings, "lora_dropout", 0.05)),
        lora_targets=lora_targets_from(settings),
        adapter_prompt_length=int(_get(settings, "adapter_prompt_length", 10)),
        adapter_start_layer=adapter_start,
        quantize=quantize,
        freeze_layers=_get(settings, "freeze_layers", None),
        eval_batch_size=_get(settings, "eval_batch_size", None),
        grad_clip=float(_get(settings, "grad_clip", 1.0)),
        device_type=device_type,
    )
