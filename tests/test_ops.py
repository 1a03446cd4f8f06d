"""lit_model/kernels/ops.py against PyTorch's own operations: the RMSNorm with its hand-written backward (values,
both gradients, a second backward; in 16 bits against the published upcast formula), the rotary embedding against its formula (values, gradient, a second backward,
memory layout), and causal attention in halves (values and gradients, with and without
grouped queries, an odd length), and that the model takes the halves where it should; on CUDA's paths, grouped
key/value heads copied to every query head where CUDA would take the math kernel, with the same numbers; fp32
linear maps on oneDNN (values, gradients, a second backward, what backward keeps) and which CPUs take them; oneDNN's
kernel caches capped (a process running products of ever new shapes stays bounded)."""

from __future__ import annotations

import os
from dataclasses import replace
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from lit_model import GPT, Config
from lit_model.model.gpt import RMSNorm, rope_cache
from lit_model.kernels import ops
from lit_model.core.errors import UsageError
from lit_model.kernels import attention as attention_module
from lit_model.kernels.ops import (FP32_LINEAR_ENV, _RMSNorm, block_scores, causal_attention_in_blocks,
                                   causal_attention_in_halves, rotate, upcast_rms_norm)
from lit_model.kernels.policy import KernelPolicy, kernel_policy
from lit_model.parallel.apply import Levers, parallelize
from lit_model.parallel.dims import ParallelDims
from lit_model.methods.objective import CausalLM, mean_loss

# the CPU's and CUDA's policies, as the code that places a model hands them in (flash_attn, if installed, does not
# run on CPU tensors)
CPU = kernel_policy("cpu")
CUDA = replace(kernel_policy("cuda"), flash_attn=False)


def rms_norm(x, weight, eps, policy=CPU):
    """``ops.rms_norm`` as a model with ``policy`` takes it."""
    return ops.rms_norm(x, weight, eps, policy.norms_by_hand(x.numel()))


def linear(x, weight, bias=None, device_type="cpu"):
    """``ops.linear`` as a model on ``device_type`` takes it, with the policy chosen now (after ``kernel``)."""
    return ops.linear(x, weight, bias, kernel_policy(device_type).onednn_fp32_linear)


def hand_written(x, weight, eps):
    """The autograd.Function itself, whatever the size (rms_norm leaves inputs of a few rows to PyTorch)."""
    return _RMSNorm.apply(x, weight, eps)


def test_rms_norm_equals_pytorch_in_values_and_gradients():
    generator = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 7, 32, generator=generator)).requires_grad_()
    weight = torch.randn(32, generator=generator).requires_grad_()
    upstream = torch.randn(2, 7, 32, generator=generator)
    ours = hand_written(x, weight, 1e-5)
    reference = F.rms_norm(x, (32,), weight, 1e-5)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(ours, (x, weight), upstream), torch.autograd.grad(reference, (x, weight), upstream)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_rms_norm_gradients_are_exact_to_second_order():
    # Sophia differentiates the gradients again: the backward must itself be differentiable, and right.
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, dtype=torch.float64, generator=generator).requires_grad_()
    weight = torch.randn(5, dtype=torch.float64, generator=generator).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: hand_written(x, w, 1e-6), (x, weight))
    assert torch.autograd.gradgradcheck(lambda x, w: hand_written(x, w, 1e-6), (x, weight))


def test_rms_norm_takes_the_hand_written_backward_for_activations_only():
    weight = torch.randn(256, requires_grad=True)
    activations = torch.randn(4, 512, 256, requires_grad=True)  # a training micro batch
    decoding = torch.randn(1, 1, 256, requires_grad=True)
    assert type(rms_norm(activations, weight, 1e-6).grad_fn).__name__ == "_RMSNormBackward"
    assert type(rms_norm(decoding, weight, 1e-6).grad_fn).__name__ != "_RMSNormBackward"
    # the planner tracing a GPU run hands in CUDA's policy: PyTorch's kernel there
    assert type(rms_norm(activations, weight, 1e-6, CUDA).grad_fn).__name__ != "_RMSNormBackward"


def test_rms_norm_gives_the_same_numbers_without_autograd():
    x, weight = torch.randn(4, 512, 256), torch.randn(256, requires_grad=True)
    with_autograd = rms_norm(x, weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, 1e-6), with_autograd)


def test_rms_norm_skips_gradients_nobody_wants():
    x = torch.randn(4, 8, requires_grad=True)
    weight = torch.ones(8)  # frozen, e.g. under LoRA
    hand_written(x, weight, 1e-6).sum().backward()
    assert x.grad is not None and weight.grad is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_of_16_bit_activations_is_the_upcast_formula_computed_in_fewer_passes(dtype):
    # The published formula (fp32 statistics, normalised values rounded before the weight multiplies them) is the
    # reference; against float64 arithmetic on the same 16-bit inputs, the hand-written path is no further off.
    generator = torch.Generator().manual_seed(4)
    x = (3 * torch.randn(4, 512, 64, generator=generator)).to(dtype).requires_grad_()
    weight = (1 + 0.1 * torch.randn(64, generator=generator)).to(dtype).requires_grad_()
    upstream = torch.randn(4, 512, 64, generator=generator).to(dtype)
    ours, reference = rms_norm(x, weight, 1e-5), upcast_rms_norm(x, weight, 1e-5)
    assert type(ours.grad_fn).__name__ == "_RMSNormBackward" and ours.dtype == dtype
    x64, weight64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    exact = upcast_rms_norm(x64, weight64, 1e-5)
    exact_grads = torch.autograd.grad(exact, (x64, weight64), upstream.double())
    for a, b, truth in zip((ours, *torch.autograd.grad(ours, (x, weight), upstream)),
                           (reference, *torch.autograd.grad(reference, (x, weight), upstream)), (exact, *exact_grads)):
        error, reference_error = ((t.double() - truth).norm() / truth.norm() for t in (a, b))
        assert error <= 1.01 * reference_error  # the gradients, widened once, are closer: ~0.5-0.7x its error
    with torch.no_grad():
        assert torch.equal(rms_norm(x, weight, 1e-5), ours)


def test_a_16_bit_model_takes_the_hand_written_norm_for_activations_only():
    norm = RMSNorm(64).to(torch.bfloat16)
    norm.kernel_policy = CPU
    activations = torch.randn(4, 512, 64, dtype=torch.bfloat16, requires_grad=True)
    decoding = torch.randn(1, 1, 64, dtype=torch.bfloat16, requires_grad=True)
    assert type(norm(activations).grad_fn).__name__ == "_RMSNormBackward"
    assert type(norm(decoding).grad_fn).__name__ != "_RMSNormBackward"
    torch.testing.assert_close(norm(decoding), upcast_rms_norm(decoding, norm.weight, norm.eps), rtol=0, atol=0)


def rotate_half_formula(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_tables(length, n_elem, dtype=torch.float32):
    config = Config(n_layer=1, n_head=2, n_embd=2 * n_elem, block_size=length, rope_base=100)
    return [t.to(dtype) for t in rope_cache(config, length, torch.device("cpu"))]


@pytest.mark.parametrize("approximate", [None, "none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_product_equals_autograds_exactly_and_keeps_its_two_inputs_only(approximate, dtype):
    generator = torch.Generator().manual_seed(0)
    a, b, grad = (torch.randn(4, 7, 48, generator=generator).to(dtype) for _ in range(3))
    activation = F.silu if approximate is None else lambda x: F.gelu(x, approximate=approximate)
    results = []
    for fused in (False, True):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = ops.gated_product(x, y, approximate) if fused else activation(x) * y
        results.append((out, *torch.autograd.grad(out, (x, y), grad), len(saved)))
    (plain, *plain_grads, plain_kept), (fused, *fused_grads, fused_kept) = results
    assert torch.equal(fused, plain) and all(torch.equal(f, p) for f, p in zip(fused_grads, plain_grads))
    assert (plain_kept, fused_kept) == (3, 2)  # autograd: a, act(a), b; fused: a and b


def test_gated_product_is_differentiable_twice():
    generator = torch.Generator().manual_seed(1)
    a, b = (torch.randn(3, 5, dtype=torch.float64, generator=generator).requires_grad_() for _ in range(2))
    for approximate in (None, "tanh"):
        assert torch.autograd.gradgradcheck(lambda x, y: ops.gated_product(x, y, approximate), (a, b))


def test_rotate_equals_the_rotate_half_formula_in_values_gradient_and_layout():
    generator = torch.Generator().manual_seed(2)
    cos, sin = rope_tables(6, 8)
    # (B, heads, T, head_size) as attention makes it: a transposed view of (B, T, heads, head_size)
    x = torch.randn(2, 6, 3, 8, generator=generator).transpose(1, 2).requires_grad_()
    upstream = torch.randn(2, 3, 6, 8, generator=generator)
    ours, reference = rotate(x, cos, sin), rotate_half_formula(x, cos, sin)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)
    assert ours.stride() == x.stride()  # no copy into another layout
    torch.testing.assert_close(torch.autograd.grad(ours, x, upstream)[0], torch.autograd.grad(reference, x, upstream)[0],
                               rtol=1e-6, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(rotate(x, cos, sin), ours)


def test_rotate_is_differentiable_twice():
    cos, sin = (t.double() for t in rope_tables(4, 6))
    x = torch.randn(1, 2, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: rotate(x, cos, sin), (x,))
    assert torch.autograd.gradgradcheck(lambda x: rotate(x, cos, sin) ** 2, (x,))


@pytest.mark.parametrize("n_head, n_kv, length", [(4, 4, 16), (4, 2, 16), (2, 1, 9)])
def test_attention_in_halves_equals_causal_attention(n_head, n_kv, length):
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, n_head, length, 8, generator=generator).requires_grad_()
    k = torch.randn(2, n_kv, length, 8, generator=generator).requires_grad_()
    v = torch.randn(2, n_kv, length, 8, generator=generator).requires_grad_()
    upstream = torch.randn(2, length, n_head, 8, generator=generator)
    gqa = n_kv != n_head
    ours = causal_attention_in_halves(q, k, v, 0.3)
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=gqa).transpose(1, 2)
    assert ours.shape == (2, length, n_head, 8) and ours.is_contiguous()
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(ours, (q, k, v), upstream), torch.autograd.grad(reference, (q, k, v), upstream)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("length, halves, planned_for", [(400, True, None), (300, False, None), (400, False, "cuda")])
def test_model_attends_in_halves_only_where_it_pays(monkeypatch, length, halves, planned_for):
    calls = []
    monkeypatch.setattr(attention_module, "causal_attention_in_halves",
                        lambda *args: calls.append(args) or causal_attention_in_halves(*args))
    config = Config(name="t", block_size=512, vocab_size=64, padded_vocab_size=64, n_layer=1, n_embd=16, n_head=2,
                    n_query_groups=1, intermediate_size=32)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 64, (1, length))
    # The memory planner traces a GPU run on the CPU: it hands in the GPU's policy (one attention call).
    if planned_for:
        model.set_kernel_policy(CUDA)
    logits = model(idx)
    assert bool(calls) is halves
    # Causality holds either way: a later token does not change earlier logits.
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 64
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1], rtol=1e-5, atol=1e-5)


def test_attention_in_halves_keeps_only_the_mask_more():
    """The halves join in the layout the output projection keeps, which one call's output is copied to as well: a
    training forward saves the same tensors either way, plus the second half's mask (which SDPA keeps converted to
    fp32)."""

    def saved_bytes(model: GPT, idx: torch.Tensor) -> int:
        storages = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            mean_loss(CausalLM(), model, (idx, idx))
        return sum(storages.values())

    config = Config(name="t", block_size=512, vocab_size=64, padded_vocab_size=64, n_layer=1, n_embd=16, n_head=2,
                    n_query_groups=1, intermediate_size=32)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 64, (2, 400))
    in_halves = saved_bytes(model, idx)
    model.set_kernel_policy(replace(CPU, halves_lengths=None))
    assert in_halves - saved_bytes(model, idx) == 200 * 400 * 4


def test_grouped_heads_are_copied_where_cuda_would_take_the_math_kernel():
    fp32, bf16 = torch.float32, torch.bfloat16
    assert CUDA.expands_shared_heads(fp32, 64, masked=False, query_length=2048)  # SmolLM2 in 32-true
    assert CUDA.expands_shared_heads(bf16, 64, masked=True, query_length=2048)  # packing's document masks
    assert not CUDA.expands_shared_heads(bf16, 64, masked=False, query_length=2048)  # flash takes them
    assert not CUDA.expands_shared_heads(fp32, 64, masked=False, query_length=128)  # probabilities smaller
    assert not CPU.expands_shared_heads(fp32, 64, masked=False, query_length=2048)  # the CPU kernel takes them


@pytest.mark.parametrize("packed", [False, True])
def test_copied_heads_give_the_same_numbers(monkeypatch, packed):
    """The model on CUDA's paths (here on the CPU) copies k and v for SDPA; values and gradients are the CPU's."""
    calls = []
    expands_shared_heads = KernelPolicy.expands_shared_heads
    monkeypatch.setattr(KernelPolicy, "expands_shared_heads",
                        lambda *args: calls.append(expands_shared_heads(*args)) or calls[-1])
    config = Config(name="t", block_size=64, vocab_size=64, padded_vocab_size=64, n_layer=2, n_embd=32, n_head=4,
                    n_query_groups=2, intermediate_size=48)
    torch.manual_seed(0)
    model = GPT(config)
    idx = torch.randint(0, 64, (2, 40))
    positions = torch.tensor([[0] * 17 + list(range(23))] * 2) if packed else None

    def run(device_type: str):
        model.zero_grad()
        model.set_kernel_policy(CUDA if device_type == "cuda" else CPU)
        logits = model(idx, input_pos=None, positions=positions) if packed else model(idx)
        logits.float().square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    (cpu, cpu_grads), (cuda, cuda_grads) = run("cpu"), run("cuda")
    assert calls[-1] is True  # fp32, 40 queries of head size 8: copied on CUDA's paths
    torch.testing.assert_close(cuda, cpu, rtol=1e-5, atol=1e-5)
    for a, b in zip(cuda_grads, cpu_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# ---- fp32 linear maps on oneDNN ------------------------------------------------------------------------------
onednn = pytest.mark.skipif(not hasattr(torch.ops.mkldnn, "_linear_pointwise") or not torch.backends.mkldnn.is_available(),
                            reason="this torch has no oneDNN")


@pytest.fixture
def kernel(monkeypatch):
    """Set LIT_MODEL_FP32_LINEAR for one test (the choice is made once per process, so its cache is cleared)."""
    def choose(value):
        monkeypatch.setenv(FP32_LINEAR_ENV, value)
        ops.onednn_fp32_linear.cache_clear()
    monkeypatch.setattr(ops, "ONEDNN_LINEAR_MIN_MACS", 0)  # these tests' products are tiny
    yield choose
    monkeypatch.delenv(FP32_LINEAR_ENV, raising=False)
    ops.onednn_fp32_linear.cache_clear()


def saved_bytes(fn):
    """Bytes autograd keeps for backward while ``fn()`` builds its graph (each storage once)."""
    kept = {}
    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(kept.values())


@onednn
@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("out_features", [40, 56])  # the weight's gradient copies the narrower operand: grad or x
def test_onednn_linear_equals_f_linear_in_values_gradients_and_what_it_keeps(kernel, frozen, out_features):
    kernel("onednn")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=generator, requires_grad=True)
    weight = torch.randn(out_features, 48, generator=generator).requires_grad_(not frozen)
    bias = torch.randn(out_features, generator=generator).requires_grad_(not frozen)
    upstream = torch.randn(3, 5, out_features, generator=generator)
    ours, ours_kept = saved_bytes(lambda: linear(x, weight, bias))
    reference, reference_kept = saved_bytes(lambda: F.linear(x, weight, bias))
    assert ours.grad_fn.name().endswith("_OneDNNLinearBackward")
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    inputs = (x,) if frozen else (x, weight, bias)
    for a, b in zip(torch.autograd.grad(ours, inputs, upstream), torch.autograd.grad(reference, inputs, upstream)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert ours_kept == reference_kept  # a frozen weight keeps no input: the planner's trace counts what aten keeps
    assert ours_kept == (x.nbytes + weight.nbytes if not frozen else weight.nbytes)


@onednn
@pytest.mark.parametrize("out_features", [8, 24])
def test_onednn_linear_is_differentiable_twice(kernel, out_features):
    kernel("onednn")  # Sophia's Hessian differentiates the gradients again
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=generator, requires_grad=True)
    weight = torch.randn(out_features, 16, generator=generator, requires_grad=True)
    results = []
    for f in (linear, F.linear):
        grad_x, grad_weight = torch.autograd.grad(f(x, weight).tanh().sum(), (x, weight), create_graph=True)
        results.append(torch.autograd.grad(grad_x.square().sum() + grad_weight.square().sum(), (x, weight)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@onednn
def test_only_large_enough_fp32_products_outside_autocast_take_onednn(kernel, monkeypatch):
    kernel("onednn")
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8)
    assert linear(x, weight).grad_fn.name().endswith("_OneDNNLinearBackward")
    assert "OneDNN" not in linear(x.bfloat16(), weight.bfloat16()).grad_fn.name()
    transposed = torch.randn(8, 4).t().requires_grad_()  # oneDNN would copy it: F.linear's path
    assert "OneDNN" not in linear(transposed, weight).grad_fn.name()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x, weight).dtype == torch.bfloat16  # autocast's product, as F.linear's
    # the planner tracing a GPU run hands in the GPU's policy
    assert "OneDNN" not in linear(x, weight, device_type="cuda").grad_fn.name()
    monkeypatch.setattr(ops, "ONEDNN_LINEAR_MIN_MACS", x.numel() * weight.size(0))  # small products: BLAS
    assert "OneDNN" not in linear(x, weight).grad_fn.name()
    assert linear(torch.cat([x, x]), weight).grad_fn.name().endswith("_OneDNNLinearBackward")
    kernel("blas")
    assert "OneDNN" not in linear(x, weight).grad_fn.name()


def test_auto_takes_onednn_on_cpus_other_than_intels_and_is_the_default(kernel, monkeypatch):
    available = hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available()
    for unset in (False, True):  # unset means auto
        kernel("auto")
        if unset:
            monkeypatch.delenv(FP32_LINEAR_ENV)
        for vendor, expected in (("GenuineIntel", False), ("AuthenticAMD", True), (None, False)):
            monkeypatch.setattr(ops, "_cpu_vendor", lambda vendor=vendor: vendor)
            ops.onednn_fp32_linear.cache_clear()
            assert ops.onednn_fp32_linear() is (expected and available and torch.backends.mkl.is_available())
    kernel("blas")
    assert ops.onednn_fp32_linear() is False
    kernel("fast")
    with pytest.raises(UsageError, match="LIT_MODEL_FP32_LINEAR='fast': use auto"):
        ops.onednn_fp32_linear()


def test_decoding_reads_column_major_matrices_where_mkl_off_intel_multiplies_one_row(kernel, monkeypatch):
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: True)
    monkeypatch.setattr(ops, "_cpu_vendor", lambda: "AuthenticAMD")
    monkeypatch.setattr(ops, "ONEDNN_LINEAR_MIN_MACS", 48 * 40)  # one-row products of larger matrices: oneDNN
    cpu, small, large = torch.device("cpu"), (40, 48), (41, 48)
    kernel("auto")
    assert ops.decoding_column_major(small, torch.float32, cpu)
    assert ops.decoding_column_major(large, torch.float32, cpu) is not ops.onednn_fp32_linear()  # oneDNN reads rows
    kernel("blas")  # every product on MKL
    assert ops.decoding_column_major(large, torch.float32, cpu)
    for shape, dtype, device in ((small, torch.bfloat16, cpu), ((48,), torch.float32, cpu), (small, torch.float32, torch.device("meta"))):
        assert not ops.decoding_column_major(shape, dtype, device)
    monkeypatch.setattr(ops, "_cpu_vendor", lambda: "GenuineIntel")
    assert not ops.decoding_column_major(small, torch.float32, cpu)


@onednn
def test_a_model_trains_alike_on_either_kernel(kernel):
    config = Config(n_layer=2, n_embd=32, n_head=4, block_size=16, vocab_size=64, padded_vocab_size=64,
                    intermediate_size=48, mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm")
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    losses, grads = [], []
    for choice in ("blas", "onednn"):
        kernel(choice)
        torch.manual_seed(0)
        model = GPT.initialized(config)
        loss = mean_loss(CausalLM(), model, (idx, idx))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in model.parameters()])
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_configure_cpu_kernels_caps_onednns_caches_and_keeps_the_users_values(monkeypatch):
    for variable in ops.ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "7")
    ops.configure_cpu_kernels()
    assert ops.ONEDNN_CACHE_VARIABLES == ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(ops.ONEDNN_CACHE_CAPACITY)
    assert os.environ["LRU_CACHE_CAPACITY"] == "7"


# fp32 products on oneDNN at ever new row counts, in a fresh process (two kernels a shape): RSS growth (MB) over
# 120 shapes after a capped cache is full (freed buffers go back to the OS at once, so that what grows is what
# oneDNN keeps, not glibc's heap around it)
NEW_SHAPES = """
import os, sys
import torch
from lit_model.kernels import ops
if sys.argv[1] == "capped":
    ops.configure_cpu_kernels()
else:
    os.environ.update({variable: "1024" for variable in ops.ONEDNN_CACHE_VARIABLES})  # oneDNN's default
def rss_bytes():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def onednn(x, weight):
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
weight = torch.randn(1536, 384, generator=torch.Generator().manual_seed(0))
full = ops.ONEDNN_CACHE_CAPACITY // 2 + 8
for i, rows in enumerate(range(64, 64 + (full + 120) * 5, 5)):
    if i == full:
        before = rss_bytes()
    onednn(onednn(torch.randn(rows, 384), weight), weight.t())
print((rss_bytes() - before) / 2**20)
"""


@onednn
@pytest.mark.slow
def test_capped_onednn_caches_bound_a_process_running_ever_new_shapes():
    grown = {}
    for case in ("capped", "uncapped"):
        env = {k: v for k, v in os.environ.items() if k not in ops.ONEDNN_CACHE_VARIABLES}
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        proc = subprocess.run([sys.executable, "-c", NEW_SHAPES, case], capture_output=True, text=True, env=env, check=True)
        grown[case] = float(proc.stdout)
    assert grown["uncapped"] > 80 and grown["capped"] < grown["uncapped"] / 10, grown  # ~0.7 MB a kernel


# ---- causal attention in query blocks -----------------------------------------------------------------------
def _attention_errors(attend, q, k, v, upstream):
    """Mean and largest errors of attention's output and of its three input gradients against fp64."""
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference = F.scaled_dot_product_attention(*exact, is_causal=True)
    reference_grads = torch.autograd.grad(reference, exact, upstream.double())
    out = attend(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    errors = [(a.double() - b).abs() for a, b in zip((out, *grads), (reference, *reference_grads))]
    return [e.mean().item() for e in errors], [e.max().item() for e in errors]


@pytest.mark.parametrize("batch, heads, length, head_size", [(2, 3, 300, 16), (1, 4, 256, 64), (1, 2, 100, 8)])
def test_attention_in_blocks_is_about_as_exact_as_the_flash_kernel(batch, heads, length, head_size):
    """bf16 inputs, lengths that are a multiple of the block or not, shorter than one. The output and the key and
    value gradients are within 1.4x the CPU flash kernel's mean error against fp64 (scores and softmax in fp32),
    the query gradient within 1.75x (measured 1.4-1.6x: the score gradients are rounded to bf16 for its product, as
    for the keys'; an fp32 product there cost 5-18 % of the attention's time); no value off by more than a few bf16
    steps."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, length, head_size, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    upstream = torch.randn(batch, heads, length, head_size, dtype=torch.bfloat16)
    scale = head_size**-0.5
    (out, dq, dk, dv), largest = _attention_errors(lambda *qkv: causal_attention_in_blocks(*qkv, scale), q, k, v, upstream)
    flash, _ = _attention_errors(lambda *qkv: F.scaled_dot_product_attention(*qkv, is_causal=True), q, k, v, upstream)
    assert dq <= 1.75 * flash[1]
    for error, kernel_error in zip((out, dk, dv), (flash[0], flash[2], flash[3])):
        assert error <= 1.4 * kernel_error
    assert max(largest) < 0.03
    # In fp64 the same math as PyTorch's, up to the fp32 scores.
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    _, largest = _attention_errors(lambda *qkv: causal_attention_in_blocks(*qkv, scale), *exact, upstream.double())
    assert max(largest) < 1e-5


def test_attention_in_blocks_lays_its_output_out_as_the_flash_kernel():
    """The output is (B, T, heads, head_size) in memory: the model's transpose back is a view, which the output
    projection keeps, so nothing is kept twice."""
    q, k, v = (torch.randn(2, 3, 200, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out = causal_attention_in_blocks(q, k, v, 8**-0.5)
    assert out.shape == (2, 3, 200, 8) and out.transpose(1, 2).is_contiguous()


def test_block_scores_count_each_block_against_the_keys_up_to_its_last_query():
    assert block_scores(128) == 128 * 128
    assert block_scores(256) == 128 * 128 + 128 * 256
    assert block_scores(300) == 128 * 128 + 128 * 256 + 44 * 300
    assert block_scores(50) == 50 * 50


def test_attention_in_blocks_only_in_bf16_on_the_cpu_within_its_bounds():
    bf16 = torch.bfloat16
    assert CPU.attends_in_blocks(bf16, batch=1, heads=4, length=1024, width=256)  # vs_peers.py's model
    assert CPU.attends_in_blocks(bf16, batch=8, heads=4, length=256, width=256)
    assert not CPU.attends_in_blocks(bf16, batch=1, heads=4, length=256, width=256)  # flash's one call as fast
    assert CPU.attends_in_blocks(bf16, batch=1, heads=32, length=1024, width=2048)  # TinyLlama
    assert not CPU.attends_in_blocks(bf16, batch=1, heads=32, length=2048, width=2048)  # 17 values of its width
    assert not CPU.attends_in_blocks(torch.float32, batch=8, heads=4, length=256, width=256)
    assert not CUDA.attends_in_blocks(bf16, batch=8, heads=4, length=256, width=256)


def test_attention_in_blocks_takes_groups_of_heads_whose_tiles_fit(monkeypatch):
    """Whole samples while their tiles fit ATTENTION_TILE_BYTES, else heads of one sample; the same numbers."""
    monkeypatch.setattr(ops, "ATTENTION_TILE_BYTES", 1 << 22)
    assert ops._head_groups(2, 4, 1024) == [(slice(0, 2),)]  # 8 heads of 512 KiB tiles
    assert ops._head_groups(1, 32, 2048) == [(slice(0, 1), slice(h, h + 4)) for h in range(0, 32, 4)]  # 1 MiB each
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 300, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    upstream = torch.randn(3, 4, 300, 8, dtype=torch.float64)
    whole = causal_attention_in_blocks(q, k, v, 0.3)
    whole_grads = torch.autograd.grad(whole, (q, k, v), upstream)
    head_tiles = ops.ATTENTION_BLOCK * 300 * 4
    for heads, groups in ((4, 3), (3, 6)):  # one sample's 4 heads a group; then 3 heads and 1 of each sample
        monkeypatch.setattr(ops, "ATTENTION_TILE_BYTES", heads * head_tiles)
        assert len(ops._head_groups(3, 4, 300)) == groups
        grouped = causal_attention_in_blocks(q, k, v, 0.3)
        torch.testing.assert_close(grouped, whole, rtol=1e-12, atol=1e-12)
        for a, b in zip(torch.autograd.grad(grouped, (q, k, v), upstream), whole_grads):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _tiny_bf16_model(n_query_groups: int = 2) -> GPT:
    # wide enough for its 4 heads to keep their probabilities over 300 tokens (ops.KEPT_PROBABILITIES_PER_WIDTH)
    config = Config(name="t", block_size=300, vocab_size=64, padded_vocab_size=64, n_layer=2, n_embd=96, n_head=4,
                    n_query_groups=n_query_groups, intermediate_size=128)
    torch.manual_seed(0)
    return GPT(config).to(torch.bfloat16)


@pytest.mark.parametrize("planned_for, grad, blocks", [(None, True, True), (None, False, False), ("cuda", True, False)])
def test_model_attends_in_blocks_in_training_steps_on_the_cpu(monkeypatch, planned_for, grad, blocks):
    """A training forward in bf16 on the CPU takes the blocks; evaluation (no gradients) and generation keep the
    flash kernel, and the planner tracing a GPU run takes the GPU's path."""
    calls = []
    monkeypatch.setattr(attention_module, "causal_attention_in_blocks",
                        lambda *args: calls.append(args) or causal_attention_in_blocks(*args))
    model = _tiny_bf16_model()
    idx = torch.randint(0, 64, (8, 200))  # 8 samples of 4 heads: over ops.MIN_BLOCK_SCORES
    if planned_for:
        model.set_kernel_policy(CUDA)
    with torch.set_grad_enabled(grad):
        mean_loss(CausalLM(), model, (idx, idx))
    assert len(calls) == (2 if blocks else 0)
    calls.clear()
    mean_loss(CausalLM(), model, (idx, idx, torch.arange(200).repeat(8, 1)))  # packed samples: masks, the flash kernel
    assert not calls


@pytest.mark.parametrize("n_query_groups", [4, 2])
def test_model_in_blocks_trains_as_with_the_flash_kernel(n_query_groups):
    """The same loss and gradients (to bf16's precision) with grouped key/value heads or not; and a selective
    checkpoint, which redoes the score tiles in backward, gives exactly the gradients of the blocks without it."""

    idx = torch.randint(0, 64, (3, 300), generator=torch.Generator().manual_seed(1))  # over ops.MIN_BLOCK_SCORES

    def loss_and_grads(model: GPT):
        loss = mean_loss(CausalLM(), model, (idx, idx))
        return [loss.detach().float()] + [g.float() for g in torch.autograd.grad(loss, list(model.parameters()))]

    model = _tiny_bf16_model(n_query_groups)
    in_blocks = loss_and_grads(model)
    selective = parallelize(_tiny_bf16_model(n_query_groups), ParallelDims(dp_replicate=1, dp_shard=1),
                            Levers(ac_interval=1, ac_selective=True))
    for a, b in zip(loss_and_grads(selective), in_blocks):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    model.set_kernel_policy(replace(CPU, bf16_attention_in_blocks=False))
    flash = loss_and_grads(model)
    torch.testing.assert_close(in_blocks[0], flash[0], rtol=1e-2, atol=1e-2)
    for a, b in zip(in_blocks[1:], flash[1:]):
        assert (a - b).norm() <= 0.05 * b.norm() + 1e-4
