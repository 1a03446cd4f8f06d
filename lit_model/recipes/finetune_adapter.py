"""Fine-tune with a LLaMA-Adapter prefix (frozen base, learned gated prefixes in the upper blocks):
setup -> fit -> save the base weights with the adapter beside them.

    python finetune/adapter.py                                # out/pretrain/final on stdlib instructions
    python finetune/adapter.py --quantize bnb.nf4             # the frozen base weights in 4 bits
    python finetune/adapter.py --config config_hub/finetune/llama-3.2-1b/adapter.yaml --checkpoint_dir DIR
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning.fabric import Fabric

from lit_model.recipes.cli import parse
from lit_model.core.errors import run_cli
from lit_model.recipes import common, finetune
from lit_model.run import Run
from lit_model.train import session
from lit_model.train.args import check_args


@dataclass
class AdapterArgs(finetune.FinetuneArgs):
    """Fine-tune a checkpoint with a LLaMA-Adapter prefix on instruction data.

    Args:
        adapter_prompt_length: learned prefix vectors per adapted block
        adapter_start_layer: first block with a prefix (default: the upper half of the blocks)
    """

    out_dir: Path = Path("out/finetune/adapter")
    adapter_prompt_length: int = 10
    adapter_start_layer: Optional[int] = None
    learning_rate: float = 3e-3
    min_lr: float = 3e-4


def main(args: AdapterArgs) -> None:
    check_args(args)
    run = finetune.resolve(args, "adapter")
    common.plan_or_train(run, args, train)


def train(fabric: Fabric, run: Run, args: AdapterArgs) -> None:
    run, setup = finetune.prepare(fabric, run, args)
    fabric.seed_everything(args.seed)  # the same prefixes on every rank
    model = finetune.load_model(fabric, run, setup)
    finetune.add_adapter(fabric, run, model)
    model, optimizer = session.setup_model_and_optimizer(fabric, model, run, args)
    progress, run = finetune.train(fabric, run, args, setup, model, optimizer, trainable_only=True)
    if progress.stopped:  # saved and summarized by fit: no final/, no answer
        return

    final_dir = args.out_dir / "final"
    finetune.save_trained(fabric, run, setup, model, final_dir)
    del model, optimizer  # the sample reloads final/: the trained copy and the optimizer state go first
    finetune.finish(fabric, run, args, setup, progress, final_dir)


def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> AdapterArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(AdapterArgs, sys.argv[1:] if argv is None else list(argv), prog)))
