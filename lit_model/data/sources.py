"""Data read through Hugging Face ``datasets``: named hub datasets (``--data alpaca``; of each kind: instructions,
text, preference pairs, GRPO prompts), local ``.parquet`` and ``.csv`` files and directories written by
``Dataset.save_to_disk``; and the one table that maps common sources' field names to the record shapes fine-tuning
reads (instruction/input/output, or chat messages; preference and prompt records take TRL's names, renamed only
where a source or --data_fields says so).

``datasets`` is imported only when such data is asked for, so the default data and JSON files do not need it.
"""

from __future__ import annotations

import csv
import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional

from huggingface_hub.errors import GatedRepoError, HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

from lit_model.data.cache import cache_root, cached
from lit_model.core.errors import UsageError, UserError

TABLE_SUFFIXES = (".parquet", ".csv", ".tsv")
DELIMITERS = {".csv": ",", ".tsv": "\t"}  # the tables read as delimited text
Kind = Literal["instruct", "text", "preference", "prompts"]


@dataclass(frozen=True)
class DataKind:
    what: str  # what a message calls such data
    scripts: str  # what trains on it
    fields: tuple[str, ...]  # its records' fields (ours), which --data_fields may map
    example: str  # a --data_fields value for it


KINDS: dict[str, DataKind] = {
    "instruct": DataKind("instruction", "finetune/lora.py, full.py or adapter.py",
                         ("instruction", "input", "output", "messages"), "instruction=question,output=answer"),
    "text": DataKind("plain text", "pretrain/main.py", (), ""),
    "preference": DataKind("preference-pair", "finetune/dpo.py", ("prompt", "chosen", "rejected"),
                           "prompt=question,chosen=better,rejected=worse"),
    "prompts": DataKind("prompt", "finetune/grpo.py", ("prompt", "answer"), "prompt=question,answer=solution"),
}


@dataclass(frozen=True)
class Named:
    repo: str  # hub dataset id
    kind: Kind
    fields: tuple[tuple[str, str], ...] = ()  # (ours, theirs) where the table's guess would be wrong
    gated: bool = False
    config: Optional[str] = None  # the hub dataset's configuration (subset), where it has several
    answer_after: Optional[str] = None  # "answer" is the text after this marker, which ends a worked solution


NAMED: dict[str, Named] = {
    "alpaca": Named("tatsu-lab/alpaca", "instruct"),  # instruction, input, output (and text: the rendered prompt)
    "alpaca_2k": Named("mhenrichsen/alpaca_2k_test", "instruct"),  # instruction, input, output
    "dolly": Named("databricks/databricks-dolly-15k", "instruct"),  # instruction, context, response, category
    "lima": Named("GAIR/lima", "instruct", gated=True),  # conversations: alternating user/assistant strings
    "longform": Named("akoksal/LongForm", "instruct", fields=(("instruction", "input"),)),  # input, output
    "tinystories": Named("roneneldan/TinyStories", "text"),  # text
    # TRL's conversational pairs: chosen and rejected whole conversations sharing their first messages (and scores)
    "ultrafeedback": Named("trl-lib/ultrafeedback_binarized", "preference"),
    "hh-rlhf": Named("trl-lib/hh-rlhf-helpful-base", "preference"),  # prompt, chosen, rejected: lists of messages
    "orca_dpo": Named("Intel/orca_dpo_pairs", "preference", fields=(("prompt", "question"),)),  # system, question, ...
    # question, answer: a worked solution ending "#### 72", the number exact_match compares
    "gsm8k": Named("openai/gsm8k", "prompts", fields=(("prompt", "question"),), config="main", answer_after="####"),
}

# Our field -> the names sources use for it, tried in order (the one mapping table).
FIELDS: dict[str, tuple[str, ...]] = {
    "instruction": ("instruction", "prompt", "question", "query"),
    "input": ("input", "context"),
    "output": ("output", "response", "answer", "completion"),
    "messages": ("messages", "conversations", "conversation"),
    "text": ("text", "content", "story"),
}
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "bot": "assistant", "model": "assistant"}


# ---- flags -----------------------------------------------------------------------------------------------
def check_data_flags(data: Optional[str], data_path: Optional[Path], data_fields: Optional[str], kind: Kind) -> None:
    """--data, --data_path and --data_fields, checked with the other flags before anything starts."""
    if data is not None and data_path is not None:
        raise UsageError(f"--data {data} and --data_path {data_path} both name the training data; pass one of them.")
    if data is not None:
        check_kind(data, kind)
    parse_fields(data_fields, kind)


def named(name: str) -> Named:
    if name not in NAMED:
        close = difflib.get_close_matches(name.lower(), NAMED, n=3, cutoff=0.5)
        hint = f"Did you mean {' or '.join(close)}? " if close else ""
        raise UsageError(f"--data {name} is not a known dataset. {hint}Known: {', '.join(NAMED)}. For other data "
                         "pass a local file or directory with --data_path (.json, .jsonl, .parquet, .csv, or a "
                         "directory written by datasets' save_to_disk).")
    return NAMED[name]


def check_kind(name: str, kind: Kind) -> Named:
    """The named dataset, if it is data of this kind (instruction records, text, preference pairs, prompts)."""
    source = named(name)
    if source.kind != kind:
        raise UsageError(f"--data {name} is {KINDS[source.kind].what} data; use it with {KINDS[source.kind].scripts}, "
                         f"or pick one of {', '.join(n for n, s in NAMED.items() if s.kind == kind)}.")
    return source


def parse_fields(spec: Optional[str], kind: Kind = "instruct") -> dict[str, str]:
    """``"instruction=question,output=answer"`` -> ``{"instruction": "question", "output": "answer"}``, each of ours
    a field of ``kind``'s records."""
    if not spec:
        return {}
    ours, example = KINDS[kind].fields, f"--data_fields {KINDS[kind].example}"
    pairs = [item.split("=", 1) for item in spec.split(",") if item.strip()]
    if not pairs or any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise UsageError(f"--data_fields {spec!r} must be OURS=THEIRS pairs separated by commas, e.g. {example}.")
    fields = {ours.strip(): theirs.strip() for ours, theirs in pairs}
    if unknown := sorted(set(fields) - set(ours)):
        raise UsageError(f"--data_fields maps {', '.join(unknown)}, which fine-tuning does not read in "
                         f"{KINDS[kind].what} records; the fields are {', '.join(ours)}, e.g. {example}.")
    return fields


# ---- field mapping ---------------------------------------------------------------------------------------
def map_record(record: Any, fields: dict[str, str], where: str, kind: Kind = "instruct") -> Any:
    """The record with its fields renamed to ours (``fields`` first, then, for instructions, the table); a record
    the table cannot map is returned as it is, and ``instruct.segments`` reports the fields it has. Preference and
    prompt records keep every field ``fields`` does not rename (TRL's names are ours; a prompt's others go to the
    rewards)."""
    if not isinstance(record, dict):
        return record
    if missing := sorted(theirs for theirs in fields.values() if theirs not in record):
        raise UserError(f"{where} has no field {', '.join(map(repr, missing))} (given with --data_fields); its fields "
                        f"are {sorted(record)}. Map those, e.g. --data_fields {KINDS[kind].example}.")
    if kind != "instruct":
        kept = {key: value for key, value in record.items() if key not in fields.values()}
        return {**kept, **{ours: record[theirs] for ours, theirs in fields.items()}}
    found, taken = {}, set(fields.values())  # a field --data_fields maps is not also guessed as another
    for ours, aliases in FIELDS.items():
        key = fields.get(ours) or next((a for a in aliases if a not in taken and record.get(a) is not None), None)
        if key is not None and record.get(key) is not None:
            found[ours] = record[key]
    if "messages" in found and not {"instruction", "output"} <= set(fields):
        return {"messages": _messages(found["messages"])}
    if "instruction" in found and "output" in found:
        return {key: found[key] for key in ("instruction", "input", "output") if key in found}
    return record


def _messages(turns: Any) -> Any:
    """Chat turns as ``{"role", "content"}``: ShareGPT's ``{"from", "value"}`` with human/gpt roles, or plain
    strings taking turns user/assistant (LIMA); anything else is returned for ``segments`` to report."""
    if not isinstance(turns, list):
        return turns
    if all(isinstance(t, str) for t in turns):
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return turns
        role = turn.get("role", turn.get("from"))
        messages.append({"role": ROLES.get(role, role) if isinstance(role, str) else role,
                         "content": turn.get("content", turn.get("value"))})
    return messages


# ---- loading through `datasets` --------------------------------------------------------------------------
def is_table(path: Path) -> bool:
    """A file or directory that needs ``datasets``: .parquet, .csv, or what ``save_to_disk`` wrote."""
    return path.suffix in TABLE_SUFFIXES or (path.is_dir() and (path / "dataset_dict.json").is_file()) or (
        path.is_dir() and (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _datasets() -> Any:
    try:
        import datasets  # only for this data: the default path and JSON files do not need it
    except ImportError:
        raise UserError("Reading named datasets, .parquet, .csv and save_to_disk directories needs the `datasets` "
                        "package: pip install 'lit-model[data]' (or pip install datasets).") from None
    return datasets


def hub_repo(name: str) -> str:
    """Where ``load_dataset`` finds a named dataset (tests point this at a local directory)."""
    return named(name).repo


def load_table(path: Path) -> Any:
    """A local .parquet/.csv file or save_to_disk directory as a ``datasets.Dataset`` (its train split)."""
    datasets = _datasets()
    try:
        if path.is_dir():
            table = datasets.load_from_disk(str(path))
        else:
            # CSV/TSV cells stay text (pandas would make an answer "3" an int); Parquet keeps its own types
            delimiter = DELIMITERS.get(path.suffix)
            options = {} if delimiter is None else {"features": _text_columns(path, delimiter), "sep": delimiter,
                                                    "keep_default_na": False}
            builder = "parquet" if delimiter is None else "csv"
            table = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except (OSError, ValueError, csv.Error, datasets.exceptions.DatasetGenerationError) as error:
        raise UserError(f"{path} could not be read as a dataset ({type(error).__name__}: {error}). Fix or "
                        "replace the file.") from None
    return _train_split(table, str(path))


def _text_columns(path: Path, delimiter: str) -> Any:
    """Every column of a CSV (TSV) file as a string column (its header names them), after checking that every row has
    the header's number of fields: pandas takes a longer row's extra leading fields as its index and pads a shorter
    one with empty cells, so a ragged row would become another record's fields or an empty pair without a word."""
    datasets = _datasets()
    with path.open(newline="", encoding="utf-8") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        header, line = next(reader, []), reader.line_num + 1
        for row in reader:
            if row and len(row) != len(header):  # pandas skips blank lines
                raise UserError(
                    f"Line {line} of {path} has {len(row)} field(s) where the header has {len(header)} "
                    f"({', '.join(header)}): a {'comma' if delimiter == ',' else 'tab'} inside a field needs the field "
                    "in double quotes, and every row one field per column. Fix that row, or save the data as .jsonl.")
            line = reader.line_num + 1
    return datasets.Features({name: datasets.Value("string") for name in header})


def load_named(name: str, kind: Kind) -> Any:
    """The named dataset's train split (of its configuration) through ``datasets.load_dataset`` (downloaded once into
    its cache; HF_DATASETS_OFFLINE=1 / HF_HUB_OFFLINE=1 read the cache only)."""
    source = check_kind(name, kind)
    datasets = _datasets()
    local = ("Download it where there is a network and pass the local copy (save_to_disk directory, .parquet or "
             ".jsonl) with --data_path.")
    try:
        table = datasets.load_dataset(hub_repo(name), source.config, split="train")
    except GatedRepoError:
        raise UserError(f"{source.repo} is gated: accept its terms on https://huggingface.co/datasets/{source.repo} "
                        f"and log in (hf auth login, or set HF_TOKEN). Or: {local}") from None
    except datasets.exceptions.DatasetNotFoundError as error:
        gated = " It is gated: accept its terms on the hub and log in (hf auth login)." if source.gated else ""
        raise UserError(f"--data {name}: {error}.{gated} {local}") from None
    except (ConnectionError, OfflineModeIsEnabled, LocalEntryNotFoundError, FileNotFoundError, HFValidationError,
            RuntimeError) as error:
        if isinstance(error, RuntimeError) and "script" not in str(error):
            raise
        raise _fetch_error(name, hub_repo(name), error, local) from None
    return _train_split(table, source.repo)


def _fetch_error(name: str, repo: str, error: BaseException, local: str) -> UserError:
    """The paragraph for a named dataset that ``load_dataset`` could not fetch: the hub's HTTP status when it
    answered with one (huggingface_hub retried 5xx answers for about 20 s), a loading script, a repo id that names
    nothing, or no network."""
    first = (str(error).splitlines() or [type(error).__name__])[0][:300]
    chain, cause = [], error
    while cause is not None and len(chain) < 20:  # datasets wraps the hub's HTTP error in its own FileNotFoundError
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    for cause in chain:
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if isinstance(status, int):
            later = "the hub is down or overloaded: try again later" if status >= 500 else "check the dataset's name"
            return UserError(f"--data {name}: the Hugging Face hub answered HTTP {status} for {repo} ({later}). {local}")
    if isinstance(error, RuntimeError):
        return UserError(f"--data {name}: {repo} is read by a loading script ({first}), which the installed datasets "
                         f"no longer runs. {local}")
    offline = any(isinstance(c, (ConnectionError, OfflineModeIsEnabled, LocalEntryNotFoundError)) for c in chain)
    if not offline:
        return UserError(f"--data {name}: {repo} is neither a local dataset nor a dataset on the hub ({first}). {local}")
    return UserError(f"--data {name} could not be fetched from the Hugging Face hub ({repo}) and is not in the datasets "
                     f"cache: no network or offline mode ({type(error).__name__}). {local}")


def _train_split(table: Any, what: str) -> Any:
    if hasattr(table, "column_names") and isinstance(table.column_names, list):
        return table
    if "train" in table or len(table) == 1:
        return table["train" if "train" in table else next(iter(table))]
    raise UserError(f"{what} has splits {sorted(table)} but no 'train' split. Save the split to train on by itself.")


def table_records(data: Optional[str], path: Optional[Path], fields: dict[str, str], kind: Kind = "instruct"
                  ) -> tuple[list[tuple[str, Any]], str]:
    """``(where, mapped record)`` pairs of a named dataset or a table file/directory of ``kind``'s records, and what
    it is."""
    marker = None
    if data is not None:
        table, source = load_named(data, kind), named(data)
        what, fields, marker = f"{data} ({source.repo})", {**dict(source.fields), **fields}, source.answer_after
    else:
        table, what = load_table(path), str(path)
    records = [(f"{what} row {i}", map_record(row, fields, f"{what} row {i}", kind)) for i, row in enumerate(table)]
    return [(where, final_answer(record, marker)) for where, record in records], what


def final_answer(record: Any, marker: Optional[str]) -> Any:
    """The record with its "answer" cut to the text after ``marker`` (GSM8K's worked solutions end "#### 72": the
    number, which exact_match compares); without a marker, or an answer that has none, the record as it is."""
    answer = record.get("answer") if isinstance(record, dict) else None
    if marker is None or not isinstance(answer, str) or marker not in answer:
        return record
    return {**record, "answer": answer.rsplit(marker, 1)[1].strip()}


def text_file(data: Optional[str], path: Optional[Path]) -> Path:
    """A named text dataset or a table as a JSON-lines file of ``{"text": ...}`` records in the cache, which
    pretraining tokenizes like any .jsonl; rebuilt when ``datasets``' fingerprint of the data changes."""
    table = load_named(data, "text") if data is not None else load_table(path)
    column = next((c for c in FIELDS["text"] if c in table.column_names), None)
    if column is None:
        raise UserError(f"{data or path} has columns {table.column_names} but no text column "
                        f"({', '.join(FIELDS['text'])}). Rename the text column to 'text'.")
    stem = data or path.stem or "data"
    # datasets' own fingerprint changes with the data (hub revision, or the local files)
    out = cache_root() / "datasets" / f"{stem}-{table._fingerprint[:16]}.jsonl"

    def build(write: Any) -> dict[str, int]:
        for text in table[column]:
            write((json.dumps({"text": text}, ensure_ascii=False) + "\n").encode())
        return {"records": len(table)}

    cached(out, build, valid=lambda record: isinstance(record.get("records"), int))
    return out
