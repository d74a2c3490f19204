"""Tests of latentsweep.trainers.train.regularise (mixup, input noise, EMA/SWA), InfoNCE label smoothing and their use
by the loop."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.train.loop import train
from latentsweep.trainers.losses import LOSSES, Temperature
from latentsweep.trainers.train.regularise import EMA, SWA, BatchAugment, build_average
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.train.tasks import TASKS, predict
from latentsweep.trainers.config.validate import validate

B, DT, DI = 12, 5, 7
SMALL = {"model.hidden": "32", "train.batch_size": 32, "train.epochs": 2, "data.val_ratio": 0.2,
         "eval.gallery_size": 20, "loss.infonce.weight": 1.0, "train.device": "cpu"}


def cfg_with(**values) -> Config:
    return with_values(Config(), {k.replace("__", "."): v for k, v in values.items()})


def make_batch(seed: int = 0) -> dict:
    """B captions of 6 images (2 captions each): raw targets y [B, DI], unit targets y_n, inputs x [B, DT]."""
    g = torch.Generator().manual_seed(seed)
    img = torch.arange(B) // 2
    y = torch.randn(B // 2, DI, generator=g)[img] * 3.0
    return {"x": torch.randn(B, DT, generator=g), "y": y, "y_n": F.normalize(y, dim=-1), "img": img}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train_path, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=16, dim_image=24, n_labels=4)
    return load_train(train_path)


# ---------------------------------------------------------------------------------------------- augmentation

def test_augment_off_returns_the_batch_untouched():
    batch = make_batch()
    assert BatchAugment(Config(), batch["x"])(batch) is batch


def test_mixup_mixes_inputs_and_targets_with_one_lambda_and_one_pairing():
    cfg = cfg_with(augment__mixup_alpha=0.4, train__seed=3)
    batch = make_batch()
    out = BatchAugment(cfg, batch["x"])(batch)
    lam = float(np.random.default_rng(3).beta(0.4, 0.4))  # the augmenter's own generators, seeded by train.seed
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(3))
    assert not torch.equal(perm, torch.arange(B))
    torch.testing.assert_close(out["x"], lam * batch["x"] + (1 - lam) * batch["x"][perm])
    torch.testing.assert_close(out["y"], lam * batch["y"] + (1 - lam) * batch["y"][perm])
    torch.testing.assert_close(out["y_n"], F.normalize(lam * batch["y_n"] + (1 - lam) * batch["y_n"][perm], dim=-1))
    assert torch.allclose(out["y_n"].norm(dim=-1), torch.ones(B))
    assert batch["x"] is not out["x"] and torch.equal(batch["x"], make_batch()["x"])  # the input batch is intact


def test_mixup_ids_group_exactly_the_rows_with_equal_mixed_targets():
    cfg = cfg_with(augment__mixup_alpha=1.0)
    batch = make_batch()
    batch["y_n"] = batch["y_n"][:1].expand(B, DI)  # one image for every row: all mixed targets are equal
    batch["y"] = batch["y"][:1].expand(B, DI)
    assert torch.equal(BatchAugment(cfg, batch["x"])(batch)["img"], torch.zeros(B, dtype=torch.long))
    for seed in range(5):
        out = BatchAugment(cfg_with(augment__mixup_alpha=1.0, train__seed=seed), batch["x"])(make_batch(seed))
        same_id = out["img"][:, None] == out["img"][None, :]
        same_target = (out["y_n"][:, None, :] == out["y_n"][None, :, :]).all(-1)
        assert torch.equal(same_id, same_target)


@pytest.mark.parametrize("loss", ["infonce", "multipos_infonce", "queue_infonce", "triplet", "cosine", "moment",
                                  "agreement", "mse"])
def test_every_translation_loss_accepts_a_mixed_batch(loss):
    cfg = cfg_with(augment__mixup_alpha=0.5, loss__queue_infonce__warmup_epochs=0, **{f"loss__{loss}__weight": 1.0})
    batch = BatchAugment(cfg, make_batch()["x"])(make_batch())
    raw = torch.randn(B, DI, requires_grad=True)
    state = LOSSES.get(loss)(getattr(cfg.loss, loss), DI)
    state.after_step({}, make_batch(1))  # the queue loss enqueues (real images), the others keep nothing
    terms = state({"pred": F.normalize(raw, dim=-1), "raw": raw}, batch, Temperature(cfg.temperature))
    total = sum(terms.values())
    total.backward()
    assert math.isfinite(float(total.detach()))
    # agreement pairs only rows with equal mixed targets, which a random pairing rarely makes: 0 is right there.
    assert loss == "agreement" or raw.grad.abs().sum() > 0


def test_noise_is_gaussian_in_units_of_the_per_dimension_train_std():
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([0.01, 0.1, 1.0, 10.0, 100.0])  # RoBERTa-like and e5-like scales side by side
    train_x = torch.randn(4000, DT, generator=g) * scale
    batch = {**make_batch(), "x": train_x}
    out = BatchAugment(cfg_with(augment__noise_std=0.3), train_x)(batch)
    rel = (out["x"] - train_x) / train_x.std(dim=0)
    torch.testing.assert_close(rel.std(dim=0), torch.full((DT,), 0.3), atol=0.02, rtol=0)
    assert rel.mean(dim=0).abs().max() < 0.03
    assert out["y_n"] is batch["y_n"] and out["img"] is batch["img"]  # targets untouched


def test_mixup_needs_the_translate_task():
    with pytest.raises(ConfigError, match="augment.mixup_alpha"):
        validate(cfg_with(augment__mixup_alpha=0.2, data__task="multilabel", loss__multilabel_triplet__weight=1.0))


# ---------------------------------------------------------------------------------------------- label smoothing

def _logits_case():
    batch = make_batch()
    pred = F.normalize(torch.randn(B, DI, generator=torch.Generator().manual_seed(5)), dim=-1)
    return {"pred": pred, "raw": pred}, batch


def test_multipos_label_smoothing_matches_the_smoothed_targets():
    out, batch = _logits_case()
    eps, tau = 0.2, 0.05
    cfg = cfg_with(loss__multipos_infonce__weight=1.0, loss__multipos_infonce__label_smoothing=eps,
                   temperature__tau=tau)
    state = Temperature(cfg.temperature)
    loss = LOSSES.get("multipos_infonce")
    got = float(loss(cfg.loss.multipos_infonce, DI)(out, batch, state)["multipos_infonce"])
    logits = out["pred"] @ batch["y_n"][::2].T / tau  # [B, U]: images are rows 0, 2, 4, ...
    onehot = F.one_hot(batch["img"], B // 2).float()
    c2i = -((1 - eps) * onehot + eps / (B // 2)) * logits.log_softmax(-1)
    pos = onehot.T / onehot.T.sum(-1, keepdim=True)  # [U, B]
    i2c = -((1 - eps) * pos + eps / B) * logits.T.log_softmax(-1)
    assert math.isclose(got, 0.5 * float(c2i.sum(-1).mean() + i2c.sum(-1).mean()), rel_tol=1e-5)
    plain = loss(Config().loss.multipos_infonce, DI)(out, batch, state)["multipos_infonce"]
    assert not math.isclose(got, float(plain), rel_tol=1e-3)


def test_queue_label_smoothing_changes_the_loss_and_zero_is_the_default():
    out, batch = _logits_case()
    cfg = cfg_with(loss__queue_infonce__weight=1.0, loss__queue_infonce__warmup_epochs=0)
    smooth_cfg = with_values(cfg, {"loss.queue_infonce.label_smoothing": 0.1})
    queued, tau = make_batch(1)["y_n"], Temperature(cfg.temperature)
    state, smoothed = (LOSSES.get("queue_infonce")(c.loss.queue_infonce, DI) for c in (cfg, smooth_cfg))
    state.enqueue(queued)
    smoothed.enqueue(queued)
    plain = state(out, batch, tau)["queue_infonce"]
    smooth = smoothed(out, batch, tau)["queue_infonce"]
    assert cfg.loss.queue_infonce.label_smoothing == 0.0 and float(smooth) != float(plain)


# ---------------------------------------------------------------------------------------------- weight averaging

class BNNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = nn.Linear(3, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


def _step(net: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A fake optimiser step (random in-place update) plus a train-mode forward (moves the BN statistics)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g))
        net(torch.randn(8, 3, generator=g) * 2 + 1)
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_ema_equals_the_hand_computed_average_including_batchnorm_buffers():
    torch.manual_seed(0)
    net, decay = BNNet(), 0.3  # below the warm-up's (1 + n) / (10 + n) from the 3rd update on
    ema = build_average(cfg_with(train__average="ema", train__ema_decay=decay), net)
    assert isinstance(ema, EMA)
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    for n in range(4):
        live = _step(net, n)
        ema.after_step()
        d = min(decay, (1 + n) / (10 + n))
        for k, v in live.items():
            expected[k] = d * expected[k] + (1 - d) * v if v.is_floating_point() else v
    got = ema.model(net).state_dict()
    for k, v in expected.items():
        torch.testing.assert_close(got[k], v, msg=k)
    assert int(got["bn.num_batches_tracked"]) == 4
    assert not torch.equal(got["lin.weight"], net.lin.weight) and not got["lin.weight"].requires_grad


def test_ema_warm_up_then_the_configured_decay():
    ema = build_average(cfg_with(train__average="ema", train__ema_decay=0.99), BNNet())
    decays = []
    for _ in range(1000):  # the warm-up reaches 0.99 after 890 updates
        decays.append(ema.decay())
        ema.after_step()
    assert decays[0] == pytest.approx(0.1) and decays[-1] == 0.99 and decays == sorted(decays)


def test_swa_is_the_uniform_mean_of_the_epochs_from_its_start():
    net = BNNet()
    swa = build_average(cfg_with(train__average="swa", train__swa_start=0.5, train__epochs=4), net)
    assert isinstance(swa, SWA)
    states = []
    for epoch in range(4):
        states.append(_step(net, epoch))
        swa.after_epoch(epoch)
        if epoch < 2:
            assert swa.model(net) is net  # before the start epoch the live model is validated
    got = swa.model(net).state_dict()
    torch.testing.assert_close(got["lin.weight"], (states[2]["lin.weight"] + states[3]["lin.weight"]) / 2)
    torch.testing.assert_close(got["bn.running_var"], (states[2]["bn.running_var"] + states[3]["bn.running_var"]) / 2)


def test_unknown_average_names_the_registered_ones():
    with pytest.raises(ConfigError, match="ema"):
        validate(cfg_with(train__average="emma"))


# ---------------------------------------------------------------------------------------------- in the loop

def test_ema_with_decay_zero_trains_exactly_like_no_averaging(data):
    base = with_values(Config(), {**SMALL, "model.norm": "batchnorm"})
    plain = train(base, data)
    ema0 = train(with_values(base, {"train.average": "ema", "train.ema_decay": 0.0}), data)
    assert plain.history == ema0.history


def test_checkpoint_and_validation_use_the_averaged_weights(data, tmp_path):
    """The saved best.pt is the averaged model (not the live one) and reproduces the val MRR that selected it."""
    cfg = with_values(Config(), {**SMALL, "model.norm": "batchnorm", "train.average": "ema", "train.ema_decay": 0.9})
    live = train(with_values(cfg, {"train.average": "none"}), data)
    result = train(cfg, data, out_dir=tmp_path)
    model, _, meta = load_model(tmp_path / "best.pt")
    saved = model.state_dict()
    for k, v in result.model.state_dict().items():
        torch.testing.assert_close(saved[k], v.cpu(), msg=k)
    key = "inner.net.blocks.0.1.running_var"  # a BatchNorm buffer: averaged too
    assert not torch.allclose(saved[key], live.model.state_dict()[key])
    task = TASKS.get("translate")(cfg, data, torch.device("cpu"))
    assert task.evaluate(model)["val/mrr"] == meta["metrics"]["val/mrr"] == result.best_metrics["val/mrr"]
    assert result.best_metrics["val/mrr"] != live.history[result.best_epoch]["val/mrr"]


@pytest.mark.parametrize("values", [{"augment.mixup_alpha": 0.4}, {"augment.noise_std": 0.2},
                                    {"train.average": "swa", "train.swa_start": 0.3, "train.epochs": 3}])
def test_each_regulariser_changes_training_and_stays_deterministic(data, values):
    cfg = with_values(Config(), {**SMALL, "loss.queue_infonce.weight": 0.5, "loss.queue_infonce.warmup_epochs": 0})
    plain = train(with_values(cfg, {"train.epochs": values.get("train.epochs", 2)}), data)
    on = train(with_values(cfg, values), data)
    assert on.history != plain.history
    assert train(with_values(cfg, values), data).history == on.history
    assert all(math.isfinite(v) for v in on.history[-1].values())
    x = torch.as_tensor(data.text[:4])
    assert predict(on.model, x).shape == (4, data.image.shape[1])
