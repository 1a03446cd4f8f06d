"""The reward of vs_peers.py's GRPO rows, loaded by both sides (lit-model's --reward FILE:distinct, TRL's
reward_funcs): the fraction of a completion's tokens that are distinct. It differs between a group's completions
(a length reward would not: the benchmark's base model writes to the length limit), so the advantages are not zero."""

from __future__ import annotations

from typing import Any, Sequence


def distinct(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
             **fields: Any) -> list[float]:
    return [len(set(ids)) / max(len(ids), 1) for ids in completion_ids]
