"""The one-budget job (`latentsweep run STUDY --time 30m`): one wall-clock budget split between the search and the
pick, the split re-estimated before every trial from the finished trials' measured costs (search.study.budget), the
trial running at the search's end stopped there (its best finished epoch kept), then the pick with what is left."""
from __future__ import annotations

import re
import time
from dataclasses import replace

from search.pick.outputs import PickResult
from search.pick.picker import PickOptions, estimate_pick, run_pick
from search.pick.plan import note
from search.study.budget import (
    PICK_FIXED_S, RESERVE_MAX_FRACTION, RESERVE_MIN_FRACTION, RESERVE_REFITS, SearchBudget,
)
from search.study.runner import run_study
from search.study.worker import RunSpec
from trainers.errors import LatentsweepError

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
# Below this a one-budget run cannot train one trial and one refit of anything but a toy (seconds).
MIN_TOTAL_S = 60.0
# Once the search has reached the reserve, the pick's own plan (its selection costs no training) says what it needs;
# the search goes on when that leaves at least MIN_MORE_SEARCH_S, keeping PICK_MARGIN x the plan for the pick (the
# estimates of refits were within 20% of what they took on the demo holdouts).
PICK_MARGIN = 1.25
MIN_MORE_SEARCH_S = 30.0


def parse_duration(text: str) -> float:
    """'30m', '1h30m', '90s', '600' (seconds) -> seconds; anything else is a one-line error."""
    word = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", word):
        seconds = float(word)
    elif word and re.fullmatch(r"(\d+(\.\d+)?[hms])+", word):
        seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", word))
    else:
        raise LatentsweepError(f"--time must be a duration like 30m, 1h30m, 90s or 600 (seconds), got '{text}'")
    if seconds < MIN_TOTAL_S:
        raise LatentsweepError(f"--time {text} is {seconds:g} s: a search and a pick need at least "
                               f"{MIN_TOTAL_S:.0f} s")
    return seconds


def describe_split(total: float) -> str:
    """The split printed before any work starts."""
    return (f"run: {total:.0f} s in all. The search runs until the pick's reserve begins: {RESERVE_REFITS} refits "
            f"of the best trials on every labelled image plus {PICK_FIXED_S:.0f} s, estimated from the trials' "
            f"measured costs before each trial, within {RESERVE_MIN_FRACTION:.0%}-{RESERVE_MAX_FRACTION:.0%} of the "
            f"budget ({RESERVE_MAX_FRACTION:.0%} until a trial has finished); the trial running then stops there and "
            "keeps its best epoch. The pick gets every second left.")


def run_one_budget(spec: RunSpec, total: float, pick: PickOptions, workers: int = 1,
                   started: float | None = None) -> tuple[dict, PickResult]:
    """Search then pick within `total` seconds from `started` (time.time(), default now): (the study summary, the
    pick's result). `pick` gives the pick's options; its budget is replaced by the time left after the search."""
    budget = SearchBudget(time.time() if started is None else started, total)
    note(describe_split(total))
    summary = run_study(replace(spec, timeout=None, budget=budget), workers=workers)
    need = estimate_pick(pick, budget.left())
    spare = budget.left() - need * PICK_MARGIN if need is not None else 0.0
    if spare >= MIN_MORE_SEARCH_S:  # the reserve was a rule of thumb; the pick's own plan is known now
        note(f"the pick's plan needs about {need:.0f} s of the {budget.left():.0f} s left: the search goes on for "
             f"{spare:.0f} s more")
        summary = run_study(replace(spec, timeout=None, budget=replace(budget, reserve_s=budget.left() - spare)),
                            workers=workers)
    left = budget.left()
    note(f"search done in {total - left:.0f} s ({summary.get('trials_finished', 0)} trials); the pick gets the "
         f"{left:.0f} s left")
    if left <= 0:
        raise LatentsweepError(f"the search used the whole budget of {total:.0f} s: nothing is left for the pick")
    return summary, run_pick(replace(pick, budget=left))


__all__ = ["MIN_TOTAL_S", "describe_split", "parse_duration", "run_one_budget"]
