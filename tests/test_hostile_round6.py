"""Hostile-input corpus, part 6 (issue 39): outputs that resolve (directly or through a symlink) to an input, a store
or a checkpoint; studies whose trial attributes are damaged; bad devices and environment variables; the Python API's
progress sink; degenerate data. Same contract as the earlier parts (bad_input_kit.assert_rejected): exit 2, one line,
nothing written, the existing study and its runs unchanged."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bad_input_kit import GOOD_STUDY, NAME, assert_rejected
from latentsweep.search.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def _link(at: Path, to: Path) -> Path:
    at.parent.mkdir(parents=True, exist_ok=True)
    at.symlink_to(to)
    return at


def _run(existing, data, out, *extra) -> list[str]:
    return ["run", str(existing["study_file"]), "--time", "60", "--data", str(data["train"]), "--test",
            str(data["test"]), "--state-dir", str(existing["state"]), "--out", str(out), "--quiet", *extra]


def _pick(existing, out, *extra) -> list[str]:
    return ["pick", NAME, "--state-dir", str(existing["state"]), "--out", str(out), "--no-refit", "--quiet", *extra]


# ---- outputs never overwrite inputs ---------------------------------------------------------------------------------
# case: (argv from the fixtures and tmp_path, fragments of the one-line error); each writes through a symlink or
# straight onto an input, a store or a checkpoint.
OUTPUT_CASES = {
    "run_out_links_to_the_test": (lambda d, e, t: _run(e, d, _link(t / "sub.csv", d["test"])),
                                  ["is the input --test", "through the link", "would replace the input"]),
    "run_out_is_the_study_file": (lambda d, e, t: _run(e, d, e["study_file"]), ["is the input STUDY"]),
    "run_out_is_optuna_db": (lambda d, e, t: _run(e, d, e["state"] / "optuna.db"), ["the Optuna storage"]),
    "run_out_links_to_mlflow_db": (lambda d, e, t: _run(e, d, _link(t / "s.csv", e["state"] / "mlflow.db")),
                                   ["the MLflow tracking store", "through the link"]),
    "run_out_is_a_checkpoint": (lambda d, e, t: _run(e, d, e["checkpoint"]), ["is inside the trials' folders"]),
    "run_manifest_beside_out_links_to_the_train_file": (
        lambda d, e, t: _run(e, d, _link(t / "s.manifest.json", d["train"]).with_name("s.csv")),
        ["s.manifest.json is the input --data"]),
    "pick_out_links_to_the_train_file": (lambda d, e, t: _pick(e, _link(t / "p.csv", d["train"]), "--data",
                                                               str(d["train"])), ["is the input --data"]),
    "pick_out_is_the_recorded_train_file": (lambda d, e, t: _pick(e, _link(t / "p.csv", d["train"])),
                                            ["is the input --data"]),
    "pick_out_is_optuna_db_wal": (lambda d, e, t: _pick(e, e["state"] / "optuna.db-wal"), ["the Optuna storage"]),
    "pick_report_beside_out_is_a_checkpoint": (
        lambda d, e, t: _pick(e, _link(t / "p.report.csv", e["checkpoint"]).with_name("p.csv")),
        ["p.report.csv is inside the trials' folders"]),
    "pick_out_in_the_artifacts": (lambda d, e, t: _pick(e, e["state"] / "artifacts" / "x.csv"),
                                  ["the MLflow artifacts"]),
    "predict_out_is_its_checkpoint": (lambda d, e, t: ["predict", str(e["checkpoint"]), "--test", str(d["test"]),
                                                       "--out", str(e["checkpoint"])], ["is the input CHECKPOINT"]),
    "predict_out_links_to_the_test": (lambda d, e, t: ["predict", str(e["checkpoint"]), "--test", str(d["test"]),
                                                       "--out", str(_link(t / "s.csv", d["test"]))],
                                      ["is the input --test"]),
    "holdout_out_holds_a_link_to_its_input": (
        lambda d, e, t: ["data", "holdout", str(d["train"]), "--out",
                         str(_link(t / "h" / "test.clean.npz", d["train"]).parent), "--force"],
        ["is the input PATH", "through the link"]),
    "train_out_is_a_trial_folder": (lambda d, e, t: ["train", str(e["study_file"]), "--data", str(d["train"]),
                                                     "--state-dir", str(e["state"]), "--out",
                                                     str(e["checkpoint"].parent), "--quiet"],
                                    ["is inside the trials' folders"]),
    "study_run_storage_is_the_train_file": (lambda d, e, t: ["study", "run", str(e["study_file"]), "--data",
                                                             str(d["train"]), "--state-dir", str(t / "s"),
                                                             "--storage", f"sqlite:///{d['train']}", "--quiet"],
                                            ["--storage", "is the input --data"]),
    "study_init_over_the_default_stores": (lambda d, e, t: ["study", "init", "quick", str(e["state"] / "mlflow.db"),
                                                            "--force"], ["DEST", "the MLflow tracking store"]),
}


@pytest.mark.parametrize("case", sorted(OUTPUT_CASES))
def test_an_output_never_replaces_an_input_or_a_store(case, data, existing, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LATENTSWEEP_STATE_DIR", str(existing["state"]))  # the default state of predict, init
    make, fragments = OUTPUT_CASES[case]
    guarded = [data["train"], data["test"], existing["study_file"], existing["checkpoint"]]
    before = {p: p.read_bytes() for p in guarded}
    code = main(make(data, existing, tmp_path))
    assert_rejected(capsys, code, existing, *fragments, absent=[tmp_path / "s"])
    assert {p: p.read_bytes() for p in guarded} == before
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]  # nothing staged or left


# ---- damaged studies: read with a warning, never a traceback ------------------------------------------------------

def _damage(state: Path) -> None:
    """Trial 0's attributes of the wrong type (timing, best epoch, checkpoint, device) and side values that are not
    JSON, written straight into the storage (Optuna refuses to update a finished trial); then a RUNNING trial whose
    MLflow run id is not a run and whose worker (on this machine) is gone."""
    import json
    import sqlite3

    import optuna

    from latentsweep.search.study.owners import OWNER_ATTR, worker_id

    with sqlite3.connect(state / "optuna.db") as conn:
        (trial,) = conn.execute("SELECT trial_id FROM trials WHERE number = 0").fetchone()
        for key, value in {"timing": {"setup_s": "slow", "train_s": 1.0, "eval_s": 0.1, "captions": 9, "images": 3,
                                      "per_image": False},
                           "latentsweep.side": "{not json", "best_epoch": "two", "latentsweep.device": ["cpu", 1]
                           }.items():
            conn.execute("DELETE FROM trial_user_attributes WHERE trial_id = ? AND key = ?", (trial, key))
            conn.execute("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (?, ?, ?)",
                         (trial, key, json.dumps(value)))
    storage = optuna.storages.RDBStorage(f"sqlite:///{state / 'optuna.db'}")
    running = optuna.load_study(study_name=NAME, storage=storage).ask()
    storage.set_trial_user_attr(running._trial_id, "mlflow_run_id", "no-such-run")
    dead = __import__("subprocess").Popen([__import__("sys").executable, "-c", "pass"])
    dead.wait()
    storage.set_trial_user_attr(running._trial_id, OWNER_ATTR, worker_id(dead.pid))
    storage.remove_session()


@pytest.fixture
def damaged(existing, tmp_path) -> Path:
    import shutil

    state = tmp_path / "state"
    shutil.copytree(existing["state"], state)
    _damage(state)
    return state


def test_a_damaged_study_is_read_with_warnings_not_a_traceback(damaged, data, tmp_path, capsys):
    assert main(["study", "status", NAME, "--state-dir", str(damaged)]) == 0
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "side values (latentsweep.side) are not a JSON object" in err
    assert "COMPLETE" in out
    assert main(["study", "reap", NAME, "--state-dir", str(damaged)]) == 0  # the stale trial: failed at once
    err = capsys.readouterr().err
    assert "Traceback" not in err and "'no-such-run' is not in the tracking store" in err
    out_csv = tmp_path / "pick" / "sub.csv"
    assert main(["pick", NAME, "--state-dir", str(damaged), "--out", str(out_csv), "--no-refit", "--quiet",
                 "--data", str(data["train"]), "--test", str(data["test"])]) == 0
    assert "Traceback" not in capsys.readouterr().err and out_csv.is_file()


def test_a_timing_of_the_wrong_type_reads_as_none():
    from latentsweep.trainers.train.cost import Timing

    good = {"setup_s": 1.0, "train_s": 2.0, "eval_s": 0.5, "captions": 10, "images": 4, "per_image": False}
    assert Timing.from_attrs(good) is not None
    for key, bad in (("setup_s", "1"), ("captions", None), ("per_image", "no"), ("train_s", float("nan")),
                     ("images", True), ("eval_s", -1.0)):
        assert Timing.from_attrs({**good, key: bad}) is None, key


# ---- devices and environment: refused before anything is stored, naming what the user set ------------------------

@pytest.mark.parametrize("device", ["cuda:0", "CUDA", "mps", "meta", "cpu:1", ""])
def test_a_bad_train_device_is_refused_before_anything_is_stored(device, data, existing, tmp_path, monkeypatch,
                                                                  capsys):
    # a CPU machine, also on a GPU runner
    monkeypatch.setattr("latentsweep.search.study.preflight.cuda_count", lambda: 0)
    study = tmp_path / "dev.toml"
    study.write_text(GOOD_STUDY.replace("batch_size = 64", f'batch_size = 64\ndevice = "{device}"'))
    state = tmp_path / "state"
    code = main(["run", str(study), "--time", "60", "--data", str(data["train"]), "--test", str(data["test"]),
                 "--state-dir", str(state), "--quiet"])
    _, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and f"'{device}'" in err, err
    assert not state.exists()


ENV_CASES = {  # variable, value, fragments of the one-line error (never the option the user did not type)
    "gpus_not_numbers": ("LATENTSWEEP_GPUS", "x,y", ["$LATENTSWEEP_GPUS"]),
    "per_gpu_not_a_number": ("LATENTSWEEP_PER_GPU", "abc", ["$LATENTSWEEP_PER_GPU must be a whole number"]),
    "per_gpu_zero": ("LATENTSWEEP_PER_GPU", "0", ["$LATENTSWEEP_PER_GPU must be >= 1"]),
    "per_gpu_without_gpus": ("LATENTSWEEP_PER_GPU", "2", ["$LATENTSWEEP_PER_GPU needs --gpus"]),
}


@pytest.mark.parametrize("case", sorted(ENV_CASES))
def test_an_environment_error_names_the_variable(case, data, existing, tmp_path, monkeypatch, capsys):
    variable, value, fragments = ENV_CASES[case]
    monkeypatch.setenv(variable, value)
    state = tmp_path / "state"
    code = main(["study", "run", str(existing["study_file"]), "--data", str(data["train"]), "--state-dir",
                 str(state), "--quiet"])
    line = assert_rejected(capsys, code, existing, *fragments, absent=[state])
    assert "--gpus " not in line.split("needs")[0] and "--per-gpu" not in line


# ---- the Python API's progress sink ---------------------------------------------------------------------------------

@pytest.mark.parametrize("sink,fragment", [(42, "must be a callable"), ("stderr", "must be a callable"),
                                           (lambda: None, "must take one argument"),
                                           (lambda a, b: None, "must take one argument")])
def test_a_sink_that_cannot_take_a_line_is_refused_up_front(sink, fragment):
    from latentsweep.trainers.core.progress import progress_to, say
    from latentsweep.trainers.core.errors import LatentsweepError

    with pytest.raises(LatentsweepError, match=fragment):
        with progress_to(sink):
            say("never")


def test_a_sink_that_raises_is_ignored_with_one_warning(capsys):
    from latentsweep.trainers.core.progress import progress_to, say

    def broken(line):
        raise RuntimeError("sink down")

    with progress_to(broken):
        for n in range(3):
            say(f"line {n}")
    err = capsys.readouterr().err
    assert err.count("progress sink raised RuntimeError: sink down") == 1, err


def test_progress_false_says_nothing_not_even_optunas_warnings(data, tmp_path, capfd):
    import warnings

    from latentsweep.search import api

    study = tmp_path / "quiet.toml"
    study.write_text(GOOD_STUDY.replace(f'name = "{NAME}"', 'name = "quiet"'))
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # what a notebook shows by default, once per place
        api.run_study(str(study), data=str(data["train"]), state_dir=str(tmp_path / "state"), progress=False)
    out, err = capfd.readouterr()
    assert out == "" and err == "", err


# ---- data: a tiny train file and a bad test file ------------------------------------------------------------------

@pytest.mark.parametrize("change,fragment", [
    (lambda a: a["captions/embeddings"].__setitem__((3, 2), float("nan")), "NaN"),
    (lambda a: a.update({"captions/embeddings": (a["captions/embeddings"] * 10).astype("int64")}), "dtype int64"),
])
def test_a_test_file_with_nan_or_integer_embeddings_is_refused_before_anything_is_stored(
        change, fragment, data, existing, tmp_path, capsys):
    import numpy as np

    arrays = dict(np.load(data["test"]))
    arrays["captions/embeddings"] = arrays["captions/embeddings"].copy()
    change(arrays)
    bad = tmp_path / "bad_test.npz"
    np.savez(bad, **arrays)
    state = tmp_path / "state"
    code = main(["run", str(existing["study_file"]), "--time", "60", "--data", str(data["train"]), "--test",
                 str(bad), "--state-dir", str(state), "--quiet"])
    assert_rejected(capsys, code, existing, "bad_test.npz", fragment, absent=[state])


@pytest.mark.slow  # a one-trial study and a pick: 15-30 s on 2 loaded cores
def test_a_ten_image_train_file_is_one_line_not_a_traceback(tmp_path, capsys):
    from latentsweep.trainers.data.synthetic import write_synthetic

    train, test, _ = write_synthetic(tmp_path / "ten", 10, dim_text=24, dim_image=32, n_test=20)
    study = tmp_path / "ten.toml"
    study.write_text(GOOD_STUDY.replace("val_ratio = 0.25", "val_ratio = 0.2").replace(NAME, "ten"))
    state = tmp_path / "state"
    assert main(["study", "run", str(study), "--data", str(train), "--state-dir", str(state), "--quiet"]) == 0
    capsys.readouterr()
    code = main(["pick", "ten", "--state-dir", str(state), "--out", str(tmp_path / "sub.csv"), "--no-refit",
                 "--quiet", "--test", str(test)])
    _, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("latentsweep: error:")]
    assert code == 2 and "Traceback" not in err and len(errors) == 1, err  # 1 val image (demo's ratio, 10 images)
    assert "val split has 1 image(s)" in errors[0] and not (tmp_path / "sub.csv").exists()


def test_an_earlier_jobs_submission_is_kept_aside_with_its_manifest(tmp_path, capsys):
    """`run` moves an earlier job's submission, manifest and report aside before its floor is written: a run stopped
    at any moment never leaves a submission beside another job's manifest."""
    from latentsweep.search.cli.run import keep_earlier

    out = tmp_path / "sub.csv"
    files = {out: "earlier csv", tmp_path / "sub.manifest.json": "{}", tmp_path / "sub.report.csv": "report"}
    for path, text in files.items():
        path.write_text(text)
    keep_earlier(out)
    assert not [p for p in files if p.exists()]
    assert (tmp_path / "sub.earlier.csv").read_text() == "earlier csv"
    assert (tmp_path / "sub.earlier.manifest.json").read_text() == "{}"
    assert (tmp_path / "sub.earlier.report.csv").read_text() == "report"
    assert "kept aside as" in capsys.readouterr().err
    keep_earlier(out)  # nothing there: nothing said
    assert capsys.readouterr().err == ""
