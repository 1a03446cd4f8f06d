"""A multi-turn conversation on the continuous-batching engine (infer/batching.py) with prefix caching: each turn
sends the whole conversation, and the engine shares the blocks earlier turns filled, so a turn prefills only what
they did not hold (the previous turn's last, partial block, the end of the reply and the new message)."""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Optional, Sequence

from lit_model.core.errors import UserError
from lit_model.infer.batching import Completion, Engine, Event, Request, complete
from lit_model.infer.engine import Sampling
from lit_model.infer.load import Precision
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, PoolSpec, blocks_for
from lit_model.infer.stream import TextStream
from lit_model.model.gpt import GPT


class ChatSession:
    """A conversation with ``model`` in ``style``, of at most ``max_length`` tokens (the pool holds exactly that
    many positions, rounded up to whole blocks). Turn k samples with seed ``sampling.seed + k``."""

    def __init__(self, model: GPT, precision: Precision, sampling: Sampling, tokenizer, style, max_length: int,
                 system: Optional[str] = None, stop: Sequence[str] = ()) -> None:
        self.tokenizer, self.style, self.system, self.sampling = tokenizer, style, system, sampling
        self.max_length = max_length
        self.engine = Engine(model, precision, PoolSpec(blocks_for(max_length, DEFAULT_BLOCK_SIZE)), max_batch=1,
                             prefix_caching=True)
        self.stop_sequences = tuple(tuple(ids) for ids in style.stop_tokens(tokenizer))
        self.stop_strings = [*style.stop_strings, *stop]
        self.reset()

    def reset(self) -> None:
        """Forget the conversation. The cache keeps its blocks: a new conversation that begins alike shares them."""
        self.tokens: list[int] = []  # the whole conversation, token by token
        self.turns = 0
        self.last: Optional[Completion] = None
        self.last_start_pos = 0  # positions of the last turn's prompt taken from the cache, not computed again

    def turn_ids(self, message: str) -> list[int]:
        if self.turns == 0:
            return self.tokenizer.encode(self.style.turn(message, system=self.system)).tolist()
        return self.tokenizer.encode(self.style.next_turn(message), bos=False).tolist()

    def send(self, message: str, max_new_tokens: int, write: Optional[Callable[[str], object]] = None,
             notify: Callable[[str], object] = lambda text: None) -> str:
        """Answer ``message``; the reply streams through ``write``. A conversation that would overflow the
        context is started over with this message (``notify`` says so). On an error the conversation stays as it
        was."""
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
        prompt = self.tokens + new_ids
        request = Request(f"turn-{self.turns}", tuple(prompt), max_new_tokens,
                          replace(self.sampling, seed=self.sampling.seed + self.turns),
                          tuple(self.tokenizer.eos_ids), self.stop_sequences)
        stream = TextStream(self.tokenizer, self.stop_strings, context=prompt[-4:], write=write)

        def on_event(event: Event) -> None:
            if any([stream.add(token) for token in event.tokens]) and event.finish_reason is None:
                self.engine.cancel(event.id)  # a stop string ended the reply

        shared_before = self.engine.stats().shared_positions
        completion = complete(self.engine, [request], on_event)[0][request.id]
        if completion.error is not None:
            raise UserError(f"{completion.error} Send a shorter message, pass a smaller --max_seq_length or "
                            "--max_new_tokens, or load the weights in 4 bits with --quantize bnb.nf4.")
        self.last_start_pos = self.engine.stats().shared_positions - shared_before
        reply = stream.finish()
        reply_ids = self.tokenizer.encode(reply, bos=False).tolist() if stream.stopped else list(completion.tokens)
        self.tokens = prompt + reply_ids
        self.turns += 1
        self.last = completion
        return reply
