"""Every study file trains: `latentsweep train` for one epoch on small synthetic data (labelled for the multilabel
recipe), and a one-trial `study run` of full.toml (lightning-hydra-template style: a recipe that cannot start is a
regression, whatever the study that uses it)."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from latentsweep.search.cli.main import main
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.data.synthetic import write_synthetic

STUDIES = sorted((Path(__file__).resolve().parents[1] / "studies").glob("*.toml"))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("studyfiles")
    train, _, _ = write_synthetic(root, 160, dim_text=24, dim_image=32, n_labels=6)
    return train


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("study", STUDIES, ids=lambda p: p.stem)
def test_every_study_file_trains_one_epoch(study, data, tmp_path):
    # Warm-up longer than one epoch is rejected by design, so it is zeroed for the one-epoch run.
    code, stdout, stderr = _run(["train", str(study), "--data", str(data), "--epochs", "1", "--quiet",
                                 "--set", "schedule.warmup_epochs=0", "--out", str(tmp_path / "run")])
    assert code == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["best_epoch"] == 0 and 0.0 < summary["val/mrr"] <= 1.0
    assert (tmp_path / "run" / "best.pt").is_file()


def test_full_study_runs_one_trial(data, tmp_path):
    study = next(p for p in STUDIES if p.stem == "full")
    name = load_study_file(study).name
    code, _, stderr = _run(["study", "run", str(study), "--data", str(data), "--n-trials", "1", "--quiet",
                            "--state-dir", str(tmp_path / "state")])
    assert code == 0, stderr
    import optuna

    trials = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'state' / 'optuna.db'}").trials
    ran = [t for t in trials if t.state.name != "WAITING"]  # the other enqueued recipes wait for later trials
    assert len(ran) == 1 and ran[0].state.name in ("COMPLETE", "PRUNED")
