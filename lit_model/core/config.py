"""One dataclass that describes every supported decoder architecture.

Published configurations live in ``lit_model/core/configs/*.yaml`` (one file per family); ``Config.from_name``
looks them up by the Hugging Face repo name, with or without the organisation.
"""

from __future__ import annotations

import copy
import difflib
import math
import typing
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Optional

import yaml

from lit_model.core.errors import UsageError

CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(UsageError, ValueError):
    """A Config field of the wrong type or out of range. Also a ValueError, so code that builds a Config from a
    file the user did not write as one (a Hugging Face config.json) can report it as that file's fault."""


@dataclass
class Config:
    name: str = ""
    hf_org: str = ""  # Hugging Face organisation of the published checkpoint ("" for project configs)
    hf_type: str = "llama"  # transformers `model_type` this architecture converts to and from
    block_size: int = 4096  # longest context the model supports
    vocab_size: int = 50254  # tokenizer vocabulary
    padded_vocab_size: Optional[int] = None  # embedding rows (vocab padded for speed); None: vocab_size
    n_layer: int = 16
    n_embd: int = 4096
    n_head: int = 32
    head_size: Optional[int] = None  # None: n_embd // n_head
    n_query_groups: Optional[int] = None  # key/value heads; None: n_head (multi-head attention)
    # Positional encoding
    rotary_percentage: float = 1.0  # fraction of each head that gets rotary embeddings (GPT-NeoX, Phi)
    rope_base: float = 10000.0
    rope_scaling: Optional[dict[str, Any]] = None  # Llama 3.1 style {"factor", "low_freq_factor", ...}
    # Block layout
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm(x)) instead of sequential
    shared_attention_norm: bool = False  # parallel residual with one norm for both branches (Phi)
    post_attention_norm: bool = False  # extra norms after attention / MLP output (Gemma 2)
    post_mlp_norm: bool = False
    # Linear layers
    bias: bool = False  # bias on every linear layer except the head
    attn_bias: bool = False  # bias on query/key/value only (Qwen2)
    lm_head_bias: bool = False
    tie_embeddings: bool = False
    # Normalisation
    norm_class_name: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    norm_eps: float = 1e-5
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight) (Gemma)
    # MLP
    mlp_class_name: Literal["GptNeoxMLP", "LLaMAMLP", "GemmaMLP", "LLaMAMoE"] = "LLaMAMLP"
    intermediate_size: Optional[int] = None  # None: 4 * n_embd (LLaMAMoE: each expert's)
    # Mixture of experts (LLaMAMoE: Mixtral, Qwen3-MoE): n_expert SwiGLU experts, n_expert_per_token chosen per
    # token by a router; their softmax probabilities renormalised to sum to 1 (Mixtral) or not (moe_norm_topk=False)
    n_expert: int = 0
    n_expert_per_token: int = 0
    moe_norm_topk: bool = True
    gelu_approximate: str = "none"  # "tanh" for gelu_new / gelu_pytorch_tanh
    # Attention and output variants
    scale_embeddings: bool = False  # multiply embeddings by sqrt(n_embd) (Gemma)
    attention_scores_scalar: Optional[int] = None  # scores scaled by 1/sqrt(this) instead of head_size
    attention_logit_softcapping: Optional[float] = None
    final_logit_softcapping: Optional[float] = None
    sliding_window_size: Optional[int] = None  # local attention window
    sliding_window_layer_stride: int = 1  # 1: every layer is local; 2: every other layer (Gemma 2)
    # k > 0: with a window, layers k-1, 2k-1, ... attend globally and the others locally (Gemma 3: 6, i.e. 5:1);
    # replaces sliding_window_layer_stride
    full_attention_every: int = 0
    rope_local_base: Optional[float] = None  # RoPE base of the sliding-window layers, unscaled (Gemma 3)
    nope_every: int = 0  # k > 0: layers k-1, 2k-1, ... use no positional encoding at all (SmolLM3: 4)
    # RMSNorm of queries and keys before RoPE: "head" normalises each head (Qwen3, Gemma 3), "projection" the
    # whole query/key projection (OLMo 2)
    qk_norm: Optional[Literal["head", "projection"]] = None
    pre_norm: bool = True  # norms before attention and MLP; False: only the post norms (OLMo 2)
    extra: dict[str, Any] = field(default_factory=dict)  # family-specific HF fields kept for export

    def __post_init__(self) -> None:
        # Every construction path (--model_config, the registry, a checkpoint, conversion) lands here, so a
        # bad value is named before a model of the wrong shape is built.
        check_types(self)
        if self.padded_vocab_size is None:
            self.padded_vocab_size = self.vocab_size
        if self.head_size is None:
            if self.n_embd % self.n_head:
                raise ConfigError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}: each head gets "
                                 "n_embd / n_head channels. Change one of them, or give head_size.")
            self.head_size = self.n_embd // self.n_head
        if self.n_query_groups is None:
            self.n_query_groups = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        check_ranges(self)
        self.rope_n_elem = int(self.rotary_percentage * self.head_size)

    @property
    def hf_name(self) -> str:
        return f"{self.hf_org}/{self.name}" if self.hf_org else self.name

    def layer_uses_sliding_window(self, layer_idx: int) -> bool:
        if self.sliding_window_size is None:
            return False
        if self.full_attention_every:
            return (layer_idx + 1) % self.full_attention_every != 0
        return layer_idx % self.sliding_window_layer_stride == 0

    def layer_uses_rope(self, layer_idx: int) -> bool:
        return not (self.nope_every and (layer_idx + 1) % self.nope_every == 0)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> "Config":
        """Look up a published configuration by HF repo name (``org/name`` or ``name``)."""
        registry = _registry()
        key = name.split("/")[-1]
        if key not in registry:
            close = difflib.get_close_matches(key, list(registry), n=5, cutoff=0.4)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise UsageError(
                f"Unknown model name {name!r}.{hint} Run `python -m lit_model.config` to list all "
                f"{len(registry)} known names, or pass --model_config with a YAML of Config fields."
            )
        org = name.split("/")[0] if "/" in name else None
        entry = copy.deepcopy(registry[key])
        if org is not None and entry.get("hf_org") and org != entry["hf_org"]:
            raise UsageError(
                f"{name!r}: the registry knows {key!r} as {entry['hf_org']}/{key}, not under {org!r}."
            )
        entry.update(overrides)
        return cls(**entry)

    @classmethod
    def from_file(cls, path: str | Path, **overrides: Any) -> "Config":
        path = Path(path)
        if not path.is_file():
            raise UsageError(f"Model config {str(path)!r} does not exist: pass a YAML file of Config fields.")
        try:
            data = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as error:
            raise UsageError(f"{path} is not valid YAML ({_first_line(error)}). Write one `field: value` per line.") from None
        except RecursionError:  # a file nested thousands of levels deep; no Config field nests more than two
            raise UsageError(f"{path} nests too deeply to be a model config. Write one `field: value` per line.") from None
        if not isinstance(data, dict) or not data:
            # An empty file would otherwise give the defaults: a 3.4B-parameter model nobody asked for.
            raise UsageError(
                f"{path} holds no Config fields ({'empty' if data is None else type(data).__name__}). Write a mapping "
                "such as `n_layer: 4`, `n_embd: 256`, `n_head: 4`, `block_size: 512`, `vocab_size: 8192`, or pass "
                "--model_name (python -m lit_model.config lists the known ones)."
            )
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            close = {k: difflib.get_close_matches(str(k), [f.name for f in fields(cls)], n=1) for k in unknown}
            hints = "".join(f" {k!r}: did you mean {v[0]!r}?" for k, v in close.items() if v)
            raise UsageError(f"{path}: unknown Config fields {sorted(map(str, unknown))}.{hints}")
        data.update(overrides)
        try:
            return cls(**data)
        except ConfigError as error:
            raise ConfigError(f"{path}: {error}") from None

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, **overrides: Any) -> "Config":
        return cls.from_file(Path(checkpoint_dir) / "model_config.yaml", **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def save(self, checkpoint_dir: str | Path) -> None:
        path = Path(checkpoint_dir) / "model_config.yaml"
        path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def sequence_length(config: Config, override: Optional[int]) -> int:
    """The training sequence length for ``--override_max_seq_length``; one rule for training and --plan."""
    if override is None:
        return config.block_size
    if not 1 <= override <= config.block_size:
        raise UsageError(
            f"--override_max_seq_length {override} is outside 1..{config.block_size}, the context "
            f"{config.name or 'this model'} supports. Use a value of at most {config.block_size}."
        )
    return override


# ---- validation: every field's type, then the ranges and the relations between fields -----------------------
def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


@lru_cache(maxsize=1)
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(Config)


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is typing.Union:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " (or null)"
    return {int: "an integer", float: "a number", bool: "true or false", str: "text", dict: "a mapping"}.get(
        origin or hint, str(hint))


def _matches(value: Any, hint: Any) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return any(_matches(value, a) for a in args)
    if origin is Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is float:  # an integer is a fine number; a bool is not
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin or hint)


def check_types(config: Config) -> None:
    for name, hint in _field_types().items():
        value = getattr(config, name)
        if not _matches(value, hint):
            fix = ""
            if isinstance(value, str) and hint in (float, Optional[float]):
                fix = " (YAML reads a number like 1e-5 as text: write 1.0e-5)"
            raise ConfigError(f"Config field {name}: {value!r} is not {_type_name(hint)}{fix}.")


# field -> smallest allowed value; None (where the type allows it) means "derived" or "off"
_AT_LEAST = {
    "block_size": 1, "vocab_size": 1, "padded_vocab_size": 1, "n_layer": 1, "n_embd": 1, "n_head": 1,
    "head_size": 1, "n_query_groups": 1, "intermediate_size": 1, "attention_scores_scalar": 1,
    "sliding_window_size": 1, "sliding_window_layer_stride": 1,
}
_POSITIVE = ("rope_base", "norm_eps", "attention_logit_softcapping", "final_logit_softcapping")


# How far a size may exceed the registry's largest: room for the next generation of models, while a file that asks
# for 10^9 layers or a 10^12-token vocabulary is refused before anything is built from it.
SIZE_HEADROOM = 4
# The fields that decide how much a model allocates (and how long building it takes); n_query_groups divides
# n_head, so it is bounded by n_head's limit
SIZE_FIELDS = ("block_size", "vocab_size", "padded_vocab_size", "n_layer", "n_embd", "n_head", "head_size",
               "intermediate_size", "n_expert", "n_expert_per_token")


@lru_cache(maxsize=1)
def size_limits() -> dict[str, tuple[int, str]]:
    """Each size field's largest allowed value and the registry model it derives from: SIZE_HEADROOM times the
    largest value any published config gives the field."""
    largest: dict[str, tuple[int, str]] = {}
    for model, entry in _registry().items():
        for name in SIZE_FIELDS:
            value = entry.get(name)
            if isinstance(value, int) and value > largest.get(name, (0, ""))[0]:
                largest[name] = (value, model)
    return {name: (value * SIZE_HEADROOM, model) for name, (value, model) in largest.items()}


def size_limit_error(name: str, value: Any, what: str) -> Optional[str]:
    """The reason ``value`` is too large for the size field ``name`` (``what`` names where it came from), or None."""
    limit, model = size_limits().get(name, (math.inf, ""))
    if value <= limit:
        return None
    return (f"{what}: {value} is larger than any model lit-model builds ({name} at most {limit}, {SIZE_HEADROOM}x "
            f"that of the largest published model, {model})")


def check_ranges(config: Config) -> None:
    for name, least in _AT_LEAST.items():
        value = getattr(config, name)
        if value is not None and value < least:
            raise ConfigError(f"Config field {name}: {value} must be at least {least}.")
    for name in SIZE_FIELDS:
        value = getattr(config, name)
        error = size_limit_error(name, value, f"Config field {name}") if value is not None else None
        if error:
            raise ConfigError(f"{error}. Check the value; the file may be damaged.")
    for name in _POSITIVE:
        value = getattr(config, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"Config field {name}: {value} must be a positive number.")
    if config.padded_vocab_size < config.vocab_size:
        raise ConfigError(f"Config field padded_vocab_size={config.padded_vocab_size} is smaller than "
                         f"vocab_size={config.vocab_size}: the embedding needs a row per token.")
    if config.n_head % config.n_query_groups:
        raise ConfigError(f"n_head={config.n_head} is not divisible by n_query_groups={config.n_query_groups}: "
                         "each key/value head serves the same number of query heads.")
    if not 0.0 <= config.rotary_percentage <= 1.0:
        raise ConfigError(f"Config field rotary_percentage: {config.rotary_percentage} must be in [0, 1].")
    if int(config.rotary_percentage * config.head_size) % 2:
        raise ConfigError(f"rotary_percentage={config.rotary_percentage} x head_size={config.head_size} gives an odd "
                         "number of rotary channels; RoPE rotates channel pairs. Pick values whose product is even.")
    if config.gelu_approximate not in ("none", "tanh"):
        raise ConfigError(f"Config field gelu_approximate: {config.gelu_approximate!r} must be none or tanh.")


@lru_cache(maxsize=1)
def _registry() -> dict[str, dict[str, Any]]:
    """Every published config, keyed by name. Each YAML file holds a list of entries; an entry may
    name a ``base`` entry (earlier in any file) whose fields it inherits and overrides."""
    registry: dict[str, dict[str, Any]] = {}
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        for entry in yaml.safe_load(path.read_text()) or []:
            entry = dict(entry)
            base = entry.pop("base", None)
            if base is not None:
                if base not in registry:
                    raise ValueError(f"{path}: {entry['name']!r} names base {base!r}, which no earlier entry defines")
                entry = {**copy.deepcopy(registry[base]), **entry}
            if entry["name"] in registry:
                raise ValueError(f"{path}: duplicate config name {entry['name']!r}")
            registry[entry["name"]] = entry
    return registry


def known_names() -> list[str]:
    return sorted(_registry())


def cli(argv: list[str]) -> None:
    """``python -m lit_model.config``: every known model name."""
    if argv:
        raise UsageError(f"python -m lit_model.config takes no arguments (got {' '.join(argv)}): it lists every known "
                         "model name.")
    for model_name in known_names():
        print(Config.from_name(model_name).hf_name)

