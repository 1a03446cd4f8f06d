"""lit_model/kernels/ops.py against the PyTorch calls it replaces, forward + backward, on this machine's CPU:

    python benchmarks/ops.py            # ~30 seconds; writes benchmarks/results/ops.{csv,md}
    python benchmarks/ops.py --ops linear decoding --threads 0 --report ops_linear   # fp32 linear kernels, default threads

1. RMSNorm: ``ops.rms_norm`` vs ``F.rms_norm`` on (4 x 512, width) fp32 activations, and in bf16 vs the upcast
   formula (``ops.upcast_rms_norm``: fp32 statistics, as Hugging Face's and litgpt's RMSNorm).
2. Rotary embedding: ``ops.rotate`` vs the "rotate half" formula it replaces (``x * cos + cat(-x2, x1) * sin``),
   on queries as attention makes them (4 x 512 tokens, 4 heads of 64, a transposed view), fp32 and bf16.
3. Causal attention: ``ops.causal_attention_in_halves`` vs one causal ``F.scaled_dot_product_attention`` call,
   2048 tokens a batch (batch = 2048 / T), 4 query heads over 2 key/value heads of 64, fp32 and bf16, for T
   from 128 to 1024. The model takes the halves for 384 <= T <= 512 (``KernelPolicy.attends_in_halves``), where this table
   shows them faster in both dtypes.
   ``python benchmarks/ops.py --ops blocks --threads 0 --report ops_attention_blocks``: causal attention by query
   blocks (``ops.causal_attention_in_blocks``: fp32 scores and softmax per block of 128 queries, the probabilities
   kept) vs PyTorch's flash kernel, as many key/value heads as query heads, from vs_peers.py's model (4 heads of 64)
   to TinyLlama's 32 heads, bf16 and fp32, default threads (as the scripts run). The model takes the blocks in bf16
   on the CPU (``KernelPolicy.attends_in_blocks``), within a bound on the probabilities it keeps.
4. fp32 linear maps: ``ops.linear`` on oneDNN (``LIT_MODEL_FP32_LINEAR=onednn``) vs ``F.linear`` on PyTorch's BLAS
   (MKL), forward + backward, on the shapes of benchmarks/vs_peers.py's model: 8 x 256 tokens through its 256 -> 256,
   256 -> 688, 688 -> 256 and 256 -> 4096 (head) maps, and forward only for one token (a decoding step).
   lit-model takes oneDNN by default on x86 CPUs other than Intel's (``ops.onednn_fp32_linear``).
5. Decoding's fp32 products: one row through every matrix of a decoding step (three model shapes), each matrix read
   once a step, with the weights stored as ``ops.decoding_column_major`` says (column-major where MKL multiplies them on
   CPUs other than Intel's) against row-major, lit-model's kernel choice for both:
   ``python benchmarks/ops.py --ops linear decoding --threads 0 --report ops_linear``.

One thread (as benchmarks/vs_litgpt.py runs); each figure is the median of 5 rounds of 10 calls, the two
implementations alternating within a round, so the ratio comes from the same moments of a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from _tables import cpu_description, csv_text, markdown_table  # noqa: E402
from lit_model.model.gpt import rope_cache  # noqa: E402
from lit_model.core.config import Config  # noqa: E402
from lit_model.kernels import ops  # noqa: E402
from lit_model.kernels.ops import causal_attention_in_halves, linear, rms_norm, rotate, upcast_rms_norm  # noqa: E402
from lit_model.kernels.policy import kernel_policy  # noqa: E402
from lit_model.core.files import atomic_write

RESULTS = ROOT / "benchmarks" / "results"
DEFAULT_ONEDNN_LINEAR_MIN_MACS = ops.ONEDNN_LINEAR_MIN_MACS  # linear_rows lowers it to time the raw kernels
CPU = kernel_policy("cpu")  # the kernels a model on this CPU takes


def compare(ours: Callable[[], None], theirs: Callable[[], None], rounds: int = 5, calls: int = 10) -> tuple[float, float]:
    """Median milliseconds per call of each, alternating."""
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    for fn in (ours, theirs):
        fn()  # warm-up
    for _ in range(rounds):
        for name, fn in (("ours", ours), ("theirs", theirs)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append(1e3 * (time.perf_counter() - start) / calls)
    return statistics.median(times["ours"]), statistics.median(times["theirs"])


def rms_norm_rows() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for width in (256, 512, 1024):
            x = torch.randn(4, 512, width, dtype=dtype, requires_grad=True)
            weight = (1 + 0.1 * torch.randn(width)).to(dtype).requires_grad_()
            grad = torch.randn_like(x)
            if dtype == torch.float32:
                reference = lambda: F.rms_norm(x, (width,), weight, 1e-5).backward(grad)  # noqa: E731
            else:  # what HF's and litgpt's RMSNorm compute, and lit-model's for a few rows or on a GPU
                reference = lambda: upcast_rms_norm(x, weight, 1e-5).backward(grad)  # noqa: E731
            ours, theirs = compare(lambda: rms_norm(x, weight, 1e-5, CPU.norms_by_hand(x.numel())).backward(grad), reference)
            rows.append({"op": "rms_norm fwd+bwd", "shape": f"4x512x{width}", "dtype": str(dtype).removeprefix("torch."),
                         "lit_model_ms": round(ours, 3), "pytorch_ms": round(theirs, 3), "speedup": round(theirs / ours, 3)})
    return rows


def rope_rows() -> list[dict]:
    rows = []
    cos, sin = rope_cache(Config(n_layer=1, n_head=4, n_embd=256, block_size=512), 512, torch.device("cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(4, 512, 4, 64, dtype=dtype, requires_grad=True)
        grad = torch.randn(4, 4, 512, 64, dtype=dtype)
        cos_d, sin_d = cos.to(dtype), sin.to(dtype)

        def formula() -> None:
            q = x.transpose(1, 2)
            q1, q2 = q.chunk(2, dim=-1)
            (q * cos_d + torch.cat((-q2, q1), dim=-1) * sin_d).backward(grad)

        ours, theirs = compare(lambda: rotate(x.transpose(1, 2), cos_d, sin_d).backward(grad), formula)
        rows.append({"op": "rotary embedding fwd+bwd", "shape": "4x512x4x64", "dtype": str(dtype).removeprefix("torch."),
                     "lit_model_ms": round(ours, 3), "pytorch_ms": round(theirs, 3), "speedup": round(theirs / ours, 3)})
    return rows


def attention_rows() -> list[dict]:
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for length in (128, 256, 384, 512, 768, 1024):
            batch = 2048 // length
            q = torch.randn(batch, 4, length, 64, dtype=dtype, requires_grad=True)
            k = torch.randn(batch, 2, length, 64, dtype=dtype, requires_grad=True)
            v = torch.randn(batch, 2, length, 64, dtype=dtype, requires_grad=True)
            grad = torch.randn(batch, length, 4, 64, dtype=dtype)

            def halves() -> None:
                first, second = causal_attention_in_halves(q, k, v, 0.125, True)
                torch.autograd.backward([first, second], list(grad.split([first.size(1), second.size(1)], dim=1)))

            def whole() -> None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
                out.transpose(1, 2).backward(grad)

            ours, theirs = compare(halves, whole)
            rows.append({"op": "causal attention fwd+bwd", "shape": f"{batch}x{length} tokens",
                         "dtype": str(dtype).removeprefix("torch."), "lit_model_ms": round(ours, 3),
                         "pytorch_ms": round(theirs, 3), "speedup": round(theirs / ours, 3)})
    return rows


BLOCK_SHAPES = ((1, 4, 256, 64), (8, 4, 256, 64), (1, 4, 512, 64), (1, 4, 1024, 64), (1, 9, 512, 64),
                (1, 16, 512, 128), (1, 32, 1024, 64), (1, 4, 2048, 64), (1, 32, 2048, 64))


def block_attention_rows() -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for batch, heads, length, head_size in BLOCK_SHAPES if dtype == torch.bfloat16 else BLOCK_SHAPES[:4]:
            q, k, v = (torch.randn(batch, heads, length, head_size, dtype=dtype, requires_grad=True) for _ in range(3))
            grad = torch.randn(batch, length, heads, head_size, dtype=dtype)
            scale = head_size**-0.5
            blocks = lambda: ops.causal_attention_in_blocks(q, k, v, scale).transpose(1, 2).backward(grad)  # noqa: E731
            flash = lambda: F.scaled_dot_product_attention(  # noqa: E731
                q, k, v, is_causal=True, scale=scale).transpose(1, 2).backward(grad)
            calls = max(1, min(10, 2**26 // (batch * heads * length * length)))
            ours, theirs = compare(blocks, flash, calls=calls)
            rows.append({"op": "causal attention in blocks fwd+bwd",
                         "shape": f"{batch}x{heads}x{length}x{head_size}", "dtype": str(dtype).removeprefix("torch."),
                         "lit_model_ms": round(ours, 3), "pytorch_ms": round(theirs, 3), "speedup": round(theirs / ours, 3)})
    return rows


def linear_rows() -> list[dict]:
    """ops.linear forced onto oneDNN (whatever the product's size) against F.linear (BLAS), fp32."""
    os.environ[ops.FP32_LINEAR_ENV] = "onednn"
    ops.onednn_fp32_linear.cache_clear()
    ops.ONEDNN_LINEAR_MIN_MACS = 0  # the raw kernels, also where linear() would leave small products to BLAS
    rows = []
    shapes = [(8 * 256, n_in, n_out, True) for n_in, n_out in ((256, 256), (256, 688), (688, 256), (256, 4096))]
    shapes += [(tokens, n, n, False) for tokens in (1, 8, 32, 64) for n in (256, 1024, 4096)]
    for tokens, n_in, n_out, backward in shapes:
        x = torch.randn(tokens, n_in, requires_grad=backward)
        weight = torch.randn(n_out, n_in, requires_grad=backward)
        grad = torch.randn(tokens, n_out)
        if backward:
            ours, theirs = compare(lambda: linear(x, weight, None, onednn=True).backward(grad), lambda: F.linear(x, weight).backward(grad))
        else:
            with torch.no_grad():
                ours, theirs = compare(lambda: linear(x, weight, None, onednn=True), lambda: F.linear(x, weight), calls=200 if n_in < 4096 else 20)
        rows.append({"op": "linear fwd+bwd" if backward else "linear fwd", "shape": f"{tokens}x{n_in} -> {n_out}",
                     "dtype": "float32", "multiply_adds": tokens * n_in * n_out, "lit_model_ms": round(ours, 4),
                     "pytorch_ms": round(theirs, 4), "speedup": round(theirs / ours, 3)})
    return rows


# A decoding step's matrices, (in, out) for each product: the 5.26M model of benchmarks/vs_peers.py (4 layers), a
# GPT-NeoX layer of 768 (pythia-160m's x 12) and a Llama layer of 2048 (TinyLlama-1.1B's) with their heads
DECODING_MODELS = {
    "5.26M (4 x 256)": 4 * [(256, 256)] * 4 + 4 * [(256, 688), (256, 688), (688, 256)] + [(256, 4096)],
    "pythia-160m (12 x 768)": 12 * [(768, 2304), (768, 768), (768, 3072), (3072, 768)] + [(768, 50304)],
    "TinyLlama-1.1B, one layer of 2048": [(2048, 2048), (2048, 256), (2048, 256), (2048, 2048), (2048, 5632),
                                          (2048, 5632), (5632, 2048), (2048, 32000)],
}


def decoding_rows() -> list[dict]:
    """One-row products through every matrix of a decoding step, each read once a step as decoding reads them (not
    from a warm cache): ops.linear with the weights stored as ``ops.decoding_column_major`` says (as generation loads them) against row-major, fp32,
    with lit-model's default kernel choice."""
    os.environ.pop(ops.FP32_LINEAR_ENV, None)
    ops.onednn_fp32_linear.cache_clear()
    ops.ONEDNN_LINEAR_MIN_MACS = DEFAULT_ONEDNN_LINEAR_MIN_MACS
    rows = []
    for name, shapes in DECODING_MODELS.items():
        weights = [torch.randn(n_out, n_in) for n_in, n_out in shapes]
        laid_out = [w.t().contiguous().t() if ops.decoding_column_major(w.shape, w.dtype, w.device) else w
                    for w in weights]
        inputs = {n_in: torch.randn(1, 1, n_in) for n_in, _ in shapes}

        def step(matrices: list[torch.Tensor]) -> Callable[[], None]:
            onednn = kernel_policy("cpu").onednn_fp32_linear  # as generation on the CPU
            return lambda: [linear(inputs[w.size(1)], w, None, onednn) for w in matrices]

        with torch.no_grad():
            ours, theirs = compare(step(laid_out), step(weights), calls=20)
        column_major = sum(w.numel() for w in laid_out if not w.is_contiguous())
        share = column_major / sum(w.numel() for w in weights)
        rows.append({"op": "decoding step's products",
                     "shape": f"{name}: {len(shapes)} x 1 row, {share:.0%} of the weights column-major",
                     "dtype": "float32", "multiply_adds": sum(w.numel() for w in weights), "lit_model_ms": round(ours, 4), "pytorch_ms": round(theirs, 4), "speedup": round(theirs / ours, 3)})
    return rows


SECTIONS = {"rms_norm": rms_norm_rows, "rope": rope_rows, "attention": attention_rows, "blocks": block_attention_rows,
            "linear": linear_rows, "decoding": decoding_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ops", nargs="+", choices=list(SECTIONS), default=["rms_norm", "rope", "attention"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads; 0: torch's default")
    parser.add_argument("--report", default="ops", help="benchmarks/results/NAME.{csv,md}")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    before = os.getloadavg()[0]
    rows = [row for name in args.ops for row in SECTIONS[name]()]
    table = markdown_table(rows)
    RESULTS.mkdir(exist_ok=True)
    command = " ".join(["python benchmarks/ops.py", *(["--ops", *args.ops] if args.ops != parser.get_default("ops") else []),
                        *(["--threads", str(args.threads)] if args.threads != 1 else []),
                        *(["--report", args.report] if args.report != "ops" else [])])
    atomic_write(RESULTS / f"{args.report}.csv", csv_text(rows))
    atomic_write(RESULTS / f"{args.report}.md",
        f"# lit_model/kernels/ops.py vs PyTorch {torch.__version__} (CPU: {cpu_description()}; {threads} thread{'s' * (threads > 1)})\n\n"
        f"Regenerate: `{command}`\n\n"
        "Median of 5 alternating rounds of 10 calls; `speedup` = PyTorch's time / lit-model's "
        "(for the bf16 RMSNorm, the upcast formula Hugging Face and litgpt use; for the rotary embedding, the formula "
        "written with PyTorch's operations, as model.py had it; for the linear maps, F.linear on PyTorch's BLAS; for decoding's products, "
        "ops.linear over the same weights stored row-major). "
        "Attention: 4 query heads over 2 key/value heads of 64, 2048 tokens a batch; lit-model takes the halves "
        "for 384 <= T <= 512 where it does not take the blocks. Attention in blocks: batch x heads x T x head size, "
        f"against the flash kernel; calls per round fewer for the largest shapes. 1-minute load average {before:.1f} before, {os.getloadavg()[0]:.1f} after.\n\n"
        f"{table}\n"
    )
    print(table)


if __name__ == "__main__":
    main()
