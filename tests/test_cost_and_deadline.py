"""What a job costs (latentsweep.trainers.train.cost), the deadline of a training run, and the search/pick split of a
one-budget run."""
from __future__ import annotations

import time

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from latentsweep.search.pick.onebudget import parse_duration
from latentsweep.search.pick.plan import PICK_FIXED_S
from latentsweep.search.study.budget import (
    RESERVE_MAX_FRACTION, RESERVE_MIN_FRACTION, RESERVE_REFITS, SAFE_FACTOR, JobBudget, PickCost,
)
from latentsweep.search.study.contract import TIMING_ATTR
from test_loop import data, small_cfg  # noqa: F401 - the module's data fixture, by name
from latentsweep.trainers.eval import metrics
from latentsweep.trainers.train.cost import Timing, contention, mean_epoch
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.train.loop import DeadlineReached, train


def test_estimate_scales_training_by_captions_and_by_images_only_for_a_per_image_loss():
    t = Timing(setup_s=2.0, train_s=10.0, eval_s=3.0, captions=800, images=200, per_image=False)
    assert t.estimate(1000, 250, epochs=4) == pytest.approx(2.0 + 4 * 10.0 * 1000 / 800)
    assert t.estimate(1000, 250, epochs=4, validate=True) == pytest.approx(2.0 + 4 * (12.5 + 3.0))
    wide = Timing(2.0, 10.0, 3.0, 800, 200, per_image=True)
    assert wide.estimate(1000, 250, epochs=4) == pytest.approx(2.0 + 4 * 10.0 * (1000 / 800) * (250 / 200))


def test_timing_round_trips_through_attrs_and_rejects_anything_else():
    t = Timing(1.5, 2.5, 0.5, 10, 3, True)
    assert Timing.from_attrs(t.as_attrs()) == t
    for bad in (None, "x", {}, {**t.as_attrs(), "extra": 1}, {k: v for k, v in t.as_attrs().items() if k != "eval_s"}):
        assert Timing.from_attrs(bad) is None
    assert mean_epoch([9.0, 1.0, 3.0]) == 2.0 and mean_epoch([4.0]) == 4.0 and mean_epoch([]) == 0.0


def test_a_training_run_measures_its_parts(data):  # noqa: F811
    result = train(small_cfg(**{"train.epochs": 3}), data)
    t = result.timing
    assert t.setup_s > 0 and t.train_s > 0 and t.eval_s > 0
    assert t.images < len(data.image) and t.captions < len(data.cap2img)  # the training side of the split
    assert not result.stopped_at_deadline


def test_the_deadline_stops_training_keeping_the_best_finished_epoch(data, tmp_path):  # noqa: F811
    cfg = small_cfg(**{"train.epochs": 50, "train.early_stop": 0})
    ends = {"at": Deadline.never()}

    def after_epoch(report) -> None:
        if report.epoch == 2:  # from now on the deadline has passed: the next step must not start
            ends["at"] = Deadline.after(0.0)

    result = train(cfg, data, callback=after_epoch, out_dir=tmp_path, deadline=lambda: ends["at"])
    assert result.stopped_at_deadline and len(result.history) == 3 and result.best_epoch <= 2
    assert (tmp_path / "best.pt").is_file()
    with pytest.raises(DeadlineReached, match="before the run started"):
        train(cfg, data, deadline=lambda: Deadline.after(-1.0))


def test_no_epoch_starts_that_would_not_finish_before_the_deadline(data, tmp_path, monkeypatch):  # noqa: F811
    """Validation is slowed to VAL_S (below the loop: the metrics it calls). After epoch 1 the deadline is set to
    the measured training epoch plus half a validation: a loop that checks only before each step would train epoch 2
    and then validate past the deadline; this one must not start epoch 2 at all."""
    real = metrics.evaluate_with_ranks

    def slow(*args, **kwargs):
        time.sleep(VAL_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(metrics, "evaluate_with_ranks", slow)
    cfg = small_cfg(**{"train.epochs": 50, "train.early_stop": 0})
    ends, seen = {"at": Deadline.never()}, []

    def after_epoch(report) -> None:
        seen.append(report.epoch)
        if report.epoch == 1:
            ends["at"] = Deadline.after(report.timing.train_s + VAL_S / 2)

    result = train(cfg, data, callback=after_epoch, out_dir=tmp_path, deadline=lambda: ends["at"])
    assert result.stopped_at_deadline and seen == [0, 1] and len(result.history) == 2


VAL_S = 1.0


def test_the_one_deadline():
    d = Deadline.after(100.0)
    assert d.bounded and 99.0 < d.left() <= 100.0 and not d.passed() and d.overrun() == 0.0
    assert d.fits(50.0) and not d.fits(150.0) and d.fits(None)
    assert d.earlier(100.0).passed() and not d.earlier(50.0).passed()
    assert d.sooner(Deadline.after(10.0)).left() <= 10.0 and d.sooner(Deadline.never()) is d
    never = Deadline.never()
    assert not never.bounded and never.fits(1e12) and never.left() == float("inf") and never.overrun() == 0.0
    late = Deadline.after(-5.0)
    assert late.passed() and not late.fits(None) and late.overrun() >= 5.0


def _study_with(refit_seconds: list[float], images: int = 100, eval_s: float = 0.0) -> optuna.Study:
    """A study whose trials each measured a refit of `seconds` on `images` images x 4 captions (1 epoch) and a
    validation pass of `eval_s`."""
    study = optuna.create_study(direction="maximize")
    for i, seconds in enumerate(refit_seconds):
        timing = Timing(0.0, seconds, eval_s, 4 * images, images, False)
        study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.5 + i / 100, params={"x": 0.1},
                                     distributions={"x": FloatDistribution(0, 1)}, intermediate_values={0: 0.5},
                                     user_attrs={TIMING_ATTR: timing.as_attrs()}))
    return study


# the pool of `pick --top 5` with val selection (latentsweep.search.pick.options)
PICK = PickCost(PICK_FIXED_S, pool=10)


def quiet_machine() -> float:
    """A quiet machine's slowdown, whatever this one's load is now."""
    return 1.0


def test_the_picks_fixed_work_is_reserved_longer_on_a_loaded_machine():
    """At a load average of 11 on 2 cores a 240-s job's pick took 70 s of its 35 s: its fixed work (the selection and
    the export, PICK_FIXED_S measured quiet) is scaled by the load per core; what this job measured is not."""
    study = _study_with([20.0, 20.0])
    quiet = JobBudget(Deadline.after(1000.0), total_s=1000.0, pick=PICK, slowdown=quiet_machine)
    loaded = JobBudget(Deadline.after(1000.0), total_s=1000.0, pick=PICK, slowdown=lambda: contention(11.0, 2))
    assert loaded.reserve(study, 400, 100) - quiet.reserve(study, 400, 100) == pytest.approx(4.5 * PICK_FIXED_S)
    assert contention(11.0, 2) == 5.5 and contention(1.5, 2) == 1.0 and contention(0.0, 0) == 1.0
    assert contention() >= 1.0  # this machine, now




def test_the_pick_reserve_follows_the_measured_costs_within_its_bounds():
    budget = JobBudget(Deadline.after(1000.0), total_s=1000.0, pick=PICK, slowdown=quiet_machine)
    # nothing measured yet: the smallest reserve (the pick has nothing to refit), the first trial may start
    assert budget.reserve(_study_with([]), 400, 100) == RESERVE_MIN_FRACTION * 1000 == budget.opening_reserve()
    assert budget.reserve(_study_with([1.0]), 400, 100) == RESERVE_MIN_FRACTION * 1000  # cheap refits
    assert budget.reserve(_study_with([20.0, 20.0]), 400, 100) == pytest.approx(RESERVE_REFITS * 20 + PICK_FIXED_S)
    # the candidates' predictions are part of the pick's fixed work
    assert budget.reserve(_study_with([20.0], eval_s=2.0), 400, 100) == pytest.approx(
        RESERVE_REFITS * 20 + PICK_FIXED_S + PICK.pool * 2.0)
    end = budget.search_end(_study_with([1.0]), 400, 100)
    assert end.end == pytest.approx(budget.deadline.end - 100.0)


def test_refits_are_reserved_only_for_trials_that_beat_the_answer_in_place():
    """The pick refits only an ensemble that first beat the job's answer in place on the val split: while no trial
    does (at challenge size on 2 cores the floor beat both trials of a 1200-s run, and half the budget waited for
    refits that never ran), the search keeps that time; once one does, the refits are reserved again."""
    from latentsweep.search.study.contract import ANSWER_ATTR, OBJECTIVE_ATTR

    budget = JobBudget(Deadline.after(1000.0), total_s=1000.0, pick=PICK, slowdown=quiet_machine)
    study = _study_with([20.0, 20.0])  # best reported value 0.5 each
    with_refits = RESERVE_REFITS * 20 + PICK_FIXED_S
    assert budget.reserve(study, 400, 100) == pytest.approx(with_refits)  # nothing judged yet: as before
    study.set_user_attr(OBJECTIVE_ATTR, "val/mrr")
    study.set_user_attr(ANSWER_ATTR, {"source": "the closed-form ridge", "val_mrr": 0.6})
    assert budget.reserve(study, 400, 100) == RESERVE_MIN_FRACTION * 1000  # the pick's fixed work alone, at least
    study.set_user_attr(ANSWER_ATTR, {"source": "the closed-form ridge", "val_mrr": 0.4})
    assert budget.reserve(study, 400, 100) == pytest.approx(with_refits)
    study.set_user_attr(OBJECTIVE_ATTR, "val/loss")  # another measure than the judge's: not compared
    study.set_user_attr(ANSWER_ATTR, {"source": "the closed-form ridge", "val_mrr": 0.6})
    assert budget.reserve(study, 400, 100) == pytest.approx(with_refits)


def test_the_candidates_validation_counts_each_trials_own_pass():
    """A dear side trial (the knn's validation is its predictions over the training set) counts once, not as the
    mean of every place of the pool; places not filled yet cost the cheapest measured pass."""
    budget = JobBudget(Deadline.after(2000.0), total_s=2000.0, pick=PICK, slowdown=quiet_machine)
    study = _study_with([20.0])
    timing = Timing(0.0, 20.0, 100.0, 400, 100, False)
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.4, params={"x": 0.2},
                                 distributions={"x": FloatDistribution(0, 1)}, intermediate_values={0: 0.4},
                                 user_attrs={TIMING_ATTR: timing.as_attrs()}))
    assert budget.reserve(study, 400, 100) == pytest.approx(
        RESERVE_REFITS * 20 + PICK_FIXED_S + 100.0 + 0.0 * (PICK.pool - 1))


def test_a_candidate_the_keeper_scored_counts_what_scoring_it_took():
    """The keeper's load and score of a trial's checkpoint is what the pick pays for that candidate: at challenge size
    a knn side trial's validation (its predictions, 122 s on 2 cores) is a memo read for the pick (seconds), and
    counting the validation ended a `run --time 1200` 258 s early. Unjudged trials still count their validation; a
    damaged entry is left out."""
    from latentsweep.search.study.contract import ANSWER_ATTR, JUDGED_KEY

    budget = JobBudget(Deadline.after(1000.0), total_s=1000.0, pick=PICK, slowdown=quiet_machine)
    study = _study_with([20.0])  # trial 0: validation 0
    timing = Timing(0.0, 20.0, 100.0, 400, 100, False)
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.4, params={"x": 0.2},
                                 distributions={"x": FloatDistribution(0, 1)}, intermediate_values={0: 0.4},
                                 user_attrs={TIMING_ATTR: timing.as_attrs()}))  # trial 1: validation 100 s
    refits = RESERVE_REFITS * 20
    assert budget.reserve(study, 400, 100) == pytest.approx(refits + PICK_FIXED_S + 100.0)
    study.set_user_attr(ANSWER_ATTR, {"source": "floor", "val_mrr": None, JUDGED_KEY: {"1": 3.0}})
    assert budget.reserve(study, 400, 100) == pytest.approx(refits + PICK_FIXED_S + 3.0)
    for damaged in ({"1": "slow"}, {"1": -1.0}, {"x": 3.0}, [3.0], {"1": True}):
        study.set_user_attr(ANSWER_ATTR, {"source": "floor", "val_mrr": None, JUDGED_KEY: damaged})
        assert budget.reserve(study, 400, 100) == pytest.approx(refits + PICK_FIXED_S + 100.0)


def test_the_reserve_never_shrinks_as_the_machine_slows_down():
    """A loaded machine or bigger data measures dearer refits and validations: the pick's share must not fall (it
    fell from 50% to 10% of the budget once one refit no longer fit in half of it)."""
    budget = JobBudget(Deadline.after(240.0), total_s=240.0, pick=PICK, slowdown=quiet_machine)
    costs = [0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    reserves = [budget.reserve(_study_with([c], eval_s=c / 10), 400, 100) for c in costs]
    assert reserves == sorted(reserves) and reserves[-1] == RESERVE_MAX_FRACTION * 240


def test_the_reserve_never_falls_below_what_the_safe_answer_took():
    slow_floor = JobBudget(Deadline.after(100.0), total_s=100.0, pick=PICK, floor_s=40.0, slowdown=quiet_machine)
    assert slow_floor.reserve(_study_with([0.1]), 400, 100) == SAFE_FACTOR * 40.0  # above the 50% cap too
    assert slow_floor.hard_stop().end <= slow_floor.deadline.end - SAFE_FACTOR * 40.0 + 1e-6


@pytest.mark.parametrize("text,seconds", [("30m", 1800), ("1h30m", 5400), ("90s", 90), ("600", 600), ("1.5h", 5400)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "soon", "10x", "-5m", "5", "30s", "9" * 400, "1000h"])
def test_bad_durations_are_one_line_errors(text):
    with pytest.raises(LatentsweepError, match="--time"):
        parse_duration(text)


def test_a_run_times_what_predicting_its_val_split_again_costs(data):  # noqa: F811 - test_loop's fixture
    """What the pick pays per candidate is one prediction of the val split, timed once after the first validation:
    a knn model reads it back from its memo (at challenge size its validation took 122 s on 2 cores, and the reserve
    counted that for the pick), an MLP runs one forward again. A timing recorded before predict_s existed reads as
    before and counts its validation pass."""
    knn_run = train(small_cfg(**{"model.kind": "knn"}), data)
    computed = knn_run.model.inner.computed
    assert knn_run.timing.predict_s is not None and 0 <= knn_run.timing.predict_s < knn_run.timing.eval_s
    assert knn_run.model.inner.computed == computed  # nothing predicted twice: its memo answered
    mlp = train(small_cfg(**{"train.epochs": 2}), data)
    assert mlp.timing.predict_s > 0 and mlp.timing.pick_s() == mlp.timing.predict_s
    old = {k: v for k, v in mlp.timing.as_attrs().items() if k != "predict_s"}
    assert Timing.from_attrs(old).pick_s() == mlp.timing.eval_s
    assert Timing.from_attrs({**old, "predict_s": "soon"}) is None and Timing.from_attrs({**old, "x": 1}) is None


def test_a_side_trial_is_not_the_typical_trial_the_search_claims_next():
    """The knn side trial's cost grows with the captions squared: at challenge size its 266 s, taken as the typical
    trial, ended a `run --time 1200` search with 784 s left and no MLP trial tried."""
    from latentsweep.search.study.contract import SIDE_ATTR
    from latentsweep.search.study.objective import typical_trial_s

    study = optuna.create_study(direction="maximize")
    side = Timing(200.0, 0.0, 66.0, 400, 100, False)
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.4, intermediate_values={0: 0.4},
                                 user_attrs={TIMING_ATTR: side.as_attrs(), SIDE_ATTR: '{"model.kind": "knn"}'}))
    assert typical_trial_s(study) is None  # nothing claimable measured yet
    mlp = Timing(2.0, 10.0, 3.0, 400, 100, False)
    study.add_trial(create_trial(state=TrialState.COMPLETE, value=0.5, intermediate_values={0: 0.5},
                                 user_attrs={TIMING_ATTR: mlp.as_attrs()}))
    assert typical_trial_s(study) == pytest.approx(15.0)
