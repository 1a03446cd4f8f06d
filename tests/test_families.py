"""The architecture switches of the newer families (Qwen3, Gemma 3, OLMo 2, SmolLM3, mixtures of experts) beyond
HF parity (tests/test_convert.py): KV-cache decoding equals the full forward, the analytic planner agrees with the
trace and its parameter count with every published one, and LoRA adapts and merges every expert."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from lit_model.core.config import Config
from lit_model.infer.decode import forward_last
from lit_model.infer.kv_cache import set_kv_cache
from lit_model.plan.closed_form import param_counts, training_phases
from lit_model.run import resolve_run
from lit_model.plan.trace import trace_training
from lit_model.model.gpt import GPT
from lit_model.methods.objective import CausalLM, mean_loss

sys.path.insert(0, str(Path(__file__).parent))
from test_config import PUBLISHED_PARAMETERS  # noqa: E402
from test_memory_plan import args, tiny  # noqa: E402

TINY = dict(name="tiny", block_size=64, vocab_size=300, n_layer=6, n_embd=64, n_head=4, n_query_groups=2)
FEATURES = {
    "qwen3": dict(qk_norm="head", head_size=24),
    "gemma3": dict(
        qk_norm="head", head_size=24, post_attention_norm=True, post_mlp_norm=True, norm_unit_offset=True,
        mlp_class_name="GemmaMLP", gelu_approximate="tanh", scale_embeddings=True, attention_scores_scalar=20,
        sliding_window_size=4, full_attention_every=3, rope_base=1e4, rope_local_base=10.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    "olmo2": dict(qk_norm="projection", pre_norm=False, post_attention_norm=True, post_mlp_norm=True),
    "smollm3": dict(nope_every=4),
    "qwen3_moe": dict(qk_norm="head", mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_norm_topk=False),
}
def tiny_model(**fields) -> GPT:
    torch.manual_seed(0)
    model = GPT(Config(**{**TINY, **fields}))
    model.init_weights()
    with torch.no_grad():  # norms away from 1 (0 for Gemma's offset norms), so that each one matters
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
    return model.eval()


@pytest.mark.parametrize("family", list(FEATURES))
def test_kv_cache_decoding_equals_the_full_forward(family: str) -> None:
    """generation.py runs the blocks itself (forward_last): a prefill, a chat turn and single steps past the
    window must give the logits of the whole sequence's forward at each chunk's last position."""
    model = tiny_model(**FEATURES[family])
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids)
        set_kv_cache(model, 1, 16)
        for a, b in [(0, 6), (6, 9), (9, 10), (10, 11), (11, 12)]:
            torch.testing.assert_close(forward_last(model, ids[:, a:b], torch.arange(a, b), b), full[:, b - 1])


@pytest.mark.parametrize("family", list(FEATURES))
@pytest.mark.parametrize("precision, trainable", [("32-true", "full"), ("bf16-true", "lora"), ("bf16-mixed", "full")])
def test_analytic_planner_agrees_with_the_trace(family: str, precision: str, trainable: str) -> None:
    fields = {k: v for k, v in FEATURES[family].items() if k != "head_size"}
    if family == "gemma3":
        fields.update(sliding_window_size=64, n_layer=3)  # a window shorter than the 128 planned tokens
    spec = resolve_run(args(precision=precision, micro_batch_size=4, global_batch_size=4), tiny(**fields), trainable,
                       device_type="cpu")
    traced, closed = trace_training(spec).phases, training_phases(spec)
    # (the evaluation phase under bf16-mixed is 1.2 % off for every architecture, these switches or not)
    for phase, rel in (("train_step", 0.01), ("evaluation", 0.02)):
        assert sum(closed[phase].values()) == pytest.approx(sum(traced[phase].values()), rel=rel), phase
    # (the trace files by shape what has the vocabulary as last dimension as logits/loss memory; the closed form
    # also counts the loss's gradient into the final norm's output there: compare activations and loss together)
    transient = lambda phases: phases["train_step"]["activations"] + phases["train_step"]["logits_loss"]  # noqa: E731
    assert transient(closed) == pytest.approx(transient(traced), rel=0.01)
    assert closed["train_step"]["parameters"] == traced["train_step"]["parameters"]


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_analytic_parameter_count(name: str) -> None:
    """The planner's closed-form count is the published one (which test_config checks the model against)."""
    assert param_counts(Config.from_name(name)).total == PUBLISHED_PARAMETERS[name]


def test_lora_adapts_every_expert_and_merges_exactly() -> None:
    from lit_model.methods.lora import LoRAConfig, apply_lora, merge_state_dict

    model = tiny_model(**FEATURES["qwen3_moe"])
    base = {name: t.clone() for name, t in model.state_dict().items()}
    config = LoRAConfig(r=4, query=False, value=False, mlp=True, dropout=0.0)
    names = apply_lora(model, config)
    assert sorted(names) == sorted(f"blocks.{i}.mlp.experts.{e}.{n}" for i in range(6) for e in range(4)
                                   for n in ("fc_1", "fc_2", "proj"))
    with torch.no_grad():  # a non-zero update, so that merging has something to add
        for name, param in model.named_parameters():
            if name.endswith("lora_B"):
                param.normal_(0.0, 0.1)
    ids = torch.randint(0, 300, (2, 16), generator=torch.Generator().manual_seed(3))
    mean_loss(CausalLM(), model, (ids, ids)).backward()
    # every expert chose some of the 32 tokens: each one's adapter gets a gradient
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("lora_A")]
    assert len(grads) == 6 * 4 * 3 and all(g is not None and g.abs().sum() > 0 for g in grads)
    lora = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    merged = GPT(model.config)
    merged.load_state_dict(merge_state_dict(base, lora, config))
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(ids), model.eval()(ids), rtol=1e-5, atol=1e-5)
