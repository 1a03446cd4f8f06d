"""HF <-> lit-model conversion: logits parity for every supported family, both directions, plus the
weight-file layouts, the CLI and its error messages. Tiny random models built here; nothing is downloaded."""

import json
import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lit_model.core.config import Config  # noqa: E402
from lit_model.io.convert import config_from_hf, config_to_hf, hf_to_lit, lit_to_hf  # noqa: E402
from lit_model.core.errors import UserError  # noqa: E402
from lit_model.model.gpt import GPT  # noqa: E402
from lit_model.methods.load import load_gpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VOCAB, SEQ = 128, 16
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so every branch of the llama3 scaling is used
}
FAMILIES = {
    "llama": ("llama", {}),
    "llama3_tied": ("llama", {"rope_parameters": LLAMA3_ROPE, "tie_word_embeddings": True}),
    "mistral": ("mistral", {"sliding_window": 5, "head_dim": 8}),
    "gpt_neox": ("gpt_neox", {"num_key_value_heads": None}),
    "gpt_neox_sequential": (
        "gpt_neox",
        {"num_key_value_heads": None, "use_parallel_residual": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}},
    ),
    "phi": ("phi", {}),
    "phi3": ("phi3", {}),
    "gemma": ("gemma", {"head_dim": 16}),
    "gemma2": (
        "gemma2",
        {"head_dim": 16, "sliding_window": 5, "query_pre_attn_scalar": 12, "attn_logit_softcapping": 2.0,
         "final_logit_softcapping": 8.0},
    ),
    "qwen2": ("qwen2", {"tie_word_embeddings": False}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),
    # q/k RMSNorm per head; head_dim 16 != hidden_size / heads
    "qwen3": ("qwen3", {"head_dim": 16, "tie_word_embeddings": False}),
    "qwen3_tied": ("qwen3", {"head_dim": 16, "tie_word_embeddings": True}),
    # 6 layers, every 3rd global (Gemma 3's pattern, shorter): local RoPE base 10, global 1e4 with linear scaling
    "gemma3": (
        "gemma3_text",
        {"head_dim": 16, "num_hidden_layers": 6, "sliding_window": 5, "query_pre_attn_scalar": 12,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2,
         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}},
    ),
    "olmo2": ("olmo2", {}),  # norms after attention and MLP only; q/k RMSNorm over the whole projection
    "smollm3": ("smollm3", {"num_hidden_layers": 4, "no_rope_layer_interval": 2}),  # layers 1 and 3 without RoPE
    "mistral_nemo": ("mistral", {"head_dim": 16, "sliding_window": 5}),  # head_dim != hidden_size / heads
    # mixtures of experts: 4 experts, 2 per token
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                "head_dim": 16, "norm_topk_prob": False}),
    "qwen3_moe_normalised": ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                                           "head_dim": 16, "norm_topk_prob": True}),
}

# What config_from_hf must read from the new families' config.json (the parity test then shows it is right).
FEATURES = {
    "qwen3": dict(qk_norm="head", head_size=16, bias=False, attn_bias=False),
    "gemma3": dict(qk_norm="head", full_attention_every=3, sliding_window_size=5, rope_base=10000.0,
                   rope_local_base=10.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, post_mlp_norm=True),
    "olmo2": dict(qk_norm="projection", pre_norm=False, post_attention_norm=True, post_mlp_norm=True),
    "smollm3": dict(nope_every=2, tie_embeddings=True),
    "mistral_nemo": dict(head_size=16),
    "mixtral": dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_norm_topk=True),
    "qwen3_moe": dict(mlp_class_name="LLaMAMoE", n_expert=4, n_expert_per_token=2, moe_norm_topk=False,
                      intermediate_size=48, qk_norm="head"),
}


def make_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    model_type, overrides = FAMILIES[family]
    kwargs = {**SMALL, **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **kwargs)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    # HF's init (std 0.02, norms at 1, biases at 0) would hide swapped norms or biases: randomize everything.
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim == 1:
                param.add_(torch.randn_like(param) * 0.3)
            else:
                param.normal_(0.0, 0.2)
    return model.eval()


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def hf_logits(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    return model(idx).logits


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape
    assert (actual - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", list(FAMILIES))
def test_roundtrip_logits(family: str, tmp_path: Path) -> None:
    hf_model = make_hf_model(family)
    hf_model.save_pretrained(tmp_path / "hf")
    idx = tokens()
    expected = hf_logits(hf_model, idx)

    hf_to_lit(tmp_path / "hf", tmp_path / "lit")
    model = load_gpt(tmp_path / "lit")
    for field, value in FEATURES.get(family, {}).items():
        assert getattr(model.config, field) == value, field
    with torch.no_grad():
        assert_same(model(idx), expected)
        if model.config.sliding_window_size is not None:  # the window must matter for the test to mean anything
            model_global = load_gpt(tmp_path / "lit", sliding_window_size=None)
            assert (model_global(idx) - expected).abs().max() > 1e-3
        if model.config.final_logit_softcapping is not None:
            uncapped = load_gpt(
                tmp_path / "lit", final_logit_softcapping=None, attention_logit_softcapping=None
            )
            assert (uncapped(idx) - expected).abs().max() > 1e-3
        if family == "llama3_tied":
            assert model.config.rope_scaling["rope_type"] == "llama3"
        # each feature the config.json asked for must matter, for the test to mean anything
        switches = [("rope_scaling", None), ("rope_local_base", None), ("nope_every", 0), ("full_attention_every", 0)]
        if model.config.n_expert:
            switches.append(("moe_norm_topk", False))
        for field, off in switches:
            if getattr(model.config, field) != off:
                without = load_gpt(tmp_path / "lit", **{field: off})
                assert (without(idx) - expected).abs().max() > 1e-3, field

    lit_to_hf(tmp_path / "lit", tmp_path / "hf2")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert_same(hf_logits(reloaded, idx), expected)
    written = json.loads((tmp_path / "hf2" / "config.json").read_text())
    original = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings", "vocab_size"):
        assert written.get(key) == original.get(key), key
    if original["tie_word_embeddings"]:
        assert "lm_head.weight" not in load_file(tmp_path / "hf2" / "model.safetensors")


def test_gemma3_multimodal_checkpoint_converts_its_language_model(tmp_path: Path) -> None:
    """Gemma 3 4B+ is published as Gemma3ForConditionalGeneration: the language model converts, the SigLIP tower
    and projector are left out, and text-only logits match the multimodal model's."""
    text = {**SMALL, **FAMILIES["gemma3"][1]}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(0)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.3) if param.ndim == 1 else param.normal_(0.0, 0.2)
    hf_model.save_pretrained(tmp_path / "hf")
    idx = tokens()
    hf_to_lit(tmp_path / "hf", tmp_path / "lit")
    model = load_gpt(tmp_path / "lit")
    assert model.config.hf_type == "gemma3_text" and model.config.full_attention_every == 3
    with torch.no_grad():
        assert_same(model(idx), hf_logits(hf_model, idx))
    lit_to_hf(tmp_path / "lit", tmp_path / "hf2")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf2", attn_implementation="eager").eval()
    assert_same(hf_logits(reloaded, idx), hf_logits(hf_model, idx))


def test_config_roundtrip_and_rejections() -> None:
    hf = make_hf_model("gemma2").config.to_dict()
    config = config_from_hf(hf)
    assert (config.sliding_window_size, config.sliding_window_layer_stride) == (5, 2)
    assert config.layer_uses_sliding_window(0) and not config.layer_uses_sliding_window(1)
    assert config.attention_scores_scalar == 12 and config.norm_unit_offset and config.post_mlp_norm
    assert config_from_hf(config_to_hf(config)) == config
    # legacy (transformers 4) layout: rope_theta / rope_scaling / rotary_pct at the top level
    legacy = {**SMALL, "model_type": "gpt_neox", "rotary_pct": 0.5, "rotary_emb_base": 500.0}
    config = config_from_hf(legacy)
    assert (config.rotary_percentage, config.rope_base, config.bias) == (0.5, 500.0, True)
    legacy = {**SMALL, "model_type": "llama", "rope_theta": 5e5, "rope_scaling": {**LLAMA3_ROPE, "rope_type": None,
                                                                                     "type": "llama3"}}
    assert config_from_hf(legacy).rope_scaling["factor"] == 8.0
    with pytest.raises(UserError, match="llama, mistral"):
        config_from_hf({**SMALL, "model_type": "bert"})
    with pytest.raises(UserError, match="yarn"):
        config_from_hf({**SMALL, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "factor": 2.0}})
    # every published config can be written as its HF model type and read back unchanged
    from lit_model.core.config import known_names

    for name in known_names():
        published = Config.from_name(name)
        back = config_from_hf(config_to_hf(published))
        assert back.padded_vocab_size == published.padded_vocab_size and back.n_layer == published.n_layer, name
    with pytest.raises(UserError, match="parallel_residual"):
        config_to_hf(Config(hf_type="llama", n_layer=2, n_embd=32, n_head=4, parallel_residual=True))


def test_lit_model_from_scratch_to_hf(tmp_path: Path) -> None:
    """A checkpoint that never came from HF (empty Config.extra) still exports."""
    from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir

    config = Config(hf_type="gemma", n_layer=2, n_embd=32, n_head=4, n_query_groups=1, head_size=16,
                    vocab_size=VOCAB, intermediate_size=48, block_size=64, tie_embeddings=True, norm_unit_offset=True,
                    scale_embeddings=True, mlp_class_name="GemmaMLP", gelu_approximate="tanh", norm_eps=1e-6)
    torch.manual_seed(0)
    model = GPT(config)
    model.init_weights()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    save_checkpoint_dir(lit_state_dict(model, config), config, tmp_path / "lit")
    lit_to_hf(tmp_path / "lit", tmp_path / "hf")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        assert_same(hf_logits(reloaded, tokens()), model.eval()(tokens()))


def _save_bin(state_dict: dict, out_dir: Path, shards: int) -> None:
    names = sorted(state_dict)
    if shards == 1:
        torch.save(state_dict, out_dir / "pytorch_model.bin")
        return
    weight_map = {}
    for number in range(shards):
        file = f"pytorch_model-{number + 1:05d}-of-{shards:05d}.bin"
        part = {n: state_dict[n] for n in names[number::shards]}
        torch.save(part, out_dir / file)
        weight_map.update({n: file for n in part})
    (out_dir / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))


def test_weight_file_layouts(tmp_path: Path) -> None:
    hf_model = make_hf_model("phi3")  # fused qkv / gate_up tensors split across shards
    hf_model.save_pretrained(tmp_path / "single")
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    for name, shards in (("bin", 1), ("bin_sharded", 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((tmp_path / "single" / "config.json").read_text())
        _save_bin(state, tmp_path / name, shards)

    reference = None
    for name in ("single", "sharded", "bin", "bin_sharded"):
        hf_to_lit(tmp_path / name, tmp_path / f"lit_{name}")
        weights = load_file(tmp_path / f"lit_{name}" / "model.safetensors")
        if reference is None:
            reference = weights
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[k], reference[k]) for k in weights)

    # and sharded output, with an index transformers can follow
    lit_to_hf(tmp_path / "lit_single", tmp_path / "hf_sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "hf_sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf_sharded", attn_implementation="eager").eval()
    idx = tokens()
    assert_same(hf_logits(reloaded, idx), hf_logits(hf_model, idx))

    # bf16 on request
    hf_to_lit(tmp_path / "single", tmp_path / "lit_bf16", dtype="bfloat16")
    assert load_file(tmp_path / "lit_bf16" / "model.safetensors")["embed.weight"].dtype == torch.bfloat16


def test_tokenizer_files_are_copied(tmp_path: Path) -> None:
    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"bos_token": "<s>"}')
    hf_to_lit(tmp_path / "hf", tmp_path / "lit")
    assert (tmp_path / "lit" / "tokenizer_config.json").is_file()
    lit_to_hf(tmp_path / "lit", tmp_path / "hf2")
    assert (tmp_path / "hf2" / "tokenizer_config.json").read_text() == '{"bos_token": "<s>"}'


def test_lit_shape_mismatch(tmp_path: Path) -> None:
    make_hf_model("llama").save_pretrained(tmp_path / "hf")
    hf_to_lit(tmp_path / "hf", tmp_path / "lit")
    weights = load_file(tmp_path / "lit" / "model.safetensors")
    weights["blocks.0.mlp.fc_1.weight"] = torch.zeros(3, 32)
    save_file(weights, tmp_path / "lit" / "model.safetensors")
    (tmp_path / "lit" / "manifest.json").unlink()  # edited by hand: its manifest would refuse it as damaged
    with pytest.raises(UserError, match=r"blocks\.0\.mlp\.fc_1\.weight.*\(3, 32\).*\(64, 32\)"):
        lit_to_hf(tmp_path / "lit", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("LIT_MODEL_DEBUG", None)
    return subprocess.Popen(
        [sys.executable, "-m", "lit_model.convert", *args],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_cli(tmp_path: Path) -> None:
    """The real entry point in a subprocess: one conversion and one refusal, run side by side."""
    hf_dir = tmp_path / "hf"
    hf_model = make_hf_model("qwen2")
    hf_model.save_pretrained(hf_dir)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("do not delete")
    ok = _cli("hf_to_lit", "--hf_dir", str(hf_dir), "--out_dir", str(tmp_path / "lit"))
    refused = _cli("hf_to_lit", "--hf_dir", str(hf_dir), "--out_dir", str(busy))
    out, err = ok.communicate(timeout=120)
    assert ok.returncode == 0, err
    assert str(tmp_path / "lit") in out and "model.safetensors" in err  # final line; per-shard progress
    with torch.no_grad():
        assert_same(load_gpt(tmp_path / "lit")(tokens()), hf_logits(hf_model, tokens()))
    _, err = refused.communicate(timeout=120)
    assert refused.returncode == 1 and "Traceback" not in err and "--overwrite" in err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


def run_main(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, *args: str) -> tuple[int, str]:
    """``python -m lit_model.convert ARGS`` in this process (saves a torch import per case)."""
    from lit_model import convert

    monkeypatch.setattr(sys, "argv", ["convert.py", *args])
    monkeypatch.delenv("LIT_MODEL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        convert.main()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return exit_info.value.code, " ".join(err.split())


def test_cli_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    hf_dir = tmp_path / "hf"
    make_hf_model("qwen2").save_pretrained(hf_dir)
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    (no_config / "model.safetensors").write_bytes(b"")
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({**SMALL, "model_type": "bert"}))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text((hf_dir / "config.json").read_text())
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("do not delete")
    bad_shape = tmp_path / "bad_shape"
    make_hf_model("qwen2").save_pretrained(bad_shape)
    weights = load_file(bad_shape / "model.safetensors")
    weights["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    save_file(weights, bad_shape / "model.safetensors", metadata={"format": "pt"})

    cases = {
        no_config: "no config.json",
        unsupported: "Supported model types: llama, mistral, gpt_neox, phi, phi3, gemma, gemma2, qwen2",
        no_weights: "looked for model.safetensors.index.json, model.safetensors, pytorch_model.bin.index.json, "
        "pytorch_model.bin",
        bad_shape: "'model.layers.1.self_attn.k_proj.weight' has shape (8, 32) but config.json implies (16, 32)",
    }
    for source, fragment in cases.items():
        args = ("hf_to_lit", "--hf_dir", str(source), "--out_dir", str(tmp_path / "o"))
        code, err = run_main(monkeypatch, capsys, *args)
        assert code == 1 and fragment in err, (source.name, err)
        assert not (tmp_path / "o").exists()

    code, err = run_main(monkeypatch, capsys, "hf_to_lit", "--hf_dir", str(hf_dir), "--out_dir", str(busy))
    assert code == 1 and "--overwrite" in err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    code, err = run_main(monkeypatch, capsys, "lit_to_hf", "--checkpoint_dir", str(hf_dir), "--out_dir", str(busy))
    assert code == 1 and "hf_to_lit" in err  # an HF directory is not a lit checkpoint: says how to convert it
    # with --overwrite the refusal turns into a conversion
    from lit_model import convert

    convert.main(["hf_to_lit", "--hf_dir", str(hf_dir), "--out_dir", str(busy), "--overwrite"])
    assert {"model.safetensors", "model_config.yaml"} <= {p.name for p in busy.iterdir()}
    assert not (busy / "keep.txt").exists()


# config.json as the hub serves it (transformers 4 layout), for the entries whose layout differs most from what
# transformers 5 writes: each must read as its registry entry.
GEMMA3_1B_HUB = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
    "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None,
    "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
    "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "vocab_size": 262144,
}
GEMMA3_4B_HUB = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
    "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144, "mm_tokens_per_image": 256,
    "torch_dtype": "bfloat16",
    "text_config": {"model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240,
                    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
                    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
                    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
                    "rope_local_base_freq": 10000, "rope_theta": 1000000, "vocab_size": 262208},
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152},
}
SMOLLM3_HUB = {
    "architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", "hidden_size": 2048, "intermediate_size": 11008,
    "num_hidden_layers": 36, "num_attention_heads": 16, "num_key_value_heads": 4, "max_position_embeddings": 65536,
    "rope_theta": 5000000.0, "rms_norm_eps": 1e-06, "vocab_size": 128256, "tie_word_embeddings": True,
    "no_rope_layer_interval": 4, "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(36)],
    "use_sliding_window": False, "sliding_window": None, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu",
}
QWEN3_MOE_HUB = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
    "vocab_size": 151936, "tie_word_embeddings": False, "use_sliding_window": False, "sliding_window": None,
    "max_window_layers": 48, "attention_bias": False, "hidden_act": "silu",
}


@pytest.mark.parametrize("hub, name", [(GEMMA3_1B_HUB, "gemma-3-1b-it"), (GEMMA3_4B_HUB, "gemma-3-4b-it"),
                                       (SMOLLM3_HUB, "SmolLM3-3B"), (QWEN3_MOE_HUB, "Qwen3-30B-A3B")])
def test_hub_config_reads_as_the_registry_entry(hub: dict, name: str) -> None:
    config, published = config_from_hf(hub), Config.from_name(name)
    architecture = [f.name for f in fields(Config) if f.name not in ("name", "hf_org", "vocab_size", "extra")]
    assert {f: getattr(config, f) for f in architecture} == {f: getattr(published, f) for f in architecture}
