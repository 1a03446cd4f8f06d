"""GRPO fine-tuning on prompts and rewards (LoRA, QLoRA, LLaMA-Adapter or every weight): setup -> fit (rollouts +
training) -> save.

    python finetune/grpo.py --data_path prompts.jsonl                          # LoRA; exact match with "answer"
    python finetune/grpo.py --data_path prompts.jsonl --reward rewards.py:correct --reward length \
        --reward_weights '[1.0, -0.01]'
    python finetune/grpo.py --data gsm8k --method adapter                    # a named hub set; LLaMA-Adapter
    python finetune/grpo.py --data_path prompts.jsonl --method full
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.finetune_grpo import GRPOArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/finetune_grpo.py)

if __name__ == "__main__":
    cli()
