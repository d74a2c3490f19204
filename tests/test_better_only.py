"""Better only, on the same images: every answer of a `latentsweep run` job (the closed-form floor, each trial's
checkpoint, the pick's ensemble) is scored on the study's val split before it replaces the answer in place, the floor
fit without those images; a worse answer leaves the one in place, and the manifest says which won and by how much."""
from __future__ import annotations

import json
import types
from pathlib import Path

import numpy as np
import optuna
import pytest

from conftest import tiny_study_file
from latentsweep.search.cli.main import main
from latentsweep.search.pick.judge import Score, Standing, make_judge
from latentsweep.search.pick.onebudget import _gate
from latentsweep.search.pick.safe import Keeper, SafeAnswer, best_trial, local_checkpoint, ridge_answer
from latentsweep.search.study.budget import answer_to_beat, judged_seconds
from latentsweep.search.study.contract import StudyRecord
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.models.closed_form import fit_ridge, held_out_mrr, moments, solve
from latentsweep.trainers.data.sets import load_test, load_train
from latentsweep.trainers.data.splits import captions_of
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny study of 2 trials, run once: trained MLPs far below the closed-form ridge on this data."""
    root = tmp_path_factory.mktemp("better")
    train, test, _ = write_synthetic(root / "data", 240, dim_text=24, dim_image=32, n_test=60)
    study_file = tiny_study_file(root, "better", n_trials=2, epochs=2)
    state = root / "state"
    assert main(["study", "run", str(study_file), "--data", str(train), "--state-dir", str(state), "--quiet"]) == 0
    data = load_train(train)
    study = optuna.load_study(study_name="better", storage=f"sqlite:///{state / 'optuna.db'}")
    return types.SimpleNamespace(root=root, train=train, test=test, study_file=study_file, state=state, data=data,
                                 study=study, judge=make_judge(load_study_file(study_file).base, data))


def flat(value: float, n: int = 100) -> Score:
    """A score whose every val image has reciprocal rank `value`."""
    return Score(value, np.full(n, value))


def noisy(base: Score, shift: float, spread: float, seed: int = 0) -> Score:
    """`base` with each image's reciprocal rank moved by `shift` plus noise of standard deviation `spread`."""
    per_image = base.per_image + shift + np.random.default_rng(seed).normal(0.0, spread, len(base.per_image))
    return Score(float(per_image.mean()), per_image)


def test_an_answer_replaces_the_one_in_place_only_when_better_beyond_the_splits_noise():
    standing = Standing("floor", flat(0.5))
    assert not standing.offer("trial 1", flat(0.4))
    assert not standing.offer("trial 2", flat(0.5))  # a tie keeps the answer in place
    assert standing.source == "floor"
    assert standing.offer("pick", flat(0.5), ties_win=True)  # ... except for the pick: the same configs on more images
    assert standing.offer("trial 3", flat(0.6))
    record = standing.record()
    assert record["winner"] == "trial 3" and record["val_mrr"] == 0.6
    assert record["margin_val_mrr"] == pytest.approx(0.1)
    assert [o["won"] for o in record["offered"]] == [False, False, True, True]
    assert Standing("nothing", None).offer("trial 0", flat(0.1))  # nothing scored in place: the first answer wins
    lazy, calls = Standing("floor", None), []
    lazy.pending = lambda: calls.append(1) or lazy.offer("floor", flat(0.5))  # the floor, scored when first compared
    assert lazy.record()["val_mrr"] is None and not calls
    assert not lazy.offer("trial 1", flat(0.4)) and lazy.offer("trial 2", flat(0.6)) and calls == [1]
    assert lazy.record()["margin_val_mrr"] == pytest.approx(0.1)


def test_a_gain_inside_the_val_splits_noise_does_not_replace_the_answer():
    """Paired per val image: a mean gain of 0.006 with a per-image spread of 0.2 over 120 images (standard error
    0.018) is noise; the same gain with a spread of 0.01 is not; nor is a gain of 0.1 with the wide spread."""
    in_place = noisy(flat(0.3, 120), 0.0, 0.2, seed=1)
    standing = Standing("floor", in_place)
    assert not standing.offer("trial 0", noisy(in_place, 0.006, 0.2))
    assert standing.source == "floor" and "not above 1.645 standard errors" in standing.lost_line(
        "trial 0", noisy(in_place, 0.006, 0.2))
    entry = standing.offered[-1]
    assert entry["gain_se"] > 0.01 and abs(entry["gain_per_image"]) < entry["gain_se"] * 1.645
    assert not standing.offer("pick", noisy(in_place, 0.006, 0.2), ties_win=True)  # not the same ranks: no tie
    assert standing.offer("trial 1", noisy(in_place, 0.006, 0.01))
    assert standing.offer("trial 2", noisy(standing.scored, 0.1, 0.2, seed=2))


def test_the_judge_reads_the_val_captions_in_place(tmp_path):
    """The judge lives as long as a `latentsweep run` job: it holds the loaded captions and the val rows, not a copy of
    the val captions (0.1 GB at challenge size), and scores the floor exactly as on a copy."""
    train, _, _ = write_synthetic(tmp_path / "data", 160, dim_text=12, dim_image=16)
    data = load_train(train)
    judge = make_judge(load_study_file(tiny_study_file(tmp_path, "judge")).base, data)
    assert judge.captions is data.text
    np.testing.assert_array_equal(judge.text, data.text[captions_of(data.cap2img, judge.held_images)])
    ridge = solve(moments(data, captions_of(data.cap2img, judge.train_images)), 0.1)
    assert judge.score_floor(data, 0.1).mrr == held_out_mrr(ridge, judge.text, judge.gallery, judge.target,
                                                        seed=judge.seed)


@pytest.mark.slow  # the module's study (2 trials): 20-30 s on the loaded 2 cores, shared
def test_a_trials_checkpoint_scores_its_own_value_on_the_judges_images(world):
    """The judge's images and protocol are the trials' own: a checkpoint scores exactly its recorded val/mrr."""
    for trial in world.study.trials:
        model, _, _ = load_model(local_checkpoint(trial, world.state), "cpu")
        assert world.judge.score_models([model], [1.0], "cpu").mrr == pytest.approx(trial.value, abs=1e-6)


@pytest.mark.slow  # the module's study (2 trials): 20-30 s on the loaded 2 cores, shared
def test_the_floor_is_scored_fit_without_the_val_images(world):
    """Like with like: the floor's score is the ridge fit on the train part; the submission's ridge (fit on every
    image, the val split's too) would score higher on the val split than it has any right to."""
    seen, _ = fit_ridge(world.data)
    fair = world.judge.score_floor(world.data, seen.alpha).mrr
    unfair = world.judge.score(seen.predict(world.judge.text)).mrr
    assert 0.0 < fair < unfair
    # the floor's fast in-gallery MRR is the trials' own protocol
    # (latentsweep.trainers.eval.metrics.evaluate_leaderboard)
    alone = solve(moments(world.data, captions_of(world.data.cap2img, world.judge.train_images)), seen.alpha)
    assert world.judge.score(alone.predict(world.judge.text)).mrr == pytest.approx(fair, abs=1e-6)


def _keeper(world, tmp_path, floor_score):
    out = tmp_path / "submission.csv"
    floor = ridge_answer(world.data, load_test(world.test), out)
    standing = Standing(floor.source, None)
    standing.offer(floor.source, floor_score)
    return Keeper("better", f"sqlite:///{world.state / 'optuna.db'}", world.state, load_test(world.test), out,
                  "cpu", floor, world.judge, standing), out


@pytest.mark.slow  # the module's study (2 trials): 20-30 s on the loaded 2 cores, shared
def test_a_worse_trial_leaves_the_floor_in_place(world, tmp_path, capsys):
    keeper, out = _keeper(world, tmp_path, world.judge.score_floor(world.data, fit_ridge(world.data)[0].alpha))
    before = out.read_bytes()
    answer = keeper.refresh()
    keeper.close()
    assert answer.source.startswith("the closed-form ridge")
    assert out.read_bytes() == before
    best = best_trial(world.study)
    assert f"trial {best.number}'s checkpoint scores {best.value:.4f}" in capsys.readouterr().err
    assert keeper.standing.record()["margin_val_mrr"] > 0
    # the search's reserve reads the answer to beat from the study (refits only for trials above it)
    study = optuna.load_study(study_name="better", storage=f"sqlite:///{world.state / 'optuna.db'}")
    assert answer_to_beat(StudyRecord.of(study)) == keeper.standing.score > best.value
    # and what scoring each trial's checkpoint took, the pick's cost of that candidate
    assert set(judged_seconds(StudyRecord.of(study))) == {n for n, _ in keeper.looked} and \
        all(0 < s < 60 for s in judged_seconds(StudyRecord.of(study)).values())


@pytest.mark.slow  # the module's study (2 trials): 20-30 s on the loaded 2 cores, shared
def test_a_better_trial_replaces_the_floor(world, tmp_path):
    # a floor that scored nothing on the val split
    keeper, out = _keeper(world, tmp_path, flat(0.0, len(world.judge.held_images)))
    before = out.read_bytes()
    answer = keeper.refresh()
    keeper.close()
    assert answer.source == f"trial {best_trial(world.study).number}'s checkpoint"
    assert out.read_bytes() != before
    assert keeper.standing.record()["winner"] == answer.source


@pytest.mark.slow  # the module's study (2 trials): 20-30 s on the loaded 2 cores, shared
def test_the_pick_that_loses_is_not_written_and_says_so(world, capsys):
    """The pick's gate: its chosen ensemble scored on the val split against the answer in place."""
    models = [load_model(local_checkpoint(t, world.state), "cpu")[0] for t in world.study.trials]
    standing = Standing("the floor", flat(0.99, len(world.judge.held_images)))
    assert _gate(world.judge, standing)(models, [0.5, 0.5], "cpu") is None
    assert "the pick's ensemble scores" in capsys.readouterr().err and standing.source == "the floor"
    standing = Standing("nothing", None)
    standing.offer("the floor", flat(0.01, len(world.judge.held_images)))
    record = _gate(world.judge, standing)(models, [0.5, 0.5], "cpu")
    assert record["winner"] == "the pick's ensemble" and record["margin_val_mrr"] > 0


@pytest.mark.slow  # 20-30 s on 2 cores: a whole run
def test_run_never_ends_below_its_floor_and_the_manifest_says_who_won(world, tmp_path, capsys):
    """Trials far below the closed-form ridge (the issue's knn side trial at real size): the submission stays the
    floor's, byte for byte, and the manifest names it with its margin over every answer it beat."""
    study_file = tiny_study_file(tmp_path, "floor", n_trials=3, epochs=2)
    state = tmp_path / "state"
    assert main(["run", str(study_file), "--time", "60", "--data", str(world.train), "--test", str(world.test),
                 "--state-dir", str(state), "--quiet"]) == 0
    out = state / "picks" / "floor" / "submission.csv"
    floor_only = tmp_path / "floor.csv"
    ridge_answer(world.data, load_test(world.test), floor_only)
    assert out.read_bytes() == floor_only.read_bytes()
    doc = json.loads(out.with_name("submission.manifest.json").read_text())
    answer = doc["answer"]
    assert answer["winner"].startswith("the closed-form ridge") and answer["margin_val_mrr"] > 0
    scores = [o["val_mrr"] for o in answer["offered"] if o["val_mrr"] is not None]
    assert answer["val_mrr"] == max(scores) and len(scores) >= 2
    assert "standard errors" in capsys.readouterr().err  # the lost line: the gain and its noise
    assert np.isfinite(answer["val_mrr"]) and answer["scored_on"]["val_images"] > 0


@pytest.mark.slow  # the module's study (2 trials): 20-30 s on the loaded 2 cores, shared
def test_a_missing_checkpoint_is_said_once_per_trial(world, tmp_path, capsys):
    """The keeper looks every 5 s: a best trial whose best.pt is gone is said once, not at every look."""
    import shutil

    state = tmp_path / "state"
    shutil.copytree(world.state, state)
    best = best_trial(world.study)
    local_checkpoint(best, state).unlink()
    out = tmp_path / "submission.csv"
    keeper = Keeper("better", f"sqlite:///{state / 'optuna.db'}", state, load_test(world.test), out, "cpu",
                    SafeAnswer(out, "nothing yet", 0.0), world.judge, Standing("nothing yet", None))
    for _ in range(3):
        assert keeper.refresh().source == "nothing yet"
    keeper.close()
    err = capsys.readouterr().err
    assert err.count(f"trial {best.number}'s checkpoint is not under") == 1, err
