"""latentsweep.trainers.core.io.atomic_write and atomic_path: all or nothing, and the permissions a plain `open` would
give."""
from __future__ import annotations

import os
import stat

import pytest

from latentsweep.trainers.core.io import atomic_path, atomic_write


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.csv"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as fh:
            fh.write("half")
            raise RuntimeError("disk full")
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.csv"]


def test_new_files_get_the_umask_mode_and_existing_ones_keep_theirs(tmp_path):
    previous = os.umask(0o027)
    try:
        with atomic_write(tmp_path / "new.txt") as fh:
            fh.write("x")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.txt").stat().st_mode) == 0o640  # 0o666 & ~0o027, not mkstemp's 0o600
    kept = tmp_path / "kept.bin"
    kept.write_bytes(b"a")
    kept.chmod(0o604)
    with atomic_write(kept, "wb") as fh:
        fh.write(b"b")
    assert kept.read_bytes() == b"b" and stat.S_IMODE(kept.stat().st_mode) == 0o604


def test_missing_directory_is_an_error_unless_parents(tmp_path):
    with pytest.raises(FileNotFoundError):
        with atomic_write(tmp_path / "no" / "f.txt", parents=False) as fh:
            fh.write("x")
    with atomic_write(tmp_path / "yes" / "f.txt") as fh:
        fh.write("x")
    assert (tmp_path / "yes" / "f.txt").read_text() == "x"


def test_atomic_path_publishes_what_a_path_writer_wrote_only_when_its_check_passes(tmp_path):
    target, names = tmp_path / "submission.csv", lambda: sorted(p.name for p in tmp_path.iterdir())
    target.write_text("old\n")
    staged_seen = []
    with pytest.raises(ValueError):
        with atomic_path(target) as staged:
            staged.write_text("bad\n")
            staged_seen.append((staged.parent, target.read_text()))  # beside it; nothing in place yet
            raise ValueError("the check of the staged file failed")
    assert staged_seen == [(tmp_path, "old\n")] and target.read_text() == "old\n" and names() == ["submission.csv"]
    with atomic_path(target) as staged:
        staged.write_text("new\n")
    assert target.read_text() == "new\n" and names() == ["submission.csv"]


def test_a_failed_rename_names_the_users_path_not_the_temporary(tmp_path):
    target = tmp_path / "taken"
    target.mkdir()  # a directory where the file should go: os.replace fails
    with pytest.raises(OSError) as caught:
        with atomic_write(target) as fh:
            fh.write("x")
    assert caught.value.filename == str(target) and [p.name for p in tmp_path.iterdir()] == ["taken"]
