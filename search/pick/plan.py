"""The time plan of `latentsweep pick`: its default budget, what the budget buys (candidates, folds, refit seeds),
the estimate printed before any training, and the clock that reports each job (i of n, elapsed, left).

What a pick spends its time on, in order:
  1. fold jobs: every candidate retrained on k-1 image folds, k times (out-of-fold predictions for the selection);
  2. refits: the chosen members retrained on every labelled image, one seed each and more while the budget lasts.
The fold models are not thrown away: a chosen member's k fold models are bagged into the submission with its refits
(AutoGluon predicts with its bagged fold models the same way), so the selection's compute is also submission compute.

The plan shrinks along REDUCTIONS until its estimate fits the budget, keeping one refit of the best candidate (one
model that saw every image). The budget is one latentsweep.trainers.core.deadline.Deadline (a `latentsweep run` passes
its job's). Jobs
run candidate by candidate; a job starts only when its estimate fits before the deadline less the export's reserve
and stops there keeping its best finished epoch (or is dropped, its seconds said), so the export's share stays free;
a candidate whose folds are then incomplete leaves the selection (its finished jobs are kept and reused by the next
pick).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.progress import say

# The default budget is this fraction of the study's wall time: a pick is a finishing step, not a second study.
DEFAULT_BUDGET_FRACTION = 0.5
# ... within these bounds (seconds): even a short study gets a minute (one refit and a small selection), and no pick
# runs longer than 10 minutes unless asked (`--budget SECONDS` or `--budget none`).
DEFAULT_BUDGET_MIN, DEFAULT_BUDGET_MAX = 60.0, 600.0
# Order in which the plan gives work up: folds first (5 -> 3 keeps every image in the selection and 3 bagged models
# per member on 2/3 of the images), then the weakest candidates; one candidate needs no selection at all, and then
# only its refit seeds are left to shrink. Two folds (models on half the images) are never planned.
REDUCTIONS = (("folds", 3), ("top", 4), ("top", 3), ("top", 2), ("top", 1), ("seeds", 2), ("seeds", 1))


def default_budget(wall_seconds: float | None) -> tuple[float, str]:
    """(seconds, why) of the default pick budget from the study's wall time (None: unknown)."""
    if not wall_seconds:
        return DEFAULT_BUDGET_MAX, f"default, the study's wall time is unknown (at most {DEFAULT_BUDGET_MAX:.0f} s)"
    budget = min(max(DEFAULT_BUDGET_FRACTION * wall_seconds, DEFAULT_BUDGET_MIN), DEFAULT_BUDGET_MAX)
    return budget, (f"default: {DEFAULT_BUDGET_FRACTION:g} x the study's {wall_seconds:.0f} s wall time, within "
                    f"{DEFAULT_BUDGET_MIN:.0f}-{DEFAULT_BUDGET_MAX:.0f} s")


def study_wall_seconds(trials) -> float | None:
    """Seconds from the first trial's start to the last finished trial's end (what the user waited for the study)."""
    starts = [t.datetime_start for t in trials if t.datetime_start]
    ends = [t.datetime_complete for t in trials if t.datetime_complete]
    return (max(ends) - min(starts)).total_seconds() if starts and ends else None


@dataclass
class Plan:
    top: int
    folds: int  # 0 = no out-of-fold selection (a single member)
    seeds: int  # refit seeds per chosen member wanted; the refit step gives as many as the rest of the budget holds
    estimate: float  # estimated seconds of the planned jobs (folds, plus one refit of the best candidate)
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.folds:
            return (f"{self.top} candidates x {self.folds} folds = {self.top * self.folds} fold jobs and one refit, "
                    f"estimated {self.estimate:.0f} s; then refits of the chosen members, up to {self.seeds} seed(s) "
                    "each, while the budget lasts")
        return f"1 candidate, no selection, {self.seeds} refit seed(s), estimated {self.estimate:.0f} s"


def plan(cost_of: Callable[[int, int, int], float], top: int, folds: int, seeds: int,
         budget: float | None) -> Plan:
    """Shrink (top, folds, seeds) along REDUCTIONS until cost_of(top, folds, seeds) (estimated seconds) fits the
    budget; each drop is noted. cost_of counts the fold jobs and, with folds, one refit of the best candidate, without
    folds (a single candidate) its `seeds` refits."""
    knobs = {"top": top, "folds": folds if top > 1 else 0, "seeds": seeds}
    notes: list[str] = []
    for knob, value in REDUCTIONS:
        estimate = cost_of(**knobs)
        if budget is None or estimate <= budget:
            break
        if knobs[knob] > value:
            notes.append(f"budget {budget:.0f} s: estimated {estimate:.0f} s, so {knob} {knobs[knob]} -> {value}")
            knobs[knob] = value
            if knobs["top"] == 1:
                knobs["folds"] = 0
    estimate = cost_of(**knobs)
    if budget is not None and estimate > budget:
        notes.append(f"budget {budget:.0f} s: still estimated {estimate:.0f} s at the smallest plan (one job)")
    return Plan(knobs["top"], knobs["folds"], knobs["seeds"], estimate, notes)


# The pick's work besides its training jobs, the one home of its costs, from one measurement (the demo data on 2
# cores): loading the candidates and the selection took about SELECT_S, and the export after the last job (the
# submission's predictions, the pyfunc model with every checkpoint, the MLflow run and its files) about
# EXPORT_FIXED_S plus EXPORT_PER_MODEL_S per model in the submission: 15-25 s in all.
# - the clock keeps the export's share of the budget free when it admits a job;
# - a one-budget job starts the pick only with PICK_MIN_S left (with less it would overrun the budget to replace a
#   submission already in place);
# - and its search reserves PICK_FIXED_S for that work (the measurement's top, with a margin), besides one prediction
#   of the val split per candidate of the pool (latentsweep.search.study.budget.PickCost).
EXPORT_FIXED_S, EXPORT_PER_MODEL_S = 10.0, 1.0
# The MLflow model alone (search/pick/pyfunc_model.log_ensemble: torch.export of each member, the pyfunc saved, logged
# and registered), the part of the export admitted by the deadline itself: 3.5-3.7 s for two of the tests' members on
# 2 quiet cores (2026-11-27), the first member's torch.export 2.5-2.8 s of it, a next member's 0.2 s.
MODEL_EXPORT_S = 4.0
SELECT_S = 10.0
PICK_MIN_S = EXPORT_FIXED_S + SELECT_S
PICK_FIXED_S = 30.0
# A measured/estimated ratio outside these bounds says more about one odd job than about the estimates: clipped.
FACTOR_BOUNDS = (0.25, 4.0)


class Clock:
    """The pick's clock on the job's one deadline (latentsweep.trainers.core.deadline; Deadline.never() for an unbounded
    pick). A job
    starts only when its estimate (scaled by what the jobs so far really took against their estimates) fits in what
    is left before the deadline after the export's reserve, and trains with that reserve's start as its own deadline
    (latentsweep.search.pick.jobs.run_job): the export's share stays free; and one line per finished job."""

    def __init__(self, deadline: Deadline, started: float | None = None):
        self.deadline = deadline
        self.started = time.monotonic() if started is None else started
        self.done = 0
        self.total = 0  # jobs announced so far (fold jobs, then refits as they are planned)
        self.models = 1  # models the submission will export (the export's reserve grows with them)
        self.trained: list[tuple[float, float | None]] = []  # (seconds, estimate) of each job trained here
        self.finished: set[str] = set()

    @property
    def budget(self) -> float | None:
        """The pick's seconds from its start to the deadline (None: no deadline), for its lines and manifest."""
        return self.deadline.end - self.started if self.deadline.bounded else None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        """Seconds left before the deadline (never negative; inf without one)."""
        return self.deadline.left()

    def export_reserve(self) -> float:
        return EXPORT_FIXED_S + EXPORT_PER_MODEL_S * self.models

    @property
    def factor(self) -> float:
        """Measured / estimated seconds over the jobs trained so far (1 before any)."""
        pairs = [(s, e) for s, e in self.trained if e]
        if not pairs:
            return 1.0
        ratio = sum(s for s, _ in pairs) / sum(e for _, e in pairs)
        return min(max(ratio, FACTOR_BOUNDS[0]), FACTOR_BOUNDS[1])

    def expect(self, cost: float | None) -> float:
        """Expected seconds of a job estimated at `cost`: scaled by the factor; without an estimate, the mean of
        the jobs trained so far (0 before any: the first job of unknown cost is what teaches the clock)."""
        if cost is not None:
            return cost * self.factor
        seconds = [s for s, _ in self.trained]
        return sum(seconds) / len(seconds) if seconds else 0.0

    def admits(self, cost: float | None) -> bool:
        """Whether a job estimated at `cost` seconds may start: a reused job (cost 0) always, otherwise only while
        its expected seconds fit before the deadline less the export's reserve."""
        if not self.deadline.bounded or cost == 0.0:
            return True
        left = self.left() - self.export_reserve()
        return left > 0 and self.expect(cost) <= left

    def job_deadline(self) -> Deadline:
        """Where a job must stop (keeping its best finished epoch): the deadline less the export's reserve."""
        return self.deadline.earlier(self.export_reserve()) if self.deadline.bounded else self.deadline

    def announce(self, jobs: int) -> None:
        self.total += jobs

    def timed(self, job, train: Callable[[], tuple], queue: list):
        """Run `train()` -> (checkpoint or None when the deadline left no finished epoch, seconds or None when
        reused) for `job`; record it and report one line with the expected seconds of the jobs of `queue` not yet
        run. Returns the checkpoint (None: the job was dropped, its seconds said)."""
        ckpt, seconds = train()
        if seconds is not None:
            self.trained.append((seconds, job.cost))
        self.finished.add(job.name)
        remaining = sum(self.expect(j.cost) for j in queue if j.name not in self.finished)
        what = describe_job(job, seconds) if ckpt is not None else (
            f"dropped: the deadline came before its first epoch ended ({seconds:.0f} s spent)")
        self.job_done(job.name, what, remaining)
        return ckpt

    def job_done(self, name: str, what: str, remaining_estimate: float) -> None:
        """After a job: 'job i/n NAME: WHAT; elapsed, about N s left of the plan'."""
        self.done += 1
        budget = f" of {self.budget:.0f} s" if self.budget is not None else ""
        say(f"latentsweep: job {self.done}/{self.total} {name}: {what}; elapsed {self.elapsed:.0f} s{budget}, "
            f"about {max(remaining_estimate, 0.0):.0f} s of planned work left")


def describe_job(job, seconds: float | None) -> str:
    """What a finished job did, for the pick's progress line."""
    if seconds is None:
        return f"reused {job.run_dir}"
    epochs = job.cfg.train.stop_after or job.cfg.train.epochs
    estimated = "no estimate" if job.cost is None else f"estimated {job.cost:.0f} s"
    return f"trained {epochs} epochs in {seconds:.0f} s ({estimated})"


__all__ = ["Clock", "Plan", "default_budget", "describe_job", "plan", "study_wall_seconds"]
