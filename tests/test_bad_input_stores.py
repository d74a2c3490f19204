"""Hostile-input corpus, part 4 (issue 20, section 4): the stores themselves turn hostile. A state directory on a file
system that fills up during a trial, one mounted read-only, and two `study run` of the same name started at once.
Full and read-only file systems are real (a small tmpfs, mounted by root; skipped where mounting is not allowed)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from conftest import tiny_study_file as study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
HEARTBEAT = ("--heartbeat", "1", "--grace", "2")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB tmpfs at tmp_path/fs (unmounted afterwards); skipped where mounting is not allowed."""
    mount = tmp_path / "fs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def statuses(state: Path, name: str) -> dict[str, str]:
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    return {r.info.run_name: r.info.status for r in client.search_runs([exp.experiment_id])}


def trials(state: Path, name: str) -> list[str]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")
    return [t.state.name for t in study.trials]


FILL = """
import os
from pathlib import Path
from latentsweep.trainers.losses.core import InfoNCE

real = InfoNCE.terms

def terms(self, *args, **kwargs):  # the disk fills up while the first trial trains (another program's file)
    filler = Path(os.environ["LATENTSWEEP_FILL"])
    if not filler.exists():
        with open(filler, "wb") as fh:
            try:
                while True:
                    fh.write(b"x" * (1 << 20))
            except OSError:
                pass
    return real(self, *args, **kwargs)

InfoNCE.terms = terms
"""


def test_storage_full_during_a_trial_stops_in_one_line_and_reap_closes_every_run(small_fs, synthetic, tmp_path):
    state, name = small_fs / "state", "fullfs"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FILL)
    env = {**__import__("os").environ, "LATENTSWEEP_FILL": str(small_fs / "filler"),
           "PYTHONPATH": f"{hook}:{ROOT}"}
    sf = study_file(tmp_path, name, n_trials=2, epochs=2)
    proc = subprocess.run([sys.executable, "-m", "latentsweep", "study", "run", str(sf), "--data", str(synthetic),
                           "--state-dir", str(state), "--quiet", *HEARTBEAT], capture_output=True, text=True,
                          env=env, timeout=600, cwd=ROOT)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and err[-1].startswith("latentsweep: error: "), proc.stderr
    assert "full" in err[-1] or "No space left" in err[-1], err[-1]
    (small_fs / "filler").unlink()  # the user frees the space, then reaps
    # once the dead worker's last heartbeat is older than --grace (2 s): reaping within it finds the trial alive, and
    # a suite run once did
    time.sleep(3)
    assert main(["study", "reap", name, "--state-dir", str(state), *HEARTBEAT]) == 0
    states = trials(state, name)
    assert "RUNNING" not in states and "COMPLETE" not in states[:1]
    assert "RUNNING" not in statuses(state, name).values(), statuses(state, name)  # the parent run too
    assert main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet",
                 *HEARTBEAT]) == 0  # the retry runs, the budget is exact
    assert trials(state, name).count("COMPLETE") == 2


@pytest.fixture
def read_only_view(tmp_path):
    """make(path) -> a read-only bind mount of `path` (unmounted afterwards); skipped where mounting is not allowed."""
    mounts = []

    def make(path: Path) -> Path:
        view = tmp_path / f"ro-{len(mounts)}"
        view.mkdir()
        if subprocess.run(["mount", "--bind", str(path), str(view)], capture_output=True).returncode:
            pytest.skip("cannot bind-mount here (needs root)")
        mounts.append(view)
        subprocess.run(["mount", "-o", "remount,bind,ro", str(view)], check=True)
        return view

    yield make
    for view in mounts:
        subprocess.run(["umount", "-l", str(view)], check=False)


def test_a_read_only_state_directory(read_only_view, synthetic, tmp_path, capsys):
    name = "rostate"
    sf = study_file(tmp_path, name, n_trials=1, epochs=1)
    assert main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(tmp_path / "state"),
                 "--quiet"]) == 0
    state = read_only_view(tmp_path / "state")
    capsys.readouterr()
    for command in ("run", "create", "worker"):
        code = main(["study" if command != "worker" else "worker", *([command] if command != "worker" else []),
                     str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet", "--n-trials", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("latentsweep: error: "), err
        assert "is not writable: Read-only file system" in err[0], err
    assert main(["study", "status", name, "--state-dir", str(state)]) == 0  # reading still works
    assert trials(tmp_path / "state", name) == ["COMPLETE"]  # unchanged (read through the writable path)


def test_two_same_name_studies_started_at_once_share_one_budget(synthetic, tmp_path):
    state, name = tmp_path / "state", "twins"
    sf = study_file(tmp_path, name, n_trials=3, epochs=1)
    cmd = [sys.executable, "-m", "latentsweep", "study", "run", str(sf), "--data", str(synthetic), "--state-dir",
           str(state), "--quiet"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert all("Traceback" not in err for _, err in outs)
    assert trials(state, name) == ["COMPLETE"] * 3  # one study, one budget (not 3 each)
    runs = statuses(state, name)
    assert sorted(runs) == [f"study-{name}", "trial-0", "trial-1", "trial-2"]  # one parent run
    assert "RUNNING" not in runs.values()
