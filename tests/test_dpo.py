"""finetune/dpo.py end to end on a tiny checkpoint: LoRA-DPO (the reference is the base with its adapters off) and
full DPO (the reference's log-probabilities computed once and cached, verified and rebuilt), what is logged, exact
resume, the plan, --packing (the unpacked run's metrics, less padding), and one clear message for bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
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
    (("--data", "alpaca"), 2, "reads preference pairs from --data_path"),
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
