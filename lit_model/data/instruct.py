"""Instruction data for fine-tuning: JSON/JSONL records -> prompt-styled token sequences with the prompt
masked from the loss, length-grouped micro batches and padded collation.

A record is either Alpaca-style, ``{"instruction": ..., "input": ... (optional), "output": ...}``, or a chat,
``{"messages": [{"role": "system" | "user" | "assistant", "content": ...}, ...]}`` (every assistant message
is a target). With no data of its own, fine-tuning uses instruction pairs made from the Python standard
library with ``ast``: "Write a Python function `name(args)` that: <docstring summary>" -> the function's
source, cached once and split into train/val by file like the pretraining corpus.
"""

from __future__ import annotations

import ast
import bisect
import hashlib
import json
import sys
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from lit_model.data.cache import cache_root, cached
from lit_model.data.sources import TABLE_SUFFIXES, Kind, is_table, map_record, table_records
from lit_model.data.text import GlobalBatchSampler, json_records, split_by_file, stdlib_sources
from lit_model.core.errors import UsageError, UserError
from lit_model.io.prompts import Alpaca, PromptStyle

IGNORE_INDEX = -100
MAX_SOURCE_CHARS = 1200  # default data: functions up to this long (most fit 512 tokens with their prompt)
# Batches are padded to a multiple of this many tokens: few distinct shapes. With exact lengths, the default LoRA
# run's peak RSS on the CPU grew from 1.0 to 3.2 GB over 100 steps (freed blocks of ever new sizes stay with the
# allocator); padded to 64 it stayed at 0.9 GB, at the same speed.
PAD_MULTIPLE = 64


# ---- reading records -----------------------------------------------------------------------------------
def read_records(path: Path, fields: Optional[dict[str, str]] = None, kind: Kind = "instruct"
                 ) -> list[tuple[str, dict[str, Any]]]:
    """``(where, record)`` pairs of a .json file (a list of records), a .jsonl file (one per line), a .parquet or
    .csv file or a save_to_disk directory (through ``datasets``), or of every such file in a directory (sorted);
    field names mapped to ours (``fields``: ours -> theirs, then for instructions the common names of
    ``sources.FIELDS``; ``kind``: whose records, ``sources.map_record``)."""
    path, fields = Path(path).expanduser(), fields or {}
    if not path.exists():
        raise UserError(
            f"The data path {path} does not exist. Pass a .json/.jsonl/.parquet/.csv/.tsv file (or a directory of "
            "them) with --data_path, or leave it out to fine-tune on instructions made from the Python standard library."
        )
    if is_table(path):
        return table_records(None, path, fields, kind)[0]
    suffixes = (".json", ".jsonl") + TABLE_SUFFIXES
    files = sorted(p for p in path.rglob("*") if p.suffix in suffixes and p.is_file()) if path.is_dir() else [path]
    if not files:
        raise UserError(f"The directory {path} holds no .json or .jsonl files, nor .parquet, .csv or .tsv files. Point "
                        "--data_path at your data.")
    example = '{"instruction": "...", "output": "..."}'
    return [item for file in files for item in (
        table_records(None, file, fields, kind)[0] if is_table(file) else
        [(where, map_record(record, fields, where, kind)) for where, record in json_records(file, example)])]


def segments(record: Any, where: str, style: PromptStyle) -> list[tuple[str, bool]]:
    """The record's text as ``(piece, is_target)`` pieces in the prompt style."""
    if isinstance(record, dict) and "messages" in record:
        return _chat_segments(record["messages"], where, style)
    if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("instruction", "output")) or (
        not isinstance(record.get("input") or "", str)
    ):
        if isinstance(record, dict):
            wrong = [f"{k!r} is a JSON {type(record[k]).__name__}" for k in ("instruction", "input", "output")
                     if record.get(k) is not None and not isinstance(record[k], str)]
            found = f"keys {sorted(record)}" + (f" ({', '.join(wrong)})" if wrong else "")
        else:
            found = f"a JSON {type(record).__name__}, not an object"
        raise UserError(
            f"{where} has {found}, but a record needs string fields 'instruction' and 'output' (optionally "
            "'input'), or a 'messages' list of {role, content}. Map the fields with --data_fields, e.g. "
            "--data_fields instruction=question,output=answer, or fix the record."
        )
    extra = record.get("input") or ""
    if isinstance(style, Alpaca):
        prompt = style.apply(record["instruction"], input=extra)
    else:
        prompt = style.apply(record["instruction"] + (f"\n\n{extra}" if extra else ""))
    return [(prompt, False), (record["output"] + style.end, True)]


def _chat_segments(messages: Any, where: str, style: PromptStyle) -> list[tuple[str, bool]]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise UserError(f"{where}: 'messages' must be a list of {{\"role\": ..., \"content\": ...}} objects with string values.")
    if unknown := sorted({m["role"] for m in messages} - {"system", "user", "assistant"}):
        raise UserError(f"{where}: unknown role(s) {', '.join(map(repr, unknown))} in 'messages'; a role is 'system', "
                        "'user' or 'assistant'. Rename them or drop the record.")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: the conversation has no 'assistant' message to learn from. Add one or drop the record.")
    pieces, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = style.apply_chat(messages[:i], add_generation_prompt=False) + style.assistant
        if not before.startswith(done):  # e.g. a system message after the first user turn
            raise UserError(f"{where}: put the system message first; the conversation cannot be rendered turn by turn.")
        pieces += [(before[len(done):], False), (message["content"] + style.end, True)]
        done = before + message["content"] + style.end
    return pieces


def encode(pieces: Sequence[tuple[str, bool]], tokenizer: Any, mask_prompt: bool) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (bos as the tokenizer wants it, eos after the last piece) and a per-token target flag."""
    ids: list[int] = []
    flags: list[bool] = []
    for i, (text, target) in enumerate(pieces):
        piece = tokenizer.encode(text, bos=None if i == 0 else False).tolist()
        ids += piece
        flags += [target or not mask_prompt] * len(piece)
    if tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
        flags.append(True)
    return np.asarray(ids, dtype=np.int64), np.asarray(flags, dtype=bool)


# ---- the dataset ---------------------------------------------------------------------------------------
class InstructDataset(Dataset):
    """Samples of (input_ids, targets), targets = next token or -100 where masked; lengths for grouping."""

    def __init__(self, samples: list[tuple[np.ndarray, np.ndarray]], prompts: list[str]) -> None:
        self.samples, self.prompts = samples, prompts
        self.lengths = [len(ids) - 1 for ids, _ in samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, flags = self.samples[index]
        targets = np.where(flags[1:], ids[1:], IGNORE_INDEX)
        return torch.from_numpy(ids[:-1]), torch.from_numpy(targets)

    @property
    def target_tokens(self) -> int:
        return int(sum(flags[1:].sum() for _, flags in self.samples))


class PackedDataset(Dataset):
    """An InstructDataset's samples packed into sequences of at most ``max_length`` tokens, each item
    ``(input_ids, targets, positions)`` with every sample's positions counting from 0 (the model confines
    attention to each sample, see ``GPT.forward``). Packs are filled best-fit (see ``pack_best_fit``)."""

    def __init__(self, samples: InstructDataset, max_length: int) -> None:
        self.samples = samples
        self.packs = pack_best_fit(samples.lengths, max_length)
        self.lengths = [sum(samples.lengths[i] for i in pack) for pack in self.packs]

    def __len__(self) -> int:
        return len(self.packs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        parts = [self.samples[i] for i in self.packs[index]]
        positions = torch.cat([torch.arange(len(ids)) for ids, _ in parts])
        return torch.cat([ids for ids, _ in parts]), torch.cat([targets for _, targets in parts]), positions

    @property
    def target_tokens(self) -> int:
        return self.samples.target_tokens


def pack_best_fit(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Sample indices in packs of at most ``max_length`` tokens, in the data's order: each sample goes into the
    pack with the least room left that holds it, else starts a new pack (best fit; a binary search over the packs'
    rooms). On the default data at 512 tokens (4,178 samples of 182 tokens on average) the packs are 95 % full;
    the order-preserving greedy of torchtune's PackedDataset (a sample that does not fit the current pack starts
    the next) fills them 78 %, so it needs 22 % more sequences, i.e. compute, for the same samples. Which samples
    share a pack does not matter: each attends only to itself, and the sampler shuffles the packs."""
    packs: list[list[int]] = []
    rooms: list[tuple[int, int]] = []  # (tokens left, pack index) of the packs not full, sorted
    for index, length in enumerate(lengths):
        at = bisect.bisect_left(rooms, (length, -1))
        if at < len(rooms):
            room, pack = rooms.pop(at)
        else:
            room, pack = max_length, len(packs)
            packs.append([])
        packs[pack].append(index)
        if room > length:
            bisect.insort(rooms, (room - length, pack))
    return packs


def padded_length(longest: int, multiple: int = PAD_MULTIPLE, max_length: Optional[int] = None) -> int:
    """The length ``collate`` pads a batch to: its longest sample rounded up to ``multiple``, at most ``max_length``
    (samples are cut to it)."""
    length = -(-longest // multiple) * multiple
    return min(length, max_length) if max_length is not None else length


def collate(
    items: Sequence[tuple[torch.Tensor, ...]], pad_id: int = 0, multiple: int = PAD_MULTIPLE,
    max_length: Optional[int] = None,
) -> tuple[torch.Tensor, ...]:
    """Right-pad to ``padded_length``: input ids with ``pad_id``, targets with -100 (no loss) and, in packed
    items, positions with 0 (each padding token a document of its own, which attends only to itself)."""
    length = padded_length(max(len(item[0]) for item in items), multiple, max_length)
    fills = (pad_id, IGNORE_INDEX, 0)[: len(items[0])]
    batch = tuple(torch.full((len(items), length), fill, dtype=torch.long) for fill in fills)
    for row, item in enumerate(items):
        for padded, part in zip(batch, item):
            padded[row, : len(part)] = part
    return batch


class LengthGroupedSampler(GlobalBatchSampler):
    """GlobalBatchSampler whose step sorts its whole global batch by length (longest first) before cutting it
    into micro batches, which go to the ranks round-robin: the micro batches, and so the padding and the
    gradients, are the same for any number of processes, and each rank gets a mix of long and short ones."""

    def __init__(self, lengths: Sequence[int], *args: Any, **kwargs: Any) -> None:
        super().__init__(len(lengths), *args, **kwargs)
        self.lengths = lengths

    def step_indices(self, step: int) -> list[int]:
        G, M, n = self.global_batch_size, self.micro_batch_size, self.dataset_len
        batch = [int(self._permutation(p // n)[p % n]) for p in range(step * G, (step + 1) * G)]
        batch.sort(key=lambda i: (-self.lengths[i], i))
        micro = [batch[i : i + M] for i in range(0, G, M)]
        return [index for chunk in micro[self.rank :: self.world_size] for index in chunk]


def padding_fraction(lengths: Sequence[int], global_batch_size: int, micro_batch_size: int, steps: int,
                     max_length: int, seed: int = 0,
                     micro_tokens: Optional[Callable[[list[int]], tuple[int, int]]] = None) -> float:
    """The share of padding tokens in the micro batches of the first ``steps`` steps, as LengthGroupedSampler
    groups them and ``collate`` pads them (the same micro batches for any number of processes).
    ``micro_tokens(indices) -> (real tokens, tokens run)`` of a micro batch made otherwise (preference pairs)."""
    sampler = LengthGroupedSampler(lengths, global_batch_size, micro_batch_size, 0, 1, seed=seed)
    real = padded = 0
    for step in range(steps):
        indices = sampler.step_indices(step)
        for start in range(0, len(indices), micro_batch_size):
            chunk = indices[start : start + micro_batch_size]
            if micro_tokens is not None:
                tokens = micro_tokens(chunk)
            else:
                tokens = (sum(lengths[i] for i in chunk),
                          len(chunk) * padded_length(max(lengths[i] for i in chunk), max_length=max_length))
            real, padded = real + tokens[0], padded + tokens[1]
    return 1 - real / max(padded, 1)


@dataclass
class InstructData:
    train: Union[InstructDataset, PackedDataset]
    val: Union[InstructDataset, PackedDataset]
    description: str
    sample_instruction: str  # a fixed validation prompt (already in the prompt style) to answer at the end


def build_dataset(records: list[tuple[str, Any]], tokenizer: Any, style: PromptStyle, seq_length: int,
                  mask_prompt: bool) -> tuple[InstructDataset, int, int]:
    """Tokenized samples cut to ``seq_length + 1`` tokens; returns (dataset, samples cut, samples dropped
    because the cut left them no target token)."""
    samples, prompts, cut, dropped = [], [], 0, 0
    for where, record in records:
        pieces = segments(record, where, style)
        ids, flags = encode(pieces, tokenizer, mask_prompt)
        if len(ids) > seq_length + 1:
            cut += 1
            ids, flags = ids[: seq_length + 1], flags[: seq_length + 1]
        if len(ids) < 2 or not flags[1:].any():
            dropped += 1
            continue
        samples.append((ids, flags))
        prompts.append(pieces[0][0])
    return InstructDataset(samples, prompts), cut, dropped


def load_instruct_data(data_path: Optional[Path], tokenizer: Any, style: PromptStyle, seq_length: int,
                       mask_prompt: bool = True, val_fraction: float = 0.05, seed: int = 42,
                       data: Optional[str] = None, fields: Optional[dict[str, str]] = None) -> InstructData:
    """Train/val samples of a named dataset (``data``), a local file or directory, or (neither) the stdlib's."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val_split_fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05.")
    if data_path is None and data is None:
        train_records, val_records = stdlib_instructions(val_fraction)
        what = f"{len(train_records) + len(val_records)} instructions made from the Python standard library"
    else:
        if data is not None:
            records, source = table_records(data, None, fields or {})
        else:
            records, source = read_records(data_path, fields), str(data_path)
        train_records, val_records = split_records(records, source, val_fraction, seed)
        what = f"{source}: {len(records)} records"
    train, train_cut, train_dropped = build_dataset(train_records, tokenizer, style, seq_length, mask_prompt)
    val, val_cut, val_dropped = build_dataset(val_records, tokenizer, style, seq_length, mask_prompt)
    note = cut_note(len(train), len(val), train_cut + val_cut, train_dropped + val_dropped, seq_length, "sample")
    lengths = np.asarray(train.lengths)
    description = (
        f"{what}, {len(train)} train / {len(val)} val samples in the {style.name!r} prompt style, "
        f"{int(lengths.mean())} tokens on average (max {lengths.max()}), "
        f"{'prompt masked' if mask_prompt else 'prompt trained'}{note}"
    )
    return InstructData(train, val, description, val.prompts[0])


def split_records(records: list[Any], source: str, val_fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """A fixed train/val split of ``records`` (the same whatever --seed is), at least one record on each side."""
    if len(records) < 2:
        raise UserError(f"{source} holds {len(records)} record(s); a train/val split needs at least 2.")
    order = np.random.default_rng(seed).permutation(len(records))
    n_val = min(max(1, round(len(records) * val_fraction)), len(records) - 1)
    return [records[i] for i in sorted(order[n_val:])], [records[i] for i in sorted(order[:n_val])]


def cut_note(n_train: int, n_val: int, cut: int, dropped: int, seq_length: int, unit: str) -> str:
    """What the cut to ``seq_length`` did, for the data's description; an error when a split lost every ``unit``
    (a sample, a pair) to it."""
    if n_train == 0 or n_val == 0:
        raise UserError(
            f"No {'training' if n_train == 0 else 'validation'} {unit} keeps a response token within "
            f"{seq_length} tokens ({dropped} {unit}s lost theirs to the cut). Raise "
            f"--override_max_seq_length (up to the model's block size), or use {unit}s with shorter prompts."
        )
    note = f"; {cut} {unit}s were longer than {seq_length + 1} tokens and were cut" if cut else ""
    return note + (f" ({dropped} of them lost every response token and were dropped)" if dropped else "")


# ---- the default data: the standard library's documented functions ---------------------------------------
def stdlib_instructions(val_fraction: float = 0.05) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """Train/val instruction records from the stdlib (split by source file, the pretraining split)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    files = [p for p in stdlib_sources() if not {"test", "tests", "idle_test"} & set(p.relative_to(root).parts)]
    key = hashlib.sha256("v1|".join(f"{p}|{p.stat().st_size}" for p in files).encode()).hexdigest()[:12]
    path = cache_root() / "instruct" / f"stdlib-py{version}-functions-{key}.jsonl"
    cached(path, lambda write: _write_jsonl(write, _function_records(files, root)),
           valid=lambda record: isinstance(record.get("records"), int))
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]  # checked by cached
    _, val_files = split_by_file(files, val_fraction, root=root)
    val_names = {p.relative_to(root).as_posix() for p in val_files}
    train = [(f"{r['file']} ({r['name']})", r) for r in records if r["file"] not in val_names]
    val = [(f"{r['file']} ({r['name']})", r) for r in records if r["file"] in val_names]
    return train, val


def _function_records(files: Sequence[Path], root: Path) -> Iterator[dict[str, str]]:
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines(keepends=True)
        for node, owner in _documented_functions(tree):
            code = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip()  # from `def` (decorators left out)
            summary = (ast.get_docstring(node) or "").strip().splitlines()[0].strip()
            if len(code) > MAX_SOURCE_CHARS or len(summary) < 10:
                continue
            kind, name = ("method", f"{owner}.{node.name}") if owner else ("function", node.name)
            yield {
                "instruction": f"Write a Python {kind} `{name}({ast.unparse(node.args)})` that: {summary}",
                "input": "",
                "output": textwrap.dedent(code),
                "file": path.relative_to(root).as_posix(),
                "name": name,
            }


def _documented_functions(tree: ast.Module) -> Iterator[tuple[ast.AST, str]]:
    """Public top-level functions and public methods of public top-level classes that have a docstring."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    for node in tree.body:
        if isinstance(node, functions) and not node.name.startswith("_") and ast.get_docstring(node):
            yield node, ""
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, functions) and not sub.name.startswith("_") and ast.get_docstring(sub):
                    yield sub, node.name


def _write_jsonl(write: Callable[[bytes], object], records: Iterable[dict[str, str]]) -> dict[str, int]:
    count = 0
    for record in records:
        write((json.dumps(record) + "\n").encode("utf-8"))
        count += 1
    return {"records": count}
