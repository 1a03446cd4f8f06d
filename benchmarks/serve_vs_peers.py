"""lit-model serve against transformers serve (continuous batching) and litgpt serve: the real servers, one model,
the same prompts, streamed greedy chat completions from 1, 4 and 16 concurrent clients (issue 48's target: at 16
clients, >= 1.2x the better peer's tokens/s, with equal greedy outputs).

    python benchmarks/serve_vs_peers.py                           # 1, 4, 16 clients, median of 3 (installs litgpt)
    python benchmarks/serve_vs_peers.py --quick                   # 1 and 4 clients, one repeat: a smoke check
    python benchmarks/serve_vs_peers.py --servers lit_model transformers --clients 16 --repeats 5

The model (made once under benchmarks/.peers/serve/): SmolLM2-135M's shape scaled down to 25M parameters (Llama:
8 layers x 384, 6 query heads over 2 key/value heads, SwiGLU 1024, vocab 16384 untied, context 1024) with random
weights, written by transformers from lit-model's config_to_hf (benchmarks/_peer_prep.py serve_model) with a
byte-level BPE tokenizer of exactly 16384 tokens (lit_model.io.tokenizer.train_bpe on the Python standard library's
sources) and a chat template that renders the user's text as it is (what litgpt's default prompt style does, so
every server feeds the model the same tokens). The end-of-text token's output row is zero, so greedy decoding never
stops early: every request generates its whole max_tokens on every server. lit-model reads it through `lit-model
convert hf_to_lit`; litgpt through its own weight copy (copy_weights_hf_llama, what `litgpt convert_to_litgpt`
runs for a Llama: that command takes only the names of litgpt's registry, and the smallest Llama there is
SmolLM2-135M); transformers as it is. All compute in float32.

The servers, each started by this script, on 127.0.0.1, with OMP_NUM_THREADS = MKL_NUM_THREADS = --threads:
  lit-model     lit-model serve --checkpoint_dir DIR --precision 32-true --port P
  transformers  transformers serve DIR --continuous-batching --device cpu --dtype float32 --port P
  litgpt        litgpt serve DIR --openai_spec true --stream true --accelerator cpu --devices 1
                --precision 32-true --temperature 0 --max_new_tokens M --timeout 600 --port P
litgpt's server reads a request's temperature as `temperature or its default`, so 0 means its --temperature:
greedy decoding is its flag (it reads a request's max_completion_tokens; --max_new_tokens is the same number).
--stream true: without it, LitServe sent this streamed chat a chunk a second. --timeout: its default (30 s) fails
the requests that wait in its queue (it serves one request at a time) longer than that.

What is measured: each server alone on the machine (one is started, warmed up with two requests, measured at every
concurrency, stopped; then the next), `--repeats` rounds in a rotating order; the table has the medians of the
rounds. At C concurrent clients, max(8, C x --requests_per_client) requests, prompts taken in order from
prompts.json (corpus pieces of 8, 24, 64, 160 and 384 tokens in turn), each client sending its next request when
its previous one has ended: POST /v1/chat/completions, temperature 0, max_completion_tokens --max_tokens, streamed
(server-sent events, read with httpx). tokens/s: all the completion tokens (the usage a server reports, else its
content chunks: litgpt reports 0 and streams a chunk per token) over the time from the first request sent to the last one ended. TTFT: from sending a request to
its first chunk with content; p50 and p95 over the requests. greedy_equal: of this server's outputs, how many are
the same text as lit-model's for the same prompt (lit-model's own: its outputs at every concurrency against the
first one it gave for that prompt, at the lowest concurrency).

Results: benchmarks/results/serve_vs_peers.md and .csv.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx
from _tables import cpu_description, csv_text, markdown_table
from _venvs import LITGPT_VERSION, litgpt_python
from vs_peers import (CORPUS, WORK, base_env, lit_env, lit_llama_fields, litgpt_llama_fields, prep, quiet_run,
                      write_corpus, write_yaml)

HERE = Path(__file__).resolve().parent
SERVE = WORK / "serve"
NAME = "serve-25m"
# SmolLM2-135M's shape scaled down (Llama: RMSNorm, SwiGLU, 3 query heads per key/value head), untied: 25M parameters
ARCH = dict(vocab_size=16384, padded_vocab_size=16384, n_layer=8, n_embd=384, n_head=6, n_query_groups=2,
            intermediate_size=1024, norm_eps=1e-5, rope_base=10000, tie_embeddings=False)
BLOCK = 1024
HF_DIR, LIT_DIR, LITGPT_DIR = SERVE / "hf" / NAME, SERVE / "lit" / NAME, SERVE / "litgpt" / NAME
SERVERS = ("lit_model", "transformers", "litgpt")
STARTUP_S = 300  # the longest a server may take to answer /health
STOP_S = 20  # SIGTERM, then this long before SIGKILL
REQUEST_S = 600  # the longest one streamed request may take
WARMUP_PROMPTS = (0, 4)  # the shortest and the longest prompt: kernels and buffers of both sizes exist


@dataclass(frozen=True)
class Sample:
    prompt: int  # index into prompts.json
    text: str
    tokens: int
    ttft_s: float


@dataclass(frozen=True)
class Level:
    """One server at one concurrency in one round."""
    samples: tuple[Sample, ...]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return sum(s.tokens for s in self.samples) / self.seconds


# ---- the model, in each server's form -------------------------------------------------------------
def prepare(servers: list[str]) -> Optional[str]:
    """Make what is missing of the checkpoints; litgpt's interpreter (its venv, made on first use) if it runs."""
    SERVE.mkdir(parents=True, exist_ok=True)
    if not (HF_DIR / "model.safetensors").exists():
        write_corpus()
        lit_yaml = SERVE / "model.yaml"
        write_yaml(lit_yaml, lit_llama_fields(NAME, BLOCK, ARCH))
        tmp = HF_DIR.with_name(NAME + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        prep(sys.executable, "hf_config", lit_yaml, tmp)
        prep(sys.executable, "serve_model", CORPUS, tmp)
        os.replace(tmp, HF_DIR)
    if "lit_model" in servers and not (LIT_DIR / "model.safetensors").exists():
        quiet_run([lit_model_program(), "convert", "hf_to_lit", "--hf_dir", HF_DIR, "--out_dir", LIT_DIR,
                   "--overwrite", "true"], lit_env(), SERVE)
    if "litgpt" not in servers:
        return None
    litgpt = litgpt_python(("litserve", "requests"))  # `litgpt serve` needs LitServe, its command line requests
    if not (LITGPT_DIR / "lit_model.pth").exists():
        litgpt_yaml = SERVE / "litgpt.yaml"
        write_yaml(litgpt_yaml, litgpt_llama_fields(NAME, BLOCK, ARCH))
        prep(litgpt, "litgpt_from_hf", HF_DIR, litgpt_yaml, LITGPT_DIR, env=base_env())
    return litgpt


def lit_model_program() -> str:
    return str(Path(sys.executable).with_name("lit-model"))


# ---- the servers ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Server:
    name: str
    argv: tuple[str, ...]
    env: dict[str, str]
    model: Optional[str]  # the request's "model"; None: the first of GET /v1/models


def server(name: str, port: int, threads: int, max_tokens: int, litgpt: Optional[str]) -> Server:
    threads_env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    if name == "lit_model":
        argv = [lit_model_program(), "serve", "--checkpoint_dir", LIT_DIR, "--precision", "32-true", "--port", port]
        return Server(name, tuple(map(str, argv)), {**lit_env(), **threads_env}, None)
    if name == "transformers":
        argv = [Path(sys.executable).with_name("transformers"), "serve", HF_DIR, "--continuous-batching",
                "--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", port]
        return Server(name, tuple(map(str, argv)), {**base_env(), **threads_env}, str(HF_DIR))
    argv = [Path(litgpt).with_name("litgpt"), "serve", LITGPT_DIR, "--openai_spec", "true", "--stream", "true",
            "--accelerator", "cpu",
            "--devices", 1, "--precision", "32-true", "--temperature", 0, "--max_new_tokens", max_tokens,
            "--timeout", REQUEST_S, "--port", port]
    return Server(name, tuple(map(str, argv)), {**base_env(), **threads_env}, NAME)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(spec: Server, port: int, log: Path) -> subprocess.Popen:
    """The server, in its own process group (its workers go with it), once /health answers 200."""
    with open(log, "a") as handle:
        handle.write(f"$ {' '.join(spec.argv)}\n")
        handle.flush()
        process = subprocess.Popen(spec.argv, env=spec.env, cwd=SERVE, stdout=handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    deadline = time.monotonic() + STARTUP_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{spec.name} exited ({process.returncode}) before answering /health:\n{tail(log)}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    stop(process)
    raise RuntimeError(f"{spec.name} did not answer /health within {STARTUP_S} s:\n{tail(log)}")


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, then SIGKILL to whatever is left of it (a worker that outlived its
    parent, or a server that did not stop within STOP_S)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        if sig == signal.SIGTERM:
            try:
                process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                pass


def tail(log: Path, lines: int = 30) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


# ---- the clients ----------------------------------------------------------------------------------
async def request(client: httpx.AsyncClient, url: str, model: str, prompt: int, text: str, max_tokens: int) -> Sample:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_completion_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    pieces: list[str] = []
    usage: Optional[int] = None
    first: Optional[float] = None
    start = time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"the server streamed an error: {chunk['error']}")
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            content = "".join((choice.get("delta") or {}).get("content") or "" for choice in chunk.get("choices", []))
            if content:
                first = first or time.perf_counter()
                pieces.append(content)
    if first is None:
        raise RuntimeError(f"no content streamed for prompt {prompt}")
    return Sample(prompt, "".join(pieces), usage or len(pieces), first - start)  # litgpt's usage says 0


async def level(port: int, model: str, prompts: list[str], indices: list[int], clients: int, max_tokens: int) -> Level:
    """``clients`` concurrent clients, each sending the next of ``indices`` when its previous request has ended."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    queue = list(reversed(indices))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=REQUEST_S, limits=limits) as client:

        async def one_client() -> None:
            while queue:
                i = queue.pop()
                samples.append(await request(client, url, model, i, prompts[i], max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(clients)))
        seconds = time.perf_counter() - start
    return Level(tuple(sorted(samples, key=lambda s: s.prompt)), seconds)


def model_name(spec: Server, port: int) -> str:
    if spec.model is not None:
        return spec.model
    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]


def measure(spec: Server, port: int, prompts: list[str], plan: dict[int, list[int]], max_tokens: int,
            log: Path) -> dict[int, Level]:
    """Start the server, warm it up, run every concurrency of ``plan`` (clients: prompt indices), stop it."""
    process = start(spec, port, log)
    try:
        model = model_name(spec, port)
        asyncio.run(level(port, model, prompts, list(WARMUP_PROMPTS), len(WARMUP_PROMPTS), max_tokens))
        results = {}
        for clients, indices in plan.items():
            results[clients] = asyncio.run(level(port, model, prompts, indices, clients, max_tokens))
            print(f"  {spec.name:12s} {clients:3d} clients: {results[clients].tokens_per_s:7.1f} tokens/s, "
                  f"TTFT p50 {percentile([s.ttft_s for s in results[clients].samples], 50) * 1e3:.0f} ms",
                  flush=True)
        return results
    finally:
        stop(process)


# ---- the report -----------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile (the smallest value with at least q % of the values at or below it)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


def references(rounds: list[dict[str, dict[int, Level]]]) -> dict[int, str]:
    """lit-model's text for each prompt: the first it gave, at the lowest concurrency."""
    texts: dict[int, str] = {}
    for results in rounds:
        for clients in sorted(results.get("lit_model", {})):
            for sample in results["lit_model"][clients].samples:
                texts.setdefault(sample.prompt, sample.text)
    return texts


def rows(rounds: list[dict[str, dict[int, Level]]], servers: list[str], clients_list: list[int]) -> list[dict]:
    reference = references(rounds)
    out = []
    for clients in clients_list:
        speeds = {name: statistics.median(r[name][clients].tokens_per_s for r in rounds) for name in servers}
        best_peer = max((speeds[name] for name in servers if name != "lit_model"), default=None)
        for name in servers:
            samples = [s for r in rounds for s in r[name][clients].samples]
            ttft = [s.ttft_s * 1e3 for s in samples]
            compared = [s for s in samples if s.prompt in reference]
            equal = sum(s.text == reference[s.prompt] for s in compared)
            ours = name == "lit_model" and best_peer
            out.append({"clients": clients, "server": name, "tokens_per_s": round(speeds[name], 1),
                        "ttft_p50_ms": round(percentile(ttft, 50)), "ttft_p95_ms": round(percentile(ttft, 95)),
                        "requests": len(samples), "tokens_per_request": round(statistics.mean(s.tokens for s in samples), 1),
                        "greedy_equal": f"{equal}/{len(compared)}" if reference else "-",
                        "lit_model_vs_best_peer": round(speeds[name] / best_peer, 2) if ours else ""})
    return out


def write(table: list[dict], args: argparse.Namespace, load: tuple[float, float], seconds: float) -> None:
    from lit_model.core.files import atomic_write  # imported after the runs: it imports torch

    results = HERE / "results"
    results.mkdir(exist_ok=True)
    atomic_write(results / f"{args.out}.csv", csv_text(table))
    at_16 = [row for row in table if row["clients"] == max(args.clients) and row["lit_model_vs_best_peer"] != ""]
    verdict = (f"At {max(args.clients)} clients lit-model generates {at_16[0]['lit_model_vs_best_peer']}x the "
               "tokens/s of the better peer (target: >= 1.2x).") if at_16 else ""
    flags = " ".join(f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
                     if k != "quick")
    atomic_write(results / f"{args.out}.md", "\n".join([
        f"# Serving: lit-model vs transformers serve and litgpt {LITGPT_VERSION} serve (CPU, median of "
        f"{args.repeats})",
        "",
        f"Regenerate: `python benchmarks/serve_vs_peers.py {flags}` ({seconds / 60:.0f} minutes). See the script's "
        "docstring for the model, the servers' command lines and what is measured.",
        "",
        f"CPU: {cpu_description()}; {args.threads} threads per server (OMP_NUM_THREADS, MKL_NUM_THREADS). 1-minute "
        f"load average {load[0]:.1f} before, {load[1]:.1f} after (the machine is shared with other jobs: absolute "
        "speeds move with their load; each round measures every server once, in a rotating order).",
        "",
        f"Model: {NAME} (SmolLM2-135M's shape scaled down), random weights, float32; streamed chat completions, greedy, "
        f"{args.max_tokens} new tokens each; prompts of 8-384 tokens. greedy_equal: outputs with the same text as "
        "lit-model's for the same prompt.",
        "",
        markdown_table(table),
        "",
        verdict,
        "",
    ]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--clients", nargs="+", type=int, default=[1, 4, 16])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests_per_client", type=int, default=3)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="serve_vs_peers", help="the results' file name, without suffix")
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, one repeat")
    args = parser.parse_args()
    # SIGTERM (timeout, kill) as an exception: measure's finally stops the server, which runs in its own session
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    if args.quick:
        args.clients, args.repeats = [1, 4], 1
    litgpt = prepare(args.servers)
    prompts = json.loads((HF_DIR / "prompts.json").read_text())
    plan = {c: [i % len(prompts) for i in range(max(8, c * args.requests_per_client))] for c in args.clients}
    log = SERVE / "servers.log"
    load_before, start = os.getloadavg()[0], time.monotonic()
    rounds = []
    for r in range(args.repeats):
        order = args.servers[r % len(args.servers):] + args.servers[:r % len(args.servers)]
        print(f"round {r + 1}/{args.repeats}", flush=True)
        rounds.append({name: measure(server(name, port := free_port(), args.threads, args.max_tokens, litgpt), port,
                                     prompts, plan, args.max_tokens, log) for name in order})
    table = rows(rounds, args.servers, args.clients)
    print(markdown_table(table))
    write(table, args, (load_before, os.getloadavg()[0]), time.monotonic() - start)


if __name__ == "__main__":
    main()
