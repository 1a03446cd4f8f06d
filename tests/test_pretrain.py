"""pretrain/main.py end to end on a tiny model: outputs, exact resume, 1 vs N processes, FSDP, signals,
and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, read_metrics, run_script
from lit_model.kernels.ops import onednn_fp32_linear
from lit_model.train.loop import seed_step
from safetensors import safe_open
from lit_model.methods.load import load_gpt


def tiny_args(setup: dict[str, Path], out_dir: Path, *extra: str) -> list[str]:
    return [
        "--model_config", setup["config"], "--tokenizer_dir", setup["tokenizer"], "--data_path", setup["data"],
        "--out_dir", out_dir, "--micro_batch_size", "2", "--global_batch_size", "8", "--eval_iters", "2",
        "--max_steps", "6", "--log_interval", "1", "--eval_interval", "3", "--warmup_steps", "2", *extra,
    ]


def pretrain(setup: dict[str, Path], out_dir: Path, *extra: str, **kwargs) -> subprocess.CompletedProcess:
    return run_script("pretrain/main.py", *tiny_args(setup, out_dir, *extra), cache=setup["root"] / "cache", **kwargs)


def losses(out_dir: Path) -> list[tuple[str, str]]:
    return [(row["train_loss"], row["val_loss"]) for row in read_metrics(out_dir)]


def test_run_writes_final_checkpoint_metrics_summary_and_sample(tiny_setup, tmp_path):
    proc = pretrain(tiny_setup, tmp_path / "run", "--max_steps", "20", "--learning_rate", "0.01")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "run"
    for name in ("model.safetensors", "model_config.yaml", "tokenizer.json"):
        assert (out / "final" / name).is_file()
    rows = read_metrics(out)
    assert [int(r["step"]) for r in rows] == list(range(1, 21))
    assert set(rows[0]) >= {"step", "tokens", "train_loss", "val_loss", "learning_rate", "tokens_per_sec", "peak_memory_bytes"}
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]) - 0.5
    summary = json.loads((out / "summary.json").read_text())
    for key in ("tokens_per_sec", "peak_memory_bytes", "train_loss", "val_loss", "steps", "wall_time_s",
                "micro_batch_size", "global_batch_size", "precision", "devices"):
        assert key in summary
    assert summary["steps"] == 20 and summary["tokens"] == 20 * 8 * 64 and summary["precision"] == "32-true"
    assert summary["fp32_linear"] == ("onednn" if onednn_fp32_linear() else "blas")
    assert "Sample:" in proc.stdout and "step 20/20" in proc.stdout and "unigram baseline" in proc.stdout


    model = load_gpt(out / "final")
    assert model.config.name == "test-tiny"


def test_resume_gives_exactly_the_uninterrupted_losses(tiny_setup, tmp_path):
    full = tmp_path / "full"
    assert pretrain(tiny_setup, full, "--save_interval", "2", "--keep_last", "10").returncode == 0
    interrupted = tmp_path / "interrupted"
    shutil.copytree(full, interrupted)
    # Pretend the run died right after the step-2 checkpoint.
    for path in ("checkpoints/step-00000004", "checkpoints/step-00000006", "final", "summary.json"):
        shutil.rmtree(interrupted / path, ignore_errors=True) if "." not in path else (interrupted / path).unlink()
    proc = pretrain(tiny_setup, interrupted, "--save_interval", "2", "--keep_last", "10", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    assert losses(interrupted) == losses(full)


def test_a_step_draws_on_the_cpu_what_torch_manual_seed_made_it_draw():
    """The per-step seed (dropout's masks, so that a resumed step redoes them) seeds the CPU's generator only, as
    torch.manual_seed seeded it for every backend: the same masks as before, for runs resumed across the change."""
    seed_step(torch.device("cpu"), 1234)
    masks = torch.nn.functional.dropout(torch.ones(256), 0.5), torch.randint(0, 1000, (8,))
    torch.manual_seed(1234)
    assert torch.equal(masks[0], torch.nn.functional.dropout(torch.ones(256), 0.5))
    assert torch.equal(masks[1], torch.randint(0, 1000, (8,)))
    seed_step(torch.device("cpu"), 1235)
    assert not torch.equal(masks[0], torch.nn.functional.dropout(torch.ones(256), 0.5))


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy_args", [("--strategy", "ddp"), ("--strategy", "fsdp"), ("--strategy", "fsdp", "--cpu_offload")])
def test_two_processes_match_one(tiny_setup, tmp_path, strategy_args):
    single = tmp_path / "single"
    assert pretrain(tiny_setup, single).returncode == 0
    multi = tmp_path / "multi"
    proc = pretrain(tiny_setup, multi, "--devices", "2", *strategy_args)
    assert proc.returncode == 0, proc.stderr
    for (train_1, val_1), (train_2, val_2) in zip(losses(single), losses(multi)):
        assert float(train_1) == pytest.approx(float(train_2), abs=1e-4)
        assert (val_1 == "") == (val_2 == "")
    summary = json.loads((multi / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["peak_memory_bytes_all_ranks"] > summary["peak_memory_bytes"]
    assert (multi / "final" / "model.safetensors").is_file()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiprocess
def test_torchrun_two_nodes_on_loopback(tiny_setup, tmp_path):
    port = str(free_port())
    out = tmp_path / "nodes"
    args = tiny_args(tiny_setup, out, "--num_nodes", "2", "--devices", "1", "--strategy", "ddp")
    env_cache = {"LIT_MODEL_CACHE": str(tiny_setup["root"] / "cache")}
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", port,
             str(ROOT / "pretrain/main.py"), *map(str, args)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**__import__("os").environ, **env_cache},
        )
        for rank in (0, 1)
    ]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["devices"] == 2 and summary["steps"] == 6


def test_sigterm_saves_a_checkpoint_and_exits_zero(tiny_setup, tmp_path):
    out = tmp_path / "signal"
    args = tiny_args(tiny_setup, out, "--max_steps", "100000", "--save_interval", "0", "--eval_interval", "1000")
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "pretrain/main.py"), *map(str, args)], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**__import__("os").environ, "LIT_MODEL_CACHE": str(tiny_setup["root"] / "cache"), "PYTHONUNBUFFERED": "1"},
    )
    for line in proc.stdout:
        if line.startswith("step 3/"):
            proc.send_signal(signal.SIGTERM)
            break
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr
    assert "Stopped by signal" in stdout
    checkpoints = sorted((out / "checkpoints").glob("step-*"))
    assert checkpoints and int(checkpoints[-1].name.split("-")[1]) >= 3


@pytest.mark.parametrize(
    "extra, code, needle",
    [
        (("--data_path", "/nonexistent/corpus"), 1, "does not exist"),
        (("--micro_batch_size", "3"), 2, "micro_batch_size"),
        (("--override_max_seq_length", "4096"), 2, "at most 64"),
        (("--optimizer", "Adamm"), 2, "AdamW"),
        (("--precision", "16-mixed"), 2, "CUDA"),
        (("--cpu_offload", "--strategy", "ddp"), 2, "FSDP"),
        (("--freeze_layers", "[nothing.*]"), 2, "match no parameter"),
        (("--model_name", "Llama-2-7b"), 2, "Did you mean"),
    ],
)
def test_bad_input_is_one_clear_message(tiny_setup, tmp_path, extra, code, needle):
    args = list(extra)
    if "--model_name" in args:  # --model_config would win over --model_name
        proc = run_script("pretrain/main.py", "--out_dir", tmp_path / "x", *args, cache=tiny_setup["root"] / "cache")
    else:
        proc = pretrain(tiny_setup, tmp_path / "bad", *args)
    assert proc.returncode == code, proc.stderr
    assert needle in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def test_out_dir_with_another_run_is_refused_and_other_config_cannot_resume(tiny_setup, tmp_path):
    out = tmp_path / "taken"
    assert pretrain(tiny_setup, out, "--max_steps", "2").returncode == 0
    again = pretrain(tiny_setup, out, "--max_steps", "2")
    assert again.returncode == 2 and "--resume auto" in again.stderr and "--overwrite" in again.stderr
    other = tiny_setup["root"] / "other.yaml"
    other.write_text(tiny_setup["config"].read_text().replace("n_layer: 2", "n_layer: 3"))
    args = tiny_args(tiny_setup, out, "--max_steps", "4", "--resume", "auto")
    args[args.index("--model_config") + 1] = other
    proc = run_script("pretrain/main.py", *args, cache=tiny_setup["root"] / "cache")
    assert proc.returncode == 2 and "another model config" in " ".join(proc.stderr.split()) and "Traceback" not in proc.stderr


def test_nan_loss_stops_with_the_step_and_a_hint(tiny_setup, tmp_path):
    proc = pretrain(tiny_setup, tmp_path / "nan", "--learning_rate", "1e30", "--grad_clip", "0", "--warmup_steps", "1")
    assert proc.returncode == 1
    message = " ".join(proc.stderr.split())
    assert "at step" in message and "--learning_rate" in message and "Traceback" not in proc.stderr


def test_config_hub_yamls_parse_into_flags():
    sys.path.insert(0, str(ROOT / "pretrain"))
    try:
        from main import PretrainArgs
    finally:
        sys.path.pop(0)
    from lit_model import Config
    from lit_model.recipes.cli import parse

    for path in sorted((ROOT / "config_hub" / "pretrain").glob("*.yaml")):
        args = parse(PretrainArgs, ["--config", str(path)])
        Config.from_name(args.model_name)  # a registry name
    default = parse(PretrainArgs, ["--config", str(ROOT / "config_hub/pretrain/lit-model-5m.yaml")])
    assert default == parse(PretrainArgs, ["--precision", "32-true"])  # the YAML spells out the defaults


@pytest.mark.parametrize(
    "extra",
    [
        ("--precision", "bf16-true"),
        ("--precision", "bf16-mixed"),
        ("--precision", "16-true"),
        ("--optimizer", "SGD", "--learning_rate", "0.1"),
        ("--optimizer", "Lion", "--learning_rate", "0.001"),
        ("--optimizer", "Sophia", "--learning_rate", "0.05"),
        ("--optimizer", "Adafactor"),
        ("--optimizer", "AdamW8bit"),
        ("--optimizer", "torch.optim.RMSprop", "--learning_rate", "0.001"),
        ("--activation_checkpointing", "--activation_checkpointing_interval", "2", "--freeze_layers", "1",
         "--empty_cache_interval", "2", "--loss_chunk_size", "16"),
        ("--activation_checkpointing", "selective", "--mlp_tiles", "2", "--loss_chunk_size", "auto"),
        ("--activation_offloading", "disk", "--micro_batch_size", "4"),
    ],
    ids=lambda extra: "-".join(a.strip("-") for a in extra[:2]),
)
def test_levers_train_end_to_end(tiny_setup, tmp_path, extra):
    proc = pretrain(tiny_setup, tmp_path / "lever", "--learning_rate", "0.01", "--max_steps", "8", *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path / "lever")
    first, last = float(rows[0]["train_loss"]), float(rows[-1]["train_loss"])
    assert last < first, (first, last)
    summary = json.loads((tmp_path / "lever" / "summary.json").read_text())
    if "--precision" in extra:
        assert summary["precision"] == extra[1]
    if "--activation_offloading" in extra:  # every file read back or removed, the process's folder too
        assert not any((tmp_path / "lever" / "activations").iterdir())


@pytest.mark.slow
def test_compile_trains(tiny_setup, tmp_path):
    proc = pretrain(tiny_setup, tmp_path / "compiled", "--compile", "--max_steps", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(tmp_path / "compiled" / "final" / "model.safetensors", "pt") as f:
        assert "blocks.0.attn.query.weight" in set(f.keys())


def test_compile_compiles_each_block_in_place():
    """--compile compiles block by block (whole, inductor kept every loss chunk's logits gradient at once on a GPU:
    benchmarks/results/plan_accuracy_gpu.md); the model and its parameter names stay its own."""
    from lightning.fabric import Fabric

    from lit_model import Config
    from lit_model.model.gpt import GPT
    from lit_model.run import resolve_run
    from lit_model.train.args import TrainArgs
    from lit_model.train.step import unwrap
    from lit_model.train.session import setup_model_and_optimizer

    config = Config(name="tiny", block_size=64, vocab_size=256, n_layer=2, n_embd=32, n_head=2, intermediate_size=64)
    settings = TrainArgs(precision="32-true", micro_batch_size=2, global_batch_size=2, compile=True, devices=1)
    run = resolve_run(settings, config, "full", "cpu", present=False)
    model = GPT(config)
    names = [name for name, _ in model.named_parameters()]
    wrapped, _ = setup_model_and_optimizer(Fabric(accelerator="cpu", devices=1), model, run, settings)
    assert unwrap(wrapped) is model and [name for name, _ in model.named_parameters()] == names
    assert all(block._compiled_call_impl is not None for block in model.blocks)
    assert model._compiled_call_impl is None  # the fused loss stays eager


def test_plan_prints_the_prediction_and_exits_without_training(tiny_setup, tmp_path):
    proc = pretrain(tiny_setup, tmp_path / "planned", "--plan", "json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["peak_bytes"] > 0 and plan["fits"] is True and {"train_step", "evaluation"} <= set(plan["by_phase"])
    assert not (tmp_path / "planned").exists()
    small = run_script("pretrain/main.py", "--model_name", "Llama-2-7b-hf", "--plan", "json", "--device_memory",
                       "24GB", "--precision", "bf16-true", "--micro_batch_size", "1")
    verdict = json.loads(small.stdout)
    assert verdict["fits"] is False and verdict["suggestions"]


@pytest.mark.slow
def test_loggers_receive_the_metrics_rows_and_a_resume_replaces_the_later_ones(tiny_setup, tmp_path, monkeypatch):
    """--logger csv,tensorboard,wandb,mlflow: each backend gets metrics.csv's rows and the flags, under out_dir/logs
    (W&B offline, MLflow in a file store: no network). A resume from step 2 with another learning rate replaces
    steps 3.. in TensorBoard as in metrics.csv, and is a second W&B and MLflow run starting at step 3."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "logged"
    loggers = ("--logger", "csv,tensorboard,wandb,mlflow", "--save_interval", "2", "--keep_last", "10")
    assert pretrain(tiny_setup, out, *loggers).returncode == 0
    first = read_metrics(out)
    for path in ("checkpoints/step-00000004", "checkpoints/step-00000006", "final", "summary.json"):
        shutil.rmtree(out / path, ignore_errors=True) if "." not in path else (out / path).unlink()
    proc = pretrain(tiny_setup, out, *loggers, "--resume", "auto", "--learning_rate", "0.01")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert rows[:2] == first[:2] and rows[3]["train_loss"] != first[3]["train_loss"]  # step 3 updates at 0.01

    def column(key: str, kept: list[dict[str, str]]) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r[key])) for r in kept if r[key]]

    events = EventAccumulator(str(out / "logs" / "tensorboard"))
    events.Reload()
    for key in ("train_loss", "val_loss", "learning_rate", "tokens"):
        assert [(e.step, pytest.approx(e.value)) for e in events.Scalars(key)] == column(key, rows), key

    runs = sorted((out / "logs" / "mlflow").glob("*/*/metrics"), key=lambda p: (p.parent / "meta.yaml").read_text())
    assert len(runs) == 2
    for metrics, kept in zip(sorted(runs, key=lambda p: len((p / "train_loss").read_text())), (rows[2:], first)):
        lines = [line.split() for line in (metrics / "train_loss").read_text().splitlines()]
        assert [(int(step), pytest.approx(float(value))) for _, value, step in lines] == column("train_loss", kept)
        assert (metrics.parent / "params" / "max_steps").read_text() == "6"
        assert "status: 3" in (metrics.parent / "meta.yaml").read_text()  # FINISHED
    wandb_runs = sorted((out / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(wandb_runs) == 2 and all(b"train_loss" in path.read_bytes() for path in wandb_runs)


def test_wandb_is_offline_unless_told_online_or_logged_in(tmp_path, monkeypatch):
    from lit_model.train.loggers import wandb_offline

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    netrc = tmp_path / "netrc"
    netrc.write_text("machine example.org login user password secret\n")
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_offline()  # no key: W&B would prompt for one
    netrc.write_text("machine api.wandb.ai login user password secret\n")  # what `wandb login` writes
    assert not wandb_offline()
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert wandb_offline()
    monkeypatch.setenv("WANDB_MODE", "online")
    netrc.unlink()
    assert not wandb_offline()
    monkeypatch.delenv("WANDB_MODE")
    assert wandb_offline()
    monkeypatch.setenv("WANDB_API_KEY", "0" * 40)
    assert not wandb_offline()


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_a_new_model_is_built_once_in_its_dtype_without_a_default_initialised_copy(monkeypatch, dtype_name):
    """GPT.initialized (what pretraining builds) allocates each weight once, in the run's dtype; a 16-bit weight's
    values are drawn in fp32 a block of rows at a time, never as an fp32 copy of the whole table."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import lit_model.model.gpt as model_module
    from lit_model import GPT, Config

    dtype = getattr(torch, dtype_name)
    config = Config(name="t", block_size=64, vocab_size=4096, n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
                    intermediate_size=172, tie_embeddings=True)
    monkeypatch.setattr(model_module, "INIT_DRAW_ELEMENTS", 1 << 12)

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[tuple[torch.dtype, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            aliases = any(r.alias_info is not None for r in func._schema.returns)  # a view or an in-place op
            if isinstance(out, torch.Tensor) and out.device.type == "cpu" and not aliases:
                self.made.append((out.dtype, out.numel()))
            return out

    torch.manual_seed(0)
    with Allocations() as allocations:
        model = GPT.initialized(config, dtype)
    table = 4096 * 64
    assert model.lm_head.weight is model.embed.weight
    assert {p.dtype for p in model.parameters()} == {dtype} and model.cos.dtype == torch.float32
    tables = [numel for made_dtype, numel in allocations.made if numel >= table]
    assert tables == [table] * len(tables) and 1 <= len(tables) <= 2  # the embedding (to_empty may make the head's too)
    if dtype != torch.float32:
        assert max(n for d, n in allocations.made if d == torch.float32) <= 1 << 12  # the draws, in blocks
    assert model.embed.weight.float().std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[1].norm_1.weight.float().eq(1).all()
    # the same seed, the same weights
    torch.manual_seed(0)
    again = GPT.initialized(config, dtype)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
