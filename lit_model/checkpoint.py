"""Checkpoint directories: ``model.safetensors`` + ``model_config.yaml`` + tokenizer files.

Everything is written into a temporary sibling directory and renamed into place, so an interrupted save
never leaves a half-written checkpoint where a good one (or nothing) was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

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
    model: nn.Module, checkpoint_dir: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None
) -> None:
    """Assign the stored tensors to a (meta-device) model, checking names and shapes first."""
    checkpoint_dir = check_checkpoint_dir(checkpoint_dir)
    path = checkpoint_dir / WEIGHTS_NAME
    try:
        state_dict = load_file(str(path), device=str(device))
    except (SafetensorError, OSError) as error:
        raise UserError(f"Could not read {path}: {error}. The file is damaged; re-create or re-convert it.") from None
    if dtype is not None:
        for name, tensor in state_dict.items():
            if tensor.is_floating_point():
                state_dict[name] = tensor.to(dtype)
    check_state_dict(model, state_dict, source=str(path))
    model.load_state_dict(state_dict, strict=False, assign=True)
    if getattr(model.config, "tie_embeddings", False):
        model.lm_head.weight = model.embed.weight


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
