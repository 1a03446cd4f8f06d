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

import importlib.util
from pathlib import Path

from _trl_common import load_base, peer_parser, train, trainer_settings

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = peer_parser(__doc__.split("\n")[0], "out/trl-grpo")
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--prompts_per_step", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()

    from datasets import load_dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    spec = importlib.util.spec_from_file_location("_grpo_reward", HERE / "_grpo_reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    dtype, tokenizer, model, lora = load_base(args)
    prompts = load_dataset("json", data_files=args.data_path, split="train")

    class StepStamps(TrainerCallback):
        seen = 0

        def on_step_end(self, arguments, state, control, **kwargs):
            print(f"trl-step {state.global_step} tokens {state.num_input_tokens_seen - self.seen}", flush=True)
            self.seen = state.num_input_tokens_seen

    config = GRPOConfig(**trainer_settings(args), use_vllm=False, num_generations=args.num_generations,
                        max_completion_length=args.max_new_tokens, temperature=args.temperature, beta=0.0,
                        loss_type="dapo", per_device_train_batch_size=args.prompts_per_step * args.num_generations)
    trainer = GRPOTrainer(model=model, reward_funcs=reward.distinct, args=config, train_dataset=prompts,
                          processing_class=tokenizer, peft_config=lora, callbacks=[StepStamps()])
    train(trainer, args, dtype)


if __name__ == "__main__":
    main()
