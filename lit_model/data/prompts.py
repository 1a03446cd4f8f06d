"""Prompt data for GRPO: records of a prompt to complete, in TRL's forms: ``{"prompt": str}`` or conversational,
``"prompt"`` (or ``"messages"``) a list of ``{"role", "content"}`` messages ending with the user's; every other field
(``answer``, ...) is kept as it is for the rewards. A prompt is written in the run's prompt style, opening the
assistant's turn, and tokenized once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lit_model.core.errors import UsageError, UserError
from lit_model.data.instruct import split_records
from lit_model.data.sources import is_table, map_record, table_records
from lit_model.data.text import json_records
from lit_model.io.prompts import PromptStyle

PROMPT_EXAMPLE = '{"prompt": "...", "answer": "..."}'
PROMPT_KEYS = ("prompt", "messages")


@dataclass(frozen=True)
class Prompt:
    prompt: Any  # as the record gives it (a string or messages): what the rewards see
    text: str  # in the prompt style, opening the assistant's turn
    ids: np.ndarray  # the styled prompt's tokens
    fields: dict[str, Any] = field(default_factory=dict)  # the record's other fields


@dataclass
class PromptData:
    train: list[Prompt]
    val: list[Prompt]
    description: str
    sample_instruction: str  # what the end of a run answers: the first validation prompt, styled

    @property
    def longest(self) -> int:
        return max(len(p.ids) for p in (*self.train, *self.val))


def read_prompt_records(path: Path, fields: dict[str, str]) -> list[tuple[str, Any]]:
    """``(where, record)`` of a .json/.jsonl file, or of a .parquet/.csv file or save_to_disk directory, with every
    field as it is but those ``fields`` renames (the instruction loaders map fields to theirs and drop the rest)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"--data_path {path} does not exist. Pass a .json/.jsonl/.parquet/.csv file of prompt records "
                         f"like {PROMPT_EXAMPLE}.")
    if is_table(path):
        return table_records(None, path, fields, "prompts")[0]
    return [(where, map_record(record, fields, where, "prompts"))
            for where, record in json_records(path, PROMPT_EXAMPLE)]


def prompt_text(record: Any, where: str, style: PromptStyle) -> tuple[Any, str, dict[str, Any]]:
    """The record's prompt (as given), its text in ``style`` and the record's other fields."""
    key = next((k for k in PROMPT_KEYS if isinstance(record, dict) and record.get(k)), None)
    if key is None:
        found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        raise UserError(f"{where} has {found}, but a prompt record needs a non-empty 'prompt' (a string, or a list of "
                        f"messages) or 'messages': {PROMPT_EXAMPLE}. Fix or drop the record.")
    prompt, fields = record[key], {k: v for k, v in record.items() if k not in PROMPT_KEYS}
    if isinstance(prompt, str):
        return prompt, style.apply(prompt), fields
    valid = isinstance(prompt, list) and all(
        isinstance(m, dict) and m.get("role") in ("system", "user", "assistant") and isinstance(m.get("content"), str)
        for m in prompt)
    if not valid or prompt[-1]["role"] != "user":
        raise UserError(f"{where}: a conversational prompt is a list of {{\"role\": \"system\"|\"user\"|\"assistant\", "
                        "\"content\": str}} messages ending with the user's, which the completions answer.")
    return prompt, style.apply_chat(prompt, add_generation_prompt=True), fields


def build_prompts(records: list[tuple[str, Any]], tokenizer: Any, style: PromptStyle, max_prompt_length: int
                  ) -> tuple[list[Prompt], int]:
    """The tokenized prompts, and how many were dropped as longer than ``max_prompt_length`` tokens."""
    prompts, dropped = [], 0
    for where, record in records:
        prompt, text, fields = prompt_text(record, where, style)
        ids = tokenizer.encode(text, bos=None).numpy().astype(np.int64)
        if len(ids) > max_prompt_length:
            dropped += 1
            continue
        prompts.append(Prompt(prompt, text, ids, fields))
    return prompts, dropped


def load_prompt_data(data_path: Optional[Path], tokenizer: Any, style: PromptStyle, max_prompt_length: int,
                     val_fraction: float = 0.05, seed: int = 42, data: Optional[str] = None,
                     fields: Optional[dict[str, str]] = None) -> PromptData:
    """Train/val prompts of a named hub dataset (``data``) or a local file, each at most ``max_prompt_length``
    tokens (the context less the completion's ``--max_new_tokens``): longer ones are dropped, and said so."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val_split_fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05.")
    if data is not None:
        records, source = table_records(data, None, fields or {}, "prompts")
    else:
        records, source = read_prompt_records(data_path, fields or {}), str(data_path)
    train_records, val_records = split_records(records, source, val_fraction, seed)
    train, train_dropped = build_prompts(train_records, tokenizer, style, max_prompt_length)
    val, val_dropped = build_prompts(val_records, tokenizer, style, max_prompt_length)
    dropped = train_dropped + val_dropped
    if not train or not val:
        raise UserError(f"No {'training' if not train else 'validation'} prompt fits {max_prompt_length} tokens, the "
                        f"context less --max_new_tokens ({dropped} were longer). Lower --max_new_tokens, raise "
                        "--override_max_seq_length (up to the model's block size), or shorten the prompts.")
    lengths = np.asarray([len(p.ids) for p in train])
    note = f"; {dropped} prompts longer than {max_prompt_length} tokens were dropped" if dropped else ""
    description = (f"{source}: {len(records)} records, {len(train)} train / {len(val)} val prompts in the "
                   f"{style.name!r} prompt style, {int(lengths.mean())} tokens on average (max {lengths.max()}){note}")
    return PromptData(train, val, description, val[0].text)

