"""Timed greedy generations with lit-model or litgpt on the same tiny random model (see vs_litgpt.py). Prints
one JSON line: decode speed and peak RSS.

Both implementations are timed the same way, at each new token as their streaming interface hands it over
(lit-model's ``on_token``, litgpt's ``generate_fn`` iterator): ``decode_tokens_per_sec`` is the tokens after
the first over the time from the first to the last (the prefill excluded), and ``step_tokens_per_sec`` one over
the median time between two tokens, which a shared machine's bursts of load disturb less. Each is the median
over ``--runs`` generations after a warm-up one.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from _train_worker import ARCH

DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}


def peak_rss_bytes() -> int:
    """VmHWM: unlike ru_maxrss it does not carry over the parent's peak across exec."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["lit_model", "litgpt"], required=True)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.precision]
    prompt = torch.randint(0, ARCH["vocab_size"], (args.prompt_length,))
    total = args.prompt_length + args.max_new_tokens
    stamps: list[float] = []
    if args.impl == "lit_model":
        from lit_model import GPT, Config
        from lit_model.infer.decode import generate

        model = GPT(Config(name="bench", **ARCH)).to(dtype).eval()
        stamp = lambda row, token: stamps.append(time.perf_counter())  # noqa: E731
        run = lambda: generate(model, prompt, args.max_new_tokens, temperature=0.0, on_token=stamp)  # noqa: E731
    else:
        from litgpt import GPT, Config
        from litgpt.generate.base import generate_fn

        model = GPT(Config(name="bench", mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False,
                           rotary_percentage=1.0, parallel_residual=False, **ARCH)).to(dtype).eval()
        model.max_seq_length = total
        model.set_kv_cache(batch_size=1)

        def run() -> None:
            for _ in generate_fn(model, prompt, total, temperature=0.0, top_k=1, include_prompt=False,
                                 include_eos=True):
                stamps.append(time.perf_counter())

    decode, step = [], []
    with torch.inference_mode():
        for i in range(args.runs + 1):  # the first is a warm-up
            stamps.clear()
            run()
            assert len(stamps) == args.max_new_tokens, f"{len(stamps)} tokens: an eos ended the generation early"
            if i == 0:
                continue
            gaps = [b - a for a, b in zip(stamps, stamps[1:])]
            decode.append(len(gaps) / (stamps[-1] - stamps[0]))
            step.append(1 / statistics.median(gaps))
    print(json.dumps({
        "impl": args.impl, "precision": args.precision, "decode_tokens_per_sec": statistics.median(decode),
        "step_tokens_per_sec": statistics.median(step), "peak_rss_bytes": peak_rss_bytes(),
    }))


if __name__ == "__main__":
    main()
