"""The one progress channel: every line latentsweep tells its user (a trial's result, the pick's plan and jobs, a
warning, a note from the trainer) goes through `say` to one sink. Nothing is said until a sink is set: search sets
stderr in the CLI and its workers (search/progress.py); the Python API silences it (`progress=False`) or redirects it
(`set_progress_sink(callable)`). Library code never prints or logs: it calls `say` (the trainer lives below search,
so the channel lives here)."""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Callable, Iterator

Sink = Callable[[str], None]
_sink: Sink | None = None  # nothing is said until a sink is set
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
    from latentsweep.trainers.core.errors import LatentsweepError

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


__all__ = ["progress_to", "say", "set_progress_sink"]
