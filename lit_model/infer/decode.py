"""Prefill, decode one token, decode n (gpt-fast's split): ``forward_last`` runs a prompt (or one token) through
the cache and returns the last position's logits; ``decode_step`` is the single-token step (compiled once for static
shapes with ``compile``); ``generate`` samples up to n tokens for a batch, with stop tokens and sequences.

The decode step has static shapes ((batch, 1) tokens, a 1-element position tensor advanced in place), so it can be
``torch.compile``d once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from lit_model.core.config import Config
from lit_model.core.errors import UsageError
from lit_model.infer.kv_cache import kv_cache_shape, set_kv_cache
from lit_model.infer.sampling import sample
from lit_model.kernels.ops import decoding_kernels
from lit_model.model.gpt import GPT


def check_lengths(prompt_length: int, max_new_tokens: int, config: Config) -> int:
    """Return prompt + new tokens, or raise naming the limit (and the largest --max_new_tokens that fits)."""
    limit = config.block_size
    if max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be at least 1, not {max_new_tokens}.")
    if prompt_length >= limit:
        raise UsageError(
            f"The prompt is {prompt_length} tokens long, but {config.name or 'this model'} has a context of "
            f"{limit} tokens, which must also hold at least one new token. Shorten the prompt to at most "
            f"{limit - 1} tokens."
        )
    if prompt_length + max_new_tokens > limit:
        largest = limit - prompt_length
        raise UsageError(
            f"--max_new_tokens {max_new_tokens} does not fit: the prompt is {prompt_length} tokens and "
            f"{config.name or 'this model'} has a context of {limit} tokens, so at most {largest} new tokens fit. "
            f"Pass --max_new_tokens {largest} (or less), or shorten the prompt."
        )
    return prompt_length + max_new_tokens


def forward_last(
    model: GPT, idx: torch.Tensor, input_pos: torch.Tensor, input_pos_maxp1: Optional[int] = None
) -> torch.Tensor:
    """``model(idx, input_pos)[:, -1]`` (logits of shape (batch, vocab)) without the head over every prompt
    position; activations hop to the next device where consecutive blocks live on different GPUs.
    ``input_pos``: the positions (T,) of every row's tokens, or each row's own (batch, T) (a paged cache's batch of
    sequences of different lengths, infer/batching.py). ``input_pos_maxp1`` (``input_pos[-1] + 1``, positions
    shared by the rows) lets attention read only the filled part of the cache."""
    x = model.embed(idx.to(model.embed.weight.device))  # sampled on the head's device
    if model.config.scale_embeddings:
        x = x * torch.tensor(model.config.n_embd**0.5, dtype=x.dtype)
    # cast once here rather than in every block's apply_rope (the same values: apply_rope casts to this dtype)
    if input_pos.ndim == 1:
        cos = model.cos.index_select(0, input_pos).to(x.dtype)
        sin = model.sin.index_select(0, input_pos).to(x.dtype)
    else:  # (batch, 1, T, n_elem): broadcast over the heads
        cos, sin = model.cos[input_pos].unsqueeze(1).to(x.dtype), model.sin[input_pos].unsqueeze(1).to(x.dtype)
    for block in model.blocks:
        device = block.attn.proj.weight.device
        if x.device != device:
            x, cos, sin, input_pos = x.to(device), cos.to(device), sin.to(device), input_pos.to(device)
        x = block(x, cos, sin, input_pos, input_pos_maxp1)
    x = model.norm_f(x[:, -1:].to(model.norm_f.weight.device))
    return model.head(x.to(model.lm_head.weight.device))[:, -1]


Step = Callable[[GPT, torch.Tensor, torch.Tensor, int], torch.Tensor]


def decode_step(model: GPT, compile: bool = False) -> Step:
    """The single-token step ``(model, token, input_pos, input_pos_maxp1) -> logits``: ``forward_last``, or,
    when ``compile``, ``forward_last`` compiled once for static shapes (so over the whole cache, masked)."""
    if not compile:
        return forward_last
    compiled = torch.compile(forward_last, dynamic=False)

    def step(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor, input_pos_maxp1: int) -> torch.Tensor:
        return compiled(model, idx, input_pos)

    return step


@dataclass
class Generation:
    tokens: list[list[int]]  # per sample: the new tokens, without the eos / stop sequence that ended it
    steps: int  # tokens sampled per sample (the last one is never fed back through the model)
    end_pos: int  # start_pos + prompt length + steps - 1: the cache holds prompt and kept tokens before it
    time_to_first_token: float  # seconds: prefill + first sample
    decode_time: float  # seconds for steps 3.. (steps 2.. when there are only 2), timed after the first compiled call
    stopped: list[bool] = field(default_factory=list)  # ended by eos / a stop sequence / on_token

    @property
    def decode_tokens_per_sec(self) -> float:
        n = (self.steps - (2 if self.steps > 2 else 1)) * len(self.tokens)
        return n / self.decode_time if n and self.decode_time > 0 else float("nan")


@torch.inference_mode()
def generate(
    model: GPT,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    on_token: Optional[Callable[[int, int], Optional[bool]]] = None,
    num_samples: int = 1,
    generator: Optional[torch.Generator] = None,
    start_pos: int = 0,
    step: Step = forward_last,
) -> Generation:
    """Sample up to ``max_new_tokens`` tokens after ``prompt_ids`` for ``num_samples`` samples in one batch.

    ``prompt_ids`` is 1-D (shared by every sample) or (batch, T). It is written to cache positions
    ``start_pos ..``: 0 starts afresh (a cache of exactly prompt + new positions is allocated unless one of the
    right batch size and at least that length exists); a chat passes the position after its history.
    A sample ends at one of ``eos_ids``, at the end of one of the token ``stop_sequences`` (both left out of
    the result), or when ``on_token(sample, token)`` returns True. ``on_token`` sees every kept token as soon
    as it is sampled (held back only while it might start a multi-token stop sequence).
    """
    prompt = prompt_ids.reshape(1, -1).expand(num_samples, -1) if prompt_ids.ndim == 1 else prompt_ids
    batch, length = prompt.shape
    if length < 1:
        raise UsageError("The prompt is empty: give at least one token to continue from.")
    needed = start_pos + length + max_new_tokens
    if needed > model.max_seq_length:
        model.set_kv_cache(batch, needed)  # raises the model's "exceeds the context" error
    shape = kv_cache_shape(model)
    if start_pos == 0 and (shape is None or shape[0] != batch or shape[1] < needed):
        set_kv_cache(model, batch, needed)
    elif shape is None or shape[0] != batch or shape[1] < needed - 1:
        raise ValueError(f"The KV cache {shape} does not hold batch {batch} and positions up to {needed - 1}.")

    device = model.embed.weight.device
    prompt = prompt.to(device)
    eos = set(int(i) for i in eos_ids)
    stops = [list(map(int, s)) for s in stop_sequences if len(s)]
    hold = max((len(s) for s in stops), default=1) - 1
    tokens: list[list[int]] = [[] for _ in range(batch)]
    emitted, done = [0] * batch, [False] * batch

    def emit(row: int, upto: int) -> None:
        while emitted[row] < upto and not done[row]:
            value = tokens[row][emitted[row]]
            emitted[row] += 1
            if on_token is not None and on_token(row, value):
                del tokens[row][emitted[row]:]
                done[row] = True

    start = time.perf_counter()
    end = start_pos + length
    logits = forward_last(model, prompt, torch.arange(start_pos, end, device=device), end)
    token = sample(logits, temperature, top_k, top_p, generator)
    input_pos = torch.tensor([end], device=device)  # the step's position, advanced in place with ``end``
    steps, first_token_at, second_token_at = 0, 0.0, 0.0
    # On an accelerator the next step is queued before this token is read on the host, so the device keeps
    # computing while Python looks at the token (an early stop wastes one step, written past the kept tokens)
    lookahead = device.type != "cpu"
    with decoding_kernels(model, batch):
        while True:
            next_token = None
            if lookahead and 0 < steps < max_new_tokens - 1:
                next_token = sample(step(model, token, input_pos, end + 1), temperature, top_k, top_p, generator)
                input_pos.add_(1)
                end += 1
            values = token.reshape(-1).tolist()  # the one host sync per step
            steps += 1
            if steps <= 2:  # a compiled step compiles on its first call: the rate is measured after it
                second_token_at = time.perf_counter()
                first_token_at = first_token_at or second_token_at
            for row, value in enumerate(values):
                if done[row]:
                    continue
                if value in eos:
                    emit(row, len(tokens[row]))
                    done[row] = True
                    continue
                tokens[row].append(value)
                matched = next((s for s in stops if tokens[row][-len(s):] == s), None)
                if matched is not None:
                    del tokens[row][-len(matched):]
                    emit(row, len(tokens[row]))
                    done[row] = True
                else:
                    emit(row, len(tokens[row]) - hold)
            if all(done) or steps >= max_new_tokens:
                break
            if next_token is None:
                next_token = sample(step(model, token, input_pos, end + 1), temperature, top_k, top_p, generator)
                input_pos.add_(1)
                end += 1
            token = next_token
    stopped = list(done)
    for row in range(batch):
        emit(row, len(tokens[row]))
    return Generation(
        tokens=tokens,
        steps=steps,
        end_pos=start_pos + length + steps - 1,
        time_to_first_token=first_token_at - start,
        decode_time=time.perf_counter() - (second_token_at if steps > 2 else first_token_at),
        stopped=stopped,
    )
