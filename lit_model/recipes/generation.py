"""What generate/base.py and generate/chat.py share: their flags, checked before any file is read, the config,
tokenizer and prompt style read (never the weights), then the model loaded and the inference engine built over it;
and their --plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

import torch

from lit_model.core.config import Config
from lit_model.core.errors import UsageError
from lit_model.core.precision import PRECISIONS
from lit_model.core.units import parse_memory
from lit_model.infer.engine import Generator, Sampling, out_of_memory_hint
from lit_model.infer.load import DEFAULT_CHECKPOINT, Precision, load_model, resolve_devices, resolve_generation_precision
from lit_model.infer.sampling import check_sampling
from lit_model.io.download import resolve_checkpoint
from lit_model.io.prompts import PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.methods.quantize import QUANTIZE_MODES
from lit_model.model.gpt import GPT
from lit_model.plan.generation import plan_generation
from lit_model.plan.report import check_plan_fits


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

    def sampling(self) -> Sampling:
        return Sampling(self.args.temperature, self.args.top_k, self.args.top_p, self.args.seed)

    def generator(self, model: GPT) -> Generator:
        """The inference engine over ``model`` with the flags' precision, sampling and decode step."""
        return Generator(model, self.precision, self.sampling(), compile=self.args.compile)


def print_generation_plan(setup: GenerationSetup, prompt_length: int, max_new_tokens: int, batch_size: int,
                          paged: bool = False) -> None:
    """generate/base.py's and chat.py's ``--plan text|json``: the predicted peak memory of generating
    ``max_new_tokens`` after ``prompt_length`` tokens for ``batch_size`` samples with the script's settings
    (``paged``: in the continuous-batching engine's pool)."""
    args = setup.args
    plan = plan_generation(setup.config, prompt_length, max_new_tokens, batch_size, setup.precision.name,
                           args.quantize, args.device_memory, setup.device_type, devices=args.devices,
                           compile=args.compile, paged=paged)
    print(plan.to_json() if args.plan == "json" else plan.to_text())
    check_plan_fits(plan)


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
