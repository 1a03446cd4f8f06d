"""Prompt styles: how a family's chat/instruction models expect a conversation to be written.

A style is a row of template pieces. A conversation renders as
``[system] user assistant reply end user assistant reply end ... user assistant``, where ``assistant`` opens
the model's turn (the generation prompt) and ``end`` closes a finished reply; families without a system role
put the system text at the start of the first user message. Chat builds each turn from the same pieces
(``turn``), so a conversation prefilled turn by turn is exactly ``apply_chat`` of it.

A checkpoint whose tokenizer carries a chat template (``ChatTemplate``) renders with it instead, as transformers
does; the built-in styles serve checkpoints without one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

import yaml

from lit_model.core.config import Config
from lit_model.core.errors import UsageError, UserError
from lit_model.io.chat_template import read_chat_template, render, special_tokens

PROMPT_STYLE_FILE = "prompt_style.yaml"
Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}


@dataclass(frozen=True)
class PromptStyle:
    name: str = "default"
    user: str = "{content}"  # one user turn
    assistant: str = ""  # opens the assistant's turn
    end: str = ""  # closes a finished assistant turn
    system: str = "{content}\n\n"  # a system message
    system_in_user: bool = False  # no system role: the system text starts the first user message
    default_system: Optional[str] = None  # used when the conversation has no system message
    stop: tuple[str, ...] = ()  # special tokens that end the assistant's turn (besides the tokenizer's eos)
    stop_strings: tuple[str, ...] = ()  # text that ends the assistant's turn

    # ---- rendering -------------------------------------------------------------------------------
    def apply(self, prompt: str, system: Optional[str] = None, history: Sequence[Message] = ()) -> str:
        """One user message (after an optional ``history`` of messages), ready for the model to answer."""
        messages = [*([{"role": "system", "content": system}] if system is not None else []), *history]
        return self.apply_chat([*messages, {"role": "user", "content": prompt}])

    def apply_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """A whole conversation; ends with the opening of the assistant's turn after a user message."""
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        text, first = "", True
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "user":
                text += self.turn(content, system=system, first=first, generation_prompt=False)
                first = False
            elif role == "assistant":
                text += self.assistant + content + self.end
            elif role != "system":
                raise UsageError(f"Unknown chat role {role!r}: use 'system', 'user' or 'assistant'.")
        if add_generation_prompt and messages and messages[-1]["role"] == "user":
            text += self.assistant
        return text

    def turn(self, message: str, system: Optional[str] = None, first: bool = True, generation_prompt: bool = True) -> str:
        """The text a chat adds for one user message: the first turn starts with the system text, a later one
        closes the previous reply (``end``); both end by opening the assistant's turn."""
        if first:
            system = system if system is not None else self.default_system
            system_text = self.system.format(content=system) if system else ""
            if self.system_in_user:
                text = self.user.format(content=system_text + message)
            else:
                text = system_text + self.user.format(content=message)
        else:
            text = self.user.format(content=message)
        return text + (self.assistant if generation_prompt else "")

    def next_turn(self, message: str) -> str:
        """What follows a reply that the model produced itself: the end of its turn, then the next user turn."""
        return self.end + self.turn(message, first=False)

    def stop_tokens(self, tokenizer: Any) -> list[list[int]]:
        """Token sequences that end the assistant's turn: the style's special tokens the vocabulary has."""
        ids = []
        for token in self.stop:
            try:
                ids.append([tokenizer.token_to_id(token)])
            except UserError:  # e.g. a base checkpoint's tokenizer without the chat tokens
                continue
        return ids

    # ---- lookup ----------------------------------------------------------------------------------
    @classmethod
    def from_name(cls, name: str) -> "PromptStyle":
        if name not in STYLES:
            raise UsageError(f"Unknown prompt style {name!r}. Choose one of: {', '.join(STYLES)}.")
        return STYLES[name]

    @classmethod
    def from_config(cls, config: Union[Any, str]) -> "PromptStyle":
        """The style of a model by its config name (e.g. "Llama-3.2-1B-Instruct"); "default" if unknown."""
        name = (config if isinstance(config, str) else getattr(config, "name", "") or "").split("/")[-1].lower()
        return STYLES[next((style for pattern, style in BY_MODEL_NAME if re.search(pattern, name)), "default")]

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: Union[str, Path], config: Any = None) -> "PromptStyle":
        """The style saved with a fine-tuned checkpoint (``prompt_style.yaml``), else the checkpoint's chat
        template, else the config's."""
        path = Path(checkpoint_dir) / PROMPT_STYLE_FILE
        if path.is_file():
            name = _saved_style_name(path)
            if name == ChatTemplate.name:
                template = ChatTemplate.load(checkpoint_dir)
                if template is None:
                    raise UserError(
                        f"{path} says the model was fine-tuned with its chat template, but {checkpoint_dir} has "
                        "none (chat_template.jinja or tokenizer_config.json's chat_template). Copy the tokenizer "
                        "files of the base checkpoint into it, or pass --prompt_style."
                    )
                return template
            return cls.from_name(name)
        template = ChatTemplate.load(checkpoint_dir)
        if template is not None:
            return template
        if config is None:
            config = Config.from_checkpoint(checkpoint_dir)
        return cls.from_config(config)

    def save(self, checkpoint_dir: Union[str, Path]) -> None:
        (Path(checkpoint_dir) / PROMPT_STYLE_FILE).write_text(yaml.safe_dump({"name": self.name}))


@dataclass(frozen=True)
class Alpaca(PromptStyle):
    """Alpaca, with the optional ``input`` field of its data set."""

    def apply(self, prompt: str, system: Optional[str] = None, history: Sequence[Message] = (), input: str = "") -> str:
        if not input:
            return super().apply(prompt, system, history)
        system = system if system is not None else ALPACA_INPUT_SYSTEM
        return super().apply(f"{prompt}\n\n### Input:\n{input}", system, history)


@dataclass(frozen=True)
class ChatTemplate(PromptStyle):
    """A checkpoint's chat template (Jinja, rendered as transformers renders it). ``assistant`` (what opens the
    assistant's turn) and ``end`` (what closes it) are found by rendering a probe conversation, for what builds
    training samples piece by piece; every rendering of a conversation is the template's own."""

    name: str = "chat_template"
    template: str = ""
    variables: Mapping[str, str] = field(default_factory=dict, compare=False)  # bos_token, eos_token, ...

    @classmethod
    def load(cls, checkpoint_dir: Union[str, Path]) -> Optional["ChatTemplate"]:
        """The checkpoint's chat template, or None. ``save`` writes only the name: the template itself is one of
        the tokenizer files every checkpoint carries."""
        source = read_chat_template(checkpoint_dir)
        if source is None:
            return None
        style = cls(template=source, variables=special_tokens(checkpoint_dir))
        user, reply = [{"role": "user", "content": _PROBE[0]}], {"role": "assistant", "content": _PROBE[1]}
        opened = style.apply_chat(user)
        closed = style.apply_chat([*user, reply], add_generation_prompt=False)
        without = style.apply_chat(user, add_generation_prompt=False)
        if not (opened.startswith(without) and closed.startswith(opened + _PROBE[1])):
            raise UserError(
                f"The chat template in {checkpoint_dir} does not write a conversation turn after turn (a reply is "
                "not its prompt followed by the reply), which chat and fine-tuning rely on. Pass --prompt_style "
                "with a built-in style."
            )
        end = closed[len(opened) + len(_PROBE[1]):]
        # What closes a reply ends generation: as a token when it is one (<|im_end|>), else as text
        stop = (end.strip(),) if end.strip() else ()
        return replace(style, assistant=opened[len(without):], end=end, stop=stop, stop_strings=stop)

    def apply_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        return render(self.template, messages, add_generation_prompt, self.variables)

    def turn(self, message: str, system: Optional[str] = None, first: bool = True, generation_prompt: bool = True) -> str:
        if not first:
            return self.next_turn(message)[len(self.end):]
        messages = [*([{"role": "system", "content": system}] if system is not None else []), {"role": "user", "content": message}]
        return self.apply_chat(messages, add_generation_prompt=generation_prompt)

    def next_turn(self, message: str) -> str:
        """What follows a reply: the template's text for a probe conversation that ends with the reply, cut from
        its rendering with ``message`` after it (the template sees the real message: it may trim or escape it)."""
        probe = [{"role": "user", "content": _PROBE[0]}, {"role": "assistant", "content": _PROBE[1]}]
        before = self.apply_chat(probe[:1]) + _PROBE[1]
        after = self.apply_chat([*probe, {"role": "user", "content": message}])
        if not after.startswith(before):
            raise UserError("The checkpoint's chat template renders earlier turns differently once a message follows "
                            "them, so chat cannot keep them in its cache. Pass --prompt_style with a built-in style.")
        return after[len(before):]


def _saved_style_name(path: Path) -> str:
    """The style name ``PromptStyle.save`` wrote (``name: alpaca``); a file that is not that is named, with the fix."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (yaml.YAMLError, ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        data = None  # reported below, as any other content that is not a style
    name = data.get("name", "default") if isinstance(data, dict) else None
    if not isinstance(name, str):
        raise UserError(f"{path} does not hold a prompt style (`name: STYLE`, as fine-tuning writes it). Fix or delete "
                        f"it, or pass --prompt_style (one of {', '.join(STYLES)}).")
    return name


_PROBE = ("Hi", "Hello")  # a probe conversation; plain words no template rewrites


ALPACA_SYSTEM = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request."
)
ALPACA_INPUT_SYSTEM = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request."
)
_CHATML = PromptStyle(
    "chatml", user="<|im_start|>user\n{content}<|im_end|>\n", assistant="<|im_start|>assistant\n",
    end="<|im_end|>\n", system="<|im_start|>system\n{content}<|im_end|>\n", stop=("<|im_end|>", "<|endoftext|>"),
)
_STYLES: list[PromptStyle] = [
    PromptStyle("default", end="\n"),
    Alpaca("alpaca", user="### Instruction:\n{content}\n\n", assistant="### Response:\n", end="\n\n",
           default_system=ALPACA_SYSTEM, stop_strings=("### Instruction:",)),
    _CHATML,
    replace(_CHATML, name="qwen2.5", default_system="You are Qwen, created by Alibaba Cloud. You are a helpful assistant."),
    PromptStyle("llama-2", user="[INST] {content} [/INST]", end=" </s><s>", system="<<SYS>>\n{content}\n<</SYS>>\n\n",
                system_in_user=True, stop=("</s>",)),
    PromptStyle("llama-3", user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>",
                assistant="<|start_header_id|>assistant<|end_header_id|>\n\n", end="<|eot_id|>",
                system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
                stop=("<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")),
    PromptStyle("mistral", user="[INST] {content} [/INST]", end="</s>", system_in_user=True, stop=("</s>",)),
    PromptStyle("gemma", user="<start_of_turn>user\n{content}<end_of_turn>\n", assistant="<start_of_turn>model\n",
                end="<end_of_turn>\n", system_in_user=True, stop=("<end_of_turn>", "<eos>")),
    PromptStyle("phi-2", user="Instruct: {content}\n", assistant="Output:", end="\n", stop=("<|endoftext|>",),
                stop_strings=("\nInstruct:",)),
    PromptStyle("phi-3", user="<|user|>\n{content}<|end|>\n", assistant="<|assistant|>\n", end="<|end|>\n",
                system="<|system|>\n{content}<|end|>\n", stop=("<|end|>", "<|endoftext|>")),
    PromptStyle("tinyllama", user="<|user|>\n{content}</s>\n", assistant="<|assistant|>\n", end="</s>\n",
                system="<|system|>\n{content}</s>\n", stop=("</s>",),
                default_system="You are a friendly chatbot who always gives helpful, detailed, and polite answers."),
]
STYLES: dict[str, PromptStyle] = {style.name: style for style in _STYLES}

# First match wins: (regular expression on the lower-cased config name, style name)
BY_MODEL_NAME: list[tuple[str, str]] = [
    (r"llama-3.*instruct", "llama-3"),
    (r"llama-2.*chat", "llama-2"),
    (r"qwen2\.5.*instruct", "qwen2.5"),
    (r"(qwen|smollm).*(instruct|chat)", "chatml"),
    (r"(mistral|mixtral).*instruct", "mistral"),
    (r"gemma.*-it\b", "gemma"),
    (r"phi-2", "phi-2"),
    (r"phi-3", "phi-3"),
    (r"tinyllama.*chat", "tinyllama"),
]
