"""Preference data: records of a prompt with a chosen and a rejected completion -> pairs of token rows whose targets
are the completions' tokens alone (methods/preference.py's batches: (pairs, 2, time), chosen first).

A record takes TRL's forms: ``{"prompt": str, "chosen": str, "rejected": str}``; conversational, with
``"prompt"`` a list of messages and ``"chosen"`` / ``"rejected"`` the assistant's message(s); or with an implicit
prompt, ``"chosen"`` and ``"rejected"`` whole conversations that share their first messages. The prompt is written
in the run's prompt style, as instruction fine-tuning writes it (``instruct.segments``).
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from lit_model.core.errors import UsageError, UserError
from lit_model.data.instruct import (IGNORE_INDEX, PAD_MULTIPLE, cut_note, encode, padded_length, read_records, segments,
                                     split_records)
from lit_model.data.sources import table_records
from lit_model.io.prompts import PromptStyle

PAIR_EXAMPLE = '{"prompt": "...", "chosen": "...", "rejected": "..."}'


def pair_segments(record: Any, where: str, style: PromptStyle) -> tuple[list[tuple[str, bool]], list[tuple[str, bool]]]:
    """The chosen and the rejected conversation as ``(piece, is_target)`` pieces: the shared prompt, then the
    completion, its pieces the only targets."""
    if not isinstance(record, dict) or not all(record.get(key) for key in ("chosen", "rejected")):
        found = f"keys {sorted(record)}" if isinstance(record, dict) else f"a JSON {type(record).__name__}"
        missing = [key for key in ("chosen", "rejected") if isinstance(record, dict) and not record.get(key)]
        raise UserError(
            f"{where} has {found}{f' (no or an empty {missing[0]!r})' if missing else ''}, but a preference record "
            f"needs a non-empty 'chosen' and 'rejected' completion of a 'prompt': {PAIR_EXAMPLE}, or with messages "
            "as TRL's conversational format. Fix or drop the record."
        )
    prompt, chosen, rejected = record.get("prompt"), record["chosen"], record["rejected"]
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise UserError(f"{where}: string completions need a string 'prompt' ({PAIR_EXAMPLE}).")
        return tuple(segments({"instruction": prompt, "output": completion}, where, style)  # type: ignore[return-value]
                     for completion in (chosen, rejected))
    if not isinstance(chosen, list) or not isinstance(rejected, list):
        raise UserError(f"{where}: 'chosen' and 'rejected' are both strings or both lists of messages.")
    if prompt is None:  # implicit prompt: the messages both conversations start with
        shared = next((i for i, (a, b) in enumerate(zip(chosen, rejected)) if a != b), min(len(chosen), len(rejected)))
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if not isinstance(prompt, list) or not prompt:
        raise UserError(f"{where}: a conversational record's 'prompt' is a non-empty list of messages.")
    return tuple(_completion_pieces(prompt, completion, where, style) for completion in (chosen, rejected))  # type: ignore[return-value]


def _completion_pieces(prompt: list[Any], completion: list[Any], where: str, style: PromptStyle
                       ) -> list[tuple[str, bool]]:
    """The conversation ``prompt + completion``, only the completion's assistant replies as targets."""
    if not completion or not all(isinstance(m, dict) and m.get("role") == "assistant" for m in completion):
        raise UserError(f"{where}: each completion is one or more assistant messages after the prompt; this one has "
                        f"{[m.get('role') if isinstance(m, dict) else m for m in completion]}.")
    pieces = segments({"messages": [*prompt, *completion]}, where, style)
    targets = [i for i, (_, target) in enumerate(pieces) if target][-len(completion):]
    return [(text, i in targets) for i, (text, _) in enumerate(pieces)]


class PreferenceDataset(Dataset):
    """Pairs of token rows: each item ``(input_ids, targets)`` of shape (2, length), chosen first, right-padded to
    the longer of the two (targets IGNORE_INDEX outside the completion), and with ``reference`` (pairs, 2) the
    pair's reference log-probabilities as a third part; ``lengths`` for grouping by length, ``ends`` each row's
    length up to its last target (what --packing packs: ``pack_rows``)."""

    def __init__(self, pairs: list[tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]],
                 prompts: list[str], reference: Optional[torch.Tensor] = None) -> None:
        self.pairs, self.prompts, self.reference = pairs, prompts, reference
        self.lengths = [max(len(ids) for ids, _ in pair) - 1 for pair in pairs]
        self.ends = [tuple(int(np.flatnonzero(flags[1:])[-1]) + 1 for _, flags in pair) for pair in pairs]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        length = self.lengths[index]
        input_ids = torch.zeros(2, length, dtype=torch.long)
        targets = torch.full((2, length), IGNORE_INDEX, dtype=torch.long)
        for row, (ids, flags) in enumerate(self.pairs[index]):
            input_ids[row, : len(ids) - 1] = torch.from_numpy(ids[:-1])
            targets[row, : len(ids) - 1] = torch.from_numpy(np.where(flags[1:], ids[1:], IGNORE_INDEX))
        return (input_ids, targets) if self.reference is None else (input_ids, targets, self.reference[index])

    def with_reference(self, reference: torch.Tensor) -> "PreferenceDataset":
        """The same pairs with their reference log-probabilities (pairs, 2)."""
        if tuple(reference.shape) != (len(self), 2):
            raise ValueError(f"reference log-probabilities of shape {tuple(reference.shape)} for {len(self)} pairs")
        return PreferenceDataset(self.pairs, self.prompts, reference)

    def digest(self) -> str:
        """SHA-256 of the pairs' tokens and target flags: what a cache of values computed from them is keyed by."""
        sha = hashlib.sha256()
        for pair in self.pairs:
            for ids, flags in pair:
                sha.update(np.int64(len(ids)).tobytes() + ids.astype("<i8").tobytes() + flags.astype(bool).tobytes())
        return sha.hexdigest()

    @property
    def target_tokens(self) -> int:
        return int(sum(flags[1:].sum() for pair in self.pairs for _, flags in pair))

    def batch_tokens(self, indices: Sequence[int], max_length: int, packed: bool) -> tuple[int, int]:
        """A micro batch's rows' tokens up to their last target, and the tokens the step runs: ``collate_pairs``'s
        padded rows, or with ``packed`` the rows ``pack_rows`` makes of them (``padding_fraction``'s micro_tokens)."""
        ends = [end for i in indices for end in self.ends[i]]
        if packed:
            rows, width = pack_rows(ends, max_length)
            return sum(ends), len(rows) * width
        return sum(ends), len(ends) * padded_length(max(self.lengths[i] for i in indices), max_length=max_length)


def pack_rows(lengths: Sequence[int], max_length: int) -> tuple[list[list[int]], int]:
    """Rows of ``lengths`` tokens (a micro batch's chosen and rejected rows) packed into rows of at most
    ``max_length`` tokens: the packed rows' indices into ``lengths`` and the width they are padded to (as
    ``collate_pairs`` pads). Of every row count from the fewest that could hold them to one row each, the one whose
    padded rows hold the fewest tokens, each filled longest first into the emptiest row (balanced: a last, nearly
    empty row would be padded to the full width). One row each is the unpacked layout, so the packed rows never hold
    more tokens than ``collate_pairs``' (what the planner plans: the data's longest micro batch)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    longest = padded_length(max(lengths), max_length=max_length)
    best: tuple[int, list[list[int]], int] = (len(lengths) * longest + 1, [], 0)
    for count in range(-(-sum(lengths) // max_length), len(lengths) + 1):
        if count * longest >= best[0]:  # no row is narrower than the longest: more rows only cost more
            break
        rows: list[list[int]] = [[] for _ in range(count)]
        fills = [(0, row) for row in range(count)]  # a heap: the emptiest row first
        for index in order:
            fill, row = heapq.heappop(fills)
            rows[row].append(index)
            heapq.heappush(fills, (fill + lengths[index], row))
        fullest = max(fill for fill, _ in fills)
        width = padded_length(fullest, max_length=max_length)
        if fullest <= max_length and count * width < best[0]:
            best = (count * width, rows, width)
    return best[1], best[2]


def collate_pairs(items: Sequence[tuple[torch.Tensor, ...]], pad_id: int = 0, multiple: int = PAD_MULTIPLE,
                  max_length: Optional[int] = None) -> tuple[torch.Tensor, ...]:
    """(pairs, 2, length) batches, right-padded to ``padded_length``: input ids with ``pad_id``, targets with
    IGNORE_INDEX, a reference's log-probabilities (pairs, 2) stacked as they are."""
    length = padded_length(max(item[0].size(1) for item in items), multiple, max_length)
    input_ids = torch.full((len(items), 2, length), pad_id, dtype=torch.long)
    targets = torch.full((len(items), 2, length), IGNORE_INDEX, dtype=torch.long)
    for row, item in enumerate(items):
        input_ids[row, :, : item[0].size(1)] = item[0][:, :length]
        targets[row, :, : item[1].size(1)] = item[1][:, :length]
    rest = [torch.stack([item[i] for item in items]) for i in range(2, len(items[0]))]
    return (input_ids, targets, *rest)


@dataclass
class PreferenceData:
    train: PreferenceDataset
    val: PreferenceDataset
    description: str
    sample_instruction: str  # what the end of a run answers: the first validation pair's prompt, styled


def build_pairs(records: list[tuple[str, Any]], tokenizer: Any, style: PromptStyle, seq_length: int
                ) -> tuple[PreferenceDataset, int, int]:
    """Tokenized pairs, each row cut to ``seq_length + 1`` tokens; returns (dataset, pairs cut, pairs dropped
    because the cut left one of its completions no token)."""
    pairs, prompts, cut, dropped = [], [], 0, 0
    for where, record in records:
        both = pair_segments(record, where, style)
        rows = [encode(pieces, tokenizer, mask_prompt=True) for pieces in both]
        if any(len(ids) > seq_length + 1 for ids, _ in rows):
            cut += 1
            rows = [(ids[: seq_length + 1], flags[: seq_length + 1]) for ids, flags in rows]
        if any(len(ids) < 2 or not flags[1:].any() for ids, flags in rows):
            dropped += 1
            continue
        pairs.append((rows[0], rows[1]))
        prompts.append(both[0][0][0])
    return PreferenceDataset(pairs, prompts), cut, dropped


def load_preference_data(data_path: Optional[Path], tokenizer: Any, style: PromptStyle, seq_length: int,
                         val_fraction: float = 0.05, seed: int = 42, data: Optional[str] = None,
                         fields: Optional[dict[str, str]] = None) -> PreferenceData:
    """Train/val pairs of a named hub dataset (``data``) or a local .json/.jsonl/.parquet/.csv file or directory."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"--val_split_fraction {val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05.")
    if data_path is None and data is None:
        raise UsageError(f"Preference training needs data: --data_path FILE with records like {PAIR_EXAMPLE} (or "
                         "TRL's conversational form), or --data NAME.")
    if data is not None:
        records, source = table_records(data, None, fields or {}, "preference")
    else:
        records, source = read_records(Path(data_path), fields, "preference"), str(data_path)
    train_records, val_records = split_records(records, source, val_fraction, seed)
    train, train_cut, train_dropped = build_pairs(train_records, tokenizer, style, seq_length)
    val, val_cut, val_dropped = build_pairs(val_records, tokenizer, style, seq_length)
    note = cut_note(len(train), len(val), train_cut + val_cut, train_dropped + val_dropped, seq_length, "pair")
    lengths = np.asarray(train.lengths)
    description = (f"{source}: {len(records)} records, {len(train)} train / {len(val)} val pairs in the {style.name!r} "
                   f"prompt style, {int(lengths.mean())} tokens on average (max {lengths.max()}){note}")
    return PreferenceData(train, val, description, val.prompts[0])
