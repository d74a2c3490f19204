"""The one-budget job (`latentsweep run STUDY --time 30m`): one deadline for the search and the pick, and always a
submission inside it. Its steps, each replacing the submission only with an answer that scores higher on the study's
val split (latentsweep.search.pick.judge; the manifest says which answer won and by how much):
  1. the pick's inputs checked (before any trial is stored);
  2. the closed-form ridge's submission, in seconds (the floor: a budget shorter than one trial still ends with it),
     scored on the val split as a ridge fit without those images;
  3. the search, until the pick's reserve begins (latentsweep.search.study.budget, re-estimated after every epoch), the
  keeper
     (latentsweep.search.pick.safe) offering each new best trial's checkpoint; a machine, store or outage failure ends
     the
     search, not the job;
  4. the keeper's last look;
  5. the pick (ensemble and refits) on the job's deadline with every second left; a pick that scores below the
     answer in place, fails on anything but our own bug, or has no time left leaves that answer.
The MLflow export and registration come after the submission is in place (latentsweep.search.pick.outputs)."""
from __future__ import annotations

import json
import math
import re
import time
from typing import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from latentsweep.search.failures import Kind, classify, first_line
from latentsweep.search.pick.candidates import test_path_for
from latentsweep.search.pick.options import PickOptions, check_options, check_writable, out_path, pool_size
from latentsweep.search.pick.outputs import PickResult
from latentsweep.search.pick.picker import pick_until
from latentsweep.search.pick.plan import PICK_FIXED_S, PICK_MIN_S
from latentsweep.search.pick.judge import Judge, Standing, make_judge
from latentsweep.search.process import least_time
from latentsweep.search.pick.safe import Keeper, SafeAnswer, ridge_answer
from latentsweep.search.stores import safe_name
from latentsweep.search.study.budget import (
    RESERVE_MAX_FRACTION, RESERVE_MIN_FRACTION, RESERVE_REFITS, JobBudget, PickCost,
)
from latentsweep.search.study.runner import run_study
from latentsweep.search.study.worker import RunSpec
from latentsweep.search.tracking.probe import probe_tracking_store
from latentsweep.trainers.data.sets import check_text_dim, load_test_shared, load_train_shared
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.errors import DataError, LatentsweepError
from latentsweep.trainers.core.io import atomic_write
from latentsweep.trainers.core.devices import resolve_device
from latentsweep.trainers.core.progress import say

_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0}
# Below this a one-budget run cannot train one trial and one refit of anything but a toy (seconds).
MIN_TOTAL_S = 60.0
# Above this a budget is a typo, not a plan (a week): `--time` of 400 nines would otherwise be infinity.
MAX_TOTAL_S = 7 * 24 * 3600.0


def parse_duration(text: str) -> float:
    """'30m', '1h30m', '90s', '600' (seconds) -> seconds; anything else is a one-line error."""
    word = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", word):
        seconds = float(word)
    elif word and re.fullmatch(r"(\d+(\.\d+)?[hms])+", word):
        seconds = sum(float(n) * _UNITS[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)([hms])", word))
    else:
        raise LatentsweepError(f"--time must be a duration like 30m, 1h30m, 90s or 600 (seconds), got '{text}'")
    least = least_time(MIN_TOTAL_S)  # MIN_TOTAL_S, or less in a test ($LATENTSWEEP_TEST_MIN_TIME_S)
    if seconds < least:
        raise LatentsweepError(f"--time {text} is {seconds:g} s: a search and a pick need at least {least:.0f} s")
    if not math.isfinite(seconds) or seconds > MAX_TOTAL_S:
        raise LatentsweepError(f"--time {text[:40]} is over {MAX_TOTAL_S / 86400:.0f} days: give a budget the job "
                               "can plan for")
    return seconds


def describe_split(total: float) -> str:
    """The split printed before any work starts."""
    return (f"run: {total:.0f} s in all, one deadline. A closed-form answer is written first (seconds), then the "
            f"search runs until the pick's reserve begins ({RESERVE_REFITS} refits of the best trials on every "
            f"labelled image, plus {PICK_FIXED_S:.0f} s times the load per core and the candidates' predictions, "
            f"as measured, within "
            f"{RESERVE_MIN_FRACTION:.0%}-{RESERVE_MAX_FRACTION:.0%} of the budget); no trial or epoch starts that "
            "would not finish before it. The best trial's submission is written, then the pick improves it with "
            "every second left.")


def check_pick_inputs(pick: PickOptions, data_path: str) -> PickOptions:
    """Everything the pick will need, checked before the search stores anything: its options, device, test file
    (read and matched to the training data), output path and tracking store. Returns `pick` with its output and test
    paths resolved (one line, exit 2, for each bad one)."""
    check_options(pick)  # the device too
    test = test_path_for(Path(data_path), pick.test)
    check_text_dim(load_test_shared(test), load_train_shared(data_path).text.shape[1], "the training captions have")
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
    # which answer won on the val split, by how much (latentsweep.search.pick.judge.Standing)
    answer_record: dict | None = None
    search_ended: str = ""  # the one line of the failure that ended the search early ('' when it ended as planned)


def run_one_budget(spec: RunSpec, total: float, pick: PickOptions, workers: int = 1,
                   started: float | None = None) -> OneBudgetResult:
    """Search then pick within `total` seconds from `started` (time.monotonic(), default now); `pick` as returned by
    check_pick_inputs. A submission is in place from step 2 on (see the module's docstring)."""
    deadline = Deadline.after(total, started)
    say(f"latentsweep: {describe_split(total)}")
    test, out = load_test_shared(pick.test), Path(pick.out)
    data = load_train_shared(spec.data_path)
    answer = _floor(data, test, out, lambda: total - deadline.left())
    judge, standing = _judge(spec, data, answer)
    job_budget = JobBudget(deadline, total, PickCost(PICK_FIXED_S, pool_size(pick)), floor_s=answer.seconds)
    if deadline.left() <= job_budget.opening_reserve():
        say(f"latentsweep: {deadline.left():.0f} s left, not more than the pick's opening reserve of "
            f"{job_budget.opening_reserve():.0f} s: no search; the submission stays {answer.source}")
        _write_answer_manifest(spec, out, standing, "no search: no time for one")
        return OneBudgetResult({}, answer, None, deadline.overrun(), _late(deadline, "the start"), standing.record())
    keeper = Keeper(safe_name(spec.name), spec.storage.url, Path(spec.state_dir), test, out,
                    resolve_device(pick.device), answer, judge, standing, data)
    summary, ended = _search(spec, job_budget, workers, keeper)
    late = _late(deadline, "the search")
    answer = _last_look(keeper)
    if ended.kind is Kind.BUG:  # our own bug: loudly, now that the best answer is in place
        say(f"latentsweep: the search stopped on a bug; the submission in place is {answer.source} -> {answer.path}")
        raise ended.exc
    result = None
    if deadline.left() >= PICK_MIN_S:
        done = (f"search done ({summary.get('trials_finished', 0)} trials)" if ended.kind is None else
                f"search ended early ({ended.reason})")
        say(f"latentsweep: {done}; the pick gets the {deadline.left():.0f} s left")
        result = _try_pick(pick, deadline, answer, judge, standing)
    else:
        say(f"latentsweep: {deadline.left():.0f} s left, under the pick's {PICK_MIN_S:.0f} s minimum: the submission "
            f"stays {answer.source}")
    late = late or _late(deadline, "the pick")
    if result is None and not out.is_file():  # no floor, no trial with a value, no pick: nothing to submit
        raise LatentsweepError(f"no submission could be made: {answer.source}, and no trial finished an epoch")
    if result is None:
        _write_answer_manifest(spec, out, standing, "the pick did not replace the answer in place")
    if ended.kind is not None:
        say(f"latentsweep: submission: {out} ({'the pick' if result is not None else standing.source}); the search "
            f"ended early: {ended.reason}")
    return OneBudgetResult(summary, answer, result, deadline.overrun(), late, standing.record(), ended.reason)


@dataclass(frozen=True)
class SearchEnd:
    """Why the search ended: `kind` None when it ended as planned (its budget or its trials), else the class of the
    failure that ended it (latentsweep.search.failures) with its one line and the exception."""
    kind: Kind | None = None
    reason: str = ""
    exc: BaseException | None = None


def _search(spec: RunSpec, job_budget: JobBudget, workers: int, keeper: Keeper) -> tuple[dict, SearchEnd]:
    """The search, with the keeper watching it. A failure inside it (a full disk, a store down, a worker that
    stopped) ends the search, not the job: said in one line, the pick runs with what finished. A bug is returned
    too, raised by the caller once the best answer is in place; an interrupt is raised at once."""
    try:
        with keeper:  # the best trial's answer replaces the floor while the search runs, when it beats it
            return run_study(replace(spec, timeout=None, budget=job_budget), workers=workers, figures=False), \
                SearchEnd()
    except Exception as exc:  # noqa: BLE001 - classified once (latentsweep.search.failures)
        failure = classify(exc)
        return {"search_ended": failure.reason}, SearchEnd(failure.kind, failure.reason, exc)


def _judge(spec: RunSpec, data, answer: SafeAnswer) -> tuple[Judge | None, Standing]:
    """The val split every answer is scored on (latentsweep.search.pick.judge) and the floor's standing on it: the ridge
    fit on
    the split's train part, scored when the first other answer is offered. Without a judge (a study that holds
    nothing out) answers replace each other unscored."""
    standing = Standing(answer.source, None)
    judge = make_judge(spec.parsed_study().base, data)
    if judge is None:
        say("latentsweep: warning: the study holds no val split out, so answers are not compared: each one replaces "
            "the last")
        return None, standing
    standing.judge = judge.describe()

    def score_floor() -> None:
        started = time.monotonic()
        try:
            score = judge.score_floor(data, answer.alpha)
        except (RuntimeError, DataError) as exc:  # the solve on degenerate data: the floor stays, unscored
            say(f"latentsweep: warning: the floor could not be scored on the val split ({first_line(exc)})")
            return
        standing.offer(answer.source, score)
        say(f"latentsweep: the floor scores {score.mrr:.4f} MRR on the val split ({len(judge.held_images)} images, "
            f"fit on the other {len(judge.train_images)} in {time.monotonic() - started:.1f} s): an answer replaces "
            "it only by beating that beyond the split's noise")

    if answer.alpha is not None:
        standing.pending = score_floor
    return judge, standing


def _floor(data, test, out: Path, into_job: Callable[[], float]) -> SafeAnswer:
    """The closed-form ridge's answer; when degenerate data makes its solve fail, the job goes on without a floor.
    Its line says when it came in the job's clock (`into_job`: start-up and the data's read included, as the user
    waits for it) and what the closed form itself took."""
    try:
        answer = ridge_answer(data, test, out)
    except (RuntimeError, DataError) as exc:  # torch.linalg.LinAlgError is a RuntimeError
        say(f"latentsweep: warning: no closed-form answer ({first_line(exc)}); the first trial's answer will be the "
            "first")
        return SafeAnswer(out, "no answer yet (the closed form failed)", 0.0)
    say(f"latentsweep: first answer {into_job():.1f} s into the job (the closed form took {answer.seconds:.1f} s): "
        f"{answer.source} -> {answer.path}")
    return answer


def _last_look(keeper: Keeper) -> SafeAnswer:
    """The keeper's last look after the search: the best answer, or the answer in place when the look fails on
    anything but our own bug (said in one line). The study's storage is closed after it."""
    try:
        answer = keeper.refresh()
    except Exception as exc:  # noqa: BLE001 - classified once: a bug is raised with its traceback
        failure = classify(exc)
        if failure.kind is Kind.BUG:
            raise
        say(f"latentsweep: warning: could not read the best trial ({failure.reason}); the submission stays "
            f"{keeper.answer.source}")
        return keeper.answer
    finally:
        keeper.close()
    say(f"latentsweep: safe answer: {answer.source} (written in {answer.seconds:.1f} s) -> {answer.path}")
    return answer


def _late(deadline: Deadline, step: str) -> str:
    """`step` when the deadline has passed by its end (the first step that overran), else ''."""
    return step if deadline.passed() else ""


def _gate(judge: Judge | None, standing: Standing):
    """The pick's last check (latentsweep.search.pick.picker.run_pick's `gate`): its ensemble of the chosen trials'
    checkpoints,
    with the chosen weights, scored on the judge's val split; it replaces the answer in place when it beats it beyond
    the split's noise (judge.Standing.offer), or ranks every val caption as it does (a tie goes to the pick: its
    refits are the same configs trained on more images). Returns the manifest's
    `answer` record, or None (the pick loses, said in one line)."""
    def gate(models, weights, device) -> dict | None:
        score = None if judge is None else judge.score_models(models, weights, device)
        if not standing.offer("the pick's ensemble", score, ties_win=True):
            say("latentsweep: " + standing.lost_line("the pick's ensemble", score))
            return None
        return standing.record()

    return gate


def _try_pick(pick: PickOptions, deadline: Deadline, answer: SafeAnswer, judge: Judge | None,
              standing: Standing) -> PickResult | None:
    """The pick inside the job's deadline; None when it loses to the answer in place (latentsweep.search.pick.judge) or
    fails on
    anything but our own bug or an interrupt: the answer in place stays, said in one line (and in the standings)."""
    in_place = (standing.source, standing.scored)
    try:
        return pick_until(pick, deadline, _gate(judge, standing))
    except Exception as exc:  # noqa: BLE001 - classified once: a bug is raised with its traceback
        failure = classify(exc)
        if failure.kind is Kind.BUG:
            raise
        standing.source, standing.scored = in_place  # a pick that won but failed to write is not the answer
        standing.offered.append({"answer": "the pick's ensemble", "val_mrr": None, "won": False,
                                 "failed": failure.reason})
        say(f"latentsweep: warning: the pick did not finish ({failure.reason}); the submission stays {answer.source}")
        return None


def _write_answer_manifest(spec: RunSpec, out: Path, standing: Standing, why: str) -> None:
    """The manifest beside a submission the pick did not make: which answer is in place, its val MRR, and every
    answer it was compared with (a failure to write it is said, the submission stays)."""
    doc = {"study": spec.name, "submission": str(out), "made_by": standing.source, "pick": why,
           "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "answer": standing.record()}
    try:
        with atomic_write(out.with_name(f"{out.stem}.manifest.json")) as fh:
            fh.write(json.dumps(doc, indent=2, default=float) + "\n")
    except OSError as exc:
        say(f"latentsweep: warning: could not write the manifest beside {out} ({first_line(exc)})")


__all__ = ["MIN_TOTAL_S", "OneBudgetResult", "check_pick_inputs", "describe_split", "parse_duration",
           "run_one_budget"]
