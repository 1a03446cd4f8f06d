"""A checkpoint's own chat template (``chat_template.jinja`` or ``chat_template`` in tokenizer_config.json),
rendered the way ``transformers``' ``apply_chat_template`` renders it: Jinja2 in a sandbox that lets the template
read only what it is given, with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``,
``strftime_now``, ``namespace``, loop controls and the ``{% generation %}`` tag, and the tokenizer's special
tokens (``bos_token``, ``eos_token``, ...) as variables next to ``messages`` and ``add_generation_prompt``.

A template is code from the checkpoint, so its rendering is bounded: RENDER_BUDGET_S of time, MAX_RENDERED_CHARS
of output, no ``lipsum`` and no arithmetic that builds a giant value (``"x" * 10**12``, ``10 ** 10**9``); whatever
it raises ends in one message that names the fix (``--prompt_style``).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import threading
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

from lit_model.core.errors import UserError
from lit_model.io.tokenizer import _read_json as read_json

TEMPLATE_FILE = "chat_template.jinja"  # where transformers >= 4.50 saves it
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# A conversation renders in milliseconds; a template that loops for longer (nested range(100000)) is stopped
RENDER_BUDGET_S = 3.0
# Far above a whole context of text (a million tokens is about four million characters)
MAX_RENDERED_CHARS = 32 * 2**20
# The largest integer a template may compute (bits): a hundred digits are plenty for any chat template
MAX_INT_BITS = 4096
FIX = "Fix the template (chat_template.jinja, or chat_template in tokenizer_config.json), or pass --prompt_style " \
      "with a built-in style."


class RenderTimeout(Exception):
    """Raised inside a rendering that ran past RENDER_BUDGET_S (see ``_time_limit``)."""


def read_chat_template(checkpoint_dir: Union[str, Path]) -> Optional[str]:
    """The checkpoint's chat template source, or None. ``chat_template.jinja`` wins over tokenizer_config.json's
    (as in transformers); of several named templates, the one named "default"."""
    checkpoint_dir = Path(checkpoint_dir)
    if (checkpoint_dir / TEMPLATE_FILE).is_file():
        return (checkpoint_dir / TEMPLATE_FILE).read_text(encoding="utf-8")
    template = _tokenizer_config(checkpoint_dir).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"), None)
    return template if isinstance(template, str) and template.strip() else None


def special_tokens(checkpoint_dir: Union[str, Path]) -> dict[str, str]:
    """``bos_token``, ``eos_token``, ... as text, from tokenizer_config.json, else special_tokens_map.json."""
    checkpoint_dir = Path(checkpoint_dir)
    tokens: dict[str, str] = {}
    for source in (_tokenizer_config(checkpoint_dir), read_json(checkpoint_dir / "special_tokens_map.json")):
        for key in SPECIAL_TOKENS:
            value = source.get(key)
            if isinstance(value, dict):  # transformers' AddedToken form: {"content": "<s>", "lstrip": false, ...}
                value = value.get("content")
            if isinstance(value, str) and key not in tokens:
                tokens[key] = value
    return tokens


def render(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
           variables: Mapping[str, Any]) -> str:
    """The conversation as the template writes it (``variables``: the special tokens)."""
    import jinja2

    template = _compile(source)
    try:
        with _time_limit(RENDER_BUDGET_S):
            pieces, size = [], 0
            for piece in template.generate(
                messages=[dict(m) for m in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **variables,
            ):
                size += len(piece)
                if size > MAX_RENDERED_CHARS:
                    raise jinja2.exceptions.SecurityError(f"it wrote more than {MAX_RENDERED_CHARS} characters")
                pieces.append(piece)
            return "".join(pieces)
    except RenderTimeout:
        raise UserError(f"The checkpoint's chat template was stopped after {RENDER_BUDGET_S:g} s of rendering (a "
                        f"conversation takes milliseconds): it loops without end, or nearly. {FIX}") from None
    except jinja2.exceptions.SecurityError as error:
        raise UserError(f"The checkpoint's chat template was stopped: {error}. {FIX}") from None
    except Exception as error:  # noqa: BLE001 - whatever the template's code raises (1/0, recursion, memory)
        if type(error) is jinja2.TemplateError:  # raise_exception(...): the template's verdict on the conversation
            raise UserError(
                f"The checkpoint's chat template refused this conversation: {error}. Change the conversation (e.g. "
                "alternate user and assistant messages, system first), or pass --prompt_style with a built-in style."
            ) from None
        detail = str(error).strip().splitlines()[0] if str(error).strip() else "no detail"
        raise UserError(f"The checkpoint's chat template failed while rendering ({type(error).__name__}: "
                        f"{detail}). {FIX}") from None


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Raise RenderTimeout in this thread once ``seconds`` have passed. A template's loops run as Python bytecode,
    which an exception set from a timer thread interrupts at once: no signal, so it works in any thread, and the
    timer ends with the block."""
    thread, lock, running = threading.get_ident(), threading.Lock(), [True]

    def expire() -> None:
        with lock:  # never after the block has ended: the exception would land in unrelated code
            if running[0]:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), ctypes.py_object(RenderTimeout))

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            running[0] = False
        timer.cancel()


def _too_large(operator: str, left: Any, right: Any) -> bool:
    """Whether ``left operator right`` would build a value no chat template needs, in one long C call that the
    time limit cannot interrupt (``"x" * 10**12``, ``10 ** 10**9``)."""
    if operator == "**" and _is_int(left) and _is_int(right):
        return right > 0 and abs(left) > 1 and right * abs(left).bit_length() > MAX_INT_BITS
    if operator == "*":
        if _is_int(left) and _is_int(right):
            return left.bit_length() + right.bit_length() > MAX_INT_BITS
        for count, sequence in ((left, right), (right, left)):
            if _is_int(count) and isinstance(sequence, (str, list, tuple)):
                return count * len(sequence) > MAX_RENDERED_CHARS
    return False


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_arguments(function: Any, arguments: Sequence[Any]) -> None:
    """Refuse a size argument no chat template needs (``'x'.center(10**10)``, ``indent(10**10)``): the call would
    build the value in one long C call that the time limit cannot interrupt."""
    import jinja2

    large = next((a for a in arguments if _is_int(a) and abs(a) > MAX_RENDERED_CHARS), None)
    if large is not None:
        raise jinja2.exceptions.SecurityError(
            f"it calls {getattr(function, '__name__', 'a function')} with {large}, larger than any chat template needs")


def _bounded_filter(function: Any) -> Any:
    """A Jinja filter whose arguments are checked by ``_check_arguments`` (its filtered value is not: any size)."""
    skip = 2 if hasattr(function, "jinja_pass_arg") else 1  # the context or environment, then the value

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(function, [*args[skip:], *kwargs.values()])
        return function(*args, **kwargs)

    return bounded


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates do not want
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Namespace(jinja2.utils.Namespace):
        """``namespace(...)`` without underscore attributes, which could reach interpreter internals."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")

    class TemplateDict:
        """``dict(...)`` and ``dict.fromkeys(...)``, without the class itself (its attributes lead out)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` marks the assistant's text for masks; rendered as is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if _too_large(operator, left, right):
                raise jinja2.exceptions.SecurityError(
                    f"it computes {str(left)[:20]!r} {operator} {str(right)[:20]!r}, a value larger than any chat "
                    "template needs")
            return super().call_binop(context, operator, left, right)

        def call(self, context: Any, function: Any, /, *args: Any, **kwargs: Any) -> Any:
            _check_arguments(function, [*args, *kwargs.values()])
            return super().call(context, function, *args, **kwargs)

    environment = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    del environment.globals["lipsum"]  # lipsum(n=1000000): a template's way to write megabytes in one call
    environment.filters["tojson"] = tojson
    environment.filters.update({name: _bounded_filter(f) for name, f in environment.filters.items()})
    environment.globals.update(
        raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=TemplateDict(), namespace=Namespace,
    )
    try:
        return environment.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise UserError(
            f"The checkpoint's chat template is not valid Jinja ({error.message}, line {error.lineno}). Fix "
            f"{TEMPLATE_FILE} or tokenizer_config.json's chat_template, or pass --prompt_style with a built-in style."
        ) from None


def _tokenizer_config(checkpoint_dir: Path) -> dict[str, Any]:
    return read_json(checkpoint_dir / "tokenizer_config.json")
