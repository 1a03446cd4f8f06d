"""The suggestion search and the plan's assumptions, off the committed grid (issue 50): every lever found where it
alone fixes a run, the user's flags that block a fix changed with a note, PagedAdamW8bit's paged verdict, and a
fine-tune planned at its data's longest sample rather than the model's whole context."""

from __future__ import annotations

import dataclasses
import json
import types

import pytest
import torch

from lit_model import Config
from lit_model.data.instruct import padded_length
from lit_model.model.loss import DEFAULT_LOSS_CHUNK_SIZE
from lit_model.io.tokenizer import ByteCountTokenizer, Tokenizer
from lit_model.plan.planner import plan_spec
from lit_model.plan.report import check_plan_fits
from lit_model.plan.search import SUGGESTION_MARGIN, _give_way, suggest_changes
from lit_model.plan.training import plan_training
from lit_model.recipes import finetune
from lit_model.recipes.finetune_dpo import DPOArgs, read_pairs
from lit_model.recipes.finetune_full import FullArgs
from lit_model.recipes.finetune_lora import LoRAArgs
from lit_model.run import resolve_run
from lit_model.core.units import parse_memory

LLAMA_8B = Config.from_name("Llama-3.1-8B")
SMALL = Config.from_name("pythia-410m")
LONG = Config.from_name("SmolLM2-360M")  # a context of 8,192


def full_args(**flags) -> FullArgs:
    return FullArgs(**{"precision": "bf16-true", "micro_batch_size": 2, "global_batch_size": 8,
                       "override_max_seq_length": 2048, "grad_clip": None, "plan": "text", **flags})


# lever -> (what the suggestion's flags start with, the run it alone fixes: trainable, flags, config)
LEVERS = {
    "activation_checkpointing": ("--activation_checkpointing", "full", {}, SMALL),
    "selective checkpointing": ("--activation_checkpointing selective", "full", {}, SMALL),
    "activation_offloading": ("--activation_offloading cpu", "full", {}, SMALL),
    "mlp_tiles": ("--mlp_tiles 4", "full", {"override_max_seq_length": 8192, "micro_batch_size": 1,
                                           "activation_checkpointing": True}, LONG),
    "precision": ("--precision bf16-true", "full", {"precision": "32-true"}, SMALL),
    "micro_batch_size": ("--micro_batch_size 1", "full", {}, SMALL),
    "optimizer 8-bit": ("--optimizer AdamW8bit", "full", {}, SMALL),
    "optimizer 4-bit": ("--optimizer AdamW4bit", "full", {"precision": "32-true"}, SMALL),
    "optimizer GaLore": ("--optimizer GaLore", "full", {}, SMALL),
    "optimizer in backward": ("--optimizer_in_backward", "full", {"micro_batch_size": 1, "global_batch_size": 1,
                                                                  "override_max_seq_length": 256}, LLAMA_8B),
    "quantize": ("--quantize bnb.nf4", "lora", {}, LLAMA_8B),
    "loss_chunk_size": (f"--loss_chunk_size {DEFAULT_LOSS_CHUNK_SIZE}", "full", {"loss_chunk_size": 0}, SMALL),
    "cpu_offload": ("--cpu_offload", "full", {}, LLAMA_8B),
    "fsdp": ("--strategy fsdp", "full", {"devices": 2}, SMALL),
    "devices": ("--devices 2 --strategy fsdp", "full", {}, LLAMA_8B),
    "sequence length": ("--override_max_seq_length 1024", "full", {}, SMALL),
}


@pytest.mark.parametrize("lever", list(LEVERS))
def test_each_lever_alone_is_found(lever):
    """On a device just large enough for the run with that one lever, the search names it (the closed form's search;
    the trace confirms its picks in plan_run)."""
    flag, trainable, flags, config = LEVERS[lever]
    run = resolve_run(full_args(**flags), config, trainable, "cuda", present=False)
    # with unlimited memory every single change "fits": the lever's is among them, and saves memory
    singles = {" ".join(s.flags): s for s in suggest_changes(run, 10**15, limit=100, max_changes=1, engine="analytic")}
    name = next((f for f in singles if f.startswith(flag)), None)
    assert name is not None, (lever, list(singles))
    alone = singles[name].peak_bytes
    assert alone < plan_spec(run, None).peak_bytes, lever
    memory = int(alone / (1 - SUGGESTION_MARGIN)) + 1
    found = [" ".join(s.flags) for s in suggest_changes(run, memory, limit=100, engine="analytic")]
    assert any(f.startswith(flag) for f in found), (lever, found)


TORCHTUNE_8B = dict(micro_batch_size=2, global_batch_size=2, activation_checkpointing=True, compile=True,
                    optimizer="PagedAdamW8bit")  # torchtune's full fine-tune of Llama 3.1 8B on a 24 GB GPU


def test_search_changes_the_user_flags_that_block_a_fix():
    """--cpu_offload is the fix of a full 8B fine-tune on 24 GiB, blocked by the user's PagedAdamW8bit (bitsandbytes
    cannot step FSDP's shards) and --optimizer_in_backward (FSDP averages before any step): the search changes both,
    and says so; a combination in conflict with itself is never offered."""
    for extra in ({}, {"optimizer_in_backward": True}):
        plan = plan_training(LLAMA_8B, full_args(**TORCHTUNE_8B, **extra), device_memory="24GiB", engine="analytic")
        flags = {" ".join(s.flags): s for s in plan.suggestions}
        offload = next(f for f in flags if f.startswith("--cpu_offload --optimizer AdamW"))
        assert ("--optimizer_in_backward false" in offload) == bool(extra), offload
        assert any("cannot be stepped by PagedAdamW8bit" in n for n in flags[offload].notes)
        check_plan_fits(plan)  # exit 0: a fix exists
    run = resolve_run(full_args(**TORCHTUNE_8B), LLAMA_8B, "full", "cuda", present=False)
    changes, notes = _give_way(run, {"activation_offloading": "cpu"})
    assert changes == {"activation_offloading": "cpu", "compile": False} and "compile" in notes[0]
    # its own conflict: a step in backward with the micro batch halved (accumulation) is not undone but skipped
    changes, notes = _give_way(run, {"optimizer_in_backward": True, "micro_batch_size": 1})
    assert changes == {"optimizer_in_backward": True, "micro_batch_size": 1} and not notes
    every = suggest_changes(run, 10**15, limit=1000, engine="analytic")
    assert not any("--optimizer_in_backward" in s.flags and "--micro_batch_size 1" in s.flags for s in every)


def test_paged_optimizer_state_fits_with_a_verdict():
    """torchtune's run (optimizer step in backward): over 24 GiB by less than PagedAdamW8bit's state, so it fits with
    that much paged to host memory (the verdict, the bytes and the estimated slowdown said); over by more, it does not,
    and the search offers the step in backward with the paged note."""
    args = full_args(**TORCHTUNE_8B, optimizer_in_backward=True, grad_clip=0.0)
    plan = plan_training(LLAMA_8B, args, device_memory="24GiB", engine="analytic")
    state = plan.by_category["optimizer_state"]
    assert plan.fits and 0 < plan.paged_bytes == plan.peak_bytes - parse_memory("24GiB") <= state
    text = plan.to_text()
    assert "FITS in" in text and "paged to host memory" in text and "s more per step" in text
    assert json.loads(plan.to_json())["paged_bytes"] == plan.paged_bytes
    check_plan_fits(plan)
    plain = plan_training(LLAMA_8B, full_args(**TORCHTUNE_8B), device_memory="24GiB", engine="analytic")
    assert not plain.fits and plain.paged_bytes == 0 and plain.peak_bytes - plain.device_memory > state
    paged = [s for s in plain.suggestions if "paged to host memory" in "; ".join(s.notes)]
    assert paged and paged[0].flags[0] == "--optimizer_in_backward", [s.flags for s in plain.suggestions]
    assert plain.suggestions.index(paged[0]) > 0  # after the fixes that fit the device whole
    adamw = plan_training(LLAMA_8B, full_args(**{**TORCHTUNE_8B, "optimizer": "AdamW8bit"}, optimizer_in_backward=True,
                                              grad_clip=0.0), device_memory="24GiB", engine="analytic")
    assert not adamw.fits and adamw.paged_bytes == 0  # bitsandbytes' AdamW8bit state is not paged


def test_byte_count_bounds_a_tokenizer(tiny_setup):
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    for text in ("def f(x):\n    return x", "naïve café — ünïcödé ✓ 日本語", "", " " * 50, "\U0001f600" * 3):
        for bos in (None, False):
            assert len(ByteCountTokenizer().encode(text, bos=bos)) >= len(tokenizer.encode(text, bos=bos)), text


def test_a_finetune_plan_reads_its_data_lengths(tiny_checkpoint, tiny_setup, tmp_path):
    """No --override_max_seq_length: the plan's sequence is the data's longest sample as collate pads it (the
    tokenizer's count), not the model's context; without a tokenizer (a model not downloaded: here --model_config),
    the UTF-8 byte count, an upper bound; --packing fills the whole sequence; DPO reads its pairs."""
    data = tmp_path / "data.jsonl"
    records = [{"instruction": "Say hi " * n, "output": "hi " * n} for n in (1, 2, 3, 2)]
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    flags = dict(data_path=data, plan="text", val_split_fraction=0.25, prompt_style="default")  # no template
    args = LoRAArgs(checkpoint_dir=tiny_checkpoint, **flags)
    run = finetune.resolve(args, "lora")
    style = finetune.prompt_style(run, args)
    train = finetune.read_instruct_data(run.replace(seq_len=10**6), args, Tokenizer(tiny_checkpoint), style).train
    assert run.seq_len == padded_length(max(train.lengths), max_length=run.config.block_size)
    assert "longest sample of the data, counted in tokens" in run.seq_len_source
    long_context = tmp_path / "long.yaml"
    long_context.write_text(tiny_setup["config"].read_text().replace("block_size: 64", "block_size: 4096"))
    bound = finetune.resolve(LoRAArgs(model_config=long_context, **flags), "lora")
    assert run.seq_len <= bound.seq_len < 4096 and "UTF-8 bytes" in bound.seq_len_source
    assert bound.seq_len >= padded_length(max(train.lengths))
    plan = plan_training(bound.config, LoRAArgs(model_config=long_context, **flags), trainable="lora",
                         device_type="cpu", engine="analytic", detect=False)
    assert plan.run["seq_length"] == 4096  # the API plans the run it is given
    missing = finetune.resolve(LoRAArgs(model_config=long_context, **{**flags, "data_path": tmp_path / "later.jsonl"}),
                               "lora")
    assert missing.seq_len == 4096 and "does not exist yet" in missing.seq_len_source
    packed = finetune.resolve(LoRAArgs(model_config=long_context, packing=True, **flags), "lora")
    assert packed.seq_len == 4096 and not packed.seq_len_source
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": "Say hi " * n, "chosen": "hi " * n, "rejected": "no"}) + "\n"
                             for n in (1, 2, 3, 2)))
    dpo = finetune.resolve(DPOArgs(model_config=long_context, **{**flags, "data_path": pairs}), "lora", read_pairs)
    assert padded_length(1) <= dpo.seq_len < 4096 and "UTF-8 bytes" in dpo.seq_len_source


def test_auto_micro_batch_is_planned_at_the_data_length(tiny_setup):
    """--micro_batch_size auto in a fine-tune picks the micro batch at the data's longest sample (train or
    validation), not at a cut length of the model's whole context, so it is not smaller than what fits."""
    config = dataclasses.replace(Config.from_file(tiny_setup["config"]), block_size=4096)
    args = LoRAArgs(micro_batch_size="auto", global_batch_size=16, precision="32-true")
    one = plan_spec(resolve_run(args, config, "lora", "cpu").replace(micro_batch_size=1, micro_batch_auto=False), None, "trace")
    args.device_memory = str(int(one.peak_bytes / 0.9 * 1.01))  # micro batches of 1 fit the whole context, 2 do not
    run = resolve_run(args, config, "lora", "cpu")
    fabric = types.SimpleNamespace(print=lambda *a, **k: None, device=torch.device("cpu"))
    data = types.SimpleNamespace(train=types.SimpleNamespace(lengths=[20, 41, 7]), val=types.SimpleNamespace(lengths=[50]))
    chosen = finetune.choose_for_data(fabric, run, args, data)
    at_context = finetune.common.choose_micro_batch_size(fabric, run, args)
    assert not chosen.micro_batch_auto and chosen.seq_len == 4096  # the cut stays; only the choice used the data
    assert chosen.micro_batch_size > max(at_context.micro_batch_size, 1), (chosen.micro_batch_size, at_context.micro_batch_size)
    at_data = finetune.common.choose_micro_batch_size(fabric, run.replace(seq_len=padded_length(50)), args)
    assert chosen.micro_batch_size == at_data.micro_batch_size


def test_a_plan_of_data_the_run_would_stop_on_says_so(tiny_checkpoint, tmp_path):
    """Samples whose prompts fill the whole context: the run would stop on them (no response token left); its plan
    is of the memory at the whole length, with the reason in its note, not that stop."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"instruction": "word " * 200, "output": "hi"}) + "\n" for _ in range(4)))
    run = finetune.resolve(LoRAArgs(checkpoint_dir=tiny_checkpoint, data_path=data, plan="text",
                                    val_split_fraction=0.25), "lora")
    assert run.seq_len == run.config.block_size and "the run would stop on its data" in run.seq_len_source
