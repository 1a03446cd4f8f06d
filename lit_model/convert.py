"""``python -m lit_model.convert hf_to_lit | lit_to_hf [flags]``: the command line of lit_model.io.convert.

    python -m lit_model.convert hf_to_lit --hf_dir DIR --out_dir DIR [--overwrite]
    python -m lit_model.convert lit_to_hf --checkpoint_dir DIR --out_dir DIR [--overwrite]
"""

from typing import Optional

from lit_model.recipes.cli import main as cli_main
from lit_model.io.convert import COMMANDS


def main(argv: Optional[list[str]] = None) -> None:
    cli_main(COMMANDS, argv)


if __name__ == "__main__":
    main()
