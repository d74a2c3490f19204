"""Tests of latentsweep.trainers.data.npz's member reader (Member, Npz.open/array): the same arrays as numpy.load,
stored or deflated, with either inflate back end (isal_zlib or zlib), and every damage a DataError naming the key."""
import os
import struct
import zipfile
import zlib

import numpy as np
import pytest

from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.data import npz as N

try:
    from isal import isal_zlib
except ImportError:  # a machine pyproject installs no isal on (no wheel for it): zlib alone
    isal_zlib = None
BACKENDS = {"zlib": zlib} | ({"isal": isal_zlib} if isal_zlib is not None else {})
SAVERS = {"stored": np.savez, "deflated": np.savez_compressed}


def arrays() -> dict[str, np.ndarray]:
    """Every layout numpy writes: C and Fortran order, byte orders, text, records, 0-d, empty; "big" spans several
    INPUT_CHUNKs deflated and more than one STORED_CHUNK stored (9.6 MB of float32)."""
    rng = np.random.default_rng(0)
    onehot = np.zeros((300, 70), bool)
    onehot[np.arange(300), rng.integers(0, 70, 300)] = True
    return {
        "big": rng.standard_normal((2400, 1000)).astype(np.float32),
        "floats64_be": rng.standard_normal((17, 5)).astype(">f8"),
        "ids": rng.integers(-2**62, 2**62, 1001),
        "text": np.array(["caption", "ünïcödé", "", "x" * 40]),
        "raw": np.array([b"ab", b"\x00\xff", b""]),
        "label_fortran": np.asfortranarray(onehot),
        "records": np.array([(1, 2.5), (3, -1.0)], dtype=[("a", "<i4"), ("b", "<f8")]),
        "scalar": np.array(7),
        "empty": np.zeros((0, 3), np.float32),
    }


@pytest.fixture(scope="module", params=list(SAVERS))
def saved(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("npz") / f"{request.param}.npz"
    SAVERS[request.param](path, **arrays())
    return path


def test_isal_is_the_default_back_end_where_installed():
    assert N.INFLATE is (isal_zlib or zlib)  # the dense label's inflate is ~5x zlib's with it


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_arrays_are_bit_identical_to_numpy_load(saved, backend):
    with N.Npz(saved, BACKENDS[backend]) as npz, np.load(saved) as ref:
        assert set(npz.keys) == set(ref.files)
        for key in ref.files:
            got, want = npz.array(key), ref[key]
            assert got.dtype == want.dtype and got.shape == want.shape, key
            assert got.flags.f_contiguous == want.flags.f_contiguous, key
            assert got.tobytes(order="A") == want.tobytes(order="A"), key


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_streamed_reads_give_the_members_bytes(saved, backend):
    """read(n) in odd steps (as the dense label is read) returns exactly the member's bytes, then b"" at its end."""
    with N.Npz(saved, BACKENDS[backend]) as npz, zipfile.ZipFile(saved) as zf:
        for key in ("big", "label_fortran", "scalar"):
            want = zf.read(key + ".npy")
            with npz.open(key) as f:
                pieces = iter(lambda: f.read(333_333), b"")
                assert b"".join(pieces) == want and f.tell() == len(want)
                assert f.read(5) == b"" and f.read() == b""


def _saved_middle(tmp_path, how: str, key: str = "big") -> tuple:
    """(path, file offset of the middle of `key`'s stored or deflated data) of arrays() saved `how`."""
    path = tmp_path / "t.npz"
    SAVERS[how](path, **arrays())
    start, length = _data_span(path, key)
    return path, start + length // 2


def _data_span(path, key: str) -> tuple[int, int]:
    """(first byte, length) of a member's stored or deflated data in the file."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(key + ".npy")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<26xHH", f.read(30))
    return info.header_offset + 30 + name_len + extra_len, info.compress_size


def _flip(path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("how", list(SAVERS))
def test_a_flipped_data_byte_is_a_data_error_naming_the_key(tmp_path, backend, how):
    path, middle = _saved_middle(tmp_path, how)
    _flip(path, middle)
    with N.Npz(path, BACKENDS[backend]) as npz:
        np.testing.assert_array_equal(npz.array("ids"), arrays()["ids"])  # the other members still read
        with pytest.raises(DataError, match="key 'big': cannot read, file truncated or corrupt") as err:
            npz.array("big")
    if how == "stored":  # nothing but the CRC-32 can see a stored member's damage
        assert "CRC-32" in str(err.value)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_wrong_crc_in_the_directory_is_a_data_error(tmp_path, backend):
    """The deflated stream intact, its CRC-32 in the zip directory wrong: the check at the member's end fails."""
    path = tmp_path / "t.npz"
    np.savez_compressed(path, **arrays())
    with zipfile.ZipFile(path) as zf:
        crc = struct.pack("<I", zf.getinfo("text.npy").CRC)
    raw = path.read_bytes()
    assert raw.count(crc) == 2  # the local header's copy and the directory's
    path.write_bytes(raw.replace(crc, struct.pack("<I", zf.getinfo("text.npy").CRC ^ 1)))
    with N.Npz(path, BACKENDS[backend]) as npz, pytest.raises(DataError, match="key 'text'.*bad CRC-32"):
        npz.array("text")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("how", list(SAVERS))
def test_a_file_cut_inside_a_member_is_a_data_error_naming_the_key(tmp_path, backend, how):
    """The zip directory read, then the file cut short (a copy still being written): the member's read says so."""
    path, middle = _saved_middle(tmp_path, how)
    with N.Npz(path, BACKENDS[backend]) as npz:
        os.truncate(path, middle)
        with pytest.raises(DataError, match="key 'big': cannot read, file truncated or corrupt"):
            npz.array("big")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("damage", ["flip", "cut"])
def test_a_damaged_dense_label_is_a_data_error_naming_the_key(tmp_path, backend, damage):
    """The label's streamed read (its own path: read(n) in row steps, not Npz.array) reports damage the same way."""
    rng = np.random.default_rng(1)
    nc, ni = 4000, 300
    label = np.zeros((nc, ni), bool)
    label[np.arange(nc), rng.integers(0, ni, nc)] = True
    path = tmp_path / "t.npz"
    np.savez_compressed(path, **{"captions/label": label})
    start, length = _data_span(path, "captions/label")
    if damage == "flip":
        _flip(path, start + length // 2)
    with N.Npz(path, BACKENDS[backend]) as npz:
        if damage == "cut":
            os.truncate(path, start + length // 2)
        with pytest.raises(DataError, match="key 'captions/label'"):
            N.read_cap2img(npz, nc, ni, chunk_rows=7)


def test_headers_are_parsed_one_at_a_time():
    """A header read waits while another thread parses one (CPython 3.11's AST constructor fails when two threads
    parse at once: python/cpython#106905); it goes on once that parse ends."""
    import io
    import threading

    buf = io.BytesIO()
    np.lib.format.write_array(buf, np.zeros((3, 2), np.float32))
    got = []
    with N._HEADER_LOCK:  # another thread's header parse in progress
        reader = threading.Thread(target=lambda: got.append(N._read_header(io.BytesIO(buf.getvalue()))))
        reader.start()
        reader.join(timeout=0.5)
        assert reader.is_alive() and got == []
    reader.join(timeout=10)
    assert got and got[0][0] == (3, 2) and got[0][2] == np.float32
