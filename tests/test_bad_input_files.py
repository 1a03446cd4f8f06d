"""Bad checkpoint, adapter and conversion files, and output directories that would lose an input: merge, convert
and generate give one paragraph, exit status 2 (usage) or 1 (runtime), no traceback, and nothing is written or
deleted anywhere (the whole directory tree the case starts from is compared before and after).

Each case starts from the same tree in an empty working directory: ``P/ck`` (the tiny base checkpoint with an
unmerged LoRA adapter beside it and the adapter's manifest), ``P/base`` (the base alone), ``P/hf`` (the base
exported to Hugging Face's layout), ``P/notes.txt``, ``run/final`` (a run's final checkpoint), its
``run/checkpoints/step-2`` and ``metrics.csv``, and a regular file ``FILE``. A case changes some of it, then runs
the real command line. The planted-kill, file-mode and read-only cases follow the table.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, run_captured, run_script_inprocess
from test_bad_input import BASE, CONVERT, MERGE, tree
from test_faults import flip_byte

from lit_model import GPT, Config
from lit_model.entry import main as lit_model_main
from lit_model.io.checkpoint import MANIFEST_NAME, WEIGHTS_NAME, check_checkpoint_dir, write_manifest
from lit_model.io.convert import lit_to_hf
from lit_model.methods.lora import LORA_CONFIG, LORA_MANIFEST, LORA_WEIGHTS, LoRAConfig, apply_lora, save_adapter

LIT = "lit-model"  # the installed command's entry point, run in this process
LORA = LoRAConfig(r=2, alpha=4.0)
GENERATE = ["--prompt", "def f():", "--max_new_tokens", "2"]


@pytest.fixture(scope="module")
def start(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tree every case starts from (see the module's docstring), built once."""
    root = tmp_path_factory.mktemp("start")
    shutil.copytree(tiny_checkpoint, root / "P" / "base")
    shutil.copytree(tiny_checkpoint, root / "P" / "ck")
    model = GPT(Config.from_checkpoint(tiny_checkpoint))
    apply_lora(model, LORA)
    torch.manual_seed(0)
    weights = {n: torch.randn(p.shape) * 0.1 for n, p in model.named_parameters() if p.requires_grad}
    save_adapter(root / "P" / "ck", weights, LORA)
    lit_to_hf(str(tiny_checkpoint), str(root / "P" / "hf"))
    (root / "P" / "notes.txt").write_text("years of work\n")
    shutil.copytree(tiny_checkpoint, root / "run" / "final")
    (root / "run" / "checkpoints" / "step-2").mkdir(parents=True)
    (root / "run" / "checkpoints" / "step-2" / "state.pt").write_text("state")
    (root / "run" / "metrics.csv").write_text("step,train_loss\n2,4.5\n")
    (root / "FILE").write_text("not a directory\n")
    return root


# ---- changes a case makes to the starting tree -------------------------------------------------------------------
def adapter(change: Callable[[dict[str, torch.Tensor]], None], manifest: bool = False) -> Callable[[Path], None]:
    """Rewrite P/ck's lora.safetensors with ``change`` applied, and its manifest to match (``manifest``: the
    adapter was saved so, by a tool or a person) or without one (assembled by hand)."""
    def apply(root: Path) -> None:
        ck = root / "P" / "ck"
        weights = load_file(str(ck / LORA_WEIGHTS))
        change(weights)
        save_file(weights, str(ck / LORA_WEIGHTS))
        (ck / LORA_MANIFEST).unlink()
        if manifest:
            write_manifest(ck, [ck / LORA_WEIGHTS], name=LORA_MANIFEST, lora=LORA.hyperparameters())
    return apply


def write(relative: str, data: bytes | str, keep_manifest: bool = True) -> Callable[[Path], None]:
    """Replace a file of the tree; without ``keep_manifest`` the adapter's manifest goes (a hand-made adapter)."""
    def apply(root: Path) -> None:
        path = root / relative
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        if not keep_manifest:
            (root / "P" / "ck" / LORA_MANIFEST).unlink()
    return apply


def yaml_text(text: str) -> Callable[[Path], None]:
    """lora.yaml replaced by hand (so without the adapter's manifest, which would name the change first)."""
    return write(f"P/ck/{LORA_CONFIG}", text, keep_manifest=False)


def damage(relative: str) -> Callable[[Path], None]:
    return lambda root: flip_byte(root / relative)


def raw_safetensors(header: dict, data: bytes, length: Optional[int] = None) -> bytes:
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded) if length is None else length) + encoded + data


def crafted_weights(edit: Callable[[dict, bytearray], Optional[int]], directory: str = "P/base") -> Callable[[Path], None]:
    """``directory``'s model.safetensors with its header edited by ``edit(header, data)`` (which may return a header
    length to claim), and a manifest that matches: a file made to pass the checksums."""
    def apply(root: Path) -> None:
        path = root / directory / WEIGHTS_NAME
        blob = path.read_bytes()
        (length,) = struct.unpack("<Q", blob[:8])
        header, data = json.loads(blob[8 : 8 + length]), bytearray(blob[8 + length :])
        claimed = edit(header, data)
        path.write_bytes(raw_safetensors(header, bytes(data), claimed))
        write_manifest(root / directory)
    return apply


def first_two(header: dict) -> tuple[str, str]:
    names = sorted((n for n in header if n != "__metadata__"), key=lambda n: header[n]["data_offsets"])
    return names[0], names[1]


def overlap(header: dict, data: bytearray) -> None:
    first, second = first_two(header)
    begin, end = header[second]["data_offsets"]
    start = header[first]["data_offsets"][0] + 4  # tensor 2 starts 4 bytes into tensor 1
    header[second]["data_offsets"] = [start, start + end - begin]


def into_header(header: dict, data: bytearray) -> None:
    first, _ = first_two(header)
    begin, end = header[first]["data_offsets"]
    header[first]["data_offsets"] = [begin - 64, end - 64]  # 64 bytes before the data: the JSON header


def set_entry(key: str, value: object) -> Callable[[dict, bytearray], None]:
    """The embedding's (512 x 64 F32) entry changed."""
    def edit(header: dict, data: bytearray) -> None:
        header["embed.weight"][key] = value
    return edit


def huge_length(header: dict, data: bytearray) -> int:
    return 2**63 - 1


def trailing_bytes(header: dict, data: bytearray) -> None:
    data.extend(b"\x00" * 16)


def int_hf_weights(root: Path) -> None:
    """P/hf's weights with the embedding stored as int32 (a converter must refuse, not convert)."""
    path = root / "P" / "hf" / "model.safetensors"
    tensors = load_file(str(path))
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].to(torch.int32)
    save_file(tensors, str(path), metadata={"format": "pt"})


def int_lit_weights(root: Path) -> None:
    """run/final's weights with one matrix stored as int32, no manifest (made by hand)."""
    path = root / "run" / "final" / WEIGHTS_NAME
    tensors = load_file(str(path))
    tensors["embed.weight"] = tensors["embed.weight"].to(torch.int32)
    save_file(tensors, str(path))
    (root / "run" / "final" / MANIFEST_NAME).unlink()


def nothing(root: Path) -> None:
    pass


def then(*changes: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        for change in changes:
            change(root)
    return apply


def a_lora_a(weights: dict[str, torch.Tensor]) -> str:
    return sorted(n for n in weights if n.endswith(".lora_A"))[0]


def rank_4(weights: dict[str, torch.Tensor]) -> None:
    name = a_lora_a(weights)
    weights[name] = torch.randn(4, weights[name].shape[1])  # r = 4 where lora.yaml and lora_B say 2


def embed_3x3(weights: dict[str, torch.Tensor]) -> None:
    weights["embed.weight"] = torch.randn(3, 3)


def all_nan(weights: dict[str, torch.Tensor]) -> None:
    for name in weights:
        weights[name] = torch.full_like(weights[name], float("nan"))


def one_inf(weights: dict[str, torch.Tensor]) -> None:
    weights[a_lora_a(weights)][0, 0] = float("inf")


def drop_b(weights: dict[str, torch.Tensor]) -> None:
    del weights[a_lora_a(weights).replace(".lora_A", ".lora_B")]


def int_a(weights: dict[str, torch.Tensor]) -> None:
    name = a_lora_a(weights)
    weights[name] = weights[name].to(torch.int32)


def huge_b(weights: dict[str, torch.Tensor]) -> None:
    name = a_lora_a(weights)
    weights[name] = torch.full_like(weights[name], 3e38)
    weights[name.replace(".lora_A", ".lora_B")] = torch.full_like(weights[name.replace(".lora_A", ".lora_B")], 3e38)


MERGE_CK = ["merge", "--checkpoint_dir", "P/ck"]
TO_HF = ["lit_to_hf", "--checkpoint_dir", "run/final"]
TO_LIT = ["hf_to_lit", "--hf_dir", "P/hf"]
PYTHON_TAG = "r: !!python/object/apply:os.system ['touch PWNED']\nalpha: 4.0\n"

# (script, argv, change, exit status, fragment of the message)
CASES = [
    # an output directory that holds the input or lies inside it: refused, with --overwrite or without
    (MERGE, [*MERGE_CK, "--out_dir", "P", "--overwrite"], nothing, 2, "--out_dir P holds the input"),
    (LIT, [*MERGE_CK, "--out_dir", "P", "--overwrite"], nothing, 2, "would delete that input"),
    (MERGE, [*MERGE_CK, "--out_dir", ".", "--overwrite"], nothing, 2, "--out_dir . holds the input"),
    (MERGE, [*MERGE_CK, "--out_dir", "P/ck/merged"], nothing, 2, "--out_dir P/ck/merged lies inside the input"),
    (MERGE, [*MERGE_CK, "--out_dir", "P/ck/merged", "--overwrite"], nothing, 2, "lies inside the input"),
    (CONVERT, [*TO_HF, "--out_dir", "run", "--overwrite"], nothing, 2, "--out_dir run holds the input"),
    (LIT, ["convert", *TO_HF, "--out_dir", "run", "--overwrite"], nothing, 2, "--out_dir run holds the input"),
    (CONVERT, [*TO_HF, "--out_dir", "run/final/hf"], nothing, 2, "--out_dir run/final/hf lies inside the input"),
    (CONVERT, [*TO_LIT, "--out_dir", "P", "--overwrite"], nothing, 2, "--out_dir P holds the input"),
    (CONVERT, [*TO_LIT, "--out_dir", "P/hf/lit"], nothing, 2, "--out_dir P/hf/lit lies inside the input"),
    (CONVERT, [*TO_HF, "--out_dir", "run/final", "--overwrite"], nothing, 2, "is the input directory"),
    # an output directory that cannot be written (fails for root too): before any weight is read
    (MERGE, [*MERGE_CK, "--out_dir", "FILE/merged"], nothing, 2, "FILE is a file, so no directory can be made under it"),
    (MERGE, [*MERGE_CK, "--out_dir", "FILE", "--overwrite"], nothing, 2, "--out_dir FILE is a file, not a directory"),
    (MERGE, [*MERGE_CK, "--out_dir", "/proc/1/merged"], nothing, 2, "/proc/1 is not writable by this user"),
    (CONVERT, [*TO_HF, "--out_dir", "FILE/hf"], nothing, 2, "FILE is a file, so no directory can be made under it"),
    (CONVERT, [*TO_HF, "--out_dir", "/proc/1/hf"], nothing, 2, "/proc/1 is not writable by this user"),
    (CONVERT, [*TO_LIT, "--out_dir", "FILE/lit"], nothing, 2, "FILE is a file, so no directory can be made under it"),
    (CONVERT, [*TO_LIT, "--out_dir", "/proc/1/lit"], nothing, 2, "/proc/1 is not writable by this user"),
    (CONVERT, [*TO_LIT, "--out_dir", "FILE", "--overwrite"], nothing, 2, "--out_dir FILE is a file, not a directory"),
    (MERGE, [*MERGE_CK, "--out_dir", "run"], nothing, 1, "run already exists and is not empty"),
    # adapters that do not fit the base: named, nothing written
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(embed_3x3), 1, "no place for e.g. 'embed.weight'"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(embed_3x3, manifest=True), 1, "no place for e.g. 'embed.weight'"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(rank_4), 1, "has shape (4, 64), where this model and lora.yaml need (2, 64)"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(drop_b), 1, "missing e.g."),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(int_a), 1, "holds torch.int32 values, not floating point"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(all_nan), 1, "holds NaN or infinite values"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(all_nan, manifest=True), 1, "holds NaN or infinite values"),
    (MERGE, [*MERGE_CK], adapter(one_inf), 1, "holds NaN or infinite values"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], adapter(huge_b), 1, "gives NaN or infinite values"),
    (BASE, ["--checkpoint_dir", "P/ck", *GENERATE], adapter(all_nan), 1, "holds NaN or infinite values"),
    (BASE, ["--checkpoint_dir", "P/ck", *GENERATE], adapter(rank_4), 1, "need (2, 64)"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 4\nalpha: 4.0\n"), 1, "has shape (2, 64), where this model and lora.yaml need (4, 64)"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_CONFIG}", "r: 4\nalpha: 4.0\n"), 1,
     "holds other hyperparameters than the adapter was trained with"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_CONFIG}", "r: 2\nalpha: 8.0\n"), 1,
     "holds other hyperparameters than the adapter was trained with"),
    # damaged or empty adapter files: the adapter's manifest names them, or the reader does
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], damage(f"P/ck/{LORA_WEIGHTS}"), 1, "lora.safetensors is damaged: its SHA-256 differs"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_WEIGHTS}", b""), 1, "is damaged: 0 bytes where"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_WEIGHTS}", b"", keep_manifest=False), 1,
     "Could not read P/ck/lora.safetensors"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_WEIGHTS}", b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage", keep_manifest=False),
     1, "Could not read P/ck/lora.safetensors"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_MANIFEST}", "{not json"), 1, "lora.manifest.json is damaged"),
    (BASE, ["--checkpoint_dir", "P/ck", *GENERATE], damage(f"P/ck/{LORA_WEIGHTS}"), 1, "its SHA-256 differs"),
    # lora.yaml that is not a mapping of the hyperparameters
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: [2\n"), 1, "lora.yaml is not a valid UTF-8 YAML file"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("- r\n- alpha\n"), 1, "lora.yaml holds a list, not the LoRA hyperparameters"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], write(f"P/ck/{LORA_CONFIG}", b"r: 2\nalpha: \xff\xfe\n", keep_manifest=False), 1,
     "lora.yaml is not a valid UTF-8 YAML file"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text(PYTHON_TAG), 1, "could not determine a constructor for the tag"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text(""), 1, "lora.yaml holds nothing, not the LoRA hyperparameters"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("just text\n"), 1, "lora.yaml holds a str"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: two\nalpha: 4.0\n"), 1, "r: 'two' is not an integer"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 2.5\nalpha: 4.0\n"), 1, "r: 2.5 is not an integer"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 2\nalpha: .nan\n"), 1, "alpha: nan is not a number"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 2\nalpha: '4'\n"), 1, "alpha: '4' is not a number"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 2\nalpha: 4.0\nquery: maybe\n"), 1, "query: 'maybe' is not true or false"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 0\nalpha: 4.0\n"), 1, "the LoRA rank must be a positive integer"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 2\nalpha: 4.0\ndropout: 1.5\n"), 1, "must be in [0, 1)"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], yaml_text("r: 2\nalpha: 4.0\nmerged: true\n"), 1, "says its weights are already merged"),
    (BASE, ["--checkpoint_dir", "P/ck", *GENERATE], yaml_text(PYTHON_TAG), 1, "lora.yaml is not a valid UTF-8 YAML file"),
    # lit-model's own safetensors reader: the header is checked as strictly as the safetensors library does
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(overlap), 1, "overlapping it"),
    (MERGE, [*MERGE_CK, "--out_dir", "OUT"], crafted_weights(overlap, "P/ck"), 1, "overlapping it"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(into_header), 1, "not [begin, end] inside the"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(huge_length), 1, "its header claims 9223372036854775807 bytes"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("data_offsets", ["0", "16"])), 1,
     "has the data_offsets ['0', '16']"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("data_offsets", [0, 8, 16])), 1,
     "has the data_offsets [0, 8, 16]"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("shape", [-512, -64])), 1,
     "has the shape [-512, -64], not a list of sizes"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("shape", ["512", 64])), 1,
     "has the shape ['512', 64], not a list of sizes"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("shape", "big")), 1, "has the shape 'big'"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("shape", [64, 512])), 1,
     "has shape (64, 512) but the model config expects (512, 64)"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("shape", [512, 32])), 1,
     "spans 131072 bytes, its shape [512, 32] of F32 65536"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("dtype", "F4")), 1, "has the dtype 'F4', not one of"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("dtype", 32)), 1, "has the dtype 32"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(set_entry("dtype", "I32")), 1, "holds torch.int32 values"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE], crafted_weights(trailing_bytes), 1, "its tensors end at byte"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE],
     then(write(f"P/base/{WEIGHTS_NAME}", raw_safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                                           "__metadata__": "x"}, b"\x00" * 4)),
          lambda root: write_manifest(root / "P" / "base")), 1, "its header is not a JSON object of tensors"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE],
     then(write(f"P/base/{WEIGHTS_NAME}", struct.pack("<Q", 6) + b"[[[[[[" + b"\x00" * 8),
          lambda root: write_manifest(root / "P" / "base")), 1, "its header is not JSON"),
    (BASE, ["--checkpoint_dir", "P/base", *GENERATE],
     then(write(f"P/base/{WEIGHTS_NAME}", b"\x01\x02"), lambda root: write_manifest(root / "P" / "base")), 1,
     "2 bytes, fewer than the 8 of a header's length"),
    # integer weights: refused by both converters, naming the tensor
    (CONVERT, [*TO_LIT, "--out_dir", "OUT"], int_hf_weights, 1, "tensor 'model.embed_tokens.weight' holds torch.int32 values"),
    (LIT, ["convert", *TO_LIT, "--out_dir", "OUT"], int_hf_weights, 1, "holds torch.int32 values"),
    (CONVERT, [*TO_HF, "--out_dir", "OUT"], int_lit_weights, 1, "tensor 'embed.weight' holds torch.int32 values"),
]


def case_id(case: tuple) -> str:
    script, argv, _, _, fragment = case
    return f"{Path(script).stem}-{' '.join(argv)[:40]}-{fragment[:40]}"


@pytest.mark.parametrize("script, argv, change, code, fragment", CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_file(start, tmp_path, monkeypatch, script, argv, change, code, fragment):
    shutil.copytree(start, tmp_path, dirs_exist_ok=True)
    monkeypatch.chdir(tmp_path)
    change(tmp_path)
    before = tree(tmp_path)
    if script == LIT:
        proc = run_captured(lambda: lit_model_main(argv), [LIT, *argv])
    else:
        proc = run_script_inprocess(script, *argv, monkeypatch=monkeypatch)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == code, proc.stderr
    message = proc.stderr.split("error: ", 1)[-1]
    assert "\n\n" not in message.strip() and message.strip().endswith("."), proc.stderr  # one paragraph
    assert fragment in " ".join(message.split()), proc.stderr
    assert tree(tmp_path) == before  # nothing written, nothing deleted, no temporary directory left


# ---- a kill between the two renames of a directory's replacement ------------------------------------------------
def dead_pid() -> int:
    """The number of a process that has ended."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def plant_killed_replace(directory: Path, pid: int) -> Path:
    """What a kill -9 between the renames leaves: the directory moved to ``.NAME.old-PID`` and a half-written
    ``.NAME.tmp-PID`` beside it, no ``NAME``."""
    old = directory.with_name(f".{directory.name}.old-{pid}")
    os.replace(directory, old)
    half = directory.with_name(f".{directory.name}.tmp-{pid}")
    half.mkdir()
    (half / WEIGHTS_NAME).write_bytes(b"\x00" * 10)
    return old


@pytest.mark.parametrize("command", ["merge", "generate"])
def test_a_checkpoint_left_aside_by_a_killed_replacement_is_restored(start, tmp_path, monkeypatch, command):
    shutil.copytree(start / "P", tmp_path / "P")
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "P" / ("ck" if command == "merge" else "base")
    old = plant_killed_replace(target, dead_pid())
    if command == "merge":
        proc = run_script_inprocess(MERGE, *MERGE_CK, monkeypatch=monkeypatch)
    else:
        proc = run_script_inprocess(BASE, "--checkpoint_dir", "P/base", *GENERATE, monkeypatch=monkeypatch)
    assert proc.returncode == 0, proc.stderr
    assert f"Note: P/{target.name} was missing" in proc.stderr and f"Restored that content to P/{target.name}" in \
        " ".join(proc.stderr.split())
    assert not old.exists() and (target / WEIGHTS_NAME).is_file()
    if command == "merge":
        assert LoRAConfig.from_dir(target).merged


def test_a_replacement_still_in_progress_is_left_alone(start, tmp_path, monkeypatch):
    """``.NAME.old-PID`` of a process that is alive (and started before the rename): it may be about to rename the
    new directory in; nothing is restored."""
    shutil.copytree(start / "P", tmp_path / "P")
    monkeypatch.chdir(tmp_path)
    old = plant_killed_replace(tmp_path / "P" / "ck", os.getppid())
    proc = run_script_inprocess(MERGE, *MERGE_CK, monkeypatch=monkeypatch)
    assert proc.returncode == 1 and "does not exist" in proc.stderr and old.is_dir(), proc.stderr


KILLED_REPLACE = """
import os, shutil, signal, sys
from pathlib import Path
import lit_model.core.files as files
new, final = Path(sys.argv[1]), Path(sys.argv[2])
if sys.argv[3] == "fallback":  # a system without renameat2: the second rename never happens
    files._exchange = lambda first, second: False
    replace = os.replace
    calls = []
    def killed_on_second(*args):
        calls.append(args)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        replace(*args)
    files.os.replace = killed_on_second
else:  # killed right after the swap, before the old content is removed
    files.shutil.rmtree = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
files.replace_directory(new, final)
"""


@pytest.mark.parametrize("how", ["exchange", "fallback"])
def test_a_kill_during_a_replacement_never_loses_the_directory(start, tmp_path, how):
    final, new = tmp_path / "ck", tmp_path / ".ck.tmp-1"
    shutil.copytree(start / "P" / "base", final)
    shutil.copytree(start / "P" / "ck", new)
    proc = subprocess.run([sys.executable, "-c", KILLED_REPLACE, str(new), str(final), how],
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if how == "exchange":  # swapped in one step: the new content is there
        assert (final / LORA_WEIGHTS).is_file()
    else:  # the old content is restored by the next reader
        assert not final.exists()
        check_checkpoint_dir(final)
        assert final.is_dir() and not (final / LORA_WEIGHTS).is_file()
        assert not list(tmp_path.glob(".ck.old-*"))


# ---- file modes --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o022, 0o002], ids=["umask-022", "umask-002"])
def test_written_checkpoints_follow_the_umask(start, tmp_path, monkeypatch, mask):
    shutil.copytree(start / "P", tmp_path / "P")
    monkeypatch.chdir(tmp_path)
    previous = os.umask(mask)
    try:
        for script, argv in ((MERGE, [*MERGE_CK, "--out_dir", "merged"]),
                             (CONVERT, ["lit_to_hf", "--checkpoint_dir", "merged", "--out_dir", "hf"]),
                             (CONVERT, ["hf_to_lit", "--hf_dir", "hf", "--out_dir", "lit"])):
            proc = run_script_inprocess(script, *argv, monkeypatch=monkeypatch)
            assert proc.returncode == 0, proc.stderr
    finally:
        os.umask(previous)
    for out in ("merged", "hf", "lit"):
        for path in (tmp_path / out, *(tmp_path / out).rglob("*")):
            expected = (0o777 if path.is_dir() else 0o666) & ~mask
            assert path.stat().st_mode & 0o777 == expected, (path, oct(path.stat().st_mode & 0o777))


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_a_read_only_out_dir_is_one_paragraph_before_any_work(start, tmp_path, monkeypatch):
    shutil.copytree(start / "P", tmp_path / "P")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro").chmod(0o555)
    try:
        for script, argv in ((MERGE, [*MERGE_CK, "--out_dir", "ro/merged"]),
                             (CONVERT, ["lit_to_hf", "--checkpoint_dir", "P/base", "--out_dir", "ro/hf"])):
            proc = run_script_inprocess(script, *argv, monkeypatch=monkeypatch)
            assert proc.returncode == 2 and "ro is not writable by this user" in proc.stderr, proc.stderr
            assert list((tmp_path / "ro").iterdir()) == []
    finally:
        (tmp_path / "ro").chmod(0o755)
