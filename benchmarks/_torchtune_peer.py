"""The torchtune peer of vs_peers.py: `tune run full_finetune_single_device --config FILE` on the CPU.

torchtune has no pretraining recipe: its full fine-tuning recipe trains every weight of a checkpoint, so the run
starts from a randomly initialised transformers checkpoint of the same model (made here with transformers,
`init`), which the recipe loads through FullModelHFCheckpointer as a LLAMA3 model, and trains on the corpus with
`text_completion_dataset` packed into windows of the block size. Its tokenizer is torchtune's
HuggingFaceBaseTokenizer on the same tokenizer.json; ``tokenizer`` below only gives it the ``max_seq_len`` that
torchtune's text datasets read from their tokenizer (its own model tokenizers carry one, that wrapper does not).

    _torchtune_peer.py init CONFIG_DIR OUT_DIR     # lit-model's env (transformers): the random-init checkpoint
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path


def tokenizer(path: str, max_seq_len: int):
    """torchtune's HuggingFaceBaseTokenizer (for a tokenizer.json) with the max_seq_len its datasets expect."""
    from torchtune.modules.transforms.tokenizers import HuggingFaceBaseTokenizer

    directory = Path(path)
    wrapped = HuggingFaceBaseTokenizer(str(directory / "tokenizer.json"),
                                       tokenizer_config_json_path=str(directory / "tokenizer_config.json"),
                                       generation_config_path=str(directory / "generation_config.json"))
    wrapped.max_seq_len = max_seq_len
    return wrapped


def recipe_config(*, block: int, micro: int, steps: int, precision: str, run_dir: Path, init_dir: Path,
                  tokenizer_dir: Path, corpus: Path, arch: dict, schedule: dict) -> str:
    """The recipe's YAML: the same model, data, batch, schedule (linear warmup, cosine to the end), AdamW."""
    config = {
        "output_dir": str(run_dir),
        "model": {"_component_": "torchtune.models.llama3.llama3", "vocab_size": arch["vocab_size"],
                  "num_layers": arch["n_layer"], "num_heads": arch["n_head"], "num_kv_heads": arch["n_query_groups"],
                  "embed_dim": arch["n_embd"], "max_seq_len": block, "intermediate_dim": arch["intermediate_size"],
                  "rope_base": arch["rope_base"], "norm_eps": arch["norm_eps"]},
        "tokenizer": {"_component_": "_torchtune_peer.tokenizer", "path": str(tokenizer_dir), "max_seq_len": block},
        "dataset": {"_component_": "torchtune.datasets.text_completion_dataset", "source": "text",
                    "data_files": sorted(str(p) for p in corpus.glob("*.txt")), "column": "text", "split": "train",
                    "packed": True, "add_eos": True},
        "seed": schedule["seed"], "shuffle": True,
        "checkpointer": {"_component_": "torchtune.training.FullModelHFCheckpointer", "checkpoint_dir": str(init_dir),
                         "checkpoint_files": ["model.safetensors"], "recipe_checkpoint": None,
                         "output_dir": str(run_dir), "model_type": "LLAMA3"},
        "resume_from_checkpoint": False,
        "batch_size": micro, "epochs": 1, "max_steps_per_epoch": steps, "gradient_accumulation_steps": 1,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": schedule["lr"], "weight_decay": schedule["weight_decay"],
                      "betas": [0.9, 0.95], "fused": False},
        "lr_scheduler": {"_component_": "torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup",
                         "num_warmup_steps": schedule["warmup"]},
        "loss": {"_component_": "torchtune.modules.loss.CEWithChunkedOutputLoss"},
        "optimizer_in_bwd": False, "clip_grad_norm": schedule["grad_clip"], "compile": False, "device": "cpu",
        "enable_activation_checkpointing": False, "enable_activation_offloading": False,
        "dtype": {"32-true": "fp32", "bf16-true": "bf16"}[precision],
        "metric_logger": {"_component_": "torchtune.training.metric_logging.StdoutLogger"},
        "log_every_n_steps": 1, "log_peak_memory_stats": False,
    }
    return json.dumps(config, indent=1)  # JSON is YAML


def init(config_dir: str, out_dir: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    model.save_pretrained(out_dir)
    shutil.copy(Path(config_dir) / "config.json", Path(out_dir) / "config.json")


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
