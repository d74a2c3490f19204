"""A study as MLflow and Optuna users see it, through their own APIs: plain progress lines in a log file, the pick
run's model loaded where latentsweep cannot be imported, and a state directory copied, then moved."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import optuna
import pytest
from mlflow import MlflowClient

from conftest import tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.eval.submission import read_submission
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
STUDY = "e2e"
TRIALS = 3


def cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """The CLI in a subprocess with stdout and stderr redirected to files (not a terminal), as in CI or nohup."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "latentsweep", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 3-trial study run by the CLI with stderr captured, then a registered pick."""
    root = tmp_path_factory.mktemp("e2e")
    train, test, _ = write_synthetic(root / "data", 240, dim_text=24, dim_image=32, n_test=60)
    study_file = tiny_study_file(root, STUDY, n_trials=TRIALS, epochs=2)
    state = root / "state"
    done = cli("study", "run", str(study_file), "--data", str(train), "--state-dir", str(state), "--quiet")
    assert done.returncode == 0, done.stderr
    out = root / "picked" / "submission.csv"
    assert main(["pick", STUDY, "--state-dir", str(state), "--top", "3", "--register", "e2e-ensemble",
                 "--out", str(out), "--quiet"]) == 0
    manifest = json.loads(out.with_name("submission.manifest.json").read_text())
    return types.SimpleNamespace(root=root, state=state, train=train, test=test, study_file=study_file,
                                 err=done.stderr, out=out, manifest=manifest)


def test_log_file_has_one_plain_line_per_trial(world):
    assert "\r" not in world.err and "\x1b[" not in world.err  # no bars, no cursor codes in a file
    lines = [line for line in world.err.splitlines() if f"study {STUDY} trial" in line]
    assert len(lines) == TRIALS  # --quiet keeps the per-trial lines; no epoch lines without --verbose
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{world.state / 'optuna.db'}")
    best = -np.inf
    for line, trial in zip(lines, study.trials):
        best = max(best, trial.value)
        assert line.startswith(f"study {STUDY} trial {trial.number} COMPLETE")
        assert f"value {trial.value:.4f}" in line and f"best {best:.4f}" in line and " s" in line


def test_verbose_adds_one_line_per_epoch(world):
    sf = tiny_study_file(world.root, "verbose", n_trials=1, epochs=2)
    done = cli("study", "run", str(sf), "--data", str(world.train), "--state-dir", str(world.root / "v"),
               "--verbose")
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    epochs = [line for line in done.stderr.splitlines() if " epoch " in line and "trial 0" in line]
    assert [line.split(" epoch ")[1].split()[0] for line in epochs] == ["0", "1"]
    assert sum("study verbose trial 0 COMPLETE" in line for line in done.stderr.splitlines()) == 1


def test_study_commands_address_a_study_by_name(world, capsys):
    assert main(["study", "list", "--state-dir", str(world.state)]) == 0
    out = capsys.readouterr().out
    assert STUDY in out and "val/mrr" in out
    assert main(["study", "status", STUDY, "--state-dir", str(world.state)]) == 0
    lines = capsys.readouterr().out.splitlines()
    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{world.state / 'optuna.db'}")
    assert lines[0].startswith(f"study {STUDY}: maximize val/mrr, {TRIALS} trials ({TRIALS} complete)")
    assert f"best {study.best_value:.4f} (trial {study.best_trial.number})" in lines[0]
    numbers = [int(line.split()[0]) for line in lines[2:]]
    ranked = sorted(study.trials, key=lambda t: -t.value)
    assert numbers == [t.number for t in ranked]  # best first
    assert main(["study", "reap", STUDY, "--state-dir", str(world.state)]) == 0
    assert "closed 0 stale MLflow run(s)" in capsys.readouterr().out
    assert main(["study", "reap", "nosuch", "--state-dir", str(world.state)]) == 2
    assert main(["--version"]) == 0  # main returns exit codes (argparse's SystemExit included)
    assert capsys.readouterr().out.startswith("latentsweep ")


def test_pick_run_and_model_carry_their_story(world):
    client = MlflowClient(f"sqlite:///{world.state / 'mlflow.db'}")
    run = client.get_run(world.manifest["mlflow"]["run_id"])
    assert "Gain over the best single member" in run.data.tags["mlflow.note.content"]
    assert "ensemble_weights.png" in {a.path for a in client.list_artifacts(run.info.run_id)}
    contexts = {d.dataset.name: {t.key: t.value for t in d.tags}["mlflow.data.context"]
                for d in run.inputs.dataset_inputs}
    assert contexts == {world.train.name: "train", world.test.name: "test"}
    model = client.get_logged_model(world.manifest["mlflow"]["model_id"])
    assert model.name == f"{STUDY}-ensemble"
    assert model.params["method"] == "greedy" and "members" not in model.params
    assert {m.key for m in model.metrics} >= {"gain_mrr", "gain_mrr_se"}
    assert "best single" in model.tags["mlflow.note.content"]


STANDALONE = textwrap.dedent("""
    import importlib.abc, json, sys
    class NoProject(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] == "latentsweep":
                raise ModuleNotFoundError(f"No module named '{name}' (blocked: latentsweep is not installed)")
            return None
    sys.meta_path.insert(0, NoProject())
    try:
        import latentsweep  # noqa: F401
        raise SystemExit("latentsweep is importable: the check would prove nothing")
    except ModuleNotFoundError:
        pass
    import numpy as np, mlflow.pyfunc
    x = np.load(sys.argv[2])
    model = mlflow.pyfunc.load_model(sys.argv[1])
    outs = [model.predict(x.astype(np.float32)), model.predict(x.astype(np.float64)), model.predict(x.tolist())]
    assert not any(m.split(".")[0] == "latentsweep" for m in sys.modules)
    np.save(sys.argv[3], np.stack(outs))
""")


def standalone_predict(tmp_path: Path, model_uri: str, x: np.ndarray, tracking_uri: str) -> np.ndarray:
    """Load and predict in a fresh interpreter where search/trainers cannot be imported; float32, float64, lists."""
    script, inputs, outputs = tmp_path / "load.py", tmp_path / "x.npy", tmp_path / "y.npy"
    script.write_text(STANDALONE)
    np.save(inputs, x)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["MLFLOW_TRACKING_URI"] = tracking_uri
    done = subprocess.run([sys.executable, str(script), model_uri, str(inputs), str(outputs)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return np.load(outputs)


def test_model_loads_and_predicts_without_latentsweep(world, tmp_path):
    from latentsweep.trainers.data.sets import load_test

    test = load_test(world.test)
    ids, vectors = read_submission(world.out)
    tracking = f"sqlite:///{world.state / 'mlflow.db'}"
    preds = standalone_predict(tmp_path, "models:/e2e-ensemble/1", test.embeddings, tracking)
    for pred in preds:  # float32, float64 and lists give the submission's vectors
        assert pred.shape == vectors.shape and np.allclose(pred, vectors, atol=1e-5)


def test_copied_then_moved_state_dir_keeps_commands_and_ui_working(world, tmp_path):
    from latentsweep.search.ui import servers

    copy = tmp_path / "copy"
    shutil.copytree(world.state, copy)
    moved = tmp_path / "elsewhere" / "state"
    moved.parent.mkdir()
    copy.rename(moved)
    hidden = world.state.with_name("hidden")
    world.state.rename(hidden)  # the original is gone: nothing may still point into it
    try:
        assert main(["study", "status", STUDY, "--state-dir", str(moved)]) == 0
        tracking = f"sqlite:///{moved / 'mlflow.db'}"
        client = MlflowClient(tracking)
        exp = client.get_experiment_by_name(STUDY)
        assert exp.artifact_location.startswith(moved.as_uri())
        trial = client.search_runs([exp.experiment_id], "tags.`latentsweep.role` = 'trial'")[0]
        assert {"best.pt", "config.toml"} <= {a.path for a in client.list_artifacts(trial.info.run_id)}
        assert Path(client.download_artifacts(trial.info.run_id, "config.toml", str(tmp_path))).is_file()
        out = tmp_path / "again.csv"
        assert main(["pick", STUDY, "--state-dir", str(moved), "--top", "2", "--out", str(out), "--quiet"]) == 0
        manifest = json.loads(out.with_name("again.manifest.json").read_text())
        assert {m["origin"] for m in manifest["members"]} == {"local"}  # Optuna's relative checkpoint paths
        assert all(str(moved) in m["checkpoint"] for m in manifest["members"])
        from latentsweep.trainers.data.sets import load_test

        x = load_test(world.test).embeddings[:5]
        assert standalone_predict(tmp_path, "models:/e2e-ensemble/1", x, tracking).shape == (3, 5, 32)

        handle = servers.start_ui(moved, mlflow_port=servers.free_port(), dashboard_port=servers.free_port())
        try:
            listed = servers.http_json(f"{handle.mlflow_url}/api/2.0/mlflow/artifacts/list?run_id="
                                       f"{trial.info.run_id}")
            assert "best.pt" in {f["path"] for f in listed["files"]}
            studies = servers.http_json(handle.dashboard_url + "/api/studies")["study_summaries"]
            assert STUDY in [s["study_name"] for s in studies]
        finally:
            handle.stop()
    finally:
        hidden.rename(world.state)
