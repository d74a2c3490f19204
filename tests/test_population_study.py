"""A worker's population (latentsweep.search.study.population): each member its own Optuna trial and MLflow run, told on
its own;
a failing member fails alone; join fills the budget exactly; the defaults a machine gets (CPU: unchanged; CUDA: every
GPU). Real Optuna on SQLite, real MLflow on SQLite, the trainers' own population step."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import torch
from mlflow import MlflowClient

from conftest import default_sigint, tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.data.synthetic import write_synthetic

POP = "latentsweep.population"


@pytest.fixture(scope="module")
def state(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("state")


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


def run(sf: Path, state: Path, synthetic: Path, *extra: str) -> int:
    return main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet",
                 "--no-warm-start", *extra])  # each study its own trials, not earlier studies' best


def trials(state: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}").get_trials()


def runs(state: Path, name: str):
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    return client, {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}


def assert_nothing_running(state: Path, name: str) -> None:
    assert [t.number for t in trials(state, name) if t.state.name == "RUNNING"] == []
    assert [n for n, r in runs(state, name)[1].items() if r.info.status == "RUNNING"] == []


def test_each_member_is_its_own_trial_and_run_and_join_fills_the_budget_exactly(state, synthetic, tmp_path, capsys):
    sf = tiny_study_file(tmp_path, "pop3", n_trials=3, epochs=2, pruner="median")
    assert run(sf, state, synthetic, "--population", "2") == 0
    got = trials(state, "pop3")
    assert len(got) == 3  # join claimed one more after the first two: no trial beyond the budget
    assert {t.state.name for t in got} <= {"COMPLETE", "PRUNED"}
    assert {t.user_attrs["latentsweep.device"] for t in got} == {"cpu"}
    populations = {t.user_attrs[POP]["id"] for t in got}
    assert len(populations) == 1 and {t.user_attrs[POP]["size"] for t in got} == {2}  # one population, joins too
    client, by_name = runs(state, "pop3")
    for t in got:
        r = by_name[f"trial-{t.number}"]
        assert r.info.status == "FINISHED" and r.data.tags["latentsweep.device"] == "cpu"
        assert r.data.tags[POP] == t.user_attrs[POP]["id"] and r.data.tags[f"{POP}_size"] == "2"
        epochs = len(t.intermediate_values)
        assert [m.step for m in client.get_metric_history(r.info.run_id, "val/mrr")] == list(range(epochs))
        assert t.state.name == "PRUNED" or epochs == 2
    assert len({by_name[f"trial-{t.number}"].info.run_id for t in got}) == 3
    from latentsweep.search.study.report import study_table
    table = study_table(optuna.load_study(study_name="pop3", storage=f"sqlite:///{state / 'optuna.db'}"))
    assert set(table["population"]) == {2} and set(table["device"]) == {"cpu"}  # what `study status` shows
    assert_nothing_running(state, "pop3")


DIVERGES = """
[study]
name = "{name}"
n_trials = 4
sampler = {{ name = "random", seed = 0 }}
pruner = {{ name = "none" }}

[base.data]
val_ratio = 0.25

[base.model]
kind = "mlp"
hidden = [32]

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = 2
batch_size = 64

[space]
"optim.lr" = {{ type = "categorical", choices = [0.001, 1e30] }}

[[enqueue]]
"optim.lr" = 1e30

[[enqueue]]
"optim.lr" = 0.001
"""


def test_a_member_whose_config_fails_fails_alone(state, synthetic, tmp_path, capsys):
    sf = tmp_path / "diverge.toml"
    sf.write_text(DIVERGES.format(name="diverge"))
    assert run(sf, state, synthetic, "--population", "3") == 0
    got = trials(state, "diverge")
    assert len(got) == 4 and got[0].params["optim.lr"] == 1e30  # the enqueued diverging config first
    diverged = [t.params["optim.lr"] == 1e30 for t in got]
    assert [t.state.name for t in got] == ["FAIL" if d else "COMPLETE" for d in diverged] and not all(diverged)
    _, by_name = runs(state, "diverge")
    for t, d in zip(got, diverged):
        assert by_name[f"trial-{t.number}"].info.status == ("FAILED" if d else "FINISHED")
        if d:  # a config failure: counted, not retried
            assert "not finite" in t.user_attrs["latentsweep.error"]
    assert_nothing_running(state, "diverge")


@pytest.mark.slow
def test_configs_that_cannot_share_a_step_train_in_their_own_groups(state, synthetic, tmp_path, capsys):
    """A knn side trial (no stacked step) and MLP/residual MLP trials (different shapes): each group trains on its
    own, and every trial still ends told, with its own run, within the budget."""
    kind = '"model.kind" = { type = "categorical", choices = ["mlp", "residual_mlp"] }\n'
    side = '\n[[side]]\nmodel = { kind = "knn" }\n'
    sf = tiny_study_file(tmp_path, "groups", n_trials=5, epochs=1, extra=kind + side)
    assert run(sf, state, synthetic, "--population", "3") == 0
    got = trials(state, "groups")
    assert len(got) == 5 and {t.state.name for t in got} <= {"COMPLETE", "PRUNED"}
    side = [t for t in got if "latentsweep.side" in t.user_attrs]
    assert len(side) == 1
    others = {t.user_attrs[POP]["id"] for t in got if t not in side}
    assert side[0].user_attrs[POP]["id"] not in others  # the knn trained in a group of its own
    assert_nothing_running(state, "groups")


def test_a_bug_in_the_shared_step_fails_its_members_as_a_bug_alone_would(state, synthetic, tmp_path, monkeypatch,
                                                                          capsys):
    import latentsweep.search.study.population as population

    def broken(members, data, **kwargs):  # the stacked step raising our own bug before any member ended
        raise RuntimeError("a bug in the stacked step")

    monkeypatch.setattr(population.stacking, "train_population", broken)
    sf = tiny_study_file(tmp_path, "stepbug", n_trials=3, epochs=1)
    with pytest.raises(RuntimeError, match="a bug in the stacked step"):
        run(sf, state, synthetic, "--population", "2")
    got = trials(state, "stepbug")
    assert [t.state.name for t in got] == ["FAIL", "FAIL"]  # both members, counted (not retried), as alone
    assert all("a bug in the stacked step" in t.user_attrs["latentsweep.error"] for t in got)
    study = optuna.load_study(study_name="stepbug", storage=f"sqlite:///{state / 'optuna.db'}")
    assert "a bug in the stacked step" in study.user_attrs["latentsweep.halted"]  # the other workers stop too
    assert {r.info.status for n, r in runs(state, "stepbug")[1].items() if n.startswith("trial-")} == {"FAILED"}
    assert_nothing_running(state, "stepbug")


def test_population_one_and_a_cpu_default_are_the_one_trial_worker(state, synthetic, tmp_path, monkeypatch, capsys):
    import latentsweep.search.study.population as population
    from latentsweep.search.study.devices import WorkerPlan, plan_workers

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert plan_workers(None, None, None) == WorkerPlan(1)  # no option on a CPU machine: one worker, as before
    looped = []
    monkeypatch.setattr(population, "population_loop", lambda *a, **k: looped.append(1))  # must not be reached
    sf = tiny_study_file(tmp_path, "cpudefault", n_trials=2, epochs=1)
    assert run(sf, state, synthetic) == 0
    assert run(tiny_study_file(tmp_path, "popone", n_trials=1, epochs=1), state, synthetic, "--population", "1") == 0
    assert looped == []
    got = trials(state, "cpudefault")
    assert [t.state.name for t in got] == ["COMPLETE", "COMPLETE"]
    assert all(POP not in t.user_attrs for t in got)  # trained alone: no population recorded
    assert "using every GPU" not in capsys.readouterr().err


def test_the_machine_decides_workers_and_gpus_and_the_option_the_population(monkeypatch):
    import latentsweep.search.study.devices as devices
    from latentsweep.search.study.devices import machine_defaults
    monkeypatch.setattr(devices, "max_workers", lambda: 1000)  # memory for any count: the cores decide
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: [])  # cards' memory unread (no nvidia-smi): no cap
    assert machine_defaults(0, None, None, None, cpus=16) == (1, None, None)  # CPU: one worker, one trial
    assert machine_defaults(1, None, None, None, cpus=16) == ("auto", "all", 8)  # one GPU, 16 cores: 8 on it
    assert machine_defaults(4, None, None, None, cpus=32) == ("auto", "all", 4)  # 2 cores a worker
    assert machine_defaults(1, None, None, None, cpus=64) == ("auto", "all", 8)  # at most the 8 measured
    assert machine_defaults(8, None, None, None, cpus=4) == ("auto", "all", 1)  # at least one a GPU
    assert machine_defaults(4, 1, None, None, 1) == (1, None, None)  # --workers 1: the old behaviour
    assert machine_defaults(4, None, "1", None) == (1, "1", None)  # --gpus alone: one worker on it
    assert machine_defaults(4, None, None, 2) == (1, None, 2)  # --per-gpu alone is the user's (needs --gpus)
    assert machine_defaults(2, "auto", None, None) == ("auto", None, None)
    monkeypatch.setattr(devices, "max_workers", lambda: 6)  # memory for 6 workers: 3 on each of 2 GPUs
    assert machine_defaults(2, None, None, None, cpus=64) == ("auto", "all", 3)
    monkeypatch.setattr(devices, "max_workers", lambda: 1000)
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: [80 << 30, 8 << 30])  # the smaller card holds 4
    assert machine_defaults(2, None, None, None, cpus=64) == ("auto", "all", 4)
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: [1 << 30])  # too small for one: still one a GPU
    assert machine_defaults(1, None, None, None, cpus=64) == ("auto", "all", 1)
    from latentsweep.search.cli.main import build_parser  # one trial at a time unless --population is given
    assert build_parser("study").parse_args(["study", "run", "s.toml"]).population == 1
    assert build_parser("run").parse_args(["run", "s.toml", "--time", "60"]).population == 1


def test_the_cards_memory_is_read_without_cuda_or_is_unknown(monkeypatch, tmp_path):
    """nvidia-smi's MiB per card; no nvidia-smi on the PATH (a CPU machine, another vendor): unknown, no cap."""
    from latentsweep.search.study.devices import gpu_memory_bytes
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 81559\necho 8192\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpu_memory_bytes() == [81559 << 20, 8192 << 20]
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert gpu_memory_bytes() == []


def test_a_cuda_machine_uses_every_gpu_and_says_so_in_one_line(monkeypatch, tmp_path):
    import latentsweep.search.study.devices as devices
    from latentsweep.search.study.devices import WorkerPlan, describe_plan, plan_workers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(devices, "usable_cores", lambda: 8)
    monkeypatch.setattr(devices, "gpu_memory_bytes", lambda: [80 << 30, 80 << 30])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))  # no MPS daemon listens there
    plan = plan_workers(None, None, None)
    assert plan == WorkerPlan(4, ("0", "1"), 2, machine=True)  # 8 cores, 2 a worker: 2 on each GPU
    line = describe_plan(plan, 1)
    assert "\n" not in line and "2 (0,1)" in line and "4 worker(s)" in line and "population 1" in line, line
    assert "MPS off" in line and "nvidia-cuda-mps-control -d" in line, line
    (tmp_path / "control").touch()  # the daemon's socket: MPS on
    assert "MPS on" in describe_plan(plan, 1)
    assert plan_workers(1, None, None) == WorkerPlan(1)  # --workers 1: nothing pinned, nothing said
    assert not plan_workers("auto", None, None).machine  # an option given: the user's plan, not said
    one = plan_workers(None, "0", None)
    assert "MPS" not in describe_plan(one, 1)  # one worker on its GPU: nothing shares it


def test_a_population_claims_no_further_than_the_first_trial_of_another_shape():
    """Claimed trials of other shapes wait for their group, RUNNING and untrained: the population stops claiming at
    the first, which then leads the next group (the rest are claimed when its places are free)."""
    from latentsweep.search.study.population import Population, Seat

    class Claims(Population):
        def _claim(self, joining=False):
            seat = Seat(trial=None, beat=None, group=next(groups))
            self.seats.append(seat)
            return seat

    groups = iter([1, 1, 2, 3, 3])
    pop = Claims(study_file=None, spec=None, study=None, runner=None, size=4)
    pop._fill()
    assert [s.group for s in pop.seats] == [1, 1, 2]
    groups = iter([1, 1, 1, 1, 1])
    pop = Claims(study_file=None, spec=None, study=None, runner=None, size=4)
    pop._fill()
    assert [s.group for s in pop.seats] == [1, 1, 1, 1]  # one shape: every place


def test_population_auto_is_one_on_a_cpu(synthetic):
    from latentsweep.search.study.population import population_size
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.search.study.worker import RunSpec
    from latentsweep.trainers.data.sets import load_train

    sf = load_study_file("quickstart")
    spec = RunSpec("quick", "q", None, "", None, ".", str(synthetic), 1, None)
    assert population_size("auto", sf, spec, load_train(synthetic)) == 1
    assert population_size(4, sf, spec, load_train(synthetic)) == 4


@pytest.mark.parametrize("value, said", [("0", "--population must be a whole number >= 1 or auto, got 0"),
                                         ("many", "must be a whole number or auto, got 'many'")])
def test_a_bad_population_is_one_line(state, synthetic, tmp_path, capsys, value, said):
    sf = tiny_study_file(tmp_path, "badpop")
    assert run(sf, state, synthetic, "--population", value) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0]


def test_the_api_takes_a_population(tmp_path):
    from latentsweep.search.api import run_study
    with pytest.raises(LatentsweepError, match="population must be a whole number >= 1 or auto, got -1"):
        run_study("quickstart", population=-1, state_dir=str(tmp_path / "s"))


def start(sf: Path, state: Path, synthetic: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "latentsweep", "study", "run", str(sf), "--data", str(synthetic),
                             "--state-dir", str(state), "--quiet", "--no-warm-start", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=default_sigint)


def members_running(proc: subprocess.Popen, state: Path, name: str, k: int = 2) -> str:
    """The worker (host:pid) once it holds `k` RUNNING trials whose runs are open: a population mid-training."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
        try:
            owners = [t.user_attrs.get("latentsweep.worker") for t in trials(state, name)
                      if t.state.name == "RUNNING" and "mlflow_run_id" in t.user_attrs]  # its run opened
        except Exception:  # noqa: BLE001 - the study is not created yet
            continue
        owner = next((o for o in owners if o and owners.count(o) >= k), None)
        if owner is not None:
            return owner
    raise AssertionError(proc.communicate())


def ended(proc: subprocess.Popen, timeout: float) -> tuple[bytes, bytes]:
    """proc.communicate(timeout): on a timeout the job and its spawned workers first write their threads' stacks to
    stderr (SIGUSR1, search/process.py configure_process), which the failure shows; then the job is stopped with its
    workers (SIGTERM, then SIGKILL), so a failed test leaves no process behind (one left from a timed-out run held its
    workers' store connections)."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _ask_stacks(proc)
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        raise AssertionError(f"the job ran past {timeout:.0f} s; its stacks then:\n{err.decode()[-12000:]}") from None


def _ask_stacks(proc: subprocess.Popen) -> None:
    """SIGUSR1 to the job and its spawned workers (not multiprocessing's resource tracker, which has no handler)."""
    import psutil

    job = psutil.Process(proc.pid)
    for p in [job, *job.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            if p.pid == proc.pid or "spawn_main" in " ".join(p.cmdline()):
                p.send_signal(signal.SIGUSR1)
    time.sleep(2)  # faulthandler writes at once; the pipe is read by communicate


@pytest.mark.slow
def test_killing_a_worker_mid_population_leaves_nothing_running(state, synthetic, tmp_path):
    """SIGKILL of one of two spawned workers while its population trains: the launcher reaps all its members at once,
    the other worker finishes the budget, and a resume leaves nothing RUNNING."""
    sf = tiny_study_file(tmp_path, "killpop", n_trials=6, epochs=30)
    proc = start(sf, state, synthetic, "--workers", "2", "--population", "3")
    victim = members_running(proc, state, "killpop")
    os.kill(int(victim.rsplit(":", 1)[1]), signal.SIGKILL)
    out, err = ended(proc, 300)
    assert proc.returncode == 0, err.decode()[-2000:]
    killed = [t for t in trials(state, "killpop") if t.user_attrs.get("latentsweep.worker") == victim]
    assert len([t for t in killed if t.state.name == "FAIL"]) >= 2  # every member of the dead worker reaped
    assert_nothing_running(state, "killpop")
    assert run(sf, state, synthetic, "--population", "3") == 0  # resumed: the retries run, nothing left open
    assert_nothing_running(state, "killpop")


@pytest.mark.slow
def test_ctrl_c_mid_population_fails_and_retries_every_member(state, synthetic, tmp_path):
    sf = tiny_study_file(tmp_path, "intpop", n_trials=4, epochs=40)
    proc = start(sf, state, synthetic, "--population", "3")
    members_running(proc, state, "intpop")
    proc.send_signal(signal.SIGINT)
    _, err = ended(proc, 120)
    assert proc.returncode == 130, err.decode()[-2000:]
    got = trials(state, "intpop")
    failed = [t for t in got if t.state.name == "FAIL"]
    # each sampled trial retried; a claim the interrupt cut short (no parameters sampled yet) may be told FAIL at once,
    # with nothing to retry
    waiting = len([t for t in got if t.state.name == "WAITING"])
    assert len(failed) >= 2 and len([t for t in failed if t.params]) <= waiting <= len(failed)
    _, by_name = runs(state, "intpop")
    # the members training when Ctrl-C came are KILLED; a trial claimed but not yet started may have no run
    states = [by_name[f"trial-{t.number}"].info.status for t in failed if f"trial-{t.number}" in by_name]
    assert states.count("KILLED") >= 2 and set(states) <= {"KILLED", "FAILED"}
    assert_nothing_running(state, "intpop")
