"""Hostile-input corpus, part 6 (issue 39): outputs that resolve (directly or through a symlink) to an input, a store
or a checkpoint; studies whose trial attributes are damaged; bad devices and environment variables; the Python API's
progress sink; degenerate data. Same contract as the earlier parts (bad_input_kit.assert_rejected): exit 2, one line,
nothing written, the existing study and its runs unchanged."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from bad_input_kit import GOOD_STUDY, NAME, assert_rejected
from search.cli.main import main

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
