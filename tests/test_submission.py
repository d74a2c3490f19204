"""Tests of latentsweep.trainers.eval.submission and `latentsweep submission check|score`: format, atomicity, checks and
scoring."""
import json
import os
import re

import numpy as np
import pytest
import torch

from latentsweep.search.cli.main import main
from latentsweep.trainers.data.sets import load_test
from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.eval.metrics import leaderboard_from_ordered
from latentsweep.trainers.eval.submission import check_submission, read_submission, score_submission, write_submission

N, DT, DI = 250, 8, 12


def save_test(path, ids):
    """A test.clean.npz with the challenge's exact keys."""
    emb = np.random.default_rng(0).standard_normal((len(ids), DT)).astype(np.float32)
    np.savez_compressed(path, **{
        "metadata/num_captions": np.array([len(ids)], dtype=np.int64),
        "metadata/num_images": np.array([0], dtype=np.int64),
        "metadata/embedding_dim_text": np.array([DT], dtype=np.int64),
        "metadata/embedding_dim_image": np.array([DI], dtype=np.int64),
        "captions/ids": np.asarray(ids, dtype=np.int64),
        "captions/text": np.array([f"caption {i}" for i in ids]),
        "captions/embeddings": emb,
    })
    return path


def save_answers(path, ids, image):
    np.savez_compressed(path, **{
        "captions/ids": np.asarray(ids, dtype=np.int64),
        "images/embeddings": np.asarray(image, dtype=np.float32),
        "images/names": np.array([f"{i}.jpg" for i in range(len(ids))]),
    })
    return path


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(1)
    ids = np.arange(1, N + 1)
    truth = rng.standard_normal((N, DI)).astype(np.float32)
    pred = truth + rng.standard_normal((N, DI)).astype(np.float32)
    return {
        "ids": ids, "truth": truth, "pred": pred,
        "test": save_test(tmp_path / "test.clean.npz", ids),
        "answers": save_answers(tmp_path / "answers.npz", ids, truth),
        "sub": tmp_path / "sub.csv",
    }


def write_rows(path, rows):
    path.write_text("id,embedding\n" + "".join(r + "\n" for r in rows))
    return path


def test_round_trip_is_exact_and_format_matches(tmp_path):
    rng = np.random.default_rng(2)
    emb = rng.standard_normal((7, 16)).astype(np.float32)
    emb[0, :4] = [1e-38, 3.4e38, -0.0, np.float32(1e-45)]   # tiny, huge, signed zero, subnormal
    ids = np.array([5, 3, 9, 1, 2, 8, 4])
    path = tmp_path / "s.csv"
    assert write_submission(path, ids, emb) == 7
    lines = path.read_text().splitlines()
    assert lines[0] == "id,embedding"
    assert all(re.fullmatch(r'\d+,"\[[^\]]+(, [^\]]+){15}\]"', line) for line in lines[1:])
    got_ids, got = read_submission(path)
    np.testing.assert_array_equal(got_ids, ids)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.int32), emb.view(np.int32))   # bit-exact, -0.0 included


def test_reading_holds_the_values_as_float32_rows(tmp_path):
    """A submission is read into float32 rows as it goes: at most its text and lines at once (2x the file), not also
    a Python float per value (0.25 GB at the challenge's 5,000 x 1536; 3.8x the file in all)."""
    import tracemalloc

    emb = np.random.default_rng(0).standard_normal((300, 512)).astype(np.float32)
    path = tmp_path / "sub.csv"
    write_submission(path, np.arange(300), emb)
    tracemalloc.start()
    try:
        ids, got = read_submission(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    np.testing.assert_array_equal(got, emb)
    assert peak < 2.5 * path.stat().st_size


def test_write_accepts_tensor_and_row_generator(tmp_path):
    emb = torch.randn(4, 3)
    write_submission(tmp_path / "a.csv", [1, 2, 3, 4], emb)
    write_submission(tmp_path / "b.csv", range(1, 5), (row for row in emb.numpy()))
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()


def leftovers(directory):
    return sorted(p.name for p in directory.iterdir())


def test_atomic_write_removes_everything_on_nan(tmp_path):
    emb = np.ones((5, 3), dtype=np.float32)
    emb[3, 1] = np.nan
    with pytest.raises(DataError, match=r"row 3 \(id 4\).*non-finite"):
        write_submission(tmp_path / "s.csv", [1, 2, 3, 4, 5], emb)
    assert leftovers(tmp_path) == []


def test_atomic_write_keeps_old_file_when_generator_raises(tmp_path):
    path = tmp_path / "s.csv"
    write_submission(path, [1], [[0.5, 0.25]])
    before = path.read_text()

    def rows():
        yield [1.0, 2.0]
        raise RuntimeError("encoder crashed")

    with pytest.raises(RuntimeError, match="encoder crashed"):
        write_submission(path, [1, 2, 3], rows())
    assert leftovers(tmp_path) == ["s.csv"]
    assert path.read_text() == before


@pytest.mark.parametrize("ids,emb,message", [
    ([1, 2, 3], np.ones((2, 3)), "more ids than embedding rows"),
    ([1, 2], np.ones((3, 3)), "more embedding rows than ids"),
    ([1, 2, 1], np.ones((3, 3)), "duplicate id 1"),
    ([1, 2], [[1.0, 2.0], [1.0]], "row 1 .*shape"),
    ([], np.ones((0, 3)), "no rows"),
])
def test_write_rejects_inconsistent_input(tmp_path, ids, emb, message):
    with pytest.raises(DataError, match=message):
        write_submission(tmp_path / "s.csv", ids, emb)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("body,message", [
    ("id,vec\n1,\"[1, 2]\"\n", "line 1: header"),
    ("id,embedding\n1,\"[1, x2]\"\n", "line 2: value 'x2' is not a number"),
    ("id,embedding\n1,\"[1, 2]\"\n2,\"[1, 2, 3]\"\n", "line 3: 3 values, expected 2"),
    ("id,embedding\n1,\"[1, 2]\"\nabc,\"[1, 2]\"\n", "line 3: id 'abc' is not an integer"),
    ("id,embedding\n1,\"1, 2\"\n", "line 2: embedding must be a quoted list"),
    ("id,embedding\n1\n", "line 2: expected"),
    ("id,embedding\n", "no rows"),
    ("", "line 1: header"),
])
def test_read_rejects_malformed_files_naming_file_and_line(tmp_path, body, message):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(DataError, match=message) as info:
        read_submission(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_read_missing_file(tmp_path):
    with pytest.raises(DataError, match="not found"):
        read_submission(tmp_path / "nope.csv")


def test_check_accepts_a_valid_submission(files):
    write_submission(files["sub"], files["ids"][::-1], files["pred"][::-1])
    assert check_submission(files["sub"], load_test(files["test"]), dim=DI) == (N, DI)


def test_check_names_missing_duplicate_and_extra_ids(files):
    rows = [f'{i},"[1, 2]"' for i in list(range(1, 6)) + [3, 3, 1001, 1002]]
    write_rows(files["sub"], rows)
    test = load_test(files["test"])
    with pytest.raises(DataError) as info:
        check_submission(files["sub"], test)
    msg = str(info.value)
    assert f"{N - 5} missing (first: 6, 7, 8, 9, 10, ...)" in msg
    assert "1 duplicated (first: 3; id 3 on lines 4, 7, 8)" in msg
    assert "2 not in test set" in msg and "1001, 1002" in msg


def test_check_wrong_dim_and_nan(files):
    write_submission(files["sub"], files["ids"], files["pred"])
    test = load_test(files["test"])
    with pytest.raises(DataError, match=f"dim {DI}, expected 1536"):
        check_submission(files["sub"], test, dim=1536)
    rows = [f'{i},"[1, 2]"' for i in files["ids"]]
    rows[9] = '10,"[nan, 2]"'
    write_rows(files["sub"], rows)
    with pytest.raises(DataError, match=r"line 11 \(id 10\): non-finite"):
        check_submission(files["sub"], test)


def test_score_is_order_independent_and_matches_protocol(files):
    perm = np.random.default_rng(3).permutation(N)
    write_submission(files["sub"], files["ids"][perm], files["pred"][perm])
    got = score_submission(files["sub"], files["answers"])
    want = leaderboard_from_ordered(files["pred"], files["truth"], gallery_size=100)
    assert got == pytest.approx(want)
    write_submission(files["sub"], files["ids"], files["truth"] * 2.0)
    assert score_submission(files["sub"], files["answers"])["mrr"] == 1.0


def test_score_rejects_mismatched_dim(files):
    write_submission(files["sub"], files["ids"], files["pred"][:, :5])
    with pytest.raises(DataError, match=f"dim 5, expected {DI}"):
        score_submission(files["sub"], files["answers"])


def test_cli_check_and_score(files, capsys):
    write_submission(files["sub"], files["ids"], files["pred"])
    assert main(["submission", "check", str(files["sub"]), "--test", str(files["test"]), "--dim", str(DI)]) == 0
    assert capsys.readouterr().out.strip() == f"ok: {N} rows, dim {DI}"
    assert main(["submission", "score", str(files["sub"]), "--answers", str(files["answers"])]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert last["mrr"] == pytest.approx(score_submission(files["sub"], files["answers"])["mrr"])
    assert any(line.startswith("r10") for line in out[:-1])


def test_cli_errors_are_one_line_exit_2(files, capsys):
    write_rows(files["sub"], ['1,"[1, 2]"'])
    assert main(["submission", "check", str(files["sub"]), "--test", str(files["test"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("latentsweep: error: ") and err.count("\n") == 1 and "missing" in err
    assert main(["submission", "score", str(files["sub"]), "--answers", os.fspath(files["answers"])]) == 2
    assert "latentsweep: error: " in capsys.readouterr().err
