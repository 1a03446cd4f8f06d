"""LoRA: low-rank adapters on a GPT's linear layers, also on bitsandbytes quantized ones (QLoRA).

A LoRA layer computes ``base(x) + scaling * B(A(dropout(x)))`` with ``A`` (r x in) and ``B`` (out x r, zero at
the start), ``scaling = alpha / r``. ``apply_lora`` turns the chosen layers into LoRA layers in place by
swapping their class for a subclass that adds the adapter (``LoRANLinear``, ``LoRALinear4bit``, ...), so the
base parameters keep their names (``blocks.0.attn.query.weight``) and a quantized base stays what it was; the
adapter parameters sit beside them (``blocks.0.attn.query.lora_A``). Only adapter parameters (and, on request,
the biases of the adapted layers) get gradients and optimizer state.

DoRA (``dora``, Liu et al. 2024, "Weight-Decomposed Low-Rank Adaptation") trains a magnitude per output feature
beside A and B: the layer computes ``m * (W + scaling * B @ A) x / ||W + scaling * B @ A||`` with the norm of each
output row (PEFT's ``DoraLinearLayer``: the paper's column-wise norm of the transposed weight). As the paper
suggests (section 4.3) and PEFT does, the norm is a constant for backward: it is computed without a graph each
forward (of a dequantized copy of a quantized weight), which costs one (out x in) weight's memory for a moment
and keeps nothing for backward. ``m`` starts as the base weight's row norms, so the layer starts as the base.

Merging adds ``scaling * B @ A`` to the base weights of a checkpoint directory (DoRA: and rescales each row to
its magnitude), in full precision, from the stored base weights (never from a quantized copy):

    python -m lit_model.lora merge --checkpoint_dir DIR    # DIR: base weights + lora.safetensors + lora.yaml
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
import yaml
from safetensors.torch import save_file

from lit_model.core.classes import mixed_class
from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.core.files import dataclass_from_yaml
from lit_model.io.checkpoint import (
    WEIGHTS_NAME, SafetensorsReader, check_adapter_weights, check_checkpoint_dir, check_output_dir,
    derive_checkpoint_dir, read_safetensors, verify_manifest, write_manifest,
)
from lit_model.kernels.ops import dropout_linear
from lit_model.kernels.policy import KernelPolicy, kernel_policy
from lit_model.methods.adapter import AdapterAttention
from lit_model.methods.quantize import dequantized_weight
from lit_model.model.contracts import Step
from lit_model.model.gpt import GPT

LORA_WEIGHTS = "lora.safetensors"
LORA_CONFIG = "lora.yaml"
# The adapter's own manifest: lora.safetensors' size and SHA-256, and lora.yaml's hyperparameters but ``merged``
# (the one field a user changes, to merge or use the adapter over other copies of its base weights)
LORA_MANIFEST = "lora.manifest.json"
# flag -> the module names (last parts of the qualified name) it adapts
TARGETS = {
    "query": ("attn.query",),
    "key": ("attn.key",),
    "value": ("attn.value",),
    "projection": ("attn.proj",),
    "mlp": ("mlp.fc_1", "mlp.fc_2", "mlp.fc", "mlp.proj"),
    "head": ("lm_head",),
}


@dataclass
class LoRAConfig:
    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.05
    query: bool = True
    key: bool = False
    value: bool = True
    projection: bool = False
    mlp: bool = False
    head: bool = False
    bias: bool = False  # also train the biases of the adapted layers
    dora: bool = False  # DoRA: a trained magnitude per output feature, the direction W + scaling * B @ A normalised
    merged: bool = False  # in a checkpoint directory: the weights beside this file already include the adapter

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or self.r <= 0:
            raise UsageError(f"--lora_r {self.r}: the LoRA rank must be a positive integer, e.g. --lora_r 8.")
        if self.alpha <= 0:
            raise UsageError(f"--lora_alpha {self.alpha} must be positive (the update is scaled by alpha / r).")
        if not 0 <= self.dropout < 1:
            raise UsageError(f"--lora_dropout {self.dropout} must be in [0, 1).")
        if not any(getattr(self, flag) for flag in TARGETS):
            raise UsageError(
                "No layer to adapt: turn on at least one of --lora_query, --lora_key, --lora_value, "
                "--lora_projection, --lora_mlp, --lora_head."
            )

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def targets(self, name: str) -> bool:
        name = re.sub(r"\.experts\.\d+", "", name)  # each expert of a mixture is an MLP (mlp.experts.3.fc_1: mlp.fc_1)
        return any(
            name == suffix or name.endswith("." + suffix)
            for flag, suffixes in TARGETS.items() if getattr(self, flag) for suffix in suffixes
        )

    def save(self, directory: Path) -> None:
        (Path(directory) / LORA_CONFIG).write_text(yaml.safe_dump(asdict(self), sort_keys=False))

    @classmethod
    def from_flags(cls, flags: object) -> "LoRAConfig":
        """From a script's ``lora_r``, ``lora_alpha``, ... flags."""
        return cls(**{f.name: getattr(flags, f"lora_{f.name}") for f in fields(cls) if hasattr(flags, f"lora_{f.name}")})

    @classmethod
    def from_dir(cls, directory: Path) -> "LoRAConfig":
        path = Path(directory) / LORA_CONFIG
        if not path.is_file():
            raise UserError(f"{directory} has no {LORA_CONFIG} (the LoRA hyperparameters); it is not a LoRA checkpoint.")
        return dataclass_from_yaml(cls, path, "the LoRA hyperparameters (r, alpha, ...)")

    def hyperparameters(self) -> dict[str, object]:
        """What the adapter's weights depend on: every field but ``merged``."""
        return {k: v for k, v in asdict(self).items() if k != "merged"}


class LoRALayer:
    """Mixed in before a linear layer class (nn.Linear, bnb Linear4bit/Linear8bitLt) by ``apply_lora``."""

    lora_A: nn.Parameter
    lora_B: nn.Parameter
    lora_magnitude: Optional[nn.Parameter]  # DoRA's, per output feature; None: plain LoRA
    kernel_policy: KernelPolicy  # the model's (apply_lora; GPT.set_kernel_policy later)
    lora_enabled = True  # False: the base layer alone (adapters_disabled)

    def _init_lora(self, config: LoRAConfig, dtype: torch.dtype) -> None:
        device = self.bias.device if self.bias is not None else self.weight.device
        self.lora_A = nn.Parameter(torch.empty(config.r, self.in_features, device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, config.r, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))  # as nn.Linear; B = 0 makes the start exact
        self.lora_dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.lora_scaling = config.scaling
        self.lora_magnitude = nn.Parameter(self.direction_norm().to(dtype)) if config.dora else None

    @torch.no_grad()
    def direction_norm(self) -> torch.Tensor:
        """DoRA's ``||W + scaling * B @ A||`` per output row, in fp32, outside the graph (a constant for backward)."""
        # a quantized weight dequantized: bitsandbytes' layers, or the planner's stand-in, which has its own method
        own = getattr(self, "dequantized_weight", None)
        weight = self.weight if self.weight.is_floating_point() else own() if own else dequantized_weight(self)
        direction = weight + (self.lora_B @ self.lora_A).to(weight.dtype) * self.lora_scaling
        return torch.linalg.vector_norm(direction, dim=1, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)  # type: ignore[misc]
        if not self.lora_enabled:
            return out
        p = self.lora_dropout.p if self.training and isinstance(self.lora_dropout, nn.Dropout) else 0.0
        low, factor = dropout_linear(x, self.lora_A, p, self.kernel_policy.unscaled_dropout)
        scaling = self.lora_scaling * factor
        if self.lora_magnitude is None and low.dtype == out.dtype:
            # one matrix product adds scaling * B @ low to the base output: no output-sized product, scaled copy and sum
            return torch.addmm(out.reshape(-1, out.size(-1)), low.reshape(-1, low.size(-1)), self.lora_B.t(),
                               alpha=scaling).view(out.shape)
        low_rank = F.linear(low, self.lora_B) * scaling
        if self.lora_magnitude is None:
            return out + low_rank.to(out.dtype)
        # DoRA: m / ||W + sBA|| * (W x + s B A x) + bias, written as the base output plus (scale - 1) * (W x + sBAx)
        # + sBAx: backward keeps one output-sized tensor for the magnitudes' gradient (PEFT's form keeps two), and
        # the start (scale exactly 1: the norm is cast to the magnitude's dtype; B = 0) adds exact zeros. Unlike
        # PEFT, with dropout the base term uses the base output on x (no second base matmul on the dropped-out x).
        scale = self.lora_magnitude / self.direction_norm().to(self.lora_magnitude.dtype)
        base = out if self.bias is None else out - self.bias
        return out + ((scale - 1) * (base + low_rank) + low_rank).to(out.dtype)

    # ---- memory contract (model/contracts.py) ------------------------------------------------
    @staticmethod
    def parameter_sizes(r: int, in_features: int, out_features: int, dora: bool) -> list[int]:
        """Element counts of A, B (and DoRA's magnitudes)."""
        return [r * in_features, out_features * r] + ([out_features] if dora else [])

    @staticmethod
    def memory_contract(step: Step, in_dim: int, out_dim: int, in_rg: bool) -> float:
        """Kept bytes per token of the branch on an input of ``in_dim`` channels (``in_rg``: it requires grad); the
        base layer's, and the input where the branch keeps it, are its neighbours' business (``gpt.BlockLinears``)."""
        dm = step.compute_bytes
        kept = float(step.lora_r * dm)  # A's output, kept by the B matmul
        if step.lora_dora:  # base + low-rank output, kept by its product with the magnitudes' scale
            kept += out_dim * step.param_bytes
        if step.lora_dropout > 0 and step.lora_keeps_input:
            kept += in_dim  # the boolean mask beside the input (BlockLinears counts the input once)
        elif step.lora_dropout > 0:
            kept += in_dim * dm  # dropout output (its half-precision cast under autocast), kept by the A matmul
            if in_rg:  # the boolean mask, kept for the input's gradient
                kept += in_dim
        elif step.autocast:
            kept += in_dim * dm  # the A matmul's own cast of its input
        return kept


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within this block ``model``'s LoRA layers compute their base layers alone, and its LLaMA-Adapter attention
    without the prefixes: the model before fine-tuning (the reference of preference training and GRPO, with no second
    copy of the weights)."""
    switches = [(module, "lora_enabled" if isinstance(module, LoRALayer) else "adapter_enabled")
                for module in model.modules() if isinstance(module, (LoRALayer, AdapterAttention))]
    for module, switch in switches:
        setattr(module, switch, False)
    try:
        yield
    finally:
        for module, switch in switches:
            delattr(module, switch)  # back to the class's True


def is_linear(module: nn.Module) -> bool:
    """nn.Linear or a bitsandbytes linear layer (which subclass it)."""
    return isinstance(module, nn.Linear) and not isinstance(module, LoRALayer)


def apply_lora(model: nn.Module, config: LoRAConfig, dtype: Optional[torch.dtype] = None) -> list[str]:
    """Turn the targeted linear layers of ``model`` into LoRA layers, freeze everything else; returns their
    names. ``dtype`` of the adapter weights: default the model's floating-point dtype."""
    if config.head and getattr(getattr(model, "config", None), "tie_embeddings", False):
        raise UsageError(
            "--lora_head with a model whose output head shares its weight with the embedding "
            f"({model.config.name}: tie_embeddings) cannot be merged into one weight afterwards. Leave --lora_head off."
        )
    dtype = dtype or next(p.dtype for p in model.parameters() if p.is_floating_point())
    model.requires_grad_(False)
    policy = model.kernel_policy if isinstance(model, GPT) else kernel_policy("cpu")  # unplaced: the CPU's, as GPT's
    names = []
    for name, module in model.named_modules():
        if is_linear(module) and config.targets(name):
            module.__class__ = mixed_class(LoRALayer, type(module), f"LoRA{type(module).__name__}")
            module._init_lora(config, dtype)
            module.kernel_policy = policy  # a bitsandbytes base holds none of its own
            if config.bias and module.bias is not None:
                module.bias.requires_grad_(True)
            names.append(name)
    if not names:
        raise UsageError(f"No linear layer of the model matches the LoRA targets {config}; check the --lora_* flags.")
    return names


def save_adapter(directory: Path, weights: dict[str, torch.Tensor], config: LoRAConfig) -> None:
    """``lora.safetensors``, ``lora.yaml`` and the adapter's manifest into ``directory``."""
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / LORA_WEIGHTS))
    config.save(directory)
    write_manifest(directory, [directory / LORA_WEIGHTS], name=LORA_MANIFEST, lora=config.hyperparameters())


def read_adapter(directory: Path, config: LoRAConfig, model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights of ``directory``, checked against its manifest (a directory without one: used with a
    note) and against the trainable parameters of ``model``, which ``apply_lora`` adapted with ``config``
    (``check_adapter_weights``)."""
    path = directory / LORA_WEIGHTS
    if not path.is_file():
        raise UserError(f"{directory} has {LORA_CONFIG} but no {LORA_WEIGHTS}; copy the adapter weights there.")
    manifest = verify_manifest(directory, LORA_MANIFEST)
    if manifest is not None and manifest.get("lora") != config.hyperparameters():
        raise UserError(
            f"{directory / LORA_CONFIG} holds other hyperparameters than the adapter was trained with ({LORA_MANIFEST}: "
            f"{manifest.get('lora')}). Restore lora.yaml from where the adapter was trained (only merged may change).")
    weights = read_safetensors(path)
    expected = {name: parameter.shape for name, parameter in model.named_parameters() if parameter.requires_grad}
    check_adapter_weights(path, weights, expected, LORA_CONFIG)
    return weights


def load_saved_lora(model: GPT, checkpoint_dir: Path) -> bool:
    """If ``checkpoint_dir`` carries an unmerged LoRA (``lora.yaml`` with ``merged: false`` beside
    ``lora.safetensors``), make ``model``'s targeted layers LoRA layers holding it (frozen, eval use): the model
    computes what the merged checkpoint would. Returns whether it did; a merged LoRA (a LoRA run's final/) is in the
    weights already."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / LORA_CONFIG).is_file():
        return False
    config = LoRAConfig.from_dir(checkpoint_dir)
    if config.merged:
        return False
    apply_lora(model, config, dtype=model.embed.weight.dtype)
    weights = read_adapter(checkpoint_dir, config, model)
    for name, tensor in weights.items():  # each copied to its layer's device (blocks may sit on several GPUs)
        model.get_parameter(name).data.copy_(tensor)
    model.requires_grad_(False)
    return True


@dataclass(frozen=True)
class LoRAWeights:
    """An unmerged LoRA held beside a base model without changing it (``read_lora``); ``use_lora`` switches the
    model to it. Several of them share one copy of the base weights (serving ``base:adapter`` models)."""

    config: LoRAConfig
    weights: dict[str, torch.Tensor]  # lora_A / lora_B (/ lora_magnitude) by parameter name, on their layers' devices


def read_lora(directory: Path, model: GPT) -> LoRAWeights:
    """The LoRA saved in ``directory`` (lora.yaml + lora.safetensors, merged or not: its weights are the update),
    checked against ``model``'s architecture, on the devices and in the dtype of the layers it adapts."""
    config = LoRAConfig.from_dir(directory)
    if config.bias:
        raise UserError(
            f"{directory / LORA_CONFIG} trains the adapted layers' biases (bias: true), which replace the shared base "
            "model's. Merge it (lit-model merge) and serve the merged checkpoint with its own --checkpoint_dir.")
    shaped = GPT.on_meta(model.config)  # the adapted layers' shapes, no memory; model itself stays as it is
    apply_lora(shaped, config)
    weights = read_adapter(Path(directory), config, shaped)
    dtype = model.embed.weight.dtype
    placed = {name: tensor.to(model.get_submodule(name.rsplit(".", 1)[0]).weight.device, dtype)
              for name, tensor in weights.items()}
    return LoRAWeights(config, placed)


def use_lora(model: GPT, adapter: Optional[LoRAWeights]) -> None:
    """Make ``model`` compute with ``adapter`` (None: the base alone) by pointing its LoRA layers at the adapter's
    tensors; the base weights are never copied or changed, so switching is cheap and exact."""
    for name, module in model.named_modules():
        targeted = adapter is not None and isinstance(module, nn.Linear) and adapter.config.targets(name)
        if targeted and not isinstance(module, LoRALayer):
            module.__class__ = mixed_class(LoRALayer, type(module), f"LoRA{type(module).__name__}")
            module.kernel_policy = model.kernel_policy
            module.lora_dropout = nn.Identity()  # inference: no dropout
        if not isinstance(module, LoRALayer):
            continue
        module.lora_enabled = targeted
        if targeted:
            module.lora_A = nn.Parameter(adapter.weights[f"{name}.lora_A"], requires_grad=False)
            module.lora_B = nn.Parameter(adapter.weights[f"{name}.lora_B"], requires_grad=False)
            magnitude = adapter.weights.get(f"{name}.lora_magnitude")
            module.lora_magnitude = None if magnitude is None else nn.Parameter(magnitude, requires_grad=False)
            module.lora_scaling = adapter.config.scaling


def merge_state_dict(base: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], config: LoRAConfig) -> dict[str, torch.Tensor]:
    """Base weights with the adapter added (in fp32, stored back in each weight's dtype; DoRA: each row scaled to
    its trained magnitude); trained biases replace the base ones. ``base`` and its adapted weights are changed in
    place; returns ``base``."""
    prefixes = sorted({name[: -len(".lora_A")] for name in lora if name.endswith(".lora_A")})
    for prefix in prefixes:
        weight_name = f"{prefix}.weight"
        if weight_name not in base or f"{prefix}.lora_B" not in lora:
            raise UserError(f"The LoRA weights adapt {prefix!r}, which the base weights do not have ({weight_name}).")
        weight = base[weight_name]
        delta = (lora[f"{prefix}.lora_B"].float() @ lora[f"{prefix}.lora_A"].float()) * config.scaling
        if delta.shape != weight.shape:
            raise UserError(f"LoRA update for {weight_name} has shape {tuple(delta.shape)}, the weight {tuple(weight.shape)}.")
        merged = weight.float() + delta
        magnitude = lora.get(f"{prefix}.lora_magnitude")
        if magnitude is not None:
            merged = merged * (magnitude.float() / torch.linalg.vector_norm(merged, dim=1))[:, None]
        weight.copy_(merged)  # in place: a new bf16 tensor per layer would leave the old one's hole on the heap
        if not torch.isfinite(weight).all():
            raise UserError(f"Merging the LoRA update into {weight_name} gives NaN or infinite values (in "
                            f"{weight.dtype}); nothing was written. Use an earlier checkpoint of the adapter.")
    for name, tensor in lora.items():
        if not name.endswith((".lora_A", ".lora_B", ".lora_magnitude")):  # a trained bias
            if name not in base:
                raise UserError(f"The LoRA weights hold {name!r}, which the base weights do not have.")
            base[name] = tensor.to(base[name].dtype)
    return base


def save_merged_checkpoint(
    base_dir: Path, lora: dict[str, torch.Tensor], config: LoRAConfig, out_dir: Path,
    write_extra: Optional[Callable[[Path], None]] = None, skip: tuple[str, ...] = (), overwrite: bool = False,
) -> Path:
    """Write ``out_dir`` (atomically): ``base_dir``'s files with its weights merged with ``lora`` in full
    precision, and the adapter weights + hyperparameters (``merged: true``) beside them. A non-empty ``out_dir``
    is replaced only with ``overwrite``."""
    with SafetensorsReader(check_checkpoint_dir(base_dir) / WEIGHTS_NAME) as file:
        merged = merge_state_dict({name: file.read(name) for name in file.shapes}, lora, config)

    def write_adapter(directory: Path) -> None:
        save_adapter(directory, lora, LoRAConfig(**{**asdict(config), "merged": True}))
        if write_extra is not None:
            write_extra(directory)

    return derive_checkpoint_dir(base_dir, out_dir, merged, write_adapter,
                                 skip=(LORA_WEIGHTS, LORA_CONFIG, LORA_MANIFEST, *skip), overwrite=overwrite)


def merge(checkpoint_dir: Path, out_dir: Optional[Path] = None, overwrite: bool = False) -> Path:
    """Merge ``checkpoint_dir/lora.safetensors`` into its base weights, in place (what the command is asked to do
    with the directory it names) or into ``out_dir``, which must be new or empty unless ``overwrite``, and neither
    hold ``checkpoint_dir`` nor lie inside it. Everything is checked before anything heavy is read."""
    checkpoint_dir = check_checkpoint_dir(checkpoint_dir)
    out_dir = checkpoint_dir if out_dir is None else Path(out_dir)
    in_place = out_dir.resolve() == checkpoint_dir.resolve()
    check_output_dir(out_dir, overwrite or in_place, inputs=(checkpoint_dir,))
    config = LoRAConfig.from_dir(checkpoint_dir)
    if config.merged:
        raise UserError(
            f"{checkpoint_dir}/{LORA_CONFIG} says its weights are already merged (a LoRA run's final/ is). Use the "
            f"directory as it is, or merge into the original base weights: copy {LORA_WEIGHTS}, {LORA_CONFIG} (with "
            f"merged: false) and {LORA_MANIFEST} next to them."
        )
    model = GPT.on_meta(Config.from_checkpoint(checkpoint_dir))  # the adapted layers' shapes, no memory
    apply_lora(model, config)
    lora = read_adapter(checkpoint_dir, config, model)
    return save_merged_checkpoint(checkpoint_dir, lora, config, out_dir, overwrite=overwrite or in_place)


def cli(argv: list[str]) -> None:
    """``python -m lit_model.lora merge ...``"""
    parser = argparse.ArgumentParser(prog="python -m lit_model.lora", description="LoRA utilities")
    commands = parser.add_subparsers(dest="command", required=True)
    merge_parser = commands.add_parser("merge", help="merge lora.safetensors into the base weights of a checkpoint dir")
    merge_parser.add_argument("--checkpoint_dir", type=Path, required=True, help="base weights + lora.safetensors + lora.yaml")
    merge_parser.add_argument("--out_dir", type=Path, default=None, help="write the merged checkpoint here (default: in place)")
    merge_parser.add_argument("--overwrite", action="store_true", help="replace --out_dir if it exists and is not empty")
    args = parser.parse_args(argv)
    out = merge(args.checkpoint_dir, args.out_dir, args.overwrite)
    print(f"Merged the LoRA weights into {out} (generate: python generate/base.py --checkpoint_dir {out})")

