"""Bad-input corpus: every bad file or setting gives one error line naming the problem, exit 2, no traceback, no
partial output, and no change to an existing study (Optuna trials, MLflow runs, trial files)."""
from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import optuna
import pytest

from search.cli import main
from trainers.submission import write_submission
from trainers.synthetic import write_synthetic

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
    return {"state": state, "study_file": study_file, "before": before, "checkpoint": Path(checkpoint)}


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


# ---- bad data files --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", sorted(NPZ_CASES))
def test_data_check_names_the_problem(case, data, capsys):
    line = one_line_error(capsys, main(["data", "check", str(data[case])]))
    for fragment in NPZ_CASES[case][1]:
        assert fragment in line


@pytest.mark.parametrize("case", sorted(NPZ_CASES))
def test_bad_data_leaves_existing_study_unchanged(case, data, existing, capsys):
    args = study_cmd("run", existing["study_file"], existing["state"], "--data", str(data[case]), "--quiet")
    line = one_line_error(capsys, main(args))
    for fragment in NPZ_CASES[case][1]:
        assert fragment in line
    assert snapshot(existing["state"]) == existing["before"]


@pytest.mark.parametrize("command", ["create", "worker"])
def test_bad_data_in_create_and_worker(command, data, existing, capsys):
    args = study_cmd(command, existing["study_file"], existing["state"], "--data", str(data["nan"]))
    assert "row 7" in one_line_error(capsys, main(args))
    assert snapshot(existing["state"]) == existing["before"]


def test_bad_data_writes_nothing_to_a_fresh_state_dir(data, existing, tmp_path, capsys):
    state = tmp_path / "fresh"
    args = study_cmd("run", existing["study_file"], state, "--data", str(data["label_two_images"]), "--quiet")
    one_line_error(capsys, main(args))
    assert not state.exists() or list(state.rglob("*")) == []


def test_train_with_bad_data_writes_no_output(data, existing, tmp_path, capsys):
    out = tmp_path / "train-out"
    code = main(["train", str(existing["study_file"]), "--data", str(data["wrong_rank"]), "--out", str(out),
                 "--quiet"])
    assert "wrong_rank.npz" in one_line_error(capsys, code)
    assert not out.exists()


# ---- train/test mismatch and submissions -----------------------------------------------------------------------------

def test_predict_with_other_text_dim_keeps_existing_output(data, existing, tmp_path, capsys):
    out = tmp_path / "submission.csv"
    out.write_text("previous submission\n")
    code = main(["predict", str(existing["checkpoint"]), "--test", str(data["test_dim5"]), "--out", str(out)])
    line = one_line_error(capsys, code)
    assert "test_dim5.npz" in line and "dim 5" in line and "expects 8" in line
    assert out.read_text() == "previous submission\n"
    fresh = tmp_path / "new.csv"
    one_line_error(capsys, main(["predict", str(existing["checkpoint"]), "--test", str(data["test_dim5"]),
                                 "--out", str(fresh)]))
    assert not fresh.exists() and list(tmp_path.glob(".new.csv.*")) == []


@pytest.fixture(scope="session")
def submissions(tmp_path_factory, data) -> dict[str, Path]:
    """A valid submission for the good test set (dim 12) and its broken variants."""
    from trainers.data import load_test

    out = tmp_path_factory.mktemp("submissions")
    ids = load_test(data["test"]).ids
    rows = np.random.default_rng(0).standard_normal((len(ids), 12)).astype(np.float32)
    good = out / "good.csv"
    write_submission(good, ids, rows)
    lines = good.read_text().splitlines()  # header, then one row per id in test order
    variants = {"missing": lines[:-3], "duplicate": lines + [lines[4]],
                "extra": lines + ["999" + lines[4][lines[4].index(","):]]}
    files = {"good": good}
    for name, text in variants.items():
        files[name] = out / f"{name}.csv"
        files[name].write_text("\n".join(text) + "\n")
    return files


def test_submission_check_wrong_dim(data, submissions, capsys):
    assert main(["submission", "check", str(submissions["good"]), "--test", str(data["test"]), "--dim", "12"]) == 0
    capsys.readouterr()
    code = main(["submission", "check", str(submissions["good"]), "--test", str(data["test_dim5"]), "--dim", "5"])
    line = one_line_error(capsys, code)
    assert "good.csv" in line and "dim 12, expected 5" in line


@pytest.mark.parametrize("case, fragment", [("missing", "3 missing (first: 18, 19, 20)"),
                                            ("duplicate", "1 duplicated (first: 4; id 4 on lines 5, 22)"),
                                            ("extra", "1 not in test set")])
def test_submission_ids(case, fragment, data, submissions, capsys):
    line = one_line_error(capsys, main(["submission", "check", str(submissions[case]), "--test", str(data["test"])]))
    assert f"{case}.csv" in line and fragment in line
    if case == "extra":
        assert "(first: 999)" in line


# ---- bad study files -------------------------------------------------------------------------------------------------

STUDY_FILE_CASES = {
    "unknown_knob": "base: unknown config key 'model.hiden' (did you mean 'model.hidden'?)",
    "inverted_range": "space.optim.lr: inverted range: low 0.01 > high 0.0001",
    "empty_range": "space.model.dropout: empty range: low == high == 0.2",
    "unknown_sampler": "study.sampler: unknown sampler 'tpee' (did you mean 'tpe'?)",
    "unknown_pruner": "study.pruner: unknown pruner 'medain' (did you mean 'median'?)",
}


@pytest.mark.parametrize("case", sorted(STUDY_FILE_CASES))
@pytest.mark.parametrize("command", ["run", "create", "worker", "reap"])
def test_bad_study_file_leaves_existing_study_unchanged(case, command, data, existing, capsys):
    path = CORPUS / f"{case}.toml"
    code = main(study_cmd(command, path, existing["state"], "--data", str(data["train"]))
                if command != "reap" else study_cmd(command, path, existing["state"]))
    (problem,) = problem_lines(capsys, code, path)
    assert STUDY_FILE_CASES[case] in problem
    assert snapshot(existing["state"]) == existing["before"]


@pytest.mark.parametrize("command", ["run", "create", "worker", "reap"])
def test_malformed_toml(command, existing, capsys):
    path = CORPUS / "malformed.toml"
    line = one_line_error(capsys, main(study_cmd(command, path, existing["state"])))
    assert f"{path}: malformed TOML" in line and "line 5" in line
    assert snapshot(existing["state"]) == existing["before"]


def test_train_with_bad_study_file(tmp_path, capsys):
    out = tmp_path / "out"
    path = CORPUS / "unknown_sampler.toml"
    (problem,) = problem_lines(capsys, main(["train", str(path), "--out", str(out)]), path)
    assert "unknown sampler 'tpee'" in problem
    assert not out.exists()


# ---- unreachable stores and unwritable state ------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "create", "worker", "reap"])
def test_unreachable_storage(command, data, existing, tmp_path, capsys):
    extra = ["--storage", UNREACHABLE_STORAGE] + (["--data", str(data["train"])] if command != "reap" else [])
    line = one_line_error(capsys, main(study_cmd(command, existing["study_file"], existing["state"], *extra)))
    assert f"cannot open Optuna storage {UNREACHABLE_STORAGE}" in line and "refused" in line
    assert snapshot(existing["state"]) == existing["before"]
    fresh = tmp_path / "fresh"  # nothing written anywhere, not even an MLflow database
    one_line_error(capsys, main(study_cmd(command, existing["study_file"], fresh, *extra)))
    assert list(fresh.rglob("*")) == []


def test_unreachable_storage_in_status(capsys):
    line = one_line_error(capsys, main(["study", "status", NAME, "--storage", UNREACHABLE_STORAGE]))
    assert "cannot open Optuna storage" in line


@pytest.mark.parametrize("command", ["run", "create", "worker"])
def test_unreachable_tracking_server(command, data, existing, capsys):
    extra = ["--tracking-uri", UNREACHABLE_TRACKING, "--data", str(data["train"])]
    line = one_line_error(capsys, main(study_cmd(command, existing["study_file"], existing["state"], *extra)))
    assert f"MLflow tracking server {UNREACHABLE_TRACKING} is not reachable" in line
    assert snapshot(existing["state"]) == existing["before"]


@pytest.mark.parametrize("command", ["run", "create", "worker", "reap"])
def test_unwritable_state_dir(command, existing, tmp_path, capsys):
    # A directory below a regular file cannot be created, not even by root (tests may run as root, which ignores
    # permission bits, so a read-only directory would not do).
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    state = blocker / "state"
    line = one_line_error(capsys, main(study_cmd(command, existing["study_file"], state)))
    assert f"state directory {state} is not writable" in line


def test_unwritable_state_dir_from_environment(existing, tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("LATENTSWEEP_STATE_DIR", str(blocker / "state"))
    line = one_line_error(capsys, main(["study", "create", str(existing["study_file"])]))
    assert str(blocker / "state") in line


# ---- the real process: exit code and stderr as a user sees them ------------------------------------------------------

@pytest.mark.parametrize("argv, fragment", [
    (["data", "check", "{truncated}"], "truncated.npz"),
    (["study", "create", str(CORPUS / "unknown_pruner.toml"), "--state-dir", "{state}"], "problem(s) in"),
    (["study", "create", "{study_file}", "--state-dir", "{state}", "--storage", UNREACHABLE_STORAGE],
     "cannot open Optuna storage"),
])
def test_subprocess_exit_code_and_no_traceback(argv, fragment, data, existing, tmp_path):
    fill = {"truncated": data["truncated"], "state": tmp_path / "state", "study_file": existing["study_file"]}
    argv = [a.format(**fill) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "search", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith("latentsweep: error: ") and fragment in proc.stderr.splitlines()[0]
