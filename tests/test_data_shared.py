"""latentsweep.trainers.data.sets.load_train_shared: one read of a train file per process while its bytes stay the same;
a study run
reads its file once (its pre-flight check and its trials share the read)."""
from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest

import latentsweep.trainers.data.sets
from conftest import tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.sets import load_train_shared
from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture
def reads(monkeypatch, tmp_path) -> list[str]:
    """Every real read of a train file (latentsweep.trainers.data.sets.load_train) by path, from here on (an empty data
    cache: a file
    of the same bytes mapped by an earlier test is not read)."""
    seen, real = [], latentsweep.trainers.data.sets.load_train
    monkeypatch.setenv(latentsweep.trainers.data.sets.CACHE_ENV, str(tmp_path / "data-cache"))

    def counted(path, **kwargs):
        seen.append(str(path))
        return real(path, **kwargs)

    monkeypatch.setattr(latentsweep.trainers.data.sets, "load_train", counted)
    return seen


def test_the_same_bytes_are_read_once_and_new_bytes_again(tmp_path, reads):
    a, _, _ = write_synthetic(tmp_path / "a", 30, dim_text=8, dim_image=12, n_test=5)
    b, _, _ = write_synthetic(tmp_path / "b", 30, dim_text=8, dim_image=12, n_test=5, seed=1)
    first = load_train_shared(a)
    assert load_train_shared(a) is first and reads == [str(a)]
    shutil.copyfile(b, a)  # same path, other bytes
    second = load_train_shared(a)
    assert second is not first and reads == [str(a), str(a)]
    assert np.array_equal(second.text, latentsweep.trainers.data.sets.load_train(b).text)
    a.unlink()
    with pytest.raises(DataError):  # a file gone since is said as load_train says it, not served from memory
        load_train_shared(a)


def test_a_study_run_reads_its_train_file_once(tmp_path, reads):
    train, _, _ = write_synthetic(tmp_path / "syn", 60, dim_text=8, dim_image=12, n_test=10)
    sf = tiny_study_file(tmp_path, "readonce", n_trials=2)
    assert main(["study", "run", str(sf), "--data", str(train), "--state-dir", str(tmp_path / "state"),
                 "--quiet"]) == 0
    assert reads == [str(train)]


def _rss_file() -> int:
    """This process's resident bytes of mapped files (RssFile of /proc/self/status)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssFile"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_mapped_sets_pages_are_handed_back_and_read_again_unchanged(tmp_path, reads):
    """After a search every page of the mapped data is resident; `hand_back_pages` (a pick's first step) hands them
    back, and a later read gets the same values from the file."""
    path, _, _ = write_synthetic(tmp_path / "d", 2_000, dim_text=512, dim_image=768, n_test=0)
    load_train_shared(path)  # the parse, which writes the cache and maps it
    data = load_train_shared(path)
    assert isinstance(data.text, np.memmap)
    before = float(np.asarray(data.text).sum()) + float(np.asarray(data.image).sum())  # every page read
    resident = _rss_file()
    data.hand_back_pages()
    mapped = data.text.nbytes + data.image.nbytes  # 26 MB
    assert resident - _rss_file() > 0.8 * mapped
    assert float(np.asarray(data.text).sum()) + float(np.asarray(data.image).sum()) == before
