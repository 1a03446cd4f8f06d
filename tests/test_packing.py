"""--packing: samples packed into sequences give the unpacked loss and gradients (RoPE positions restart and
attention stays within each sample), the packing itself, the padding it saves, out-of-memory recovery on packed
batches, the planner's view of the masks, and fine-tuning end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from lightning.fabric import Fabric

from lit_model import GPT, Config
from lit_model.methods.adapter import AdapterConfig, apply_adapter
from lit_model.data.instruct import IGNORE_INDEX, InstructDataset, PackedDataset, collate, pack_best_fit, padding_fraction
from lit_model.plan.training import plan_run
from lit_model.run import resolve_run
from lit_model.train.recovery import SIMULATED_CAP_ENV
import test_finetune
from lit_model.methods.objective import CausalLM
from test_finetune import finetune
from test_memory_plan import args as plan_args, tiny as plan_config
from test_oom import CAP, TINY, make_step

ft = test_finetune.ft  # the tiny checkpoint and instruction data, a fixture
MODELS = {
    "llama": dict(mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm"),
    # a window shorter than the samples: the packed mask must cut it per sample as the unpacked one does
    "sliding-window": dict(sliding_window_size=8, sliding_window_layer_stride=2),
    # the explicit attention path (Gemma 2)
    "softcapping": dict(attention_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "adapter": {},  # LLaMA-Adapter: every token also attends to the prefix
}


def instruct_dataset(lengths: list[int], seed: int = 0) -> InstructDataset:
    """Samples of these lengths (input tokens), the first third of each one's targets masked (the prompt)."""
    generator = np.random.default_rng(seed)
    return InstructDataset([(generator.integers(0, 512, n + 1), np.arange(n + 1) >= n // 3) for n in lengths],
                           [""] * len(lengths))


def summed_loss_and_gradients(model: GPT, batches: list[tuple[torch.Tensor, ...]]) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    total = 0.0
    for batch in batches:
        loss = CausalLM().loss_sum(model, batch).loss
        loss.backward()
        total += loss.item()
    return total, {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("name", MODELS)
def test_packed_samples_give_the_unpacked_loss_and_gradients(name):
    torch.manual_seed(0)
    model = GPT(Config(**{**TINY, "block_size": 128, **MODELS[name]}))
    model.init_weights()
    if name == "adapter":
        apply_adapter(model, AdapterConfig(prompt_length=4, start_layer=1))
        torch.nn.init.constant_(model.blocks[1].attn.adapter_gate, 0.5)
    dataset = instruct_dataset([20, 33, 7, 50])
    unpacked = summed_loss_and_gradients(model, [(ids[None], targets[None]) for ids, targets in dataset])
    packed_dataset = PackedDataset(dataset, 128)
    assert packed_dataset.packs == [[0, 1, 2, 3]]  # the four samples in one sequence, padded to 128
    batch = collate([packed_dataset[0]], max_length=128)
    assert batch[0].shape == (1, 128) and batch[2][0, :20].tolist() == list(range(20)) and batch[2][0, 20] == 0
    packed = summed_loss_and_gradients(model, [batch])
    assert packed[0] == pytest.approx(unpacked[0], rel=1e-5)
    for key, grad in unpacked[1].items():
        torch.testing.assert_close(packed[1][key], grad, rtol=1e-4, atol=1e-6, msg=key)


def test_generation_path_is_unchanged_and_positions_exclude_input_pos():
    torch.manual_seed(0)
    model = GPT(Config(**TINY)).eval()
    idx = torch.randint(0, 512, (2, 16))
    # one sample per row, positions 0..T-1: exactly the plain forward
    torch.testing.assert_close(model(idx, positions=torch.arange(16).expand(2, 16)), model(idx), rtol=1e-5, atol=1e-6)
    model.set_kv_cache(2, 16)
    with pytest.raises(ValueError, match="exclude each other"):
        model(idx, input_pos=torch.arange(16), positions=torch.arange(16).expand(2, 16))


def test_pack_best_fit_fills_the_fullest_pack_that_holds_a_sample():
    lengths = [5, 3, 8, 2, 2, 9, 1, 10]
    packs = pack_best_fit(lengths, 10)
    # the first 2 goes where 2 tokens are left in the older pack, the second into the other
    assert packs == [[0, 1, 3], [2, 4], [5, 6], [7]]
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in pack) == 10 for pack in packs)


def test_packing_lowers_the_padding_fraction():
    dataset = instruct_dataset(np.random.default_rng(0).integers(10, 200, 400).tolist())
    packed = PackedDataset(dataset, 512)
    unpacked_fraction = padding_fraction(dataset.lengths, 16, 4, 25, 512)
    packed_fraction = padding_fraction(packed.lengths, 16, 4, 25, 512)
    assert unpacked_fraction > 0.15 and packed_fraction < 0.1, (unpacked_fraction, packed_fraction)
    assert packed.target_tokens == dataset.target_tokens and sum(packed.lengths) == sum(dataset.lengths)


def packed_step_batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Two micro batches of 4 rows of 64 tokens, each row three samples of 20, 24 and 20 tokens."""
    generator = torch.Generator().manual_seed(1)
    positions = torch.cat([torch.arange(20), torch.arange(24), torch.arange(20)]).expand(4, 64)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 512, (4, 64), generator=generator)
        targets = ids.roll(-1, 1)
        targets[:, :5] = IGNORE_INDEX
        batches.append((ids, targets, positions))
    return batches


def test_out_of_memory_recovery_splits_packed_batches(monkeypatch):
    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model, _, step, _ = make_step(fabric, 4)
    loss, _, tokens, _ = step(packed_step_batches(), "at step 1")
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    monkeypatch.setenv(SIMULATED_CAP_ENV, CAP)
    model, _, step, reports = make_step(fabric, 4)
    split_loss, _, split_tokens, _ = step(packed_step_batches(), "at step 1")
    assert step.micro_batch_size == 2 and not reports
    assert split_tokens == tokens and torch.allclose(split_loss, loss, rtol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("engine", ["trace", "analytic"])
def test_plan_counts_the_document_masks(engine):
    config = plan_config(block_size=512, n_query_groups=4)  # every head its own keys: CUDA's fused kernel takes a mask
    run = resolve_run(plan_args(override_max_seq_length=512), config, "full", "cuda", present=False)
    plain = plan_run(run, engine=engine, suggest=False, detect=False)
    packed = plan_run(run.replace(packing=True), engine=engine, suggest=False, detect=False)
    mask = run.micro_batch_size * run.seq_len**2 * run.compute_bytes  # (B, 1, T, T) in bfloat16
    # the trace: the mask and per-token RoPE tables, less the memory of the unmasked causal kernel it replaces
    assert 0.8 * mask < packed.tensor_peak_bytes - plain.tensor_peak_bytes < 1.3 * mask
    assert packed.by_phase["evaluation"] > plain.by_phase["evaluation"]
    # grouped queries with a mask: no fused CUDA kernel takes both; the model copies k and v to every head for the
    # memory-efficient kernel (KernelPolicy.expands_shared_heads), instead of the math kernel's probabilities of every head
    grouped_config = plan_config(block_size=512)
    grouped = run.replace(config=grouped_config)
    plain = plan_run(grouped, engine=engine, suggest=False, detect=False)
    packed = plan_run(grouped.replace(packing=True), engine=engine, suggest=False, detect=False)
    lacked = (grouped_config.n_head - grouped_config.n_query_groups) * grouped_config.head_size
    copies = grouped_config.n_layer * 2 * run.micro_batch_size * run.seq_len * lacked * run.compute_bytes
    assert 0.8 * (mask + copies) < packed.tensor_peak_bytes - plain.tensor_peak_bytes < 1.3 * (mask + copies)
    assert packed.tensor_peak_bytes - plain.tensor_peak_bytes < config.n_layer * config.n_head * mask  # no T x T each


@pytest.mark.slow
def test_finetune_with_packing(ft, tmp_path):
    out = tmp_path / "packed"
    proc = finetune(ft, "lora", out, "--packing", "true")
    assert proc.returncode == 0, proc.stderr
    assert "with --packing" in proc.stdout and "Training 6 steps of 8 sequences" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["padding_fraction"] == summary["padding_fraction_with_packing"]
    assert summary["padding_fraction_with_packing"] < summary["padding_fraction_without_packing"]
    assert summary["val_loss"] is not None and summary["steps"] == 6
