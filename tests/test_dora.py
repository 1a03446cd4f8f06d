"""DoRA (--lora_dora): the start is exactly the base model, the merged model gives the trained model's logits,
PEFT's DoRA gives the same outputs and gradients, QLoRA + DoRA, the planner's view, and a fine-tune that resumes."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from safetensors.torch import load_file

from lit_model.methods.lora import LoRAConfig, apply_lora, merge_state_dict
from lit_model.plan.training import plan_run
from lit_model.run import resolve_run
import test_finetune
from lit_model.methods.objective import CausalLM, mean_loss
from test_finetune import finetune, losses
from test_lora import tiny_model
from test_memory_plan import args as plan_args, tiny as plan_config

ft = test_finetune.ft  # the tiny checkpoint and instruction data, a fixture
DORA = LoRAConfig(r=4, alpha=8, key=True, projection=True, mlp=True, dropout=0.0, dora=True)


def train_a_little(model, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    idx = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(steps):
        loss = mean_loss(CausalLM(), model, (idx, idx))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_dora_starts_as_the_base_model_exactly_and_trains_its_magnitudes():
    model = tiny_model()
    idx = torch.randint(0, 128, (2, 16))
    before = model(idx)
    apply_lora(model, DORA)
    assert torch.equal(model(idx), before)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "blocks.0.attn.query.lora_magnitude" in trainable and model.blocks[0].attn.query.lora_magnitude.shape == (64,)
    losses = train_a_little(model)
    assert losses[-1] < losses[0]
    magnitude = model.blocks[0].mlp.fc_1.lora_magnitude
    assert not torch.equal(magnitude, model.blocks[0].mlp.fc_1.weight.norm(dim=1))  # the magnitudes trained


def test_merged_dora_gives_the_logits_of_the_trained_model():
    base = tiny_model()
    model = copy.deepcopy(base)
    apply_lora(model, DORA)
    train_a_little(model)
    trained = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    merged = tiny_model()
    merged.load_state_dict(merge_state_dict(dict(base.state_dict()), trained, DORA))
    idx = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(merged.eval()(idx), model.eval()(idx), atol=1e-5, rtol=1e-5)


def one_linear() -> torch.nn.Module:
    """A module whose one linear layer (16 x 24, with a bias) is named as a GPT's MLP projection."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.mlp = torch.nn.Module()
    model.mlp.proj = torch.nn.Linear(24, 16)
    return model


def test_dora_matches_peft_on_a_linear_layer():
    peft = pytest.importorskip("peft")
    theirs = peft.get_peft_model(one_linear(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                               target_modules=["proj"], use_dora=True))
    ours = one_linear()
    apply_lora(ours, LoRAConfig(r=4, alpha=8, dropout=0.0, query=False, value=False, mlp=True, dora=True))
    layer, peft_layer = ours.mlp.proj, theirs.base_model.model.mlp.proj

    def pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.lora_A, peft_layer.lora_A["default"].weight), (layer.lora_B, peft_layer.lora_B["default"].weight),
                (layer.lora_magnitude, peft_layer.lora_magnitude_vector["default"].weight)]

    torch.testing.assert_close(*pairs()[2])  # both start from the base weight's row norms
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the same "trained" state in both
        for mine, peft_parameter in pairs():
            mine.add_(torch.randn(mine.shape, generator=generator) * 0.1)
            peft_parameter.copy_(mine)
    x = torch.randn(5, 24, generator=generator)
    out, peft_out = layer(x), peft_layer(x)
    torch.testing.assert_close(out, peft_out, rtol=1e-5, atol=1e-6)
    out.square().sum().backward()
    peft_out.square().sum().backward()
    for mine, peft_parameter in pairs():
        torch.testing.assert_close(mine.grad, peft_parameter.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.int8"])
def test_qdora_starts_as_the_quantized_base_and_trains(mode):
    from lit_model.methods.quantize import quantize_model

    model = tiny_model(bias=False)
    quantize_model(model, mode, torch.float32)
    idx = torch.randint(0, 128, (2, 16))
    before = model(idx)
    apply_lora(model, LoRAConfig(r=4, mlp=True, dora=True, dropout=0.0))
    assert torch.equal(model(idx), before)
    losses = train_a_little(model)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("quantize", [None, "bnb.nf4"])
def test_plan_counts_dora(quantize):
    config = plan_config()
    run = resolve_run(plan_args(), config, "lora", "cuda", present=False, quantize=quantize)
    lora, dora = run, run.replace(lora=LoRAConfig(dora=True))
    traced = {r.lora_dora: plan_run(r, engine="trace", suggest=False, detect=False) for r in (lora, dora)}
    analytic = {r.lora_dora: plan_run(r, engine="analytic", suggest=False, detect=False) for r in (lora, dora)}
    extra = traced[True].tensor_peak_bytes - traced[False].tensor_peak_bytes
    # the magnitudes, their gradients and AdamW state, the outputs kept for the magnitudes' gradient and the norm
    assert extra > 0
    assert analytic[True].tensor_peak_bytes - analytic[False].tensor_peak_bytes > 0
    # the closed form stays within 10 % of the trace (or above it), with and without DoRA
    assert analytic[True].tensor_peak_bytes > 0.9 * traced[True].tensor_peak_bytes


@pytest.mark.slow
def test_dora_fine_tune_saves_merges_and_resumes(ft, tmp_path):
    flags = ("--lora_dora", "true", "--lora_mlp", "true", "--max_steps", "4", "--save_interval", "2", "--keep_last", "10")
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    proc = finetune(ft, "lora", uninterrupted, *flags)
    assert proc.returncode == 0, proc.stderr
    assert "DoRA r=8" in proc.stdout
    final = uninterrupted / "final"
    adapter = load_file(str(final / "lora.safetensors"))
    assert any(name.endswith("lora_magnitude") for name in adapter) and LoRAConfig.from_dir(final).dora
    shutil.copytree(uninterrupted, interrupted)
    for path in ("checkpoints/step-00000004", "final", "summary.json"):  # as if it died after the step-2 checkpoint
        shutil.rmtree(interrupted / path) if (interrupted / path).is_dir() else (interrupted / path).unlink()
    proc = finetune(ft, "lora", interrupted, *flags, "--resume", "auto")
    assert proc.returncode == 0 and "at step 2" in proc.stdout, proc.stderr
    assert losses(interrupted) == losses(uninterrupted)
