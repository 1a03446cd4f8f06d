"""The plan of a server (`lit-model serve --plan`): the model's memory (``plan_generation``'s, without its KV cache),
the paged KV cache pool that ``--kv_cache_memory`` leaves room for, and how many sequences of a given length it holds
at once, with the flag changes that hold more."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Optional

from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.core.precision import PRECISION_DTYPES
from lit_model.core.units import format_bytes, parse_memory
from lit_model.infer.paged import block_bytes, blocks_for, read_bytes
from lit_model.plan.generation import plan_generation
from lit_model.run import render_flags

SEQUENCE_LENGTHS = (512, 2048)  # besides the model's whole context
# A decoding step gathers its sequences' keys and values, padded to the longest: the plan keeps room for a full batch
# of this many positions each (a typical mix; longer ones are fewer, and an out-of-memory step preempts sequences)
READ_POSITIONS = 2048


@dataclass(frozen=True)
class PoolMemory:
    """``--kv_cache_memory``: a fraction of the memory left after the model (like vLLM's gpu_memory_utilization),
    or bytes."""

    fraction: Optional[float] = None
    bytes: Optional[int] = None

    def of(self, left: int) -> int:
        return self.bytes if self.bytes is not None else int(self.fraction * left)


def parse_pool_memory(text: str) -> PoolMemory:
    try:
        fraction = float(text)
    except ValueError:
        return PoolMemory(bytes=parse_memory(text))
    if not 0 < fraction <= 1:
        raise UsageError(f"--kv_cache_memory {text}: a fraction of the memory left after the weights is in (0, 1], "
                         "e.g. 0.5; or give bytes with a unit, e.g. 8GB.")
    return PoolMemory(fraction=fraction)


@dataclass(frozen=True)
class ServeSuggestion:
    flags: str
    sequences: dict[int, int]  # concurrent sequences of each length with this change


@dataclass(frozen=True)
class ServePlan:
    model: str
    precision: str
    quantize: Optional[str]
    kv_cache_dtype: str
    block_size: int
    device_type: str
    device_memory: Optional[int]
    model_bytes: int  # weights, a step's activations, the framework's overhead
    read_bytes: int  # a decoding step's read of the cache (READ_POSITIONS per sequence): also before the pool
    pool_bytes: int
    num_blocks: int
    bytes_per_token: float  # of one sequence, every layer's keys and values
    sequences: dict[int, int]  # length -> sequences of that length the pool holds at once
    max_batch: int
    suggestions: list[ServeSuggestion] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.num_blocks > 0

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "fits": self.fits}, indent=2)

    def to_text(self) -> str:
        memory = "unknown" if self.device_memory is None else format_bytes(self.device_memory)
        quantized = f", {self.quantize}" if self.quantize else ""
        lines = [
            f"Serving plan: {self.model}, {self.precision}{quantized}, KV cache {self.kv_cache_dtype} in blocks of "
            f"{self.block_size} positions",
            f"  device memory:        {memory} ({self.device_type})",
            f"  model:                {format_bytes(self.model_bytes)} (weights, a step's activations, overhead)",
            f"  reading the cache:    {format_bytes(self.read_bytes)} (a step of --max_batch {self.max_batch} sequences of "
            f"up to {READ_POSITIONS} positions)",
            f"  KV cache pool:        {format_bytes(self.pool_bytes)} = {self.num_blocks} blocks",
            f"  per sequence-token:   {self.bytes_per_token:,.0f} bytes",
            "  concurrent sequences: " + ", ".join(f"{n} of {length} tokens" for length, n in self.sequences.items())
            + f" (at most --max_batch {self.max_batch} decode at once; a request beyond the whole pool is refused)",
        ]
        if self.suggestions:
            lines.append("More concurrent sequences with:")
            lines += [f"  {s.flags}: " + ", ".join(f"{n} of {length}" for length, n in s.sequences.items())
                      for s in self.suggestions]
        return "\n".join(lines)


def plan_serving(config: Config, precision: str, quantize: Optional[str], pool: PoolMemory, kv_cache_dtype: str,
                 block_size: int, max_batch: int, device_memory: Optional[str], device_type: str, devices: int = 1,
                 suggest: bool = True) -> ServePlan:
    """The server's memory: the model's is ``plan_generation``'s for one short sequence without its KV cache; a
    step's read of the cache is ``paged.read_bytes`` for ``max_batch`` sequences of READ_POSITIONS (at most the
    context); the pool is ``pool`` of what is left after both (with bytes: those)."""
    dtype, autocast = PRECISION_DTYPES[precision]
    base = plan_generation(config, 1, 1, 1, precision, quantize, device_memory, device_type, devices=devices)
    read = read_bytes(config, max_batch, min(READ_POSITIONS, config.block_size), kv_cache_dtype, autocast or dtype)
    model_bytes = base.peak_bytes - base.by_category.get("kv_cache", 0)
    left = max(0, (base.device_memory or 0) - model_bytes - read)
    pool_bytes = pool.of(left) if pool.bytes is not None or base.device_memory is not None else 0
    per_block = block_bytes(config, block_size, kv_cache_dtype, autocast or dtype)
    num_blocks = pool_bytes // per_block
    lengths = sorted({*(n for n in SEQUENCE_LENGTHS if n < config.block_size), config.block_size})
    plan = ServePlan(config.name, precision, quantize, kv_cache_dtype, block_size, device_type, base.device_memory,
                     model_bytes, read, pool_bytes, num_blocks, per_block / block_size,
                     {n: num_blocks // blocks_for(n, block_size) for n in lengths}, max_batch)
    if not suggest:
        return plan
    options: list[dict[str, Any]] = []
    if quantize is None and device_type == "cuda":
        options.append({"quantize": "bnb.nf4"})
    if kv_cache_dtype not in ("int8", "fp8"):
        options.append({"kv_cache_dtype": "int8"})
    if device_type == "cuda":
        options.append({"devices": devices * 2})
    suggestions = []
    for changes in options:
        other = plan_serving(config, precision, changes.get("quantize", quantize), pool,
                             changes.get("kv_cache_dtype", kv_cache_dtype), block_size, max_batch, device_memory,
                             device_type, changes.get("devices", devices), suggest=False)
        if other.num_blocks > num_blocks:
            suggestions.append(ServeSuggestion(" ".join(render_flags(changes)), other.sequences))
    return replace(plan, suggestions=suggestions)


def check_serve_plan_fits(plan: ServePlan) -> None:
    """``--plan``'s exit status: 1 when the pool holds no block and no suggestion gives it one."""
    if plan.fits or any(max(s.sequences.values(), default=0) > 0 for s in plan.suggestions):
        return
    raise UserError(
        f"No KV cache block fits: the model and a step's read of the cache take "
        f"{format_bytes(plan.model_bytes + plan.read_bytes)} of "
        f"{'unknown' if plan.device_memory is None else format_bytes(plan.device_memory)} and --kv_cache_memory leaves "
        "no room for one block of the pool (see the plan above). Pass --kv_cache_memory with bytes, a larger "
        "fraction, or a larger --device_memory."
    )
