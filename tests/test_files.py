"""lit_model.core.files: an atomic write leaves the old content or the new one, and no temporary file behind."""

from __future__ import annotations

import errno
import os

import pytest

from lit_model.core.errors import UserError
from lit_model.core import files
from lit_model.core.files import atomic_open, atomic_write, umask


def test_atomic_write_replaces_text_and_bytes(tmp_path):
    target = tmp_path / "summary.json"
    atomic_write(target, "old\n")
    atomic_write(target, "new\n")
    assert target.read_text() == "new\n"
    atomic_write(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_failure_mid_write_keeps_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "metrics.csv"
    target.write_text("step\n1\n")
    with pytest.raises(RuntimeError):
        with atomic_open(target, "w") as handle:
            handle.write("step\n")
            raise RuntimeError("killed")
    assert target.read_text() == "step\n1\n"
    assert os.listdir(tmp_path) == ["metrics.csv"]


def test_atomic_open_refuses_append(tmp_path):
    with pytest.raises(ValueError):
        with atomic_open(tmp_path / "x", "a"):
            pass


def test_a_full_disk_is_a_message_naming_the_file_and_the_fix(tmp_path):
    target = tmp_path / "summary.json"
    target.write_text("{}\n")
    with pytest.raises(UserError, match=r"disk holding .*summary.json is full \(\d+\.\d GB free.*--out_dir") as raised:
        with atomic_open(target, "w") as handle:
            handle.write("{")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert raised.value.exit_code == 1 and raised.value.__cause__ is None
    assert target.read_text() == "{}\n" and os.listdir(tmp_path) == ["summary.json"]


def test_a_left_aside_directory_is_restored_only_when_its_mover_is_gone(tmp_path, monkeypatch, capsys):
    """``.NAME.old-PID`` beside a missing NAME: restored when PID is this process (a container restart reuses
    numbers; this process is not replacing NAME) or a process that started after the rename, never while the
    process that moved it may still rename the new directory in."""
    final = tmp_path / "ck"
    old = tmp_path / f".ck.old-{os.getppid()}"
    old.mkdir()
    files.restore_replaced(final)  # the parent process is alive and older than the rename: it may be mid-replace
    assert old.is_dir() and not final.exists()
    monkeypatch.setattr(files, "_started_at", lambda pid: old.lstat().st_ctime + 60)  # the number reused since
    files.restore_replaced(final)
    assert final.is_dir() and not old.exists()
    assert f"Note: {final} was missing" in capsys.readouterr().err
    os.replace(final, tmp_path / f".ck.old-{os.getpid()}")
    files.restore_replaced(final)
    assert final.is_dir() and list(tmp_path.iterdir()) == [final]


def test_umask_is_read_without_changing_it():
    previous = os.umask(0o027)
    try:
        assert umask() == 0o027 and os.umask(0o027) == 0o027
    finally:
        os.umask(previous)
