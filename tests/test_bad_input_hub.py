"""Bad input from the Hub and from files a model comes with: a served Hub that breaks (HTTP 500/503, a connection
cut mid-file, a listing with ``../`` names, a server that never answers), config.json values of the wrong type or
of absurd size, a hand-made checkpoint's model_config.yaml, and chat templates that loop, blow up or raise. Each
ends within seconds with one paragraph naming the problem, exit 1 (or 2 for a bad flag), no traceback, and nothing
written: the command runs from an empty working directory whose tree is compared before and after.

The Hub is tests/conftest.py's (``serve``, with ``faults``); nothing reaches the network.
"""

from __future__ import annotations

import io
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from conftest import HUB_REPO as REPO, run_script_inprocess
from lit_model.io.checkpoint import MANIFEST_NAME
from test_bad_input import tree
from test_download import hub_env  # noqa: F401 - the fixture

hub_constants = pytest.importorskip("huggingface_hub.constants")
hub_http = pytest.importorskip("huggingface_hub.utils._http")

DOWNLOAD = "lit_model/download.py"
DEEP = "[" * 200_000 + "]" * 200_000  # json.loads raises RecursionError


def one_paragraph(proc: Any) -> str:
    """The command's error message, checked to be one paragraph and the only one (huggingface_hub's own retry
    warnings may come before it), with no traceback anywhere."""
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.stderr.count("error: ") == 1, proc.stderr
    message = proc.stderr[proc.stderr.index("error: "):].strip()
    assert "\n\n" not in message, message
    return " ".join(message.split())


def edited(change: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], str]:
    """config.json's text after ``change`` edits (or replaces) the tiny Llama's."""
    def text(config: dict[str, Any]) -> str:
        result = change(config)
        return json.dumps(config if result is None else result)
    return text


def with_keys(**values: Any) -> Callable[[dict[str, Any]], str]:
    return edited(lambda config: config.update(values))


def legacy_rope(**values: Any) -> Callable[[dict[str, Any]], str]:
    """transformers 4's layout: rope_theta and rope_scaling at the top level, no rope_parameters."""
    def change(config: dict[str, Any]) -> None:
        config.pop("rope_parameters", None)
        config.update(values)
    return edited(change)


# (id, config.json text from the tiny Llama's, exit status, fragment of the message)
CONFIG_CASES = [
    ("rope_theta-text", legacy_rope(rope_theta="abc"), 1, "config.json: 'rope_theta' is 'abc', which is not a number"),
    ("rope_theta-nested-text", with_keys(rope_parameters={"rope_type": "default", "rope_theta": "abc"}), 1,
     "'rope_theta' is 'abc', which is not a number"),
    ("rope_parameters-list", with_keys(rope_parameters=[10000.0, "default"]), 1,
     "'rope_parameters' is [10000.0, 'default'], which is not a mapping"),
    ("rope_scaling-text", legacy_rope(rope_scaling="llama3"), 1, "'rope_scaling' is 'llama3', which is not a mapping"),
    ("llama3-factor-text", legacy_rope(rope_scaling={"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
     1, "'factor' is '8', which is not a number"),
    ("linear-without-factor", with_keys(rope_parameters={"rope_type": "linear"}), 1, "'factor' is None"),
    ("deep", lambda config: DEEP, 1, "config.json nests too deeply to be a model's config"),
    ("deep-setting", with_keys(custom=json.loads("[" * 900 + "]" * 900)), 1,
     "config.json: 'custom' nests more than 32 levels deep, which no model setting does"),
    ("layers-1e9", lambda config: json.dumps(config).replace('"num_hidden_layers": 2', '"num_hidden_layers": 1e9'), 1,
     "'num_hidden_layers' is 1000000000.0, which is not a positive integer"),
    ("layers-10^9", with_keys(num_hidden_layers=10**9), 1,
     "'num_hidden_layers': 1000000000 is larger than any model lit-model builds (n_layer at most 376"),
    ("layers-0", with_keys(num_hidden_layers=0), 1, "'num_hidden_layers' is 0, which is not a positive integer"),
    ("hidden-10^7", with_keys(hidden_size=10**7), 1, "'hidden_size': 10000000 is larger than any model"),
    ("heads-10^6", with_keys(num_attention_heads=10**6), 1, "'num_attention_heads': 1000000 is larger than any"),
    ("kv-heads-10^6", with_keys(num_key_value_heads=10**6), 1, "'num_key_value_heads': 1000000 is larger than any"),
    ("vocab-10^12", with_keys(vocab_size=10**12), 1, "'vocab_size': 1000000000000 is larger than any model"),
    ("context-10^10", with_keys(max_position_embeddings=10**10), 1, "(block_size at most 4096000"),
    ("intermediate-10^9", with_keys(intermediate_size=10**9), 1, "(intermediate_size at most"),
    ("head_dim-10^6", with_keys(head_dim=10**6), 1, "(head_size at most"),
    ("hidden-text", with_keys(hidden_size="64"), 1, "'hidden_size' is '64', which is not a positive integer"),
    ("hidden-bool", with_keys(hidden_size=True), 1, "'hidden_size' is True, which is not a positive integer"),
    ("tie-text", with_keys(tie_word_embeddings="no"), 1, "'tie_word_embeddings' is 'no', which is not true or false"),
    ("act-list", with_keys(hidden_act=["silu"]), 1, "'hidden_act' is ['silu'], which is not text"),
    ("eps-text", with_keys(rms_norm_eps="1e-5"), 1, "'rms_norm_eps' is '1e-5', which is not a number"),
    ("theta-nan", legacy_rope(rope_theta=float("nan")), 1, "rope_base: nan must be a positive number"),
    ("bias-number", with_keys(attention_bias=1), 1, "'attention_bias' is 1, which is not true or false"),
]


@pytest.fixture
def case_dir(tmp_path, monkeypatch) -> Path:
    """An empty working directory for the command (the Hub's cache lives beside it, under tmp_path)."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def no_backoff(monkeypatch) -> None:
    """huggingface_hub retries with backoff (about 23 s); the test skips the waiting."""
    monkeypatch.setattr(hub_http.time, "sleep", lambda seconds: None)


def refused(work: Path, argv: list[str], code: int, fragment: str) -> Any:
    before = tree(work)
    proc = run_script_inprocess(DOWNLOAD, *argv)
    assert proc.returncode == code, proc.stderr
    message = one_paragraph(proc)
    assert fragment in message, message
    assert tree(work) == before  # no checkpoint directory, nothing half-written
    return proc


@pytest.mark.parametrize("config_text, code, fragment", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_json(tiny_hf, serve, hub_env, case_dir, tmp_path, config_text, code, fragment):  # noqa: F811
    repo = tmp_path / "repo"
    shutil.copytree(tiny_hf[0], repo)
    text = config_text(json.loads((repo / "config.json").read_text()))
    (repo / "config.json").write_text(text)
    hub = serve({REPO: repo})
    hub_env(hub.url)
    refused(case_dir, [REPO, "--checkpoint_dir", "ckpt"], code, fragment)
    assert hub.fetched == ["config.json"]  # refused before the weights


# (id, faults planted in the Hub, exit status, fragment of the message)
HUB_CASES = [
    ("dotdot-sibling", {"model-x/../../../../escaped-of-1.safetensors": 404}, 1,
     "lists a file named 'model-x/../../../../escaped-of-1.safetensors', which would be written outside the download"),
    ("absolute-sibling", {"/tmp/escaped.json": 404}, 1, "which would be written outside the download cache"),
    ("cut-mid-file", {"model.safetensors": "close"}, 1,
     "the connection to the Hugging Face Hub broke off or stopped answering (RemoteProtocolError"),
    ("config-500", {"config.json": 500}, 1, "the Hugging Face Hub answered HTTP 500 (Internal Server Error)"),
    ("config-503", {"config.json": 503}, 1, "answered HTTP 503 (Service Unavailable), a failure on the Hub's side"),
    ("listing-500", {"api": 500}, 1, "failed: the Hugging Face Hub answered HTTP 500 (Internal Server Error)"),
    ("listing-503", {"api": 503}, 1, "failed: the Hugging Face Hub answered HTTP 503 (Service Unavailable)"),
    ("weights-500", {"model.safetensors": 500}, 1, "HTTP 500 (Internal Server Error)"),
    ("tokenizer-503", {"tokenizer.json": 503}, 1, "HTTP 503 (Service Unavailable)"),
    ("listing-429", {"api": 429}, 1, "answered HTTP 429 (Too Many Requests)"),
]


@pytest.mark.parametrize("faults, code, fragment", [c[1:] for c in HUB_CASES], ids=[c[0] for c in HUB_CASES])
def test_hub_that_breaks(tiny_hf, serve, hub_env, case_dir, no_backoff, faults, code, fragment):  # noqa: F811
    hub = serve({REPO: tiny_hf[0]}, faults=faults)
    hub_env(hub.url)
    refused(case_dir, [REPO, "--checkpoint_dir", "ckpt"], code, fragment)


# (argv, exit status, fragment): repository ids and checkpoint directories refused before the Hub is asked
ARGV_CASES = [
    (["../escape"], 2, "'../escape' is not a valid Hugging Face repository id"),
    (["org/.."], 2, "'org/..' is not a valid Hugging Face repository id"),
    (["org/na me"], 2, "ORG and NAME hold only letters, digits"),
    (["org/-name"], 2, "not at either end"),
    (["org/a--b"], 2, "no '..' or '--'"),
    ([REPO, "--checkpoint_dir", "FILE/ckpt"], 2, "--checkpoint_dir FILE/ckpt: FILE is a file, so no directory can be"),
    ([REPO, "--checkpoint_dir", "FILE"], 2, "--checkpoint_dir FILE is a file, not a directory"),
    ([REPO, "--checkpoint_dir", "/proc/1/ckpt"], 2, "/proc/1 is not writable by this user"),
]


@pytest.mark.parametrize("argv, code, fragment", ARGV_CASES, ids=[" ".join(c[0]) for c in ARGV_CASES])
def test_bad_repo_id_or_checkpoint_dir(tiny_hf, serve, hub_env, case_dir, argv, code, fragment):  # noqa: F811
    (case_dir / "FILE").write_text("not a directory\n")
    hub = serve({REPO: tiny_hf[0]})
    hub_env(hub.url)
    refused(case_dir, argv, code, fragment)
    assert hub.fetched == []  # not a byte fetched: a checkpoint that cannot be written is found first


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_checkpoint_parent(tiny_hf, serve, hub_env, case_dir):  # noqa: F811
    (case_dir / "ro").mkdir()
    (case_dir / "ro").chmod(0o555)
    hub = serve({REPO: tiny_hf[0]})
    hub_env(hub.url)
    try:
        refused(case_dir, [REPO, "--checkpoint_dir", "ro/ckpt"], 2, "ro is not writable by this user")
    finally:
        (case_dir / "ro").chmod(0o755)
    assert hub.fetched == []


def test_a_server_that_never_answers_ends_within_seconds(tiny_hf, serve, hub_env, case_dir, no_backoff,  # noqa: F811
                                                         monkeypatch):
    """huggingface_hub lists a repository with no timeout at all; every request is bounded by
    HF_HUB_DOWNLOAD_TIMEOUT (here 1 s)."""
    monkeypatch.setattr(hub_constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    hub = serve({REPO: tiny_hf[0]}, faults={"api": "hang"})
    hub_env(hub.url)
    start = time.monotonic()
    refused(case_dir, [REPO, "--checkpoint_dir", "ckpt"], 1, "broke off or stopped answering (ReadTimeout")
    assert time.monotonic() - start < 10


def hand_made(checkpoint: Path, work: Path, files: dict[str, bytes]) -> None:
    """work/ckpt: a copy of ``checkpoint`` with ``files`` written into it, and no manifest (made by hand: none
    vouches for, or against, its files)."""
    shutil.copytree(checkpoint, work / "ckpt")
    (work / "ckpt" / MANIFEST_NAME).unlink()
    for name, content in files.items():
        (work / "ckpt" / name).write_bytes(content)


def model_config(text: Optional[str] = None, **fields: Any) -> Callable[[str], str]:
    def change(original: str) -> str:
        if text is not None:
            return text
        import yaml

        data = yaml.safe_load(original)
        data.update(fields)
        return yaml.safe_dump(data)
    return change


# A hand-made lit checkpoint is the same attack as a config.json: (id, model_config.yaml from the tiny one's,
# fragment of the message); each refused with exit 2 before a model is built
CHECKPOINT_CASES = [
    ("layers-10^9", model_config(n_layer=10**9), "n_layer: 1000000000 is larger than any model lit-model builds"),
    ("embd-10^7", model_config(n_embd=10**7, n_head=1), "n_embd: 10000000 is larger than any model"),
    ("vocab-10^12", model_config(vocab_size=10**12, padded_vocab_size=10**12), "vocab_size: 1000000000000 is larger"),
    ("context-10^10", model_config(block_size=10**10), "block_size: 10000000000 is larger"),
    ("experts-10^6", model_config(n_expert=10**6, n_expert_per_token=2, mlp_class_name="LLaMAMoE"),
     "n_expert: 1000000 is larger"),
    ("deep", model_config("a: " + "[" * 200_000 + "]" * 200_000), "nests too deeply to be a model config"),
]


@pytest.mark.parametrize("change, fragment", [c[1:] for c in CHECKPOINT_CASES], ids=[c[0] for c in CHECKPOINT_CASES])
@pytest.mark.parametrize("script", ["generate/base.py", "lit_model/convert.py"])
def test_hand_made_checkpoint_config(tiny_checkpoint, case_dir, script, change, fragment):
    path = tiny_checkpoint / "model_config.yaml"
    hand_made(tiny_checkpoint, case_dir, {"model_config.yaml": change(path.read_text()).encode()})
    argv = ["lit_to_hf", "--checkpoint_dir", "ckpt", "--out_dir", "out"] if "convert" in script else \
        ["--checkpoint_dir", "ckpt", "--max_new_tokens", "1"]
    before = tree(case_dir)
    proc = run_script_inprocess(script, *argv)
    assert proc.returncode == 2, proc.stderr
    assert fragment in one_paragraph(proc)
    assert tree(case_dir) == before


NESTED_RANGE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# (id, chat_template.jinja, fragment of the message): generate/chat.py refuses the checkpoint's template when it
# loads it (it renders a probe conversation), exit 1, within seconds
TEMPLATE_CASES = [
    ("nested-range", NESTED_RANGE, "was stopped after 3 s of rendering"),
    ("range-10^10", "{{ range(10**10) | list }}", "it calls safe_range with 10000000000, larger than any chat template needs"),
    ("range-10^6", "{{ range(10**6) | list | length }}", "(OverflowError: Range too big."),
    ("lipsum", "{{ lipsum(n=1000000) }}", "failed while rendering (UndefinedError: 'lipsum' is undefined)"),
    ("zero-division", "{{ 1 // 0 }}", "failed while rendering (ZeroDivisionError: integer division or modulo by zero)"),
    ("type", "{{ 'a' + 1 }}", "(TypeError: can only concatenate str"),
    ("recursion", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "(RecursionError: maximum recursion depth"),
    ("float-overflow", "{{ 10.0 ** 400 }}", "(OverflowError:"),
    ("memory", "{{ '%99999999999d' % 1 }}", "(MemoryError:"),
    ("huge-string", "{{ 'x' * 10**12 }}", "was stopped: it computes 'x' * '1000000000000', a value larger than"),
    ("huge-list", "{{ ([0] * 10**9) | length }}", "a value larger than any chat template needs"),
    ("huge-power", "{{ 10 ** 10000000 }}", "it computes '10' ** '10000000'"),
    ("squaring", "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
     "a value larger than any chat template needs"),
    ("center-filter", "{{ 'x' | center(10**10) }}", "it calls do_center with 10000000000, larger than any chat"),
    ("center-method", "{{ 'x'.center(10**10) }}", "it calls center with 10000000000"),
    ("indent-filter", "{{ 'x' | indent(10**10) }}", "it calls do_indent with 10000000000"),
    ("megabytes", "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "it wrote more than 33554432 characters"),
]


# prompt_style.yaml, which fine-tuning saves beside a checkpoint, written by hand: (id, its bytes)
PROMPT_STYLE_CASES = [
    ("invalid-yaml", b"name: [alpaca\n"),
    ("a-list", b"- alpaca\n"),
    ("name-a-number", b"name: 5\n"),
    ("not-utf8", b"name: \xff\xfe\n"),
    ("deep", ("name: " + "[" * 200_000 + "]" * 200_000).encode()),
]


def chat_refuses(checkpoint: Path, files: dict[str, bytes], fragment: str, monkeypatch: Any) -> None:
    """generate/chat.py on a copy of ``checkpoint`` with ``files`` added: exit 1 within seconds, one paragraph
    with ``fragment`` and the --prompt_style fix, nothing written."""
    work = Path.cwd()
    hand_made(checkpoint, work, files)
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n/exit\n"))
    before = tree(work)
    start = time.monotonic()
    proc = run_script_inprocess("generate/chat.py", "--checkpoint_dir", "ckpt", "--max_new_tokens", "1")
    assert time.monotonic() - start < 10
    assert proc.returncode == 1, proc.stderr
    message = one_paragraph(proc)
    assert fragment in message and "--prompt_style" in message, message
    assert tree(work) == before


@pytest.mark.parametrize("content", [c[1] for c in PROMPT_STYLE_CASES], ids=[c[0] for c in PROMPT_STYLE_CASES])
def test_bad_prompt_style_file(tiny_checkpoint, case_dir, monkeypatch, content):
    chat_refuses(tiny_checkpoint, {"prompt_style.yaml": content}, "prompt_style.yaml does not hold a prompt style",
                 monkeypatch)


@pytest.mark.parametrize("template, fragment", [c[1:] for c in TEMPLATE_CASES], ids=[c[0] for c in TEMPLATE_CASES])
def test_bad_chat_template(tiny_checkpoint, case_dir, monkeypatch, template, fragment):
    chat_refuses(tiny_checkpoint, {"chat_template.jinja": template.encode()}, fragment, monkeypatch)


def test_render_time_limit_off_the_main_thread():
    """The time limit needs no signal: a rendering in another thread (a server's) is stopped too, the next one
    renders normally, and no timer thread is left behind."""
    from lit_model.core.errors import UserError
    from lit_model.io.chat_template import render

    outcome: list[BaseException] = []

    def chat() -> None:
        try:
            render(NESTED_RANGE, [], True, {})
        except UserError as error:
            outcome.append(error)

    threads = set(threading.enumerate())
    worker = threading.Thread(target=chat)
    start = time.monotonic()
    worker.start()
    worker.join(10)
    assert not worker.is_alive() and time.monotonic() - start < 10
    assert "was stopped after 3 s of rendering" in str(outcome[0])
    assert render("{% for m in messages %}{{ m.content }}{% endfor %}", [{"role": "user", "content": "hi"}], True,
                  {}) == "hi"
    time.sleep(0.1)
    assert set(threading.enumerate()) <= threads
