"""The TRL peer of vs_peers.py's GRPO rows: what a TRL user writes to GRPO-fine-tune a small Llama with LoRA on the
CPU, generating with transformers (``use_vllm=False``, TRL's default).

    _trl_grpo_peer.py --base_dir DIR --data_path PROMPTS.jsonl --precision 32-true ...

`load_dataset("json")` on {"prompt"} string records (already in the alpaca template: lit-model reads the same file
with --prompt_style default, which leaves a prompt as it is); `AutoModelForCausalLM` from the base (bf16-true:
created in bfloat16); peft's `LoraConfig` handed to `GRPOTrainer`; the reward: benchmarks/_grpo_reward.py's
``distinct``, the file lit-model's --reward loads. GRPOConfig's defaults are kept where lit-model's are the same (DAPO
loss, group-scaled rewards, beta 0 so no reference, epsilon 0.2 both ways, one iteration, top_p 1, no top_k) and
set to lit-model's run where they differ: no autocast (`bf16` is True by default), no gradient checkpointing (on by
default), G completions of at most --max_new_tokens, one step's completions in one micro batch (per-device batch =
prompts x G, no accumulation: TRL generates them in one `generate` call), the learning rate (linear warmup, then
cosine to --min_lr), AdamW with betas (0.9, 0.95), no gradient clipping.

For the benchmark, a callback prints ``trl-step N tokens T`` after each optimizer step: T is what the step's rollouts
added to TRL's own count of prompt + completion tokens (``state.num_input_tokens_seen``, which GRPOTrainer raises by
the prompts' tokens and the completions' up to and including their eos), which vs_peers.py time-stamps.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base_dir", required=True)
    parser.add_argument("--data_path", required=True)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--prompts_per_step", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
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
    parser.add_argument("--out_dir", default="out/trl-grpo")
    args = parser.parse_args()

    import torch
    from datasets import load_dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("_grpo_reward", HERE / "_grpo_reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)

    set_seed(args.seed)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(args.base_dir)
    tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.base_dir, dtype=dtype)
    prompts = load_dataset("json", data_files=args.data_path, split="train")
    lora = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                      target_modules=args.lora_targets.split(","))

    class StepStamps(TrainerCallback):
        seen = 0

        def on_step_end(self, arguments, state, control, **kwargs):
            print(f"trl-step {state.global_step} tokens {state.num_input_tokens_seen - self.seen}", flush=True)
            self.seen = state.num_input_tokens_seen

    config = GRPOConfig(
        output_dir=args.out_dir, use_cpu=True, bf16=False, gradient_checkpointing=False, use_vllm=False,
        num_generations=args.num_generations, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, beta=0.0, loss_type="dapo",
        per_device_train_batch_size=args.prompts_per_step * args.num_generations, gradient_accumulation_steps=1,
        max_steps=args.steps, learning_rate=args.learning_rate, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_lr}, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=args.grad_clip, seed=args.seed, logging_steps=1,
        dataloader_num_workers=0, save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward.distinct, args=config, train_dataset=prompts,
                          processing_class=tokenizer, peft_config=lora, callbacks=[StepStamps()])
    print(f"Model: {sum(p.numel() for p in trainer.model.parameters()):,} parameters "
          f"({sum(p.numel() for p in trainer.model.parameters() if p.requires_grad):,} trainable), {dtype}", flush=True)
    trainer.train()
    trainer.save_model(str(Path(args.out_dir) / "final"))


if __name__ == "__main__":
    main()
