"""Model operations arranged to do less work than PyTorch's own, with the same math: an RMSNorm with a
hand-written backward, a rotary embedding without the rotated copy, causal attention on the CPU split so that
its kernel skips the masked quarter (fp32) or computed by query blocks on the BLAS (bf16 training), dropout before a
linear map without its division (its mask boolean), and fp32 linear maps on oneDNN where PyTorch's BLAS is slow (x86 CPUs other than
Intel's). Against PyTorch's: benchmarks/results/ops.md, ops_attention_blocks.md and ops_linear.md
(``python benchmarks/ops.py``)."""

from __future__ import annotations

import contextlib
import functools
import math
import os
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F

from lit_model.core.errors import UsageError

# ---- fp32 linear maps on the CPU ----------------------------------------------------------------------------
FP32_LINEAR_ENV = "LIT_MODEL_FP32_LINEAR"  # "auto" (default), "onednn" or "blas": which kernel runs fp32 x @ W.T


def _cpu_vendor() -> Optional[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


@functools.cache
def onednn_fp32_linear() -> bool:
    """Whether fp32 linear maps on the CPU run on oneDNN's inner product instead of PyTorch's BLAS (MKL). MKL takes
    its AVX-512 code by CPU vendor, so on other x86 CPUs it runs at about half of oneDNN's speed, which is
    vendor-neutral: on an AMD EPYC (2 cores, torch 2.13 with MKL 2024.2) a 64 x 4096 -> 4096 product ran 2.3x faster
    on oneDNN, and a training step's 2048 x 256 -> 688 map 1.6x (forward and backward, whose weight gradient stays on
    BLAS; benchmarks/results/ops_linear.md).

    ``LIT_MODEL_FP32_LINEAR``: ``auto`` (the default) takes oneDNN on x86 CPUs other than Intel's where the BLAS is
    MKL; ``onednn`` and ``blas`` choose one everywhere. oneDNN makes a kernel for every product shape, so batches of
    varying lengths add kernels: ``configure_cpu_kernels`` caps its caches, which bounds them (a LoRA fine-tune of a
    768-wide model on that EPYC, samples of 64 to 576 tokens: 1.75x BLAS's tokens/s at 1.07x its peak RSS;
    benchmarks/results/cpu_kernels.md)."""
    choice = os.environ.get(FP32_LINEAR_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "onednn", "blas"):
        raise UsageError(f"{FP32_LINEAR_ENV}={choice!r}: use auto (the default), onednn or blas (the kernel of fp32 "
                         "linear maps on the CPU), or unset it.")
    available = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    if choice != "auto" or not available:
        return available and choice == "onednn"
    return mkl_off_vendor()


def mkl_off_vendor() -> bool:
    """Whether PyTorch's BLAS is MKL on an x86 CPU other than Intel's, where MKL takes its slower code."""
    return torch.backends.mkl.is_available() and _cpu_vendor() not in (None, "GenuineIntel")


# oneDNN (PyTorch's CPU kernels for 16-bit products, and lit-model's fp32 linear maps on CPUs other than Intel's)
# keeps every kernel it makes, one per product shape, in two caches of 1,024 (oneDNN's and ideep's): ~0.7 MB of its
# own each, and the heap around them cannot shrink, so batches of ever new lengths grow the process step by step
# (bf16 768 -> 3072 -> 768 maps, forward and input gradient, at 300 row counts: +1.6 GB after two passes; capped at
# 64, +0.3 GB). A run needs more than a step's kernels: a bf16 LoRA fine-tune (batches padded to multiples of 64) made
# 114 in 30 steps, and capped at 64 it ran 15% slower, remaking them (0.25-0.5 ms each): hence 256
# (benchmarks/results/cpu_kernels.md).
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
ONEDNN_CACHE_CAPACITY = 256
# what one kernel keeps, rounded up: 0.62-0.72 MB measured on an AMD EPYC, fp32 and bf16, 64 x 768 -> 768 to
# 8192 x 768 -> 3072 and 2048 x 4096 -> 4096 (freed buffers returned to the OS at once, so only the kernel counts)
ONEDNN_KERNEL_BYTES = 1 << 20


def onednn_kernel_cache_bytes() -> int:
    """The most oneDNN's kernel caches hold in this process: the larger capacity (its variables, else the cap that
    ``configure_cpu_kernels`` sets) times ``ONEDNN_KERNEL_BYTES``."""
    values = [os.environ.get(variable, str(ONEDNN_CACHE_CAPACITY)) for variable in ONEDNN_CACHE_VARIABLES]
    return max((int(v) for v in values if v.strip().isdigit()), default=ONEDNN_CACHE_CAPACITY) * ONEDNN_KERNEL_BYTES


def configure_cpu_kernels() -> None:
    """Before the process runs its first product: check ``LIT_MODEL_FP32_LINEAR`` and cap oneDNN's kernel caches
    (read when the first kernel is made; a user's own values of the variables are kept)."""
    onednn_fp32_linear()
    for variable in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(variable, str(ONEDNN_CACHE_CAPACITY))


# oneDNN costs ~15 us a call more than MKL: it wins from about this many multiply-adds (rows x in x out) on (a
# 32 x 256 -> 256 product breaks even, 64 rows run 1.25x faster; one row of 4096 -> 4096, 2.8x; decoding a small
# model's 256-wide rows, 2-4x slower): benchmarks/results/ops_linear.md
ONEDNN_LINEAR_MIN_MACS = 2**21


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], onednn: bool) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; in fp32 on oneDNN where ``onednn`` (the policy's ``onednn_fp32_linear``), for
    products of more than ``ONEDNN_LINEAR_MIN_MACS`` (outside autocast, which casts the product to 16 bits; for a
    contiguous ``x``, which oneDNN would copy otherwise; not inside torch.compile, which chooses its own kernels). It
    keeps the same tensors for backward as F.linear, and its backward is differentiable (Sophia)."""
    # the size first: every product of a decoding step is below it, so one cheap test decides (dozens a token)
    if (x.numel() * weight.size(0) > ONEDNN_LINEAR_MIN_MACS and x.dtype is torch.float32 and weight.dtype is torch.float32
            and onednn and x.is_contiguous() and (bias is None or bias.dtype is torch.float32)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class _OneDNNLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[no-untyped-def]
        # as aten's linear: x only for the weight's gradient, the weight only for x's (a frozen base keeps no input)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, weight if ctx.needs_input_grad[0] else None)
        ctx.has_bias = bias is not None
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = linear(grad, weight.t(), None, onednn=True)  # grad @ W; oneDNN reads the transposed weight in place
        rows = grad.reshape(-1, grad.size(-1))
        if ctx.needs_input_grad[1]:
            grad_weight = _weight_gradient(rows, x.reshape(-1, x.size(-1)))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _weight_gradient(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``grad.t() @ x`` (out x in) as ``linear`` (on oneDNN; differentiable): the narrower of the two (rows x out,
    rows x in) copied transposed and the wider read transposed in place, so that the product's columns run over the
    wider side. On an AMD EPYC this took 0.55-0.75x the time of MKL's ``grad.t().mm(x)`` for 256 to 8,192 rows of 256
    <-> 688 (copying the wider, or letting oneDNN copy, gained little on one of the two shapes). The copy, rows x
    min(out, in), is this code's tensor, which the planner's trace counts; oneDNN allocates nothing that large."""
    if x.size(1) >= grad.size(1):
        return linear(grad.t().contiguous(), x.t(), None, onednn=True)
    return linear(x.t().contiguous(), grad.t(), None, onednn=True).t().contiguous()


# oneDNN (what PyTorch runs bfloat16 matmuls on, on the CPU) costs ~20 us per call beyond the memory traffic:
# for a batch of one token that is most of the time of a small matrix (256x256: 27 us vs 7-12 us with ATen's own
# kernel), while from ~2**24 elements on oneDNN is the faster one (11008x4096: 7.0 ms vs 12.4 ms, one core).
ATEN_GEMV_MAX_NUMEL = 2**24


def use_aten_gemv(model: torch.nn.Module, batch: int) -> bool:
    """Whether decoding steps should bypass oneDNN: one sample, bfloat16 on the CPU, every matrix small."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return batch == 1 and all(
        w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.numel() <= ATEN_GEMV_MAX_NUMEL for w in weights
    )


@contextlib.contextmanager
def onednn_disabled() -> Iterator[None]:
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def decoding_kernels(model: torch.nn.Module, batch: int) -> contextlib.AbstractContextManager:
    """Around a generation's decoding steps: ATen's own matrix-vector products where they beat oneDNN's
    (``use_aten_gemv``), else the defaults."""
    return onednn_disabled() if use_aten_gemv(model, batch) else contextlib.nullcontext()


def decoding_column_major(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``linear`` multiplies one row (decoding) by a weight of this shape fastest stored column-major
    (``weight.t()`` contiguous, the same values): a fp32 matrix on the CPU whose one-row product goes to the BLAS
    (below ``ONEDNN_LINEAR_MIN_MACS``, or every one where oneDNN is off) where that BLAS is MKL off Intel's CPUs.
    On an AMD EPYC, the 29 one-row products of a decoding step of a 5.26M model (256-wide, 17 MB of weights) took
    0.42 instead of 0.51 ms, pythia-160m's 49 17.4 instead of 19.2 (benchmarks/results/ops_linear.md), and
    ``generate/base.py`` of the 5.26M model ran at 1.33x litgpt's tokens/s where it had run at 1.02-1.06x
    (benchmarks/results/vs_peers_amd_generate.md); products of many rows run at the same speed either way (+-6 %,
    64 to 2,048 rows). The larger matrices stay row-major, for oneDNN, whose one-row product is
    the fastest from that layout (2048 x 8192: 1.6 ms, against 2.4 ms column-major on MKL and 3.0 column-major on
    oneDNN): benchmarks/results/ops_linear.md."""
    if not (torch.device(device).type == "cpu" and dtype is torch.float32 and len(shape) == 2 and mkl_off_vendor()):
        return False
    return math.prod(shape) <= ONEDNN_LINEAR_MIN_MACS or not onednn_fp32_linear()


class _MaskedLinear(torch.autograd.Function):
    """``F.linear(x * mask, weight)`` for a boolean ``mask`` that keeps its input and the mask (one byte an element)
    for backward and recomputes the masked input there; autograd would keep the masked copy and the mask in x's
    dtype. The input is often kept anyway: a norm's output that LoRA's query, key and value branches share."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, mask, weight)
        return F.linear(x * mask, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, Optional[torch.Tensor]]:
        x, mask, weight = ctx.saved_tensors
        grad_x = (grad @ weight) * mask if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[2]:
            grad_weight = grad.reshape(-1, grad.size(-1)).t() @ (x * mask).reshape(-1, x.size(-1))
        return grad_x, None, grad_weight


def dropout_linear(x: torch.Tensor, weight: torch.Tensor, p: float, unscaled: bool) -> tuple[torch.Tensor, float]:
    """The linear map ``weight`` of ``x`` after dropout (training) as ``(out, factor)``: ``factor * out`` is
    ``F.linear(F.dropout(x, p), weight)``, each value kept with probability ``1 - p`` as F.dropout keeps it. Where
    ``unscaled`` (the policy's, on the CPU) the kept values are not divided by ``1 - p`` (``factor`` carries it to
    the caller's scale, so the input is read once where F.dropout reads it twice) and the mask is boolean: with
    ``x`` and ``weight`` of one dtype and no autocast, backward keeps ``x`` and the mask (``_MaskedLinear``), else
    the masked input and the boolean mask. Elsewhere F.dropout (CUDA's fused kernel keeps a boolean mask), and under
    torch.compile, where the in-place ``bernoulli_`` on ``empty_like`` gave NaN (torch 2.13's CPU inductor: a LoRA
    fine-tune with --compile lost its first step) and inductor fuses F.dropout anyway."""
    if p == 0:
        return F.linear(x.to(weight.dtype), weight), 1.0
    if not unscaled or torch.compiler.is_compiling():
        return F.linear(F.dropout(x, p, training=True).to(weight.dtype), weight), 1.0
    mask = torch.empty_like(x).bernoulli_(1 - p).bool()  # F.dropout's draws: the same mask for the same seed
    if x.dtype == weight.dtype and not torch.is_autocast_enabled(x.device.type):
        return _MaskedLinear.apply(x, mask, weight), 1 / (1 - p)
    return F.linear((x * mask).to(weight.dtype), weight), 1 / (1 - p)


def _activation(x: torch.Tensor, approximate: Optional[str]) -> torch.Tensor:
    return F.silu(x) if approximate is None else F.gelu(x, approximate=approximate)


class _GatedProduct(torch.autograd.Function):
    """``activation(a) * b`` keeping only ``a`` and ``b`` for backward, where the activation is recomputed (as Liger's
    fused SwiGLU): autograd keeps ``a``, ``activation(a)`` and ``b``. Its gradients are autograd's, op for op: the
    activation's own backward kernel on ``grad * b``, and ``grad * activation(a)``."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, approximate: Optional[str]) -> torch.Tensor:
        ctx.approximate = approximate
        ctx.save_for_backward(a, b)
        return _activation(a, approximate) * b

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None]:
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            if ctx.approximate is None and torch.is_grad_enabled():  # a second backward: PyTorch's formula for it
                sigmoid = torch.sigmoid(a)
                grad_a = grad * b * sigmoid * (1 + a * (1 - sigmoid))
            elif ctx.approximate is None:
                grad_a = torch.ops.aten.silu_backward(grad * b, a)
            else:
                grad_a = torch.ops.aten.gelu_backward(grad * b, a, approximate=ctx.approximate)
        if ctx.needs_input_grad[1]:
            grad_b = grad * _activation(a, ctx.approximate)
        return grad_a, grad_b, None


def gated_product(a: torch.Tensor, b: torch.Tensor, approximate: Optional[str] = None) -> torch.Tensor:
    """SwiGLU's ``silu(a) * b`` (``approximate`` None) or GeGLU's ``gelu(a, approximate) * b``: with gradients, backward
    keeps ``a`` and ``b`` only (``_GatedProduct``); without, in place in the fresh ``a`` (the caller holds ``a`` and
    ``b`` until it returns: a new product would hold a third and fourth tensor of their size); compiled, the plain
    expression, which inductor fuses and whose saved tensors its partitioner chooses."""
    if torch.compiler.is_compiling():
        return _activation(a, approximate) * b
    if not torch.is_grad_enabled() or not (a.requires_grad or b.requires_grad):
        gated = F.silu(a, inplace=True) if approximate is None else F.gelu(a, approximate=approximate)
        return gated.mul_(b)
    return _GatedProduct.apply(a, b, approximate)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, by_hand: bool) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, for ``x`` and ``weight`` of one dtype. A
    16-bit ``x`` is normalised in fp32 and rounded to its dtype before the weight multiplies it (as Hugging Face's
    and litgpt's RMSNorm do).

    On the CPU, PyTorch's norm (and the upcast formula in 16 bits) runs as separate elementwise kernels in forward
    and backward; for activations of more than a few rows this one makes fewer passes over them (a one-pass
    ``vector_norm``, 16-bit values widened to fp32 once; in backward, one product shared by both gradients, which
    are computed in fp32 and rounded once). It saves only ``x`` (``1/rms`` is recomputed), and its backward is made
    of differentiable operations, so a second backward (Sophia's Hessian) still works. Which one runs: ``by_hand``,
    the policy's choice by size, so the numbers are the same with and without autograd."""
    if not by_hand:
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.size(-1),), weight, eps)
        return upcast_rms_norm(x, weight, eps)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _RMSNorm.apply(x, weight, eps)
    return _forward(x, weight, eps)


def upcast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm as the published implementations write it: statistics and normalisation in fp32, then rounded to
    ``x``'s dtype and multiplied by the weight (with ``unit_offset``, Gemma's ``1 + weight``, in fp32 before the
    rounding)."""
    x_fp32 = x.float()  # x itself when it is fp32
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)


def _forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x_wide = _widened(x)
    inverse_rms = _inverse_rms(x_wide, eps)
    normed = x * inverse_rms if x_wide is x else x_wide.mul_(inverse_rms)  # a widened copy is this function's own
    return normed.to(x.dtype).mul_(weight)


def _widened(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype its statistics are computed in: fp32 for 16-bit inputs, else its own (no copy)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    # vector_norm reads x once; x.pow(2).mean() writes a squared copy first.
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return norm.square().div_(x.size(-1)).add_(eps).rsqrt_()


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return _forward(x, weight, eps)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        x, weight = ctx.saved_tensors
        size = x.size(-1)
        x_wide, grad_wide, weight_wide = _widened(x), _widened(grad), _widened(weight)
        inverse_rms = _inverse_rms(x_wide, ctx.eps)
        normed = x_wide * inverse_rms
        grad_times_normed = grad_wide * normed  # serves both gradients: summed over rows, and dotted with weight
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # d/dx of w * x * r(x) = r * (g w - x_hat * mean(g w x_hat)), g the incoming gradient.
            mean_product = (grad_times_normed @ weight_wide).div_(size).unsqueeze(-1)
            grad_x = torch.addcmul(grad_wide * weight_wide, normed, mean_product, value=-1).mul_(inverse_rms).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_times_normed.reshape(-1, size).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the "rotate half" convention: ``x * cos + cat(-x2, x1) * sin`` over the last dimension
    (``x1``, ``x2`` its halves), for ``cos``/``sin`` of ``x``'s dtype whose two halves are equal (``rope_cache``).

    Three kernels into one output, ``x * cos`` and a product-sum into each half, where the formula takes a negated
    half, a concatenated copy, two products and a sum (and autograd as many more in backward). Backward is the
    inverse rotation (``sin`` negated), so nothing of ``x`` is kept; it is made of this same function, so a second
    backward works. The output has ``x``'s memory layout. Under ``torch.compile`` the formula itself: Inductor
    fuses it into one kernel and cannot lower products written into views (``out=``)."""
    if torch.compiler.is_compiling():
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin
    if torch.is_grad_enabled() and x.requires_grad:
        return _Rotate.apply(x, cos, sin)
    return _rotated(x, cos, sin)


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    sin = sin[..., :half]
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos  # one kernel over all values rather than one per half: fewer calls (a decoding step runs dozens)
    out[..., :half].addcmul_(x2, sin, value=-1)
    out[..., half:].addcmul_(x1, sin)
    return out


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(cos, sin)
        return _rotated(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        cos, sin = ctx.saved_tensors
        return rotate(grad, cos, -sin), None, None


def cuda_attention_kernel(dtype: torch.dtype, head_size: int, masked: bool, shared_key_heads: bool) -> str:
    """The kernel a CUDA ``scaled_dot_product_attention`` of a training step runs, in PyTorch's order (sdp_utils):
    flash needs fp16/bf16, no explicit mask and a head size up to 256; memory-efficient takes fp32 and a mask but
    not enable_gqa's shared key/value heads (pytorch/pytorch#191085, which would add them, was closed unmerged);
    else math, which keeps the T x T probabilities of every head for backward. Measured on an H200 (torch 2.11,
    benchmarks/results/plan_accuracy_gpu.md): SmolLM2-360M (grouped queries) in 32-true peaked 1.9 GB above a
    trace that assumed a fused kernel, about its 32 layers' probabilities."""
    if dtype in (torch.float16, torch.bfloat16) and not masked and head_size <= 256:
        return "flash"
    return "math" if shared_key_heads else "efficient"


def causal_attention_in_halves(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of (B, heads, T, head_size) queries over keys and values with as many or fewer heads (the
    CPU's kernel takes grouped heads as they are) as two calls of the CPU's flash kernel: the first half of the queries against the first
    half of the keys, the second half against all keys with an explicit mask. Returns (B, T, heads, head_size).

    PyTorch 2.13's CPU flash-attention kernel appears to compute the whole T x T score matrix for T <= 512 and
    mask half of it (its key blocks are 512 long); the two calls skip the upper-right quarter, and
    benchmarks/results/ops.md measures them against the one call."""
    return _CausalHalves.apply(q, k, v, scale)


class _CausalHalves(torch.autograd.Function):
    """The two halves written into one output, which is also what backward reads as each half's output: a consumer
    that keeps the output (the projection after attention) keeps the same storage, as with one call. (Each call's
    own output, kept by SDPA's backward, would be a second copy once joined.)"""

    @staticmethod
    def forward(ctx, q, k, v, scale):  # type: ignore[no-untyped-def]
        B, H, T, D = q.shape
        half = T // 2
        # Query half + i sees keys 0 .. half + i: additive, in the inputs' dtype, as SDPA converts a boolean mask
        visible = torch.ones(T - half, k.size(2), dtype=torch.bool, device=q.device).tril(half)
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        out = torch.empty(B, T, H, D, dtype=q.dtype, device=q.device)
        first, lse_first = _flash_cpu(q[:, :, :half], k[:, :, :half], v[:, :, :half], 0.0, True, scale=scale)
        out[:, :half].copy_(first.transpose(1, 2))
        del first
        second, lse_second = _flash_cpu(q[:, :, half:], k, v, 0.0, False, attn_mask=mask, scale=scale)
        out[:, half:].copy_(second.transpose(1, 2))
        ctx.save_for_backward(q, k, v, out, lse_first, lse_second, mask)
        ctx.scale = scale
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        q, k, v, out, lse_first, lse_second, mask = ctx.saved_tensors
        half = q.size(2) // 2
        grad, out = grad.transpose(1, 2), out.transpose(1, 2)  # (B, heads, T, head_size) views
        dq_first, dk_first, dv_first = _flash_cpu_backward(
            grad[:, :, :half], q[:, :, :half], k[:, :, :half], v[:, :, :half], out[:, :, :half], lse_first, 0.0, True,
            scale=ctx.scale)
        dq_second, dk, dv = _flash_cpu_backward(grad[:, :, half:], q[:, :, half:], k, v, out[:, :, half:], lse_second,
                                                0.0, False, attn_mask=mask, scale=ctx.scale)
        dk[:, :, :half] += dk_first
        dv[:, :, :half] += dv_first
        return torch.cat((dq_first, dq_second), dim=2), dk, dv, None


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# ---- causal attention in query blocks (CPU, bf16 training) -----------------------------------------------------
# Query rows per block: each block's scores against the keys it can see are one (rows x keys) fp32 tile per head.
ATTENTION_BLOCK = 128
# Bytes of the fp32 score tiles computed at once (_head_groups): 4 MiB ran 32 heads over 1,024 and 2,048 tokens at
# 1.4x the flash kernel, one tile of them all at 0.8-1.07x (benchmarks/ops.py --ops blocks; 1 and 16 MiB between)
ATTENTION_TILE_BYTES = 1 << 22
# The most probabilities a token's block may keep per layer, in units of the embedding width: a Llama block keeps
# about 15 values of that width per token besides (its norms' inputs, q, k, v, the attention output, the MLP's
# three), so this at most about doubles what the layer keeps.
KEPT_PROBABILITIES_PER_WIDTH = 12
# Fewer scores a layer than this (batch x heads x block_scores): the flash kernel's one call ran as fast as the blocks'
# dozens (1 to 2 samples of 4 heads over 256 tokens: 0.75-1.06x, 9 heads 0.97-1.22x, on a shared 2-core machine)
MIN_BLOCK_SCORES = 1 << 19


def block_scores(length: int) -> int:
    """The (query, key) scores per head that ``causal_attention_in_blocks`` computes and keeps over ``length``
    tokens: each block of queries against every key up to its last query."""
    ends = [min(start + ATTENTION_BLOCK, length) for start in range(0, length, ATTENTION_BLOCK)]
    return sum((end - start) * end for start, end in zip(range(0, length, ATTENTION_BLOCK), ends))


def causal_attention_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal ``F.scaled_dot_product_attention`` of (B, heads, T, head_size) inputs with as many key heads as query
    heads, by blocks of ATTENTION_BLOCK queries: each block's scores against the keys up to its last query in
    fp32 (one batched matmul; the masked keys beyond the block are never computed), softmax in fp32, and the
    probabilities, rounded to the inputs' dtype as the flash kernel rounds them, kept for backward (which then
    needs no second score product). Returns (B, heads, T, head_size)."""
    device_type = q.device.type
    if torch.is_autocast_enabled(device_type):  # in autocast's dtype, as autocast runs F.scaled_dot_product_attention
        dtype = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dtype) for t in (q, k, v))
    with torch.autocast(device_type, enabled=False):  # then its own precisions (autocast would run baddbmm in bf16)
        return _CausalAttentionInBlocks.apply(q, k, v, scale)


class _CausalAttentionInBlocks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale):  # type: ignore[no-untyped-def]
        B, H, T, D = q.shape
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        bias = torch.full((T, T), float("-inf"), dtype=torch.float32, device=q.device).triu_(1)  # query i sees keys <= i
        # (B, T, heads, head_size) in memory, as the flash kernel lays its output out: the caller's transpose back to
        # (B, T, heads x head_size) is then a view, and the output projection keeps what this keeps
        out = q.new_empty(B, T, H, D).transpose(1, 2)
        probabilities = []
        for heads in _head_groups(B, H, T):
            qg, kg, vg = (t[heads].reshape(-1, T, D) for t in (q, k, v))
            q32, k32t = qg.float(), kg.float().transpose(1, 2)
            for start in range(0, T, ATTENTION_BLOCK):
                end = min(start + ATTENTION_BLOCK, T)
                # baddbmm only here (activations.SAVED_OPS leaves it out: a selective checkpoint redoes these tiles)
                scores = torch.baddbmm(bias[start:end, :end], q32[:, start:end], k32t[:, :, :end], alpha=scale)
                p = torch.softmax(scores, dim=-1).to(q.dtype)
                del scores
                out[heads][:, :, start:end] = torch.bmm(p, vg[:, :end]).view(*out[heads].shape[:2], end - start, D)
                probabilities.append(p)
        ctx.scale = scale
        ctx.save_for_backward(q, k, v, out, *probabilities)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        with torch.autocast(grad.device.type, enabled=False):
            return _CausalAttentionInBlocks.gradients(ctx, grad)

    @staticmethod
    def gradients(ctx, grad):  # type: ignore[no-untyped-def]
        q, k, v, out, *probabilities = ctx.saved_tensors
        B, H, T, D = q.shape
        # rowsum(P * dP) of each query = its output . its incoming gradient
        delta = (grad.float() * out.float()).sum(-1, keepdim=True)
        groups = _head_groups(B, H, T)
        dq, dk, dv = (torch.empty_like(t) for t in (q, k, v)) if len(groups) > 1 else (None, None, None)
        tiles = iter(probabilities)
        for heads in groups:
            qg, kg, vg = (t[heads].reshape(-1, T, D) for t in (q, k, v))
            g, delta_g = grad[heads].reshape(-1, T, D), delta[heads].reshape(-1, T, 1)
            dq_g = torch.empty_like(qg)
            dk_g = torch.zeros(kg.shape, dtype=torch.float32, device=kg.device)  # sums over the blocks, in fp32
            dv_g = torch.zeros(vg.shape, dtype=torch.float32, device=vg.device)
            for start in range(0, T, ATTENTION_BLOCK):
                p = next(tiles)
                end = start + p.size(1)
                g_rows = g[:, start:end]
                dv_g[:, :end] += torch.bmm(p.transpose(1, 2), g_rows)
                # d scores = P * (dP - rowsum(P * dP)), scaled as the scores were
                ds = torch.bmm(g_rows, vg[:, :end].transpose(1, 2)).float().sub_(delta_g[:, start:end])
                ds = ds.mul_(p).mul_(ctx.scale).to(q.dtype)
                dq_g[:, start:end] = torch.bmm(ds, kg[:, :end])
                dk_g[:, :end] += torch.bmm(ds.transpose(1, 2), qg[:, start:end])
            dk_g, dv_g = dk_g.to(k.dtype), dv_g.to(v.dtype)
            if len(groups) == 1:
                return dq_g.view(q.shape), dk_g.view(q.shape), dv_g.view(q.shape), None
            for full, part in ((dq, dq_g), (dk, dk_g), (dv, dv_g)):
                full[heads] = part.view(full[heads].shape)
        return dq, dk, dv, None


def _head_groups(batch: int, heads: int, length: int) -> list[tuple[slice, ...]]:
    """(batch, head) index groups whose score tiles (ATTENTION_BLOCK x length, fp32) take about ATTENTION_TILE_BYTES:
    a group of whole samples, else heads of one sample. A tile that outgrows the CPU's caches runs slower than the
    flash kernel (32 heads over 2,048 tokens: 0.6x as one tile)."""
    per_head = ATTENTION_BLOCK * length * 4
    group = max(1, ATTENTION_TILE_BYTES // per_head)
    if group >= heads:
        samples = group // heads
        return [(slice(b, b + samples),) for b in range(0, batch, samples)]
    return [(slice(b, b + 1), slice(h, h + group)) for b in range(batch) for h in range(0, heads, group)]
