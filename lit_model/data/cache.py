"""The cache of data derived from the inputs (token arrays, the default instruction records, the default
tokenizer) under ``cache_root()``.

A cache file is written atomically (lit_model/files.py) and then a record beside it, ``<file>.json``, with
its size and SHA-256 (and what its builder adds, e.g. the token count). Every load checks the file against
its record, so a truncated, shuffled or half-replaced cache is rebuilt (with a one-line warning) instead of
mapped with a wrong length or trained on silently. Hashing the standard library's 18 MB train array took
12-45 ms on a busy 2-core machine (SHA-256 at 0.4-1.4 GB/s), against 0.7 s for the whole cached load, so it
runs on every load (a 10 GB corpus cache would add seconds). Builds take a file lock, so the ranks of a run
build once; a complete cache is read without the lock, so it also works from a read-only directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from lit_model.errors import UserError
from lit_model.files import atomic_open, atomic_write

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


def checked_record(path: Path, valid: Callable[[dict[str, Any]], bool] = lambda record: True,
                   ) -> tuple[Optional[dict[str, Any]], Optional[str]]:
    """``(record, None)`` when ``path`` matches its record (and ``valid(record)``); ``(None, why)`` when it
    does not, and ``(None, None)`` when there is no cache file yet."""
    if not path.is_file():
        return None, None
    try:
        record = json.loads(record_path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None, "has no record of its size and checksum (an older version wrote it, or its writer was stopped)"
    except (OSError, ValueError) as error:
        return None, f"has an unreadable record ({error})"
    if not isinstance(record, dict) or not isinstance(record.get("size"), int) or "sha256" not in record or (
        not valid(record)
    ):
        return None, "has a damaged record"
    size = path.stat().st_size
    if size != record["size"]:
        return None, f"has {size:,} bytes where its record says {record['size']:,} (truncated or overwritten)"
    if sha256_file(path) != record["sha256"]:
        return None, "does not match its SHA-256 (its bytes changed)"
    return record, None


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
            print(f"warning: the cache file {path} {problem}; rebuilding it.", file=sys.stderr, flush=True)
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
