"""Every script is a plain function whose signature is its command line (jsonargparse), so each one
also runs from a YAML file: ``--config file.yaml`` with flags on the command line overriding it."""

from __future__ import annotations

import sys
import typing
from argparse import ArgumentError
from dataclasses import fields
from typing import Any, Callable, Optional

from jsonargparse import CLI, ActionConfigFile, ArgumentParser

from lit_model.errors import UsageError, run_cli


def main(entry: Callable[..., Any] | dict[str, Callable[..., Any]], argv: Optional[list[str]] = None) -> Any:
    """Parse the command line into ``entry``'s arguments (a function, or a dict of subcommands) and run it;
    user errors exit cleanly (errors.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    functions = entry.values() if isinstance(entry, dict) else [entry]
    argv = bare_bool_flags({k: v for f in functions for k, v in typing.get_type_hints(f).items()}, argv)
    return run_cli(CLI, entry, args=argv, as_positional=False, fail_untyped=False)


def parse(args_cls: type, argv: Optional[list[str]] = None) -> Any:
    """Flat flags for the fields of dataclass ``args_cls`` (plus ``--config``); returns an instance."""
    parser = ArgumentParser(description=(args_cls.__doc__ or "").split("\n")[0], exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file of flags; the command line overrides it")
    parser.add_class_arguments(args_cls, nested_key=None, as_group=False)
    argv = bare_bool_flags(typing.get_type_hints(args_cls), sys.argv[1:] if argv is None else argv)
    try:
        namespace = parser.parse_args(argv)
    except ArgumentError as error:
        raise UsageError(f"{error}. Run with --help to list every flag.") from None
    values = namespace.as_dict()
    return args_cls(**{f.name: values[f.name] for f in fields(args_cls)})


def bare_bool_flags(type_hints: dict[str, Any], argv: list[str]) -> list[str]:
    """Let ``--overwrite`` mean ``--overwrite true`` for boolean parameters, as users of other CLIs expect."""
    bool_flags = {f"--{name}" for name, hint in type_hints.items() if hint is bool}
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg in bool_flags and (following is None or following.startswith("--")):
            out.append("true")
    return out
