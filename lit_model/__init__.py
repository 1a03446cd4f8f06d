"""lit-model: pretrain, fine-tune and run GPT-style language models without losing a run to OOM."""

from typing import Any

__all__ = ["Config", "GPT", "UsageError", "UserError"]
_EXPORTS = {"Config": "lit_model.core.config", "GPT": "lit_model.model.gpt", "UsageError": "lit_model.core.errors",
            "UserError": "lit_model.core.errors"}


def __getattr__(name: str) -> Any:
    # Imported on first use, so `python -m lit_model.config` (or .convert) runs its module only once.
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'lit_model' has no attribute {name!r}")
