"""The time split of a one-budget run (`latentsweep run --time`): how long its search may go on, given what the pick
after it needs, re-estimated before every trial from the finished trials' measured costs (trainers.cost)."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import optuna
from optuna.trial import TrialState

from search.study.objective import TIMING_ATTR
from trainers.cost import Timing

# What the pick is reserved: this many refits on every labelled image of the best trials' configs. On the held-out
# challenge-format set of issue 19, 7 refits (4 members) reached 0.640 test MRR and 12 refits (3 seeds x 4) added
# nothing, so about 8 refits is what a pick turns into test score.
RESERVE_REFITS = 8
# ... plus the pick's own fixed work (candidates' checkpoints, predictions, the export of the model and its MLflow
# run), measured at 15-25 s on the demo data on 2 cores.
PICK_FIXED_S = 30.0
# The reserve stays within these fractions of the whole budget: before any trial has finished (nothing measured
# yet) it is the upper bound, so a first slow trial cannot eat the pick's time; and the search always gets half.
RESERVE_MIN_FRACTION, RESERVE_MAX_FRACTION = 0.1, 0.5
# The trials whose refit costs are averaged: the best few, since those are what the pick refits.
RESERVE_TRIALS = 3


@dataclass(frozen=True)
class SearchBudget:
    """The whole job's wall-clock budget: it started at `start` (time.time()) and has `total` seconds."""
    start: float
    total: float
    reserve_s: float | None = None  # a reserve fixed by the caller (the pick's own estimate) instead of the rule
    @property
    def end(self) -> float:
        return self.start + self.total

    def reserve(self, study: optuna.Study, captions: int, images: int) -> float:
        """Seconds kept for the pick: RESERVE_REFITS refits of the best measured trials on every labelled image
        (`captions`, `images`), plus PICK_FIXED_S, within RESERVE_MIN/MAX_FRACTION of the total. When not even one
        refit fits in the largest reserve (a loss whose cost grows with the images, at challenge size), the pick
        will submit the trials' own checkpoints, so it keeps only the smallest reserve and the search the rest."""
        if self.reserve_s is not None:
            return self.reserve_s
        costs = refit_costs(study, captions, images)
        low, high = RESERVE_MIN_FRACTION * self.total, RESERVE_MAX_FRACTION * self.total
        if not costs:
            return high
        refit = statistics.fmean(costs)
        if refit + PICK_FIXED_S > high:
            return max(PICK_FIXED_S, low)
        return min(max(RESERVE_REFITS * refit + PICK_FIXED_S, low), high)

    def search_end(self, study: optuna.Study, captions: int, images: int) -> float:
        """time.time() at which the search stops: no trial starts after it and a running one stops there."""
        return self.end - self.reserve(study, captions, images)

    def left(self) -> float:
        return max(self.end - time.time(), 0.0)


def refit_costs(study: optuna.Study, captions: int, images: int) -> list[float]:
    """Estimated seconds of a refit on every labelled image for each of the best RESERVE_TRIALS trials that recorded
    their timings (their best epoch so far + 1 epochs, no validation); running trials count from their first epoch."""
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    done = [t for t in study.get_trials(deepcopy=False, states=states)
            if Timing.from_attrs(t.user_attrs.get(TIMING_ATTR)) and t.intermediate_values]
    sign = 1.0 if study.direction == optuna.study.StudyDirection.MAXIMIZE else -1.0
    done.sort(key=lambda t: -sign * max(sign * v for v in t.intermediate_values.values()))
    out = []
    for t in done[:RESERVE_TRIALS]:
        values = t.intermediate_values
        best_epoch = max(values, key=lambda e: sign * values[e])
        out.append(Timing.from_attrs(t.user_attrs[TIMING_ATTR]).estimate(captions, images, best_epoch + 1))
    return out


__all__ = ["SearchBudget", "refit_costs"]
