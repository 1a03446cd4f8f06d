"""Fine-tune with LoRA (QLoRA with --quantize): setup -> fit -> save merged weights + the adapter.

    python finetune/lora.py                                   # out/pretrain/final on stdlib instructions
    python finetune/lora.py --quantize bnb.nf4                # QLoRA: frozen base weights in 4 bits
    python finetune/lora.py --config config_hub/finetune/llama-3.2-1b/lora.yaml --checkpoint_dir DIR
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.finetune_lora import LoRAArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/finetune_lora.py)

if __name__ == "__main__":
    cli()
