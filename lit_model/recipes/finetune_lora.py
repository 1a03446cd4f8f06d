"""Fine-tune with LoRA (QLoRA with --quantize): setup -> fit -> save merged weights + the adapter.

    python finetune/lora.py                                   # out/pretrain/final on stdlib instructions
    python finetune/lora.py --quantize bnb.nf4                # QLoRA: frozen base weights in 4 bits
    python finetune/lora.py --config config_hub/finetune/llama-3.2-1b/lora.yaml --checkpoint_dir DIR
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lightning.fabric import Fabric

from lit_model.recipes.cli import parse
from lit_model.core.errors import run_cli
from lit_model.methods.lora import LoRAConfig, apply_lora, save_merged_checkpoint
from lit_model.recipes import common, finetune
from lit_model.run import Run
from lit_model.train import session
from lit_model.train.args import check_args


@dataclass
class LoRAArgs(finetune.FinetuneArgs):
    """Fine-tune a checkpoint with LoRA adapters on instruction data (QLoRA with --quantize).

    Args:
        lora_r: rank of the low-rank update
        lora_alpha: the update is scaled by lora_alpha / lora_r
        lora_dropout: dropout on the adapter's input
        lora_query: adapt the attention query projections
        lora_key: adapt the attention key projections
        lora_value: adapt the attention value projections
        lora_projection: adapt the attention output projections
        lora_mlp: adapt the MLP layers
        lora_head: adapt the output head
        lora_bias: also train the biases of the adapted layers
        lora_dora: DoRA: also train a magnitude per output feature, the adapted weight's rows normalised (better
            accuracy at low ranks; costs a weight-sized norm per adapted layer and forward, and more activations)
    """

    out_dir: Path = Path("out/finetune/lora")
    lora_r: int = LoRAConfig.r
    lora_alpha: float = LoRAConfig.alpha
    lora_dropout: float = LoRAConfig.dropout
    lora_query: bool = LoRAConfig.query
    lora_key: bool = LoRAConfig.key
    lora_value: bool = LoRAConfig.value
    lora_projection: bool = LoRAConfig.projection
    lora_mlp: bool = LoRAConfig.mlp
    lora_head: bool = LoRAConfig.head
    lora_bias: bool = LoRAConfig.bias
    lora_dora: bool = LoRAConfig.dora


def main(args: LoRAArgs) -> None:
    check_args(args)
    run = finetune.resolve(args, "lora")  # bad LoRA flags fail before any process starts
    common.plan_or_train(run, args, train)


def train(fabric: Fabric, run: Run, args: LoRAArgs) -> None:
    run, setup = finetune.prepare(fabric, run, args)
    fabric.seed_everything(args.seed)  # the same adapter initialisation on every rank
    model = finetune.load_model(fabric, run, setup)
    lora = run.lora
    layers = apply_lora(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fabric.print(f"{'DoRA' if lora.dora else 'LoRA'} r={lora.r} alpha={lora.alpha:g} on {len(layers)} layers: "
                 f"{trainable:,} trainable parameters")
    model, optimizer = session.setup_model_and_optimizer(fabric, model, run, args)
    progress, run = finetune.train(fabric, run, args, setup, model, optimizer, trainable_only=True)
    if progress.stopped:  # saved and summarized by fit: no final/, no answer
        return

    final_dir = args.out_dir / "final"
    adapter_weights = finetune.gather_trainable(model)
    if fabric.global_rank == 0:  # merged from the full-precision base weights, never from a quantized copy
        save_merged_checkpoint(setup.checkpoint_dir, adapter_weights, lora, final_dir, setup.style.save, finetune.DERIVED_FILES,
                               overwrite=True)  # this run's own final/ (check_out_dir)
    fabric.barrier()
    del model, optimizer, adapter_weights  # the sample reloads final/: the trained copy and the optimizer state go first
    finetune.finish(fabric, run, args, setup, progress, final_dir)



def cli(argv: Optional[list[str]] = None, prog: Optional[str] = None) -> None:
    """The command line: flags (or --config YAML) -> LoRAArgs -> main; one paragraph and an exit status on bad input.
    ``prog``: the name --help shows (lit-model shows the script's)."""
    run_cli(lambda: main(parse(LoRAArgs, sys.argv[1:] if argv is None else list(argv), prog)))
