"""The fused head + cross-entropy (lit_model/model/loss.py) against F.cross_entropy on full logits: loss and every
gradient, with ignored targets, a bias, soft-capping, an uneven last chunk, autocast and no grad; and the
model's fallback for a double backward (Sophia) and for a LoRA head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lit_model import GPT, Config
from lit_model.kernels.policy import kernel_policy
from lit_model.model.loss import linear_cross_entropy

CPU = kernel_policy("cpu")
from lit_model.methods.lora import LoRAConfig, apply_lora
from lit_model.methods.objective import CausalLM, mean_loss


def reference_loss(x, weight, bias, targets, softcap=None):
    logits = F.linear(x, weight, bias).float()
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")


def inputs(dtype=torch.float32, bias=False):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(70, 16, generator=generator).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(50, 16, generator=generator)).to(dtype).requires_grad_()
    b = torch.randn(50, generator=generator).to(dtype).requires_grad_() if bias else None
    targets = torch.randint(0, 50, (70,), generator=generator)
    targets[::4] = -100
    return x, weight, b, targets


def gradients(loss, tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("chunk_size", [70, 32, 1])
@pytest.mark.parametrize("bias, softcap", [(False, None), (True, None), (False, 5.0)])
def test_equals_cross_entropy_on_full_logits(chunk_size, bias, softcap):
    x, weight, b, targets = inputs(bias=bias)
    expected = reference_loss(x, weight, b, targets, softcap)
    loss = linear_cross_entropy(x, weight, b, targets, chunk_size, softcap, onednn=CPU.onednn_fp32_linear)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-4)
    scale = 0.37  # backward scales the gradients made in forward by the incoming gradient
    for got, want in zip(gradients(scale * loss, (x, weight, b)), gradients(scale * expected, (x, weight, b))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(x, weight, b, targets, chunk_size, softcap, onednn=CPU.onednn_fp32_linear), expected,
                                   rtol=1e-5, atol=1e-4)


def test_autocast_keeps_fp32_weight_gradients():
    x, weight, b, targets = inputs(bias=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(x, weight, b, targets, 32, onednn=CPU.onednn_fp32_linear)
        expected = F.cross_entropy(F.linear(x, weight.to(torch.bfloat16), b.to(torch.bfloat16)).float(), targets,
                                   reduction="sum")
    assert loss.dtype == torch.float32
    got = gradients(loss, (x, weight, b))
    assert [g.dtype for g in got] == [torch.float32] * 3
    for g, want in zip(got, gradients(expected, (x, weight, b))):
        torch.testing.assert_close(g, want, rtol=0.05, atol=0.02)


def test_bf16_is_close_to_fp32():
    x, weight, _, targets = inputs(torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as Fabric's bf16-true sets it around the forward
    try:
        loss = linear_cross_entropy(x, weight, None, targets, 32, onednn=CPU.onednn_fp32_linear)
    finally:
        torch.set_default_dtype(default)
    assert loss.dtype == torch.float32
    expected = reference_loss(x.float(), weight.float(), None, targets)
    assert loss.item() == pytest.approx(expected.item(), rel=0.01)
    grad_x, grad_weight = gradients(loss, (x, weight))
    assert grad_weight.dtype == torch.bfloat16
    torch.testing.assert_close(grad_x, gradients(expected, (x,))[0], rtol=0.05, atol=0.02)


def test_a_second_backward_is_refused():
    x, weight, _, targets = inputs()
    loss = linear_cross_entropy(x, weight, None, targets, 32, onednn=CPU.onednn_fp32_linear)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once"):
        loss.backward()


def tiny_model() -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(name="t", block_size=32, vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_query_groups=2,
                       intermediate_size=64, tie_embeddings=False))
    model.init_weights()
    return model


def test_double_backward_falls_back_to_checkpointed_chunks():
    """Sophia differentiates the gradients again: the model then takes the (twice differentiable) checkpointed
    path, with the same loss and gradients."""
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    fused, plain = tiny_model(), tiny_model()
    objectives = (CausalLM(chunk_size=24), CausalLM(chunk_size=24, differentiable_twice=True))
    losses = [mean_loss(objective, model, (tokens[:, :-1], tokens[:, 1:]))
              for objective, model in zip(objectives, (fused, plain))]
    torch.testing.assert_close(losses[0], losses[1])
    grads = [torch.autograd.grad(loss, list(model.parameters()), create_graph=model is plain)
             for loss, model in zip(losses, (fused, plain))]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # a Hessian-vector product through the head works on the fallback path
    hvp = torch.autograd.grad(grads[1][-1].sum(), plain.lm_head.weight)
    assert hvp[0].abs().sum() > 0


def test_lora_head_takes_the_checkpointed_path():
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    model = tiny_model()
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.0, head=True))
    loss = mean_loss(CausalLM(chunk_size=24), model, (tokens[:, :-1], tokens[:, 1:]))
    with torch.no_grad():
        expected = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, 64).float(), tokens[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
