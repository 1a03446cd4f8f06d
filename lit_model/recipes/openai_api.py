"""`lit-model serve`'s LitServe side: OpenAI's API (``ServeSpec``) over the continuous-batching engine (``EngineAPI``
in LitServe's inference worker, a separate process, stepped by ``ServeLoop``). recipes/serve.py has the flags.

The HTTP process validates each request (pydantic; the model name) and queues a ``Job``; the worker tokenizes it in
the checkpoint's prompt style, answers ``Engine.rejection`` as a 400 before any byte is streamed, and turns each
engine step's tokens into text deltas. A client that goes away mid-request is told to the worker through the
``cancels`` queue (LitServe does not), which cancels it in the engine and so frees its blocks. The worker publishes
the engine's counters in ``stats`` (shared memory): ``GET /v1/pool`` shows them and the server's summary reads them.

LoRA adapters (``base:adapter`` model names) share the base weights; the engine runs one adapter's requests at a
time: requests queue in arrival order, and the adapter switches when the engine has drained the previous adapter's
requests (requests of the running adapter join it while no other adapter's request is waiting before them).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Iterator, Optional, Union

import litserve as ls
import psutil
import torch
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from litserve.loops.continuous_batching_loop import ContinuousBatchingLoop, Output
from litserve.specs.openai import (ChatCompletionRequest, ChatCompletionResponse, ChatCompletionResponseChoice,
                                   OpenAISpec, UsageInfo)
from litserve.utils import LitAPIStatus, ResponseBufferItem, WorkerSetupStatus
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from lit_model.core.errors import STOP_SIGNALS, Interrupted, UserError
from lit_model.core.units import format_bytes
from lit_model.infer.batching import Engine, Event, Request
from lit_model.infer.engine import Sampling
from lit_model.infer.load import Precision, load_model, resolve_devices
from lit_model.infer.paged import PoolSpec, block_bytes, storage_dtype
from lit_model.infer.stream import TextStream
from lit_model.io.prompts import PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.methods.lora import LoRAWeights, read_lora, use_lora
from lit_model.plan.serving import PoolMemory

# /v1/pool: the engine's counters, then the requests answered (to their end), the tokens they were given and the
# requests cancelled because their client went away
STAT_FIELDS = ("running", "waiting", "free_blocks", "total_blocks", "preemptions", "requests", "tokens", "abandoned")
IDLE_POLL_S = 0.005  # an idle worker looks for work this often (LitServe's loop would otherwise spin a core)


@dataclass(frozen=True)
class ServeOptions:
    """What the inference worker needs to build the engine (pickled into LitServe's worker process)."""

    checkpoint_dir: Path
    model_name: str  # the base model's name in the API
    devices: int
    precision: Precision
    quantize: Optional[str]
    style: PromptStyle
    pool: PoolMemory  # --kv_cache_memory
    kv_cache_dtype: str
    block_size: int
    max_batch: int
    max_tokens: int  # new tokens of a request that sets no max_tokens (at most the context left after its prompt)
    sampling: Sampling  # the defaults of a request that sets none; its seed: the first request's, + 1 per request
    stop: tuple[str, ...]  # --stop: ends every request
    adapters: tuple[tuple[str, Path], ...]  # (name, LoRA directory)
    address: str


@dataclass(frozen=True)
class Job:
    """One request as the HTTP process queues it for the worker: ``messages`` (chat) or ``prompt`` (completion)."""

    adapter: Optional[str]
    messages: Optional[tuple[tuple[str, str], ...]]  # (role, content)
    prompt: Optional[str]
    max_tokens: Optional[int]
    temperature: Optional[float]
    top_p: Optional[float]
    top_k: Optional[int]
    seed: Optional[int]
    stop: tuple[str, ...]


# ---- the HTTP side ------------------------------------------------------------------------------------------------
class ChatRequest(ChatCompletionRequest):
    """LitServe's chat request with OpenAI's limits checked, ``seed`` and (as vLLM) ``top_k``; unset sampling
    fields take the server's flags."""

    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)
    n: Optional[int] = Field(1, ge=1, le=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stream_options: Optional[dict[str, bool]] = None


class CompletionRequest(BaseModel):
    model: Optional[str] = ""
    prompt: Union[str, list[str]]
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=1)
    n: Optional[int] = Field(1, ge=1, le=1)
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[dict[str, bool]] = None
    seed: Optional[int] = Field(None, ge=0, lt=2**63)


def openai_error(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    """OpenAI's error body, which its clients show as the exception's message."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def install_error_handlers(app: Any) -> None:
    """Malformed JSON and bad fields: 400 in OpenAI's format, naming each field (FastAPI answers 422 in its own)."""

    async def invalid(request: HTTPRequest, error: RequestValidationError) -> JSONResponse:
        problems = []
        for item in error.errors():
            where = ".".join(str(part) for part in item.get("loc", ())[1:])
            problems.append(f"the body is not valid JSON ({item.get('ctx', {}).get('error', item['msg'])})"
                            if item.get("type") == "json_invalid" else f"{where or 'body'}: {item['msg']}")
        return openai_error(400, "Invalid request: " + "; ".join(problems) + ".")

    async def http_error(request: HTTPRequest, error: StarletteHTTPException) -> JSONResponse:
        return openai_error(error.status_code, str(error.detail))

    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _stop_strings(stop: Union[str, list[str], None]) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class ServeSpec(OpenAISpec):
    """OpenAI's API: ``/v1/chat/completions`` and ``/v1/completions`` (SSE streaming or not), ``/v1/models``, and
    ``/v1/pool`` (the engine's counters)."""

    def __init__(self, base: str, adapters: tuple[str, ...], cancels: Any, stats: Any) -> None:
        super().__init__()
        self.base, self.adapters, self.cancels, self.stats = base, adapters, cancels, stats

    def pre_setup(self, lit_api: ls.LitAPI) -> None:
        self.add_endpoint(self.api_path, self.chat_completion, ["POST"])
        self.add_endpoint("/v1/completions", self.completion, ["POST"])
        self.add_endpoint("/v1/models", self.models, ["GET"])
        self.add_endpoint("/v1/pool", self.pool, ["GET"])

    @property
    def model_names(self) -> list[str]:
        return [self.base, *(f"{self.base}:{name}" for name in self.adapters)]

    async def models(self) -> dict[str, Any]:
        created = int(time.time())
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "lit-model"}
                                           for name in self.model_names]}

    async def pool(self) -> dict[str, int]:
        with self.stats.get_lock():
            return dict(zip(STAT_FIELDS, self.stats[:]))

    def _adapter(self, model: Optional[str]) -> Union[Optional[str], JSONResponse]:
        """The adapter a model name selects (None: the base), or the 404 naming the served models."""
        if not model or model == self.base:
            return None
        base, _, adapter = model.partition(":")
        if base == self.base and adapter in self.adapters:
            return adapter
        return openai_error(404, f"The model {model!r} does not exist here. This server serves: "
                                 f"{', '.join(self.model_names)}.", param="model", code="model_not_found")

    async def chat_completion(self, request: ChatRequest, raw: HTTPRequest) -> Any:
        adapter = self._adapter(request.model)
        if isinstance(adapter, JSONResponse):
            return adapter
        messages = []
        for message in request.messages:
            content = message.content
            if isinstance(content, list):
                if any(getattr(part, "type", None) != "text" for part in content):
                    return openai_error(400, "Only text message content is supported (no images or audio).",
                                        param="messages")
                content = "".join(part.text for part in content)
            messages.append((message.role, content or ""))
        job = Job(adapter, tuple(messages), None, request.max_completion_tokens or request.max_tokens,
                  request.temperature, request.top_p, request.top_k, request.seed, _stop_strings(request.stop))
        return await self._answer(job, request, raw, chat=True)

    async def completion(self, request: CompletionRequest, raw: HTTPRequest) -> Any:
        adapter = self._adapter(request.model)
        if isinstance(adapter, JSONResponse):
            return adapter
        prompt = request.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                return openai_error(400, f"prompt holds {len(prompt)} prompts; send one per request.", param="prompt")
            prompt = prompt[0]
        job = Job(adapter, None, prompt, request.max_tokens, request.temperature, request.top_p, request.top_k,
                  request.seed, _stop_strings(request.stop))
        return await self._answer(job, request, raw, chat=False)

    async def _answer(self, job: Job, request: Union[ChatRequest, CompletionRequest], raw: HTTPRequest,
                      chat: bool) -> Any:
        """Queue ``job``; answer its rejection as an error, else stream it or collect it. A client that goes away
        (the stream closed, or a disconnect seen while collecting) cancels it in the worker."""
        uid = str(uuid.uuid4())
        pieces, event = deque(), asyncio.Event()
        self.response_buffer[uid] = ResponseBufferItem(event=event, response_queue=pieces)
        self.request_queue.put((self.response_queue_id, uid, time.monotonic(), job))
        replies = self._replies(uid, pieces, event)
        try:
            first = await anext(replies)  # the worker's acceptance (prompt_tokens) or its rejection
        except BaseException:
            await replies.aclose()
            raise
        if "error" in first:
            await replies.aclose()
            return openai_error(first["status"], first["error"], param=first.get("param"))
        model = request.model or self.base
        if request.stream:
            usage = bool((request.stream_options or {}).get("include_usage"))
            return StreamingResponse(self._events(replies, first, model, chat, usage), media_type="text/event-stream")
        return await self._collect(replies, first, model, chat, raw)

    async def _replies(self, uid: str, pieces: deque, event: asyncio.Event) -> AsyncIterator[dict[str, Any]]:
        """The worker's outputs for ``uid`` as dicts; closed before the last one, it cancels the request."""
        finished = False
        try:
            async for data, status in self.data_streamer(pieces, event, send_status=True):
                if status == LitAPIStatus.ERROR:
                    finished = True
                    yield {"error": "The model worker failed on this request (its log says why).", "status": 500}
                    return
                reply = json.loads(data)
                finished = "error" in reply or reply.get("finish_reason") is not None
                yield reply
                if finished:
                    return
        finally:
            self.response_buffer.pop(uid, None)
            if not finished:
                self.cancels.put(uid)

    async def _events(self, replies: AsyncIterator[dict[str, Any]], first: dict[str, Any], model: str, chat: bool,
                      usage: bool) -> AsyncIterator[str]:
        """Server-sent events: a chunk per delta, the last with the finish reason, usage if asked, [DONE]."""
        ident, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:12]}", int(time.time())
        reply = first
        try:
            if chat:  # OpenAI's first chat chunk names the role
                yield _sse(_chunk(ident, created, model, chat, {"role": "assistant", "content": ""}, None))
            async for reply in replies:
                if "error" in reply:
                    yield _sse({"error": {"message": reply["error"], "type": "server_error", "param": None,
                                          "code": None}})
                    return
                if reply["text"] or reply["finish_reason"]:
                    yield _sse(_chunk(ident, created, model, chat, {"content": reply["text"]}, reply["finish_reason"]))
            if usage:
                yield _sse({**_chunk(ident, created, model, chat, {}, None), "choices": [], "usage": _usage(first, reply)})
            yield "data: [DONE]\n\n"
        finally:
            await replies.aclose()

    async def _collect(self, replies: AsyncIterator[dict[str, Any]], first: dict[str, Any], model: str, chat: bool,
                       raw: HTTPRequest) -> Any:
        texts, reply = [], first
        try:
            async for reply in replies:
                if "error" in reply:
                    return openai_error(reply["status"], reply["error"])
                texts.append(reply["text"])
                if reply["finish_reason"] is None and await raw.is_disconnected():
                    return None  # nobody to answer; closing ``replies`` cancels the request
        finally:
            await replies.aclose()
        text, usage = "".join(texts), UsageInfo(**_usage(first, reply))
        if chat:
            choice = ChatCompletionResponseChoice(index=0, message={"role": "assistant", "content": text},
                                                  finish_reason=reply["finish_reason"])
            return ChatCompletionResponse(model=model, choices=[choice], usage=usage)
        return {"id": f"cmpl-{uuid.uuid4().hex[:12]}", "object": "text_completion", "created": int(time.time()),
                "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                             "finish_reason": reply["finish_reason"]}], "usage": usage.model_dump()}


def _usage(first: dict[str, Any], last: dict[str, Any]) -> dict[str, int]:
    prompt, completion = first["prompt_tokens"], last["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chunk(ident: str, created: int, model: str, chat: bool, delta: dict[str, str],
           finish_reason: Optional[str]) -> dict[str, Any]:
    if chat:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [choice]}
    choice = {"index": 0, "text": delta.get("content", ""), "logprobs": None, "finish_reason": finish_reason}
    return {"id": ident, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


# ---- the worker side ----------------------------------------------------------------------------------------------
@dataclass
class Live:
    """A request the engine runs: its text so far, turned into deltas as tokens come."""

    stream: TextStream
    pieces: list[str]  # text the stream released since the last output
    prompt_tokens: int
    completion_tokens: int = 0


@dataclass(frozen=True)
class Queued:
    uid: str
    adapter: Optional[str]
    request: Request


class EngineAPI(ls.LitAPI):
    """LitServe's side of the engine, in the inference worker: ``add_request`` (LitServe's event loop thread) only
    hands requests over; ``step`` (one thread) takes them, cancels what the HTTP side gave up, runs
    ``Engine.step`` once and returns each request's text delta."""

    def __init__(self, options: ServeOptions, spec: ServeSpec) -> None:
        super().__init__(spec=spec, loop=ServeLoop())
        self.options = options
        self.server_pid = os.getpid()  # the process that starts the server (this object is pickled into the worker)
        self.inbox: deque[tuple[str, Job]] = deque()

    def setup(self, device: str) -> None:
        # Ctrl-C reaches every process of the terminal's group: the server process stops this one once the requests
        # in flight are answered
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logging.getLogger("litserve").setLevel(logging.WARNING)  # as the server process's (log_level="warning")
        try:
            self._build()
        except UserError as error:  # one paragraph, as run_cli prints it; the server then exits 1 (serve.main)
            print(f"error: {error}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None

    def _build(self) -> None:
        options = self.options
        devices = resolve_devices(options.devices)
        self.tokenizer = Tokenizer(options.checkpoint_dir)
        self.model = load_model(options.checkpoint_dir, devices, options.precision.dtype, options.quantize,
                                decoding=True)
        self.adapters: dict[Optional[str], Optional[LoRAWeights]] = {
            None: None, **{name: read_lora(directory, self.model) for name, directory in options.adapters}}
        self.adapter: Optional[str] = None
        per_block = block_bytes(self.model.config, options.block_size, options.kv_cache_dtype,
                                options.precision.compute_dtype)
        # --devices N: each GPU holds its layers' share of every block; sizing the pool by the emptiest GPU as if it
        # held all of them is safe (if N times too cautious)
        left = min(memory_left(device) for device in devices)
        pool_bytes = options.pool.of(left)
        if pool_bytes > left:
            raise UserError(
                f"--kv_cache_memory {format_bytes(pool_bytes)} is more than the {format_bytes(left)} of memory left "
                "after loading the weights. Pass a smaller size, or a fraction of what is left such as 0.5.")
        num_blocks = pool_bytes // per_block
        if num_blocks < 1:
            raise UserError(
                f"--kv_cache_memory gives {pool_bytes:,} bytes, less than one block of the KV cache ({per_block:,} "
                f"bytes for {options.block_size} positions). Pass a larger size or fraction.")
        pool = PoolSpec(block_size=options.block_size, num_blocks=num_blocks, kv_dtype=options.kv_cache_dtype)
        self.engine = Engine(self.model, options.precision, pool, max_batch=options.max_batch, prefix_caching=True)
        self.stop_tokens = tuple(tuple(ids) for ids in options.style.stop_tokens(self.tokenizer))
        self.queue: deque[Queued] = deque()
        self.live: dict[str, Live] = {}
        self.dropped: set[str] = set()  # cancelled before they arrived here
        self.count, self.served, self.generated, self.abandoned = 0, 0, 0, 0
        stored = str(storage_dtype(options.kv_cache_dtype, options.precision.compute_dtype)).replace("torch.", "")
        print(f"Serving {', '.join(self.spec.model_names)} at {options.address}/v1 (OpenAI API; /v1/pool shows the "
              f"KV cache). KV cache pool: {num_blocks} blocks of {options.block_size} positions, "
              f"{format_bytes(num_blocks * per_block)} ({stored}).", file=sys.stderr, flush=True)
        self._publish()

    def add_request(self, uid: str, request: Job) -> None:
        self.inbox.append((uid, request))

    def has_capacity(self) -> bool:
        return True  # the engine queues what does not fit yet

    def has_active_requests(self) -> bool:
        return bool(self.inbox or self.queue or self.live)

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output

    def step(self, prev_outputs: Optional[list[Output]]) -> list[Output]:
        outputs: list[Output] = []
        while self.inbox:
            uid, job = self.inbox.popleft()
            outputs += self._take(uid, job)
        outputs += self._cancel_abandoned()
        if self.queue and not self.engine.has_work():  # between adapters: switch to the oldest waiting request's
            if self.queue[0].adapter != self.adapter:
                self.engine.forget_prefixes()  # the cached keys and values are the other weights'
            self.adapter = self.queue[0].adapter
            use_lora(self.model, self.adapters[self.adapter])
        while self.queue and self.queue[0].adapter == self.adapter:
            self.engine.add(self.queue.popleft().request)
        if self.engine.has_work():
            for event in self.engine.step():
                outputs += self._on_event(event)
        self._publish()
        return outputs

    def _take(self, uid: str, job: Job) -> list[Output]:
        """Tokenize ``job``; its rejection, or its acceptance (with the prompt's token count)."""
        if uid in self.dropped:
            self.dropped.discard(uid)
            self.abandoned += 1
            return [Output(uid, {}, LitAPIStatus.FINISH_STREAMING)]
        options = self.options
        try:
            if job.messages is not None:
                text = options.style.apply_chat([{"role": role, "content": content} for role, content in job.messages])
            else:
                text = job.prompt
            prompt_ids = self.tokenizer.encode(text).tolist()
        except UserError as error:  # a role the prompt style does not know, text that is not UTF-8 (lone surrogates)
            return _rejected(uid, str(error), "messages")
        if not prompt_ids:
            if self.tokenizer.bos_id is None:
                return _rejected(uid, "The prompt is empty and the tokenizer has no bos token to start from.", "prompt")
            prompt_ids = [self.tokenizer.bos_id]
        context = self.model.max_seq_length
        max_tokens = job.max_tokens or max(1, min(options.max_tokens, context - len(prompt_ids)))
        defaults = options.sampling
        seed = job.seed if job.seed is not None else defaults.seed + self.count
        self.count += 1
        sampling = Sampling(defaults.temperature if job.temperature is None else job.temperature,
                            job.top_k or defaults.top_k, job.top_p or defaults.top_p, seed)
        chat = job.messages is not None
        request = Request(uid, tuple(prompt_ids), max_tokens, sampling, tuple(self.tokenizer.eos_ids),
                          self.stop_tokens if chat else ())
        reason = self.engine.rejection(request)
        if reason is not None:
            return _rejected(uid, reason, "max_tokens")
        stop = (*job.stop, *options.stop, *(options.style.stop_strings if chat else ()))
        pieces: list[str] = []
        self.live[uid] = Live(TextStream(self.tokenizer, stop, prompt_ids[-4:], pieces.append), pieces, len(prompt_ids))
        self.queue.append(Queued(uid, job.adapter, request))
        return [Output(uid, {"text": "", "finish_reason": None, "prompt_tokens": len(prompt_ids),
                             "completion_tokens": 0}, LitAPIStatus.OK)]

    def _cancel_abandoned(self) -> list[Output]:
        """Cancel the requests whose clients went away: their blocks are free at once."""
        outputs = []
        while True:
            try:
                uid = self.spec.cancels.get_nowait()
            except queue.Empty:
                return outputs
            if uid not in self.live:
                self.dropped.add(uid)  # not here yet: dropped when it comes
                continue
            del self.live[uid]
            self.abandoned += 1
            self.queue = deque(queued for queued in self.queue if queued.uid != uid)
            self.engine.cancel(uid)
            outputs.append(Output(uid, {}, LitAPIStatus.FINISH_STREAMING))

    def _on_event(self, event: Event) -> list[Output]:
        live = self.live.get(event.id)
        if live is None:  # cancelled here (a stop string, a client gone): the engine's "cancelled" confirms it
            return []
        finish = event.finish_reason
        for token in event.tokens:
            live.completion_tokens += 1
            if live.stream.add(token):  # a stop string: the text before it is the answer
                if finish is None:
                    self.engine.cancel(event.id)
                finish = "stop"
                break
        if finish == "error" or finish == "cancelled":
            del self.live[event.id]
            error = {"error": event.error or "The engine cancelled this request.", "status": 500}
            return [Output(event.id, error, LitAPIStatus.OK), Output(event.id, {}, LitAPIStatus.FINISH_STREAMING)]
        if finish is not None:
            live.stream.finish()
        reply = {"text": "".join(live.pieces), "finish_reason": finish, "prompt_tokens": live.prompt_tokens,
                 "completion_tokens": live.completion_tokens}
        live.pieces.clear()
        outputs = [Output(event.id, reply, LitAPIStatus.OK)]
        if finish is not None:
            del self.live[event.id]
            self.served += 1
            self.generated += live.completion_tokens
            outputs.append(Output(event.id, {}, LitAPIStatus.FINISH_STREAMING))
        return outputs

    def _publish(self) -> None:
        stats = self.engine.stats()
        values = (stats.running, stats.waiting, stats.free_blocks, stats.total_blocks, stats.preemptions,
                  self.served, self.generated, self.abandoned)
        with self.spec.stats.get_lock():
            self.spec.stats[:] = values


def _rejected(uid: str, message: str, param: str) -> list[Output]:
    return [Output(uid, {"error": message, "status": 400, "param": param}, LitAPIStatus.OK),
            Output(uid, {}, LitAPIStatus.FINISH_STREAMING)]


def memory_left(device: torch.device) -> int:
    """What the KV cache pool may take after the weights: CUDA's free memory, the CPU's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


class ServeLoop(ContinuousBatchingLoop):
    """LitServe's continuous batching loop, which pauses while there is nothing to do instead of spinning, and ends
    the worker once the server process is gone (killed: LitServe's own stop terminates the worker)."""

    async def run(self, lit_api: ls.LitAPI, *args: Any) -> None:
        if not lit_api.has_active_requests():
            if os.getppid() != lit_api.server_pid:  # the server process was killed: nobody will send work or stop us
                os._exit(0)
            await asyncio.sleep(IDLE_POLL_S)
            return
        await super().run(lit_api, *args)


class WorkerFailed(Exception):
    """The inference worker ended before it was ready (it printed why)."""


class Server(ls.LitServer):
    """LitServer that stops waiting for a worker that died while loading (LitServe waits for ever), and stops on
    SIGTERM as on Ctrl-C (``stopping_on_signals``)."""

    def verify_worker_status(self) -> None:
        while not any(status == WorkerSetupStatus.READY for status in self.workers_setup_status.values()):
            if any(not worker.is_alive() for worker in self.inference_workers):
                raise WorkerFailed
            time.sleep(0.05)

    def stop(self) -> bool:
        """Start LitServer's own shutdown (uvicorn finishes the requests in flight, then the worker is stopped);
        False before it serves."""
        if self._shutdown_event is None:
            return False
        self._shutdown_event.set()
        return True

    @contextlib.contextmanager
    def stopping_on_signals(self) -> Iterator[None]:
        """SIGTERM/SIGINT stop the server (``stop``); before it serves (loading the model) they end the process as
        run_cli ends any. The main thread waits in a call a signal may not interrupt (LitServer's wait on its
        manager, while another thread takes the signal), so a thread that reads the signal wake-up pipe stops the
        server too. The HTTP process LitServe forks shares the handler: there it exits quietly once uvicorn, which
        raises the signal again after its own graceful stop, is done."""
        server_pid = os.getpid()

        def handle(signum: int, frame: Any) -> None:
            if os.getpid() != server_pid:
                raise SystemExit(0)
            if not self.stop():
                raise Interrupted(signum)

        read, write = os.pipe()
        os.set_blocking(write, False)

        def watch() -> None:
            while data := os.read(read, 1):
                if data[0] in STOP_SIGNALS and self.stop():
                    return

        previous = {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}
        previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        threading.Thread(target=watch, name="lit-model-serve-signals", daemon=True).start()
        try:
            yield
        finally:
            signal.set_wakeup_fd(previous_fd)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(write)  # ends watch
