"""The `latentsweep` command line: one sub-command module per area, user errors as one line and exit 2."""
from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
import time
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from latentsweep.search.process import (
    STOP_SIGNALS, configure_process, end_quickly, exit_code, exit_now, interrupt_on, process_started, stopped_by,
)
from latentsweep.search.progress import print_error, report_error

# Each module of latentsweep.search.cli named here exposes add_parser(subparsers); the handler it sets as `func` returns
# an exit
# code and is named after its command: `latentsweep study run` -> cmd_study_run (tests/test_layout.py checks it).
COMMAND_MODULES = ("data", "submission", "train", "study", "pick", "run", "ui")
# The module of each top-level command (tests/test_layout.py checks it against the parsers): a command imports only its
# own module, so `latentsweep train` does not load MLflow, pandas and the picker through the others (0.13 GB of RSS
# at start, docs/memory.md).
MODULE_OF = {"data": "data", "submission": "submission", "train": "train", "predict": "train", "study": "study",
             "worker": "study", "pick": "pick", "run": "run", "ui": "ui"}
SIGPIPE_EXIT = 141  # 128 + SIGPIPE (13): what a shell reports for a writer whose reader left (`yes | head`)
# Each top-level command's one-line help, for the parser that `--help`, `--version`, no command and an unknown command
# get: it imports no command module, so they answer before torch, Optuna, MLflow or SQLAlchemy is loaded
# (docs/design.md, "Start-up"). tests/test_layout.py checks these lines against the commands' own parsers.
COMMAND_HELP = {
    "data": "check and build data files",
    "submission": "check or score a submission CSV",
    "train": "train a study file's base config once",
    "predict": "write a validated submission from one checkpoint",
    "study": "run and inspect Optuna studies",
    "worker": "join an existing study as one worker (any machine)",
    "pick": "ensemble a study's best trials into a submission (out-of-fold selection, refit on every labelled image)",
    "run": "search and pick within one time budget: the submission, MLflow runs and a registered model at the end",
    "ui": "serve the MLflow UI and optuna-dashboard until Ctrl-C",
}


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line like every other user error (argparse prints the usage first): exit 2.
    Sub-command parsers inherit the class (add_subparsers uses the parent's class)."""

    def error(self, message: str):
        where = self.prog.removeprefix("latentsweep").strip()
        print_error(f"{where + ': ' if where else ''}{message} (see --help)")
        self.exit(2)


def version() -> str:
    """The installed distribution's version (pyproject.toml), or 'unknown' when run from a bare checkout."""
    try:
        return dist_version("latentsweep")
    except PackageNotFoundError:
        return "unknown"


def build_parser(command: str | None = None, light: bool = False) -> argparse.ArgumentParser:
    """The parser of `command` alone when it is a known top-level command, else of every command (`light`: every
    command's name and help line only, from COMMAND_HELP, without importing their modules)."""
    parser = OneLineParser(
        prog="latentsweep",
        description="Hyperparameter search and experiment tracking for latent-space translation.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    if light and command not in MODULE_OF:
        for name, text in COMMAND_HELP.items():
            sub.add_parser(name, help=text)
        return parser
    for name in [MODULE_OF[command]] if command in MODULE_OF else COMMAND_MODULES:
        importlib.import_module(f"latentsweep.search.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `latentsweep` entry point: the one place (with a spawned worker's entry) that sets process-wide state.
    SIGTERM and SIGHUP stop a command as Ctrl-C does, from its start-up (imports) to its end: one line, the command's
    clean-up run (trials closed, workers stopped, temporary folders removed), exit 128 + the signal's number."""
    real = argv is None
    try:
        # A budget (`run --time`) counts from the process's start, imports included, as the user's clock does;
        # called from Python (a test, a notebook), from this call.
        started = process_started() if real else time.monotonic()
        with interrupt_on(*STOP_SIGNALS):
            try:
                code = _main(sys.argv[1:] if real else list(argv), started)
            except KeyboardInterrupt:
                code = _interrupted()
    except KeyboardInterrupt:  # at the very start or end of the block, outside its handlers
        code = _interrupted()
    if real:  # the process is ending, its work done: a late signal cannot interrupt its exit (a traceback, -15)
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        end_quickly()
        if stopped_by() is not None:  # 128 + the signal's number, whatever the interpreter's teardown would make it
            exit_now(code)
    return code


def _interrupted() -> int:
    """The one line of a command stopped by a signal, and its exit code."""
    name = signal.Signals(exit_code() - 128).name
    print(f"latentsweep: interrupted{'' if name == 'SIGINT' else f' ({name})'}", file=sys.stderr)
    return exit_code()


def _main(argv: list[str], started: float) -> int:
    parser = build_parser(argv[0] if argv else None, light=True)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argument error (2, already printed): an exit code, as for the rest
        return int(exc.code or 0)
    args.started = started
    configure_process()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # classified once (search/failures.py): a bug keeps its traceback, the rest one line
        if isinstance(exc, BrokenPipeError) and stdout_gone():
            return SIGPIPE_EXIT  # `latentsweep study status X | head`: the reader wants no more, and no error line
        code = report_error(exc)
        if code is None:
            raise
        return code


def stdout_gone() -> bool:
    """Whether stdout's reader has left (not another pipe or socket: a pipe without reader polls POLLERR)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() (Windows), or a stdout without a file (a test's capture)
        return False
    if gone:  # to /dev/null: Python's flush at exit would fail a second time (the process ends: no fd to close)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return gone


if __name__ == "__main__":
    sys.exit(main())
