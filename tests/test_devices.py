"""Devices: names read from their text and checked against the machine, GPU slots of local workers, the device each
trial records. CUDA is faked by patching torch's device queries, so the CUDA branches run on a CPU machine."""
from __future__ import annotations

import os

import pytest
import torch

from latentsweep.trainers.core.devices import check_device, machine_gpu, resolve_device, usable_cores
from latentsweep.trainers.core.errors import LatentsweepError


@pytest.fixture
def one_gpu(monkeypatch):
    """torch reports one CUDA device (and nothing initialises CUDA: resolve_device only asks)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_one_gpu_accepts_its_ordinal(one_gpu):
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["cuda:1", "cuda:256", "cuda:999"])
def test_one_gpu_refuses_any_other_ordinal(one_gpu, name):
    # torch.device keeps the ordinal in 8 bits: cuda:999 was index -25 and cuda:256 index 0, both let through
    with pytest.raises(LatentsweepError) as err:
        resolve_device(name)
    message = str(err.value)
    assert "\n" not in message and f"'{name}'" in message and "1 CUDA device(s)" in message


@pytest.mark.parametrize("name", ["cuda:01", "cuda:-1", "gpu", "meta", "cuda:", "CUDA:0", "cuda:1.0"])
def test_names_outside_the_grammar_are_one_line(one_gpu, name):
    with pytest.raises(LatentsweepError, match="is not one of auto, cpu, cuda, cuda:N"):
        resolve_device(name)


def test_no_cuda_refuses_cuda_names(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("cuda", "cuda:0"):
        with pytest.raises(LatentsweepError, match="no CUDA device is available"):
            resolve_device(name)
    assert resolve_device("auto") == torch.device("cpu")


def test_check_device_counts_what_the_process_sees():
    check_device("cuda:3", 4)
    with pytest.raises(LatentsweepError, match="has 4 CUDA device"):
        check_device("cuda:4", 4)


def test_the_recorded_device_is_the_machines_gpu():
    assert machine_gpu(torch.device("cpu")) == "cpu"
    assert machine_gpu(torch.device("cuda", 0), visible="2,3") == "cuda:2"  # pinned to GPU 2: its cuda:0 is GPU 2
    assert machine_gpu(torch.device("cuda", 1), visible="2, 3") == "cuda:3"
    assert machine_gpu(torch.device("cuda", 1), visible="") == "cuda:1"  # not pinned: the ordinal is the GPU


# The caching allocator's words, as a worker on a GPU shared with another process sees them (sizes made up).
SHARED_OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
              "1.10 GiB is free. Process 4242 has 70.00 GiB memory in use. Including non-PyTorch memory, this process "
              "has 8.00 GiB memory in use. Of the allocated memory 7.50 GiB is allocated by PyTorch.")


def test_a_gpu_filled_by_other_processes_is_the_machines_fault():
    from latentsweep.search.failures import Kind, classify
    failure = classify(torch.OutOfMemoryError(SHARED_OOM))
    assert failure.kind is Kind.MACHINE and failure.retried and not failure.counts
    assert "\n" not in str(failure.user_error(3)) and "retried" in str(failure.user_error(3))


@pytest.mark.parametrize("message", [
    # alone on the GPU: the config does not fit
    SHARED_OOM.replace("Process 4242 has 70.00 GiB memory in use. ", ""),
    # the other process holds less than was missing: the config would not fit on the GPU alone either
    SHARED_OOM.replace("Tried to allocate 2.00 GiB", "Tried to allocate 75.00 GiB"),
    "CUDA",  # no sizes to read
])
def test_an_oversized_config_stays_a_memory_failure(message):
    from latentsweep.search.failures import Kind, classify
    assert classify(torch.OutOfMemoryError(message)).kind is Kind.MEMORY


@pytest.mark.skipif(not hasattr(torch, "AcceleratorError"), reason="this torch has no AcceleratorError")
def test_an_accelerator_error_is_retried():
    from latentsweep.search.failures import Kind, classify, one_line
    exc = torch.AcceleratorError("CUDA error: unspecified launch failure\nCUDA kernel errors might be reported later")
    failure = classify(exc)
    assert failure.kind is Kind.MACHINE and failure.retried and not failure.counts and not failure.goes_on
    assert one_line(exc) == "AcceleratorError: CUDA error: unspecified launch failure"


# GPU slots of local workers (latentsweep.search.study.devices), on a fake list of GPUs.

def test_slots_fill_every_gpu_before_doubling_up():
    from latentsweep.search.study.devices import assign_slots
    assert assign_slots(("0", "1"), 2, 4) == ["0", "1", "0", "1"]
    assert assign_slots(("0", "1"), 2, 3) == ["0", "1", "0"]
    assert assign_slots(("5",), 3, 3) == ["5", "5", "5"]
    assert assign_slots((), 1, 3) == [None, None, None]  # no --gpus: nothing is set


def test_more_workers_than_slots_is_one_line():
    from latentsweep.search.study.devices import assign_slots
    with pytest.raises(LatentsweepError, match=r"--workers 5 is more than 2 GPU\(s\) x --per-gpu 2 = 4 slots"):
        assign_slots(("0", "1"), 2, 5)


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_workers_auto_is_every_gpu_slot(two_gpus):
    from latentsweep.search.study.devices import WorkerPlan, plan_workers
    assert plan_workers("auto", "all", 2) == WorkerPlan(4, ("0", "1"), 2)
    assert plan_workers("auto", None, None) == WorkerPlan(2, ("0", "1"), 1)  # auto on a GPU machine: all of them
    assert plan_workers(1, "1", None) == WorkerPlan(1, ("1",), 1)
    assert plan_workers(3, None, None) == WorkerPlan(3)  # no --gpus, no auto: nothing pinned


def test_gpus_are_named_through_the_parents_own_pin(two_gpus, monkeypatch):
    from latentsweep.search.study.devices import plan_workers
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")  # this process sees GPUs 4 and 6 as its 0 and 1
    assert plan_workers("auto", "all", 1).gpus == ("4", "6")
    assert plan_workers(1, "1", 1).gpus == ("6",)


@pytest.mark.parametrize("workers, gpus, per_gpu, said", [
    (1, "2", None, r"--gpus 2: this machine has 2 CUDA device\(s\) \(0 to 1\), not 2"),
    (1, "0,0", None, "named twice"),
    (1, "0;1", None, "must be 'all' or GPU numbers"),
    (1, "-1", None, "must be 'all' or GPU numbers"),
    (3, "0", None, r"--workers 3 is more than 1 GPU\(s\) x --per-gpu 1"),
    (1, "0", 0, "--per-gpu must be >= 1"),
    (0, None, None, "--workers must be >= 1"),
])
def test_bad_gpu_options_are_one_line(two_gpus, workers, gpus, per_gpu, said):
    from latentsweep.search.study.devices import plan_workers
    with pytest.raises(LatentsweepError, match=said) as err:
        plan_workers(workers, gpus, per_gpu)
    assert "\n" not in str(err.value)


def test_a_cpu_machine_is_unchanged(monkeypatch):
    from latentsweep.search.study.devices import CPU_THREADS_PER_WORKER, WorkerPlan, plan_workers
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert plan_workers(2, None, None) == WorkerPlan(2)
    assert plan_workers("auto", None, None) == WorkerPlan(max(1, usable_cores() // CPU_THREADS_PER_WORKER))
    with pytest.raises(LatentsweepError, match="no CUDA device is available"):
        plan_workers(1, "0", None)
    with pytest.raises(LatentsweepError, match="--per-gpu needs --gpus"):
        plan_workers(1, None, 2)


def test_each_spawned_worker_gets_its_own_slot(monkeypatch, tmp_path):
    """_run_spawned hands worker i the i-th slot, and worker_main pins it before the worker runs."""
    import latentsweep.search.study.runner as runner
    from latentsweep.search.study.storage import StorageSettings
    from latentsweep.search.study.worker import RunSpec

    started = []

    class FakeProcess:  # multiprocessing's spawn context, recorded instead of started
        def __init__(self, target, args, name):
            self.args, self.name, self.pid, self.exitcode = args, name, len(started), 0
            started.append(self)

        def start(self):
            pass

        def is_alive(self):
            return False

        def join(self, timeout=None):
            pass

    monkeypatch.setattr(runner.mp, "get_context", lambda method: type("Ctx", (), {"Process": FakeProcess}))
    monkeypatch.setattr(runner, "reap_owner", lambda *args: [])
    spec = RunSpec("s.toml", "s", StorageSettings("sqlite://"), "sqlite://", None, str(tmp_path), "d.npz", 4, None,
                   progress=False, gpus=("0", "1"), per_gpu=2)
    runner._run_spawned(spec, None, 3, None)
    assert [p.args[-1].cuda_visible for p in started] == ["0", "1", "0"]

    seen = []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # what a process pinned to one GPU sees
    monkeypatch.setattr(runner, "run_worker", lambda s: seen.append(os.environ.get("CUDA_VISIBLE_DEVICES")))
    runner.worker_main(started[1].args[-1])
    assert seen == ["1"]


# Through the commands: every device is checked against the machine before anything is stored.

def run_main(argv: list[str]) -> tuple[int, str, str]:
    import contextlib
    import io

    from latentsweep.search.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("command", [["study", "run"], ["run", "--time", "10m"], ["worker"]])
def test_gpus_on_a_machine_without_them_stop_before_anything_is_stored(tmp_path, monkeypatch, command):
    from conftest import tiny_study_file
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # set, the line names it (visible_note)
    state = tmp_path / "state"
    code, _, err = run_main([*command, str(tiny_study_file(tmp_path, "g")), "--gpus", "0", "--state-dir", str(state)])
    assert code == 2 and err.strip() == "latentsweep: error: --gpus 0: no CUDA device is available on this machine"
    assert not state.exists()


@pytest.mark.parametrize("extra, said", [
    ('[base.train]\ndevice = "cuda:1"', "base: train.device: device 'cuda:1' but this machine has 1 CUDA device(s)"),
    ('[[side]]\ntrain.device = "cuda:256"', "side[0]: train.device: device 'cuda:256' but this machine has 1"),
    ('"train.device" = { type = "categorical", choices = ["cpu", "cuda:0", "cuda:999"] }\n'
     '[[enqueue]]\n"train.device" = "cuda:999"', "enqueue[0]: train.device: device 'cuda:999'"),
    ('"train.device" = { type = "categorical", choices = ["cpu", "cuda:0", "cuda:2"] }', "space: train.device: "
                                                                                        "device 'cuda:2'"),
])
def test_every_device_a_trial_can_get_is_checked_first(tmp_path, one_gpu, extra, said):
    from conftest import tiny_study_file
    sf = tiny_study_file(tmp_path, "dev", extra="" if extra.startswith("[base") else extra)
    if extra.startswith("[base"):  # a second [base.train] table would be a TOML error: set the key in the first
        sf.write_text(sf.read_text().replace("[base.train]\n", '[base.train]\ndevice = "cuda:1"\n', 1))
    state = tmp_path / "state"
    code, _, err = run_main(["study", "run", str(sf), "--state-dir", str(state)])
    assert code == 2 and len(err.strip().splitlines()) == 1 and said in err, err
    assert not state.exists()
    code, _, err = run_main(["study", "run", str(sf), "--gpus", "0", "--state-dir", str(state)])
    assert code == 2 and "(each worker is pinned to one GPU, which it sees as cuda:0)" in err and not state.exists()


def test_train_refuses_a_wrapped_ordinal_before_its_output(tmp_path, one_gpu):
    from conftest import tiny_study_file
    out = tmp_path / "out"
    code, _, err = run_main(["train", str(tiny_study_file(tmp_path, "t")), "--set", "train.device=cuda:256",
                             "--out", str(out)])
    assert code == 2 and "device 'cuda:256' but this machine has 1 CUDA device(s)" in err and not out.exists()


def test_each_trial_records_its_device(tmp_path):
    """The MLflow tag of each trial run, the Optuna trial's attribute, and the `device` column of `study status`."""
    from mlflow import MlflowClient
    import optuna

    from conftest import tiny_study_file
    from latentsweep.trainers.data.synthetic import write_synthetic
    train, _, _ = write_synthetic(tmp_path / "syn", 120, dim_text=16, dim_image=24, n_test=20)
    state = tmp_path / "state"
    sf = tiny_study_file(tmp_path, "recorded", n_trials=1, epochs=1)
    code, _, err = run_main(["study", "run", str(sf), "--data", str(train), "--state-dir", str(state), "--quiet"])
    assert code == 0, err
    trial = optuna.load_study(study_name="recorded", storage=f"sqlite:///{state / 'optuna.db'}").trials[0]
    assert trial.user_attrs["latentsweep.device"] == "cpu"
    run = MlflowClient(f"sqlite:///{state / 'mlflow.db'}").get_run(trial.user_attrs["mlflow_run_id"])
    assert run.data.tags["latentsweep.device"] == "cpu"
    code, out, _ = run_main(["study", "status", "recorded", "--state-dir", str(state), "--csv"])
    assert code == 0 and out.splitlines()[0].startswith("number,state,value,duration_s,device")
    assert out.splitlines()[1].split(",")[4] == "cpu"


def test_workers_on_one_machine_claim_distinct_slots(tmp_path):
    """`worker --gpus 0,1 --per-gpu 2` four times (compose replicas sharing the state volume): every slot once, in
    assign_slots' order; a fifth worker is refused in one line; a worker's exit frees its slot."""
    from latentsweep.search.study import devices
    try:
        got = [devices.claim_slot(("0", "1"), 2, tmp_path / "gpu-slots") for _ in range(4)]
        assert got == ["0", "1", "0", "1"]
        with pytest.raises(LatentsweepError, match=r"every GPU slot \(2 GPU\(s\) x --per-gpu 2\) is held"):
            devices.claim_slot(("0", "1"), 2, tmp_path / "gpu-slots")
        os.close(devices.HELD.pop(1))  # the worker on GPU 1 exits: its lock goes with it
        assert devices.claim_slot(("0", "1"), 2, tmp_path / "gpu-slots") == "1"
        assert devices.claim_slot((), 2, tmp_path / "gpu-slots") is None
    finally:
        while devices.HELD:
            os.close(devices.HELD.pop())


def test_compose_replicas_get_gpus_from_the_environment(tmp_path, monkeypatch):
    from conftest import tiny_study_file
    monkeypatch.setenv("LATENTSWEEP_GPUS", "all")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    state = tmp_path / "state"
    code, _, err = run_main(["worker", str(tiny_study_file(tmp_path, "e")), "--state-dir", str(state)])
    assert code == 2 and "$LATENTSWEEP_GPUS all: no CUDA device is available" in err and not state.exists()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_usable_cores_are_the_process_affinity_not_the_machines():
    """A process limited to one core (taskset, a container's cpuset) plans for one, whatever the machine has."""
    import subprocess
    import sys

    code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
            "from latentsweep.trainers.core.devices import usable_cores; print(usable_cores(), os.cpu_count())")
    one, machine = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                  timeout=120).stdout.split()
    assert one == "1" and int(machine) >= 1
