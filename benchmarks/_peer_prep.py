"""The one-time preparations of vs_peers.py, each run by the interpreter that has the library it needs, so that
the benchmark's own process imports neither torch nor a peer (its peak RSS stays far below every measured one):

    _peer_prep.py tokenizer CORPUS_DIR VOCAB OUT_DIR      # lit-model's env: one byte-level BPE (`tokenizers`)
    _peer_prep.py lit_data CORPUS_DIR TOKENIZER BLOCK     # lit-model's env: fill its token cache
    _peer_prep.py hf_config MODEL_YAML OUT_DIR            # lit-model's env: the equivalent transformers config.json
    _peer_prep.py lit_to_hf CHECKPOINT OUT_DIR            # lit-model's env: its converter to a transformers dir
    _peer_prep.py instruct CORPUS_DIR TOKENIZER N OUT     # lit-model's env: a deterministic instruction JSON
    _peer_prep.py pairs INSTRUCT TOKENIZER BLOCK OUT     # lit-model's env: preference pairs (.jsonl) from it
    _peer_prep.py grpo_prompts INSTRUCT OUT               # lit-model's env: GRPO prompts (.jsonl) from it
    _peer_prep.py litgpt_data DATA_DIR TOKENIZER BLOCK    # litgpt's env: TextFiles.prepare_data (litdata chunks)
    _peer_prep.py litgpt_from_hf HF_DIR MODEL_YAML OUT    # litgpt's env: its own HF->litgpt weight copy
    _peer_prep.py serve_model CORPUS_DIR HF_DIR            # lit-model's env: serve_vs_peers.py's model (random) and prompts
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
# serve_vs_peers.py: its chat template renders the user's text as it is, as litgpt's default prompt style does, so
# every server feeds the model the same tokens through /v1/chat/completions.
SERVE_CHAT_TEMPLATE = "{% for message in messages %}{{ message.content }}{% endfor %}"
SERVE_PROMPT_TOKENS = (8, 24, 64, 160, 384)  # the prompts' lengths, in turn
SERVE_PROMPTS = 64


def tokenizer(corpus: str, vocab: str, out_dir: str) -> None:
    from lit_model.io.tokenizer import train_bpe

    train_bpe(sorted(Path(corpus).glob("*.txt")), int(vocab), out_dir)


def lit_data(corpus: str, tokenizer_dir: str, block: str) -> None:
    from lit_model.data.text import load_pretrain_data
    from lit_model.io.tokenizer import Tokenizer

    load_pretrain_data(Path(corpus), Tokenizer(tokenizer_dir), int(block))


def hf_config(model_yaml: str, out_dir: str) -> None:
    from lit_model.core.config import Config
    from lit_model.io.convert import config_to_hf

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "config.json").write_text(json.dumps(config_to_hf(Config.from_file(model_yaml)), indent=1))


def lit_to_hf(checkpoint: str, out_dir: str) -> None:
    from lit_model.io.convert import lit_to_hf as convert

    convert(checkpoint, out_dir, overwrite=True)
    for name in TOKENIZER_FILES:  # a transformers model directory carries its tokenizer
        shutil.copy(Path(checkpoint) / name, Path(out_dir) / name)


def instruct(corpus: str, tokenizer_dir: str, count: str, out: str) -> None:
    """Records whose instruction, input and output are consecutive pieces of the corpus, cut at token counts
    (16 + 64 + 96 tokens, the same for every record), so every implementation's batches hold about the same tokens
    whatever its padding; the mean length of a record as lit-model's alpaca template tokenizes it is written
    beside it (``.stats.json``): the tokens each sample counts for in the fine-tuning rows."""
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    ids = [i for path in sorted(Path(corpus).glob("*.txt")) for i in tok.encode(path.read_text()).tolist()]
    pieces, records, start = (16, 64, 96), [], 0
    while len(records) < int(count):
        parts = []
        for n in pieces:
            parts.append(tok.decode(ids[start:start + n]).strip() or "pass")
            start += n
        records.append({"instruction": "Continue the code. " + parts[0], "input": parts[1], "output": parts[2]})
    style = PromptStyle.from_name("alpaca")
    lengths = [len(tok.encode(style.apply(r["instruction"], input=r["input"]) + r["output"])) + 1 for r in records]
    Path(out).write_text(json.dumps(records, indent=1))
    Path(out).with_suffix(".stats.json").write_text(json.dumps({"mean_tokens": statistics.mean(lengths),
                                                                "max_tokens": max(lengths), "records": len(records)}))


def pairs(instruct_path: str, tokenizer_dir: str, block: str, out: str) -> None:
    """Preference pairs from the instruction records: the prompt is a record's instruction and input, chosen its
    output, rejected the next record's output, each completion cut (by tokens) so that the prompt, the completion,
    the alpaca template's end and the end of text fit ``block``. The mean tokens of a pair (its chosen and its
    rejected row, as lit-model's alpaca template tokenizes them) are written beside it (``.stats.json``)."""
    from lit_model.io.prompts import PromptStyle
    from lit_model.io.tokenizer import Tokenizer

    tok, style = Tokenizer(tokenizer_dir), PromptStyle.from_name("alpaca")
    records = json.loads(Path(instruct_path).read_text())

    def row_length(prompt: str, completion: str) -> int:
        return len(tok.encode(style.apply(prompt) + completion + style.end)) + 1  # + the end of text

    def fit(prompt: str, completion: str) -> str:
        ids = tok.encode(completion).tolist()
        while row_length(prompt, completion) > int(block):
            ids = ids[:-1]
            completion = tok.decode(ids)
        return completion

    lines, sizes = [], []
    for i, record in enumerate(records):
        prompt = f"{record['instruction']}\n\n{record['input']}"
        chosen = fit(prompt, record["output"])
        rejected = fit(prompt, records[(i + 1) % len(records)]["output"])
        lines.append(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}))
        sizes.append(row_length(prompt, chosen) + row_length(prompt, rejected))
    Path(out).write_text("\n".join(lines) + "\n")
    Path(out).with_suffix(".stats.json").write_text(json.dumps({"mean_pair_tokens": statistics.mean(sizes),
                                                                "max_pair_tokens": max(sizes), "pairs": len(lines)}))


def grpo_prompts(instruct_path: str, out: str) -> None:
    """GRPO's prompts: each record's instruction and input (as the pairs' prompts), written in lit-model's alpaca
    template, so that both implementations read the same text as it is (about 110 tokens: with the 64-token
    completions, within the block of 256)."""
    from lit_model.io.prompts import PromptStyle

    style = PromptStyle.from_name("alpaca")
    records = json.loads(Path(instruct_path).read_text())
    lines = [json.dumps({"prompt": style.apply(f"{r['instruction']}\n\n{r['input']}")}) for r in records]
    Path(out).write_text("\n".join(lines) + "\n")


def litgpt_data(data_dir: str, tokenizer_dir: str, block: str) -> None:
    from litgpt.data import TextFiles
    from litgpt.tokenizer import Tokenizer

    data = TextFiles(train_data_path=Path(data_dir))
    data.connect(Tokenizer(tokenizer_dir), batch_size=1, max_seq_length=int(block))
    data.prepare_data()


def litgpt_from_hf(hf_dir: str, model_yaml: str, out_dir: str) -> None:
    """litgpt's convert_hf_checkpoint takes only architectures of its registry; for a custom one its own weight
    copy (copy_weights_hf_llama) with the config read from the YAML does the same."""
    import torch
    import yaml
    from litgpt import Config
    from litgpt.scripts.convert_hf_checkpoint import copy_weights_hf_llama
    from litgpt.utils import save_config
    from safetensors.torch import load_file

    config = Config(**yaml.safe_load(Path(model_yaml).read_text()))
    state_dict: dict = {}
    copy_weights_hf_llama(config, {}, state_dict, load_file(Path(hf_dir) / "model.safetensors"))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state_dict, out / "lit_model.pth")
    save_config(config, out)
    for name in TOKENIZER_FILES:
        shutil.copy(Path(hf_dir) / name, out / name)


def serve_model(corpus: str, hf_dir: str) -> None:
    """Into the transformers directory that holds the model's config.json: a tokenizer of exactly its vocabulary
    (any id the model picks decodes) with SERVE_CHAT_TEMPLATE, random weights with the end-of-text token's output
    row zeroed (its logit is 0 where the largest of the others is above: greedy decoding never stops early, so every
    request generates its whole max_tokens on every server), and prompts.json: SERVE_PROMPTS consecutive pieces of
    the corpus, of SERVE_PROMPT_TOKENS tokens in turn."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_model.io.tokenizer import train_bpe

    out = Path(hf_dir)
    config = AutoConfig.from_pretrained(out)
    tok = train_bpe(sorted(Path(corpus).glob("*.txt")), config.vocab_size, out)
    if tok.processor.get_vocab_size() != config.vocab_size:
        raise SystemExit(f"The corpus gave {tok.processor.get_vocab_size()} tokens, not {config.vocab_size}")
    config_path = out / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": SERVE_CHAT_TEMPLATE}))
    config.bos_token_id = config.eos_token_id = tok.eos_id  # the tokenizer's, for the generation_config.json too
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight[tok.eos_id] = 0
    model.save_pretrained(out)
    ids = [i for path in sorted(Path(corpus).glob("*.txt"))[:4] for i in tok.encode(path.read_text()).tolist()]
    prompts, start = [], 0
    for i in range(SERVE_PROMPTS):
        length = SERVE_PROMPT_TOKENS[i % len(SERVE_PROMPT_TOKENS)]
        prompts.append(tok.decode(ids[start:start + length]))
        start += length
    (out / "prompts.json").write_text(json.dumps(prompts, indent=1))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
