"""Data through `datasets`: .parquet/.csv/save_to_disk through --data_path, named hub datasets through --data
(the real `load_dataset` path, pointed at local parquet files shaped like each source: no network) of every kind
(instructions, text, preference pairs, GRPO prompts), the one field-name mapping table, --data_fields, and the
messages for what cannot work."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from lit_model.data import sources
from lit_model.data.instruct import read_records
from lit_model.data.text import load_pretrain_data, tokenize_files
from lit_model.core.errors import UserError
from lit_model.io.tokenizer import Tokenizer
from conftest import run_script_inprocess

datasets = pytest.importorskip("datasets")

ALPACA = [{"instruction": f"Add {i} and 1.", "input": "", "output": f"{i + 1}", "text": "rendered"} for i in range(4)]
# Rows shaped like each named source (its own field names) and what fine-tuning reads from the first one
SOURCES = {
    "alpaca": (ALPACA, {"instruction": "Add 0 and 1.", "input": "", "output": "1"}),
    "alpaca_2k": ([{k: r[k] for k in ("instruction", "input", "output")} for r in ALPACA],
                  {"instruction": "Add 0 and 1.", "input": "", "output": "1"}),
    "dolly": ([{"instruction": f"Summarize {i}.", "context": "Some text.", "response": "Short.", "category": "summarization"}
               for i in range(4)], {"instruction": "Summarize 0.", "input": "Some text.", "output": "Short."}),
    "lima": ([{"conversations": [f"Hi {i}", "Hello!"], "source": "stackexchange"} for i in range(4)],
             {"messages": [{"role": "user", "content": "Hi 0"}, {"role": "assistant", "content": "Hello!"}]}),
    "longform": ([{"input": f"Write about {i}.", "output": "An essay.", "source": "C4", "subset": "c4"} for i in range(4)],
                 {"instruction": "Write about 0.", "output": "An essay."}),
}
STORIES = [{"text": f"Once upon a time there was a cat number {i}. The cat was happy."} for i in range(40)]


def turn(role: str, content: str) -> dict[str, str]:
    return {"content": content, "role": role}  # as the hub's parquet files order a message's fields


# Preference and prompt sets shaped like each hub source (TRL's layouts; GSM8K's answer a worked solution)
PAIR_SOURCES = {
    "ultrafeedback": [{"chosen": [turn("user", f"Add {i} and 1."), turn("assistant", f"{i + 1}")],
                       "rejected": [turn("user", f"Add {i} and 1."), turn("assistant", "no idea")],
                       "score_chosen": 8.0, "score_rejected": 3.0} for i in range(20)],
    "hh-rlhf": [{"prompt": [turn("user", f"Hi {i}")], "chosen": [turn("assistant", "Hello!")],
                 "rejected": [turn("assistant", "Go away.")]} for i in range(20)],
    "orca_dpo": [{"system": "", "question": f"What is {i} + 1?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"}
                 for i in range(20)],
}
GSM8K = [{"question": f"Natalia sold {i} and twice as many. In all?",
          "answer": f"In May she sold {i} * 2 = <<{i}*2={2 * i}>>{2 * i}.\nIn all {i} + {2 * i} = {3 * i}.\n#### {3 * i}"}
         for i in range(20)]
# openai/gsm8k's layout: a configuration per directory, named in the dataset card
GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
---
"""


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each named dataset as a local directory of parquet files (as a hub repo lays them out); only the repo id
    -> location step is redirected, load_dataset runs as it would on the hub's files, with a private cache."""
    root = tmp_path / "hub"
    tables = {**{name: rows for name, (rows, _) in SOURCES.items()}, "tinystories": STORIES, **PAIR_SOURCES}
    for name, rows in tables.items():
        (root / name / "data").mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(str(root / name / "data" / "train-00000-of-00001.parquet"))
    for config, rows in (("main", GSM8K), ("socratic", GSM8K[:3])):
        (root / "gsm8k" / config).mkdir(parents=True)
        datasets.Dataset.from_list(rows).to_parquet(str(root / "gsm8k" / config / "train-00000-of-00001.parquet"))
    (root / "gsm8k" / "README.md").write_text(GSM8K_CARD)
    monkeypatch.setattr(sources, "hub_repo", lambda name: str(root / name))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    return root


@pytest.mark.parametrize("name", list(SOURCES))
def test_named_instruction_datasets_map_their_fields(name: str, hub: Path) -> None:
    records, what = sources.table_records(name, None, {})
    assert what == f"{name} ({sources.NAMED[name].repo})"
    assert len(records) == 4
    assert records[0] == (f"{what} row 0", SOURCES[name][1])


@pytest.mark.parametrize("name", list(PAIR_SOURCES))
def test_named_preference_datasets_load_into_pairs(name: str, hub: Path, tiny_setup: dict[str, Path]) -> None:
    """Each named set of pairs through load_dataset into tokenized pairs whose targets are the completions alone:
    the chosen and the rejected row share the prompt's tokens and differ in the completion."""
    from lit_model.data.preference import load_preference_data
    from lit_model.io.prompts import PromptStyle

    data = load_preference_data(None, Tokenizer(tiny_setup["tokenizer"]), PromptStyle.from_name("chatml"), 256,
                                val_fraction=0.1, data=name)
    assert data.description.startswith(f"{name} ({sources.NAMED[name].repo}): 20 records, 18 train / 2 val pairs")
    (chosen, chosen_flags), (rejected, rejected_flags) = data.train.pairs[0]
    start = int(chosen_flags.argmax())  # the first target: the completion's first token
    assert start > 0 and int(rejected_flags.argmax()) == start and (chosen[:start] == rejected[:start]).all()
    assert not (len(chosen) == len(rejected) and (chosen == rejected).all())
    question = {"ultrafeedback": "Add", "hh-rlhf": "Hi", "orca_dpo": "What is"}[name]
    assert question in data.sample_instruction  # orca_dpo's question is the prompt (its Named fields)


def test_gsm8k_loads_its_main_configuration_into_prompts_with_the_final_number_as_answer(
        hub: Path, tiny_setup: dict[str, Path]) -> None:
    from lit_model.data.prompts import load_prompt_data
    from lit_model.io.prompts import PromptStyle

    records, what = sources.table_records("gsm8k", None, {}, "prompts")
    assert what == "gsm8k (openai/gsm8k)" and len(records) == 20  # the main configuration, not socratic's 3 rows
    assert records[7][1] == {"prompt": GSM8K[7]["question"], "answer": "21"}
    data = load_prompt_data(None, Tokenizer(tiny_setup["tokenizer"]), PromptStyle.from_name("alpaca"), 200,
                            val_fraction=0.1, data="gsm8k")
    assert data.description.startswith("gsm8k (openai/gsm8k): 20 records, 18 train / 2 val prompts")
    assert all(p.prompt.startswith("Natalia sold") and p.fields["answer"].isdigit() for p in data.train + data.val)


def test_data_fields_rename_preference_and_prompt_fields(tmp_path: Path) -> None:
    """--data_fields for pairs and prompts: the named fields renamed to ours, every other field kept (the rewards
    read them), in JSON lines and in tables alike."""
    from lit_model.data.prompts import read_prompt_records

    rows = [{"question": f"q{i}", "better": "b", "worse": "w", "id": i} for i in range(3)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "pairs.parquet"))
    fields = sources.parse_fields("prompt=question,chosen=better,rejected=worse", "preference")
    for name in ("pairs.jsonl", "pairs.parquet"):
        records = [record for _, record in read_records(tmp_path / name, fields, "preference")]
        assert records == [{"id": i, "prompt": f"q{i}", "chosen": "b", "rejected": "w"} for i in range(3)], name
    prompts = [{"task": f"t{i}", "solution": str(i), "level": 1} for i in range(3)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    fields = sources.parse_fields("prompt=task,answer=solution", "prompts")
    assert [record for _, record in read_prompt_records(tmp_path / "prompts.jsonl", fields)] == [
        {"level": 1, "prompt": f"t{i}", "answer": str(i)} for i in range(3)]
    with pytest.raises(UserError, match=r"has no field 'question' \(given with --data_fields\).* e\.g\. "
                                        r"--data_fields prompt=question,answer=solution"):
        read_prompt_records(tmp_path / "prompts.jsonl", {"prompt": "question"})


def test_local_formats_read_the_same_records(tmp_path: Path) -> None:
    rows = [{"question": f"What is {i} + 1?", "answer": f"{i + 1}"} for i in range(3)]
    table = datasets.Dataset.from_list(rows)
    table.to_parquet(str(tmp_path / "d.parquet"))
    table.to_csv(str(tmp_path / "d.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved_dict"))
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = [{"instruction": f"What is {i} + 1?", "output": f"{i + 1}"} for i in range(3)]
    for name in ("d.parquet", "d.csv", "saved", "saved_dict", "d.jsonl"):
        assert [record for _, record in read_records(tmp_path / name)] == expected, name


def test_mapping_table_and_data_fields() -> None:
    share_gpt = {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                   {"from": "gpt", "value": "Hello"}]}
    assert sources.map_record(share_gpt, {}, "r") == {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"}]}
    assert sources.map_record({"prompt": "p", "response": "r", "id": 3}, {}, "r") == {"instruction": "p", "output": "r"}
    assert sources.map_record({"q": "p", "a": "r"}, {}, "r") == {"q": "p", "a": "r"}  # left for segments to report
    fields = sources.parse_fields("instruction=q, output=a")
    assert fields == {"instruction": "q", "output": "a"}
    assert sources.map_record({"q": "p", "a": "r"}, fields, "r") == {"instruction": "p", "output": "r"}


def test_pretrain_text_from_named_dataset_and_parquet(hub: Path, tiny_setup: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIT_MODEL_CACHE", str(tmp_path / "cache"))
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    exported = sources.text_file("tinystories", None)
    assert [json.loads(line) for line in exported.read_text().splitlines()] == STORIES
    named = load_pretrain_data(None, tokenizer, 16, data="tinystories")
    local = load_pretrain_data(hub / "tinystories" / "data" / "train-00000-of-00001.parquet", tokenizer, 16)
    assert len(named[0]) == len(local[0]) > 0
    assert torch.equal(named[0][0][0], local[0][0][0])


def test_pretrain_reads_every_table_in_a_directory(tiny_setup: dict[str, Path], tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """--data_path DIR: its .parquet and .csv files (through `datasets`) next to .jsonl, every record's text once."""
    monkeypatch.setenv("LIT_MODEL_CACHE", str(tmp_path / "cache"))
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    corpus = tmp_path / "corpus"
    (corpus / "more").mkdir(parents=True)
    datasets.Dataset.from_list(STORIES[:15]).to_parquet(str(corpus / "a.parquet"))
    datasets.Dataset.from_list(STORIES[15:30]).to_csv(str(corpus / "more" / "b.csv"), index=False)
    (corpus / "c.jsonl").write_text("".join(json.dumps(story) + "\n" for story in STORIES[30:]))
    train, val, description = load_pretrain_data(corpus, tokenizer, 16, val_fraction=0.3)
    everything = tmp_path / "all.jsonl"
    everything.write_text("".join(json.dumps(story) + "\n" for story in STORIES))
    expected = tokenize_files([everything], tokenizer, tmp_path / "tokens", "all")
    assert len(train.tokens) + len(val.tokens) == len(expected) and len(val) > 0
    assert re.search(r"(\d) train / (\d) val files", description).group(1, 2) in (("2", "1"), ("1", "2"))

    (corpus / "more" / "b.csv").write_text("title,body\nA,B\n")
    with pytest.raises(UserError, match=r"b\.csv has columns \['title', 'body'\] but no text column"):
        load_pretrain_data(corpus, tokenizer, 16, val_fraction=0.3)


@pytest.mark.slow  # ~5 s: one LoRA step end to end
def test_finetune_on_a_named_dataset(hub: Path, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = run_script_inprocess("finetune/lora.py", "--checkpoint_dir", tiny_checkpoint, "--out_dir", tmp_path / "out",
                                "--data", "dolly", "--max_steps", "1", "--global_batch_size", "2",
                                "--micro_batch_size", "2", "--rehearse", "false", "--prompt_style", "default", cache=tmp_path / "cache",
                                monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert "Data: dolly (databricks/databricks-dolly-15k): 4 records, 3 train / 1 val samples" in proc.stdout


def test_dpo_reads_the_named_pairs_its_flags_name(hub: Path, tiny_setup: dict[str, Path]) -> None:
    """finetune/dpo.py --data NAME --data_fields ...: what its runs and plans read (``read_pairs``)."""
    from types import SimpleNamespace

    from lit_model.io.prompts import PromptStyle
    from lit_model.recipes.cli import parse
    from lit_model.recipes.finetune_dpo import DPOArgs, read_pairs

    args = parse(DPOArgs, ["--data", "orca_dpo", "--data_fields", "rejected=chosen,chosen=rejected"])
    data = read_pairs(SimpleNamespace(seq_len=256), args, Tokenizer(tiny_setup["tokenizer"]), PromptStyle.from_name("alpaca"))
    assert data.description.startswith("orca_dpo (Intel/orca_dpo_pairs): 20 records, 19 train / 1 val pairs")
    # the flags' mapping on top of the named set's own (question -> prompt): here the pairs' sides swapped
    tokenizer = Tokenizer(tiny_setup["tokenizer"])
    (chosen, flags), _ = data.val.pairs[0]
    completion = tokenizer.decode(torch.from_numpy(chosen[flags]))
    assert any(completion.startswith(f"{i + 2}") for i in range(20)) and "What is" in data.sample_instruction


@pytest.mark.slow  # ~5 s: one GRPO step end to end
def test_grpo_on_a_named_dataset(hub: Path, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = run_script_inprocess("finetune/grpo.py", "--checkpoint_dir", tiny_checkpoint, "--out_dir", tmp_path / "out",
                                "--data", "gsm8k", "--max_steps", "1", "--global_batch_size", "4", "--num_generations",
                                "2", "--micro_batch_size", "4", "--max_new_tokens", "4", "--eval_iters", "1",
                                "--prompt_style", "default", "--rehearse", "false", cache=tmp_path / "cache",
                                monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert "Data: gsm8k (openai/gsm8k): 20 records, 19 train / 1 val prompts" in proc.stdout
    assert (tmp_path / "out" / "final" / "lora.safetensors").is_file()


FINETUNE = ("finetune/lora.py", "--checkpoint_dir", "{checkpoint}", "--out_dir", "{tmp}/out", "--max_steps", "1")
DPO = ("finetune/dpo.py", *FINETUNE[1:])
GRPO = ("finetune/grpo.py", *FINETUNE[1:])


@pytest.mark.parametrize("argv, code, fragment", [
    ((*FINETUNE, "--data", "alpaca", "--data_path", "{tmp}/d.jsonl"), 2, "both name the training data; pass one"),
    ((*FINETUNE, "--data", "alpaka"), 2, "--data alpaka is not a known dataset. Did you mean alpaca or alpaca_2k?"),
    ((*FINETUNE, "--data", "tinystories"), 2, "is plain text data; use it with pretrain/main.py"),
    (("pretrain/main.py", "--out_dir", "{tmp}/out", "--data", "dolly"), 2,
     "--data dolly is instruction data; use it with finetune/lora.py, full.py or adapter.py, or pick one of "
     "tinystories."),
    ((*FINETUNE, "--data", "ultrafeedback"), 2, "--data ultrafeedback is preference-pair data; use it with "
     "finetune/dpo.py, or pick one of alpaca"),
    ((*FINETUNE, "--data", "gsm8k"), 2, "--data gsm8k is prompt data; use it with finetune/grpo.py"),
    ((*DPO, "--data", "alpaca"), 2, "--data alpaca is instruction data; use it with finetune/lora.py, full.py or "
     "adapter.py, or pick one of ultrafeedback, hh-rlhf, orca_dpo."),
    ((*DPO, "--data", "gsm8k"), 2, "--data gsm8k is prompt data; use it with finetune/grpo.py, or pick one of "
     "ultrafeedback"),
    ((*GRPO, "--data", "hh-rlhf"), 2, "--data hh-rlhf is preference-pair data; use it with finetune/dpo.py, or pick "
     "one of gsm8k."),
    ((*DPO, "--data", "orca_dpo", "--data_path", "{tmp}/d.jsonl"), 2, "both name the training data; pass one"),
    ((*GRPO, "--data", "gsm8k", "--data_path", "{tmp}/d.jsonl"), 2, "both name the training data; pass one"),
    ((*DPO, "--data_fields", "instruction=q"), 2, "--data_fields maps instruction, which fine-tuning does not read "
     "in preference-pair records; the fields are prompt, chosen, rejected"),
    ((*DPO,), 2, "finetune/dpo.py needs preference pairs: --data_path FILE"),
    ((*GRPO,), 2, "or a named hub dataset with --data (gsm8k)"),
    ((*FINETUNE, "--data_fields", "question"), 2, "must be OURS=THEIRS pairs"),
    ((*FINETUNE, "--data_fields", "prompt=q"), 2, "--data_fields maps prompt, which fine-tuning does not read"),
    ((*FINETUNE, "--data_path", "{tmp}/odd.parquet"), 1,
     "has keys ['a', 'q'], but a record needs string fields 'instruction' and 'output' (optionally 'input'), "
     "or a 'messages' list of {role, content}. Map the fields with --data_fields"),
    ((*FINETUNE, "--data_path", "{tmp}/bad.parquet"), 1, "bad.parquet could not be read as a dataset (ArrowInvalid: "),
    ((*FINETUNE, "--data_path", "{tmp}/odd.parquet", "--data_fields", "instruction=question,output=a"), 1,
     "has no field 'question' (given with --data_fields); its fields are ['a', 'q']"),
])
def test_bad_data_sources(argv: tuple[str, ...], code: int, fragment: str, tiny_checkpoint: Path, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    datasets.Dataset.from_list([{"q": "x", "a": "y"}] * 3).to_parquet(str(tmp_path / "odd.parquet"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    argv = tuple(arg.format(tmp=tmp_path, checkpoint=tiny_checkpoint) for arg in argv)
    proc = run_script_inprocess(*argv, cache=tmp_path / "cache", monkeypatch=monkeypatch)
    assert proc.returncode == code, proc.stderr
    assert fragment in " ".join(proc.stderr.split()), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_no_network_names_the_local_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    # offline mode: load_dataset looks in its (empty) cache only, exactly what it does without a network
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    with pytest.raises(sources.UserError, match=r"--data alpaca could not be fetched .* no network or offline mode "
                                               r".* pass the local copy .* with --data_path"):
        sources.table_records("alpaca", None, {})
