"""The Config registry: name lookup, and every published entry checked against ``transformers``.

Nothing is downloaded: each registry entry is turned into the matching ``transformers`` config (``hf_config``
below), both models are built on the meta device, and their parameter counts must agree exactly.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
import yaml

from lit_model.config import CONFIG_DIR, Config, ConfigError, known_names
from lit_model.errors import UsageError
from lit_model.model import GPT, rope_cache

transformers = pytest.importorskip("transformers")

PUBLISHED = [name for name in known_names() if Config.from_name(name).hf_org]
HF_TYPES = ("llama", "mistral", "gpt_neox", "phi", "phi3", "gemma", "gemma2", "qwen2")

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
    final_logit_softcapping=None,
)
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
    "gemma": dict(_GEMMA, sliding_window_size=None),
    "gemma2": {
        **{k: v for k, v in _GEMMA.items() if "softcapping" not in k and k != "attention_scores_scalar"},
        **dict(post_attention_norm=True, post_mlp_norm=True, sliding_window_layer_stride=2),
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
    FIXED[_t].update(norm_unit_offset=False, attention_logit_softcapping=None, final_logit_softcapping=None)
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
    if config.rope_scaling is not None:
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
    assert hf_rotary.attention_scaling == 1.0
    cos, sin = rope_cache(config, 2, torch.device("cpu"))
    ours = torch.atan2(sin[1], cos[1])[: config.rope_n_elem // 2]
    assert ours.shape == hf_rotary.inv_freq.shape
    torch.testing.assert_close(ours, hf_rotary.inv_freq.float(), rtol=1e-5, atol=1e-7)
