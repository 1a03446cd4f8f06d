"""Fine-tune every weight of a checkpoint on instruction data: setup -> fit -> save.

    python finetune/full.py                                   # out/pretrain/final on stdlib instructions
    python finetune/full.py --freeze_layers 2                 # keep the embedding and the first 2 blocks frozen
    python finetune/full.py --config config_hub/finetune/llama-3.2-1b/full.yaml --checkpoint_dir DIR
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.finetune_full import FullArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/finetune_full.py)

if __name__ == "__main__":
    cli()
