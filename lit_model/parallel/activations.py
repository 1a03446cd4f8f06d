"""Where a training forward keeps its activations: selective activation checkpointing (keep the matmul and
attention outputs, recompute the element-wise ops), activation offloading (saved tensors moved to host memory
or to files until backward needs them) and the tiled MLP (the MLP computed, and recomputed, a sequence tile at
a time).

``parallel/apply.py`` wraps the model's blocks and MLPs in them from outside (the model knows none of them), for
training and for the memory planner's trace alike, so the trace runs exactly this code. Under the trace the tensors are fake:
offloading then only drops the device tensor and remembers its bytes (``_Dropped``), which is what the trace
must see (device memory falls, host memory rises); the real destinations write nothing for fake tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import is_fake
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

# ---- selective activation checkpointing ---------------------------------------------------------------------
aten = torch.ops.aten
# The ops whose outputs a selective checkpoint keeps: the matmuls and attention, which cost the most to redo. Every
# other op (norms, activations, RoPE, residual adds, casts) is recomputed in backward from the kept outputs and the
# block's input. As torchtitan's "op" selective AC (which also keeps every other matmul only; this keeps them all).
# Not baddbmm: only the CPU's attention in blocks (ops.py) calls it, for fp32 score tiles that are cheaper to redo
# than to keep (4 bytes a score; the blocks' products with the values are kept).
SAVED_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._flash_attention_forward.default, aten._efficient_attention_forward.default,
    *([torch.ops.mkldnn._linear_pointwise.default] if hasattr(torch.ops.mkldnn, "_linear_pointwise") else []),  # ops.linear
})


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """``torch.utils.checkpoint.checkpoint(..., context_fn=selective_contexts)``: keep matmul/attention outputs."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def checkpointed(function: Callable[..., torch.Tensor], *args: Any, selective: bool = False) -> torch.Tensor:
    """``function(*args)`` whose activations are recomputed in backward (all of them, or with ``selective`` all but
    the matmul and attention outputs)."""
    if selective:
        return checkpoint(function, *args, use_reentrant=False, context_fn=selective_contexts)
    return checkpoint(function, *args, use_reentrant=False)


# ---- the tiled MLP ----------------------------------------------------------------------------------------
def tiled(mlp: nn.Module, x: torch.Tensor, tiles: int) -> torch.Tensor:
    """``mlp(x)`` for x of (batch, time, channels), computed ``tiles`` slices of time at a time. Under autograd each
    tile is checkpointed: only one tile's intermediate activations (the MLP's largest, intermediate_size wide) exist
    at once, in forward and in the recomputation in backward; the MLP keeps nothing but its input."""
    pieces = x.tensor_split(min(tiles, x.size(1)), dim=1)
    grad = torch.is_grad_enabled()
    return torch.cat([checkpointed(mlp, piece) if grad else mlp(piece) for piece in pieces], dim=1)


# ---- activation offloading --------------------------------------------------------------------------------
OFFLOAD_TARGETS = ("cpu", "disk")
# Saved tensors smaller than this stay on the device: the fixed cost of a copy (a stream event and a pinned buffer,
# or a file: tens of microseconds) outweighs moving a few KB, and such tensors (norm statistics, indices) are a
# small share of a block's activations. torchtune's OffloadActivations uses 1 KB for GPU copies only; files cost more.
MIN_OFFLOAD_BYTES = 64 * 1024


@dataclass(frozen=True)
class _View:
    """How a saved tensor sits in its storage."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    def of(self, storage: torch.Tensor) -> torch.Tensor:
        """This view of ``storage`` (its bytes as a flat uint8 tensor)."""
        return storage.view(self.dtype).as_strided(self.size, self.stride, self.offset)


class _Stored:
    """One offloaded storage (every saved view of it shares it): where its bytes went, and the storage once it is
    back on the device."""

    def __init__(self, nbytes: int, device: torch.device, where: Any) -> None:
        self.nbytes, self.device, self.where = nbytes, device, where
        self.data: Any = None
        self.loaded: Optional[torch.Tensor] = None

    def load(self) -> torch.Tensor:
        if self.loaded is None:  # the first of its views that backward needs brings it back
            self.loaded = self.where.load(self)
            self.data = None
        return self.loaded


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat uint8 tensor."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),), (1,))


class _Dropped:
    """The planner's trace (fake tensors): the device storage is let go and an uninitialised one comes back in
    backward, so the trace sees exactly the device memory that offloading frees and brings back."""

    def store(self, tensor: torch.Tensor, stored: _Stored) -> None:
        pass  # (a flat view of a fake storage would be a new fake tensor of the tracker's, counted twice)

    def load(self, stored: _Stored) -> torch.Tensor:
        return torch.empty(stored.nbytes, dtype=torch.uint8, device=stored.device)


class _HostMemory:
    """CUDA: pinned host buffers, filled on a side stream so that the copies overlap the forward's compute. The
    device block goes back to the allocator when the forward drops the tensor, but is not reused before the copy on
    the side stream has finished (``record_stream``)."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()

    def store(self, tensor: torch.Tensor, stored: _Stored) -> None:
        storage = _bytes_of(tensor)
        host = torch.empty(storage.size(), dtype=torch.uint8, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())  # the tensor is complete
        with torch.cuda.stream(self.stream):
            host.copy_(storage, non_blocking=True)
        storage.record_stream(self.stream)
        stored.data = host

    def load(self, stored: _Stored) -> torch.Tensor:
        torch.cuda.current_stream().wait_stream(self.stream)  # every copy to the host has finished
        return stored.data.to(stored.device, non_blocking=True)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)


class _DiskFiles:
    """Files in a directory of this process under ``directory`` (made at the first tensor, removed with the
    offloader). Each storage is one temporary file in it, deleted as soon as backward has read it back, or when
    autograd drops it unread (a failed or abandoned step)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.folder: Optional[str] = None

    def _folder(self) -> str:
        if self.folder is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.folder = tempfile.mkdtemp(prefix=".activations-", dir=self.directory)
            weakref.finalize(self, shutil.rmtree, self.folder, True)
        return self.folder

    def store(self, tensor: torch.Tensor, stored: _Stored) -> None:
        storage = _bytes_of(tensor)
        descriptor, path = tempfile.mkstemp(suffix=".tmp", dir=self._folder())
        weakref.finalize(stored, _remove, path)
        host = storage.cpu()
        with os.fdopen(descriptor, "wb") as file:
            # straight from the storage's memory: a numpy view of it would leave the storage unresizable, and FSDP
            # frees its unsharded parameters (which a saved tensor may view) by resizing their storages to 0
            file.write((ctypes.c_char * host.numel()).from_address(host.data_ptr()))
        stored.data = path

    def load(self, stored: _Stored) -> torch.Tensor:
        data = torch.from_file(stored.data, size=stored.nbytes, dtype=torch.uint8)
        _remove(stored.data)
        return data.to(stored.device)


class ActivationOffloading:
    """Saved-tensor hooks that move what the forward saves for backward out of device memory and bring it back when
    backward needs it. ``target``: "cpu" (pinned host memory; CUDA only) or "disk" (files under ``directory``).
    A storage moves once however many of its views are saved (a linear's input saved by q, k and v). Tensors under
    MIN_OFFLOAD_BYTES, parameters and the tensors passed as ``resident`` stay where they are.
    ``held_bytes``/``peak_bytes``: the offloaded bytes now / at most (host memory or disk)."""

    def __init__(self, target: str, directory: Optional[Union[str, Path]] = None) -> None:
        if target not in OFFLOAD_TARGETS:
            raise ValueError(f"target={target!r}: use one of {OFFLOAD_TARGETS}")
        self.target, self.directory = target, directory
        self._destination: Any = None  # made at the first real tensor (the trace needs no stream and no files)
        self._dropped = _Dropped()
        self.held_bytes = 0
        self.peak_bytes = 0

    def destination(self) -> Any:
        if self._destination is None:
            if self.target == "disk" and self.directory is None:
                raise ValueError("disk offloading needs a directory")
            self._destination = _HostMemory() if self.target == "cpu" else _DiskFiles(Path(self.directory))
        return self._destination

    def _release(self, nbytes: int) -> None:
        self.held_bytes -= nbytes

    def _store(self, tensor: torch.Tensor) -> _Stored:
        stored = _Stored(tensor.untyped_storage().nbytes(), tensor.device,
                         self._dropped if is_fake(tensor) else self.destination())
        stored.where.store(tensor, stored)
        self.held_bytes += stored.nbytes
        self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        weakref.finalize(stored, self._release, stored.nbytes)
        return stored

    @contextlib.contextmanager
    def __call__(self, resident: tuple[torch.Tensor, ...] = ()) -> Iterator[None]:
        keep = {id(t) for t in resident}
        # storage -> its offloaded copy, for the storages saved in this forward (checked alive: a freed storage's
        # address may be reused by a new one)
        moved: dict[int, tuple[StorageWeakRef, "weakref.ref[_Stored]"]] = {}

        def pack(tensor: torch.Tensor) -> Any:
            if (tensor.numel() * tensor.element_size() < MIN_OFFLOAD_BYTES or isinstance(tensor, nn.Parameter)
                    or id(tensor) in keep):
                # detached: a saved output held with its grad_fn would make a reference cycle through autograd's
                # graph that Python's garbage collector cannot see, and the step's whole graph would never be freed
                return tensor.detach()
            key = tensor.untyped_storage()._cdata
            found = moved.get(key)
            stored = found[1]() if found is not None and not found[0].expired() else None
            if stored is None:
                stored = self._store(tensor)
                moved[key] = (StorageWeakRef(tensor.untyped_storage()), weakref.ref(stored))
            return stored, _View(tensor.size(), tensor.stride(), tensor.storage_offset(), tensor.dtype)

        def unpack(saved: Any) -> torch.Tensor:
            if isinstance(saved, torch.Tensor):
                return saved
            stored, view = saved
            return view.of(stored.load())

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
