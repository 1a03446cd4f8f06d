"""GRPO fine-tuning on prompts and rewards: setup -> fit, each step's completions generated in this process by the
inference engine with the weights being trained -> save.

    python finetune/grpo.py --data_path prompts.jsonl                          # LoRA, exact match with "answer"
    python finetune/grpo.py --data_path prompts.jsonl --reward rewards.py:correct --reward 'format:^\\d+$' \\
        --reward_weights '[1.0, 0.2]'
    python finetune/grpo.py --data gsm8k                                       # a named hub set of prompts
    python finetune/grpo.py --data_path prompts.jsonl --method adapter         # LLaMA-Adapter prefixes
    python finetune/grpo.py --data_path prompts.jsonl --method full            # every weight (beta 0)

The objective (methods/grpo.py) is TRL 1.16's GRPOTrainer with its defaults: DAPO's token-level loss, clipping at
0.2, num_iterations 1, beta 0, group-scaled advantages. Defaults sized for a CPU: 4 completions per prompt (TRL 8)
and 64 new tokens (TRL 512). A step rolls out --global_batch_size / --num_generations prompts, then trains on their
completions --micro_batch_size at a time; a KV cache of G x (prompt + --max_new_tokens) positions exists only while
a prompt's group is generated.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

from lightning.fabric import Fabric

from lit_model.core.errors import UsageError, run_cli
from lit_model.core.meter import Meter
from lit_model.data.prompts import PROMPT_EXAMPLE, PromptData, load_prompt_data
from lit_model.infer.load import Precision
from lit_model.infer.rollout import EvaluationRollouts, Rollouts, row_length, train_rollouts
from lit_model.infer.sampling import check_sampling
from lit_model.io.prompts import PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.methods.rewards import load_rewards
from lit_model.plan.oom_report import out_of_memory_report
from lit_model.recipes import common, finetune
from lit_model.data.sources import parse_fields
from lit_model.recipes.cli import parse
from lit_model.recipes.finetune_adapter import AdapterArgs
from lit_model.recipes.finetune_lora import LoRAArgs
from lit_model.run import Run
from lit_model.train import session
from lit_model.train.args import check_args
from lit_model.train.loop import Progress, fit
from lit_model.train.step import unwrap


@dataclass
class GRPOArgs(LoRAArgs, AdapterArgs):
    """Fine-tune a checkpoint with GRPO on prompts and rewards (LoRA, QLoRA, LLaMA-Adapter or every weight).

    Args:
        data_path: .json/.jsonl/.parquet/.csv prompt records, TRL's formats: {"prompt": str} or a "prompt" (or
            "messages") list of chat messages, with any other fields (e.g. "answer") handed to the rewards
        data: a named hub dataset of prompts instead of --data_path: gsm8k (its "answer" the number after "####")
            (downloaded once into the datasets cache; needs `pip install datasets`)
        data_fields: map the data's field names to ours, OURS=THEIRS pairs: e.g. prompt=question,answer=solution
            (ours: prompt, answer)
        method: lora (with --quantize: QLoRA), adapter (LLaMA-Adapter, as finetune/adapter.py; with --quantize the
            base in low precision) or full (every weight)
        reward: a built-in (exact_match: the completion equals the record's "answer"; format:REGEX; length: its
            tokens) or FILE.py:function, a function (prompts, completions, **fields) -> list[float]; repeat the flag
            for several, summed with --reward_weights
        reward_weights: one weight per --reward (default: 1 each)
        num_generations: completions per prompt, the group whose rewards each is compared with (TRL's default: 8)
        max_new_tokens: the longest completion (TRL's max_completion_length, 512 by default)
        temperature: sampling temperature of the rollouts (TRL: 1.0; must be positive)
        top_k: sample from the k likeliest tokens only (default: no limit, as TRL)
        top_p: nucleus sampling (1: off, as TRL)
        loss_type: dapo (token-level over the step, TRL's default), grpo (each completion's mean) or dr_grpo
        scale_rewards: group (advantages over the group's std, TRL's default), batch (the step's std) or none
        beta: weight of the KL to the reference (0: none, TRL's default; > 0 needs --method lora or adapter, whose
            base with its adapters off is the reference)
        epsilon: the ratio's lower clip, 1 - epsilon
        epsilon_high: the ratio's upper clip, 1 + epsilon_high (DAPO's "clip higher" when above epsilon)
    """

    data_kind: ClassVar[str] = "prompts"  # what --data may name
    out_dir: Path = Path("out/finetune/grpo")
    method: Literal["lora", "adapter", "full"] = "lora"
    reward: list[str] = field(default_factory=lambda: ["exact_match"])
    reward_weights: Optional[list[float]] = None
    num_generations: int = 4
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: float = 1.0
    loss_type: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    micro_batch_size: Union[int, Literal["auto"]] = 4
    global_batch_size: int = 8
    learning_rate: float = 1e-5
    min_lr: float = 1e-6
    eval_iters: int = 4


def main(args: GRPOArgs) -> None:
    check_args(args)
    finetune.check_own_data(args, "finetune/grpo.py", "prompts", PROMPT_EXAMPLE)
    if args.max_tokens is not None or not args.max_steps or args.max_steps < 1:
        raise UsageError("Give the run's length in steps with --max_steps N: a GRPO step's tokens are known only once "
                         "its completions are generated, so --max_tokens cannot say when to stop.")
    check_sampling(args.temperature, args.top_k, args.top_p)
    if args.temperature == 0:
        raise UsageError("--temperature 0 samples every completion of a prompt alike, so their rewards never differ "
                         "and GRPO learns nothing: use a positive temperature (TRL's default is 1.0).")
    if args.plan is None:
        load_rewards(args.reward, args.reward_weights)  # the user's files run once now: their errors before any output
    has_data = args.data_path is not None or args.data is not None
    run = finetune.resolve(args, args.method, read_prompts if has_data else None, rollout_length)
    if run.parallel.fsdp:
        raise UsageError("GRPO generates its rollouts with the whole model in each process, and FSDP shards it "
                         "(--strategy fsdp, or --cpu_offload): use one device or --strategy ddp.")
    if run.per_rank_batch % args.num_generations:
        raise UsageError(f"--global_batch_size {run.global_batch_size} over {run.world_size} processes gives each "
                         f"{run.per_rank_batch} completions, not a multiple of --num_generations {args.num_generations}: "
                         "each process rolls out whole groups. Make the global batch a multiple of "
                         f"{args.num_generations * run.world_size}.")
    if args.max_new_tokens >= run.seq_len:
        raise UsageError(f"--max_new_tokens {args.max_new_tokens} leaves no room for a prompt in the context of "
                         f"{run.seq_len} tokens: lower it, or raise --override_max_seq_length (up to the block size).")
    common.plan_or_train(run, args, train)


def read_prompts(run: Run, args: GRPOArgs, tokenizer: Any, style: PromptStyle) -> PromptData:
    """The prompts this run rolls out, each at most the context less --max_new_tokens."""
    return load_prompt_data(args.data_path, tokenizer, style, run.seq_len - args.max_new_tokens,
                            args.val_split_fraction, data=args.data, fields=parse_fields(args.data_fields, "prompts"))


def rollout_length(data: PromptData, run: Run) -> tuple[int, str]:
    """The longest rollout row: the longest prompt with the longest completion, padded as rows are (the rehearsal's)."""
    return (row_length(data.longest + run.grpo.max_new_tokens, run.seq_len),
            f"the longest prompt of the data with --max_new_tokens {run.grpo.max_new_tokens}")


def train(fabric: Fabric, run: Run, args: GRPOArgs) -> None:
    run = common.choose_loss_chunk_size(fabric, common.choose_micro_batch_size(fabric, run, args), args)
    spec = run.grpo
    tokenizer, style = Tokenizer(run.checkpoint_dir), finetune.prompt_style(run, args)
    data = read_prompts(run, args, tokenizer, style)
    if args.sample_instruction is not None:
        data.sample_instruction = style.apply(args.sample_instruction)
    fabric.print(f"Data: {data.description}")
    rewards, weights = load_rewards(spec.rewards, spec.reward_weights)
    setup = finetune.Setup(run.checkpoint_dir, tokenizer, style, data, {})
    fabric.seed_everything(args.seed)  # the same adapter initialisation on every rank
    model = finetune.load_model(fabric, run, setup)
    finetune.make_trainable(fabric, run, model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    reference = finetune.adapters_off(run) if spec.beta > 0 else "none (beta 0)"
    fabric.print(f"GRPO ({spec.loss_type}) with {', '.join(spec.rewards)}: {trainable:,} trainable parameters; "
                 f"reference: {reference}")
    model, optimizer = session.setup_model_and_optimizer(fabric, model, run, args)
    progress = Progress()
    save_filter = finetune.resume(fabric, run, args, model, optimizer, progress, trainable_only=run.trainable != "full")

    precision = Precision(run.precision, run.param_dtype, run.autocast_dtype)
    rollouts = Rollouts(unwrap(model), tokenizer, precision, spec, rewards, weights, run.seq_len, fabric.device,
                        announce=lambda line: fabric.print(line, flush=True), rows=spec.rollout_rows(run.micro_batch_size))
    prompts_per_step = run.global_batch_size // spec.num_generations
    meter = Meter()  # the training rollouts' tokens and seconds, logged apart from the training's
    train_batches = train_rollouts(rollouts, data.train, prompts_per_step, run.micro_batch_size, fabric.global_rank,
                                   run.world_size, args.seed, progress.step, meter)
    # every rank evaluates as many prompts (one group a batch), its own where there are enough
    count = max(1, min(args.eval_iters, len(data.val)) // run.world_size)
    first = fabric.global_rank * count
    val_batches = EvaluationRollouts(rollouts, [data.val[(first + i) % len(data.val)] for i in range(count)], args.seed)
    objective = session.objective(run, optimizer)
    longest, _ = rollout_length(data, run)
    rehearsal_batch = tuple(part.to(fabric.device) for part in objective.example_batch(
        run.micro_batch_size, longest, run.config.padded_vocab_size))
    fabric.print(f"Training {args.max_steps} steps of {prompts_per_step} prompts x {spec.num_generations} completions "
                 f"of up to {spec.max_new_tokens} tokens (micro batch {run.micro_batch_size}, {run.accumulation} "
                 f"accumulation steps, {run.world_size} process(es), {run.precision})")
    progress, run = fit(fabric, run, model, optimizer, objective, train_batches, val_batches, args, args.max_steps,
                        progress, out_of_memory_report, save_filter=save_filter, rehearsal_batch=rehearsal_batch,
                        rollout_meter=meter)
    if progress.stopped:  # saved and summarized by fit: no final/, no answer
        return
    final_dir = args.out_dir / "final"
    finetune.save_trained(fabric, run, setup, model, final_dir)
    del model, optimizer, rollouts, train_batches, val_batches  # the sample reloads final/
    finetune.finish(fabric, run, args, setup, progress, final_dir)


def repeated_rewards(argv: list[str]) -> list[str]:
    """Every ``--reward X`` (or ``--reward=X``) as one list flag, so that the flag repeats: ``--reward a --reward b``
    sums both. A regular expression's commas and brackets survive: the list is JSON. A list given as such
    (``--reward '[a, b]'``) is left as it is."""
    values, rest, i = [], [], 0
    while i < len(argv):
        if argv[i] == "--reward" and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 1
        elif argv[i].startswith("--reward="):
            values.append(argv[i][len("--reward="):])
        else:
            rest.append(argv[i])
        i += 1
    if not values or any(value.lstrip().startswith("[") for value in values):
        return argv
    return [*rest, "--reward", json.dumps(values)]


def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> GRPOArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    args = sys.argv[1:] if argv is None else list(argv)
    run_cli(lambda: main(parse(GRPOArgs, repeated_rewards(args), prog)))

