"""User-facing errors: one paragraph naming the problem and the fix, no traceback.

Raise ``UsageError`` for bad flags or arguments (exit 2) and ``UserError`` for a bad input found while
running (exit 1). Scripts run their entry point through ``run_cli``, which prints the message and exits;
``LIT_MODEL_DEBUG=1`` re-raises to show the traceback.
"""

from __future__ import annotations

import os
import sys
import textwrap
from typing import Any, Callable


class UserError(Exception):
    """A problem with the user's input found at run time (exit status 1)."""

    exit_code = 1


class UsageError(UserError):
    """A bad flag or argument (exit status 2)."""

    exit_code = 2


def run_cli(entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    try:
        return entry(*args, **kwargs)
    except UserError as error:
        if os.environ.get("LIT_MODEL_DEBUG") == "1":
            raise
        # Every rank validates the same inputs and fails alike; one copy of the message is enough.
        if os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0":
            message = textwrap.fill(str(error), width=100, break_long_words=False, break_on_hyphens=False)
            print(f"error: {message}", file=sys.stderr, flush=True)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            sys.stdout.flush()
            os._exit(error.exit_code)  # skip process-group teardown, which can hang or abort
        sys.exit(error.exit_code)
