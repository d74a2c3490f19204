"""Kill-proof (issue 39): a trial whose local worker is gone is failed and retried at once (not after the heartbeat's
grace), and `latentsweep run` killed (SIGKILL, SIGTERM, SIGINT) at many moments across its phases leaves --out absent
or a complete valid submission, no worker process alive, no temporary folder (on a signal it can handle), and is
resumed by the same command, which answers; nothing is RUNNING in Optuna or MLflow at the end."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import pytest

from conftest import default_sigint, tiny_study_file
from search.cli.main import build_parser
from search.cli.study import make_spec
from search.study.owners import OWNER_ATTR, worker_id
from search.study.studyfile import load_study_file
from search.study.worker import claim_trial, dispose_study, load_or_create, reap
from search.tracking import make_tracker
from trainers.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("kill")
    train, test, _ = write_synthetic(root / "data", 240, dim_text=24, dim_image=32, n_test=100)
    return root, train, test


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_gone_local_workers_trial_is_failed_at_once_and_a_live_ones_is_not(world, tmp_path):
    _, train, _ = world
    sf = tiny_study_file(tmp_path, "gone", n_trials=3)
    args = build_parser().parse_args(["study", "run", str(sf), "--data", str(train), "--state-dir",
                                      str(tmp_path / "state")])
    spec = make_spec(args)  # the default heartbeat: 60 s, grace 180 s
    tracker = make_tracker(spec.tracking_uri, spec.artifact_root)
    study = load_or_create(load_study_file(sf), spec, tracker)
    try:
        first, second = claim_trial(study, 3), claim_trial(study, 3)
        study._storage.set_trial_user_attr(first._trial_id, OWNER_ATTR, worker_id(_dead_pid()))
        study._storage.set_trial_user_attr(second._trial_id, OWNER_ATTR, worker_id(os.getppid()))  # alive
        reap(study, tracker)
        states = [t.state.name for t in study.get_trials()]
        assert states == ["FAIL", "RUNNING", "WAITING"], states  # the dead one's retry queued, the live one runs
        assert study.get_trials()[2].system_attrs["failed_trial"] == 0
        elsewhere = claim_trial(study, 3)  # a worker of another machine with the same pid is not this machine's
        study._storage.set_trial_user_attr(elsewhere._trial_id, OWNER_ATTR, f"otherhost:{_dead_pid()}")
        reap(study, tracker)
        assert study.get_trials()[2].state.name == "RUNNING"
    finally:
        dispose_study(study)
