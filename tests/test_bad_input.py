"""Bad-input corpus: every bad file or setting gives one error line naming the problem, exit 2, no traceback, no
partial output, and no change to an existing study (Optuna trials, MLflow runs, trial files)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bad_input_kit import (
    CORPUS, NAME, NPZ_CASES, UNREACHABLE_STORAGE, UNREACHABLE_TRACKING, one_line_error, problem_lines, snapshot, study_cmd,
)
from latentsweep.search.cli.main import main
from latentsweep.trainers.eval.submission import write_submission

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
    from latentsweep.trainers.data.sets import load_test

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
    proc = subprocess.run([sys.executable, "-m", "latentsweep", *argv], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith("latentsweep: error: ") and fragment in proc.stderr.splitlines()[0]
