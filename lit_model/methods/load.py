"""A GPT from a checkpoint directory: its config, its weights and the adapter (or unmerged LoRA) saved beside them.
It sits above model/, io/ and methods/ because it needs all three; the model itself reads no files."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from lit_model.core.config import Config
from lit_model.io.checkpoint import check_checkpoint_dir, load_model_weights
from lit_model.methods.adapter import load_saved_adapter
from lit_model.methods.lora import load_saved_lora
from lit_model.model.gpt import GPT


def load_gpt(checkpoint_dir: str | Path, device: str | torch.device = "cpu", dtype: Optional[torch.dtype] = None,
             **config_overrides: Any) -> GPT:
    """Build on the meta device and assign the stored tensors, so only one copy of the weights is ever in memory;
    a LLaMA-Adapter checkpoint's prefixes and an unmerged LoRA are attached. In eval mode."""
    checkpoint_dir = check_checkpoint_dir(checkpoint_dir)
    config = Config.from_checkpoint(checkpoint_dir, **config_overrides)
    model = GPT.on_meta(config)
    load_model_weights(model, checkpoint_dir, device=device, dtype=dtype)
    load_saved_adapter(model, checkpoint_dir)
    load_saved_lora(model, checkpoint_dir)
    model.reset_rope_cache(torch.device(device))
    return model.eval()
