"""Preference fine-tuning (DPO, IPO, SimPO, ORPO; LoRA, QLoRA, LLaMA-Adapter or every weight): setup -> fit -> save.

    python finetune/dpo.py --data_path pairs.jsonl                      # LoRA-DPO: the reference is the base
    python finetune/dpo.py --data ultrafeedback --method adapter        # a named hub set; LLaMA-Adapter
    python finetune/dpo.py --data_path pairs.jsonl --method full        # the reference's log-probabilities once
    python finetune/dpo.py --data_path pairs.jsonl --loss simpo --beta 2.0
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.finetune_dpo import DPOArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/finetune_dpo.py)

if __name__ == "__main__":
    cli()
