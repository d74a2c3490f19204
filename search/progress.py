"""Where search points the progress channel (trainers/core/progress.py, whose `say` every line goes through): stderr in
the CLI and the workers it spawns (above any tqdm bar), nothing for an API call with progress=False (its libraries
quiet too); and the one user-error line, which is said on stderr quiet or not (an error is not progress). Progress
bars follow the commands' own `progress`/`--quiet` switches."""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import warnings
from typing import Iterator

from latentsweep.trainers.core.progress import progress_to, set_progress_sink


def stderr_sink(line: str) -> None:
    """One line on stderr, above any tqdm bar of this process (tqdm.write keeps the bar intact)."""
    from tqdm.auto import tqdm

    tqdm.write(line, file=sys.stderr)
    sys.stderr.flush()


# LATENTSWEEP_PROGRESS=off starts a process silent: the API's progress=False sets it for its call, so the worker
# processes a study spawns (`workers=K`) are silent too.
PROGRESS_ENV = "LATENTSWEEP_PROGRESS"
if os.environ.get(PROGRESS_ENV) != "off":  # `import latentsweep` (every CLI start, worker and API user) says on stderr
    set_progress_sink(stderr_sink)


def print_error(message: str) -> None:
    """The one user-error line, `latentsweep: error: MESSAGE`, on stderr (not on the progress channel)."""
    print(f"latentsweep: error: {message}", file=sys.stderr)


def report_error(exc: BaseException) -> int | None:
    """A command's or a spawned worker's failure as its one error line: returns the exit code (1: another worker's
    bug, whose traceback is in that worker's output; 2: a user error, a full disk, a store down), or None for a bug
    of ours or an interrupt, which the caller raises on (its traceback kept)."""
    from latentsweep.search.failures import (  # imported here: it loads torch, which --version must not
        StudyHalted, one_line,
    )

    halted = isinstance(exc, StudyHalted)
    line = str(exc) if halted else one_line(exc)
    if line is None:
        return None
    print_error(line)
    return 1 if halted else 2


OPTUNA_LOGGER = "optuna"
# The warnings latentsweep.search.process.quiet_optuna silences in the CLI's process, by message (Optuna's
# ExperimentalWarning
# class is not imported here: --version must not load Optuna).
OPTUNA_WARNINGS = (r".* is experimental", "Heartbeat of storage is supposed to be used with Study.optimize")


@contextlib.contextmanager
def quiet_libraries() -> Iterator[None]:
    """For the block: MLflow's migration lines and artifact bars off, as the CLI sets them for its whole process
    (latentsweep.search.process.quiet_mlflow), and the processes it spawns silent (PROGRESS_ENV); then all restored (a
    notebook's own settings are its own)."""
    from latentsweep.search.process import ENV_DEFAULTS, MIGRATION_LOGGERS, STORE_ERROR_LOGGER

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


__all__ = ["honours_progress", "print_error", "report_error", "stderr_sink"]
