"""Score a checkpoint on lm-evaluation-harness tasks: results.json and a table under --out_dir (CHECKPOINT_DIR/eval).

    python evaluate/main.py --checkpoint_dir out/lora/final --tasks hellaswag,arc_easy --limit 100
    python evaluate/main.py --checkpoint_dir DIR --tasks my_task.yaml --num_fewshot 5 --batch_size auto
    python evaluate/main.py --checkpoint_dir DIR --batch_size 32 --device_memory 24GB --plan text   # will it fit?
"""

import signal

signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C during the imports: a quiet exit, no traceback (run_cli then takes over)

from lit_model.recipes.evaluate import EvaluateArgs, cli, main  # noqa: E402,F401  (the recipe: lit_model/recipes/evaluate.py)

if __name__ == "__main__":
    cli()
