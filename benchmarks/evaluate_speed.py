"""lit-model evaluate vs lm-eval's own ``hf`` model: tokens/s of the log-likelihood pass of one local multiple-choice
task on the same checkpoint (random weights of a Pythia architecture, written by this script; the ``hf`` model reads
its ``convert lit_to_hf`` copy), same batch size, fp32 on the CPU.

    python benchmarks/evaluate_speed.py                       # pythia-14m, batch size 16, 3 repeats
    python benchmarks/evaluate_speed.py --model pythia-70m --docs 25   # results/evaluate_speed_pythia-70m.md

The task (written by the script, with its JSON file): ``--docs`` questions, each the lines of a Python standard
library file before a line, whose four choices are that line and three others (lm-eval asks for each choice's
log-likelihood after the question: 4 x docs requests). Each repeat runs both models, alternating, each in a fresh
process under ``simple_evaluate``; the time is that of the model's ``loglikelihood`` call (tokenizing and scoring
every request, as lm-eval calls it), and the tokens are the inputs the requests feed the model (the same number for
both). The tables report each one's median and the ratio lit-model / hf; both must score the same accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: its lit_model, not an installed one

from _tables import cpu_description, csv_text, markdown_table  # noqa: E402
from lit_model.core.files import atomic_write  # noqa: E402

STDLIB = Path(os.__file__).parent
SOURCES = ("textwrap", "shlex", "fnmatch", "argparse", "string", "difflib", "calendar", "ftplib")
VOCAB = 8192  # the BPE trained on SOURCES: the model's vocabulary stays the architecture's (the head's cost is real)


def write_checkpoint(out_dir: Path, config, tokenizer_dir: Path, seed: int) -> None:
    """A checkpoint of ``config`` with random weights (init_weights) and the BPE trained on SOURCES (once)."""
    import torch

    from lit_model import GPT
    from lit_model.io.checkpoint import lit_state_dict, save_checkpoint_dir
    from lit_model.io.tokenizer import train_bpe

    if not (tokenizer_dir / "tokenizer.json").is_file():
        train_bpe([STDLIB / f"{name}.py" for name in SOURCES], VOCAB, tokenizer_dir)
    torch.manual_seed(seed)
    gpt = GPT(config)
    gpt.init_weights()
    save_checkpoint_dir(lit_state_dict(gpt, config), config, out_dir, tokenizer_dir=tokenizer_dir)


def prepare(work: Path, model: str, docs: int, seed: int) -> None:
    """The checkpoint (random weights), its transformers copy and the task over its JSON file."""
    from lit_model import Config
    from lit_model.io.convert import lit_to_hf

    if not (work / "lit" / "model_config.yaml").is_file():
        write_checkpoint(work / "lit", Config.from_name(model), work / "tokenizer", seed)
        lit_to_hf(work / "lit", work / "hf")
    rng = random.Random(seed)
    lines = [line for name in SOURCES for line in (STDLIB / f"{name}.py").read_text().splitlines() if line.strip()]
    rows = []
    for _ in range(docs):
        end = rng.randrange(40, len(lines))
        context = "\n".join(lines[end - rng.randrange(8, 40) : end]) + "\n"  # 8-40 lines: ~60-400 tokens
        choices = [lines[end], *rng.sample(lines, 3)]
        rng.shuffle(choices)
        rows.append({"question": context, "choices": choices, "answer": choices.index(lines[end])})
    (work / "task.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (work / "task.yaml").write_text(
        f"task: evaluate_speed\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {work / 'task.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n")


def worker(impl: str, work: Path, batch_size: int) -> dict:
    """One implementation's run of the task, in this process: the seconds of its loglikelihood call."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    if impl == "hf":
        from lm_eval.models.huggingface import HFLM

        lm = HFLM(pretrained=str(work / "hf"), backend="causal", device="cpu", dtype="float32", batch_size=batch_size)
    else:
        from lit_model.infer.load import Precision, load_model
        from lit_model.io.prompts import PromptStyle
        from lit_model.io.tokenizer import Tokenizer
        from lit_model.recipes.evaluate import harness_model

        lit = work / "lit"
        lm = harness_model(load_model(lit, ["cpu"], torch.float32, decoding=True), Tokenizer(lit),
                           PromptStyle.from_checkpoint(lit), Precision("32-true", torch.float32, None), batch_size,
                           1234, lit)
    timed = {"seconds": 0.0, "requests": 0}
    loglikelihood = lm.loglikelihood

    def timed_loglikelihood(requests, *args, **kwargs):
        start = time.perf_counter()
        out = loglikelihood(requests, *args, **kwargs)
        timed["seconds"] += time.perf_counter() - start
        timed["requests"] += len(requests)
        return out

    lm.loglikelihood = timed_loglikelihood
    results = simple_evaluate(model=lm, tasks=[str(work / "task.yaml")], task_manager=TaskManager(include_defaults=False),
                              bootstrap_iters=0, log_samples=False)
    tokens = lm.scorer.tokens if impl == "lit_model" else None  # the inputs fed to the model (the same for both)
    return {**timed, "tokens": tokens, "acc": results["results"]["evaluate_speed"]["acc,none"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="pythia-14m")
    parser.add_argument("--docs", type=int, default=100)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per process (1: a shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", choices=["hf", "lit_model"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, default=HERE / ".evaluate_speed")
    args = parser.parse_args()
    work = args.work / args.model
    if args.worker:
        print(json.dumps(worker(args.worker, work, args.batch_size)))
        return
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, args.model, args.docs, args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads),
           "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"hf": [], "lit_model": []}
    for repeat in range(args.repeats):
        for impl in (("hf", "lit_model") if repeat % 2 == 0 else ("lit_model", "hf")):
            command = [sys.executable, __file__, "--worker", impl, "--model", args.model, "--work", str(args.work),
                       "--batch_size", str(args.batch_size)]
            out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
            runs[impl].append(json.loads(out.strip().splitlines()[-1]))
            print(impl, runs[impl][-1], file=sys.stderr, flush=True)
    load_after = os.getloadavg()[0]
    tokens = runs["lit_model"][0]["tokens"]
    medians = {impl: statistics.median(run["seconds"] for run in done) for impl, done in runs.items()}
    rows = [{"model": args.model, "implementation": impl, "batch_size": args.batch_size,
             "requests": runs[impl][0]["requests"], "input_tokens": tokens,
             "seconds_median": round(medians[impl], 2),
             "seconds_all": " ".join(f"{run['seconds']:.2f}" for run in runs[impl]),
             "tokens_per_sec": round(tokens / medians[impl]), "speed_vs_hf": round(medians["hf"] / medians[impl], 2),
             "acc": runs[impl][0]["acc"]} for impl in ("hf", "lit_model")]
    import lm_eval
    import torch
    import transformers

    stem = HERE / "results" / ("evaluate_speed" if args.model == "pythia-14m" else f"evaluate_speed_{args.model}")
    flags = " ".join(sys.argv[1:])
    text = (f"# evaluate: lit-model vs lm-eval {lm_eval.__version__}'s hf model (transformers "
            f"{transformers.__version__}, torch {torch.__version__}), log-likelihood pass\n\n"
            f"Regenerate: `python benchmarks/evaluate_speed.py{' ' + flags if flags else ''}`\n\n"
            f"CPU: {cpu_description()}; {args.threads} thread(s) per process; 1-minute load average "
            f"{load_before:.1f} before, {load_after:.1f} after (a shared machine: absolute speeds move with its load, "
            f"the runs alternate between the implementations).\n\n"
            f"{__doc__.split(chr(10) + chr(10), 1)[0]}\n\n{markdown_table(rows)}\n")
    atomic_write(stem.with_suffix(".md"), text)
    atomic_write(stem.with_suffix(".csv"), csv_text(rows))
    print(text)


if __name__ == "__main__":
    main()
