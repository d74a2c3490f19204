"""The train set's mapping handed back after each read (trainers/core/pages.py seal and drop, called by Rows): the
process stops holding the pages it read, reads the same values again, and no other memory is ever dropped."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from latentsweep.trainers.core import pages
from latentsweep.trainers.data.rows import Rows

pytestmark = pytest.mark.skipif(pages._libc("madvise") is None, reason="madvise: Linux only")


def _resident_kb(array: np.ndarray) -> int:
    """Rss of the mapping holding `array`'s first byte, from /proc/self/smaps."""
    address, inside = array.__array_interface__["data"][0], False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, stop = (int(x, 16) for x in head.split("-"))
            inside = start <= address < stop
        elif inside and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError("no mapping holds the array")


@pytest.fixture
def mapped(tmp_path):
    values = np.random.default_rng(0).standard_normal((4096, 1024)).astype(np.float32)  # 16 MB, a 4 KB page a row
    np.save(tmp_path / "text.npy", values)
    array = np.load(tmp_path / "text.npy", mmap_mode="c")
    assert pages.seal(array)
    return values, array


def test_rows_read_from_a_sealed_mapping_leave_its_pages_with_the_page_cache(mapped):
    values, array = mapped
    base = torch.as_tensor(array)
    assert float(base.sum()) == pytest.approx(float(values.sum()), rel=1e-4)  # every page read
    assert _resident_kb(array) > 12_000
    rows = Rows(base, torch.arange(0, 4096, 3))
    got = rows[torch.tensor([5, 700, 1200])]
    np.testing.assert_array_equal(got.numpy(), values[[15, 2100, 3600]])
    assert _resident_kb(array) < 1_000  # dropped after the read: at most the header's page or a neighbour's
    np.testing.assert_array_equal(rows.materialize().numpy(), values[::3])
    assert _resident_kb(array) < 1_000
    want = torch.from_numpy(values[::3].copy()).sum(0)
    assert torch.equal(rows.column_stat(lambda x: x.sum(0)), want) and _resident_kb(array) < 1_000


def test_memory_that_is_not_a_sealed_mapping_is_never_dropped(mapped, tmp_path):
    values, _ = mapped
    anonymous = values.copy()
    pages.drop(anonymous)
    pages.drop(torch.as_tensor(anonymous))
    np.testing.assert_array_equal(anonymous, values)
    unsealed = np.load(tmp_path / "text.npy", mmap_mode="c")  # mapped but not sealed: writable, left alone
    unsealed[0, 0] = 7.0
    pages.drop(unsealed)
    assert unsealed[0, 0] == 7.0


def test_a_dead_arrays_mapping_is_forgotten(tmp_path):
    np.save(tmp_path / "a.npy", np.ones((2048, 1024), np.float32))
    array = np.load(tmp_path / "a.npy", mmap_mode="c")
    assert pages.seal(array)
    ours = [entry for entry in pages._sealed if entry[2]() is array]
    assert len(ours) == 1
    del array
    pages.drop(np.zeros(4))  # a lookup prunes the dead ones
    assert ours[0] not in pages._sealed and all(ref() is not None for _, _, ref in pages._sealed)


def test_a_long_gather_reads_a_block_at_a_time_to_the_same_values(tmp_path):
    """More rows than one read (rows.GATHER_ROWS): the whole subset and a column statistic are the same values as one
    gather of a copy, and the mapping's pages are handed back after each read (none held at the end)."""
    from latentsweep.trainers.data import rows as rows_mod

    values = np.random.default_rng(1).standard_normal((3 * rows_mod.GATHER_ROWS + 17, 64)).astype(np.float32)
    np.save(tmp_path / "wide.npy", values)
    array = np.load(tmp_path / "wide.npy", mmap_mode="c")
    assert pages.seal(array)
    index = torch.from_numpy(np.flatnonzero(np.arange(len(values)) % 7 != 3))
    rows = Rows(torch.as_tensor(array), index)
    copy = torch.from_numpy(values)[index]
    assert len(index) > rows_mod.GATHER_ROWS and torch.equal(rows.materialize(), copy)
    assert torch.equal(rows.column_stat(lambda x: x.mean(0)), copy.mean(0))
    assert torch.equal(rows_mod.gather(torch.as_tensor(array), index, slice(3, 9)), copy[:, 3:9])
    assert _resident_kb(array) < 1_000


def test_a_save_maps_a_sealed_array_a_block_at_a_time(mapped, tmp_path):
    """A checkpoint holding rows of the sealed set (the knn model's keys) is written through pages.Writer: the
    mapping holds at most one block of it during any write and nothing after, and the file reads back equal."""
    from latentsweep.trainers.train.checkpoint import _without_crc32, atomic_torch_save

    values = np.random.default_rng(2).standard_normal((3 * pages.WRITE_BLOCK // 4096 + 5, 1024)).astype(np.float32)
    np.save(tmp_path / "big.npy", values)
    array = np.load(tmp_path / "big.npy", mmap_mode="c")
    assert pages.seal(array)
    seen: list[int] = []

    class Watched:  # the file torch.save writes into, noting the mapping's resident size at every write
        def __init__(self, fh):
            self.fh = fh

        def write(self, data):
            seen.append(_resident_kb(array))
            return self.fh.write(data)

        def flush(self):
            self.fh.flush()

    with open(tmp_path / "ck.pt", "wb") as fh, _without_crc32():  # atomic_torch_save's save, into a watched file
        torch.save({"keys": torch.as_tensor(array)}, pages.Writer(Watched(fh)))
    assert len(seen) > 3 and max(seen) <= pages.WRITE_BLOCK // 1024 + 1_000
    assert _resident_kb(array) < 1_000
    atomic_torch_save({"keys": torch.as_tensor(array)}, tmp_path / "atomic.pt")
    assert _resident_kb(array) < 1_000 and torch.serialization.get_crc32_options()  # the setting put back
    for name in ("ck.pt", "atomic.pt"):
        np.testing.assert_array_equal(torch.load(tmp_path / name, weights_only=True)["keys"].numpy(), values)
