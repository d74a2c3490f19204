"""The time split of a one-budget run (`latentsweep run --time`): how long its search may go on, given what the pick
after it needs, re-estimated before every trial and after every epoch from the trials' measured costs (latentsweep.trainers.train.cost)."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import optuna
from optuna.trial import TrialState

from latentsweep.search.study.contract import JUDGED_KEY, StudyRecord, read_timing, read_trials
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.train.cost import contention

# What the pick is reserved: this many refits on every labelled image of the best trials' configs. On the held-out
# challenge-format set of issue 19, 7 refits (4 members) reached 0.640 test MRR and 12 refits (3 seeds x 4) added
# nothing, so about 8 refits is what a pick turns into test score.
RESERVE_REFITS = 8
# ... plus the pick's own work (PickCost, decided by the pick: latentsweep.search.pick.plan and
# latentsweep.search.pick.options).
# The reserve stays within these fractions of the whole budget (the search always gets half). Before any trial has
# measured an epoch it is the lower bound: with nothing measured the pick has nothing to refit, and the first epoch
# measured sets the reserve, which stops that trial at once if it must. As the upper bound (until 2026-11-27), short
# budgets on a loaded machine never searched: at a load of 11 on 2 cores a `run --time 60` spent 17-24 s starting
# and 7-8 s on the floor, and 30 s of opening reserve left its knn side trial (15 s, +0.05 to +0.08 test MRR over the
# floor on demo holdouts 3 and 4) no room (benchmarks/warm_start.py logs; docs/one-budget.md).
RESERVE_MIN_FRACTION, RESERVE_MAX_FRACTION = 0.1, 0.5
# ... and never below this many times what the safe answer (latentsweep.search.pick.safe) took on this machine: the
# answer the
# job falls back to must always fit after the search.
SAFE_FACTOR = 2.0
# How long past its `--timeout` a spawned worker may take before the parent stops it: its running trial stops at its
# next step and closes (artifacts, figure, end of its MLflow run: under 5 s on the demo data on 2 cores); 30 s is 6x.
WATCHDOG_GRACE_S = 30.0
# The trials whose refit costs are averaged: the best few, since those are what the pick refits.
RESERVE_TRIALS = 3


@dataclass(frozen=True)
class PickCost:
    """What the pick after the search costs besides its refits, as the pick decides it (the one-budget job passes
    latentsweep.search.pick.plan.PICK_FIXED_S and the pool of latentsweep.search.pick.options.pool_size): its fixed work
    in seconds, and one prediction of the val split per candidate of its pool, each at what the keeper measured
    loading and scoring it took, or what its trial measured predicting the val split again (at challenge size most of
    the pick's own work)."""
    fixed_s: float
    pool: int


@dataclass(frozen=True)
class JobBudget:
    """The whole one-budget job's time (search and pick): `total_s` seconds ending at `deadline` (the one deadline
    of the job, latentsweep.trainers.core.deadline); `pick` what the pick costs besides its refits; `floor_s` is what
    the closed-form
    floor (latentsweep.search.pick.safe) took on this machine (the reserve's lowest bound)."""
    deadline: Deadline
    total_s: float
    pick: PickCost
    floor_s: float = 0.0
    # how many times longer the pick's fixed work (measured quiet) takes on this machine now
    slowdown: Callable[[], float] = contention

    def reserve(self, study: optuna.Study, captions: int, images: int) -> float:
        """Seconds kept for the pick: RESERVE_REFITS refits of the best measured trials on every labelled image
        (`captions`, `images`), counted only when one of them beats the job's answer in place on the val split
        (answer_to_beat: the pick refits only an ensemble that beat it first), plus the pick's fixed work and one
        prediction of the val split per candidate of its pool (the fixed work scaled by the machine's load: `slowdown`;
        the measured parts carry it already); within RESERVE_MIN/MAX_FRACTION of the total and never
        below SAFE_FACTOR x the safe answer. A slower machine or bigger data never gets a smaller one."""
        costs = refit_costs(study, captions, images, max(RESERVE_TRIALS, self.pick.pool))
        low, high = RESERVE_MIN_FRACTION * self.total_s, RESERVE_MAX_FRACTION * self.total_s
        floor = SAFE_FACTOR * self.floor_s
        if not costs:
            return self.opening_reserve()
        record = StudyRecord.of(study)
        # the candidates so far, each at what the keeper measured the pick pays for it (load and score) or else what
        # its trial measured predicting the val split again; places not yet filled cost the cheapest
        judged = judged_seconds(record)
        pool = [judged.get(c.number, c.pick_s) for c in costs[:self.pick.pool]]
        fixed = self.pick.fixed_s * self.slowdown() + sum(pool) + (self.pick.pool - len(pool)) * min(pool)
        to_beat = answer_to_beat(record)
        refitted = [c for c in costs[:RESERVE_TRIALS] if to_beat is None or c.value > to_beat]
        refits = RESERVE_REFITS * statistics.fmean(c.refit_s for c in refitted) if refitted else 0.0
        return max(min(max(refits + fixed, low), high), floor)

    def opening_reserve(self) -> float:
        """The reserve before anything is measured: no trial starts unless more than this is left. The smallest the
        pick may ever get (hard_stop's), as nothing is measured for it to refit yet."""
        return max(RESERVE_MIN_FRACTION * self.total_s, SAFE_FACTOR * self.floor_s)

    def hard_stop(self) -> Deadline:
        """When the search's workers must be gone whatever their trials measured: before the smallest reserve the
        pick may ever get (the watchdog of latentsweep.search.study.runner enforces it on spawned workers)."""
        return self.deadline.earlier(self.opening_reserve())

    def search_end(self, study: optuna.Study, captions: int, images: int) -> Deadline:
        """When the search stops: no trial starts after it and a running one stops there."""
        return self.deadline.earlier(self.reserve(study, captions, images))


@dataclass(frozen=True)
class TrialCost:
    """One measured trial, as the reserve reads it: its number, its refit on every labelled image, what predicting the
    val split costs the pick for it (Timing.pick_s) and its best reported value."""
    number: int
    refit_s: float
    pick_s: float
    value: float


def answer_to_beat(record: StudyRecord) -> float | None:
    """The val MRR of the job's answer in place (ANSWER_ATTR, written by its keeper), when the study's trials report
    the same measure (objective val/mrr, maximised); None otherwise, or before the keeper has judged one."""
    if record.objective != "val/mrr" or not record.maximize or record.answer is None:
        return None
    score = record.answer.get("val_mrr")
    return float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else None


def judged_seconds(record: StudyRecord) -> dict[int, float]:
    """trial number -> seconds the keeper took to load and score its checkpoint on the val split (JUDGED_KEY of the
    answer in place); an entry that is not a number of seconds is left out (its trial's own measure counts)."""
    judged = (record.answer or {}).get(JUDGED_KEY)
    if not isinstance(judged, dict):
        return {}
    return {int(n): float(s) for n, s in judged.items() if isinstance(n, str) and n.isdigit()
            and isinstance(s, (int, float)) and not isinstance(s, bool) and 0 <= s < float("inf")}


def workers_stop(budget: JobBudget | None, timeout: float | None) -> Deadline:
    """When a launcher stops the workers it spawned now (SIGTERM; their trials are retried): a one-budget run's
    hard stop, or `--timeout` + WATCHDOG_GRACE_S from now, the sooner (Deadline.never() without either)."""
    hard = budget.hard_stop() if budget is not None else Deadline.never()
    return hard.sooner(Deadline.after(None if timeout is None else timeout + WATCHDOG_GRACE_S))


def refit_costs(study: optuna.Study, captions: int, images: int, n: int = RESERVE_TRIALS) -> list[TrialCost]:
    """For each of the best `n` trials that recorded their timings, best first: the estimated seconds of its refit on
    every labelled image (its best epoch so far + 1 epochs, no validation), what predicting the val split costs the
    pick for it and its best reported value; running trials count from their first epoch."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    trials = read_trials(study, states)
    timings = {t.number: read_timing(t, study.study_name) for t in trials}
    done = [t for t in trials if timings[t.number] and t.intermediate_values]
    sign = 1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else -1.0
    done.sort(key=lambda t: -sign * max(sign * v for v in t.intermediate_values.values()))
    out = []
    for t in done[:n]:
        values = t.intermediate_values
        best_epoch = max(values, key=lambda e: sign * values[e])
        timing = timings[t.number]
        out.append(TrialCost(t.number, timing.estimate(captions, images, best_epoch + 1), timing.pick_s(),
                             values[best_epoch]))
    return out


__all__ = ["JobBudget", "PickCost", "TrialCost", "answer_to_beat", "judged_seconds", "refit_costs", "workers_stop"]
