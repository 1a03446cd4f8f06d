"""README's "Real models" recipe end to end, each command in a fresh process as a user types it: download from
a Hub served on 127.0.0.1 (a tiny Llama with a chat template, made by transformers), plan, LoRA fine-tune on
chat records, chat and generate, export back to transformers. Nothing reaches the network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT

transformers = pytest.importorskip("transformers")

REPO = "tiny-org/tiny-chat"
# ChatML, as Qwen's templates render it
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHATS = [
    {"messages": [{"role": "user", "content": f"Add {i} and 1."}, {"role": "assistant", "content": f"{i + 1}."}]}
    for i in range(24)
]


def lit_model(*args: str, cwd: Path, env: dict[str, str], stdin: str = "") -> subprocess.CompletedProcess:
    """``lit-model ARGS`` (``python -m lit_model`` is the same entry point); exit 0 or the output is shown."""
    result = subprocess.run([sys.executable, "-m", "lit_model", *args], input=stdin, capture_output=True, text=True,
                            cwd=cwd, env=env, timeout=600)
    assert result.returncode == 0, f"lit-model {' '.join(args)}:\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr
    return result


@pytest.mark.slow  # ~1 min: six commands, each a new process
def test_real_model_recipe(tiny_hf, serve, tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(tiny_hf[0], repo)
    (repo / "chat_template.jinja").write_text(TEMPLATE)
    hub = serve({REPO: repo})
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "hf-cache"), "HF_HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "0", "LIT_MODEL_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    for key in ("HF_TOKEN", "LIT_MODEL_DEBUG"):
        env.pop(key, None)
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(chat) + "\n" for chat in CHATS))

    result = lit_model("download", REPO, cwd=tmp_path, env=env)
    checkpoint = tmp_path / "checkpoints" / REPO
    assert f"lit-model chat --model_name {REPO}" in result.stdout
    assert {"model.safetensors", "model_config.yaml", "tokenizer.json", "chat_template.jinja", "manifest.json"} <= {
        p.name for p in checkpoint.iterdir()}

    result = lit_model("plan", "finetune", "lora", "--model_name", REPO, "--device_memory", "24GB", cwd=tmp_path, env=env)
    assert "fits" in result.stdout.lower() and not (tmp_path / "out").exists()  # planned: nothing written

    lit_model("finetune", "lora", "--model_name", REPO, "--data_path", "chat.jsonl", "--out_dir", "out/lora",
              "--max_steps", "2", "--global_batch_size", "4", "--micro_batch_size", "2", "--eval_interval", "2",
              "--eval_iters", "1", "--save_interval", "2", cwd=tmp_path, env=env)
    out = tmp_path / "out" / "lora"
    assert {"model.safetensors", "lora.safetensors", "chat_template.jinja", "manifest.json"} <= {
        p.name for p in (out / "final").iterdir()}
    assert json.loads((out / "summary.json").read_text())["steps"] == 2 and (out / "metrics.csv").is_file()

    result = lit_model("chat", "--checkpoint_dir", "out/lora/final", "--max_new_tokens", "8", cwd=tmp_path, env=env,
                       stdin="Add 3 and 1.\n/reset\nAdd 5 and 1.\n")
    assert result.stdout.strip() and result.stderr == "(conversation reset)\n"  # two replies (random text), no error
    result = lit_model("generate", "--model_name", REPO, "--prompt", "Add 2 and 1.", "--max_new_tokens", "8",
                       cwd=tmp_path, env=env)
    assert result.stdout.strip() and "tokens/s" in result.stderr

    lit_model("convert", "lit_to_hf", "--checkpoint_dir", "out/lora/final", "--out_dir", "out/hf", cwd=tmp_path, env=env)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "hf")
    tuned = transformers.AutoModelForCausalLM.from_pretrained(repo)
    with torch.no_grad():  # the export holds the fine-tuned weights: LoRA moved them from the base's
        idx = torch.tensor([[1, 2, 3, 4]])
        assert not torch.allclose(model(idx).logits, tuned(idx).logits)
