"""The `latentsweep` command line: one sub-command module per area, user errors as one line and exit 2."""
from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from search.failures import StudyHalted, one_line
from search.process import configure_process

# Each module of search.cli named here exposes add_parser(subparsers); the handler it sets as `func` returns an exit
# code and is named after its command: `latentsweep study run` -> cmd_study_run (tests/test_layout.py checks it).
COMMAND_MODULES = ("data", "submission", "train", "study", "pick", "run", "ui")
# The module of each top-level command (tests/test_layout.py checks it against the parsers): a command imports only its
# own module, so `latentsweep train` does not load MLflow, pandas and the picker through the others (0.13 GB of RSS
# at start, README "Challenge-size training memory"). --help, --version and an unknown command build every parser.
MODULE_OF = {"data": "data", "submission": "submission", "train": "train", "predict": "train", "study": "study",
             "worker": "study", "pick": "pick", "run": "run", "ui": "ui"}


class OneLineParser(argparse.ArgumentParser):
    """Argument errors as one line like every other user error (argparse prints the usage first): exit 2.
    Sub-command parsers inherit the class (add_subparsers uses the parent's class)."""

    def error(self, message: str):
        where = self.prog.removeprefix("latentsweep").strip()
        self.exit(2, f"latentsweep: error: {where + ': ' if where else ''}{message} (see --help)\n")


def version() -> str:
    """The installed distribution's version (pyproject.toml), or 'unknown' when run from a bare checkout."""
    try:
        return dist_version("latentsweep")
    except PackageNotFoundError:
        return "unknown"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of `command` alone when it is a known top-level command, else of every command."""
    parser = OneLineParser(
        prog="latentsweep",
        description="Hyperparameter search and experiment tracking for latent-space translation.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in [MODULE_OF[command]] if command in MODULE_OF else COMMAND_MODULES:
        importlib.import_module(f"search.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `latentsweep` entry point: the one place (with a spawned worker's entry) that sets process-wide state."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv[0] if argv else None)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or an argument error (2, already printed): an exit code, as for the rest
        return int(exc.code or 0)
    configure_process()
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("latentsweep: interrupted", file=sys.stderr)
        return 130
    except StudyHalted as exc:  # a worker's bug, its traceback already printed by that worker: exit 1, not 2
        print(f"latentsweep: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # classified once (search.failures): a bug keeps its traceback, the rest is one line
        line = one_line(exc)
        if line is None:
            raise
        print(f"latentsweep: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
