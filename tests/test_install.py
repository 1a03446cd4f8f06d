"""An installed lit-model is whole: the wheel built from this checkout, installed apart from it, runs `lit-model
pretrain`, `finetune lora`, `generate` and `plan` from a directory outside the checkout, on its own code (nothing is
read from the source tree: the commands are the recipes in lit_model/recipes, the model registry ships in the
wheel)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, installed without its dependencies (they are this environment's) into a directory of its own."""
    root = tmp_path_factory.mktemp("install")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(root / "wheel"), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    (wheel,) = (root / "wheel").glob("lit_model-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "lit_model/core/configs/llama3.yaml" in names and "lit_model/recipes/pretrain.py" in names
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(root / "site"),
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr
    return root / "site"


def lit_model(site: Path, cwd: Path, cache: Path, *args: object) -> subprocess.CompletedProcess:
    # PYTHONPATH puts the installed copy before this environment's (editable) one; the checkout is not on the path
    env = {**os.environ, "PYTHONPATH": str(site), "LIT_MODEL_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    env.pop("LIT_MODEL_DEBUG", None)
    return subprocess.run([sys.executable, str(site / "bin" / "lit-model"), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_the_installed_wheel_runs_every_command_outside_the_checkout(site: Path, tiny_setup: dict[str, Path],
                                                                      tmp_path: Path) -> None:
    work, cache = tmp_path / "elsewhere", tiny_setup["root"] / "cache"
    work.mkdir()
    where = subprocess.run([sys.executable, "-c", "import lit_model; print(lit_model.__file__)"], cwd=work,
                           env={**os.environ, "PYTHONPATH": str(site)}, capture_output=True, text=True)
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout

    small = ("--micro_batch_size", 2, "--global_batch_size", 4, "--max_steps", 3, "--eval_interval", 3,
             "--eval_iters", 1, "--warmup_steps", 1, "--log_interval", 1)
    pretrain = lit_model(site, work, cache, "pretrain", "--model_config", tiny_setup["config"], "--tokenizer_dir",
                         tiny_setup["tokenizer"], "--data_path", tiny_setup["data"], "--out_dir", "out/pretrain", *small)
    assert pretrain.returncode == 0, pretrain.stderr
    final = work / "out" / "pretrain" / "final"
    assert (final / "model.safetensors").is_file() and (work / "out" / "pretrain" / "summary.json").is_file()

    data = work / "data.jsonl"
    data.write_text("".join(f'{{"instruction": "Add {a} and 1.", "input": "", "output": "{a + 1}"}}\n' for a in range(16)))
    lora = lit_model(site, work, cache, "finetune", "lora", "--checkpoint_dir", final, "--data_path", data,
                     "--out_dir", "out/lora", "--prompt_style", "default", *small)
    assert lora.returncode == 0, lora.stderr
    assert (work / "out" / "lora" / "final" / "lora.safetensors").is_file()

    generate = lit_model(site, work, cache, "generate", "--checkpoint_dir", "out/lora/final", "--prompt", "def f(x):",
                         "--max_new_tokens", 5)
    assert generate.returncode == 0 and generate.stdout.strip() and "5 tokens in 1 sample" in generate.stderr, generate.stderr

    plan = lit_model(site, work, cache, "plan", "finetune", "lora", "--checkpoint_dir", final, "--data_path", data,
                     "--prompt_style", "default", "--device_memory", "24GB", *small)
    assert plan.returncode == 0 and plan.stdout.startswith("Memory plan (per rank): test-tiny"), plan.stderr
