"""``lit-model COMMAND``: each command runs what its script or module runs, in-process (same output, same
exit status, same messages); ``lit-model config`` lists the registry by family with parameter counts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_model.core.config import Config, known_names
from lit_model.entry import HELP, SCRIPTS, config_table, families, main
from lit_model.model.gpt import GPT
from tests.conftest import ROOT, run_captured, run_script_inprocess


def run_entry(*args: str) -> subprocess.CompletedProcess:
    """``lit-model ARGS`` in this process: (exit status, stdout, stderr)."""
    return run_captured(lambda: main(list(args)), ["lit-model", *args])


def run_module(module_main, *args: str) -> subprocess.CompletedProcess:
    return run_captured(lambda: module_main(list(args)), list(args))


def same(a: subprocess.CompletedProcess, b: subprocess.CompletedProcess) -> None:
    assert (a.returncode, a.stdout, a.stderr) == (b.returncode, b.stdout, b.stderr)


def test_setup_declares_the_console_script() -> None:
    run_setup = pytest.importorskip("distutils.core").run_setup  # setuptools provides it on Python >= 3.12
    dist = run_setup(str(ROOT / "setup.py"), stop_after="init")
    assert dist.entry_points["console_scripts"] == ["lit-model = lit_model.entry:main"]


def test_help_lists_every_command() -> None:
    result = run_entry("--help")
    assert result.returncode == 0
    listed = re.findall(r"^  (\S+)  ", result.stdout, flags=re.MULTILINE)
    assert listed == ["pretrain", "finetune", "generate", "chat", "evaluate", "serve", "plan", "download", "convert", "merge",
                      "config"]
    assert listed == list(HELP)
    assert run_entry().returncode == 2 and run_entry().stdout == result.stdout


@pytest.mark.parametrize("command", list(SCRIPTS))
def test_script_commands_are_the_scripts(command: str) -> None:
    """--help is the script's own, word for word (the script itself runs)."""
    result = run_entry(*command.split(), "--help")
    script = SCRIPTS[command][0]
    assert result.returncode == 0 and result.stdout.startswith(f"usage: {Path(script).name} ")
    same(result, run_script_inprocess(script, "--help"))


def test_plan() -> None:
    # a planned GPU: the CPU's free memory would change between the two runs
    args = ("--model_name", "Llama-3.2-1B", "--prompt", "hi", "--max_new_tokens", "20", "--device_memory", "24GB")
    result = run_entry("plan", "generate", *args)
    assert result.returncode == 0 and result.stdout.startswith("Memory plan (per rank): Llama-3.2-1B generation")
    same(result, run_script_inprocess("generate/base.py", *args, "--plan", "text"))
    chat = ("--model_name", "Llama-3.2-1B", "--device_memory", "8GB", "--plan", "json")
    as_json = run_entry("plan", "chat", *chat)
    same(as_json, run_script_inprocess("generate/chat.py", *chat))
    assert as_json.stdout.lstrip().startswith("{")


def test_config_lists_families_with_parameter_counts() -> None:
    result = run_entry("config")
    assert result.returncode == 0 and result.stdout == config_table() + "\n"
    headers = re.findall(r"^(\S+):$", result.stdout, flags=re.MULTILINE)
    assert headers == sorted(headers) == list(families())
    rows = re.findall(r"^  (\S+)\s+\S+\s+\(([\d,]+)\)$", result.stdout, flags=re.MULTILINE)
    assert sorted(name.split("/")[-1] for name, _ in rows) == known_names()
    counts = {name.split("/")[-1]: int(count.replace(",", "")) for name, count in rows}
    for name in ("lit-model-5m", "pythia-14m", "Llama-3.2-1B"):  # against the model itself (tied head: once)
        with torch.device("meta"):
            model = GPT(Config.from_name(name))
        assert counts[name] == sum({id(p): p.numel() for p in model.parameters()}.values())
    assert counts["Llama-3.2-1B"] == 1_235_814_400  # the published count
    assert "  meta-llama/Llama-3.2-1B " in result.stdout
    bad = run_entry("config", "extra")
    assert bad.returncode == 2 and "takes no arguments" in bad.stderr


def test_module_commands_are_the_modules(tmp_path) -> None:
    from lit_model.convert import main as convert_main
    from lit_model.download import main as download_main
    from lit_model.core.errors import run_cli
    from lit_model.methods.lora import cli as lora_cli

    same(run_entry("download", "Llama-3.2-1B"), run_module(download_main, "Llama-3.2-1B"))
    assert "meta-llama/Llama-3.2-1B" in run_entry("download", "Llama-3.2-1B").stderr
    convert = ("hf_to_lit", "--hf_dir", str(tmp_path / "missing"), "--out_dir", str(tmp_path / "out"))
    result = run_entry("convert", *convert)
    assert result.returncode == 1 and "does not exist" in result.stderr
    same(result, run_module(convert_main, *convert))
    merge = ("--checkpoint_dir", str(tmp_path / "missing"))
    result = run_entry("merge", *merge)
    assert result.returncode == 1
    same(result, run_module(lambda argv: run_cli(lora_cli, argv), "merge", *merge))


def test_finetune_help_names_the_methods() -> None:
    result = run_entry("finetune", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: lit-model finetune lora|full|adapter|dpo|grpo [flags]")


@pytest.mark.parametrize(
    "args, message",
    [
        (("finetune",), "needs a method: lora, full, adapter, dpo or grpo"),
        (("finetune", "qlora"), "needs a method (got 'qlora')"),
        (("fintune",), "Unknown command 'fintune'. Did you mean finetune?"),
        (("plan",), "needs a command to plan"),
        (("plan", "download"), "cannot run 'download'"),
        (("plan", "evaluate"), "evaluate has no --plan"),
    ],
)
def test_bad_commands(args: tuple[str, ...], message: str) -> None:
    result = run_entry(*args)
    assert result.returncode == 2 and message in " ".join(result.stderr.split()) and "Traceback" not in result.stderr


def test_python_dash_m(tmp_path) -> None:
    """``python -m lit_model`` is the same command, in a fresh interpreter."""
    result = subprocess.run([sys.executable, "-m", "lit_model", "--help"], capture_output=True, text=True, cwd=tmp_path,
                            env={"PYTHONPATH": str(ROOT), "PATH": ""}, timeout=120)
    assert result.returncode == 0 and result.stdout == run_entry("--help").stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_processes_through_the_command(tiny_setup, tmp_path) -> None:
    """``python -m lit_model pretrain --devices 2``: Fabric's second process runs the same script, and the run
    equals the script's own (the same losses at every logged step)."""
    from tests.test_pretrain import losses, pretrain, tiny_args

    env = {**os.environ, "PYTHONPATH": str(ROOT), "LIT_MODEL_CACHE": str(tiny_setup["root"] / "cache")}
    env.pop("LIT_MODEL_DEBUG", None)
    command = [sys.executable, "-m", "lit_model", "pretrain", *map(str, tiny_args(tiny_setup, tmp_path / "cmd")),
               "--devices", "2", "--strategy", "ddp"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stderr
    assert pretrain(tiny_setup, tmp_path / "script", "--devices", "2", "--strategy", "ddp").returncode == 0
    assert losses(tmp_path / "cmd") == losses(tmp_path / "script")
    assert json.loads((tmp_path / "cmd" / "summary.json").read_text())["devices"] == 2
