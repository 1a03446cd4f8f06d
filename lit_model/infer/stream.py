"""Text as tokens arrive: streaming decode that is correct for byte-level BPE and SentencePiece, with stop strings."""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence


class TextStream:
    """Turns tokens into text as they arrive, correct for byte-level BPE and SentencePiece.

    A window of recent tokens is decoded, and only the growth of its text is emitted; text that ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) waits for the next token. ``context`` (a few prompt tokens)
    keeps SentencePiece from dropping the first new word's leading space. Text that could be the start of one
    of ``stop`` strings is held back until it is clear; ``add`` returns True once a stop string appears (the
    text before it is kept).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), context: Sequence[int] = (), write: Optional[Callable[[str], object]] = None) -> None:
        self.tokenizer, self.stop, self.write = tokenizer, [s for s in stop if s], write
        self.ids = [int(i) for i in context][-4:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text, self.printed, self.stopped = "", 0, False

    def add(self, token: int) -> bool:
        if self.stopped:
            return True
        self.ids.append(int(token))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._flush(final=False)

    def finish(self) -> str:
        """Emit what is left (even an incomplete character) and return the whole text."""
        if not self.stopped:
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            full = self.tokenizer.decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)
            self._flush(final=True)
        return self.text

    def _flush(self, final: bool) -> bool:
        start = max(0, self.printed - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:  # hold back a tail that a stop string may begin with
            held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - held
        if end > self.printed:
            if self.write is not None:
                self.write(self.text[self.printed : end])
            self.printed = end
        return self.stopped


def stdout_writer(text: str) -> None:
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:  # a terminal that is not UTF-8: what it cannot show becomes \xe9-style escapes
        encoding = sys.stdout.encoding or "ascii"
        sys.stdout.write(text.encode(encoding, "backslashreplace").decode(encoding))
    sys.stdout.flush()
