"""Fine-tune every weight of a checkpoint on instruction data: setup -> fit -> save.

    python finetune/full.py                                   # out/pretrain/final on stdlib instructions
    python finetune/full.py --freeze_layers 2                 # keep the embedding and the first 2 blocks frozen
    python finetune/full.py --config config_hub/finetune/llama-3.2-1b/full.yaml --checkpoint_dir DIR
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning.fabric import Fabric

from lit_model.recipes.cli import parse
from lit_model.core.errors import UsageError, run_cli
from lit_model.recipes import common, finetune
from lit_model.run import Run
from lit_model.train import session
from lit_model.train.args import check_args
from lit_model.train.loop import save_final


@dataclass
class FullArgs(finetune.FinetuneArgs):
    """Fine-tune all weights of a checkpoint on instruction data."""

    out_dir: Path = Path("out/finetune/full")
    learning_rate: float = 3e-4
    min_lr: float = 3e-5
    weight_decay: float = 0.1


def main(args: FullArgs) -> None:
    check_args(args)
    if args.quantize is not None:
        raise UsageError(
            f"--quantize {args.quantize} stores frozen weights, but full fine-tuning trains every weight. Use "
            f"finetune/lora.py --quantize {args.quantize} (QLoRA), or drop --quantize."
        )
    run = finetune.resolve(args, "full")
    common.plan_or_train(run, args, train)


def train(fabric: Fabric, run: Run, args: FullArgs) -> None:
    run, setup = finetune.prepare(fabric, run, args)
    fabric.seed_everything(args.seed)
    model = finetune.load_model(fabric, run, setup).requires_grad_(True)
    model, optimizer = session.setup_model_and_optimizer(fabric, model, run, args)  # applies --freeze_layers
    progress, run = finetune.train(fabric, run, args, setup, model, optimizer, trainable_only=False)
    if progress.stopped:  # saved and summarized by fit: no final/, no answer
        return

    final_dir = args.out_dir / "final"
    save_final(fabric, model, run.config, final_dir, setup.checkpoint_dir, write_extra=setup.style.save)
    del model, optimizer  # the sample reloads final/: the trained copy and the optimizer state go first
    finetune.finish(fabric, run, args, setup, progress, final_dir)



def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> FullArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(FullArgs, sys.argv[1:] if argv is None else list(argv), prog)))
