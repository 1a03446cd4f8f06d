"""Chat with a checkpoint's model in its family's prompt style; the conversation stays in the KV cache.

    python generate/chat.py --model_name Qwen/Qwen2.5-0.5B-Instruct   # after lit-model download Qwen/Qwen2.5-0.5B-Instruct
    printf 'Hi!\\nAnd then?\\n/exit\\n' | python generate/chat.py --checkpoint_dir DIR   # reads lines until EOF

Type /reset to start a new conversation and /exit (or end the input) to quit.
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.chat import ChatArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/chat.py)

if __name__ == "__main__":
    cli()
