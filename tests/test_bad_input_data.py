"""Bad data and files (corpora, instruction data, tokenizers, caches, prompts, chat input, HF indexes): each
ends with one paragraph naming the problem, exit 1 (a bad input found at run time) or 2 (a bad flag), no
traceback, and nothing written. Bad flags, model configs and --plan are in test_bad_input.py."""

from __future__ import annotations

import io
import json
import os
import stat
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from lit_model import Config
from lit_model.io.convert import config_to_hf
from conftest import run_script, run_script_inprocess

DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError
GARBAGE = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()  # what `head -c 4096 /dev/urandom` gives
IS_ROOT = os.geteuid() == 0  # root reads and writes whatever the permission bits say


def write(relative: str, content: str | bytes) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        path = tmp / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return setup


def both(*setups: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        for each in setups:
            each(tmp)
    return setup


def unreadable(relative: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        write(relative, "some text\n" * 100)(tmp)
        (tmp / relative).chmod(0)
    return setup


def mkdir(relative: str) -> Callable[[Path], None]:
    return lambda tmp: (tmp / relative).mkdir(parents=True)


def read_only_dir(relative: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / relative).mkdir()
        (tmp / relative).chmod(stat.S_IRUSR | stat.S_IXUSR)
    return setup


def hf_dir(index: object) -> Callable[[Path], None]:
    """A Hugging Face directory (a tiny Llama's config.json) whose sharded index is ``index`` (or ``index(tmp)``)."""
    def setup(tmp: Path) -> None:
        config = Config(name="tiny", block_size=32, vocab_size=64, n_layer=1, n_embd=16, n_head=2)
        write("hf/config.json", json.dumps(config_to_hf(config)))(tmp)
        content = index(tmp) if callable(index) else index
        write("hf/model.safetensors.index.json", content if isinstance(content, str) else json.dumps(content))(tmp)
        write("outside.safetensors", b"not read")(tmp)
    return setup


def pretrain(data: str, tokenizer: str = "{tokenizer}") -> tuple[str, ...]:
    return ("pretrain/main.py", "--model_config", "{config}", "--tokenizer_dir", tokenizer, "--data_path", data,
            "--out_dir", "{out}", "--max_steps", "1")


FINETUNE = ("finetune/lora.py", "--checkpoint_dir", "{checkpoint}", "--out_dir", "{out}", "--max_steps", "1")
GENERATE = ("generate/base.py", "--checkpoint_dir", "{checkpoint}", "--max_new_tokens", "2")
CONVERT = ("lit_model/convert.py", "hf_to_lit", "--hf_dir", "{tmp}/hf", "--out_dir", "{out}")
RECORD = {"instruction": "Add two numbers.", "output": "def add(a, b):\n    return a + b"}

# (id, setup of the bad file(s) under tmp, command line, exit status, fragment of the message)
CASES = [
    # ---- pretraining corpora
    ("pretrain-missing-data-path", None, pretrain("{tmp}/nowhere"), 1,
     "nowhere does not exist"),
    ("pretrain-empty-corpus-dir", mkdir("corpus"), pretrain("{tmp}/corpus"), 1,
     "has no usable files"),
    ("pretrain-corpus-smaller-than-a-window", write("tiny.txt", "x = 1\n"), pretrain("{tmp}/tiny.txt"),
     1, "fewer than one window of seq_length + 1 = 65 tokens"),
    ("pretrain-empty-file", write("empty.txt", ""), pretrain("{tmp}/empty.txt"), 1,
     "has 0 tokens, fewer than one window"),
    ("pretrain-binary-garbage-txt", write("garbage.txt", GARBAGE), pretrain("{tmp}/garbage.txt"), 1,
     "garbage.txt is not UTF-8 text"),
    ("pretrain-latin1-file-in-corpus-dir",
     both(write("corpus/a.txt", "def f():\n    pass\n" * 200), write("corpus/b.txt", "caf\xe9\n".encode("latin-1") * 99)),
     pretrain("{tmp}/corpus"), 1, "b.txt is not UTF-8 text (byte 0xe9"),
    ("pretrain-nul-bytes", write("zeros.txt", bytes(4096)), pretrain("{tmp}/zeros.txt"), 1,
     "zeros.txt holds NUL bytes"),
    ("pretrain-deep-json", write("deep.json", DEEP), pretrain("{tmp}/deep.json"), 1,
     "deep.json nests JSON deeper than Python's parser allows"),
    ("pretrain-jsonl-without-text", write("c.jsonl", '{"text": "ok"}\n{"body": "x"}\n'),
     pretrain("{tmp}/c.jsonl"), 1, 'line 2 of {tmp}/c.jsonl has no "text" string field'),
    ("pretrain-jsonl-bad-line", write("c.jsonl", '{"text": "ok"}\n{"text": "ok"}\n{"text": \n'),
     pretrain("{tmp}/c.jsonl"), 1, "Line 3 of {tmp}/c.jsonl is not valid JSON"),
    ("pretrain-unreadable-corpus-file", unreadable("locked.txt"), pretrain("{tmp}/locked.txt"), 1,
     "Cannot read {tmp}/locked.txt: Permission denied"),
    ("pretrain-tokenizer-dir-without-tokenizer", write("tok/readme.md", "no tokenizer here"),
     pretrain("{data}", "{tmp}/tok"), 1,
     "No tokenizer in {tmp}/tok: expected tokenizer.json or tokenizer.model, found readme.md"),
    ("pretrain-tokenizer-dir-is-a-file", write("tok.json", "{}"),
     pretrain("{data}", "{tmp}/tok.json"), 1, "is a file, not a directory"),
    ("pretrain-tokenizer-json-is-a-directory", write("tok/tokenizer.json/x", "x"),
     pretrain("{data}", "{tmp}/tok"), 1, "expected tokenizer.json or"),
    ("pretrain-garbage-tokenizer-json", write("tok/tokenizer.json", GARBAGE),
     pretrain("{data}", "{tmp}/tok"), 1,
     "Could not read the tokenizer file {tmp}/tok/tokenizer.json"),
    ("pretrain-damaged-tokenizer-config", both(write("tok/tokenizer.json", "{}"), write("tok/tokenizer_config.json", DEEP)),
     pretrain("{data}", "{tmp}/tok"), 1, "Could not read {tmp}/tok/tokenizer_config"),
    ("pretrain-cache-is-a-file", write("cache-file", "x"),
     ("LIT_MODEL_CACHE={tmp}/cache-file", *pretrain("{data}")), 1, "set LIT_MODEL_CACHE to a writable"),
    ("pretrain-read-only-cache", read_only_dir("ro-cache"), ("LIT_MODEL_CACHE={tmp}/ro-cache", *pretrain("{data}")), 1,
     "set LIT_MODEL_CACHE to a writable"),
    # ---- instruction data
    ("finetune-missing-data-path", None, (*FINETUNE, "--data_path", "{tmp}/nowhere.json"), 1,
     "nowhere.json does not exist"),
    ("finetune-dir-without-json", write("d/notes.txt", "x"), (*FINETUNE, "--data_path", "{tmp}/d"), 1,
     "holds no .json or .jsonl files"),
    ("finetune-empty-file", write("empty.json", ""), (*FINETUNE, "--data_path", "{tmp}/empty.json"), 1,
     "holds 0 record(s)"),
    ("finetune-deep-json", write("deep.json", DEEP), (*FINETUNE, "--data_path", "{tmp}/deep.json"), 1,
     "deep.json nests JSON deeper"),
    ("finetune-deep-jsonl-line", write("deep.jsonl", json.dumps(RECORD) + "\n" + DEEP + "\n"),
     (*FINETUNE, "--data_path", "{tmp}/deep.jsonl"), 1, "Line 2 of {tmp}/deep.jsonl nests JSON deeper"),
    ("finetune-jsonl-bad-line", write("d.jsonl", json.dumps(RECORD) + "\n\n" + '{"instruction": "x",\n'),
     (*FINETUNE, "--data_path", "{tmp}/d.jsonl"), 1, "Line 3 of {tmp}/d.jsonl is not valid JSON"),
    ("finetune-broken-json-list", write("d.json", json.dumps([RECORD] * 3)[:-1]),
     (*FINETUNE, "--data_path", "{tmp}/d.json"), 1, "d.json is not valid JSON (Expecting"),
    ("finetune-missing-output", write("d.json", json.dumps([RECORD, {"instruction": "x", "reply": "y"}])),
     (*FINETUNE, "--data_path", "{tmp}/d.json"), 1,
     "record 1 of {tmp}/d.json has keys ['instruction', 'reply'], but a record needs"),
    ("finetune-output-not-a-string", write("d.json", json.dumps([RECORD, {**RECORD, "input": "", "output": 5}])),
     (*FINETUNE, "--data_path", "{tmp}/d.json"), 1, "has keys ['input', 'instruction', 'output'] ('output' is a JSON int)"),
    ("finetune-input-a-list", write("d.json", json.dumps([RECORD, {**RECORD, "input": ["a"]}])),
     (*FINETUNE, "--data_path", "{tmp}/d.json"), 1, "('input' is a JSON list)"),
    ("finetune-record-not-an-object", write("d.jsonl", json.dumps(RECORD) + "\n42\n"),
     (*FINETUNE, "--data_path", "{tmp}/d.jsonl"), 1, "line 2 of {tmp}/d.jsonl has a JSON int, not an object"),
    ("finetune-unknown-chat-role", write("d.json", json.dumps([RECORD, {"messages": [
        {"role": "robot", "content": "hi"}, {"role": "assistant", "content": "hello"}]}])),
     (*FINETUNE, "--data_path", "{tmp}/d.json"), 1, "unknown role(s) 'robot'"),
    ("finetune-latin1-json", write("d.json", json.dumps([RECORD, {**RECORD, "output": "caf\xe9"}],
                                                        ensure_ascii=False).encode("latin-1")),
     (*FINETUNE, "--data_path", "{tmp}/d.json"), 1, "d.json is not UTF-8 text"),
    ("finetune-unreadable-file", unreadable("d.json"), (*FINETUNE, "--data_path", "{tmp}/d.json"), 1,
     "Cannot read {tmp}/d.json"),
    # ---- generation flags with bytes that are not UTF-8 (in-process: argv as Python decoded it)
    ("generate-non-utf8-stop", None, (*GENERATE, "--stop", "\udcff\udcfe"), 2, "--stop is not UTF-8 text (byte 0xff"),
    ("pretrain-non-utf8-sample-prompt", None, (*pretrain("{data}"), "--sample_prompt", "def f\udcff():"), 2,
     "--sample_prompt is not UTF-8 text (byte 0xff at character 5)"),
    ("chat-non-utf8-system", None, ("generate/chat.py", "--checkpoint_dir", "{checkpoint}", "--system", "caf\udce9"), 2,
     "--system is not UTF-8 text (byte 0xe9 at character 3)"),
    # ---- Hugging Face indexes
    ("convert-index-climbs-out", hf_dir({"weight_map": {"a": "model-1.safetensors", "b": "../outside.safetensors"}}),
     CONVERT, 1, "points at weight files outside {tmp}/hf (e.g. '../outside.safetensors')"),
    ("convert-index-absolute-path", hf_dir(lambda tmp: {"weight_map": {"a": str(tmp / "outside.safetensors")}}), CONVERT, 1,
     "points at weight files outside"),
    ("convert-index-not-a-string", hf_dir({"weight_map": {"a": ["x.safetensors"]}}), CONVERT, 1,
     "points at weight files outside"),
    ("convert-index-deep", hf_dir(DEEP), CONVERT, 1, "Could not read {tmp}/hf/model.safetensors.index.json"),
    ("convert-index-a-list", hf_dir([1, 2]), CONVERT, 1, "has no weight_map"),
    ("convert-hf-dir-is-a-file", write("hf", "x"), CONVERT, 1, "--hf_dir {tmp}/hf is a file, not a directory"),
]
NEEDS_PERMISSIONS = {"pretrain-unreadable-corpus-file", "pretrain-read-only-cache", "finetune-unreadable-file"}


def snapshot(directory: Path) -> dict[str, bytes] | None:
    if not directory.exists():
        return None
    return {str(p.relative_to(directory)): p.read_bytes() if p.is_file() else b"/" for p in sorted(directory.rglob("*"))}


@pytest.mark.parametrize("name, setup, argv, code, fragment", CASES, ids=[case[0] for case in CASES])
def test_bad_data_is_one_paragraph_without_traceback(name: str, setup, argv: tuple[str, ...], code: int, fragment: str,
                                                     tiny_setup: dict[str, Path], tiny_checkpoint: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if name in NEEDS_PERMISSIONS and IS_ROOT:
        pytest.skip("root ignores permission bits")
    if setup is not None:
        setup(tmp_path)
    places = {"tmp": tmp_path, "out": tmp_path / "out", "checkpoint": tiny_checkpoint, **tiny_setup}
    argv = tuple(arg.format(**places) for arg in argv)
    cache = tmp_path / "cache"
    if argv[0].startswith("LIT_MODEL_CACHE="):  # as on a shell's command line
        cache, argv = Path(argv[0].split("=", 1)[1]), argv[1:]
    before = snapshot(tmp_path / "out")  # None: no script creates out_dir before its inputs are read
    proc = run_script_inprocess(*argv, cache=cache, monkeypatch=monkeypatch)
    message = " ".join(proc.stderr.split())
    assert proc.returncode == code, proc.stderr
    assert fragment.format(**places) in message, proc.stderr
    assert "Traceback" not in proc.stderr and "error: " in proc.stderr
    assert snapshot(tmp_path / "out") == before  # nothing written
    assert not list(cache.rglob("*.tmp"))  # no half-written cache file


def test_read_only_cache_still_serves_a_complete_cache(tiny_setup: dict[str, Path], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache built before (e.g. shared, read-only) is read without a lock; only a build needs to write."""
    from lit_model.data.text import load_pretrain_data
    from lit_model.io.tokenizer import Tokenizer

    monkeypatch.setenv("LIT_MODEL_CACHE", str(tmp_path / "cache"))
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    train, val, _ = load_pretrain_data(tiny_setup["data"], tokenizer, 64)
    for path in (tmp_path / "cache" / "tokens").iterdir():
        if path.suffix == ".lock":
            path.unlink()  # gone, and the directory read-only: a lock could not be taken
    (tmp_path / "cache" / "tokens").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        again, _, _ = load_pretrain_data(tiny_setup["data"], tokenizer, 64)
    finally:
        (tmp_path / "cache" / "tokens").chmod(0o755)
    assert np.array_equal(again.tokens, train.tokens)
    assert not list((tmp_path / "cache" / "tokens").glob("*.lock"))


@pytest.mark.slow
def test_non_utf8_prompt_from_a_real_command_line(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # str arguments are encoded with os.fsencode: "\udcff" becomes the byte 0xff on the real command line
    proc = run_script("generate/base.py", "--checkpoint_dir", tiny_checkpoint, "--prompt", "def f\udcff():",
                      "--max_new_tokens", "2", cache=tmp_path / "cache")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and proc.stdout == ""
    assert "--prompt is not UTF-8 text (byte 0xff at character 5)" in " ".join(proc.stderr.split())


def chat(checkpoint: Path, stdin: bytes | None, monkeypatch: pytest.MonkeyPatch, subprocess: bool = False):
    args = ("generate/chat.py", "--checkpoint_dir", checkpoint, "--max_new_tokens", "3", "--temperature", "0")
    if subprocess:  # latin-1 passes the bytes in unchanged; what comes out is UTF-8
        proc = run_script(*args, input=stdin.decode("latin-1"), encoding="latin-1")
        proc.stdout, proc.stderr = (out.encode("latin-1").decode("utf-8") for out in (proc.stdout, proc.stderr))
        return proc
    piped = None if stdin is None else io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8")  # not a tty
    monkeypatch.setattr(sys, "stdin", piped)
    return run_script_inprocess(*args)


BAD_STDIN = b"hello\n" + GARBAGE.replace(b"\n", b"") + b"\x00\nhello\n"  # binary garbage, a NUL among it


def assert_bad_line_skipped(proc, good) -> None:
    """The two good lines get the same answers as without the bad one between them, which gets one message."""
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout == good.stdout and good.stdout.count("\n") == 2
    assert proc.stderr.count("error: ") == 1 and "Input line 2 is not utf-8 text" in " ".join(proc.stderr.split())


def test_chat_skips_input_lines_that_are_not_text_and_ends_at_eof(tiny_checkpoint: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    good = chat(tiny_checkpoint, b"hello\nhello\n", monkeypatch)
    assert good.returncode == 0, good.stderr
    assert_bad_line_skipped(chat(tiny_checkpoint, BAD_STDIN, monkeypatch), good)
    empty = chat(tiny_checkpoint, b"", monkeypatch)  # no input at all: a clean end
    assert (empty.returncode, empty.stdout, empty.stderr) == (0, "", "")
    closed = chat(tiny_checkpoint, None, monkeypatch)  # started with stdin closed (`<&-`): Python has no sys.stdin
    assert (closed.returncode, closed.stdout, closed.stderr) == (0, "", "")


@pytest.mark.slow
def test_chat_binary_input_through_a_real_pipe(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = chat(tiny_checkpoint, b"hello\nhello\n", monkeypatch)
    assert_bad_line_skipped(chat(tiny_checkpoint, BAD_STDIN, monkeypatch, subprocess=True), good)


def test_generated_text_reaches_a_terminal_that_is_not_utf8(monkeypatch: pytest.MonkeyPatch) -> None:
    from lit_model.infer.stream import stdout_writer

    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))  # e.g. PYTHONIOENCODING=ascii
    stdout_writer("caf\u00e9 \ufffd ok")  # was a UnicodeEncodeError traceback mid-generation
    assert raw.getvalue() == b"caf\\xe9 \\ufffd ok"
