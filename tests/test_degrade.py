"""Degrade, never fail: a store outage or a full disk inside the search of `latentsweep run` ends the search, not the
job. The failure is real and below the code under test: the study's PostgreSQL database is dropped while the search
runs (no monkeypatch), or the disk under the trials' checkpoints is filled. The job still ends with a valid
submission, exit 0, and one line naming the submission and why the search ended."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
import types
import uuid
from pathlib import Path

import optuna
import pytest

from conftest import tiny_study_file
from latentsweep.trainers.data.sets import load_test
from latentsweep.trainers.eval.submission import check_submission
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
PG = dict(host="127.0.0.1", port=5432, user="postgres", dbname="postgres", connect_timeout=5)


def _admin():
    import psycopg2

    conn = psycopg2.connect(**PG)
    conn.autocommit = True  # CREATE/DROP DATABASE cannot run in a transaction
    return conn


@pytest.fixture
def pg_db():
    """A fresh database (dropped at the end, if the test did not); skips only when the server is unreachable."""
    psycopg2 = pytest.importorskip("psycopg2")
    try:
        conn = _admin()
    except psycopg2.OperationalError as exc:
        pytest.skip(f"PostgreSQL unreachable: {str(exc).strip().splitlines()[0]}")
    name = f"ls_degrade_{uuid.uuid4().hex[:12]}"
    with conn.cursor() as cur:
        cur.execute(f'CREATE DATABASE "{name}"')
    try:
        yield name
    finally:
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        conn.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("degrade")
    train, test, _ = write_synthetic(root / "data", 240, dim_text=24, dim_image=32, n_test=60)
    return types.SimpleNamespace(root=root, train=train, test=test)


def _finished(url: str, name: str) -> int:
    try:
        study = optuna.load_study(study_name=name, storage=url)
    except Exception:  # noqa: BLE001 - not created yet
        return 0
    return sum(t.state.is_finished() for t in study.get_trials(deepcopy=False))


def _run_with_fault(cmd: list[str], tmp_path: Path, url: str, name: str, fault) -> tuple[int, str]:
    """Start `cmd` (a `latentsweep run` of 300 s: on a loaded machine the search keeps half of it, time for 2 trials),
    call `fault()` once study `name` at `url` has 2 finished trials, and wait for the job's end: (its exit code, its
    stderr)."""
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        give_up = time.monotonic() + 120
        while _finished(url, name) < 2 and proc.poll() is None and time.monotonic() < give_up:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        fault()
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


def _submission_line(world, state: Path, name: str, code: int, err: str) -> str:
    """The job ended with exit 0, no traceback and a valid submission: its one `submission:` line."""
    assert code == 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    submission = state / "picks" / name / "submission.csv"
    assert check_submission(submission, load_test(world.test), dim=32) == (60, 32)
    last = [line for line in err.splitlines() if line.startswith("latentsweep: submission:")]
    assert len(last) == 1 and str(submission) in last[0], err[-3000:]
    return last[0]


@pytest.mark.slow  # 30-60 s on 2 cores: a run until its first trials, then the outage and the job's end
def test_a_store_dropped_mid_search_ends_the_search_not_the_job(world, tmp_path, pg_db):
    url = f"postgresql+psycopg2://postgres@127.0.0.1:5432/{pg_db}"
    study = tiny_study_file(tmp_path, "outage", n_trials=200, epochs=3)
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "latentsweep", "run", str(study), "--time", "300", "--storage", url, "--data",
           str(world.train), "--test", str(world.test), "--state-dir", str(state), "--quiet"]

    def outage() -> None:  # the study's database is gone
        conn = _admin()
        with conn.cursor() as cur:
            cur.execute(f'DROP DATABASE "{pg_db}" WITH (FORCE)')
        conn.close()

    line = _submission_line(world, state, "outage", *_run_with_fault(cmd, tmp_path, url, "outage", outage))
    assert "the search ended early" in line
    submission = state / "picks" / "outage" / "submission.csv"
    doc = json.loads(submission.with_name("submission.manifest.json").read_text())
    assert doc["answer"]["winner"] == doc["made_by"]


@pytest.fixture
def small_disk(tmp_path):
    """A 64-MB tmpfs at tmp_path/state/studies (where trials write their checkpoints), unmounted at the end: a real
    filesystem that can be filled. Skips where this process may not mount one (not root, no CAP_SYS_ADMIN)."""
    where = tmp_path / "state" / "studies"
    where.mkdir(parents=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc})")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


def _fill(where: Path) -> None:
    """Write zeros into `where` until its filesystem says ENOSPC."""
    block = bytes(1 << 20)
    with open(where / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(block)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


@pytest.mark.slow  # 30-60 s on 2 cores: a run until its first trials, then the full disk and the job's end
def test_a_disk_filled_mid_search_ends_the_search_not_the_job(world, tmp_path, small_disk):
    """The disk under the trials' checkpoints fills while the search runs (no monkeypatch: the filesystem says
    ENOSPC): the job still ends with the submission in place, exit 0, one line saying why the search ended, and no
    trial or MLflow run left RUNNING."""
    study = tiny_study_file(tmp_path, "fulldisk", n_trials=200, epochs=3)
    state = tmp_path / "state"
    cmd = [sys.executable, "-m", "latentsweep", "run", str(study), "--time", "300", "--data", str(world.train),
           "--test", str(world.test), "--state-dir", str(state), "--quiet"]
    url = f"sqlite:///{state / 'optuna.db'}"
    line = _submission_line(world, state, "fulldisk",
                            *_run_with_fault(cmd, tmp_path, url, "fulldisk", lambda: _fill(small_disk)))
    assert "the search ended early" in line and "No space left on device" in line, line
    stored = optuna.load_study(study_name="fulldisk", storage=url).get_trials(deepcopy=False)
    assert not [t.number for t in stored if t.state == optuna.trial.TrialState.RUNNING]


@pytest.mark.slow  # 3 short trainings: 15 s on 2 cores, 60 s with the load average at 13
def test_a_pick_job_stops_at_the_deadline_or_is_dropped_with_its_seconds(world, tmp_path):
    """The pick's jobs run on the job's one deadline: a refit whose deadline has passed is dropped (no checkpoint,
    its seconds said); one cut by the deadline after its first epoch keeps what finished and is not stamped done (the
    next pick trains it again whole); one with time to spare is stamped done."""
    from latentsweep.search.pick.jobs import DONE_FILE, Job, run_job
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.trainers.config.tree import with_values
    from latentsweep.trainers.data.sets import load_train
    from latentsweep.trainers.core.deadline import Deadline

    data = load_train(world.train)
    base = load_study_file(tiny_study_file(tmp_path, "jobs", epochs=1)).base
    cfg = with_values(base, {"data.split": "all", "data.path": str(world.train)})
    ckpt, seconds = run_job(Job("m/refit-seed-0", "m", cfg, None, tmp_path / "late", 1.0), data, False,
                            Deadline.after(-1.0))
    assert ckpt is None and seconds is not None and seconds >= 0.0
    ckpt, one = run_job(Job("m/refit-seed-1", "m", cfg, None, tmp_path / "whole", 1.0), data, False,
                        Deadline.never())
    assert ckpt is not None and (tmp_path / "whole" / DONE_FILE).is_file()
    # 3x what one epoch and the start-up took: the first epoch ends inside it (the machine may be loaded), and the
    # 5,000 planned epochs never do
    long = with_values(cfg, {"train.epochs": 5000})
    ckpt, seconds = run_job(Job("m/refit-seed-2", "m", long, None, tmp_path / "cut", 60.0), data, False,
                            Deadline.after(3 * one + 1.0))
    assert ckpt is not None and ckpt.is_file() and not (tmp_path / "cut" / DONE_FILE).exists()
    assert seconds < 3 * one + 1.0 + 5 * one
