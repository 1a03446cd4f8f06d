"""Writing files so that a kill at any moment leaves either the old content or the new one, never a mix.

Every file the project writes or rewrites goes through ``atomic_write`` (or ``atomic_open`` for streamed
content): a temporary file in the target's own directory (never $TMPDIR: same file system, so the rename is
atomic and a small /tmp cannot fail a save), flushed and fsynced, then renamed over the target.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterator, Optional, Union

from lit_model.core.errors import UsageError, UserError


def fsync_directory(directory: Union[str, Path]) -> None:
    """Make a rename inside ``directory`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def is_disk_full(error: BaseException) -> bool:
    """A write that failed for want of space: an OSError (ENOSPC, EDQUOT), or a library's own error wrapping one
    (safetensors' writer raises ``SafetensorError: ... No space left on device (os error 28)``)."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return "No space left on device" in str(error) or "Disk quota exceeded" in str(error)


def disk_full_error(path: Union[str, Path], what: Optional[str] = None) -> UserError:
    """The message for a write of ``what`` (default: ``path``) that ran out of space, after the temporary files were
    removed."""
    path = Path(path)
    where = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    free = shutil.disk_usage(where).free
    return UserError(
        f"The disk holding {path} is full ({free / 1e9:.1f} GB free after removing this write's temporary files), so "
        f"{what or path} was not written; what was there before is untouched. Free space on that disk, or choose an "
        "--out_dir on a larger one, and run again (--resume auto continues from the newest checkpoint the run saved, "
        "if any).")


@contextlib.contextmanager
def atomic_open(path: Union[str, Path], mode: str = "w", **kwargs) -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on leaving the block without an error it replaces
    ``path``, on an error (or a kill) the target is untouched and the temporary file is removed."""
    if not any(m in mode for m in "wx"):
        raise ValueError(f"atomic_open writes a whole file; mode {mode!r} is not a write mode")
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode.replace("x", "w"), **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if is_disk_full(error):
            raise disk_full_error(path) from None
        raise
    fsync_directory(path.parent)


def atomic_write(path: Union[str, Path], data: Union[str, bytes], encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``data`` (text or bytes) atomically; returns ``path``."""
    if isinstance(data, str):
        with atomic_open(path, "w", encoding=encoding, newline="") as handle:
            handle.write(data)
    else:
        with atomic_open(path, "wb") as handle:
            handle.write(data)
    return Path(path)


def check_out_dir_path(out_dir: Path, flag: str = "--out_dir") -> None:
    """``out_dir`` can be a directory this process creates and writes into (whether it holds another run's
    files is the command's business); ``flag`` names it in the messages."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{flag} {out_dir} is a file, not a directory. Pick another {flag}.")
    existing = out_dir
    while not existing.exists():  # the nearest ancestor that exists is where the directories get created
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {out_dir}: {existing} is a file, so no directory can be made under it. "
                         f"Pick another {flag}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out_dir}: {existing} is not writable by this user. Pick a directory you "
                         "can write to, or change its permissions.")
