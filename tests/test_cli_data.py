"""Tests of `latentsweep data check`: the summary of each file kind, and one-line errors with exit code 2."""
import numpy as np
import pytest

from latentsweep.search.cli.main import main
from latentsweep.trainers.data.writer import write_train_npz
from latentsweep.trainers.data.synthetic import make_synthetic, write_synthetic


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    train, test, answers = write_synthetic(out, 30, captions_per_image=4, dim_text=6, dim_image=10, n_labels=2,
                                           n_test=12, seed=5)
    return {"train": train, "test": test, "answers": answers, "dir": out}


def check(path, capsys):
    code = main(["data", "check", str(path)])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_train(files, capsys):
    code, out, err = check(files["train"], capsys)
    assert code == 0 and err == ""
    assert f"{files['train']}: train file" in out
    assert "captions: 120 (text dim 6), images: 30 (image dim 10)" in out
    assert "captions per image: min 4, mean 4.00, max 4" in out
    assert "label format: dense bool [120, 30] one-hot" in out
    assert "multi-labels: 2 labels" in out and "label_00, label_01" in out
    image_mean = float(out.split("image norms: mean ")[1].split(",")[0])
    assert 20 < image_mean < 32  # the generator targets the real data's norm of about 26
    assert out.rstrip().endswith("ok")


def test_check_test_and_answers(files, capsys):
    code, out, _ = check(files["test"], capsys)
    assert code == 0 and "test file" in out and "captions: 12 (text dim 6), ids 1..12" in out
    code, out, _ = check(files["answers"], capsys)
    assert code == 0 and "answers file" in out and "captions: 12, ids 1..12, image dim 10" in out


@pytest.mark.parametrize("fmt, shown", [("index", "integer index [60]"), ("sparse", "sparse CSR")])
def test_check_reports_label_format(tmp_path, capsys, fmt, shown):
    data = make_synthetic(20, 3, 4, 4, seed=1)["train"]
    path = write_train_npz(tmp_path / "t.npz", label_format=fmt, **data)
    code, out, _ = check(path, capsys)
    assert code == 0 and f"label format: {shown}" in out
    assert "captions per image: min 3, mean 3.00, max 3" in out and "multi-labels: none" in out


def _one_line_error(code, out, err):
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("latentsweep: error: ") and "Traceback" not in err
    return lines[0]


def test_bad_label_row_exits_2_with_one_line(files, tmp_path, capsys):
    with np.load(files["train"]) as npz:
        arrays = dict(npz)
    arrays["captions/label"][17, :] = False
    bad = tmp_path / "bad.npz"
    np.savez_compressed(bad, **arrays)
    line = _one_line_error(*check(bad, capsys))
    assert str(bad) in line and "'captions/label'" in line and "row 17 has 0 images" in line


@pytest.mark.parametrize("content, fragment", [(None, "file not found"), (b"not a zip", "not a readable npz")])
def test_missing_or_non_zip_file(tmp_path, capsys, content, fragment):
    path = tmp_path / "x.npz"
    if content is not None:
        path.write_bytes(content)
    assert fragment in _one_line_error(*check(path, capsys))


def test_unknown_file_kind(tmp_path, capsys):
    path = tmp_path / "other.npz"
    np.savez_compressed(path, foo=np.arange(3))
    line = _one_line_error(*check(path, capsys))
    assert "cannot tell the file kind" in line and "'foo'" in line
