"""The Hugging Face peer of vs_peers.py: what a transformers user writes to pretrain or LoRA-fine-tune a small Llama
on the CPU, with `Trainer`:

    _hf_trainer_peer.py prepare  --corpus DIR --tokenizer_dir DIR --block N        # fill the datasets cache
    _hf_trainer_peer.py pretrain --config_dir DIR --corpus DIR --tokenizer_dir DIR --block N ...
    _hf_trainer_peer.py lora     --base_dir DIR --data_path FILE.json --block N ...

Pretraining follows transformers' run_clm.py example: `load_dataset("text")` on the corpus files (line breaks
kept), tokenize, concatenate and cut into blocks of N tokens (`datasets` caches both maps, so `prepare` makes the
timed runs find them done), `LlamaForCausalLM` from the config, `Trainer`. LoRA: peft's `get_peft_model` on the base
(alpaca prompts, loss on the response only, batches padded to their longest sample). Precision: 32-true is fp32;
bf16-true creates the model in bfloat16 (`dtype=torch.bfloat16`), as HF users train in bf16 on a CPU (the
`bf16=True` flag is autocast over fp32 weights, the other thing). The learning rate: linear warmup, then cosine
to --min_lr (`cosine_with_min_lr`), AdamW (Trainer's default optimizer) with betas (0.9, 0.95).

For the benchmark, a callback prints ``hf-step N`` after each optimizer step, which vs_peers.py time-stamps; the
Trainer logs its own metrics every step besides.
"""

from __future__ import annotations

import argparse
import json
from itertools import chain
from pathlib import Path

ALPACA = ("Below is an instruction that describes a task, paired with an input that provides further context. "
          "Write a response that appropriately completes the request.\n\n"
          "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")


def clm_dataset(corpus: str, tokenizer_dir: str, block: int):
    """run_clm.py's pipeline: text lines -> token ids -> concatenated and cut into blocks (labels = inputs)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    files = sorted(str(p) for p in Path(corpus).glob("*.txt"))
    raw = load_dataset("text", data_files={"train": files}, keep_linebreaks=True)["train"]
    tokenized = raw.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

    def group_texts(examples):
        joined = {k: list(chain(*examples[k])) for k in examples}
        total = len(joined["input_ids"]) // block * block
        result = {k: [t[i:i + block] for i in range(0, total, block)] for k, t in joined.items()}
        result["labels"] = result["input_ids"].copy()
        return result

    return tokenized.map(group_texts, batched=True, batch_size=1000)


def instruct_dataset(data_path: str, tokenizer, block: int):
    from datasets import Dataset

    records = json.loads(Path(data_path).read_text())

    def encode(record):
        prompt = tokenizer(ALPACA.format(**record))["input_ids"]
        answer = tokenizer(record["output"])["input_ids"] + [tokenizer.eos_token_id]
        ids = (prompt + answer)[:block]
        return {"input_ids": ids, "attention_mask": [1] * len(ids),
                "labels": ([-100] * len(prompt) + answer)[:block]}

    return Dataset.from_list(records).map(encode, remove_columns=["instruction", "input", "output"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("kind", choices=["prepare", "pretrain", "lora"])
    parser.add_argument("--corpus")
    parser.add_argument("--tokenizer_dir")
    parser.add_argument("--config_dir")
    parser.add_argument("--base_dir")
    parser.add_argument("--data_path")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--micro_batch_size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--min_lr", type=float, default=3e-4)
    parser.add_argument("--warmup_steps", type=int, default=10)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--lora_r", type=int, default=8)
    parser.add_argument("--lora_alpha", type=float, default=16)
    parser.add_argument("--lora_dropout", type=float, default=0.05)
    parser.add_argument("--lora_targets", default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj")
    parser.add_argument("--out_dir", default="out/hf")
    args = parser.parse_args()
    if args.kind == "prepare":
        clm_dataset(args.corpus, args.tokenizer_dir, args.block)
        return

    import torch
    from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq,
                              Trainer, TrainerCallback, TrainingArguments, default_data_collator, set_seed)

    set_seed(args.seed)
    dtype = torch.bfloat16 if args.precision == "bf16-true" else torch.float32
    if args.kind == "pretrain":
        config = AutoConfig.from_pretrained(args.config_dir)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        train_dataset, collator = clm_dataset(args.corpus, args.tokenizer_dir, args.block), default_data_collator
    else:
        from peft import LoraConfig, get_peft_model

        tokenizer = AutoTokenizer.from_pretrained(args.base_dir)
        tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.base_dir, dtype=dtype)
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha,
                                                 lora_dropout=args.lora_dropout, task_type="CAUSAL_LM",
                                                 target_modules=args.lora_targets.split(",")))
        train_dataset = instruct_dataset(args.data_path, tokenizer, args.block)
        collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    print(f"Model: {sum(p.numel() for p in model.parameters()):,} parameters "
          f"({sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable), {dtype}", flush=True)

    class StepStamps(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            print(f"hf-step {state.global_step}", flush=True)

    training_args = TrainingArguments(
        output_dir=args.out_dir, use_cpu=True, max_steps=args.steps,
        per_device_train_batch_size=args.micro_batch_size, gradient_accumulation_steps=1,
        learning_rate=args.learning_rate, lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_lr}, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=args.grad_clip, seed=args.seed, logging_steps=1,
        save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=train_dataset, data_collator=collator,
                      callbacks=[StepStamps()])
    trainer.train()
    trainer.save_model(str(Path(args.out_dir) / "final"))


if __name__ == "__main__":
    main()
