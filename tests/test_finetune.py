"""finetune/{full,lora,adapter}.py end to end on a tiny checkpoint: what trains, what is saved, exact resume,
QLoRA memory, 1 vs 2 processes, the default data, and clear errors for bad input."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, STDLIB, read_metrics
from lit_model.methods.load import load_gpt

MODEL = dict(name="ft-tiny", block_size=256, vocab_size=512, n_layer=2, n_embd=64, n_head=4, n_query_groups=2,
             intermediate_size=128)


def make_checkpoint(directory: Path, tokenizer_dir: Path, seed: int = 0, **config) -> Path:
    from lit_model import GPT, Config
    from lit_model.io.checkpoint import save_checkpoint_dir

    torch.manual_seed(seed)
    model = GPT(Config(**{**MODEL, **config}))
    model.init_weights()
    return save_checkpoint_dir(model.state_dict(), model.config, directory, tokenizer_dir=tokenizer_dir)


@pytest.fixture(scope="session")
def ft(tmp_path_factory) -> dict[str, Path]:
    """A tiny "pretrained" checkpoint (byte-level BPE of 512 tokens) and 144 arithmetic instructions."""
    from lit_model.io.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("ft")
    train_bpe([STDLIB / f"{n}.py" for n in ("textwrap", "shlex", "fnmatch", "string")], 512, root / "tokenizer")
    make_checkpoint(root / "base", root / "tokenizer")
    records = [{"instruction": f"Add {a} and {b}.", "input": "", "output": str(a + b)} for a in range(12) for b in range(12)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return {"root": root, "base": root / "base", "tokenizer": root / "tokenizer", "data": root / "data.jsonl",
            "cache": root / "cache"}


def finetune(ft: dict[str, Path], method: str, out_dir: Path, *extra: str, **kwargs) -> subprocess.CompletedProcess:
    args = ["--checkpoint_dir", ft["base"], "--data_path", ft["data"], "--out_dir", out_dir, "--micro_batch_size", "2",
            "--global_batch_size", "8", "--max_steps", "6", "--log_interval", "1", "--eval_interval", "3",
            "--eval_iters", "2", "--warmup_steps", "2", "--learning_rate", "0.01", *extra]
    return run(f"finetune/{method}.py", *args, cache=ft["cache"], **kwargs)


def run(script: str, *args, cache: Path, cwd: Path = ROOT, env_extra: dict[str, str] = {}) -> subprocess.CompletedProcess:
    """conftest.run_script with extra environment variables and another working directory. One intra-op thread
    per process: two processes of two threads on two cores (or a busy machine) make each step ~50x slower."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "LIT_MODEL_CACHE": str(cache), "OMP_NUM_THREADS": "1", **env_extra}
    env.pop("LIT_MODEL_DEBUG", None)
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def losses(out_dir: Path) -> list[tuple[str, str]]:
    return [(row["train_loss"], row["val_loss"]) for row in read_metrics(out_dir)]


def saved_model_keys(checkpoint: Path) -> set[str]:
    return set(torch.load(checkpoint / "state.pt", map_location="cpu", weights_only=True)["model"])


@pytest.fixture(scope="session")
def lora_run(ft) -> Path:
    out = ft["root"] / "lora"
    proc = finetune(ft, "lora", out, "--save_interval", "2", "--keep_last", "10", "--lora_mlp", "true")
    assert proc.returncode == 0, proc.stderr
    assert "Generated answer:" in proc.stdout and "step 6/6" in proc.stdout
    return out


def test_lora_trains_only_the_adapter_and_saves_merged_weights_beside_it(ft, lora_run):
    from lit_model.methods.lora import LoRAConfig

    final = lora_run / "final"
    for name in ("model.safetensors", "model_config.yaml", "tokenizer.json", "lora.safetensors", "lora.yaml", "prompt_style.yaml"):
        assert (final / name).is_file(), name
    lora = load_file(str(final / "lora.safetensors"))
    assert lora and all(name.endswith(("lora_A", "lora_B")) for name in lora)
    # resumable checkpoints hold only the trainable parameters (plus optimizer state and progress)
    assert saved_model_keys(lora_run / "checkpoints" / "step-00000006") == set(lora)
    config = LoRAConfig.from_dir(final)
    assert config.merged and config.mlp and not config.key
    base, merged = load_file(str(ft["base"] / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert set(base) == set(merged)
    for name, tensor in base.items():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.lora_A" in lora:  # adapted: base + scaling * B @ A
            delta = lora[f"{prefix}.lora_B"] @ lora[f"{prefix}.lora_A"] * config.scaling
            assert delta.abs().max() > 0
            torch.testing.assert_close(merged[name], tensor + delta)
        else:  # everything else is the base, bit for bit
            assert torch.equal(merged[name], tensor), name
    assert load_gpt(final).config.name == "ft-tiny"
    rows = read_metrics(lora_run)
    assert [int(r["step"]) for r in rows] == list(range(1, 7)) and rows[2]["val_loss"] and rows[5]["val_loss"]
    summary = json.loads((lora_run / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["method"] == "lora" and summary["peak_memory_bytes"] > 0


def test_lora_resume_gives_exactly_the_uninterrupted_losses(ft, lora_run, tmp_path):
    interrupted = tmp_path / "interrupted"
    shutil.copytree(lora_run, interrupted)
    # Pretend the run died right after the step-2 checkpoint.
    for path in ("checkpoints/step-00000004", "checkpoints/step-00000006", "final"):
        shutil.rmtree(interrupted / path)
    (interrupted / "summary.json").unlink()
    proc = finetune(ft, "lora", interrupted, "--save_interval", "2", "--keep_last", "10", "--lora_mlp", "true",
                    "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert "Resumed from" in proc.stdout and "at step 2" in proc.stdout
    assert losses(interrupted) == losses(lora_run)
    assert load_file(str(interrupted / "final" / "lora.safetensors")).keys() == load_file(str(lora_run / "final" / "lora.safetensors")).keys()
    # other LoRA flags cannot resume this run: a clear error instead of a silent partial load
    proc = finetune(ft, "lora", interrupted, "--save_interval", "2", "--lora_r", "4", "--resume", "auto", "--max_steps", "8")
    assert proc.returncode == 2 and "other trainable parameters" in " ".join(proc.stderr.split())


@pytest.mark.slow
@pytest.mark.parametrize("method", ["adapter", "full"])
def test_adapter_and_full_resume_give_exactly_the_uninterrupted_losses(ft, tmp_path, method):
    uninterrupted, interrupted = tmp_path / "uninterrupted", tmp_path / "interrupted"
    flags = ("--max_steps", "4", "--save_interval", "2", "--keep_last", "10")
    assert finetune(ft, method, uninterrupted, *flags).returncode == 0
    shutil.copytree(uninterrupted, interrupted)
    for path in ("checkpoints/step-00000004", "final", "summary.json"):  # as if it died after the step-2 checkpoint
        shutil.rmtree(interrupted / path) if (interrupted / path).is_dir() else (interrupted / path).unlink()
    proc = finetune(ft, method, interrupted, *flags, "--resume", "auto")
    assert proc.returncode == 0 and "at step 2" in proc.stdout, proc.stderr
    assert losses(interrupted) == losses(uninterrupted)


def test_adapter_trains_only_its_prefixes_and_generate_loads_it(ft, tmp_path):
    from lit_model.methods.adapter import AdapterAttention

    out = tmp_path / "adapter"
    proc = finetune(ft, "adapter", out, "--adapter_start_layer", "1", "--adapter_prompt_length", "4")
    assert proc.returncode == 0, proc.stderr
    final = out / "final"
    adapter = load_file(str(final / "adapter.safetensors"))
    assert set(adapter) == {"blocks.1.attn.adapter_prefix", "blocks.1.attn.adapter_gate"}
    assert adapter["blocks.1.attn.adapter_gate"].abs().max() > 0  # the gate opened
    assert saved_model_keys(out / "checkpoints" / "step-00000006") == set(adapter)
    base, saved = load_file(str(ft["base"] / "model.safetensors")), load_file(str(final / "model.safetensors"))
    assert base.keys() == saved.keys() and all(torch.equal(base[k], saved[k]) for k in base)
    model = load_gpt(final)
    assert isinstance(model.blocks[1].attn, AdapterAttention)
    torch.testing.assert_close(model.blocks[1].attn.adapter_gate.data, adapter["blocks.1.attn.adapter_gate"])
    generated = run("generate/base.py", "--checkpoint_dir", final, "--prompt", "Add 1 and 2.", "--max_new_tokens", "5", cache=ft["cache"])
    assert generated.returncode == 0, generated.stderr


def test_full_finetune_respects_freeze_layers(ft, tmp_path):
    out = tmp_path / "full"
    proc = finetune(ft, "full", out, "--freeze_layers", "1")
    assert proc.returncode == 0, proc.stderr
    base, tuned = load_file(str(ft["base"] / "model.safetensors")), load_file(str(out / "final" / "model.safetensors"))
    assert base.keys() == tuned.keys()
    for name in base:
        frozen = name.startswith(("embed.", "blocks.0."))
        assert torch.equal(base[name], tuned[name]) == frozen, name
    assert (out / "final" / "prompt_style.yaml").read_text().strip() == "name: alpaca"


@pytest.mark.slow
def test_loss_goes_down_on_the_default_data(ft, tmp_path):
    out = tmp_path / "default"
    args = ["--checkpoint_dir", ft["base"], "--out_dir", out, "--micro_batch_size", "4", "--global_batch_size", "8",
            "--max_steps", "16", "--log_interval", "1", "--eval_interval", "8", "--eval_iters", "2", "--warmup_steps", "2",
            "--learning_rate", "0.01", "--override_max_seq_length", "128"]
    proc = run("finetune/full.py", *args, cache=ft["cache"])
    assert proc.returncode == 0, proc.stderr
    assert "instructions made from the Python standard library" in proc.stdout and "were cut" in proc.stdout
    rows = read_metrics(out)
    train = [float(r["train_loss"]) for r in rows]
    val = [float(r["val_loss"]) for r in rows if r["val_loss"]]
    assert sum(train[-4:]) / 4 < sum(train[:4]) / 4 - 0.3 and val[-1] < val[0]


def test_default_data_is_made_from_the_standard_library(ft, monkeypatch):
    from lit_model.data.instruct import stdlib_instructions

    monkeypatch.setenv("LIT_MODEL_CACHE", str(ft["cache"]))
    train, val = stdlib_instructions()
    assert len(train) > 2000 and len(val) > 50
    assert not {r["file"] for _, r in train} & {r["file"] for _, r in val}  # split by source file
    record = next(r for _, r in train if r["name"] == "fnmatchcase")
    assert record["instruction"] == ("Write a Python function `fnmatchcase(name, pat)` that: Test whether FILENAME "
                                     "matches PATTERN, including case.")
    assert record["output"].startswith("def fnmatchcase(name, pat):\n") and record["file"] == "fnmatch.py"
    assert stdlib_instructions() == (train, val)  # cached and deterministic


@pytest.mark.slow
def test_qlora_peak_memory_is_below_lora(ft, tmp_path):
    """Peak RSS while training (the last metrics.csv row, logged before the final merge, which reads the
    full-precision base on the CPU) of the same run with and without --quantize bnb.nf4. The model has ~57M
    parameters (226 MB in fp32, ~30 MB in nf4) so that the weights dominate: importing bitsandbytes alone adds
    ~45 MB of RSS, and each block is read in fp32 before it is quantized."""
    base = make_checkpoint(tmp_path / "big", ft["tokenizer"], n_layer=8, n_embd=768, n_head=12, n_query_groups=12,
                           intermediate_size=2048)
    peaks = {}
    for name, extra in (("lora", ()), ("qlora", ("--quantize", "bnb.nf4"))):
        out = tmp_path / name
        args = ["--checkpoint_dir", base, "--data_path", ft["data"], "--out_dir", out, "--micro_batch_size", "1",
                "--global_batch_size", "1", "--max_steps", "2", "--eval_iters", "1", "--log_interval", "1", *extra]
        proc = run("finetune/lora.py", *args, cache=ft["cache"], env_extra={"MALLOC_MMAP_THRESHOLD_": "65536"})
        assert proc.returncode == 0, proc.stderr
        peaks[name] = int(read_metrics(out)[-1]["peak_memory_bytes"])
    assert peaks["qlora"] < peaks["lora"] - 100 * 2**20, peaks


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra", [("--strategy", "ddp"), ("--strategy", "fsdp", "--quantize", "bnb.nf4")])
def test_two_processes_match_one(ft, tmp_path, extra):
    """The same micro batches (length-grouped per global batch) and gradients for any number of processes;
    without dropout, whose random masks are drawn per rank."""
    single = tmp_path / "single"
    quantize = extra[extra.index("--quantize"):] if "--quantize" in extra else ()
    assert finetune(ft, "lora", single, "--lora_dropout", "0", *quantize).returncode == 0
    multi = tmp_path / "multi"
    proc = finetune(ft, "lora", multi, "--lora_dropout", "0", "--devices", "2", *extra)
    assert proc.returncode == 0, proc.stderr
    for (train_1, val_1), (train_2, val_2) in zip(losses(single), losses(multi)):
        assert float(train_1) == pytest.approx(float(train_2), abs=1e-4)
        assert (val_1 == "") == (val_2 == "")
    assert json.loads((multi / "summary.json").read_text())["devices"] == 2
    single_lora, multi_lora = load_file(str(single / "final" / "lora.safetensors")), load_file(str(multi / "final" / "lora.safetensors"))
    assert single_lora.keys() == multi_lora.keys()
    for name in single_lora:
        torch.testing.assert_close(single_lora[name], multi_lora[name], atol=1e-4, rtol=1e-3)


# ---- bad input: one paragraph, exit 1 (bad input) or 2 (bad flags), no traceback ------------------------------
def load_script(method: str):
    spec = importlib.util.spec_from_file_location(f"finetune_{method}", ROOT / "finetune" / f"{method}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def run_in_process(method: str, argv: list[str], capsys) -> tuple[int, str]:
    from lit_model.recipes.cli import parse
    from lit_model.core.errors import run_cli

    module = load_script(method)
    args_cls = getattr(module, {"lora": "LoRAArgs", "full": "FullArgs", "adapter": "AdapterArgs"}[method])
    with pytest.raises(SystemExit) as exit_info:
        run_cli(lambda: module.main(parse(args_cls, [str(a) for a in argv])))
    return exit_info.value.code, " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize(
    "method, extra, code, needle",
    [
        ("lora", ("--lora_r", "0"), 2, "rank must be a positive integer"),
        ("lora", ("--prompt_style", "alpacca"), 2, "Unknown prompt style 'alpacca'"),
        ("lora", ("--quantize", "bnb.nf4", "--precision", "bf16-mixed"), 2, "needs a '-true' precision"),
        ("full", ("--quantize", "bnb.nf4"), 2, "finetune/lora.py --quantize bnb.nf4"),
        ("adapter", ("--freeze_layers", "1"), 2, "applies to full fine-tuning"),
        ("lora", ("--override_max_seq_length", "8"), 1, "Raise --override_max_seq_length"),
        ("lora", ("--data_path", "BAD_LINE"), 1, "Line 3 of"),
        ("lora", ("--data_path", "MISSING_OUTPUT"), 1, "has keys ['instruction', 'reply']"),
        ("lora", ("--checkpoint_dir", "NO_TOKENIZER"), 1, "missing tokenizer.json or tokenizer.model"),
        ("lora", ("--model_name", "pythia-14m", "--checkpoint_dir", "NO_TOKENIZER"), 2, "pass one of them"),
        # --checkpoint_dir back at its default: as if only --model_name were given
        ("lora", ("--model_name", "pythia-14m", "--checkpoint_dir", "out/pretrain/final"), 1,
         "`lit-model download EleutherAI/pythia-14m`"),
        ("lora", ("--plan", "json", "--checkpoint_dir", "NO_TOKENIZER/missing"), 2, "Pass --model_name"),
    ],
)
def test_bad_input_is_one_clear_message(ft, tmp_path, capsys, method, extra, code, needle):
    bad_line = tmp_path / "bad.jsonl"
    bad_line.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": "b"\n')
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "reply": "b"}\n')
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(ft["base"], no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    replace = {"BAD_LINE": bad_line, "MISSING_OUTPUT": missing, "NO_TOKENIZER": no_tokenizer}
    argv = ["--checkpoint_dir", ft["base"], "--data_path", ft["data"], "--out_dir", tmp_path / "out",
            *[replace.get(a, a) for a in extra]]
    got, message = run_in_process(method, argv, capsys)
    assert got == code and needle in message, message


@pytest.mark.parametrize("method", ["full", "lora", "adapter"])
def test_plan_from_the_checkpoint_or_a_model_name(ft, capsys, method):
    from lit_model.recipes.cli import parse

    module = load_script(method)
    args_cls = getattr(module, {"lora": "LoRAArgs", "full": "FullArgs", "adapter": "AdapterArgs"}[method])
    module.main(parse(args_cls, ["--checkpoint_dir", str(ft["base"]), "--plan", "json"]))
    plan = json.loads(capsys.readouterr().out)
    assert plan["run"]["trainable"] == method and sum(plan["by_category"].values()) == plan["peak_bytes"]
    base_params = plan["by_category"]["parameters"]
    trainable_share = plan["by_category"]["gradients"] / base_params
    assert trainable_share > 0.9 if method == "full" else trainable_share < 0.2  # parameters include buffers

    # before downloading: will Llama-2-7B fit a 24 GB GPU?
    module.main(parse(args_cls, ["--model_name", "Llama-2-7b-hf", "--plan", "json", "--device_memory", "24GB"]))
    plan = json.loads(capsys.readouterr().out)
    assert plan["run"]["model"] == "Llama-2-7b-hf" and plan["fits"] is False and plan["suggestions"]
    assert all(s["peak_bytes"] <= 24e9 for s in plan["suggestions"])

    # a custom architecture before it has a checkpoint: --model_config, as pretrain takes it
    custom = ft["base"].parent / f"custom-{method}.yaml"
    custom.write_text((ft["base"] / "model_config.yaml").read_text().replace("n_layer: 2", "n_layer: 4"))
    module.main(parse(args_cls, ["--model_config", str(custom), "--plan", "json"]))
    deeper = json.loads(capsys.readouterr().out)
    assert deeper["by_category"]["parameters"] > base_params
    code, message = run_in_process(method, ["--model_config", str(custom), "--checkpoint_dir", str(ft["base"])], capsys)
    assert code == 2 and "--model_config" in message and "--plan" in message


def test_missing_default_checkpoint_names_the_command_that_makes_it(ft, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, message = run_in_process("lora", ["--data_path", ft["data"]], capsys)
    assert code == 1 and "out/pretrain/final does not exist" in message and "`python pretrain/main.py`" in message
    proc = run("finetune/lora.py", "--data_path", ft["data"], cache=ft["cache"], cwd=tmp_path)  # the same as a real command
    assert proc.returncode == 1 and "python pretrain/main.py" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.multiprocess
def test_int8_with_fsdp_says_what_works_instead(ft, tmp_path):
    proc = finetune(ft, "lora", tmp_path / "int8", "--devices", "2", "--strategy", "fsdp", "--quantize", "bnb.int8")
    message = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "4-bit mode" in message and "--strategy ddp" in message and "Traceback" not in message


def test_config_hub_yamls_parse_into_flags():
    from lit_model.recipes.cli import parse

    for method, name in (("full", "FullArgs"), ("lora", "LoRAArgs"), ("adapter", "AdapterArgs"), ("dpo", "DPOArgs")):
        args_cls = getattr(load_script(method), name)
        paths = sorted((ROOT / "config_hub" / "finetune").glob(f"*/{method}.yaml"))
        assert len(paths) >= 2
        for path in paths:
            assert parse(args_cls, ["--config", str(path)]).precision in (None, "bf16-true")
        default = ROOT / "config_hub" / "finetune" / "lit-model-5m" / f"{method}.yaml"
        assert parse(args_cls, ["--config", str(default)]) == parse(args_cls, [])  # the YAML spells out the defaults


# ---- the end of a run -----------------------------------------------------------------------------------------
def live(kind: type) -> list:
    import gc

    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, kind)]


@pytest.mark.parametrize("method, extra", [
    ("full", ()), ("lora", ()), ("adapter", ()),
    ("full", ("--optimizer_in_backward", "--grad_clip", "0", "--micro_batch_size", "8")),  # hooks on every parameter
    ("full", ("--optimizer", "AdaLomo", "--grad_clip", "0", "--micro_batch_size", "8")),
])
def test_the_sample_at_the_end_runs_after_the_trained_model_and_optimizer_are_gone(ft, tmp_path, monkeypatch, method, extra):
    """The sample reloads final/ in fp32; the plan's sample phase holds that copy alone (test_memory_plan), so the
    scripts must have dropped the model they trained and its optimizer state by then."""
    from lit_model import GPT
    from lit_model.recipes.cli import parse
    from lit_model.recipes import common

    # what earlier tests left (the planner's fake models among them) may be collected during the run: count only
    # the objects made since
    before = {kind: weakref.WeakSet(live(kind)) for kind in (GPT, torch.optim.Optimizer)}
    seen = []
    real = common.sample_text

    def sample_text(*args, **kwargs):
        seen.append(tuple(sum(o not in old for o in live(kind)) for kind, old in before.items()))
        return real(*args, **kwargs)

    monkeypatch.setattr(common, "sample_text", sample_text)
    monkeypatch.setenv("LIT_MODEL_CACHE", str(ft["cache"]))
    module = load_script(method)
    args_cls = getattr(module, {"lora": "LoRAArgs", "full": "FullArgs", "adapter": "AdapterArgs"}[method])
    argv = ["--checkpoint_dir", ft["base"], "--data_path", ft["data"], "--out_dir", tmp_path / "out", "--micro_batch_size",
            "2", "--global_batch_size", "8", "--max_steps", "2", "--eval_iters", "1", *extra]
    module.main(parse(args_cls, [str(a) for a in argv]))
    assert seen == [(0, 0)]
