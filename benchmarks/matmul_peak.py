"""This CPU's dense matmul peak, and what fraction of it a training run achieves.

    python benchmarks/matmul_peak.py                                # the peak, fp32 and bf16
    python benchmarks/matmul_peak.py --tokens_per_sec 5000 --block 256 --precision bf16-true
    python benchmarks/matmul_peak.py --step_bound --block 256 --micro_batch 8   # the linear layers' products alone
    python benchmarks/matmul_peak.py --report    # lit-model-40m pretraining at block 1,024 against the peak: results/
    python benchmarks/matmul_peak.py --report --device cuda --compile --size 8192 --micro_batch 16 --steps 30 \
        --name matmul_peak_h100                  # on a GPU, also with --compile

The peak: torch.mm on square matrices (4096 by default), in fp32 also oneDNN's inner product (whichever is faster:
on non-Intel CPUs MKL's torch.mm runs at about half of it), torch's default threads, best of --repeats timed calls
after a warm-up one: 2 n^3 FLOP per call. A training step's FLOP per token: 6 N + 12 n_layer n_embd T (the PaLM
paper's count: N the parameters that multiply (all but the embedding table; the output head included), T the
sequence length; the attention term counts the full T x T scores, as if nothing were skipped under the causal
mask). vs_peers.py reports lit-model's pretraining rows with it.

The step bound (``--step_bound``): every matrix product a training step of the model's linear layers must do, at
its own shape (for y = x W^T of M tokens: the forward M x in @ in x out, and backward's dX = dY W and dW = dY^T x),
each timed alone with the peak's kernels (best of --repeats), summed: the time these products take at best, before the
attention, the norms, the loss and the optimizer add to it. An implementation that runs the same products (the
peers split query/key/value and the MLP's input matrices into smaller ones) trains at most micro batch x block
tokens in that time.

The report (``--report``, benchmarks/results/matmul_peak.{md,csv}): lit-model's own pretrain/main.py as a user runs it
(default threads and data) on lit-model-40m at block 1,024, micro batch 4, in each precision: the median of the
per-step tokens/s in its metrics.csv (the first --skip steps and the last, which evaluates, left out) against the
peak measured right after, and the step bound of the same shapes. ``--device cuda``: the products on the GPU (each
timed call synchronizes), the runs on it too (pretrain/main.py takes the GPU where there is one); ``--compile``
adds each precision's run with ``--compile``.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _tables import best_seconds, cpu_description, csv_text, markdown_table

from lit_model.core.files import atomic_write

ROOT = Path(__file__).resolve().parents[1]

FORMULA = ("Achieved training FLOP/s = tokens/s x (6 N + 12 n_layer n_embd T): N the parameters that multiply (all "
           "but the embedding table and the norms, the output head included: 4,210,688 for the 5.26M model), T the block size; "
           "the attention term counts the full T x T scores (PaLM's count), whatever the causal mask lets a kernel skip.")
DEFAULT_ARCH = dict(vocab_size=4096, n_layer=4, n_embd=256, n_head=4, n_query_groups=4, intermediate_size=688)


def best_mm_seconds(m: int, k: int, n: int, precision: str = "32-true", repeats: int = 5, device: str = "cpu") -> float:
    """The best time of an m x k by k x n product of the precision's dtype, after a warm-up call: torch.mm, or in
    fp32 oneDNN's inner product where this torch has it (the kernel lit-model's fp32 linear maps take on non-Intel
    CPUs, where MKL's torch.mm runs at about half of it: lit_model/kernels/ops.py), whichever is faster. On a GPU each
    timed call waits for the product (torch's default fp32 there: no TF32, as lit-model's 32-true runs)."""
    import torch  # here: vs_peers.py imports this module, and its own process stays without torch while it measures

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    if a.is_cuda:
        return best_seconds(lambda: (torch.mm(a, b), torch.cuda.synchronize()), repeats)
    kernels = [lambda: torch.mm(a, b)]
    if dtype == torch.float32 and hasattr(torch.ops.mkldnn, "_linear_pointwise") and torch.backends.mkldnn.is_available():
        kernels.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b.t(), None, "none", [], ""))
    return min(best_seconds(kernel, repeats) for kernel in kernels)


def matmul_peak(precision: str = "32-true", size: int = 4096, repeats: int = 5, device: str = "cpu") -> float:
    """The best FLOP/s of a product of two size x size matrices of the precision's dtype (best_mm_seconds)."""
    return 2 * size**3 / best_mm_seconds(size, size, size, precision, repeats, device)


def linear_shapes(n_embd: int, n_head: int, n_query_groups: int, intermediate_size: int, vocab_size: int, n_layer: int,
                  **_: object) -> list[tuple[int, int, int]]:
    """(in, out, how many) of the model's linear layers: fused query/key/value, attention output, the MLP's two
    input matrices (fused) and its output, the head."""
    head = n_embd // n_head
    return [(n_embd, head * (n_head + 2 * n_query_groups), n_layer), (n_embd, n_embd, n_layer),
            (n_embd, 2 * intermediate_size, n_layer), (intermediate_size, n_embd, n_layer), (n_embd, vocab_size, 1)]


def matmul_parameters(**arch: object) -> int:
    """The weights of a Llama-style model's matrix products: attention (query, key, value, output), the MLP's three
    matrices, and the untied output head."""
    return sum(fan_in * fan_out * count for fan_in, fan_out, count in linear_shapes(**arch))  # type: ignore[arg-type]


def step_matmul_seconds(tokens: int, precision: str = "32-true", repeats: int = 10, device: str = "cpu",
                        **arch: object) -> float:
    """The time of a training step's linear-layer products for ``tokens`` tokens (forward, dX, dW), each timed alone."""
    total = 0.0
    for fan_in, fan_out, count in linear_shapes(**arch):  # type: ignore[arg-type]
        products = [(tokens, fan_in, fan_out), (tokens, fan_out, fan_in), (fan_out, tokens, fan_in)]
        total += count * sum(best_mm_seconds(m, k, n, precision, repeats, device) for m, k, n in products)
    return total


def training_flops_per_token(block: int, **arch: object) -> float:
    return 6 * matmul_parameters(**arch) + 12 * int(arch["n_layer"]) * int(arch["n_embd"]) * block


def architecture(model_name: str) -> dict:
    from lit_model import Config  # imports torch: see best_mm_seconds

    config = Config.from_name(model_name)
    return {key: getattr(config, key) for key in DEFAULT_ARCH} | {"vocab_size": config.padded_vocab_size}


def pretrain_tokens_per_sec(model_name: str, block: int, micro_batch: int, precision: str, steps: int, skip: int,
                            compile: bool = False) -> float:
    """The median per-step tokens/s of pretrain/main.py (default threads and data), steps skip+1 .. steps-1."""
    with tempfile.TemporaryDirectory() as out:
        argv = [sys.executable, "pretrain/main.py", "--model_name", model_name, "--precision", precision,
                "--micro_batch_size", str(micro_batch), "--global_batch_size", str(micro_batch),
                "--override_max_seq_length", str(block), "--max_steps", str(steps), "--warmup_steps", "1",
                "--log_interval", "1", "--eval_interval", str(steps), "--eval_iters", "1", "--save_interval", "0",
                "--out_dir", out, "--overwrite", *(["--compile", "true"] if compile else [])]
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
        with open(Path(out) / "metrics.csv", newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("tokens_per_sec")]
    return statistics.median(float(row["tokens_per_sec"]) for row in rows if skip < int(row["step"]) < steps)


def device_description(device: str) -> str:
    if device == "cpu":
        return f"CPU: {cpu_description()}"
    import torch

    return f"GPU: {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})"


def report(out_dir: Path, model_name: str, block: int, micro_batch: int, steps: int, skip: int, repeats: int,
           name: str = "matmul_peak", device: str = "cpu", size: int = 4096, compile_too: bool = False) -> str:
    arch, tokens = architecture(model_name), micro_batch * block
    rows = []
    for precision in ("32-true", "bf16-true"):
        for compile in (False, True) if compile_too else (False,):
            measured = pretrain_tokens_per_sec(model_name, block, micro_batch, precision, steps, skip, compile)
            peak = matmul_peak(precision, size, repeats, device)
            bound = tokens / step_matmul_seconds(tokens, precision, device=device, **arch)
            achieved = measured * training_flops_per_token(block, **arch)
            run = f"{model_name} pretrain, micro batch {micro_batch} x block {block}{', --compile' if compile else ''}"
            rows.append({"run": run, "precision": precision,
                     "tokens_per_sec": f"{measured:.0f}", "training_gflops": f"{achieved / 1e9:.1f}",
                     "matmul_peak_gflops": f"{peak / 1e9:.1f}", "fraction_of_peak": f"{achieved / peak:.3f}",
                     "linear_products_bound_tokens_per_sec": f"{bound:.0f}", "fraction_of_bound": f"{measured / bound:.3f}"})
    atomic_write(out_dir / f"{name}.csv", csv_text(rows))
    argv = [a for i, a in enumerate(sys.argv[1:]) if a != "--out_dir" and (i == 0 or sys.argv[i] != "--out_dir")]
    command = " ".join(["python benchmarks/matmul_peak.py", *argv])  # as run, wherever it wrote
    text = "\n".join([
        f"# lit-model against this {'CPU' if device == 'cpu' else 'GPU'}'s matmul peak\n",
        f"Generated by `{command}` (see its docstring). {device_description(device)}. "
        f"Each run: `pretrain/main.py --model_name {model_name} --micro_batch_size {micro_batch} --override_max_seq_length "
        f"{block} --max_steps {steps}`, tokens/s the median of steps {skip + 1} to {steps - 1}.\n",
        FORMULA + f" Peak: {size} x {size} products (torch.mm; in fp32 on a CPU also oneDNN's inner product, whichever is faster), best of "
        f"{repeats}, measured after each run. The bound: "
        "the step's linear-layer products timed alone.\n",
        markdown_table(rows),
    ])
    atomic_write(out_dir / f"{name}.md", text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens_per_sec", type=float, help="a run's training tokens/s, to report against the peak")
    parser.add_argument("--block", type=int, help="sequence length (default 256; with --report 1,024)")
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-true"])
    parser.add_argument("--step_bound", action="store_true", help="the step's linear-layer products alone: a speed bound")
    parser.add_argument("--micro_batch", type=int, help="default 8; with --report 4")
    parser.add_argument("--model_name", help="a lit-model config's architecture (default: the 5.26M peer model)")
    parser.add_argument("--report", action="store_true", help="measure lit-model-40m pretraining at block 1,024 (or "
                        "--model_name, --block, --micro_batch) against the peak into --out_dir")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--skip", type=int, default=2, help="the first steps left out of the report's tokens/s")
    parser.add_argument("--out_dir", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--name", default="matmul_peak", help="the report's file name (--out_dir/NAME.{md,csv})")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the products (and --report's "
                        "runs: pretrain/main.py takes the GPU where there is one) run")
    parser.add_argument("--compile", action="store_true", help="--report: also each precision's run with --compile")
    args = parser.parse_args()
    if args.report:
        print(report(args.out_dir, args.model_name or "lit-model-40m", args.block or 1024, args.micro_batch or 4,
                     args.steps, args.skip, args.repeats, args.name, args.device, args.size, args.compile))
        return
    arch = architecture(args.model_name) if args.model_name else DEFAULT_ARCH
    block, micro_batch = args.block or 256, args.micro_batch or 8
    peaks = {p: matmul_peak(p, args.size, args.repeats) for p in ("32-true", "bf16-true")}
    for precision, peak in peaks.items():
        print(f"{args.size} x {args.size} product, {precision}: {peak / 1e9:,.1f} GFLOP/s (best of {args.repeats})")
    if args.tokens_per_sec:
        achieved = args.tokens_per_sec * training_flops_per_token(block, **arch)
        print(f"{FORMULA}\n{args.tokens_per_sec:,.0f} tokens/s at block {block}: {achieved / 1e9:,.1f} GFLOP/s, "
              f"{achieved / peaks[args.precision]:.3f} of the {args.precision} peak")
    if args.step_bound:
        tokens = micro_batch * block
        for precision, peak in peaks.items():
            seconds = step_matmul_seconds(tokens, precision, **arch)
            flops = 6 * tokens * matmul_parameters(**arch)
            print(f"{precision}, micro batch {micro_batch} x block {block}: the linear layers' products alone take "
                  f"{seconds * 1e3:.1f} ms a step ({flops / seconds / peak:.3f} of the peak): at most "
                  f"{tokens / seconds:,.0f} tokens/s")


if __name__ == "__main__":
    main()
