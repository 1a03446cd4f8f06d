"""Each memory lever changes what it should: activation checkpointing and bf16 lower the memory saved for
backward, chunked cross-entropy and gradient accumulation leave the numbers unchanged, freezing keeps
weights fixed."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lit_model import GPT, Config
from lit_model.core.errors import UsageError
from lit_model.kernels.ops import block_scores
from lit_model.parallel.apply import Levers, parallelize
from lit_model.parallel.dims import ParallelDims
from lit_model.train.step import freeze_layers
from lit_model.methods.objective import CausalLM, mean_loss

CONFIG = dict(name="levers", block_size=128, vocab_size=256, n_layer=4, n_embd=64, n_head=4, n_query_groups=2,
              intermediate_size=128)


def make_model(dtype: torch.dtype = torch.float32, **overrides) -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**{**CONFIG, **overrides}))
    model.init_weights()
    return model.to(dtype)


def batch(batch_size: int = 8, length: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 256, (batch_size, length + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def saved_for_backward_bytes(model: GPT, inputs: torch.Tensor, targets: torch.Tensor, plain_head: bool = False,
                             objective: CausalLM = CausalLM()) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct storages autograd keeps for backward (what activation memory is made of).
    ``plain_head``: the loss as F.cross_entropy on the model's full logits instead of the model's fused loss."""
    storages: dict[int, int] = {}
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        if plain_head:
            logits = model(inputs).float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        else:
            loss = mean_loss(objective, model, (inputs, targets))
    return sum(storages.values()), loss


def gradients(model: GPT) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_activation_checkpointing_saves_less_and_gives_the_same_loss_and_gradients():
    inputs, targets = batch()
    plain = make_model()
    plain_bytes, plain_loss = saved_for_backward_bytes(plain, inputs, targets)
    plain_loss.backward()
    for interval, ratio in ((1, 0.35), (2, 0.7)):
        checkpointed = parallelize(make_model(), ParallelDims(dp_replicate=1, dp_shard=1), Levers(ac_interval=interval))
        ckpt_bytes, ckpt_loss = saved_for_backward_bytes(checkpointed, inputs, targets)
        ckpt_loss.backward()
        assert ckpt_bytes < ratio * plain_bytes, (interval, ckpt_bytes, plain_bytes)
        assert ckpt_loss.item() == pytest.approx(plain_loss.item(), abs=1e-6)
        for name, grad in gradients(plain).items():
            torch.testing.assert_close(gradients(checkpointed)[name], grad, rtol=1e-4, atol=1e-6)


def test_bf16_true_halves_weights_and_saved_activations_with_a_close_loss():
    inputs, targets = batch()
    fp32_bytes, fp32_loss = saved_for_backward_bytes(make_model(), inputs, targets)
    bf16 = make_model(torch.bfloat16)
    in_blocks, bf16_loss = saved_for_backward_bytes(bf16, inputs, targets)
    assert sum(p.nbytes for p in bf16.parameters()) * 2 == sum(p.nbytes for p in make_model().parameters())
    assert bf16_loss.dtype == torch.float32  # the loss is always computed in fp32
    assert bf16_loss.item() == pytest.approx(fp32_loss.item(), abs=0.05)
    # On the CPU, bf16 attention in blocks (KernelPolicy.attends_in_blocks) keeps each head's probabilities and the key/value
    # heads copied to every query head, not the flash kernel's fp32 logsumexp; with the flash kernel bf16 keeps
    # under 0.7x what fp32 keeps.
    bf16.set_kernel_policy(replace(bf16.kernel_policy, bf16_attention_in_blocks=False))
    bf16_bytes, flash_loss = saved_for_backward_bytes(bf16, inputs, targets)
    assert bf16_bytes < 0.7 * fp32_bytes
    assert flash_loss.item() == pytest.approx(bf16_loss.item(), abs=0.02)
    (B, T), (L, H, groups, hs) = inputs.shape, (CONFIG["n_layer"], CONFIG["n_head"], CONFIG["n_query_groups"], 16)
    assert in_blocks - bf16_bytes == L * B * (H * block_scores(T) * 2 + 2 * (H - groups) * T * hs * 2 - H * T * 4)


def test_chunked_cross_entropy_equals_the_full_one_and_keeps_no_logits():
    inputs, targets = batch(4, 128)
    reference, full, chunked = make_model(), make_model(), make_model()
    reference_bytes, reference_loss = saved_for_backward_bytes(reference, inputs, targets, plain_head=True)
    reference_loss.backward()
    logits_bytes = 4 * 128 * 256 * 4
    head_gradient_bytes = (4 * 128 + 256) * 64 * 4  # what the fused loss keeps instead: d(input), d(weight)
    for model, chunk_size in ((full, 0), (chunked, 64)):
        saved, loss = saved_for_backward_bytes(model, inputs, targets, objective=CausalLM(chunk_size))
        loss.backward()
        assert loss.item() == pytest.approx(reference_loss.item(), abs=1e-5)
        assert saved <= reference_bytes - logits_bytes + head_gradient_bytes
        for name, grad in gradients(reference).items():
            torch.testing.assert_close(gradients(model)[name], grad, rtol=1e-4, atol=1e-6)


def test_ignored_targets_do_not_count():
    inputs, targets = batch(2, 32)
    model = make_model()
    masked = targets.clone()
    masked[:, :16] = -100
    with torch.no_grad():
        logits = model(inputs)
        expected = torch.nn.functional.cross_entropy(logits[:, 16:].reshape(-1, 256), targets[:, 16:].reshape(-1))
        assert mean_loss(CausalLM(), model, (inputs, masked)).item() == pytest.approx(expected.item(), abs=1e-6)


def test_gradient_accumulation_equals_the_full_batch():
    inputs, targets = batch(8, 64)
    full, accumulated = make_model(), make_model()
    mean_loss(CausalLM(), full, (inputs, targets)).backward()
    for part in range(4):
        rows = slice(2 * part, 2 * part + 2)
        (mean_loss(CausalLM(), accumulated, (inputs[rows], targets[rows])) / 4).backward()
    for name, grad in gradients(full).items():
        torch.testing.assert_close(gradients(accumulated)[name], grad, rtol=1e-4, atol=1e-6)


def test_freeze_layers_by_count_and_pattern():
    model = make_model()
    frozen = freeze_layers(model, 2)
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert "embed.weight" in names and any(n.startswith("blocks.1.") for n in names)
    assert not any(n.startswith("blocks.2.") for n in names)
    assert frozen == sum(p.numel() for n, p in model.named_parameters() if n in names)

    model = make_model()
    freeze_layers(model, ["blocks.[0-2].mlp.*"])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    inputs, targets = batch(2, 32)
    mean_loss(CausalLM(), model, (inputs, targets)).backward()
    optimizer.step()
    for name, parameter in model.named_parameters():
        changed = not torch.equal(before[name], parameter)
        assert changed == (not ("mlp" in name and name.split(".")[1] in "012")), name

    with pytest.raises(UsageError, match="match no parameter"):
        freeze_layers(make_model(), ["nothing.*"])
    with pytest.raises(UsageError, match="0..4"):
        freeze_layers(make_model(), 9)


def test_max_seq_length_is_capped_by_the_block_size():
    from lit_model.core.errors import UserError

    model = make_model()
    model.max_seq_length = 32
    assert model.cos.shape[0] == 32
    with pytest.raises(UserError, match="block_size=128"):
        model.max_seq_length = 256
    with pytest.raises(UserError, match="max_seq_length=32"):
        model(torch.zeros(1, 33, dtype=torch.long))
