"""The `latentsweep` command line: one sub-command module per area, user errors as one line and exit 2."""
from __future__ import annotations

import argparse
import importlib
import sys

from trainers.errors import LatentsweepError

# Each module exposes add_parser(subparsers); the handler it sets as `func` returns an exit code.
COMMAND_MODULES = (
    "search.cmd_data",
    "search.cmd_submission",
    "search.cmd_train",
    "search.cmd_study",
    "search.cmd_pick",
    "search.cmd_ui",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="latentsweep",
        description="Hyperparameter search and experiment tracking for latent-space translation.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LatentsweepError as exc:
        print(f"latentsweep: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("latentsweep: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
