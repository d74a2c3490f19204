"""Tests of `latentsweep train` and `latentsweep predict` through latentsweep.search.cli.main.main, on tiny synthetic
data."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import tomllib
from pathlib import Path

import pytest
import torch

from latentsweep.search.cli.main import main
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.config.tree import from_dict
from latentsweep.trainers.data.sets import load_test
from latentsweep.trainers.eval.submission import check_submission, read_submission
from latentsweep.trainers.data.synthetic import write_synthetic

QUICKSTART = str(Path(__file__).resolve().parents[1] / "studies" / "quickstart.toml")


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    train, test, _ = write_synthetic(root / "good", 300, dim_text=32, dim_image=48, n_test=40)
    _, wrong_test, _ = write_synthetic(root / "wrong", 20, dim_text=16, dim_image=48, n_test=10)
    return {"train": train, "test": test, "wrong_test": wrong_test}


def run_main(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def trained(syn, tmp_path_factory):
    out = tmp_path_factory.mktemp("train") / "run"
    code, stdout, stderr = run_main(["train", QUICKSTART, "--data", str(syn["train"]), "--epochs", "2",
                                     "--set", "model.hidden=64", "--out", str(out), "--quiet"])
    return code, stdout, stderr, out


# ---------------------------------------------------------------------------------------------- train

def test_train_prints_json_summary_last(trained):
    code, stdout, stderr, out = trained
    assert code == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert isinstance(summary, dict)
    assert 0.0 < summary["val/mrr"] <= 1.0
    assert summary["best_epoch"] in (0, 1)
    assert Path(summary["checkpoint"]) == out / "best.pt"
    assert json.loads((out / "result.json").read_text()) == summary


def test_train_writes_config_metrics_and_checkpoint(trained, syn):
    _, _, _, out = trained
    cfg = from_dict(tomllib.loads((out / "config.toml").read_text()))
    # The study's base with the command-line overrides applied, and the data path made explicit.
    assert cfg.model.hidden == (64,) and cfg.train.epochs == 2
    assert cfg.optim.name == "adamw" and cfg.loss.infonce.weight == 1.0  # from studies/quickstart.toml [base]
    assert cfg.data.path == str(syn["train"])
    with open(out / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["epoch"]) for r in rows] == [0, 1]
    model, ckpt_cfg, meta = load_model(out / "best.pt")
    assert ckpt_cfg == cfg
    assert model.text_mean.shape == (32,)


def test_train_unknown_override_key_exits_2(syn, tmp_path):
    code, stdout, stderr = run_main(["train", QUICKSTART, "--data", str(syn["train"]),
                                     "--set", "loss.triplet.margn=1", "--out", str(tmp_path / "x"), "--quiet"])
    assert code == 2
    assert stderr.startswith("latentsweep: error:")
    assert "did you mean 'loss.triplet.margin'" in stderr
    assert len(stderr.strip().splitlines()) == 1  # one line, no traceback
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv, fragment", [
    (["--set", "train.epochs=zero"], "train.epochs: expected int"),
    (["--set", "novalue"], "not of the form key=value"),
    (["--set", "data.val_ratio=2"], "above the maximum"),
])
def test_train_bad_override_values_exit_2(syn, tmp_path, argv, fragment):
    code, _, stderr = run_main(["train", QUICKSTART, "--data", str(syn["train"]), "--out", str(tmp_path / "x"),
                                "--quiet", *argv])
    assert code == 2 and fragment in stderr


def test_train_missing_study_or_data_exit_2(syn, tmp_path):
    code, _, stderr = run_main(["train", str(tmp_path / "nope.toml"), "--data", str(syn["train"])])
    assert code == 2 and "file not found" in stderr
    code, _, stderr = run_main(["train", QUICKSTART, "--data", str(tmp_path / "nope.npz"),
                                "--out", str(tmp_path / "x"), "--quiet"])
    assert code == 2 and "nope.npz" in stderr


# ---------------------------------------------------------------------------------------------- predict

def test_predict_writes_a_valid_submission(trained, syn, tmp_path):
    _, _, _, out = trained
    sub = tmp_path / "sub.csv"
    code, stdout, stderr = run_main(["predict", str(out / "best.pt"), "--test", str(syn["test"]), "--out", str(sub)])
    assert code == 0, stderr
    test = load_test(syn["test"])
    check_submission(sub, test, dim=48)
    ids, emb = read_submission(sub)
    assert list(ids) == list(test.ids)
    assert emb.shape == (40, 48)
    # The submission is the checkpoint's prediction (L2-normalised output: quickstart keeps out_norm on).
    model, _, _ = load_model(out / "best.pt")
    with torch.no_grad():
        expected = model(torch.as_tensor(test.embeddings))["pred"].numpy()
    assert emb == pytest.approx(expected, abs=1e-5)
    assert "40 rows" in stdout


def test_predict_wrong_text_dim_exits_2_and_writes_nothing(trained, syn, tmp_path):
    _, _, _, out = trained
    sub = tmp_path / "sub.csv"
    code, _, stderr = run_main(["predict", str(out / "best.pt"), "--test", str(syn["wrong_test"]),
                                "--out", str(sub)])
    assert code == 2
    assert "dim 16" in stderr and "expects 32" in stderr
    assert not sub.exists()
    assert list(tmp_path.iterdir()) == []


def test_predict_missing_checkpoint_exits_2(syn, tmp_path):
    code, _, stderr = run_main(["predict", str(tmp_path / "none.pt"), "--test", str(syn["test"]),
                                "--out", str(tmp_path / "s.csv")])
    assert code == 2 and "checkpoint not found" in stderr
