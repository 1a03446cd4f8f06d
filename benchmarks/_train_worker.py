"""One timed training run of a tiny Llama-style model, with lit-model or with litgpt (whichever the running
interpreter has). Prints one JSON line. Used by vs_litgpt.py; each run is a fresh process so peak RSS
belongs to that run alone."""

import argparse
import json
import resource
import time

import torch
from lightning.fabric import Fabric

ARCH = dict(block_size=512, vocab_size=8192, padded_vocab_size=8192, n_layer=4, n_embd=256, n_head=4,
            n_query_groups=2, intermediate_size=688)
OPTIMIZER = dict(learning_rate=1e-3, weight_decay=0.1)


def build(impl: str):
    if impl == "lit_model":
        from lit_model import GPT, Config
        from lit_model.core.precision import param_dtype
        from lit_model.methods.objective import CausalLM, mean_loss
        from lit_model.train.optimizers import build_optimizer

        model = GPT(Config(name="bench", **ARCH))

        def optimizer(model, precision):  # as lit-model's scripts build it (fused AdamW where supported)
            return build_optimizer(model, "AdamW", **OPTIMIZER, device_type="cpu", param_dtype=param_dtype(precision))

        return model, lambda idx, targets: mean_loss(CausalLM(), model, (idx, targets)), optimizer
    from litgpt import GPT, Config
    from litgpt.utils import chunked_cross_entropy, instantiate_torch_optimizer

    model = GPT(Config(name="bench", mlp_class_name="LLaMAMLP", norm_class_name="RMSNorm", bias=False,
                       rotary_percentage=1.0, parallel_residual=False, **ARCH))

    def optimizer(model, precision):  # as litgpt's pretrain.py builds it: fused only on CUDA
        args = {"lr": OPTIMIZER["learning_rate"], "weight_decay": OPTIMIZER["weight_decay"], "betas": (0.9, 0.95)}
        return instantiate_torch_optimizer({"class_path": "torch.optim.AdamW", "init_args": args},
                                           model.parameters(), fused=False)

    return model, lambda idx, targets: chunked_cross_entropy(model(idx), targets), optimizer  # its pretrain step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["lit_model", "litgpt"], required=True)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--micro_batch_size", type=int, default=4)
    parser.add_argument("--seq_length", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()

    fabric = Fabric(accelerator="cpu", devices=1, precision=args.precision)
    fabric.seed_everything(0)
    model, loss_fn, make_optimizer = build(args.impl)
    n_params = sum(p.numel() for p in model.parameters())
    if args.compile:
        model = torch.compile(model)
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(make_optimizer(model, args.precision))
    tokens = torch.randint(0, ARCH["vocab_size"], (args.micro_batch_size, args.seq_length + 1))
    idx, targets = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        loss = loss_fn(idx, targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(2):  # warm-up (and compilation)
        step()
    start = time.perf_counter()
    for _ in range(args.steps):
        loss = step()
    seconds = time.perf_counter() - start
    print(json.dumps({
        "impl": args.impl, "precision": args.precision, "compile": args.compile, "params": n_params,
        "tokens_per_sec": args.steps * args.micro_batch_size * args.seq_length / seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "final_loss": loss,
    }))


if __name__ == "__main__":
    main()
