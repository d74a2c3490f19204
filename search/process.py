"""Process-wide settings, applied only where a process starts (the CLI's main, a spawned study worker) or scoped to a
block that restores them: library log levels, warning filters, environment defaults, the matplotlib backend and
signals that stop a run like Ctrl-C."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from typing import Iterator

# MLflow's first use of a SQLite store logs one INFO line per schema migration through these loggers.
MIGRATION_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration", "alembic")
# MLflow's SQL store also logs every database error with its traceback (at ERROR) before raising it: the error is
# classified and said in one line by search.failures' callers, so that logger only speaks when it is critical.
STORE_ERROR_LOGGER = "mlflow.store.db.utils"
ENV_DEFAULTS = {
    "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",  # the REST client's "View run ... at: URL" on every run end
    "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",  # one bar per copied checkpoint is noise
}


def quiet_optuna() -> None:
    """Optuna's INFO lines duplicate our progress bar; heartbeats/stale-trial handling are 'experimental' in Optuna
    but relied on knowingly here (ask/tell with our own heartbeat thread)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


def quiet_mlflow() -> None:
    """MLflow's migration INFO lines and its SQL store's error tracebacks (unless the user configured those loggers),
    URL lines and artifact bars (unless the environment sets them)."""
    for key, value in ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    for name in MIGRATION_LOGGERS:
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.CRITICAL if name == STORE_ERROR_LOGGER else logging.WARNING)


def configure_process() -> None:
    """Everything a latentsweep process sets once at its start: quiet libraries, and figures drawn without a display
    (headless workers, CI). A library the command has not imported (the CLI imports only the command's module) is
    set through the environment or not at all: importing matplotlib and Optuna only to configure them cost `train`
    45 MB of RSS (benchmarks/memory_peak.py)."""
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    else:
        os.environ["MPLBACKEND"] = "Agg"  # read by matplotlib when it is first imported
    if "optuna" in sys.modules:
        quiet_optuna()
    quiet_mlflow()


# Signals received inside an interrupt_on block. Their KeyboardInterrupt can be lost: raised while a finalizer or a
# weakref callback runs (SQLAlchemy's run at garbage collection), Python prints "Exception ignored" and goes on, and
# a Ctrl-C was once lost that way in a study; raise_if_interrupted raises it again at the next check.
_received: set[int] = set()


def raise_if_interrupted() -> None:
    """KeyboardInterrupt when a signal of the current interrupt_on block arrived (whether or not its first
    KeyboardInterrupt got through): the study's runner asks between epochs and before claiming a trial."""
    if _received:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupt_on(*signals: int | None) -> Iterator[None]:
    """Inside the block, each of `signals` (None entries are skipped) raises KeyboardInterrupt, so a run stops as on
    Ctrl-C, and is remembered for raise_if_interrupted; the previous handlers are restored after. Handlers can only
    be set in the main thread; elsewhere this does nothing."""
    def interrupt(signum, _frame):
        _received.add(signum)
        raise KeyboardInterrupt

    _received.clear()
    in_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.signal(sig, interrupt) for sig in signals if sig is not None and in_main}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def process_started() -> float:
    """When this process started, on time.monotonic()'s clock (psutil reads the kernel's start time of the process:
    interpreter start-up and imports are seconds on a loaded machine, and the user's clock counts them)."""
    import psutil  # only the CLI's entry asks, once

    age = time.time() - psutil.Process().create_time()
    return time.monotonic() - min(max(age, 0.0), time.monotonic())
