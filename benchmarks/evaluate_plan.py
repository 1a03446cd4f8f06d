"""``lit-model evaluate --plan`` against the measured peak: the planned peak memory of evaluating, and the peak RSS of
the real command (``evaluate/main.py``, each run in a fresh process, its peak from wait4) on CPU, fp32.

    python benchmarks/evaluate_plan.py

Two models with random weights (a 2-layer 64-wide one with a 512-token context and pythia-14m's architecture with
its 512-token context and 50k vocabulary), batch sizes 4 and 16, requests of a quarter of the context and of the
whole context. Each run evaluates three local tasks together: multiple choice (4 choices after a context of that
length), a rolling log-likelihood of a text of that length (every position scored) and a generation of 16 tokens
after a prompt of that length (the same prompt in every document, so the batch runs whole). The plan is for the
longest requests (the whole context) whatever the requests are: its error on the shorter ones is how much it
overestimates them. Results: benchmarks/results/evaluate_plan.csv and .md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout: its lit_model, not an installed one

from _tables import cpu_description, csv_text, markdown_table  # noqa: E402
from evaluate_speed import STDLIB, write_checkpoint  # noqa: E402
from lit_model.core.files import atomic_write  # noqa: E402

WORK = HERE / ".evaluate_plan"
MODELS = {"tiny-2x64": dict(name="tiny-2x64", block_size=512, vocab_size=8192, n_layer=2, n_embd=64, n_head=4,
                            n_query_groups=2, intermediate_size=256),
          "pythia-14m": None}
BATCH_SIZES = (4, 16)
LENGTHS = (0.25, 1.0)  # of the context


def tasks(work: Path, tokenizer, length: int, docs: int) -> str:
    """Three task YAMLs over a JSON file whose texts are ``length`` tokens long; their paths, comma-separated."""
    ids = tokenizer.encode((STDLIB / "argparse.py").read_text(), bos=False).tolist()
    texts = [tokenizer.decode(ids[i * length : (i + 1) * length]) for i in range(docs)]
    rows = [{"text": text, "choices": [" x", " y", " None", " self"], "answer": 0} for text in texts]
    (work / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {work / 'data.jsonl'}\ntest_split: test\n"
    bodies = {
        "mc": "output_type: multiple_choice\ndoc_to_text: '{{text}}'\ndoc_to_choice: '{{choices}}'\n"
              "doc_to_target: answer\nmetric_list:\n  - metric: acc\n",
        "ppl": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
               "metric_list:\n  - metric: word_perplexity\n",
        "gen": f"output_type: generate_until\ndoc_to_text: {json.dumps(texts[0])}\ndoc_to_target: 'x'\n"
               "generation_kwargs:\n  until: ['\\n\\n\\n']\n  max_gen_toks: 16\n  do_sample: false\n"
               "metric_list:\n  - metric: exact_match\n",
    }
    paths = []
    for name, body in bodies.items():
        paths.append(work / f"plan_{name}.yaml")
        paths[-1].write_text(f"task: plan_{name}\n{common}{body}")
    return ",".join(map(str, paths))


ENV = {**os.environ, "PYTHONPATH": str(HERE.parent), "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
       "HF_HUB_OFFLINE": "1"}  # this checkout's lit_model


def peak_rss(command: list[str]) -> int:
    """The peak RSS of ``command`` run to its end (wait4's ru_maxrss: of that process alone)."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV)
    _, status, usage = os.wait4(process.pid, 0)
    if status != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {process.stderr.read()}")
    return usage.ru_maxrss * 1024


def main() -> None:
    from lit_model import Config
    from lit_model.io.tokenizer import Tokenizer

    script = str(HERE.parent / "evaluate" / "main.py")
    rows = []
    for model, fields in MODELS.items():
        config = Config(**fields) if fields else Config.from_name(model)
        checkpoint = WORK / model
        if not (checkpoint / "model_config.yaml").is_file():
            write_checkpoint(checkpoint, config, WORK / "tokenizer", seed=0)
        tokenizer = Tokenizer(checkpoint)
        for batch_size in BATCH_SIZES:
            flags = ["--checkpoint_dir", str(checkpoint), "--precision", "32-true", "--batch_size", str(batch_size)]
            plan = json.loads(subprocess.run([sys.executable, script, *flags, "--plan", "json"], check=True,
                                             capture_output=True, text=True, env=ENV).stdout)
            for share in LENGTHS:
                length = int(config.block_size * share)
                specs = tasks(WORK, tokenizer, length, docs=2 * batch_size)
                measured = peak_rss([sys.executable, script, *flags, "--tasks", specs, "--out_dir", str(WORK / "out"),
                                     "--overwrite"])
                rows.append({"model": model, "batch_size": batch_size, "request_tokens": length,
                             "context": config.block_size, "planned_mib": round(plan["peak_bytes"] / 2**20),
                             "planned_phase": plan["peak_phase"], "measured_peak_rss_mib": round(measured / 2**20),
                             "error_pct": round(100 * (plan["peak_bytes"] - measured) / measured, 1)})
                print(rows[-1], file=sys.stderr, flush=True)
    errors = [row["error_pct"] for row in rows]
    text = (f"# evaluate --plan against the measured peak RSS (CPU, fp32)\n\nRegenerate: `python "
            f"benchmarks/evaluate_plan.py`\n\nCPU: {cpu_description()}, 1 thread.\n\n"
            f"{__doc__.split(chr(10) + chr(10))[2]}\n\n{markdown_table(rows)}\n\nerror = (planned - measured) / "
            f"measured: from {min(errors):+.1f} % to {max(errors):+.1f} % (negative: the plan is under the peak).\n")
    atomic_write(HERE / "results" / "evaluate_plan.md", text)
    atomic_write(HERE / "results" / "evaluate_plan.csv", csv_text(rows))
    print(text)


if __name__ == "__main__":
    main()
