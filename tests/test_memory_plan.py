"""The memory planner (lit_model/memory): exact trace vs analytic model, verdicts, suggestions, units, plots."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import warnings
from typing import Any
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lit_model import Config
from lit_model.core.errors import UsageError
from lit_model.core.units import detect_device_memory, parse_memory
from lit_model.plan.generation import plan_generation
from lit_model.plan.plot import plot_plan
from lit_model.plan.report import Plan
from lit_model.plan.search import max_micro_batch_size
from lit_model.plan.training import plan_training
from lit_model.plan.closed_form import CATEGORIES, param_counts, training_phases
from lit_model.plan.planner import CLOSED_FORM_MARGIN
from lit_model.plan.calibration import OVERHEAD
from lit_model.model.gpt import GPT, default_dtype
from lit_model.kernels.ops import cuda_attention_kernel
from lit_model.run import CPU_HEAP_SHARDED, Run, resolve_run
from lit_model.train.args import TrainArgs
from lit_model.train.optimizers import build_optimizer
from lit_model.plan.trace import optimizer_state_bytes, trace_training
from lit_model.methods.objective import CausalLM, mean_loss

GB = 10**9
ROOT = Path(__file__).resolve().parents[1]


def tiny(**overrides) -> Config:
    fields = dict(name="tiny", block_size=256, vocab_size=1024, n_layer=2, n_embd=128, n_head=4, n_query_groups=2,
                  intermediate_size=344, tie_embeddings=True)
    fields.update(overrides)
    return Config(**fields)


def args(**overrides) -> TrainArgs:
    """Training flags for a small plan (the planner resolves a script's flags as the script does)."""
    fields = dict(precision="bf16-true", micro_batch_size=2, global_batch_size=8, override_max_seq_length=128,
                  activation_checkpointing=False, optimizer="AdamW", loss_chunk_size=1024, devices=1, num_nodes=1)
    fields.update(overrides)
    return TrainArgs(**fields)


def resolved(config: Config, settings: TrainArgs, trainable: str = "full", device_type: str = "cuda",
             quantize=None) -> Run:
    return resolve_run(settings, config, trainable, device_type, present=False, quantize=quantize)


def peak(config: Config, settings, **kwargs) -> int:
    kwargs.setdefault("engine", "analytic")
    kwargs.setdefault("device_type", "cuda")
    return plan_training(config, settings, suggest=False, detect=False, **kwargs).peak_bytes


LLAMA2 = Config.from_name("Llama-2-7b-hf")


# ---- the plan's bookkeeping ------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_categories_add_up_to_the_peak(engine):
    plan = plan_training(tiny(), args(), trainable="lora", device_type="cpu", engine=engine, detect=False)
    assert plan.engine == engine
    assert sum(plan.by_category.values()) == plan.peak_bytes
    assert plan.peak_bytes == max(plan.by_phase.values()) == plan.by_phase[plan.peak_phase]
    assert set(plan.by_phase) == {"train_step", "evaluation", "checkpoint_save", "sample"}  # CPU: the sample at the end
    for phase, categories in plan.phase_categories.items():
        assert set(categories) == set(CATEGORIES)
        assert sum(categories.values()) == plan.by_phase[phase]
    assert plan.by_category["parameters"] > 0 and plan.by_category["overhead"] > 0


def test_cpu_overhead_terms_add_up():
    from lit_model.plan.calibration import MB, MiB, OVERHEAD
    from lit_model.plan.overhead import cpu_overhead_terms

    cats = {"parameters": 10**9, "gradients": 300 * MB, "activations": 200 * MB, "logits_loss": 100 * MB}
    terms = cpu_overhead_terms(cats)
    assert terms == {"runtime": OVERHEAD.cpu_runtime, "data": 48 * MiB, "allocator_retention": int(OVERHEAD.cpu_allocator_retention * 600 * MB)}
    # a second process adds its process group; persistent tensors (parameters) leave no retained heap
    assert cpu_overhead_terms(cats, world_size=2)["runtime"] == OVERHEAD.cpu_runtime + OVERHEAD.cpu_distributed
    assert cpu_overhead_terms({"parameters": 5 * 10**9})["allocator_retention"] == 0
    # DDP's gradients are views into its buckets, allocated once: only the activations and logits churn
    assert cpu_overhead_terms(cats, world_size=2, gradients_persist=True)["allocator_retention"] == int(
        OVERHEAD.cpu_allocator_retention * 300 * MB)
    # a quantized model's dequantized weights are freed each pass: part of them stays on the heap
    with_dequantized = cpu_overhead_terms(cats, dequantized=1000 * MB)["allocator_retention"]
    assert with_dequantized == int(OVERHEAD.cpu_allocator_retention * 600 * MB + OVERHEAD.cpu_allocator_retention_dequantized * 1000 * MB)
    # what FSDP's all-gathers free is transient like the activations; an adapter fine-tune has a term of its own
    assert cpu_overhead_terms(cats, gathered=400 * MB)["allocator_retention"] == int(OVERHEAD.cpu_allocator_retention * 1000 * MB)
    assert cpu_overhead_terms(cats, adapter_step_transient=600 * MB) == {
        **terms, "adapter_fine_tuning": OVERHEAD.cpu_adapter_fine_tuning}
    # ... bounded by what the training step's transient tensors can leave freed
    assert cpu_overhead_terms(cats, adapter_step_transient=10 * MB)["adapter_fine_tuning"] == int(
        OVERHEAD.cpu_adapter_fine_tuning_rate * 10 * MB)
    # the run's heap settings (run.CPU_HEAP) leave their pad at the heap's top: counted whole
    assert cpu_overhead_terms(cats, cpu_heap="lit_model") == {**terms, "heap_top_pad": 16 * MiB}
    # glibc's defaults keep freed blocks; a low mmap threshold of the user's returns them
    assert cpu_overhead_terms(cats, cpu_heap="returns_freed")["allocator_retention"] == int(0.025 * 600 * MB)


@pytest.mark.parametrize("environment, training, generation", [
    ({}, "lit_model", "glibc"),
    ({"MALLOC_MMAP_THRESHOLD_": "65536"}, "returns_freed", "returns_freed"),
    ({"MALLOC_MMAP_THRESHOLD_": str(64 << 20)}, "glibc", "glibc"),  # a high threshold keeps glibc's retention
    ({"MALLOC_ARENA_MAX": "2"}, "glibc", "glibc"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "glibc", "glibc"),
])
def test_the_cpu_heap_regime_is_resolved_once_from_the_environment(monkeypatch, environment, training, generation):
    """A run carries how glibc's heap behaves in its process (Run.cpu_heap, resolved once from the environment); the
    planner reads that field, never the environment. A generation process sets nothing (sets_heap=False)."""
    from lit_model.plan.training import plan_run
    from lit_model.run import resolve_cpu_heap

    for name in [n for n in os.environ if n.startswith("MALLOC_") or n == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        training = "glibc" if training == "lit_model" else training
    run = resolved(tiny(), args(), "full", "cpu")
    assert run.cpu_heap == training and resolve_cpu_heap("cpu", sets_heap=False) == generation
    assert resolved(tiny(), args(), "full", "cuda").cpu_heap == generation
    terms = plan_run(run, engine="analytic", suggest=False, detect=False).overhead_terms
    assert ("heap_top_pad" in terms) == (training == "lit_model")
    for name in environment:
        monkeypatch.delenv(name)
    assert plan_run(run, engine="analytic", suggest=False, detect=False).overhead_terms == terms


def test_cpu_sample_phase_holds_only_the_fp32_copy():
    plan = plan_training(tiny(), args(), device_type="cpu", engine="analytic", suggest=False, detect=False)
    sample = plan.phase_categories["sample"]
    # the scripts drop the trained model and its optimizer before the sample (test_finetune: nothing of them lives on)
    assert sample["optimizer_state"] == sample["gradients"] == 0
    # the fp32 weights (tied: one embedding) and RoPE tables for the 128-token prompt + 100 new tokens
    assert sample["parameters"] == param_counts(tiny()).total * 4 + 2 * 228 * tiny().rope_n_elem * 4
    assert sample["kv_cache"] == 2 * 2 * 2 * 228 * 32 * 4
    assert sum(plan.overhead_terms.values()) == plan.by_category["overhead"]


@pytest.mark.parametrize("layers", [2, 8])
def test_cpu_sample_and_save_of_an_adapter_fine_tune_reuse_the_heap_its_training_kept(layers):
    """The sample gives back the heap glibc kept before it reloads final/ (recipes/common.py sample_text): a LoRA run's
    sample holds what a full fine-tune's does. Its save holds that heap (at most what the training step's transient
    tensors leave) until the merge's reads of the base checkpoint take it: a base of 8 blocks of 1,024 (over 128 MiB
    in bf16) fills it, one of 2 narrow blocks not."""
    config = tiny(n_layer=layers, n_embd=1024, n_head=8, n_query_groups=8, intermediate_size=4096) if layers > 2 else tiny()

    def plan(trainable: str):
        return plan_training(config, args(), trainable=trainable, device_type="cpu", engine="analytic", suggest=False,
                             detect=False).phase_categories

    lora, full = plan("lora"), plan("full")
    assert lora["sample"] == full["sample"]
    base_read = lora["checkpoint_save"]["checkpoint"]
    assert (base_read > OVERHEAD.cpu_adapter_fine_tuning) == (layers > 2)
    step = lora["train_step"]
    kept = min(OVERHEAD.cpu_adapter_fine_tuning, OVERHEAD.cpu_adapter_fine_tuning_rate * (
        step["activations"] + step["logits_loss"] + step["gradients"]))
    assert lora["checkpoint_save"]["overhead"] == full["checkpoint_save"]["overhead"] + int(max(kept - base_read, 0))


def test_json_and_text():
    plan = plan_training(LLAMA2, args(micro_batch_size=4, override_max_seq_length=2048), trainable="lora",
                         device_memory="24GB", engine="analytic")
    data = json.loads(plan.to_json())
    assert data["peak_bytes"] == plan.peak_bytes and data["fits"] is False and data["device_memory"] == 24 * GB
    assert data["suggestions"] and all("flags" in s for s in data["suggestions"])
    text = plan.to_text()
    assert "DOES NOT FIT" in text and "train_step" in text and "activations" in text
    assert plan.suggestions[0].flags[0] in text


def test_fits_and_does_not_fit():
    config, settings = tiny(), args()
    need = peak(config, settings)
    assert plan_training(config, settings, device_memory=need, engine="analytic", suggest=False).fits
    small = plan_training(config, settings, device_memory=need - 1, engine="analytic", suggest=False)
    assert not small.fits and small.headroom_bytes == -1
    unknown = plan_training(config, settings, engine="analytic", detect=False)
    assert unknown.fits and unknown.device_memory is None and any("--device_memory" in n for n in unknown.notes)


def test_every_suggestion_fits_when_applied():
    config = Config.from_name("lit-model-40m")
    settings = args(precision="32-true", micro_batch_size=8, global_batch_size=32, override_max_seq_length=1024)
    need = peak(config, settings)
    plan = plan_training(config, settings, device_memory=int(need * 0.55), engine="analytic")
    assert not plan.fits and len(plan.suggestions) >= 3
    costs = [s.cost for s in plan.suggestions]
    assert costs == sorted(costs)
    for suggestion in plan.suggestions:
        assert 1 <= len(suggestion.changes) <= 4  # up to 3 levers (--devices also sets --strategy)
        assert suggestion.peak_bytes <= plan.device_memory
        new_settings = suggestion.apply(settings)
        assert new_settings is not settings and settings.micro_batch_size == 8  # the original is untouched
        replanned = plan_training(config, new_settings, device_memory=plan.device_memory, engine="analytic")
        assert replanned.fits, (suggestion.flags, replanned.peak_bytes, plan.device_memory)
        assert replanned.peak_bytes == suggestion.peak_bytes
        assert plan.replan(suggestion).fits
    halved = [s for s in plan.suggestions if "micro_batch_size" in s.changes]
    for s in halved:  # the global batch is kept: the micro batch divides the per-rank batch
        assert settings.global_batch_size % s.changes["micro_batch_size"] == 0


def test_suggestions_of_a_traced_plan_show_the_trace_of_the_changed_run():
    """The closed form screens the combinations; each suggestion offered is the changed run's trace, and fits."""
    settings = args(micro_batch_size=1, global_batch_size=8, override_max_seq_length=1024)
    plan = plan_training(LLAMA2, settings, trainable="lora", device_memory="12GB", max_suggestions=3)
    assert plan.engine == "trace" and not plan.fits and plan.suggestions
    for suggestion in plan.suggestions:
        traced = plan.replan(suggestion, engine="trace")
        assert traced.engine == "trace" and traced.fits
        assert suggestion.peak_bytes == traced.peak_bytes and suggestion.by_category == traced.by_category


def test_the_closed_form_only_screens_suggestions_the_trace_decides(monkeypatch):
    """The closed form wrong by up to its tested margin, either way, changes no suggestion offered: it lets through
    what it puts within that margin of the budget, and the trace decides."""
    import lit_model.plan.planner as plan_module
    from lit_model.plan.planner import CLOSED_FORM_MARGIN

    settings = args(micro_batch_size=1, global_batch_size=8, override_max_seq_length=1024)
    expected = plan_training(LLAMA2, settings, trainable="lora", device_memory="12GB", max_suggestions=3).suggestions
    exact = plan_module._analytic_phases
    for factor in (1 + 0.9 * CLOSED_FORM_MARGIN, 1 - 0.9 * CLOSED_FORM_MARGIN):
        def skewed(spec, factor=factor):
            phases, used, host = exact(spec)
            return {p: {c: int(v * factor) for c, v in cats.items()} for p, cats in phases.items()}, used, host
        monkeypatch.setattr(plan_module, "_analytic_phases", skewed)
        suggestions = plan_training(LLAMA2, settings, trainable="lora", device_memory="12GB", max_suggestions=3).suggestions
        assert [s.flags for s in suggestions] == [s.flags for s in expected]
        assert [s.peak_bytes for s in suggestions] == [s.peak_bytes for s in expected]


def test_lora_suggestions_include_quantization_and_offload_on_gpu():
    plan = plan_training(LLAMA2, args(micro_batch_size=1, global_batch_size=1, override_max_seq_length=1024),
                         trainable="lora", device_memory="12GB", engine="analytic")
    flags = [" ".join(s.flags) for s in plan.suggestions]
    assert any("--quantize bnb.nf4" in f for f in flags) and any("--cpu_offload" in f for f in flags)
    for suggestion in plan.suggestions:
        assert plan.replan(suggestion).fits


# ---- exact trace vs analytic model ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "config_kw, settings_kw, plan_kw",
    [
        ({}, dict(precision="32-true"), dict(trainable="full")),
        # 400 tokens: attention in halves on the CPU (lit_model/kernels/ops.py), with the fp32 RMSNorm of ops.py too
        (dict(block_size=512), dict(precision="32-true", override_max_seq_length=400, micro_batch_size=2), dict(trainable="full")),
        ({}, dict(activation_checkpointing=True), dict(trainable="lora")),
        ({}, dict(global_batch_size=8, micro_batch_size=2, loss_chunk_size=64), dict(trainable="full")),
        ({}, dict(precision="bf16-mixed"), dict(trainable="full")),
        ({}, dict(optimizer="AdamW8bit"), dict(trainable="lora", quantize="bnb.nf4")),
        ({}, dict(optimizer="AdamW8bit"), dict(trainable="full")),  # the CPU step's fp32 temporaries, 16-bit weights
        ({}, dict(optimizer="AdamW4bit", precision="32-true"), dict(trainable="full")),
        (dict(n_layer=3), dict(), dict(trainable="adapter")),
        (dict(mlp_class_name="GptNeoxMLP", norm_class_name="LayerNorm", parallel_residual=True, bias=True,
              rotary_percentage=0.25, tie_embeddings=False), dict(precision="32-true"), dict(trainable="full")),
        (dict(sliding_window_size=64, vocab_size=4096), dict(), dict(trainable="lora")),
        # bf16 over 4 x 400 tokens: attention in blocks on the CPU (KernelPolicy.attends_in_blocks), kept and recomputed
        (dict(block_size=512), dict(override_max_seq_length=400, micro_batch_size=4), dict(trainable="full")),
        (dict(block_size=512), dict(override_max_seq_length=400, micro_batch_size=4, activation_checkpointing=True),
         dict(trainable="lora")),
    ],
)
def test_trace_agrees_with_analytic(config_kw, settings_kw, plan_kw):
    spec = resolved(tiny(**config_kw), args(**settings_kw), device_type="cpu", **plan_kw)
    traced = trace_training(spec).phases
    closed = training_phases(spec)
    for phase in ("train_step", "evaluation"):
        t, a = sum(traced[phase].values()), sum(closed[phase].values())
        assert a == pytest.approx(t, rel=CLOSED_FORM_MARGIN), (phase, traced[phase], closed[phase])
        # where the trace cannot plan a run, the closed form rounded up by that margin is not below it
        moving = lambda cats: sum(v for c, v in cats.items() if c != "parameters")  # noqa: E731
        assert moving(closed[phase]) * (1 + CLOSED_FORM_MARGIN) >= moving(traced[phase]), (phase, traced[phase], closed[phase])
    # the resident state is exact
    for category in ("parameters", "optimizer_state"):
        assert closed["train_step"][category] == pytest.approx(traced["train_step"][category], rel=0.01)


@pytest.mark.parametrize(
    "config_kw, settings_kw, trainable",
    [
        (dict(n_layer=8), dict(precision="32-true"), "full"),
        (dict(n_layer=8), dict(activation_checkpointing=True, activation_checkpointing_interval=3), "lora"),
        (dict(n_layer=9, sliding_window_size=64, full_attention_every=3), dict(), "full"),  # Gemma 3's local/global
        (dict(n_layer=8, nope_every=4), dict(precision="bf16-mixed"), "full"),  # SmolLM3's blocks without RoPE
        (dict(n_layer=8), dict(), "adapter"),  # plain blocks, then adapted ones
        (dict(n_layer=8), dict(freeze_layers=3), "full"),
        # a middle block's backward holds the previous block's reduce-scatter buffer: traced from 3 blocks and 4
        (dict(n_layer=8), dict(devices=4, strategy="fsdp", activation_checkpointing=True, global_batch_size=8), "full"),
        # cpu_offload: the gradient shards move to the host block by block (a backward peak, few tokens)
        (dict(n_layer=8, n_embd=256, intermediate_size=1024, n_head=4, n_query_groups=4),
         dict(devices=4, strategy="fsdp", cpu_offload=True, activation_checkpointing=True, global_batch_size=4,
              micro_batch_size=1, override_max_seq_length=16), "full"),
    ],
)
def test_a_deep_model_traced_at_a_few_blocks_extrapolates_exactly(config_kw, settings_kw, trainable):
    from lit_model.plan.trace import trace_by_layers

    run = resolved(tiny(**config_kw), args(**settings_kw), trainable, device_type="cpu")
    whole, extrapolated = trace_training(run), trace_by_layers(run)
    assert extrapolated.phases == whole.phases
    assert "extrapolated to" in extrapolated.notes[-1]


def test_layers_extrapolate_each_stretch_of_the_step_where_the_peak_moves_with_depth():
    """With a large tied vocabulary, 2 blocks peak in backward (the embedding's gradient) and 12 at the end of
    forward (the activations): each stretch's peak is extrapolated, then the largest taken."""
    def run(n_layer: int) -> Run:
        config = tiny(n_layer=n_layer, vocab_size=98304, n_embd=576, n_head=9, n_query_groups=3, intermediate_size=1536)
        settings = args(micro_batch_size=4, global_batch_size=4, override_max_seq_length=128, loss_chunk_size=128)
        return resolved(config, settings, device_type="cpu")

    def peak_stretch(result) -> str:
        stretches = result.regions["train_step"]
        return max(stretches, key=lambda key: sum(stretches[key].values())).split(":")[1]

    from lit_model.plan.trace import trace_by_layers

    shallow, deep = trace_training(run(2)), trace_training(run(12))
    assert (peak_stretch(shallow), peak_stretch(deep)) == ("backward", "forward")
    assert trace_by_layers(run(12)).phases == deep.phases


def test_what_the_plan_does_not_model_it_says():
    plan = plan_training(tiny(), args(compile=True, optimizer="PagedAdamW8bit"), trainable="lora", engine="analytic",
                         detect=False)
    assert any(note.startswith("--compile (each block compiled) is not traced") for note in plan.notes)
    assert any(note.startswith("PagedAdamW8bit's state is counted in GPU memory") for note in plan.notes)


def test_a_70b_model_is_planned_by_the_trace():
    config = Config.from_name("Llama-3.3-70B-Instruct")
    settings = args(micro_batch_size=1, global_batch_size=8, override_max_seq_length=2048)
    traced = plan_training(config, settings, trainable="lora", device_memory="80GB", suggest=False)
    closed = plan_training(config, settings, trainable="lora", device_memory="80GB", suggest=False, engine="analytic")
    assert traced.engine == "trace" and any("extrapolated to 80" in note for note in traced.notes)
    assert traced.tensor_peak_bytes == pytest.approx(closed.tensor_peak_bytes, rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("trainable", ["full", "lora"])
@pytest.mark.parametrize("ac", [False, True])
def test_trace_agrees_with_analytic_lit_model_40m(precision, trainable, ac):
    spec = resolved(Config.from_name("lit-model-40m"), args(precision=precision, micro_batch_size=4, global_batch_size=4,
                                                            override_max_seq_length=256, activation_checkpointing=ac),
                    trainable=trainable, device_type="cpu")
    t = sum(trace_training(spec).phases["train_step"].values())
    a = sum(training_phases(spec)["train_step"].values())
    assert a == pytest.approx(t, rel=0.02)


# ---- the prediction moves the right way ----------------------------------------------------------------
def test_prediction_orders():
    config = Config.from_name("lit-model-40m")
    base = dict(precision="32-true", micro_batch_size=4, global_batch_size=16, override_max_seq_length=512)
    assert peak(config, args(**base, activation_checkpointing=True)) < peak(config, args(**base))
    assert peak(config, args(**{**base, "precision": "bf16-true"})) < peak(config, args(**base))
    assert peak(config, args(**{**base, "micro_batch_size": 8})) > peak(config, args(**base))
    assert peak(config, args(**base), trainable="lora") < peak(config, args(**base))
    assert peak(config, args(**{**base, "override_max_seq_length": 256})) < peak(config, args(**base))
    one = peak(LLAMA2, args(micro_batch_size=1, global_batch_size=16, devices=1, strategy="fsdp"))
    four = peak(LLAMA2, args(micro_batch_size=1, global_batch_size=16, devices=4, strategy="fsdp"))
    assert four < one / 2
    offload = peak(LLAMA2, args(micro_batch_size=1, global_batch_size=16, cpu_offload=True))
    assert offload < four
    ddp = peak(config, args(**base, devices=2, strategy="ddp"))
    assert ddp > peak(config, args(**base))  # NCCL's buffers


@pytest.mark.parametrize("engine", ["analytic", "trace"])
def test_ddp_gradients_are_one_copy_in_its_buckets(engine):
    """DDP runs with gradient_as_bucket_view (train/fabric.py): the buckets, allocated when DDP wraps the model,
    hold the gradients in every phase, and no second copy exists while they are reduced."""
    config = tiny(block_size=512)
    base = dict(precision="32-true", micro_batch_size=4, global_batch_size=16, override_max_seq_length=512)
    plans = [plan_training(config, args(**base, **extra), engine=engine, device_type="cpu", suggest=False, detect=False)
             for extra in ({}, dict(devices=2, strategy="ddp"))]
    single, ddp = (plan.phase_categories for plan in plans)
    trainable = param_counts(config).total * 4
    assert ddp["train_step"]["gradients"] == single["train_step"]["gradients"] == trainable  # accumulating
    assert ddp["evaluation"]["gradients"] == ddp["checkpoint_save"]["gradients"] == trainable
    assert single["evaluation"]["gradients"] == 0


def test_cuda_attention_kernel_is_the_one_pytorch_dispatches_to():
    bf16, fp32 = torch.bfloat16, torch.float32
    assert cuda_attention_kernel(bf16, 64, masked=False, shared_key_heads=True) == "flash"
    assert cuda_attention_kernel(fp32, 64, masked=False, shared_key_heads=False) == "efficient"
    assert cuda_attention_kernel(fp32, 64, masked=False, shared_key_heads=True) == "math"  # SmolLM2 in 32-true
    assert cuda_attention_kernel(bf16, 64, masked=True, shared_key_heads=False) == "efficient"  # a sliding window
    assert cuda_attention_kernel(bf16, 64, masked=True, shared_key_heads=True) == "math"
    assert cuda_attention_kernel(bf16, 512, masked=False, shared_key_heads=True) == "math"  # flash stops at 256


@pytest.mark.parametrize("precision", ["32-true", "bf16-true"])
def test_a_cuda_plan_holds_what_cudas_attention_kernel_keeps(precision):
    """fp32 with grouped queries: no fused CUDA kernel takes the shared heads. Over queries longer than twice the
    head size the model copies k and v to every head for the memory-efficient kernel (KernelPolicy.expands_shared_heads);
    shorter ones take the math kernel, which keeps every head's T x T probabilities (measured on an H200:
    SmolLM2-360M 32-true, 1.9 GB above a fused-kernel trace). bf16 takes flash: the CPU's bytes."""
    B, n_layer, n_head, hs = 2, 2, 4, 32

    def activations(T: int, groups: int, device_type: str = "cuda") -> int:
        settings = args(precision=precision, micro_batch_size=B, override_max_seq_length=T)
        spec = resolved(tiny(n_query_groups=groups), settings, device_type=device_type)
        traced = trace_training(spec).phases["train_step"]
        closed = training_phases(spec)["train_step"]
        assert sum(closed.values()) == pytest.approx(sum(traced.values()), rel=0.05)  # the closed form agrees
        return traced["activations"]

    if precision == "32-true":  # the CPU's fused kernel takes grouped queries; a model without them is the same
        short = 2 * hs
        assert activations(short, 2) - activations(short, 2, "cpu") >= n_layer * B * n_head * short * short * 4
        copies = n_layer * 2 * B * 128 * (n_head - 2) * hs * 4  # k and v: the heads the groups lacked
        assert activations(128, 2) - activations(128, 2, "cpu") == pytest.approx(copies, rel=0.1)
        assert activations(128, 4) == activations(128, 4, "cpu")
    else:
        assert activations(128, 2) == activations(128, 2, "cpu")


def test_sophia_is_traced_with_its_double_backward():
    """Sophia's Hessian steps run backward with create_graph=True on the math attention kernel: the trace runs
    exactly that (benchmarks/results/memory_ladder.md measured 2.7x AdamW's peak on the CPU), without torch's
    create_graph warning in the plan's output."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sophia = plan_training(tiny(), args(optimizer="Sophia"), device_type="cpu", engine="trace", suggest=False,
                               detect=False)
    assert not [w for w in caught if "create_graph" in str(w.message)]
    adamw = plan_training(tiny(), args(), device_type="cpu", engine="trace", suggest=False, detect=False)
    assert sophia.engine == "trace" and sophia.tensor_peak_bytes > 1.5 * adamw.tensor_peak_bytes


def test_fsdp_checkpoint_gathers_on_rank0_host():
    plan = plan_training(LLAMA2, args(micro_batch_size=1, global_batch_size=8, devices=8, strategy="fsdp"),
                         device_memory="80GB", engine="analytic")
    assert plan.world_size == 8
    assert plan.phase_categories["checkpoint_save"]["checkpoint"] > 0  # the largest weight, gathered unsharded
    assert plan.host_bytes["checkpoint_save_rank0"] == pytest.approx(13.5 * GB, rel=0.01)
    assert any("host RAM" in note for note in plan.notes)


def test_llama2_7b_on_24gb():
    settings = args(micro_batch_size=1, global_batch_size=16, override_max_seq_length=1304)
    full = plan_training(LLAMA2, settings, trainable="full", device_memory="24GB", engine="analytic")
    assert not full.fits and full.by_category["optimizer_state"] > 26 * GB
    lora = plan_training(LLAMA2, settings, trainable="lora", device_memory="24GB", engine="analytic")
    assert lora.fits
    # litgpt's resource table: 21.30 GB max_memory_allocated for this run (longest Alpaca sample: 1304 tokens)
    assert lora.tensor_peak_bytes == pytest.approx(21.3 * GB, rel=0.10)


@pytest.mark.slow
def test_llama2_7b_lora_trace():
    settings = args(micro_batch_size=1, global_batch_size=16, override_max_seq_length=1304)
    traced = plan_training(LLAMA2, settings, trainable="lora", device_memory="24GB", engine="trace")
    closed = plan_training(LLAMA2, settings, trainable="lora", device_memory="24GB", engine="analytic")
    assert traced.engine == "trace" and traced.fits
    assert closed.tensor_peak_bytes == pytest.approx(traced.tensor_peak_bytes, rel=0.03)


# ---- micro batch auto ------------------------------------------------------------------------------------
def test_max_micro_batch_size():
    config = Config.from_name("lit-model-40m")
    settings = args(precision="bf16-true", global_batch_size=48, override_max_seq_length=512)
    budget = 2 * GB
    best = max_micro_batch_size(resolved(config, settings), budget, margin=0.1, confirm_with_trace=False)
    assert best >= 1 and 48 % best == 0
    limit = budget * 0.9
    assert peak(config, args(**{**vars(settings), "micro_batch_size": best})) <= limit
    bigger = min(m for m in range(best + 1, 49) if 48 % m == 0)
    assert peak(config, args(**{**vars(settings), "micro_batch_size": bigger})) > limit
    assert max_micro_batch_size(resolved(config, settings), 100 * 10**6, confirm_with_trace=False) == 0
    # "auto" in the settings is resolved by plan_training
    plan = plan_training(config, args(**{**vars(settings), "micro_batch_size": "auto"}), device_memory=budget, engine="analytic")
    assert plan.run["micro_batch_size"] == best


def test_max_micro_batch_size_confirmed_by_trace():
    config = tiny()
    settings = args(global_batch_size=16, override_max_seq_length=256)
    p2, p4 = (plan_training(config, args(**{**vars(settings), "micro_batch_size": m}), device_type="cpu", engine="trace",
                            detect=False).peak_bytes for m in (2, 4))
    budget = int((p2 + p4) / 2 / 0.9)
    assert max_micro_batch_size(resolved(config, settings, device_type="cpu"), budget, confirm_with_trace=True) == 2


def test_the_traced_micro_batch_is_the_largest_whose_trace_fits():
    """Traced at 1 and 2 and extended along the line, then settled by the trace: the same answer as tracing every
    divisor of the per-rank batch."""
    config = tiny()
    settings = args(global_batch_size=16, override_max_seq_length=256, micro_batch_size=1)
    run = resolved(config, settings, device_type="cpu")
    peaks = {m: plan_training(config, args(**{**vars(settings), "micro_batch_size": m}), device_type="cpu",
                              engine="trace", detect=False, suggest=False).peak_bytes for m in (1, 2, 4, 8, 16)}
    for budget in (peaks[1] - 1, peaks[1], peaks[4] + 1, (peaks[8] + peaks[16]) // 2, peaks[16] * 2):
        expected = max((m for m, peak in peaks.items() if peak <= budget * 0.9), default=0)
        assert max_micro_batch_size(run, budget, confirm_with_trace=True) == expected, budget


# ---- generation -----------------------------------------------------------------------------------------
def test_generation_plan_grows_with_new_tokens_not_block_size():
    short = plan_generation(LLAMA2, 512, 128, detect=False)
    long = plan_generation(LLAMA2, 512, 1024, detect=False)
    assert long.peak_bytes > short.peak_bytes
    assert long.run["kv_cache_bytes"] == pytest.approx(short.run["kv_cache_bytes"] * (1536 / 640))
    # KV cache: 2 (k, v) x 32 layers x 640 positions x 4096 channels x 2 bytes
    assert short.run["kv_cache_bytes"] == 2 * 32 * 640 * 4096 * 2
    bigger_context = Config.from_name("Llama-2-7b-hf", block_size=32768)
    assert plan_generation(bigger_context, 512, 128, detect=False).peak_bytes == short.peak_bytes
    assert sum(short.by_category.values()) == short.peak_bytes


def test_quantized_generation_plans_the_load_of_the_last_block():
    """load_weights stages one block in the load dtype and quantizes it before reading the next (an H200 measured
    Llama-2-7B nf4 0.39 GB reserved above its allocated peak, one block's bf16 weights being 0.40 GB)."""
    from lit_model.plan.generation import staged_block_bytes

    plain = plan_generation(LLAMA2, 12, 50, dtype="bf16-true", detect=False)
    nf4 = plan_generation(LLAMA2, 12, 50, dtype="bf16-true", quantize="bnb.nf4", detect=False)
    assert "load" not in plain.phase_categories and nf4.peak_phase == "load"
    load, prefill = nf4.phase_categories["load"], nf4.phase_categories["prefill"]
    assert load["kv_cache"] == 0 and load["parameters"] == prefill["parameters"]
    # the prefill's quantization bytes hold a layer dequantized in flight (one MLP matrix, 90 MB) where the load
    # holds a whole block's weights (405 MB)
    assert load["quantization"] - prefill["quantization"] == staged_block_bytes(LLAMA2, torch.bfloat16) - 4096 * 11008 * 2
    assert staged_block_bytes(LLAMA2, torch.bfloat16) == (4 * 4096 * 4096 + 3 * 4096 * 11008) * 2


def test_plans_trace_with_a_memtracker_that_keeps_no_fake_mode(monkeypatch):
    """torch before 2.12: MemTracker's __enter__ records no fake mode (the planner's tracker compares with it); the
    plans are traced there too (they fell back to the closed form on an H200's torch 2.11, and a generation plan,
    which has none, failed)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    config = tiny()
    spec = resolved(config, args(), device_type="cpu")
    today = (trace_training(spec).phases, plan_generation(config, 20, 10, dtype="32-true", device_type="cpu", detect=False))
    enter = MemTracker.__enter__

    def enter_keeping_no_fake_mode(self):
        result = enter(self)
        self.__dict__.pop("_fake_mode_on_entry", None)
        return result

    monkeypatch.setattr(MemTracker, "__enter__", enter_keeping_no_fake_mode)
    monkeypatch.setattr("lit_model.plan.generation._GENERATION_TRACES", {})
    older = (trace_training(spec).phases, plan_generation(config, 20, 10, dtype="32-true", device_type="cpu", detect=False))
    assert older[0] == today[0]
    assert older[1].phase_categories == today[1].phase_categories and older[1].engine == "trace"


def test_generation_over_several_gpus_plans_the_fullest_of_the_pipeline():
    from lit_model.infer.load import device_map, pipeline_stages

    one = plan_generation(LLAMA2, 512, 128, detect=False)
    two = plan_generation(LLAMA2, 512, 128, detect=False, devices=2)
    # 32 blocks split 16 + 16: each GPU holds half the KV cache and half the blocks, plus the embedding or the head
    assert two.by_category["kv_cache"] * 2 == one.by_category["kv_cache"]
    half_blocks = (one.by_category["parameters"] - (2 * 32000 * 4096 + 4096) * 2) / 2
    assert half_blocks < two.by_category["parameters"] < one.by_category["parameters"] * 0.55
    assert two.peak_bytes < one.peak_bytes and two.run["devices"] == 2 and "GPU" in two.notes[-1]
    # the planned split is the one load_model places
    placed = device_map(LLAMA2, [torch.device("cpu"), torch.device("meta")])
    assert {part: device.type == "meta" for part, device in placed.items()} == {
        part: stage == 1 for part, stage in pipeline_stages(LLAMA2, 2).items()}
    # a 7B model that does not fit one 12 GB GPU in bf16 fits two
    assert not plan_generation(LLAMA2, 512, 128, device_memory="12GB").fits
    assert plan_generation(LLAMA2, 512, 128, device_memory="12GB", devices=2).fits


def test_generation_kv_cache_in_the_compute_dtype():
    kv = {p: plan_generation(LLAMA2, 100, 100, dtype=p, device_memory="80GB").run["kv_cache_bytes"]
          for p in ("32-true", "bf16-mixed", "bf16-true")}
    assert kv["bf16-mixed"] == kv["bf16-true"] == kv["32-true"] // 2


def test_generation_quantized_and_verdict():
    bf16 = plan_generation(LLAMA2, 256, 256, dtype="bf16-true", device_memory="8GB")
    assert not bf16.fits and any(s.changes.get("quantize") == "bnb.nf4" for s in bf16.suggestions)
    nf4 = plan_generation(LLAMA2, 256, 256, dtype="bf16-true", quantize="bnb.nf4", device_memory="8GB")
    assert nf4.fits and nf4.peak_bytes < bf16.peak_bytes / 2
    # litgpt's table: Llama-2-7B inference 13.52 GB bf16, 4.57 GB nf4 (max allocated)
    assert bf16.tensor_peak_bytes == pytest.approx(13.52 * GB, rel=0.08)
    assert nf4.tensor_peak_bytes == pytest.approx(4.57 * GB, rel=0.15)
    with pytest.raises(UsageError):
        plan_generation(LLAMA2, 4000, 200, detect=False)


@pytest.mark.parametrize("config, precision", [
    (tiny(), "32-true"),
    (tiny(tie_embeddings=False, mlp_class_name="GptNeoxMLP", norm_class_name="LayerNorm", parallel_residual=True,
          rotary_percentage=0.25, bias=True), "bf16-true"),
    (tiny(attention_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window_size=16,
          sliding_window_layer_stride=2), "32-true"),
])
def test_generation_trace_is_what_real_tensors_hold(config: Config, precision: str) -> None:
    """The plan's generation trace (fake tensors) against the same code on real tensors under the same tracker
    (PyTorch's MemTracker, which frozen weights need the planner's subclass of): every part's bytes are equal, and
    each phase's peak (the prefill of a 40-token prompt, and the last step of 24 new tokens, which reads the whole
    cache) equal or a few hundred bytes above."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    from lit_model.infer.decode import forward_last
    from lit_model.infer.kv_cache import set_kv_cache
    from lit_model.infer.sampling import sample
    from lit_model.plan.trace_generation import TRACED_TOP_P, trace_generation
    from lit_model.plan.tracker import _Tracker
    from lit_model.core.precision import param_dtype

    dtype, prompt_length, new = param_dtype(precision), 40, 24
    traced = trace_generation(config, prompt_length, new, 2, dtype, dtype, None, "cpu")
    torch.manual_seed(0)
    with default_dtype(dtype):
        model = GPT(config)
        model.max_seq_length = prompt_length + new
    model.eval().requires_grad_(False)
    set_kv_cache(model, 2, prompt_length + new)
    held = sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    resident = sum(sum(part.values()) for part in traced.resident.values())
    assert resident == held
    kv = 2 * config.n_layer * 2 * config.n_query_groups * (prompt_length + new) * config.head_size * dtype.itemsize  # k, v
    assert sum(part["kv_cache"] for part in traced.resident.values()) == kv
    prompt = torch.randint(0, config.padded_vocab_size, (2, prompt_length))
    steps = {"prefill": (prompt, torch.arange(prompt_length), prompt_length),
             "decode": (prompt[:, -1:], torch.tensor([prompt_length + new - 1]), prompt_length + new)}
    for phase, (idx, input_pos, input_pos_maxp1) in steps.items():
        tracker = _Tracker(config.padded_vocab_size)
        tracker.track_external(model, prompt)
        with torch.no_grad(), tracker:
            sample(forward_last(model, idx, input_pos, input_pos_maxp1), temperature=1.0, top_p=TRACED_TOP_P)
        real_peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")][_TOTAL_KEY]
        # equal, but for a few hundred bytes more in the trace where a window's mask meets soft-capping (fake kernels)
        assert 0 <= resident + sum(traced.transient[phase].values()) - real_peak <= 1024, phase
    assert traced.transient["prefill"]["activations"] > traced.transient["decode"]["activations"]


def test_generation_plan_on_the_cpu_is_the_generation_process() -> None:
    """A CPU generation plan counts generate/base.py's runtime and the heap its prefill leaves, not a training
    process's (no training data); the training plan's sample at the end takes the traced tensors alone."""
    from lit_model.plan.calibration import OVERHEAD

    plan = plan_generation(tiny(), 40, 24, dtype="32-true", device_type="cpu", detect=False)
    assert plan.engine == "trace"
    prefill = plan.phase_categories["prefill"]
    transient = prefill["activations"] + prefill["logits_loss"]
    assert plan.overhead_terms == {"runtime": OVERHEAD.cpu_generation_runtime,
                                   "allocator_retention": int(OVERHEAD.cpu_generation_retention * transient)}
    # the run's sample: at most 100 new tokens after the training sequence length (128), in fp32, in this process
    training = plan_training(tiny(), args(precision="32-true"), device_type="cpu", suggest=False, detect=False)
    sample = plan_generation(tiny(), 128, 100, dtype=torch.float32, device_type="cpu", detect=False)
    tensors = {c: size for c, size in sample.phase_categories["prefill"].items() if c != "overhead"}
    assert {c: size for c, size in training.phase_categories["sample"].items() if c != "overhead"} == tensors


CPU_STEP_PEAK = """
import sys, torch
from lit_model.train.optimizers import build_optimizer
dtype = getattr(torch, sys.argv[2])
param = torch.nn.Parameter(torch.randn(2048, 4096, dtype=dtype))
optimizer = build_optimizer(torch.nn.ParameterList([param]), sys.argv[1], learning_rate=1e-3, device_type="cpu",
                            param_dtype=dtype)
param.grad = torch.randn_like(param)
optimizer.step()  # the state, and torchao's compiled step
resident = int(open("/proc/self/statm").read().split()[1]) * 4096
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
optimizer.step()
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(peak - resident)
"""


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc to reset the peak")
@pytest.mark.parametrize("name, dtype", [("AdamW8bit", "float32"), ("AdamW8bit", "bfloat16"), ("AdamW4bit", "float32"),
                                         ("AdamWFp8", "float32")])
def test_cpu_quantized_optimizer_step_temporaries_are_measured(name: str, dtype: str) -> None:
    """What the trace's stand-in step allocates on the CPU (calibration.quantized_step_bytes) against the real
    step of the library, in a fresh process: its resident peak above the memory before the step."""
    import subprocess

    from lit_model.plan.calibration import quantized_step_bytes

    pytest.importorskip("torchao" if name != "AdamW8bit" else "bitsandbytes")
    done = subprocess.run([sys.executable, "-c", CPU_STEP_PEAK, name, dtype], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = int(done.stdout.split()[-1])
    planned = quantized_step_bytes(name, 2048 * 4096, getattr(torch, dtype).itemsize, "cpu")
    assert planned == pytest.approx(measured, abs=0.05 * 2048 * 4096 * 4), (measured, planned)


def test_cpu_plan_counts_the_quantized_optimizers_library() -> None:
    from lit_model.plan.calibration import CPU_OPTIMIZER_LIBRARY
    from lit_model.plan.overhead import bitsandbytes_import_bytes

    plans = {name: plan_training(tiny(), args(optimizer=name), device_type="cpu", suggest=False, detect=False)
             for name in ("AdamW", "AdamW8bit", "AdamWFp8")}
    assert "optimizer_library" not in plans["AdamW"].overhead_terms
    # bitsandbytes' term is what importing it adds to a training process, measured (a constant had outgrown it)
    assert plans["AdamW8bit"].overhead_terms["optimizer_library"] == bitsandbytes_import_bytes() < 128 * 2**20
    assert plans["AdamWFp8"].overhead_terms["optimizer_library"] == CPU_OPTIMIZER_LIBRARY["adamwfp8"]
    gpu = plan_training(tiny(), args(optimizer="AdamW8bit"), device_type="cuda", suggest=False, detect=False)
    assert gpu.overhead_terms == {}


def test_cuda_reserve_counts_the_loss_logits_and_a_compiled_steps_temporaries_whole() -> None:
    """On a GPU the allocator maps anew what does not fit the gaps freed activations leave: the loss's
    vocabulary-wide blocks (torchtune's 7B LoRA run on an H200 reserved 0.61 GB where 12 % of its moving tensors
    gave 0.31) and torchao's compiled AdamW4bit step on the largest parameter (pythia-160m: 1.27 GB against 0.47)."""
    from lit_model.plan.calibration import MB, OVERHEAD
    from lit_model.plan.overhead import cuda_overhead_bytes, cuda_step_fresh_bytes

    fixed = OVERHEAD.cuda_context + OVERHEAD.cuda_workspaces
    cats = {"parameters": 10**9, "activations": 200 * MB, "logits_loss": 100 * MB}
    assert cuda_overhead_bytes(cats) == int(fixed + OVERHEAD.cuda_fragmentation * 200 * MB + 100 * MB)
    assert cuda_overhead_bytes(cats, step_fresh=7 * MB) == cuda_overhead_bytes(cats) + 7 * MB

    config = tiny(n_layer=2, vocab_size=32000, n_embd=256, tie_embeddings=False)  # largest: 32,000 x 256
    plans = {name: plan_training(config, args(optimizer=name, precision="bf16-true"), device_type="cuda", suggest=False,
                                 detect=False) for name in ("AdamW8bit", "AdamW4bit")}
    fresh = cuda_step_fresh_bytes(plans["AdamW4bit"].planned)
    assert fresh == int(6.75 * 4 * 32000 * 256)  # the CPU's measured copies, in fp32
    assert cuda_step_fresh_bytes(plans["AdamW8bit"].planned) == 0  # bitsandbytes' kernels update in place
    step = {name: plan.phase_categories["train_step"] for name, plan in plans.items()}
    fragmentation = OVERHEAD.cuda_fragmentation_expandable  # the training scripts' allocator setting
    moving = {name: sum(v for c, v in cats.items() if c not in ("overhead", "parameters", "logits_loss"))
              for name, cats in step.items()}
    for name, cats in step.items():
        expected = fixed + fragmentation * moving[name] + cats["logits_loss"] + (fresh if name == "AdamW4bit" else 0)
        assert cats["overhead"] == pytest.approx(expected, abs=2)
    assert any(note.startswith("AdamW4bit's compiled step makes") for note in plans["AdamW4bit"].notes)
    assert cuda_step_fresh_bytes(plan_training(config, args(optimizer="AdamW4bit"), device_type="cpu", suggest=False,
                                               detect=False).planned) == 0  # the CPU trace holds them as tensors


def test_cpu_retention_counts_what_the_step_freed_before_an_optimizer_peak() -> None:
    """An 8-bit optimizer's CPU step peaks after the activations are freed; glibc still holds heap from them
    (pythia-70m bf16 8 x 256 with AdamW8bit peaked 1,739 MiB, planned 1,598 by the activations at the step alone):
    the retention follows the most transient bytes of any stretch of the step, at the rate measured for heap kept
    from an earlier stretch (calibration: cpu_allocator_retention_after_backward)."""
    from lit_model.plan.calibration import OVERHEAD

    config = tiny(n_layer=4, vocab_size=32000, n_embd=256, tie_embeddings=False)  # the embedding's step is the peak
    settings = dict(precision="bf16-true", micro_batch_size=2, override_max_seq_length=64)
    plans = {name: plan_training(config, args(optimizer=name, **settings), device_type="cpu", suggest=False,
                                 detect=False) for name in ("AdamW", "AdamW8bit")}
    assert plans["AdamW8bit"].by_category["activations"] < 2**16  # freed before the step
    at_step = plans["AdamW8bit"].by_category
    transient_at_step = at_step["activations"] + at_step["logits_loss"] + at_step["gradients"]
    retained = plans["AdamW8bit"].overhead_terms["allocator_retention"]
    assert retained > OVERHEAD.cpu_allocator_retention * transient_at_step * 1.5
    # the same activations freed before the step as AdamW's run holds at its backward peak, at the higher rate
    rate = OVERHEAD.cpu_allocator_retention_after_backward / OVERHEAD.cpu_allocator_retention
    assert rate > 1
    assert retained == pytest.approx(rate * plans["AdamW"].overhead_terms["allocator_retention"], rel=0.05)
    # AdamW's own peak is in backward: the usual rate
    adamw = plans["AdamW"].by_category
    assert plans["AdamW"].overhead_terms["allocator_retention"] == pytest.approx(
        OVERHEAD.cpu_allocator_retention * (adamw["activations"] + adamw["logits_loss"] + adamw["gradients"]), abs=1)


# ---- units, device, plot -----------------------------------------------------------------------------------
def test_parse_memory():
    assert parse_memory("24GB") == 24 * 10**9
    assert parse_memory("24GiB") == 24 * 2**30
    assert parse_memory("512MB") == 512 * 10**6
    assert parse_memory("512 MiB") == 512 * 2**20
    assert parse_memory("1.5gb") == 1_500_000_000
    assert parse_memory("80G") == 80 * 10**9
    assert parse_memory("1TB") == 10**12
    assert parse_memory(123456) == 123456
    assert parse_memory("8e9") == 8 * 10**9
    for bad in ("", "GB", "24 parsecs", "-1GB", "0", "24GBs"):
        with pytest.raises(UsageError):
            parse_memory(bad)


def test_detect_device_memory_cpu():
    available = detect_device_memory("cpu")
    assert 10**8 < available < 10**14


def test_plot_plan(tmp_path):
    plan = plan_training(LLAMA2, args(micro_batch_size=4, override_max_seq_length=2048), trainable="lora",
                         device_memory="24GB", engine="analytic")
    path = plot_plan(plan, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_bad_inputs():
    with pytest.raises(UsageError):
        plan_training(LLAMA2, args(), trainable="full", quantize="bnb.nf4", engine="analytic")
    with pytest.raises(UsageError):
        plan_training(LLAMA2, args(), trainable="prefix", engine="analytic")
    with pytest.raises(UsageError):
        plan_training(LLAMA2, args(precision="fp8"), engine="analytic")


@pytest.mark.parametrize("micro, global_batch, devices, needle", [
    (3, 16, 1, "use a micro_batch_size among [1, 2, 4, 8, 16]"),
    (64, 16, 1, "use a micro_batch_size among [1, 2, 4, 8, 16]"),
    (4, 12, 8, "use a global_batch_size that is a multiple of 32"),
])
def test_plan_refuses_the_batches_training_refuses(micro, global_batch, devices, needle):
    """One rule (lit_model.data.text.check_batch_sizes) for the plan and the samplers: the same message."""
    from lit_model.data.text import GlobalBatchSampler

    settings = args(micro_batch_size=micro, global_batch_size=global_batch, devices=devices)
    with pytest.raises(UsageError) as planned:
        plan_training(tiny(), settings, engine="analytic", detect=False)
    with pytest.raises(UsageError) as trained:
        GlobalBatchSampler(100, global_batch, micro, 0, devices)
    assert str(planned.value) == str(trained.value) and needle in str(planned.value)


def test_check_plan_fits_fails_only_when_nothing_fits():
    from lit_model.core.errors import UserError
    from lit_model.plan.report import check_plan_fits

    hopeless = plan_training(LLAMA2, args(), device_memory="1MB", engine="analytic")
    assert not hopeless.fits and not hopeless.suggestions
    with pytest.raises(UserError, match="does not fit in 1.00 MB per device, and no combination"):
        check_plan_fits(hopeless)
    rescued = plan_training(LLAMA2, args(), device_memory="24GB", engine="analytic")
    assert not rescued.fits and rescued.suggestions
    check_plan_fits(rescued)
    check_plan_fits(plan_training(tiny(), args(), device_memory="80GB", engine="analytic"))


def test_plan_is_a_dataclass_with_the_documented_fields():
    plan = plan_training(tiny(), args(), engine="analytic", detect=False)
    assert isinstance(plan, Plan)
    for name in ("peak_bytes", "by_category", "by_phase", "fits", "device_memory", "suggestions"):
        assert hasattr(plan, name)


def test_with_the_scripts_args_dataclasses():
    """The scripts' own argument dataclasses work as settings; suggestions apply to them."""
    import importlib.util

    from lit_model.train.args import TrainArgs

    pretrain = TrainArgs(micro_batch_size=8, global_batch_size=32, precision="32-true", override_max_seq_length=512)
    plan = plan_training(Config.from_name("lit-model-40m"), pretrain, device_memory="2GB", engine="analytic")
    assert not plan.fits and plan.suggestions
    applied = plan.suggestions[0].apply(pretrain)
    assert isinstance(applied, TrainArgs) and plan.replan(plan.suggestions[0]).fits

    spec = importlib.util.spec_from_file_location("finetune_lora", ROOT / "finetune" / "lora.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["finetune_lora"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop("finetune_lora", None)
    lora_args = module.LoRAArgs(micro_batch_size=1, global_batch_size=16, precision="bf16-true",
                                override_max_seq_length=1304, lora_key=True)
    plan = plan_training(LLAMA2, lora_args, trainable="lora", device_memory="24GB", engine="analytic")
    assert plan.fits and plan.run["lora_targets"] == ["query", "key", "value"]
    qlora = plan_training(LLAMA2, module.LoRAArgs(quantize="bnb.nf4", micro_batch_size=1, override_max_seq_length=1304),
                          trainable="lora", device_memory="24GB", engine="analytic")
    assert qlora.run["quantize"] == "bnb.nf4" and qlora.peak_bytes < plan.peak_bytes


# ---- the bitsandbytes stand-in against the real layer ----------------------------------------------------
@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_quantized_stand_in_holds_and_saves_what_bitsandbytes_does(mode, dtype):
    """The trace cannot run bitsandbytes (no fake-tensor kernels), so it builds QuantLinearSim: checked here against
    the real layer on the CPU. Held: the packed weight and the quantization state tensors (bitsandbytes' serialised
    metadata entry is not held in training). Saved for backward: nothing but the resident packed weight."""
    from lit_model.plan.modules import QuantLinearSim
    from lit_model.methods.quantize import quantize_linear

    torch.manual_seed(0)
    linear = nn.Linear(256, 1000, bias=False).to(dtype)
    real, sim = quantize_linear(linear, mode).train(), QuantLinearSim(linear, mode)
    real_state = 0
    if mode == "bnb.int8":
        real_state = real.weight.SCB.numel() * real.weight.SCB.element_size()
    else:
        for name, tensor in real.weight.quant_state.as_dict(packed=True).items():
            real_state += 0 if name.startswith("quant_state.") else tensor.numel() * tensor.element_size()
        real_state += 4 if mode == "bnb.nf4-dq" else 0  # the nested offset, a float32 scalar outside as_dict
    assert sim.weight.numel() * sim.weight.element_size() == real.weight.numel() * real.weight.element_size()
    assert sim.quant_statistics.numel() == real_state

    def saved_extra(layer: nn.Module) -> int:
        """Bytes saved for backward that are not the input or a parameter (memory the layer adds per step)."""
        x = torch.randn(2, 8, 256, dtype=dtype, requires_grad=True)
        resident = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {x.untyped_storage().data_ptr()}
        extra = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: extra.append(t) or t, lambda t: t):
            y = layer(x)
        y.float().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape and y.shape == (2, 8, 1000)
        return sum(t.untyped_storage().nbytes() for t in extra if t.untyped_storage().data_ptr() not in resident)

    assert saved_extra(real) == saved_extra(sim) == 0


# ---- FSDP: one rank of the sharded model, traced over a fake process group ----------------------------------
@pytest.mark.parametrize("trainable, precision, steps", [
    ("full", "32-true", 1),
    ("full", "bf16-true", 2),  # two micro batches a step: each reduce-scatters its gradients into the shards
    ("lora", "bf16-true", 1),
])
def test_fsdp_is_traced_per_rank(trainable, precision, steps):
    """The trace shards the model with the scripts' shard_model over PyTorch's fake process group: a rank holds
    its share of the parameters, gradients and optimizer state, and the gathered blocks in flight. The closed form
    (closed_form.py) is the cross-check: the resident state agrees exactly, the whole step within 15 %."""
    def run(devices: int) -> Run:
        settings = args(devices=devices, strategy="fsdp", precision=precision, global_batch_size=2 * devices * steps)
        return resolved(tiny(n_layer=4), settings, trainable)

    traces = {devices: trace_training(run(devices)) for devices in (1, 2, 4)}
    plans = {devices: trace.phases["train_step"] for devices, trace in traces.items()}
    closed = training_phases(run(2))["train_step"]
    assert plans[2]["optimizer_state"] == pytest.approx(plans[1]["optimizer_state"] / 2, rel=0.01)
    assert plans[4]["optimizer_state"] == pytest.approx(plans[1]["optimizer_state"] / 4, rel=0.02)
    assert closed["optimizer_state"] == pytest.approx(plans[2]["optimizer_state"], rel=0.01)
    totals = {devices: sum(phase.values()) for devices, phase in plans.items()}
    assert totals[4] < totals[2] < totals[1]
    if steps == 2:  # the second micro batch's forward: the first one's gradients, already reduce-scattered
        held = {devices: trace.regions["train_step"]["3:forward"]["gradients"] for devices, trace in traces.items()}
        assert held[1] > 0 and held[4] == pytest.approx(held[1] / 4, rel=0.02)
    assert sum(closed.values()) == pytest.approx(totals[2], rel=0.15)


def test_fsdp_shards_torchao_optimizer_state():
    """torchao's AdamW4bit keeps state of each rank's shard (its _new_buffer quantizes the DTensor's local tensor)."""
    def state(devices: int) -> int:
        settings = args(devices=devices, strategy="fsdp", optimizer="AdamW4bit", global_batch_size=2 * devices)
        return trace_training(resolved(tiny(n_layer=2, n_embd=256, intermediate_size=512), settings, "full")).phases[
            "checkpoint_save"]["optimizer_state"]

    assert state(4) == pytest.approx(state(1) / 4, rel=0.05)


@pytest.mark.parametrize("optimizer, moments", [("Lion", 1), ("torch.optim.Adam", 2)])
def test_lion_and_optimizer_classes_are_traced(optimizer, moments):
    """The trace runs any optimizer whose step runs on fake tensors: a class path too (its own state, not a guess)."""
    config = tiny()
    plan = plan_training(config, args(optimizer=optimizer), device_type="cpu", detect=False, suggest=False)
    assert plan.engine == "trace"
    weights = param_counts(config).total * 2  # bf16
    assert plan.phase_categories["checkpoint_save"]["optimizer_state"] == pytest.approx(moments * weights, abs=512)


def _real_optimizer_state_bytes(config: Config, optimizer: str) -> int:
    """The optimizer state after two real steps of the bf16 model (each storage once)."""
    torch.manual_seed(0)
    with default_dtype(torch.bfloat16):
        model = GPT(config)
    model.max_seq_length = 128
    optim = build_optimizer(model, optimizer, learning_rate=1e-4, device_type="cpu", param_dtype=torch.bfloat16)
    for _ in range(2):
        idx = torch.randint(0, config.vocab_size, (2, 128))
        mean_loss(CausalLM(), model, (idx, idx)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
    return optimizer_state_bytes(optim)


@pytest.mark.parametrize("optimizer", ["Adafactor", "pytorch_optimizer.Prodigy"])
def test_optimizers_that_read_tensor_values_are_traced_with_stand_ins(optimizer):
    """Adafactor reads its step count and Prodigy its step-size estimates (.item()), which fake tensors cannot
    answer: the trace answers with stand-ins and its state equals a real step's (Prodigy: four moments; the closed
    form had Adafactor's at 11,252 bytes where the real optimizer keeps 12,912). For a class path the plan cannot
    know whether a branch depends on those values: it says so and rounds the optimizer's memory up by the trainable
    parameters' size; lit-model's own optimizers get no margin."""
    config = tiny()
    plan = plan_training(config, args(optimizer=optimizer), device_type="cpu", engine="trace", detect=False,
                         suggest=False)
    assert plan.engine == "trace"
    state = plan.phase_categories["checkpoint_save"]["optimizer_state"]
    assert state == pytest.approx(_real_optimizer_state_bytes(config, optimizer), abs=16)
    margin = plan.phase_categories["train_step"]["optimizer_state"] - state
    stand_in_notes = [n for n in plan.notes if "stand-ins" in n]
    if optimizer == "Adafactor":
        assert margin == 0 and not stand_in_notes
    else:
        assert margin == param_counts(config).total * 2 and len(stand_in_notes) == 1
        assert stand_in_notes[0].startswith("pytorch_optimizer.Prodigy read 4 tensor value(s)")


class HostStepOptimizer(torch.optim.Optimizer):
    """Three moments per parameter, the update taken through numpy: a step fake tensors cannot run."""

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                state = self.state[param]
                if not state:
                    state.update(first=torch.zeros_like(param), second=torch.zeros_like(param), third=torch.zeros_like(param))
                state["first"].add_(param.grad)
                state["second"].addcmul_(param.grad, param.grad)
                state["third"].copy_(param)
                param.sub_(torch.from_numpy(state["first"].float().numpy()).to(param.dtype), alpha=group["lr"])


def test_an_optimizer_step_the_trace_cannot_run_is_bounded_by_a_real_one():
    """Where the trace fails, the plan says in which part of the step, and a class path's state is measured on a small
    real model (here three moments: the closed form alone would plan AdamW's two), plus its temporaries bounded by
    the trainable parameters' size."""
    config = tiny()
    plan = plan_training(config, args(optimizer=f"{__name__}.HostStepOptimizer"), device_type="cpu", engine="trace",
                         detect=False, suggest=False)
    weights = param_counts(config).total * 2  # bf16
    assert plan.engine == "analytic"
    assert any(n.startswith("Planned by the closed form, because the exact trace failed in the optimizer step (") for n in plan.notes)
    assert plan.phase_categories["checkpoint_save"]["optimizer_state"] == 3 * weights
    assert plan.phase_categories["train_step"]["optimizer_state"] == 4 * weights
    assert any("HostStepOptimizer's state measured on a small real model" in n for n in plan.notes)


def test_an_evaluation_the_trace_cannot_run_is_named_in_the_plan(monkeypatch):
    from lit_model.plan import trace

    def unsupported(*args, **kwargs):
        raise NotImplementedError("no fake-tensor kernel for this op")

    monkeypatch.setattr(trace, "evaluation_sums", unsupported)
    plan = plan_training(tiny(), args(), device_type="cpu", engine="trace", detect=False, suggest=False)
    assert plan.engine == "analytic"
    assert any(n.startswith("Planned by the closed form, because the exact trace failed in the evaluation pass "
                            "(NotImplementedError: no fake-tensor")
               for n in plan.notes), plan.notes


def test_fsdp_cpu_offload_is_traced_with_shards_gradients_and_optimizer_state_in_host_memory():
    """The trace runs the offloading FSDP step; what lives in host memory (the rank's shards and the optimizer
    state throughout, each gradient shard from the moment it is reduce-scattered) is taken off the device's bytes
    at every moment and reported as host memory. A wide model at few tokens with checkpointing, so that the step
    peaks in backward, with gradient shards already made."""
    config = tiny(n_layer=4, n_embd=256, intermediate_size=1024, n_head=4, n_query_groups=4)
    flags = dict(devices=4, strategy="fsdp", global_batch_size=4, micro_batch_size=1, override_max_seq_length=16,
                 activation_checkpointing=True)
    base = resolved(config, args(**flags), "full")
    plain, offload = trace_training(base), trace_training(base.replace(parallel=dataclasses.replace(base.parallel, cpu_offload=True)))
    shards = plain.phases["checkpoint_save"]["parameters"] - offload.phases["checkpoint_save"]["parameters"]
    assert shards == pytest.approx(param_counts(config).total * 2 / 4, rel=0.01)  # bf16, a quarter each
    state = plain.phases["checkpoint_save"]["optimizer_state"]
    assert state > 0 and offload.host_bytes["cpu_offload"] == 2 * shards + state  # full training: a gradient each
    for phase, categories in offload.phases.items():
        assert categories["parameters"] == plain.phases[phase]["parameters"] - shards
        assert categories["optimizer_state"] == 0
    step, offloaded = plain.regions["train_step"], offload.regions["train_step"]
    assert list(step) == list(offloaded)
    after_backward = list(step)[list(step).index("2:backward") + 1:]
    for key in after_backward:  # every gradient is a reduce-scattered shard: on the device without offloading only
        assert step[key]["gradients"] == shards and offloaded[key]["gradients"] == 0
    # the backward peak holds some shards already: the offloading step's peak is lower by more than shards + state
    assert plain.phases["train_step"]["gradients"] > offload.phases["train_step"]["gradients"] > 0
    assert sum(offload.phases["train_step"].values()) < sum(plain.phases["train_step"].values()) - shards - state
    plan = plan_training(config, args(**flags, cpu_offload=True), device_type="cuda", engine="auto", detect=False,
                         suggest=False)
    assert plan.engine == "trace" and plan.host_bytes["cpu_offload"] == offload.host_bytes["cpu_offload"]


def test_fsdp_hybrid_shard_is_traced_over_its_two_dimensional_mesh():
    """HYBRID_SHARD shards within a node and replicates across nodes: per rank, FSDP over one node's devices."""
    config = tiny(n_layer=4)
    hybrid = resolved(config, args(devices=2, num_nodes=2, strategy="fsdp", sharding_strategy="HYBRID_SHARD",
                                   global_batch_size=8), "full")
    one_node = resolved(config, args(devices=2, strategy="fsdp", global_batch_size=4), "full")
    assert hybrid.world_size == 4 and hybrid.micro_batch_size == one_node.micro_batch_size
    assert trace_training(hybrid).phases == trace_training(one_node).phases


@pytest.mark.slow
def test_fsdp_planned_inside_a_process_group_is_traced_in_a_fresh_process(tmp_path):
    """The ranks of a run plan --micro_batch_size auto inside their process group, where the trace cannot make its
    fake one: the trace runs in a newly started process and gives the same plan as outside a process group."""
    import torch.distributed as dist

    config, flags = tiny(), args(devices=2, strategy="fsdp")
    outside = plan_training(config, flags, device_type="cuda", engine="trace", detect=False, suggest=False)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        inside = plan_training(config, flags, device_type="cuda", engine="trace", detect=False, suggest=False)
    finally:
        dist.destroy_process_group()
    assert inside.engine == outside.engine == "trace"
    assert inside.by_phase == outside.by_phase and inside.notes == outside.notes


def test_a_cpu_qlora_plan_counts_the_heap_its_dequantized_weights_leave():
    from lit_model.plan.calibration import OVERHEAD
    from lit_model.plan.overhead import dequantized_bytes

    config = tiny()
    run = resolved(config, args(precision="bf16-true"), "lora", "cpu", quantize="bnb.nf4")
    linear = sum(i * o for i, o, _ in param_counts(config).block_linear.values())
    assert dequantized_bytes(run) == config.n_layer * linear * 2 and dequantized_bytes(resolved(config, args(), "lora", "cpu")) == 0
    plans = {q: plan_training(config, args(precision="bf16-true"), trainable="lora", quantize=q, device_type="cpu",
                              engine="trace", suggest=False, detect=False) for q in (None, "bnb.nf4")}
    for phase in ("train_step", "evaluation"):  # the phases that run the model; the save and the sample do not
        extra = plans["bnb.nf4"].phase_categories[phase]["overhead"] - plans[None].phase_categories[phase]["overhead"]
        assert extra == pytest.approx(OVERHEAD.cpu_allocator_retention_dequantized * dequantized_bytes(run), abs=2)
    assert plans["bnb.nf4"].phase_categories["sample"]["overhead"] == plans[None].phase_categories["sample"]["overhead"]



@pytest.mark.slow
def test_a_cpu_plan_measures_the_runtime_of_the_training_scripts():
    # the runtime term is measured in a fresh interpreter (overhead.cpu_runtime_bytes), not assumed: it covers at least
    # what importing the scripts' modules alone makes resident (a constant of an earlier import set was 60 MiB short)
    import subprocess

    imports = subprocess.run([sys.executable, "-c", "import lit_model.recipes.pretrain, lit_model.recipes.finetune; "
                              "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') "
                              "if l.startswith('VmRSS')))"], capture_output=True, text=True, check=True)
    plan = plan_training(tiny(), args(), device_type="cpu", engine="analytic", suggest=False, detect=False)
    assert plan.overhead_terms["runtime"] >= int(imports.stdout.split()[-1])


def test_a_cpu_plan_of_a_checkpointed_step_keeps_the_heap_its_recompute_passes_through():
    # on the CPU the recompute allocates each block's activations again between the gradients backward keeps, so the
    # heap reaches the un-checkpointed step's height (overhead.recomputed_transient_bytes); a LoRA backward keeps no
    # gradients of the blocks' weights, and its plan keeps no such heap
    from lit_model.plan.calibration import OVERHEAD
    from lit_model.plan.overhead import recomputed_transient_bytes

    checkpointed = args(activation_checkpointing=True, micro_batch_size=8, override_max_seq_length=256)
    plans = {trainable: plan_training(tiny(), checkpointed, trainable=trainable, device_type="cpu", engine="analytic",
                                      suggest=False, detect=False) for trainable in ("full", "lora")}
    heap = int(OVERHEAD.cpu_allocator_retention_after_backward
               * recomputed_transient_bytes(resolved(tiny(), checkpointed, "full", "cpu")))
    assert plans["full"].peak_phase == "train_step" and plans["full"].overhead_terms["allocator_retention"] >= heap
    lora_step = plans["lora"].phase_categories["train_step"]["overhead"] - OVERHEAD.cpu_adapter_fine_tuning
    assert lora_step < plans["full"].phase_categories["train_step"]["overhead"]


def test_a_cpu_fsdp_plan_counts_the_heap_its_all_gathers_leave_and_an_adapter_run_its_own_term():
    from lit_model.plan.calibration import OVERHEAD
    from lit_model.plan.overhead import cpu_overhead_terms, gathered_bytes

    config = tiny()
    fsdp = args(devices=2, strategy="fsdp")
    run = resolved(config, fsdp, "full", "cpu")
    assert gathered_bytes(run) == int(OVERHEAD.cpu_fsdp_gather_copies * param_counts(config).total * 2)
    assert gathered_bytes(resolved(config, args(devices=2, strategy="ddp"), "full", "cpu")) == 0
    plan = plan_training(config, fsdp, device_type="cpu", engine="analytic", suggest=False, detect=False)
    # the heap settings an FSDP process gets (run.CPU_HEAP_SHARDED) map the gathered blocks apart and return them
    sharded = run.cpu_heap == "lit_model"
    assert run.heap_mode == ("lit_model_sharded" if sharded else run.cpu_heap)
    assert run.heap_settings == (CPU_HEAP_SHARDED if sharded else ())
    rate = OVERHEAD.cpu_allocator_retention_mmap if sharded else OVERHEAD.cpu_allocator_retention
    for phase, cats in plan.phase_categories.items():  # the step and the evaluation gather; the save and sample do not
        runtime = plan.overhead_terms["runtime"] - OVERHEAD.cpu_distributed
        extra = cats["overhead"] - sum(cpu_overhead_terms(cats, 2, cpu_heap=run.heap_mode, runtime=runtime).values())
        runs_model = phase in ("train_step", "evaluation")
        assert extra == pytest.approx(rate * gathered_bytes(run) if runs_model else 0, abs=2)
    for trainable in ("lora", "adapter"):
        adapted = plan_training(config, args(), trainable=trainable, device_type="cpu", engine="analytic", suggest=False,
                                detect=False)
        # the tiny model's step leaves less freed heap than the term's measured ceiling: its transient bytes bound it
        step = adapted.phase_categories["train_step"]
        transient = step["activations"] + step["logits_loss"] + step["gradients"]
        assert OVERHEAD.cpu_adapter_fine_tuning_rate * transient < OVERHEAD.cpu_adapter_fine_tuning
        assert adapted.overhead_terms["adapter_fine_tuning"] == int(OVERHEAD.cpu_adapter_fine_tuning_rate * transient)
        assert sum(adapted.overhead_terms.values()) == adapted.by_category["overhead"]
    assert "adapter_fine_tuning" not in plan.overhead_terms

# ---- a tied embedding's two gradients ---------------------------------------------------------------------------
class _Recorded(torch.autograd.Function):
    """Identity whose backward returns a new gradient tensor and records where it lives."""

    pointers: list[int] = []

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        out = grad.clone()
        _Recorded.pointers.append(out.data_ptr())
        return out


def _tied_weights_gradient_reuses_a_contribution() -> bool:
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(512, 32))
    tokens = torch.randint(0, 512, (16,))
    _Recorded.pointers = []
    (nn.functional.embedding(tokens, weight) @ _Recorded.apply(weight).t()).sum().backward()
    return weight.grad.data_ptr() in _Recorded.pointers


def test_a_real_run_sums_a_tied_weights_two_gradients_in_place_but_not_under_a_dispatch_mode():
    """What the trace's tied-gradient rule stands on: without a dispatch mode autograd adds the embedding's gradient
    into the head's (the sum lives where a contribution lived); under one (the tracker) it adds out of place."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    assert _tied_weights_gradient_reuses_a_contribution()
    with Passthrough():
        assert not _tied_weights_gradient_reuses_a_contribution()


def test_the_trace_holds_two_embedding_sized_tensors_when_a_tied_embedding_backpropagates():
    def backward_peak(tie_embeddings: bool) -> int:
        config = tiny(vocab_size=32768, n_embd=64, intermediate_size=172, n_layer=1, tie_embeddings=tie_embeddings)
        run = resolved(config, args(micro_batch_size=1, global_batch_size=1, override_max_seq_length=16), device_type="cpu")
        stretches = trace_training(run).regions["train_step"]
        return max(c["activations"] + c["gradients"] for key, c in stretches.items() if key.endswith("backward"))

    table = 32768 * 64 * 2  # the embedding (bf16)
    # tied: the head's gradient (in autograd's buffer) and the embedding's; their sum replaces the first
    assert 2 * table <= backward_peak(True) < 2.2 * table
    # untied: the same two tensors, each its own parameter's gradient
    assert 2 * table <= backward_peak(False) < 2.2 * table


def test_cpu_plan_of_a_compiled_generation_counts_the_compiler() -> None:
    """generate --compile on the CPU: the compiler and its code beside the eager step's tensors (whole runs, 5M to
    160M parameters: 120-156 MiB above eager), a term that follows the parameter count."""
    from lit_model.plan.calibration import OVERHEAD

    config = tiny()
    eager, compiled = (plan_generation(config, 10, 20, dtype="32-true", device_type="cpu", detect=False, compile=flag)
                       for flag in (False, True))
    assert compiled.tensor_peak_bytes == eager.tensor_peak_bytes and "compiled_code" not in eager.overhead_terms
    expected = OVERHEAD.cpu_generation_compile_runtime + OVERHEAD.cpu_generation_compile_per_parameter * param_counts(config).total
    assert compiled.overhead_terms["compiled_code"] == int(expected)
    assert compiled.peak_bytes == eager.peak_bytes + int(expected)
    assert any(note.startswith("--compile:") for note in compiled.notes)
    # on a GPU the compiled step allocated and reserved more than the eager one (an H200 run): a copy of the KV cache
    # and a fixed reserve, in every phase
    gpu = [plan_generation(config, 10, 20, device_type="cuda", detect=False, compile=flag) for flag in (False, True)]
    kv = gpu[1].run["kv_cache_bytes"]
    for phase, size in gpu[0].by_phase.items():
        assert gpu[1].by_phase[phase] == size + int(OVERHEAD.cuda_compiled_decode + OVERHEAD.cuda_compiled_decode_kv_copies * kv)


def test_cpu_plan_of_a_compiled_run_counts_the_compiler() -> None:
    """--compile on the CPU: the compiler, its code and the heap its kernels leave (pretrain/main.py, lit-model-5m
    4 x 128 in 32-true: 128 MiB above the eager run's peak), a term of its own in every phase; the tensors are the
    eager run's (on an H200 the compiled blocks allocated what eager does)."""
    from lit_model.plan.closed_form import model_bytes
    from lit_model.plan.calibration import OVERHEAD

    eager, compiled = (plan_training(tiny(), args(compile=flag, precision="32-true"), device_type="cpu", suggest=False,
                                     detect=False) for flag in (False, True))
    assert compiled.tensor_peak_bytes == eager.tensor_peak_bytes and "compiled_code" not in eager.overhead_terms
    cats = compiled.by_category
    trainable = model_bytes(compiled.planned).trainable * 4  # every parameter trains (elements, in fp32)
    expected = (OVERHEAD.cpu_compile_runtime + OVERHEAD.cpu_compile_per_parameter_byte * trainable
                + OVERHEAD.cpu_compile_per_activation_byte * (cats["activations"] + cats["logits_loss"]))
    assert compiled.overhead_terms["compiled_code"] == int(expected)
    assert compiled.peak_bytes == eager.peak_bytes + compiled.overhead_terms["compiled_code"]
    # LoRA: the compiler's memory takes the place of the heap an eager adapter fine-tune keeps (pythia-70m: no more),
    # and does not grow with the activations (compiled adapters save fewer of them)
    lora = plan_training(tiny(), args(compile=True, precision="32-true"), trainable="lora", device_type="cpu",
                         suggest=False, detect=False)
    terms = lora.overhead_terms
    compiler = OVERHEAD.cpu_compile_runtime + OVERHEAD.cpu_compile_per_parameter_byte * 4 * model_bytes(lora.planned).trainable
    assert terms["compiled_code"] == pytest.approx(max(compiler - terms["adapter_fine_tuning"], 0), abs=2)
    gpu = plan_training(tiny(), args(compile=True), device_type="cuda", suggest=False, detect=False)
    assert gpu.peak_bytes == plan_training(tiny(), args(), device_type="cuda", suggest=False, detect=False).peak_bytes


@pytest.mark.parametrize("malloc_env", [{}, {"MALLOC_ARENA_MAX": "2"}], ids=["fsdp-heap", "user-heap"])
def test_a_cpu_lora_fsdp_save_counts_the_merge_beside_the_gathered_copy_only_where_glibc_keeps_it(monkeypatch,
                                                                                                 malloc_env):
    """The merge reads the base after the checkpoint's gathered copy is freed: where an FSDP process's heap returns
    freed blocks (run.CPU_HEAP_SHARDED) only the larger of the two is held; at glibc's own settings both are."""
    from lit_model.plan.closed_form import checkpoint_gather_bytes
    from lit_model.plan.planner import lora_merge_bytes

    for name in [n for n in os.environ if n.startswith("MALLOC_")]:
        monkeypatch.delenv(name)
    for name, value in malloc_env.items():
        monkeypatch.setenv(name, value)
    config, settings = tiny(), args(devices=2, strategy="fsdp")
    run = resolved(config, settings, "lora", "cpu")
    plan = plan_training(config, settings, trainable="lora", device_type="cpu", engine="analytic", suggest=False,
                         detect=False)
    gathered, merge = checkpoint_gather_bytes(run), lora_merge_bytes(run)
    assert gathered > 0 and merge > 0
    expected = max(gathered, merge) if run.heap_mode == "lit_model_sharded" else gathered + merge
    assert run.heap_mode == ("lit_model_sharded" if not malloc_env else "glibc")
    assert plan.phase_categories["checkpoint_save"]["checkpoint"] == expected
