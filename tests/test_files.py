"""megagate.files: atomic writes leave the old file or the new one, never half of one; folders checked up front."""

from __future__ import annotations

import os

import pytest

from megagate.errors import MegagateError
from megagate.files import atomic_dir, atomic_path, check_writable_dir, write_atomic


def test_write_atomic_replaces_whole_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "sub" / "a.txt"
    write_atomic(target, "old\n")
    write_atomic(target, b"new\n")
    assert target.read_bytes() == b"new\n"
    assert oct(target.stat().st_mode & 0o777) == oct(0o644)
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.txt"]


def test_atomic_path_keeps_the_old_file_when_the_writer_fails(tmp_path):
    target = tmp_path / "plot.png"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]
    with atomic_path(target, mode=0o755) as tmp:
        tmp.write_text("new")
    assert target.read_text() == "new" and os.access(target, os.X_OK)


def test_atomic_dir_publishes_or_removes(tmp_path):
    out = tmp_path / "export"
    out.mkdir()
    (out / "stale.json").write_text("{}")
    with pytest.raises(ValueError), atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
        raise ValueError("bad tensor")
    assert sorted(p.name for p in out.iterdir()) == ["stale.json"]  # untouched
    with atomic_dir(out) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_check_writable_dir_names_the_setting(tmp_path):
    check_writable_dir(tmp_path / "new" / "deeper", "output.dir")  # creatable: fine, nothing created
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(MegagateError, match=r"^output.dir '.*file' is a file, not a folder$"):
        check_writable_dir(tmp_path / "file", "output.dir")
    with pytest.raises(MegagateError, match=r"^--out '.*file/sub' is under '.*file', which is a file, not a folder$"):
        check_writable_dir(tmp_path / "file" / "sub", "--out")
