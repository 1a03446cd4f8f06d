"""A phase's tokens and seconds, added where the phase runs and read where it is logged: GRPO's rollouts run inside
the data iterator the fit loop draws from (infer/), which logs them (train/) without knowing what they are."""

from __future__ import annotations


class Meter:
    """Tokens and seconds added up since the last ``take``. A plain class: it accumulates."""

    def __init__(self) -> None:
        self.tokens, self.seconds = 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.tokens += tokens
        self.seconds += seconds

    def take(self) -> tuple[int, float]:
        """What was added since the last call, and start again from zero."""
        taken = self.tokens, self.seconds
        self.tokens, self.seconds = 0, 0.0
        return taken
