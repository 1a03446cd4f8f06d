"""Checkpoint directories: ``model.safetensors`` + ``model_config.yaml`` + tokenizer files + ``manifest.json``.

Everything is written into a temporary sibling directory and renamed into place, so an interrupted save
never leaves a half-written checkpoint where a good one (or nothing) was. The manifest (every file's size and
SHA-256, written last) is verified before a checkpoint is used, so flipped bytes, a truncated file or a
planted one stop with a message naming the file instead of training on garbage or running a pickle.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import struct
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.nn as nn
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from lit_model.core.config import Config
from lit_model.core.errors import UserError
from lit_model.core.files import (
    atomic_write, check_out_dir_path, disk_full_error, follow_umask, fsync_directory, is_disk_full, replace_directory,
    restore_replaced,
)
from lit_model.io.tokenizer import TOKENIZER_FILES, has_tokenizer

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "model_config.yaml"
MANIFEST_NAME = "manifest.json"


def refuse_to_replace(final_dir: Path) -> None:
    """Nothing replaces a user's directory (or file) unless they passed --overwrite; an empty one holds nothing."""
    if final_dir.exists() and (not final_dir.is_dir() or any(final_dir.iterdir())):
        raise UserError(f"{final_dir} already exists and is not empty; nothing was written. Pass --overwrite to "
                        "replace it, or choose another output directory.")


def check_output_dir(out_dir: Path, overwrite: bool, inputs: tuple[Path, ...] = (), flag: str = "--out_dir") -> None:
    """What ``atomic_directory`` checks before it writes anything, for a command to call before its heavy work with
    the directories it reads (``inputs``): ``out_dir`` can be made and renamed into place, holds no input and lies
    in none, and is empty unless ``overwrite``."""
    restore_replaced(out_dir)
    check_out_dir_path(out_dir, inputs, replaced=True, flag=flag)
    if not overwrite:
        refuse_to_replace(out_dir)


@contextlib.contextmanager
def atomic_directory(final_dir: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``final_dir`` once the block finished, with its files given the
    umask's modes and its manifest written last. A non-empty ``final_dir`` is refused (before anything is written)
    unless ``overwrite``: pass the user's --overwrite, or True only for a directory of a run the user already
    allowed."""
    final_dir = Path(final_dir)
    check_output_dir(final_dir, overwrite)
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = final_dir.with_name(f".{final_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir()
    try:
        yield tmp_dir
        follow_umask(tmp_dir)
        write_manifest(tmp_dir)
        if not overwrite:  # it may have appeared meanwhile
            refuse_to_replace(final_dir)
    except BaseException as error:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        if is_disk_full(error):
            raise disk_full_error(final_dir) from None
        raise
    replace_directory(tmp_dir, final_dir)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):  # small reads: hashing adds nothing to a load's peak memory
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST_NAME)


def write_manifest(directory: str | Path, paths: Optional[list[Path]] = None, name: str = MANIFEST_NAME,
                   **extra: object) -> Path:
    """``directory/name``: the size and SHA-256 of ``paths`` (default: every file below ``directory``, subdirectories
    too: a sharded state) and the ``extra`` entries, each file fsynced first so the manifest never describes data
    still in the page cache."""
    directory = Path(directory)
    paths = _files(directory) if paths is None else paths
    files = {}
    for path in paths:
        with open(path, "rb") as file:
            os.fsync(file.fileno())
        files[path.relative_to(directory).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    for sub in {p.parent for p in paths} | {directory}:
        fsync_directory(sub)
    return atomic_write(directory / name, json.dumps({"format": 1, "files": files, **extra}, indent=1) + "\n")


# Manifests verified by this process, with the file stats they had then (None: no manifest, noted), so the
# several steps of one load (config, tokenizer, weights) hash the files once
_verified: dict[Path, Optional[tuple]] = {}


def verify_checkpoint_dir(directory: str | Path) -> bool:
    """Check every file the manifest lists against its size and SHA-256; raise a UserError naming the first bad
    one. Returns False for a directory without a manifest (an older version's, or one made by hand): it is used
    as it is, with a one-line note. Files added beside the listed ones (e.g. lora.safetensors) are allowed."""
    return verify_manifest(directory) is not None


def verify_manifest(directory: str | Path, name: str = MANIFEST_NAME) -> Optional[dict]:
    """``verify_checkpoint_dir`` for the manifest ``name`` (an adapter's has its own); returns the manifest, or
    None where there is none."""
    directory = Path(directory)
    manifest_path = directory / name
    key_path = directory.resolve() / name
    if not manifest_path.is_file():
        if _verified.get(key_path, ()) is None:  # noted once
            return None
        _verified[key_path] = None
        print(f"Note: {directory} has no {name} (written by an older version or by hand); "
              "its files are used unverified.", file=sys.stderr)
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
        entries = [(listed, int(entry["size"]), str(entry["sha256"])) for listed, entry in manifest["files"].items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as error:
        raise UserError(f"{manifest_path} is damaged ({error!r}), so {directory} cannot be verified. Use another "
                        "checkpoint, or delete the manifest if you trust the files.") from None
    stats = []
    for listed, size, _ in entries:
        path = directory / listed
        if Path(listed).is_absolute() or ".." in Path(listed).parts or not path.is_file():
            raise UserError(f"{path} is missing (listed in {manifest_path}): the checkpoint {directory} is "
                            "incomplete. Use another checkpoint or re-create this one.")
        stat = path.stat()
        stats.append((listed, stat.st_size, stat.st_mtime_ns))
    key = tuple(stats)
    if _verified.get(key_path) == key:
        return manifest
    for listed, size, sha256 in entries:
        path = directory / listed
        actual = path.stat().st_size
        if actual != size:
            raise UserError(f"{path} is damaged: {actual} bytes where {size} were written (truncated or overwritten). "
                            f"The checkpoint {directory} cannot be used; use another one or re-create it.")
        if _sha256(path) != sha256:
            raise UserError(f"{path} is damaged: its SHA-256 differs from the one written with it (flipped bytes, or a "
                            f"replaced file). The checkpoint {directory} cannot be used; use another one or re-create it.")
    _verified[key_path] = key
    return manifest


def lit_state_dict(model: nn.Module, config: Config) -> dict[str, torch.Tensor]:
    """The model's weights as stored on disk: tied head weights once, contiguous tensors."""
    state_dict = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_embeddings:
        state_dict.pop("lm_head.weight", None)
    return state_dict


def save_weights(state_dict: dict[str, torch.Tensor], directory: Path) -> None:
    save_file({k: v.detach().contiguous() for k, v in state_dict.items()}, str(directory / WEIGHTS_NAME))


def save_checkpoint_dir(
    state_dict: dict[str, torch.Tensor],
    config: Config,
    out_dir: str | Path,
    tokenizer_dir: Optional[str | Path] = None,
    overwrite: bool = False,
    write_extra: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Write weights, config, the tokenizer files and what ``write_extra(tmp_dir)`` adds atomically to ``out_dir``
    (``overwrite``: see ``atomic_directory``)."""
    out_dir = Path(out_dir)
    if config.tie_embeddings:
        state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
    with atomic_directory(out_dir, overwrite) as tmp_dir:
        save_weights(state_dict, tmp_dir)
        config.save(tmp_dir)
        if tokenizer_dir is not None:
            for name in TOKENIZER_FILES:
                if (Path(tokenizer_dir) / name).is_file():
                    shutil.copy2(Path(tokenizer_dir) / name, tmp_dir / name)
        if write_extra is not None:
            write_extra(tmp_dir)
    return out_dir


def derive_checkpoint_dir(
    base_dir: str | Path,
    out_dir: str | Path,
    state_dict: Optional[dict[str, torch.Tensor]] = None,
    write_extra: Optional[Callable[[Path], None]] = None,
    skip: tuple[str, ...] = (),
    overwrite: bool = False,
) -> Path:
    """Write ``out_dir`` atomically from checkpoint ``base_dir``: its files (config, tokenizer, ...) except those
    named in ``skip``, ``state_dict`` as the weights (default: a copy of the base weights), then what
    ``write_extra(tmp_dir)`` adds. ``out_dir`` may be ``base_dir`` itself (with ``overwrite``, see
    ``atomic_directory``)."""
    base_dir = check_checkpoint_dir(base_dir)
    with atomic_directory(out_dir, overwrite) as tmp_dir:
        for path in sorted(base_dir.iterdir()):
            replaced = state_dict is not None and path.name == WEIGHTS_NAME
            if path.is_file() and path.name not in (*skip, MANIFEST_NAME) and not replaced:
                shutil.copy2(path, tmp_dir / path.name)
        if state_dict is not None:
            save_weights(state_dict, tmp_dir)
        if write_extra is not None:
            write_extra(tmp_dir)
    return Path(out_dir)


def check_checkpoint_dir(checkpoint_dir: str | Path, need_tokenizer: bool = False) -> Path:
    """The gate every load of a checkpoint directory passes: its files are there and match its manifest."""
    checkpoint_dir = Path(checkpoint_dir)
    restore_replaced(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise UserError(
            f"Checkpoint directory {str(checkpoint_dir)!r} does not exist. Pass --checkpoint_dir with a directory "
            "made by pretrain/main.py, a finetune script, or `python -m lit_model.convert hf_to_lit`."
        )
    missing = [name for name in (WEIGHTS_NAME, CONFIG_NAME) if not (checkpoint_dir / name).is_file()]
    if need_tokenizer and not has_tokenizer(checkpoint_dir):
        missing.append("tokenizer.json or tokenizer.model")
    if missing:
        present = sorted(p.name for p in checkpoint_dir.iterdir())
        hint = (
            " It looks like a Hugging Face checkpoint: convert it with `python -m lit_model.convert hf_to_lit "
            f"--hf_dir {checkpoint_dir} --out_dir <dir>`."
            if (checkpoint_dir / "config.json").is_file()
            else ""
        )
        raise UserError(
            f"{checkpoint_dir} is not a complete lit-model checkpoint: missing {', '.join(missing)} "
            f"(found: {', '.join(present) or 'nothing'}).{hint}"
        )
    verify_checkpoint_dir(checkpoint_dir)
    return checkpoint_dir


def load_model_weights(
    model: nn.Module,
    checkpoint_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: Optional[torch.dtype] = None,
    devices: Optional[dict[str, torch.device]] = None,
    on_part: Optional[Callable[[str, nn.Module], None]] = None,
    column_major: frozenset[str] = frozenset(),
) -> None:
    """Assign the stored tensors to a (meta-device) model one part ("embed", "blocks.3", ...) at a time,
    each tensor cast straight to ``dtype`` and moved to its part's device (``devices``, else ``device``); the
    matrices named in ``column_major`` are read straight into that layout (``SafetensorsReader.read``).
    Names and shapes are checked before anything is read; ``on_part`` runs after each part (quantization)."""
    path = check_checkpoint_dir(checkpoint_dir) / WEIGHTS_NAME
    devices = devices or {}
    tied = bool(getattr(model.config, "tie_embeddings", False))
    with SafetensorsReader(path) as file:
        check_state_dict(model, file.meta_tensors(), source=str(path))
        for part_name, part in model_parts(model):
            prefix, part_device = part_name + ".", torch.device(devices.get(part_name, device))
            state: dict[str, torch.Tensor] = {}
            for name in file.shapes:
                if name.startswith(prefix):
                    state[name[len(prefix):]] = file.read(name, dtype, name in column_major).to(part_device)
            if tied and part_name == "lm_head":
                state["weight"] = model.embed.weight
            if not state:
                continue
            part.load_state_dict(state, strict=True, assign=True)
            del state
            if on_part is not None:
                on_part(part_name, part)


def model_parts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Top-level children, with ModuleLists split into their items ("blocks.0", "blocks.1", ...)."""
    parts = []
    for name, child in model.named_children():
        if isinstance(child, nn.ModuleList):
            parts.extend((f"{name}.{i}", item) for i, item in enumerate(child))
        else:
            parts.append((name, child))
    return parts


class SafetensorsReader:
    """Reads one tensor of a .safetensors file at a time with plain file reads: unlike a memory map, the
    file's pages never count towards the process's memory, so peak RSS shows only the tensors kept. The header
    is checked as strictly as the safetensors library checks it (``_parse_header``), so no tensor is read from
    another's bytes or from the header."""

    DTYPES = {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    }
    STAGING_BYTES = 16 << 20  # a cast reads through this much at a time
    MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.file = open(self.path, "rb")
        except OSError as error:
            raise UserError(f"Could not read {self.path}: {error!r}. Check the file, or re-create or re-convert it.") from None
        try:
            self.entries, self.base = self._parse_header()
        except UserError:
            self.file.close()
            raise
        self.shapes = {name: tuple(entry[1]) for name, entry in self.entries.items()}
        self.staging: Optional[torch.Tensor] = None

    def _parse_header(self) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], int]:
        """(name -> (dtype, shape, start, end) in the data section, the data section's offset in the file)."""
        def damaged(what: str) -> UserError:
            return UserError(f"{self.path} is damaged or not a safetensors file: {what}. Re-create or re-convert it.")

        def unique(pairs: list[tuple[str, object]]) -> dict[str, object]:
            if len({key for key, _ in pairs}) != len(pairs):
                raise damaged("its header names a tensor twice")
            return dict(pairs)

        size = os.fstat(self.file.fileno()).st_size
        if size < 8:
            raise damaged(f"{size} bytes, fewer than the 8 of a header's length")
        (length,) = struct.unpack("<Q", self.file.read(8))
        if length > min(size - 8, self.MAX_HEADER_BYTES):
            raise damaged(f"its header claims {length} bytes, the file holds {size - 8} after the length (and a header "
                          f"holds at most {self.MAX_HEADER_BYTES})")
        try:
            header = json.loads(self.file.read(length), object_pairs_hook=unique)
        except (ValueError, RecursionError) as error:
            raise damaged(f"its header is not JSON ({type(error).__name__}: {str(error)[:100]})") from None
        if not isinstance(header, dict) or not isinstance(header.pop("__metadata__", {}), dict):
            raise damaged("its header is not a JSON object of tensors")
        entries, data_bytes = {}, size - 8 - length
        for name, entry in header.items():
            if not isinstance(entry, dict):
                raise damaged(f"tensor {name!r} is described by {entry!r}, not by dtype, shape and data_offsets")
            dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in self.DTYPES:
                raise damaged(f"tensor {name!r} has the dtype {dtype!r}, not one of {', '.join(self.DTYPES)}")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise damaged(f"tensor {name!r} has the shape {shape!r}, not a list of sizes (integers >= 0)")
            if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                    and 0 <= offsets[0] <= offsets[1] <= data_bytes):
                raise damaged(f"tensor {name!r} has the data_offsets {offsets!r}, not [begin, end] inside the "
                              f"{data_bytes}-byte data section")
            if offsets[1] - offsets[0] != math.prod(shape) * self.DTYPES[dtype].itemsize:
                raise damaged(f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, its shape {shape} of {dtype} "
                              f"{math.prod(shape) * self.DTYPES[dtype].itemsize}")
            entries[name] = (self.DTYPES[dtype], shape, *offsets)
        end = 0  # the tensors tile the data section in offset order: no gap, no overlap, nothing after
        for name, (_, _, start, stop) in sorted(entries.items(), key=lambda item: item[1][2:]):
            if start != end:
                raise damaged(f"tensor {name!r} starts at byte {start} of the data section where the previous one "
                              f"ends at {end} ({'overlapping it' if start < end else 'a gap'})")
            end = stop
        if end != data_bytes:
            raise damaged(f"its tensors end at byte {end} of the {data_bytes}-byte data section")
        return entries, 8 + length

    def meta_tensors(self) -> dict[str, torch.Tensor]:
        """Each stored tensor's shape and dtype, on the meta device (for ``check_state_dict``)."""
        return {name: torch.empty(shape, dtype=dtype, device="meta") for name, (dtype, shape, *_) in self.entries.items()}

    def read(self, name: str, dtype: Optional[torch.dtype] = None, column_major: bool = False) -> torch.Tensor:
        """The stored tensor, or (``dtype``) a tensor of that dtype converted from it through one small reused
        buffer: a bf16 copy of every tensor allocated and freed around the cast interleaves short- and long-lived
        blocks on glibc's heap, which then keeps the holes (measured: +0.7 GB loading a 1.1B model in fp32).
        ``column_major`` (a matrix): the same values stored column-major (``.t()`` contiguous), written through
        that buffer too, so no row-major copy is made and freed."""
        stored, shape, start, end = self.entries[name]
        dtype = stored if dtype is None or not stored.is_floating_point else dtype
        column_major = column_major and len(shape) == 2
        tensor = torch.empty(shape[::-1], dtype=dtype).t() if column_major else torch.empty(shape, dtype=dtype)
        if dtype == stored and not column_major:
            self._read_into(tensor.reshape(-1).view(torch.uint8), start, end, name)
            return tensor
        size = stored.itemsize
        rows = tensor.view(-1, 1) if tensor.dim() < 2 else tensor.flatten(1)  # a matrix itself, either layout
        row_bytes = rows.size(1) * size
        if self.staging is None or self.staging.numel() < row_bytes:
            self.staging = torch.empty(max(self.STAGING_BYTES, row_bytes), dtype=torch.uint8)
        step = self.staging.numel() // max(row_bytes, 1)  # whole rows at a time (an empty row: one pass)
        for first in range(0, rows.size(0), step):
            count = min(step, rows.size(0) - first)
            chunk = self.staging[: count * row_bytes]
            self._read_into(chunk, start + first * row_bytes, start + (first + count) * row_bytes, name)
            rows[first : first + count].copy_(chunk.view(stored).view(count, rows.size(1)))
        return tensor

    def _read_into(self, buffer: torch.Tensor, start: int, end: int, name: str) -> None:
        self.file.seek(self.base + start)
        if end - start != buffer.numel() or self.file.readinto(memoryview(buffer.numpy())) != end - start:
            raise UserError(f"{self.path} is truncated or damaged at tensor {name!r}; re-create or re-convert it.")

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.staging = None
        self.file.close()


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """A small file of tensors (an adapter's) read whole by the safetensors library, which refuses a damaged
    header, overlapping or out-of-range offsets; any of those is one paragraph naming the file."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as error:
        raise UserError(f"Could not read {path}: {error}. The file is damaged or not a safetensors file; re-create "
                        "it, or copy it again from where it was trained.") from None


def check_adapter_weights(path: Path, weights: dict[str, torch.Tensor], expected: dict[str, torch.Size],
                          config_name: str) -> None:
    """An adapter's ``weights`` (read from ``path``) are what the adapted model's trainable parameters
    (``expected``) need: the same names and shapes, floating point and finite; else one paragraph naming the
    tensor. ``config_name``: the file of settings the shapes follow from."""
    missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or extra:
        raise UserError(
            f"{path} does not fit {config_name} and this model: it holds {len(weights)} tensors, the adapted model "
            f"{len(expected)} ({f'missing e.g. {missing[0]!r}' if missing else f'no place for e.g. {extra[0]!r}'}). "
            f"Use the adapter with the base model and {config_name} it was trained with, or re-create it.")
    for name, tensor in weights.items():
        if tuple(tensor.shape) != tuple(expected[name]):
            raise UserError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, where this model and {config_name} need "
                f"{tuple(expected[name])}. The adapter belongs to another model or other settings (a LoRA rank r?).")
        if not tensor.is_floating_point():
            raise UserError(f"{path}: tensor {name!r} holds {tensor.dtype} values, not floating point weights. "
                            "Re-create the adapter.")
        if not torch.isfinite(tensor).all():
            raise UserError(f"{path}: tensor {name!r} holds NaN or infinite values (a diverged training run?); the "
                            "model would compute NaN. Use an earlier checkpoint of the adapter.")


def check_state_dict(model: nn.Module, state_dict: dict[str, torch.Tensor], source: str) -> None:
    expected = {name: tensor.shape for name, tensor in model.state_dict().items()}
    if getattr(model.config, "tie_embeddings", False):
        expected.pop("lm_head.weight", None)
    for name, tensor in state_dict.items():
        if name not in expected:
            raise UserError(f"{source} holds a tensor {name!r} that this model config has no place for.")
        if tuple(tensor.shape) != tuple(expected[name]):
            raise UserError(
                f"{source}: tensor {name!r} has shape {tuple(tensor.shape)} but the model config expects "
                f"{tuple(expected[name])}. The weights and model_config.yaml belong to different models."
            )
        if not tensor.is_floating_point():
            raise UserError(f"{source}: tensor {name!r} holds {tensor.dtype} values, where a model's weights are "
                            "floating point. The file is damaged or was not written for this model; re-create it.")
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise UserError(f"{source} is missing {len(missing)} tensors the model needs, e.g. {missing[:3]}.")
