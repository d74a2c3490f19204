"""Process-wide settings, applied only where a process starts (the CLI's main, a spawned study worker) or scoped to a
block that restores them: library log levels, warning filters, environment defaults, the matplotlib backend and
signals that stop a run like Ctrl-C."""
from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from typing import Iterator, NoReturn

# MLflow's first use of a SQLite store logs one INFO line per schema migration through these loggers.
MIGRATION_LOGGERS = ("mlflow.store.db.utils", "alembic.runtime.migration", "alembic")
# MLflow's SQL store also logs every database error with its traceback (at ERROR) before raising it: the error is
# classified and said in one line by latentsweep.search.failures' callers, so that logger only speaks when it is
# critical.
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
    """Everything a latentsweep process sets once at its start: quiet libraries, figures drawn without a display
    (headless workers, CI), and the Python stacks of all its threads on a crash and on SIGUSR1 (faulthandler). A
    library the command has not imported (the CLI imports only the command's module) is set through the environment
    or not at all: importing matplotlib and Optuna only to configure them cost `train` 45 MB of RSS
    (benchmarks/memory_peak.py)."""
    if "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    else:
        os.environ["MPLBACKEND"] = "Agg"  # read by matplotlib when it is first imported
    if "optuna" in sys.modules:
        quiet_optuna()
    quiet_mlflow()
    # (no file behind stderr, as in a notebook or a captured test: nothing to write to, so not asked)
    with contextlib.suppress(AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both of the last
        # a crash in native code (a write into the sealed train set, trainers/core/pages.py) dies with the Python
        # stacks of every thread, not a bare "Segmentation fault"
        faulthandler.enable(file=sys.stderr.fileno(), all_threads=True)
        if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: a job that seems hung writes every thread's stack
            faulthandler.register(signal.SIGUSR1, file=sys.stderr.fileno(), all_threads=True)


# Signals received inside the outermost interrupt_on block, in order. Their KeyboardInterrupt can be lost: raised while
# a finalizer or a weakref callback runs (SQLAlchemy's run at garbage collection), Python prints "Exception ignored"
# and goes on, and a Ctrl-C was once lost that way in a study; raise_if_interrupted raises it again at the next check.
_received: list[int] = []
_depth = 0  # interrupt_on blocks entered (main thread): nested blocks share the outermost one's signals
# Signals that stop a command as Ctrl-C does (a scheduler's SIGTERM, a closed terminal's SIGHUP); the exit code is
# 128 + the first one's number, as a shell reports a process killed by it (130, 143, 129).
STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
# The signal that forces a stop: the second is ignored so the first's clean-up (closing the running trial and its
# MLflow run, stopping the workers, removing temporary folders) finishes; a third is raised anyway.
FORCE_AFTER = 3
PR_SET_PDEATHSIG = 1  # linux/prctl.h
INTERRUPTED_LOGGER = "sqlalchemy.pool"  # "Error closing cursor" (sqlalchemy.engine.base.Connection._safe_close_cursor)


_forced = [True]  # False in a spawned worker: its launcher forces it (SIGKILL after a grace), signals never do
_deferred = [0]  # stops_deferred blocks entered: a first stop is remembered there, and raised as the outermost ends


def _interrupt(signum, _frame) -> None:
    _received.append(signum)
    if len(_received) == 1:
        # A cursor the interrupt cut short fails to close, and SQLAlchemy's pool logs that with a traceback: a
        # consequence of the stop, which the command says in one line.
        logging.getLogger(INTERRUPTED_LOGGER).setLevel(logging.CRITICAL)
    if len(_received) == 1 and not _deferred[0] or (_forced[0] and len(_received) >= FORCE_AFTER):
        raise KeyboardInterrupt


@contextlib.contextmanager
def stops_deferred() -> Iterator[None]:
    """A stop signal inside the block (interrupt_on's) is remembered, and raised as KeyboardInterrupt when the block
    ends: for a few steps that must not be cut in two (a trial made and claimed). A forced stop (FORCE_AFTER) is still
    raised at once. Python runs signal handlers in the main thread whichever thread the signal reaches, so this holds
    where pthread_sigmask (one thread's mask: signals_blocked) does not."""
    before = len(_received)  # a stop before the block was raised then (the block is then part of its clean-up)
    _deferred[0] += 1
    try:
        yield
    finally:
        _deferred[0] -= 1
    if not _deferred[0] and before == 0 and _received:
        raise KeyboardInterrupt


def _quiet_unraisable(unraisable) -> None:
    """A KeyboardInterrupt raised inside a finalizer or weakref callback is dropped by Python with an "Exception
    ignored" traceback; it is remembered in _received and raised again at the next check, so it is not printed."""
    if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt) and _received:
        return
    _previous_hook[0](unraisable)


_previous_hook = [sys.unraisablehook]


def raise_if_interrupted() -> None:
    """KeyboardInterrupt when a signal of the current interrupt_on block arrived (whether or not its first
    KeyboardInterrupt got through): the study's runner asks between epochs and before claiming a trial."""
    if _received:
        raise KeyboardInterrupt


def stopped_by() -> int | None:
    """The first signal received in the current (or last) interrupt_on block; None when none came."""
    return _received[0] if _received else None


def exit_code() -> int:
    """What a command stopped by a signal exits with: 128 + its number (130 for Ctrl-C or an interrupt raised
    without a signal)."""
    return 128 + (stopped_by() or signal.SIGINT)


@contextlib.contextmanager
def interrupt_on(*signals: int | None) -> Iterator[None]:
    """Inside the block, each of `signals` (None entries are skipped) raises KeyboardInterrupt, so a run stops as on
    Ctrl-C, and is remembered for raise_if_interrupted; a second signal is ignored while the first one's clean-up
    runs (FORCE_AFTER). The previous handlers are restored after. Blocks nest: an inner block keeps what the outer
    one received. Handlers can only be set in the main thread; elsewhere this does nothing."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth == 0:
        _received.clear()
        _previous_hook[0], sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
    _depth += 1
    previous = {sig: signal.signal(sig, _interrupt) for sig in signals if sig is not None}
    try:
        yield
    finally:
        _depth -= 1
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if _depth == 0:
            sys.unraisablehook = _previous_hook[0]


def spawned_child(target, *args) -> None:
    """The entry of a child process a launcher spawned with STOP_SIGNALS blocked (latentsweep.search.study.runner): the
    terminal's Ctrl-C reaches the whole process group, but the launcher stops its children itself (SIGTERM), so a
    child ignores SIGINT until its own work installs a handler, and a SIGTERM or SIGHUP during its start-up (imports)
    ends it without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _forced[0] = False  # the launcher's SIGTERM after the terminal's SIGINT is one stop, not two
    with interrupt_on(*(s for s in STOP_SIGNALS if s != signal.SIGINT)):
        _end_with_parent()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
        try:
            target(*args)
        except KeyboardInterrupt:
            pass
    end_quickly()  # its launcher waits for it to exit


def _end_with_parent() -> None:
    """Linux: this process gets SIGTERM when its launcher dies, however it dies (SIGKILL included), so no worker
    outlives its job (prctl PR_SET_PDEATHSIG); a launcher already gone sends it now. Elsewhere nothing."""
    import ctypes
    import ctypes.util
    import multiprocessing

    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """STOP_SIGNALS held back (not lost) in this thread inside the block: processes started here inherit the mask,
    so none is interrupted in its start-up before spawned_child decides what a signal means to it."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# Tests only (README, Tests): the CLI's clock starts this many seconds before the process did (a back-dated start),
# so that a test or a benchmark smoke of the smallest budget (`run --time 60`) waits out 60 - N s of it, not 60. It
# can only shorten a job: the 60-s minimum and the promise to end inside --time are unchanged.
TEST_SPENT_ENV = "LATENTSWEEP_TEST_SPENT_S"


def end_quickly() -> None:
    """Called once a process's work is done: the interpreter's teardown then skips the garbage collector's passes over
    the million objects torch, MLflow, Optuna and pandas leave (gc.freeze; exit handlers still run). The exit after
    those imports took 7-8.5 s at a load average of 11 on 2 cores, 1.0-1.4 s frozen (2026-11-27), and the user's
    clock of `run --time` counts it."""
    gc.disable()
    gc.freeze()


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once its work and clean-up are done: exit handlers run (atexit) and the output is
    flushed, without the interpreter's teardown after them. A command stopped by a signal returns 128 + its number,
    yet under CPython 3.11 it exited by SIGINT (-2) in 4 of 40 runs of a population stopped by Ctrl-C
    (tests/test_population_study.py), after its one line and with no traceback; in those runs CPython's
    _Py_UnhandledKeyboardInterrupt flag was set (read with ctypes), which happens when a KeyboardInterrupt escapes
    code Python runs nested. The exact path to the SIGINT was not found; without the teardown, 0 of 48 runs. Nothing
    is left for the teardown to do: the command closed its trials, runs and workers."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing more can be said
            stream.flush()
    os._exit(code)


def process_started() -> float:
    """When this process started, on time.monotonic()'s clock (psutil reads the kernel's start time of the process:
    interpreter start-up and imports are seconds on a loaded machine, and the user's clock counts them), back-dated
    by $LATENTSWEEP_TEST_SPENT_S (tests only; anything but a number of seconds >= 0 is ignored)."""
    import psutil  # only the CLI's entry asks, once

    age = time.time() - psutil.Process().create_time()
    try:
        spent = float(os.environ.get(TEST_SPENT_ENV, "0"))
    except ValueError:
        spent = 0.0
    spent = spent if math.isfinite(spent) and spent > 0 else 0.0
    return time.monotonic() - min(max(age, 0.0) + spent, time.monotonic())


# Tests only (README, Tests): the least `run --time` accepts, lowered from the product's minimum to this many seconds,
# so that a test or a benchmark smoke of a one-budget run that needs no pick (the floor and a trial on tiny data) spends
# 20 s, not 60. It can only shorten a job: a budget it lets through runs like any other, and without it nothing
# changes.
TEST_MIN_TIME_ENV = "LATENTSWEEP_TEST_MIN_TIME_S"


def least_time(minimum: float) -> float:
    """The least `run --time` accepts: `minimum`, or $LATENTSWEEP_TEST_MIN_TIME_S when it is a number of seconds above
    0 and below `minimum` (tests only; anything else is ignored)."""
    try:
        lowered = float(os.environ.get(TEST_MIN_TIME_ENV, "nan"))
    except ValueError:
        return minimum
    return lowered if 0.0 < lowered < minimum else minimum  # nan and inf fail a comparison
