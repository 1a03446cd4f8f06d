"""lit-model against its peers as users meet them: each one's own scripts, same model, data and schedule.

Each implementation runs its own command-line scripts on the same model, tokenizer, text and schedule, with its
default threads.

    python benchmarks/vs_peers.py                     # the default rows, median of 3 (installs the peers first)
    python benchmarks/vs_peers.py --quick             # one row, one repeat: a smoke check
    python benchmarks/vs_peers.py --rows all --steps 60 --repeats 3
    python benchmarks/vs_peers.py --list              # the rows, the default ones marked, and a time estimate

Peers: litgpt (``litgpt pretrain``, ``litgpt finetune_lora``, ``litgpt generate``; pinned, in
benchmarks/.venv-litgpt), Hugging Face ``Trainer`` on the equivalent ``LlamaForCausalLM`` (benchmarks/_hf_trainer_peer.py,
with peft for LoRA; lit-model's environment), TRL's ``DPOTrainer`` for DPO, with peft LoRA or full fine-tuning
(benchmarks/_trl_dpo_peer.py), and its ``GRPOTrainer`` with peft LoRA for GRPO (benchmarks/_trl_grpo_peer.py; both in
lit-model's environment), and torchtune (``tune run``, in benchmarks/.venv-torchtune) where it runs.

What is measured, and how:

- Everything each run needs is made once before the first timed run (benchmarks/.peers/): a text corpus (Python
  standard library sources, sorted, in shards), ONE byte-level BPE tokenizer trained on it with `tokenizers`
  (vocab 4096; a transformers tokenizer directory every implementation reads), the model as each one configures
  it (a Llama-style 5.26M model: 4 layers, 256 wide, 4 heads of 64, 4 key/value heads, MLP 688, RMSNorm, RoPE,
  untied head), each implementation's tokenized-data cache, and for fine-tuning and generation one base
  checkpoint (a short lit-model pretraining) converted to transformers (lit-model's converter) and to litgpt
  (litgpt's own weight copy).
- Each run is one process started from the command line the report lists, with the environment the benchmark
  was started in, less OMP_NUM_THREADS / MKL_NUM_THREADS: every implementation takes torch's default threads.
  Runs go round the implementations (A, B, C, A, B, C, ...) `--repeats` times per row; the table has medians.
- Training tokens/s is each training loop's steady state: the benchmark stamps (time.perf_counter) each per-step
  log line as it reads it from the process's pipe (unbuffered output), and divides the tokens of the optimizer
  steps after step W (the first W steps, compilation and warm-up, are excluded; `--warmup`) up to step N-1 by the
  time between the lines of steps W and N-1. Step N is left out because some loops evaluate before they log it.
  Pretraining counts micro batch x block tokens a step (every sample is a full window). Fine-tuning counts
  micro batch x the mean tokenized length of a record (records are cut to equal token counts, so padding is
  small for every implementation): real tokens, whatever an implementation pads. DPO counts pairs x the mean
  tokenized length of a pair's chosen row plus its rejected row (the same token sequences on both sides). Full DPO's
  reference: TRL's DPOTrainer, as a TRL user runs it, loads a second copy of the model and runs it forward every
  step; lit-model computes the reference's log-probabilities of every pair once before training (not in tokens/s)
  and caches them under $LIT_MODEL_CACHE (the first run of a row computes them, later runs read them).
- GRPO counts each step's rollouts, generation and training together: the prompt plus completion tokens of the
  step's completions (prompts x G; a completion's tokens up to and including the eos that ended it) over the step's
  time, summed over the steps after W as above. Those counts vary by step (completions end at different lengths),
  so each side's per-step line carries them: lit-model's step line has `rollout T tok` (what its rollouts generated
  from and generated), TRL's is `trl-step N tokens T`, printed by a callback in the peer script from what the step
  added to GRPOTrainer's own `state.num_input_tokens_seen` (the same quantity). Both sides load the same prompts file
  (alpaca-formatted, read as they are) and the same reward file (benchmarks/_grpo_reward.py: the fraction of a
  completion's tokens that are distinct), sample at temperature 1 with no top-k/top-p, and train with beta 0 (no
  reference), the DAPO loss and peft/lit-model LoRA on the same layers; TRL generates with transformers'
  `generate` (`use_vllm=False`), all of a step's completions in one call; lit-model with its continuous-batching
  engine, as many whole groups at a time as a micro batch holds (here all 8 of a step's).
- Generation tokens/s is new tokens over the time from the start of generation to the last token (the prefill
  of the short prompt included), from each implementation's own report: litgpt prints it; lit-model prints the
  time to the first token and the decode rate after it, from which the same quantity follows.
- peak_rss_mb is the training process's own peak resident set: the ru_maxrss that wait4 returns for it (the
  kernel's high-water mark; exact). That value also carries the benchmark's own peak at the fork (vfork), which
  the report prints and which is far below every measured one. tree_mb is the whole process tree: every 0.1 s
  the training process's VmRSS plus each other process's private pages (USS, smaps_rollup), so a forked data
  loader worker's copy-on-write pages count once; the peak of that sum (sampled). processes: how many the tree
  had. With one process, tree_mb equals peak_rss_mb up to sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import yaml
from _tables import cpu_description, csv_text, markdown_table
from _venvs import litgpt_python, venv_python

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORK = HERE / ".peers"
CORPUS = WORK / "corpus"
TOKENIZER = WORK / "tokenizer"
CORPUS_BYTES = 8 * 2**20  # ~2.3M tokens: the largest row (block 1024, micro 32, 60 steps) reads ~2M
ARCH = dict(vocab_size=4096, padded_vocab_size=4096, n_layer=4, n_embd=256, n_head=4, n_query_groups=4,
            intermediate_size=688, norm_eps=1e-5, rope_base=10000, tie_embeddings=False)
PRETRAIN = dict(lr=3e-3, min_lr=3e-4, warmup=10, weight_decay=0.1, grad_clip=1.0, seed=1337)
# No gradient clipping in fine-tuning: litgpt's finetune_lora has none (it refuses --train.max_norm), so none clips.
FINETUNE = dict(lr=1e-3, min_lr=1e-4, warmup=10, weight_decay=0.0, grad_clip=0.0, seed=1337, r=8, alpha=16, dropout=0.05)
DPO_BETA = 0.1  # TRL's default; the DPO and GRPO rows take FINETUNE's schedule and LoRA settings
# GRPO: TRL's defaults where lit-model's are the same; G and the completion length lit-model's CPU defaults (TRL: 8
# and 512); a step is 2 prompts x G completions (the rows' micro batch), trained in one micro batch
GRPO = dict(num_generations=4, prompts_per_step=2, max_new_tokens=64, temperature=1.0)
INSTRUCT_RECORDS = 2000
GENERATE = dict(prompt="def fibonacci(n):\n", max_new_tokens=224)  # + the prompt: within the base's block of 256
TORCHTUNE = ("torchtune==0.6.1", "torchao==0.11.0")  # torchao 0.12+ dropped the NF4 module torchtune 0.6.1 imports
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
IMPLS = ("lit_model", "litgpt", "hf", "torchtune", "lit_model_glibc", "trl")
# lit_model_glibc: lit-model with glibc's default heap, to measure what the heap settings the training scripts give a
# CPU run do (lit_model.run.CPU_HEAP). Any MALLOC_* variable turns those off; MALLOC_PERTURB_=0 is glibc's default
# (no perturbation) and, unlike setting a threshold or the top pad to its default value, leaves glibc's adaptive
# thresholds on: MALLOC_TOP_PAD_=131072 halved lit-model's tokens/s at micro batch 1.
GLIBC_DEFAULT_HEAP = {"MALLOC_PERTURB_": "0"}


# ---- rows ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Row:
    kind: str  # pretrain, lora, dpo, grpo, generate
    block: int
    micro: int
    precision: str
    method: str = "lora"  # dpo: lora or full (the other kinds' own)

    @property
    def name(self) -> str:
        if self.kind == "generate":
            return f"generate-{self.precision}"
        full = "-full" if self.method == "full" else ""
        return f"{self.kind}{full}-b{self.block}-m{self.micro}-{self.precision}"


PRECISIONS = ("32-true", "bf16-true")
ROWS = [Row("pretrain", block, micro, p) for block in (256, 1024) for micro in (1, 8, 32) for p in PRECISIONS]
ROWS += [Row("lora", 256, 8, p) for p in PRECISIONS] + [Row("generate", 256, 1, p) for p in PRECISIONS]
ROWS += [Row("dpo", 256, 4, p, method) for method in ("lora", "full") for p in PRECISIONS]  # micro = pairs (2 rows each)
ROWS += [Row("grpo", 256, GRPO["prompts_per_step"] * GRPO["num_generations"], p) for p in PRECISIONS]  # micro = completions
# The default run: the setup (block 256, micro = global 8) in both precisions, the long block at micro 8,
# fine-tuning and generation: just under an hour on 2 idle cores at 60 steps x 3 repeats (--list prints the estimate;
# --rows all, the whole matrix, about six hours).
DEFAULT_ROWS = ["pretrain-b256-m8-32-true", "pretrain-b256-m8-bf16-true", "pretrain-b1024-m8-bf16-true",
                "lora-b256-m8-32-true", "lora-b256-m8-bf16-true", "generate-32-true", "generate-bf16-true"]
QUICK_ROW = "pretrain-b256-m8-32-true"


def select_rows(names: list[str]) -> list[Row]:
    by_name = {row.name: row for row in ROWS}
    if names == ["all"]:
        return list(ROWS)
    chosen = []
    for name in names:  # a name, or a prefix/pattern such as pretrain-b1024 or bf16
        matched = [row for row in ROWS if row.name == name] or [row for row in ROWS if name in row.name]
        if not matched:
            raise SystemExit(f"--rows {name}: no such row; the rows are: {', '.join(by_name)}")
        chosen += [row for row in matched if row not in chosen]
    return chosen


# ---- what the runs share -------------------------------------------------------------------------
def lit_env() -> dict[str, str]:
    return {**base_env(), "PYTHONPATH": str(ROOT)}


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARIABLES}  # torch's default threads for all
    env.update(PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")  # nothing can be downloaded here
    return env


def prep(python: str, *args: object, env: Optional[dict[str, str]] = None) -> None:
    quiet_run([python, str(HERE / "_peer_prep.py"), *args], env or lit_env(), WORK)


def quiet_run(argv: list[object], env: dict[str, str], cwd: Path) -> None:
    """A preparation step, its output appended to benchmarks/.peers/prepare.log (its tail shown if it fails)."""
    argv = list(map(str, argv))
    done = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True)
    with open(WORK / "prepare.log", "a") as log:
        log.write(f"$ {shlex.join(argv)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise SystemExit(f"Preparing failed ({shlex.join(argv)}):\n{tail}")


def write_corpus() -> None:
    """Python standard library sources (UTF-8 ones, sorted by path) in 512 KB shards, CORPUS_BYTES in all."""
    if CORPUS.is_dir() and any(CORPUS.glob("*.txt")):
        return
    root = Path(sysconfig.get_paths()["stdlib"])
    tmp = CORPUS.with_name("corpus.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    shard, written, buffer = 0, 0, []
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        buffer.append(text)
        if sum(map(len, buffer)) >= 512 * 1024:
            (tmp / f"shard-{shard:03d}.txt").write_text("".join(buffer))
            written, shard, buffer = written + sum(map(len, buffer)), shard + 1, []
            if written >= CORPUS_BYTES:
                break
    os.replace(tmp, CORPUS)


def write_yaml(path: Path, fields: dict) -> None:
    path.write_text(yaml.safe_dump(fields, sort_keys=False))  # a float as 1.0e-05, which YAML reads as a number


def yaml_fields(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def model_yaml(block: int) -> Path:
    """lit-model's --model_config for this block size."""
    path = WORK / f"model-b{block}.yaml"
    if not path.exists():
        write_yaml(path, lit_llama_fields(f"peer-5m-b{block}", block, ARCH))
    return path


def litgpt_yaml(block: int) -> Path:
    """litgpt's --model_config: the same architecture in litgpt's Config fields."""
    path = WORK / f"litgpt-b{block}.yaml"
    if not path.exists():
        write_yaml(path, litgpt_llama_fields(f"peer-5m-b{block}", block, ARCH))
    return path


def lit_llama_fields(name: str, block: int, arch: dict) -> dict:
    """A Llama-style architecture (ARCH's fields) as lit-model's Config fields."""
    return {"name": name, "hf_type": "llama", "block_size": block, **arch}


def litgpt_llama_fields(name: str, block: int, arch: dict) -> dict:
    """The same in litgpt's Config fields."""
    arch = {k: v for k, v in arch.items() if k != "tie_embeddings"}  # litgpt ties through --train.tie_embeddings
    return {"name": name, "block_size": block, **arch, "rotary_percentage": 1.0, "parallel_residual": False,
            "bias": False, "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP"}


def hf_config_dir(block: int) -> Path:
    """The equivalent transformers config.json (lit-model's converter writes it from the YAML)."""
    out = WORK / f"hf-config-b{block}"
    if not (out / "config.json").exists():
        prep(sys.executable, "hf_config", model_yaml(block), out)
    return out


def litgpt_data_dir(block: int) -> Path:
    """litgpt's TextFiles reads *.txt from a directory and writes its litdata chunks (for one block size) beside
    them: a directory per block of links to the corpus shards (its first shard is litgpt's validation split)."""
    out = WORK / f"litgpt-data-b{block}"
    if not out.is_dir():
        tmp = out.with_name(out.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for shard in sorted(CORPUS.glob("*.txt")):
            if not (tmp / shard.name).exists():
                (tmp / shard.name).symlink_to(shard)
        os.replace(tmp, out)
    return out


class Setup:
    """Made once and kept in benchmarks/.peers/ between invocations (delete it after changing what it holds):
    everything the rows need."""

    def __init__(self, rows: list[Row], impls: list[str], pythons: dict[str, str]) -> None:
        WORK.mkdir(exist_ok=True)
        write_corpus()
        if not (TOKENIZER / "tokenizer.json").exists():
            prep(sys.executable, "tokenizer", CORPUS, ARCH["vocab_size"], TOKENIZER)
        blocks = sorted({row.block for row in rows if row.kind == "pretrain"})
        for block in blocks:  # each implementation's tokenized data, before anything is timed
            prep(sys.executable, "lit_data", CORPUS, TOKENIZER, block)
            if "litgpt" in impls:
                prep(pythons["litgpt"], "litgpt_data", litgpt_data_dir(block), TOKENIZER, block, env=base_env())
            if "hf" in impls:
                quiet_run([sys.executable, HERE / "_hf_trainer_peer.py", "prepare", *hf_data_args(block)], lit_env(), WORK)
            if "torchtune" in impls:
                torchtune_init(block)
        self.instruct = WORK / "instruct.json"
        if any(row.kind in ("lora", "dpo", "grpo", "generate") for row in rows):
            self.base = base_checkpoint()
            self.base_hf = WORK / "base-hf"
            if not (self.base_hf / "model.safetensors").exists():
                prep(sys.executable, "lit_to_hf", self.base, self.base_hf)
            self.base_litgpt = WORK / "base-litgpt"
            if "litgpt" in impls and not (self.base_litgpt / "lit_model.pth").exists():
                prep(pythons["litgpt"], "litgpt_from_hf", self.base_hf, litgpt_yaml(256), self.base_litgpt,
                     env=base_env())
            if not self.instruct.exists():
                prep(sys.executable, "instruct", CORPUS, TOKENIZER, INSTRUCT_RECORDS, self.instruct)
            self.sample_tokens = json.loads(self.instruct.with_suffix(".stats.json").read_text())["mean_tokens"]
        self.pairs = WORK / "pairs-b256.jsonl"  # the DPO rows' preference pairs, read by every implementation
        if any(row.kind == "dpo" for row in rows):
            if not self.pairs.exists():
                prep(sys.executable, "pairs", self.instruct, TOKENIZER, 256, self.pairs)
            self.pair_tokens = json.loads(self.pairs.with_suffix(".stats.json").read_text())["mean_pair_tokens"]
        self.prompts = WORK / "grpo-prompts.jsonl"  # the GRPO rows' prompts, read by both implementations
        if any(row.kind == "grpo" for row in rows) and not self.prompts.exists():
            prep(sys.executable, "grpo_prompts", self.instruct, self.prompts)


def base_checkpoint() -> Path:
    """The base of the fine-tuning and generation rows: 40 steps of lit-model pretraining, block 256 (its weights
    matter little: the rows time the work, and generation runs to max_new_tokens unless it meets an end of text)."""
    out = WORK / "base"
    if not (out / "final" / "model_config.yaml").exists():
        command = [sys.executable, "pretrain/main.py", "--model_config", model_yaml(256), "--tokenizer_dir", TOKENIZER,
                   "--data_path", CORPUS, "--precision", "32-true", "--micro_batch_size", 8, "--global_batch_size", 8,
                   "--max_steps", 40, "--eval_iters", 2, "--save_interval", 0, "--out_dir", out, "--overwrite", "true"]
        quiet_run(command, lit_env(), ROOT)
    return out / "final"


def hf_data_args(block: int) -> list[str]:
    return ["--corpus", str(CORPUS), "--tokenizer_dir", str(TOKENIZER), "--block", str(block)]


# ---- the commands --------------------------------------------------------------------------------
@dataclass
class Command:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    step_line: Optional[re.Pattern]  # a per-step log line; group 1: the optimizer step, group 2 (GRPO): its tokens
    tokens_per_step: float  # when the line does not say


def commands(impl: str, row: Row, run_dir: Path, steps: int, setup: Setup, pythons: dict[str, str]) -> Command:
    if impl == "lit_model_glibc":
        command = lit_model_command(row, run_dir, steps, setup, pythons)
        return replace(command, env={**command.env, **GLIBC_DEFAULT_HEAP})
    return {"lit_model": lit_model_command, "litgpt": litgpt_command, "hf": hf_command,
            "torchtune": torchtune_command, "trl": trl_command}[impl](row, run_dir, steps, setup, pythons)


def tokens_per_step(row: Row, setup: Setup) -> float:
    if row.kind == "grpo":  # the step lines count them
        return 0
    if row.kind == "dpo":
        return row.micro * setup.pair_tokens
    return row.micro * (row.block if row.kind == "pretrain" else setup.sample_tokens)


def lit_model_command(row: Row, run_dir: Path, steps: int, setup: Setup, pythons: dict[str, str]) -> Command:
    schedule = PRETRAIN if row.kind == "pretrain" else FINETUNE
    common = ["--precision", row.precision, "--out_dir", run_dir, "--overwrite", "true"]
    if row.kind == "generate":
        argv = ["generate/base.py", "--checkpoint_dir", setup.base, "--prompt", GENERATE["prompt"],
                "--max_new_tokens", GENERATE["max_new_tokens"], "--temperature", 0, "--precision", row.precision]
        return Command(as_argv(pythons["lit_model"], argv), lit_env(), ROOT, None, 0)
    loop = ["--micro_batch_size", row.micro, "--global_batch_size", row.micro, "--max_steps", steps,
            "--learning_rate", schedule["lr"], "--min_lr", schedule["min_lr"], "--warmup_steps", schedule["warmup"],
            "--weight_decay", schedule["weight_decay"], "--grad_clip", schedule["grad_clip"], "--seed", schedule["seed"],
            "--log_interval", 1, "--eval_interval", steps, "--eval_iters", 2, "--save_interval", 0]
    step_line = re.compile(r"^step (\d+)/\d+ \|")
    lora = ["--lora_r", FINETUNE["r"], "--lora_alpha", FINETUNE["alpha"], "--lora_dropout", FINETUNE["dropout"],
            *lora_targets("lit")] if row.method == "lora" else []
    if row.kind == "pretrain":
        argv = ["pretrain/main.py", "--model_config", model_yaml(row.block), "--tokenizer_dir", TOKENIZER,
                "--data_path", CORPUS, *loop, *common]
    elif row.kind == "grpo":  # the prompts are in the template already: the default style leaves them as they are
        argv = ["finetune/grpo.py", "--checkpoint_dir", setup.base, "--data_path", setup.prompts, "--prompt_style",
                "default", "--method", row.method, "--reward", f"{HERE / '_grpo_reward.py'}:distinct",
                "--num_generations", GRPO["num_generations"], "--max_new_tokens", GRPO["max_new_tokens"],
                "--temperature", GRPO["temperature"], "--beta", 0, "--loss_type", "dapo", *lora, *loop, *common]
        step_line = re.compile(r"^step (\d+)/\d+ \|.* \| rollout (\d+) tok in ")
    else:
        script, data = ("finetune/dpo.py", setup.pairs) if row.kind == "dpo" else ("finetune/lora.py", setup.instruct)
        dpo = ["--method", row.method, "--loss", "dpo", "--beta", DPO_BETA] if row.kind == "dpo" else []
        argv = [script, "--checkpoint_dir", setup.base, "--data_path", data, "--prompt_style", "alpaca", *dpo,
                *lora, *loop, *common]
    return Command(as_argv(pythons["lit_model"], argv), lit_env(), ROOT, step_line, tokens_per_step(row, setup))


def lora_targets(style: str) -> list[str]:
    """The adapted layers, the same for every implementation: the four attention projections and the MLP."""
    if style == "hf":
        return ["--lora_targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"]
    flags = {"query": True, "key": True, "value": True, "projection": True, "mlp": True, "head": False}
    return [x for k, v in flags.items() for x in (f"--lora_{k}", str(v).lower())]


def litgpt_command(row: Row, run_dir: Path, steps: int, setup: Setup, pythons: dict[str, str]) -> Command:
    litgpt = str(Path(pythons["litgpt"]).with_name("litgpt"))
    if row.kind == "generate":
        argv = ["generate", setup.base_litgpt, "--prompt", GENERATE["prompt"], "--max_new_tokens",
                GENERATE["max_new_tokens"], "--temperature", 0, "--top_k", 1, "--precision", row.precision]
        return Command(as_argv(litgpt, argv), base_env(), run_dir, None, 0)
    schedule = PRETRAIN if row.kind == "pretrain" else FINETUNE
    optimizer = {"class_path": "torch.optim.AdamW",
                 "init_args": {"lr": schedule["lr"], "weight_decay": schedule["weight_decay"], "betas": [0.9, 0.95]}}
    loop = ["--precision", row.precision, "--devices", 1, "--out_dir", run_dir, "--logger_name", "csv",
            "--optimizer", json.dumps(optimizer), "--seed", schedule["seed"],
            "--train.micro_batch_size", row.micro, "--train.global_batch_size", row.micro,
            "--train.lr_warmup_steps", schedule["warmup"], "--train.min_lr", schedule["min_lr"],
            *(["--train.max_norm", schedule["grad_clip"]] if schedule["grad_clip"] else []),
            "--train.log_interval", 1, "--train.save_interval", steps,
            "--eval.interval", steps, "--eval.max_iters", 2]
    if row.kind == "pretrain":  # its loop ends on max_tokens (it reads no max_steps); the lr decays over those steps
        model = json.dumps(yaml_fields(litgpt_yaml(row.block)))  # its --model_config takes the fields, not a file
        argv = ["pretrain", f"peer-5m-b{row.block}", "--model_config", model, "--tokenizer_dir", TOKENIZER,
                "--data", "TextFiles", "--data.train_data_path", litgpt_data_dir(row.block),
                "--train.max_tokens", steps * row.micro * row.block, "--train.max_seq_length", row.block,
                "--eval.initial_validation", "false", *loop]
    else:
        argv = ["finetune_lora", setup.base_litgpt, "--data", "JSON", "--data.json_path", setup.instruct,
                "--data.val_split_fraction", 0.05, "--data.prompt_style", "alpaca", "--data.mask_prompt", "true",
                "--lora_r", FINETUNE["r"], "--lora_alpha", FINETUNE["alpha"], "--lora_dropout", FINETUNE["dropout"],
                *lora_targets("litgpt"), "--train.max_steps", steps, "--train.epochs", 1000, *loop]
    return Command(as_argv(litgpt, argv), base_env(), run_dir, re.compile(r"\| iter \d+ step (\d+) \|"),
                   tokens_per_step(row, setup))


def hf_command(row: Row, run_dir: Path, steps: int, setup: Setup, pythons: dict[str, str]) -> Command:
    schedule = PRETRAIN if row.kind == "pretrain" else FINETUNE
    argv = [str(HERE / "_hf_trainer_peer.py"), row.kind, "--precision", row.precision, "--micro_batch_size", row.micro,
            "--steps", steps, "--learning_rate", schedule["lr"], "--min_lr", schedule["min_lr"],
            "--warmup_steps", schedule["warmup"], "--weight_decay", schedule["weight_decay"],
            "--grad_clip", schedule["grad_clip"], "--seed", schedule["seed"], "--out_dir", run_dir]
    if row.kind == "pretrain":
        argv += ["--config_dir", hf_config_dir(row.block), *hf_data_args(row.block)]
    else:
        argv += ["--base_dir", setup.base_hf, "--data_path", setup.instruct, "--lora_r", FINETUNE["r"],
                 "--lora_alpha", FINETUNE["alpha"], "--lora_dropout", FINETUNE["dropout"], *lora_targets("hf"),
                 "--block", row.block]
    return Command(as_argv(sys.executable, argv), lit_env(), run_dir, re.compile(r"^hf-step (\d+)$"),
                   tokens_per_step(row, setup))


def trl_command(row: Row, run_dir: Path, steps: int, setup: Setup, pythons: dict[str, str]) -> Command:
    """TRL's DPOTrainer (benchmarks/_trl_dpo_peer.py) or GRPOTrainer (_trl_grpo_peer.py), in this interpreter as the
    HF Trainer runs."""
    schedule = ["--steps", steps, "--learning_rate", FINETUNE["lr"], "--min_lr", FINETUNE["min_lr"],
                "--warmup_steps", FINETUNE["warmup"], "--weight_decay", FINETUNE["weight_decay"],
                "--grad_clip", FINETUNE["grad_clip"], "--seed", FINETUNE["seed"], "--lora_r", FINETUNE["r"],
                "--lora_alpha", FINETUNE["alpha"], "--lora_dropout", FINETUNE["dropout"], *lora_targets("hf"),
                "--precision", row.precision, "--base_dir", setup.base_hf, "--out_dir", run_dir]
    if row.kind == "grpo":
        argv = [str(HERE / "_trl_grpo_peer.py"), "--data_path", setup.prompts,
                *(x for k, v in GRPO.items() for x in (f"--{k}", v)), *schedule]
        return Command(as_argv(sys.executable, argv), lit_env(), run_dir, re.compile(r"^trl-step (\d+) tokens (\d+)$"),
                       tokens_per_step(row, setup))
    argv = [str(HERE / "_trl_dpo_peer.py"), "--data_path", setup.pairs, "--block", row.block, "--method", row.method,
            "--micro_batch_size", row.micro, "--beta", DPO_BETA, *schedule]
    return Command(as_argv(sys.executable, argv), lit_env(), run_dir, re.compile(r"^trl-step (\d+)$"),
                   tokens_per_step(row, setup))


def torchtune_command(row: Row, run_dir: Path, steps: int, setup: Setup, pythons: dict[str, str]) -> Command:
    """`tune run full_finetune_single_device` (torchtune has no pretraining recipe: see _torchtune_peer.py)."""
    from _torchtune_peer import recipe_config

    init_dir = torchtune_init(row.block)
    config = run_dir / "torchtune.yaml"
    config.write_text(recipe_config(block=row.block, micro=row.micro, steps=steps, precision=row.precision,
                                    run_dir=run_dir, init_dir=init_dir, tokenizer_dir=TOKENIZER, corpus=CORPUS,
                                    arch=ARCH, schedule=PRETRAIN))
    tune = str(Path(pythons["torchtune"]).with_name("tune"))
    env = {**base_env(), "PYTHONPATH": str(HERE)}  # for _torchtune_peer.tokenizer, the config's tokenizer
    return Command([tune, "run", "full_finetune_single_device", "--config", str(config)], env, run_dir,
                   re.compile(r"Step (\d+) \| loss:"), tokens_per_step(row, setup))


def torchtune_init(block: int) -> Path:
    """The randomly initialised transformers checkpoint torchtune's fine-tuning recipe starts from."""
    init_dir = WORK / f"torchtune-init-b{block}"
    if not (init_dir / "model.safetensors").exists():
        quiet_run([sys.executable, HERE / "_torchtune_peer.py", "init", hf_config_dir(block), init_dir], lit_env(), WORK)
    return init_dir


def as_argv(program: str, args: list[object]) -> list[str]:
    return [program, *map(str, args)]


# ---- running one measured process ----------------------------------------------------------------
def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of a process in bytes ({} once it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in lines if line.startswith(("VmRSS", "VmHWM"))}


def private_bytes(pid: int) -> int:
    """USS: the pages only this process maps (smaps_rollup's Private_Clean + Private_Dirty)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    return sum(int(line.split()[1]) * 1024 for line in text.splitlines() if line.startswith("Private_"))


def descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        parent = stack.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            stack += children
    return found


def own_peak_bytes() -> int:
    return read_status(os.getpid()).get("VmHWM", 0)


@dataclass
class Result:
    returncode: int
    output: str
    stamps: dict[int, float]
    step_tokens: dict[int, float]  # the tokens the step lines say their step had (GRPO)
    peak_rss: int
    tree_peak: int
    processes: int
    seconds: float


def run_process(command: Command, log_path: Path) -> Result:
    """Start the command, stamp its lines as they arrive, sample its process tree, and wait4 for its peak."""
    start = time.perf_counter()
    process = subprocess.Popen(command.argv, cwd=command.cwd, env=command.env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace")
    lines: list[str] = []
    stamps: dict[int, float] = {}
    step_tokens: dict[int, float] = {}
    seen: set[int] = set()
    tree_peak = 0
    done = threading.Event()

    def read() -> None:
        for line in process.stdout:
            now = time.perf_counter()
            lines.append(line)
            if command.step_line is not None and (match := command.step_line.search(line.strip())):
                stamps.setdefault(int(match.group(1)), now)
                if match.re.groups > 1:
                    step_tokens.setdefault(int(match.group(1)), float(match.group(2)))

    def sample() -> None:
        nonlocal tree_peak
        while not done.wait(0.1):
            children = descendants(process.pid)
            seen.update(children)
            total = read_status(process.pid).get("VmRSS", 0) + sum(private_bytes(c) for c in children)
            tree_peak = max(tree_peak, total)

    reader, sampler = threading.Thread(target=read, daemon=True), threading.Thread(target=sample)
    reader.start()
    sampler.start()
    _, status, usage = os.wait4(process.pid, 0)
    done.set()
    process.returncode = os.waitstatus_to_exitcode(status)
    reader.join(timeout=60)  # a leftover grandchild holding the pipe open does not hang the benchmark
    sampler.join()
    output = "".join(lines)
    log_path.write_text(f"$ {shlex.join(command.argv)}\n\n{output}")
    peak = usage.ru_maxrss * 1024
    return Result(process.returncode, output, stamps, step_tokens, peak, max(tree_peak, peak), len(seen) + 1,
                  time.perf_counter() - start)


def training_rate(result: Result, command: Command, steps: int, warmup: int) -> float:
    first, last = warmup, steps - 1
    if first not in result.stamps or last not in result.stamps:
        raise RuntimeError(f"no per-step log line for step {first} or {last} (found steps "
                           f"{min(result.stamps, default=None)}..{max(result.stamps, default=None)})")
    counted = range(first + 1, last + 1)
    if command.step_line.groups > 1:  # each line says its step's tokens
        tokens = sum(result.step_tokens[step] for step in counted if step in result.step_tokens)
    else:
        tokens = len(counted) * command.tokens_per_step
    return tokens / (result.stamps[last] - result.stamps[first])



def generation_rate(impl: str, output: str) -> float:
    """New tokens / (time to the last token, prefill included), from the implementation's own report."""
    if impl == "lit_model":  # "time to first token: X s, decode: Y tokens/s (N tokens in 1 sample(s))"
        match = re.search(r"time to first token: ([\d.]+) s, decode: ([\d.]+) tokens/s \((\d+) tokens", output)
        if match is None:
            raise RuntimeError("no statistics line in lit-model's output")
        first, rate, count = float(match.group(1)), float(match.group(2)), int(match.group(3))
        return count / (first + (count - 1) / rate)
    match = re.search(r"Time for inference 1: ([\d.]+) sec total, ([\d.]+) tokens/sec", output)  # litgpt
    if match is None:
        raise RuntimeError("no 'Time for inference' line in litgpt's output")
    return float(match.group(2))


# ---- the benchmark -------------------------------------------------------------------------------
def impls_for(row: Row, impls: list[str]) -> list[str]:
    supported = {"pretrain": ("lit_model", "litgpt", "hf", "torchtune", "lit_model_glibc"),
                 "lora": ("lit_model", "litgpt", "hf", "lit_model_glibc"),
                 "dpo": ("lit_model", "trl"), "grpo": ("lit_model", "trl"),
                 "generate": ("lit_model", "litgpt")}[row.kind]
    return [impl for impl in impls if impl in supported]


def benchmark(rows: list[Row], impls: list[str], steps: int, warmup: int, repeats: int, setup: Setup,
              pythons: dict[str, str]) -> tuple[list[dict], dict[str, dict[str, str]], dict[str, str]]:
    table, commands_used, failures = [], {}, {}
    for row in rows:
        runs: dict[str, list[tuple[float, Result]]] = {}
        names = impls_for(row, impls)
        for repeat in range(repeats):
            for impl in names:
                if f"{row.name} {impl}" in failures:
                    continue
                run_dir = WORK / "runs" / row.name / f"{impl}-{repeat}"
                run_dir.mkdir(parents=True, exist_ok=True)
                command = commands(impl, row, run_dir, steps, setup, pythons)
                variables = [f"{k}={v}" for k, v in GLIBC_DEFAULT_HEAP.items() if command.env.get(k) == v]
                commands_used.setdefault(row.name, {})[impl] = shlex.join([*variables, *command.argv])
                result = run_process(command, run_dir / "output.log")
                try:
                    if result.returncode != 0:
                        raise RuntimeError(f"exit status {result.returncode}")
                    rate = (generation_rate(impl, result.output) if row.kind == "generate"
                            else training_rate(result, command, steps, warmup))
                except RuntimeError as error:
                    tail = "\n".join(result.output.strip().splitlines()[-15:])
                    failures[f"{row.name} {impl}"] = f"{error}; see {run_dir / 'output.log'}; last lines:\n{tail}"
                    print(f"{row.name} {impl}: FAILED ({error})", flush=True)
                    continue
                runs.setdefault(impl, []).append((rate, result))
                print(f"{row.name} {impl} #{repeat + 1}: {rate:,.0f} tok/s, peak RSS {result.peak_rss / 2**20:,.0f} MB, "
                      f"tree {result.tree_peak / 2**20:,.0f} MB ({result.processes} processes), "
                      f"{result.seconds:.0f} s", flush=True)
        table += summarize(row, runs)
    return table, commands_used, failures


def summarize(row: Row, runs: dict[str, list[tuple[float, Result]]]) -> list[dict]:
    medians = {impl: {"rate": statistics.median(r for r, _ in results),
                      "rss": statistics.median(x.peak_rss for _, x in results),
                      "tree": statistics.median(x.tree_peak for _, x in results),
                      "processes": max(x.processes for _, x in results), "n": len(results)}
               for impl, results in runs.items()}
    ours = medians.get("lit_model")
    rows = []
    for impl, m in medians.items():
        rows.append({
            "row": row.name, "implementation": impl, "runs": m["n"], "tokens_per_sec": round(m["rate"], 1),
            "lit_model_speed_ratio": round(ours["rate"] / m["rate"], 3) if ours else "",
            "peak_rss_mb": round(m["rss"] / 2**20), "lit_model_rss_ratio": round(ours["rss"] / m["rss"], 3) if ours else "",
            "tree_mb": round(m["tree"] / 2**20), "processes": m["processes"],
        })
    return rows


# ---- time estimate -------------------------------------------------------------------------------
# Rough costs on 2 idle cores (this project's machine), from short runs on a loaded one: training tokens/s of the
# 5.26M model at block 256 (the implementations within about 2x of each other; a longer block slows in proportion
# to the FLOP per token), and each process's fixed cost (imports, data loading, litgpt's compilation, lit-model's
# rehearsal and end-of-run sample, torchtune's packing of the corpus, evaluations and saves).
EST_TOKENS_PER_SEC = {"32-true": 5000, "bf16-true": 7000}
EST_FIXED_SECONDS = {"lit_model": 15, "litgpt": 40, "hf": 15, "torchtune": 20, "lit_model_glibc": 15, "trl": 20}
# DPO: a pair is two rows of about 229 tokens; the reference's forward pass (no backward) adds a third to the work
EST_PAIR_TOKENS, EST_DPO_COST = 457, 4 / 3
EST_GRPO_STEP_SECONDS = 1.5  # a step's rollouts (G x 64 new tokens, one at a time) cost more than its training


def estimate_seconds(rows: list[Row], impls: list[str], steps: int, repeats: int, sample_tokens: float = 247) -> float:
    from matmul_peak import training_flops_per_token

    total = 0.0
    for row in rows:
        for impl in impls_for(row, impls):
            if row.kind == "generate":
                total += repeats * (EST_FIXED_SECONDS[impl] / 2 + 10)
                continue
            if row.kind == "grpo":
                total += repeats * (EST_FIXED_SECONDS[impl] + steps * EST_GRPO_STEP_SECONDS)
                continue
            tokens = steps * row.micro * {"pretrain": row.block, "dpo": EST_PAIR_TOKENS * EST_DPO_COST}.get(row.kind,
                                                                                                 sample_tokens)
            slower = training_flops_per_token(row.block, **ARCH) / training_flops_per_token(256, **ARCH)
            total += repeats * (EST_FIXED_SECONDS[impl] + tokens * slower / EST_TOKENS_PER_SEC[row.precision])
    return total


# ---- report --------------------------------------------------------------------------------------
def versions(pythons: dict[str, str]) -> dict[str, str]:
    probes = {"lit_model": (pythons.get("lit_model"), "lit-model torch lightning"),
              "hf": (sys.executable, "torch transformers peft"),
              "trl": (sys.executable, "torch transformers peft trl"),
              "litgpt": (pythons.get("litgpt"), "litgpt torch lightning litdata"),
              "torchtune": (pythons.get("torchtune"), "torchtune torchao torch")}
    found = {}
    for impl, (python, packages) in probes.items():
        if python is None:
            continue
        code = ("import importlib.metadata as m, sys\n"
                "print(', '.join(f'{p} {m.version(p)}' for p in sys.argv[1:]))")
        out = subprocess.run([python, "-c", code, *packages.split()], capture_output=True, text=True)
        found[impl] = out.stdout.strip() or out.stderr.strip().splitlines()[-1]
    return found


def write_report(table: list[dict], commands_used: dict[str, dict[str, str]], failures: dict[str, str],
                 args: argparse.Namespace, load: tuple[tuple[float, ...], tuple[float, ...]],
                 found_versions: dict[str, str], torchtune_note: str, own_peak: int) -> None:
    from lit_model.core.files import atomic_write  # imported after the runs: it imports torch

    # a smoke check's numbers (one short run) stay out of benchmarks/results/, beside the runs' logs
    results = HERE / "results" if not args.quick else WORK
    results.mkdir(exist_ok=True)
    name = args.report if not args.quick else "vs_peers_quick"
    if table:
        atomic_write(results / f"{name}.csv", csv_text(table))
    sections = [
        f"# lit-model vs peers, as users run them (CPU, {os.cpu_count()} cores, median of {args.repeats})\n",
        f"Regenerate: `python benchmarks/vs_peers.py --rows {' '.join(args.rows)} --impls {' '.join(args.impls)} "
        f"--steps {args.steps} --warmup {args.warmup} --repeats {args.repeats}"
        + (f" --report {args.report}" if args.report != "vs_peers" else "") + "`\n",
        __doc__.split("What is measured, and how:", 1)[1].strip() + "\n",
        f"Steps per training run: {args.steps}; tokens/s from step {args.warmup} to step {args.steps - 1}. "
        "Threads: each implementation's default (OMP_NUM_THREADS and MKL_NUM_THREADS removed from the environment). "
        "Precision: 32-true and bf16-true are lit-model's and litgpt's own flags; the Hugging Face Trainer runs "
        "32-true in fp32 and bf16-true with the model created in bfloat16 (`dtype=torch.bfloat16`, formerly "
        "`torch_dtype`; no autocast), as HF users train in bf16 on a CPU, and so do TRL's DPOTrainer and GRPOTrainer (with "
        "`bf16=False`: their configs' default is autocast); torchtune's `dtype: fp32` / `bf16`.\n",
        f"CPU: {cpu_description()} (tokens/s and their ratios are of this machine).\n",
        f"Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load[0])}; after: "
        f"{', '.join(f'{x:.2f}' for x in load[1])}. This benchmark's own peak RSS during the runs: {own_peak / 2**20:.0f} MB.\n",
        "Versions: " + "; ".join(f"{impl}: {v}" for impl, v in found_versions.items()) + ".\n",
        f"torchtune: {torchtune_note}\n",
        markdown_table(table) + "\n" if table else "No row completed.\n",
    ]
    sections.append(flops_section(table, select_rows(args.rows)))
    if failures:
        sections.append("## Failures\n\n" + "\n\n".join(f"**{k}**: {v}" for k, v in failures.items()) + "\n")
    sections.append("## Commands\n\n" + "\n".join(
        f"- {row} / {impl}: `{command}`" for row, per_impl in commands_used.items() for impl, command in per_impl.items()) + "\n")
    configs = [WORK / "runs" / row / "torchtune-0" / "torchtune.yaml" for row, per_impl in commands_used.items()
               if "torchtune" in per_impl]
    if configs:  # the file torchtune's command names, as the first run of the first such row wrote it
        sections.append(f"torchtune's --config ({configs[0].parent.parent.name}; the other rows differ in block, "
                        f"batch, steps and dtype):\n\n```yaml\n{configs[0].read_text()}\n```\n")
    atomic_write(results / f"{name}.md", "\n".join(sections))


def flops_section(table: list[dict], rows: list[Row]) -> str:
    """lit-model's achieved training FLOP/s against this CPU's measured matmul peak (benchmarks/matmul_peak.py)."""
    from matmul_peak import FORMULA, matmul_peak, training_flops_per_token

    by_name = {row.name: row for row in rows}
    ours = [r for r in table if r["implementation"] == "lit_model" and by_name[r["row"]].kind == "pretrain"]
    if not ours:
        return ""
    peaks = {p: matmul_peak(p) for p in {by_name[r["row"]].precision for r in ours}}
    lines = ["## lit-model's achieved FLOP/s\n", f"{FORMULA}\n",
             "Peak: the best of several 4096 x 4096 products (torch.mm; in fp32 also oneDNN's inner product, the faster "
             "on non-Intel CPUs: benchmarks/matmul_peak.py), default threads, measured after the runs.\n",
             "| row | tokens/s | training GFLOP/s | matmul peak GFLOP/s | fraction of peak |", "|---|---|---|---|---|"]
    for r in ours:
        row = by_name[r["row"]]
        achieved = r["tokens_per_sec"] * training_flops_per_token(row.block, **ARCH)
        lines.append(f"| {row.name} | {r['tokens_per_sec']} | {achieved / 1e9:.1f} | {peaks[row.precision] / 1e9:.1f} | "
                     f"{achieved / peaks[row.precision]:.3f} |")
    return "\n".join(lines) + "\n"


# ---- main ----------------------------------------------------------------------------------------
TORCHTUNE_NOTE = (
    "torchtune 0.6.1 with torchao 0.11.0, in benchmarks/.venv-torchtune. It has no pretraining recipe: its "
    "pretraining rows run `tune run full_finetune_single_device` from a randomly initialised transformers checkpoint "
    "of the same model (benchmarks/_torchtune_peer.py), `text_completion_dataset` packed into block-size windows, "
    "AdamW, cosine schedule to 0 after the same warmup. torchao 0.12 and later (0.18.0 is the newest) no longer "
    "have torchao.dtypes.nf4tensor, which torchtune 0.6.1 imports at start (`ModuleNotFoundError: No module named "
    "'torchao.dtypes.nf4tensor'`), hence the pinned 0.11.0. Not in the fine-tuning (its LoRA recipes take only "
    "their own model builders' LoRA variants) nor the generation rows.")


def peer_pythons(impls: list[str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each peer's interpreter, installed on first use; a peer that does not install is left out, with the error."""
    pythons, failed = {}, {}
    # lit-model as its README installs it (`pip install -e .`: no test extras, so no transformers, which lightning's
    # torchmetrics would otherwise import at start-up); the HF driver and the preparation run in this environment
    installers = {"lit_model": lambda: venv_python(HERE / ".venv-lit-model", ["-e", str(ROOT)]),
                  "litgpt": lambda: litgpt_python(("litdata",)),
                  "torchtune": lambda: venv_python(HERE / ".venv-torchtune", list(TORCHTUNE))}
    for impl, installer in installers.items():
        if impl in impls or (impl == "lit_model" and "lit_model_glibc" in impls):
            try:
                pythons[impl] = installer()
            except subprocess.CalledProcessError as error:
                failed[impl] = f"did not install: {error}"
    return pythons, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="row names or parts of them (pretrain-b1024, "
                        "bf16, lora), or all")
    parser.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s (compilation, warm-up)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROW}, one repeat, 20 steps: a smoke check")
    parser.add_argument("--report", default="vs_peers", help="name of the results files (benchmarks/results/NAME.md, "
                        ".csv): rows measured at different times keep their own report")
    parser.add_argument("--list", action="store_true", help="list the rows and the time estimate, run nothing")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats, args.steps, args.warmup = [QUICK_ROW], 1, 20, 5
    if not 0 < args.warmup < args.steps - 1:
        parser.error("--warmup must be at least 1 and below --steps - 1")
    rows = select_rows(args.rows)
    if args.list:
        for row in ROWS:
            print(("* " if row.name in DEFAULT_ROWS else "  ") + row.name)
        print(f"\n--rows {' '.join(args.rows)} --steps {args.steps} --repeats {args.repeats}: about "
              f"{estimate_seconds(rows, args.impls, args.steps, args.repeats) / 60:.0f} minutes on 2 idle cores")
        return
    pythons, failed = peer_pythons(args.impls)
    impls = [impl for impl in args.impls if impl not in failed]
    print(f"{len(rows)} rows, estimated {estimate_seconds(rows, args.impls, args.steps, args.repeats) / 60:.0f} min "
          "on 2 idle cores (plus one-time preparation)", flush=True)
    setup = Setup(rows, impls, pythons)
    before = os.getloadavg()
    table, commands_used, failures = benchmark(rows, impls, args.steps, args.warmup, args.repeats, setup, pythons)
    after, own_peak = os.getloadavg(), own_peak_bytes()  # before the report imports torch
    failures.update(failed)
    note = failed.get("torchtune", TORCHTUNE_NOTE) if "torchtune" in args.impls else "not asked for (--impls)."
    write_report(table, commands_used, failures, args, (before, after), versions(pythons), note, own_peak)
    print("\n" + (markdown_table(table) if table else "no row completed"))
    for key, text in failures.items():
        print(f"\n{key}: {text}")


if __name__ == "__main__":
    main()
