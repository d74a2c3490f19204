"""Hostile values of the GPU surfaces (--gpus, --per-gpu, --workers, --population, train.device, the pick's --device,
CUDA_VISIBLE_DEVICES, $LATENTSWEEP_GPUS/$LATENTSWEEP_PER_GPU, the slot locks of `worker`) on a machine with one CUDA
device and on one with none. Each either works and says in one line what it uses (GPUs, workers, population), or
ends within seconds with exit code 2 and one `latentsweep: error:` line naming the bad value and the valid choices,
with nothing stored: no state directory left where there was none, no study, no MLflow run. The real CLI and real
SQLite stores; only torch's device queries are faked (as tests/test_devices.py does), and reaching the worker spawn
in a refused case fails the test (a huge --workers must never get that far)."""
from __future__ import annotations

import contextlib
import io
import os
import sqlite3
import time
from pathlib import Path

import optuna
import pytest
import torch

from conftest import tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.data.synthetic import write_synthetic

VISIBLE = "CUDA_VISIBLE_DEVICES"
REFUSED_WITHIN_S = 10.0  # "within seconds": every check below reads options, the study file and the data only
HUGE = "1000000000"  # far above any machine's worker processes or population


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_hostile")
    train, test, _ = write_synthetic(root / "syn", 120, dim_text=8, dim_image=12, n_test=20)
    return {"train": train, "test": test, "root": root}


def fake_gpus(monkeypatch, count: int, env: dict[str, str] | None = None) -> None:
    """torch sees `count` CUDA devices (nothing initialises CUDA); the device variables are the case's only."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    for name in (VISIBLE, "LATENTSWEEP_GPUS", "LATENTSWEEP_PER_GPU"):
        monkeypatch.delenv(name, raising=False)
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)


def no_spawn(monkeypatch) -> None:
    """A refused case must stop before any worker process is started."""
    import latentsweep.search.study.runner as runner

    def refuse(method):
        raise AssertionError("a worker process would be spawned")

    monkeypatch.setattr(runner.mp, "get_context", refuse)


def cli(argv: list[str]) -> tuple[int, str, str, float]:
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def command(files: dict, study: Path, state: Path, which: str, extra: list[str]) -> list[str]:
    head = {"study": ["study", "run"], "run": ["run", "--time", "60", "--test", str(files["test"])],
            "worker": ["worker"]}[which]
    return [*head, str(study), "--data", str(files["train"]), "--state-dir", str(state), "--quiet", *extra]


def one_error(code: int, out: str, err: str, wall: float) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and "Traceback" not in err and len(lines) == 1, (code, err)
    assert lines[0].startswith("latentsweep: error: ") and wall < REFUSED_WITHIN_S, (lines, wall)
    return lines[0]


# (GPUs seen, extra arguments, environment, fragments the one line must hold, fragments it must not hold)
REFUSED = {
    "gpus 1 of one": (1, ["--gpus", "1"], {}, ["--gpus 1", "1 CUDA device(s) (0 to 0)"], []),
    "gpus 0,0": (1, ["--gpus", "0,0"], {}, ["--gpus 0,0", "named twice", "--per-gpu"], []),
    "gpus -1": (1, ["--gpus", "-1"], {}, ["'-1'", "'all' or GPU numbers"], []),
    "gpus cuda:0": (1, ["--gpus", "cuda:0"], {}, ["'cuda:0'", "'all' or GPU numbers"], []),
    "gpus empty": (1, ["--gpus", ""], {}, ["got ''", "'all' or GPU numbers"], []),
    "gpus huge": (1, ["--gpus", "99999999999999999999"], {}, ["not 99999999999999999999", "(0 to 0)"], []),
    "gpus word": (1, ["--gpus", "ALL"], {}, ["'ALL'", "'all' or GPU numbers"], []),
    "per-gpu 0": (1, ["--gpus", "all", "--per-gpu", "0"], {}, ["--per-gpu", ">= 1", "got 0"], []),
    "per-gpu -1": (1, ["--gpus", "all", "--per-gpu", "-1"], {}, ["--per-gpu", ">= 1", "got -1"], []),
    "per-gpu huge": (1, ["--gpus", "all", "--per-gpu", HUGE, "--workers", "1"], {}, ["--per-gpu", HUGE, "<= "], []),
    "per-gpu huge, workers auto": (1, ["--gpus", "all", "--per-gpu", HUGE, "--workers", "auto"], {},
                                   ["--per-gpu", HUGE, "<= "], []),
    "per-gpu text": (1, ["--gpus", "all", "--per-gpu", "two"], {}, ["--per-gpu", "'two'", "whole number >= 1"], []),
    "per-gpu without gpus": (1, ["--per-gpu", "2"], {}, ["--per-gpu needs --gpus"], []),
    "workers 0": (1, ["--workers", "0"], {}, ["--workers", "got 0", ">= 1 or auto"], []),
    "workers -3": (1, ["--workers", "-3"], {}, ["--workers", "got -3", ">= 1 or auto"], []),
    "workers huge": (1, ["--workers", "100000"], {}, ["--workers", "100000", "<= ", "or auto"], []),
    "workers huge, no GPU": (0, ["--workers", "100000"], {}, ["--workers", "100000", "<= ", "or auto"], []),
    "workers text": (1, ["--workers", "many"], {}, ["'many'", "whole number or auto"], []),
    "3 workers on 1 GPU x 2": (1, ["--gpus", "all", "--workers", "3", "--per-gpu", "2"], {},
                               ["--workers 3", "2 slots"], []),
    "population 0": (1, ["--population", "0"], {}, ["--population", "got 0", "or auto"], []),
    "population -1": (1, ["--population", "-1"], {}, ["--population", "got -1", "or auto"], []),
    "population huge": (1, ["--population", HUGE], {}, ["--population", HUGE, "or auto"], []),
    "population text": (1, ["--population", "1.5"], {}, ["'1.5'", "whole number or auto"], []),
    "gpus, no GPU": (0, ["--gpus", "0"], {}, ["--gpus 0", "no CUDA device"], []),
    "gpus all, no GPU": (0, ["--gpus", "all", "--workers", "auto", "--per-gpu", "2"], {}, ["--gpus all",
                                                                                          "no CUDA device"], []),
    "visible empty": (0, ["--gpus", "0"], {VISIBLE: ""}, ["--gpus 0", "no CUDA device", f"{VISIBLE}=''"], []),
    "visible garbage": (0, ["--gpus", "all"], {VISIBLE: "abc"}, ["no CUDA device", f"{VISIBLE}='abc'"], []),
    "visible hides the one asked": (1, ["--gpus", "1"], {VISIBLE: "3"}, ["--gpus 1", f"{VISIBLE}='3'"], []),
    "env gpus beyond": (1, [], {"LATENTSWEEP_GPUS": "1"}, ["$LATENTSWEEP_GPUS 1", "(0 to 0)"], ["--gpus"]),
    "env per-gpu huge": (1, [], {"LATENTSWEEP_GPUS": "0", "LATENTSWEEP_PER_GPU": HUGE},
                         ["$LATENTSWEEP_PER_GPU", HUGE], ["--per-gpu"]),
}


@pytest.mark.parametrize("which", ["study", "run"])
@pytest.mark.parametrize("case", REFUSED)
def test_a_hostile_device_option_is_one_line_and_stores_nothing(files, tmp_path, monkeypatch, case, which):
    count, extra, env, said, unsaid = REFUSED[case]
    fake_gpus(monkeypatch, count, env)
    no_spawn(monkeypatch)
    state = tmp_path / "state"
    study = tiny_study_file(tmp_path, "hostile", n_trials=1, epochs=1)
    line = one_error(*cli(command(files, study, state, which, extra)))
    assert all(s in line for s in said) and not any(s in line for s in unsaid), line
    assert not state.exists()


# A train.device or pick device the machine lacks: (GPUs seen, the study's base train.device, extra arguments,
# environment, fragments of the one line, fragments it must not hold)
DEVICES = {
    "cuda:1 on one GPU, defaults": (1, "cuda:1", [], {}, ["'cuda:1'", "1 CUDA device(s)", "cuda:0"], ["--gpus"]),
    "cuda:1 on one GPU, 2 workers": (1, "cuda:1", ["--workers", "2"], {}, ["'cuda:1'", "1 CUDA device(s)"], []),
    "cuda:1 with --gpus 0": (1, "cuda:1", ["--gpus", "0"], {}, ["'cuda:1'", "as cuda:0"], []),
    "cuda, visible empty": (0, "cuda", [], {VISIBLE: ""}, ["'cuda'", "no CUDA device", f"{VISIBLE}=''"], []),
    "pick device cuda:1": (1, "auto", ["--device", "cuda:1"], {}, ["--device: ", "'cuda:1'", "1 CUDA device(s)"], []),
    "pick device mps": (0, "auto", ["--device", "mps"], {}, ["--device: ", "'mps'", "not one of"], []),
}


@pytest.mark.parametrize("case", DEVICES)
def test_a_device_the_machine_lacks_is_one_line_and_stores_nothing(files, tmp_path, monkeypatch, case):
    count, device, extra, env, said, unsaid = DEVICES[case]
    fake_gpus(monkeypatch, count, env)
    no_spawn(monkeypatch)
    study = tiny_study_file(tmp_path, "dev", n_trials=1, epochs=1)
    study.write_text(study.read_text().replace("[base.train]\n", f'[base.train]\ndevice = "{device}"\n', 1))
    state = tmp_path / "state"
    line = one_error(*cli(command(files, study, state, "run" if "--device" in extra else "study", extra)))
    assert all(s in line for s in said) and not any(s in line for s in unsaid), line
    assert not state.exists()


def test_a_base_device_that_is_no_device_is_said_once_as_the_bases(files, tmp_path, capsys):
    """Not under the first [[side]] or [[enqueue]] entry built on [base] (each would repeat it)."""
    study = tiny_study_file(tmp_path, "dev", n_trials=1, epochs=1, extra='\n[[side]]\nmodel = { kind = "knn" }\n')
    study.write_text(study.read_text().replace("[base.train]\n", '[base.train]\ndevice = "mps"\n', 1))
    state = tmp_path / "state"
    assert main(["study", "run", str(study), "--state-dir", str(state), "--data", str(files["train"])]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[1:] == [f"  {study}: base: an invalid config: train.device='mps' is not one of auto, cpu, cuda, "
                         "cuda:N"], lines
    assert not state.exists()


# ---- cases that work: one line says what is used ---------------------------------------------------------------------

def trial_states(state: Path) -> list[str]:
    storage = f"sqlite:///{state / 'optuna.db'}"
    return [t.state.name for s in optuna.get_all_study_summaries(storage)
            for t in optuna.load_study(study_name=s.study_name, storage=storage).get_trials()]


def run_states(state: Path) -> list[str]:
    with sqlite3.connect(state / "mlflow.db") as conn:
        return [row[0] for row in conn.execute("SELECT status FROM runs")]


def plan_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("using ")]


# (GPUs seen, extra arguments, trials, fragments of the one plan line). Two spawned workers take 40-50 s on 2 loaded
# cores: those run in the slow step (.ci/run).
WORKS = {
    "one GPU shared by two workers": pytest.param(
        1, ["--gpus", "all", "--per-gpu", "2", "--workers", "auto"], 2,
        ["GPU(s) 0", "2 worker(s)", "2 per GPU", "population 1", "MPS"], marks=pytest.mark.slow),
    "two workers, none pinned": pytest.param(1, ["--workers", "2"], 2, ["2 worker(s)", "not pinned", "population 1"],
                                             marks=pytest.mark.slow),
    "workers auto without a GPU": pytest.param(0, ["--workers", "auto"], 1, ["worker(s)", "--workers auto",
                                                                             "population 1"]),
}


@pytest.mark.parametrize("count, extra, n_trials, said", WORKS.values(), ids=WORKS.keys())
def test_a_plan_that_works_says_what_it_uses_in_one_line(files, tmp_path, monkeypatch, count, extra, n_trials, said):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)  # the workers themselves train on this CPU
    for name in (VISIBLE, "LATENTSWEEP_GPUS", "LATENTSWEEP_PER_GPU"):
        monkeypatch.delenv(name, raising=False)
    state = tmp_path / "state"
    study = tiny_study_file(tmp_path, "works", n_trials=n_trials, epochs=1)
    code, _, err, _ = cli(command(files, study, state, "study", [*extra, "--no-warm-start"]))
    assert code == 0 and "Traceback" not in err, err
    lines = plan_lines(err)
    assert len(lines) == 1 and all(s in lines[0] for s in said), err
    assert trial_states(state) == ["COMPLETE"] * n_trials and "RUNNING" not in run_states(state)


# ---- `latentsweep worker --gpus`: its slot, and a slot folder it cannot lock in -------------------------------------

@pytest.fixture
def created(files, tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A study created (no trial run) in its own state directory, on a one-GPU machine."""
    fake_gpus(monkeypatch, 1)
    state = tmp_path / "state"
    study = tiny_study_file(tmp_path, "joined", n_trials=1, epochs=1)
    code, _, err, _ = cli(["study", "create", str(study), "--data", str(files["train"]), "--state-dir", str(state),
                           "--no-warm-start"])
    assert code == 0, err
    return study, state


def stored(state: Path) -> tuple:
    """Files (SQLite's journal files aside: opening a store in WAL mode makes them), trials and runs."""
    files = sorted(str(p.relative_to(state)) for p in state.rglob("*") if not p.name.endswith(("-wal", "-shm")))
    return files, trial_states(state), run_states(state)


def blocked_by_a_file(slots: Path) -> None:
    slots.write_text("not a folder")


def blocked_by_a_dead_link(slots: Path) -> None:
    slots.symlink_to(slots.parent / "gone" / "gpu-slots")


def read_only(slots: Path) -> None:
    slots.mkdir()
    slots.chmod(0o500)  # pytest's tmp_path clean-up makes it writable again


SLOT_DIRS = {"a file": blocked_by_a_file, "a link to nowhere": blocked_by_a_dead_link,
             "read-only": pytest.param(read_only, marks=pytest.mark.skipif(
                 os.geteuid() == 0, reason="root writes into a read-only folder"))}


@pytest.mark.parametrize("block", SLOT_DIRS.values(), ids=SLOT_DIRS.keys())
def test_a_worker_that_cannot_lock_a_slot_is_one_line(files, created, monkeypatch, block):
    study, state = created
    no_spawn(monkeypatch)
    block(state / "gpu-slots")
    before = stored(state)
    line = one_error(*cli(command(files, study, state, "worker", ["--gpus", "0"])))
    assert str(state / "gpu-slots") in line and "GPU slot" in line and "--state-dir" in line, line
    after = stored(state)
    assert after == before, (before, after)


def test_a_worker_on_the_one_gpu_says_its_slot(files, created, monkeypatch):
    from latentsweep.search.study import devices
    study, state = created
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # it trains on this CPU once pinned
    monkeypatch.setenv(VISIBLE, "0")  # restored after: the worker pins this process
    held = len(devices.HELD)
    try:
        code, _, err, _ = cli(command(files, study, state, "worker", ["--gpus", "0", "--per-gpu", "2"]))
    finally:
        while len(devices.HELD) > held:
            os.close(devices.HELD.pop())
    assert code == 0, err
    lines = plan_lines(err)
    assert len(lines) == 1 and "GPU 0" in lines[0] and "1 GPU(s) x --per-gpu 2" in lines[0], err
    assert trial_states(state) == ["COMPLETE"] and "RUNNING" not in run_states(state)
