"""``python -m lit_model.download ORG/NAME [flags]``: the command line of lit_model.io.download."""

import sys
import typing
from typing import Optional

from jsonargparse import CLI

from lit_model.recipes.cli import bare_bool_flags
from lit_model.core.errors import run_cli
from lit_model.io.download import download


def main(argv: Optional[list[str]] = None) -> None:
    """The repository id is positional, as in ``hf download``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    argv = bare_bool_flags(typing.get_type_hints(download), argv)
    run_cli(CLI, download, args=argv, as_positional=True, fail_untyped=False)


if __name__ == "__main__":
    main()
