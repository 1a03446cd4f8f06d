"""Scoring text with a loaded model, for evaluation: the log-likelihood of a continuation after its context (and
whether greedy decoding would have produced it), and of a whole text over windows of the model's context
("rolling", for perplexity).

Requests run longest first, in batches padded on the right: a causal model's positions never attend to the padding
after them, so a row scores as it would alone. Only the positions that predict a continuation token go through the
head (``GPT.forward``'s ``readout``), ``HEAD_BYTES`` of logits at a time, so a batch never holds (batch, time,
vocabulary) logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from lit_model.core.errors import UserError
from lit_model.infer.engine import is_out_of_memory
from lit_model.infer.load import Precision
from lit_model.model.gpt import GPT

Pair = tuple[Sequence[int], Sequence[int]]  # (context tokens, continuation tokens)
AUTO_BATCH_SIZE = 64  # batch_size=None without a plan: batches of up to this many rows, halved on running out of memory
# the head's fp32 (positions, vocabulary) logits of scored positions, at most this many bytes at once: twice the
# 32 MiB that glibc's adaptive mmap threshold stops at, so that a full block is always memory-mapped and goes back to
# the OS when freed, where smaller ones fragment its heap (a 2-layer model, 16 x 512 tokens scored, peaked 160 MiB
# higher with 8 MiB blocks than with 32 MiB ones: benchmarks/evaluate_plan.py)
HEAD_BYTES = 64 << 20


@dataclass(frozen=True)
class Score:
    logprob: float  # the sum of the continuation tokens' log-probabilities
    greedy: bool  # every continuation token is the most likely one at its position


class Scorer:
    """A loaded model that scores token sequences under ``precision``, ``batch_size`` rows at a time (None: up to
    ``auto_start``, the plan's, halved while the longest batch of a call runs out of memory). Counts the requests, the
    tokens run through the model and the seconds, for ``summary``."""

    def __init__(self, model: GPT, precision: Precision, batch_size: Optional[int] = None,
                 auto_start: int = AUTO_BATCH_SIZE) -> None:
        self.model, self.precision, self.batch_size, self.auto_start = model, precision, batch_size, auto_start
        self.requests, self.tokens, self.seconds = 0, 0, 0.0

    @property
    def context_size(self) -> int:
        """The most tokens one row feeds the model: its context."""
        return self.model.max_seq_length

    def continuations(self, pairs: Sequence[Pair], on_scored: Callable[[int], object] = lambda n: None) -> list[Score]:
        """The score of each (context, continuation) pair, as lm-eval's ``hf`` model computes it: the model reads
        the last ``context_size`` tokens of context + continuation but the final one (earlier context is cut off),
        and the continuation tokens are scored at the positions that predict them. ``on_scored(n)``: after each
        batch."""
        for context, continuation in pairs:
            if not context or not continuation:
                raise ValueError("every pair needs a context (at least the prefix token) and a continuation")
            if len(continuation) > self.context_size:
                raise UserError(
                    f"A request scores a continuation of {len(continuation)} tokens, more than the model's context of "
                    f"{self.context_size} tokens holds. The task does not suit this model; evaluate it on other tasks."
                )
        order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
        scores: list[Optional[Score]] = [None] * len(pairs)
        size = self.batch_size or self.auto_start
        start, done = time.perf_counter(), 0
        while done < len(order):
            rows = order[done : done + size]
            try:
                batch = self._score_batch([pairs[i] for i in rows])
            except (torch.OutOfMemoryError, RuntimeError) as error:
                if not is_out_of_memory(error):
                    raise
                if self.batch_size is None and len(rows) > 1:
                    size = len(rows) // 2  # the longest rows come first: what fits them fits every later batch
                    continue
                raise UserError(
                    f"Out of memory while scoring {len(rows)} sequence(s) of up to {self.context_size} tokens. Pass a "
                    "smaller --batch_size (or auto), or load the weights in 4 bits with --quantize bnb.nf4."
                ) from None
            for i, score in zip(rows, batch):
                scores[i] = score
            done += len(rows)
            on_scored(len(rows))
        self.seconds += time.perf_counter() - start
        self.requests += len(pairs)
        return scores  # type: ignore[return-value]  (every slot is filled)

    def rolling(self, texts: Sequence[Sequence[int]], prefix_token: int,
                on_scored: Callable[[int], object] = lambda n: None) -> list[float]:
        """The log-likelihood of each whole token sequence (``rolling_windows`` of the model's context, all texts'
        windows batched together); ``on_scored(n)``: after each batch, ``n`` windows."""
        windows = [rolling_windows(tokens, prefix_token, self.context_size) for tokens in texts]
        scores = iter(self.continuations([pair for text in windows for pair in text], on_scored))
        return [sum(next(scores).logprob for _ in text) for text in windows]

    def summary(self) -> str:
        rate = f"{self.requests / self.seconds:.1f} requests/s, {self.tokens / self.seconds:,.0f} tokens/s" \
            if self.seconds > 0 else "n/a"
        return (f"log-likelihood: {self.requests:,} requests ({self.tokens:,} tokens) in {self.seconds:.1f} s: "
                f"{rate}")

    @torch.inference_mode()
    def _score_batch(self, pairs: Sequence[Pair]) -> list[Score]:
        inputs = [[*context, *continuation][-(self.context_size + 1) : -1] for context, continuation in pairs]
        lengths = [len(continuation) for _, continuation in pairs]
        idx = torch.zeros(len(inputs), max(map(len, inputs)), dtype=torch.long)  # right-padded with token 0
        for row, tokens in enumerate(inputs):
            idx[row, : len(tokens)] = torch.tensor(tokens)
        # the positions that predict continuation tokens: the last len(continuation) inputs of each row
        rows = torch.repeat_interleave(torch.arange(len(inputs)), torch.tensor(lengths))
        positions = torch.cat([torch.arange(len(tokens) - n, len(tokens)) for tokens, n in zip(inputs, lengths)])
        targets = torch.tensor([token for _, continuation in pairs for token in continuation])
        device = self.model.embed.weight.device
        with self.precision.context(device.type):
            picked, greedy = score_positions(self.model, idx.to(device), rows, positions, targets)
        self.tokens += sum(map(len, inputs))
        return [Score(float(p.sum()), bool(g.all()))
                for p, g in zip(picked.cpu().split(lengths), greedy.cpu().split(lengths))]


def score_positions(model: GPT, idx: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                    targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of ``targets`` at (``rows``, ``positions``) of ``idx``'s rows, and whether each is the
    most likely token there. The head runs on those positions only, ``head_rows`` at a time, and keeps of each
    row's log-softmax only the target's entry: the vocabulary-wide tensors stay ``HEAD_BYTES`` whatever the batch
    scores (a rolling window scores every position). The planner traces this (plan/trace_generation.py)."""
    step = head_rows(model.config.padded_vocab_size)

    def readout(model: GPT, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        picked = hidden[rows.to(hidden.device), positions.to(hidden.device)]
        wanted = targets.to(model.lm_head.weight.device)
        logprobs, greedy = [], []
        for start in range(0, len(wanted), step):  # fp32 logits: lm-eval sums many small log-probabilities
            logits = model.head(picked[start : start + step]).float()
            target = wanted[start : start + step, None]
            logprobs.append((logits.gather(1, target) - torch.logsumexp(logits, dim=-1, keepdim=True)).squeeze(1))
            greedy.append(logits.argmax(dim=-1) == target.squeeze(1))
        return torch.cat(logprobs), torch.cat(greedy)

    return model(idx, readout=readout)


def head_rows(vocab_size: int) -> int:
    """How many scored positions go through the head at once: ``HEAD_BYTES`` of fp32 logits."""
    return max(1, HEAD_BYTES // (4 * vocab_size))


def rolling_windows(tokens: Sequence[int], prefix_token: int, length: int) -> list[Pair]:
    """(context, continuation) pairs that predict each of ``tokens`` exactly once, each from at most ``length``
    inputs: the first window's ``length`` tokens after ``prefix_token`` (bos, or eos where there is none), each later
    window's next ``length`` tokens with the ``length`` tokens before its end as inputs. lm-eval's
    ``get_rolling_token_windows`` with ``context_len=1``, made disjoint, as its ``hf`` model scores a text."""
    tokens = list(tokens)
    pairs: list[Pair] = []
    for start in range(0, len(tokens), length):
        end = min(start + length, len(tokens))
        context = [prefix_token] if start == 0 else tokens[end - length - 1 : start]
        pairs.append((context, tokens[start:end]))
    return pairs
