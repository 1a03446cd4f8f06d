"""Pretraining data: text files -> a cached flat token array -> fixed-length windows, and a sampler that
gives every optimizer step the same global batch whatever the number of processes.

With no data of its own, pretraining uses the running Python's standard library (~30 MB of real code)
and a byte-level BPE tokenizer trained on it, so a run works offline. Everything expensive is cached
under ``cache_root()``, built by one process at a time and checked on every load (lit_model/data/cache.py).
User data must be UTF-8 text: a file that is not gets a message naming it, never U+FFFD or a traceback.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lit_model.data.cache import (
    cache_root, cached, checked_directory, file_lock, warn_rebuild, write_directory_record,
)
from lit_model.data.sources import TABLE_SUFFIXES, is_table, text_file
from lit_model.core.errors import UsageError, UserError
from lit_model.io.tokenizer import TOKENIZER_FILES, Tokenizer, train_bpe

TEXT_SUFFIXES = (".txt", ".md", ".py")
JSON_SUFFIXES = (".json", ".jsonl")
# Big files are encoded in pieces of ~256 K characters (cut at line ends) to bound memory: the tokenizers library
# holds ~170 bytes per character of a piece while it encodes it (offsets, alignments, token strings): a 4 M-character
# piece took a pretraining process from 0.6 to 1.1 GB; 256 K-character pieces add ~50 MB and encode as fast.
_CHUNK_CHARS = 1 << 18


def stdlib_sources() -> list[Path]:
    """The running Python's standard-library sources: real text that every machine has."""
    files = []
    for directory, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]  # installed packages
        files += [Path(directory, name) for name in names if name.endswith(".py")]
    return sorted(files)


def split_by_file(
    files: Sequence[str | Path], val_fraction: float = 0.05, root: str | Path | None = None
) -> tuple[list[Path], list[Path]]:
    """Put a file in val when a hash of its path (relative to ``root``) falls below ``val_fraction``: the
    split does not depend on the order of the files nor on which others exist."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05.")
    paths = sorted({Path(f) for f in files})
    if not paths:
        return [], []
    base = Path(root) if root is not None else Path(os.path.commonpath([p.parent for p in paths]))
    digests = {p: hashlib.sha256(p.relative_to(base).as_posix().encode()).hexdigest() for p in paths}
    score = {p: int(digest[:16], 16) / 2**64 for p, digest in digests.items()}  # uniform in [0, 1)
    val = [p for p in paths if score[p] < val_fraction]
    if len(paths) >= 2 and not val:  # too few files for the fraction: hold out the most val-like one
        val = [min(paths, key=score.__getitem__)]
    elif len(paths) >= 2 and len(val) == len(paths):
        val.remove(max(paths, key=score.__getitem__))
    held_out = set(val)
    return [p for p in paths if p not in held_out], val


def default_tokenizer(vocab_size: int = 8192) -> Tokenizer:
    """A byte-level BPE trained once on the stdlib train files, then loaded from the cache."""
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    out_dir = cache_root() / "tokenizers" / f"stdlib-py{version}-bpe{vocab_size}"
    if not checked_directory(out_dir)[0]:
        with file_lock(out_dir.with_name(out_dir.name + ".lock")):
            complete, problem = checked_directory(out_dir)  # another rank may have trained it while we waited
            if not complete:
                if problem is not None:
                    warn_rebuild(out_dir, problem)
                train, _ = split_by_file(stdlib_sources())
                # `tokenizers` trains on UTF-8 only; a few stdlib test files are latin-1/koi8-r on purpose
                train_bpe([f for f in train if _is_utf8(f)], vocab_size, out_dir)
                write_directory_record(out_dir)
    return Tokenizer(out_dir)


def _is_utf8(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _documents(path: Path, errors: str) -> Iterator[Iterator[str]]:
    """Each document of a file as an iterator of text pieces (a JSON record, or a whole text file)."""
    if path.suffix in JSON_SUFFIXES:
        for where, record in json_records(path, '{"text": "..."}', errors):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                raise UserError(f'{where} has no "text" string field. Each JSON record must look like '
                                '{"text": "..."}; rename the field or convert the file to plain text.')
            yield iter([record["text"]])
        return
    try:
        handle = open(path, encoding="utf-8", errors=errors)
    except OSError as error:
        raise _unreadable(path, error) from None
    with handle:

        def pieces() -> Iterator[str]:
            while chunk := _read(path, handle, _CHUNK_CHARS):
                # end pieces at a line end: a cut changes at most the one whitespace token around it
                yield chunk + _read(path, handle, -1, line=True)

        yield pieces()


def read_text(path: Path, errors: str = "strict") -> str:
    """The whole of a UTF-8 file (``errors="replace"``: other bytes become U+FFFD); a message if it is not text."""
    try:
        with open(path, encoding="utf-8", errors=errors) as handle:
            return _read(path, handle, -1)
    except OSError as error:
        raise _unreadable(path, error) from None


def _read(path: Path, handle: Any, size: int, line: bool = False) -> str:
    try:
        text = handle.readline() if line else handle.read(size)
    except UnicodeDecodeError as error:
        raise UserError(
            f"{path} is not UTF-8 text (byte 0x{error.object[error.start]:02x}: {error.reason}). lit-model reads "
            "UTF-8 text: convert a file in another encoding (e.g. `iconv -f latin1 -t utf-8 FILE > FILE.utf8`), "
            "or remove the file if it is not text."
        ) from None
    except OSError as error:
        raise _unreadable(path, error) from None
    if "\x00" in text and handle.errors == "strict":
        raise UserError(f"{path} holds NUL bytes, so it is a binary file, not text. Remove it from the data, or "
                        "convert it to UTF-8 text (a UTF-16 file: `iconv -f utf-16 -t utf-8 FILE > FILE.utf8`).")
    return text


def _unreadable(path: Path, error: OSError) -> UserError:
    return UserError(f"Cannot read {path}: {error.strerror or error}. Make it a readable file (e.g. `chmod u+r`), "
                     "or leave it out of the data.")


def json_records(path: Path, example: str, errors: str = "strict") -> list[tuple[str, Any]]:
    """``(where, record)`` pairs of a JSON file (a record or a list of them) or a JSON-lines file (one per
    line); ``example`` shows a record in the messages."""
    text = read_text(path, errors)
    try:
        data = json.loads(text)
        return [(f"record {i} of {path}", r) for i, r in enumerate(data if isinstance(data, list) else [data])]
    except RecursionError:
        raise _too_deep(str(path), example) from None
    except ValueError as error:
        if path.suffix != ".jsonl" and text.lstrip().startswith("["):  # a broken list: its error, not line 1's
            raise UserError(f"{path} is not valid JSON ({error}). Fix the file: a .json file holds a record like "
                            f"{example} or a list of them.") from None
    records = []  # JSON lines: one record per line
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append((f"line {n} of {path}", json.loads(line)))
        except RecursionError:
            raise _too_deep(f"Line {n} of {path}", example) from None
        except ValueError as error:
            raise UserError(f"Line {n} of {path} is not valid JSON ({error}). A .json/.jsonl file holds JSON "
                            f"records like {example}, one per line or as a list; fix or remove that line.") from None
    return records


def _too_deep(where: str, example: str) -> UserError:
    return UserError(f"{where} nests JSON deeper than Python's parser allows (about {sys.getrecursionlimit()} "
                     f"levels), so it is not a record like {example}. Fix or replace the file.")


def _tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    digest = hashlib.sha256(f"{type(tokenizer).__name__}|{tokenizer.vocab_size}|{tokenizer.bos_id}|"
                            f"{tokenizer.eos_id}".encode())
    checkpoint_dir = getattr(tokenizer, "checkpoint_dir", None)
    for name in TOKENIZER_FILES if checkpoint_dir is not None else ():
        if (path := Path(checkpoint_dir) / name).is_file():
            digest.update(name.encode() + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size < 2**16 else np.uint32)


def tokenize_files(files: Iterable[str | Path], tokenizer: Tokenizer, cache_dir: str | Path, name: str,
                   errors: str = "strict") -> np.ndarray:
    """Encode the files (sorted; eos, if the tokenizer has one, after each document) into one flat array at
    ``<cache_dir>/<name>-<key>.bin``; the key changes with the files (path, size, mtime) or the tokenizer.
    The array is checked against its record (token count, size, SHA-256) on every call, and rebuilt if it
    does not match. Files must be UTF-8 text (``errors="replace"``: other bytes become U+FFFD).

    Returns a read-only ``np.memmap`` (an empty array when there are no tokens: empty files can't be mapped).
    """
    paths = sorted({Path(f).resolve() for f in files})
    dtype = token_dtype(tokenizer.vocab_size)
    # `errors` is left out of the key: a strict build fails or equals the lenient one, and the stdlib's
    # lenient cache has a name of its own
    # the piece size is in the key: where a file is cut can change the whitespace token at the cut
    key = hashlib.sha256(f"v1|{_CHUNK_CHARS}|{dtype.str}|{_tokenizer_fingerprint(tokenizer)}".encode())
    for path in paths:
        stat = path.stat()
        key.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    out = Path(cache_dir) / f"{re.sub(r'[^A-Za-z0-9._-]+', '_', name)}-{key.hexdigest()[:16]}.bin"
    record = cached(out, lambda write: _write_tokens(paths, tokenizer, dtype, out.stem, write, errors),
                    valid=lambda r: isinstance(r.get("tokens"), int) and r["tokens"] * dtype.itemsize == r["size"])
    count = record["tokens"]
    if count == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(out, dtype=dtype, mode="r", shape=(count,))  # the length the record vouches for


def _write_tokens(paths: list[Path], tokenizer: Tokenizer, dtype: np.dtype, what: str,
                  write: Callable[[bytes], object], errors: str) -> dict[str, int]:
    from tqdm import tqdm

    limit, eos, count = np.iinfo(dtype).max, tokenizer.eos_id is not None, 0
    with tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, file=sys.stderr,
              desc=f"Tokenizing {what}", dynamic_ncols=True) as bar:
        for n, path in enumerate(paths, 1):
            for document in _documents(path, errors):
                piece, first = next(document, ""), True
                while piece:  # look one piece ahead: only the document's last piece gets eos
                    following = next(document, "")
                    ids = tokenizer.encode(piece, bos=None if first else False, eos=eos and not following)
                    if len(ids) and int(ids.max()) > limit:
                        raise UserError(f"Token id {int(ids.max())} does not fit {dtype}; the tokenizer's "
                                        f"vocab_size={tokenizer.vocab_size} is wrong. Fix its tokenizer.json.")
                    write(ids.numpy().astype(dtype).tobytes())
                    count += len(ids)
                    piece, first = following, False
            bar.update(path.stat().st_size)
            bar.set_postfix_str(f"{n}/{len(paths)} files", refresh=False)
    return {"tokens": count}


class PackedDataset(Dataset):
    """Non-overlapping windows of ``seq_length + 1`` tokens (stride ``seq_length``): the last token of one
    window is the first of the next, so every token is a target exactly once."""

    def __init__(self, tokens: np.ndarray | torch.Tensor, seq_length: int) -> None:
        if seq_length < 1:
            raise UsageError(f"seq_length={seq_length} must be a positive number of tokens.")
        self.tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        self.seq_length = seq_length

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_length)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = (index % len(self)) * self.seq_length
        window = torch.from_numpy(np.asarray(self.tokens[start : start + self.seq_length + 1], dtype=np.int64))
        return window[:-1], window[1:]


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, world_size: int) -> None:
    """The one rule for a valid batch, used by training (the samplers), the flag checks and --plan: every
    process runs the same whole number of micro batches per optimizer step."""
    G, M, W = global_batch_size, micro_batch_size, world_size
    if min(G, M, W) < 1:
        raise UsageError(f"global_batch_size ({G}), micro_batch_size ({M}) and the number of processes ({W}) must "
                         "each be at least 1.")
    if G % (W * M):
        per_rank = G // W if G % W == 0 else 0
        valid = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
        fix = (f"use a micro_batch_size among {valid}" if valid else
               f"use a global_batch_size that is a multiple of {W * M} (devices x micro_batch_size)")
        raise UsageError(f"global_batch_size={G} must be divisible by devices ({W}) x micro_batch_size ({M}) "
                         f"so every process runs the same number of micro batches per step; {fix}.")


class GlobalBatchSampler:
    """Batch sampler whose global batch at optimizer step ``s`` does not depend on the world size.

    Epoch ``e`` is a permutation of the windows seeded with ``seed + e``; step ``s`` takes positions
    ``[s*G, (s+1)*G)`` of the epochs laid end to end (wrapping into the next epoch as needed), and rank
    ``r`` takes the contiguous share ``[r*G/W, (r+1)*G/W)`` of them as micro batches of ``M`` indices.
    Iteration is infinite and resumes at ``state_dict()["step"]``, the number of steps handed out in full.
    A DataLoader with workers fetches ahead, so on resume prefer the training loop's own optimizer step:
    ``load_state_dict({"step": step})``. With Fabric, set up the loader with ``use_distributed_sampler=False``.
    """

    def __init__(self, dataset_len: int, global_batch_size: int, micro_batch_size: int, rank: int,
                 world_size: int, seed: int = 0, start_step: int = 0) -> None:
        G, M, W = global_batch_size, micro_batch_size, world_size
        if dataset_len < 1:
            raise UserError("The dataset has no windows to sample; use more data or a shorter seq_length.")
        if min(G, M, W) < 1 or not 0 <= rank < W or seed < 0 or start_step < 0:
            raise UsageError(f"Invalid sampler settings: global_batch_size={G}, micro_batch_size={M}, rank={rank}, "
                             f"world_size={W}, seed={seed}, start_step={start_step}; sizes must be positive, "
                             "0 <= rank < world_size, and seed and step non-negative.")
        check_batch_sizes(G, M, W)
        self.dataset_len, self.global_batch_size, self.micro_batch_size = dataset_len, G, M
        self.rank, self.world_size, self.seed, self.step = rank, W, seed, start_step
        self._perms: dict[int, np.ndarray] = {}

    @property
    def accumulation_steps(self) -> int:
        """Micro batches per optimizer step on each rank."""
        return self.global_batch_size // (self.world_size * self.micro_batch_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step spans at most a few epochs: keep memory bounded
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng(self.seed + epoch).permutation(self.dataset_len)
        return self._perms[epoch]

    def step_indices(self, step: int) -> list[int]:
        """This rank's share of the global batch of ``step``."""
        share = self.global_batch_size // self.world_size
        start = step * self.global_batch_size + self.rank * share
        n = self.dataset_len
        return [int(self._permutation(p // n)[p % n]) for p in range(start, start + share)]

    def __iter__(self) -> Iterator[list[int]]:
        M = self.micro_batch_size
        while True:
            step = self.step
            indices = self.step_indices(step)
            for i in range(0, len(indices), M):
                if i + M >= len(indices):  # count the step as handed out with its last micro batch
                    self.step = step + 1
                yield indices[i : i + M]

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step = int(state["step"])


def _data_files(directory: Path) -> list[Path]:
    suffixes = TEXT_SUFFIXES + JSON_SUFFIXES + TABLE_SUFFIXES
    return sorted(p for p in directory.rglob("*") if p.suffix in suffixes and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def load_pretrain_data(data_path: Path | None, tokenizer: Tokenizer, seq_length: int,
                       val_fraction: float = 0.05, data: str | None = None) -> tuple[PackedDataset, PackedDataset, str]:
    """Train/val windows of ``seq_length`` tokens from the stdlib (neither ``data_path`` nor ``data``), one file,
    a directory (its .parquet/.csv files too), or a named text dataset / .parquet / .csv / save_to_disk directory
    (tables through ``datasets``: their text column as a JSON-lines file in the cache)."""
    if not 0 < val_fraction < 1:
        raise UsageError(f"val_fraction={val_fraction} must be between 0 and 1 (exclusive), e.g. 0.05.")
    if data is not None or (data_path is not None and Path(data_path).expanduser().exists()
                            and is_table(Path(data_path).expanduser())):
        data_path = text_file(data, None if data_path is None else Path(data_path).expanduser())
    cache_dir = cache_root() / "tokens"
    if data_path is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        train_files, val_files = split_by_file(stdlib_sources(), val_fraction, root=root)
        what = f"the Python {sys.version_info.major}.{sys.version_info.minor} standard library ({root})"
        name = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}"
        errors = "replace"  # a few stdlib test files are latin-1/koi8-r on purpose
    else:
        data_path = Path(data_path).expanduser()
        if not data_path.exists():
            raise UserError(f"The data path {data_path} does not exist. Pass an existing text file or directory "
                            "with --data_path, or leave it out to pretrain on the Python standard library.")
        name, what, errors = data_path.stem or "data", str(data_path), "strict"
        if data_path.is_dir():
            files = _data_files(data_path)
            if not files:
                raise UserError(f"The directory {data_path} has no usable files: pretraining reads "
                                f"{', '.join('*' + s for s in TEXT_SUFFIXES + JSON_SUFFIXES + TABLE_SUFFIXES)} "
                                'files (searched recursively; JSON records and tables need a "text" field). Add '
                                "such files or point --data_path at another directory.")
            split = split_by_file(files, val_fraction, root=data_path)  # by the table's path, not its export's
            train_files, val_files = ([text_file(None, p) if is_table(p) else p for p in part] for part in split)
        else:
            train_files, val_files = [data_path], []
    train = tokenize_files(train_files, tokenizer, cache_dir, f"{name}-train", errors)
    if val_files:
        val = tokenize_files(val_files, tokenizer, cache_dir, f"{name}-val", errors)
    else:  # a single file: hold out the tail of its token stream
        cut = len(train) - int(len(train) * val_fraction)
        train, val = train[:cut], train[cut:]
    window = seq_length + 1
    if len(train) < window:  # the split took too much: train on everything, the fallback below finds a val
        train, val = (train if len(val) == 0 else np.concatenate([train, val])), train[:0]
    if len(train) < window:
        raise UserError(f"The training data ({what}) has {len(train)} tokens, fewer than one window of "
                        f"seq_length + 1 = {window} tokens. Add more text, or pass --override_max_seq_length "
                        f"with a value below {max(1, len(train) - 1)}.")
    note = ""
    if len(val) < window:  # held-out part shorter than a window: take the last train windows instead
        n_train = (len(train) - 1) // seq_length
        n_val = max(1, round(n_train * val_fraction))
        if n_train >= 2:
            n_val = min(n_val, n_train - 1)
            train, val = train[: (n_train - n_val) * seq_length + 1], train[(n_train - n_val) * seq_length :]
            note = f"; the held-out split was shorter than a window, so val is the last {n_val} window(s) of train"
        else:
            val = train
            note = "; too little text for a held-out split, so val reuses the single train window (not held out)"
        val = val[: n_val * seq_length + 1]
    train_ds, val_ds = PackedDataset(train, seq_length), PackedDataset(val, seq_length)
    description = (f"{what}: {len(train_files)} train / {len(val_files)} val files, {len(train) / 1e6:.2f}M train / "
                   f"{len(val) / 1e6:.2f}M val tokens, {len(train_ds)} train / {len(val_ds)} val windows of "
                   f"{seq_length} tokens{note}")
    return train_ds, val_ds, description


# tokens counted at a time: bincount copies its input to int64, 8 bytes a token, at the end of a pretraining run
# (where the process peaks when the model is small): 1M tokens are 8 MiB, where 16M were the whole 71 MB int64 copy of
# the default corpus's 8.9M tokens on top of the run's peak (issue 50)
UNIGRAM_CHUNK = 1 << 20


def unigram_loss(train_tokens: np.ndarray | torch.Tensor, val_tokens: np.ndarray | torch.Tensor,
                 vocab_size: int) -> float:
    """Cross-entropy (nats/token) on val of add-one-smoothed train token frequencies: the loss of a model
    that ignores context, which pretraining has to beat to have learned anything."""
    def counts(tokens: np.ndarray | torch.Tensor) -> np.ndarray:
        tokens = tokens.numpy() if isinstance(tokens, torch.Tensor) else tokens
        total = np.zeros(vocab_size, dtype=np.int64)
        for start in range(0, len(tokens), UNIGRAM_CHUNK):
            chunk = np.bincount(np.asarray(tokens[start : start + UNIGRAM_CHUNK], dtype=np.int64), minlength=vocab_size)
            if len(chunk) > vocab_size:
                raise UsageError(f"Token id {len(chunk) - 1} is outside vocab_size={vocab_size}; pass the "
                                 "tokenizer's vocab_size.")
            total += chunk
        return total

    val_counts = counts(val_tokens)
    if val_counts.sum() == 0:
        raise UsageError("unigram_loss needs at least one validation token.")
    log_p = np.log(counts(train_tokens) + 1.0) - math.log(len(train_tokens) + vocab_size)
    return float(-(val_counts * log_p).sum() / val_counts.sum())
