"""Every script is a plain function whose signature is its command line (jsonargparse), so each one
also runs from a YAML file: ``--config file.yaml`` with flags on the command line overriding it, wherever
``--config`` stands."""

from __future__ import annotations

import difflib
import json
import re
import sys
import typing
from argparse import ArgumentError
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Union

import yaml
from jsonargparse import CLI, ActionConfigFile, ArgumentParser

from lit_model.core.errors import UsageError, run_cli
from lit_model.kernels.ops import configure_cpu_kernels
from lit_model.io.tokenizer import check_utf8


def main(entry: Callable[..., Any] | dict[str, Callable[..., Any]], argv: Optional[list[str]] = None) -> Any:
    """Parse the command line into ``entry``'s arguments (a function, or a dict of subcommands) and run it;
    user errors exit cleanly (errors.py)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    functions = entry.values() if isinstance(entry, dict) else [entry]
    hints = {k: v for f in functions for k, v in typing.get_type_hints(f).items()}
    argv = config_first(bare_bool_flags(hints, argv))

    def run() -> Any:
        try:
            return CLI(entry, args=argv, as_positional=False, fail_untyped=False, exit_on_error=False)
        except ArgumentError as error:
            raise UsageError(f"{usage_message(str(error), hints, argv)} Run with --help to list every flag.") from None

    return run_cli(run)


def parse(args_cls: type, argv: Optional[list[str]] = None, prog: Optional[str] = None) -> Any:
    """Flat flags for the fields of dataclass ``args_cls`` (plus ``--config``); returns an instance. ``prog``: the
    command's name in --help (default: this process's, ``sys.argv[0]``)."""
    parser = ArgumentParser(prog=prog, description=(args_cls.__doc__ or "").split("\n")[0], exit_on_error=False)
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file of flags; the command line overrides it")
    parser.add_class_arguments(args_cls, nested_key=None, as_group=False)
    hints = typing.get_type_hints(args_cls)
    argv = config_first(repeated_list_flags(hints, bare_bool_flags(hints, sys.argv[1:] if argv is None else argv)))
    check_empty_values(hints, argv)
    try:
        namespace = parser.parse_args(argv)
    except ArgumentError as error:
        raise UsageError(f"{usage_message(str(error), hints, argv)} Run with --help to list every flag.") from None
    configure_cpu_kernels()  # LIT_MODEL_FP32_LINEAR checked with the flags, before anything is written
    values = namespace.as_dict()
    for name, value in values.items():  # text flags (prompts, patterns) reach a tokenizer or a file as UTF-8
        for text in value if isinstance(value, list) else [value]:
            if type(text) is str:  # not a Path: a file name need not be UTF-8
                check_utf8(text, f"--{name}")
    return args_cls(**{f.name: values[f.name] for f in fields(args_cls)})


def bare_bool_flags(type_hints: dict[str, Any], argv: list[str]) -> list[str]:
    """Let ``--overwrite`` mean ``--overwrite true`` for boolean parameters (also ones that take a word besides true
    and false, such as --activation_checkpointing selective), as users of other CLIs expect."""
    bool_flags = {f"--{name}" for name, hint in type_hints.items()
                  if hint is bool or (typing.get_origin(hint) is Union and bool in typing.get_args(hint))}
    out: list[str] = []
    for i, arg in enumerate(argv):
        out.append(arg)
        following = argv[i + 1] if i + 1 < len(argv) else None
        if arg in bool_flags and (following is None or following.startswith("--")):
            out.append("true")
    return out


def repeated_list_flags(type_hints: dict[str, Any], argv: list[str]) -> list[str]:
    """Let a flag that takes a text or a list of texts (``--prompt``, ``--stop``) be repeated: ``--prompt A --prompt
    B`` means the list ``["A", "B"]`` (jsonargparse would keep the last one alone)."""
    listed = {f"--{name}" for name, hint in type_hints.items()
              if typing.get_origin(hint) is Union and list[str] in typing.get_args(hint)}
    values: dict[str, list[str]] = {}
    rest: list[tuple[str, bool]] = []  # (argument, whether it is a listed flag's one slot, where it first stood)
    i = 0
    while i < len(argv):
        flag, equals, inline = argv[i].partition("=")
        if flag in listed and (equals or i + 1 < len(argv)):
            if flag not in values:
                rest.append((flag, True))
            values.setdefault(flag, []).append(inline if equals else argv[i + 1])
            i += 1 if equals else 2
            continue
        rest.append((argv[i], False))
        i += 1
    out: list[str] = []
    for arg, slot in rest:
        out.append(arg)
        if slot:
            given = values[arg]
            out.append(given[0] if len(given) == 1 else json.dumps(given))
    return out


def config_first(argv: list[str]) -> list[str]:
    """Move every ``--config FILE`` before the first flag: jsonargparse applies arguments in order, so a
    ``--config`` after a flag would silently override it. A subcommand name before the flags stays first."""
    configs: list[str] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config" and i + 1 < len(argv):
            configs += argv[i : i + 2]
            i += 2
            continue
        (configs if argv[i].startswith("--config=") else rest).append(argv[i])
        i += 1
    first_flag = next((i for i, arg in enumerate(rest) if arg.startswith("-")), len(rest))
    return rest[:first_flag] + configs + rest[first_flag:]


def describe(hint: Any) -> str:
    """What a flag of type ``hint`` accepts, in words: ``one of text, json (or leave it out)``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(map(str, args)) if len(args) > 1 else str(args[0])
    if origin is typing.Union:
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" (or leave it out)" if type(None) in args else "")
    if origin is list:
        return "a list like '[a, b]'"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "text", Path: "a path"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _given(flag: str, argv: list[str]) -> Optional[str]:
    """The last value given to ``--flag`` on the command line (None: it came from a --config file)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == f"--{flag}" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(f"--{flag}="):
            value = arg.split("=", 1)[1]
    return value


def usage_message(error: str, hints: dict[str, Any], argv: list[str]) -> str:
    """jsonargparse's error as one sentence naming the flag, the value and what it accepts."""
    key = re.search(r'Parser key "([^"]+)"', error)
    if key and key.group(1) in hints:
        flag = key.group(1)
        given = _given(flag, argv)
        if given is None:
            match = re.search(r"(?:Given|Got) value: (.*)", error)
            given = match.group(1).strip() if match else "?"
        return f"--{flag} {given!r} is not valid: give {describe(hints[flag])}."
    unknown = re.search(r"nrecognized arguments: (.*)", error)
    if unknown:
        hints_text = ""
        for word in unknown.group(1).split():
            close = difflib.get_close_matches(word.lstrip("-").split("=")[0], list(hints), n=1)
            if word.startswith("--") and close:
                hints_text += f" {word.split('=')[0]}: did you mean --{close[0]}?"
        return f"Unknown argument(s): {unknown.group(1).strip()}.{hints_text}"
    return error.rstrip(".") + "."


def _config_values(argv: list[str]) -> dict[str, Any]:
    """The values the ``--config`` files in ``argv`` set, as written (a file jsonargparse cannot read is left
    to it to report)."""
    values: dict[str, Any] = {}
    for i, arg in enumerate(argv):
        path = argv[i + 1] if arg == "--config" and i + 1 < len(argv) else arg[len("--config="):] if arg.startswith("--config=") else None
        if path is None or not Path(path).is_file():
            continue
        try:
            data = yaml.safe_load(Path(path).read_text())
        except (yaml.YAMLError, UnicodeDecodeError, OSError):
            continue
        values.update(data if isinstance(data, dict) else {})
    return values


def check_empty_values(hints: dict[str, Any], argv: list[str]) -> None:
    """``--out_dir ""`` (on the command line or in a --config file) would become the current directory, and
    ``--seed ""`` a parse error deep inside jsonargparse: an empty value is only meaningful for text flags."""
    from_files = _config_values(argv)
    for flag, hint in hints.items():
        given = _given(flag, argv)
        if (from_files.get(flag) if given is None else given) == "" and str not in (hint, *typing.get_args(hint)):
            raise UsageError(f"--{flag} is empty: give {describe(hint)}" + (
                " (use . for the current directory)." if hint is Path else "."))
