"""Tests of the training loop on tiny synthetic data: learning, determinism, callback, checkpoint, early stop,
divergence."""
from __future__ import annotations

import csv

import numpy as np
import pytest
import torch

from latentsweep.trainers.eval import metrics
from latentsweep.trainers.train.checkpoint import CenteredModel, load_model
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.train.loop import EpochReport, TrainingDiverged, seed_everything, train
from latentsweep.trainers.losses import Criterion
from latentsweep.trainers.models.zoo import build_model
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.train.tasks import TASKS, predict
from latentsweep.trainers.config.validate import validate

EPOCHS = 3
SMALL = {"model.hidden": "64", "train.batch_size": 64, "train.epochs": EPOCHS, "data.val_ratio": 0.2,
         "eval.gallery_size": 20, "loss.infonce.weight": 1.0, "train.seed": 0, "train.device": "cpu"}


def small_cfg(**values) -> Config:
    return with_values(Config(), {**SMALL, **values})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train_path, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 300, dim_text=32, dim_image=48, n_labels=5)
    return load_train(train_path)


@pytest.fixture(scope="module")
def run(data, tmp_path_factory):
    """One 3-epoch run with a recording callback and an output directory, shared by the tests that read it."""
    out = tmp_path_factory.mktemp("run")
    reports: list[EpochReport] = []
    result = train(small_cfg(), data, callback=reports.append, out_dir=out)
    return result, reports, out


def untrained_mrr(cfg: Config, data) -> float:
    """val/mrr of the model as initialised by `train` (same seed), evaluated by the task."""
    seed_everything(cfg.train.seed)
    task = TASKS.get(cfg.data.task)(cfg, data, torch.device("cpu"))
    model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean)
    return task.evaluate(model)["val/mrr"]


# ---------------------------------------------------------------------------------------------- learning

def test_training_improves_over_the_untrained_model(run, data):
    result, _, _ = run
    before = untrained_mrr(small_cfg(), data)
    assert result.best_metrics["val/mrr"] > before + 0.05
    assert result.history[-1]["train/loss"] < result.history[0]["train/loss"]


def test_best_epoch_is_the_max_val_mrr(run, data):
    result, _, _ = run
    scores = [row["val/mrr"] for row in result.history]
    assert len(result.history) == EPOCHS
    assert result.best_epoch == scores.index(max(scores))
    assert result.best_metrics == result.history[result.best_epoch]
    # The returned model carries the best epoch's weights.
    cfg = small_cfg()
    task = TASKS.get("translate")(cfg, data, torch.device("cpu"))
    assert task.evaluate(result.model)["val/mrr"] == pytest.approx(result.best_metrics["val/mrr"], abs=1e-9)


def test_val_ranks_are_the_best_models_global_ranks(run):
    result, _, _ = run
    assert result.val_ranks is not None and result.val_ranks.min() >= 1
    assert metrics.summarize(result.val_ranks)["mrr"] == pytest.approx(result.best_metrics["val/mrr_global"])


def test_val_ranks_come_from_the_best_epoch_not_the_last(data):
    """The ranks are kept from the best epoch's own validation (no second pass): they must be the returned model's,
    computed here the naive way, in a run whose last epoch is worse than its best."""
    result = train(small_cfg(**{"optim.lr": 0.03, "train.epochs": 4}), data)
    assert result.best_epoch < len(result.history) - 1  # the setup this test needs: a later epoch did worse
    task = TASKS.get("translate")(small_cfg(), data, torch.device("cpu"))
    x, images = (v.materialize() if hasattr(v, "materialize") else v for v in (task.val_x, task.val_images))
    with torch.no_grad():
        pred = result.model.eval()(x)["pred"]
    sims = torch.nn.functional.normalize(pred, dim=1) @ torch.nn.functional.normalize(images, dim=1).T
    true = sims[torch.arange(len(sims)), task.val_img]
    naive = 1 + (sims > true[:, None]).sum(1)
    np.testing.assert_array_equal(result.val_ranks, naive.numpy())


def test_fixed_seed_reproduces_identical_metrics(run, data):
    result, _, _ = run
    again = train(small_cfg(), data)
    assert again.history == result.history  # exact equality on CPU, every key of every epoch
    other = train(small_cfg(**{"train.seed": 1, "train.epochs": 1}), data)
    assert other.history[0]["train/loss"] != result.history[0]["train/loss"]  # the seed matters


# ---------------------------------------------------------------------------------------------- callback

def test_callback_sees_every_epoch(run):
    result, reports, _ = run
    assert [r.epoch for r in reports] == list(range(EPOCHS))
    best = -1.0
    for report, row in zip(reports, result.history):
        assert 0.0 < report.metrics["val/mrr"] <= 1.0
        assert 0.0 < report.metrics["val/mrr_global"] <= 1.0
        assert {**report.metrics, "epoch": report.epoch} == row
        assert report.improved == (report.metrics["val/mrr"] > best)
        best = max(best, report.metrics["val/mrr"])


def test_callback_can_stop_training(data, tmp_path):
    class Stop(Exception):
        pass

    seen = []

    def callback(report: EpochReport) -> None:
        seen.append(report.epoch)
        if report.epoch == 1:
            raise Stop

    with pytest.raises(Stop):
        train(small_cfg(), data, callback=callback, out_dir=tmp_path)
    assert seen == [0, 1]
    with open(tmp_path / "metrics.csv") as fh:
        assert [int(row["epoch"]) for row in csv.DictReader(fh)] == [0, 1]  # the stopped epoch is recorded


# ---------------------------------------------------------------------------------------------- outputs

def test_best_checkpoint_and_metrics_csv(run, data):
    result, _, out = run
    assert result.checkpoint == out / "best.pt" and result.checkpoint.is_file()
    model, cfg, meta = load_model(result.checkpoint)
    assert cfg == small_cfg()
    assert meta["epoch"] == result.best_epoch
    assert meta["metrics"]["val/mrr"] == result.best_metrics["val/mrr"]
    assert meta["data_fingerprint"] == data.fingerprint
    x = torch.as_tensor(data.text[:50])
    assert torch.allclose(predict(model, x), predict(result.model, x), atol=1e-6)

    with open(out / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == EPOCHS
    assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
    for row, hist in zip(rows, result.history):
        assert float(row["val/mrr"]) == pytest.approx(hist["val/mrr"])
        assert float(row["train/loss"]) == pytest.approx(hist["train/loss"])


@pytest.mark.parametrize("every_s", [0.0, 1e9])  # a write per improved epoch, or one when the run ends
def test_best_checkpoint_is_the_best_epoch_however_often_it_is_written(data, tmp_path, monkeypatch, every_s):
    import latentsweep.trainers.train.loop as loop

    monkeypatch.setattr(loop, "CHECKPOINT_EVERY_S", every_s)
    writes = []
    real = loop._save_best
    monkeypatch.setattr(loop, "_save_best", lambda *a: writes.append(a[5]) or real(*a))
    # data.split = "all" (a refit): every epoch is the best one, its state copied into the previous epoch's copy
    result = train(small_cfg(**{"data.split": "all"}), data, out_dir=tmp_path / "all")
    assert result.best_epoch == EPOCHS - 1 and writes[-1] == EPOCHS - 1
    assert writes == (list(range(EPOCHS)) if not every_s else [0, EPOCHS - 1])  # the first at once, then the last
    model, _, meta = load_model(tmp_path / "all" / "best.pt")
    assert meta["epoch"] == EPOCHS - 1
    x = torch.as_tensor(data.text[:50])
    assert torch.equal(predict(model, x), predict(result.model, x))

    class Stop(Exception):
        pass

    def stop_at_1(report: EpochReport) -> None:
        if report.epoch == 1:
            raise Stop

    with pytest.raises(Stop):  # a pruned trial: its best epoch so far is on disk all the same
        train(small_cfg(**{"data.split": "all"}), data, out_dir=tmp_path / "stopped", callback=stop_at_1)
    assert load_model(tmp_path / "stopped" / "best.pt")[2]["epoch"] == 1


def test_no_out_dir_writes_no_checkpoint(data):
    result = train(small_cfg(**{"train.epochs": 1}), data)
    assert result.checkpoint is None and len(result.history) == 1


def test_train_threads_apply_inside_and_are_restored(data):
    """train.threads is the training's own setting: the caller's torch thread count is unchanged afterwards."""
    before = torch.get_num_threads()
    seen = []
    train(small_cfg(**{"train.epochs": 1, "train.threads": before + 1}), data,
          callback=lambda r: seen.append(torch.get_num_threads()))
    assert seen == [before + 1] and torch.get_num_threads() == before


def test_early_stopping_stops(data):
    # lr = 0: val/mrr never improves after epoch 0, so patience 1 stops after epoch 1.
    seen = []
    result = train(small_cfg(**{"optim.lr": 0.0, "train.early_stop": 1, "train.epochs": 4}), data,
                   callback=lambda r: seen.append(r.epoch))
    assert seen == [0, 1]
    assert len(result.history) == 2 and result.best_epoch == 0
    assert result.history[0]["val/mrr"] == result.history[1]["val/mrr"]


def test_val_loss_is_the_configured_losses_on_the_val_batches(data):
    # lr = 0: the model stays as initialised, so val/loss can be recomputed from the untrained model; it never
    # improves, so early stopping on it (patience 1) stops after epoch 1.
    cfg = small_cfg(**{"optim.lr": 0.0, "train.early_stop": 1, "train.epochs": 4, "train.monitor": "val/loss",
                       "loss.cosine.weight": 0.5})
    result = train(cfg, data)
    assert len(result.history) == 2
    seed_everything(cfg.train.seed)
    task = TASKS.get(cfg.data.task)(cfg, data, torch.device("cpu"))
    model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean).eval()
    criterion = Criterion(cfg, task.dim_out)
    with torch.no_grad():
        losses = [float(criterion(model(b["x"]), b)[0]) for b in task.val_batches()]
    assert sum(len(b["x"]) for b in task.val_batches()) == len(task.val_x)  # every val caption, once
    assert result.history[0]["val/loss"] == pytest.approx(sum(losses) / len(losses), rel=1e-5)
    assert "val/loss" not in train(small_cfg(**{"train.epochs": 1}), data).history[0]  # only computed if watched


def test_early_stopping_and_plateau_watch_val_loss_but_the_best_epoch_is_by_mrr(data):
    cfg = small_cfg(**{"optim.name": "adam", "optim.lr": 0.05, "train.early_stop": 3, "train.epochs": 10,
                       "train.monitor": "val/loss", "schedule.name": "plateau", "schedule.plateau_patience": 0})
    result = train(cfg, data)
    losses = [row["val/loss"] for row in result.history]
    worse = [e > 0 and losses[e] >= min(losses[:e]) for e in range(len(losses))]  # val/loss did not improve
    assert any(worse)  # the LR is high enough for the loss to bounce, so the checks below see both cases
    stale, stop = 0, len(losses) - 1
    for e in range(len(losses)):
        stale = stale + 1 if worse[e] else 0
        if stale >= 3:
            stop = e
            break
    assert len(result.history) == stop + 1  # stopped by val/loss patience, not by val/mrr's
    assert result.best_epoch == max(range(len(losses)), key=lambda e: result.history[e]["val/mrr"])
    lrs = [row["lr"] for row in result.history]  # the LR each epoch trained with
    for e in range(1, len(lrs)):  # patience 0: the LR halves right after an epoch whose val/loss did not improve
        assert lrs[e] == pytest.approx(lrs[e - 1] * (0.5 if worse[e - 1] else 1.0))


def test_learnable_tau_is_logged_and_saved(data, tmp_path):
    cfg = small_cfg(**{"temperature.mode": "learnable", "temperature.tau": 0.1, "train.epochs": 2})
    result = train(cfg, data, out_dir=tmp_path)
    taus = [row["train/tau"] for row in result.history]
    assert len(taus) == 2 and all(t != pytest.approx(0.1, rel=1e-4) for t in taus)  # learned, and logged
    criterion = Criterion(cfg, 48)
    criterion.load_state_dict(torch.load(tmp_path / "best.pt", map_location="cpu", weights_only=True)["loss_state"])
    assert float(criterion.temperature().detach()) == pytest.approx(result.best_metrics["train/tau"], rel=1e-5)
    assert "train/tau" not in train(small_cfg(**{"train.epochs": 1}), data).history[0]  # fixed tau: not logged


def test_huge_lr_sgd_with_mse_diverges(data, tmp_path):
    cfg = small_cfg(**{"loss.infonce.weight": 0.0, "loss.mse.weight": 1.0, "model.out_norm": False,
                       "optim.name": "sgd", "optim.lr": 1e6, "train.epochs": 2})
    with pytest.raises(TrainingDiverged, match="loss is not finite at epoch 0"):
        train(cfg, data, out_dir=tmp_path)
    assert not (tmp_path / "best.pt").exists()  # nothing written for a diverged epoch


# ---------------------------------------------------------------------------------------------- tasks

@pytest.mark.parametrize("negatives", ["batch_hard", "global_hard", "step_hard", "random"])
def test_multilabel_task_reports_label_metrics(data, negatives):
    cfg = small_cfg(**{"data.task": "multilabel", "loss.infonce.weight": 0.0, "loss.multilabel_triplet.weight": 1.0,
                       "loss.multilabel_triplet.negatives": negatives, "model.out_dim": 16, "eval.recall_k": 5,
                       "train.epochs": 2})
    result = train(cfg, data)
    assert len(result.history) == 2
    for row in result.history:
        assert 0.0 < row["val/mrr"] <= 1.0
        assert 0.0 <= row["val/recall@5"] <= 1.0
    assert result.val_ranks is None


def _hardest_negative_rows(task, model, anchors: torch.Tensor) -> torch.Tensor:
    """Brute force, as the multi-label seed: per anchor, the training item sharing no label that is most similar
    under the model now."""
    emb = predict(model, task.x)
    rows = []
    for a in anchors.tolist():
        best = max((j for j in range(len(task.x)) if not bool((task.labels[a] & task.labels[j]).any())),
                   key=lambda j: float(emb[a] @ emb[j]))
        rows.append(best)
    return torch.tensor(rows)


def test_multilabel_step_hard_mines_every_step_with_the_live_model(data):
    cfg = small_cfg(**{"data.task": "multilabel", "loss.infonce.weight": 0.0, "loss.multilabel_triplet.weight": 1.0,
                       "loss.multilabel_triplet.negatives": "step_hard", "model.out_dim": 16, "model.kind": "linear",
                       "model.bias": False})
    task = TASKS.get("multilabel")(cfg, data, torch.device("cpu"))
    model = build_model(cfg, task.model_context())
    task.epoch_context(model)
    batches = task.batches(torch.Generator().manual_seed(0))
    for _ in range(2):  # the second batch after new weights: mined with them, not with the epoch's first ones
        batch = next(batches)
        assert torch.equal(batch["neg_x"], task.x[_hardest_negative_rows(task, model, batch["img"])])
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn_like(param))


def test_multilabel_fixed_positives_are_drawn_once(data):
    cfg = small_cfg(**{"data.task": "multilabel", "loss.infonce.weight": 0.0, "loss.multilabel_triplet.weight": 1.0,
                       "loss.multilabel_triplet.positives": "fixed", "model.out_dim": 16, "eval.recall_k": 5,
                       "train.epochs": 2, "model.kind": "linear", "model.bias": False})
    task = TASKS.get("multilabel")(cfg, data, torch.device("cpu"))
    pos = task.fixed_pos
    assert torch.equal(pos, TASKS.get("multilabel")(cfg, data, torch.device("cpu")).fixed_pos)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):  # two epochs: the same positive for each anchor
        for batch in task.batches(gen):
            expected = pos[batch["img"]]
            assert torch.equal(batch["has_pos"], expected >= 0)
            assert torch.equal(batch["pos_x"][batch["has_pos"]], task.x[expected[expected >= 0]])
    result = train(cfg, data)
    assert len(result.history) == 2 and result.history[-1]["train/multilabel_triplet"] > 0
    with pytest.raises(ConfigError, match="val/loss"):
        validate(with_values(cfg, {"train.monitor": "val/loss"}))


def test_validate_rejects_label_loss_on_translate_task(data):
    cfg = small_cfg(**{"loss.multilabel_triplet.weight": 1.0})
    with pytest.raises(ConfigError, match="multilabel"):
        validate(cfg)
    with pytest.raises(ConfigError, match="multilabel"):
        train(cfg, data)


def test_validate_rejects_translation_loss_on_multilabel_task():
    cfg = small_cfg(**{"data.task": "multilabel", "loss.multilabel_triplet.weight": 1.0})
    with pytest.raises(ConfigError, match="loss.infonce.weight = 0"):
        validate(cfg)


def test_validate_rejects_warmup_longer_than_training():
    with pytest.raises(ConfigError, match="warmup_epochs"):
        validate(small_cfg(**{"schedule.warmup_epochs": 5.0}))
