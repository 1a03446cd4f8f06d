"""Preference fine-tuning (DPO, IPO, SimPO, ORPO) on pairs of a chosen and a rejected completion: setup -> the
reference's log-probabilities (once, when the loss needs them and no adapters give them) -> fit -> save.

    python finetune/dpo.py --data_path pairs.jsonl                      # LoRA-DPO: the reference is the base
    python finetune/dpo.py --data ultrafeedback                         # a named hub set of pairs
    python finetune/dpo.py --data_path pairs.jsonl --quantize bnb.nf4   # QLoRA-DPO
    python finetune/dpo.py --data_path pairs.jsonl --method adapter     # LLaMA-Adapter prefixes
    python finetune/dpo.py --data_path pairs.jsonl --method full        # every weight; the reference computed once
    python finetune/dpo.py --data_path pairs.jsonl --loss simpo --beta 2.0   # reference-free
    python finetune/dpo.py --data_path pairs.jsonl --packing true       # each micro batch's rows packed

The reference costs no second model during training: with LoRA or LLaMA-Adapter it is the model with its adapters
off; for full fine-tuning (or with --reference_model, or continuing a saved adapter, whose prefixes the reference
keeps) its per-pair log-probabilities are computed before training, a batch at a time, and cached under
$LIT_MODEL_CACHE keyed by the reference's weights and the data's tokens (checked on every read, rebuilt when it
does not match).
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal, Optional, Union

import numpy as np
import torch
from lightning.fabric import Fabric

from lit_model.core.errors import UsageError, UserError, run_cli
from lit_model.data.cache import cache_root, cached, checked_record, checkpoint_digest
from lit_model.data.instruct import padding_fraction
from lit_model.data.preference import (PAIR_EXAMPLE, PreferenceData, PreferenceDataset, collate_pairs,
                                      load_preference_data)
from lit_model.infer.load import load_model as load_checkpoint_model
from lit_model.io.checkpoint import check_checkpoint_dir
from lit_model.io.prompts import PromptStyle
from lit_model.io.tokenizer import Tokenizer
from lit_model.methods.preference import reference_log_probs
from lit_model.recipes import common, finetune
from lit_model.data.sources import parse_fields
from lit_model.recipes.cli import parse
from lit_model.recipes.finetune_adapter import AdapterArgs
from lit_model.recipes.finetune_lora import LoRAArgs
from lit_model.run import Run
from lit_model.train import session
from lit_model.train.args import check_args

REFERENCE_CACHE = "reference"  # under cache_root(): one file of float32 (pairs, 2) per reference and data


@dataclass
class DPOArgs(LoRAArgs, AdapterArgs):
    """Fine-tune a checkpoint on preference pairs with DPO, IPO, SimPO or ORPO (LoRA, QLoRA, LLaMA-Adapter or every
    weight).

    Args:
        data_path: .json/.jsonl/.parquet/.csv preference records, TRL's formats: {"prompt", "chosen", "rejected"}
            strings, or chat messages (a "prompt" list of messages and "chosen"/"rejected" assistant messages, or
            whole conversations sharing their first messages)
        data: a named hub dataset of preference pairs instead of --data_path: ultrafeedback, hh-rlhf, orca_dpo
            (downloaded once into the datasets cache; needs `pip install datasets`)
        data_fields: map the data's field names to ours, OURS=THEIRS pairs: e.g. prompt=question (ours: prompt,
            chosen, rejected)
        method: lora (with --quantize: QLoRA), adapter (LLaMA-Adapter, as finetune/adapter.py; with --quantize the
            base in low precision) or full (every weight)
        loss: dpo (Rafailov et al. 2023), ipo (Azar et al. 2023), simpo (Meng et al. 2024; reference-free) or orpo
            (Hong et al. 2024; reference-free, adds the chosen completion's NLL)
        beta: the loss's temperature: DPO's and IPO's regularisation towards the reference (TRL's default 0.1),
            SimPO's reward scale (2.0-2.5 in its paper), ORPO's weight of the odds-ratio term (0.1)
        simpo_gamma: SimPO's target reward margin
        reference_model: checkpoint whose log-probabilities are DPO's/IPO's reference, computed once before
            training (default: with LoRA or an adapter the base model with its adapters off; for full fine-tuning,
            or continuing a saved adapter, the starting checkpoint)
        packing: pack each micro batch's chosen and rejected rows into rows of up to the run's sequence length,
            each attending only to itself with its positions from 0: the same log-probabilities, losses and rewards,
            less padding computed; --global_batch_size and --micro_batch_size still count pairs
    """

    data_kind: ClassVar[str] = "preference"  # what --data may name
    out_dir: Path = Path("out/finetune/dpo")
    method: Literal["lora", "adapter", "full"] = "lora"
    loss: Literal["dpo", "ipo", "simpo", "orpo"] = "dpo"
    beta: float = 0.1
    simpo_gamma: float = 0.5
    reference_model: Optional[Path] = None
    micro_batch_size: Union[int, Literal["auto"]] = 2
    global_batch_size: int = 8
    learning_rate: float = 5e-5
    min_lr: float = 5e-6


def main(args: DPOArgs) -> None:
    check_args(args)
    finetune.check_own_data(args, "finetune/dpo.py", "preference pairs", PAIR_EXAMPLE)
    if args.reference_model is not None and args.plan is None:
        check_checkpoint_dir(args.reference_model)
    has_data = args.data_path is not None or args.data is not None
    run = finetune.resolve(args, args.method, read_pairs if has_data else None)
    common.plan_or_train(run, args, train)


def read_pairs(run: Run, args: DPOArgs, tokenizer: Any, style: PromptStyle) -> PreferenceData:
    return load_preference_data(args.data_path, tokenizer, style, run.seq_len, args.val_split_fraction,
                                data=args.data, fields=parse_fields(args.data_fields, "preference"))


def prepare(fabric: Fabric, run: Run, args: DPOArgs) -> tuple[Run, finetune.Setup]:
    """The tokenizer, the pairs and the micro batch (``auto``), with the reference's log-probabilities where the loss
    takes them precomputed."""
    tokenizer, style = Tokenizer(run.checkpoint_dir), finetune.prompt_style(run, args)
    data = read_pairs(run, args, tokenizer, style)
    if args.sample_instruction is not None:
        data.sample_instruction = style.apply(args.sample_instruction)
    fabric.print(f"Data: {data.description}")
    run = finetune.choose_for_data(fabric, run, args, data)
    steps = min(args.max_steps or 1, math.ceil(len(data.train) / run.global_batch_size))  # at most an epoch
    fractions = [padding_fraction(data.train.lengths, run.global_batch_size, run.micro_batch_size, steps, run.seq_len,
                                  args.seed, partial(data.train.batch_tokens, max_length=run.seq_len, packed=packed))
                 for packed in (False, True)]
    padding = finetune.padding_summary(fabric, run, fractions, f"each micro batch's {2 * run.micro_batch_size} rows "
                                                               f"in rows of up to {run.seq_len} tokens")
    if run.preference.reference == "precomputed":
        reference = args.reference_model or run.checkpoint_dir
        data.train = data.train.with_reference(reference_values(fabric, run, reference, data.train, "train"))
        data.val = data.val.with_reference(reference_values(fabric, run, reference, data.val, "validation"))
    return run, finetune.Setup(run.checkpoint_dir, tokenizer, style, data, padding)


def reference_key(run: Run, reference: Path, dataset: PreferenceDataset) -> str:
    """What the reference's log-probabilities depend on: its weights (its manifest's checksums, else the weights'
    own), the pairs' tokens, the dtypes they are computed in, the loss chunk and the packing (summation order)."""
    identity = {"weights": checkpoint_digest(reference), "pairs": dataset.digest(), "precision": run.precision,
                "chunk": run.loss_chunk_size, "packing": run.seq_len if run.packing else None, "format": 1}
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:40]


def reference_values(fabric: Fabric, run: Run, reference: Path, dataset: PreferenceDataset, split: str) -> torch.Tensor:
    """The reference's summed log-probabilities (pairs, 2) of ``dataset``'s completions: from the cache when it holds
    them (size and checksum verified against its record, and every value finite), else computed now on this device
    by the reference model (loaded, used and freed before the policy is loaded) and cached."""
    path = cache_root() / REFERENCE_CACHE / f"{reference_key(run, reference, dataset)}.f32"
    pairs = len(dataset)
    values = _read_reference(path, pairs)
    if values is not None:
        fabric.print(f"Reference log-probabilities of the {pairs} {split} pairs: from the cache {path}")
        return values

    def build(write) -> dict[str, int]:
        computed = compute_reference(fabric, run, reference, dataset, split)
        write(computed.numpy().astype("<f4").tobytes())
        return {"pairs": pairs}

    cached(path, build, valid=lambda record: record.get("pairs") == pairs)
    values = _read_reference(path, pairs)
    if values is None:
        raise UserError(f"The reference log-probabilities just written to {path} do not read back as {pairs} pairs of "
                        "finite values: the reference model gives non-finite log-probabilities (a damaged checkpoint, "
                        "or --precision 16-true overflowing). Check --reference_model / --checkpoint_dir, or use "
                        "--precision bf16-true or 32-true.")
    return values


def _read_reference(path: Path, pairs: int) -> Optional[torch.Tensor]:
    """The cache file's values when it matches its record and holds ``pairs`` pairs of finite values, else None."""
    record, _ = checked_record(path, lambda record: record.get("pairs") == pairs)
    if record is None or path.stat().st_size != pairs * 2 * 4:
        return None
    values = torch.from_numpy(np.fromfile(path, dtype="<f4").reshape(pairs, 2).astype(np.float32))
    return values if bool(torch.isfinite(values).all()) else None


def compute_reference(fabric: Fabric, run: Run, reference: Path, dataset: PreferenceDataset, split: str) -> torch.Tensor:
    """The reference model's log-probabilities of every pair, ``run.eval_batch`` pairs at a time (packed as training
    packs them), in the run's dtype."""
    fabric.print(f"Computing the reference's log-probabilities of the {len(dataset)} {split} pairs with {reference} ...",
                 flush=True)
    model = load_checkpoint_model(reference, [fabric.device], run.param_dtype, max_seq_length=run.seq_len)
    if model.config.padded_vocab_size != run.config.padded_vocab_size:
        raise UsageError(f"--reference_model {reference} has a vocabulary of {model.config.padded_vocab_size} tokens, "
                         f"the trained model {run.config.padded_vocab_size}: the reference must share its tokenizer.")
    pad = partial(collate_pairs, max_length=run.seq_len)
    batches = (tuple(part.to(fabric.device) for part in pad([dataset[i] for i in range(start, min(start + run.eval_batch, len(dataset)))]))
               for start in range(0, len(dataset), run.eval_batch))
    with fabric.autocast():
        values = reference_log_probs(model, batches, run.loss_chunk_size, run.seq_len if run.packing else None)
    del model
    gc.collect()
    return values


def train(fabric: Fabric, run: Run, args: DPOArgs) -> None:
    run, setup = prepare(fabric, run, args)
    fabric.seed_everything(args.seed)  # the same adapter initialisation on every rank
    model = finetune.load_model(fabric, run, setup)
    spec = run.preference
    finetune.make_trainable(fabric, run, model)
    reference = {"adapters": finetune.adapters_off(run), "none": "none (a reference-free loss)",
                 "precomputed": f"{args.reference_model or setup.checkpoint_dir}, computed once"}[spec.reference]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fabric.print(f"{spec.loss.upper()} beta={spec.beta:g}: {trainable:,} trainable parameters; reference: {reference}")
    model, optimizer = session.setup_model_and_optimizer(fabric, model, run, args)
    progress, run = finetune.train(fabric, run, args, setup, model, optimizer, trainable_only=run.trainable != "full",
                                   collate_fn=collate_pairs)
    if progress.stopped:  # saved and summarized by fit: no final/, no answer
        return

    final_dir = args.out_dir / "final"
    finetune.save_trained(fabric, run, setup, model, final_dir)
    del model, optimizer  # the sample reloads final/: the trained copy and the optimizer state go first
    finetune.finish(fabric, run, args, setup, progress, final_dir)


def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> DPOArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(DPOArgs, sys.argv[1:] if argv is None else list(argv), prog)))

