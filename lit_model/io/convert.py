"""Convert between Hugging Face ``transformers`` checkpoints and lit-model checkpoint directories.

    python -m lit_model.convert hf_to_lit --hf_dir DIR --out_dir DIR [--overwrite]
    python -m lit_model.convert lit_to_hf --checkpoint_dir DIR --out_dir DIR [--overwrite]

Supported ``model_type`` values: llama (Llama 2/3/3.1/3.2/3.3, TinyLlama, SmolLM2), mistral (7B, Small 3, Nemo),
mixtral, gpt_neox (Pythia), phi (phi-1.5, phi-2), phi3 (Phi-3, Phi-4), gemma, gemma2, gemma3_text, qwen2, qwen3,
qwen3_moe, olmo2 and smollm3; of gemma3 (Gemma 3 4B+, multimodal) the language model, exported as gemma3_text.
``transformers`` itself is not needed: config.json is read as written by transformers 5 (``rope_parameters``) or by
older versions (``rope_theta``/``rope_scaling``, ``rotary_pct``/``rotary_emb_base``), and the weights are read shard
by shard so that at most one copy of the model is in memory.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any, Callable, Iterator, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lit_model.core.config import Config, size_limit_error
from lit_model.core.errors import UsageError, UserError
from lit_model.io.checkpoint import (
    WEIGHTS_NAME,
    SafetensorsReader,
    atomic_directory,
    check_checkpoint_dir,
    check_output_dir,
    check_state_dict,
    save_checkpoint_dir,
)
from lit_model.io.tokenizer import TOKENIZER_FILES
from lit_model.model.gpt import GPT

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "phi": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
# Multimodal checkpoints whose language model converts on its own (its vision tower is left out): model_type ->
# the language model's type. Exported back, it is that text-only model.
_TEXT_PARTS = {"gemma3": "gemma3_text"}
SUPPORTED_TYPES = tuple(ARCHITECTURES) + tuple(_TEXT_PARTS)

# HF weight files, in the order they are looked for.
SAFE_INDEX, SAFE_SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN_SINGLE = "pytorch_model.bin.index.json", "pytorch_model.bin"
WEIGHT_FILE_NAMES = (SAFE_INDEX, SAFE_SINGLE, BIN_INDEX, BIN_SINGLE)

# config.json keys that say nothing about the model and are not carried in Config.extra.
_DROPPED_KEYS = {
    "transformers_version", "_name_or_path", "architectures", "model_type", "dtype", "torch_dtype", "auto_map",
    "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict", "chunk_size_feed_forward",
    "is_encoder_decoder", "problem_type",
}
# Tensors some checkpoints hold that are recomputed, not learned.
_IGNORED_HF_TENSORS = re.compile(r"(rotary_emb\.inv_freq|attention\.masked_bias|attention\.bias)$")

_DEFAULT_TIE = {"gemma": True, "gemma2": True, "gemma3_text": True, "smollm3": True}
_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


# ------------------------------------------------------------------------------------------------
# config.json <-> Config
# ------------------------------------------------------------------------------------------------
_REQUIRED = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# What each config.json key the conversion reads must hold: (what to call it in a message, the check). A value of
# another type is named with its key instead of failing somewhere inside the conversion (float("abc")).
_COUNT = ("a positive integer", lambda v: _is_int(v) and v >= 1)
_KINDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    **dict.fromkeys(("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "max_position_embeddings",
                     "intermediate_size", "moe_intermediate_size", "num_key_value_heads", "head_dim",
                     "num_local_experts", "num_experts", "num_experts_per_tok", "original_max_position_embeddings",
                     "sliding_window", "sliding_window_pattern", "_sliding_window_pattern", "no_rope_layer_interval",
                     "query_pre_attn_scalar"), _COUNT),
    **dict.fromkeys(("max_window_layers", "decoder_sparse_step"), ("an integer", _is_int)),
    **dict.fromkeys(("rope_theta", "rotary_emb_base", "partial_rotary_factor", "rotary_pct", "layer_norm_eps",
                     "rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping", "rope_local_base_freq"),
                    ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))),
    **dict.fromkeys(("tie_word_embeddings", "use_parallel_residual", "attention_bias", "mlp_bias", "qk_layernorm",
                     "use_sliding_window", "norm_topk_prob", "use_bidirectional_attention"),
                    ("true or false", lambda v: isinstance(v, bool))),
    **dict.fromkeys(("hidden_act", "hidden_activation"), ("text", lambda v: isinstance(v, str))),
    **dict.fromkeys(("rope_parameters", "rope_scaling"), ("a mapping", lambda v: isinstance(v, dict))),
    **dict.fromkeys(("layer_types", "no_rope_layers", "mlp_only_layers"), ("a list", lambda v: isinstance(v, list))),
}
# config.json keys that size the model -> the Config field whose limit bounds them (core.config.size_limits)
_SIZE_KEYS = {
    "hidden_size": "n_embd", "num_attention_heads": "n_head", "num_key_value_heads": "n_head",
    "num_hidden_layers": "n_layer", "vocab_size": "padded_vocab_size", "max_position_embeddings": "block_size",
    "original_max_position_embeddings": "block_size", "intermediate_size": "intermediate_size",
    "moe_intermediate_size": "intermediate_size", "head_dim": "head_size", "num_local_experts": "n_expert",
    "num_experts": "n_expert", "num_experts_per_tok": "n_expert_per_token",
}


# config.json settings nest two or three levels; ones kept in Config.extra must fit in model_config.yaml, whose
# writer and reader recurse per level
_MAX_NESTING = 32


def _too_deep(value: Any) -> bool:
    level = [value]
    for _ in range(_MAX_NESTING):
        level = [item for v in level if isinstance(v, (dict, list)) for item in (v.values() if isinstance(v, dict) else v)]
        if not level:
            return False
    return True


def _bad_value(key: str, value: Any, kind: str) -> UserError:
    return UserError(f"config.json: {key!r} is {value!r}, which is not {kind}. The file is damaged or was edited: "
                     "fix it, or download it again from the model's repository.")


def _number(key: str, value: Any) -> float:
    """A number from inside a nested config.json value (``rope_parameters``' factor)."""
    if not _KINDS["rope_theta"][1](value):
        raise _bad_value(key, value, "a number")
    return float(value)


class _Reader:
    """Reads config.json keys, checking each value's type and size, and remembers which ones it read (the rest go
    to ``Config.extra``)."""

    def __init__(self, hf: dict[str, Any]) -> None:
        self.hf = hf
        self.used: set[str] = set()
        self.model_type = hf.get("model_type")

    def __call__(self, key: str, default: Any = _REQUIRED) -> Any:
        self.used.add(key)
        value = self.hf.get(key)
        if value is None:
            if default is _REQUIRED:
                raise UserError(
                    f"config.json of this {self.model_type} model has no {key!r}; it is not a complete "
                    "Hugging Face config. Re-download config.json from the model's repository."
                )
            return default
        kind, check = _KINDS.get(key, ("", lambda v: True))
        if not check(value):
            raise _bad_value(key, value, kind)
        too_large = size_limit_error(_SIZE_KEYS[key], value, f"config.json: {key!r}") if key in _SIZE_KEYS else None
        if too_large:  # before a list per layer or a model is built from it
            raise UserError(f"{too_large}. The file is damaged or was edited: download it again.")
        return value


def _unsupported(model_type: str, what: str) -> UserError:
    return UserError(
        f"This {model_type} checkpoint uses {what}, which lit-model does not implement, so it cannot be converted "
        "without changing the model's outputs. Convert a checkpoint without it."
    )


def _read_rope(get: _Reader, layer_type: Optional[str] = None) -> tuple[float, float, Optional[dict[str, Any]]]:
    """(rope_theta, partial_rotary_factor, scaling) from either config.json layout; ``layer_type`` picks one
    layer type's settings where they are nested per layer type (Gemma 3's global layers)."""
    params = dict(get("rope_parameters", None) or {})
    legacy = dict(get("rope_scaling", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # nested per layer type
        values = list(params.values())
        if layer_type is not None:
            values = [params.get(layer_type) or {}]
        if any(v != values[0] for v in values):
            raise _unsupported(get.model_type, "different RoPE settings per layer type")
        params = dict(values[0])
    merged = {**legacy, **params}
    theta = merged.pop("rope_theta", None)
    if theta is None:
        theta = get("rope_theta", None)
    if theta is None:
        theta = get("rotary_emb_base", 10000.0)
    partial = merged.pop("partial_rotary_factor", None)
    if partial is None:
        partial = get("partial_rotary_factor", None)
    if partial is None:
        partial = get("rotary_pct", 0.25 if get.model_type == "gpt_neox" else 1.0)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    get.used.update(("rope_parameters", "rope_scaling", "rope_theta", "rotary_emb_base", "partial_rotary_factor",
                     "rotary_pct"))
    theta, partial = _number("rope_theta", theta), _number("partial_rotary_factor", partial)
    if rope_type == "default":
        return theta, partial, None
    if rope_type == "linear":
        return theta, partial, {"rope_type": "linear", "factor": _number("factor", merged.get("factor"))}
    if rope_type == "llama3":
        original = merged.get("original_max_position_embeddings") or get("original_max_position_embeddings", None)
        factors = ("factor", "low_freq_factor", "high_freq_factor")
        if original is None or any(merged.get(key) is None for key in factors):
            raise UserError(
                "config.json asks for llama3 RoPE scaling but lacks one of factor, low_freq_factor, "
                "high_freq_factor, original_max_position_embeddings. Fix its rope_parameters/rope_scaling."
            )
        if not _COUNT[1](original):
            raise _bad_value("original_max_position_embeddings", original, _COUNT[0])
        scaling = {"rope_type": "llama3", **{key: _number(key, merged[key]) for key in factors},
                   "original_max_position_embeddings": original}
        return theta, partial, scaling
    raise _unsupported(get.model_type, f"RoPE scaling of type {rope_type!r} (supported: default, linear, llama3)")


def _read_local_rope(get: _Reader, theta: float, scaling: Optional[dict[str, Any]]) -> Optional[float]:
    """Gemma 3: the unscaled RoPE base of the sliding-window layers; None where they use the global tables."""
    params = get("rope_parameters", None) or {}
    if isinstance(params.get("sliding_attention"), dict):
        local = dict(params["sliding_attention"])
        local_type, local_theta = local.get("rope_type", "default"), local.get("rope_theta", 10000.0)
        if local_type == "default" and local.get("partial_rotary_factor", 1.0) != 1.0:
            local_type = "partial rotary"
    else:  # transformers 4 layout
        local_type, local_theta = "default", get("rope_local_base_freq", 10000.0)
    if local_type != "default":
        raise _unsupported(get.model_type, f"RoPE of type {local_type!r} on the sliding-window layers")
    local_theta = _number("rope_theta", local_theta)
    if local_theta == theta and scaling is None:
        return None
    return local_theta


def _read_sliding(get: _Reader, n_layer: int) -> tuple[Optional[int], int, int]:
    """(sliding_window_size, sliding_window_layer_stride, full_attention_every) from ``sliding_window`` and
    ``layer_types``."""
    t = get.model_type
    window = get("sliding_window", None)
    if t in ("qwen2", "qwen3", "qwen3_moe"):
        if not get("use_sliding_window", False):
            get("max_window_layers", None)
            get("layer_types", None)
            return None, 1, 0
        layer_types = get("layer_types", None)
        if layer_types is None:
            first = get("max_window_layers", 0)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layer)]
        else:
            get("max_window_layers", None)
    elif t == "gemma2":
        layer_types = get("layer_types", None)
        if layer_types is None:
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layer)]
    elif t == "gemma3_text":
        layer_types = get("layer_types", None)
        pattern = get("sliding_window_pattern", None) or get("_sliding_window_pattern", 6)
        if layer_types is None:
            layer_types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layer)]
    elif t in ("mistral", "mixtral", "phi3"):
        layer_types = get("layer_types", None) or ["sliding_attention"] * n_layer
    else:
        return None, 1, 0
    if window is None:
        return None, 1, 0
    if len(layer_types) != n_layer:
        raise UserError(f"config.json lists {len(layer_types)} layer_types for {n_layer} layers. Fix config.json.")
    sliding = [kind == "sliding_attention" for kind in layer_types]
    if not any(sliding):
        return None, 1, 0
    if all(sliding):
        return int(window), 1, 0
    if sliding == [i % 2 == 0 for i in range(n_layer)]:
        return int(window), 2, 0
    for every in range(2, n_layer + 1):
        if sliding == [(i + 1) % every != 0 for i in range(n_layer)]:
            return int(window), 1, every
    raise _unsupported(
        t, "sliding-window attention on a layer pattern other than all layers, every other layer or all but every "
        "k-th layer"
    )


def _read_nope(get: _Reader, n_layer: int) -> int:
    """SmolLM3: k where layers k-1, 2k-1, ... have no RoPE (``no_rope_layers``: 1 = RoPE, 0 = none)."""
    if get("use_sliding_window", False):
        get("sliding_window", None)
        raise _unsupported(get.model_type, "sliding-window attention (use_sliding_window=true)")
    get("layer_types", None)
    interval = int(get("no_rope_layer_interval", 4))
    uses_rope = get("no_rope_layers", None)
    if uses_rope is None:
        uses_rope = [int((i + 1) % interval != 0) for i in range(n_layer)]
    if all(uses_rope):
        return 0
    for every in range(1, n_layer + 1):
        if [bool(u) for u in uses_rope] == [(i + 1) % every != 0 for i in range(n_layer)]:
            return every
    raise _unsupported(get.model_type, "layers without RoPE on a pattern other than every k-th layer")


def _text_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The language model's config.json contents where ``hf_config`` describes a multimodal model (Gemma 3 4B+);
    else ``hf_config`` itself."""
    t = hf_config.get("model_type")
    if not isinstance(t, str) or t not in _TEXT_PARTS:
        return hf_config
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        raise UserError(
            f"config.json of this {t} model has no text_config. Re-download it from the model's repository."
        )
    outer = {k: v for k, v in hf_config.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype")}
    return {**outer, **text, "model_type": _TEXT_PARTS[t]}


def _text_tensor_name(hf_name: str) -> Optional[str]:
    """A multimodal checkpoint's language-model tensor under the text-only model's name; None for the rest."""
    for prefix, text_prefix in (("language_model.model.", "model."), ("model.language_model.", "model."),
                                ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head.")):
        if hf_name.startswith(prefix):
            return text_prefix + hf_name[len(prefix):]
    return None


def config_from_hf(hf_config: dict[str, Any]) -> Config:
    """A ``Config`` from the contents of a Hugging Face config.json (of a multimodal model: its language model)."""
    if not isinstance(hf_config, dict):
        raise UserError(f"config.json holds {type(hf_config).__name__}, not a JSON object of settings. Download it "
                        "again from the model's repository.")
    hf_config = _text_config(hf_config)
    t = hf_config.get("model_type")
    if not isinstance(t, str) or t not in ARCHITECTURES:
        raise UserError(
            f"model_type {t!r} in config.json is not supported. Supported model types: "
            f"{', '.join(SUPPORTED_TYPES)}."
        )
    get = _Reader(hf_config)
    if hf_config.get("quantization_config"):
        raise _unsupported(t, "quantized weights (quantization_config)")
    n_embd, n_head, n_layer = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    kw: dict[str, Any] = dict(
        hf_type=t,
        vocab_size=get("vocab_size"),
        block_size=get("max_position_embeddings", 4096),
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
        intermediate_size=get("intermediate_size"),
        tie_embeddings=bool(get("tie_word_embeddings", _DEFAULT_TIE.get(t, False))),
    )
    if t == "gpt_neox":
        kw["n_query_groups"] = n_head
    else:
        kw["n_query_groups"] = get("num_key_value_heads", n_head)
    if t != "gpt_neox":
        kw["head_size"] = get("head_dim", None) or n_embd // n_head
    kw["rope_base"], kw["rotary_percentage"], kw["rope_scaling"] = _read_rope(
        get, "full_attention" if t == "gemma3_text" else None
    )
    if t == "gemma3_text":
        kw["rope_local_base"] = _read_local_rope(get, kw["rope_base"], kw["rope_scaling"])
    kw["sliding_window_size"], kw["sliding_window_layer_stride"], kw["full_attention_every"] = _read_sliding(
        get, n_layer
    )

    if t in ("gpt_neox", "phi"):
        kw.update(norm_class_name="LayerNorm", norm_eps=get("layer_norm_eps", 1e-5), mlp_class_name="GptNeoxMLP")
        act = get("hidden_act", "gelu" if t == "gpt_neox" else "gelu_new")
        if act not in _GELU:
            raise _unsupported(t, f"the activation {act!r} (supported: {', '.join(_GELU)})")
        kw["gelu_approximate"] = _GELU[act]
        kw["bias"] = True
        if t == "gpt_neox":
            if not get("attention_bias", True):
                raise _unsupported(t, "attention layers without bias (attention_bias=false)")
            kw["parallel_residual"] = bool(get("use_parallel_residual", True))
        else:
            if get("qk_layernorm", False):
                raise _unsupported(t, "layer norms on queries and keys (qk_layernorm=true)")
            kw.update(parallel_residual=True, shared_attention_norm=True, lm_head_bias=True)
    else:
        kw["norm_eps"] = get("rms_norm_eps", 1e-6)
        if t in ("gemma", "gemma2", "gemma3_text"):
            act = get("hidden_activation", None) or get("hidden_act", "gelu_pytorch_tanh")
            if t == "gemma" and act == "gelu":  # legacy value of the official Gemma releases; HF does the same
                act = "gelu_pytorch_tanh"
            get("hidden_act", None)
            if act not in _GELU:
                raise _unsupported(t, f"the activation {act!r} (supported: {', '.join(_GELU)})")
            kw.update(
                mlp_class_name="GemmaMLP", gelu_approximate=_GELU[act], norm_unit_offset=True, scale_embeddings=True
            )
        else:
            act = get("hidden_act", "silu")
            if act != "silu":
                raise _unsupported(t, f"the activation {act!r} (supported: silu)")
        if t == "qwen2":
            kw["attn_bias"] = True
        elif t in ("llama", "gemma", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "olmo2", "smollm3"):
            attention_bias, mlp_bias = bool(get("attention_bias", False)), bool(get("mlp_bias", False))
            if t != "llama" and attention_bias:
                raise _unsupported(t, "attention bias (attention_bias=true)")
            if attention_bias != mlp_bias:
                raise _unsupported(t, "bias on the attention but not the MLP layers or vice versa")
            kw["bias"] = attention_bias
        if t in ("qwen3", "qwen3_moe", "gemma3_text"):
            kw["qk_norm"] = "head"
        elif t == "olmo2":
            kw.update(qk_norm="projection", pre_norm=False, post_attention_norm=True, post_mlp_norm=True)
        elif t == "smollm3":
            kw["nope_every"] = _read_nope(get, n_layer)
        if t == "mixtral":
            kw.update(mlp_class_name="LLaMAMoE", n_expert=get("num_local_experts"),
                      n_expert_per_token=get("num_experts_per_tok"), moe_norm_topk=True)
        elif t == "qwen3_moe":
            if get("decoder_sparse_step", 1) != 1 or get("mlp_only_layers", None):
                raise _unsupported(
                    t, "dense MLP layers between the expert layers (decoder_sparse_step, mlp_only_layers)"
                )
            n_expert = get("num_experts", None) or get("num_local_experts")  # the name transformers 5 writes
            kw.update(mlp_class_name="LLaMAMoE", n_expert=n_expert, n_expert_per_token=get("num_experts_per_tok"),
                      moe_norm_topk=bool(get("norm_topk_prob", False)), intermediate_size=get("moe_intermediate_size"))
            get.used.discard("intermediate_size")  # the (unused) dense MLP size: kept in extra for the export
        if t in ("gemma2", "gemma3_text"):
            kw.update(
                post_attention_norm=True,
                post_mlp_norm=True,
                attention_scores_scalar=get("query_pre_attn_scalar", None),
                attention_logit_softcapping=get("attn_logit_softcapping", None),
                final_logit_softcapping=get("final_logit_softcapping", None),
            )
        if hf_config.get("use_bidirectional_attention"):
            raise _unsupported(t, "bidirectional attention")
        get("use_bidirectional_attention", None)
        if t == "phi3" and get("original_max_position_embeddings", None) is not None:
            get.used.discard("original_max_position_embeddings")  # kept in extra: Phi-3 writes it back

    extra = {k: v for k, v in hf_config.items() if k not in get.used and k not in _DROPPED_KEYS}
    deep = next((key for key, value in extra.items() if _too_deep(value)), None)
    if deep is not None:
        raise UserError(f"config.json: {deep!r} nests more than {_MAX_NESTING} levels deep, which no model setting does "
                        "(model_config.yaml could not hold it). The file is damaged or was edited: download it again.")
    try:
        return Config(extra=extra, **kw)
    except ValueError as error:
        raise UserError(f"config.json describes an inconsistent model: {str(error).rstrip('.')}. Fix config.json.") from None


def config_to_hf(config: Config) -> dict[str, Any]:
    """The config.json contents for ``config``; raises UserError if the HF model type cannot express it."""
    t = config.hf_type
    if t not in ARCHITECTURES:
        raise UserError(
            f"This checkpoint's hf_type is {t!r}, which has no Hugging Face conversion. Supported: "
            f"{', '.join(SUPPORTED_TYPES)}. Set hf_type in model_config.yaml to the matching transformers model type."
        )
    hf: dict[str, Any] = {"architectures": [ARCHITECTURES[t]], "model_type": t}
    derived: dict[str, Any] = dict(
        vocab_size=config.padded_vocab_size,
        hidden_size=config.n_embd,
        num_hidden_layers=config.n_layer,
        num_attention_heads=config.n_head,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.block_size,
        tie_word_embeddings=config.tie_embeddings,
    )
    if t != "gpt_neox":
        derived["num_key_value_heads"] = config.n_query_groups
    if (
        t in ("llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text", "qwen2", "qwen3", "qwen3_moe", "smollm3")
        or config.head_size != config.n_embd // config.n_head
    ):
        derived["head_dim"] = config.head_size
    rope: dict[str, Any] = {"rope_theta": config.rope_base, "rope_type": "default"}
    if config.rope_scaling:
        rope.update(config.rope_scaling)
        rope.setdefault("rope_type", "llama3")  # model.py's default
    if config.rotary_percentage != 1.0 or t in ("gpt_neox", "phi", "phi3"):
        rope["partial_rotary_factor"] = config.rotary_percentage
    derived["rope_parameters"] = rope
    if t == "gemma3_text":  # RoPE per layer type: the local layers' own base, unscaled
        local_base = config.rope_local_base
        local = dict(rope) if local_base is None else {"rope_theta": local_base, "rope_type": "default"}
        derived["rope_parameters"] = {"full_attention": rope, "sliding_attention": local}

    if t in ("gpt_neox", "phi"):
        derived["layer_norm_eps"] = config.norm_eps
        act = {"none": "gelu", "tanh": "gelu_new"}.get(config.gelu_approximate, config.gelu_approximate)
        derived["hidden_act"] = act
        if t == "gpt_neox":
            derived.update(use_parallel_residual=config.parallel_residual, attention_bias=config.bias)
        else:
            derived["qk_layernorm"] = False
    else:
        derived["rms_norm_eps"] = config.norm_eps
        if t == "gemma":
            derived["hidden_act"] = "gelu_pytorch_tanh" if config.gelu_approximate == "tanh" else "gelu"
        elif t in ("gemma2", "gemma3_text"):
            derived["hidden_activation"] = "gelu_pytorch_tanh" if config.gelu_approximate == "tanh" else "gelu"
        else:
            derived["hidden_act"] = "silu"
        if t in ("llama", "gemma", "gemma2", "gemma3_text", "qwen3", "qwen3_moe", "olmo2", "smollm3"):
            derived["attention_bias"] = config.bias
        if t in ("llama", "smollm3"):
            derived["mlp_bias"] = config.bias
    window = config.sliding_window_size
    layer_types = [
        "sliding_attention" if config.layer_uses_sliding_window(i) else "full_attention" for i in range(config.n_layer)
    ]
    if t in ("mistral", "mixtral", "phi3"):
        derived["sliding_window"] = window
    elif t in ("gemma2", "gemma3_text"):
        if window is None:  # every layer global: a window as long as the context is the same thing
            window = config.block_size
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.n_layer)]
        derived.update(
            sliding_window=window,
            layer_types=layer_types,
            query_pre_attn_scalar=config.attention_scores_scalar or config.head_size,
            attn_logit_softcapping=config.attention_logit_softcapping,
            final_logit_softcapping=config.final_logit_softcapping,
        )
    elif t in ("qwen2", "qwen3", "qwen3_moe"):
        derived.update(
            use_sliding_window=window is not None,
            sliding_window=window,
            max_window_layers=0 if window is not None else config.n_layer,
            layer_types=layer_types,
        )
    if t == "mixtral":
        derived.update(num_local_experts=config.n_expert, num_experts_per_tok=config.n_expert_per_token)
    elif t == "qwen3_moe":
        derived.update(
            num_experts=config.n_expert,
            num_experts_per_tok=config.n_expert_per_token,
            norm_topk_prob=config.moe_norm_topk,
            moe_intermediate_size=config.intermediate_size,
            intermediate_size=config.extra.get("intermediate_size", config.intermediate_size),  # dense size, unused
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if t == "smollm3":
        # the list decides; the interval is only HF's default for building that list
        derived.update(
            use_sliding_window=False, no_rope_layers=[int(config.layer_uses_rope(i)) for i in range(config.n_layer)]
        )
        if config.nope_every:
            derived["no_rope_layer_interval"] = config.nope_every
    hf.update({k: v for k, v in config.extra.items() if k not in derived and k not in _DROPPED_KEYS})
    hf.update(derived)

    # Anything the HF model type cannot express shows up as a difference after a round trip.
    back = config_from_hf(hf)
    differences = [
        f"{f.name}={getattr(config, f.name)!r} (as {t}: {getattr(back, f.name)!r})"
        for f in fields(Config)
        if f.name not in ("name", "hf_org", "vocab_size", "extra", "hf_type")
        and _canonical(config, f.name) != _canonical(back, f.name)
    ]
    if differences:
        raise UserError(
            f"This model cannot be written as a Hugging Face {t!r} model: {'; '.join(differences)}. "
            "Set hf_type in model_config.yaml to the model type it was converted from."
        )
    return hf


def _canonical(config: Config, name: str) -> Any:
    value = getattr(config, name)
    if name == "rope_scaling" and value:
        numbers = {k: float(v) for k, v in value.items() if k != "rope_type"}
        return {**numbers, "rope_type": value.get("rope_type", "llama3")}
    if name == "gelu_approximate" and config.mlp_class_name == "LLaMAMLP":
        return None
    if name == "attention_scores_scalar" and value == config.head_size:
        return None
    if name == "sliding_window_size" and value is not None and value >= config.block_size:
        return None
    if name in ("sliding_window_layer_stride", "full_attention_every") and (
        config.sliding_window_size is None or config.sliding_window_size >= config.block_size
    ):
        return 1 if name == "sliding_window_layer_stride" else 0
    if name == "rope_local_base" and value == config.rope_base and not config.rope_scaling:
        return None
    return value


# ------------------------------------------------------------------------------------------------
# Weight names
# ------------------------------------------------------------------------------------------------
_LLAMA_LAYER = {
    "norm_1": "input_layernorm",
    "attn.query": "self_attn.q_proj",
    "attn.key": "self_attn.k_proj",
    "attn.value": "self_attn.v_proj",
    "attn.proj": "self_attn.o_proj",
    "norm_2": "post_attention_layernorm",
    "mlp.fc_1": "mlp.gate_proj",
    "mlp.fc_2": "mlp.up_proj",
    "mlp.proj": "mlp.down_proj",
}
_LAYER_MODULES: dict[str, dict[str, str]] = {
    "llama": _LLAMA_LAYER,
    "mistral": _LLAMA_LAYER,
    "qwen2": _LLAMA_LAYER,
    "gemma": _LLAMA_LAYER,
    "gemma2": {
        **_LLAMA_LAYER,
        "post_attention_norm": "post_attention_layernorm",
        "norm_2": "pre_feedforward_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    },
    "smollm3": _LLAMA_LAYER,
    "qwen3": {**_LLAMA_LAYER, "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"},
    "olmo2": {
        **{lit: hf for lit, hf in _LLAMA_LAYER.items() if not lit.startswith("norm_")},
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
        "post_attention_norm": "post_attention_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
    },
    "phi3": {"norm_1": "input_layernorm", "attn.proj": "self_attn.o_proj", "norm_2": "post_attention_layernorm",
             "mlp.proj": "mlp.down_proj"},
    "phi": {
        "norm_1": "input_layernorm",
        "attn.query": "self_attn.q_proj",
        "attn.key": "self_attn.k_proj",
        "attn.value": "self_attn.v_proj",
        "attn.proj": "self_attn.dense",
        "mlp.fc": "mlp.fc1",
        "mlp.proj": "mlp.fc2",
    },
    "gpt_neox": {
        "norm_1": "input_layernorm",
        "norm_2": "post_attention_layernorm",
        "attn.proj": "attention.dense",
        "mlp.fc": "mlp.dense_h_to_4h",
        "mlp.proj": "mlp.dense_4h_to_h",
    },
}
_MLP_NAMES = ("mlp.fc_1", "mlp.fc_2", "mlp.proj")
_LAYER_MODULES["mixtral"] = {
    **{lit: hf for lit, hf in _LLAMA_LAYER.items() if lit not in _MLP_NAMES}, "mlp.gate": "block_sparse_moe.gate"
}
_LAYER_MODULES["qwen3_moe"] = {
    **{lit: hf for lit, hf in _LAYER_MODULES["qwen3"].items() if lit not in _MLP_NAMES}, "mlp.gate": "mlp.gate"
}
# Each expert's SwiGLU layers (lit: mlp.experts.<e>.<name>), the HF name formatted with the expert's number.
_EXPERT_MODULES = {
    "mixtral": {"fc_1": "block_sparse_moe.experts.{}.w1", "fc_2": "block_sparse_moe.experts.{}.w3",
                "proj": "block_sparse_moe.experts.{}.w2"},
    "qwen3_moe": {"fc_1": "mlp.experts.{}.gate_proj", "fc_2": "mlp.experts.{}.up_proj",
                  "proj": "mlp.experts.{}.down_proj"},
}
_LAYER_MODULES["gemma3_text"] = {
    **_LAYER_MODULES["gemma2"], "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"
}
# Fused HF modules: hf module -> the lit modules it holds, in order.
_FUSED: dict[str, dict[str, tuple[str, ...]]] = {
    "phi3": {"self_attn.qkv_proj": ("attn.query", "attn.key", "attn.value"),
             "mlp.gate_up_proj": ("mlp.fc_1", "mlp.fc_2")},
    "gpt_neox": {"attention.query_key_value": ("attn.query", "attn.key", "attn.value")},
}


def _top_level(t: str) -> dict[str, str]:
    if t == "gpt_neox":
        return {"embed": "gpt_neox.embed_in", "norm_f": "gpt_neox.final_layer_norm", "lm_head": "embed_out"}
    return {"embed": "model.embed_tokens", "norm_f": "model.final_layernorm" if t == "phi" else "model.norm",
            "lm_head": "lm_head"}


def _layer_prefix(t: str) -> str:
    return "gpt_neox.layers." if t == "gpt_neox" else "model.layers."


class WeightMap:
    """Renames, splits and fuses tensors between the lit and HF layouts of one model."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.t = config.hf_type
        self.top = _top_level(self.t)
        self.top_back = {hf: lit for lit, hf in self.top.items()}
        if self.t == "gpt_neox":
            self.top_back["lm_head"] = "lm_head"  # transformers 5 may write the head as lm_head
        self.layer = dict(_LAYER_MODULES[self.t])
        for e in range(config.n_expert):
            self.layer.update({f"mlp.experts.{e}.{lit}": hf.format(e) for lit, hf in _EXPERT_MODULES[self.t].items()})
        self.layer_back = {hf: lit for lit, hf in self.layer.items()}
        self.fused = _FUSED.get(self.t, {})
        self.fused_of = {lit: hf for hf, parts in self.fused.items() for lit in parts}
        self.prefix = _layer_prefix(self.t)
        self._layer_re = re.compile(rf"^{re.escape(self.prefix)}(\d+)\.(.+)\.(weight|bias)$")
        self._lit_layer_re = re.compile(r"^blocks\.(\d+)\.(.+)\.(weight|bias)$")

    def _sizes(self, parts: tuple[str, ...]) -> list[int]:
        c = self.config
        sizes = {"attn.query": c.n_head * c.head_size, "attn.key": c.n_query_groups * c.head_size,
                 "attn.value": c.n_query_groups * c.head_size, "mlp.fc_1": c.intermediate_size,
                 "mlp.fc_2": c.intermediate_size}
        return [sizes[p] for p in parts]

    # ---- HF -> lit ------------------------------------------------------------------------
    def to_lit(self, hf_name: str, tensor: torch.Tensor) -> Optional[list[tuple[str, torch.Tensor]]]:
        """The lit tensors made from one HF tensor; None if the name is not part of this layout."""
        module, _, param = hf_name.rpartition(".")
        if module in self.top_back and param in ("weight", "bias"):
            return [(f"{self.top_back[module]}.{param}", tensor)]
        match = self._layer_re.match(hf_name)
        if match is None:
            return None
        i, module, param = match.groups()
        if module in self.layer_back:
            return [(f"blocks.{i}.{self.layer_back[module]}.{param}", tensor)]
        if module in self.fused:
            parts = self.fused[module]
            if self.t == "gpt_neox":
                c = self.config
                pieces = tensor.reshape(c.n_head, 3, c.head_size, *tensor.shape[1:]).unbind(1)
                pieces = [p.reshape(c.n_head * c.head_size, *tensor.shape[1:]) for p in pieces]
            else:
                pieces = tensor.split(self._sizes(parts), dim=0)
            return [(f"blocks.{i}.{lit}.{param}", piece.clone()) for lit, piece in zip(parts, pieces)]
        return None

    # ---- lit -> HF ------------------------------------------------------------------------
    def to_hf(self, lit_names: list[str], get: Callable[[str], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """HF tensors in lit order; ``get`` loads a lit tensor by name (lazily, e.g. from safe_open)."""
        done: set[str] = set()
        for name in lit_names:
            if name == "lm_head.weight" and self.config.tie_embeddings:
                continue
            module, _, param = name.rpartition(".")
            if module in self.top:
                yield f"{self.top[module]}.{param}", get(name)
                continue
            match = self._lit_layer_re.match(name)
            if match is None:
                raise UserError(f"The checkpoint holds a tensor {name!r} that has no Hugging Face counterpart.")
            i, module, param = match.groups()
            if module in self.layer:
                yield f"{self.prefix}{i}.{self.layer[module]}.{param}", get(name)
                continue
            if module not in self.fused_of:
                raise UserError(f"The checkpoint holds a tensor {name!r} that has no Hugging Face counterpart.")
            hf_module = self.fused_of[module]
            hf_name = f"{self.prefix}{i}.{hf_module}.{param}"
            if hf_name in done:
                continue
            done.add(hf_name)
            pieces = [get(f"blocks.{i}.{lit}.{param}") for lit in self.fused[hf_module]]
            if self.t == "gpt_neox":
                c = self.config
                rest = pieces[0].shape[1:]
                stacked = torch.stack([p.reshape(c.n_head, c.head_size, *rest) for p in pieces], dim=1)
                yield hf_name, stacked.reshape(c.n_head * 3 * c.head_size, *rest)
            else:
                yield hf_name, torch.cat(pieces, dim=0)


# ------------------------------------------------------------------------------------------------
# Reading HF checkpoints
# ------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise UserError(f"Could not read {path}: {error}. Re-download or fix the file.") from None


def _inside(name: Any) -> bool:
    """Whether an index entry names a file inside the checkpoint's directory: judged on the text, not on the
    resolved path, because Hugging Face's cache links a snapshot's files to blobs elsewhere."""
    if not isinstance(name, str) or not name or "\\" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def hf_weight_files(hf_dir: Path) -> list[Path]:
    """The weight files of an HF checkpoint directory, in shard order."""
    for index_name, single_name in ((SAFE_INDEX, SAFE_SINGLE), (BIN_INDEX, BIN_SINGLE)):
        index = hf_dir / index_name
        if index.is_file():
            data = _read_json(index)
            weight_map = data.get("weight_map") if isinstance(data, dict) else None
            if not isinstance(weight_map, dict) or not weight_map:
                raise UserError(f"{index} has no weight_map. Re-download it from the model's repository.")
            outside = [name for name in weight_map.values() if not _inside(name)]
            if outside:
                raise UserError(
                    f"{index} points at weight files outside {hf_dir} (e.g. {outside[0]!r}); a weight_map names files "
                    "in the checkpoint's own directory. The index is damaged or was tampered with: download it again."
                )
            files = [hf_dir / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise UserError(
                    f"{index} lists {len(files)} weight files but {len(missing)} are missing from {hf_dir} "
                    f"(e.g. {missing[0]}). Download all shards."
                )
            return files
        if (hf_dir / single_name).is_file():
            return [hf_dir / single_name]
    for pattern in ("model-*-of-*.safetensors", "pytorch_model-*-of-*.bin"):
        shards = sorted(hf_dir.glob(pattern))
        if shards:
            return shards
    present = sorted(p.name for p in hf_dir.iterdir())
    raise UserError(
        f"{hf_dir} holds no Hugging Face weight files: looked for {', '.join(WEIGHT_FILE_NAMES)} and shards named "
        f"model-*-of-*.safetensors or pytorch_model-*-of-*.bin (found: {', '.join(present) or 'nothing'}). "
        "Download the weights into that directory."
    )


def _iter_shard(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one weight file, one at a time."""
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise UserError(f"Could not read {path}: {error}. The file is damaged; download it again.") from None
        return
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)  # legacy (non-zip) format
    except Exception as error:  # noqa: BLE001 - any unpickling failure means a bad file
        raise UserError(f"Could not read {path}: {error}. The file is damaged; download it again.") from None
    if not isinstance(state, dict):
        raise UserError(f"{path} does not hold a state dict of tensors. Download the weights again.")
    for name in list(state):
        yield name, state.pop(name)


def _parse_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).replace("torch.", ""), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise UsageError(f"--dtype {dtype!r} is not a floating point torch dtype. Use float32, bfloat16 or float16.")
    return value


def _check_out_dir(out_dir: Path, overwrite: bool, source: Path) -> None:
    """Before any weight is read: ``out_dir`` is not the input, can be written, and is empty unless ``overwrite``."""
    if out_dir.resolve() == source.resolve():
        raise UsageError(f"--out_dir {out_dir} is the input directory. Choose a different output directory.")
    check_output_dir(out_dir, overwrite, inputs=(source,))


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _name_from_registry(config: Config, name: str) -> None:
    """Name the config after its directory; a published model's registry entry also gives the organisation
    and the tokenizer's vocabulary size (HF's vocab_size is the padded embedding size)."""
    config.name = name
    try:
        known = Config.from_name(name)
    except UsageError:
        return
    if (known.hf_type, known.padded_vocab_size, known.n_layer, known.n_embd) == (
        config.hf_type, config.padded_vocab_size, config.n_layer, config.n_embd
    ):
        config.hf_org, config.vocab_size = known.hf_org, known.vocab_size


def hf_to_lit(hf_dir: str, out_dir: str, overwrite: bool = False, dtype: Optional[str] = None) -> Path:
    """Convert a Hugging Face checkpoint directory into a lit-model checkpoint directory.

    Args:
        hf_dir: Directory with config.json and model.safetensors / sharded safetensors / pytorch_model*.bin.
        out_dir: Where to write model.safetensors, model_config.yaml and the tokenizer files.
        overwrite: Replace out_dir if it exists and is not empty.
        dtype: Store the weights in this dtype (e.g. bfloat16); default: as in the HF checkpoint.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    target_dtype = _parse_dtype(dtype)
    if not hf_dir.is_dir():
        state = "is a file, not a directory" if hf_dir.exists() else "does not exist"
        raise UserError(f"--hf_dir {hf_dir} {state}. Pass the directory a Hugging Face model was saved to.")
    if not (hf_dir / "config.json").is_file():
        raise UserError(
            f"--hf_dir {hf_dir} has no config.json, so it is not a Hugging Face model directory. Pass the directory "
            "that holds config.json and the model's weight files."
        )
    hf_config = _read_json(hf_dir / "config.json")
    config = config_from_hf(hf_config)
    multimodal = hf_config.get("model_type") in _TEXT_PARTS
    _name_from_registry(config, hf_dir.resolve().name)
    _check_out_dir(out_dir, overwrite, hf_dir)
    files = hf_weight_files(hf_dir)

    weight_map = WeightMap(config)
    model = GPT.on_meta(config)
    expected_lit = {name: t.shape for name, t in model.state_dict().items()}
    if config.tie_embeddings:
        expected_lit.pop("lm_head.weight", None)
    meta_state = model.state_dict()
    expected_hf = {hf: tuple(t.shape) for hf, t in weight_map.to_hf(list(expected_lit), meta_state.__getitem__)}
    head_names = {f"{_top_level(config.hf_type)['lm_head']}.weight", "lm_head.weight"}

    state_dict: dict[str, torch.Tensor] = {}
    tied_head: Optional[torch.Tensor] = None
    for number, path in enumerate(files, 1):
        count = 0
        for hf_name, tensor in _iter_shard(path):
            if multimodal:
                hf_name = _text_tensor_name(hf_name)
                if hf_name is None:  # the vision tower and its projector
                    continue
            if _IGNORED_HF_TENSORS.search(hf_name):
                continue
            if not tensor.is_floating_point():
                raise UserError(
                    f"{path}: tensor {hf_name!r} holds {tensor.dtype} values, where a model's weights are floating "
                    "point (an integer-quantized or damaged checkpoint). Download the original floating-point weights."
                )
            if config.tie_embeddings and hf_name in head_names:
                tied_head = tensor  # only used if the checkpoint lacks the embedding
                continue
            expected_name = hf_name
            if config.hf_type == "gpt_neox" and hf_name == "lm_head.weight":
                expected_name = "embed_out.weight"
            if expected_name not in expected_hf:
                raise UserError(
                    f"{path} holds a tensor {hf_name!r} that a {config.hf_type} model with this config.json has no "
                    "place for. The weights and config.json belong to different models."
                )
            if tuple(tensor.shape) != expected_hf[expected_name]:
                raise UserError(
                    f"{path}: tensor {hf_name!r} has shape {tuple(tensor.shape)} but config.json implies "
                    f"{expected_hf[expected_name]}. The weights and config.json belong to different models; "
                    "download matching files."
                )
            for lit_name, lit_tensor in weight_map.to_lit(hf_name, tensor) or []:
                if target_dtype is not None:
                    lit_tensor = lit_tensor.to(target_dtype)
                state_dict[lit_name] = lit_tensor
            count += 1
        _log(f"[{number}/{len(files)}] read {count} tensors from {path.name}")
    if config.tie_embeddings and "embed.weight" not in state_dict and tied_head is not None:
        state_dict["embed.weight"] = tied_head if target_dtype is None else tied_head.to(target_dtype)
    missing = sorted(set(expected_lit) - set(state_dict))
    if missing:
        hf_missing = sorted(hf for hf, _ in weight_map.to_hf(missing, meta_state.__getitem__)) or missing
        raise UserError(
            f"The weights in {hf_dir} lack {len(hf_missing)} tensors that config.json calls for, e.g. "
            f"{', '.join(hf_missing[:3])}. Download all weight files of the model."
        )
    check_state_dict(model, state_dict, source=str(hf_dir))
    save_checkpoint_dir(state_dict, config, out_dir, tokenizer_dir=hf_dir, overwrite=overwrite)
    print(f"Saved a lit-model checkpoint of {hf_dir} ({config.hf_type}) to {out_dir}")
    return out_dir


# ------------------------------------------------------------------------------------------------
# Writing HF checkpoints
# ------------------------------------------------------------------------------------------------
def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), flags=re.IGNORECASE)
        if match is None:
            raise UsageError(f"--max_shard_size {size!r} is not a size. Use bytes or e.g. 500MB, 5GB.")
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        value = int(float(match.group(1)) * units[(match.group(2) or "").upper()])
    if value < 1:
        raise UsageError(f"--max_shard_size {size!r} must be at least 1 byte; e.g. 500MB or 5GB.")
    return value


def lit_to_hf(
    checkpoint_dir: str, out_dir: str, overwrite: bool = False, max_shard_size: Union[int, str] = "5GB"
) -> Path:
    """Convert a lit-model checkpoint directory into one ``transformers.AutoModelForCausalLM`` can load.

    Args:
        checkpoint_dir: A lit-model checkpoint (model.safetensors + model_config.yaml).
        out_dir: Where to write config.json, model.safetensors (or shards + index) and the tokenizer files.
        overwrite: Replace out_dir if it exists and is not empty.
        max_shard_size: Split the weights into shards of at most this size (bytes, or e.g. "5GB").
    """
    checkpoint_dir, out_dir = check_checkpoint_dir(checkpoint_dir), Path(out_dir)
    limit = _parse_size(max_shard_size)
    config = Config.from_checkpoint(checkpoint_dir)
    hf_config = config_to_hf(config)
    _check_out_dir(out_dir, overwrite, checkpoint_dir)


    weights_path = checkpoint_dir / WEIGHTS_NAME
    model = GPT.on_meta(config)
    try:
        handle = safe_open(str(weights_path), framework="pt", device="cpu")
        names = list(handle.keys())
        # a dtype SafetensorsReader does not know (U16, U32, ...) is no floating-point one either
        shapes = {n: torch.empty(handle.get_slice(n).get_shape(), device="meta",
                                 dtype=SafetensorsReader.DTYPES.get(handle.get_slice(n).get_dtype(), torch.uint8))
                  for n in names}
        dtypes = {handle.get_slice(n).get_dtype() for n in names}
    except (SafetensorError, OSError) as error:
        raise UserError(f"Could not read {weights_path}: {error}. The file is damaged; re-create it.") from None
    check_state_dict(model, shapes, source=str(weights_path))
    order = [n for n in model.state_dict() if n in shapes]
    weight_map = WeightMap(config)
    with handle as f, atomic_directory(out_dir, overwrite) as tmp_dir:
        shards = _write_shards(weight_map.to_hf(order, f.get_tensor), tmp_dir, limit)
        hf_config["dtype"] = _hf_dtype(dtypes)
        (tmp_dir / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        for name in TOKENIZER_FILES:
            if (checkpoint_dir / name).is_file():
                shutil.copy2(checkpoint_dir / name, tmp_dir / name)
    print(f"Saved a Hugging Face {config.hf_type} checkpoint ({shards} weight file(s)) of {checkpoint_dir} "
          f"to {out_dir}")
    return out_dir


def _hf_dtype(dtypes: set[str]) -> str:
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    floating = [names[d] for d in dtypes if d in names]
    return floating[0] if len(set(floating)) == 1 else "float32"


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, limit: int) -> int:
    """Write HF tensors to safetensors files of at most ``limit`` bytes (a larger tensor gets its own)."""
    written: list[tuple[Path, list[str]]] = []
    current: dict[str, torch.Tensor] = {}
    current_bytes = total = 0

    def flush() -> None:
        path = out_dir / f".shard-{len(written) + 1}.safetensors"
        save_file({k: v.contiguous() for k, v in current.items()}, str(path), metadata={"format": "pt"})
        written.append((path, list(current)))
        _log(f"wrote shard {len(written)} ({len(current)} tensors, {current_bytes / 1e6:.1f} MB)")
        current.clear()

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > limit:
            flush()
            current_bytes = 0
        current[name] = tensor
        current_bytes += size
        total += size
    if current or not written:
        flush()
    if len(written) == 1:
        written[0][0].rename(out_dir / SAFE_SINGLE)
        return 1
    weight_map = {}
    for number, (path, names) in enumerate(written, 1):
        final = f"model-{number:05d}-of-{len(written):05d}.safetensors"
        path.rename(out_dir / final)
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / SAFE_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return len(written)


COMMANDS = {"hf_to_lit": hf_to_lit, "lit_to_hf": lit_to_hf}

