"""Continue a prompt with a checkpoint's model: the text streams to stdout, a speed/memory line to stderr.

    python generate/base.py --checkpoint_dir out/pretrain/final --prompt "def fib(n):"
    python generate/base.py --checkpoint_dir checkpoints/Llama-3.2-1B --quantize bnb.nf4 --num_samples 3
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Union

import torch

from lit_model.checkpoint import check_checkpoint_dir
from lit_model.config import Config
from lit_model.errors import UsageError
from lit_model import cli
from lit_model.generation import (
    TextStream, check_lengths, check_sampling, decode_step, generate, load_model, make_generator,
    out_of_memory_hint, resolve_devices, resolve_generation_precision, set_kv_cache, stats_line,
    stdout_writer,
)
from lit_model.prompts import PromptStyle
from lit_model.tokenizer import Tokenizer


def main(
    checkpoint_dir: Path = Path("out/pretrain/final"),
    prompt: str = "What food do llamas eat?",
    max_new_tokens: int = 50,
    temperature: float = 0.8,
    top_k: Optional[int] = 50,
    top_p: float = 1.0,
    num_samples: int = 1,
    precision: Optional[str] = None,
    quantize: Optional[str] = None,
    compile: bool = False,
    seed: int = 1234,
    stop: Optional[Union[list[str], str]] = None,
    devices: int = 1,
    prompt_style: Optional[str] = None,
) -> None:
    """Generate a continuation of a prompt.

    Args:
        checkpoint_dir: checkpoint directory (weights, model_config.yaml, tokenizer)
        prompt: the text to continue
        max_new_tokens: how many tokens to generate at most; the KV cache holds prompt + this many positions
        temperature: sampling temperature; 0 is greedy decoding
        top_k: sample only among the k most likely tokens (omit for no limit)
        top_p: nucleus sampling: only among the most likely tokens that cover this probability (1: off)
        num_samples: samples generated together in one batch
        precision: 32-true, 16-mixed, bf16-mixed, 16-true or bf16-true; default: the cheapest the device runs
        quantize: bnb.nf4, bnb.nf4-dq, bnb.fp4 or bnb.int8: load the linear layers' weights quantized
        compile: torch.compile the single-token decode step
        seed: random seed for sampling
        stop: a string, or a list like '["\\n\\n", "User:"]', that ends the generation (not printed)
        devices: GPUs to place consecutive blocks on, for models that do not fit one (CPU: 1)
        prompt_style: how to wrap the prompt (default, alpaca, chatml, llama-3, ...); default: the checkpoint's
    """
    checkpoint_dir = check_checkpoint_dir(checkpoint_dir, need_tokenizer=True)
    check_sampling(temperature, top_k, top_p, num_samples)
    device_list = resolve_devices(devices)
    settings = resolve_generation_precision(precision, device_list[0].type, quantize)
    config = Config.from_checkpoint(checkpoint_dir)
    tokenizer = Tokenizer(checkpoint_dir)
    style = PromptStyle.from_name(prompt_style) if prompt_style else PromptStyle.from_checkpoint(checkpoint_dir, config)

    prompt_ids = tokenizer.encode(style.apply(prompt))
    if len(prompt_ids) == 0:
        if tokenizer.bos_id is None:
            raise UsageError("--prompt is empty and the tokenizer has no bos token to start from. Pass a prompt.")
        prompt_ids = torch.tensor([tokenizer.bos_id])
    total = check_lengths(len(prompt_ids), max_new_tokens, config)

    torch.manual_seed(seed)
    with out_of_memory_hint("loading the model"):
        model = load_model(checkpoint_dir, device_list, settings.dtype, quantize, max_seq_length=total)
        set_kv_cache(model, num_samples, total, settings.compute_dtype)
    generator = make_generator(seed, model.lm_head.weight.device)
    stop_strings = [*style.stop_strings, *([stop] if isinstance(stop, str) else stop or [])]
    write = stdout_writer if num_samples == 1 else None
    streams = [TextStream(tokenizer, stop_strings, prompt_ids[-4:].tolist(), write) for _ in range(num_samples)]

    with out_of_memory_hint("generating"), settings.context(device_list[0].type):
        result = generate(
            model, prompt_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            eos_ids=tokenizer.eos_ids, stop_sequences=style.stop_tokens(tokenizer), num_samples=num_samples,
            on_token=lambda row, token: streams[row].add(token), generator=generator,
            step=decode_step(model, compile),
        )
    texts = [stream.finish() for stream in streams]
    if num_samples == 1:
        stdout_writer("\n")
    else:
        stdout_writer("".join(f"--- sample {i + 1} ---\n{text}\n" for i, text in enumerate(texts)))
    print(stats_line(result, device_list), file=sys.stderr, flush=True)


if __name__ == "__main__":
    cli.main(main)
