"""The one deadline of a job: a monotonic end time that the search, the training loop and the pick all read, and
whether a piece of work of a measured cost still fits before it."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

# time.monotonic() is CLOCK_MONOTONIC on Linux (mach_absolute_time on macOS, QueryPerformanceCounter on Windows):
# one system-wide clock, so a Deadline pickled into a spawned worker process means the same instant there. It never
# jumps with the wall clock (NTP, a user changing the date), which time.time() does.


class DeadlineReached(Exception):
    """A run's deadline passed before its first epoch ended: there is no model to keep (not a config error)."""


@dataclass(frozen=True)
class Deadline:
    """An instant on time.monotonic(); `end = inf` (Deadline.never()) is no deadline: the one spelling of "none",
    never None."""
    end: float

    @classmethod
    def after(cls, seconds: float | None, start: float | None = None) -> "Deadline":
        """`seconds` after `start` (time.monotonic(); default now); None seconds: never."""
        if seconds is None:
            return cls.never()
        return cls((time.monotonic() if start is None else start) + seconds)

    @classmethod
    def never(cls) -> "Deadline":
        return cls(math.inf)

    @property
    def bounded(self) -> bool:
        return math.isfinite(self.end)

    def left(self) -> float:
        """Seconds left (never negative; inf without a deadline)."""
        return max(self.end - time.monotonic(), 0.0)

    def passed(self) -> bool:
        return time.monotonic() >= self.end

    def overrun(self) -> float:
        """Seconds past the deadline (0 when not passed)."""
        return max(time.monotonic() - self.end, 0.0) if self.bounded else 0.0

    def fits(self, seconds: float | None) -> bool:
        """Whether work measured at `seconds` would end before the deadline; unmeasured work (None) fits while the
        deadline has not passed (the first of a kind is what measures it)."""
        if seconds is None:
            return not self.passed()
        return time.monotonic() + seconds <= self.end

    def earlier(self, seconds: float) -> "Deadline":
        """The deadline `seconds` before this one (a stage that must leave that much for what follows it)."""
        return Deadline(self.end - seconds)

    def sooner(self, other: "Deadline") -> "Deadline":
        """The earlier of the two."""
        return self if self.end <= other.end else other


__all__ = ["Deadline"]
