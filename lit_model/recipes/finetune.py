"""What finetune/full.py, lora.py and adapter.py share: their flags, the checkpoint + data setup, loading the
base model (quantized on request), the fit with padded length-grouped batches and trainable-only checkpoints,
and the end of the run (summary, an answer to a fixed validation instruction)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, ClassVar, Literal, Optional, Union

import torch
import torch.nn as nn
from lightning.fabric import Fabric
from safetensors.torch import save_file

from lit_model.core.errors import UsageError, UserError
from lit_model.core.units import format_bytes
from lit_model.data.instruct import (InstructData, PackedDataset, collate, load_instruct_data, padded_length,
                                     padding_fraction)
from lit_model.data.preference import PreferenceData
from lit_model.data.prompts import PromptData
from lit_model.data.sources import NAMED, parse_fields
from lit_model.infer.load import load_model as load_checkpoint_model
from lit_model.io.checkpoint import derive_checkpoint_dir
from lit_model.io.download import resolve_checkpoint
from lit_model.io.prompts import PROMPT_STYLE_FILE, PromptStyle
from lit_model.io.tokenizer import ByteCountTokenizer, Tokenizer, has_tokenizer
from lit_model.methods.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, AdapterAttention, AdapterConfig, apply_adapter
from lit_model.methods.lora import LORA_CONFIG, LORA_WEIGHTS, LoRAConfig, apply_lora, save_merged_checkpoint
from lit_model.methods.quantize import check_quantize
from lit_model.model.gpt import GPT
from lit_model.plan.oom_report import out_of_memory_report
from lit_model.recipes import common
from lit_model.run import Run, Trainable, resolve_run
from lit_model.train import session
from lit_model.train.args import TrainArgs
from lit_model.train.loop import Progress, fit, rollout_rates, save_final, write_summary
from lit_model.train.resumable import STATE_NAME
from lit_model.train.step import unwrap

DEFAULT_CHECKPOINT = Path("out/pretrain/final")
# What a fine-tune writes into its final/ itself, so never copies from the checkpoint it started from
DERIVED_FILES = (LORA_WEIGHTS, LORA_CONFIG, ADAPTER_WEIGHTS, ADAPTER_CONFIG, PROMPT_STYLE_FILE)
Quantize = Literal["bnb.nf4", "bnb.nf4-dq", "bnb.fp4", "bnb.int8"]


@dataclass
class FinetuneArgs(TrainArgs):
    """Flags shared by finetune/full.py, lora.py and adapter.py.

    Args:
        checkpoint_dir: checkpoint to start from (weights, model_config.yaml, tokenizer); default: what
            `python pretrain/main.py` writes
        model_name: ORG/NAME (or its registry name) of a model `lit-model download ORG/NAME` wrote to
            checkpoints/ORG/NAME, in place of --checkpoint_dir; with --plan also a model not downloaded yet
            (its architecture from the config registry)
        model_config: with --plan: a YAML of Config fields, to plan a custom architecture before it has a checkpoint
        data_path: .json/.jsonl/.parquet/.csv instruction data (Alpaca keys, common aliases such as
            prompt/response or question/answer, or chat "messages"/"conversations"), a directory of them, or a
            directory written by datasets' save_to_disk; omitted: instructions made from the Python standard library
        data: a named hub dataset instead of --data_path: alpaca, alpaca_2k, dolly, lima (gated), longform
            (downloaded once into the datasets cache; needs `pip install datasets`)
        data_fields: map the data's field names to ours, OURS=THEIRS pairs: e.g.
            instruction=question,output=answer (ours: instruction, input, output, messages)
        quantize: keep the frozen base weights in bnb.nf4, bnb.nf4-dq, bnb.fp4 or bnb.int8 (lora.py: QLoRA)
        prompt_style: alpaca, chatml, llama-3, ...; default: the checkpoint's, or alpaca for a base model
        mask_prompt: compute the loss on the responses only (prompt tokens get target -100)
        packing: pack several samples into each sequence of up to the run's sequence length, each attending only
            to itself with its positions from 0 (the loss per token is the unpacked one): far less padding, more
            real tokens per second; --global_batch_size and --micro_batch_size then count sequences, not samples
        val_split_fraction: share of the records held out for validation
        sample_instruction: instruction answered at the end (default: the first validation sample's)
    """

    data_kind: ClassVar[str] = "instruct"  # what --data may name
    checkpoint_dir: Path = DEFAULT_CHECKPOINT
    model_name: Optional[str] = None
    model_config: Optional[Path] = None
    data: Optional[str] = None
    data_fields: Optional[str] = None
    out_dir: Path = Path("out/finetune")
    quantize: Optional[Quantize] = None
    prompt_style: Optional[str] = None
    mask_prompt: bool = True
    packing: bool = False
    val_split_fraction: float = 0.05
    sample_instruction: Optional[str] = None
    micro_batch_size: Union[int, Literal["auto"]] = 4
    global_batch_size: int = 16
    max_steps: Optional[int] = 100
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    log_interval: int = 5
    eval_interval: int = 25
    eval_iters: int = 10
    save_interval: int = 50


@dataclass
class Setup:
    checkpoint_dir: Path
    tokenizer: Tokenizer
    style: PromptStyle
    data: Union[InstructData, PreferenceData, PromptData]
    padding: dict[str, float]  # summary.json's padding fractions: this run's, and without and with packing




def read_instruct_data(run: Run, args: FinetuneArgs, tokenizer: Any, style: PromptStyle) -> InstructData:
    """The instruction samples this run trains and validates on (the standard library's when no data is named)."""
    return load_instruct_data(args.data_path, tokenizer, style, run.seq_len, args.mask_prompt, args.val_split_fraction,
                              data=args.data, fields=parse_fields(args.data_fields))


# A recipe's data: (run, args, tokenizer, style) -> train/val data with a description
ReadData = Callable[[Run, Any, Any, PromptStyle], Union[InstructData, PreferenceData, PromptData]]
# ... and the length of its longest micro batch as the run pads it (at most the run's), with what that length is
BatchLength = Callable[[Any, Run], tuple[int, str]]


def collated_length(data: Union[InstructData, PreferenceData], run: Run) -> tuple[int, str]:
    """Instruction samples' or preference pairs' longest micro batch: the longest sample, padded as ``collate`` pads."""
    return padded_length(max(data.train.lengths), max_length=run.seq_len), "the longest sample of the data"


def resolve(args: FinetuneArgs, method: Trainable, read_data: Optional[ReadData] = read_instruct_data,
            batch_length: BatchLength = collated_length) -> Run:
    """The run, resolved once in the script's main: every flag checked against the checkpoint and the device
    before any process starts (a plan reads the architecture, and the data's lengths with ``read_data`` and
    ``batch_length``: see ``with_data_length``)."""
    if args.freeze_layers is not None and method != "full":
        raise UsageError(f"--freeze_layers applies to full fine-tuning (finetune/full.py); {method} already trains "
                         "only its own parameters. Drop --freeze_layers.")
    if method == "lora":  # its flags' checks need no checkpoint: they come before any is read
        LoRAConfig.from_flags(args)
    checkpoint_dir, config = resolve_checkpoint(args.model_name, args.checkpoint_dir, DEFAULT_CHECKPOINT,
                                                plan=args.plan is not None, model_config=args.model_config)
    if args.plan is not None:  # the architecture and the data's lengths only: no weights are read
        return with_data_length(resolve_run(args, config, method), args, checkpoint_dir, read_data, batch_length)
    continues_adapter = (checkpoint_dir / ADAPTER_CONFIG).is_file()
    if continues_adapter and method != "adapter":
        raise UsageError(
            f"{checkpoint_dir} holds a LLaMA-Adapter fine-tune ({ADAPTER_CONFIG}), whose prefixes cannot be merged "
            f"into the weights that {method} fine-tuning would start from. Continue it with finetune/adapter.py "
            "(or dpo.py / grpo.py with --method adapter), or start from its base checkpoint."
        )
    run = resolve_run(args, config, method, checkpoint_dir=checkpoint_dir)
    check_quantize(run.quantize, run.device_type, run.param_dtype, run.autocast_dtype is not None)
    if run.quantize == "bnb.int8" and run.parallel.fsdp:
        raise UsageError(
            "--quantize bnb.int8 cannot be sharded: bitsandbytes keeps LLM.int8()'s row scales on the weight object, "
            "which FSDP replaces with its shards. With --strategy fsdp use a 4-bit mode (bnb.nf4, bnb.nf4-dq, "
            "bnb.fp4: FSDP shards their packed weights), or keep bnb.int8 with --strategy ddp or one device."
        )
    if continues_adapter:  # its prefixes are continued as they were saved
        run = continue_adapter(run, checkpoint_dir)
    if run.adapter is not None:
        run.adapter.check(run.config.n_layer)
    return run


def continue_adapter(run: Run, checkpoint_dir: Path) -> Run:
    """The run continuing the LLaMA-Adapter ``checkpoint_dir`` carries. The model it starts from has those prefixes,
    so the base with them off is not its reference: a preference loss takes the checkpoint's log-probabilities,
    computed once; GRPO, whose rollouts are new every step, has no such reference."""
    run = run.replace(adapter=AdapterConfig.from_dir(checkpoint_dir))
    if run.preference is not None and run.preference.reference == "adapters":
        run = run.replace(preference=dataclasses.replace(run.preference, reference="precomputed"))
    if run.grpo is not None and run.grpo.reference == "adapters":
        raise UsageError(f"--beta {run.grpo.beta} keeps the policy near the model it starts from, but "
                         f"{checkpoint_dir} carries a trained LLaMA-Adapter, so the base with its prefixes off is "
                         "another model. Use --beta 0, or start from a checkpoint without an adapter (a merged LoRA or "
                         "a full fine-tune).")
    return run


def with_data_length(run: Run, args: FinetuneArgs, checkpoint_dir: Optional[Path], read_data: Optional[ReadData],
                     batch_length: BatchLength = collated_length) -> Run:
    """--plan: the run at the length of the longest micro batch its data makes (the rehearsal's: ``batch_length``,
    e.g. the longest sample padded as ``collate`` pads it), not the model's whole context, with where that length
    comes from. Without the
    checkpoint's tokenizer (a model not downloaded yet) the samples are counted in UTF-8 bytes, an upper bound of any
    tokenizer's count. Packed samples' sequences (``packs_whole_length``), a recipe without data to read, data not
    there yet and data the run would stop on (noted) are planned at the run's length."""
    if packs_whole_length(run) or read_data is None:
        return run
    if args.data_path is not None and not Path(args.data_path).exists():  # planned before the data is there
        return run.replace(seq_len_source=f"--data_path {args.data_path} does not exist yet: planned at the whole "
                                          "length (--override_max_seq_length, else the model's context)")
    tokenizer = Tokenizer(checkpoint_dir) if checkpoint_dir is not None and has_tokenizer(checkpoint_dir) else None
    counted = run.replace(checkpoint_dir=checkpoint_dir)
    try:
        data = read_data(counted, args, tokenizer or ByteCountTokenizer(), prompt_style(counted, args))
    except UserError as error:  # the run would stop on it; the plan is of its memory, and says why it assumed more
        return run.replace(seq_len_source=f"planned at the whole length: the run would stop on its data: {error}")
    length, what = batch_length(data, run)
    unit = "tokens" if tokenizer is not None else "UTF-8 bytes (no tokenizer yet: an upper bound of its tokens)"
    packed = "; --packing packs a micro batch's rows into at most as many tokens" if run.packing else ""
    return run.replace(seq_len=length, seq_len_source=f"{what}, counted in {unit} and padded as batches are "
                                                      f"({data.description}){packed}")


def packs_whole_length(run: Run) -> bool:
    """Whether the run's micro batches are sequences of its whole length: packed samples fill them; packed preference
    rows never hold more tokens than their micro batch unpacked (``pack_rows``), which is planned instead."""
    return run.packing and run.preference is None


def check_own_data(args: Any, script: str, what: str, example: str) -> None:
    """The flags of a fine-tune that reads its own kind of records (``what``, like ``example``; finetune/dpo.py's
    pairs, grpo.py's prompts): some data unless it only plans, and --quantize only with a frozen base."""
    if args.data_path is None and args.data is None and args.plan is None:
        names = ", ".join(name for name, source in NAMED.items() if source.kind == args.data_kind)
        raise UsageError(f"{script} needs {what}: --data_path FILE with records like {example} (or chat messages, as "
                         f"TRL takes them), or a named hub dataset with --data ({names}).")
    if args.method == "full" and args.quantize is not None:
        raise UsageError(f"--quantize {args.quantize} freezes the base weights, but --method full trains every weight. "
                         "Use --method lora (QLoRA) or --method adapter with --quantize, or drop --quantize.")


def prompt_style(run: Run, args: FinetuneArgs) -> PromptStyle:
    """--prompt_style, else the checkpoint's (the config's when there is none yet, for a plan); a base model's
    "default" style has no turn markers (instructions and answers would run together), so alpaca's instead."""
    if args.prompt_style is not None:
        return PromptStyle.from_name(args.prompt_style)
    style = (PromptStyle.from_config(run.config) if run.checkpoint_dir is None
             else PromptStyle.from_checkpoint(run.checkpoint_dir, run.config))
    return style if style.name != "default" else PromptStyle.from_name("alpaca")


def prepare(fabric: Fabric, run: Run, args: FinetuneArgs) -> tuple[Run, Setup]:
    """The tokenizer, the data and the micro batch (``auto``); every rank does the same and fails alike."""
    checkpoint_dir = run.checkpoint_dir
    tokenizer, style = Tokenizer(checkpoint_dir), prompt_style(run, args)
    data = read_instruct_data(run, args, tokenizer, style)
    if args.sample_instruction is not None:
        data.sample_instruction = style.apply(args.sample_instruction)
    fabric.print(f"Data: {data.description}")
    run = choose_for_data(fabric, run, args, data)
    packed = PackedDataset(data.train, run.seq_len)
    steps = min(args.max_steps or 1, math.ceil(len(data.train) / run.global_batch_size))  # at most an epoch
    fractions = [padding_fraction(train.lengths, run.global_batch_size, run.micro_batch_size, steps, run.seq_len, args.seed)
                 for train in (data.train, packed)]
    padding = padding_summary(fabric, run, fractions, f"{len(data.train)} samples in {len(packed)} sequences of up to "
                                                      f"{run.seq_len} tokens")
    if run.packing:
        data = dataclasses.replace(data, train=packed, val=PackedDataset(data.val, run.seq_len))
    return run, Setup(checkpoint_dir, tokenizer, style, data, padding)


def padding_summary(fabric: Fabric, run: Run, fractions: list[float], packed: str) -> dict[str, float]:
    """summary.json's padding fractions (the micro batches' share of padding tokens, without and with packing, and
    this run's), printed with how packing makes its batches (``packed``)."""
    fabric.print(f"Padding: {fractions[0]:.1%} of the tokens in the micro batches without packing, {fractions[1]:.1%} "
                 f"with --packing ({packed})")
    return {"padding_fraction_without_packing": fractions[0], "padding_fraction_with_packing": fractions[1],
            "padding_fraction": fractions[run.packing]}


def choose_for_data(fabric: Fabric, run: Run, args: FinetuneArgs, data: Union[InstructData, PreferenceData]) -> Run:
    """``--micro_batch_size auto`` and ``--loss_chunk_size auto`` planned at the longest micro batch the data makes
    (its longest sample, train or validation, padded as ``collate`` pads it; packed: the whole sequence), not at the
    cut length, which may be the model's whole context: the batch the rehearsal then confirms."""
    if not (run.micro_batch_auto or run.loss_chunk_auto):
        return run
    longest = max(max(data.train.lengths), max(data.val.lengths))
    planned = run if packs_whole_length(run) else run.replace(seq_len=padded_length(longest, max_length=run.seq_len))
    chosen = common.choose_loss_chunk_size(fabric, common.choose_micro_batch_size(fabric, planned, args), args)
    return run.replace(micro_batch_size=chosen.micro_batch_size, micro_batch_auto=False,
                       loss_chunk_size=chosen.loss_chunk_size, loss_chunk_auto=False)


def load_model(fabric: Fabric, run: Run, setup: Setup) -> GPT:
    """The checkpoint's model in the precision's dtype, frozen, in train mode: on this process's device (each
    part quantized there as it is read), or on the CPU for FSDP, which shards it from there."""
    device = torch.device("cpu") if run.parallel.fsdp else fabric.device
    model = load_checkpoint_model(setup.checkpoint_dir, [device], run.param_dtype, run.quantize, max_seq_length=run.seq_len)
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            # bitsandbytes repacks 4-bit weights in place for CPU inference when it sees an eval-mode forward
            # without gradients (our validation): keep the one layout that training and FSDP's shards use
            module.support_avx512bf16_for_cpu = False
    n_parameters = sum(p.numel() for p in GPT.on_meta(run.config).parameters())  # before quantization packs them
    fabric.print(f"Model: {run.config.name} from {setup.checkpoint_dir}, {n_parameters:,} parameters"
                 f"{f', frozen base weights in {run.quantize}' if run.quantize else ''}")
    return model.train()


def trainable_names(model: nn.Module) -> set[str]:
    return {name for name, p in unwrap(model).named_parameters() if p.requires_grad}


def _strip_wrappers(name: str) -> str:
    for prefix in ("_forward_module.", "module.", "_orig_mod."):
        while name.startswith(prefix):
            name = name[len(prefix):]
    return name


def train(fabric: Fabric, run: Run, args: FinetuneArgs, setup: Setup, model: nn.Module, optimizer: Any,
          trainable_only: bool, collate_fn: Callable[..., tuple[torch.Tensor, ...]] = collate) -> tuple[Progress, Run]:
    """Resume if asked (``resume``), then fit. ``collate_fn(items,
    max_length=...)``: the micro batches of the data's samples (preference pairs: ``collate_pairs``)."""
    data, progress = setup.data, Progress()
    save_filter = resume(fabric, run, args, model, optimizer, progress, trainable_only)
    pad = partial(collate_fn, max_length=run.seq_len)
    train_batches = session.train_batches(fabric, data.train, run, args, progress.step, pad, data.train.lengths)
    val_batches = session.val_batches(fabric, data.val, run, args, pad)
    tokens_per_sample = data.train.target_tokens / len(data.train)
    max_steps = args.max_steps
    if args.max_tokens is not None:
        max_steps = math.ceil(args.max_tokens / (run.global_batch_size * tokens_per_sample))
    if not max_steps or max_steps < 1:
        raise UsageError("Give the run a length: --max_steps N or --max_tokens N.")
    unit = "pairs" if run.preference is not None else "sequences" if run.packing else "samples"
    fabric.print(
        f"Training {max_steps} steps of {run.global_batch_size} {unit} "
        f"(~{tokens_per_sample:.0f} response tokens "
        f"each; micro batch {run.micro_batch_size}, {run.accumulation} accumulation steps, "
        f"{run.world_size} process(es), {run.precision})"
    )
    rehearsal_batch = session.longest_batch(fabric, data.train, run, pad, data.train.lengths)
    return fit(fabric, run, model, optimizer, session.objective(run, optimizer), train_batches, val_batches, args,
               max_steps, progress, out_of_memory_report,
               save_filter=save_filter, rehearsal_batch=rehearsal_batch)


def resume(fabric: Fabric, run: Run, args: FinetuneArgs, model: nn.Module, optimizer: Any, progress: Progress,
           trainable_only: bool) -> Optional[dict[str, Any]]:
    """Resume if asked; returns what the resumable checkpoints hold (``fit``'s ``save_filter``): with
    ``trainable_only`` only the trainable parameters and their optimizer state (the frozen base comes from
    ``--checkpoint_dir``). FSDP saves its sharded checkpoints whole: Fabric cannot load a filtered sharded checkpoint."""
    save_filter, check = None, None
    if trainable_only and not run.parallel.fsdp:
        names = trainable_names(model)
        save_filter = {"model": lambda name, value: _strip_wrappers(name) in names}
        check = partial(check_resumable, model=model, names=names)
    session.resume_if_asked(fabric, args, model, optimizer, progress, run.config, strict=save_filter is None, check=check,
                            base=run.checkpoint_dir)
    return save_filter


def check_resumable(path: Path, model: nn.Module, names: set[str]) -> None:
    """A trainable-only checkpoint (verified) loads non-strictly: check first that it holds exactly these parameters."""
    try:
        saved = torch.load(path / STATE_NAME, map_location="cpu", mmap=True, weights_only=True)["model"]
    except session.LOAD_ERRORS as error:
        raise session.unloadable(path / STATE_NAME, error) from None
    shapes = {n: tuple(p.shape) for n, p in unwrap(model).named_parameters() if n in names}
    found = {_strip_wrappers(n): tuple(t.shape) for n, t in saved.items()}
    if found != shapes:
        raise UsageError(
            f"Checkpoint {path} holds other trainable parameters ({len(found)}) than this run has ({len(shapes)}): it "
            "was written with other LoRA/adapter flags. Resume with the flags of that run, or start over with "
            "--overwrite or a new --out_dir."
        )


def gather_trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole and on the CPU (a collective under FSDP: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    state = {}
    for name, parameter in unwrap(model).named_parameters():
        if parameter.requires_grad:
            tensor = parameter.full_tensor() if isinstance(parameter, DTensor) else parameter
            state[name] = tensor.detach().to("cpu", copy=True)
    return state


def make_trainable(fabric: Fabric, run: Run, model: GPT) -> None:
    """LoRA's adapters (``run.lora``) or LLaMA-Adapter's prefixes (``run.adapter``) on the frozen model, else every
    weight trainable: the preference and GRPO fine-tunes, which take any of them."""
    if run.lora is not None:
        layers = apply_lora(model, run.lora)
        fabric.print(f"LoRA r={run.lora.r} alpha={run.lora.alpha:g} on {len(layers)} layers")
    elif run.adapter is not None:
        add_adapter(fabric, run, model)
    else:
        model.requires_grad_(True)


def add_adapter(fabric: Fabric, run: Run, model: GPT) -> None:
    """LLaMA-Adapter's prefixes and gates, the only trainable parameters: new ones, or those the checkpoint carries
    (a saved adapter continued, ``resolve``)."""
    if any(isinstance(block.attn, AdapterAttention) for block in model.blocks):
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(name.endswith((".adapter_prefix", ".adapter_gate")))
    else:
        apply_adapter(model, run.adapter)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fabric.print(f"Adapter: {run.adapter.prompt_length} prefix vectors in blocks {run.adapter.start_layer}.."
                 f"{run.config.n_layer - 1}: {trainable:,} trainable parameters")


def adapters_off(run: Run) -> str:
    """The reference of a LoRA or adapter run that takes it from the model itself (``lora.adapters_disabled``)."""
    return f"the model with its {'LoRA adapters' if run.lora is not None else 'adapter prefixes'} off"


def save_trained(fabric: Fabric, run: Run, setup: Setup, model: nn.Module, final_dir: Path) -> None:
    """final/ of a ``make_trainable`` model: LoRA's merged into the base weights; the untouched base weights with the
    LLaMA-Adapter beside them (what generate and evaluate load); else the whole model."""
    if run.trainable == "full":
        save_final(fabric, model, run.config, final_dir, setup.checkpoint_dir, write_extra=setup.style.save)
        return
    adapter_weights = gather_trainable(model)  # a collective under FSDP: every rank
    if fabric.global_rank == 0 and run.lora is not None:  # merged from the full-precision base weights
        save_merged_checkpoint(setup.checkpoint_dir, adapter_weights, run.lora, final_dir, setup.style.save,
                               DERIVED_FILES, overwrite=True)  # this run's own final/ (check_out_dir)
    elif fabric.global_rank == 0:
        derive_checkpoint_dir(setup.checkpoint_dir, final_dir, None,
                              partial(write_adapter, adapter_weights, run.adapter, setup.style), DERIVED_FILES,
                              overwrite=True)  # this run's own final/ (check_out_dir)
    fabric.barrier()


def write_adapter(weights: dict[str, torch.Tensor], adapter: AdapterConfig, style: PromptStyle, directory: Path
                  ) -> None:
    """The adapter's files in a checkpoint directory of the base weights: its prefixes and gates, its config and the
    prompt style."""
    save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / ADAPTER_WEIGHTS))
    adapter.save(directory)
    style.save(directory)


def finish(fabric: Fabric, run: Run, args: FinetuneArgs, setup: Setup, progress: Progress, final_dir: Path) -> None:
    """Summary, an answer to the fixed validation instruction from the saved model, and where things are."""
    what = run.trainable if run.quantize is None or run.trainable != "lora" else f"qlora ({run.quantize})"
    what += " + DoRA" if run.lora is not None and run.lora.dora else ""
    what = f"{run.preference.loss} ({what})" if run.preference is not None else what
    what = f"grpo ({what})" if run.grpo is not None else what
    answer = common.sample_text(fabric, final_dir, setup.tokenizer, setup.data.sample_instruction, max_new_tokens=100)
    # after the sample: peak_memory_bytes is the whole process's peak (the sample reloads the model in fp32)
    # GRPO: where the time went, rollouts or training (the same tokens over each phase's seconds)
    phases = (rollout_rates(progress.rollout_tokens, progress.rollout_seconds, progress.train_seconds)
              if run.grpo is not None else {})
    summary = write_summary(fabric, run, progress, args, {"final_dir": str(final_dir), "method": what, **setup.padding,
                                                          **phases})
    phase_text = (f" | rollouts {phases['rollout_tokens_per_sec']:,.0f} tok/s ({phases['rollout_seconds']:.1f} s), "
                  f"training {phases['train_tokens_per_sec']:,.0f} tok/s ({phases['train_seconds']:.1f} s) of "
                  f"{phases['rollout_tokens']:,} prompt + completion tokens" if phases else "")
    fabric.print(
        f"\nValidation loss {summary['val_loss']:.3f} | {summary['tokens_per_sec']:,.0f} tok/s{phase_text} | peak memory "
        f"{format_bytes(summary['peak_memory_bytes'])}\n"
        f"Saved {final_dir} (generate: python generate/base.py --checkpoint_dir {final_dir}), metrics in "
        f"{args.out_dir / 'metrics.csv'}, summary in {args.out_dir / 'summary.json'}\n"
        f"Validation instruction:\n{setup.data.sample_instruction}\nGenerated answer:\n{answer}"
    )

