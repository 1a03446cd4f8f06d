"""Writing files so that a kill at any moment leaves either the old content or the new one, never a mix.

Every file the project writes or rewrites goes through ``atomic_write`` (or ``atomic_open`` for streamed
content): a temporary file in the target's own directory (never $TMPDIR: same file system, so the rename is
atomic and a small /tmp cannot fail a save), flushed and fsynced, then renamed over the target.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import functools
import glob
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import IO, Any, Iterator, Optional, TypeVar, Union

import yaml

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
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes it owner-only; other tools' files follow the umask
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


def check_out_dir_path(out_dir: Path, inputs: tuple[Path, ...] = (), replaced: bool = False,
                       flag: str = "--out_dir") -> None:
    """``out_dir`` can be a directory this process creates and writes into (whether it holds another run's
    files is the command's business), and replacing it loses none of the command's ``inputs``: it neither holds
    one nor lies inside one (``out_dir`` equal to an input is the command's business: merge replaces its input in
    place, convert refuses). ``replaced``: it is written beside itself and renamed into place (``atomic_directory``),
    so its parent must be writable too."""
    out_dir = Path(out_dir)
    for source in inputs:
        source, target = Path(source).resolve(), out_dir.resolve()
        if target in source.parents or source in target.parents:
            where = "holds the input" if target in source.parents else "lies inside the input"
            raise UsageError(f"{flag} {out_dir} {where} {source}: replacing it (--overwrite) would delete that input "
                             "and everything beside it, and an output inside its input mixes the two. Choose an "
                             f"{flag} outside {source} (and not one of its parents).")
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"{flag} {out_dir} is a file, not a directory. Pick another {flag}.")
    existing = out_dir.parent if replaced else out_dir
    while not existing.exists():  # the nearest ancestor that exists is where the directories get created
        existing = existing.parent
    if not existing.is_dir():
        raise UsageError(f"{flag} {out_dir}: {existing} is a file, so no directory can be made under it. "
                         f"Pick another {flag}.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out_dir}: {existing} is not writable by this user. Pick a directory you "
                         "can write to, or change its permissions.")


def umask() -> int:
    """The process's umask, read where Linux shows it: ``os.umask`` reads it only by setting another one for a
    moment, during which another thread's new files would get that one."""
    with contextlib.suppress(OSError, ValueError, StopIteration, IndexError):
        lines = Path("/proc/self/status").read_text().splitlines()
        return int(next(line.split()[1] for line in lines if line.startswith("Umask:")), 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(root: Path) -> None:
    """Give ``root`` and everything below it the modes a new file (0666) or directory (0777) gets under the
    umask, as other tools' outputs have: safetensors' writer and ``mkstemp`` make owner-only files, which the other
    users of a shared machine or checkpoint directory could not read."""
    mask = umask()
    for path in (Path(root), *Path(root).rglob("*")):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


# renameat2's flag (linux/fs.h) and the "relative to the working directory" descriptor (fcntl.h)
RENAME_EXCHANGE, AT_FDCWD = 2, -100
# Directories this process is replacing now: their ``.NAME.old-PID`` is no leftover (see restore_replaced)
_replacing: set[Path] = set()


@functools.lru_cache(maxsize=1)
def _renameat2() -> Optional[Any]:
    """glibc's renameat2 (2.28+), or None (another C library, another system)."""
    try:
        return ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None


def _exchange(first: Path, second: Path) -> bool:
    """Swap two existing paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the system or the
    file system cannot."""
    renameat2 = _renameat2()
    if renameat2 is None:
        return False
    if renameat2(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def replace_directory(new: Path, final: Path) -> None:
    """Put the directory ``new`` in the place of ``final``, which may exist. Where the system can, the two are
    swapped in one step, so a kill at any moment leaves ``final`` holding the old content or the new one (a kill
    before the old content is removed from ``new``'s name leaves only that behind). Elsewhere the old directory is
    first renamed to ``.NAME.old-PID``; a kill before the second rename leaves ``final`` missing, which
    ``restore_replaced`` undoes."""
    new, final = Path(new), Path(final)
    if not final.exists():
        os.replace(new, final)
    elif _exchange(new, final):
        shutil.rmtree(new, ignore_errors=True)  # now the old content
    else:
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        _replacing.add(final.absolute())
        try:
            os.replace(final, old)
            os.replace(new, final)
        finally:
            _replacing.discard(final.absolute())
        shutil.rmtree(old, ignore_errors=True)
    fsync_directory(final.parent)


def _started_at(pid: int) -> Optional[float]:
    """When process ``pid`` started (seconds since the epoch, Linux's /proc), or None where that cannot be read."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _still_replacing(pid: int, old: Path, final: Path) -> bool:
    """Whether the process that renamed ``final`` to ``old`` may still be between its two renames: it is alive and
    started before the rename (a process started later only reuses its number, as after a container restart)."""
    if pid == os.getpid():
        return final.absolute() in _replacing
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        pass
    started = _started_at(pid)
    return started is None or started <= old.lstat().st_ctime + 1  # btime has whole seconds


def restore_replaced(final: Path) -> None:
    """Undo a kill between ``replace_directory``'s two renames (of this version's fallback, or of an older
    version's): ``final`` missing and its old content in ``.NAME.old-PID``, that process ended. Every reader and
    writer of a checkpoint directory calls this first."""
    final = Path(final)
    if final.name in ("", ".", "..") or final.exists() or final.is_symlink():
        return
    for old in sorted(final.parent.glob(f".{glob.escape(final.name)}.old-*")):
        pid = old.name.rsplit("-", 1)[1]
        if not pid.isdigit() or not old.is_dir() or _still_replacing(int(pid), old, final):
            continue
        os.replace(old, final)
        fsync_directory(final.parent)
        print(f"Note: {final} was missing: a process ({pid}) was killed while replacing it, after moving the old "
              f"content to {old.name}. Restored that content to {final}.", file=sys.stderr)
        return


def read_yaml_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file of ``key: value`` pairs, read with ``safe_load`` (a ``!!python/...`` tag is refused, never run);
    anything else (not UTF-8, not YAML, empty, a list) is one paragraph naming the file and ``what`` it holds."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError, RecursionError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{path} is not a valid UTF-8 YAML file ({first}); it should hold {what}, one `key: value` per "
                        "line. Fix it or re-create it.") from None
    if not isinstance(data, dict):
        held = "nothing" if data is None else f"a {type(data).__name__}"
        raise UserError(f"{path} holds {held}, not {what} (one `key: value` per line). Fix it or re-create it.")
    return data


Fields = TypeVar("Fields")


def dataclass_from_yaml(cls: type[Fields], path: Path, what: str) -> Fields:
    """``cls`` (a dataclass of bools and numbers with defaults) from the YAML file ``path`` holding ``what``: each
    value of the type of its field's default (a bool is no number, a quoted or non-finite number no number); keys
    ``cls`` does not have are left out. Any problem is one paragraph naming the file (exit status 1)."""
    data = read_yaml_mapping(path, what)
    values = {}
    for field in dataclasses.fields(cls):
        if field.name not in data:
            continue
        value, default = data[field.name], field.default
        if isinstance(default, bool):
            fits, kind = isinstance(value, bool), "true or false"
        else:
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            fits, kind = number and (isinstance(value, int) or not isinstance(default, int)), \
                "an integer" if isinstance(default, int) else "a number"
        if not fits:
            raise UserError(f"{path}: {field.name}: {value!r} is not {kind}. Fix it, or re-create {path.name} where it "
                            "was written.")
        values[field.name] = value
    try:
        return cls(**values)
    except UsageError as error:  # the checks of the flags the file's values came from
        raise UserError(f"{path}: {error}") from None
