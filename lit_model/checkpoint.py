"""Checkpoint directories: ``model.safetensors`` + ``model_config.yaml`` + tokenizer files.

Everything is written into a temporary sibling directory and renamed into place, so an interrupted save
never leaves a half-written checkpoint where a good one (or nothing) was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from safetensors.torch import save_file

from lit_model.config import Config
from lit_model.errors import UserError

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "model_config.yaml"


@contextlib.contextmanager
def atomic_directory(final_dir: str | Path, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``final_dir`` only once the block finished."""
    final_dir = Path(final_dir)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        yield tmp_dir
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    if final_dir.exists():
        if not overwrite:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise UserError(f"{final_dir} already exists. Pass --overwrite to replace it.")
        old_dir = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
        os.replace(final_dir, old_dir)
        os.replace(tmp_dir, final_dir)
        shutil.rmtree(old_dir, ignore_errors=True)
    else:
        os.replace(tmp_dir, final_dir)


def lit_state_dict(model: nn.Module, config: Config) -> dict[str, torch.Tensor]:
    """The model's weights as stored on disk: tied head weights once, contiguous tensors."""
    state_dict = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        state_dict.pop("lm_head.weight", None)
    return state_dict


def save_weights(state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(directory / WEIGHTS_NAME))


def save_checkpoint_dir(
    state_dict: dict[str, torch.Tensor],
    config: Config,
    out_dir: str | Path,
    tokenizer_dir: Optional[str | Path] = None,
) -> Path:
    """Write weights, config and the tokenizer files atomically to ``out_dir``."""
    from lit_model.tokenizer import TOKENIZER_FILES

    out_dir = Path(out_dir)
    if config.tie_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    with atomic_directory(out_dir) as tmp_dir:
        save_weights(state_dict, tmp_dir)
        config.save(tmp_dir)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp_dir / name)
    return out_dir


def derive_checkpoint_dir(
    base_dir: str | Path,
    out_dir: str | Path,
    state_dict: Optional[dict[str, torch.Tensor]] = None,
    write_extra: Optional[Callable[[Path], None]] = None,
    skip: tuple[str, ...] = (),
) -> Path:
    """Write ``out_dir`` atomically from checkpoint ``base_dir``: its files (config, tokenizer, ...) except those
    named in ``skip``, ``state_dict`` as the weights (default: a copy of the base weights), then what
    ``write_extra(tmp_dir)`` adds. ``out_dir`` may be ``base_dir`` itself."""
    base_dir = check_checkpoint_dir(base_dir)
    with atomic_directory(out_dir) as tmp_dir:
        for path in sorted(base_dir.iterdir()):
            replaced = state_dict is not None and path.name == WEIGHTS_NAME
            if path.is_file() and path.name not in skip and not replaced:
                shutil.copy2(path, tmp_dir / path.name)
        if state_dict is not None:
            save_weights(state_dict, tmp_dir)
        if write_extra is not None:
            write_extra(tmp_dir)
    return Path(out_dir)


def check_checkpoint_dir(checkpoint_dir: str | Path, need_tokenizer: bool = False) -> Path:
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(
            f"Checkpoint directory {str(checkpoint_dir)!r} does not exist. Pass --checkpoint_dir with a directory "
            "made by pretrain/main.py, a finetune script, or `python -m lit_model.convert hf_to_lit`."
        )
    missing = [name for name in (WEIGHTS_NAME, CONFIG_NAME) if not (checkpoint_dir / name).is_file()]
    if need_tokenizer and not any((checkpoint_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model")):
        missing.append("tokenizer.json or tokenizer.model")
    if missing:
        present = sorted(p.name for p in checkpoint_dir.iterdir())
        hint = (
            " It looks like a Hugging Face checkpoint: convert it with `python -m lit_model.convert hf_to_lit "
            f"--hf_dir {checkpoint_dir} --out_dir <dir>`."
            if (checkpoint_dir / "config.json").is_file()
            else ""
        )
        raise UserError(
            f"{checkpoint_dir} is not a complete lit-model checkpoint: missing {', '.join(missing)} "
            f"(found: {', '.join(present) or 'nothing'}).{hint}"
        )
    return checkpoint_dir


def load_model_weights(
    model: nn.Module,
    checkpoint_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: Optional[torch.dtype] = None,
    devices: Optional[dict[str, torch.device]] = None,
    on_part: Optional[Callable[[str, nn.Module], None]] = None,
) -> None:
    """Assign the stored tensors to a (meta-device) model one part ("embed", "blocks.3", ...) at a time,
    each tensor cast straight to ``dtype`` and moved to its part's device (``devices``, else ``device``).
    Names and shapes are checked before anything is read; ``on_part`` runs after each part (quantization)."""
    path = check_checkpoint_dir(checkpoint_dir) / WEIGHTS_NAME
    devices = devices or {}
    tied = bool(getattr(model.config, "tie_embeddings", False))
    with SafetensorsReader(path) as file:
        check_state_dict(model, {n: torch.empty(s, device="meta") for n, s in file.shapes.items()}, source=str(path))
        for part_name, part in model_parts(model):
            prefix, part_device = part_name + ".", torch.device(devices.get(part_name, device))
            state: dict[str, torch.Tensor] = {}
            for name in file.shapes:
                if name.startswith(prefix):
                    tensor = file.read(name)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    state[name[len(prefix):]] = tensor.to(part_device)
            if tied and part_name == "lm_head":
                state["weight"] = model.embed.weight
            if not state:
                continue
            part.load_state_dict(state, strict=True, assign=True)
            del state
            if on_part is not None:
                on_part(part_name, part)


def model_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children, with ModuleLists split into their items ("blocks.0", "blocks.1", ...)."""
    parts = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            parts.extend((f"{name}.{i}", item) for i, item in enumerate(child))
        else:
            parts.append((name, child))
    return parts


class SafetensorsReader:
    """Reads one tensor of a .safetensors file at a time with plain file reads: unlike a memory map, the
    file's pages never count towards the process's memory, so peak RSS shows only the tensors kept."""

    DTYPES = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file = open(self.path, "rb")
            (length,) = struct.unpack("<Q", self.file.read(8))
            header = json.loads(self.file.read(length))
            header.pop("__metadata__", None)
            self.entries = {name: (self.DTYPES[e["dtype"]], e["shape"], *e["data_offsets"]) for name, e in header.items()}
        except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
            raise UserError(f"Could not read {self.path}: {error!r}. The file is damaged; re-create or re-convert it.") from None
        self.base = 8 + length
        self.shapes = {name: tuple(entry[1]) for name, entry in self.entries.items()}

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, start, end = self.entries[name]
        tensor = torch.empty(shape, dtype=dtype)
        buffer = tensor.reshape(-1).view(torch.uint8).numpy()
        self.file.seek(self.base + start)
        if end - start != buffer.nbytes or self.file.readinto(memoryview(buffer)) != buffer.nbytes:
            raise UserError(f"{self.path} is truncated or damaged at tensor {name!r}; re-create or re-convert it.")
        return tensor

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if getattr(model.config, "tie_embeddings", False):
        expected.pop("lm_head.weight", None)
    for name, tensor in state_dict.items():
        if name not in expected:
            raise UserError(f"{source} holds a tensor {name!r} that this model config has no place for.")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise UserError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)} but the model config expects "
                f"{tuple(expected[name])}. The weights and model_config.yaml belong to different models."
            )
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensors the model needs, e.g. {missing[:3]}.")
