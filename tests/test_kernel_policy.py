"""lit_model/kernels/policy.py: the kernel choices made once per device, and a model that takes them from its
policy alone (no device check): CUDA's policy on CPU tensors takes CUDA's kernels, as the planner's trace needs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lit_model import GPT, Config
from lit_model.kernels import attention as attention_module
from lit_model.kernels import ops
from lit_model.kernels.policy import kernel_policy
from lit_model.methods.objective import CausalLM, mean_loss

BF16, FP32 = torch.bfloat16, torch.float32


def test_the_cpu_and_cuda_policies_choose_the_kernels_ops_chose_by_device(monkeypatch):
    monkeypatch.setenv(ops.FP32_LINEAR_ENV, "onednn")
    ops.onednn_fp32_linear.cache_clear()
    try:
        cpu, cuda, mps = kernel_policy("cpu"), kernel_policy("cuda"), kernel_policy("mps")
        assert cpu.onednn_fp32_linear is ops.onednn_fp32_linear() and not cuda.onednn_fp32_linear
    finally:
        monkeypatch.delenv(ops.FP32_LINEAR_ENV)
        ops.onednn_fp32_linear.cache_clear()
    assert (cpu.unscaled_dropout, cuda.unscaled_dropout, mps.unscaled_dropout) == (True, False, False)
    assert cpu.norms_by_hand(2**16 + 1) and not cpu.norms_by_hand(2**16) and not cuda.norms_by_hand(2**20)
    assert [cpu.attends_in_halves(t) for t in (383, 384, 512, 513)] == [False, True, True, False]
    assert not cuda.attends_in_halves(400) and not mps.attends_in_halves(400)
    assert cpu.attends_in_blocks(BF16, batch=8, heads=4, length=256, width=256)
    assert not cuda.attends_in_blocks(BF16, batch=8, heads=4, length=256, width=256)
    assert cuda.expands_shared_heads(FP32, 64, masked=False, query_length=2048)
    assert not cpu.expands_shared_heads(FP32, 64, masked=False, query_length=2048)
    assert not mps.expands_shared_heads(FP32, 64, masked=False, query_length=2048)
    assert cuda.cuda_sdpa and not cpu.cuda_sdpa and not cpu.flash_attn


def test_the_policy_is_frozen():
    with pytest.raises(AttributeError):
        kernel_policy("cpu").unscaled_dropout = False  # type: ignore[misc]


def test_a_model_handed_cudas_policy_takes_cudas_kernels_on_cpu_tensors(monkeypatch):
    """bf16 training over 400 tokens on CPU tensors: the CPU's policy takes the blocks and the hand-written norm;
    CUDA's (flash_attn left out, as the planner's trace leaves it) takes SDPA and PyTorch's norm: the model looks
    at no tensor's device."""
    taken = []
    for name in ("causal_attention_in_blocks", "causal_attention_in_halves"):
        kernel = getattr(attention_module, name)
        monkeypatch.setattr(attention_module, name, lambda *args, kernel=kernel, name=name: taken.append(name) or kernel(*args))
    norm = ops._RMSNorm.apply
    monkeypatch.setattr(ops._RMSNorm, "apply", lambda *args: taken.append("norm") or norm(*args))
    config = Config(name="t", block_size=400, vocab_size=64, padded_vocab_size=64, n_layer=1, n_embd=96, n_head=4,
                    n_query_groups=2, intermediate_size=128)
    torch.manual_seed(0)
    model = GPT(config).to(BF16)
    idx = torch.randint(0, 64, (8, 400), generator=torch.Generator().manual_seed(0))
    mean_loss(CausalLM(), model, (idx, idx))
    assert "causal_attention_in_blocks" in taken and "norm" in taken
    taken.clear()
    model.set_kernel_policy(replace(kernel_policy("cuda"), flash_attn=False))
    assert all(m.kernel_policy is model.kernel_policy for m in model.modules() if hasattr(m, "kernel_policy"))
    mean_loss(CausalLM(), model, (idx, idx))
    assert taken == []
