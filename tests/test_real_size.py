"""Costs that grow with the data (issue 38), on small data: the closed form's gallery-only scoring against the metrics
module's, the train file read once per machine (the memory-mapped cache), the knn checkpoint without its keys, and
the knn side trial's estimate before it starts."""
from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from latentsweep.search.tracking.memory import InMemoryTracker
from latentsweep.trainers.models.closed_form import ALPHAS, fit_ridge, held_out_mrr, moments, solve
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.eval.metrics import evaluate_leaderboard
from latentsweep.trainers.data.synthetic import write_synthetic


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("real-size") / "d", 260, dim_text=12, dim_image=20,
                                  n_test=20)
    return train


def test_the_ridge_scores_its_galleries_as_the_leaderboard_does(small):
    data = load_train(small)
    ridge = solve(moments(data, np.arange(150 * 5)), 0.1)
    held = np.arange(len(data.cap2img))[data.cap2img >= 50]  # captions of images 50.. (a gallery of 100 and a top-up)
    image = data.image[50:].copy()
    image[3] = 0.0  # a degenerate image: never outranks, the worst rank as a target
    local = data.cap2img[held] - 50
    for seed in (0, 1):
        want = evaluate_leaderboard(ridge.predict(data.text[held]), image, local, seed=seed)["mrr"]
        assert held_out_mrr(ridge, data.text[held], image, local, seed) == pytest.approx(want, abs=1e-6)
        assert held_out_mrr(ridge, data.text, image, local, seed, caps=held) == pytest.approx(want, abs=1e-6)


def test_the_chosen_strength_has_the_best_held_out_score(small):
    ridge, scores = fit_ridge(load_train(small))
    assert set(scores) == set(ALPHAS) and ridge.alpha == max(scores, key=scores.get)
    assert len(set(scores.values())) > 1  # the strengths are told apart, not all scored alike


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh data cache and no train set held by this process (as in a newly spawned worker)."""
    from latentsweep.trainers.data import sets as data_mod

    monkeypatch.setenv(data_mod.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(data_mod, "_last_read", [])
    monkeypatch.setattr(data_mod, "reads", {"parsed": 0, "mapped": 0})
    return data_mod


def test_a_second_process_maps_the_file_instead_of_parsing_it(small, cache):
    first = cache.load_train_shared(small)
    cache._last_read.clear()  # what a new process starts with
    second = cache.load_train_shared(small)
    assert cache.reads == {"parsed": 1, "mapped": 1}
    assert isinstance(second.text, np.memmap) and second.fingerprint == first.fingerprint
    for name in ("caption_ids", "text", "image", "cap2img", "image_names"):
        np.testing.assert_array_equal(getattr(second, name), getattr(first, name))


def test_a_write_into_the_mapped_set_is_a_crash_with_its_stack(small, cache, tmp_path):
    """The mapping is sealed read-only (pages.seal): a write would land in a private page that the next pages.drop
    throws away, so it is stopped where it happens, and the cache is unchanged."""
    import subprocess

    first = cache.load_train_shared(small)  # writes the cache the child maps
    code = (f"from latentsweep.search.process import configure_process; configure_process()\n"
            f"from latentsweep.trainers.data.sets import load_train_shared\n"
            f"import torch\n"
            f"data = load_train_shared({str(small)!r})\n"
            f"torch.as_tensor(data.text)[0] += 1.0\n")
    env = {**__import__("os").environ, cache.CACHE_ENV: str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -11, done.stderr
    assert "Segmentation fault" in done.stderr and 'File "<string>", line 5' in done.stderr
    cache._last_read.clear()
    assert cache.reads["mapped"] == 0 and np.array_equal(cache.load_train_shared(small).text, first.text)
    assert cache.reads["mapped"] == 1


def test_a_changed_file_is_parsed_again(small, cache, tmp_path):
    import shutil

    copy = tmp_path / "train.npz"
    shutil.copy(small, copy)
    cache.load_train_shared(copy)
    write_synthetic(tmp_path / "other", 30, dim_text=12, dim_image=20)
    shutil.copy(tmp_path / "other" / "train.npz", copy)  # same path, other bytes
    cache._last_read.clear()
    assert len(cache.load_train_shared(copy).image) == 30 and cache.reads == {"parsed": 2, "mapped": 0}


def test_the_cache_off_parses_every_time(small, cache, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, "off")
    cache.load_train_shared(small)
    cache._last_read.clear()
    cache.load_train_shared(small)
    assert cache.reads == {"parsed": 2, "mapped": 0}


def test_a_knn_model_that_would_not_finish_is_not_started(small, tmp_path):
    from latentsweep.trainers.config.tree import Config, with_values
    from latentsweep.trainers.core.deadline import Deadline
    from latentsweep.trainers.models.knn import build_seconds
    from latentsweep.trainers.train.loop import train
    from latentsweep.trainers.train.run import DeadlineReached

    data = load_train(small)
    cfg = with_values(Config(), {"model.kind": "knn", "data.val_ratio": 0.25})
    estimate = build_seconds(cfg, data)
    assert estimate > 0
    with pytest.raises(DeadlineReached, match="knn model's estimated"):
        train(cfg, data, out_dir=tmp_path / "short", deadline=lambda: Deadline.after(estimate / 100 + 1e-3))
    assert not (tmp_path / "short" / "best.pt").exists()  # nothing built, nothing saved
    result = train(cfg, data, out_dir=tmp_path / "long", deadline=lambda: Deadline.after(100 * estimate + 60))
    assert (tmp_path / "long" / "best.pt").is_file() and result.best_metrics["val/mrr"] > 0


def test_a_knn_checkpoint_carries_its_val_predictions(small, tmp_path):
    from latentsweep.trainers.train.checkpoint import load_model
    from latentsweep.trainers.config.tree import Config, with_values
    from latentsweep.trainers.train.loop import train
    from latentsweep.trainers.train.tasks import predict, split_images
    from latentsweep.trainers.data.splits import captions_of

    data = load_train(small)
    cfg = with_values(Config(), {"model.kind": "knn", "data.val_ratio": 0.25})
    train(cfg, data, out_dir=tmp_path / "knn")
    val = torch.as_tensor(data.text[captions_of(data.cap2img, split_images(cfg, data)[1])])
    model, _, _ = load_model(tmp_path / "knn" / "best.pt")
    kept = predict(model, val)
    assert model.inner.computed == 0  # every val caption read from what the trial's validation computed
    other = torch.as_tensor(data.text[:7]) + 0.01  # rows it never saw are computed
    predict(model, other)
    assert model.inner.computed == 7
    # a checkpoint without the kept rows (written before them) loads and predicts the same
    payload = torch.load(tmp_path / "knn" / "best.pt", weights_only=True)
    assert "inner.memo_pred" in payload["state_dict"]
    for key in ("inner.memo_hash", "inner.memo_pred"):
        del payload["state_dict"][key]
    torch.save(payload, tmp_path / "old.pt")
    torch.save(payload, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # a file torch cannot map
    for name in ("old.pt", "legacy.pt"):
        old, _, _ = load_model(tmp_path / name)
        torch.testing.assert_close(predict(old, val), kept, rtol=1e-5, atol=1e-6)
        assert old.inner.computed == len(val)


def test_the_cache_keeps_the_most_recently_used_copies(cache, tmp_path):
    paths = [write_synthetic(tmp_path / f"f{i}", 20 + i, dim_text=6, dim_image=8)[0]
             for i in range(cache.CACHE_KEEP + 1)]
    for path in paths:
        cache.load_train_shared(path)
    kept = sorted(p.name for p in (tmp_path / "cache").iterdir())
    assert len(kept) == cache.CACHE_KEEP and cache.cache_dir(cache.fingerprint(paths[0])).name not in kept
    assert isinstance(cache.load_train_shared(paths[-1]).text, np.memmap)  # the process that wrote it maps it too


def test_a_knn_candidate_is_loaded_without_a_prediction(small, tmp_path):
    """The pick loads a knn trial's checkpoint without predicting anything: a probe row for its output width made it
    read every key of the mapped file (0.5 GB at challenge size, resident from then on)."""
    from latentsweep.search.pick.candidates import make_candidate
    from latentsweep.trainers.config.tree import Config, with_values
    from latentsweep.trainers.train.loop import train

    data = load_train(small)
    train(with_values(Config(), {"model.kind": "knn", "data.val_ratio": 0.25}), data, out_dir=tmp_path / "knn")
    cand = make_candidate("trial-0", 0, tmp_path / "knn" / "best.pt", "local", 0.5, "cpu")
    assert cand.dims == (data.text.shape[1], data.image.shape[1]) and cand.model.inner.computed == 0


class LitteringTracker(InMemoryTracker):
    """An in-memory tracker that leaves cyclic garbage holding the frame that logs a trial's artifacts (as matplotlib's
    parser leaves tracebacks behind when a trial's figure is drawn): that frame's callers stay alive with it until
    Python's next full collection."""

    def log_artifacts(self, run_id, paths, artifact_path=None):
        super().log_artifacts(run_id, paths, artifact_path)
        litter = [sys._getframe()]
        litter.append(litter)


@pytest.mark.parametrize("pruned", [False, True])
def test_a_finished_trial_frees_its_model_without_a_collection(small, tmp_path, monkeypatch, pruned):
    """A trial's model (the knn side trial's keys: 0.5 GB at challenge size) is freed when its trial ends, complete or
    pruned, not at Python's next full collection under the next trial and the pick."""
    import gc
    import weakref

    import optuna

    from conftest import tiny_study_file
    from latentsweep.search.cli.main import build_parser
    from latentsweep.search.cli.study import make_spec
    from latentsweep.search.study.objective import TrialRunner
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.trainers.train import loop

    built = []
    real_build = loop.build_model
    monkeypatch.setattr(loop, "build_model", lambda *a, **k: built.append(real_build(*a, **k)) or built[-1])
    sf = tiny_study_file(tmp_path, "freed", n_trials=1, epochs=1)
    args = build_parser().parse_args(["study", "run", str(sf), "--data", str(small), "--state-dir", str(tmp_path)])
    tracker = LitteringTracker()
    tracker.ensure_study("freed", {})
    runner = TrialRunner(load_study_file(sf), make_spec(args), load_train(small), tracker, tmp_path / "t")
    pruner = optuna.pruners.ThresholdPruner(lower=2.0) if pruned else optuna.pruners.NopPruner()  # MRR < 2: pruned
    study = optuna.create_study(direction="maximize", pruner=pruner)
    # the process's first optimizer imports torch._dynamo, whose garbage holds that run's frames until a collection
    # (once per process): made here, before the trial
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    gc.collect()
    gc.disable()
    try:
        state, _ = runner.run(study.ask())
        model = weakref.ref(built.pop())
        assert state.name == ("PRUNED" if pruned else "COMPLETE") and (tmp_path / "t" / "trial-0" / "best.pt").is_file()
        assert model() is None
    finally:
        gc.enable()
