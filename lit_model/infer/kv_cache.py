"""The KV cache of generation: exactly the positions a call needs (prompt + new tokens), each block's cache on the
device of its weights, so memory grows with --max_new_tokens, never with the block size."""

from __future__ import annotations

from typing import Optional

import torch

from lit_model.model.gpt import GPT, KVCache


def set_kv_cache(model: GPT, batch_size: int, max_length: int, dtype: Optional[torch.dtype] = None) -> None:
    """Preallocate exactly ``max_length`` positions, each block's cache on the device of its weights."""
    if max_length > model.max_seq_length:
        model.set_kv_cache(batch_size, max_length)  # raises the model's "exceeds the context" error
    dtype = dtype or model.embed.weight.dtype
    for block in model.blocks:
        block.attn.kv_cache = KVCache(batch_size, model.config, max_length, block.attn.proj.weight.device, dtype)


def kv_cache_nbytes(model: GPT) -> int:
    return sum(
        buf.numel() * buf.element_size()
        for block in model.blocks
        if block.attn.kv_cache is not None
        for buf in (block.attn.kv_cache.k, block.attn.kv_cache.v)
    )


def kv_cache_shape(model: GPT) -> Optional[tuple[int, int]]:
    """(batch size, positions) of the allocated cache, or None."""
    cache = model.blocks[0].attn.kv_cache
    return None if cache is None else (cache.k.size(0), cache.k.size(2))
