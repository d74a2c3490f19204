"""Suite-wide settings: one torch thread per test process (tiny models gain nothing from more, and on a 2-core CI box
thread contention between the test and the worker processes it spawns costs far more than it gives)."""
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the worker processes tests spawn
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# Many tests run several studies on one synthetic file in one state directory: warm start (on by default) would queue
# one study's configurations in the next. tests/test_warm_start.py turns it back on.
os.environ.setdefault("LATENTSWEEP_WARM_START", "off")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

# Under pytest-xdist (`-n 2 --dist loadgroup`: README, Tests) tests are dealt to the workers one unit at a time (a
# test, or all the tests of one xdist_group), and a module-scoped fixture is built in every worker that gets one of its
# tests. These modules' fixtures run a study, a pick or a training (tens of seconds each on 2 cores): each module's
# tests go to one worker, which builds them once.
SHARED_FIXTURE_MODULES = {"test_picker.py", "test_pick_budget.py", "test_better_only.py", "test_bad_input_round5.py",
                          "test_cli_train.py", "test_loop.py", "test_tracking_e2e.py"}

# Dealt first, in this order: the longest tests (wall seconds measured 2026-11-27 with -n 2 on 2 cores under a load
# average of about 10, each 2-5x its quiet time), so that the other worker's shorter tests fill the time beside them
# instead of one long test ending the run alone with the other worker idle. xdist deals the groups above before any
# single test. The slow step (.ci/run): test_kill's 12 moments and the wheel 580 s each, the population kill 287 s,
# the plugins 147 s, the workers smoke 93 s, the inductor capture 91 s, the tracker bug 79 s, the notebook and
# PostgreSQL's four workers 70 s. The suite: two same-name studies at once 103 s, two workers halted by a bug 69-71 s,
# a full disk mid-trial 60 s, parallel SQLite workers 51 s.
LONGEST_FIRST = (
    "test_kill.py::test_run_killed_at_every_phase", "test_wheel.py::",
    "test_population_study.py::test_killing_a_worker", "test_plugins.py::test_both_examples",
    "test_smoke_runs_in_a_temp_dir[workers.py]", "test_capture.py::test_a_run_captured_by_inductor",
    "test_always_an_answer.py::test_a_bug_in_our_tracker", "test_notebook.py::", "test_postgres.py::test_four_workers",
    "test_bad_input_stores.py::test_two_same_name", "test_failures.py::test_a_bug_in_the_tracker_stops_two_workers",
    "test_own_bugs.py::test_a_bug_in_a_loss_stops_every_worker", "test_bad_input_stores.py::test_storage_full",
    "test_study.py::test_parallel_sqlite_workers",
)


def _rank(item) -> int:
    return next((i for i, long in enumerate(LONGEST_FIRST) if long in item.nodeid), len(LONGEST_FIRST))


# After xdist's own hook (which finds no group mark yet, so adds nothing): each id gets its group once, whatever the
# pytest and pytest-xdist versions (the minimum-versions check runs older ones).
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.name in SHARED_FIXTURE_MODULES:
            _group(item, item.path.stem, config)
    items.sort(key=_rank)  # stable: the rest in collection order


def _group(item, name: str, config) -> None:
    """Mark `item` xdist_group `name` and, on an xdist worker of --dist loadgroup, write the group into its node id
    ("id@group", what xdist's scheduler reads), as xdist does for the marks it sees: pytest-xdist 3.8 writes it to a
    field pytest 9.2 no longer reads (pytest-dev/pytest-xdist#1386), and every group was silently dealt test by test
    to both workers."""
    item.add_marker(pytest.mark.xdist_group(name))
    if not getattr(config.option, "loadgroup", False) or item.nodeid.endswith(f"@{name}"):
        return
    if hasattr(item, "_id"):  # pytest >= 9.2: a structured id, parsed back from its string form
        item._id = type(item._id).parse(f"{item.nodeid}@{name}")
    else:
        item._nodeid = f"{item.nodeid}@{name}"


# A back-dated start: seconds of a `run --time 60` budget counted as already spent, so that a test of the smallest
# budget waits out 50 s of it, not 60. More would starve the search: it only starts with more than half the budget
# left (the pick's opening reserve, latentsweep.search.study.budget), after the floor, which takes seconds on a loaded
# machine (at
# 20 s the zero-seconds test's search finished no trial there). A CLI process reads $LATENTSWEEP_TEST_SPENT_S
# (latentsweep.search.process.process_started); an in-process command takes the clock from main_spent below.
SPENT_S = 10.0


def main_spent(argv: list[str], spent_s: float = SPENT_S) -> int:
    """latentsweep.search.cli.main.main(argv) with its clock started `spent_s` s ago: the command's code unchanged, its
    budget
    shorter by that much."""
    import time

    from latentsweep.search.cli.main import _main

    return _main(list(argv), time.monotonic() - spent_s)


# The least `run --time` a test or benchmark smoke asks for when it needs no pick: a one-budget job on tiny data (the
# floor and a trial) in 20 s instead of the product's 60-s minimum, which $LATENTSWEEP_TEST_MIN_TIME_S lowers for tests
# only (latentsweep.search.process.least_time). A job whose pick must run keeps 60 s: the pick starts only with
# PICK_MIN_S (20 s) left after the search, which ends with half the budget left (latentsweep.search.study.budget).
SHORT_TIME_S = 20


@pytest.fixture
def short_time(monkeypatch) -> int:
    """`run --time SHORT_TIME_S` accepted in this test, in-process and in the CLI processes it starts; returns it."""
    from latentsweep.search.process import TEST_MIN_TIME_ENV

    monkeypatch.setenv(TEST_MIN_TIME_ENV, str(SHORT_TIME_S))
    return SHORT_TIME_S


def default_sigint() -> None:
    """preexec_fn for subprocesses a test will Ctrl-C: a shell that starts a job in the background (`cmd &`, as CI
    runners may) leaves SIGINT ignored, and Python then installs no KeyboardInterrupt handler in the child."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


# A study small enough for integration tests: 2-epoch MLP on synthetic data, a conditional knob, room for extra knobs.
TINY_STUDY = """
[study]
name = "{name}"
n_trials = {n_trials}
sampler = {{ name = "tpe", seed = 0, n_startup_trials = 2 }}
pruner = {{ name = "{pruner}" }}

[base.data]
val_ratio = 0.25

[base.model]
kind = "mlp"
hidden = [32]

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = {epochs}
batch_size = 64

[space]
"optim.lr" = {{ type = "float", low = 1e-4, high = 1e-2, log = true }}
"loss.triplet.weight" = {{ type = "float", low = 0.0, high = 1.0 }}
"loss.triplet.margin" = {{ type = "float", low = 0.05, high = 0.4, when = "loss.triplet.weight > 0.5" }}
{extra}
"""


def tiny_study_file(tmp: Path, name: str, n_trials: int = 3, epochs: int = 2, pruner: str = "none",
                    extra: str = "") -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(TINY_STUDY.format(name=name, n_trials=n_trials, epochs=epochs, pruner=pruner, extra=extra))
    return path


from bad_input_kit import data, existing  # noqa: E402,F401 - session fixtures of the bad-input corpus, by name
