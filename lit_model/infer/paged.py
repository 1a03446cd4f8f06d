"""The paged KV cache (vLLM's paged attention, in PyTorch): each layer's keys and values live in one pool of
fixed-size blocks; a sequence holds a table of the blocks it has written, so the memory a batch takes follows the
tokens its sequences really hold, not batch x the longest length. Requests of different lengths share one pool and
leave it block by block (infer/batching.py schedules them).

Keys and values are stored in the compute dtype, or quantized (``int8``, or ``fp8`` e4m3) with one scale per block
and key head: a block's scale only grows (a new token larger than what the block holds rescales the block's stored
values once), so a block's values never clip.

On every device the read is a gather of the batch's blocks into (batch, key heads, positions, head size) followed by
the attention kernel the policy picks, masked per row by position: the blocks past a row's length are masked out."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from lit_model.core.config import Config
from lit_model.core.errors import UsageError
from lit_model.model.gpt import GPT, attention_mask

# --kv_cache_dtype: how keys and values are stored ("auto": the compute dtype)
KV_DTYPES: dict[str, Optional[torch.dtype]] = {
    "auto": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
QUANTIZED_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}  # the largest magnitude each stores
SCALE_DTYPE = torch.float32
DEFAULT_BLOCK_SIZE = 16  # vLLM's default: small enough that a sequence wastes at most 15 positions


@dataclass(frozen=True)
class PoolSpec:
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_dtype: str = "auto"


def storage_dtype(kv_dtype: str, compute_dtype: torch.dtype) -> torch.dtype:
    if kv_dtype not in KV_DTYPES:
        raise UsageError(f"--kv_cache_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}.")
    return KV_DTYPES[kv_dtype] or compute_dtype


def block_bytes(config: Config, block_size: int, kv_dtype: str, compute_dtype: torch.dtype) -> int:
    """Bytes of one block in every layer: keys and values of ``block_size`` positions (+ a quantized block's scale
    per key head)."""
    dtype = storage_dtype(kv_dtype, compute_dtype)
    values = 2 * block_size * config.n_query_groups * config.head_size * dtype.itemsize
    scales = 2 * config.n_query_groups * SCALE_DTYPE.itemsize if dtype in QUANTIZED_MAX else 0
    return config.n_layer * (values + scales)


def read_bytes(config: Config, batch: int, positions: int, kv_dtype: str, compute_dtype: torch.dtype) -> int:
    """The transient of one layer's read in a step of ``batch`` sequences whose longest holds ``positions``: the
    gathered keys and values in the compute dtype (+ the gathered stored values and their scales where quantized,
    before they are dequantized), and the boolean mask. What the plan adds to a step's activations."""
    dtype = storage_dtype(kv_dtype, compute_dtype)
    elements = 2 * batch * positions * config.n_query_groups * config.head_size
    stored = elements * dtype.itemsize + elements // config.head_size * compute_dtype.itemsize if (
        dtype in QUANTIZED_MAX) else 0
    return elements * compute_dtype.itemsize + stored + batch * positions


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


class BlockPool:
    """Which blocks are free, and the block tables of the batch the model runs now (``bind``), shared by the layers'
    caches. Block ids index the same block in every layer."""

    def __init__(self, spec: PoolSpec) -> None:
        if spec.num_blocks < 1 or spec.block_size < 1:
            raise UsageError(f"A KV cache pool needs at least one block of at least one position, not {spec}.")
        self.spec = spec
        self.free: list[int] = list(range(spec.num_blocks - 1, -1, -1))  # a stack: the lowest ids go first
        self.tables: dict[torch.device, torch.Tensor] = {}

    @property
    def free_blocks(self) -> int:
        return len(self.free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise ValueError(f"{count} blocks asked, {len(self.free)} free")
        return [self.free.pop() for _ in range(count)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))

    def bind(self, tables: list[list[int]]) -> None:
        """The block tables (one row per sequence of the next forward, padded with block 0: past a row's length
        its positions are masked)."""
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        read = (table[:, :, None] * self.spec.block_size + torch.arange(self.spec.block_size)).reshape(-1)
        self.tables = {torch.device("cpu"): (table, read)}

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The bound tables (rows, blocks) on ``device``, and the slots a forward reads: every row's blocks in order."""
        if device not in self.tables:  # the layers on a GPU read their own copy, made once per forward
            self.tables[device] = tuple(x.to(device) for x in next(iter(self.tables.values())))
        return self.tables[device]


class PagedKVCache(nn.Module):
    """One layer's keys and values in ``pool``'s blocks: ``update`` writes a batch's new positions through the
    bound block tables and returns every row's positions so far, with the mask of each row's own positions."""

    def __init__(self, pool: BlockPool, config: Config, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.pool, self.block_size = pool, pool.spec.block_size
        slots = pool.spec.num_blocks * self.block_size
        shape = (slots, config.n_query_groups, config.head_size)
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.quantized_max = QUANTIZED_MAX.get(dtype)
        if self.quantized_max is not None:
            scales = (pool.spec.num_blocks, config.n_query_groups)
            self.register_buffer("k_scale", torch.zeros(scales, device=device, dtype=SCALE_DTYPE), persistent=False)
            self.register_buffer("v_scale", torch.zeros(scales, device=device, dtype=SCALE_DTYPE), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, input_pos_maxp1: Optional[int],
               sliding_window: Optional[int]) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        """``input_pos`` (B, T): each row's positions; ``k``, ``v`` (B, key heads, T, head size)."""
        B, heads, T, size = k.shape
        table, read = self.pool.table(self.k.device)
        block_of = table.gather(1, input_pos // self.block_size)
        slots = (block_of * self.block_size + input_pos % self.block_size).reshape(-1)
        new_k, new_v = (x.transpose(1, 2).reshape(B * T, heads, size) for x in (k, v))
        if self.quantized_max is None:
            self.k.index_copy_(0, slots, new_k.to(self.k.dtype))
            self.v.index_copy_(0, slots, new_v.to(self.v.dtype))
            keys, values = self.k.index_select(0, read), self.v.index_select(0, read)
        else:
            keys = self._write_quantized(self.k, self.k_scale, slots, new_k, read, k.dtype)
            values = self._write_quantized(self.v, self.v_scale, slots, new_v, read, k.dtype)
        positions = table.size(1) * self.block_size
        keys, values = (x.view(B, positions, heads, size).transpose(1, 2) for x in (keys, values))
        return keys, values, attention_mask(input_pos, positions, sliding_window)

    def _write_quantized(self, data: torch.Tensor, scale: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                         read: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Store ``x`` (N, heads, size) at ``slots``; return the slots ``read``, dequantized to ``dtype``. A block's
        scale covers the largest value it holds: where new values exceed it, its stored values are rescaled."""
        bs, q = self.block_size, self.quantized_max
        blocks = slots // bs
        scale[blocks[slots % bs == 0]] = 0  # a block written from its first position starts afresh (a new owner)
        largest = x.abs().amax(-1).to(SCALE_DTYPE) / q  # (N, heads)
        grown = scale.scatter_reduce(0, blocks[:, None].expand_as(largest), largest, "amax")
        touched = blocks.unique()
        old, new = scale[touched], grown[touched]
        ratio = torch.where(new > 0, old / new, torch.zeros_like(new))
        by_block = data.view(scale.size(0), bs, *data.shape[1:])
        by_block[touched] = quantize(by_block[touched].to(SCALE_DTYPE) * ratio[:, None, :, None], data.dtype, q)
        scale[touched] = new
        data[slots] = quantize(x.to(SCALE_DTYPE) / new_or_one(grown[blocks])[..., None], data.dtype, q)
        # dequantized in the compute dtype, in place: the read's transient is its stored and its compute copy
        return data.index_select(0, read).to(dtype).mul_(scale[read // bs].to(dtype)[..., None])


def new_or_one(scale: torch.Tensor) -> torch.Tensor:
    """Divide by the scale; a block of zeros has scale 0 and stores zeros."""
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def quantize(x: torch.Tensor, dtype: torch.dtype, largest: float) -> torch.Tensor:
    x = x.clamp(-largest, largest)
    return (x.round() if dtype == torch.int8 else x).to(dtype)


def set_paged_cache(model: GPT, pool: BlockPool, dtype: torch.dtype) -> None:
    """Every layer's cache in ``pool``'s blocks, on the device of its weights."""
    for block in model.blocks:
        block.attn.kv_cache = PagedKVCache(pool, model.config, block.attn.proj.weight.device, dtype)
