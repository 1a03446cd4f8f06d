"""Pretrain a GPT from scratch: setup -> fit -> save.

    python pretrain/main.py                       # the tiny default on the Python standard library
    python pretrain/main.py --devices 4           # 4 processes (GPUs, or CPU processes with gloo)
    python pretrain/main.py --config config_hub/pretrain/tinyllama.yaml
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal, Optional, Union

from lightning.fabric import Fabric

from lit_model import GPT, Config
from lit_model.recipes.cli import parse
from lit_model.core.errors import UsageError, run_cli
from lit_model.core.units import format_bytes
from lit_model.data.text import default_tokenizer, load_pretrain_data, unigram_loss
from lit_model.io.tokenizer import Tokenizer
from lit_model.plan.oom_report import out_of_memory_report
from lit_model.recipes import common
from lit_model.run import Run, resolve_run
from lit_model.train import session
from lit_model.train.args import TrainArgs, check_args
from lit_model.train.loop import Progress, fit, save_final, write_summary


@dataclass
class PretrainArgs(TrainArgs):
    """Pretrain a GPT from scratch on text files, or on the Python standard library by default.

    Args:
        model_name: architecture from the config registry (python -m lit_model.config lists them)
        model_config: YAML of Config fields for a custom architecture (overrides model_name)
        tokenizer_dir: directory with tokenizer.json/tokenizer.model; default: a BPE trained on the stdlib
        sample_prompt: prompt for the sample generated at the end
        data: a named hub text dataset instead of --data_path: tinystories (needs `pip install datasets`)
    """

    data_kind: ClassVar[str] = "text"  # what --data may name
    model_name: str = "lit-model-5m"
    model_config: Optional[Path] = None
    tokenizer_dir: Optional[Path] = None
    data: Optional[str] = None
    micro_batch_size: Union[int, Literal["auto"]] = 4  # divides the global batch over 1, 2 or 4 processes
    global_batch_size: int = 16
    max_steps: Optional[int] = 100  # ~4 minutes of the default model on 2 idle CPU cores (~3,500 tok/s)
    warmup_steps: int = 10
    eval_interval: int = 50
    save_interval: int = 50
    sample_prompt: str = "def fibonacci(n):\n"


def main(args: PretrainArgs) -> None:
    check_args(args)
    # a bad --model_name or --model_config stops before any process starts; the run is resolved here, once
    run = resolve_run(args, model_config(args))
    common.plan_or_train(run, args, train)


def model_config(args: PretrainArgs) -> Config:
    return Config.from_file(args.model_config) if args.model_config else Config.from_name(args.model_name)


def train(fabric: Fabric, run: Run, args: PretrainArgs) -> None:
    config, seq_length = run.config, run.seq_len
    run = common.choose_loss_chunk_size(fabric, common.choose_micro_batch_size(fabric, run, args), args)
    tokenizer = Tokenizer(args.tokenizer_dir) if args.tokenizer_dir else default_tokenizer(config.vocab_size)
    if tokenizer.vocab_size > config.padded_vocab_size:
        raise UsageError(
            f"The tokenizer has {tokenizer.vocab_size} tokens but {config.name} embeds only "
            f"{config.padded_vocab_size}. Use a model config with vocab_size >= {tokenizer.vocab_size}."
        )
    train_data, val_data, description = load_pretrain_data(args.data_path, tokenizer, seq_length, data=args.data)
    fabric.print(f"Data: {description}")

    fabric.seed_everything(args.seed)
    model = GPT.initialized(config, run.param_dtype)
    model.max_seq_length = seq_length
    fabric.print(f"Model: {config.name}, {sum(p.numel() for p in model.parameters()):,} parameters")
    model, optimizer = session.setup_model_and_optimizer(fabric, model, run, args)

    progress = Progress()
    session.resume_if_asked(fabric, args, model, optimizer, progress, config)
    train_batches = session.train_batches(fabric, train_data, run, args, progress.step)
    val_batches = session.val_batches(fabric, val_data, run, args)
    tokens_per_step = run.global_batch_size * seq_length
    max_steps = args.max_steps if args.max_tokens is None else math.ceil(args.max_tokens / tokens_per_step)
    if max_steps < 1:
        raise UsageError("Give the run a length: --max_steps N or --max_tokens N.")
    fabric.print(
        f"Training {max_steps} steps of {run.global_batch_size} x {seq_length} tokens "
        f"(micro batch {run.micro_batch_size}, {run.accumulation} accumulation steps, "
        f"{run.world_size} process(es), {run.precision})"
    )
    rehearsal_batch = session.longest_batch(fabric, train_data, run)
    progress, run = fit(fabric, run, model, optimizer, session.objective(run, optimizer), train_batches, val_batches,
                        args, max_steps, progress, out_of_memory_report, rehearsal_batch=rehearsal_batch)
    if progress.stopped:  # saved and summarized by fit: no final/, no sample
        return

    final_dir = args.out_dir / "final"
    save_final(fabric, model, config, final_dir, tokenizer.checkpoint_dir)
    del model, optimizer  # the sample reloads final/: the trained copy and the optimizer state go first
    baseline = unigram_loss(train_data.tokens, val_data.tokens, config.padded_vocab_size)
    sample = common.sample_text(fabric, final_dir, tokenizer, args.sample_prompt)
    # after the sample: peak_memory_bytes is the whole process's peak (the sample reloads the model in fp32)
    summary = write_summary(fabric, run, progress, args, {"unigram_val_loss": baseline, "final_dir": str(final_dir)})
    fabric.print(
        f"\nValidation loss {summary['val_loss']:.3f} vs unigram baseline {baseline:.3f} | "
        f"{summary['tokens_per_sec']:,.0f} tok/s | peak memory {format_bytes(summary['peak_memory_bytes'])}\n"
        f"Saved {final_dir} (generate: python generate/base.py --checkpoint_dir {final_dir}), "
        f"metrics in {args.out_dir / 'metrics.csv'}, summary in {args.out_dir / 'summary.json'}\n"
        f"Sample:\n{args.sample_prompt}{sample}"
    )



def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> PretrainArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(PretrainArgs, sys.argv[1:] if argv is None else list(argv), prog)))
