"""The inference engine for one prompt: a ``Generator`` holds a loaded model with its precision, sampling settings,
seeded random generator, decode step (compiled with --compile) and contiguous KV cache, and generates for a prompt
and its samples. generate/base.py's single prompt and the end-of-run sample run through it; several prompts, chat,
serving, evaluation and rollouts run on the continuous-batching engine (infer/batching.py)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch

from lit_model.core.errors import UserError
from lit_model.core.units import format_bytes, peak_rss_bytes
from lit_model.infer.decode import Generation, Step, decode_step, generate
from lit_model.infer.kv_cache import set_kv_cache
from lit_model.infer.load import Precision
from lit_model.infer.sampling import make_generator
from lit_model.model.gpt import GPT


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.8  # 0: greedy
    top_k: Optional[int] = 50  # None: no limit
    top_p: float = 1.0  # 1: no nucleus filtering
    seed: int = 1234


class Generator:
    """A model ready to generate: ``precision`` (its autocast, and the KV cache's dtype), ``sampling`` (drawn from a
    generator seeded on the head's device) and the single-token step (compiled once with ``compile``)."""

    def __init__(self, model: GPT, precision: Precision, sampling: Sampling = Sampling(), compile: bool = False) -> None:
        self.model, self.precision, self.sampling = model, precision, sampling
        self.random = make_generator(sampling.seed, model.lm_head.weight.device)
        self.step: Step = decode_step(model, compile)

    def allocate(self, batch_size: int, max_length: int) -> None:
        """A KV cache for ``batch_size`` sequences of ``max_length`` positions, in the compute dtype."""
        with out_of_memory_hint("allocating the KV cache"):
            set_kv_cache(self.model, batch_size, max_length, self.precision.compute_dtype)

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, eos_ids: Sequence[int] = (),
                 stop_sequences: Sequence[Sequence[int]] = (),
                 on_token: Optional[Callable[[int, int], Optional[bool]]] = None, num_samples: int = 1,
                 start_pos: int = 0) -> Generation:
        """``decode.generate`` with this generator's settings, under its precision; running out of memory is told as
        such."""
        with out_of_memory_hint("generating"), self.precision.context(self.model.lm_head.weight.device.type):
            return generate(self.model, prompt_ids, max_new_tokens, self.sampling.temperature, self.sampling.top_k,
                            self.sampling.top_p, eos_ids, stop_sequences, on_token, num_samples, self.random,
                            start_pos, self.step)


def peak_memory_bytes(devices: Sequence[torch.device]) -> int:
    """CUDA: max_memory_reserved summed over the devices; CPU: the process's peak RSS."""
    if devices and devices[0].type == "cuda":
        return sum(torch.cuda.max_memory_reserved(d) for d in devices)

    return peak_rss_bytes()


def stats_line(result: Generation, devices: Sequence[torch.device]) -> str:
    tps = result.decode_tokens_per_sec
    total = sum(len(t) for t in result.tokens)
    rate = "n/a" if math.isnan(tps) else f"{tps:.2f}"
    return (
        f"time to first token: {result.time_to_first_token:.3f} s, decode: {rate} tokens/s "
        f"({total} tokens in {len(result.tokens)} sample(s)), peak memory: "
        f"{format_bytes(peak_memory_bytes(devices))}"
    )


@contextlib.contextmanager
def out_of_memory_hint(what: str) -> Iterator[None]:
    """Turn running out of (GPU or CPU) memory into a one-paragraph message with the flags that reduce it."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        raise UserError(
            f"Out of memory while {what}. Reduce --max_new_tokens or --num_samples (the KV cache grows with "
            "both), load the weights in 4 bits with --quantize bnb.nf4, or spread the blocks over more GPUs with "
            "--devices N."
        ) from None


def is_out_of_memory(error: BaseException) -> bool:
    """A GPU's out-of-memory error, or the CPU allocator's (a RuntimeError that says it could not allocate)."""
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError) and "can't allocate memory" in str(error))
