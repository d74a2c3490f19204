"""latentsweep runs on POSIX systems: where a lock needs fcntl and the platform has none, one error line says so."""
from __future__ import annotations

import pytest

from latentsweep.search.study import storage
from latentsweep.trainers.core.errors import LatentsweepError


def test_the_storage_lock_says_the_platform_without_fcntl(tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "fcntl", None)
    with pytest.raises(LatentsweepError, match="fcntl.*POSIX"):
        with storage.file_lock(tmp_path / "x.lock"):
            pass


def test_the_storage_lock_serialises_on_posix(tmp_path):
    with storage.file_lock(tmp_path / "x.lock"):
        assert (tmp_path / "x.lock").exists()
