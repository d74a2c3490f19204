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


def test_rows_read_from_a_sealed_mapping_map_none_of_its_pages(mapped):
    """Rows reads the sealed set from its file (pages.take): a batch, the whole subset and a column statistic are
    the same values as indexing a copy, and the mapping holds none of their pages (a mapped read of one row maps its
    whole page-cache folio, 2 MB on Linux 6.18)."""
    values, array = mapped
    base = torch.as_tensor(array)
    rows = Rows(base, torch.arange(0, 4096, 3))
    got = rows[torch.tensor([5, 700, 1200])]
    np.testing.assert_array_equal(got.numpy(), values[[15, 2100, 3600]])
    np.testing.assert_array_equal(rows.materialize().numpy(), values[::3])
    want = torch.from_numpy(values[::3].copy()).sum(0)
    assert torch.equal(rows.column_stat(lambda x: x.sum(0)), want)
    assert _resident_kb(array) < 1_000  # at most the header's page: no row was mapped
    float(base[::512].sum())  # a plain read of the mapping does map pages: the measure can see them
    assert _resident_kb(array) > 1_000
    pages.drop(array)
    assert _resident_kb(array) < 1_000


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
    ours = [entry for entry in pages._sealed if entry.ref() is array]
    assert len(ours) == 1
    del array
    pages.drop(np.zeros(4))  # a lookup prunes the dead ones
    assert ours[0] not in pages._sealed and all(entry.ref() is not None for entry in pages._sealed)


@pytest.mark.parametrize("kind", ["sorted dense", "sorted sparse", "scattered", "with runs"])
def test_take_reads_any_index_from_the_file_to_the_values_of_a_copy(tmp_path, kind):
    """pages.take on more rows than one read (pages.TAKE_ROWS), read window by window (a sorted dense index), a
    pread per run, or into a scratch (a column block): the same values as indexing a copy, numpy or torch, and
    nothing of the mapping held; an index out of range is an IndexError, as for indexing."""
    values = np.random.default_rng(1).standard_normal((3 * pages.TAKE_ROWS + 17, 64)).astype(np.float32)
    np.save(tmp_path / "wide.npy", values)
    array = np.load(tmp_path / "wide.npy", mmap_mode="c")
    assert pages.seal(array)
    rng, n = np.random.default_rng(2), len(values)
    index = {"sorted dense": np.flatnonzero(np.arange(n) % 7 != 3),
             "sorted sparse": np.sort(rng.choice(n, n // 9, replace=False)),
             "scattered": rng.integers(0, n, 2 * pages.TAKE_ROWS),
             "with runs": np.concatenate([np.arange(50, 90), [3, 3, 2], np.arange(n - 30, n), [-1]])}[kind]
    tensor = torch.as_tensor(array)
    np.testing.assert_array_equal(pages.take(array, index), values[index])
    assert torch.equal(pages.take(tensor, torch.from_numpy(index)), torch.from_numpy(values[index]))
    np.testing.assert_array_equal(pages.take(array, index, slice(3, 9)), values[index, 3:9])
    np.testing.assert_array_equal(pages.take(array[10:], index[index < n - 10]), values[10:][index[index < n - 10]])
    assert _resident_kb(array) < 1_000
    with pytest.raises(IndexError):
        pages.take(array, np.array([0, n]))


def test_take_indexes_what_is_not_a_sealed_mapping(mapped):
    values, _ = mapped
    index = np.array([4, 1, 4095])
    np.testing.assert_array_equal(pages.take(values, index), values[index])
    assert torch.equal(pages.take(torch.from_numpy(values), torch.from_numpy(index), slice(2, 5)),
                       torch.from_numpy(values[index, 2:5]))


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
