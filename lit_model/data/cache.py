"""The cache of data derived from the inputs (token arrays, the default instruction records, the default
tokenizer) under ``cache_root()``.

A cache file is written atomically (lit_model/core/files.py) and then a record beside it, ``<file>.json``, with
its size and SHA-256 (and what its builder adds, e.g. the token count); a cached directory (the tokenizer)
gets one listing its files. Every load checks the cache against its record, so a truncated, shuffled or half-replaced cache is rebuilt (with a one-line warning) instead of
mapped with a wrong length or trained on silently. Hashing the standard library's 18 MB train array took
12-45 ms on a busy 2-core machine (SHA-256 at 0.4-1.4 GB/s), against 0.7 s for the whole cached load, so it
runs on every load (a 10 GB corpus cache would add seconds). Builds take a file lock, so the ranks of a run
build once; a complete cache is read without the lock, so it also works from a read-only directory.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from lit_model.core.errors import UserError
from lit_model.core.files import atomic_open, atomic_write
from lit_model.io.checkpoint import MANIFEST_NAME, WEIGHTS_NAME

CACHE_VARIABLE = "LIT_MODEL_CACHE"
_HASH_CHUNK = 1 << 22


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or Path.home() / ".cache" / "lit-model")


def cache_error(path: Path, error: OSError) -> UserError:
    """The message for a cache that cannot be written: where the cache lives and how to move it."""
    return UserError(
        f"Cannot write the cache at {path}: {error.strerror or error}. lit-model keeps tokenized data and the "
        f"default tokenizer under ${CACHE_VARIABLE} (now {cache_root()}); set {CACHE_VARIABLE} to a writable "
        f"directory with free space, e.g. {CACHE_VARIABLE}=/tmp/lit-model-cache."
    )


@contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock across processes; the lock file stays (removing it would race with waiters)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a")
    except OSError as error:
        raise cache_error(path.parent, error) from None
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def record_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def content_digest(path: Path) -> str:
    """The SHA-256 of a file's bytes, or of a directory's files (their relative names and contents; hidden files
    left out): what a resumed run compares to know its data is the data its checkpoint was trained on."""
    path = Path(path)
    files = sorted(p for p in path.rglob("*") if p.is_file() and not any(part.startswith(".") for part in
                                                                          p.relative_to(path).parts)) if path.is_dir() else [path]
    # hashing a large corpus takes seconds: once per content, which the files' sizes and times stand for
    return _content_digest(str(path), tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=16)
def _content_digest(root: str, files: tuple[tuple[str, int, int], ...]) -> str:
    if len(files) == 1 and files[0][0] == root:
        return sha256_file(Path(root))
    digest = hashlib.sha256()
    for name, _, _ in files:
        digest.update(f"{Path(name).relative_to(root).as_posix()}\0{sha256_file(Path(name))}\0".encode())
    return digest.hexdigest()


def checkpoint_digest(directory: Path) -> str:
    """What identifies a checkpoint's weights: the SHA-256 of its manifest (which lists every file's), else of its
    weights file."""
    manifest = Path(directory) / MANIFEST_NAME
    return sha256_file(manifest if manifest.is_file() else Path(directory) / WEIGHTS_NAME)


def _read_record(path: Path) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    try:
        record = json.loads(record_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "has no record of its size and checksum (an older version wrote it, or its writer was stopped)"
    except (OSError, ValueError) as error:
        return None, f"has an unreadable record ({error})"
    return (record, None) if isinstance(record, dict) else (None, "has a damaged record")


def _mismatch(path: Path, entry: Any) -> Optional[str]:
    """Why ``path`` does not match its record's ``{"size", "sha256"}`` entry; None if it does."""
    if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or "sha256" not in entry:
        return "has a damaged record"
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    if size != entry["size"]:
        return f"has {size:,} bytes where its record says {entry['size']:,} (truncated or overwritten)"
    if sha256_file(path) != entry["sha256"]:
        return "does not match its SHA-256 (its bytes changed)"
    return None


def checked_record(path: Path, valid: Callable[[dict[str, Any]], bool] = lambda record: True,
                   ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """``(record, None)`` when ``path`` matches its record (and ``valid(record)``); ``(None, why)`` when it
    does not, and ``(None, None)`` when there is no cache file yet."""
    if not path.is_file():
        return None, None
    record, problem = _read_record(path)
    if record is not None and not valid(record):
        record, problem = None, "has a damaged record"
    if record is not None and (problem := _mismatch(path, record)) is not None:
        record = None
    return record, problem


def checked_directory(directory: Path) -> tuple[bool, Optional[str]]:
    """Like ``checked_record`` for a directory whose record lists its files: ``(True, None)`` when they all
    match, ``(False, why)`` when one does not, ``(False, None)`` when there is no directory yet."""
    if not directory.is_dir():
        return False, None
    record, problem = _read_record(directory)
    if record is None:
        return False, problem
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return False, "has a damaged record"
    for name, entry in files.items():
        if (problem := _mismatch(directory / name, entry)) is not None:
            return False, f"has a file {name} that {problem}"
    return True, None


def write_directory_record(directory: Path) -> None:
    """The record ``checked_directory`` checks: the size and SHA-256 of each file in ``directory``."""
    files = {p.name: {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in sorted(directory.iterdir())
             if p.is_file()}
    try:
        atomic_write(record_path(directory), json.dumps({"files": files}) + "\n")
    except OSError as error:
        raise cache_error(directory, error) from None


def warn_rebuild(path: Path, problem: str) -> None:
    print(f"warning: the cache {path} {problem}; rebuilding it.", file=sys.stderr, flush=True)


def cached(path: Path, build: Callable[[Callable[[bytes], object]], dict[str, Any]],
           valid: Callable[[dict[str, Any]], bool] = lambda record: True) -> dict[str, Any]:
    """The record of the cache file ``path``, built first if it is missing or fails its check.

    ``build(write)`` writes the content through ``write`` and returns what to add to the record; ``valid``
    checks what it added. ``build`` must turn its own read errors into ``UserError``: an ``OSError`` here is
    blamed on the cache directory.
    """
    record, _ = checked_record(path, valid)
    if record is not None:
        return record
    with file_lock(path.with_name(path.name + ".lock")):
        record, problem = checked_record(path, valid)  # another rank may have built it while we waited
        if record is not None:
            return record
        if problem is not None:
            warn_rebuild(path, problem)
        digest, size = hashlib.sha256(), 0

        def write(data: bytes) -> None:
            nonlocal size
            handle.write(data)
            digest.update(data)
            size += len(data)

        try:
            with atomic_open(path, "wb") as handle:
                extra = build(write)
            # the record last: a kill between the two leaves a file without a matching record, rebuilt next time
            record = {"size": size, "sha256": digest.hexdigest(), **extra}
            atomic_write(record_path(path), json.dumps(record) + "\n")
        except OSError as error:
            raise cache_error(path, error) from None
    return record
