"""The one-budget job (`latentsweep run STUDY --time 30m`): one deadline for the search and the pick, and always a
submission inside it. Its steps, each replacing the submission only with a better one:
  1. the pick's inputs checked (before any trial is stored);
  2. the closed-form ridge's submission, in seconds (the floor: a budget shorter than one trial still ends with it);
  3. the search, until the pick's reserve begins (search.study.budget, re-estimated after every epoch);
  4. the best trial's own checkpoint's submission;
  5. the pick (ensemble and refits) with every second left; a pick that fails on anything but our own bug, or that
     has no time left, leaves the submission of step 4.
The MLflow export and registration come after the submission is in place (search.pick.outputs)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from search.failures import Kind, classify, first_line
from search.pick.candidates import test_path_for
from search.pick.options import PickOptions, check_options, check_writable, out_path
from search.pick.outputs import PickResult
from search.pick.picker import run_pick
from search.pick.plan import EXPORT_FIXED_S, note
from search.pick.safe import Keeper, SafeAnswer, ridge_answer
from search.stores import safe_name
from search.study.budget import (
    PICK_FIXED_S, RESERVE_MAX_FRACTION, RESERVE_MIN_FRACTION, RESERVE_REFITS, SearchBudget,
)
from search.study.runner import run_study
from search.study.worker import RunSpec
from search.tracking.probe import probe_tracking_store
from trainers.data import check_text_dim, load_test, load_train_shared
from trainers.deadline import Deadline
from trainers.errors import DataError, LatentsweepError
from trainers.devices import resolve_device

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
# Below this a one-budget run cannot train one trial and one refit of anything but a toy (seconds).
MIN_TOTAL_S = 60.0
# Above this a budget is a typo, not a plan (a week): `--time` of 400 nines would otherwise be infinity.
MAX_TOTAL_S = 7 * 24 * 3600.0
# The pick starts only with at least this much left: its loading and selection plus the export's fixed part
# (search.pick.plan.EXPORT_FIXED_S) took 15-25 s on the demo data on 2 cores; with less, it would overrun the budget
# to replace a submission that is already in place.
PICK_MIN_S = EXPORT_FIXED_S + 10.0


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
    if not math.isfinite(seconds) or seconds > MAX_TOTAL_S:
        raise LatentsweepError(f"--time {text[:40]} is over {MAX_TOTAL_S / 86400:.0f} days: give a budget the job "
                               "can plan for")
    return seconds


def describe_split(total: float) -> str:
    """The split printed before any work starts."""
    return (f"run: {total:.0f} s in all, one deadline. A closed-form answer is written first (seconds), then the "
            f"search runs until the pick's reserve begins ({RESERVE_REFITS} refits of the best trials on every "
            f"labelled image, plus {PICK_FIXED_S:.0f} s and the candidates' validation, as measured, within "
            f"{RESERVE_MIN_FRACTION:.0%}-{RESERVE_MAX_FRACTION:.0%} of the budget); no trial or epoch starts that "
            "would not finish before it. The best trial's submission is written, then the pick improves it with "
            "every second left.")


def check_pick_inputs(pick: PickOptions, data_path: str) -> PickOptions:
    """Everything the pick will need, checked before the search stores anything: its options, device, test file
    (read and matched to the training data), output path and tracking store. Returns `pick` with its output and test
    paths resolved (one line, exit 2, for each bad one)."""
    check_options(pick)
    resolve_device(pick.device)
    test = test_path_for(Path(data_path), pick.test)
    check_text_dim(load_test(test), load_train_shared(data_path).text.shape[1], "the training captions have")
    out = out_path(pick, Path(pick.state_dir))
    check_writable(out)
    probe_tracking_store(pick.tracking_uri)
    return replace(pick, test=str(test), out=str(out))


@dataclass
class OneBudgetResult:
    """What a one-budget job ended with: the study summary, the submission in place and what made it, the pick's
    result when the pick finished, and the seconds past the budget (0 inside it) with the step that overran."""
    summary: dict
    answer: SafeAnswer
    pick: PickResult | None
    overrun_s: float
    overrun_in: str = ""


def run_one_budget(spec: RunSpec, total: float, pick: PickOptions, workers: int = 1,
                   started: float | None = None) -> OneBudgetResult:
    """Search then pick within `total` seconds from `started` (time.monotonic(), default now); `pick` as returned by
    check_pick_inputs. A submission is in place from step 2 on (see the module's docstring)."""
    deadline = Deadline.after(total, started)
    note(describe_split(total))
    test, out = load_test(pick.test), Path(pick.out)
    answer = _floor(spec, test, out)
    budget = SearchBudget(deadline, total, safe_s=answer.seconds)
    if deadline.left() <= budget.opening_reserve():
        note(f"{deadline.left():.0f} s left, not more than the pick's opening reserve of "
             f"{budget.opening_reserve():.0f} s: no search; the submission stays {answer.source}")
        return OneBudgetResult({}, answer, None, deadline.overrun(), _late(deadline, "the start"))
    keeper = Keeper(safe_name(spec.name), spec.storage.url, Path(spec.state_dir), test, out,
                    resolve_device(pick.device), answer)
    with keeper:  # the best trial's answer replaces the floor while the search runs
        summary = run_study(replace(spec, timeout=None, budget=budget), workers=workers, figures=False)
    late = _late(deadline, "the search")
    answer = _last_look(keeper)
    result = None
    if deadline.left() >= PICK_MIN_S:
        note(f"search done ({summary.get('trials_finished', 0)} trials); the pick gets the {deadline.left():.0f} s "
             "left")
        result = _try_pick(replace(pick, budget=deadline.left()), answer)
    else:
        note(f"{deadline.left():.0f} s left, under the pick's {PICK_MIN_S:.0f} s minimum: the submission stays "
             f"{answer.source}")
    late = late or _late(deadline, "the pick")
    if result is None and not out.is_file():  # no floor, no trial with a value, no pick: nothing to submit
        raise LatentsweepError(f"no submission could be made: {answer.source}, and no trial finished an epoch")
    return OneBudgetResult(summary, answer, result, deadline.overrun(), late)


def _floor(spec: RunSpec, test, out: Path) -> SafeAnswer:
    """The closed-form ridge's answer; when degenerate data makes its solve fail, the job goes on without a floor."""
    try:
        answer = ridge_answer(load_train_shared(spec.data_path), test, out)
    except (RuntimeError, DataError) as exc:  # torch.linalg.LinAlgError is a RuntimeError
        note(f"warning: no closed-form answer ({first_line(exc)}); the first trial's answer will be the first")
        return SafeAnswer(out, "no answer yet (the closed form failed)", 0.0)
    note(f"first answer in {answer.seconds:.1f} s: {answer.source} -> {answer.path}")
    return answer


def _last_look(keeper: Keeper) -> SafeAnswer:
    """The keeper's last look after the search: the best trial's answer, or the answer in place when the look
    fails on anything but our own bug (said in one line)."""
    try:
        answer = keeper.refresh()
    except Exception as exc:  # noqa: BLE001 - classified once: a bug is raised with its traceback
        failure = classify(exc)
        if failure.kind is Kind.BUG:
            raise
        note(f"warning: could not read the best trial ({failure.reason}); the submission stays {keeper.answer.source}")
        return keeper.answer
    note(f"safe answer: {answer.source} (written in {answer.seconds:.1f} s) -> {answer.path}")
    return answer


def _late(deadline: Deadline, step: str) -> str:
    """`step` when the deadline has passed by its end (the first step that overran), else ''."""
    return step if deadline.passed() else ""


def _try_pick(pick: PickOptions, answer: SafeAnswer) -> PickResult | None:
    """The pick; when it fails on anything but our own bug or an interrupt, the safe answer stays, said in one line."""
    try:
        return run_pick(pick)
    except Exception as exc:  # noqa: BLE001 - classified once: a bug is raised with its traceback
        failure = classify(exc)
        if failure.kind is Kind.BUG:
            raise
        note(f"warning: the pick did not finish ({failure.reason}); the submission stays {answer.source}")
        return None


__all__ = ["MIN_TOTAL_S", "OneBudgetResult", "check_pick_inputs", "describe_split", "parse_duration",
           "run_one_budget"]
