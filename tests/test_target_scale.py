"""loss.targets: every translation loss reads its image targets at one scale, unit (L2-normalised, the default) or raw
(as the data gives them, the VSE++ + slots notebook's scale); validation refuses what it cannot mean."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.losses import LOSSES, Criterion, Temperature
from latentsweep.trainers.config.validate import validate

D, K = 6, 3
IMG = torch.tensor([0, 1, 2, 3, 4, 5])  # one caption per image: no same-image pairs, as the notebook's batches
TRANSLATE = [n for n in LOSSES.names() if LOSSES.get(n).task == "translate"]
# Losses whose value does not depend on the targets' norms: cosine is scale-free, condensation's argmax over slots
# is too, agreement and slot_diversity never read the targets.
SCALE_FREE = {"cosine", "condensation", "agreement", "slot_diversity"}


def _out_batch(scale: float, seed: int = 0) -> tuple[dict, dict]:
    """A model output with slots and a batch whose raw image targets have norm `scale` (y_n their unit versions)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(len(IMG), D, generator=g)
    slots = F.normalize(torch.randn(len(IMG), K, D, generator=g), dim=-1)
    y_n = F.normalize(torch.randn(len(IMG), D, generator=g), dim=-1)
    out = {"pred": F.normalize(raw, dim=-1), "raw": raw, "slots": slots}
    batch = {"x": torch.zeros(len(IMG), 2), "y": scale * y_n, "y_n": y_n, "img": IMG, "image_idx": IMG,
             "bank": scale * y_n, "bank_idx": IMG}
    return out, batch


def _terms(name: str, targets: str, out: dict, batch: dict) -> dict:
    cfg = with_values(Config(), {"slots.k": K, "loss.queue_infonce.warmup_epochs": 0})
    batch = dict(batch, bank=batch["y_n"] if targets == "unit" else batch["bank"])
    loss = LOSSES.get(name)(getattr(cfg.loss, name), D, targets)
    return loss(out, batch, Temperature(cfg.temperature))


@pytest.mark.parametrize("name", TRANSLATE)
def test_raw_targets_of_norm_one_are_the_unit_targets(name):
    out, batch = _out_batch(scale=1.0)
    out = dict(out, raw=out["pred"])  # a unit raw output too: moment and mse read it under raw targets
    unit, raw = _terms(name, "unit", out, batch), _terms(name, "raw", out, batch)
    assert unit.keys() == raw.keys()
    for key in unit:
        assert torch.allclose(unit[key], raw[key], atol=1e-5), key


@pytest.mark.parametrize("name", TRANSLATE)
def test_raw_targets_change_exactly_the_scale_dependent_losses(name):
    out, batch = _out_batch(scale=16.0)  # about the demo data's image norm
    unit, raw = _terms(name, "unit", out, batch), _terms(name, "raw", out, batch)
    same = all(torch.allclose(unit[k], raw[k], atol=1e-5) for k in unit)
    assert same == (name in SCALE_FREE), (name, unit, raw)


def test_raw_triplet_is_the_notebooks_hinge_on_unit_pred_and_raw_targets():
    # The VSE++ + slots notebook: S = Z @ Y.T with Z unit and Y the raw image embeddings, the diagonal excluded,
    # hardest negative per caption, relu(margin + neg - pos) averaged over the batch.
    out, batch = _out_batch(scale=16.0, seed=3)
    s = out["pred"] @ batch["y"].T
    neg = s.masked_fill(torch.eye(len(IMG), dtype=torch.bool), -torch.inf).max(dim=1).values
    expected = (0.2 + neg - s.diagonal()).clamp(min=0).mean()
    cfg = with_values(Config(), {"loss.triplet.direction": "c2i", "loss.triplet.margin": 0.2})
    got = LOSSES.get("triplet")(cfg.loss.triplet, D, "raw")(out, batch, None)["triplet_c2i"]
    assert torch.allclose(got, expected, atol=1e-5)


def test_raw_slot_infonce_is_cross_entropy_over_raw_logits():
    out, batch = _out_batch(scale=16.0, seed=4)
    tau = 0.09
    logits = torch.einsum("bkd,nd->bkn", out["slots"], batch["y"]) / tau  # [B, K, B]
    target = torch.arange(len(IMG))
    expected = torch.stack([F.cross_entropy(logits[:, k], target) for k in range(K)]).mean()
    cfg = with_values(Config(), {"loss.slot_infonce.tau": tau})
    got = LOSSES.get("slot_infonce")(cfg.loss.slot_infonce, D, "raw")(out, batch, None)["slot_infonce"]
    assert torch.allclose(got, expected, atol=1e-4)


def test_mse_regresses_the_raw_output_onto_the_target_at_its_scale():
    out, batch = _out_batch(scale=16.0, seed=5)
    cfg = Config().loss.mse
    raw = LOSSES.get("mse")(cfg, D, "raw")(out, batch, None)["mse"]
    unit = LOSSES.get("mse")(cfg, D, "unit")(out, batch, None)["mse"]
    assert torch.allclose(raw, F.mse_loss(out["raw"], batch["y"]))
    assert torch.allclose(unit, F.mse_loss(out["raw"], batch["y_n"]))


def test_the_queue_keeps_raw_targets_and_masks_own_image_copies_by_cosine():
    out, batch = _out_batch(scale=16.0, seed=6)
    cfg = with_values(Config(), {"loss.queue_infonce.warmup_epochs": 0, "loss.queue_infonce.size": 12})
    loss = LOSSES.get("queue_infonce")(cfg.loss.queue_infonce, D, "raw")
    loss.after_step(out, {k: v for k, v in batch.items() if k != "image_idx"})
    assert torch.allclose(loss.queue_negatives(), batch["y"])  # enqueued at the raw scale
    no_idx = {k: v for k, v in batch.items() if k != "image_idx"}  # the val-loss path: masking by cosine
    keep = loss._not_own_image(no_idx, batch["y"], loss.queue_negatives())
    assert torch.equal(keep, ~torch.eye(len(IMG), dtype=torch.bool))


def test_criterion_passes_the_scale_to_every_loss():
    cfg = with_values(Config(), {"loss.targets": "raw", "loss.triplet.weight": 1.0, "loss.mse.weight": 1.0})
    crit = Criterion(cfg, D)
    assert all(loss.raw_targets for loss in crit.losses.values())
    assert not any(loss.raw_targets for loss in Criterion(Config(), D).losses.values())


def test_default_is_unit_and_a_bad_value_names_the_closest():
    assert Config().loss.targets == "unit"
    with pytest.raises(ConfigError, match="did you mean 'raw'"):
        with_values(Config(), {"loss.targets": "rawz"})
    with pytest.raises(ConfigError, match="loss.targets"):
        with_values(Config(), {"loss.target": "raw"})


def test_raw_targets_need_the_translate_task():
    cfg = with_values(Config(), {"loss.targets": "raw", "data.task": "multilabel", "loss.triplet.weight": 0.0,
                                 "loss.multilabel_triplet.weight": 1.0, "model.kind": "linear"})
    with pytest.raises(ConfigError, match="loss.targets = 'raw'.*multilabel"):
        validate(cfg)
    validate(with_values(cfg, {"loss.targets": "unit"}))
