"""Checkpoint directories: one copy of the weights in memory when loading, atomic writes, clear errors."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from lit_model import GPT, Config
from lit_model.io.checkpoint import (
    MANIFEST_NAME, WEIGHTS_NAME, SafetensorsReader, atomic_directory, check_checkpoint_dir, lit_state_dict,
    save_checkpoint_dir,
)
from lit_model.core.errors import UserError
from lit_model.methods.load import load_gpt

BIG = Config(name="load-test", block_size=256, vocab_size=8192, n_layer=6, n_embd=768, n_head=12, intermediate_size=2048)

LOAD_AND_MEASURE = """
import sys, torch
from lit_model import GPT
from lit_model.methods.load import load_gpt
import lit_model.io.checkpoint, numpy, safetensors.torch  # imported before measuring
from lit_model import Config
def rss(): return int(open('/proc/self/statm').read().split()[1]) * 4096
with torch.device("meta"):  # the first model built on meta initialises ~80 MB of torch state, once
    GPT(Config(name="warm-up", n_layer=1, n_embd=8, n_head=1, vocab_size=8, block_size=8))
before = rss()
model = load_gpt(sys.argv[1], dtype=torch.float32 if sys.argv[2] == 'fp32' else torch.bfloat16)
weights = sum(p.numel() * p.element_size() for p in model.parameters())
from lit_model.core.units import peak_rss_bytes
peak = peak_rss_bytes()
print(before, peak, weights)
"""


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_loading_holds_one_copy_of_the_weights(tmp_path, dtype):
    torch.manual_seed(0)
    model = GPT(BIG)
    model.init_weights()
    save_checkpoint_dir(lit_state_dict(model, BIG), BIG, tmp_path / "ckpt")
    del model
    proc = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(tmp_path / "ckpt"), dtype],
                          capture_output=True, text=True, check=True)
    before, peak, weights = map(int, proc.stdout.split())
    # The file holds fp32; a bf16 load casts through one small reused buffer, so it never holds the fp32 model
    # (nor, with a fp32 copy of each tensor freed after its cast, glibc's holes between them)
    assert peak - before < 1.1 * weights + SafetensorsReader.STAGING_BYTES, (peak - before, weights)


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32])
def test_a_cast_read_equals_the_stored_tensor_cast(tmp_path, monkeypatch, stored):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    tensors = {"a": torch.randn(37, 11).to(stored), "b": torch.randn(5).to(stored), "c": torch.randn(3, 40).to(stored),
               "ids": torch.arange(7), "empty": torch.zeros(3, 0).to(stored), "scalar": torch.tensor(2.5).to(stored)}
    save_file(tensors, str(tmp_path / "w.safetensors"))
    monkeypatch.setattr(SafetensorsReader, "STAGING_BYTES", 64)  # several chunks, the last one partial; c's rows are larger
    with SafetensorsReader(tmp_path / "w.safetensors") as file:
        for dtype in (stored, torch.float32, torch.bfloat16, torch.float16):
            for name in ("a", "b", "c"):
                for column_major in (False, True):
                    read = file.read(name, dtype, column_major)
                    assert read.dtype == dtype and torch.equal(read, tensors[name].to(dtype))
                    assert read.is_contiguous() is not (column_major and read.dim() == 2)  # a vector stays as it is
            for name in ("empty", "scalar"):
                assert torch.equal(file.read(name, dtype, True), tensors[name].to(dtype))
        assert torch.equal(file.read("ids", torch.float32), tensors["ids"])  # integers stay as stored
        assert file.read("a").dtype == stored


def test_round_trip_and_tied_weights(tmp_path):
    config = Config(name="tied", block_size=32, vocab_size=64, n_layer=1, n_embd=16, n_head=2, tie_embeddings=True)
    model = GPT(config)
    model.init_weights()
    save_checkpoint_dir(lit_state_dict(model, config), config, tmp_path / "ckpt")
    loaded = load_gpt(tmp_path / "ckpt")
    assert loaded.lm_head.weight is loaded.embed.weight
    idx = torch.randint(0, 64, (1, 8))
    torch.testing.assert_close(loaded(idx), model.eval()(idx))


def test_missing_files_and_shape_mismatch_are_clear(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_gpt(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="missing model.safetensors"):
        load_gpt(tmp_path / "empty")
    config = Config(name="a", block_size=32, vocab_size=64, n_layer=1, n_embd=16, n_head=2)
    save_checkpoint_dir(lit_state_dict(GPT(config), config), config, tmp_path / "ckpt")
    config.n_embd = 32
    config.head_size = 16
    config.intermediate_size = 128
    config.save(tmp_path / "ckpt")
    (tmp_path / "ckpt" / MANIFEST_NAME).unlink()  # edited by hand: the manifest no longer describes it
    with pytest.raises(UserError, match=r"has shape \(.*\) but the model config expects"):
        load_gpt(tmp_path / "ckpt")


def test_atomic_directory_keeps_the_old_one_when_writing_fails(tmp_path):
    target = tmp_path / "final"
    with atomic_directory(target) as tmp:
        (tmp / "good").write_text("1")
    with pytest.raises(RuntimeError):
        with atomic_directory(target, overwrite=True) as tmp:
            (tmp / "half").write_text("written")
            raise RuntimeError("crash mid-save")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert sorted(p.name for p in target.iterdir()) == ["good", MANIFEST_NAME]


def test_a_full_disk_while_saving_weights_keeps_the_old_checkpoint_and_says_so(tmp_path, monkeypatch):
    """safetensors' writer reports a full disk as its own error type (seen on a GPU machine whose 64 GB disk filled
    up at a Llama-2-7B LoRA run's final save): it must end as a message, not a traceback, with nothing half-written."""
    from safetensors import SafetensorError

    config = Config(name="tiny", block_size=16, vocab_size=32, n_layer=1, n_embd=8, n_head=2)
    state = lit_state_dict(GPT(config), config)
    save_checkpoint_dir(state, config, tmp_path / "final")
    before = sorted(p.name for p in (tmp_path / "final").iterdir())

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("lit_model.io.checkpoint.save_file", full)
    with pytest.raises(UserError, match="is full") as raised:
        save_checkpoint_dir(state, config, tmp_path / "final", overwrite=True)
    assert raised.value.__cause__ is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert sorted(p.name for p in (tmp_path / "final").iterdir()) == before


def test_a_non_empty_directory_is_replaced_only_with_overwrite(tmp_path):
    config = Config(name="a", block_size=32, vocab_size=64, n_layer=1, n_embd=16, n_head=2)
    state = lit_state_dict(GPT(config), config)
    (tmp_path / "empty").mkdir()
    save_checkpoint_dir(state, config, tmp_path / "empty")  # an empty directory holds nothing to lose
    users = tmp_path / "users"
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="--overwrite"):
        save_checkpoint_dir(state, config, users)
    with pytest.raises(UserError, match="--overwrite"):
        with atomic_directory(users) as tmp:
            (tmp / "x").write_text("never")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "users"]  # no temporary directory left
    assert [p.name for p in users.iterdir()] == ["notes.txt"] and (users / "notes.txt").read_text() == "mine"
    save_checkpoint_dir(state, config, users, overwrite=True)
    assert not (users / "notes.txt").exists() and (users / WEIGHTS_NAME).is_file()


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) // 2]
    elif how == "empty":
        data = bytearray()
    else:  # garble
        data = bytearray(b"n_layer: [unclosed\n\x00\xff")
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name,how", [(WEIGHTS_NAME, "flip"), (WEIGHTS_NAME, "truncate"), (WEIGHTS_NAME, "empty"),
                                      ("model_config.yaml", "garble"), ("model_config.yaml", "flip")])
def test_damaged_checkpoints_are_refused_with_the_file_named(tmp_path, name, how):
    config = Config(name="a", block_size=32, vocab_size=64, n_layer=1, n_embd=16, n_head=2)
    save_checkpoint_dir(lit_state_dict(GPT(config), config), config, tmp_path / "ckpt")
    load_gpt(tmp_path / "ckpt")
    _damage(tmp_path / "ckpt" / name, how)
    with pytest.raises(UserError, match=rf"{tmp_path / 'ckpt' / name} is damaged"):
        load_gpt(tmp_path / "ckpt")


def test_a_checkpoint_without_manifest_loads_with_a_note(tmp_path, capsys):
    config = Config(name="a", block_size=32, vocab_size=64, n_layer=1, n_embd=16, n_head=2)
    model = GPT(config)
    model.init_weights()
    save_checkpoint_dir(lit_state_dict(model, config), config, tmp_path / "ckpt")
    (tmp_path / "ckpt" / MANIFEST_NAME).unlink()  # as an older version or a hand-made conversion leaves it
    capsys.readouterr()
    loaded = load_gpt(tmp_path / "ckpt")
    check_checkpoint_dir(tmp_path / "ckpt")
    torch.testing.assert_close(loaded.embed.weight, model.embed.weight)
    assert capsys.readouterr().err.count(f"Note: {tmp_path / 'ckpt'} has no {MANIFEST_NAME}") == 1
