"""finetune/dpo.py end to end on a tiny checkpoint: LoRA-DPO and adapter-DPO (the reference is the base with its
adapters off) and full DPO (the reference's log-probabilities computed once and cached, verified and rebuilt), what
is logged and saved, exact resume, the plan, --packing (the unpacked run's metrics, less padding), and one clear
message for bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import read_metrics
from test_finetune import make_checkpoint, run

METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, Path]:
    """A tiny checkpoint and 60 preference pairs: the right sum chosen, a wrong one rejected."""
    from lit_model.io.tokenizer import train_bpe
    from conftest import STDLIB

    root = tmp_path_factory.mktemp("dpo")
    train_bpe([STDLIB / f"{n}.py" for n in ("textwrap", "shlex", "fnmatch", "string")], 512, root / "tokenizer")
    make_checkpoint(root / "base", root / "tokenizer")
    records = [{"prompt": f"Add {a} and {b}.", "chosen": str(a + b), "rejected": str(a + b + 1 + b % 3)}
               for a in range(10) for b in range(6)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"root": root, "base": root / "base", "data": root / "pairs.jsonl", "cache": root / "cache"}


def losses(out_dir: Path) -> list[dict[str, str]]:
    """metrics.csv less what timing and memory make differ between runs."""
    return [{k: v for k, v in row.items() if k not in ("tokens_per_sec", "peak_memory_bytes")}
            for row in read_metrics(out_dir)]


def dpo(pairs: dict[str, Path], out_dir: Path, *extra: str, cache: Path | None = None):
    args = ["--checkpoint_dir", pairs["base"], "--data_path", pairs["data"], "--out_dir", out_dir,
            "--micro_batch_size", "2", "--global_batch_size", "4", "--max_steps", "6", "--log_interval", "1",
            "--eval_interval", "3", "--eval_iters", "2", "--warmup_steps", "1", "--learning_rate", "0.01",
            "--val_split_fraction", "0.1", *extra]
    return run("finetune/dpo.py", *args, cache=cache or pairs["cache"])


@pytest.fixture(scope="module")
def lora_dpo(pairs) -> Path:
    out = pairs["root"] / "lora"
    proc = dpo(pairs, out, "--save_interval", "2", "--keep_last", "10", "--lora_dropout", "0")
    assert proc.returncode == 0, proc.stderr
    assert "reference: the model with its LoRA adapters off" in proc.stdout and "step 6/6" in proc.stdout
    return out


def test_lora_dpo_starts_at_ln2_logs_trls_metrics_and_saves_the_merged_model(lora_dpo):
    rows = read_metrics(lora_dpo)
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    # the adapters start at zero: the policy is its reference, every pair's loss is ln 2 and every reward 0
    assert float(rows[0]["train_loss"]) == pytest.approx(math.log(2), abs=1e-4)
    assert float(rows[0]["rewards/margins"]) == pytest.approx(0.0, abs=1e-4)
    for name in METRICS:
        assert all(row[name] for row in rows), name
        assert rows[2][f"val_{name}"] and rows[5][f"val_{name}"], name
    # six steps at a learning rate of 0.01 move the validation pairs' margins the chosen way
    assert float(rows[5]["val_loss"]) < math.log(2) and float(rows[5]["val_rewards/margins"]) > 0
    final = lora_dpo / "final"
    for name in ("model.safetensors", "lora.safetensors", "lora.yaml", "prompt_style.yaml", "tokenizer.json"):
        assert (final / name).is_file(), name
    assert load_file(str(final / "lora.safetensors"))
    summary = json.loads((lora_dpo / "summary.json").read_text())
    assert summary["method"] == "dpo (lora)" and summary["steps"] == 6


def test_lora_dpo_resume_gives_exactly_the_uninterrupted_losses(pairs, lora_dpo, tmp_path):
    interrupted = tmp_path / "interrupted"
    shutil.copytree(lora_dpo, interrupted)
    for path in ("checkpoints/step-00000004", "checkpoints/step-00000006", "final"):  # died after step 2's save
        shutil.rmtree(interrupted / path)
    (interrupted / "summary.json").unlink()
    proc = dpo(pairs, interrupted, "--save_interval", "2", "--keep_last", "10", "--lora_dropout", "0",
               "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    assert losses(interrupted) == losses(lora_dpo)


def test_full_dpo_computes_the_reference_once_and_rebuilds_a_damaged_cache(pairs, tmp_path):
    cache = tmp_path / "cache"
    first = dpo(pairs, tmp_path / "a", "--method", "full", "--max_steps", "2", cache=cache)
    assert first.returncode == 0, first.stderr
    assert "Computing the reference's log-probabilities of the 54 train pairs" in first.stdout
    rows = read_metrics(tmp_path / "a")
    assert float(rows[0]["train_loss"]) == pytest.approx(math.log(2), abs=1e-4)  # the policy starts as its reference
    files = sorted((cache / "reference").glob("*.f32"))
    assert len(files) == 2  # train and validation pairs

    second = dpo(pairs, tmp_path / "b", "--method", "full", "--max_steps", "2", cache=cache)
    assert second.returncode == 0, second.stderr
    assert "Computing" not in second.stdout and second.stdout.count("from the cache") == 2
    assert losses(tmp_path / "b") == losses(tmp_path / "a")

    damaged = bytearray(files[0].read_bytes())
    damaged[:4] = b"\x00\x00\xc0\x7f"  # a NaN where a log-probability was
    files[0].write_bytes(bytes(damaged))
    third = dpo(pairs, tmp_path / "c", "--method", "full", "--max_steps", "2", cache=cache)
    assert third.returncode == 0, third.stderr
    assert "rebuilding it" in third.stderr and "Computing" in third.stdout
    assert losses(tmp_path / "c") == losses(tmp_path / "a")


ADAPTER = ("--method", "adapter", "--adapter_start_layer", "1", "--adapter_prompt_length", "4")
ADAPTER_KEYS = {"blocks.1.attn.adapter_prefix", "blocks.1.attn.adapter_gate"}


@pytest.fixture(scope="module")
def adapter_dpo(pairs) -> Path:
    out = pairs["root"] / "adapter"
    proc = dpo(pairs, out, *ADAPTER, "--max_steps", "2", "--eval_interval", "2", "--save_interval", "1")
    assert proc.returncode == 0, proc.stderr
    assert "reference: the model with its adapter prefixes off" in proc.stdout and "step 2/2" in proc.stdout
    return out


def test_adapter_dpo_saves_what_finetune_adapter_saves_and_generate_loads_it(pairs, adapter_dpo):
    rows = read_metrics(adapter_dpo)
    # the gates start at zero: the policy is its reference (the prefixes off), every pair's loss ln 2
    assert float(rows[0]["train_loss"]) == pytest.approx(math.log(2), abs=1e-4) and len(rows) == 2
    final = adapter_dpo / "final"
    adapter = load_file(str(final / "adapter.safetensors"))
    assert set(adapter) == ADAPTER_KEYS and adapter["blocks.1.attn.adapter_gate"].abs().max() > 0  # the gate opened
    assert (final / "adapter.yaml").is_file() and (final / "prompt_style.yaml").is_file()
    assert not (final / "lora.safetensors").exists()
    base, saved = load_file(str(pairs["base"] / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert base.keys() == saved.keys() and all(torch.equal(base[k], saved[k]) for k in base)  # the base untouched
    state = torch.load(adapter_dpo / "checkpoints" / "step-00000001" / "state.pt", map_location="cpu", weights_only=True)
    assert set(state["model"]) == ADAPTER_KEYS  # resumable checkpoints hold the prefixes and gates alone
    assert json.loads((adapter_dpo / "summary.json").read_text())["method"] == "dpo (adapter)"
    generated = run("generate/base.py", "--checkpoint_dir", final, "--prompt", "Add 1 and 2.", "--max_new_tokens", "4",
                    cache=pairs["cache"])
    assert generated.returncode == 0, generated.stderr


@pytest.mark.slow  # ~10 s: another DPO run, and its reference computed
def test_adapter_dpo_continuing_a_saved_adapter_takes_it_as_the_reference(pairs, adapter_dpo, tmp_path):
    """The prefixes a checkpoint carries are the model the run starts from: the base with them off is not its
    reference, so the checkpoint's log-probabilities are computed once, and the first step's loss is ln 2."""
    proc = run("finetune/dpo.py", "--checkpoint_dir", adapter_dpo / "final", "--data_path", pairs["data"], "--out_dir",
               tmp_path / "out", *ADAPTER, "--max_steps", "1", "--micro_batch_size", "2", "--global_batch_size", "2",
               "--eval_iters", "1", cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
    assert f"reference: {adapter_dpo / 'final'}, computed once" in proc.stdout
    assert float(read_metrics(tmp_path / "out")[0]["train_loss"]) == pytest.approx(math.log(2), abs=1e-4)


def test_plan_of_a_lora_and_an_adapter_dpo_run(pairs, capsys, monkeypatch):
    from lit_model.recipes.finetune_dpo import cli

    monkeypatch.setenv("LIT_MODEL_CACHE", str(pairs["cache"]))
    plans = {}
    for method in ("lora", "adapter"):
        cli(["--checkpoint_dir", str(pairs["base"]), "--data_path", str(pairs["data"]), "--plan", "json",
             "--micro_batch_size", "2", "--method", method])
        plans[method] = json.loads(capsys.readouterr().out)
    assert all(plan["peak_bytes"] > 0 for plan in plans.values())
    assert plans["adapter"]["run"]["trainable"] == "adapter" and plans["lora"]["run"]["trainable"] == "lora"
    assert "lora_r" not in plans["adapter"]["run"]
    # the default adapter: 10 prefix vectors and 4 gates in the upper block, far fewer than LoRA's r=8 matrices
    gradients = {method: plan["by_category"]["gradients"] for method, plan in plans.items()}
    assert 0 < gradients["adapter"] < gradients["lora"], gradients


@pytest.mark.parametrize("loss", ["ipo", "simpo", "orpo"])
def test_the_other_losses_train(pairs, tmp_path, loss):
    proc = dpo(pairs, tmp_path / loss, "--loss", loss, "--max_steps", "2", "--eval_interval", "2")
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(tmp_path / loss)
    assert len(rows) == 2 and all(math.isfinite(float(row["train_loss"])) for row in rows)
    reference = "none (a reference-free loss)" if loss != "ipo" else "its LoRA adapters off"
    assert reference in proc.stdout


@pytest.mark.parametrize("packing", ["false", pytest.param("true", marks=pytest.mark.slow)])
def test_plan_of_a_dpo_run(pairs, packing):
    """A packed run's plan traces packed rows (tests/test_preference.py: the document masks on top) at the data's
    longest micro batch, as unpacked: its packed rows never hold more tokens."""
    proc = run("finetune/dpo.py", "--checkpoint_dir", pairs["base"], "--data_path", pairs["data"], "--plan", "json",
               "--micro_batch_size", "2", "--packing", packing, cache=pairs["cache"])
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    assert plan["peak_bytes"] > 0 and plan["run"]["packing"] == (packing == "true")
    assert plan["run"]["seq_length"] == 128  # the longest pair (96 tokens), padded
    assert ("--packing packs a micro batch's rows" in plan["run"]["seq_length_source"]) == (packing == "true")


def close_metrics(first: list[dict[str, str]], second: list[dict[str, str]]) -> None:
    """The same logged rows, each value within the last of metrics.csv's four decimals."""
    assert [row.keys() for row in first] == [row.keys() for row in second]
    for a, b in zip(first, second):
        for name, value in a.items():
            assert (value == "") == (b[name] == ""), name
            if value:
                assert float(b[name]) == pytest.approx(float(value), abs=2e-4), (a["step"], name)


@pytest.mark.slow  # ~25 s: a six-step run
def test_packed_lora_dpo_logs_the_unpacked_runs_metrics_with_less_padding(pairs, lora_dpo, tmp_path):
    """--packing: each micro batch's 4 rows (2 pairs of ~95 tokens, padded to 128) go into 2 rows of 192 tokens; the
    same pairs make each step, so every loss and reward logged is the unpacked run's, the reference (the adapters
    off) included, and summary.json says how much less padding was computed."""
    out = tmp_path / "packed"
    proc = dpo(pairs, out, "--save_interval", "2", "--keep_last", "10", "--lora_dropout", "0", "--packing", "true")
    assert proc.returncode == 0, proc.stderr
    assert "with --packing (each micro batch's 4 rows in rows of up to 256 tokens)" in proc.stdout
    close_metrics(losses(lora_dpo), losses(out))
    unpacked, packed = (json.loads((path / "summary.json").read_text()) for path in (lora_dpo, out))
    assert unpacked["padding_fraction"] == unpacked["padding_fraction_without_packing"] > 0.25
    assert packed["padding_fraction"] == packed["padding_fraction_with_packing"] < 0.01
    assert packed["padding_fraction_without_packing"] == unpacked["padding_fraction"]


@pytest.mark.slow  # ~45 s: two two-step runs
def test_packed_full_dpo_computes_its_reference_packed_and_logs_the_unpacked_metrics(pairs, tmp_path):
    """Full fine-tuning's reference log-probabilities are computed packed as training packs its rows (cached apart
    from the unpacked ones): the policy starts as its reference (ln 2), and the run logs the unpacked run's values."""
    cache = tmp_path / "cache"
    for name, packing in (("unpacked", "false"), ("packed", "true")):
        proc = dpo(pairs, tmp_path / name, "--method", "full", "--max_steps", "2", "--eval_interval", "2",
                   "--packing", packing, cache=cache)
        assert proc.returncode == 0, proc.stderr
        assert "Computing the reference's log-probabilities of the 54 train pairs" in proc.stdout
    packed = read_metrics(tmp_path / "packed")
    assert float(packed[0]["train_loss"]) == pytest.approx(math.log(2), abs=1e-4)
    close_metrics(losses(tmp_path / "unpacked"), losses(tmp_path / "packed"))
    assert len(list((cache / "reference").glob("*.f32"))) == 4  # train and validation, unpacked and packed


@pytest.mark.parametrize("extra, code, needle", [
    (("--data", "alpaca"), 2, "--data alpaca and --data_path"),  # and the wrong kind: test_data_sources.py
    (("--loss", "kto"), 2, "loss"),
    (("--method", "full", "--quantize", "bnb.nf4"), 2, "--method full trains every weight"),
    (("--beta", "0"), 2, "--beta 0.0 must be positive"),
])
def test_bad_flags_are_one_paragraph(pairs, tmp_path, extra, code, needle):
    proc = dpo(pairs, tmp_path / "out", *extra)
    assert proc.returncode == code, proc.stderr
    assert needle in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_record_without_rejected_is_named(pairs, tmp_path):
    data = tmp_path / "bad.jsonl"
    lines = pairs["data"].read_text().splitlines()
    lines[3] = json.dumps({"prompt": "Add 1 and 1.", "chosen": "2"})
    data.write_text("\n".join(lines) + "\n")
    proc = run("finetune/dpo.py", "--checkpoint_dir", pairs["base"], "--data_path", data, "--out_dir", tmp_path / "out",
               "--max_steps", "1", cache=pairs["cache"])
    assert proc.returncode == 1, proc.stderr
    message = " ".join(proc.stderr.split())
    assert "line 4" in message and "'rejected'" in message and "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "final").exists()
