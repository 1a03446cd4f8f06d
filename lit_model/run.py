"""``Run``: one training run's settings, resolved once from the flags, the model config and the machine.

Every script resolves its flags here, once, before anything starts; the Fabric setup, the model setup, the
data loaders, the planner, ``--micro_batch_size auto``, out-of-memory recovery and the summary all read the
resulting ``Run``. It is frozen: a later decision (the micro batch that ``auto`` picks, the smaller one that
recovery falls back to, a planner suggestion) is a new ``Run`` made with ``dataclasses.replace``, and a
suggestion reaches the user as the difference of two runs, rendered as flags by ``changed_flags``.

The flags that need no resolution (learning rate, intervals, out_dir, seed) stay in the parsed arguments,
which nothing writes after parsing.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, Literal, Optional, Union

import torch

from lit_model.methods.adapter import AdapterConfig
from lit_model.core.config import Config, sequence_length
from lit_model.data.text import check_batch_sizes
from lit_model.core.errors import UsageError
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.methods.lora import TARGETS as LORA_TARGET_FLAGS, LoRAConfig
from lit_model.core.precision import DTYPE_BYTES, PRECISION_DTYPES, resolve_precision
from lit_model.methods.grpo import GRPO_LOSSES, SCALE_REWARDS, GRPOSpec
from lit_model.methods.preference import PREFERENCE_LOSSES, WITH_REFERENCE, PreferenceSpec
from lit_model.methods.quantize import QUANTIZE_MODES
from lit_model.parallel.apply import Levers
from lit_model.parallel.dims import ParallelDims, resolve_parallel_dims

Trainable = Literal["full", "lora", "adapter"]
TRAINABLE = ("full", "lora", "adapter")
DEFAULT_OPTIMIZER_RANK = 128  # GaLore's paper: 128 for the 60M-130M models, 256-512 above


# --optimizer names (matched case-insensitively; train/optimizers.py builds them)
OPTIMIZERS = ("AdamW", "SGD", "Lion", "Sophia", "Adafactor", "AdamW8bit", "PagedAdamW8bit", "GaLore", "APOLLO",
              "AdamMini", "AdaLomo", "AdamW4bit", "AdamWFp8")
# Optimizers built from the model itself (its parameter names, heads, hooks): never one per parameter
MODEL_OPTIMIZERS = ("AdamMini", "AdaLomo")
DEFAULT_GRAD_CLIP = 1.0


def canonical_name(name: str) -> Optional[str]:
    """The ``OPTIMIZERS`` spelling of ``name`` (flags are matched case-insensitively); None for a class path."""
    return {n.lower(): n for n in OPTIMIZERS}.get(name.lower())


@dataclass(frozen=True)
class Run:
    config: Config
    precision: str  # one of lit_model.core.precision.PRECISIONS, resolved for the device
    device_type: str  # "cuda" or "cpu"
    devices: int  # processes per node
    num_nodes: int
    parallel: ParallelDims  # how the processes share the model (resolve_parallel_dims)
    micro_batch_size: int  # with micro_batch_auto: 1 until the processes run and pick it
    global_batch_size: int
    seq_len: int  # the longest sequence a step sees
    forward_prefetch: bool = True
    backward_prefetch: bool = True
    timeout: float = 1800.0
    micro_batch_auto: bool = False
    trainable: str = "full"
    lora: Optional[LoRAConfig] = None  # with trainable == "lora"
    adapter: Optional[AdapterConfig] = None  # with trainable == "adapter"
    quantize: Optional[str] = None
    freeze_layers: Optional[Union[int, tuple[str, ...]]] = None
    ac_interval: int = 0  # 0: no activation checkpointing; k: every k-th block
    ac_selective: bool = False  # with ac_interval: keep matmul/attention outputs, recompute the element-wise ops
    activation_offloading: Optional[str] = None  # "cpu" (pinned host memory) or "disk" (files in offload_dir)
    offload_dir: Optional[Path] = None  # with activation_offloading "disk"
    mlp_tiles: int = 1  # > 1: the MLP in this many sequence tiles, each recomputed in backward
    loss_chunk_size: int = DEFAULT_LOSS_CHUNK_SIZE  # with loss_chunk_auto: a placeholder until it is chosen
    loss_chunk_auto: bool = False
    cuda_alloc_conf: Optional[str] = None  # the CUDA caching allocator's settings the run gets (cuda_alloc_conf())
    cpu_heap: str = "glibc"  # glibc's heap in the process: "lit_model", "returns_freed" or "glibc" (resolve_cpu_heap())
    optimizer: str = "AdamW"  # an OPTIMIZERS name as spelled there, or an optimizer class's import path
    optimizer_rank: int = DEFAULT_OPTIMIZER_RANK  # GaLore / APOLLO projection rank
    optimizer_in_backward: bool = False
    eval_batch_size: Optional[int] = None
    grad_clip: float = DEFAULT_GRAD_CLIP
    compile: bool = False
    checkpoint_dir: Optional[Path] = None  # the verified checkpoint a fine-tune starts from
    # fine-tuning samples packed into sequences of seq_len tokens (preference: each micro batch's rows), document masks
    packing: bool = False
    preference: Optional[PreferenceSpec] = None  # a preference objective (DPO and kin); None: the language-model loss
    # where seq_len comes from when a plan took it from the data (its longest sample); "": the flag or the model's context
    seq_len_source: str = ""
    grpo: Optional[GRPOSpec] = None  # GRPO on rollouts of prompts (finetune/grpo.py); None: another objective

    def __post_init__(self) -> None:  # every comparison downstream is with the OPTIMIZERS spelling
        object.__setattr__(self, "optimizer", canonical_name(self.optimizer) or self.optimizer)

    # ---- derived ----
    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def heap_settings(self) -> tuple[tuple[str, int, int], ...]:
        """The mallopt settings the training process gives glibc's heap (none unless ``cpu_heap`` is "lit_model")."""
        if self.cpu_heap != "lit_model":
            return ()
        return CPU_HEAP_SHARDED if self.parallel.fsdp else CPU_HEAP

    @property
    def heap_mode(self) -> str:
        """``cpu_heap`` as the planner models it: "lit_model_sharded" where an FSDP run's settings map blocks of 1 MiB
        or more apart from the heap (returned when freed, as with the user's "returns_freed")."""
        return "lit_model_sharded" if self.cpu_heap == "lit_model" and self.parallel.fsdp else self.cpu_heap

    @property
    def levers(self) -> Levers:
        """What ``parallel.apply.parallelize`` applies to the model itself."""
        return Levers(ac_interval=self.ac_interval, ac_selective=self.ac_selective, mlp_tiles=self.mlp_tiles,
                      compile=self.compile, offload=self.activation_offloading, offload_dir=self.offload_dir,
                      forward_prefetch=self.forward_prefetch, backward_prefetch=self.backward_prefetch)

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
    def per_rank_batch(self) -> int:
        return max(1, self.global_batch_size // self.world_size)

    @property
    def accumulation(self) -> int:
        return max(1, self.per_rank_batch // self.micro_batch_size)

    @property
    def steps_in_backward(self) -> bool:
        return steps_in_backward(self.optimizer, self.optimizer_in_backward)

    @property
    def eval_batch(self) -> int:
        return self.eval_batch_size or self.micro_batch_size

    @property
    def lora_r(self) -> int:
        return (self.lora or LoRAConfig()).r

    @property
    def lora_alpha(self) -> float:
        return (self.lora or LoRAConfig()).alpha

    @property
    def lora_dropout(self) -> float:
        return (self.lora or LoRAConfig()).dropout

    @property
    def lora_dora(self) -> bool:
        return (self.lora or LoRAConfig()).dora

    @property
    def lora_targets(self) -> tuple[str, ...]:
        lora = self.lora or LoRAConfig()
        return tuple(flag for flag in LORA_TARGET_FLAGS if getattr(lora, flag))

    @property
    def adapter_prompt_length(self) -> int:
        return (self.adapter or AdapterConfig()).prompt_length

    @property
    def adapter_start_layer(self) -> int:
        return self.adapter.start_layer if self.adapter is not None else self.config.n_layer // 2

    def replace(self, **changes: Any) -> "Run":
        return dataclasses.replace(self, **changes)


# The CUDA caching allocator's settings: the user's own when set (either name), else expandable segments (fewer
# fragmentation gaps: plan/calibration.py), which PyTorch supports with CUDA on Linux.
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
DEFAULT_CUDA_ALLOC_CONF = "expandable_segments:True"


def cuda_alloc_conf(device_type: str) -> Optional[str]:
    if device_type != "cuda":
        return None
    for variable in ALLOC_CONF_VARIABLES:
        if variable in os.environ:
            return os.environ[variable]
    supported = sys.platform == "linux" and torch.version.hip is None
    return DEFAULT_CUDA_ALLOC_CONF if supported else None


# glibc's heap in a CPU training process (mallopt names, codes, values): both thresholds fixed at the ceilings glibc's
# adaptive ones reach on their own (mmap 32 MiB, trim twice that), and 16 MiB left at the heap's top when it is
# trimmed. At the defaults a step's freed blocks go back to the OS and return as page faults the kernel zeroes, every
# step: the 5.26M model of benchmarks/vs_peers.py in bf16-true, micro batch 1 x 256, ~1,500 faults a step (3 with
# these), micro batch 8 x 256 ~13,800 (~770): benchmarks/results/cpu_heap.md. Where the user set glibc's malloc
# variables, theirs stand.
CPU_HEAP_TOP_PAD = 16 << 20
CPU_HEAP = (("M_MMAP_THRESHOLD", -3, 32 << 20), ("M_TRIM_THRESHOLD", -1, 64 << 20), ("M_TOP_PAD", -2, CPU_HEAP_TOP_PAD))
# ... and in a process of an FSDP run, every block of 1 MiB or more mapped apart from the heap and returned when
# freed: FSDP all-gathers each block's parameters and reduce-scatters its gradients in forward, in the recompute and
# in backward, buffers below the 32 MiB threshold that left a fragmented heap behind them, growing step after step
# (pythia-160m 32-true, 2 ranks, micro batch 4 x 128 with checkpointing: 3.6-3.8 GB a rank after 4-6 steps, where the
# tensors and the runtime come to 2.5 GB; 2.47 GB with this threshold; issue 50).
CPU_HEAP_SHARDED = (("M_MMAP_THRESHOLD", -3, 1 << 20), *CPU_HEAP[1:])


def resolve_cpu_heap(device_type: str, sets_heap: bool = True) -> str:
    """How glibc's heap behaves in a process on ``device_type`` (the planner's retained heap follows it): "lit_model"
    where a training process (``sets_heap``) on the CPU sets ``CPU_HEAP``, on glibc, and the user set no ``MALLOC_*``
    variable and no ``glibc.malloc`` tunable; "returns_freed" where the user's ``MALLOC_MMAP_THRESHOLD_`` is at most
    1 MiB (freed blocks go back to the OS at once); else "glibc" (its adaptive thresholds, or the user's settings)."""
    threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_", "")
    if threshold.isdigit() and int(threshold) <= 1 << 20:
        return "returns_freed"
    user_set = (any(name.startswith("MALLOC_") for name in os.environ)
                or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""))
    glibc = sys.platform == "linux" and platform.libc_ver()[0] == "glibc"
    return "lit_model" if sets_heap and device_type == "cpu" and glibc and not user_set else "glibc"


def resolve_devices(devices: Union[int, str], device_type: str, present: bool = True) -> int:
    """``--devices``: "auto" is every GPU here (1 on the CPU). ``present``: the run is for this machine, so its
    GPUs must exist (a plan may be for GPUs elsewhere)."""
    cuda_here = device_type == "cuda" and torch.cuda.is_available()
    if devices == "auto":
        return torch.cuda.device_count() if cuda_here else 1
    devices = int(devices)
    if devices < 1:
        raise UsageError(f"--devices must be at least 1 (got {devices}).")
    if present and cuda_here and devices > torch.cuda.device_count():
        raise UsageError(
            f"--devices {devices} asks for more GPUs than this machine has ({torch.cuda.device_count()}). "
            "Use --num_nodes to spread over machines, or lower --devices."
        )
    return devices


# Optimizers that need whole matrices (projections, per-head blocks, their own hooks): not FSDP's shards
WHOLE_MATRIX_OPTIMIZERS = ("GaLore", "APOLLO", "AdamMini", "AdaLomo")
# Their kernels take plain tensors only (a two-process FSDP run: "got mixed torch.Tensor and DTensor")
BITSANDBYTES_OPTIMIZERS = ("AdamW8bit", "PagedAdamW8bit")


def refuse_sophia(args: Any, loss: str) -> None:
    """What the preference and GRPO objectives cannot train with: a second derivative of ``loss`` (Sophia)."""
    if canonical_name(args.optimizer) == "Sophia":
        raise UsageError(f"--optimizer Sophia estimates a Hessian by differentiating the loss twice, which {loss} "
                         "cannot be. Use AdamW (the default) or another first-order optimizer.")


def resolve_preference(args: Any, trainable: str) -> Optional[PreferenceSpec]:
    """The preference objective of a run whose flags name a ``--loss`` (finetune/dpo.py), else None. The reference:
    none for a reference-free loss; with LoRA or LLaMA-Adapter the base (its adapters off) unless
    ``--reference_model`` names another; else log-probabilities computed once before training."""
    loss = getattr(args, "loss", None)
    if loss is None:
        return None
    if loss not in PREFERENCE_LOSSES:
        raise UsageError(f"--loss {loss!r}: choose one of {', '.join(PREFERENCE_LOSSES)}.")
    if not args.beta > 0:
        raise UsageError(f"--beta {args.beta} must be positive (DPO's is 0.1; SimPO's 2.0 to 2.5).")
    refuse_sophia(args, "the preference losses")
    if loss not in WITH_REFERENCE:
        reference = "none"
    elif trainable in ("lora", "adapter") and getattr(args, "reference_model", None) is None:
        reference = "adapters"
    else:
        reference = "precomputed"
    return PreferenceSpec(loss, float(args.beta), float(args.simpo_gamma), reference)


def steps_in_backward(optimizer: str, in_backward: bool) -> bool:
    """Each parameter steps as its gradient is ready (--optimizer_in_backward, or AdaLomo, which always does)."""
    return in_backward or canonical_name(optimizer) == "AdaLomo"


def resolve_grad_clip(grad_clip: Optional[float], optimizer: str, in_backward: bool) -> float:
    """--grad_clip, or its default: 1.0, giving way to 0 where the optimizer steps inside backward, before the global
    gradient norm exists (train/args.check_args notes it; a --grad_clip the user gave is refused there instead)."""
    if grad_clip is not None:
        return float(grad_clip)
    return 0.0 if steps_in_backward(optimizer, in_backward) else DEFAULT_GRAD_CLIP


def resolve_grpo(args: Any, trainable: str) -> Optional[GRPOSpec]:
    """The GRPO settings of a run whose flags name ``--num_generations`` (finetune/grpo.py), else None. With
    ``--beta`` > 0 the reference is the base with LoRA's or LLaMA-Adapter's adapters off; full fine-tuning has no
    reference to keep without a second model, so it takes beta 0."""
    generations = getattr(args, "num_generations", None)
    if generations is None:
        return None
    if args.loss_type not in GRPO_LOSSES:
        raise UsageError(f"--loss_type {args.loss_type!r}: choose one of {', '.join(GRPO_LOSSES)} (TRL's default: dapo).")
    if args.scale_rewards not in SCALE_REWARDS:
        raise UsageError(f"--scale_rewards {args.scale_rewards!r}: choose one of {', '.join(SCALE_REWARDS)}.")
    if generations < 2:
        raise UsageError(f"--num_generations {generations}: GRPO compares each completion with the others of its "
                         "prompt, so it needs at least 2 (TRL's default is 8).")
    if args.global_batch_size % generations:
        raise UsageError(f"--global_batch_size {args.global_batch_size} counts completions: make it a multiple of "
                         f"--num_generations {generations} (each prompt's completions are trained in the same step), "
                         f"e.g. --global_batch_size {generations * max(1, args.global_batch_size // generations)}.")
    if args.max_new_tokens < 1 or not args.epsilon > 0 or not args.epsilon_high > 0:
        raise UsageError(f"--max_new_tokens ({args.max_new_tokens}) must be at least 1, --epsilon ({args.epsilon}) and "
                         f"--epsilon_high ({args.epsilon_high}) positive (TRL: 0.2).")
    if args.beta < 0:
        raise UsageError(f"--beta {args.beta} must be 0 (no reference, the default) or positive.")
    if args.beta > 0 and trainable == "full":
        raise UsageError(f"--beta {args.beta} keeps the policy near a reference, which --method full would need a "
                         "second model for (rollouts are new every step, so nothing can be computed in advance). Use "
                         "--method lora or adapter (the reference is the base with its adapters off) or --beta 0.")
    refuse_sophia(args, "GRPO's loss")
    if getattr(args, "packing", False):
        raise UsageError("--packing does not apply to GRPO: each completion is its own row, generated during the run. "
                         "Drop --packing.")
    weights = None if args.reward_weights is None else tuple(float(w) for w in args.reward_weights)
    return GRPOSpec(tuple(args.reward), weights, int(generations), int(args.max_new_tokens), float(args.temperature),
                    args.top_k, float(args.top_p), args.loss_type, float(args.beta), float(args.epsilon),
                    float(args.epsilon_high), args.scale_rewards, "adapters" if args.beta > 0 else "none")


def check_optimizer_run(run: "Run") -> None:
    """What an optimizer that steps inside backward (--optimizer_in_backward, AdaLomo) or needs whole matrices
    cannot serve in this run (the flag-level combinations are refused by the training flags' check). For every
    resolved run, and for each run the planner's suggestion search considers."""
    if run.optimizer in WHOLE_MATRIX_OPTIMIZERS and run.parallel.fsdp:
        raise UsageError(f"--optimizer {run.optimizer} works on whole matrices, and FSDP gives each process a shard "
                         "(--strategy fsdp, or --cpu_offload): use DDP or one device, or AdamW4bit with FSDP.")
    if run.optimizer in BITSANDBYTES_OPTIMIZERS and run.parallel.fsdp:
        raise UsageError(f"--optimizer {run.optimizer} (bitsandbytes) steps plain tensors, and FSDP's parameters are "
                         "sharded DTensors (--strategy fsdp, or --cpu_offload), which its kernel refuses: use --optimizer "
                         "AdamW4bit (torchao, whose state is sharded with the parameters), or DDP or one device.")
    if not run.steps_in_backward:
        return
    what = "--optimizer_in_backward" if run.optimizer_in_backward else "--optimizer AdaLomo"
    if run.world_size > 1 or run.parallel.fsdp:
        raise UsageError(f"{what} steps each parameter during backward, before DDP or FSDP has averaged (or sharded) its "
                         "gradient: run on one device (--devices 1, no --strategy fsdp or --cpu_offload), or drop it.")
    if run.micro_batch_auto or run.accumulation > 1:
        raise UsageError(f"{what} steps during every backward, so gradients cannot be accumulated over micro batches: "
                         f"give --micro_batch_size {run.global_batch_size} (the global batch), or a smaller "
                         "--global_batch_size; --micro_batch_size auto is refused for the same reason.")
    if run.precision == "16-mixed":
        raise UsageError(f"{what} steps on the gradients as they come, which 16-mixed's loss scaling leaves scaled (and "
                         "unchecked for overflow): use --precision bf16-mixed or bf16-true.")


def resolve_run(
    args: Any,
    config: Config,
    trainable: Trainable = "full",
    device_type: Optional[str] = None,
    present: Optional[bool] = None,
    world_size: Optional[int] = None,
    quantize: Optional[str] = None,
    checkpoint_dir: Optional[Path] = None,
) -> Run:
    """The one place a training run's flags are resolved. ``args``: the script's parsed flags (a TrainArgs).
    ``device_type``: where it runs; default: a GPU if there is one, or if ``--plan`` names a ``--device_memory``.
    ``present``: the run is for this machine (default: unless it is a ``--plan``); a plan may be for GPUs that
    are not here, and assumes ones with bfloat16. ``world_size`` and ``quantize`` override the flags (the
    planner's what-ifs). ``checkpoint_dir``: the checkpoint a fine-tune starts from, already verified."""
    if trainable not in TRAINABLE:
        raise UsageError(f"trainable={trainable!r}: use one of {TRAINABLE}.")
    planning = getattr(args, "plan", None) is not None
    present = not planning if present is None else present
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() or (planning and args.device_memory) else "cpu"
    quantize = quantize if quantize is not None else getattr(args, "quantize", None)
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise UsageError(f"Unknown --quantize {quantize!r}. Choose one of: {', '.join(QUANTIZE_MODES)}, or leave it out.")
    if quantize is not None and trainable == "full":
        raise UsageError(
            f"--quantize {quantize} freezes the base weights in low precision, so it works with LoRA/adapter "
            "fine-tuning (finetune/lora.py, finetune/adapter.py), not with full fine-tuning or pretraining."
        )
    precision = resolve_precision(args.precision, device_type, present)
    devices = resolve_devices(args.devices, device_type, present)
    num_nodes = int(args.num_nodes)
    if world_size is not None:  # a what-if for another number of processes, on one node
        devices, num_nodes = world_size, 1
    parallel = resolve_parallel_dims(args.strategy, devices, num_nodes, args.cpu_offload, args.sharding_strategy)
    auto = args.micro_batch_size == "auto"
    micro = 1 if auto else int(args.micro_batch_size)
    check_batch_sizes(args.global_batch_size, micro, devices * num_nodes)  # what the sampler would refuse
    if args.activation_checkpointing and args.activation_checkpointing_interval < 1:
        raise UsageError("--activation_checkpointing_interval must be >= 1 (1 = every block).")
    offloading = getattr(args, "activation_offloading", None)
    if offloading == "cpu" and device_type != "cuda":
        raise UsageError(
            "--activation_offloading cpu moves saved activations from GPU memory to host memory, but this run is on "
            "the CPU, where they already are. Use --activation_offloading disk to move them to files "
            "(--offload_dir, default OUT_DIR/activations), or drop the flag."
        )
    chunk_auto = args.loss_chunk_size == "auto"
    offload_dir = None
    if offloading == "disk":
        offload_dir = Path(getattr(args, "offload_dir", None) or Path(args.out_dir) / "activations")
    lora = LoRAConfig.from_flags(args) if trainable == "lora" else None
    adapter = None
    if trainable == "adapter":
        start = getattr(args, "adapter_start_layer", None)
        adapter = AdapterConfig(getattr(args, "adapter_prompt_length", AdapterConfig.prompt_length),
                                config.n_layer // 2 if start is None else int(start))  # default: the upper half
    freeze = args.freeze_layers
    run = Run(
        config=config,
        precision=precision,
        device_type=device_type,
        devices=devices,
        num_nodes=num_nodes,
        parallel=parallel,
        micro_batch_size=micro,
        global_batch_size=int(args.global_batch_size),
        seq_len=sequence_length(config, args.override_max_seq_length),
        forward_prefetch=bool(args.forward_prefetch),
        backward_prefetch=bool(args.backward_prefetch),
        timeout=float(args.timeout),
        micro_batch_auto=auto,
        trainable=trainable,
        lora=lora,
        adapter=adapter,
        quantize=quantize,
        freeze_layers=tuple(freeze) if isinstance(freeze, list) else freeze,
        ac_interval=int(args.activation_checkpointing_interval) if args.activation_checkpointing else 0,
        ac_selective=args.activation_checkpointing == "selective",
        activation_offloading=offloading,
        offload_dir=offload_dir,
        mlp_tiles=int(getattr(args, "mlp_tiles", 1)),
        loss_chunk_size=DEFAULT_LOSS_CHUNK_SIZE if chunk_auto else int(args.loss_chunk_size),
        loss_chunk_auto=chunk_auto,
        optimizer=args.optimizer,
        optimizer_rank=int(getattr(args, "optimizer_rank", DEFAULT_OPTIMIZER_RANK)),
        optimizer_in_backward=bool(getattr(args, "optimizer_in_backward", False)),
        eval_batch_size=args.eval_batch_size,
        grad_clip=resolve_grad_clip(args.grad_clip, args.optimizer, bool(getattr(args, "optimizer_in_backward", False))),
        compile=bool(args.compile),
        checkpoint_dir=checkpoint_dir,
        cuda_alloc_conf=cuda_alloc_conf(device_type),
        cpu_heap=resolve_cpu_heap(device_type),
        packing=bool(getattr(args, "packing", False)),
        preference=resolve_preference(args, trainable),
        grpo=resolve_grpo(args, trainable),
    )
    check_optimizer_run(run)
    return run


# Run attribute (a dotted path) -> how the user says it; attributes not here are not flags of their own
FLAG_OF = {
    "precision": "precision", "micro_batch_size": "micro_batch_size", "global_batch_size": "global_batch_size",
    "parallel.cpu_offload": "cpu_offload", "optimizer": "optimizer", "quantize": "quantize",
    "loss_chunk_size": "loss_chunk_size", "parallel.sharding_strategy": "sharding_strategy",
    "activation_offloading": "activation_offloading", "mlp_tiles": "mlp_tiles",
    "optimizer_in_backward": "optimizer_in_backward", "grad_clip": "grad_clip", "compile": "compile",
}


def changed_flags(old: Run, new: Run) -> dict[str, Any]:
    """The flags that turn ``old`` into ``new`` (the one rendering of a run's difference as flags)."""
    flags: dict[str, Any] = {}
    for attribute, flag in FLAG_OF.items():
        value = attrgetter(attribute)(new)
        if value != attrgetter(attribute)(old):
            flags[flag] = value
    if new.ac_interval != old.ac_interval or new.ac_selective != old.ac_selective:
        flags["activation_checkpointing"] = ("selective" if new.ac_selective else True) if new.ac_interval else False
        if new.ac_interval > 1 or old.ac_interval > 1:
            flags["activation_checkpointing_interval"] = max(new.ac_interval, 1)
    if new.world_size != old.world_size:
        flags["devices"] = new.devices
        if new.num_nodes != old.num_nodes:
            flags["num_nodes"] = new.num_nodes
    strategy, old_strategy = new.parallel.strategy_name, old.parallel.strategy_name
    # --cpu_offload alone turns on FSDP (auto)
    if strategy != old_strategy and not (new.parallel.fsdp and new.parallel.cpu_offload and not old.parallel.cpu_offload):
        flags["strategy"] = strategy if strategy != "single" else "auto"
    if new.seq_len != old.seq_len:
        flags["override_max_seq_length"] = new.seq_len
    return flags


def render_flags(flags: dict[str, Any]) -> list[str]:
    """``{"cpu_offload": True, "micro_batch_size": 2}`` -> ``["--cpu_offload", "--micro_batch_size 2"]``."""
    rendered = []
    for name, value in flags.items():
        if value is True:
            rendered.append(f"--{name}")
        elif value is False:
            rendered.append(f"--{name} false")
        else:
            rendered.append(f"--{name} {value}")
    return rendered
