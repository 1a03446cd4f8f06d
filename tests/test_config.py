"""The Config registry: name lookup, and every published entry checked against ``transformers``.

Nothing is downloaded: each registry entry is turned into the matching ``transformers`` config (``hf_config``
below), both models are built on the meta device, and their parameter counts must agree exactly.
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import pytest
import torch
import yaml

from lit_model.core.config import CONFIG_DIR, SIZE_FIELDS, SIZE_HEADROOM, Config, ConfigError, known_names, size_limits
from lit_model.core.errors import UsageError
from lit_model.model.gpt import GPT, rope_cache

transformers = pytest.importorskip("transformers")

PUBLISHED = [name for name in known_names() if Config.from_name(name).hf_org]
HF_TYPES = ("llama", "mistral", "mixtral", "gpt_neox", "phi", "phi3", "gemma", "gemma2", "gemma3_text", "qwen2",
            "qwen3", "qwen3_moe", "olmo2", "smollm3")

# Parameter counts of the released checkpoints (model cards / safetensors metadata), each also reproduced by
# ``transformers`` in test_matches_transformers.
PUBLISHED_PARAMETERS = {
    "Llama-2-7b-hf": 6_738_415_616,
    "Llama-2-13b-hf": 13_015_864_320,
    "Llama-2-70b-hf": 68_976_648_192,
    "Meta-Llama-3-8B": 8_030_261_248,
    "Meta-Llama-3-70B": 70_553_706_496,
    "Llama-3.2-1B": 1_235_814_400,
    "Llama-3.2-3B": 3_212_749_824,
    "Mistral-7B-v0.1": 7_241_732_096,
    "Mistral-7B-v0.3": 7_248_023_552,
    "TinyLlama-1.1B-intermediate-step-1431k-3T": 1_100_048_384,
    "SmolLM2-135M": 134_515_008,
    "SmolLM2-360M": 361_821_120,
    "SmolLM2-1.7B": 1_711_376_384,
    "pythia-14m": 14_067_712,
    "pythia-70m": 70_426_624,
    "pythia-160m": 162_322_944,
    "pythia-410m": 405_334_016,
    "pythia-1b": 1_011_781_632,
    "pythia-1.4b": 1_414_647_808,
    "pythia-2.8b": 2_775_208_960,
    "pythia-6.9b": 6_857_302_016,
    "pythia-12b": 11_846_072_320,
    "phi-1_5": 1_418_270_720,
    "phi-2": 2_779_683_840,
    "Phi-3-mini-4k-instruct": 3_821_079_552,
    "gemma-2b": 2_506_172_416,
    "gemma-7b": 8_537_680_896,
    "gemma-2-2b": 2_614_341_888,
    "gemma-2-9b": 9_241_705_984,
    "gemma-2-27b": 27_227_128_320,
    "Qwen2.5-0.5B": 494_032_768,
    "Qwen2.5-1.5B": 1_543_714_304,
    "Qwen2.5-3B": 3_085_938_688,
    "Qwen2.5-7B": 7_615_616_512,
    "Qwen2.5-14B": 14_770_033_664,
    "Qwen2.5-32B": 32_763_876_352,
    "Qwen2.5-72B": 72_706_203_648,
    # Qwen3 model cards give total / non-embedding counts rounded: 0.6B / 0.44B, 1.7B / 1.4B, 4.0B / 3.6B,
    # 8.2B / 6.95B, 14.8B / 13.2B, 32.8B / 31.2B; these are the exact counts of the config.json architectures.
    "Qwen3-0.6B": 596_049_920,
    "Qwen3-1.7B": 1_720_574_976,
    "Qwen3-4B": 4_022_468_096,
    "Qwen3-8B": 8_190_735_360,
    "Qwen3-14B": 14_768_307_200,
    "Qwen3-32B": 32_762_123_264,
    # Gemma 3: 1b is text only (999,885,952 on its model page). 4b/12b/27b are the language models of multimodal
    # checkpoints whose published totals (4,300,079,472 / 12,187,325,040 / 27,432,406,640) are these plus the
    # same SigLIP tower (416,866,032) and a projector of 1152 * n_embd + 1152.
    "gemma-3-1b-pt": 999_885_952,
    "gemma-3-4b-pt": 3_880_263_168,
    "gemma-3-12b-pt": 11_766_034_176,
    "gemma-3-27b-pt": 27_009_346_304,
    # Model pages (safetensors totals): OLMo 2 7B 7.30B / 13B 13.7B, SmolLM3 3.08B, Llama 3.3 70.6B (Llama 3.1 70B's
    # architecture), Mistral Nemo 12.2B, Mistral Small 3 23.6B, Phi-4 14.7B.
    "OLMo-2-1124-7B": 7_298_617_344,
    "OLMo-2-1124-13B": 13_716_198_400,
    "SmolLM3-3B": 3_075_098_624,
    "Llama-3.3-70B-Instruct": 70_553_706_496,
    "Mistral-Nemo-Base-2407": 12_247_782_400,
    "Mistral-Small-24B-Base-2501": 23_572_403_200,
    "phi-4": 14_659_507_200,
    # Mixtures of experts (total; active per token): Mixtral 8x7B 46.7B (12.9B), 8x22B 141B (39B; the Instruct
    # model's larger vocabulary adds 2 x 768 x 6144), Qwen3-30B-A3B 30.5B (3.3B), Qwen3-235B-A22B 235B (22B).
    "Mixtral-8x7B-v0.1": 46_702_792_704,
    "Mixtral-8x22B-v0.1": 140_620_634_112,
    "Mixtral-8x22B-Instruct-v0.1": 140_630_071_296,
    "Qwen3-30B-A3B": 30_532_122_624,
    "Qwen3-235B-A22B": 235_093_634_560,
}

def n_parameters(model: torch.nn.Module) -> int:
    """Each parameter tensor once: tied weights are the same Parameter object."""
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def lit_parameters(config: Config) -> int:
    with torch.device("meta"):
        return n_parameters(GPT(config))


# ---------------------------------------------------------------------------------------------------------------
# Config -> transformers config
# ---------------------------------------------------------------------------------------------------------------
_LLAMA_LIKE = dict(
    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", parallel_residual=False, shared_attention_norm=False,
    post_attention_norm=False, post_mlp_norm=False, lm_head_bias=False, norm_unit_offset=False,
    scale_embeddings=False, rotary_percentage=1.0, attention_scores_scalar=None, attention_logit_softcapping=None,
    final_logit_softcapping=None, qk_norm=None, pre_norm=True, nope_every=0, rope_local_base=None,
    full_attention_every=0, n_expert=0, n_expert_per_token=0,
)
_MOE = {**{k: v for k, v in _LLAMA_LIKE.items() if k not in ("n_expert", "n_expert_per_token")},
        "mlp_class_name": "LLaMAMoE"}
_GEMMA = dict(
    _LLAMA_LIKE, mlp_class_name="GemmaMLP", gelu_approximate="tanh", norm_unit_offset=True, scale_embeddings=True,
    bias=False, attn_bias=False,
)
# What each transformers architecture hard-codes: a registry entry that differs would build the same parameter
# count in a few cases (e.g. a GELU flavour, a norm offset) but not the same model.
FIXED: dict[str, dict[str, Any]] = {
    "llama": dict(_LLAMA_LIKE, sliding_window_size=None),  # attention_bias == mlp_bias == bias
    "mistral": dict(_LLAMA_LIKE, bias=False, attn_bias=False, sliding_window_layer_stride=1),
    "phi3": dict(_LLAMA_LIKE, bias=False, attn_bias=False, sliding_window_layer_stride=1),
    "qwen2": dict(_LLAMA_LIKE, bias=False, attn_bias=True, sliding_window_size=None),
    "qwen3": dict(_LLAMA_LIKE, bias=False, attn_bias=False, sliding_window_size=None, qk_norm="head"),
    "qwen3_moe": dict(_MOE, bias=False, attn_bias=False, sliding_window_size=None, qk_norm="head"),
    "mixtral": dict(_MOE, bias=False, attn_bias=False, sliding_window_layer_stride=1, moe_norm_topk=True),
    "olmo2": dict(_LLAMA_LIKE, bias=False, attn_bias=False, sliding_window_size=None, qk_norm="projection",
                  pre_norm=False, post_attention_norm=True, post_mlp_norm=True),
    "smollm3": {**{k: v for k, v in _LLAMA_LIKE.items() if k != "nope_every"}, "bias": False, "attn_bias": False,
                "sliding_window_size": None},
    "gemma": dict(_GEMMA, sliding_window_size=None),
    "gemma2": {
        **{k: v for k, v in _GEMMA.items() if "softcapping" not in k and k != "attention_scores_scalar"},
        **dict(post_attention_norm=True, post_mlp_norm=True, sliding_window_layer_stride=2),
    },
    "gemma3_text": {
        **{k: v for k, v in _GEMMA.items() if k not in ("attention_scores_scalar", "rope_local_base",
                                                          "full_attention_every")},
        **dict(post_attention_norm=True, post_mlp_norm=True, qk_norm="head", sliding_window_layer_stride=1),
    },
    "gpt_neox": dict(
        norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", shared_attention_norm=False, bias=True,
        lm_head_bias=False, tie_embeddings=False, post_attention_norm=False, post_mlp_norm=False,
        scale_embeddings=False, sliding_window_size=None, attention_scores_scalar=None,
    ),
    "phi": dict(
        norm_class_name="LayerNorm", mlp_class_name="GptNeoxMLP", parallel_residual=True, shared_attention_norm=True,
        bias=True, lm_head_bias=True, tie_embeddings=False, post_attention_norm=False, post_mlp_norm=False,
        scale_embeddings=False, sliding_window_size=None, gelu_approximate="tanh", attention_scores_scalar=None,
    ),
}
for _t in ("gpt_neox", "phi"):
    FIXED[_t].update(norm_unit_offset=False, attention_logit_softcapping=None, final_logit_softcapping=None,
                     qk_norm=None, pre_norm=True, nope_every=0, rope_local_base=None, full_attention_every=0,
                     n_expert=0)
_GELU_NAME = {"none": "gelu", "tanh": "gelu_new"}


def hf_config(config: Config) -> tuple[str, dict[str, Any]]:
    """(model_type, kwargs for ``AutoConfig.for_model``) describing the same architecture as ``config``."""
    t = config.hf_type
    for name, value in FIXED[t].items():
        assert getattr(config, name) == value, f"{config.name}: {t} models have {name}={value!r}"
    if t == "llama":
        assert not config.attn_bias or config.bias, f"{config.name}: llama has no query/key/value-only bias"

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_base}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
    if config.rotary_percentage != 1.0:
        rope["partial_rotary_factor"] = config.rotary_percentage
    kw: dict[str, Any] = dict(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.n_embd,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        max_position_embeddings=config.block_size,
        tie_word_embeddings=config.tie_embeddings,
        rope_parameters=rope,
    )
    kw.update({k: v for k, v in config.extra.items() if k != "torch_dtype"})
    if t in ("gpt_neox", "phi"):
        assert config.n_query_groups == config.n_head, f"{config.name}: {t} has no grouped-query attention"
        assert config.head_size == config.n_embd // config.n_head
        kw.update(layer_norm_eps=config.norm_eps, hidden_act=_GELU_NAME[config.gelu_approximate])
        if t == "gpt_neox":
            kw.update(use_parallel_residual=config.parallel_residual, attention_bias=config.bias)
        else:
            kw.update(num_key_value_heads=config.n_query_groups, qk_layernorm=False)
        return t, kw

    kw.update(rms_norm_eps=config.norm_eps, num_key_value_heads=config.n_query_groups, head_dim=config.head_size)
    if t == "llama":
        kw.update(attention_bias=config.bias, mlp_bias=config.bias, hidden_act="silu")
    elif t in ("mistral", "phi3"):
        kw.update(sliding_window=config.sliding_window_size, hidden_act="silu")
    elif t == "qwen2":
        kw.update(use_sliding_window=False, hidden_act="silu")
    elif t == "qwen3":
        kw.update(use_sliding_window=False, hidden_act="silu", attention_bias=False)
    elif t == "qwen3_moe":
        kw.update(use_sliding_window=False, hidden_act="silu", attention_bias=False, num_experts=config.n_expert,
                  num_experts_per_tok=config.n_expert_per_token, norm_topk_prob=config.moe_norm_topk,
                  moe_intermediate_size=config.intermediate_size, decoder_sparse_step=1, mlp_only_layers=[])
    elif t == "mixtral":
        kw.update(sliding_window=config.sliding_window_size, hidden_act="silu", num_local_experts=config.n_expert,
                  num_experts_per_tok=config.n_expert_per_token)
    elif t == "olmo2":
        kw.update(hidden_act="silu", attention_bias=False)
    elif t == "smollm3":
        kw.update(hidden_act="silu", attention_bias=False, mlp_bias=False, use_sliding_window=False,
                  no_rope_layers=[int(config.layer_uses_rope(i)) for i in range(config.n_layer)])
    elif t == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": config.rope_local_base or config.rope_base}
        kw.update(
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=False,
            query_pre_attn_scalar=config.attention_scores_scalar or config.head_size,
            sliding_window=config.sliding_window_size,
            layer_types=["sliding_attention" if config.layer_uses_sliding_window(i) else "full_attention"
                         for i in range(config.n_layer)],
            rope_parameters={"full_attention": rope, "sliding_attention": local},
        )
    elif t == "gemma":
        kw.update(hidden_act="gelu_pytorch_tanh", attention_bias=False)
    elif t == "gemma2":
        kw.update(
            hidden_activation="gelu_pytorch_tanh",
            attention_bias=False,
            query_pre_attn_scalar=config.attention_scores_scalar or config.head_size,
            attn_logit_softcapping=config.attention_logit_softcapping,
            final_logit_softcapping=config.final_logit_softcapping,
            sliding_window=config.sliding_window_size,
        )
    return t, kw


def build_hf(config: Config) -> tuple[Any, torch.nn.Module]:
    model_type, kw = hf_config(config)
    hf_cfg = transformers.AutoConfig.for_model(model_type, **kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    return hf_cfg, model


# ---------------------------------------------------------------------------------------------------------------
# Name lookup
# ---------------------------------------------------------------------------------------------------------------
def test_from_name_with_or_without_org():
    config = Config.from_name("Llama-2-7b-hf")
    assert config == Config.from_name("meta-llama/Llama-2-7b-hf")
    assert config.hf_name == "meta-llama/Llama-2-7b-hf"
    assert (config.n_layer, config.n_embd, config.n_head, config.intermediate_size) == (32, 4096, 32, 11008)
    assert config.head_size == 128 and config.n_query_groups == 32 and config.padded_vocab_size == 32000


def test_from_name_overrides():
    config = Config.from_name("pythia-160m", block_size=256, n_layer=2)
    assert (config.block_size, config.n_layer, config.n_embd) == (256, 2, 768)
    assert Config.from_name("pythia-160m").n_layer == 12  # the registry itself is untouched


def test_unknown_name_suggests_close_names():
    with pytest.raises(UsageError, match="Unknown model name") as error:
        Config.from_name("Llama-2-7b")
    assert "Did you mean" in str(error.value) and "Llama-2-7b-hf" in str(error.value)
    with pytest.raises(UsageError, match="qwen2.5-7b|Qwen2.5-7B"):
        Config.from_name("Qwen/Qwen2.5-7b")  # names are case sensitive; the close match is offered


def test_every_registry_entry_passes_validation_and_a_bad_field_is_named():
    for name in known_names():  # __post_init__ validates types and ranges, so every published entry is checked
        Config.from_name(name)
    cases = [
        (dict(n_layer="four"), "n_layer: 'four' is not an integer"),
        (dict(n_head=5), "n_embd=768 is not divisible by n_head=5"),
        (dict(n_embd=-64, head_size=64), "n_embd: -64 must be at least 1"),
        (dict(rope_base=0.0), "rope_base: 0.0 must be a positive number"),
        (dict(sliding_window_size=0), "sliding_window_size: 0 must be at least 1"),
        (dict(mlp_class_name="SwiGLU"), "is not one of GptNeoxMLP, LLaMAMLP, GemmaMLP"),
        (dict(tie_embeddings=1), "tie_embeddings: 1 is not true or false"),
        (dict(rope_scaling=[8.0]), "rope_scaling: [8.0] is not a mapping (or null)"),
        (dict(gelu_approximate="exact"), "gelu_approximate: 'exact' must be none or tanh"),
    ]
    for overrides, needle in cases:
        with pytest.raises(ConfigError) as error:
            Config.from_name("pythia-160m", **overrides)
        assert needle in str(error.value) and isinstance(error.value, (UsageError, ValueError))


def test_sizes_are_bounded_by_the_registrys_largest_model():
    """Every size field's limit is SIZE_HEADROOM times the largest value a published config gives it, so a new
    registry entry raises it; one above it is refused before any model is built."""
    configs = [Config.from_name(name) for name in known_names()]
    assert size_limits()["n_layer"] == (SIZE_HEADROOM * max(c.n_layer for c in configs), "Qwen3-235B-A22B")
    assert size_limits()["block_size"][0] == SIZE_HEADROOM * max(c.block_size for c in configs)
    assert set(size_limits()) == set(SIZE_FIELDS)
    tiny = dict(block_size=64, vocab_size=512, n_layer=2, n_embd=64, n_head=4)
    for name in ("n_layer", "block_size", "vocab_size", "intermediate_size"):
        limit = size_limits()[name][0]
        Config(**{**tiny, name: limit})  # the limit itself is allowed
        with pytest.raises(ConfigError, match=rf"{name}: {limit + 1} is larger than any model lit-model builds"):
            Config(**{**tiny, name: limit + 1})


def test_model_config_file_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(UsageError, match="holds no Config fields"):  # not the 3.4B defaults
        Config.from_file(empty)
    bad = tmp_path / "bad.yaml"
    bad.write_text("n_layer: 2\nn_embd: 64\nn_head: 3\n")
    with pytest.raises(ConfigError, match=f"{bad}: n_embd=64 is not divisible by n_head=3"):
        Config.from_file(bad)


def test_wrong_org_raises():
    with pytest.raises(UsageError, match="meta-llama/Llama-2-7b-hf"):
        Config.from_name("mistralai/Llama-2-7b-hf")
    with pytest.raises(UsageError):
        Config.from_name("meta-llama/Mistral-7B-v0.1")


def test_variants_share_the_base_architecture():
    pairs = [
        ("Llama-2-7b-chat-hf", "Llama-2-7b-hf"),
        ("Llama-2-70b-chat-hf", "Llama-2-70b-hf"),
        ("Meta-Llama-3-8B-Instruct", "Meta-Llama-3-8B"),
        ("Llama-3.2-3B-Instruct", "Llama-3.2-3B"),
        ("Mistral-7B-Instruct-v0.1", "Mistral-7B-v0.1"),
        ("Mistral-7B-Instruct-v0.3", "Mistral-7B-v0.3"),
        ("TinyLlama-1.1B-Chat-v1.0", "TinyLlama-1.1B-intermediate-step-1431k-3T"),
        ("SmolLM2-1.7B-Instruct", "SmolLM2-1.7B"),
        ("gemma-2-27b-it", "gemma-2-27b"),
        ("pythia-1b-deduped", "pythia-1b"),
        ("Qwen2.5-3B-Instruct", "Qwen2.5-3B"),
        ("Qwen3-4B", "Qwen3-4B-Base"),
        ("gemma-3-12b-it", "gemma-3-12b-pt"),
        ("OLMo-2-1124-13B-Instruct", "OLMo-2-1124-13B"),
        ("SmolLM3-3B", "SmolLM3-3B-Base"),
        ("Llama-3.3-70B-Instruct", "Llama-3.1-70B"),
        ("Mistral-Nemo-Instruct-2407", "Mistral-Nemo-Base-2407"),
        ("Mistral-Small-24B-Instruct-2501", "Mistral-Small-24B-Base-2501"),
        ("Mixtral-8x7B-Instruct-v0.1", "Mixtral-8x7B-v0.1"),
        ("Qwen3-30B-A3B-Base", "Qwen3-30B-A3B"),
    ]
    ignored = {"name", "extra", "block_size", "norm_eps"}  # Qwen2.5-Instruct: 32K context, rms_norm_eps 1e-6
    for variant, base in pairs:
        a, b = Config.from_name(variant).to_dict(), Config.from_name(base).to_dict()
        assert {k: v for k, v in a.items() if k not in ignored} == {k: v for k, v in b.items() if k not in ignored}


def test_registry_highlights():
    llama31 = Config.from_name("Llama-3.1-70B")
    assert llama31.block_size == 131072 and llama31.rope_scaling["factor"] == 8.0
    llama32 = Config.from_name("Llama-3.2-3B")
    assert llama32.tie_embeddings and llama32.rope_scaling["factor"] == 32.0 and llama32.rope_base == 500000.0
    assert Config.from_name("Mistral-7B-v0.1").sliding_window_size == 4096
    assert Config.from_name("Mistral-7B-v0.3").sliding_window_size is None
    assert Config.from_name("Mistral-7B-v0.3").padded_vocab_size == 32768
    assert [Config.from_name(f"pythia-{s}").padded_vocab_size for s in ("70m", "2.8b", "6.9b", "12b")] == [
        50304, 50304, 50432, 50688,
    ]
    phi2 = Config.from_name("phi-2")
    assert phi2.rope_n_elem == 32 and phi2.shared_attention_norm and phi2.lm_head_bias
    assert Config.from_name("phi-1_5").rope_n_elem == 32
    assert Config.from_name("Phi-3-mini-4k-instruct").padded_vocab_size == 32064
    gemma = Config.from_name("gemma-2b")
    assert gemma.n_query_groups == 1 and gemma.head_size == 256 and gemma.tie_embeddings
    assert Config.from_name("gemma-7b").head_size == 256
    gemma2 = Config.from_name("gemma-2-9b")
    assert [gemma2.layer_uses_sliding_window(i) for i in range(4)] == [True, False, True, False]
    assert Config.from_name("gemma-2-27b").attention_scores_scalar == 144
    assert [Config.from_name(f"Qwen2.5-{s}").tie_embeddings for s in ("0.5B", "1.5B", "3B", "7B", "72B")] == [
        True, True, True, False, False,
    ]
    assert Config.from_name("Qwen2.5-7B").padded_vocab_size == 152064
    assert Config.from_name("Qwen2.5-0.5B").padded_vocab_size == 151936
    assert [Config.from_name(f"Qwen3-{s}").tie_embeddings for s in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")] == [
        True, True, True, False, False, False,
    ]
    assert {Config.from_name(f"Qwen3-{s}").head_size for s in ("0.6B", "4B", "32B")} == {128}  # not n_embd / n_head
    gemma3 = Config.from_name("gemma-3-27b-it")
    assert [gemma3.layer_uses_sliding_window(i) for i in range(12)] == ([True] * 5 + [False]) * 2
    assert (gemma3.rope_base, gemma3.rope_local_base, gemma3.rope_scaling) == (
        1e6, 1e4, {"rope_type": "linear", "factor": 8.0}
    )
    assert Config.from_name("gemma-3-1b-it").rope_scaling is None
    smollm3 = Config.from_name("SmolLM3-3B")
    assert [i for i in range(smollm3.n_layer) if not smollm3.layer_uses_rope(i)] == list(range(3, 36, 4))
    olmo2 = Config.from_name("OLMo-2-1124-7B")
    assert not olmo2.pre_norm and olmo2.qk_norm == "projection" and olmo2.post_mlp_norm
    assert Config.from_name("Mistral-Nemo-Base-2407").head_size == 128 != 5120 // 32



def test_configs_do_not_share_registry_state():
    config = Config.from_name("Llama-3.1-8B")
    original = config.rope_scaling["factor"]
    config.rope_scaling["factor"] = 123.0
    try:
        assert Config.from_name("Llama-3.1-8B").rope_scaling["factor"] == original
        assert Config.from_name("Llama-3.1-8B").extra is not config.extra
    finally:
        config.rope_scaling["factor"] = original  # leave the registry as it was for the other tests


# ---------------------------------------------------------------------------------------------------------------
# Registry files
# ---------------------------------------------------------------------------------------------------------------
FIELD_NAMES = {f.name for f in fields(Config)}
FLOAT_FIELDS = ("rotary_percentage", "rope_base", "norm_eps")
INT_FIELDS = ("block_size", "vocab_size", "padded_vocab_size", "n_layer", "n_embd", "n_head", "head_size",
              "n_query_groups", "intermediate_size")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_registry_file_is_well_formed(path):
    entries = yaml.safe_load(path.read_text())
    assert isinstance(entries, list) and entries
    for entry in entries:
        unknown = set(entry) - FIELD_NAMES - {"base"}
        assert not unknown, f"{path.name}: {entry.get('name')} has unknown keys {sorted(unknown)}"
        assert entry.get("base") != entry["name"]
        # YAML reads 1e-5 (no dot) as a string: numbers must load as numbers.
        for key in FLOAT_FIELDS:
            if key in entry:
                assert isinstance(entry[key], (int, float)) and not isinstance(entry[key], bool), (entry["name"], key)
        for key in INT_FIELDS:
            if entry.get(key) is not None:
                assert type(entry[key]) is int, (entry["name"], key)


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_entry(name):
    config = Config.from_name(name)
    assert config.name == name and config.hf_org and config.hf_type in HF_TYPES
    assert isinstance(config.norm_eps, float) and isinstance(config.rope_base, float)
    assert config.padded_vocab_size >= config.vocab_size
    assert config.rope_n_elem % 2 == 0 and 0 < config.rope_n_elem <= config.head_size
    if config.sliding_window_size is not None:
        assert 0 < config.sliding_window_size < config.block_size
    if config.rope_scaling is not None and config.rope_scaling.get("rope_type", "llama3") == "llama3":
        assert config.rope_scaling["original_max_position_embeddings"] < config.block_size
    # extra only carries what an exporter writes back and the model does not use
    assert set(config.extra) <= {"bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype"}, config.extra


def test_save_and_load_round_trip(tmp_path):
    config = Config.from_name("Llama-3.1-8B-Instruct")
    config.save(tmp_path)
    assert Config.from_checkpoint(tmp_path) == config


# ---------------------------------------------------------------------------------------------------------------
# Sizes
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, expected", sorted(PUBLISHED_PARAMETERS.items()))
def test_published_parameter_count(name, expected):
    assert lit_parameters(Config.from_name(name)) == expected


def test_tied_embeddings_are_counted_once():
    config = Config.from_name("SmolLM2-135M")
    with torch.device("meta"):
        model = GPT(config)
    assert model.lm_head.weight is model.embed.weight
    assert n_parameters(model) == sum(p.numel() for p in model.parameters())  # parameters() dedupes too
    untied = lit_parameters(Config.from_name("SmolLM2-135M", tie_embeddings=False))
    assert untied - n_parameters(model) == config.padded_vocab_size * config.n_embd


@pytest.mark.parametrize("name", PUBLISHED)
def test_matches_transformers(name):
    """The strong check: transformers builds the same architecture with exactly as many parameters."""
    config = Config.from_name(name)
    hf_cfg, hf_model = build_hf(config)
    assert n_parameters(hf_model) == lit_parameters(config)
    assert hf_model.get_input_embeddings().weight.shape == (config.padded_vocab_size, config.n_embd)

    # Local attention on the same layers, with the same window.
    layer_types = getattr(hf_cfg, "layer_types", None)
    if layer_types is None:
        hf_sliding = [getattr(hf_cfg, "sliding_window", None) is not None] * config.n_layer
    else:
        hf_sliding = [kind == "sliding_attention" for kind in layer_types]
    assert hf_sliding == [config.layer_uses_sliding_window(i) for i in range(config.n_layer)]
    if any(hf_sliding):
        assert hf_cfg.sliding_window == config.sliding_window_size

    # The same rotary frequencies (partial rotary and Llama 3.1 scaling included): position 1's angles are inv_freq.
    rotary = next(m for m in hf_model.modules() if type(m).__name__.endswith("RotaryEmbedding"))
    with torch.device("cpu"):
        hf_rotary = type(rotary)(config=hf_cfg)
    # Gemma 3 keeps one table per layer type: the global one, and the local one with its own base
    tables = [(config, "")]
    if config.hf_type == "gemma3_text":
        local = replace(config, rope_base=config.rope_local_base or config.rope_base, rope_scaling=None)
        tables = [(config, "full_attention_"), (local, "sliding_attention_")]
    for table_config, prefix in tables:
        assert getattr(hf_rotary, f"{prefix}attention_scaling") == 1.0
        cos, sin = rope_cache(table_config, 2, torch.device("cpu"))
        ours = torch.atan2(sin[1], cos[1])[: config.rope_n_elem // 2]
        hf_inv_freq = getattr(hf_rotary, f"{prefix}inv_freq")
        assert ours.shape == hf_inv_freq.shape
        torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=1e-5, atol=1e-7)
