"""``python -m lit_model.config``: every known model name (the registry lives in lit_model.core.config)."""

import sys

from lit_model.core.config import cli
from lit_model.core.errors import run_cli

if __name__ == "__main__":
    run_cli(cli, sys.argv[1:])
