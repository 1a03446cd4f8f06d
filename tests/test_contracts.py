"""The memory contracts (lit_model/model/contracts.py): every module class a model holds, under every method,
publishes one, and what the contracts add up to (plan/closed_form.py) is what a built model holds. The closed form
against the trace: tests/test_memory_plan.py (test_trace_agrees_with_analytic)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch
import torch.nn as nn

from lit_model.core.config import Config, known_names
from lit_model.methods.adapter import AdapterConfig, apply_adapter
from lit_model.methods.lora import LoRAConfig, apply_lora
from lit_model.model.gpt import GPT, contract_of, default_dtype
from lit_model.parallel.dims import resolve_parallel_dims
from lit_model.plan.closed_form import model_bytes, param_counts
from lit_model.plan.modules import quantize_model_sim
from lit_model.run import Run

METHODS = ("full", "lora", "dora", "adapter", "qlora")


def families() -> list[Config]:
    """One published config per kind of MLP, norm and q/k norm, cut to two blocks (the classes are all there)."""
    kinds: dict[tuple, Config] = {}
    for name in known_names():
        config = Config.from_name(name)
        kinds.setdefault((config.mlp_class_name, config.norm_class_name, config.qk_norm, config.norm_unit_offset),
                         config)
    return [dataclasses.replace(config, n_layer=2) for config in kinds.values()]


def lora_config(method: str, config: Config) -> LoRAConfig:
    return LoRAConfig(r=4, dropout=0.0, key=True, projection=True, mlp=True, head=not config.tie_embeddings,
                      dora=method == "dora")


def build(config: Config, method: str, dtype: torch.dtype = torch.float32, seq_len: Optional[int] = None) -> GPT:
    """The model a run of ``method`` trains, on the meta device (QLoRA: the planner's bitsandbytes stand-in)."""
    with default_dtype(dtype):
        model = GPT.on_meta(config)
        if seq_len is not None:
            model.max_seq_length = seq_len
        if method == "qlora":
            quantize_model_sim(model, "bnb.nf4")
        if method in ("lora", "dora", "qlora"):
            apply_lora(model, lora_config(method, config))
        if method == "adapter":
            apply_adapter(model, AdapterConfig(prompt_length=3, start_layer=1))
    return model


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("config", families(), ids=lambda config: config.name)
def test_every_module_class_has_a_contract(config, method):
    model = build(config, method)
    missing = {type(module).__qualname__ for module in model.modules() if contract_of(type(module)) is None}
    assert not missing, f"module classes without a memory contract: {sorted(missing)}"


def test_a_module_class_without_a_contract_is_found():
    assert contract_of(nn.GRU) is None


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("tie", [True, False])
def test_the_contracts_add_up_to_the_model(method, tie):
    """Parameter and buffer bytes (quantization state included) the contracts add up to = the built model's."""
    config = Config(name="tiny", block_size=256, vocab_size=1000, n_layer=3, n_embd=128, n_head=4, n_query_groups=2,
                    intermediate_size=344, tie_embeddings=tie, bias=not tie, lm_head_bias=not tie,
                    norm_class_name="RMSNorm" if tie else "LayerNorm", qk_norm="head" if tie else None)
    seq_len = 64
    model = build(config, method, torch.bfloat16, seq_len)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert param_counts(config).total == sum(p.numel() for p in GPT.on_meta(config).parameters())

    trainable = "full" if method == "full" else "adapter" if method == "adapter" else "lora"
    run = Run(config=config, precision="bf16-true", device_type="cuda", devices=1, num_nodes=1,
              parallel=resolve_parallel_dims("auto", 1, 1, False, "FULL_SHARD"), micro_batch_size=1,
              global_batch_size=1, seq_len=seq_len, trainable=trainable,
              lora=lora_config(method, config) if trainable == "lora" else None,
              adapter=AdapterConfig(prompt_length=3, start_layer=1) if trainable == "adapter" else None,
              quantize="bnb.nf4" if method == "qlora" else None)
    planned = model_bytes(run)
    assert planned.params + planned.quant_state == held
    assert planned.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
