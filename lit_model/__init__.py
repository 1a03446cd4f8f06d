"""lit-model: pretrain, fine-tune and run GPT-style language models without losing a run to OOM."""

from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.model.gpt import GPT

__all__ = ["Config", "GPT", "UsageError", "UserError"]
