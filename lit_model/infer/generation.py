"""KV-cache decoding, sampling and streaming text for ``generate/base.py`` and ``generate/chat.py``.

``generate`` prefills the prompt (positions ``start_pos ..``) in one call, then decodes one token per step
with static shapes ((batch, 1) tokens, a 1-element position tensor that is advanced in place), so the step
can be ``torch.compile``d once (``decode_step(model, compile=True)``). The cache holds exactly the positions a
call needs (prompt + new tokens), so memory grows with ``--max_new_tokens``, never with the block size.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union

import torch

from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.core.precision import PRECISIONS, param_dtype, resolve_precision
from lit_model.core.units import format_bytes, parse_memory, peak_rss_bytes
from lit_model.io.checkpoint import model_parts
from lit_model.io.download import resolve_checkpoint
from lit_model.io.prompts import PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.kernels.ops import decoding_column_major
from lit_model.kernels.policy import kernel_policy
from lit_model.methods.adapter import load_saved_adapter
from lit_model.methods.quantize import QUANTIZE_MODES, check_quantize, load_weights
from lit_model.model.gpt import GPT, KVCache, plain_linear
from lit_model.run import resolve_devices as run_devices

DEFAULT_CHECKPOINT = Path("out/pretrain/final")  # what `python pretrain/main.py` writes

# ---------------------------------------------------------------------------------------------------------
# Setup: devices, precision, lengths, loading
# ---------------------------------------------------------------------------------------------------------


def resolve_devices(devices: int) -> list[torch.device]:
    """``--devices N``: N CUDA GPUs running consecutive blocks (a pipeline), or the one CPU; the count is checked
    as every script checks it (``run.resolve_devices``)."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    count = run_devices(devices, device_type)
    if device_type == "cpu" and count > 1:
        raise UsageError(
            f"--devices {count} splits the model over several GPUs, and none is available: on the CPU "
            "generation runs on one device. Pass --devices 1."
        )
    return [torch.device(device_type, i) for i in range(count)] if device_type == "cuda" else [torch.device("cpu")]


@dataclass
class Precision:
    name: str  # the resolved --precision string
    dtype: torch.dtype  # parameters (and the KV cache without autocast)
    autocast: Optional[torch.dtype]  # "-mixed": compute dtype under torch.autocast

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.autocast or self.dtype

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.autocast)


def resolve_generation_precision(
    precision: Optional[str], device_type: str, quantize: Optional[str], planning: bool = False
) -> Precision:
    """``planning``: for a device that need not be here (a CUDA plan assumes bfloat16 support) and without
    bitsandbytes installed, so only the --quantize name is checked."""
    if precision is None and quantize == "bnb.int8" and device_type == "cuda":
        precision = "16-true"  # LLM.int8() computes in float16 on CUDA
    name = resolve_precision(precision, device_type, present=not planning)
    autocast = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}.get(name)
    if not planning:
        check_quantize(quantize, device_type, param_dtype(name), mixed=autocast is not None)
    elif quantize is not None and quantize not in QUANTIZE_MODES:
        raise UsageError(f"Unknown --quantize {quantize!r}. Choose one of: {', '.join(QUANTIZE_MODES)}, or drop it.")
    return Precision(name, param_dtype(name), autocast)


def check_lengths(prompt_length: int, max_new_tokens: int, config: Config) -> int:
    """Return prompt + new tokens, or raise naming the limit (and the largest --max_new_tokens that fits)."""
    limit = config.block_size
    if max_new_tokens < 1:
        raise UsageError(f"--max_new_tokens must be at least 1, not {max_new_tokens}.")
    if prompt_length >= limit:
        raise UsageError(
            f"The prompt is {prompt_length} tokens long, but {config.name or 'this model'} has a context of "
            f"{limit} tokens, which must also hold at least one new token. Shorten the prompt to at most "
            f"{limit - 1} tokens."
        )
    if prompt_length + max_new_tokens > limit:
        largest = limit - prompt_length
        raise UsageError(
            f"--max_new_tokens {max_new_tokens} does not fit: the prompt is {prompt_length} tokens and "
            f"{config.name or 'this model'} has a context of {limit} tokens, so at most {largest} new tokens fit. "
            f"Pass --max_new_tokens {largest} (or less), or shorten the prompt."
        )
    return prompt_length + max_new_tokens


def check_sampling(temperature: float, top_k: Optional[int], top_p: float, num_samples: int = 1) -> None:
    if temperature < 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), not {temperature}.")
    if top_k is not None and top_k < 1:
        raise UsageError(f"--top_k must be at least 1 (or left out for no limit), not {top_k}.")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"--top_p must be in (0, 1] (1 = no nucleus filtering), not {top_p}.")
    if num_samples < 1:
        raise UsageError(f"--num_samples must be at least 1, not {num_samples}.")


def pipeline_stages(config: Config, n_devices: int) -> dict[str, int]:
    """Which of ``n_devices`` each part of the model goes on (the planner plans the same split): consecutive
    blocks on consecutive devices; the embedding on the first, the final norm and head on the last (a tied head
    stays with the embedding it shares its weight with)."""
    stages = {"embed": 0, "norm_f": n_devices - 1, "lm_head": 0 if config.tie_embeddings else n_devices - 1}
    for i in range(config.n_layer):
        stages[f"blocks.{i}"] = i * n_devices // config.n_layer
    return stages


def device_map(config: Config, devices: Sequence[torch.device]) -> dict[str, torch.device]:
    return {part: devices[stage] for part, stage in pipeline_stages(config, len(devices)).items()}


def load_model(
    checkpoint_dir: str | Path,
    devices: Sequence[torch.device | str] = ("cpu",),
    dtype: torch.dtype = torch.float32,
    quantize: Optional[str] = None,
    max_seq_length: Optional[int] = None,
    decoding: bool = False,
) -> GPT:
    """The checkpoint's model, built on the meta device and filled part by part: every tensor goes straight to its
    final dtype and device, and with ``quantize`` each block is quantized before the next one is read.
    ``max_seq_length`` (default: the block size) sizes the RoPE tables. ``decoding`` (a model only to generate with):
    the weights in the layout decoding multiplies fastest (``column_major_weights``); fine-tuning, which trains them
    (and shards them under FSDP), keeps them row-major."""
    devices = [torch.device(d) for d in devices]
    config = Config.from_checkpoint(checkpoint_dir)
    model = GPT.on_meta(config)
    if max_seq_length is not None:
        model.max_seq_length = max_seq_length  # cheap on meta: the real tables are built once, below
    parts = device_map(config, devices)
    column_major = column_major_weights(model, dtype, parts) if decoding and quantize is None else frozenset()
    load_weights(model, checkpoint_dir, dtype, parts, quantize, column_major=column_major)
    load_saved_adapter(model, checkpoint_dir)  # a LLaMA-Adapter checkpoint carries its prefixes beside the weights
    model.reset_rope_cache(devices[0])
    model.set_kernel_policy(kernel_policy(torch.device(devices[0]).type))
    return model.eval().requires_grad_(False)


def column_major_weights(model: GPT, dtype: torch.dtype, parts: dict[str, torch.device]) -> frozenset[str]:
    """The linear weights that decoding multiplies fastest stored column-major (``ops.decoding_column_major``),
    by their checkpoint names; a head tied to the embedding keeps the table's rows."""
    names = set()
    for part_name, part in model_parts(model):  # the parts load_model_weights reads, each to its device
        device = parts.get(part_name, torch.device("cpu"))
        for name, module in part.named_modules(prefix=part_name):
            tied_head = name == "lm_head" and model.config.tie_embeddings
            if plain_linear(module) and not tied_head and decoding_column_major(module.weight.shape, dtype, device):
                names.add(f"{name}.weight")
    return frozenset(names)


def set_kv_cache(model: GPT, batch_size: int, max_length: int, dtype: Optional[torch.dtype] = None) -> None:
    """Preallocate exactly ``max_length`` positions, each block's cache on the device of its weights."""
    if max_length > model.max_seq_length:
        model.set_kv_cache(batch_size, max_length)  # raises the model's "exceeds the context" error
    dtype = dtype or model.embed.weight.dtype
    for block in model.blocks:
        block.attn.kv_cache = KVCache(batch_size, model.config, max_length, block.attn.proj.weight.device, dtype)


def kv_cache_nbytes(model: GPT) -> int:
    return sum(
        buf.numel() * buf.element_size()
        for block in model.blocks
        if block.attn.kv_cache is not None
        for buf in (block.attn.kv_cache.k, block.attn.kv_cache.v)
    )


def kv_cache_shape(model: GPT) -> Optional[tuple[int, int]]:
    """(batch size, positions) of the allocated cache, or None."""
    cache = model.blocks[0].attn.kv_cache
    return None if cache is None else (cache.k.size(0), cache.k.size(2))


# ---------------------------------------------------------------------------------------------------------
# Forward, sampling and the decode loop
# ---------------------------------------------------------------------------------------------------------


def forward_last(
    model: GPT, idx: torch.Tensor, input_pos: torch.Tensor, input_pos_maxp1: Optional[int] = None
) -> torch.Tensor:
    """``model(idx, input_pos)[:, -1]`` (logits of shape (batch, vocab)) without the head over every prompt
    position; activations hop to the next device where consecutive blocks live on different GPUs.
    ``input_pos_maxp1`` (``input_pos[-1] + 1``) lets attention read only the filled part of the cache."""
    x = model.embed(idx.to(model.embed.weight.device))  # sampled on the head's device
    if model.config.scale_embeddings:
        x = x * torch.tensor(model.config.n_embd**0.5, dtype=x.dtype)
    # cast once here rather than in every block's apply_rope (the same values: apply_rope casts to this dtype)
    cos = model.cos.index_select(0, input_pos).to(x.dtype)
    sin = model.sin.index_select(0, input_pos).to(x.dtype)
    for block in model.blocks:
        device = block.attn.proj.weight.device
        if x.device != device:
            x, cos, sin, input_pos = x.to(device), cos.to(device), sin.to(device), input_pos.to(device)
        x = block(x, cos, sin, input_pos, input_pos_maxp1)
    x = model.norm_f(x[:, -1:].to(model.norm_f.weight.device))
    return model.head(x.to(model.lm_head.weight.device))[:, -1]


Step = Callable[[GPT, torch.Tensor, torch.Tensor, int], torch.Tensor]


def decode_step(model: GPT, compile: bool = False) -> Step:
    """The single-token step ``(model, token, input_pos, input_pos_maxp1) -> logits``: ``forward_last``, or,
    when ``compile``, ``forward_last`` compiled once for static shapes (so over the whole cache, masked)."""
    if not compile:
        return forward_last
    compiled = torch.compile(forward_last, dynamic=False)

    def step(model: GPT, idx: torch.Tensor, input_pos: torch.Tensor, input_pos_maxp1: int) -> torch.Tensor:
        return compiled(model, idx, input_pos)

    return step


# oneDNN (what PyTorch runs bfloat16 matmuls on, on the CPU) costs ~20 us per call beyond the memory traffic:
# for a batch of one token that is most of the time of a small matrix (256x256: 27 us vs 7-12 us with ATen's own
# kernel), while from ~2**24 elements on oneDNN is the faster one (11008x4096: 7.0 ms vs 12.4 ms, one core).
ATEN_GEMV_MAX_NUMEL = 2**24


def use_aten_gemv(model: GPT, batch: int) -> bool:
    """Whether decoding steps should bypass oneDNN: one sample, bfloat16 on the CPU, every matrix small."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return batch == 1 and all(
        w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.numel() <= ATEN_GEMV_MAX_NUMEL for w in weights
    )


@contextlib.contextmanager
def onednn_disabled() -> Iterator[None]:
    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def sample(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """Next tokens of shape (batch, 1) from logits (batch, vocab): greedy at temperature 0, else top-k, then
    nucleus (top-p) filtering and a draw from ``generator``."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # drop a token once the more likely ones already cover top_p (the most likely one always stays)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class Generation:
    tokens: list[list[int]]  # per sample: the new tokens, without the eos / stop sequence that ended it
    steps: int  # tokens sampled per sample (the last one is never fed back through the model)
    end_pos: int  # start_pos + prompt length + steps - 1: the cache holds prompt and kept tokens before it
    time_to_first_token: float  # seconds: prefill + first sample
    decode_time: float  # seconds for steps 3.. (steps 2.. when there are only 2), timed after the first compiled call
    stopped: list[bool] = field(default_factory=list)  # ended by eos / a stop sequence / on_token

    @property
    def decode_tokens_per_sec(self) -> float:
        n = (self.steps - (2 if self.steps > 2 else 1)) * len(self.tokens)
        return n / self.decode_time if n and self.decode_time > 0 else float("nan")


@torch.inference_mode()
def generate(
    model: GPT,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: float = 1.0,
    eos_ids: Sequence[int] = (),
    stop_sequences: Sequence[Sequence[int]] = (),
    on_token: Optional[Callable[[int, int], Optional[bool]]] = None,
    num_samples: int = 1,
    generator: Optional[torch.Generator] = None,
    start_pos: int = 0,
    step: Step = forward_last,
) -> Generation:
    """Sample up to ``max_new_tokens`` tokens after ``prompt_ids`` for ``num_samples`` samples in one batch.

    ``prompt_ids`` is 1-D (shared by every sample) or (batch, T). It is written to cache positions
    ``start_pos ..``: 0 starts afresh (a cache of exactly prompt + new positions is allocated unless one of the
    right batch size and at least that length exists); a chat passes the position after its history.
    A sample ends at one of ``eos_ids``, at the end of one of the token ``stop_sequences`` (both left out of
    the result), or when ``on_token(sample, token)`` returns True. ``on_token`` sees every kept token as soon
    as it is sampled (held back only while it might start a multi-token stop sequence).
    """
    prompt = prompt_ids.reshape(1, -1).expand(num_samples, -1) if prompt_ids.ndim == 1 else prompt_ids
    batch, length = prompt.shape
    if length < 1:
        raise UsageError("The prompt is empty: give at least one token to continue from.")
    needed = start_pos + length + max_new_tokens
    if needed > model.max_seq_length:
        model.set_kv_cache(batch, needed)  # raises the model's "exceeds the context" error
    shape = kv_cache_shape(model)
    if start_pos == 0 and (shape is None or shape[0] != batch or shape[1] < needed):
        set_kv_cache(model, batch, needed)
    elif shape is None or shape[0] != batch or shape[1] < needed - 1:
        raise ValueError(f"The KV cache {shape} does not hold batch {batch} and positions up to {needed - 1}.")

    device = model.embed.weight.device
    prompt = prompt.to(device)
    eos = set(int(i) for i in eos_ids)
    stops = [list(map(int, s)) for s in stop_sequences if len(s)]
    hold = max((len(s) for s in stops), default=1) - 1
    tokens: list[list[int]] = [[] for _ in range(batch)]
    emitted, done = [0] * batch, [False] * batch

    def emit(row: int, upto: int) -> None:
        while emitted[row] < upto and not done[row]:
            value = tokens[row][emitted[row]]
            emitted[row] += 1
            if on_token is not None and on_token(row, value):
                del tokens[row][emitted[row]:]
                done[row] = True

    start = time.perf_counter()
    end = start_pos + length
    logits = forward_last(model, prompt, torch.arange(start_pos, end, device=device), end)
    token = sample(logits, temperature, top_k, top_p, generator)
    input_pos = torch.tensor([end], device=device)  # the step's position, advanced in place with ``end``
    steps, first_token_at, second_token_at = 0, 0.0, 0.0
    # On an accelerator the next step is queued before this token is read on the host, so the device keeps
    # computing while Python looks at the token (an early stop wastes one step, written past the kept tokens)
    lookahead = device.type != "cpu"
    kernels = onednn_disabled() if use_aten_gemv(model, batch) else contextlib.nullcontext()
    with kernels:
        while True:
            next_token = None
            if lookahead and 0 < steps < max_new_tokens - 1:
                next_token = sample(step(model, token, input_pos, end + 1), temperature, top_k, top_p, generator)
                input_pos.add_(1)
                end += 1
            values = token.reshape(-1).tolist()  # the one host sync per step
            steps += 1
            if steps <= 2:  # a compiled step compiles on its first call: the rate is measured after it
                second_token_at = time.perf_counter()
                first_token_at = first_token_at or second_token_at
            for row, value in enumerate(values):
                if done[row]:
                    continue
                if value in eos:
                    emit(row, len(tokens[row]))
                    done[row] = True
                    continue
                tokens[row].append(value)
                matched = next((s for s in stops if tokens[row][-len(s):] == s), None)
                if matched is not None:
                    del tokens[row][-len(matched):]
                    emit(row, len(tokens[row]))
                    done[row] = True
                else:
                    emit(row, len(tokens[row]) - hold)
            if all(done) or steps >= max_new_tokens:
                break
            if next_token is None:
                next_token = sample(step(model, token, input_pos, end + 1), temperature, top_k, top_p, generator)
                input_pos.add_(1)
                end += 1
            token = next_token
    stopped = list(done)
    for row in range(batch):
        emit(row, len(tokens[row]))
    return Generation(
        tokens=tokens,
        steps=steps,
        end_pos=start_pos + length + steps - 1,
        time_to_first_token=first_token_at - start,
        decode_time=time.perf_counter() - (second_token_at if steps > 2 else first_token_at),
        stopped=stopped,
    )


# ---------------------------------------------------------------------------------------------------------
# Streaming text
# ---------------------------------------------------------------------------------------------------------


class TextStream:
    """Turns tokens into text as they arrive, correct for byte-level BPE and SentencePiece.

    A window of recent tokens is decoded, and only the growth of its text is emitted; text that ends in an
    incomplete UTF-8 sequence (decoded as U+FFFD) waits for the next token. ``context`` (a few prompt tokens)
    keeps SentencePiece from dropping the first new word's leading space. Text that could be the start of one
    of ``stop`` strings is held back until it is clear; ``add`` returns True once a stop string appears (the
    text before it is kept).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), context: Sequence[int] = (), write: Optional[Callable[[str], object]] = None) -> None:
        self.tokenizer, self.stop, self.write = tokenizer, [s for s in stop if s], write
        self.ids = [int(i) for i in context][-4:]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.text, self.printed, self.stopped = "", 0, False

    def add(self, token: int) -> bool:
        if self.stopped:
            return True
        self.ids.append(int(token))
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._flush(final=False)

    def finish(self) -> str:
        """Emit what is left (even an incomplete character) and return the whole text."""
        if not self.stopped:
            prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            full = self.tokenizer.decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)
            self._flush(final=True)
        return self.text

    def _flush(self, final: bool) -> bool:
        start = max(0, self.printed - max((len(s) for s in self.stop), default=0))
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text, self.stopped = self.text[: min(hits)], True
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:  # hold back a tail that a stop string may begin with
            held = max((k for s in self.stop for k in range(1, len(s)) if self.text.endswith(s[:k])), default=0)
            end = len(self.text) - held
        if end > self.printed:
            if self.write is not None:
                self.write(self.text[self.printed : end])
            self.printed = end
        return self.stopped


def stdout_writer(text: str) -> None:
    try:
        sys.stdout.write(text)
    except UnicodeEncodeError:  # a terminal that is not UTF-8: what it cannot show becomes \xe9-style escapes
        encoding = sys.stdout.encoding or "ascii"
        sys.stdout.write(text.encode(encoding, "backslashreplace").decode(encoding))
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------------------
# Chat: the conversation lives in the KV cache
# ---------------------------------------------------------------------------------------------------------


class ChatSession:
    """A multi-turn conversation whose tokens stay in the KV cache: each turn prefills only what the cache
    does not hold yet (the end of the previous reply and the new user turn), at the positions after it."""

    def __init__(
        self,
        model: GPT,
        tokenizer,
        style,
        max_length: int,
        system: Optional[str] = None,
        stop: Sequence[str] = (),
        cache_dtype: Optional[torch.dtype] = None,
        **sampling,
    ) -> None:
        self.model, self.tokenizer, self.style, self.system = model, tokenizer, style, system
        self.max_length = max_length
        self.stop_sequences = style.stop_tokens(tokenizer)
        self.stop_strings = [*style.stop_strings, *stop]
        self.sampling = sampling  # temperature, top_k, top_p, generator, step
        set_kv_cache(model, 1, max_length, cache_dtype)
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the cache is overwritten from position 0 on the next turn)."""
        self.tokens: list[int] = []  # the whole conversation, token by token
        self.cached = 0  # self.tokens[:cached] are in the KV cache
        self.turns = 0
        self.last: Optional[Generation] = None
        self.last_start_pos = 0

    def turn_ids(self, message: str) -> list[int]:
        if self.turns == 0:
            return self.tokenizer.encode(self.style.turn(message, system=self.system)).tolist()
        return self.tokenizer.encode(self.style.next_turn(message), bos=False).tolist()

    def send(self, message: str, max_new_tokens: int, write: Optional[Callable[[str], object]] = None,
             notify: Callable[[str], object] = lambda text: None) -> str:
        """Answer ``message``; the reply streams through ``write``. A conversation that would overflow the
        context is started over with this message (``notify`` says so)."""
        first_ids = self.tokenizer.encode(self.style.turn(message, system=self.system)).tolist()
        if len(first_ids) + max_new_tokens > self.max_length:
            raise UserError(
                f"This message is {len(first_ids)} tokens long; with a reply of up to {max_new_tokens} tokens it "
                f"does not fit the context of {self.max_length} tokens. Send a shorter message (or pass a smaller "
                "--max_new_tokens or a larger --max_seq_length)."
            )
        new_ids = self.turn_ids(message) if self.turns else first_ids
        if self.turns and len(self.tokens) + len(new_ids) + max_new_tokens > self.max_length:
            notify(
                f"The conversation ({len(self.tokens)} tokens) plus this message ({len(new_ids)}) and a reply of up "
                f"to {max_new_tokens} tokens would not fit the context of {self.max_length} tokens; starting over "
                "with this message."
            )
            self.reset()
            new_ids = first_ids
        pending = torch.tensor(self.tokens[self.cached:] + new_ids, dtype=torch.long)
        stream = TextStream(self.tokenizer, self.stop_strings, context=(self.tokens + new_ids)[-4:], write=write)
        result = generate(  # on an error (e.g. out of memory) the conversation stays as it was
            self.model, pending, max_new_tokens, eos_ids=self.tokenizer.eos_ids, stop_sequences=self.stop_sequences,
            on_token=lambda row, token: stream.add(token), start_pos=self.cached, **self.sampling,
        )
        self.last_start_pos = self.cached
        self.tokens.extend(new_ids)
        reply = stream.finish()
        kept = result.tokens[0]
        reply_ids = self.tokenizer.encode(reply, bos=False).tolist() if stream.stopped else kept
        fed = result.steps - 1  # every sampled token but the last went through the model
        same = next((i for i, (a, b) in enumerate(zip(reply_ids, kept)) if a != b), min(len(reply_ids), len(kept)))
        self.cached = len(self.tokens) + min(same, fed)
        self.tokens.extend(reply_ids)
        self.turns += 1
        self.last = result
        return reply


# ---------------------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------------------


def peak_memory_bytes(devices: Sequence[torch.device]) -> int:
    """CUDA: max_memory_reserved summed over the devices; CPU: the process's peak RSS."""
    if devices and devices[0].type == "cuda":
        return sum(torch.cuda.max_memory_reserved(d) for d in devices)

    return peak_rss_bytes()


def stats_line(result: Generation, devices: Sequence[torch.device]) -> str:
    tps = result.decode_tokens_per_sec
    total = sum(len(t) for t in result.tokens)
    rate = "n/a" if math.isnan(tps) else f"{tps:.2f}"
    return (
        f"time to first token: {result.time_to_first_token:.3f} s, decode: {rate} tokens/s "
        f"({total} tokens in {len(result.tokens)} sample(s)), peak memory: "
        f"{format_bytes(peak_memory_bytes(devices))}"
    )


@contextlib.contextmanager
def out_of_memory_hint(what: str) -> Iterator[None]:
    """Turn running out of (GPU or CPU) memory into a one-paragraph message with the flags that reduce it."""
    try:
        yield
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not isinstance(error, torch.OutOfMemoryError) and "can't allocate memory" not in str(error):
            raise
        raise UserError(
            f"Out of memory while {what}. Reduce --max_new_tokens or --num_samples (the KV cache grows with "
            "both), load the weights in 4 bits with --quantize bnb.nf4, or spread the blocks over more GPUs with "
            "--devices N."
        ) from None


# ---------------------------------------------------------------------------------------------------------
# What generate/base.py and generate/chat.py share: flags checked, files read, then loading and sampling
# ---------------------------------------------------------------------------------------------------------


@dataclass
class GenerationArgs:
    """Flags generate/base.py and generate/chat.py share.

    Args:
        checkpoint_dir: checkpoint directory (weights, model_config.yaml, tokenizer)
        model_name: ORG/NAME (or its registry name) of a model `lit-model download ORG/NAME` wrote to
            checkpoints/ORG/NAME, in place of --checkpoint_dir; with --plan also a model not downloaded yet
            (its architecture from the config registry)
        model_config: with --plan: a YAML of Config fields, to plan a custom architecture before it has a checkpoint
        temperature: sampling temperature; 0 is greedy decoding
        top_k: sample only among the k most likely tokens (omit for no limit)
        top_p: nucleus sampling: only among the most likely tokens that cover this probability (1: off)
        precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true; default: the cheapest the device runs
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4 or bnb.int8: load the linear layers' weights quantized
        compile: torch.compile the single-token decode step
        seed: random seed for sampling
        stop: a string, or a list like '["\\n\\n", "User:"]', that ends the generation (not printed)
        devices: GPUs to place consecutive blocks on, for models that do not fit one (CPU: 1)
        prompt_style: how to wrap the prompt (default, alpaca, chatml, llama-3, ...); default: the checkpoint's
        plan: text or json: print the predicted peak memory of this generation and exit without reading weights;
            exit status 1 when it does not fit the device and no suggested flag change makes it fit, else 0
        device_memory: with --plan: plan for a CUDA GPU of this size, e.g. 24GB (default: this machine)
    """

    checkpoint_dir: Path = DEFAULT_CHECKPOINT
    temperature: float = 0.8
    top_k: Optional[int] = 50
    top_p: float = 1.0
    precision: Optional[str] = None
    quantize: Optional[str] = None
    compile: bool = False
    seed: int = 1234
    stop: Optional[Union[list[str], str]] = None
    devices: int = 1
    prompt_style: Optional[str] = None
    plan: Optional[Literal["text", "json"]] = None
    model_name: Optional[str] = None
    model_config: Optional[Path] = None
    device_memory: Optional[str] = None


@dataclass
class GenerationSetup:
    """A generation script's checked flags and everything it knows before reading the weights.
    ``checkpoint_dir`` and ``tokenizer`` are None when planning from ``--model_name`` (or, for the tokenizer,
    from a checkpoint directory without one); ``devices`` is empty when planning."""

    args: GenerationArgs
    checkpoint_dir: Optional[Path]
    config: Config
    tokenizer: Optional[Tokenizer]
    style: PromptStyle
    device_type: str
    devices: list[torch.device]
    precision: Precision
    stop: list[str]  # --stop, as a list

    def load(self, max_seq_length: int) -> GPT:
        """The model with RoPE tables for ``max_seq_length`` positions; torch is seeded first."""
        torch.manual_seed(self.args.seed)
        with out_of_memory_hint("loading the model"):
            return load_model(self.checkpoint_dir, self.devices, self.precision.dtype, self.args.quantize,
                              max_seq_length, decoding=True)

    def sampling(self, model: GPT) -> dict[str, Any]:
        """``generate``'s (and ``ChatSession``'s) sampling arguments: the flags, a generator seeded on the head's
        device and the decode step (compiled with --compile)."""
        return dict(
            temperature=self.args.temperature, top_k=self.args.top_k, top_p=self.args.top_p,
            generator=make_generator(self.args.seed, model.lm_head.weight.device),
            step=decode_step(model, self.args.compile),
        )

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Around each generation: the precision's autocast, and out-of-memory errors told as such."""
        with out_of_memory_hint("generating"), self.precision.context(self.device_type):
            yield


def check_generation_args(args: GenerationArgs) -> None:
    """Every flag of generate/base.py and chat.py (``num_samples``, ``prompt_length``, ``max_new_tokens``,
    ``max_seq_length`` where the script has them), checked before any file is read; the limits that depend on
    the model (its context) are checked once its config is read."""
    check_sampling(args.temperature, args.top_k, args.top_p, getattr(args, "num_samples", 1))
    for flag, least in (("max_new_tokens", 1), ("prompt_length", 1), ("max_seq_length", 2), ("devices", 1), ("seed", 0)):
        value = getattr(args, flag, None)
        if value is not None and value < least:
            raise UsageError(f"--{flag} {value} must be at least {least}.")
    if args.seed >= 2**64:
        raise UsageError(f"--seed {args.seed} must be below 2**64.")
    if args.precision is not None and args.precision not in PRECISIONS:
        raise UsageError(f"Unknown --precision {args.precision!r}. Choose one of: {', '.join(PRECISIONS)}.")
    if args.quantize is not None and args.quantize not in QUANTIZE_MODES:
        raise UsageError(f"Unknown --quantize {args.quantize!r}. Choose one of: {', '.join(QUANTIZE_MODES)}, or drop it.")
    if args.plan is None:
        plan_only = ("--device_memory", args.device_memory), ("--prompt_length", getattr(args, "prompt_length", None))
        for flag, value in plan_only:
            if value is not None:
                raise UsageError(
                    f"{flag} {value} applies with --plan only (to plan a generation before its weights are here). "
                    "Generating reads the model from its checkpoint and counts the prompt's tokens."
                )
    elif args.device_memory is not None:
        parse_memory(args.device_memory)


def prepare_generation(args: GenerationArgs) -> GenerationSetup:
    """Check the flags, then read the config, tokenizer and prompt style (never the weights). With ``--plan``
    the device is the one planned for (a CUDA GPU with ``--device_memory``, else this machine's), and
    a model not downloaded yet (``--model_name``) is planned from the registry's config."""
    check_generation_args(args)
    checkpoint_dir, config = resolve_checkpoint(args.model_name, args.checkpoint_dir, DEFAULT_CHECKPOINT,
                                                plan=args.plan is not None, model_config=args.model_config)
    if args.plan is None:
        devices = resolve_devices(args.devices)
        device_type = devices[0].type
        tokenizer: Optional[Tokenizer] = Tokenizer(checkpoint_dir)
    else:
        devices, device_type = [], "cuda" if args.device_memory or torch.cuda.is_available() else "cpu"
        has_tokenizer = checkpoint_dir is not None and any(
            (checkpoint_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model"))
        tokenizer = Tokenizer(checkpoint_dir) if has_tokenizer else None
    precision = resolve_generation_precision(args.precision, device_type, args.quantize, planning=args.plan is not None)
    if args.prompt_style:
        style = PromptStyle.from_name(args.prompt_style)
    elif checkpoint_dir is not None:
        style = PromptStyle.from_checkpoint(checkpoint_dir, config)
    else:
        style = PromptStyle.from_config(config)
    stop = [args.stop] if isinstance(args.stop, str) else list(args.stop or [])
    return GenerationSetup(args, checkpoint_dir, config, tokenizer, style, device_type, devices, precision, stop)
