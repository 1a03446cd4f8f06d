"""Sampling the next token: greedy, top-k, nucleus (top-p), from a seeded generator."""

from __future__ import annotations

from typing import Optional

import torch

from lit_model.core.errors import UsageError


def check_sampling(temperature: float, top_k: Optional[int], top_p: float, num_samples: int = 1) -> None:
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), not {temperature}.")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top_k must be at least 1 (or left out for no limit), not {top_k}.")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"--top_p must be in (0, 1] (1 = no nucleus filtering), not {top_p}.")
    if num_samples < 1:
        raise UsageError(f"--num_samples must be at least 1, not {num_samples}.")


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next tokens of shape (batch, 1) from logits (batch, vocab): greedy at temperature 0, else top-k, then
    nucleus (top-p) filtering and a draw from ``generator``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the more likely ones already cover top_p (the most likely one always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
