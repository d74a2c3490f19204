"""Out-of-fold selection and refit jobs of `latentsweep pick`: folds, subsets, budget plans, nested gains, and the
trainer's no-validation replay (data.split = "all", train.stop_after)."""
from __future__ import annotations

import numpy as np
import pytest

from latentsweep.search.pick import ensemble, jobs, oof
from latentsweep.search.pick import plan as plan_mod
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.train.loop import train
from latentsweep.trainers.eval.metrics import evaluate_leaderboard
from latentsweep.trainers.data.splits import captions_of, fold_assignment
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train_path, _, _ = write_synthetic(tmp_path_factory.mktemp("refit"), 120, dim_text=8, dim_image=12, n_test=0)
    return load_train(train_path)


def test_folds_partition_images_and_subset_keeps_pairs(data):
    fold_of = fold_assignment(data.image_names, 4)
    assert sorted(np.bincount(fold_of)) == [30, 30, 30, 30]
    part = jobs.subset(data, np.flatnonzero(fold_of != 0))
    assert len(part.image) == 90 and part.fingerprint != data.fingerprint
    held = set(data.image_names[fold_of == 0])
    assert not held & set(part.image_names)
    caps = captions_of(data.cap2img, np.flatnonzero(fold_of != 0))
    assert np.array_equal(part.text, data.text[caps])
    assert np.array_equal(part.image[part.cap2img], data.image[data.cap2img[caps]])  # each caption keeps its image


def test_replay_config_trains_without_validation_up_to_the_best_epoch():
    cfg = jobs.replay_config(with_values(Config(), {"train.epochs": 10, "train.seed": 4}), best_epoch=3, seed=7)
    assert (cfg.data.split, cfg.train.stop_after, cfg.train.epochs, cfg.train.seed) == ("all", 4, 10, 7)


def test_stop_after_keeps_the_schedule_horizon_and_the_last_epoch(data):
    cfg = with_values(Config(), {"data.split": "all", "model.hidden": [16], "loss.infonce.weight": 1.0,
                                 "train.epochs": 6, "train.stop_after": 3, "train.batch_size": 64,
                                 "schedule.name": "cosine", "optim.lr": 1e-3})
    result = train(cfg, data)
    assert len(result.history) == 3 and result.best_epoch == 2  # no validation: the last epoch is kept
    assert not any(k.startswith("val/") for k in result.history[-1])
    # cosine planned over 6 epochs: after 3 of them the LR is still about half, not at its floor
    assert 0.3e-3 < result.history[-1]["lr"] < 0.7e-3
    with pytest.raises(ConfigError, match="stop_after"):
        train(with_values(cfg, {"train.stop_after": 7}), data)


def test_plan_drops_in_order_and_notes_each_drop():
    cost = lambda top, folds, seeds: top * (folds + seeds) * 10.0  # noqa: E731
    assert plan_mod.plan(cost, 5, 5, 3, None).notes == []
    p = plan_mod.plan(cost, 5, 5, 3, budget=130)
    assert (p.top, p.folds, p.seeds) == (2, 3, 3)  # folds 5->3, then the weakest candidates
    assert [n.split(", so ")[1] for n in p.notes] == ["folds 5 -> 3", "top 5 -> 4", "top 4 -> 3", "top 3 -> 2"]
    single = plan_mod.plan(cost, 5, 5, 3, budget=1)
    assert (single.top, single.folds, single.seeds) == (1, 0, 1) and "smallest plan" in single.notes[-1]


JOB_S = {1: 12.0, 2: 9.0, 3: 7.0, 4: 20.0, 5: 5.0}  # seconds of one full-data job per candidate rank


def jobs_of(top: int, folds: int, seeds: int) -> list[float]:
    """The seconds of each job a pick runs for a plan: `folds` fold models of each candidate (each on (k-1)/k of the
    images) then one refit of the best; without folds (one candidate), its `seeds` refits."""
    if not folds:
        return [JOB_S[1]] * seeds
    return [JOB_S[c] * (folds - 1) / folds for c in range(1, top + 1) for _ in range(folds)] + [JOB_S[1]]


@pytest.mark.parametrize("budget", [1, 35, 60, 95, 130, 200, 310, 1000])
def test_the_planned_jobs_fit_the_budget_and_no_drop_was_needless(budget):
    """Run the jobs of the plan on a simulated clock: they end within the budget (or the plan is the smallest, one
    job), and the last drop the plan notes was needed: undone, the jobs would not have fitted."""
    p = plan_mod.plan(lambda **knobs: sum(jobs_of(**knobs)), 5, 5, 3, budget)
    elapsed = sum(jobs_of(p.top, p.folds, p.seeds))
    assert elapsed <= budget or (p.top, p.folds, p.seeds) == (1, 0, 1)
    drops = [n.split(", so ")[1] for n in p.notes if ", so " in n]
    if drops:  # e.g. "top 4 -> 3": with top 4 back, the pick would have overrun
        knob, before, _, _after = drops[-1].split()
        bigger = {"top": p.top, "folds": p.folds, "seeds": p.seeds, knob: int(before)}
        if bigger["top"] > 1 and knob == "top":
            bigger["folds"] = p.folds or 3
        assert sum(jobs_of(**bigger)) > budget
    else:
        assert (p.top, p.folds, p.seeds) == (5, 5, 3) and elapsed <= budget


def test_default_budget_is_half_the_study_wall_time_within_bounds():
    assert plan_mod.default_budget(600)[0] == 300
    assert plan_mod.default_budget(30)[0] == plan_mod.DEFAULT_BUDGET_MIN
    assert plan_mod.default_budget(4 * 3600)[0] == plan_mod.DEFAULT_BUDGET_MAX
    assert plan_mod.default_budget(None)[0] == plan_mod.DEFAULT_BUDGET_MAX


def _members(n_images: int = 120, caps_per_image: int = 2, seed: int = 0):
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((n_images, 16)).astype(np.float32)
    cap2img = np.repeat(np.arange(n_images), caps_per_image)
    noisy = [image[cap2img] + rng.standard_normal((len(cap2img), 16)).astype(np.float32) * (1.6 + 0.1 * i)
             for i in range(4)]
    return image, cap2img, noisy


def test_nested_gain_matches_an_oracle_that_selects_on_the_other_folds():
    image, cap2img, outs = _members()
    fold_of = np.arange(len(image)) % 3
    sel = oof.nested_select(outs, oof.Folds(fold_of, cap2img), image, "greedy", 6)
    assert sel.weights.sum() == pytest.approx(1.0) and len(sel.fold_gains) == 3
    for g in range(3):  # naive re-implementation of fold g
        inner, outer = np.flatnonzero(fold_of != g), np.flatnonzero(fold_of == g)

        def mrr_on(imgs, pred_rows):
            caps = np.flatnonzero(np.isin(cap2img, imgs))
            local = {img: k for k, img in enumerate(imgs)}
            target = np.array([local[i] for i in cap2img[caps]])
            return evaluate_leaderboard(pred_rows[caps], image[imgs], target, gallery_size=min(100, len(imgs)))["mrr"]

        in_caps = np.flatnonzero(np.isin(cap2img, inner))
        w = ensemble.method_weights("greedy", [o[in_caps] for o in outs],
                                    lambda p: mrr_on(inner, _scatter(p, in_caps, len(cap2img))), 6)
        best = int(np.argmax([mrr_on(inner, o) for o in outs]))
        ens = mrr_on(outer, ensemble.combine(outs, w))
        assert sel.fold_ensemble[g] == pytest.approx(ens)
        assert sel.fold_best[g] == pytest.approx(mrr_on(outer, outs[best]))
    assert sel.gain > 0  # independent noise: the nested ensemble beats the nested best single on average


def _scatter(rows: np.ndarray, at: np.ndarray, n: int) -> np.ndarray:
    full = np.zeros((n, rows.shape[1]), np.float32)
    full[at] = rows
    return full
