"""Continue a prompt with a checkpoint's model: the text streams to stdout, a speed/memory line to stderr.

    python generate/base.py --checkpoint_dir out/pretrain/final --prompt "def fib(n):"
    python generate/base.py --model_name meta-llama/Llama-3.2-1B --quantize bnb.nf4 --num_samples 3
    python generate/base.py --model_name Llama-2-7b-hf --device_memory 8GB --plan text   # will it fit?
    python generate/base.py --checkpoint_dir DIR --prompt "Hi" --prompt "Bye"     # or --prompts_file prompts.txt

Several prompts are generated together by continuous batching over a paged KV cache (infer/batching.py): each
holds only the cache it has written and leaves the batch when it ends.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch

from lit_model.core.errors import UsageError, run_cli
from lit_model.core.units import format_bytes
from lit_model.data.text import read_text
from lit_model.infer.batching import Engine, Event, Request, complete
from lit_model.infer.decode import check_lengths
from lit_model.infer.engine import Sampling, out_of_memory_hint, peak_memory_bytes, stats_line
from lit_model.infer.paged import DEFAULT_BLOCK_SIZE, PoolSpec, blocks_for
from lit_model.infer.stream import TextStream, stdout_writer
from lit_model.recipes.cli import parse
from lit_model.recipes.generation import GenerationArgs, GenerationSetup, prepare_generation, print_generation_plan

CHARACTERS_PER_TOKEN = 4  # --plan without a tokenizer to count the prompt: a usual ratio for English text


@dataclass
class BaseArgs(GenerationArgs):
    """Generate a continuation of a prompt.

    Args:
        prompt: the text to continue; several (--prompt A --prompt B, or a list like '["A", "B"]') are generated
            together, each printed after its own header
        prompts_file: a UTF-8 text file of prompts, one per line (empty lines skipped), generated together like
            several --prompt; replaces --prompt
        max_new_tokens: how many tokens to generate at most; the KV cache holds prompt + this many positions
        num_samples: samples generated together in one batch (per prompt)
        prompt_length: with --plan: the prompt's length in tokens; default: the tokenizer's count of the prompt,
            or where there is no tokenizer (--model_name) a quarter of its characters in the prompt style
    """

    prompt: Union[str, list[str]] = "What food do llamas eat?"
    prompts_file: Optional[Path] = None
    max_new_tokens: int = 50
    num_samples: int = 1
    prompt_length: Optional[int] = None


def main(args: BaseArgs) -> None:
    prompts = read_prompts(args)
    setup = prepare_generation(args)  # checks every flag first (check_generation_args)
    if len(prompts) > 1:
        return generate_batch(setup, args, prompts)
    args.prompt = prompts[0]
    if args.plan is not None and (args.prompt_length is not None or setup.tokenizer is None):
        length = args.prompt_length or math.ceil(len(setup.style.apply(args.prompt)) / CHARACTERS_PER_TOKEN)
    else:
        prompt_ids = setup.tokenizer.encode(setup.style.apply(args.prompt))
        if len(prompt_ids) == 0:
            if setup.tokenizer.bos_id is None:
                raise UsageError("--prompt is empty and the tokenizer has no bos token to start from. Pass a prompt.")
            prompt_ids = torch.tensor([setup.tokenizer.bos_id])
        length = len(prompt_ids)
    total = check_lengths(length, args.max_new_tokens, setup.config)
    if args.plan is not None:
        return print_generation_plan(setup, length, args.max_new_tokens, args.num_samples)

    generator = setup.generator(setup.load(max_seq_length=total))
    generator.allocate(args.num_samples, total)
    stop_strings = [*setup.style.stop_strings, *setup.stop]
    write = stdout_writer if args.num_samples == 1 else None
    context = prompt_ids[-4:].tolist()
    streams = [TextStream(setup.tokenizer, stop_strings, context, write) for _ in range(args.num_samples)]
    result = generator.generate(
        prompt_ids, args.max_new_tokens, eos_ids=setup.tokenizer.eos_ids,
        stop_sequences=setup.style.stop_tokens(setup.tokenizer), num_samples=args.num_samples,
        on_token=lambda row, token: streams[row].add(token),
    )
    texts = [stream.finish() for stream in streams]
    if args.num_samples == 1:
        stdout_writer("\n")
    else:
        stdout_writer("".join(f"--- sample {i + 1} ---\n{text}\n" for i, text in enumerate(texts)))
    print(stats_line(result, setup.devices), file=sys.stderr, flush=True)

def read_prompts(args: BaseArgs) -> list[str]:
    """--prompt (one or several) or the lines of --prompts_file."""
    if args.prompts_file is None:
        prompts = [args.prompt] if isinstance(args.prompt, str) else list(args.prompt)
        if not prompts:
            raise UsageError("--prompt is an empty list: give at least one prompt.")
        return prompts
    if args.prompt != BaseArgs.prompt:
        raise UsageError("Pass --prompt or --prompts_file, not both: the file's lines are the prompts.")
    prompts = [line for line in read_text(args.prompts_file).splitlines() if line.strip()]
    if not prompts:
        raise UsageError(f"--prompts_file {args.prompts_file} holds no prompt: write one prompt per line.")
    return prompts


def generate_batch(setup: GenerationSetup, args: BaseArgs, prompts: list[str]) -> None:
    """Several prompts (x --num_samples) through the continuous-batching engine, in a pool that holds them all at
    once; each output printed after a header, the stats line to stderr."""
    if args.compile:
        raise UsageError("--compile compiles the decode step of one prompt; with several prompts leave it out.")
    styled = [setup.style.apply(p) for p in prompts]
    if args.plan is not None:  # the pool as if every prompt were the longest: an upper bound
        longest = max(args.prompt_length or math.ceil(len(p) / CHARACTERS_PER_TOKEN) for p in styled)
        return print_generation_plan(setup, longest, args.max_new_tokens, len(prompts) * args.num_samples, paged=True)
    encoded = [tuple(setup.tokenizer.encode(p).tolist()) for p in styled]
    for text, ids in zip(prompts, encoded):
        if not ids:
            raise UsageError(f"The prompt {text!r} has no tokens: drop the empty prompt.")
    total = max(check_lengths(len(ids), args.max_new_tokens, setup.config) for ids in encoded)
    model = setup.load(max_seq_length=total)
    eos, stops = tuple(setup.tokenizer.eos_ids), tuple(map(tuple, setup.style.stop_tokens(setup.tokenizer)))
    a = args
    requests = [Request(f"{i}.{j}", ids, a.max_new_tokens, Sampling(a.temperature, a.top_k, a.top_p, a.seed + j), eos,
                        stops) for i, ids in enumerate(encoded) for j in range(a.num_samples)]
    pool = PoolSpec(sum(blocks_for(len(r.prompt_ids) + a.max_new_tokens, DEFAULT_BLOCK_SIZE) for r in requests))
    engine = Engine(model, setup.precision, pool, max_batch=len(requests))
    stop_strings = [*setup.style.stop_strings, *setup.stop]
    streams = {r.id: TextStream(setup.tokenizer, stop_strings, r.prompt_ids[-4:]) for r in requests}

    def on_event(event: Event) -> None:
        stream = streams[event.id]
        if any([stream.add(token) for token in event.tokens]) and event.finish_reason is None:
            engine.cancel(event.id)  # a stop string ended it

    with out_of_memory_hint("generating"):
        done, timing = complete(engine, requests, on_event)
    for request in requests:
        i, j = request.id.split(".")
        header = f"--- prompt {int(i) + 1}" + (f", sample {int(j) + 1}" if a.num_samples > 1 else "") + " ---"
        text = streams[request.id].finish()
        stdout_writer(f"{header}\n{text}\n" if done[request.id].error is None else
                      f"{header}\n{text}\n[{done[request.id].error}]\n")
    print(f"{len(requests)} sequences, time to first token: {timing.time_to_first_token:.3f} s, "
          f"{timing.tokens} tokens in {timing.seconds:.2f} s ({timing.tokens_per_sec:.2f} tokens/s), "
          f"peak memory: {format_bytes(peak_memory_bytes(setup.devices))}", file=sys.stderr, flush=True)


def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> BaseArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(BaseArgs, sys.argv[1:] if argv is None else list(argv), prog)))
