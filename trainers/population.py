"""Population trials: several trials of one shape group trained side by side, each member its own run.

The contract (search/ builds on it): a `Member` is one trial's config with its own callback (Optuna's report and
prune), output folder, deadline and `done` hook; `train_population` trains them and hands each member's end (a
TrainResult, or the exception that ended it) to its `done` hook, once, however it ended. A member that fails
(NaN, a bad configuration, a pruner) ends alone; the others go on. KeyboardInterrupt/SystemExit stop them all.
`join()` is asked for a new member whenever a place is free; None means no more.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from trainers.config import Config
from trainers.data import TrainSet
from trainers.deadline import Deadline
from trainers.loop import EpochReport, TrainResult, train


@dataclass(frozen=True)
class Member:
    """One trial of a population: what `trainers.loop.train` takes for one run, plus its `done` hook."""
    cfg: Config
    callback: Callable[[EpochReport], None] | None = None  # sees each epoch; raising ends this member alone
    out_dir: Path | None = None
    deadline: Callable[[], Deadline | None] | None = None
    done: Callable[[TrainResult | BaseException], None] | None = None  # the member's end, called once


def stack_key(cfg: Config) -> tuple | None:
    """Members whose keys are equal may share one stacked step; None: this config trains alone."""
    return None


def train_population(members: Sequence[Member], data: TrainSet, *, join: Callable[[], Member | None] | None = None,
                     progress: bool = False) -> list[TrainResult | BaseException]:
    """Train `members` (and those `join` adds) and return each one's end in the order they started. This first
    version trains them one after another; the stacked step replaces it with the same contract."""
    ends: list[TrainResult | BaseException] = []
    queue = list(members)
    while queue or join is not None:
        member = queue.pop(0) if queue else join()
        if member is None:
            break
        try:
            end: TrainResult | BaseException = train(member.cfg, data, callback=member.callback,
                                                     out_dir=member.out_dir, progress=progress,
                                                     deadline=member.deadline)
        except Exception as exc:  # noqa: BLE001 - the member's end, handed to its caller who classifies it
            end = exc
        ends.append(end)
        if member.done is not None:
            member.done(end)
    return ends


__all__ = ["Member", "stack_key", "train_population"]
