"""``python -m lit_model.download``: the real huggingface_hub code path against a Hub the test serves itself on
127.0.0.1 (the API endpoints huggingface_hub calls) or a cache the test lays out (offline mode), then the
conversion, checked by logit parity with the Hugging Face model. Nothing reaches the network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
hub_constants = pytest.importorskip("huggingface_hub.constants")
hub_http = pytest.importorskip("huggingface_hub.utils._http")

from conftest import HUB_COMMIT as COMMIT, HUB_REPO as REPO, sha1_file as _sha1  # noqa: E402
from lit_model.io.download import download, resolve_checkpoint  # noqa: E402
from lit_model.core.errors import UsageError, UserError  # noqa: E402
from lit_model.methods.load import load_gpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    """Point huggingface_hub (already imported, so its constants are set) at a test cache and endpoint, with
    no token; the environment variables too, for what reads them at call time."""

    def configure(endpoint: str = "http://127.0.0.1:9", offline: bool = False) -> Path:
        cache = tmp_path / "hf-cache"
        for key, value in {"HF_HUB_CACHE": str(cache), "HF_ENDPOINT": endpoint,
                           "HF_HUB_OFFLINE": "1" if offline else "0", "HF_HOME": str(tmp_path / "hf-home")}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(cache))
        monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", offline)
        monkeypatch.setattr(hub_constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(hub_constants, "HUGGINGFACE_CO_URL_TEMPLATE", endpoint + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(hub_constants, "HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
        monkeypatch.setattr(hub_constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "hf-home" / "stored_tokens"))
        return cache

    return configure


def assert_same_logits(checkpoint: Path, idx: torch.Tensor, expected: torch.Tensor) -> None:
    model = load_gpt(checkpoint)
    with torch.no_grad():
        assert (model(idx) - expected).abs().max().item() <= 1e-5


NEEDED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_download_from_a_served_hub(tiny_hf, serve, hub_env, tmp_path, capsys) -> None:
    repo, idx, logits = tiny_hf
    hub = serve({REPO: repo})
    cache = hub_env(hub.url)
    out = download(REPO, checkpoint_dir=tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    assert capsys.readouterr().out.startswith(f"Saved a lit-model checkpoint of {REPO} to {out} (the downloaded files")
    # only the files conversion reads; config.json first, so an unsupported model fails before the weights
    assert hub.fetched[0] == "config.json" and sorted(hub.fetched) == NEEDED
    snapshot = cache / "models--tiny-org--tiny-llama" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == NEEDED
    assert (cache / "models--tiny-org--tiny-llama" / "refs" / "main").read_text() == COMMIT
    assert_same_logits(out, idx, logits)
    assert load_gpt(out).config.name == "tiny-llama"  # named after the repository, not the commit
    assert (out / "tokenizer.json").read_bytes() == (repo / "tokenizer.json").read_bytes()

    # a second download of the same repository reads the cache: no file is fetched again
    hub.fetched.clear()
    with pytest.raises(UserError, match="--overwrite"):
        download(REPO, checkpoint_dir=out)
    download(REPO, checkpoint_dir=out, overwrite=True)
    assert hub.fetched == []
    assert_same_logits(out, idx, logits)


def test_bin_weights_when_no_safetensors(tiny_hf, serve, hub_env, tmp_path) -> None:
    repo, idx, logits = tiny_hf
    bin_repo = tmp_path / "bin-repo"
    shutil.copytree(repo, bin_repo, ignore=shutil.ignore_patterns("*.safetensors", "original"))
    state = {k: v.clone() for k, v in transformers.LlamaForCausalLM.from_pretrained(repo).state_dict().items()}
    torch.save(state, bin_repo / "pytorch_model.bin")
    hub = serve({REPO: bin_repo})
    hub_env(hub.url)
    out = download(REPO, checkpoint_dir=tmp_path / "ckpt")
    assert "pytorch_model.bin" in hub.fetched and "README.md" not in hub.fetched
    assert_same_logits(out, idx, logits)


def test_offline_from_the_cache_layout(tiny_hf, hub_env, tmp_path, monkeypatch) -> None:
    """HF_HUB_OFFLINE=1: the files come from a cache laid out as huggingface_hub writes it."""
    repo, idx, logits = tiny_hf
    cache = hub_env(offline=True)
    storage = cache / "models--tiny-org--tiny-llama"
    snapshot = storage / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (storage / "blobs").mkdir()
    for name in NEEDED:
        blob = storage / "blobs" / _sha1(repo / name)
        shutil.copy(repo / name, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(COMMIT)
    monkeypatch.chdir(tmp_path)
    out = download(REPO)
    assert out == Path("checkpoints/tiny-org/tiny-llama")
    assert_same_logits(tmp_path / out, idx, logits)

    with pytest.raises(UserError, match="HF_HUB_OFFLINE is set.*lit_model.convert hf_to_lit --hf_dir"):
        download("tiny-org/not-cached")


def test_hub_errors(tiny_hf, serve, hub_env, tmp_path) -> None:
    repo, _, _ = tiny_hf
    unsupported = tmp_path / "unsupported"
    unsupported.mkdir()
    (unsupported / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    (unsupported / "model.safetensors").write_bytes(b"never fetched")
    gguf = tmp_path / "gguf"
    gguf.mkdir()
    shutil.copy(repo / "config.json", gguf / "config.json")
    (gguf / "tiny-llama.Q4_K_M.gguf").write_bytes(b"a quantized export")
    hub = serve({REPO: repo, "gated-org/gated-llama": repo, "org/t5": unsupported, "org/gguf": gguf},
                gated=frozenset({"gated-org/gated-llama"}))
    hub_env(hub.url)

    with pytest.raises(UserError, match="gated model.*--access_token.*HF_TOKEN"):
        download("gated-org/gated-llama", checkpoint_dir=tmp_path / "a")
    with pytest.raises(UserError, match=r"'t5' model; lit-model converts the model types llama, mistral, gpt_neox"):
        download("org/t5", checkpoint_dir=tmp_path / "b")
    assert "model.safetensors" not in hub.fetched  # refused before the weights
    with pytest.raises(UserError, match=r"no model 'meta-llama/Llama-3.2-1b'.*Did you mean meta-llama/Llama-3\.2-1B\b"):
        download("meta-llama/Llama-3.2-1b", checkpoint_dir=tmp_path / "c")
    with pytest.raises(UserError, match="org/gguf holds no weights in a layout lit-model converts"):
        download("org/gguf", checkpoint_dir=tmp_path / "d")
    assert hub.fetched[-1] == "config.json"
    with pytest.raises(UsageError, match="ORG/NAME.*meta-llama/Llama-3.2-1B"):
        download("Llama-3.2-1B")
    assert not any((tmp_path / d).exists() for d in "abcd")  # nothing was written


def test_no_network(hub_env, tmp_path, monkeypatch) -> None:
    hub_env("http://127.0.0.1:9")  # the discard port: nothing listens
    waits: list[float] = []  # huggingface_hub retries with backoff (about 23 s); the test skips the waiting
    monkeypatch.setattr(hub_http.time, "sleep", waits.append)
    with pytest.raises(UserError, match="could not be reached.*python -m lit_model.convert hf_to_lit --hf_dir"):
        download(REPO, checkpoint_dir=tmp_path / "x")
    assert waits  # the connection was tried, and retried, before giving up


def test_model_name_resolves_to_the_download(tiny_hf, serve, hub_env, tmp_path, monkeypatch, capsys) -> None:
    """--model_name ORG/NAME reads what `lit-model download ORG/NAME` wrote; one that is not there, and both
    flags at once, are refused with the fix; --plan falls back to the registry."""
    repo, _, _ = tiny_hf
    hub_env(serve({REPO: repo}).url)
    monkeypatch.chdir(tmp_path)
    default = Path("out/pretrain/final")
    with pytest.raises(UserError, match=f"`lit-model download {REPO}`.*--checkpoint_dir"):
        resolve_checkpoint(REPO, default, default, plan=False)
    with pytest.raises(UsageError, match=f"neither downloaded.*`lit-model download {REPO}`"):
        resolve_checkpoint(REPO, default, default, plan=True)

    out = download(REPO)
    assert f"lit-model chat --model_name {REPO}" in capsys.readouterr().out
    for plan in (False, True):
        directory, config = resolve_checkpoint(REPO, default, default, plan=plan)
        assert directory == out == Path("checkpoints", REPO) and config.name == "tiny-llama"
    assert resolve_checkpoint(None, out, default, plan=False)[0] == out
    with pytest.raises(UsageError, match="pass one of them"):
        resolve_checkpoint(REPO, out, default, plan=False)

    # not downloaded: planned from the registry under its repository id or its name; generating needs it
    assert resolve_checkpoint("Qwen/Qwen2.5-0.5B-Instruct", default, default, plan=True) == (
        None, resolve_checkpoint("Qwen2.5-0.5B-Instruct", default, default, plan=True)[1])
    assert resolve_checkpoint("Qwen2.5-0.5B-Instruct", default, default, plan=True)[1].n_layer == 24
    with pytest.raises(UserError, match="`lit-model download Qwen/Qwen2.5-0.5B-Instruct`"):
        resolve_checkpoint("Qwen2.5-0.5B-Instruct", default, default, plan=False)
    assert resolve_checkpoint("lit-model-5m", default, default, plan=True)[0] is None
    with pytest.raises(UsageError, match="no published weights.*--checkpoint_dir"):
        resolve_checkpoint("lit-model-5m", default, default, plan=False)
    with pytest.raises(UsageError, match="not a Hugging Face repository id"):
        resolve_checkpoint("a/b/c", default, default, plan=False)
    with pytest.raises(UserError, match="default out/pretrain/final does not exist yet.*--model_name ORG/NAME"):
        resolve_checkpoint(None, default, default, plan=False)


@pytest.mark.slow
def test_cli_in_a_fresh_process(tiny_hf, serve, tmp_path) -> None:
    """The command line, with huggingface_hub configured only by the environment (as a user does)."""
    repo, idx, logits = tiny_hf
    hub = serve({REPO: repo})
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path),
           "HF_HUB_OFFLINE": "0", "PYTHONPATH": str(ROOT)}
    env.pop("HF_TOKEN", None)
    result = subprocess.run([sys.executable, "-m", "lit_model.download", REPO, "--checkpoint_dir", str(tmp_path / "c")],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert_same_logits(tmp_path / "c", idx, logits)
    result = subprocess.run([sys.executable, "-m", "lit_model.download", "org/missing"], capture_output=True,
                            text=True, env=env, cwd=tmp_path, timeout=300)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: There is no model 'org/missing'" in result.stderr
