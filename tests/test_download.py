"""``python -m lit_model.download``: the real huggingface_hub code path against a Hub the test serves itself on
127.0.0.1 (the API endpoints huggingface_hub calls) or a cache the test lays out (offline mode), then the
conversion, checked by logit parity with the Hugging Face model. Nothing reaches the network."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
import torch

transformers = pytest.importorskip("transformers")
hub_constants = pytest.importorskip("huggingface_hub.constants")
hub_http = pytest.importorskip("huggingface_hub.utils._http")

from lit_model.download import download  # noqa: E402
from lit_model.errors import UsageError, UserError  # noqa: E402
from lit_model.model import GPT  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_hf(tiny_setup, tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A tiny HF Llama saved by transformers with the tiny tokenizer, files a real repository would hold but
    conversion does not need, and (input ids, the HF model's logits on them)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # HF's init leaves norms at 1: randomize so a misplaced norm would show
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    repo = tmp_path_factory.mktemp("repo") / "tiny-llama"
    model.save_pretrained(repo)
    for path in tiny_setup["tokenizer"].iterdir():
        shutil.copy(path, repo / path.name)
    (repo / "pytorch_model.bin").write_bytes(b"not needed: the safetensors are there")
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.00.pth").write_bytes(b"not needed either")
    (repo / "README.md").write_text("# tiny\n")
    idx = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx).logits
    return repo, idx, logits


class Hub(ThreadingHTTPServer):
    """The Hub endpoints huggingface_hub's snapshot_download and hf_hub_download call, for repositories given
    as local directories. ``gated`` repositories refuse their files without a token (as the Hub does)."""

    daemon_threads = True

    def __init__(self, repos: dict[str, Path], gated: frozenset[str] = frozenset()) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos, self.gated = repos, gated
        self.fetched: list[str] = []  # files served with GET, in order

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class HubHandler(BaseHTTPRequestHandler):
    server: Hub

    def log_message(self, *args: object) -> None:  # keep pytest's output clean
        pass

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def _answer(self, send_body: bool) -> None:
        parts = unquote(urlparse(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            repo_id, rest = "/".join(parts[2:4]), parts[4:]
        else:
            repo_id, rest = "/".join(parts[:2]), parts[2:]
        root = self.server.repos.get(repo_id)
        if root is None:
            return self._send(401, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, send_body)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        if parts[0] == "api" and rest[:1] == ["revision"]:
            info = {"id": repo_id, "modelId": repo_id, "sha": COMMIT, "private": False,
                    "gated": "manual" if repo_id in self.server.gated else False,
                    "siblings": [{"rfilename": f} for f in files]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, send_body)
        if parts[0] == "api" and rest[:1] == ["tree"]:
            tree = [{"type": "file", "path": f, "size": (root / f).stat().st_size, "oid": _sha1(root / f)}
                    for f in files]
            return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body)
        if rest[:1] == ["resolve"]:
            if repo_id in self.server.gated and "authorization" not in {k.lower() for k in self.headers}:
                return self._send(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, send_body)
            name = "/".join(rest[2:])
            if name not in files:
                return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, send_body)
            if send_body:
                self.server.fetched.append(name)
            body = (root / name).read_bytes()
            etag = f'"{_sha1(root / name)}"'
            return self._send(200, body, {"X-Repo-Commit": COMMIT, "ETag": etag, "X-Linked-Etag": etag}, send_body)
        self._send(404, b"{}", {}, send_body)

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)


def _sha1(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@pytest.fixture
def serve():
    """Start a Hub on 127.0.0.1 for the given repositories; stopped at teardown."""
    servers: list[Hub] = []

    def start(repos: dict[str, Path], gated: frozenset[str] = frozenset()) -> Hub:
        server = Hub(repos, gated)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


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
    model = GPT.from_checkpoint(checkpoint)
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
    assert GPT.from_checkpoint(out).config.name == "tiny-llama"  # named after the repository, not the commit
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
