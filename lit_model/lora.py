"""``python -m lit_model.lora merge --checkpoint_dir DIR``: merge a LoRA adapter into its base weights (the method
lives in lit_model.methods.lora)."""

import sys

from lit_model.core.errors import run_cli
from lit_model.methods.lora import cli

if __name__ == "__main__":
    run_cli(cli, sys.argv[1:])
