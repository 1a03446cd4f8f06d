"""Rewards of GRPO's completions: ``--reward`` names a built-in or a Python function in a file, as TRL's
``reward_funcs`` take them: ``function(prompts, completions, **fields) -> list[float]``, one value per completion,
where ``fields`` are the prompt records' other fields (``answer``, ...), one value per completion, and
``completion_ids`` the completions' token ids. Several rewards are summed with ``--reward_weights``.

Built-ins: ``exact_match`` (1.0 where the completion, stripped, equals the record's ``answer``, stripped),
``format:REGEX`` (1.0 where ``re.search(REGEX, completion)`` matches, DOTALL: anchor it with ^...$ to match the whole
completion) and ``length`` (the completion's number of tokens: weight it, e.g. -0.01, to favour short answers).
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from lit_model.core.errors import UsageError, UserError

RewardFunction = Callable[..., Sequence[float]]
BUILT_IN = ("exact_match", "length", "format:REGEX")
REWARD_HELP = ("a built-in (exact_match, length, format:REGEX) or FILE.py:function, a Python function "
               "(prompts, completions, **fields) -> list of floats, one per completion")


@dataclass(frozen=True)
class Reward:
    name: str  # what metrics.csv calls it: rewards/<name>
    function: RewardFunction


def completion_text(completion: Any) -> str:
    """A completion as text: TRL hands conversational prompts' completions over as [{"role", "content"}]."""
    return completion[0]["content"] if isinstance(completion, list) else completion


def exact_match(prompts: Sequence[Any], completions: Sequence[Any], answer: Optional[Sequence[Any]] = None,
                **fields: Any) -> list[float]:
    if answer is None:
        raise UserError("the prompt records have no 'answer' field to compare the completions with: add one "
                        '({"prompt": "...", "answer": "..."}) or use another reward.')
    return [float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)]


def format_match(pattern: re.Pattern, prompts: Sequence[Any], completions: Sequence[Any], **fields: Any) -> list[float]:
    return [float(pattern.search(completion_text(c)) is not None) for c in completions]


def length(prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]],
           **fields: Any) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def reward_name(spec: str) -> str:
    """The name a ``--reward`` spec logs under (before its file is read): the function's, or the built-in's."""
    if spec.startswith("format:"):
        return "format"
    return spec.rsplit(":", 1)[1] if ":" in spec else spec


def reward_names(specs: Sequence[str]) -> tuple[str, ...]:
    """Each spec's name, made unique with a suffix (two format rewards: format, format_2)."""
    names: list[str] = []
    for spec in specs:
        name = reward_name(spec)
        names.append(name if name not in names else f"{name}_{len(names) + 1}")
    return tuple(names)


def load_reward(spec: str, name: str) -> Reward:
    """The reward a ``--reward`` spec names; a spec that names nothing usable is a usage error naming it."""
    if spec == "exact_match":
        return Reward(name, exact_match)
    if spec == "length":
        return Reward(name, length)
    if spec.startswith("format:"):
        try:
            return Reward(name, partial(format_match, re.compile(spec[len("format:"):], re.DOTALL)))
        except re.error as error:
            raise UsageError(f"--reward {spec!r}: the regular expression is not valid ({error}). Fix it (Python's re "
                             "syntax), e.g. format:'^<answer>.*</answer>$'.") from None
    path_text, _, function = spec.rpartition(":")
    if not path_text or not path_text.endswith(".py") or not function.isidentifier():
        raise UsageError(f"--reward {spec!r} is not a reward: give {REWARD_HELP}.")
    path = Path(path_text).expanduser()
    if not path.is_file():
        raise UsageError(f"--reward {spec!r}: the file {path} does not exist. Give the path of a Python file and the "
                         "function in it, e.g. --reward rewards.py:correct.")
    module_spec = importlib.util.spec_from_file_location(f"lit_model_reward_{path.stem}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:  # the user's code: any error it raises is theirs to fix
        raise UsageError(f"--reward {spec!r}: running {path} raised {type(error).__name__}: {error}. Fix the file "
                         "(it is imported once, before training starts).") from None
    found = getattr(module, function, None)
    if not callable(found):
        defined = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(f"--reward {spec!r}: {path} defines no function {function!r}"
                         f"{f' (it defines {defined})' if defined else ''}. Name one of its functions after the colon.")
    return Reward(name, found)


def load_rewards(specs: Sequence[str], weights: Optional[Sequence[float]]) -> tuple[list[Reward], torch.Tensor]:
    """The rewards ``--reward`` names and their weights (default: 1 each)."""
    if not specs:
        raise UsageError(f"GRPO needs at least one --reward: {REWARD_HELP}.")
    if weights is not None and len(weights) != len(specs):
        raise UsageError(f"--reward_weights gives {len(weights)} weight(s) for {len(specs)} reward(s) "
                         f"({', '.join(specs)}): give one weight per --reward, in the same order.")
    rewards = [load_reward(spec, name) for spec, name in zip(specs, reward_names(specs))]
    return rewards, torch.tensor(weights if weights is not None else [1.0] * len(specs), dtype=torch.float32)


def score(rewards: Sequence[Reward], prompts: Sequence[Any], completions: Sequence[Any],
          fields: dict[str, list[Any]]) -> torch.Tensor:
    """Every reward of every completion, (completions, rewards) float32. A reward that raises, or returns anything
    but one finite number per completion, stops the run with one paragraph naming it."""
    columns = []
    for reward in rewards:
        try:
            values = reward.function(prompts=list(prompts), completions=list(completions), **fields)
        except UserError as error:
            raise UserError(f"The reward {reward.name!r}: {error}") from None
        except Exception as error:  # the user's code
            raise UserError(f"The reward {reward.name!r} raised {type(error).__name__}: {error}. Fix the function; "
                            "it is called with prompts, completions and the records' other fields as keyword "
                            f"arguments ({', '.join(sorted(fields))}).") from None
        columns.append(check_values(reward.name, values, len(completions)))
    return torch.tensor(columns, dtype=torch.float32).T.contiguous()


def check_values(name: str, values: Any, expected: int) -> list[float]:
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != expected:
        found = f"{len(values)} values" if isinstance(values, Sequence) else f"a {type(values).__name__}"
        raise UserError(f"The reward {name!r} returned {found} for {expected} completions: return a list of one "
                        "float per completion, in their order.")
    bad = [v for v in values if not isinstance(v, numbers.Real) or not math.isfinite(v)]
    if bad:
        raise UserError(f"The reward {name!r} returned {bad[0]!r} among its values: every value must be a finite "
                        "number (a float or an int; bool counts as 0/1).")
    return [float(v) for v in values]
