"""The TRL peer of vs_peers.py's DPO rows: what a TRL user writes to DPO-fine-tune a small Llama on the CPU, with LoRA
or every weight.

    _trl_dpo_peer.py --base_dir DIR --data_path PAIRS.jsonl --block N --precision 32-true --method lora ...

`load_dataset("json")` on {"prompt", "chosen", "rejected"} string records, the prompt written in the alpaca template
(without input, as lit-model's --prompt_style alpaca writes a pair's string prompt) and each completion ended as
that template ends a response; `AutoModelForCausalLM` from the base (bf16-true: created in bfloat16), peft's
`LoraConfig` handed to `DPOTrainer`, which then takes the base with the adapters disabled as the reference (no
second model); --method full: no peft config and no `ref_model`, so DPOTrainer loads a second copy of the model from
the same directory as the reference (its default), run forward every step (`precompute_ref_log_probs` False). DPOConfig's defaults that differ from lit-model's run are set to lit-model's: no autocast (`bf16`
is True by default: autocast over the model's dtype), no gradient checkpointing (on by default), dropout kept (the
LoRA dropout; TRL's default zeroes every dropout), no gradient clipping. The learning rate: linear warmup, then
cosine to --min_lr (`cosine_with_min_lr`), AdamW (the Trainer's default optimizer) with betas (0.9, 0.95).

For the benchmark, a callback prints ``trl-step N`` after each optimizer step, which vs_peers.py time-stamps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# lit-model's alpaca template for an instruction without input, and what it ends a response with
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_END = "\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base_dir", required=True)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--method", default="lora", choices=["lora", "full"])
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--min_lr", type=float, default=1e-4)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--weight_decay", type=float, default=0.0)
    parser.add_argument("--grad_clip", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lora_alpha", type=float, default=16)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--lora_targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    parser.add_argument("--out_dir", default="out/trl")
    args = parser.parse_args()

    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import DPOConfig, DPOTrainer

    set_seed(args.seed)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.base_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.base_dir, dtype=dtype)
    pairs = load_dataset("json", data_files=args.data_path, split="train")
    pairs = pairs.map(lambda r: {"prompt": ALPACA_NO_INPUT.format(instruction=r["prompt"]),
                                 "chosen": r["chosen"] + ALPACA_END, "rejected": r["rejected"] + ALPACA_END})
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                      target_modules=args.lora_targets.split(","))

    class StepStamps(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            print(f"trl-step {state.global_step}", flush=True)

    config = DPOConfig(
        output_dir=args.out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, disable_dropout=False,
        beta=args.beta, loss_type="sigmoid", precompute_ref_log_probs=False, max_length=args.block,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=1, max_steps=args.steps,
        learning_rate=args.learning_rate, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_lr}, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=args.grad_clip, seed=args.seed, logging_steps=1,
        dataloader_num_workers=0, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
    )
    trainer = DPOTrainer(model=model, args=config, train_dataset=pairs, processing_class=tokenizer,
                         peft_config=lora if args.method == "lora" else None,
                         callbacks=[StepStamps()])
    print(f"Model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters "
          f"({sum(p.numel() for p in trainer.model.parameters() if p.requires_grad):,} trainable), {dtype}", flush=True)
    trainer.train()
    trainer.save_model(str(Path(args.out_dir) / "final"))


if __name__ == "__main__":
    main()
