"""Serve a checkpoint's model with OpenAI's API (chat and text completions, streaming), through LitServe: continuous
batching over a paged KV cache.

    python serve/main.py --checkpoint_dir out/lora/final --port 8000
    python serve/main.py --checkpoint_dir DIR --adapters sql=out/lora-sql/final --kv_cache_dtype int8
    python serve/main.py --checkpoint_dir DIR --kv_cache_memory 8GB --plan text   # how many sequences fit?
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.serve import ServeArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/serve.py)

if __name__ == "__main__":
    cli()
