"""Continue a prompt with a checkpoint's model: the text streams to stdout, a speed/memory line to stderr.

    python generate/base.py --checkpoint_dir out/pretrain/final --prompt "def fib(n):"
    python generate/base.py --model_name meta-llama/Llama-3.2-1B --quantize bnb.nf4 --num_samples 3
    python generate/base.py --model_name Llama-2-7b-hf --device_memory 8GB --plan text   # will it fit?
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from lit_model.recipes.cli import parse
from lit_model.core.errors import UsageError, run_cli
from lit_model.infer.decode import check_lengths
from lit_model.infer.engine import stats_line
from lit_model.infer.stream import TextStream, stdout_writer
from lit_model.recipes.generation import GenerationArgs, prepare_generation, print_generation_plan

CHARACTERS_PER_TOKEN = 4  # --plan without a tokenizer to count the prompt: a usual ratio for English text


@dataclass
class BaseArgs(GenerationArgs):
    """Generate a continuation of a prompt.

    Args:
        prompt: the text to continue
        max_new_tokens: how many tokens to generate at most; the KV cache holds prompt + this many positions
        num_samples: samples generated together in one batch
        prompt_length: with --plan: the prompt's length in tokens; default: the tokenizer's count of the prompt,
            or where there is no tokenizer (--model_name) a quarter of its characters in the prompt style
    """

    prompt: str = "What food do llamas eat?"
    max_new_tokens: int = 50
    num_samples: int = 1
    prompt_length: Optional[int] = None


def main(args: BaseArgs) -> None:
    setup = prepare_generation(args)  # checks every flag first (check_generation_args)
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



def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> BaseArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(BaseArgs, sys.argv[1:] if argv is None else list(argv), prog)))
