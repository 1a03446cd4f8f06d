"""Which kernels a run takes, chosen once from its device and environment: the model asks no device, it is handed a
``KernelPolicy`` by the code that places it (training's fabric setup, generation's load, the planner, which plans
a GPU run by handing the GPU's policy to the model it traces on fake CPU tensors). The kernels and the
measurements behind each threshold: ops.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lit_model.kernels.ops import (KEPT_PROBABILITIES_PER_WIDTH, MIN_BLOCK_SCORES, block_scores, cuda_attention_kernel,
                                   onednn_fp32_linear)

try:  # optional: used on CUDA in fp16/bf16 when installed, SDPA otherwise
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


@dataclass(frozen=True)
class KernelPolicy:
    """The kernel choices of one device. Those that also depend on shapes are methods taking the shapes."""

    # fp32 linear maps on oneDNN's inner product instead of the BLAS (ops.onednn_fp32_linear; the CPU only)
    onednn_fp32_linear: bool
    # dropout before a linear map keeps undivided values (ops.dropout_linear; the CPU only)
    unscaled_dropout: bool
    # RMSNorm by hand above this many input elements (ops.rms_norm); None: PyTorch's own norm always
    norm_by_hand_above: Optional[int]
    # causal attention without a mask over this range of lengths (inclusive) in two halves; None: never
    halves_lengths: Optional[tuple[int, int]]
    # bf16 causal attention with gradients by query blocks on the BLAS (ops.causal_attention_in_blocks)
    bf16_attention_in_blocks: bool
    # scaled_dot_product_attention runs CUDA's kernels (cuda_attention_kernel decides which)
    cuda_sdpa: bool
    # flash_attn's kernel for fp16/bf16 causal attention without a mask (installed, on CUDA)
    flash_attn: bool

    def norms_by_hand(self, numel: int) -> bool:
        """Whether ``ops.rms_norm`` takes its own path for an input of ``numel`` elements: on the CPU, above 64k
        elements. A few rows (decoding) run faster in the fewest calls; on a GPU, PyTorch's own kernel runs."""
        return self.norm_by_hand_above is not None and numel > self.norm_by_hand_above

    def attends_in_halves(self, length: int) -> bool:
        """Whether causal attention without a mask over ``length`` tokens takes ``causal_attention_in_halves``:
        on the CPU for 384 to 512 tokens, where benchmarks/results/ops.md measures the halves faster in fp32 and
        bf16 (below, the halves are too short to gain; above, the kernel's own key blocks skip masked work)."""
        return self.halves_lengths is not None and self.halves_lengths[0] <= length <= self.halves_lengths[1]

    def attends_in_blocks(self, dtype: torch.dtype, batch: int, heads: int, length: int, width: int) -> bool:
        """Whether causal self-attention that needs gradients takes ``causal_attention_in_blocks``: in bf16 on the
        CPU, for at least MIN_BLOCK_SCORES scores, where keeping the probabilities stays within
        KEPT_PROBABILITIES_PER_WIDTH values of the embedding width per token. PyTorch 2.13's CPU flash kernel
        computes whole 512-key blocks of scores whatever the causal mask lets it skip; the blocks skip them and
        multiply on the BLAS (benchmarks/results/ops_attention_blocks.md, forward and backward, 4 to 32 heads of 64
        and 128, 256 to 2,048 tokens: 1.0-1.7x above MIN_BLOCK_SCORES). fp32 stays on the flash kernel: there the
        blocks would keep 4 bytes a probability, and their gain (1.0-1.4x in that table) has not been measured in
        whole runs."""
        scores = heads * block_scores(length)
        return (self.bf16_attention_in_blocks and dtype == torch.bfloat16 and batch * scores >= MIN_BLOCK_SCORES
                and scores <= KEPT_PROBABILITIES_PER_WIDTH * width * length)

    def expands_shared_heads(self, dtype: torch.dtype, head_size: int, masked: bool, query_length: int) -> bool:
        """Whether attention over grouped key/value heads first copies them to every query head: on CUDA where no
        fused kernel takes the shared heads (``cuda_attention_kernel``: math), for queries longer than twice the
        head size. The math kernel keeps each head's query x key probabilities for backward (SmolLM2-360M in 32-true
        at 4 x 512 tokens: 1.9 GB above a fused kernel, measured on an H200); the copies, which the
        memory-efficient kernel takes with fp32 and masks, keep 2 x head_size values per key and head instead.
        litgpt copies them whenever the heads are grouped."""
        return (self.cuda_sdpa and query_length > 2 * head_size
                and cuda_attention_kernel(dtype, head_size, masked, shared_key_heads=True) == "math")


def kernel_policy(device_type: str) -> KernelPolicy:
    """The policy of a run on ``device_type`` ("cpu", "cuda", ...): on the CPU, lit-model's own kernels where they
    measured faster (fp32 linear maps on oneDNN as ``LIT_MODEL_FP32_LINEAR`` and the CPU's vendor say); elsewhere
    PyTorch's, with CUDA's attention kernel choice. A 16-bit compute dtype is a per-call input of the methods, as
    autocast decides it per operation."""
    cpu, cuda = device_type == "cpu", device_type == "cuda"
    return KernelPolicy(
        onednn_fp32_linear=cpu and onednn_fp32_linear(),
        unscaled_dropout=cpu,
        norm_by_hand_above=2**16 if cpu else None,
        halves_lengths=(384, 512) if cpu else None,
        bf16_attention_in_blocks=cpu,
        cuda_sdpa=cuda,
        flash_attn=cuda and flash_attn_func is not None,
    )
