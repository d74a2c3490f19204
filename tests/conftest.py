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

# Under pytest-xdist (`-n 2 --dist loadgroup`: README, Tests) tests are dealt to the workers one by one, and a
# module-scoped fixture is built in every worker that gets one of its tests. These modules' fixtures run a study, a
# pick or a training (tens of seconds each on 2 cores): each module's tests go to one worker, which builds them once.
SHARED_FIXTURE_MODULES = {"test_picker.py", "test_pick_budget.py", "test_better_only.py", "test_bad_input_round5.py",
                          "test_cli_train.py", "test_loop.py"}


# The slow step's longest tests (.ci/run, measured: test_kill's 12 moments 169 s, the wheel 94 s): dealt first, so
# that the other worker's many shorter tests fill the time beside them instead of one long test ending the run alone.
LONGEST_FIRST = ("test_kill.py::test_run_killed_at_every_phase", "test_wheel.py::")


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if item.path.name in SHARED_FIXTURE_MODULES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    items.sort(key=lambda item: not any(long in item.nodeid for long in LONGEST_FIRST))  # stable: the rest in order


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
