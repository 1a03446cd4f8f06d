"""``lit-model``: one command for every script.

    lit-model pretrain | finetune lora|full|adapter|dpo|grpo | generate | chat | evaluate | serve | plan COMMAND |
              download | convert | merge | config

Each command runs exactly what its script runs: the training and generation commands call the recipe the script
is a shim over (``lit_model/recipes/pretrain.py`` ...) with the same arguments, so flags, ``--config`` files,
``--help`` and errors are the script's own; the others call the module behind ``python -m lit_model.download /
convert / lora merge / config``. Nothing is read from a source checkout: an installed wheel runs every command.
Fabric starts the other processes of ``--devices N`` by running this process's command line again (``sys.argv``),
which is ``lit-model COMMAND ...`` itself.
"""

from __future__ import annotations

import difflib
import sys
from functools import partial
from typing import Callable, Optional

import yaml

from lit_model.convert import main as convert_main
from lit_model.core.config import CONFIG_DIR, Config
from lit_model.core.errors import UsageError, run_cli
from lit_model.download import main as download_main
from lit_model.methods.lora import cli as lora_cli
from lit_model.recipes import (chat, evaluate, finetune_adapter, finetune_dpo, finetune_full, finetune_grpo, finetune_lora,
                               generate, pretrain, serve)
from lit_model.plan.closed_form import param_counts

# command -> (the script users know, the recipe's command line that the script runs)
SCRIPTS: dict[str, tuple[str, Callable[..., None]]] = {
    "pretrain": ("pretrain/main.py", pretrain.cli),
    "finetune lora": ("finetune/lora.py", finetune_lora.cli),
    "finetune full": ("finetune/full.py", finetune_full.cli),
    "finetune adapter": ("finetune/adapter.py", finetune_adapter.cli),
    "finetune dpo": ("finetune/dpo.py", finetune_dpo.cli),
    "finetune grpo": ("finetune/grpo.py", finetune_grpo.cli),
    "generate": ("generate/base.py", generate.cli),
    "chat": ("generate/chat.py", chat.cli),
    "evaluate": ("evaluate/main.py", evaluate.cli),
    "serve": ("serve/main.py", serve.cli),
}
FINETUNE_METHODS = ("lora", "full", "adapter", "dpo", "grpo")
HELP = {
    "pretrain": "pretrain from scratch (pretrain/main.py)",
    "finetune": "fine-tune: finetune lora | full | adapter | dpo | grpo (finetune/*.py)",
    "generate": "continue a prompt (generate/base.py)",
    "chat": "chat with a model (generate/chat.py)",
    "evaluate": "score a checkpoint on lm-evaluation-harness tasks (evaluate/main.py)",
    "serve": "serve a model with OpenAI's API, continuous batching over a paged KV cache (serve/main.py)",
    "plan": "predict a run's peak memory without running it: plan pretrain|finetune M|generate|chat|serve [flags]",
    "download": "download ORG/NAME from the Hugging Face Hub and convert it (python -m lit_model.download)",
    "convert": "convert checkpoints: convert hf_to_lit | lit_to_hf (python -m lit_model.convert)",
    "merge": "merge lora.safetensors into a checkpoint's weights (python -m lit_model.lora merge)",
    "config": "list the known model names by family, with parameter counts",
}


def usage() -> str:
    width = max(map(len, HELP))
    rows = "\n".join(f"  {name.ljust(width)}  {text}" for name, text in HELP.items())
    return (
        "usage: lit-model COMMAND [flags]   (lit-model COMMAND --help lists a command's flags)\n\n"
        f"commands:\n{rows}\n"
    )


def main(argv: Optional[list[str]] = None) -> None:
    run_cli(dispatch, sys.argv[1:] if argv is None else list(argv))


def dispatch(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(), end="")
        if not argv:
            raise SystemExit(2)
        return
    command, rest = argv[0], argv[1:]
    if command == "plan":
        if rest[:1] == ["evaluate"]:
            raise UsageError("`lit-model plan` plans pretrain, finetune lora|full|adapter|dpo|grpo, generate, chat or serve; evaluate "
                             "has no --plan (it loads the model as generate does: `lit-model plan generate` sizes that).")
        script, rest = _script_for(rest, "lit-model plan")
        asks = any(arg in ("--plan", "-h", "--help") or arg.startswith("--plan=") for arg in rest)
        return script(rest if asks else [*rest, "--plan", "text"])
    if command in ("pretrain", "finetune", "generate", "chat", "evaluate", "serve"):
        script, rest = _script_for(argv, "lit-model")
        return script(rest)
    modules: dict[str, Callable[[list[str]], None]] = {
        "download": _download, "convert": _convert, "merge": _merge, "config": _config,
    }
    if command not in modules:
        close = difflib.get_close_matches(command, list(HELP), n=2)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise UsageError(f"Unknown command {command!r}.{hint} The commands are: {', '.join(HELP)} (lit-model --help).")
    modules[command](rest)


def _script_for(argv: list[str], prog: str) -> tuple[Callable[[list[str]], None], list[str]]:
    """The script a command line names, and the arguments left for it."""
    if not argv:
        raise UsageError(f"`{prog}` needs a command to plan: pretrain, finetune lora|full|adapter|dpo|grpo, generate, chat or serve.")
    command, rest = argv[0], argv[1:]
    if command == "finetune":
        if rest[:1] in (["-h"], ["--help"]):
            print(f"usage: {prog} finetune lora|full|adapter|dpo|grpo [flags]   ({prog} finetune lora --help lists the flags)")
            raise SystemExit(0)
        if not rest or rest[0] not in FINETUNE_METHODS:
            given = f" (got {rest[0]!r})" if rest else ""
            raise UsageError(
                f"`{prog} finetune` needs a method{given}: lora, full, adapter, dpo or grpo, e.g. `{prog} finetune lora "
                "--checkpoint_dir DIR`."
            )
        command, rest = f"finetune {rest[0]}", rest[1:]
    if command not in SCRIPTS:
        raise UsageError(f"`{prog}` cannot run {command!r}: use pretrain, finetune lora|full|adapter|dpo|grpo, generate, chat or serve.")
    script, cli = SCRIPTS[command]
    return partial(cli, prog=script.split("/")[-1]), rest  # --help and usage name the script, as it does


def _download(argv: list[str]) -> None:
    download_main(argv)


def _convert(argv: list[str]) -> None:
    convert_main(argv)


def _merge(argv: list[str]) -> None:
    lora_cli(["merge", *argv])


def _config(argv: list[str]) -> None:
    if argv and argv[0] not in ("-h", "--help"):
        raise UsageError(f"`lit-model config` takes no arguments (got {' '.join(argv)}).")
    if argv:
        print("usage: lit-model config\n\nList the known model names by family, with parameter counts.")
        return
    print(config_table())


def families() -> dict[str, list[str]]:
    """The registry's names per family (its YAML file in lit_model/configs), families sorted by name."""
    return {
        path.stem: [entry["name"] for entry in yaml.safe_load(path.read_text()) or []]
        for path in sorted(CONFIG_DIR.glob("*.yaml"))
    }


def config_table() -> str:
    """Every known model by family, smallest first, with its parameter count and Hugging Face repo id."""
    lines = []
    for family, names in families().items():
        configs = [Config.from_name(name) for name in names]
        counts = {config.name: param_counts(config).total for config in configs}
        lines.append(f"{family}:")
        width = max(len(config.hf_name) for config in configs)
        for config in sorted(configs, key=lambda c: (counts[c.name], c.name)):
            lines.append(f"  {config.hf_name.ljust(width)}  {_human(counts[config.name]):>7}  ({counts[config.name]:,})")
    return "\n".join(lines)


def _human(count: int) -> str:
    for unit, size in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= size:
            return f"{count / size:.{2 if count < 10 * size else 1}f}{unit}"
    return str(count)


if __name__ == "__main__":
    main()
