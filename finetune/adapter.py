"""Fine-tune with a LLaMA-Adapter prefix (frozen base, learned gated prefixes in the upper blocks):
setup -> fit -> save the base weights with the adapter beside them.

    python finetune/adapter.py                                # out/pretrain/final on stdlib instructions
    python finetune/adapter.py --quantize bnb.nf4             # the frozen base weights in 4 bits
    python finetune/adapter.py --config config_hub/finetune/llama-3.2-1b/adapter.yaml --checkpoint_dir DIR
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.finetune_adapter import AdapterArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/finetune_adapter.py)

if __name__ == "__main__":
    cli()
