"""What both traces (training's ``trace.py``, generation's ``trace_generation.py``) measure with: ``MemTracker``
filing the tensors by category, the planned device's kernels for a model on the CPU's fake tensors, and CUDA's
dropout and attention as the traces run them. It imports nothing of the training stack (lightning, ``train/``), so
generation's planner can use it."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from functools import partial
from typing import Any, Iterable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _ModState, _RefType
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._pytree import tree_map_only

from lit_model.kernels.ops import cuda_attention_kernel
from lit_model.kernels.policy import KernelPolicy, kernel_policy

try:
    from torch._guards import active_fake_mode
except ImportError:  # pragma: no cover
    from torch._subclasses.fake_tensor import active_fake_mode  # type: ignore


class _Ref(_RefType):
    """MemTracker's categories plus two of ours. Values equal MemTracker's, so its internal keys match."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    LOGITS = "Logits"
    QUANT = "Quant"
    HOST = "Host"  # what the real run keeps in host memory (FSDP cpu_offload's gradient shards): no device bytes


CPU = torch.device("cpu")


class _Tracker(MemTracker):
    """MemTracker that files the tensors with the vocabulary as last dimension (logits, their softmax and its
    gradient) as logits/loss memory and those created inside ``push_category("quant")`` scopes (the bitsandbytes
    stand-ins) as quantization memory, and keeps only the global peak (module-level peaks cost time).

    ``tied_shapes``: the shapes of trained parameters used in two places (a tied embedding and head). Autograd sums
    the two gradients of such a parameter before accumulating them; a real run sums them in place (the engine's
    input buffer holds the only reference), but under any dispatch mode, this tracker's included, the engine adds
    out of place, which would count a third tensor of the embedding's size at that moment. That add does not
    update the peaks: its result takes the first operand's place, as in the run.

    ``keep_gradients_on_host``: FSDP's cpu_offload moves each gradient shard to host memory once it is
    reduce-scattered; from the first moment a shard is the parameter's gradient, its bytes are filed as host memory
    and the peaks are of the device's bytes alone."""

    def __init__(self, vocab_size: int, tied_shapes: frozenset[tuple[int, ...]] = frozenset()) -> None:
        super().__init__()
        self._ref_class = _Ref
        self._scopes: list[str] = []
        self.vocab_size = vocab_size
        self.tied_shapes = tied_shapes
        self.host_gradients: tuple[nn.Parameter, ...] = ()
        self._filed: dict[nn.Parameter, int] = {}  # the id of each parameter's gradient filed as host memory
        self.values_read = 0  # how often the traced code read a tensor's value (stand-ins answered)
        self.failed_in: Optional[str] = None

    def keep_gradients_on_host(self, params: Iterable[nn.Parameter]) -> None:
        self.host_gradients = tuple(params)

    def _file_host_gradients(self) -> None:
        for param in self.host_gradients:
            grad = param.grad
            if grad is not None and self._filed.get(param) != id(grad):
                self._filed[param] = id(grad)
                self._update_and_maybe_create_winfos(grad, _Ref.HOST)  # a DTensor: its local shard's storage

    def _update_and_maybe_create_winfos(self, t: torch.Tensor, reftype: _RefType, update_existing: bool = False):  # type: ignore[no-untyped-def]
        # host memory stays host memory when MemTracker files the same gradient again (before the optimizer steps)
        if self.host_gradients and reftype is not _Ref.HOST:
            known = (self._WINFO.get(storage, (None, None))[0] for storage in get_untyped_storages(t))
            if any(info is not None and info.reftype is _Ref.HOST for info in known):
                reftype = _Ref.HOST
        return super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def push_category(self, name: str) -> None:
        self._scopes.append(name)

    def pop_category(self) -> None:
        if self._scopes:
            self._scopes.pop()

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # MemTracker's own version hooks every parameter, which fails on frozen ones (LoRA, QLoRA, freezing).
        def grad_hook(grad: torch.Tensor) -> None:
            self._update_and_maybe_create_winfos(grad, _Ref.GRAD)

        param_memory = 0
        for param in module.parameters():
            winfos = self._update_and_maybe_create_winfos(param, _Ref.PARAM)
            param_memory += sum(w.mem_consumed for w in winfos)
            if param.grad is not None:
                self._update_and_maybe_create_winfos(param.grad, _Ref.GRAD)
            if install_grad_hooks and param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (
                    param.register_hook(grad_hook),
                    # an optimizer stepping in backward may have freed the gradient already (its hook came first)
                    param.register_post_accumulate_grad_hook(lambda p: None if p.grad is None else grad_hook(p.grad)),
                )
        buffer_memory = 0
        for buffer in module.buffers():
            winfos = self._update_and_maybe_create_winfos(buffer, _Ref.BUFFER)
            buffer_memory += sum(w.mem_consumed for w in winfos)
        return param_memory, buffer_memory

    debug = False

    def __enter__(self) -> "_Tracker":
        if self._depth == 0:
            self.region_peaks: dict[str, dict] = {}
            self._region: tuple[int, str] = (0, "")
        super().__enter__()
        if self._depth == 1:  # what __torch_dispatch__ compares with; MemTracker records it itself from torch 2.12
            self._fake_mode_on_entry = active_fake_mode()
        return self

    def _mode(self) -> str:
        return "optimizer" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"

    def _region_key(self) -> str:
        """The stretch of the step this moment belongs to: the n-th run of forward, backward or optimizer ops."""
        mode = self._mode()
        index, last = self._region
        if mode != last:
            self._region = (index + 1, mode)
        return f"{self._region[0]}:{mode}"

    def _update_peak_stats(self, peak_state) -> None:
        # The global peak, and the peak of each stretch of forward, backward or optimizer ops (trace_by_layers
        # extrapolates each stretch's peak: where in a stretch the peak falls does not depend on the depth).
        snap = self._curr_mem_snap.get(CPU)
        if snap is not None:
            key = self._region_key()
            peak = self.region_peaks.get(key)
            if peak is None or _device_bytes(peak) < _device_bytes(snap):
                self.region_peaks[key] = dict(snap)
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < _device_bytes(dev_snap):
                self._peak_mem[dev] = _device_bytes(dev_snap)
                self._peak_mem_snap[dev] = dict(dev_snap)
                if self.debug:
                    self.peak_where = (sorted(self._mod_tracker.parents), self._mod_tracker.is_bw, list(self._scopes))

    def _pre_fw_hook(self, module: nn.Module, inputs: Any) -> None:
        # The step runs the root module once per micro batch; MemTracker's per-module statistics refuse that, and
        # only the global peak is kept: forget the root's statistics when a new forward through it starts.
        name = self._mod_tracker.get_known_fqn(module)
        if not self._mod_tracker.is_bw and module in self.memory_tracking and set(self._mod_tracker.parents) == {"Global", name}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)

    def _track_output(self, reftype: _RefType, tensor: torch.Tensor) -> None:
        if reftype in (_Ref.ACT, _Ref.TEMP) and tensor.dim() and tensor.shape[-1] == self.vocab_size:
            reftype = _Ref.LOGITS
        self._track(reftype, tensor)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return self._stand_in(args[0])
        try:
            res = func(*args, **(kwargs or {}))
        except Exception:
            self.failed_in = self._mode()  # where the step stops if nothing in it catches this (TraceFailed)
            raise
        if active_fake_mode() is self._fake_mode_on_entry:
            if self._in_opt:
                reftype = _Ref.OPT
            elif self._scopes:
                reftype = _Ref.QUANT
            elif self._mod_tracker.is_bw and not self._in_ac:
                reftype = _Ref.TEMP
            else:
                reftype = _Ref.ACT
            tree_map_only(torch.Tensor, partial(self._track_output, reftype), res)
            if self.host_gradients:
                self._file_host_gradients()
            if not self._sums_tied_gradients(func, args, res):
                self._update_peak_stats(_ModState.PEAK_BW if self._mod_tracker.is_bw else _ModState.PEAK_FW)
        return res

    def _stand_in(self, tensor: torch.Tensor) -> Union[bool, int, float]:
        """A value for code that reads one from a fake tensor (``.item()``, ``if tensor:``), which fake tensors cannot
        answer: Adafactor's step count, a learning-rate-free optimizer's estimates. False (the usual path past a check
        for non-finite values) or 1; what the code allocates rarely depends on it, but where it does the trace may
        miss a branch (planner.py says so and rounds up)."""
        self.values_read += 1
        if tensor.dtype is torch.bool:
            return False
        return 1.0 if tensor.dtype.is_floating_point or tensor.dtype.is_complex else 1

    def _sums_tied_gradients(self, func, args: tuple, res: Any) -> bool:  # type: ignore[no-untyped-def]
        return (func is torch.ops.aten.add.Tensor and self._mod_tracker.is_bw and isinstance(res, torch.Tensor)
                and tuple(res.shape) in self.tied_shapes and len(args) == 2
                and all(isinstance(a, torch.Tensor) and a.shape == res.shape for a in args))


def _device_bytes(snap: dict) -> int:
    return snap[_TOTAL_KEY] - snap.get(_Ref.HOST, 0)


def traced_policy(device_type: str) -> KernelPolicy:
    """The planned device's kernels, which the model takes on the CPU's fake tensors; SDPA stands for flash_attn,
    whose kernel does not run on fake tensors."""
    return replace(kernel_policy(device_type), flash_attn=False)


@contextlib.contextmanager
def _cuda_kernels():
    """Dropout and attention as CUDA runs them. Dropout: ``native_dropout`` keeps a boolean mask for backward (the CPU
    kernel keeps a noise tensor of the input's dtype, which would overstate a GPU run's LoRA dropout memory).
    Attention: the CPU's fused kernel keeps what CUDA's flash and memory-efficient kernels keep (the output and its
    logsumexp); where CUDA would take the math kernel (``cuda_attention_kernel``), the trace takes it too."""
    dropout_function, attention_function = F.dropout, F.scaled_dot_product_attention

    def dropout(input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False) -> torch.Tensor:
        if not training or p == 0.0:
            return input
        return torch.native_dropout(input, p, True)[0]

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                  *args: Any, enable_gqa: bool = False, **kwargs: Any) -> torch.Tensor:
        shared = enable_gqa and k.size(-3) != q.size(-3)
        if cuda_attention_kernel(q.dtype, q.size(-1), attn_mask is not None, shared) != "math":
            return attention_function(q, k, v, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)
        with sdpa_kernel(SDPBackend.MATH):
            return attention_function(q, k, v, attn_mask, *args, enable_gqa=enable_gqa, **kwargs)

    F.dropout, F.scaled_dot_product_attention = dropout, attention
    try:
        yield
    finally:
        F.dropout, F.scaled_dot_product_attention = dropout_function, attention_function
