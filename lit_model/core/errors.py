"""How a script ends: user errors and stop signals, one paragraph or line each, no traceback.

Raise ``UsageError`` for bad flags or arguments (exit 2) and ``UserError`` for a bad input found while
running (exit 1). Scripts run their entry point through ``run_cli``, which prints the message and exits;
``LIT_MODEL_DEBUG=1`` re-raises to show the traceback.

``run_cli`` also installs the SIGINT/SIGTERM handlers before anything else runs (``STOPS``). Outside a training
loop a signal ends the script at once with one line and exit status 128 + the signal (130 for Ctrl-C, 143 for
SIGTERM). Inside ``STOPS.deferred()`` (the fit loop) the first signal only asks the loop to save and stop at its
next safe point; a second one ends the process at once. A watchdog thread ends a process whose main thread cannot
run the handler (blocked in C++, e.g. in a collective waiting for a rank that stopped) ``STUCK_AFTER_S`` seconds
after a signal (unless it is saving, ``STOPS.patience()``), about a second after a second one.
"""

from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

# How long a signal may wait for the main thread to run its handler before the watchdog ends the process: longer
# than any single C++ call of a healthy step (a matmul, a collective whose peers are computing), well inside the
# 30 s that SLURM and Kubernetes allow between SIGTERM and SIGKILL.
STUCK_AFTER_S = 10.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class UserError(Exception):
    """A problem with the user's input found at run time (exit status 1)."""

    exit_code = 1
    every_rank = False  # True: found by one rank alone, so each rank that meets it prints it


class UsageError(UserError):
    """A bad flag or argument (exit status 2)."""

    exit_code = 2


class Interrupted(KeyboardInterrupt):
    """A stop signal where there is nothing to save (or a second one): the script ends at once. A KeyboardInterrupt,
    so code that ends an interactive loop on Ctrl-C (chat) still does."""

    def __init__(self, signum: int, again: bool = False) -> None:
        self.signum, self.again = signum, again
        super().__init__(signal.Signals(signum).name)


class StopSignals:
    """The process's SIGINT/SIGTERM state (one per process: signal handlers are process-wide)."""

    def __init__(self) -> None:
        self.requested: Optional[int] = None  # the first stop signal received
        self.deferring = False
        self.exiting = False
        self.where = ""  # what an immediate stop leaves behind, e.g. "before training started: nothing was saved"
        self.rank: Optional[int] = None  # this process's rank when there are several (named by the watchdog)
        self.patient = False  # see patience()
        self._handled = 0  # signals whose Python handler ran (the watchdog compares with those it saw)
        self._wakeup_read: Optional[int] = None  # the watchdog's pipe (see _watchdog_fd)
        self._wakeup_write: Optional[int] = None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.requested).name if self.requested else "a signal"

    def _handle(self, signum: int, frame: Any) -> None:
        self._handled += 1
        if self.exiting:
            return  # run_cli is already printing the message and exiting
        if self.deferring and self.requested is None:
            self.requested = signum  # the fit loop saves and stops at its next safe point
            return
        again = self.requested is not None
        self.requested = self.requested or signum
        raise Interrupted(signum, again)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[StopSignals]:
        """Inside: a first signal sets ``requested`` and returns; the caller stops at its next safe point."""
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Inside, a first signal is only recorded, and raised when the block ends: for code that an exception must
        not cut midway, such as torch's device and dispatch-mode context managers (an exception raised while they
        swap their mode stack corrupts it). Inside ``deferred`` this changes nothing: the caller stops as it does."""
        if self.deferring:
            yield
            return
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False
        if self.requested is not None:
            raise Interrupted(self.requested)

    @contextlib.contextmanager
    def patience(self) -> Iterator[None]:
        """Inside, the main thread may legitimately wait in C++ for long (a rank at a barrier while rank 0 writes a
        large checkpoint): the watchdog lets it finish after a first signal (a second still ends the process)."""
        self.patient = True
        try:
            yield
        finally:
            self.patient = False

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """The handlers and the watchdog while the block runs; the previous handlers afterwards (tests run scripts
        in-process). Only the main thread can install handlers; elsewhere this does nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self.requested, self.deferring, self.exiting, self.where = None, False, False, ""
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        previous_fd = signal.set_wakeup_fd(self._watchdog_fd(), warn_on_full_buffer=False)
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            # a signal this block received is not the next one's: held() would raise it in code that runs later in
            # this process (tests run scripts in-process)
            self.requested, self.deferring, self.exiting = None, False, False

    def _watchdog_fd(self) -> int:
        """The write end of a pipe that the C-level signal handler writes each signal's number to, even while the
        main thread is blocked in C++; a daemon thread reads it (started once per process)."""
        if self._wakeup_read is None:
            read, write = os.pipe()
            os.set_blocking(write, False)
            self._wakeup_read, self._wakeup_write = read, write
            threading.Thread(target=self._watch, name="lit-model-stop-watchdog", daemon=True).start()
        return self._wakeup_write

    def _watch(self) -> None:
        seen, signum, deadline = 0, 0, math.inf  # deadline: when an unhandled signal ends the process
        while True:
            if self._handled >= seen:
                deadline = math.inf
            if select.select([self._wakeup_read], [], [], None if deadline == math.inf else 0.05)[0]:
                data = os.read(self._wakeup_read, 1)
                if data and data[0] in STOP_SIGNALS:
                    seen, signum = seen + 1, data[0]
                    deadline = min(deadline, time.monotonic() + (STUCK_AFTER_S if seen == 1 else 1.0))
            elif time.monotonic() >= deadline and not (self.patient and seen == 1):
                rank = f"rank {self.rank}: " if self.rank is not None else ""
                print(
                    f"error: {rank}stopped by {signal.Signals(signum).name}, but the process was blocked inside a call "
                    "that cannot be interrupted (most likely a collective waiting for another rank that stopped "
                    "answering): exiting without saving. The newest checkpoint continues with --resume auto; "
                    "--timeout bounds such waits.",
                    file=sys.stderr, flush=True,
                )
                os._exit(128 + signum)


STOPS = StopSignals()


def _is_first_rank() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"


def _signal_children(signum: int) -> None:
    """Pass a stop on to the processes this one started (Fabric starts ranks 1.. as children of rank 0), which
    would otherwise wait for it in their next collective until --timeout. Linux lists them in /proc."""
    for children in Path("/proc/self/task").glob("*/children"):
        try:
            pids = children.read_text().split()
        except OSError:
            continue
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(int(pid), signum)


# How long a rank that the first one started waits for it to leave first, on an error (see _exit)
FIRST_RANK_EXIT_WAIT_S = 60.0


def _argv(pid: str) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def _started_by_first_rank() -> bool:
    """Whether this process's parent is the same script (Fabric starts ranks 1.. as children of rank 0, with the
    script's absolute path), not torchrun's agent or a shell."""
    try:
        parent, own = _argv(str(os.getppid())), _argv("self")
    except OSError:
        return False
    return len(parent) > 1 and len(own) > 1 and Path(parent[1]).name == Path(own[1]).name and parent[2:] == own[2:]


def _exit(code: int) -> None:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        if code != 0 and not _is_first_rank() and _started_by_first_rank():
            # Fabric's launcher in the first rank kills every rank, itself included (SIGKILL), when it sees a child
            # end with an error: the run's exit status would depend on which rank got there first (the first one
            # may still be writing its report). So the children leave after it, within a bound.
            parent, deadline = os.getppid(), time.monotonic() + FIRST_RANK_EXIT_WAIT_S
            while os.getppid() == parent and time.monotonic() < deadline:
                time.sleep(0.05)
        os._exit(code)  # skip process-group teardown, which can hang or abort
    sys.exit(code)


def run_cli(entry: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with STOPS.installed():
        try:
            return entry(*args, **kwargs)
        except KeyboardInterrupt as stop:
            STOPS.exiting = True
            if os.environ.get("LIT_MODEL_DEBUG") == "1":
                raise
            signum = stop.signum if isinstance(stop, Interrupted) else signal.SIGINT
            again = isinstance(stop, Interrupted) and stop.again
            where = f" {STOPS.where}" if STOPS.where else ""
            if _is_first_rank():
                print(f"{'Aborted by a second' if again else 'Stopped by'} {signal.Signals(signum).name}{where}.",
                      file=sys.stderr, flush=True)
            _signal_children(signum)
            _exit(128 + signum)
        except UserError as error:
            if os.environ.get("LIT_MODEL_DEBUG") == "1":
                raise
            # Every rank validates the same inputs and fails alike; one copy of the message is enough.
            if error.every_rank or _is_first_rank():
                message = textwrap.fill(str(error), width=100, break_long_words=False, break_on_hyphens=False)
                print(f"error: {message}", file=sys.stderr, flush=True)
            _exit(error.exit_code)
        except Exception as error:
            failure = compile_failure(error)
            if failure is None or os.environ.get("LIT_MODEL_DEBUG") == "1":
                raise
            if _is_first_rank():  # every rank compiles the same code and fails alike
                message = textwrap.fill(failure, width=100, break_long_words=False, break_on_hyphens=False)
                print(f"error: {message}", file=sys.stderr, flush=True)
            _exit(1)


def compile_failure(error: BaseException) -> Optional[str]:
    """The message for ``--compile`` when torch.compile could not build its code (``error`` is a
    ``torch._dynamo.exc.BackendCompilerFailed``, or was raised from one), else None. Such a failure is PyTorch's: on
    the CPU its inductor writes C++ that does not compile for some bf16 kernels (pythia-70m in bf16-true, torch 2.13:
    a conflicting declaration in a reduction), while the same run works eagerly."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if any(c.__name__ == "BackendCompilerFailed" and c.__module__.startswith("torch._dynamo") for c in type(error).__mro__):
            first = next((line.strip() for line in str(error).splitlines() if line.strip()), type(error).__name__)
            return (f"--compile failed: torch.compile could not build the compiled code ({first[:200]}). That is a "
                    "PyTorch compiler bug for this model, precision and device; the same run works without --compile "
                    "(on a CPU, PyTorch's compiler fails this way for some bf16 kernels, where --precision 32-true may "
                    "compile). Checkpoints already written are kept; LIT_MODEL_DEBUG=1 shows the traceback.")
        error = error.__cause__ or error.__context__
    return None
