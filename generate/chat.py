"""Chat with a checkpoint's model in its family's prompt style; the conversation stays in the KV cache.

    python generate/chat.py --checkpoint_dir checkpoints/Qwen2.5-0.5B-Instruct
    printf 'Hi!\\nAnd then?\\n/exit\\n' | python generate/chat.py --checkpoint_dir DIR   # reads lines until EOF

Type /reset to start a new conversation and /exit (or end the input) to quit.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

import torch

from lit_model.checkpoint import check_checkpoint_dir
from lit_model.config import Config
from lit_model.errors import UsageError, UserError
from lit_model import cli
from lit_model.generation import (
    ChatSession, check_sampling, decode_step, load_model, make_generator, out_of_memory_hint, resolve_devices,
    resolve_generation_precision, stdout_writer,
)
from lit_model.prompts import PromptStyle
from lit_model.tokenizer import Tokenizer


def main(
    checkpoint_dir: Path = Path("out/pretrain/final"),
    max_new_tokens: int = 256,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    max_seq_length: Optional[int] = None,
    system: Optional[str] = None,
    precision: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: bool = False,
    seed: int = 1234,
    stop: Optional[Union[list[str], str]] = None,
    devices: int = 1,
    prompt_style: Optional[str] = None,
) -> None:
    """Chat with a model: one message per line, /reset starts over, /exit quits.

    Args:
        checkpoint_dir: checkpoint directory (weights, model_config.yaml, tokenizer)
        max_new_tokens: longest reply in tokens
        temperature: sampling temperature; 0 is greedy decoding
        top_k: sample only among the k most likely tokens (omit for no limit)
        top_p: nucleus sampling: only among the most likely tokens that cover this probability (1: off)
        max_seq_length: context kept in the KV cache, in tokens; default: the block size, at most 4096
        system: system message (default: the prompt style's, if any)
        precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true; default: the cheapest the device runs
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4 or bnb.int8: load the linear layers' weights quantized
        compile: torch.compile the single-token decode step
        seed: random seed for sampling
        stop: a string, or a list like '["\\n\\n", "User:"]', that ends a reply (not printed)
        devices: GPUs to place consecutive blocks on, for models that do not fit one (CPU: 1)
        prompt_style: default, alpaca, chatml, llama-3, ...; default: the checkpoint's
    """
    checkpoint_dir = check_checkpoint_dir(checkpoint_dir, need_tokenizer=True)
    check_sampling(temperature, top_k, top_p)
    device_list = resolve_devices(devices)
    settings = resolve_generation_precision(precision, device_list[0].type, quantize)
    config = Config.from_checkpoint(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_name(prompt_style) if prompt_style else PromptStyle.from_checkpoint(checkpoint_dir, config)
    context = max_seq_length or min(config.block_size, 4096)
    if not 1 < context <= config.block_size:
        raise UsageError(f"--max_seq_length must be between 2 and the model's block size {config.block_size}.")
    if max_new_tokens < 1 or max_new_tokens >= context:
        raise UsageError(
            f"--max_new_tokens must be between 1 and {context - 1} (the context of {context} tokens also holds "
            "the messages)."
        )

    torch.manual_seed(seed)
    with out_of_memory_hint("loading the model"):
        model = load_model(checkpoint_dir, device_list, settings.dtype, quantize, max_seq_length=context)
        session = ChatSession(
            model, tokenizer, style, context, system=system, stop=[stop] if isinstance(stop, str) else stop or (),
            cache_dtype=settings.compute_dtype, temperature=temperature, top_k=top_k, top_p=top_p,
            generator=make_generator(seed, model.lm_head.weight.device), step=decode_step(model, compile),
        )
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {config.name or checkpoint_dir} ({style.name} prompt style). /reset starts over, "
              "/exit quits.", file=sys.stderr)
    while True:
        try:
            message = input(">> You: ") if interactive else sys.stdin.readline()
        except (EOFError, KeyboardInterrupt):
            break
        if not interactive and message == "":
            break  # end of input
        message = message.strip()
        if not message:
            continue
        if message == "/exit":
            break
        if message == "/reset":
            session.reset()
            print("(conversation reset)", file=sys.stderr, flush=True)
            continue
        if interactive:
            stdout_writer(">> Model: ")
        try:
            with out_of_memory_hint("generating"), settings.context(device_list[0].type):
                session.send(message, max_new_tokens, write=stdout_writer, notify=_notify)
        except UserError as error:  # e.g. a message longer than the context: say so and keep chatting
            print(f"error: {error}", file=sys.stderr, flush=True)
            continue
        stdout_writer("\n")


def _notify(text: str) -> None:
    print(f"({text})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    cli.main(main)
