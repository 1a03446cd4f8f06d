"""The inference engine: a ``Generator`` holds a loaded model with its precision, sampling settings, seeded random
generator, decode step and KV cache, and generates for a batch of prompts; a ``ChatSession`` keeps a conversation in
its cache. generate/base.py, generate/chat.py and the end-of-run sample run through it (later: serving, evaluation,
rollouts)."""

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
from lit_model.infer.stream import TextStream
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


class ChatSession:
    """A multi-turn conversation whose tokens stay in the KV cache: each turn prefills only what the cache
    does not hold yet (the end of the previous reply and the new user turn), at the positions after it."""

    def __init__(self, generator: "Generator", tokenizer, style, max_length: int, system: Optional[str] = None,
                 stop: Sequence[str] = ()) -> None:
        self.generator, self.tokenizer, self.style, self.system = generator, tokenizer, style, system
        self.max_length = max_length
        self.stop_sequences = style.stop_tokens(tokenizer)
        self.stop_strings = [*style.stop_strings, *stop]
        generator.allocate(1, max_length)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the cache is overwritten from position 0 on the next turn)."""
        self.tokens: list[int] = []  # the whole conversation, token by token
        self.cached = 0  # self.tokens[:cached] are in the KV cache
        self.turns = 0
        self.last: Optional[Generation] = None
        self.last_start_pos = 0

    def turn_ids(self, message: str) -> list[int]:
        if self.turns == 0:
            return self.tokenizer.encode(self.style.turn(message, system=self.system)).tolist()
        return self.tokenizer.encode(self.style.next_turn(message), bos=False).tolist()

    def send(self, message: str, max_new_tokens: int, write: Optional[Callable[[str], object]] = None,
             notify: Callable[[str], object] = lambda text: None) -> str:
        """Answer ``message``; the reply streams through ``write``. A conversation that would overflow the
        context is started over with this message (``notify`` says so)."""
        first_ids = self.tokenizer.encode(self.style.turn(message, system=self.system)).tolist()
        if len(first_ids) + max_new_tokens > self.max_length:
            raise UserError(
                f"This message is {len(first_ids)} tokens long; with a reply of up to {max_new_tokens} tokens it "
                f"does not fit the context of {self.max_length} tokens. Send a shorter message (or pass a smaller "
                "--max_new_tokens or a larger --max_seq_length)."
            )
        new_ids = self.turn_ids(message) if self.turns else first_ids
        if self.turns and len(self.tokens) + len(new_ids) + max_new_tokens > self.max_length:
            notify(
                f"The conversation ({len(self.tokens)} tokens) plus this message ({len(new_ids)}) and a reply of up "
                f"to {max_new_tokens} tokens would not fit the context of {self.max_length} tokens; starting over "
                "with this message."
            )
            self.reset()
            new_ids = first_ids
        pending = torch.tensor(self.tokens[self.cached:] + new_ids, dtype=torch.long)
        stream = TextStream(self.tokenizer, self.stop_strings, context=(self.tokens + new_ids)[-4:], write=write)
        result = self.generator.generate(  # on an error (e.g. out of memory) the conversation stays as it was
            pending, max_new_tokens, eos_ids=self.tokenizer.eos_ids, stop_sequences=self.stop_sequences,
            on_token=lambda row, token: stream.add(token), start_pos=self.cached,
        )
        self.last_start_pos = self.cached
        self.tokens.extend(new_ids)
        reply = stream.finish()
        kept = result.tokens[0]
        reply_ids = self.tokenizer.encode(reply, bos=False).tolist() if stream.stopped else kept
        fed = result.steps - 1  # every sampled token but the last went through the model
        same = next((i for i, (a, b) in enumerate(zip(reply_ids, kept)) if a != b), min(len(reply_ids), len(kept)))
        self.cached = len(self.tokens) + min(same, fed)
        self.tokens.extend(reply_ids)
        self.turns += 1
        self.last = result
        return reply


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
