"""Chat with a checkpoint's model in its family's prompt style; the conversation stays in the KV cache (the engine's
paged pool with prefix caching: a turn computes only what earlier turns did not).

    python generate/chat.py --model_name Qwen/Qwen2.5-0.5B-Instruct   # after lit-model download Qwen/Qwen2.5-0.5B-Instruct
    printf 'Hi!\\nAnd then?\\n/exit\\n' | python generate/chat.py --checkpoint_dir DIR   # reads lines until EOF

Type /reset to start a new conversation and /exit (or end the input) to quit.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass
from typing import Optional

from lit_model.recipes.cli import parse
from lit_model.core.errors import UsageError, UserError, run_cli
from lit_model.infer.chat import ChatSession
from lit_model.infer.stream import stdout_writer
from lit_model.recipes.generation import GenerationArgs, prepare_generation, print_generation_plan
from lit_model.io.tokenizer import check_utf8


@dataclass
class ChatArgs(GenerationArgs):
    """Chat with a model: one message per line, /reset starts over, /exit quits.

    Args:
        max_new_tokens: longest reply in tokens
        max_seq_length: context kept in the KV cache, in tokens; default: the block size, at most 4096. --plan
            plans a pool of this many positions and a message that fills all of it but --max_new_tokens
        system: system message (default: the prompt style's, if any)
    """

    max_new_tokens: int = 256
    max_seq_length: Optional[int] = None
    system: Optional[str] = None


def main(args: ChatArgs) -> None:
    if args.compile:
        raise UsageError("--compile compiles generate/base.py's decode step of one prompt; chat decodes in the paged "
                         "engine, which it does not compile: leave --compile out.")
    setup = prepare_generation(args)
    block_size = setup.config.block_size
    context = args.max_seq_length or min(block_size, 4096)
    if not 1 < context <= block_size:
        raise UsageError(f"--max_seq_length must be between 2 and the model's block size {block_size}.")
    if args.max_new_tokens < 1 or args.max_new_tokens >= context:
        raise UsageError(
            f"--max_new_tokens must be between 1 and {context - 1} (the context of {context} tokens also holds "
            "the messages)."
        )
    if args.plan is not None:
        return print_generation_plan(setup, context - args.max_new_tokens, args.max_new_tokens, 1, paged=True)

    session = ChatSession(setup.load(max_seq_length=context), setup.precision, setup.sampling(), setup.tokenizer,
                          setup.style, context, system=args.system, stop=setup.stop)
    interactive = sys.stdin is not None and sys.stdin.isatty()  # None: started with stdin closed, no input
    if interactive:
        name = setup.config.name or setup.checkpoint_dir
        print(f"Chatting with {name} ({setup.style.name} prompt style). /reset starts over, /exit quits.",
              file=sys.stderr)
    for number in itertools.count(1):
        try:
            message = read_message(interactive, number)
        except UserError as error:  # not text: say so and read on, like a message too long for the context
            print(f"error: {error}", file=sys.stderr, flush=True)
            continue
        if message is None:
            break  # end of input
        message = message.strip()
        if not message:
            continue
        if message == "/exit":
            break
        if message == "/reset":
            session.reset()
            print("(conversation reset)", file=sys.stderr, flush=True)
            continue
        if interactive:
            stdout_writer(">> Model: ")
        try:
            session.send(message, args.max_new_tokens, write=stdout_writer, notify=_notify)
        except UserError as error:  # e.g. a message longer than the context: say so and keep chatting
            print(f"error: {error}", file=sys.stderr, flush=True)
            continue
        stdout_writer("\n")


def read_message(interactive: bool, number: int) -> Optional[str]:
    """The next line of input (None at its end or on Ctrl-C/Ctrl-D at the prompt); a ``UserError`` for a
    line that is not text in the input's encoding. Piped input is decoded line by line, so one bad line
    costs only itself."""
    try:
        if interactive:
            line = input(">> You: ")
        elif sys.stdin is None or not (raw := sys.stdin.buffer.readline()):
            return None
        else:
            line = raw.decode(sys.stdin.encoding)
    except (EOFError, KeyboardInterrupt):
        return None
    except UnicodeDecodeError as error:
        raise UserError(
            f"Input line {number} is not {sys.stdin.encoding} text (byte 0x{error.object[error.start]:02x}), so it "
            "was skipped. Type or pipe UTF-8 text (convert a file with `iconv -t utf-8`)."
        ) from None
    check_utf8(line, f"Input line {number}")  # UTF-8 mode keeps bad bytes as surrogates instead of failing
    return line


def _notify(text: str) -> None:
    print(f"({text})", file=sys.stderr, flush=True)



def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> ChatArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(ChatArgs, sys.argv[1:] if argv is None else list(argv), prog)))
