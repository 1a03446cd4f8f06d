"""What the TRL peers of vs_peers.py (_trl_dpo_peer.py, _trl_grpo_peer.py) share: their common flags, the base model
and LoRA as a TRL user loads them, the Trainer settings that match lit-model's run (no autocast, no gradient
checkpointing, linear warmup then cosine to --min_lr, AdamW with betas (0.9, 0.95), no clipping, no saving or
evaluating while timed), and the run with its parameter count printed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def peer_parser(description: str, out_dir: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--base_dir", required=True)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--min_lr", type=float, default=1e-4)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--grad_clip", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lora_alpha", type=float, default=16)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--lora_targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    parser.add_argument("--out_dir", default=out_dir)
    return parser


def load_base(args: argparse.Namespace) -> tuple[Any, Any, Any, Any]:
    """The seeded base model (bf16-true: created in bfloat16), its tokenizer (eos as padding) and a LoRA config."""
    import torch
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    set_seed(args.seed)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.base_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.base_dir, dtype=dtype)
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                      target_modules=args.lora_targets.split(","))
    return dtype, tokenizer, model, lora


def trainer_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainingArguments both configs (DPOConfig, GRPOConfig) get."""
    return dict(output_dir=args.out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False,
                gradient_accumulation_steps=1, max_steps=args.steps, learning_rate=args.learning_rate,
                lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr": args.min_lr},
                warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, adam_beta1=0.9, adam_beta2=0.95,
                max_grad_norm=args.grad_clip, seed=args.seed, logging_steps=1, dataloader_num_workers=0,
                save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True)


def train(trainer: Any, args: argparse.Namespace, dtype: Any) -> None:
    print(f"Model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters "
          f"({sum(p.numel() for p in trainer.model.parameters() if p.requires_grad):,} trainable), {dtype}", flush=True)
    trainer.train()
    trainer.save_model(str(Path(args.out_dir) / "final"))
