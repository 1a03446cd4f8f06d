"""Chat templates: a checkpoint's own template renders byte for byte as transformers' apply_chat_template renders
it, chat's turn-by-turn prompts and fine-tuning's pieces add up to the template's whole conversation, and the
template wins over the built-in prompt styles unless a fine-tuned checkpoint saved another style."""

from __future__ import annotations

import io
import json
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lit_model.io.chat_template import read_chat_template  # noqa: E402
from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir  # noqa: E402
from lit_model.core.config import Config  # noqa: E402
from lit_model.data.instruct import segments  # noqa: E402
from lit_model.core.errors import UserError  # noqa: E402
from lit_model.io.prompts import PROMPT_STYLE_FILE, Alpaca, ChatTemplate, PromptStyle  # noqa: E402
from lit_model.model.gpt import GPT  # noqa: E402
from lit_model.io.tokenizer import Tokenizer, train_bpe  # noqa: E402
from tests.conftest import run_script_inprocess  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# Qwen2.5's ChatML template: a default system message when the conversation has none.
CHATML = (
    "{%- for message in messages %}\n"
    "    {%- if loop.first and message['role'] != 'system' %}\n"
    "        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
# Llama 3's layout: bos_token, trim, namespace, raise_exception.
LLAMA3 = (
    "{{- bos_token }}\n"
    "{%- set ns = namespace(last=none) %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message['role'] == ns.last %}\n"
    "        {{- raise_exception('Conversation roles must alternate') }}\n"
    "    {%- endif %}\n"
    "    {%- set ns.last = message['role'] %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)
# Zephyr / TinyLlama: no whitespace control in the template itself, so trim_blocks and lstrip_blocks decide.
ZEPHYR = (
    "{% for message in messages %}\n"
    "{% if message['role'] == 'user' %}\n"
    "{{ '<|user|>\\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'system' %}\n"
    "{{ '<|system|>\\n' + message['content'] + eos_token }}\n"
    "{% elif message['role'] == 'assistant' %}\n"
    "{{ '<|assistant|>\\n'  + message['content'] + eos_token }}\n"
    "{% endif %}\n"
    "{% if loop.last and add_generation_prompt %}\n"
    "{{ '<|assistant|>' }}\n"
    "{% endif %}\n"
    "{% endfor %}"
)
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "zephyr": ZEPHYR}
SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [SYSTEM, {"role": "user", "content": "  What is 2+2?\n"}],
    [SYSTEM, {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"},
     {"role": "user", "content": "Another, with {braces} & <tags>, naïve 漢字?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """Per template: a checkpoint-like directory saved by transformers (tokenizer files + chat_template.jinja)
    and the transformers tokenizer loaded back from it."""
    root = tmp_path_factory.mktemp("chat")
    train_bpe([STDLIB / "shlex.py"], 400, root / "bpe", special_tokens=("<|endoftext|>", "<|im_start|>", "<|im_end|>"))
    out = {}
    for name, template in TEMPLATES.items():
        hf = transformers.AutoTokenizer.from_pretrained(root / "bpe")
        hf.chat_template = template
        hf.save_pretrained(root / name)
        out[name] = (root / name, transformers.AutoTokenizer.from_pretrained(root / name))
    return out


def hf_render(hf_tokenizer, messages, add_generation_prompt: bool) -> str:
    return hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_renders_as_transformers(tokenizers, name: str) -> None:
    directory, hf = tokenizers[name]
    assert (directory / "chat_template.jinja").is_file()
    style = PromptStyle.from_checkpoint(directory, config="Meta-Llama-3-8B-Instruct")  # the template wins
    assert isinstance(style, ChatTemplate) and style.template == TEMPLATES[name]
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = hf_render(hf, messages, add_generation_prompt)
            assert style.apply_chat(messages, add_generation_prompt).encode() == expected.encode()
    assert style.apply("Hi", system=SYSTEM["content"]) == hf_render(hf, [SYSTEM, {"role": "user", "content": "Hi"}], True)


def test_template_in_tokenizer_config(tokenizers, tmp_path) -> None:
    """The older layout: the template inside tokenizer_config.json, also as a list of named templates."""
    directory, hf = tokenizers["chatml"]
    shutil.copy(directory / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    assert read_chat_template(tmp_path) == CHATML
    messages = CONVERSATIONS[2]
    assert ChatTemplate.load(tmp_path).apply_chat(messages) == hf_render(hf, messages, True)
    named = [{"name": "tool_use", "template": "{{ raise_exception('not this one') }}"}, {"name": "default", "template": LLAMA3}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    assert read_chat_template(tmp_path) == LLAMA3
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.load(tmp_path) is None


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_chat_turns_add_up_to_the_conversation(tokenizers, name: str) -> None:
    """What generate/chat.py prefills turn by turn (ChatSession: the first turn, then the reply the model wrote,
    then each next turn) is the template's rendering of the whole conversation."""
    directory, hf = tokenizers[name]
    style = ChatTemplate.load(directory)
    for system in (None, SYSTEM["content"]):
        text = style.turn("Name a prime.", system=system) + "7" + style.next_turn("Another?") + "11"
        text += style.next_turn("  And a third one  ")
        messages = [*([SYSTEM] if system else []), {"role": "user", "content": "Name a prime."},
                    {"role": "assistant", "content": "7"}, {"role": "user", "content": "Another?"},
                    {"role": "assistant", "content": "11"}, {"role": "user", "content": "  And a third one  "}]
        assert text == hf_render(hf, messages, True)


def test_stop_tokens(tokenizers) -> None:
    directory, _ = tokenizers["chatml"]
    style = ChatTemplate.load(directory)
    assert (style.assistant, style.end, style.stop) == ("<|im_start|>assistant\n", "<|im_end|>\n", ("<|im_end|>",))
    assert style.stop_strings == ("<|im_end|>",)  # for an end that is not one token
    tokenizer = Tokenizer(directory)
    assert style.stop_tokens(tokenizer) == [[tokenizer.token_to_id("<|im_end|>")]]
    llama3 = ChatTemplate.load(tokenizers["llama3"][0])
    assert llama3.end == "<|eot_id|>" and llama3.stop_tokens(tokenizer) == []  # not in this vocabulary


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_fine_tuning_pieces(tokenizers, name: str) -> None:
    """Chat records: the pieces are the template's whole conversation, the targets each reply and its end."""
    directory, hf = tokenizers[name]
    style = ChatTemplate.load(directory)
    messages = CONVERSATIONS[2] + [{"role": "assistant", "content": "13"}]
    pieces = segments({"messages": messages}, "record 1", style)
    assert "".join(text for text, _ in pieces) == hf_render(hf, messages, False)
    assert [text for text, target in pieces if target] == ["7" + style.end, "13" + style.end]
    # Alpaca records: the instruction as the user's message
    pieces = segments({"instruction": "Add 2 and 2.", "input": "", "output": "4"}, "record 2", style)
    user = [{"role": "user", "content": "Add 2 and 2."}]
    assert pieces == [(hf_render(hf, user, True), False), ("4" + style.end, True)]
    assert "".join(text for text, _ in pieces) == hf_render(hf, [*user, {"role": "assistant", "content": "4"}], False)


def test_checkpoint_style_precedence(tokenizers, tmp_path) -> None:
    directory, _ = tokenizers["chatml"]
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(directory, checkpoint)
    template = PromptStyle.from_checkpoint(checkpoint, config="Qwen2.5-0.5B-Instruct")
    assert isinstance(template, ChatTemplate)
    template.save(checkpoint)  # what a fine-tuning run writes into final/
    assert (checkpoint / PROMPT_STYLE_FILE).read_text() == "name: chat_template\n"
    assert PromptStyle.from_checkpoint(checkpoint, config="x") == template
    PromptStyle.from_name("alpaca").save(checkpoint)  # a run fine-tuned with --prompt_style alpaca keeps it
    assert isinstance(PromptStyle.from_checkpoint(checkpoint, config="x"), Alpaca)
    (checkpoint / PROMPT_STYLE_FILE).unlink()
    (checkpoint / "chat_template.jinja").unlink()
    assert PromptStyle.from_checkpoint(checkpoint, config="Qwen2.5-0.5B-Instruct").name == "qwen2.5"
    template.save(checkpoint)
    with pytest.raises(UserError, match="fine-tuned with its chat template, but .* has none"):
        PromptStyle.from_checkpoint(checkpoint, config="x")


def test_template_errors(tokenizers, tmp_path) -> None:
    llama3 = ChatTemplate.load(tokenizers["llama3"][0])
    with pytest.raises(UserError, match="refused this conversation: Conversation roles must alternate.*--prompt_style"):
        llama3.apply_chat([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(UserError, match="not valid Jinja"):
        ChatTemplate.load(tmp_path)
    # a template that cannot be prefilled turn by turn (the reply is written before the prompt's end)
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with pytest.raises(UserError, match="turn after turn.*--prompt_style"):
        ChatTemplate.load(tmp_path)
    # the sandbox: no attribute access to interpreter internals
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(UserError, match="unsafe"):
        ChatTemplate.load(tmp_path)


def test_chat_script_renders_with_the_template(tokenizers, tmp_path, monkeypatch) -> None:
    """generate/chat.py on a checkpoint whose template refuses one word: the refusal shows that every message
    goes through the template (and the chat goes on)."""
    guarded = tmp_path / "tokenizer"
    shutil.copytree(tokenizers["chatml"][0], guarded)
    refuse = "{% if messages[-1]['content'] == 'forbidden' %}{{ raise_exception('no forbidden words') }}{% endif %}"
    (guarded / "chat_template.jinja").write_text(refuse + CHATML)
    config = Config(name="tiny-chat", block_size=64, vocab_size=Tokenizer(guarded).vocab_size, n_layer=1, n_embd=32,
                    n_head=2, intermediate_size=64)
    torch.manual_seed(0)
    model = GPT(config)
    checkpoint = save_checkpoint_dir(lit_state_dict(model, config), config, tmp_path / "ckpt", tokenizer_dir=guarded)
    assert (checkpoint / "chat_template.jinja").read_text() == refuse + CHATML  # the checkpoint carries it
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hello\nforbidden\nhi again\n/exit\n"), encoding="utf-8"))
    result = run_script_inprocess("generate/chat.py", "--checkpoint_dir", str(checkpoint), "--max_new_tokens", "3",
                                  "--temperature", "0", "--max_seq_length", "64")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("error:") == 1
    assert "error: The checkpoint's chat template refused this conversation: no forbidden words." in result.stderr
    assert result.stdout.count("\n") == 2  # two replies
