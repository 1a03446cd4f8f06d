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

from _trl_common import load_base, peer_parser, train, trainer_settings

# lit-model's alpaca template for an instruction without input, and what it ends a response with
ALPACA_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
                   "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
ALPACA_END = "\n\n"


def main() -> None:
    parser = peer_parser(__doc__.split("\n")[0], "out/trl")
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--method", default="lora", choices=["lora", "full"])
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--beta", type=float, default=0.1)
    args = parser.parse_args()

    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import DPOConfig, DPOTrainer

    dtype, tokenizer, model, lora = load_base(args)
    pairs = load_dataset("json", data_files=args.data_path, split="train")
    pairs = pairs.map(lambda r: {"prompt": ALPACA_NO_INPUT.format(instruction=r["prompt"]),
                                 "chosen": r["chosen"] + ALPACA_END, "rejected": r["rejected"] + ALPACA_END})

    class StepStamps(TrainerCallback):
        def on_step_end(self, arguments, state, control, **kwargs):
            print(f"trl-step {state.global_step}", flush=True)

    config = DPOConfig(**trainer_settings(args), disable_dropout=False, beta=args.beta, loss_type="sigmoid",
                       precompute_ref_log_probs=False, max_length=args.block,
                       per_device_train_batch_size=args.micro_batch_size)
    trainer = DPOTrainer(model=model, args=config, train_dataset=pairs, processing_class=tokenizer,
                         peft_config=lora if args.method == "lora" else None, callbacks=[StepStamps()])
    train(trainer, args, dtype)


if __name__ == "__main__":
    main()
