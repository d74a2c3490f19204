"""The knn model (trainers/models/knn.py) against naive oracles, its temperature choice, and its path through the loop,
the
checkpoint and the pick's refits."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from latentsweep.search.pick.candidates import Candidate, best_of_each_kind, top_trials
from latentsweep.search.pick.jobs import refit_jobs, refit_queue
from latentsweep.trainers.models import knn
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.train.loop import train
from latentsweep.trainers.models.model_context import FitSet, ModelContext
from latentsweep.trainers.models.zoo import build_model
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.train.tasks import predict
from latentsweep.trainers.config.validate import validate

DIN, DOUT = 8, 6


def clustered(n_img: int = 30, caps: int = 3, seed: int = 0) -> FitSet:
    """Captions near their image's text centre (noise 0.5), images near a linear map of it: neighbours carry signal."""
    g = torch.Generator().manual_seed(seed)
    centre = torch.randn(n_img, DIN, generator=g)
    images = centre @ torch.randn(DIN, DOUT, generator=g) + 0.3 * torch.randn(n_img, DOUT, generator=g)
    img = torch.arange(n_img).repeat_interleave(caps)
    x = centre[img] + 0.5 * torch.randn(n_img * caps, DIN, generator=g)
    return FitSet(x, img, images)


def kernel_rows(fit: FitSet) -> tuple[knn.Keys, knn.Values]:
    """The model's keys (every caption, centred by their mean) and unit images of a FitSet."""
    return (knn.Keys.fit(fit.x, torch.arange(len(fit.x)), torch.zeros(DIN), fit.img),
            knn.Values(fit.images, torch.arange(len(fit.images))))


def cfg_of(**values) -> Config:
    return with_values(Config(), {"model.kind": "knn", **values})


def naive_kernel(q: torch.Tensor, fit: FitSet, k: int, tau: float, center: float) -> torch.Tensor:
    """One query at a time, in float64: centre, normalise, the k largest cosines, softmax, mix the unit images, take
    `center` x their mean off."""
    x = fit.x.double()
    mean = x.mean(0)
    keys = (x - mean) / (x - mean).norm(dim=1, keepdim=True)
    values = fit.images.double() / fit.images.double().norm(dim=1, keepdim=True)
    out = []
    for row in q.double():
        v = row - mean
        cos = keys @ (v / v.norm())
        top = sorted(range(len(cos)), key=lambda i: -float(cos[i]))[:k]
        w = torch.softmax(torch.stack([cos[i] for i in top]) / tau, dim=0)
        out.append(sum(wi * values[fit.img[i]] for wi, i in zip(w, top)) - center * values.mean(0))
    return torch.stack(out)


@pytest.mark.parametrize("k, center", [(1, 1.0), (5, 1.0), (1000, 1.0), (5, 0.0), (5, 0.5)])
def test_prediction_is_the_softmax_mix_of_the_nearest_captions_images(k, center):
    fit = clustered()
    cfg = cfg_of(**{"model.knn_k": k, "model.knn_tau": 0.05, "model.knn_center": center})
    model = build_model(cfg, ModelContext(DIN, DOUT, fit=lambda: fit))
    q = torch.randn(7, DIN)
    raw = model(q)["raw"]
    assert torch.allclose(raw.double(), naive_kernel(q, fit, k, 0.05, center), atol=1e-5)


def test_blocks_of_queries_give_the_same_rows_as_one_at_a_time():
    fit = clustered()
    model = build_model(cfg_of(**{"model.knn_tau": 0.1}), ModelContext(DIN, DOUT, fit=lambda: fit))
    q = torch.randn(knn.BLOCK + 3, DIN)  # two blocks
    together = model(q)["pred"]
    alone = torch.cat([model(q[i:i + 1])["pred"] for i in range(len(q))])
    assert torch.allclose(together, alone, atol=1e-6)
    assert model(q[:0])["pred"].shape == (0, DOUT)


def naive_loio_mrr(fit: FitSet, k: int, tau: float, queries: torch.Tensor, gallery: torch.Tensor,
                   center: float = 0.0) -> float:
    """Leave-one-image-out MRR by the definition: each query translated from the other images' captions only
    (a kernel built without them), ranked against the gallery's other images; ties count for it (metrics.py)."""
    total = 0.0
    for q in queries.tolist():
        own = int(fit.img[q])
        keep = fit.img != own
        # centring and normalising as the model does: on every training caption (the query's own image included)
        x = fit.x.double()
        keys = (x - x.mean(0)) / (x - x.mean(0)).norm(dim=1, keepdim=True)
        values = fit.images.double() / fit.images.double().norm(dim=1, keepdim=True)
        cos = keys[keep] @ keys[q]
        top = torch.topk(cos, min(k, int(keep.sum())))
        w = torch.softmax(top.values / tau, dim=0)
        pred = w @ values[fit.img[keep][top.indices]] - center * values.mean(0)
        mine = float(pred @ values[own])
        rivals = [int(g) for g in gallery if int(g) != own]
        total += 1.0 / (1 + sum(float(pred @ values[g]) > mine for g in rivals))
    return total / len(queries)


@pytest.mark.parametrize("center", [0.0, 1.0])
def test_the_temperature_is_the_best_leave_one_image_out_choice(center):
    fit = clustered(n_img=40)
    keys, unit = kernel_rows(fit)
    k, seed = 16, 3
    chosen = knn.choose_tau(keys, unit, k, seed, center)
    gen = torch.Generator().manual_seed(seed)  # the same draws as choose_tau
    queries = torch.randperm(len(fit.x), generator=gen)[:knn.CHOICE_QUERIES]
    gallery = torch.randperm(len(fit.images), generator=gen)[:knn.GALLERY_SIZE]
    scores = [naive_loio_mrr(fit, k, tau, queries, gallery, center) for tau in knn.TAU_GRID]
    got = knn.loio_mrr(keys, unit, k, seed, center)
    assert got.tolist() == pytest.approx(scores, abs=1e-6)  # every grid point, not only the argmax
    assert scores[knn.TAU_GRID.index(chosen)] == pytest.approx(max(scores), abs=1e-6)
    assert max(scores) - min(scores) > 0.01  # the grid's ends really differ here: the choice is not a tie


def test_leaving_the_image_out_matters():
    """Captions that copy their image's one text vector: with its own image in the keys, every query would be found
    exactly; left out, the choice sees only the other images (an MRR well below 1 at every temperature)."""
    fit = clustered(caps=4)
    fit = FitSet(fit.x[::4].repeat_interleave(4, dim=0), fit.img, fit.images)
    keys, unit = kernel_rows(fit)
    gen = torch.Generator().manual_seed(0)
    queries = torch.randperm(len(fit.x), generator=gen)[:knn.CHOICE_QUERIES]
    gallery = torch.randperm(len(fit.images), generator=gen)[:knn.GALLERY_SIZE]
    assert naive_loio_mrr(fit, 8, 0.01, queries, gallery) < 0.9
    assert knn.choose_tau(keys, unit, 8, 0) in knn.TAU_GRID


def test_one_image_cannot_be_left_out():
    keys, unit = kernel_rows(clustered(n_img=1))
    assert knn.choose_tau(keys, unit, 4, 0) == knn.TAU_GRID[len(knn.TAU_GRID) // 2]


def test_slots_on_knn_are_a_config_error():
    with pytest.raises(ConfigError, match="slots.k = 2: model.kind 'knn' has no trained part"):
        validate(cfg_of(**{"slots.k": 2}))
    validate(cfg_of())  # and no loss is needed


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train_path, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 200, dim_text=16, dim_image=12,
                                               n_labels=4)
    return load_train(train_path)


def test_the_loop_validates_it_once_without_a_loss_and_saves_it(data, tmp_path):
    reports = []
    cfg = with_values(Config(), {"model.kind": "knn", "train.epochs": 16, "eval.gallery_size": 20,
                                 "train.device": "cpu"})  # no loss weight set: none is needed
    result = train(cfg, data, callback=reports.append, out_dir=tmp_path)
    assert [r.epoch for r in reports] == [0] and reports[0].improved
    assert result.best_epoch == 0 and len(result.history) == 1
    assert 0.0 < result.best_metrics["val/mrr"] <= 1.0
    assert result.timing.train_s == pytest.approx(0.0, abs=1e-3)
    loaded, loaded_cfg, meta = load_model(tmp_path / "best.pt")
    assert loaded_cfg.model.kind == "knn" and meta["epoch"] == 0
    x = torch.as_tensor(data.text[:9])
    assert torch.equal(predict(loaded, x), predict(result.model, x))
    assert min(abs(float(loaded.inner.tau) / t - 1) for t in knn.TAU_GRID) < 1e-6  # float32 of a grid value
    assert len(loaded.inner.key_rows) == len(data.cap2img) - _val_captions(cfg, data)  # the training captions


def _val_captions(cfg: Config, data) -> int:
    from latentsweep.trainers.data.splits import captions_of
    from latentsweep.trainers.train.tasks import split_images

    return len(captions_of(data.cap2img, split_images(cfg, data)[1]))


def candidate(number: int, kind: str) -> Candidate:
    cfg = with_values(Config(), {"model.kind": kind, "loss.infonce.weight": 1.0})
    return Candidate(f"trial-{number}", number, Path("best.pt"), cfg, (16, 12), 0.5, None, "local",
                     torch.nn.Identity())


def test_a_knn_member_is_refit_once_however_many_seeds(data, tmp_path):
    mlp, kern = candidate(0, "mlp"), candidate(1, "knn")
    names = [j.name for j in refit_jobs([mlp, kern], 3, data, tmp_path)]
    assert names == ["trial-0/refit-seed-0", "trial-0/refit-seed-1", "trial-0/refit-seed-2", "trial-1/refit-seed-0"]
    queue = [j.name for j in refit_queue([(mlp, 0.7), (kern, 0.3)], 3, data, tmp_path)]
    assert queue == ["trial-0/refit-seed-0", "trial-1/refit-seed-0", "trial-0/refit-seed-1", "trial-0/refit-seed-2"]


class _Trial:
    def __init__(self, number: int, kind: str | None, side: str | None = None):
        self.number, self.params = number, ({} if kind is None else {"model.kind": kind})
        self.user_attrs = {} if side is None else {"latentsweep.side": json.dumps({"model.kind": side})}


def test_the_pool_takes_the_best_trial_of_each_model_kind():
    ranked = [_Trial(4, "mlp"), _Trial(2, "mlp"), _Trial(7, "geometry"), _Trial(1, "knn"), _Trial(3, "knn")]
    assert [t.number for t in best_of_each_kind(ranked)] == [4, 7, 1]
    ranked = [_Trial(4, "mlp"), _Trial(0, None, side="knn"), _Trial(2, "mlp")]  # a side trial: its kind is its own
    assert [t.number for t in best_of_each_kind(ranked)] == [4, 0]
    assert best_of_each_kind([_Trial(0, None), _Trial(1, None)]) == []  # the kind is not searched: one kind
    assert best_of_each_kind([_Trial(0, "mlp"), _Trial(1, "mlp")]) == []


def test_naive_oracle_agrees_with_a_hand_computed_case():
    """The oracle itself, on two keys: weights softmax([1, 0] / tau) on the two images."""
    fit = FitSet(torch.tensor([[1.0, 0.0], [-1.0, 0.0]]), torch.tensor([0, 1]), torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    got = naive_kernel(torch.tensor([[1.0, 0.0]]), fit, 2, 0.5, 0.0)[0]
    w = np.exp([1 / 0.5, -1 / 0.5])
    w = w / w.sum()
    assert got.tolist() == pytest.approx([w[0], w[1]])
    assert math.isclose(float(got.norm()), float(np.hypot(*w)), rel_tol=1e-9)
    centred = naive_kernel(torch.tensor([[1.0, 0.0]]), fit, 2, 0.5, 1.0)[0]  # less the unit images' mean (0.5, 0.5)
    assert centred.tolist() == pytest.approx([w[0] - 0.5, w[1] - 0.5])


def test_top_trials_add_the_best_of_each_other_kind_from_a_real_study():
    import optuna

    study = optuna.create_study(direction="maximize")
    kinds = optuna.distributions.CategoricalDistribution(["mlp", "knn"])
    for value, kind in [(0.40, "mlp"), (0.45, "mlp"), (0.30, "knn"), (0.42, "mlp"), (0.35, "knn")]:
        study.add_trial(optuna.trial.create_trial(params={"model.kind": kind}, distributions={"model.kind": kinds},
                                                  value=value))
    assert [t.number for t in top_trials(study, 2)] == [1, 3, 4]  # the two best, then the best knn trial
    assert [t.number for t in top_trials(study, 5)] == [1, 3, 0, 4, 2]  # already in the top k: not twice


def test_a_saved_knn_exports_for_any_batch_and_predicts_as_loaded(data, tmp_path):
    """The pick's MLflow export (torch.export with a dynamic batch) of a knn checkpoint that carries kept
    predictions: the program predicts every batch size as the loaded model does (it once failed on the memo)."""
    from latentsweep.search.pick.pyfunc_model import export_member

    cfg = with_values(Config(), {"model.kind": "knn", "eval.gallery_size": 20, "train.device": "cpu"})
    train(cfg, data, out_dir=tmp_path)
    loaded = load_model(tmp_path / "best.pt")[0].eval()
    assert loaded.inner.memo.n > 0  # the val captions' predictions travel with the checkpoint
    export_member(tmp_path / "best.pt", tmp_path / "member.pt2")
    program = torch.export.load(str(tmp_path / "member.pt2")).module()
    for rows in (1, 7, 40):
        x = torch.as_tensor(data.text[:rows]).float()
        torch.testing.assert_close(program(x), predict(loaded, x))
