"""Attention as one call over the kernels a ``KernelPolicy`` chooses: soft-capped scores (Gemma 2), flash_attn,
the CPU's query blocks (bf16 training), the CPU's two halves, PyTorch's scaled_dot_product_attention."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from lit_model.kernels.ops import causal_attention_in_blocks, causal_attention_in_halves
from lit_model.kernels.policy import KernelPolicy, flash_attn_func


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
              softcapping: Optional[float], width: int, policy: KernelPolicy) -> torch.Tensor:
    """Attention of (B, heads, T, head_size) queries over (B, key heads, T_k, head_size) keys and values. Without a
    mask: causal, except that one query sees every key (a decoding step over the cache). ``width``: the model's
    embedding width, which bounds what attention in blocks may keep. Returns (B, T, heads, head_size)."""
    if softcapping is not None:
        return softcapped_attention(q, k, v, mask, scale, softcapping)
    if policy.flash_attn and q.dtype in (torch.float16, torch.bfloat16) and mask is None:
        return flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                               causal=True)
    enable_gqa = k.size(1) != q.size(1)
    if mask is None and attends_in_blocks(q, k, v, width, policy):
        return causal_attention_in_blocks(q, *copy_shared_heads(k, v, q.size(1)), scale).transpose(1, 2)
    if enable_gqa and policy.expands_shared_heads(q.dtype, q.size(-1), mask is not None, q.size(2)):
        k, v = copy_shared_heads(k, v, q.size(1))
        enable_gqa = False
    if mask is None and policy.attends_in_halves(q.size(2)):
        return causal_attention_in_halves(q, k, v, scale)
    y = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=mask is None and q.size(2) > 1, scale=scale, enable_gqa=enable_gqa
    )
    return y.transpose(1, 2)


def attends_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, width: int, policy: KernelPolicy) -> bool:
    """Causal self-attention of a step that needs gradients, where the policy's ``attends_in_blocks`` takes the
    blocks."""
    T = q.size(2)
    return (T == k.size(2) and T > 1 and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
            and policy.attends_in_blocks(attention_dtype(q), q.size(0), q.size(1), T, width))


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                         scale: float, softcapping: float) -> torch.Tensor:
    """Soft-capping needs the scores themselves, so this path is explicit (Gemma 2)."""
    k, v = copy_shared_heads(k, v, q.size(1))
    scores = softcap((q @ k.transpose(-2, -1)) * scale, softcapping)
    if mask is None:
        T = q.size(2)
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (probs @ v).transpose(1, 2)


def copy_shared_heads(k: torch.Tensor, v: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, heads, T, head_size) keys and values from grouped-query attention's shared heads: each query head its own
    copy (autograd sums the copies' gradients back into the shared head)."""
    if k.size(1) == heads:
        return k, v
    return k.repeat_interleave(heads // k.size(1), dim=1), v.repeat_interleave(heads // v.size(1), dim=1)


def attention_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype attention computes in for activations ``x``: autocast's where it is on."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    return torch.tanh(x / cap) * cap
