"""The `latentsweep` command line: one sub-command module per area, user errors as one line and exit 2."""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as dist_version

from search.cli import data, pick, run, study, submission, train, ui
from search.failures import one_line
from search.process import configure_process
from search.study.objective import StudyHalted

# Each module exposes add_parser(subparsers); the handler it sets as `func` returns an exit code and is named after
# its command: `latentsweep study run` -> cmd_study_run (tests/test_layout.py checks it).
COMMAND_MODULES = (data, submission, train, study, pick, run, ui)


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


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="latentsweep",
        description="Hyperparameter search and experiment tracking for latent-space translation.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for module in COMMAND_MODULES:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The `latentsweep` entry point: the one place (with a spawned worker's entry) that sets process-wide state."""
    parser = build_parser()
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
