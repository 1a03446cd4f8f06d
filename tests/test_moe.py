"""Mixtures of experts (LLaMAMoE: Mixtral, Qwen3-MoE) in training: FSDP over two processes gives the one-process
losses, LoRA on every expert fine-tunes and merges under FSDP, and the planner's trace of a MoE step (which routes
every token to the first k experts, the routing that needs the most memory) matches the measured step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parent))
from conftest import ROOT, TINY_CONFIG  # noqa: E402
from test_finetune import finetune, ft, losses, make_checkpoint  # noqa: E402, F401
from test_pretrain import pretrain  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from moe_plan import MODEL, predict  # noqa: E402
from plan_accuracy import run_worker, settings_for  # noqa: E402

from lit_model import Config  # noqa: E402
from lit_model.plan.training import plan_training  # noqa: E402
from lit_model.model.gpt import LLaMAMoE  # noqa: E402
from lit_model.methods.load import load_gpt  # noqa: E402

MOE = dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2)


@pytest.fixture(scope="module")
def moe_setup(tiny_setup, tmp_path_factory) -> dict[str, Path]:
    """tiny_setup with the tiny config's MLPs replaced by 4 experts, 2 per token."""
    config = tmp_path_factory.mktemp("moe") / "moe.yaml"
    config.write_text(TINY_CONFIG.replace("test-tiny", "test-tiny-moe") + "".join(f"{k}: {v}\n" for k, v in MOE.items()))
    return {**tiny_setup, "config": config}


def test_an_expert_no_token_chose_still_gets_a_zero_gradient():
    """FSDP reduce-scatters every parameter of a block on every rank: a rank whose tokens all skipped an expert
    must still give that expert a gradient (zeros), or the ranks' collectives would not match."""
    torch.manual_seed(0)
    moe = LLaMAMoE(Config(name="moe", n_embd=8, n_head=2, intermediate_size=16, **MOE))
    direction = torch.randn(8)
    with torch.no_grad():  # tokens along `direction` rank the experts 2, 1, 0, 3: top-2 skips 0 and 3
        moe.gate.weight.copy_(torch.stack([direction, direction * 2, direction * 3, -direction]))
    x = torch.rand(2, 5, 1) * direction
    moe(x).sum().backward()
    for e, expert in enumerate(moe.experts):
        for name, param in expert.named_parameters():
            assert param.grad is not None, (e, name)
            assert (param.grad.abs().sum() == 0) == (e in (0, 3)), (e, name)


@pytest.mark.multiprocess
def test_fsdp_on_two_processes_matches_one(moe_setup, tmp_path):
    single, multi = tmp_path / "single", tmp_path / "multi"
    proc = pretrain(moe_setup, single)
    assert proc.returncode == 0, proc.stderr
    proc = pretrain(moe_setup, multi, "--devices", "2", "--strategy", "fsdp")
    assert proc.returncode == 0, proc.stderr
    assert len(losses(single)) == len(losses(multi)) == 6
    for (train_1, val_1), (train_2, val_2) in zip(losses(single), losses(multi)):
        assert float(train_1) == pytest.approx(float(train_2), abs=1e-4)
        assert (val_1 == "") == (val_2 == "")
        assert val_1 == "" or float(val_1) == pytest.approx(float(val_2), abs=1e-4)


@pytest.mark.multiprocess
def test_lora_on_every_expert_with_fsdp_trains_and_merges(ft, tmp_path):
    base = make_checkpoint(tmp_path / "base", ft["tokenizer"], **MOE)
    out = tmp_path / "lora"
    proc = finetune({**ft, "base": base}, "lora", out, "--lora_mlp", "true", "--lora_dropout", "0", "--devices", "2",
                    "--strategy", "fsdp")
    assert proc.returncode == 0, proc.stderr
    lora = load_file(str(out / "final" / "lora.safetensors"))
    adapted = {name.split(".lora_")[0] for name in lora if ".experts." in name}
    assert adapted == {f"blocks.{layer}.mlp.experts.{e}.{proj}" for layer in range(2) for e in range(4)
                       for proj in ("fc_1", "fc_2", "proj")}
    base_model, merged = load_gpt(base).eval(), load_gpt(out / "final").eval()
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (base_model(ids) - merged(ids)).abs().max() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("routing", ["random", "first_k"])
def test_the_plan_of_a_moe_step_matches_the_measured_run(routing):
    """benchmarks/moe_plan.py's measurement (fp32; bf16 on the CPU also fills oneDNN's per-shape kernel caches
    with each new row count, see benchmarks/results/moe_plan.md), for the router as trained and for the routing
    the trace assumes: the trace's tensor peak within 3 % of the measured step, the analytic one above it by less
    than 10 % (it places the peak later in the backward, with more gradients, for dense models too), and the whole
    plan (with its process overhead) above the process's measured peak."""
    job = {"config": {**MODEL, "n_layer": 2}, "precision": "32-true", "trainable": "full", "lora_mlp": False,
           "ac": False, "micro_batch": 2, "seq_len": 256, "routing": routing}
    measured = run_worker(job, str(ROOT / "benchmarks" / "moe_plan.py"))
    predicted = predict(job)
    assert predicted["trace"] == pytest.approx(measured["measured"], rel=0.03)
    assert measured["measured"] < predicted["analytic"] < 1.1 * measured["measured"]
    plan = plan_training(Config(**job["config"]), settings_for("32-true", 2, 256, False), device_type="cpu",
                         suggest=False, detect=False)
    assert plan.engine == "trace" and plan.peak_bytes > measured["peak_rss"]


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_the_plan_counts_the_full_cpu_kernel_caches_of_half_precision_experts(precision, monkeypatch):
    from lit_model.kernels import ops

    for variable in ops.ONEDNN_CACHE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    config = Config(name="moe", n_layer=2, n_embd=64, n_head=4, block_size=256, vocab_size=512, **MOE)
    plan = plan_training(config, settings_for(precision, 2, 256, False), device_type="cpu", engine="analytic",
                         suggest=False, detect=False)
    half = precision != "32-true"  # fp32 experts stay on BLAS, which keeps no kernel per shape
    assert any("every new expert row count" in note for note in plan.notes) == half
    assert plan.overhead_terms.get("kernel_cache") == (ops.ONEDNN_CACHE_CAPACITY * ops.ONEDNN_KERNEL_BYTES if half else None)
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1024")  # a user's own capacity: the larger cache keeps its kernels
    assert ops.onednn_kernel_cache_bytes() == 1024 * ops.ONEDNN_KERNEL_BYTES
    dense = Config(name="dense", n_layer=2, n_embd=64, n_head=4, block_size=256, vocab_size=512)
    assert "kernel_cache" not in plan_training(dense, settings_for(precision, 2, 256, False), device_type="cpu",
                                               engine="analytic", suggest=False, detect=False).overhead_terms
