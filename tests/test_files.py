"""jaxspec.files: a failed write leaves the old output and no temporary file; errors are one line.
(Directory outputs are covered through convert in test_convert.py.)"""
import os
import stat

import pytest

from jaxspec import files
from jaxspec.errors import JaxspecError


def test_write_text_replaces_and_creates_parents(tmp_path):
    path = tmp_path / "a" / "b.json"
    files.write_text(path, "one")
    files.write_text(path, "two")
    assert path.read_text() == "two" and os.listdir(path.parent) == ["b.json"]


def test_failed_write_keeps_the_old_file(tmp_path):
    path = tmp_path / "table.json"
    path.write_text("old")

    def half(tmp):
        tmp.write_text("half of it")
        raise OSError(28, "No space left on device")

    with pytest.raises(JaxspecError, match=f"cannot write {path}: .*No space left"):
        files.write_file(path, half)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["table.json"]


def test_interrupt_leaves_no_temporary(tmp_path):
    def interrupted(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        files.write_file(tmp_path / "x", interrupted)
    assert os.listdir(tmp_path) == []


def test_usual_permissions(tmp_path):
    """A writer that makes its file private (as safetensors does) still yields umask permissions."""
    umask = os.umask(0o022)
    try:
        files.write_file(tmp_path / "gates", lambda tmp: (tmp.write_bytes(b"x"), os.chmod(tmp, 0o600)))
    finally:
        os.umask(umask)
    assert stat.S_IMODE((tmp_path / "gates").stat().st_mode) == 0o644


def test_unwritable_destination(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(JaxspecError, match="cannot write"):
        files.write_text(tmp_path / "file" / "below", "x")
