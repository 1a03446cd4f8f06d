"""Serve a checkpoint's model with OpenAI's API, through LitServe: continuous batching over a paged KV cache.

    lit-model serve --checkpoint_dir out/lora/final --port 8000
    lit-model serve --checkpoint_dir DIR --adapters sql=out/lora-sql/final,chat=out/lora-chat/final
    lit-model serve --checkpoint_dir DIR --kv_cache_memory 8GB --kv_cache_dtype int8 --plan text

Endpoints: POST /v1/chat/completions (in the checkpoint's chat template or prompt style) and /v1/completions (the
prompt as it is), streamed as server-sent events with "stream": true; GET /v1/models (the base model and each
``base:adapter``); GET /v1/pool (the KV cache's free and total blocks, running and waiting requests, requests
answered and their tokens, requests cancelled because their client went away: "abandoned"); GET /health (200 once
the model is loaded). Requests set temperature, top_p, top_k, max_tokens, stop and seed; the flags of the same names
are the defaults. SIGTERM or Ctrl-C: requests in flight
finish (within SHUTDOWN_GRACE_S seconds, else they end with an error) and the server exits 0 with a summary.
Needs LitServe: pip install "lit-model[serve]". The LitServe side is recipes/openai_api.py.
"""

from __future__ import annotations

import multiprocessing
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from lit_model.core.errors import UsageError, UserError, run_cli
from lit_model.infer.engine import Sampling
from lit_model.methods.lora import LORA_CONFIG, LoRAConfig
from lit_model.infer.paged import storage_dtype
from lit_model.plan.serving import check_serve_plan_fits, parse_pool_memory, plan_serving
from lit_model.recipes.cli import parse
from lit_model.recipes.generation import GenerationArgs, prepare_generation

try:  # the serve extra: without LitServe `lit-model serve` says how to install it (main)
    from lit_model.recipes import openai_api
except ModuleNotFoundError as missing:
    if missing.name.split(".")[0] not in ("litserve", "fastapi", "pydantic", "starlette"):
        raise
    openai_api = None

HOSTS = ("127.0.0.1", "0.0.0.0", "::")  # what LitServe binds to
SHUTDOWN_GRACE_S = 10  # how long a stop waits for requests in flight


@dataclass
class ServeArgs(GenerationArgs):
    """Serve a model with OpenAI's API (chat and text completions) over HTTP.

    Args:
        port: the TCP port to listen on (1024-65535)
        host: 127.0.0.1 (this machine only), 0.0.0.0 or :: (every network interface)
        kv_cache_memory: the paged KV cache pool: a fraction of the memory left after loading the weights (e.g. 0.5;
            GPU: free CUDA memory, CPU: available RAM), or bytes (e.g. 8GB)
        kv_cache_dtype: the keys' and values' dtype: auto (the compute dtype), bf16, fp16, fp32, or int8 / fp8
            (quantized per block: twice the sequences of a 16-bit cache)
        block_size: positions per KV cache block (a sequence holds only the blocks it has written)
        max_batch: sequences decoded together at most; more requests wait
        max_tokens: new tokens of a request that sets no max_tokens (at most what the context leaves after its
            prompt)
        adapters: LoRA adapters over the same base weights, served as the models BASE:NAME: NAME=DIR,NAME=DIR
            (each DIR holds lora.yaml and lora.safetensors, as a LoRA fine-tune's output does)
    """

    port: int = 8000
    host: str = "127.0.0.1"
    kv_cache_memory: str = "0.5"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_batch: int = 64
    max_tokens: int = 256
    adapters: Optional[str] = None


def main(args: ServeArgs) -> None:
    adapters = check_serve_args(args)
    pool = parse_pool_memory(args.kv_cache_memory)
    setup = prepare_generation(args)
    if args.plan is not None:
        plan = plan_serving(setup.config, setup.precision.name, args.quantize, pool, args.kv_cache_dtype,
                            args.block_size, args.max_batch, args.device_memory, setup.device_type, args.devices)
        print(plan.to_json() if args.plan == "json" else plan.to_text())
        return check_serve_plan_fits(plan)
    if openai_api is None:
        raise UserError('lit-model serve runs LitServe, which is not installed. Install it with pip install '
                        '"lit-model[serve]" (or pip install "litserve>=0.2.19,<0.3") and run again.')
    lora = setup.checkpoint_dir / LORA_CONFIG
    if adapters and lora.is_file() and not LoRAConfig.from_dir(setup.checkpoint_dir).merged:
        raise UsageError(
            f"{setup.checkpoint_dir} carries an unmerged LoRA of its own ({lora}), which --adapters would switch off. "
            "Serve its base checkpoint with every adapter in --adapters, or merge it first (lit-model merge).")
    for name, directory in adapters:
        LoRAConfig.from_dir(directory)  # a LoRA directory (its weights are checked when the worker loads them)

    check_port_free(args.host, args.port)
    name = setup.config.name or setup.checkpoint_dir.name
    defaults = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    options = openai_api.ServeOptions(
        setup.checkpoint_dir, name, args.devices, setup.precision, args.quantize, setup.style, pool, args.kv_cache_dtype,
        args.block_size, args.max_batch, args.max_tokens, defaults, tuple(setup.stop), adapters,
        f"http://{args.host}:{args.port}")
    spawn = multiprocessing.get_context("spawn")  # LitServe's worker is a spawned process
    stats = spawn.Array("q", len(openai_api.STAT_FIELDS))
    spec = openai_api.ServeSpec(name, tuple(n for n, _ in adapters), spawn.Queue(), stats)
    server = openai_api.Server(openai_api.EngineAPI(options, spec), accelerator=setup.device_type, devices=1,
                               timeout=False)
    openai_api.install_error_handlers(server.app)
    server.uvicorn_graceful_timeout = SHUTDOWN_GRACE_S
    print(f"Loading {name} from {setup.checkpoint_dir} ...", file=sys.stderr, flush=True)
    with server.stopping_on_signals():
        try:
            server.run(host=args.host, port=args.port, num_api_servers=1, log_level="warning",
                       generate_client_file=False)
        except openai_api.WorkerFailed:
            raise SystemExit(1) from None  # the worker printed why
    counts = dict(zip(openai_api.STAT_FIELDS, stats[:]))
    print(f"Stopped: served {counts['requests']} requests, generated {counts['tokens']} tokens "
          f"({counts['abandoned']} requests abandoned by their clients).", file=sys.stderr, flush=True)


def check_serve_args(args: ServeArgs) -> tuple[tuple[str, Path], ...]:
    """The serving flags, before any file is read; returns --adapters as (name, directory) pairs."""
    if args.compile:
        raise UsageError("--compile is not supported by lit-model serve (its engine runs batches of changing shapes).")
    if args.host not in HOSTS:
        raise UsageError(f"--host {args.host!r}: give 127.0.0.1 (this machine), 0.0.0.0 or :: (every interface).")
    if not 1024 <= args.port <= 65535:
        raise UsageError(f"--port {args.port} must be between 1024 and 65535.")
    for flag, least in (("block_size", 1), ("max_batch", 1), ("max_tokens", 1)):
        if getattr(args, flag) < least:
            raise UsageError(f"--{flag} {getattr(args, flag)} must be at least {least}.")
    storage_dtype(args.kv_cache_dtype, torch.float32)  # checks the name
    adapters = []
    for item in (args.adapters or "").split(","):
        if not item.strip():
            continue
        name, _, directory = item.partition("=")
        name = name.strip()
        if not name or not directory.strip() or ":" in name or name in dict(adapters):
            raise UsageError(f"--adapters {args.adapters!r}: give NAME=DIR pairs, comma-separated, each NAME once and "
                             "without ':', e.g. --adapters sql=out/lora-sql/final,chat=out/lora-chat/final.")
        adapters.append((name, Path(directory.strip())))
    return tuple(adapters)


def check_port_free(host: str, port: int) -> None:
    """Before the model loads: LitServe binds the port only then, and says it is taken in uvicorn's log format."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as error:
            raise UserError(f"Cannot listen on {host}:{port} ({error.strerror}): another server uses the port. Stop it "
                            "or pass another --port.") from None


def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> ServeArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(ServeArgs, sys.argv[1:] if argv is None else list(argv), prog)))
