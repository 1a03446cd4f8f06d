"""Resumable checkpoints: a run's lineage of step-N directories, writing one atomically, choosing and checking the one
to resume, and refusing to mix two runs in one out_dir.

A run's resumable checkpoints are one lineage: checkpoints/lineage.json lists them in the order written (rewritten
atomically after each save), the last is the one `--resume auto` takes. A fresh run removes the previous run's, a
resume moves aside what does not lead to the checkpoint it resumes, and pruning drops the oldest written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

from lightning.fabric import Fabric

from lit_model.io.checkpoint import MANIFEST_NAME, verify_checkpoint_dir, write_manifest
from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.core.files import atomic_write, disk_full_error, fsync_directory, is_disk_full
from lit_model.data.cache import checkpoint_digest, content_digest
from lit_model.train.args import TrainArgs

CHECKPOINTS = "checkpoints"
STATE_NAME = "state.pt"
LINEAGE_NAME = "lineage.json"
DATA_ORDER_NAME = "data_order.json"
LOCK_NAME = ".lit-model.lock"  # in out_dir while a run uses it (out_dir_lock)
# The flags that decide which samples each step sees and what its targets are, and LoRA's scale (the adapter's
# shapes are checked against the checkpoint's; its scale would change what the loaded adapter computes)
DATA_ORDER_FLAGS = ("data_path", "data", "data_fields", "global_batch_size", "seed", "override_max_seq_length",
                    "val_split_fraction", "packing", "prompt_style", "mask_prompt", "lora_alpha")
# The inputs whose content decides them, recorded by checksum (data_order): an older checkpoint lacks these
DIGESTS = {"data_sha256": "--data_path", "tokenizer_sha256": "--tokenizer_dir",
           "base_checkpoint_sha256": "--checkpoint_dir", "reference_model_sha256": "--reference_model"}
ORDER_FORMAT = 2  # data_order.json's: 2 records DIGESTS and the data-shaping flags


def checkpoint_dirs(out_dir: Path) -> list[Path]:
    """Every step-N directory in out_dir/checkpoints, by step (whatever lineage it belongs to)."""
    found = [p for p in (out_dir / CHECKPOINTS).glob("step-*") if re.fullmatch(r"step-\d+", p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def lineage(out_dir: Path) -> list[Path]:
    """The current run's checkpoints, oldest written first; by step for a directory an older version wrote."""
    path = out_dir / CHECKPOINTS / LINEAGE_NAME
    if not path.is_file():
        return checkpoint_dirs(out_dir)
    try:
        names = json.loads(path.read_text())["checkpoints"]
        if not all(isinstance(n, str) and re.fullmatch(r"step-\d+", n) for n in names):
            raise ValueError(f"unexpected entries {names!r}")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{path} is damaged ({error}). Delete it to resume the newest step-N checkpoint by step "
                        "number, or start over with --overwrite.") from None
    return [out_dir / CHECKPOINTS / name for name in names]


def write_lineage(out_dir: Path, checkpoints: list[Path]) -> None:
    atomic_write(out_dir / CHECKPOINTS / LINEAGE_NAME, json.dumps({"checkpoints": [p.name for p in checkpoints]}) + "\n")


def data_order(args: TrainArgs, base: Optional[Path] = None) -> dict[str, Any]:
    """The flags that decide which samples each step sees and what it learns from them, and the checksums of the
    inputs whose content does (the data, the tokenizer, the checkpoint the run started from, ``base``, and a
    preference run's reference): a resumed run must have the same, or it would go on training on other samples or
    targets, or on another model, than the checkpoint's run without a word."""
    order: dict[str, Any] = {"format": ORDER_FORMAT}
    order.update({name: getattr(args, name) for name in DATA_ORDER_FLAGS if hasattr(args, name)})
    if order.get("data_path") is not None:
        order["data_path"] = str(Path(order["data_path"]).resolve())
    inputs = {"data_sha256": getattr(args, "data_path", None), "tokenizer_sha256": getattr(args, "tokenizer_dir", None)}
    for name, path in inputs.items():
        if path is not None and Path(path).exists():
            order[name] = content_digest(Path(path))
    for name, path in (("base_checkpoint_sha256", base), ("reference_model_sha256", getattr(args, "reference_model", None))):
        if path is not None:
            order[name] = checkpoint_digest(Path(path))
    return order


def write_state(fabric: Fabric, directory: Path, state: dict[str, Any], config: Config, filter: Optional[dict[str, Any]] = None,
                order: Optional[dict[str, Any]] = None) -> None:
    """The model config, the data order and the resumable state into a fresh ``directory`` (every rank takes
    part), then its manifest; a failure removes the directory."""
    try:
        if fabric.global_rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
            directory.mkdir(parents=True)
            config.save(directory)
            if order is not None:
                atomic_write(directory / DATA_ORDER_NAME, json.dumps(order, indent=1) + "\n")
        fabric.barrier()
        fabric.save(directory / STATE_NAME, state, filter=filter)
        fabric.barrier()
        if fabric.global_rank == 0:
            write_manifest(directory)
    except BaseException as error:
        if fabric.global_rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        if is_disk_full(error):
            raise disk_full_error(directory.parent, "the resumable checkpoint") from None
        raise


def save_resumable(fabric: Fabric, args: TrainArgs, state: dict[str, Any], config: Config, step: int,
                   filter: Optional[dict[str, Any]] = None, base: Optional[Path] = None) -> Path:
    """Write into a temporary directory inside out_dir and rename it in, then add it to the lineage, so a crash
    mid-save leaves the last good one. The model config and the data order go beside the state so a resume can
    check them before loading anything large. ``filter`` (Fabric's ``save(filter=...)``) keeps part of a state,
    e.g. only the trainable parameters; ``base``: the checkpoint a fine-tune started from. ``--keep_last`` prunes the
    oldest written."""
    out_dir = args.out_dir
    final = out_dir / CHECKPOINTS / f"step-{step:08d}"
    tmp = final.with_name(f".{final.name}.tmp")
    write_state(fabric, tmp, state, config, filter, data_order(args, base) if fabric.global_rank == 0 else None)
    if fabric.global_rank == 0:
        shutil.rmtree(final, ignore_errors=True)  # only a save killed before its lineage update leaves one
        os.replace(tmp, final)
        fsync_directory(final.parent)
        written = [p for p in lineage(out_dir) if p != final] + [final]
        kept = written[-args.keep_last:] if args.keep_last > 0 else written
        write_lineage(out_dir, kept)
        for old in written[: len(written) - len(kept)]:
            shutil.rmtree(old, ignore_errors=True)
    fabric.barrier()
    return final


def check_resumable_state(path: Path) -> None:
    """A resumable checkpoint is there and matches its manifest. A sharded (FSDP) state's DCP metadata is a
    pickle: without a manifest to prove it is the one written with it, it is not loaded."""
    if not path.is_dir():
        raise UserError(f"{path} is missing.")
    if not (path / STATE_NAME).exists():
        raise UserError(f"{path} holds no {STATE_NAME}: it is not a resumable checkpoint (final/ is not; "
                        f"resume from {path.parent / CHECKPOINTS} or with --resume auto).")
    if not verify_checkpoint_dir(path) and (path / STATE_NAME).is_dir():
        raise UserError(f"{path} is a sharded checkpoint without {MANIFEST_NAME} (written by an older version or by "
                        "hand): its metadata is a pickle that cannot be verified, so it is not loaded. Start over with "
                        "--overwrite or another --out_dir.")


def choose_resume(out_dir: Path, resume: Optional[Union[str, Path]]) -> Optional[Path]:
    """The checkpoint ``--resume`` asks for, verified. ``auto``: the newest good one of the lineage, each
    damaged or missing newer one named in a warning (None: nothing to resume)."""
    if resume is None:
        return None
    if resume != "auto":
        path = Path(resume)
        if not (path / STATE_NAME).exists():
            raise UsageError(f"--resume {path}: no checkpoint there (expected {path / STATE_NAME}). Use --resume auto.")
        check_resumable_state(path)
        return path
    candidates = lineage(out_dir)
    for path in reversed(candidates):
        try:
            check_resumable_state(path)
            return path
        except UserError as error:
            print(f"Warning: --resume auto skips {path.name}: {error}", file=sys.stderr, flush=True)
    if candidates:
        raise UserError(f"--resume auto: none of the checkpoints in {out_dir / CHECKPOINTS} is usable (see the warnings "
                        "above). Start over with --overwrite, or resume a copy you trust with --resume PATH.")
    return None


def check_resume_matches(path: Path, config: Config, args: TrainArgs, base: Optional[Path] = None) -> None:
    """The checkpoint belongs to a run of this model on this data order, data and base checkpoint (``base``)."""
    if Config.from_checkpoint(path) != config:
        raise UsageError(
            f"Checkpoint {path} was written for another model config; resuming it into this one would mix two "
            "runs. Use the same --model_name/--model_config, or start over with --overwrite or a new --out_dir."
        )
    saved_path = path / DATA_ORDER_NAME
    if not saved_path.is_file():  # an older version's checkpoint
        return
    try:
        saved = json.loads(saved_path.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a JSON {type(saved).__name__}, not an object")
    except (OSError, ValueError) as error:
        raise UserError(f"{saved_path} is damaged ({error}); resume another checkpoint.") from None
    ours = data_order(args, base)
    names = sorted(set(ours) | set(saved))
    if saved.get("format") != ORDER_FORMAT:  # an older version's record: what it lacks cannot be compared
        names = sorted(set(saved) & set(ours)) + sorted(set(saved) - set(ours))
        if unrecorded := [name for name in ours if name not in saved and name != "format"]:
            print(f"Note: {path} does not record {', '.join(unrecorded)} (an older version wrote it): resuming "
                  "without checking them.", file=sys.stderr, flush=True)
    differ = [_difference(k, ours.get(k), saved.get(k), args, base) for k in names if ours.get(k) != saved.get(k)]
    if differ:
        raise UsageError(
            f"--resume {path}: {'; '.join(differ)}. These decide which samples each step sees and what it learns from "
            "them, so the resumed run would train on other data (or another model) than the run it continues. Resume "
            "with that run's values and files, or start over with --overwrite or another --out_dir."
        )


def _difference(name: str, ours: Any, saved: Any, args: TrainArgs, base: Optional[Path]) -> str:
    """What differs between this run and the checkpoint's, in the terms of the flag."""
    if name not in DIGESTS:
        return f"--{name} {ours} (the checkpoint's run: {saved})"
    flag = DIGESTS[name]
    path = base if flag == "--checkpoint_dir" else getattr(args, flag[2:], None)
    if ours is None or saved is None:
        return f"{flag} {path or '(none)'} (the checkpoint's run: {'another' if saved else 'none'})"
    return (f"{flag} {path} holds other content than the checkpoint's run had (SHA-256 now {str(ours)[:12]}..., "
            f"then {str(saved)[:12]}...)")


def start_lineage(args: TrainArgs, config: Config, check: Optional[Callable[[Path], None]] = None,
                  base: Optional[Path] = None) -> Optional[Path]:
    """On rank 0 before training: the checkpoint to resume (None: a fresh run), checked against this run
    (``check`` adds a caller's check; ``base``: the checkpoint a fine-tune starts from), and out_dir/checkpoints made its lineage. A fresh run removes the previous
    run's checkpoints (check_out_dir let it only with --overwrite); a resume moves every checkpoint that does
    not lead to the one it resumes (a branch abandoned by an explicit --resume, damaged ones) into
    checkpoints/abandoned-<time>/. Each says which."""
    out_dir, directory = args.out_dir, args.out_dir / CHECKPOINTS
    for stale in directory.glob(".*.tmp"):  # what a save killed midway left; never a checkpoint
        shutil.rmtree(stale, ignore_errors=True) if stale.is_dir() else stale.unlink(missing_ok=True)
    path = choose_resume(out_dir, args.resume)
    if path is None:
        if args.resume is not None:
            print(f"--resume {args.resume}: no checkpoint in {out_dir} yet, starting fresh.", flush=True)
        old = checkpoint_dirs(out_dir)
        if args.overwrite and directory.is_dir() and any(directory.iterdir()):
            shutil.rmtree(directory)
            if old:
                print(f"--overwrite: removed the previous run's checkpoints in {directory} ({', '.join(p.name for p in old)}).",
                      flush=True)
        (directory / LINEAGE_NAME).unlink(missing_ok=True)  # a previous run's, whose checkpoints are gone
        return None
    check_resume_matches(path, config, args, base)
    if check is not None:
        check(path)
    inside = path.resolve().parent == directory.resolve()
    written = lineage(out_dir)
    names = [p.name for p in written]
    kept = written[: names.index(path.name) + 1] if inside and path.name in names else ([directory / path.name] if inside else [])
    kept = [p for p in kept if p.is_dir()]
    aside = [p for p in checkpoint_dirs(out_dir) if p not in kept]
    if aside:
        target = Path(tempfile.mkdtemp(prefix=time.strftime("abandoned-%Y%m%d-%H%M%S-"), dir=directory))
        for old in aside:
            os.replace(old, target / old.name)
        print(f"Resuming {path}: moved the checkpoints that do not lead to it ({', '.join(p.name for p in aside)}) to {target}.",
              flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    write_lineage(out_dir, kept)
    return path


def check_out_dir(out_dir: Path, args: TrainArgs) -> None:
    """Refuse to mix two runs in one directory unless asked to resume or overwrite. Each script calls it before
    any process starts, holding the out_dir lock (Fabric's other ranks re-run it before they join, so rank 0 has
    written nothing yet); training writes into the directory only once it starts, and a directory made for the lock
    alone goes with it, so bad inputs found before that leave nothing."""
    holds_run = any((out_dir / name).exists() for name in ("metrics.csv", "summary.json", "final")) or bool(checkpoint_dirs(out_dir))
    if holds_run and args.resume is None and not args.overwrite:
        raise UsageError(
            f"{out_dir} already holds a run. Continue it with --resume auto, start over with --overwrite, or "
            "pick another --out_dir."
        )


def _lock_holder(handle: Any) -> str:
    """Who holds the lock, as its holder wrote it (PID, host, start time)."""
    handle.seek(0)
    try:
        text = handle.read(4096).strip()
        return f" ({text})" if text else ""
    except (OSError, UnicodeDecodeError):
        return ""


def holds_out_dir_lock() -> bool:
    """Whether this process is the one that locks out_dir: the first process (Fabric's launcher, which starts ranks
    1.. with LOCAL_RANK set) or torchrun's global rank 0; the other ranks run the same checks without it."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK"))


@contextlib.contextmanager
def out_dir_lock(out_dir: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``out_dir`` (flock on out_dir/.lit-model.lock) while the block runs: a second run
    started on the same out_dir, even a moment later, stops before it checks or writes anything, instead of mixing
    its metrics and checkpoints into the first's. The kernel releases the lock when the holder dies (a SIGKILL
    leaves only the file, which the next run takes over). A directory this made for the lock alone is removed on
    the way out, so a run that stopped on a bad input leaves nothing."""
    out_dir = Path(out_dir)
    created = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    path, handle, locked = out_dir / LOCK_NAME, None, False
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        while True:
            handle = open(path, "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # a file system without locks (some NFS mounts)
                    print(f"Warning: {out_dir} cannot be locked ({error.strerror}); nothing stops a second run from "
                          "using it at the same time.", file=sys.stderr, flush=True)
                    break
                if error.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                holder = _lock_holder(handle)
                handle.close()
                raise UserError(
                    f"{out_dir} is in use by another run{holder}: two runs in one --out_dir would mix their metrics "
                    "and checkpoints. Wait for that run to end (or stop it), or pick another --out_dir."
                ) from None
            # the holder before us removes the file as it leaves: a lock on a file no longer at that path locks nothing
            if path.exists() and os.fstat(handle.fileno()).st_ino == path.stat().st_ino:
                locked = True
                break
            handle.close()
        handle.truncate(0)
        handle.write(f"PID {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S %Z')}\n")
        handle.flush()
    except OSError as error:
        if locked:
            path.unlink(missing_ok=True)
        if handle is not None:
            handle.close()
        for directory in created:
            with contextlib.suppress(OSError):
                directory.rmdir()
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise disk_full_error(out_dir, "the run's lock file") from None
        raise UserError(f"--out_dir {out_dir} cannot be written ({error.strerror or error}). Pick a directory you can "
                        "write to.") from None
    try:
        yield
    finally:
        path.unlink(missing_ok=True)  # while still held: see above
        handle.close()
        for directory in created:  # innermost first; only those left empty
            with contextlib.suppress(OSError):
                directory.rmdir()
