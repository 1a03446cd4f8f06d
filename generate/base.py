"""Continue a prompt with a checkpoint's model: the text streams to stdout, a speed/memory line to stderr.

    python generate/base.py --checkpoint_dir out/pretrain/final --prompt "def fib(n):"
    python generate/base.py --model_name meta-llama/Llama-3.2-1B --quantize bnb.nf4 --num_samples 3
    python generate/base.py --model_name Llama-2-7b-hf --device_memory 8GB --plan text   # will it fit?
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.generate import BaseArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/generate.py)

if __name__ == "__main__":
    cli()
