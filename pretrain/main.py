"""Pretrain a GPT from scratch: setup -> fit -> save.

    python pretrain/main.py                       # the tiny default on the Python standard library
    python pretrain/main.py --devices 4           # 4 processes (GPUs, or CPU processes with gloo)
    python pretrain/main.py --config config_hub/pretrain/tinyllama.yaml
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.pretrain import PretrainArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/pretrain.py)

if __name__ == "__main__":
    cli()
