"""One timed greedy generation with lit-model or litgpt on the same tiny random model (see
generate_vs_litgpt.py). Prints one JSON line: decode tokens/s (new tokens after the first, excluding the
prefill) and peak RSS."""

import argparse
import json
import resource
import time

import torch

from _train_worker import ARCH

DTYPES = {"32-true": torch.float32, "bf16-true": torch.bfloat16}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["lit_model", "litgpt"], required=True)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--prompt_length", type=int, default=32)
    parser.add_argument("--max_new_tokens", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    dtype = DTYPES[args.precision]
    prompt = torch.randint(0, ARCH["vocab_size"], (args.prompt_length,))
    total = args.prompt_length + args.max_new_tokens
    if args.impl == "lit_model":
        from lit_model import GPT, Config
        from lit_model.generation import generate

        model = GPT(Config(name="bench", **ARCH)).to(dtype).eval()
        run = lambda: generate(model, prompt, args.max_new_tokens, temperature=0.0)
    else:
        from litgpt import GPT, Config
        from litgpt.generate.base import generate

        model = GPT(Config(name="bench", mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False,
                           rotary_percentage=1.0, parallel_residual=False, **ARCH)).to(dtype).eval()
        model.max_seq_length = total
        model.set_kv_cache(batch_size=1)
        run = lambda: generate(model, prompt, total, temperature=0.0, top_k=1)
    with torch.inference_mode():
        run()  # warm-up
        prefill = [0.0]
        start = time.perf_counter()
        run()
        seconds = time.perf_counter() - start
        # Time the prefill alone to subtract it: one forward over the prompt.
        start = time.perf_counter()
        if args.impl == "lit_model":
            model.set_kv_cache(1, total)
            model(prompt[None], torch.arange(args.prompt_length))
        else:
            model(prompt[None], torch.arange(args.prompt_length))
        prefill[0] = time.perf_counter() - start
    print(json.dumps({
        "impl": args.impl, "precision": args.precision,
        "decode_tokens_per_sec": (args.max_new_tokens - 1) / max(seconds - prefill[0], 1e-9),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()
