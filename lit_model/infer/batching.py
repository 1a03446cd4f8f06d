"""Continuous batching over the paged KV cache: requests join the running batch at any step and leave it when they
end, each holding only the cache blocks it has written (infer/paged.py).

One ``Engine.step``: cancelled requests leave; waiting requests are admitted, oldest first, while the pool has the
blocks their tokens need (each is prefilled on its own and samples its first token); then every running sequence
decodes one token, in one batch unless the batch would read more cache positions than ``paged.read_budget`` allows
(then in several, rows of similar lengths together). A sequence that needs a new block when none is free preempts the newest running
sequences: their blocks go back to the pool and they wait at the head of the queue, to be recomputed (their prompt
and the tokens they have so far, prefilled again) when blocks free up. Running out of device memory inside a step
does the same, one sequence at a time, down to a batch of one. A request that could never fit (``rejection``) is
refused before it is queued.

With ``prefix_caching``, a sequence's full blocks stay remembered after it ends (paged.BlockPool), and a request that
begins with the same tokens (a chat's conversation so far, a shared system prompt or few-shot examples, a preempted
sequence recomputed) shares those blocks and prefills only the rest.

Synchronous and single-threaded: the caller (the server's worker loop, generate with several prompts) calls
``add``, ``cancel`` and ``step`` from one thread.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from lit_model.infer.decode import forward_last
from lit_model.infer.engine import Sampling, is_out_of_memory
from lit_model.infer.load import Precision
from lit_model.infer.paged import (BlockPool, PoolSpec, blocks_for, prefix_digests, read_budget, set_paged_cache,
                                   storage_dtype)
from lit_model.infer.sampling import make_generator, sample
from lit_model.kernels.ops import decoding_kernels
from lit_model.model.gpt import GPT


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    eos_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class Event:
    """What one step produced for one request: the tokens it newly keeps (an eos or a matched stop sequence is left
    out; the last tokens are held back while they could still begin a stop sequence) and, at its end, why it ended:
    "stop" (eos or a stop sequence), "length" (max_new_tokens), "cancelled", "error" (with ``error``)."""

    id: str
    tokens: tuple[int, ...] = ()
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    preemptions: int
    shared_positions: int


@dataclass(eq=False)
class _Sequence:
    request: Request
    random: torch.Generator
    generated: list[int] = field(default_factory=list)  # every sampled token, fed back or pending
    kept: list[int] = field(default_factory=list)  # what the request returns (eos / stop sequence left out)
    emitted: int = 0  # kept[:emitted] have been reported
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # positions written to the cache
    prefixes: list[bytes] = field(default_factory=list)  # the digests of its full blocks (prefix caching)

    @property
    def tokens(self) -> list[int]:
        return [*self.request.prompt_ids, *self.generated]


class Engine:
    """A loaded model serving many requests at once from one pool of KV-cache blocks (``pool``), at most
    ``max_batch`` sequences per decoding step."""

    def __init__(self, model: GPT, precision: Precision, pool: PoolSpec, max_batch: int = 64,
                 prefix_caching: bool = False) -> None:
        self.model, self.precision, self.max_batch, self.prefix_caching = model, precision, max_batch, prefix_caching
        self.max_read = read_budget(max_batch, model.max_seq_length)
        self.pool = BlockPool(pool)
        set_paged_cache(model, self.pool, storage_dtype(pool.kv_dtype, precision.compute_dtype))
        self.device = model.embed.weight.device
        self.waiting: deque[_Sequence] = deque()
        self.running: list[_Sequence] = []  # in admission order: the newest is preempted first
        self.cancelled: set[str] = set()
        self.preemptions = 0
        self.shared_positions = 0  # prompt positions taken from remembered blocks instead of computed

    def rejection(self, request: Request) -> Optional[str]:
        """Why ``request`` can never run, naming the limit; None when it can."""
        length, context = len(request.prompt_ids) + request.max_new_tokens, self.model.max_seq_length
        spec = self.pool.spec
        if not request.prompt_ids:
            return "The prompt is empty: give at least one token to continue from."
        if request.max_new_tokens < 1:
            return f"max_tokens must be at least 1, not {request.max_new_tokens}."
        if length > context:
            return (f"The prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_new_tokens}) is "
                    f"{length} tokens, beyond the model's context of {context} tokens: ask for at most "
                    f"{max(context - len(request.prompt_ids), 0)} new tokens or shorten the prompt.")
        if blocks_for(length, spec.block_size) > spec.num_blocks:
            capacity = spec.num_blocks * spec.block_size
            return (f"The prompt ({len(request.prompt_ids)} tokens) plus max_tokens ({request.max_new_tokens}) is "
                    f"{length} tokens, beyond the whole KV cache pool of {capacity} tokens ({spec.num_blocks} blocks "
                    f"of {spec.block_size}): ask for fewer tokens, or start the server with a larger "
                    "--kv_cache_memory or --kv_cache_dtype int8.")
        return None

    def add(self, request: Request) -> None:
        reason = self.rejection(request)
        if reason is not None:
            raise ValueError(reason)
        random = make_generator(request.sampling.seed, self.model.lm_head.weight.device)
        self.waiting.append(_Sequence(request, random))

    def cancel(self, request_id: str) -> None:
        """Free the request's blocks now; its "cancelled" event comes with the next step."""
        for sequence in [*self.running, *self.waiting]:
            if sequence.request.id == request_id:
                self._free(sequence)
                self.cancelled.add(request_id)

    def forget_prefixes(self) -> None:
        """The weights changed: no remembered block may be shared any more."""
        self.pool.forget_prefixes()

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.cancelled)

    def stats(self) -> EngineStats:
        return EngineStats(len(self.running), len(self.waiting), self.pool.free_blocks, self.pool.spec.num_blocks,
                           self.preemptions, self.shared_positions)

    @torch.inference_mode()
    def step(self) -> list[Event]:
        events = self._drop_cancelled()
        with self.precision.context(self.device.type):
            events += self._admit()
            if self.running:
                events += self._decode()
        return events

    # ---- the parts of a step ---------------------------------------------------------------------------------
    def _drop_cancelled(self) -> list[Event]:
        events = [Event(i, finish_reason="cancelled") for i in sorted(self.cancelled)]
        self.running = [s for s in self.running if s.request.id not in self.cancelled]
        self.waiting = deque(s for s in self.waiting if s.request.id not in self.cancelled)
        self.cancelled.clear()
        return events

    def _admit(self) -> list[Event]:
        """Prefill waiting sequences, oldest first, while their tokens (and the next one's position) fit."""
        events: list[Event] = []
        while self.waiting and len(self.running) < self.max_batch:
            sequence = self.waiting[0]
            tokens, size = sequence.tokens, self.pool.spec.block_size
            # the last token is computed even when remembered: its logits sample the next one
            prefixes = prefix_digests(tokens[:-1], size) if self.prefix_caching else []
            shared = self.pool.share(prefixes)
            needed = blocks_for(len(tokens) + 1, size) - len(shared)
            if needed > self.pool.free_blocks:
                self.pool.release(shared)
                break
            self.waiting.popleft()
            sequence.blocks = shared + self.pool.allocate(needed)
            sequence.cached = len(shared) * size
            self.shared_positions += sequence.cached
            sequence.prefixes = prefixes[:len(shared)]
            try:
                logits = self._forward([sequence], [tokens[sequence.cached:]])
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                self._free(sequence)
                if self.running:  # memory comes back as the running sequences end: try it again then
                    self.waiting.appendleft(sequence)
                    break
                events.append(Event(sequence.request.id, finish_reason="error", error=(
                    f"Out of memory prefilling a prompt of {len(sequence.tokens)} tokens alone.")))
                continue
            self.running.append(sequence)
            events += self._sample([sequence], logits)
        return events

    def _decode(self) -> list[Event]:
        """One token for every running sequence, in forwards that each read at most ``max_read`` positions (rows of
        similar lengths together); preempt the newest while blocks or memory run short."""
        self._reserve_next_positions()
        events: list[Event] = []
        pending = sorted(self.running, key=lambda s: len(s.blocks), reverse=True)
        while pending:
            width = len(pending[0].blocks) * self.pool.spec.block_size  # the longest row: every row is read as long
            group, pending = pending[:max(1, self.max_read // width)], pending[max(1, self.max_read // width):]
            try:
                logits = self._forward(group, [[s.generated[-1]] for s in group])
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                if len(group) == 1:
                    sequence = group[0]
                    self._free(sequence)
                    self.running.remove(sequence)
                    events.append(Event(sequence.request.id, finish_reason="error",
                                        error="Out of memory decoding this sequence alone."))
                    continue
                newest = max(group, key=self.running.index)
                self._preempt(newest)
                pending = [s for s in group if s is not newest] + pending
                continue
            events += self._sample(group, logits)
        return events

    def _reserve_next_positions(self) -> None:
        """A block for every running sequence whose next position starts one; preempting the newest sequences
        (whose blocks return to the pool) until they fit."""
        size = self.pool.spec.block_size
        while True:
            short = [s for s in self.running if blocks_for(s.cached + 1, size) > len(s.blocks)]
            if len(short) <= self.pool.free_blocks:
                break
            self._preempt(self.running[-1])
        for sequence in short:
            sequence.blocks += self.pool.allocate(1)

    def _preempt(self, sequence: _Sequence) -> None:
        self._free(sequence)
        self.running.remove(sequence)
        self.waiting.appendleft(sequence)  # recomputed first: its prompt plus what it has generated
        self.preemptions += 1

    def _free(self, sequence: _Sequence) -> None:
        self.pool.release(sequence.blocks)
        sequence.blocks, sequence.cached, sequence.prefixes = [], 0, []

    def _forward(self, batch: list[_Sequence], new_tokens: list[list[int]]) -> torch.Tensor:
        """The last position's logits of each sequence, after writing ``new_tokens`` (the same number per sequence)
        at its next positions."""
        count = len(new_tokens[0])
        positions = torch.tensor([list(range(s.cached, s.cached + count)) for s in batch], device=self.device)
        self.pool.bind([s.blocks for s in batch])
        with decoding_kernels(self.model, len(batch)):
            logits = forward_last(self.model, torch.tensor(new_tokens, device=self.device), positions)
        for sequence in batch:
            sequence.cached += count
            if self.prefix_caching and sequence.cached // self.pool.spec.block_size > len(sequence.prefixes):
                self._remember_full_blocks(sequence)
        return logits

    def _remember_full_blocks(self, sequence: _Sequence) -> None:
        size, known = self.pool.spec.block_size, len(sequence.prefixes)
        new = prefix_digests(sequence.tokens[:sequence.cached], size, sequence.prefixes[-1] if known else b"", known)
        for block, prefix in zip(sequence.blocks[known:], new):
            self.pool.remember(block, prefix)
        sequence.prefixes += new

    def _sample(self, batch: list[_Sequence], logits: torch.Tensor) -> list[Event]:
        """Each sequence's next token from its own sampling settings and generator; the events of the step."""
        greedy = logits.argmax(dim=-1).tolist()
        events = []
        for row, sequence in enumerate(batch):
            s = sequence.request.sampling
            token = greedy[row] if s.temperature == 0 else int(
                sample(logits[row:row + 1], s.temperature, s.top_k, s.top_p, sequence.random))
            sequence.generated.append(token)
            event = self._advance(sequence, token)
            if event is not None:
                events.append(event)
        return events

    def _advance(self, sequence: _Sequence, token: int) -> Optional[Event]:
        """Keep ``token`` (or end at an eos / a stop sequence / the length); the newly kept tokens as an event."""
        request, kept = sequence.request, sequence.kept
        reason = None
        if token in request.eos_ids:
            reason = "stop"
        else:
            kept.append(token)
            matched = next((s for s in request.stop_sequences if s and tuple(kept[-len(s):]) == s), None)
            if matched is not None:
                del kept[-len(matched):]
                reason = "stop"
            elif len(sequence.generated) >= request.max_new_tokens:
                reason = "length"
        if reason is None:
            hold = max((len(s) for s in request.stop_sequences), default=1) - 1
            upto = max(len(kept) - hold, sequence.emitted)
        else:
            upto = len(kept)
            self._free(sequence)
            self.running.remove(sequence)
        new = tuple(kept[sequence.emitted:upto])
        sequence.emitted = upto
        return Event(request.id, new, reason) if new or reason else None


@dataclass(frozen=True)
class Completion:
    tokens: tuple[int, ...]
    finish_reason: str
    error: Optional[str] = None


@dataclass(frozen=True)
class BatchTiming:
    time_to_first_token: float  # seconds from the first step to the first token of any request
    seconds: float  # the whole batch
    tokens: int  # kept tokens of every request

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


def complete(engine: Engine, requests: list[Request],
             on_event: Callable[[Event], object] = lambda event: None) -> tuple[dict[str, Completion], BatchTiming]:
    """Run ``requests`` to their ends, all queued at once; ``on_event`` sees every event as it comes."""
    for request in requests:
        engine.add(request)
    tokens: dict[str, list[int]] = {r.id: [] for r in requests}
    done: dict[str, Completion] = {}
    start, first = time.perf_counter(), None
    while engine.has_work():
        for event in engine.step():
            if event.tokens and first is None:
                first = time.perf_counter()
            tokens[event.id] += event.tokens
            if event.finish_reason is not None:
                done[event.id] = Completion(tuple(tokens[event.id]), event.finish_reason, event.error)
            on_event(event)
    seconds = time.perf_counter() - start
    timing = BatchTiming((first or start + seconds) - start, seconds, sum(len(t) for t in tokens.values()))
    return done, timing
