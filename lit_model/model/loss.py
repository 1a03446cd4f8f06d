"""Fused language-model head + cross-entropy: the loss over (tokens x vocab) logits without ever holding them
all, and without computing them twice.

A chunked loss that checkpoints each chunk (the simple way to bound the logits' memory) runs the head's matmul
again in backward and stores fp32 log-probabilities for a whole chunk. Here each chunk's logits are made,
turned into their gradient in place (softmax minus one-hot) and multiplied straight into the gradients of the
head's input and weight, all during the forward; backward only scales them by the incoming gradient. Small
chunks keep the (chunk x vocab) block in the CPU cache, which is also what makes this faster than one big
``F.cross_entropy``. The same idea as Liger's and Apple's cut-cross-entropy kernels, in plain PyTorch.
"""

from __future__ import annotations

from typing import Optional

import torch

from lit_model.kernels.ops import linear

# Tokens per chunk: a (128 x vocab) fp32 block stays in a CPU core's cache for vocabularies up to ~8k (4 MB), and
# is still a large matmul on a GPU.
DEFAULT_LOSS_CHUNK_SIZE = 128


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    chunk_size: int,
    softcap: Optional[float] = None,
    *,
    onednn: bool,
) -> torch.Tensor:
    """``onednn``: the kernel policy's ``onednn_fp32_linear``. Summed fp32 cross-entropy of ``softcap(x @ weight.T + bias)`` against ``targets`` (-100 = ignore).
    ``x``: (tokens, embedding); ``targets``: (tokens,). Under autocast the matmuls run in autocast's dtype and
    the weight's gradient still accumulates in the weight's own dtype."""
    device_type = x.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else weight.dtype
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return _LinearCrossEntropy.apply(x, weight, bias, targets, chunk_size, softcap, compute_dtype, onednn)
    with torch.autocast(device_type, enabled=False):
        return _loss_and_gradients(x, weight, bias, targets, chunk_size, softcap, compute_dtype, onednn, (False,) * 3)[0]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, targets, chunk_size, softcap, compute_dtype, onednn):  # type: ignore[no-untyped-def]
        with torch.autocast(x.device.type, enabled=False):
            loss, *gradients = _loss_and_gradients(
                x, weight, bias, targets, chunk_size, softcap, compute_dtype, onednn, ctx.needs_input_grad[:3]
            )
        # Saved (not kept on ctx) so that saved-tensor hooks, e.g. the simulated memory cap, see them.
        ctx.save_for_backward(*gradients)
        ctx.used = False
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):  # type: ignore[no-untyped-def]
        if ctx.used:  # the gradients below are scaled in place
            raise RuntimeError("The fused cross-entropy can be backpropagated once; do not use retain_graph with it.")
        ctx.used = True
        gradients = [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in ctx.saved_tensors]
        return (*gradients, None, None, None, None, None)


def _loss_and_gradients(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    chunk_size: int,
    softcap: Optional[float],
    compute_dtype: torch.dtype,
    onednn: bool,
    wanted: tuple[bool, ...],
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    weight_c = weight.to(compute_dtype)
    # Which rows count, once for all chunks. Ignored rows are zeroed through the (chunk x embedding) operands of the
    # gradients' products, which is cheaper than masking (chunk x vocab) blocks; no row is ignored in pretraining.
    valid = targets != -100
    safe_targets = torch.where(valid, targets, 0).unsqueeze(1)
    row_mask = valid.unsqueeze(1).to(compute_dtype)
    grad_x = torch.empty_like(x) if wanted[0] else None
    # The first chunk's product writes the weight's gradient whole (no zero fill to add to), unless it accumulates
    # in another dtype than the product's (autocast) or there is no chunk at all.
    writes_weight = x.size(0) > 0 and weight.dtype == compute_dtype
    grad_weight = None if not wanted[1] else torch.empty_like(weight) if writes_weight else torch.zeros_like(weight)
    grad_bias = torch.zeros_like(bias) if wanted[2] and bias is not None else None
    total = torch.zeros((), dtype=torch.float32, device=x.device)
    for start in range(0, x.size(0), chunk_size):
        rows = slice(start, start + chunk_size)
        total += _chunk(x[rows].to(compute_dtype), valid[rows], safe_targets[rows], row_mask[rows], weight_c, bias,
                        softcap, onednn, None if grad_x is None else grad_x[rows], grad_weight, grad_bias,
                        writes_weight and start == 0)
    return total, grad_x, grad_weight, grad_bias


def _chunk(
    x: torch.Tensor,
    valid: torch.Tensor,
    safe_targets: torch.Tensor,
    row_mask: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    softcap: Optional[float],
    onednn: bool,
    grad_x: Optional[torch.Tensor],
    grad_weight: Optional[torch.Tensor],
    grad_bias: Optional[torch.Tensor],
    first: bool,
) -> torch.Tensor:
    """One chunk's summed loss; writes its rows of ``grad_x`` and adds to ``grad_weight`` (``first``: writes it)
    and ``grad_bias``. A function of its own so that its (chunk x vocab) blocks are freed before the next chunk's
    are made."""
    logits = linear(x, weight, None, onednn).float()
    if bias is not None:
        logits += bias
    if softcap is not None:
        tanh = logits.div_(softcap).tanh_()
        logits = tanh * softcap
    log_probs = torch.log_softmax(logits, dim=1)
    loss = -torch.where(valid, log_probs.gather(1, safe_targets).squeeze(1), 0.0).sum()
    del log_probs  # at most two (chunk x vocab) fp32 blocks at once (three with softcapping's tanh)
    if grad_x is None and grad_weight is None and grad_bias is None:
        return loss
    # d loss / d logits = softmax - one_hot(target). softmax of the logits rather than exp(log_probs) in place (the
    # same number of blocks): PyTorch's softmax takes a faster exponential than its exp (0.8x the time, 128 x 4,096).
    grad = torch.softmax(logits, dim=1)
    del logits
    grad.scatter_add_(1, safe_targets, torch.full(safe_targets.shape, -1.0, dtype=grad.dtype, device=grad.device))
    if softcap is not None:  # d softcap(z) / dz = 1 - tanh^2
        grad.mul_(tanh.square_().neg_().add_(1.0))
    if grad_bias is not None:
        grad_bias += (valid.to(grad.dtype) @ grad).to(grad_bias.dtype)
    grad = grad.to(x.dtype)
    if grad_x is not None:
        grad_x.copy_(linear(grad, weight.t(), None, onednn).mul_(row_mask))
    if grad_weight is not None:
        if first:
            torch.mm(grad.t(), x * row_mask, out=grad_weight)
        elif grad_weight.dtype == x.dtype:
            grad_weight.addmm_(grad.t(), x * row_mask)
        else:  # autocast: half-precision product, accumulated in the weight's precision
            grad_weight += torch.mm(grad.t(), x * row_mask)
    return loss
