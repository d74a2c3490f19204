"""Shared parts of the bad-input corpus (tests/test_bad_input*.py): good and bad data files, a finished study to
protect, its snapshot, and the assertion every hostile case makes: exit code 2, one line, no traceback, no partial
file, no change to the existing study or its runs. Fixtures are registered through conftest.py."""
from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import optuna
import pytest

from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic

CORPUS = Path(__file__).parent / "corpus"
NAME = "badinput"  # the study name of the fixture study and of every corpus study file
UNREACHABLE_STORAGE = "postgresql+psycopg2://postgres@127.0.0.1:1/x"  # port 1: nothing listens, refused at once
UNREACHABLE_TRACKING = "http://127.0.0.1:1"

GOOD_STUDY = f"""
[study]
name = "{NAME}"
n_trials = 1
pruner = "none"

[base.data]
val_ratio = 0.25

[base.model]
kind = "mlp"
hidden = [16]

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = 1
batch_size = 64

[space]
"optim.lr" = {{ type = "float", low = 1e-4, high = 1e-2, log = true }}
"""


# ---- fixtures --------------------------------------------------------------------------------------------------------

def _rewrite(src: Path, dst: Path, change) -> Path:
    arrays = dict(np.load(src))
    change(arrays)
    np.savez_compressed(dst, **arrays)
    return dst


def _rename(arrays, old, new):
    arrays[new] = arrays.pop(old)


def _set(arrays, key, row, col, value):
    arrays[key][row, col] = value


def _second_image(arrays, row):
    label = arrays["captions/label"]
    label[row, (int(np.argmax(label[row])) + 1) % label.shape[1]] = True


def _truncate(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes()[:src.stat().st_size // 2])  # the zip directory at the end is lost
    return dst


def _not_zip(src: Path, dst: Path) -> Path:
    dst.write_bytes(b"this is a text file, not an npz\n" * 8)
    return dst


def _damage_member(src: Path, dst: Path, key: str) -> Path:
    """Flip bytes in the middle of one member's compressed data: the zip still opens, that member does not."""
    import zipfile

    raw = bytearray(src.read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo(key + ".npy")
    # local header: 30 fixed bytes + file name + extra field, then the compressed data
    start = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.compress_size // 2
    raw[start:start + 16] = bytes(b ^ 0xFF for b in raw[start:start + 16])
    dst.write_bytes(bytes(raw))
    return dst


# case: (how to make the bad file from the good train.npz, fragments its one-line error must contain)
NPZ_CASES = {
    "truncated": (_truncate, ["truncated.npz", "truncated or corrupt"]),
    "not_zip": (_not_zip, ["not_zip.npz", "not a readable npz"]),
    "damaged_member": (lambda src, dst: _damage_member(src, dst, "images/embeddings"),
                       ["damaged_member.npz", "'images/embeddings'", "truncated or corrupt"]),
    "missing_key": (lambda src, dst: _rewrite(src, dst, lambda a: a.pop("images/names")),
                    ["missing_key.npz", "missing key 'images/names'"]),
    "misspelled_key": (lambda src, dst: _rewrite(src, dst, lambda a: _rename(a, "images/embeddings",
                                                                             "images/embedings")),
                       ["misspelled_key.npz", "missing key 'images/embeddings'", "did you mean 'images/embedings'"]),
    "wrong_dtype": (lambda src, dst: _rewrite(src, dst, lambda a: a.update(
                        {"captions/embeddings": a["captions/embeddings"].astype(np.int32)})),
                    ["wrong_dtype.npz", "'captions/embeddings'", "dtype int32", "expected float"]),
    "wrong_rank": (lambda src, dst: _rewrite(src, dst, lambda a: a.update(
                       {"images/embeddings": a["images/embeddings"][:, :, None]})),
                   ["wrong_rank.npz", "'images/embeddings'", "rank 3", "expected rank 2"]),
    "nan": (lambda src, dst: _rewrite(src, dst, lambda a: _set(a, "captions/embeddings", 7, 3, np.nan)),
            ["nan.npz", "'captions/embeddings'", "row 7", "NaN"]),
    "inf": (lambda src, dst: _rewrite(src, dst, lambda a: _set(a, "images/embeddings", 5, 1, np.inf)),
            ["inf.npz", "'images/embeddings'", "row 5", "Inf"]),
    "label_zero_images": (lambda src, dst: _rewrite(src, dst, lambda a: _set(a, "captions/label", 11, slice(None),
                                                                               False)),
                          ["label_zero_images.npz", "'captions/label'", "row 11 has 0 images"]),
    "label_two_images": (lambda src, dst: _rewrite(src, dst, lambda a: _second_image(a, 13)),
                         ["label_two_images.npz", "'captions/label'", "row 13 has 2 images"]),
}


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> dict[str, Path]:
    """Good synthetic train/test files, a test file of another text dim, and one bad npz per NPZ_CASES entry."""
    out = tmp_path_factory.mktemp("bad_input_data")
    train, test, _ = write_synthetic(out / "good", 40, dim_text=8, dim_image=12, n_test=20, seed=3)
    files = {"train": train, "test": test}
    arrays = dict(np.load(test))
    arrays["captions/embeddings"] = np.ones((len(arrays["captions/ids"]), 5), np.float32)
    arrays["metadata/embedding_dim_text"] = np.array([5], np.int64)
    np.savez_compressed(out / "test_dim5.npz", **arrays)
    files["test_dim5"] = out / "test_dim5.npz"
    for case, (make, _) in NPZ_CASES.items():
        files[case] = make(train, out / f"{case}.npz")
    return files


@pytest.fixture(scope="session")
def existing(tmp_path_factory, data) -> dict:
    """A finished one-trial study in its own state directory, and its snapshot to compare against."""
    root = tmp_path_factory.mktemp("bad_input_study")
    study_file = root / f"{NAME}.toml"
    study_file.write_text(GOOD_STUDY)
    state = root / "state"
    assert main(["study", "run", str(study_file), "--data", str(data["train"]), "--state-dir", str(state),
                 "--quiet"]) == 0
    before = snapshot(state)
    assert [t[1] for t in before["trials"]] == ["COMPLETE"]
    assert sorted(r[1] for r in before["runs"]) == [f"study-{NAME}", "trial-0"]
    checkpoint = optuna.load_study(study_name=NAME, storage=f"sqlite:///{state / 'optuna.db'}").trials[0] \
        .user_attrs["checkpoint"]
    # the checkpoint path is stored relative to the state directory (the directory can move)
    return {"state": state, "study_file": study_file, "before": before, "checkpoint": state / checkpoint}


def snapshot(state: Path) -> dict:
    """What a rejected command must not change: studies, trials and their attributes, MLflow rows, trial files."""
    storage = f"sqlite:///{state / 'optuna.db'}"
    summaries = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=NAME, storage=storage)
    trials = [(t.number, t.state.name, t.value, sorted(t.params.items()), sorted(t.user_attrs.items()))
              for t in study.get_trials()]
    with sqlite3.connect(state / "mlflow.db") as conn:  # read directly: fast and exact (MLflow's own tables)
        runs = sorted(conn.execute("SELECT run_uuid, name, status, lifecycle_stage FROM runs"))
        counts = {table: conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
                  for table in ("experiments", "metrics", "params", "tags")}
    files = sorted(str(p.relative_to(state)) for p in (state / "studies").rglob("*"))
    return {"studies": sorted(s.study_name for s in summaries), "trials": trials,
            "user_attrs": sorted(study.user_attrs.items()), "runs": runs, "counts": counts, "files": files}


# ---- helpers ---------------------------------------------------------------------------------------------------------

def one_line_error(capsys, code: int) -> str:
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("latentsweep: error: ")
    return lines[0]


def problem_lines(capsys, code: int, study_file: Path) -> list[str]:
    """A study-file error: 'latentsweep: error: N problem(s) in FILE:' then one indented line per problem."""
    out, err = capsys.readouterr()
    assert code == 2, err
    assert "Traceback" not in err and out == ""
    first, *problems = err.strip().splitlines()
    assert first == f"latentsweep: error: {len(problems)} problem(s) in {study_file}:"
    assert problems and all(line.startswith(f"  {study_file}: ") for line in problems)
    return problems


def study_cmd(command: str, study_file: Path, state: Path, *extra: str) -> list[str]:
    head = ["worker"] if command == "worker" else ["study", command]
    return [*head, str(study_file), "--state-dir", str(state), *extra]




def assert_rejected(capsys, code: int, existing: dict, *fragments: str, absent=(), secrets=()) -> str:
    """The contract of every hostile case: exit code 2 and one error line naming the problem (each fragment), no
    traceback, nothing written at the `absent` paths, no secret echoed, the existing study and runs unchanged."""
    line = one_line_error(capsys, code)
    for fragment in fragments:
        assert fragment in line, line
    for secret in secrets:
        assert secret not in line, line
    for path in absent:
        assert not Path(path).exists(), f"{path} was written"
    assert snapshot(existing["state"]) == existing["before"]
    return line
