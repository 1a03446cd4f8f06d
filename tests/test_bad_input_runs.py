"""Training runs against bad inputs and a hostile environment: a second run on an out_dir in use, a resume whose data,
data-shaping flags or base checkpoint changed, a damaged LoRA state, ragged tables, hub datasets that cannot be
fetched, and logger servers that do not answer. Each ends with one paragraph (exit 1 or 2), no traceback, nothing
written or mixed; a wait ends within seconds.

Most cases run the scripts in this process (``run_script_inprocess``) on the tiny checkpoint of test_finetune.py;
the races with a real second process are marked slow."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from conftest import ROOT, read_metrics, run_script_inprocess
from test_bad_input import tree
from test_bad_input_data import RECORD, write
import test_finetune
import test_signals
from test_finetune import make_checkpoint
from test_signals import environment, read_until, start, train_args
from lit_model.data import sources
from lit_model.io.checkpoint import write_manifest
from lit_model.train import loggers
from lit_model.train.resumable import CHECKPOINTS, DATA_ORDER_NAME, LOCK_NAME, out_dir_lock

ft = test_finetune.ft  # fixtures: the session's tiny checkpoint and instruction data; a slower model for races
slow_setup = test_signals.slow_setup
SCRIPTS = ("pretrain/main.py", "finetune/full.py", "finetune/lora.py", "finetune/adapter.py", "finetune/dpo.py")
SMALL = ("--micro_batch_size", "2", "--global_batch_size", "4", "--eval_iters", "1", "--log_interval", "1",
         "--warmup_steps", "1", "--rehearse", "false")


def run_with(env: dict[str, str], script: str, *args: Any, timeout: float = 300) -> subprocess.CompletedProcess:
    """``script`` in a new interpreter with exactly ``env``."""
    return subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=timeout)


def one_paragraph(proc: subprocess.CompletedProcess, code: int, fragment: str) -> str:
    message = " ".join(proc.stderr.split())
    assert proc.returncode == code, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert fragment in message, message
    assert "Traceback" not in proc.stderr + proc.stdout and "error: " in proc.stderr
    return message


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Add {a} and 1.", "chosen": str(a + 1), "rejected": str(a)}) + "\n"
                            for a in range(24)))
    return path


def command(script: str, out: Path, ft: dict[str, Path], tiny_setup: dict[str, Path], pairs: Path, *extra: str) -> list[str]:
    """A valid, tiny run of ``script`` into ``out``."""
    if script == "pretrain/main.py":
        return [str(a) for a in train_args(tiny_setup, out, "--max_steps", "1", "--global_batch_size", "2", "--eval_iters", "1",
                                             "--rehearse", "false", *extra)]
    data = pairs if script == "finetune/dpo.py" else ft["data"]
    return [script, "--checkpoint_dir", str(ft["base"]), "--data_path", str(data), "--out_dir", str(out),
            "--max_steps", "1", *SMALL, *extra]


# ---- 1. one run per out_dir ------------------------------------------------------------------------------
@pytest.mark.parametrize("script", SCRIPTS)
def test_a_second_run_on_an_out_dir_in_use_stops_naming_the_first(script, ft, tiny_setup, pairs_file, tmp_path,
                                                                 monkeypatch):
    out = tmp_path / "out"
    with out_dir_lock(out):  # the first run, in this process (flock: another open of the file is another owner)
        before = tree(out)
        proc = run_script_inprocess(*command(script, out, ft, tiny_setup, pairs_file), cache=ft["cache"],
                                    monkeypatch=monkeypatch)
        one_paragraph(proc, 1, f"{out} is in use by another run (PID {os.getpid()} on {socket.gethostname()}, started ")
        assert "Wait for that run to end (or stop it), or pick another --out_dir" in " ".join(proc.stderr.split())
        assert tree(out) == before  # nothing written, the holder's lock file untouched
    assert not out.exists()  # the first run's lock went with it, and the directory it made for it


def test_the_lock_leaves_an_existing_out_dir_and_a_run_leaves_no_lock_file(ft, tiny_setup, pairs_file, tmp_path,
                                                                           monkeypatch):
    out = tmp_path / "out"
    (out / "notes.txt").parent.mkdir()
    (out / "notes.txt").write_text("mine\n")
    proc = run_script_inprocess(*command("finetune/lora.py", out, ft, tiny_setup, pairs_file), cache=ft["cache"],
                                monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert (out / "notes.txt").read_text() == "mine\n" and not (out / LOCK_NAME).exists() and (out / "final").is_dir()


@pytest.mark.slow
def test_two_runs_started_together_do_not_mix_and_a_killed_run_resumes(slow_setup, tmp_path):
    out = tmp_path / "out"
    first = start(slow_setup, out, "--max_steps", "200", "--global_batch_size", "2", "--save_interval", "2")
    try:
        read_until(first, "Training ")  # past the out_dir check; its first step a moment later
        second = run_with(environment(slow_setup), *train_args(slow_setup, out, "--max_steps", "2"))
        one_paragraph(second, 1, f"{out} is in use by another run (PID {first.pid} on ")
        assert "Saved" not in second.stdout and first.poll() is None
        while not list((out / CHECKPOINTS).glob("step-*/state.pt")):
            assert first.poll() is None, first.stderr.read()[-3000:]
            time.sleep(0.05)
        first.kill()  # SIGKILL: the lock file stays, the lock goes with the process
        first.wait(timeout=60)
    finally:
        first.kill()
    assert (out / LOCK_NAME).exists()
    last = max(int(p.name.split("-")[1]) for p in (out / CHECKPOINTS).glob("step-*"))
    resumed = run_with(environment(slow_setup), *train_args(slow_setup, out, "--max_steps", str(last + 1),
                                                            "--global_batch_size", "2", "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stdout and "Saved" in resumed.stdout
    steps = [int(row["step"]) for row in read_metrics(out)]
    assert steps == sorted(set(steps)) and steps[-1] == last + 1  # one run's rows, in order
    assert not (out / LOCK_NAME).exists()


# ---- 2. a resume checks what decides the samples, the targets and the model ------------------------------
@pytest.fixture(scope="module")
def lora_run(ft, tmp_path_factory) -> dict[str, Path]:
    """A 2-step LoRA run that saved a checkpoint at each step, on its own copy of the data."""
    root = tmp_path_factory.mktemp("lora-run")
    shutil.copy(ft["data"], root / "data.jsonl")
    argv = ["finetune/lora.py", "--checkpoint_dir", str(ft["base"]), "--data_path", str(root / "data.jsonl"),
            "--out_dir", str(root / "out"), "--max_steps", "2", "--save_interval", "1", *SMALL]
    with pytest.MonkeyPatch.context() as monkeypatch:
        proc = run_script_inprocess(*argv, cache=ft["cache"], monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "out": root / "out", "data": root / "data.jsonl", "argv": argv}


def resume(run: dict[str, Any], out: Path, **changes: str) -> list[str]:
    """The run's command line resuming into ``out``, with flags changed (or added)."""
    argv, values = list(run["argv"]), {"--out_dir": str(out), "--resume": "auto", "--max_steps": "4", **changes}
    for flag, value in values.items():
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return argv


@contextlib.contextmanager
def appended(path: Path, text: str) -> Iterator[None]:
    original = path.read_bytes()
    path.write_bytes(original + text.encode())
    try:
        yield
    finally:
        path.write_bytes(original)


def another_base(ft: dict[str, Path], tmp: Path) -> dict[str, str]:
    """A checkpoint of the same config as the run's base, other weights."""
    return {"--checkpoint_dir": str(make_checkpoint(tmp / "base2", ft["tokenizer"], seed=1))}


RESUME_CASES = [
    ("data-content-changed", None, "--data_path {data} holds other content than the checkpoint's run had (SHA-256 now"),
    ("prompt-style", lambda ft, tmp: {"--prompt_style": "chatml"}, "--prompt_style chatml (the checkpoint's run: None)"),
    ("mask-prompt", lambda ft, tmp: {"--mask_prompt": "false"}, "--mask_prompt False (the checkpoint's run: True)"),
    ("data-fields", lambda ft, tmp: {"--data_fields": "instruction=instruction,output=output"},
     "--data_fields instruction=instruction,output=output (the checkpoint's run: None)"),
    ("packing", lambda ft, tmp: {"--packing": "true"}, "--packing True (the checkpoint's run: False)"),
    ("lora-alpha", lambda ft, tmp: {"--lora_alpha": "32"}, "--lora_alpha 32.0 (the checkpoint's run: 16.0)"),
    ("another-base-checkpoint", another_base, "--checkpoint_dir {tmp}/base2 holds other content than the checkpoint's"),
]


@pytest.mark.parametrize("name, change, fragment", RESUME_CASES, ids=[case[0] for case in RESUME_CASES])
def test_a_resume_with_other_data_flags_or_base_is_refused(name, change, fragment, lora_run, ft, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(lora_run["out"], out)
    before = tree(out)
    changes = change(ft, tmp_path) if change is not None else {}
    with appended(lora_run["data"], json.dumps(RECORD) + "\n") if change is None else contextlib.nullcontext():
        proc = run_script_inprocess(*resume(lora_run, out, **changes), cache=ft["cache"], monkeypatch=monkeypatch)
    message = one_paragraph(proc, 2, fragment.format(data=lora_run["data"], tmp=tmp_path))
    assert f"--resume {out / CHECKPOINTS}/step-00000002: " in message
    assert "Resume with that run's values and files, or start over with --overwrite or another --out_dir" in message
    assert tree(out) == before  # nothing resumed, moved or written


def test_a_resume_of_an_older_checkpoint_without_the_new_records_still_works(lora_run, ft, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(lora_run["out"], out)
    older = ("data_path", "global_batch_size", "seed", "override_max_seq_length", "val_split_fraction", "packing")
    for checkpoint in (out / CHECKPOINTS).glob("step-*"):
        order = json.loads((checkpoint / DATA_ORDER_NAME).read_text())
        (checkpoint / DATA_ORDER_NAME).write_text(json.dumps({k: order[k] for k in older}))  # as an older version wrote it
        write_manifest(checkpoint)
    proc = run_script_inprocess(*resume(lora_run, out), cache=ft["cache"], monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert "does not record data, data_fields, prompt_style, mask_prompt, lora_alpha, data_sha256, base_checkpoint_sha256 (an " \
           "older version wrote it): resuming without checking them" in " ".join(proc.stderr.split())
    assert [row["step"] for row in read_metrics(out)][-1] == "4"


def test_a_pretraining_resume_on_changed_corpus_files_is_refused(tiny_setup, tmp_path, monkeypatch):
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(tiny_setup["data"], data)
    setup = {**tiny_setup, "data": data}
    argv = [str(a) for a in train_args(setup, out, "--max_steps", "1", "--global_batch_size", "2")]
    cache = tmp_path / "cache"
    assert run_script_inprocess(*argv, cache=cache, monkeypatch=monkeypatch).returncode == 0
    with open(data / "shlex.txt", "a") as handle:
        handle.write("# one more line\n")
    before = tree(out)
    proc = run_script_inprocess(*argv, "--resume", "auto", "--max_steps", "2", cache=cache, monkeypatch=monkeypatch)
    one_paragraph(proc, 2, f"--data_path {data} holds other content than the checkpoint's run had")
    assert tree(out) == before


# ---- 3. a damaged LoRA state is a message, loaded with weights_only ----------------------------------------
def test_a_damaged_lora_state_without_manifest_is_one_paragraph(lora_run, ft, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shutil.copytree(lora_run["out"], out)
    checkpoint = out / CHECKPOINTS / "step-00000002"
    (checkpoint / "manifest.json").unlink()  # as an older version wrote it
    state = checkpoint / "state.pt"
    state.write_bytes(state.read_bytes()[:1000])
    before = tree(out)
    proc = run_script_inprocess(*resume(lora_run, out), cache=ft["cache"], monkeypatch=monkeypatch)
    one_paragraph(proc, 1, f"{state} could not be loaded (")
    assert "it is damaged, or its run differs from this one" in " ".join(proc.stderr.split())
    assert tree(out) == before


# ---- 4. tables whose rows do not fit their header, and hub datasets that cannot be fetched ------------------
def parquet(relative: str, rows: list[dict[str, Any]]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        import datasets

        datasets.Dataset.from_list(rows).to_parquet(str(tmp / relative))
    return setup


def finetune_on(data: str, script: str = "finetune/lora.py") -> tuple[str, ...]:
    return (script, "--checkpoint_dir", "{checkpoint}", "--out_dir", "{out}", "--max_steps", "1", "--data_path", data)


PAIR = {"prompt": "Add 1 and 2.", "chosen": "3", "rejected": "4"}
TABLE_CASES = [
    ("csv-long-row-then-short-rows", write("d.csv", "instruction,output\na,b,c,d,e\nx\ny\n"), finetune_on("{tmp}/d.csv"),
     "Line 2 of {tmp}/d.csv has 5 field(s) where the header has 2 (instruction, output)"),
    ("csv-short-row", write("d.csv", "instruction,output\nAdd 1 and 2.,3\nAdd 2 and 2.\n"), finetune_on("{tmp}/d.csv"),
     "Line 3 of {tmp}/d.csv has 1 field(s) where the header has 2"),
    ("csv-row-after-a-quoted-multiline-field", write("d.csv", 'instruction,output\n"Add\n1 and 2.",3\nAdd, 2 and 2.,4\n'),
     finetune_on("{tmp}/d.csv"), "Line 4 of {tmp}/d.csv has 3 field(s)"),
    ("csv-unquoted-comma", write("d.csv", "instruction,input,output\nSum these.,1, 2,3\n"), finetune_on("{tmp}/d.csv"),
     "a comma inside a field needs the field in double quotes"),
    ("tsv-ragged-row", write("d.tsv", "instruction\toutput\na\tb\nc\td\te\n"), finetune_on("{tmp}/d.tsv"),
     "Line 3 of {tmp}/d.tsv has 3 field(s) where the header has 2"),
    ("csv-in-a-directory", lambda tmp: (write("d/a.jsonl", json.dumps(RECORD) + "\n")(tmp),
                                        write("d/b.csv", "instruction,output\na,b,c\n")(tmp)),
     finetune_on("{tmp}/d"), "Line 2 of {tmp}/d/b.csv has 3 field(s)"),
    ("full-csv-ragged", write("d.csv", "instruction,output\na,b\nc,d,e\n"), finetune_on("{tmp}/d.csv", "finetune/full.py"),
     "Line 3 of {tmp}/d.csv has 3 field(s)"),
    ("dpo-csv-ragged", write("p.csv", "prompt,chosen,rejected\nAdd 1 and 2.,3,4\nAdd 2, and 2.,4,5\n"),
     finetune_on("{tmp}/p.csv", "finetune/dpo.py"), "Line 3 of {tmp}/p.csv has 4 field(s) where the header has 3"),
    ("pretrain-csv-ragged", write("c.csv", "text\nhello there\na,b\n"),
     ("pretrain/main.py", "--model_config", "{config}", "--tokenizer_dir", "{tokenizer}", "--out_dir", "{out}",
      "--data_path", "{tmp}/c.csv"), "Line 3 of {tmp}/c.csv has 2 field(s) where the header has 1 (text)"),
    ("jsonl-list-row", write("d.jsonl", json.dumps(RECORD) + "\n[1, 2]\n"), finetune_on("{tmp}/d.jsonl"),
     "line 2 of {tmp}/d.jsonl has a JSON list, not an object"),
    ("jsonl-string-row", write("d.jsonl", json.dumps(RECORD) + '\n"Add 1 and 2."\n'), finetune_on("{tmp}/d.jsonl"),
     "line 2 of {tmp}/d.jsonl has a JSON str, not an object"),
    ("jsonl-null-row", write("d.jsonl", json.dumps(RECORD) + "\nnull\n"), finetune_on("{tmp}/d.jsonl"),
     "line 2 of {tmp}/d.jsonl has a JSON NoneType, not an object"),
    ("dpo-jsonl-list-row", write("p.jsonl", json.dumps(PAIR) + "\n[1]\n"), finetune_on("{tmp}/p.jsonl", "finetune/dpo.py"),
     "a JSON list"),
    ("parquet-int-output", parquet("d.parquet", [{"instruction": f"Add {a} and 2.", "output": a + 2} for a in range(3)]),
     finetune_on("{tmp}/d.parquet"), "{tmp}/d.parquet row 0 has keys ['instruction', 'output'] ('output' is a JSON int)"),
    ("parquet-without-the-fields", parquet("d.parquet", [{"question": f"Add {a} and 2.", "reply": "3"} for a in range(3)]),
     finetune_on("{tmp}/d.parquet"), "{tmp}/d.parquet row 0 has keys ['question', 'reply']"),
]


@pytest.mark.parametrize("name, setup, argv, fragment", TABLE_CASES, ids=[case[0] for case in TABLE_CASES])
def test_a_table_row_that_does_not_fit_is_named(name, setup, argv, fragment, tiny_setup, tiny_checkpoint, tmp_path,
                                               monkeypatch):
    setup(tmp_path)
    places = {"tmp": tmp_path, "out": tmp_path / "out", "checkpoint": tiny_checkpoint, **tiny_setup}
    proc = run_script_inprocess(*(arg.format(**places) for arg in argv), cache=tmp_path / "cache", monkeypatch=monkeypatch)
    one_paragraph(proc, 1, fragment.format(**places))
    assert not (tmp_path / "out").exists()


def script_dataset(tmp: Path) -> str:
    (tmp / "scripted").mkdir()
    (tmp / "scripted" / "scripted.py").write_text("import datasets\n")
    return str(tmp / "scripted")


HUB_CASES = [
    ("loading-script", script_dataset, "{repo} is read by a loading script (Dataset scripts are no longer supported"),
    ("invalid-repo-id", lambda tmp: "bad//id..", "{repo} is neither a local dataset nor a dataset on the hub"),
]


@pytest.mark.parametrize("name, repo, fragment", HUB_CASES, ids=[case[0] for case in HUB_CASES])
def test_a_hub_dataset_that_cannot_be_read_is_one_paragraph(name, repo, fragment, tiny_checkpoint, tmp_path, monkeypatch):
    import datasets

    where = repo(tmp_path)
    monkeypatch.setattr(sources, "hub_repo", lambda name: where)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.chdir(tmp_path)
    proc = run_script_inprocess("finetune/lora.py", "--checkpoint_dir", str(tiny_checkpoint), "--data", "alpaca",
                                "--out_dir", str(tmp_path / "out"), cache=tmp_path / "cache", monkeypatch=monkeypatch)
    one_paragraph(proc, 1, f"--data alpaca: {fragment.format(repo=where)}")
    assert not (tmp_path / "out").exists()


class Unavailable(BaseHTTPRequestHandler):
    def do_HEAD(self) -> None:
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def server(handler: type) -> Iterator[str]:
    """An HTTP server on 127.0.0.1 answering with ``handler``; its URL."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.mark.slow  # huggingface_hub retries a 5xx answer 5 times with backoff: ~23 s
def test_a_hub_answering_503_is_one_paragraph_naming_the_status(tiny_checkpoint, tmp_path):
    with server(Unavailable) as url:
        env = {**os.environ, "HF_ENDPOINT": url, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "0",
               "HF_DATASETS_CACHE": str(tmp_path / "hf-cache"), "LIT_MODEL_CACHE": str(tmp_path / "cache")}
        env.pop("HF_TOKEN", None)
        proc = run_with(env, "finetune/lora.py", "--checkpoint_dir", tiny_checkpoint, "--data", "alpaca", "--out_dir",
                        tmp_path / "out", timeout=120)
    one_paragraph(proc, 1, "--data alpaca: the Hugging Face hub answered HTTP 503 for tatsu-lab/alpaca (the hub is "
                           "down or overloaded: try again later)")
    assert not (tmp_path / "out").exists()


# ---- 5. loggers whose server does not answer ----------------------------------------------------------------
@contextlib.contextmanager
def within(seconds: float) -> Iterator[None]:
    """Fail (TimeoutError raised where the run waits) if the block takes longer than ``seconds``."""
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"still waiting after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def silent_server() -> Iterator[str]:
    """A server that accepts connections and never answers; its URL."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


LOGGER_CASES = [
    ("mlflow-refused", "mlflow", {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, "pretrain/main.py",
     "--logger mlflow: MLFLOW_TRACKING_URI=http://127.0.0.1:9 does not answer ("),
    ("mlflow-refused-lora", "mlflow", {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, "finetune/lora.py",
     "unset it (a file store in out_dir/logs/mlflow), or drop mlflow from --logger (metrics.csv is written either way)"),
    ("mlflow-refused-dpo", "mlflow", {"MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}, "finetune/dpo.py",
     "--logger mlflow: MLFLOW_TRACKING_URI=http://127.0.0.1:9 does not answer ("),
    ("mlflow-silent", "mlflow", {"MLFLOW_TRACKING_URI": "SILENT"}, "finetune/full.py",
     "does not answer (timed out; waited at most 3 s)"),
    ("wandb-online-refused", "wandb", {"WANDB_API_KEY": "x" * 40, "WANDB_MODE": "online", "WANDB_BASE_URL": "http://127.0.0.1:9"},
     "finetune/adapter.py", "--logger wandb: WANDB_BASE_URL=http://127.0.0.1:9 does not answer ("),
]


@pytest.mark.parametrize("name, logger, variables, script, fragment", LOGGER_CASES, ids=[case[0] for case in LOGGER_CASES])
def test_a_logger_server_that_does_not_answer_stops_the_run_within_seconds(name, logger, variables, script, fragment, ft,
                                                                           tiny_setup, pairs_file, tmp_path, monkeypatch):
    pytest.importorskip(logger)
    out = tmp_path / "out"
    with silent_server() as silent:
        for variable, value in variables.items():
            monkeypatch.setenv(variable, silent if value == "SILENT" else value)
        started = time.monotonic()
        with within(20):  # before the fix: minutes of MLflow's retries
            proc = run_script_inprocess(*command(script, out, ft, tiny_setup, pairs_file, "--logger", f"csv,{logger}"),
                                        cache=ft["cache"], monkeypatch=monkeypatch)
    assert time.monotonic() - started < 10
    one_paragraph(proc, 1, fragment)
    assert not out.exists()


class Failing:
    """A Lightning logger whose server went away after the run started."""

    def __init__(self) -> None:
        self.rows, self.finalized = 0, []

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows += 1
        if step >= 2:
            raise ConnectionError("server gone")

    def finalize(self, status: str) -> None:
        self.finalized.append(status)


def test_a_logger_failing_mid_run_is_dropped_with_a_warning_and_metrics_csv_goes_on(tiny_setup, tmp_path, monkeypatch):
    failing = Failing()
    monkeypatch.setattr(loggers, "start_logger", lambda *args: failing)
    argv = [str(a) for a in train_args(tiny_setup, tmp_path / "out", "--max_steps", "4", "--global_batch_size", "2",
                                         "--eval_iters", "1", "--rehearse", "false", "--logger", "csv,tensorboard")]
    proc = run_script_inprocess(*argv, cache=tiny_setup["root"] / "cache", monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert ("Warning: --logger tensorboard failed at step 2 (ConnectionError: server gone); it is dropped for the rest "
            "of the run, metrics.csv keeps every row.") in " ".join(proc.stderr.split())
    assert failing.rows == 2 and [row["step"] for row in read_metrics(tmp_path / "out")] == ["1", "2", "3", "4"]


def test_loggers_open_before_stops_are_deferred(tiny_setup, tmp_path, monkeypatch):
    from lit_model.core.errors import STOPS

    deferring = []

    def start_logger(*args: Any) -> Failing:
        deferring.append(STOPS.deferring)  # a stop here must end the run at once, not wait for the server
        return Failing()

    monkeypatch.setattr(loggers, "start_logger", start_logger)
    argv = [str(a) for a in train_args(tiny_setup, tmp_path / "out", "--max_steps", "1", "--global_batch_size", "2",
                                         "--eval_iters", "1", "--rehearse", "false", "--logger", "tensorboard")]
    proc = run_script_inprocess(*argv, cache=tiny_setup["root"] / "cache", monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert deferring == [False]


@pytest.mark.slow
def test_mlflow_requests_to_a_server_gone_silent_end_within_seconds(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    for variable in loggers.MLFLOW_HTTP_BOUNDS:
        monkeypatch.delenv(variable, raising=False)
    with silent_server() as url:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
        logger = loggers.start_logger("mlflow", tmp_path / "logs", "run", 0)
        started = time.monotonic()
        with within(30), pytest.raises(Exception):
            logger.log_metrics({"loss": 1.0}, step=1)
    assert time.monotonic() - started < 10
