"""Shared fixtures: a tiny corpus, tokenizer and model config, so training tests take seconds."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import runpy
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Optional, Union
from urllib.parse import unquote, urlparse

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
TINY_CONFIG = """\
name: test-tiny
block_size: 64
vocab_size: 512
n_layer: 2
n_embd: 64
n_head: 4
n_query_groups: 2
intermediate_size: 128
"""


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and a busy machine does not stall them (in this process and in
    the scripts it starts): a module asks for it with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _keep_sigint_handler():
    """Scripts run in-process (directly, through ``lit-model`` or the tutorial's commands) set SIGINT to its default
    action while they import; give every test the test process's own handler back."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)


@pytest.fixture(scope="session")
def tiny_setup(tmp_path_factory) -> dict[str, Path]:
    """A 5-file corpus, a 512-token BPE tokenizer trained on it, and a ~140k-parameter model config."""
    from lit_model.io.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("tiny")
    data = root / "data"
    data.mkdir()
    sources = [STDLIB / f"{name}.py" for name in ("textwrap", "shlex", "fnmatch", "argparse", "string")]
    for source in sources:
        (data / f"{source.stem}.txt").write_text(source.read_text())
    train_bpe(sources, 512, root / "tokenizer")
    (root / "tiny.yaml").write_text(TINY_CONFIG)
    return {"root": root, "data": data, "tokenizer": root / "tokenizer", "config": root / "tiny.yaml"}


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_setup: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A randomly initialised checkpoint of the tiny setup's model, with its tokenizer (read-only for tests)."""
    from lit_model import GPT, Config
    from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir

    torch.manual_seed(0)
    model = GPT(Config.from_file(tiny_setup["config"]))
    model.init_weights()
    out_dir = tmp_path_factory.mktemp("tiny-ckpt") / "tiny"
    return save_checkpoint_dir(lit_state_dict(model, model.config), model.config, out_dir,
                               tokenizer_dir=tiny_setup["tokenizer"])


def random_checkpoint(config: Any, tokenizer_dir: Path, out_dir: Path, std: float = 0.1) -> Path:
    """A checkpoint of ``config`` with normal(0, ``std``) weights (seeded): large enough that greedy decoding does not
    repeat one token and that a model's choices differ."""
    from lit_model import GPT
    from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir

    torch.manual_seed(0)
    model = GPT(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, std)
    return save_checkpoint_dir(lit_state_dict(model, config), config, out_dir, tokenizer_dir=tokenizer_dir)


def run_script(script: str, *args: str, cache: Path | None = None, timeout: float = 300, **popen) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("LIT_MODEL_DEBUG", None)
    if cache is not None:
        env["LIT_MODEL_CACHE"] = str(cache)
    return subprocess.run(
        [sys.executable, str(ROOT / script), *map(str, args)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout, **popen,
    )


def run_captured(call: Callable[[], Any], args: list[str]) -> subprocess.CompletedProcess:
    """Run ``call`` in this process as a command line would: (exit status, stdout, stderr). An exception that
    escapes it (what a user would see as a traceback) comes back as exit status -1 with the traceback on stderr."""
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            call()
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        except BaseException:  # noqa: BLE001 - what escapes the command is the failure under test
            traceback.print_exc()
            code = -1
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def run_script_inprocess(script: str, *args: str, cache: Path | None = None, monkeypatch=None) -> subprocess.CompletedProcess:
    """``run_script`` without a new interpreter (~50 ms instead of ~3 s): runs ``script`` as ``__main__`` with
    ``args`` as its command line (see ``run_captured``). Needs pytest's ``monkeypatch`` for the cache."""
    if cache is not None:
        monkeypatch.setenv("LIT_MODEL_CACHE", str(cache))
    argv = sys.argv
    sys.argv = [str(ROOT / script), *map(str, args)]
    try:
        return run_captured(lambda: runpy.run_path(str(ROOT / script), run_name="__main__"), list(sys.argv))
    finally:
        sys.argv = argv


def read_metrics(out_dir: Path) -> list[dict[str, str]]:
    with open(out_dir / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


# ---- a Hugging Face Hub on 127.0.0.1 (tests/test_download.py, tests/test_recipe.py) ---------------------------
HUB_REPO = "tiny-org/tiny-llama"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_hf(tiny_setup, tmp_path_factory) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """A tiny HF Llama saved by transformers with the tiny tokenizer, files a real repository would hold but
    conversion does not need, and (input ids, the HF model's logits on them)."""
    transformers = pytest.importorskip("transformers")
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
    as local directories. ``gated`` repositories refuse their files without a token (as the Hub does).
    ``faults`` break files on purpose: file name -> an HTTP status to answer instead, "close" (the connection
    closes halfway through the body) or "hang" (never answers); a name no repository holds is listed as if it
    did, and "api" breaks the repository listing instead of a file."""

    daemon_threads = True

    def __init__(self, repos: dict[str, Path], gated: frozenset[str] = frozenset(),
                 faults: Optional[dict[str, Union[int, str]]] = None) -> None:
        super().__init__(("127.0.0.1", 0), HubHandler)
        self.repos, self.gated, self.faults = repos, gated, dict(faults or {})
        self.stop = threading.Event()  # ends the "hang" answers at teardown
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
        listed = sorted({*files, *self.server.faults} - {"api"})
        if parts[0] == "api" and self._fault("api", send_body):
            return None
        if parts[0] == "api" and rest[:1] == ["revision"]:
            info = {"id": repo_id, "modelId": repo_id, "sha": HUB_COMMIT, "private": False,
                    "gated": "manual" if repo_id in self.server.gated else False,
                    "siblings": [{"rfilename": f} for f in listed]}
            return self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, send_body)
        if parts[0] == "api" and rest[:1] == ["tree"]:
            tree = [{"type": "file", "path": f, "size": (root / f).stat().st_size if f in files else 1,
                     "oid": sha1_file(root / f) if f in files else "0" * 40} for f in listed]
            return self._send(200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body)
        if rest[:1] == ["resolve"]:
            if repo_id in self.server.gated and "authorization" not in {k.lower() for k in self.headers}:
                return self._send(401, b'{"error": "gated"}', {"X-Error-Code": "GatedRepo"}, send_body)
            name = "/".join(rest[2:])
            if self._fault(name, send_body, root / name):
                return None
            if name not in files:
                return self._send(404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, send_body)
            if send_body:
                self.server.fetched.append(name)
            body = (root / name).read_bytes()
            etag = f'"{sha1_file(root / name)}"'
            return self._send(200, body, {"X-Repo-Commit": HUB_COMMIT, "ETag": etag, "X-Linked-Etag": etag}, send_body)
        self._send(404, b"{}", {}, send_body)

    def _fault(self, name: str, send_body: bool, path: Optional[Path] = None) -> bool:
        """Answer with the fault planted for ``name``, if any (see ``Hub``)."""
        fault = self.server.faults.get(name)
        if fault is None:
            return False
        if fault == "hang":
            self.server.stop.wait()
        elif fault == "close":  # the headers promise the whole file; half of it comes, then the connection ends
            body = path.read_bytes() if path is not None and path.is_file() else b"x" * 4096
            etag = f'"{hashlib.sha1(body).hexdigest()}"'
            self.send_response(200)
            for key, value in {"X-Repo-Commit": HUB_COMMIT, "ETag": etag, "X-Linked-Etag": etag,
                               "Content-Length": str(len(body))}.items():
                self.send_header(key, value)
            self.end_headers()
            if send_body:
                self.wfile.write(body[: len(body) // 2])
            self.close_connection = True
        else:
            self._send(int(fault), b'{"error": "planted"}', {}, send_body)
        return True

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)


def sha1_file(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


@pytest.fixture
def serve():
    """Start a Hub on 127.0.0.1 for the given repositories; stopped at teardown."""
    servers: list[Hub] = []

    def start(repos: dict[str, Path], gated: frozenset[str] = frozenset(),
              faults: Optional[dict[str, Union[int, str]]] = None) -> Hub:
        server = Hub(repos, gated, faults)
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop.set()
        server.shutdown()
        server.server_close()
