"""LoRA, QLoRA and the LLaMA-Adapter as modules, the merge, and the instruction data pipeline (in process)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from conftest import ROOT
from lit_model import GPT, Config
from lit_model.io.checkpoint import save_checkpoint_dir
from lit_model.core.errors import UsageError, UserError
from lit_model.methods.lora import LORA_WEIGHTS, LoRAConfig, apply_lora, merge
from lit_model.recipes.finetune import gather_trainable
from lit_model.methods.load import load_gpt
from lit_model.methods.objective import CausalLM, mean_loss

CONFIG = Config(name="unit", block_size=32, vocab_size=128, n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
                intermediate_size=128, bias=True)


def tiny_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    model = GPT(Config(**{**CONFIG.to_dict(), "padded_vocab_size": None, **overrides}))
    model.init_weights()
    return model


def randomize_lora(model: GPT) -> None:
    """LoRA starts with B = 0 (no change); give B values so the update is visible."""
    generator = torch.Generator().manual_seed(1)
    for name, parameter in model.named_parameters():
        if name.endswith("lora_B"):
            parameter.data = torch.randn(parameter.shape, generator=generator) * 0.1


def test_only_lora_parameters_train_and_the_start_is_exactly_the_base_model():
    model = tiny_model()
    idx = torch.randint(0, 128, (2, 16))
    before = model(idx)
    config = LoRAConfig(r=4, key=True, projection=True, mlp=True, head=True, dropout=0.0)
    layers = apply_lora(model, config)
    assert len(layers) == 2 * 7 + 1  # query, key, value, proj, fc_1, fc_2, mlp.proj per block + lm_head
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert torch.equal(model(idx), before)
    # names of the base weights do not change (checkpoints load into a LoRA model and back)
    assert "blocks.0.attn.query.weight" in model.state_dict() and "blocks.0.attn.query.lora_A" in model.state_dict()
    mean_loss(CausalLM(), model, (idx, idx)).backward()
    assert all((p.grad is not None) == p.requires_grad for p in model.parameters())


def test_lora_bias_makes_the_adapted_biases_trainable_only():
    model = tiny_model()
    apply_lora(model, LoRAConfig(r=2, bias=True))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "blocks.0.attn.query.bias" in trainable and "blocks.0.attn.key.bias" not in trainable


def test_merge_gives_the_logits_of_the_unmerged_model(tmp_path):
    base = tiny_model()
    save_checkpoint_dir(base.state_dict(), base.config, tmp_path / "ckpt")
    config = LoRAConfig(r=4, alpha=8, mlp=True, projection=True, bias=True, dropout=0.1)
    apply_lora(base, config)
    randomize_lora(base)
    with torch.no_grad():
        base.blocks[0].attn.query.bias.add_(0.5)  # a "trained" bias
    save_file(gather_trainable(base), str(tmp_path / "ckpt" / LORA_WEIGHTS))
    config.save(tmp_path / "ckpt")
    idx = torch.randint(0, 128, (2, 16))
    expected = base.eval()(idx)

    proc = subprocess.run([sys.executable, "-m", "lit_model.lora", "merge", "--checkpoint_dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    merged = load_gpt(tmp_path / "ckpt")
    torch.testing.assert_close(merged(idx), expected, atol=1e-5, rtol=1e-5)
    assert LoRAConfig.from_dir(tmp_path / "ckpt").merged
    with pytest.raises(UserError, match="already merged"):
        merge(tmp_path / "ckpt")


@pytest.mark.parametrize("mode", ["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8"])
def test_qlora_trains_only_the_adapter_over_a_quantized_base(mode):
    from lit_model.methods.quantize import is_quantized, quantize_model, quantized_nbytes

    model = tiny_model(bias=False)
    full_bytes = sum(p.numel() * p.element_size() for b in model.blocks for p in b.parameters())
    quantize_model(model, mode, torch.float32)
    apply_lora(model, LoRAConfig(r=4, mlp=True))
    query = model.blocks[0].attn.query
    assert is_quantized(query) and type(query).__name__.startswith("LoRA")
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    idx = torch.randint(0, 128, (2, 16))
    losses = []
    for _ in range(3):
        loss = mean_loss(CausalLM(), model, (idx, idx))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)
    base_bytes = sum(quantized_nbytes(b) for b in model.blocks) - sum(
        p.numel() * p.element_size() for n, p in model.blocks.named_parameters() if "lora_" in n or "norm" in n
    )
    assert base_bytes < full_bytes / (3 if mode == "bnb.int8" else 5)  # 4x (int8) / ~7x (4-bit) smaller



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lora_layer_computes_the_published_formula_with_the_same_dropout_draws(dtype):
    """base(x) + scaling * B(A(dropout(x))): on the CPU the dropout's 1/(1-p) rides on the scale and the sum is one
    addmm. Against the formula in float64 with F.dropout's mask (the same random draws), its values and gradients
    are as close as the formula's own in ``dtype``."""
    from lit_model.kernels.policy import kernel_policy
    from lit_model.core.classes import mixed_class
    from lit_model.methods.lora import LoRALayer

    F = torch.nn.functional
    torch.manual_seed(0)
    config = LoRAConfig(r=4, alpha=8, dropout=0.25)
    layer = mixed_class(LoRALayer, torch.nn.Linear)(16, 24, dtype=dtype)
    layer._init_lora(config, dtype)
    layer.kernel_policy = kernel_policy("cpu")  # as apply_lora hands it the model's
    torch.nn.init.normal_(layer.lora_B)
    x = torch.randn(3, 5, 16, dtype=dtype)

    def formula(x, weight, bias, a, b, keep):
        return F.linear(x, weight, bias) + F.linear(F.linear(x * keep / 0.75, a), b) * config.scaling

    for training in (True, False):
        layer.train(training)
        torch.manual_seed(1)
        keep = torch.empty_like(x).bernoulli_(0.75) if training else torch.full_like(x, 0.75)
        assert not training or ((keep == 0).any() and (keep == 1).any())
        grad = torch.randn(3, 5, 24, dtype=dtype)
        results = {}
        for name in ("layer", "formula", "float64"):
            wide = torch.float64 if name == "float64" else dtype
            inputs = [t.detach().to(wide).requires_grad_() for t in (x, layer.lora_A, layer.lora_B)]
            if name == "layer":
                torch.manual_seed(1)
                inputs[1:] = [layer.lora_A, layer.lora_B]
                out = layer(inputs[0])
            else:
                out = formula(inputs[0], layer.weight.to(wide), layer.bias.to(wide), *inputs[1:], keep.to(wide))
            results[name] = [out, *torch.autograd.grad(out, inputs, grad.to(wide))]
        for got, formula_value, exact in zip(results["layer"], results["formula"], results["float64"]):
            error = (got.double() - exact).abs().max().item()
            assert error <= 2 * (formula_value.double() - exact).abs().max().item() + 1e-6


def test_dropout_linear_is_f_dropouts_map_and_keeps_the_input_and_a_boolean_mask_on_the_cpu():
    from lit_model.kernels.ops import dropout_linear

    x = (torch.randn(64, 256) + 3).requires_grad_(True)  # no zeros of its own
    weight = torch.randn(8, 256, requires_grad=True)
    grad = torch.randn(64, 8)
    torch.manual_seed(0)
    expected = torch.nn.functional.linear(torch.nn.functional.dropout(x, 0.1, training=True), weight)
    expected_grads = torch.autograd.grad(expected, (x, weight), grad)
    saved = []
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out, factor = dropout_linear(x, weight, 0.1, unscaled=True)
    assert factor == pytest.approx(1 / 0.9)
    torch.testing.assert_close(out * factor, expected, rtol=1e-4, atol=1e-4)  # scaled after the sum, not before
    for got, want in zip(torch.autograd.grad(out * factor, (x, weight), grad), expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # backward keeps x itself, the weight and a boolean mask: no masked copy, no mask of x's dtype
    assert sorted((str(t.dtype), tuple(t.shape)) for t in saved) == sorted(
        [("torch.float32", (64, 256)), ("torch.bool", (64, 256)), ("torch.float32", (8, 256))])
    assert saved[0] is x
    mask = saved[1]
    assert 0.05 < (~mask).float().mean().item() < 0.15
    # no dropout: the plain map; CUDA's policy: F.dropout itself, unscaled
    torch.testing.assert_close(dropout_linear(x, weight, 0.0, unscaled=True)[0], x @ weight.t())
    torch.manual_seed(0)
    out, factor = dropout_linear(x, weight, 0.1, unscaled=False)
    assert factor == 1.0 and torch.equal(out, expected)
    # autocast: the masked input's cast and a boolean mask
    saved.clear()
    with torch.autocast("cpu", torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        dropout_linear(x, weight, 0.1, unscaled=True)
    assert sorted(str(t.dtype) for t in saved if t.shape == x.shape) == ["torch.bfloat16", "torch.bool"]


@pytest.mark.slow
def test_compiled_lora_blocks_with_dropout_train_to_finite_numbers():
    """--compile with LoRA dropout: torch 2.13's CPU inductor gave NaN for the in-place bernoulli_ of the CPU's
    dropout (a LoRA fine-tune lost its first step); compiled code takes F.dropout, the same in distribution."""
    model = tiny_model()
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.05))
    randomize_lora(model)
    model.train()
    for block in model.blocks:
        block.compile()
    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = mean_loss(CausalLM(), model, (idx, idx))
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads)


def test_bad_lora_settings_are_usage_errors():
    with pytest.raises(UsageError, match="positive integer"):
        LoRAConfig(r=0)
    with pytest.raises(UsageError, match="No layer to adapt"):
        LoRAConfig(query=False, value=False)
    with pytest.raises(UsageError, match="tie_embeddings"):
        apply_lora(tiny_model(tie_embeddings=True), LoRAConfig(head=True))


def test_adapter_starts_as_the_base_model_and_travels_with_its_checkpoint(tmp_path):
    from lit_model.methods.adapter import AdapterAttention, AdapterConfig, apply_adapter

    model = tiny_model()
    idx = torch.randint(0, 128, (2, 16))
    before = model(idx)
    config = AdapterConfig(prompt_length=3, start_layer=1)
    apply_adapter(model, config)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        "blocks.1.attn.adapter_prefix", "blocks.1.attn.adapter_gate"}
    assert torch.equal(model(idx), before)  # the gate starts at zero
    with torch.no_grad():
        model.blocks[1].attn.adapter_gate.fill_(0.5)
    after = model.eval()(idx)
    assert not torch.allclose(after, before)

    directory = tmp_path / "adapter-ckpt"
    state = {n: p for n, p in model.state_dict().items() if "adapter_" not in n}
    save_checkpoint_dir(state, model.config, directory)
    save_file({n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, str(directory / "adapter.safetensors"))
    config.save(directory)
    loaded = load_gpt(directory)
    assert isinstance(loaded.blocks[1].attn, AdapterAttention) and not isinstance(loaded.blocks[0].attn, AdapterAttention)
    torch.testing.assert_close(loaded(idx), after)
    with pytest.raises(UsageError, match="start_layer"):
        apply_adapter(tiny_model(), AdapterConfig(start_layer=5))


# ---- instruction data ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from conftest import STDLIB
    from lit_model.io.tokenizer import train_bpe

    return train_bpe([STDLIB / "textwrap.py", STDLIB / "shlex.py"], 400, tmp_path_factory.mktemp("tok") / "tokenizer")


def test_prompt_tokens_are_masked_and_contribute_no_loss(tokenizer):
    from lit_model.data.instruct import build_dataset, collate
    from lit_model.io.prompts import PromptStyle

    style = PromptStyle.from_name("alpaca")
    records = [("r0", {"instruction": "Say hi.", "output": "hi there"}),
               ("r1", {"messages": [{"role": "user", "content": "One?"}, {"role": "assistant", "content": "1"},
                                    {"role": "user", "content": "Two?"}, {"role": "assistant", "content": "2"}]})]
    dataset, cut, dropped = build_dataset(records, tokenizer, style, seq_length=200, mask_prompt=True)
    assert (cut, dropped) == (0, 0)
    eos = tokenizer.decode([tokenizer.eos_id])
    input_ids, targets = dataset[0]
    assert tokenizer.decode(targets[targets != -100]) == "hi there" + style.end + eos
    assert tokenizer.decode(input_ids[: int((targets == -100).sum()) + 1]) == style.apply("Say hi.")
    _, chat_targets = dataset[1]
    trained = tokenizer.decode(chat_targets[chat_targets != -100])
    assert trained == "1" + style.end + "2" + style.end + eos

    # the model's loss is the mean over the response tokens only: changing what the prompt positions would
    # have to predict (their targets are -100) changes nothing
    model = tiny_model(vocab_size=tokenizer.vocab_size, block_size=256)
    batch_ids, batch_targets = collate([dataset[0], dataset[1]])
    assert batch_ids.shape == batch_targets.shape and (batch_targets[0, len(dataset[0][1]):] == -100).all()
    longest = max(len(dataset[0][0]), len(dataset[1][0]))
    assert batch_ids.shape[1] == -(-longest // 64) * 64 and (batch_ids[0, len(dataset[0][0]):] == 0).all()  # to a multiple of 64
    assert collate([dataset[0]], max_length=len(dataset[0][0]))[0].shape[1] == len(dataset[0][0])  # not past the context
    logits = model(batch_ids)
    keep = batch_targets != -100
    manual = torch.nn.functional.cross_entropy(logits[keep], batch_targets[keep])
    torch.testing.assert_close(mean_loss(CausalLM(), model, (batch_ids, batch_targets)), manual)

    unmasked, _, _ = build_dataset(records, tokenizer, style, seq_length=200, mask_prompt=False)
    assert (unmasked[0][1] != -100).all()


def test_truncation_is_reported_and_an_empty_result_is_an_error(tokenizer, tmp_path):
    from lit_model.data.instruct import build_dataset, load_instruct_data
    from lit_model.io.prompts import PromptStyle

    style = PromptStyle.from_name("alpaca")
    records = [(f"r{i}", {"instruction": "x " * 40, "output": "y"}) for i in range(4)]
    dataset, cut, dropped = build_dataset(records, tokenizer, style, seq_length=20, mask_prompt=True)
    assert (len(dataset), cut, dropped) == (0, 4, 4)
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for _, r in records))
    with pytest.raises(UserError, match="--override_max_seq_length"):
        load_instruct_data(path, tokenizer, style, seq_length=20)


@pytest.mark.parametrize(
    "content, needle",
    [
        ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": \n', "Line 2 of"),
        ('{"instruction": "a", "output": "b"}\n{"instruction": "a", "reply": "b"}\n', "line 2 of .* has keys \\['instruction', 'reply'\\]"),
        ('[{"instruction": "a", "output": "b"}, {"prompt": "a"}]', "record 1 of .* has keys \\['prompt'\\]"),
        ('{"messages": [{"role": "user", "content": "a"}]}\n{"instruction": "a", "output": "b"}\n', "no 'assistant' message"),
    ],
)
def test_bad_records_name_the_place_and_the_fix(tokenizer, tmp_path, content, needle):
    from lit_model.data.instruct import load_instruct_data
    from lit_model.io.prompts import PromptStyle

    path = tmp_path / ("data.json" if content.startswith("[") else "data.jsonl")
    path.write_text(content)
    with pytest.raises(UserError, match=needle):
        load_instruct_data(path, tokenizer, PromptStyle.from_name("alpaca"), seq_length=64)


def test_length_grouped_batches_do_not_depend_on_the_number_of_processes():
    from lit_model.data.instruct import LengthGroupedSampler

    lengths = [int(n) for n in torch.randint(1, 100, (50,), generator=torch.Generator().manual_seed(0))]

    def micro_batches(world_size: int, step: int) -> list[list[int]]:
        batches = []
        for rank in range(world_size):
            sampler = LengthGroupedSampler(lengths, 8, 2, rank, world_size, seed=3, start_step=step)
            iterator = iter(sampler)
            batches += [next(iterator) for _ in range(sampler.accumulation_steps)]
        return sorted(batches)

    for step in (0, 7):
        single = micro_batches(1, step)
        assert single == micro_batches(2, step) == micro_batches(4, step)
        # grouped: within a step, the micro batches are consecutive runs of the length-sorted batch
        flat = sorted((i for batch in single for i in batch), key=lambda i: (-lengths[i], i))
        assert sorted(flat[i : i + 2] for i in range(0, 8, 2)) == single

