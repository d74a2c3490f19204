"""The one progress channel: every line latentsweep tells its user (a trial's result, the pick's plan and jobs, a
warning of the `latentsweep` logger, a note from the trainer) goes through `say` to one sink. The CLI keeps the
default sink, stderr (above any tqdm bar); the Python API silences it (`progress=False`) or redirects it
(`set_progress_sink(callable)`). Library code never prints: it calls `say` (search), `search.pick.plan.note` or
`search.study.progress.emit` (which call `say`), or the trainer's hook `trainers.progress.tell` (the `latentsweep`
logger, which this module routes here). Progress bars follow the commands' own `progress`/`--quiet` switches."""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import warnings
from typing import Callable, Iterator

Sink = Callable[[str], None]
# The loggers whose warnings are progress lines: the trainer's hook (and search's own lines) and search's modules
# (each logging under its module's name).
LOGGERS = ("latentsweep", "search")


def stderr_sink(line: str) -> None:
    """One line on stderr, above any tqdm bar of this process (tqdm.write keeps the bar intact)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


# LATENTSWEEP_PROGRESS=off starts a process silent: the API's progress=False sets it for its call, so the worker
# processes a study spawns (`workers=K`) are silent too.
PROGRESS_ENV = "LATENTSWEEP_PROGRESS"
_sink: Sink | None = None if os.environ.get(PROGRESS_ENV) == "off" else stderr_sink
_said: set = set()  # the `once` keys said to the current sink
_failed: list = []  # the current sink's first failure (said once on stderr, then its failures are ignored)


def set_progress_sink(sink: Sink | None) -> Sink | None:
    """Send every progress line to `sink` (a callable taking one line; None: say nothing); returns the previous
    sink. Lines said once per process (`say(..., once=key)`) are said again to a new sink. A sink that is not
    callable, or cannot be called with one line, is refused here (one line), not at the study's first line."""
    global _sink
    check_sink(sink)
    previous, _sink = _sink, sink
    _said.clear()
    _failed.clear()
    return previous


def check_sink(sink) -> None:
    """One-line LatentsweepError unless `sink` is None or callable with one positional argument (the line)."""
    from trainers.errors import LatentsweepError

    if sink is None:
        return
    if not callable(sink):
        raise LatentsweepError(f"progress sink must be a callable taking one line (or None), got "
                               f"{type(sink).__name__} {sink!r:.60}")
    try:
        signature = inspect.signature(sink)
    except (TypeError, ValueError):  # a builtin without a signature (print has one): called and seen
        return
    try:
        signature.bind("line")
    except TypeError as exc:
        raise LatentsweepError(f"progress sink {getattr(sink, '__name__', sink)!s:.60} must take one argument, the "
                               f"line ({exc})") from None


@contextlib.contextmanager
def progress_to(sink: Sink | None) -> Iterator[None]:
    """The sink for the block only."""
    previous = set_progress_sink(sink)
    try:
        yield
    finally:
        set_progress_sink(previous)


def say(line: str, once=None) -> None:
    """Tell the user one line; with `once`, only the first line of that key reaches the sink (a message every trial
    of a study would repeat)."""
    if once is not None:
        if once in _said:
            return
        _said.add(once)
    if _sink is not None:
        try:
            _sink(line)
        except Exception as exc:  # noqa: BLE001 - the user's sink: its failure must not stop a study
            if not _failed:
                _failed.append(exc)
                print(f"latentsweep: warning: the progress sink raised {type(exc).__name__}: {exc}; its failures "
                      "are ignored from now on", file=sys.stderr)


OPTUNA_LOGGER = "optuna"
# The warnings search.process.quiet_optuna silences in the CLI's process, by message (Optuna's ExperimentalWarning
# class is not imported here: --version must not load Optuna).
OPTUNA_WARNINGS = (r".* is experimental", "Heartbeat of storage is supposed to be used with Study.optimize")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the block: MLflow's migration lines and artifact bars off, as the CLI sets them for its whole process
    (search.process.quiet_mlflow), and the processes it spawns silent (PROGRESS_ENV); then all restored (a
    notebook's own settings are its own)."""
    from search.process import ENV_DEFAULTS, MIGRATION_LOGGERS, STORE_ERROR_LOGGER

    quiet_env = {**ENV_DEFAULTS, PROGRESS_ENV: "off"}
    env = {key: os.environ.get(key) for key in quiet_env}
    levels = {name: logging.getLogger(name).level for name in (*MIGRATION_LOGGERS, OPTUNA_LOGGER)}
    os.environ.update(quiet_env)
    for name in MIGRATION_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL if name == STORE_ERROR_LOGGER else logging.WARNING)
    logging.getLogger(OPTUNA_LOGGER).setLevel(logging.WARNING)  # its INFO lines (trials told, study created)
    try:
        with warnings.catch_warnings():  # Optuna's "experimental" warnings (heartbeats, fail_stale_trials)
            for text in OPTUNA_WARNINGS:
                warnings.filterwarnings("ignore", message=text)
            yield
    finally:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)


def honours_progress(function):
    """For an API function with a `progress` keyword: progress=False runs it with no sink and the libraries quiet
    (nothing said on stdout or stderr)."""
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if kwargs.get("progress", True) is not False:
            return function(*args, **kwargs)
        with progress_to(None), quiet_libraries():
            return function(*args, **kwargs)
    return wrapper


class ChannelHandler(logging.Handler):
    """A logging handler that says each record (WARNING and above) on the channel: `extra={"once": key}` says it
    once per sink."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(record.getMessage(), once=getattr(record, "once", None))
        except Exception:  # noqa: BLE001 - logging's rule: a handler never raises into the caller
            self.handleError(record)


def install() -> None:
    """Route the LOGGERS' warnings to the channel (once per process: `import search` does it)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(h, ChannelHandler) for h in logger.handlers):
            logger.addHandler(ChannelHandler())


install()

__all__ = ["progress_to", "say", "set_progress_sink", "stderr_sink"]
