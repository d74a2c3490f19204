"""Tests of latentsweep.trainers.data.sets (challenge npz reading, validation), latentsweep.trainers.data.writer,
latentsweep.trainers.data.splits (image-level
splits) and latentsweep.trainers.data.synthetic."""
import hashlib
import tracemalloc

import numpy as np
import pytest
import scipy.sparse

from latentsweep.trainers.data import sets as D
from latentsweep.trainers.data import npz as N
from latentsweep.trainers.data.sets import check_text_dim, load_answers, load_test, load_train
from latentsweep.trainers.data.writer import write_train_npz
from latentsweep.trainers.core.errors import ConfigError, DataError
from latentsweep.trainers.data.splits import captions_of, kfold_by_image, split_by_hash
from latentsweep.trainers.data.synthetic import make_synthetic, write_synthetic

NI, CPI, DT, DI = 40, 5, 6, 8


@pytest.fixture(scope="module")
def syn():
    return make_synthetic(NI, CPI, DT, DI, n_labels=3, n_test=10, seed=3)


def challenge_arrays(syn, label="dense"):
    """The exact challenge key layout, built with numpy alone (independent of our writer)."""
    tr = syn["train"]
    nc, ni = len(tr["text"]), len(tr["image"])
    onehot = np.zeros((nc, ni), bool)
    onehot[np.arange(nc), tr["cap2img"]] = True
    arrays = {
        "metadata/num_captions": np.array([nc]), "metadata/num_images": np.array([ni]),
        "metadata/embedding_dim_text": np.array([DT]), "metadata/embedding_dim_image": np.array([DI]),
        "captions/ids": tr["caption_ids"], "captions/text": tr["caption_text"], "captions/embeddings": tr["text"],
        "captions/label": onehot, "images/names": tr["image_names"], "images/embeddings": tr["image"],
    }
    if label == "fortran":
        arrays["captions/label"] = np.asfortranarray(onehot)
    if label == "scipy-csr":  # scipy.sparse.save_npz's names behind our prefix
        m = scipy.sparse.csr_matrix(arrays.pop("captions/label"))
        arrays.update({"captions/label_data": m.data, "captions/label_indices": m.indices,
                       "captions/label_indptr": m.indptr, "captions/label_shape": np.array(m.shape),
                       "captions/label_format": np.array(m.format.encode("ascii"))})
    return arrays


def save(path, arrays, **changes):
    """np.savez_compressed `arrays` with changes applied (a value of None deletes the key)."""
    arrays = dict(arrays)
    for key, value in changes.items():
        key = key.replace("__", "/")
        if value is None:
            arrays.pop(key)
        else:
            arrays[key] = value
    np.savez_compressed(path, **arrays)
    return path


def expect_error(loader, path, *fragments):
    with pytest.raises(DataError) as info:
        loader(path)
    msg = str(info.value)
    assert "\n" not in msg and str(path) in msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


# ---- reading and writing --------------------------------------------------------------------------------------------

def test_round_trip_through_our_writer(tmp_path, syn):
    tr = syn["train"]
    path = write_train_npz(tmp_path / "train.npz", **tr)
    ts = load_train(path, texts=True)
    np.testing.assert_array_equal(ts.cap2img, tr["cap2img"])
    np.testing.assert_array_equal(ts.text, tr["text"])
    np.testing.assert_array_equal(ts.image, tr["image"])
    np.testing.assert_array_equal(ts.caption_ids, tr["caption_ids"])
    assert list(ts.caption_text) == list(tr["caption_text"]) and list(ts.image_names) == list(tr["image_names"])
    assert load_train(path).caption_text is None  # training never reads the texts: dropped unless asked for
    np.testing.assert_array_equal(ts.image_labels, tr["image_labels"])
    assert list(ts.label_names) == ["label_00", "label_01", "label_02"]
    assert ts.text.dtype == np.float32 and ts.cap2img.dtype == np.int64
    assert ts.fingerprint == hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def test_our_writer_produces_the_exact_challenge_layout(tmp_path, syn):
    path = write_train_npz(tmp_path / "train.npz", label_chunk_rows=7, **syn["train"])
    expected = challenge_arrays(syn)
    with np.load(path) as npz:
        assert set(npz.files) == set(expected) | {"images/labels", "images/label_names"}
        for key, value in expected.items():
            assert npz[key].dtype.kind == value.dtype.kind, key
            np.testing.assert_array_equal(npz[key], value)


def test_captions_are_shuffled_and_the_label_is_read(tmp_path, syn):
    cap2img = syn["train"]["cap2img"]
    assert np.mean(cap2img == np.arange(len(cap2img)) // CPI) < 0.2
    ts = load_train(save(tmp_path / "t.npz", challenge_arrays(syn)))
    np.testing.assert_array_equal(ts.cap2img, cap2img)


@pytest.mark.parametrize("chunk", [1, 7, 64, 10_000, None])  # 200 rows: 7 and 64 do not divide it
@pytest.mark.parametrize("label", ["dense", "fortran"])
def test_streamed_dense_label_any_chunk(tmp_path, syn, chunk, label):
    path = save(tmp_path / "t.npz", challenge_arrays(syn, label))
    ts = load_train(path, label_chunk_rows=chunk)
    np.testing.assert_array_equal(ts.cap2img, syn["train"]["cap2img"])


def test_default_chunk_smaller_than_label(tmp_path, syn, monkeypatch):
    monkeypatch.setattr(N, "LABEL_CHUNK_BYTES", 3 * NI + 5)  # 3 rows per chunk, 200 rows
    path = write_train_npz(tmp_path / "t.npz", **syn["train"])
    np.testing.assert_array_equal(load_train(path).cap2img, syn["train"]["cap2img"])


@pytest.mark.parametrize("fmt", ["index", "sparse"])
def test_index_and_sparse_labels(tmp_path, syn, fmt):
    path = write_train_npz(tmp_path / "t.npz", label_format=fmt, **syn["train"])
    np.testing.assert_array_equal(load_train(path).cap2img, syn["train"]["cap2img"])
    assert D.describe_npz(path)["label_format"] == fmt


def test_scipy_csr_arrays_under_the_prefix_load(tmp_path, syn):
    path = save(tmp_path / "t.npz", challenge_arrays(syn, "scipy-csr"))
    np.testing.assert_array_equal(load_train(path).cap2img, syn["train"]["cap2img"])


def test_streaming_never_holds_the_dense_label(tmp_path):
    """Writing and reading a 4000 x 4000 label (16 MB dense) must allocate far less than that."""
    data = make_synthetic(800, 5, 4, 4, seed=0)["train"]
    data["image"] = np.repeat(data["image"], 5, axis=0)  # 4000 images
    data["image_names"] = np.array([f"{i}.jpg" for i in range(4000)])
    tracemalloc.start()
    try:
        path = write_train_npz(tmp_path / "big.npz", label_chunk_rows=50, **data)
        _, write_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        ts = load_train(path, label_chunk_rows=50)
        _, read_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(ts.cap2img, data["cap2img"])
    assert write_peak < 4 << 20 and read_peak < 4 << 20, (write_peak, read_peak)


def test_test_and_answers_files(tmp_path, syn):
    train, test, answers = write_synthetic(tmp_path, NI, captions_per_image=CPI, dim_text=DT, dim_image=DI,
                                           n_test=10, seed=3)
    ts = load_test(test)
    np.testing.assert_array_equal(ts.ids, np.arange(1, 11))
    np.testing.assert_array_equal(ts.embeddings, syn["test"]["embeddings"])
    ids, image = load_answers(answers)
    np.testing.assert_array_equal(ids, ts.ids)
    np.testing.assert_array_equal(image, syn["answers"]["image"])
    check_text_dim(ts, load_train(train).text.shape[1])
    assert [D.describe_npz(p)["kind"] for p in (train, test, answers)] == ["train", "test", "answers"]


# ---- bad input: one line naming file, key and row ------------------------------------------------------------

def two_hot_row(syn, row, extra):
    label = challenge_arrays(syn)["captions/label"].copy()
    label[row, extra] = not label[row, extra]
    return label


@pytest.mark.parametrize("changes, fragments", [
    ({"images/embeddings": None, "images/embedding": np.zeros((NI, DI), np.float32)},
     ["missing key 'images/embeddings'", "did you mean 'images/embedding'"]),
    ({"captions/label": None}, ["missing key 'captions/label'"]),
    ({"captions/embeddings": np.zeros((200, DT), np.int32)}, ["'captions/embeddings'", "dtype int32"]),
    ({"images/embeddings": np.zeros(NI, np.float32)}, ["'images/embeddings'", "rank 1"]),
    ({"captions/embeddings": np.zeros((0, DT), np.float32)}, ["'captions/embeddings'", "empty"]),
    ({"captions/ids": np.arange(199)}, ["'captions/ids'", "199 rows", "200"]),
    ({"metadata/num_captions": np.array([201])}, ["'metadata/num_captions'", "201", "200"]),
    ({"metadata/embedding_dim_image": np.array([9])}, ["'metadata/embedding_dim_image'", "9"]),
    ({"captions/label": np.zeros((200, NI + 1), bool)}, ["'captions/label'", f"(200, {NI + 1})"]),
    ({"captions/label": np.zeros((200, NI), np.float32)}, ["'captions/label'", "float32"]),
    ({"captions/label": np.full(200, NI)}, ["'captions/label'", "row 0", f"image index {NI}"]),
    ({"images/labels": np.zeros((NI, 3), np.float32)}, ["'images/labels'", "float32"]),
])
def test_bad_train_files(tmp_path, syn, changes, fragments):
    changes = {k.replace("/", "__"): v for k, v in changes.items()}
    expect_error(load_train, save(tmp_path / "bad.npz", challenge_arrays(syn), **changes), *fragments)


@pytest.mark.parametrize("row", [0, 57, 199])
def test_label_row_with_zero_or_two_images_is_named(tmp_path, syn, row):
    truth = int(syn["train"]["cap2img"][row])
    zero = save(tmp_path / "zero.npz", challenge_arrays(syn), captions__label=two_hot_row(syn, row, truth))
    expect_error(load_train, zero, "'captions/label'", f"row {row} has 0 images")
    two = save(tmp_path / "two.npz", challenge_arrays(syn), captions__label=two_hot_row(syn, row, (truth + 1) % NI))
    for chunk in (1, 7, None):
        expect_error(lambda p: load_train(p, label_chunk_rows=chunk), two, f"row {row} has 2 images")


def test_label_rows_with_zero_and_two_images_in_one_chunk(tmp_path, syn):
    """The total count of the chunk is right (0 + 2), yet the first bad row must still be found."""
    label = two_hot_row(syn, 40, int(syn["train"]["cap2img"][40]))
    label[42, (int(syn["train"]["cap2img"][42]) + 1) % NI] = True
    path = save(tmp_path / "t.npz", challenge_arrays(syn), captions__label=label)
    expect_error(lambda p: load_train(p, label_chunk_rows=50), path, "row 40 has 0 images", "2 such rows")


def test_sparse_label_row_with_two_images(tmp_path, syn):
    arrays = challenge_arrays(syn, "scipy-csr")
    m = scipy.sparse.csr_matrix(two_hot_row(syn, 31, (int(syn["train"]["cap2img"][31]) + 1) % NI))
    arrays.update({"captions/label_data": m.data, "captions/label_indices": m.indices,
                   "captions/label_indptr": m.indptr})
    expect_error(load_train, save(tmp_path / "s.npz", arrays), "'captions/label'", "row 31 has 2 images")
    arrays["captions/label_indptr"] = m.indptr[:-1]
    expect_error(load_train, save(tmp_path / "s.npz", arrays), "'captions/label_indptr'", "200 rows")


@pytest.mark.parametrize("key, row", [("captions/embeddings", 13), ("images/embeddings", 0)])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nan_or_inf_row_is_named(tmp_path, syn, key, row, bad):
    arrays = challenge_arrays(syn)
    arrays[key] = arrays[key].copy()
    arrays[key][row, 2] = bad
    arrays[key][row + 5, 1] = bad
    expect_error(load_train, save(tmp_path / "bad.npz", arrays), f"'{key}'", f"row {row} has NaN or Inf")


def test_file_not_found_not_zip_and_truncated(tmp_path, syn):
    expect_error(load_train, tmp_path / "nope.npz", "file not found")
    (tmp_path / "text.npz").write_text("id,embedding\n")
    expect_error(load_test, tmp_path / "text.npz", "not a readable npz")
    good = write_train_npz(tmp_path / "good.npz", **syn["train"]).read_bytes()
    (tmp_path / "cut.npz").write_bytes(good[: len(good) // 2])
    expect_error(load_train, tmp_path / "cut.npz", "truncated or corrupt")


def test_corrupt_member_bytes_name_the_key(tmp_path, syn):
    arrays = challenge_arrays(syn)
    path = tmp_path / "stored.npz"
    np.savez(path, **arrays)  # stored, not deflated: the float bytes appear verbatim in the file
    raw = bytearray(path.read_bytes())
    at = raw.find(arrays["images/embeddings"].tobytes())
    raw[at + 5] ^= 0xFF
    path.write_bytes(bytes(raw))
    expect_error(load_train, path, "'images/embeddings'", "truncated or corrupt")


def test_test_file_errors(tmp_path, syn):
    test = {"captions/ids": np.array([1, 2, 3, 2]), "captions/text": np.array(list("abcd")),
            "captions/embeddings": np.ones((4, DT), np.float32)}
    expect_error(load_test, save(tmp_path / "t.npz", test), "'captions/ids'", "row 3 repeats id 2")
    expect_error(load_test, save(tmp_path / "t.npz", test, captions__ids=np.arange(1, 5), captions__text=None),
                 "missing key 'captions/text'")
    good = load_test(save(tmp_path / "t.npz", test, captions__ids=np.arange(1, 5)))
    bad_dim = load_test(save(tmp_path / "t2.npz", test, captions__ids=np.arange(1, 5),
                             captions__embeddings=np.ones((4, DT + 1), np.float32)))
    train = load_train(save(tmp_path / "train.npz", challenge_arrays(syn)))
    check_text_dim(good, train.text.shape[1])
    with pytest.raises(DataError, match=r"t2\.npz: captions/embeddings has dim 7, the model expects 6"):
        check_text_dim(bad_dim, train.text.shape[1])


# ---- splits ------------------------------------------------------------------------------------------

NAMES = np.array([f"{1000000000 + 37 * i}.jpg" for i in range(2000)])


def test_split_by_hash_is_by_image_and_deterministic():
    tr, va = split_by_hash(NAMES, 0.2, salt="s")
    assert len(np.intersect1d(tr, va)) == 0 and len(tr) + len(va) == len(NAMES)
    assert 0.17 < len(va) / len(NAMES) < 0.23
    # The rule, recomputed independently: MD5(salt + name), first 8 bytes big-endian, over 2**64.
    expected = [i for i, n in enumerate(NAMES) if int(hashlib.md5(f"s{n}".encode()).hexdigest()[:16], 16) < 0.2 * 2**64]
    np.testing.assert_array_equal(va, expected)
    perm = np.random.default_rng(0).permutation(len(NAMES))  # order of the names does not matter
    assert set(NAMES[perm][split_by_hash(NAMES[perm], 0.2, salt="s")[1]]) == set(NAMES[va])
    assert set(split_by_hash(NAMES, 0.2, salt="other")[1]) != set(va)


def test_split_captions_never_straddle(syn):
    cap2img = syn["train"]["cap2img"]
    tr, va = split_by_hash(syn["train"]["image_names"], 0.3)
    tr_caps, va_caps = captions_of(cap2img, tr), captions_of(cap2img, va)
    assert not set(cap2img[tr_caps]) & set(cap2img[va_caps])
    assert len(tr_caps) + len(va_caps) == len(cap2img)
    assert set(cap2img[va_caps]) == set(va) and len(va_caps) == CPI * len(va)


@pytest.mark.parametrize("ratio", [0, 1, -0.1, 1.5, "0.2", None, True])
def test_split_ratio_validated(ratio):
    with pytest.raises(ConfigError, match="val_ratio"):
        split_by_hash(NAMES, ratio)


def test_split_that_leaves_a_side_empty_is_refused():
    with pytest.raises(ConfigError, match="empty validation"):
        split_by_hash(NAMES[:3], 0.01)
    with pytest.raises(ConfigError, match="empty validation"):
        kfold_by_image(NAMES[:1], 2, 1)


def test_kfold_partitions_images():
    folds = [kfold_by_image(NAMES, 5, f, seed=1) for f in range(5)]
    vals = np.concatenate([va for _, va in folds])
    assert sorted(vals) == list(range(len(NAMES)))
    assert {len(va) for _, va in folds} == {400}
    for tr, va in folds:
        assert len(np.intersect1d(tr, va)) == 0 and len(tr) + len(va) == len(NAMES)
    np.testing.assert_array_equal(kfold_by_image(NAMES, 5, 2, seed=1)[1], folds[2][1])
    assert set(kfold_by_image(NAMES, 5, 2, seed=2)[1]) != set(folds[2][1])


@pytest.mark.parametrize("n_folds, fold", [(1, 0), (5, 5), (5, -1), (2.0, 0), (5, 1.5), (3000, 0)])
def test_kfold_args_validated(n_folds, fold):
    with pytest.raises(ConfigError):
        kfold_by_image(NAMES, n_folds, fold)


# ---- synthetic generator ---------------------------------------------------------------------------------------------

def _ridge(x, y, lam=1.0):
    xm, ym = x.mean(0), y.mean(0)
    w = np.linalg.solve((x - xm).T @ (x - xm) + lam * np.eye(x.shape[1]), (x - xm).T @ (y - ym))
    return lambda q: (q - xm) @ w + ym


def test_synthetic_relation_is_learnable():
    syn = make_synthetic(300, 5, 32, 48, n_labels=4, n_test=50, seed=0)
    tr = syn["train"]
    assert abs(np.linalg.norm(tr["image"], axis=1).mean() - 26) < 1
    predict = _ridge(tr["text"], tr["image"][tr["cap2img"]])
    pred, gallery = predict(syn["test"]["embeddings"]), syn["answers"]["image"]
    pred /= np.linalg.norm(pred, axis=1, keepdims=True)
    sims = pred @ (gallery / np.linalg.norm(gallery, axis=1, keepdims=True)).T
    r1 = np.mean(sims.argmax(1) == np.arange(50))
    assert r1 > 0.2, r1  # chance is 0.02
    labels = tr["image_labels"]
    assert 0.05 < labels.mean() < 0.35
    scores = _ridge(tr["text"], labels[tr["cap2img"]].astype(np.float64))(tr["text"])
    pos, neg = scores[labels[tr["cap2img"]]], scores[~labels[tr["cap2img"]]]
    assert pos.mean() > neg.mean() + 0.2  # labels follow the latent, so text predicts them


def test_synthetic_is_deterministic_per_seed():
    a, b, c = (make_synthetic(20, 3, 4, 6, seed=s)["train"] for s in (1, 1, 2))
    np.testing.assert_array_equal(a["text"], b["text"])
    assert not np.array_equal(a["text"], c["text"])
    assert len(set(a["image_names"])) == 20 and len(a["text"]) == 60
