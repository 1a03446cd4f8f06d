"""Bad flags, model configs, command lines and --plan verdicts: one paragraph, exit status 2 (usage) or 1
(runtime), no traceback, and nothing written.

Each case runs a script in this process (``run_script_inprocess``) from an empty working directory that holds
only the case's inputs; the whole directory tree is compared before and after, so a case that created its
``--out_dir``, wrote into the run directory it started from, or dropped a file anywhere else fails. A few cases
run end to end in a new interpreter (``run_script``). Bad data, prompts, chat input and conversion inputs are
in test_bad_input_data.py.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from conftest import run_script, run_script_inprocess

PRETRAIN, FULL, LORA, ADAPTER = "pretrain/main.py", "finetune/full.py", "finetune/lora.py", "finetune/adapter.py"
BASE, CHAT, MERGE, CONVERT, CONFIG = "generate/base.py", "generate/chat.py", "lit_model/lora.py", "lit_model/convert.py", "lit_model/config.py"
TRAINING = (PRETRAIN, FULL, LORA, ADAPTER)
TINY = "name: tiny\nblock_size: 64\nvocab_size: 512\nn_layer: 2\nn_embd: 64\nn_head: 4\n"
# A run directory a case may start from: it must come out byte for byte the same
RUN_FILES = {"metrics.csv": "step,tokens,train_loss\n2,64,4.5\n", "checkpoints/step-2/state.pt": "state",
             "checkpoints/step-2/model_config.yaml": TINY}
NEEDS_14M = ("--model_name", "pythia-14m", "--device_memory")  # a plan from the registry, no checkpoint

# (script, argv, exit status, fragment of the message). In argv: OUT is a directory that does not exist yet,
# RUN the run directory above, FILE an existing file, YAML:<text> a file with that text.
CASES = [
    # every numeric training flag out of its range
    (PRETRAIN, ["--learning_rate", "-1"], 2, "--learning_rate -1.0 must be positive"),
    (PRETRAIN, ["--timeout", "0"], 2, "--timeout 0.0: give the collective timeout in seconds, more than 0"),
    (PRETRAIN, ["--learning_rate", "nan"], 2, "--learning_rate 'nan' is not valid: give a number"),
    (PRETRAIN, ["--log_interval", "0"], 2, "--log_interval 0 must be at least 1 (steps between logged rows)"),
    (PRETRAIN, ["--eval_interval", "0"], 2, "--eval_interval 0 must be at least 1 (steps between evaluations)"),
    (PRETRAIN, ["--seed", "-1"], 2, "--seed -1 must be at least 0"),
    (PRETRAIN, ["--seed", str(2**32)], 2, "must be between 0 and 4294967295"),
    (PRETRAIN, ["--num_nodes", "0"], 2, "--num_nodes 0 must be at least 1"),
    (PRETRAIN, ["--devices", "0"], 2, "--devices 0 must be at least 1"),
    (PRETRAIN, ["--warmup_steps", "-5"], 2, "--warmup_steps -5 must be at least 0"),
    (PRETRAIN, ["--grad_clip", "-1"], 2, "--grad_clip -1.0 must be at least 0 (0: off)"),
    (PRETRAIN, ["--weight_decay", "-0.1"], 2, "--weight_decay -0.1 must be at least 0"),
    (PRETRAIN, ["--min_lr", "0.5", "--learning_rate", "0.1"], 2, "--min_lr 0.5 is above --learning_rate 0.1"),
    (PRETRAIN, ["--eval_iters", "0"], 2, "--eval_iters 0 must be at least 1"),
    (PRETRAIN, ["--eval_batch_size", "0"], 2, "--eval_batch_size 0 must be at least 1"),
    (PRETRAIN, ["--keep_last", "0"], 2, "--keep_last 0 must be at least 1 (checkpoints kept)"),
    (PRETRAIN, ["--save_interval", "-1"], 2, "--save_interval -1 must be at least 0"),
    (PRETRAIN, ["--max_steps", "0"], 2, "--max_steps 0 must be at least 1"),
    (PRETRAIN, ["--max_tokens", "-100"], 2, "--max_tokens -100 must be at least 1"),
    (PRETRAIN, ["--max_steps", "null"], 2, "Give the run a length: --max_steps N or --max_tokens N"),
    (PRETRAIN, ["--loss_chunk_size", "-1"], 2, "--loss_chunk_size -1 must be at least 0 (0: unchunked)"),
    (PRETRAIN, ["--empty_cache_interval", "-1"], 2, "--empty_cache_interval -1 must be at least 0 (0: never)"),
    (PRETRAIN, ["--activation_checkpointing", "--activation_checkpointing_interval", "0"], 2,
     "--activation_checkpointing_interval 0 must be at least 1"),
    (PRETRAIN, ["--override_max_seq_length", "0"], 2, "--override_max_seq_length 0 must be at least 1"),
    (PRETRAIN, ["--override_max_seq_length", "100000"], 2, "--override_max_seq_length 100000 is outside 1..512"),
    (PRETRAIN, ["--freeze_layers", "-1"], 2, "--freeze_layers -1 must be at least 0"),
    (PRETRAIN, ["--micro_batch_size", "0"], 2, "--micro_batch_size 0 must be at least 1"),
    (PRETRAIN, ["--micro_batch_size", "3", "--global_batch_size", "16"], 2, "use a micro_batch_size among [1, 2, 4, 8, 16]"),
    (PRETRAIN, ["--device_memory", "abc", "--micro_batch_size", "auto"], 2, "Cannot read the memory size 'abc'"),
    (PRETRAIN, ["--device_memory", "0GB", "--micro_batch_size", "auto"], 2, "Memory size '0GB' must be larger than zero"),
    # optimizers that cannot serve the loop, and the accepted ones named
    (PRETRAIN, ["--optimizer", "torch.optim.LBFGS"], 2, "--optimizer torch.optim.LBFGS cannot serve this training loop"),
    (PRETRAIN, ["--optimizer", "torch.optim.SparseAdam"], 2, "Use one of AdamW, SGD, Lion, Sophia, Adafactor"),
    (PRETRAIN, ["--optimizer", "torch.nn.Linear"], 2, "is not a torch.optim.Optimizer subclass"),
    (PRETRAIN, ["--optimizer", "AdamW8bit", "--cpu_offload"], 2, "use --optimizer AdamW4bit (torchao"),
    # Literal flags name their values; other parse errors name the flag
    (PRETRAIN, ["--precision", "fp16"], 2, "--precision 'fp16' is not valid: give one of 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true"),
    (PRETRAIN, ["--strategy", "zero3"], 2, "--strategy 'zero3' is not valid: give one of auto, ddp, fsdp"),
    (PRETRAIN, ["--sharding_strategy", "FULL"], 2, "give one of FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD"),
    (PRETRAIN, ["--plan", "yaml"], 2, "--plan 'yaml' is not valid: give one of text, json"),
    (PRETRAIN, ["--micro_batch_size", "big"], 2, "--micro_batch_size 'big' is not valid: give an integer or auto"),
    (PRETRAIN, ["--compile", "maybe"], 2, "--compile 'maybe' is not valid: give true or false"),
    (PRETRAIN, ["--lerning_rate", "0.1"], 2, "did you mean --learning_rate?"),
    (PRETRAIN, ["--seed", ""], 2, "--seed is empty: give an integer"),
    # model configs: every field's type and range, an empty or unreadable file
    (PRETRAIN, ["--model_config", "YAML:" + TINY.replace("n_layer: 2", "n_layer: four")], 2, "n_layer: 'four' is not an integer"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY.replace("n_head: 4", "n_head: 5")], 2, "n_embd=64 is not divisible by n_head=5"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY.replace("n_embd: 64", "n_embd: -64")], 2, "n_embd: -64 must be at least 1"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY + "norm_eps: 1e-5\n"], 2, "norm_eps: '1e-5' is not a number (YAML reads"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY + "norm_class_name: BatchNorm\n"], 2, "is not one of RMSNorm, LayerNorm"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY + "rotary_percentage: 1.5\n"], 2, "rotary_percentage: 1.5 must be in [0, 1]"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY + "n_query_groups: 3\n"], 2, "n_head=4 is not divisible by n_query_groups=3"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY + "bias: maybe\n"], 2, "bias: 'maybe' is not true or false"),
    (PRETRAIN, ["--model_config", "YAML:" + TINY + "padded_vocab_size: 100\n"], 2, "padded_vocab_size=100 is smaller than vocab_size=512"),
    (PRETRAIN, ["--model_config", "YAML:"], 2, "holds no Config fields (empty)"),
    (PRETRAIN, ["--model_config", "YAML:- n_layer\n"], 2, "holds no Config fields (list)"),
    (PRETRAIN, ["--model_config", "YAML:n_layers: 2\n"], 2, "'n_layers': did you mean 'n_layer'?"),
    (PRETRAIN, ["--model_config", "YAML:n_layer: [2\n"], 2, "is not valid YAML"),
    (PRETRAIN, ["--model_name", "Llama-2-7b"], 2, "Did you mean"),
    # out_dir and the run it may hold
    (PRETRAIN, ["--out_dir", ""], 2, "--out_dir is empty: give a path (use . for the current directory)"),
    (PRETRAIN, ["--config", "YAML:out_dir: ''\n"], 2, "--out_dir is empty: give a path"),
    (PRETRAIN, ["--out_dir", "FILE"], 2, "is a file, not a directory"),
    (PRETRAIN, ["--out_dir", "FILE/run"], 2, "is a file, so no directory can be made under it"),
    (PRETRAIN, ["--out_dir", "/proc/1/run"], 2, "/proc/1 is not writable by this user"),
    (PRETRAIN, ["--out_dir", "RUN", "--resume", "auto", "--overwrite"], 2, "choose one of them"),
    # --plan and --plan_plot
    (PRETRAIN, ["--plan", "text", "--micro_batch_size", "3", "--global_batch_size", "16"], 2, "use a micro_batch_size among"),
    (PRETRAIN, ["--plan", "json", "--micro_batch_size", "64", "--global_batch_size", "16"], 2, "devices (1) x micro_batch_size (64)"),
    (PRETRAIN, ["--plan_plot", "plan.png"], 2, "--plan_plot draws the memory plan: add --plan text"),
    (PRETRAIN, ["--plan", "text", "--plan_plot", "missing/plan.png"], 2, "give a file name in an existing directory"),
    # --logger
    (PRETRAIN, ["--logger", "csv,tensorbord"], 2,
     "--logger 'csv,tensorbord': 'tensorbord' is not a logger. Choose from csv, tensorboard, wandb, mlflow"),
    (PRETRAIN, ["--config", "YAML:logger: [csv, neptune]\n"], 2, "'neptune' is not a logger"),
    (ADAPTER, ["--logger", ""], 2, "'' is not a logger. Choose from csv, tensorboard, wandb, mlflow"),
    # the fine-tuning scripts share the checks, plus their own flags
    (FULL, ["--learning_rate", "0"], 2, "--learning_rate 0.0 must be positive"),
    (FULL, ["--val_split_fraction", "1.5"], 2, "--val_split_fraction 1.5 must be between 0 and 1"),
    (FULL, ["--quantize", "bnb.nf5"], 2, "give one of bnb.nf4, bnb.nf4-dq, bnb.fp4, bnb.int8"),
    (FULL, ["--out_dir", "RUN", "--resume", "auto", "--overwrite"], 2, "choose one of them"),
    (LORA, ["--lora_alpha", "-1"], 2, "--lora_alpha -1.0 must be positive"),
    (LORA, ["--lora_dropout", "1.0"], 2, "--lora_dropout 1.0 must be in [0, 1)"),
    (LORA, ["--log_interval", "0"], 2, "--log_interval 0 must be at least 1"),
    (LORA, ["--optimizer", "torch.optim.LBFGS"], 2, "cannot serve this training loop"),
    (LORA, ["--plan", "text", *NEEDS_14M, "8GB", "--micro_batch_size", "3"], 2, "use a micro_batch_size among [1, 2, 4, 8, 16]"),
    (LORA, ["--plan", "text", *NEEDS_14M, "8GB", "--override_max_seq_length", "4096"], 2,
     "--override_max_seq_length 4096 is outside 1..512"),
    (ADAPTER, ["--adapter_prompt_length", "0"], 2, "--adapter_prompt_length 0 must be at least 1"),
    (ADAPTER, ["--adapter_start_layer", "-1"], 2, "--adapter_start_layer -1 must be at least 0"),
    (ADAPTER, ["--eval_interval", "0"], 2, "--eval_interval 0 must be at least 1"),
    # generation flags
    (BASE, ["--temperature", "-1"], 2, "--temperature must be >= 0"),
    (BASE, ["--temperature", "inf"], 2, "--temperature 'inf' is not valid: give a number"),
    (BASE, ["--top_k", "0"], 2, "--top_k must be at least 1"),
    (BASE, ["--top_p", "0"], 2, "--top_p must be in (0, 1]"),
    (BASE, ["--top_p", "1.5"], 2, "--top_p must be in (0, 1]"),
    (BASE, ["--num_samples", "0"], 2, "--num_samples must be at least 1"),
    (BASE, ["--max_new_tokens", "0"], 2, "--max_new_tokens 0 must be at least 1"),
    (BASE, ["--seed", "-1"], 2, "--seed -1 must be at least 0"),
    (BASE, ["--devices", "0"], 2, "--devices 0 must be at least 1"),
    (BASE, ["--precision", "fp16"], 2, "Choose one of: 32-true, 16-mixed, bf16-mixed, 16-true, bf16-true"),
    (BASE, ["--quantize", "bnb.q4"], 2, "Unknown --quantize 'bnb.q4'"),
    (BASE, ["--prompt_length", "5"], 2, "--prompt_length 5 applies with --plan only"),
    (BASE, ["--plan", "text", "--prompt_length", "0", "--model_name", "pythia-14m"], 2, "--prompt_length 0 must be at least 1"),
    (BASE, ["--plan", "text", *NEEDS_14M, "0GB"], 2, "Memory size '0GB' must be larger than zero"),
    (CHAT, ["--max_seq_length", "1"], 2, "--max_seq_length 1 must be at least 2"),
    (CHAT, ["--max_new_tokens", "0"], 2, "--max_new_tokens 0 must be at least 1"),
    (CHAT, ["--top_k", "-3"], 2, "--top_k must be at least 1"),
    (CHAT, ["--compile", "true"], 2, "chat decodes in the paged engine, which it does not compile"),
    # the other entry points
    (CONVERT, ["lit_to_hf", "--checkpoint_dir", "RUN", "--out_dir", "OUT", "--overwrite", "maybe"], 2,
     "--overwrite 'maybe' is not valid: give true or false"),
    (CONVERT, ["hf_to_lit", "--hf_dir", "RUN", "--out_dir", "OUT", "--dtype", "int8"], 2, "is not a floating point torch dtype"),
    (CONFIG, ["--all"], 2, "takes no arguments"),
    (MERGE, ["merge"], 2, "--checkpoint_dir"),
]


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under ``root`` with a hash of its contents."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def prepare(root: Path, argv: list[str]) -> list[str]:
    """The case's inputs under ``root``, and its argv with the placeholders replaced."""
    for name, text in RUN_FILES.items():
        (root / "RUN" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "RUN" / name).write_text(text)
    (root / "FILE").write_text("not a directory\n")
    out = []
    for arg in argv:
        if arg.startswith("YAML:"):
            (root / "config.yaml").write_text(arg[len("YAML:"):])
            arg = "config.yaml"
        out.append(arg)
    return out


@pytest.mark.parametrize("script, argv, code, fragment", CASES, ids=[f"{c[0]}-{' '.join(c[1])[:60]}" for c in CASES])
def test_bad_input(tmp_path, monkeypatch, script, argv, code, fragment):
    monkeypatch.chdir(tmp_path)
    argv = prepare(tmp_path, argv)
    if script in TRAINING and "--out_dir" not in argv and "--config" not in argv:  # the flag would win over the file
        argv = ["--out_dir", "OUT", *argv]
    before = tree(tmp_path)
    proc = run_script_inprocess(script, *argv, cache=tmp_path / "cache", monkeypatch=monkeypatch)
    message = " ".join(proc.stderr.split())
    assert proc.returncode == code, proc.stderr
    assert fragment in message, message
    assert "Traceback" not in proc.stderr + proc.stdout
    assert tree(tmp_path) == before  # no out_dir, no cache, nothing in the run directory changed


@pytest.mark.parametrize("script", [PRETRAIN, BASE])
def test_bad_fp32_linear_kernel_name(tmp_path, monkeypatch, script):
    from lit_model.kernels import ops
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(ops.FP32_LINEAR_ENV, "mkl")
    ops.onednn_fp32_linear.cache_clear()
    try:
        proc = run_script_inprocess(script, "--out_dir", "OUT", monkeypatch=monkeypatch) if script == PRETRAIN else \
            run_script_inprocess(script, monkeypatch=monkeypatch)
    finally:
        monkeypatch.delenv(ops.FP32_LINEAR_ENV)
        ops.onednn_fp32_linear.cache_clear()
    assert proc.returncode == 2, proc.stderr
    assert "LIT_MODEL_FP32_LINEAR='mkl': use auto (the default), onednn or blas (the kernel" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_plan_plot_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails, as where it is not installed
    proc = run_script_inprocess(PRETRAIN, "--plan", "text", "--plan_plot", "plan.png", monkeypatch=monkeypatch)
    assert proc.returncode == 2, proc.stderr
    assert "--plan_plot needs matplotlib: run `pip install matplotlib`" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script, package", [(PRETRAIN, "tensorboard"), (LORA, "wandb"), (FULL, "mlflow")])
def test_logger_without_its_package(tmp_path, monkeypatch, script, package):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, package, None)  # find_spec now answers None, as where it is not installed
    proc = run_script_inprocess(script, "--logger", f"csv,{package}", monkeypatch=monkeypatch)
    assert proc.returncode == 2, proc.stderr
    assert f"--logger {package} needs the {package} package: run `pip install {package}`" in " ".join(proc.stderr.split())
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []


def test_flags_win_over_config_wherever_they_stand(tmp_path, monkeypatch):
    """A bad value from the command line is reported whether --config comes before or after it (the file's good
    value never overrides it), and a flag fixes a bad value in the file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "good.yaml").write_text("learning_rate: 0.01\nlog_interval: 5\n")
    (tmp_path / "bad.yaml").write_text("log_interval: 0\n")
    for argv in (["--learning_rate", "-1", "--config", "good.yaml"], ["--config", "good.yaml", "--learning_rate", "-1"],
                 ["--learning_rate", "-1", "--config=good.yaml"]):
        proc = run_script_inprocess(PRETRAIN, *argv, "--out_dir", "OUT", monkeypatch=monkeypatch)
        assert proc.returncode == 2 and "--learning_rate -1.0 must be positive" in proc.stderr, proc.stderr
    proc = run_script_inprocess(PRETRAIN, "--log_interval", "7", "--config", "bad.yaml", "--plan", "json",
                                "--model_config", "tiny.yaml", monkeypatch=monkeypatch)
    assert proc.returncode == 2 and "tiny.yaml" in proc.stderr  # got past the flags: the missing file is next
    (tmp_path / "tiny.yaml").write_text(TINY)
    proc = run_script_inprocess(PRETRAIN, "--log_interval", "7", "--config", "bad.yaml", "--plan", "json",
                                "--model_config", "tiny.yaml", monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "good.yaml", "tiny.yaml"]


def test_plan_that_nothing_makes_fit_exits_1_after_printing_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    proc = run_script_inprocess(LORA, "--plan", "text", *NEEDS_14M, "1MB", monkeypatch=monkeypatch)
    assert proc.returncode == 1, proc.stderr
    assert "DOES NOT FIT in 1.00 MB" in proc.stdout and "No combination of up to 3 flag changes fits" in proc.stdout
    last = proc.stderr.strip().split("error: ")[-1]  # the message is the last output, wrapped over lines
    assert " ".join(last.split()).startswith("This run does not fit in 1.00 MB per device, and no combination")
    assert proc.stderr.rstrip().endswith("or a smaller model.")
    assert "Traceback" not in proc.stderr and list(tmp_path.iterdir()) == []
    # a suggestion that makes it fit, or a plan that fits: exit 0
    fits = run_script_inprocess(LORA, "--plan", "json", *NEEDS_14M, "80GB", monkeypatch=monkeypatch)
    assert fits.returncode == 0 and '"fits": true' in fits.stdout, fits.stderr


@pytest.mark.slow
def test_end_to_end_checks_come_before_any_process_starts(tmp_path):
    """In a new interpreter: --devices 2 with an out_dir that is a file stops before Fabric launches the second
    process; a bad interval stops before step 1; a plan nothing makes fit exits 1."""
    (tmp_path / "file").write_text("x")
    proc = run_script(PRETRAIN, "--devices", "2", "--out_dir", tmp_path / "file", timeout=120)
    assert proc.returncode == 2 and "is a file, not a directory" in " ".join(proc.stderr.split()), proc.stderr
    assert "Initializing distributed" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "file").read_text() == "x"
    proc = run_script(PRETRAIN, "--log_interval", "0", "--out_dir", tmp_path / "out", timeout=120)
    assert proc.returncode == 2 and "--log_interval 0 must be at least 1" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    proc = run_script(BASE, "--plan", "text", *NEEDS_14M, "1MB", timeout=120)
    assert proc.returncode == 1 and "Memory plan" in proc.stdout and "does not fit" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_out_of_memory_report_cites_only_checkpoints_that_exist(tmp_path):
    import torch

    from lit_model import Config
    from lit_model.run import resolve_run
    from lit_model.train.args import TrainArgs
    from lit_model.plan.oom_report import out_of_memory_report

    config = Config(name="t", block_size=64, vocab_size=512, n_layer=2, n_embd=64, n_head=4)
    args = TrainArgs(out_dir=tmp_path, micro_batch_size=1, global_batch_size=4, device_memory="2MB")

    def report() -> str:
        text = out_of_memory_report(resolve_run(args, config, device_type="cpu"), args, torch.device("cpu"), "at step 1",
                                    "simulated")
        return " ".join(text.split())

    before_any_save = report()
    assert f"No checkpoint was saved yet in {tmp_path}: start again with the new flags and --overwrite." in before_any_save
    assert "--resume auto" not in before_any_save
    for step in (2, 10):
        (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    assert f"The newest checkpoint is {tmp_path / 'checkpoints' / 'step-10'}: continue with the new flags and --resume auto." in report()
    # After an explicit --resume of step-2, the lineage (what --resume auto takes) ends there, not at step-10
    from lit_model.train.resumable import write_lineage

    write_lineage(tmp_path, [tmp_path / "checkpoints" / "step-2"])
    assert f"The newest checkpoint is {tmp_path / 'checkpoints' / 'step-2'}:" in report()


def test_a_compiler_failure_is_a_message_not_a_traceback(capsys):
    """torch.compile that cannot build its code (PyTorch's CPU inductor writes C++ that does not compile for some
    bf16 kernels) ends the run with a message naming the fix and exit code 1; any other error still raises."""
    import torch

    from lit_model.core.errors import run_cli

    def broken_backend(graph, inputs):
        raise RuntimeError("C++ compile error")

    def compiled_run() -> None:
        torch.compile(lambda x: x + 1, backend=broken_backend)(torch.ones(2))

    with pytest.raises(SystemExit) as stopped:
        run_cli(compiled_run)
    assert stopped.value.code == 1
    message = capsys.readouterr().err
    assert message.startswith("error: --compile failed: torch.compile could not build the compiled code")
    assert "without --compile" in message and "Traceback" not in message

    def other_error() -> None:
        raise RuntimeError("not a compiler failure")

    with pytest.raises(RuntimeError, match="not a compiler failure"):
        run_cli(other_error)
