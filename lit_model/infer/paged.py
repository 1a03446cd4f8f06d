"""The paged KV cache (vLLM's paged attention, in PyTorch): each layer's keys and values live in one pool of
fixed-size blocks; a sequence holds a table of the blocks it has written, so the memory a batch takes follows the
tokens its sequences really hold, not batch x the longest length. Requests of different lengths share one pool and
leave it block by block (infer/batching.py schedules them).

Keys and values are stored in the compute dtype, or quantized (``int8``, or ``fp8`` e4m3) with one scale per block
and key head: a block's scale only grows (a new token larger than what the block holds rescales the block's stored
values once), so a block's values never clip.

On every device the read is a gather of the batch's blocks into (batch, key heads, positions, head size) followed by
the attention kernel the policy picks, masked per row by position: the blocks past a row's length are masked out. A
batch of one sequence whose blocks follow each other in the pool (a chat's conversation: the pool hands out its lowest
free blocks) reads them in place, without the gather's copy."""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
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
READ_POSITIONS = 2048  # positions per sequence a full batch's read is budgeted for (``read_budget``)


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


def read_budget(max_batch: int, context: int) -> int:
    """The positions, summed over its rows (each padded to the longest), that one decoding forward may read: ``max_batch``
    sequences of up to READ_POSITIONS positions, and at least one whole context. The engine splits a step whose
    batch would read more (infer/batching.py), so the plan can count this read (``read_bytes``) as the step's most."""
    return max(max_batch * min(READ_POSITIONS, context), context)


def blocks_for(tokens: int, block_size: int) -> int:
    return math.ceil(tokens / block_size)


def prefix_digests(tokens: Sequence[int], block_size: int, start: bytes = b"", first_block: int = 0) -> list[bytes]:
    """The digest of ``tokens`` up to the end of each full block from ``first_block`` on (``start``: the digest of the
    block before it): equal digests mean equal tokens from the sequence's start, so equal keys and values."""
    digests, digest = [], start
    for begin in range(first_block * block_size, len(tokens) - block_size + 1, block_size):
        block = np.asarray(tokens[begin:begin + block_size], dtype=np.int64).tobytes()
        digest = hashlib.sha256(digest + block).digest()
        digests.append(digest)
    return digests


class BlockPool:
    """Which blocks are free, and the block tables of the batch the model runs now (``bind``), shared by the layers'
    caches. Block ids index the same block in every layer.

    Prefix caching (vLLM's automatic prefix caching): a full block can be remembered under the digest of the tokens
    from the sequence's start to its end (``remember``); a later sequence that begins with the same tokens shares it
    (``share``) instead of computing it again. A block is written only while it is its writer's last, partial block,
    so a shared (full) block never changes. Blocks no sequence holds stay remembered while the pool has other free
    blocks; they are reused, least recently released first, only when the never-remembered ones are gone."""

    def __init__(self, spec: PoolSpec) -> None:
        if spec.num_blocks < 1 or spec.block_size < 1:
            raise UsageError(f"A KV cache pool needs at least one block of at least one position, not {spec}.")
        self.spec = spec
        self.free: list[int] = list(range(spec.num_blocks - 1, -1, -1))  # a stack: the lowest ids go first
        self.holders = [0] * spec.num_blocks  # sequences holding each block
        self.block_of_prefix: dict[bytes, int] = {}
        self.prefix_of_block: dict[int, bytes] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()  # remembered blocks no sequence holds, oldest first
        self.tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self.span: Optional[slice] = None  # the bound batch's slots, where they are one run of consecutive slots

    @property
    def free_blocks(self) -> int:
        return len(self.free) + len(self.idle)

    def allocate(self, count: int) -> list[int]:
        if count > self.free_blocks:
            raise ValueError(f"{count} blocks asked, {self.free_blocks} free")
        blocks = []
        for _ in range(count):
            if self.free:
                block = self.free.pop()
            else:  # the least recently released remembered block: its prefix is forgotten
                block = self.idle.popitem(last=False)[0]
                del self.block_of_prefix[self.prefix_of_block.pop(block)]
            self.holders[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: list[int]) -> None:
        unremembered = []
        for block in blocks:
            self.holders[block] -= 1
            if self.holders[block] == 0:
                if block in self.prefix_of_block:
                    self.idle[block] = None
                else:
                    unremembered.append(block)
        self.free.extend(reversed(unremembered))

    def share(self, prefixes: list[bytes]) -> list[int]:
        """The remembered blocks of the longest run of ``prefixes`` (digests, from the first block on), now also held
        by the caller."""
        blocks = []
        for prefix in prefixes:
            block = self.block_of_prefix.get(prefix)
            if block is None:
                break
            self.idle.pop(block, None)
            self.holders[block] += 1
            blocks.append(block)
        return blocks

    def remember(self, block: int, prefix: bytes) -> None:
        """``block`` is full and holds the last tokens of ``prefix`` (a digest; see ``prefix_digests``)."""
        if prefix not in self.block_of_prefix and block not in self.prefix_of_block:
            self.block_of_prefix[prefix], self.prefix_of_block[block] = block, prefix

    def forget_prefixes(self) -> None:
        """Drop every remembered prefix: the weights changed (another adapter), so the cached keys and values are not
        what the model would compute now."""
        self.free.extend(reversed(list(self.idle)))
        self.idle.clear()
        self.block_of_prefix.clear()
        self.prefix_of_block.clear()

    def bind(self, tables: list[list[int]]) -> None:
        """The block tables (one row per sequence of the next forward, padded with block 0: past a row's length
        its positions are masked)."""
        width = max(len(t) for t in tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        read = (table[:, :, None] * self.spec.block_size + torch.arange(self.spec.block_size)).reshape(-1)
        self.tables = {torch.device("cpu"): (table, read)}
        first = tables[0][0]
        consecutive = len(tables) == 1 and tables[0] == list(range(first, first + width))
        self.span = slice(first * self.spec.block_size, (first + width) * self.spec.block_size) if consecutive else None

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
            span = self.pool.span
            keys, values = ((self.k[span], self.v[span]) if span is not None else
                            (self.k.index_select(0, read), self.v.index_select(0, read)))
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
