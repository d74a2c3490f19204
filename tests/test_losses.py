"""Tests for latentsweep.trainers.losses (every registered loss), the Temperature, the queue loss's buffers, the
Criterion and the
multi-label triplet."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from latentsweep.trainers.train.checkpoint import CenteredModel, atomic_torch_save, checkpoint_payload, load_model
from latentsweep.trainers.config.tree import Config, LossCfg, with_values
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.losses import LOSSES, Criterion, EpochContext, Temperature
from latentsweep.trainers.losses.bank import BankCE
from latentsweep.trainers.losses.base import masked_ce
from latentsweep.trainers.losses.multilabel import MultiLabelTriplet, draw_fixed_positives, negative_mask, positive_mask
from latentsweep.trainers.losses.queue import QueueInfoNCE
from latentsweep.trainers.models.zoo import ModelContext, build_model
from latentsweep.trainers.config.validate import validate_losses as validate

DIN, D, K, L = 8, 6, 3, 4
IMG = torch.tensor([0, 0, 1, 2, 2, 3])  # two images with two captions each
LABELS = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [1, 1, 1, 0], [0, 0, 0, 1]]).bool()


class Tiny(nn.Module):
    """Shared trunk with a main head (pred/raw) and a slot head, like build_model's output."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(DIN, 16)
        self.head = nn.Linear(16, D)
        self.slot = nn.Linear(16, K * D)

    def forward(self, x):
        h = torch.tanh(self.trunk(x))
        raw = self.head(h)
        slots = F.normalize(self.slot(h).view(x.shape[0], K, D), dim=-1)
        return {"pred": F.normalize(raw, dim=-1), "raw": raw, "slots": slots}


def make_cfg(values: dict | None = None) -> Config:
    base = {"slots.k": K, "loss.queue_infonce.size": 8, "loss.queue_infonce.warmup_epochs": 0,
            "loss.queue_infonce.weight": 1.0}
    return with_values(Config(), {**base, **(values or {})})


def make_batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(4, D, generator=g)
    y = images[IMG]
    return {"x": torch.randn(len(IMG), DIN, generator=g), "y": y, "y_n": F.normalize(y, dim=-1), "img": IMG,
            "labels": LABELS, "neg_x": torch.randn(len(IMG), DIN, generator=g),
            "bank": F.normalize(images, dim=-1), "bank_idx": IMG}


def make_loss(name: str, cfg: Config, dim: int = D):
    """Loss `name` built from cfg as the criterion builds it, in the state of a run at epoch 3: the queue loss has 10
    rows queued, the multi-label triplet (global_hard) a bank of 12 items."""
    loss = LOSSES.get(name)(getattr(cfg.loss, name), dim)
    queued = F.normalize(torch.randn(10, D), dim=-1)
    bank, bank_labels = torch.randn(12, D), torch.rand(12, L) > 0.6
    loss.after_step({}, {"y_n": queued})
    loss.on_epoch_start(3, EpochContext(embed_train=lambda: bank, train_labels=bank_labels))
    return loss


def call(name: str, out: dict, batch: dict, cfg_term, temperature=None) -> dict:
    """Loss `name` built from its config section `cfg_term`, run once on (out, batch)."""
    return LOSSES.get(name)(cfg_term, D)(out, batch, temperature)


def queue_loss(cfg: Config, dim: int = 3) -> QueueInfoNCE:
    return QueueInfoNCE(cfg.loss.queue_infonce, dim)


def unit(x):
    return F.normalize(torch.as_tensor(x, dtype=torch.float32), dim=-1)


# ---------------------------------------------------------------------------------------------- every loss

def test_registry_names_match_config_fields():
    # every section of LossCfg is a loss; its one leaf (targets) is the target scale they all read
    sections = [f.name for f in dataclasses.fields(LossCfg) if f.name != "targets"]
    assert LOSSES.names() == sorted(sections)


@pytest.mark.parametrize("name", LOSSES.names())
def test_loss_terms_finite_and_give_gradients(name):
    torch.manual_seed(0)
    cfg = make_cfg({"loss.triplet.margin": 1.5, "loss.slot_triplet.margin": 1.5, "loss.slot_diversity.delta": -1.0,
                    "loss.multilabel_triplet.margin": 1.5, "temperature.mode": "learnable"})
    model, batch, loss = Tiny(), make_batch(), make_loss(name, cfg)
    out = model(batch["x"])
    out["neg_pred"] = model(batch["neg_x"])["pred"]
    terms = loss(out, batch, Temperature(cfg.temperature))
    assert terms, f"{name} returned no terms"
    for key, value in terms.items():
        assert key.startswith(name) and value.dim() == 0 and torch.isfinite(value), (key, value)
    sum(terms.values()).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(float(g.abs().sum()) for g in grads) > 0


@pytest.mark.parametrize("negatives", ["batch_hard", "global_hard", "step_hard", "random"])
def test_multilabel_negative_modes_give_gradients(negatives):
    cfg = make_cfg({"loss.multilabel_triplet.negatives": negatives, "loss.multilabel_triplet.margin": 1.5})
    model, batch, state = Tiny(), make_batch(), make_loss("multilabel_triplet", cfg)
    out = model(batch["x"])
    out["neg_pred"] = model(batch["neg_x"])["pred"]
    loss = state(out, batch)["multilabel_triplet"]
    loss.backward()
    assert float(loss.detach()) > 0 and float(model.trunk.weight.grad.abs().sum()) > 0


def test_criterion_weights_and_logs_terms():
    cfg = make_cfg({"loss.cosine.weight": 2.0, "loss.triplet.weight": 0.5, "loss.queue_infonce.weight": 0.0})
    model, batch = Tiny(), make_batch()
    out, criterion = model(batch["x"]), Criterion(cfg, D)
    total, logged = criterion(out, batch)
    assert set(logged) == {"cosine", "triplet_c2i", "triplet_i2c"}
    expected = 2.0 * logged["cosine"] + 0.5 * (logged["triplet_c2i"] + logged["triplet_i2c"])
    assert torch.allclose(total, expected) and total.requires_grad
    assert not any(v.requires_grad for v in logged.values())


def test_losses_are_float32_under_autocast():
    cfg = make_cfg()
    model, batch = Tiny(), make_batch()
    out, state = model(batch["x"]), Temperature(cfg.temperature)
    plain = call("infonce", out, batch, cfg.loss.infonce, state)["infonce"]
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        cast = call("infonce", out, batch, cfg.loss.infonce, state)["infonce"]
    assert cast.dtype == torch.float32 and torch.allclose(plain, cast, atol=1e-6)


# ---------------------------------------------------------------------------------------------- triplet family

def test_triplet_zero_only_when_positives_beat_negatives_by_margin():
    y = torch.eye(4)
    batch = {"y_n": y, "img": torch.arange(4)}
    out = {"pred": y.clone()}  # positive cos 1, negative cos 0: a gap of exactly 1
    for hardest in (True, False):
        for margin, positive in ((0.5, False), (1.5, True)):
            cfg = make_cfg({"loss.triplet.margin": margin, "loss.triplet.max_violation": hardest}).loss.triplet
            terms = call("triplet", out, batch, cfg)
            assert (float(sum(terms.values())) > 0) == positive, (hardest, margin)


def test_triplet_masks_same_image_captions():
    y = unit([[1.0, 0.0], [1.0, 0.0]])
    cfg = make_cfg({"loss.triplet.margin": 1.0}).loss.triplet
    same = call("triplet", {"pred": y}, {"y_n": y, "img": torch.tensor([0, 0])}, cfg)
    distinct = call("triplet", {"pred": y}, {"y_n": y, "img": torch.tensor([0, 1])}, cfg)
    assert float(sum(same.values())) == 0.0 and float(sum(distinct.values())) > 0


def test_triplet_direction_keeps_the_named_hinges():
    torch.manual_seed(0)
    pred, y = unit(torch.randn(5, 4)), unit(torch.randn(5, 4))
    batch, out = {"y_n": y, "img": torch.arange(5)}, {"pred": pred}
    both = call("triplet", out, batch, make_cfg({"loss.triplet.margin": 1.0}).loss.triplet)
    assert set(both) == {"triplet_c2i", "triplet_i2c"} and float(both["triplet_c2i"]) != float(both["triplet_i2c"])
    for direction in ("c2i", "i2c"):
        cfg = make_cfg({"loss.triplet.margin": 1.0, "loss.triplet.direction": direction}).loss.triplet
        terms = call("triplet", out, batch, cfg)
        assert set(terms) == {f"triplet_{direction}"}
        assert torch.equal(terms[f"triplet_{direction}"], both[f"triplet_{direction}"])
    # c2i: caption i's hinge against image j is max(0, m + cos(p_i, y_j) - cos(p_i, y_i)), hardest j, batch mean.
    sim = pred @ y.T
    hinge = (1.0 + sim - sim.diagonal()[:, None]).clamp(min=0).masked_fill(torch.eye(5, dtype=torch.bool), 0)
    assert math.isclose(float(both["triplet_c2i"]), float(hinge.max(dim=1).values.mean()), rel_tol=1e-5)


def test_slot_triplet_uses_best_slot_and_needs_slots():
    y = torch.eye(3)
    junk = unit([[-1.0, -1.0, -1.0]]).expand(3, 3)
    slots = torch.stack([junk, y], dim=1)  # slot 0 junk, slot 1 exactly the image
    cfg = make_cfg({"loss.slot_triplet.margin": 0.5}).loss.slot_triplet
    batch = {"y_n": y, "img": torch.arange(3)}
    terms = call("slot_triplet", {"pred": y, "slots": slots}, batch, cfg)
    assert float(sum(terms.values())) == 0.0
    assert call("slot_triplet", {"pred": y}, batch, cfg) == {}


def test_condensation_pulls_pred_toward_the_slot_that_best_matches_the_image():
    y = torch.eye(3)[:2]  # two images, e0 and e1
    pred = unit([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]]).requires_grad_()
    # slot 0 equals pred (the closest to pred), slot 1 is the image plus a little of e2 (the closest to the image):
    # the seed picks s* by the image, so s* = slot 1.
    near_image = unit(y + 0.2 * torch.tensor([0.0, 0.0, 1.0]))
    slots = torch.stack([pred.detach(), near_image], dim=1).requires_grad_()  # [2, 2, 3]
    batch = {"y_n": y, "img": torch.arange(2)}
    cond = call("condensation", {"pred": pred, "slots": slots}, batch, make_cfg().loss.condensation)["condensation"]
    expected = (1.0 - (pred.detach() * near_image).sum(dim=-1)).mean()
    assert math.isclose(float(cond.detach()), float(expected), rel_tol=1e-5)
    cond.backward()
    assert pred.grad is not None and float(pred.grad.abs().sum()) > 0  # the gradient goes into pred
    assert float(slots.grad[:, 1].abs().sum()) > 0  # and, as in the seed (nothing detached), into s*
    assert float(slots.grad[:, 0].abs().sum()) == 0  # but not into the other slots
    stepped = unit(pred.detach() - 0.1 * pred.grad)  # a descent step on pred moves it toward s*
    assert bool(((stepped * near_image).sum(-1) > (pred.detach() * near_image).sum(-1)).all())


def test_slot_diversity_definition():
    pred = unit(torch.randn(4, D))
    slots = pred[:, None, :].expand(4, K, D)
    div = make_cfg({"loss.slot_diversity.delta": 0.5}).loss.slot_diversity
    # identical slots: every pair has cos 1 -> relu(1 - 0.5) = 0.5; orthogonal slots: 0.
    same = call("slot_diversity", {"pred": pred, "slots": slots}, {}, div)["slot_diversity"]
    assert math.isclose(float(same.detach()), 0.5, rel_tol=1e-5)
    ortho = torch.eye(D)[:K].expand(4, K, D)
    assert float(call("slot_diversity", {"pred": pred, "slots": ortho}, {}, div)["slot_diversity"]) == 0


# ---------------------------------------------------------------------------------------------- InfoNCE family

def _three_captions():
    """Captions 0 and 1 describe image A, caption 2 image B; each prediction sits exactly on its image."""
    y = torch.eye(3)[[0, 0, 1]]
    return {"pred": y.clone()}, {"y_n": y}


def test_multipos_infonce_counts_same_image_captions_as_positives():
    cfg = make_cfg({"temperature.tau": 0.5})
    state = Temperature(cfg.temperature)
    out, batch = _three_captions()
    loss = LOSSES.get("multipos_infonce")(cfg.loss.multipos_infonce, 3)
    same = loss(out, {**batch, "img": torch.tensor([0, 0, 1])}, state)
    split = loss(out, {**batch, "img": torch.tensor([0, 1, 2])}, state)
    assert float(same["multipos_infonce"]) < float(split["multipos_infonce"])
    # Hand computation with logits 1/tau = 2 for matches, 0 otherwise.
    e = math.exp(2.0)
    c2i = (2 * -math.log(e / (e + 1)) + -math.log(e / (e + 1))) / 3  # 3 captions over 2 distinct images
    i2c_a = -math.log(e / (2 * e + 1))  # image A: both captions are positives, averaged
    i2c_b = -math.log(e / (e + 2))
    expected = 0.5 * (c2i + 0.5 * (i2c_a + i2c_b))
    assert math.isclose(float(same["multipos_infonce"]), expected, rel_tol=1e-5)


def test_multipos_equals_symmetric_infonce_when_images_are_distinct():
    cfg = make_cfg()
    state = Temperature(cfg.temperature)
    batch = {"y_n": unit(torch.randn(5, D)), "img": torch.arange(5)}
    out = {"pred": unit(torch.randn(5, D))}
    a = call("multipos_infonce", out, batch, cfg.loss.multipos_infonce, state)["multipos_infonce"]
    b = call("infonce", out, batch, cfg.loss.infonce, state)["infonce"]
    assert torch.allclose(a, b, atol=1e-6)


def test_infonce_masks_false_negatives_and_smoothing():
    cfg = make_cfg({"temperature.tau": 0.5})
    state = Temperature(cfg.temperature)
    out, batch = _three_captions()
    masked = call("infonce", out, {**batch, "img": torch.tensor([0, 0, 1])}, cfg.loss.infonce, state)["infonce"]
    unmasked = call("infonce", out, {**batch, "img": torch.tensor([0, 1, 2])}, cfg.loss.infonce, state)["infonce"]
    e = math.exp(2.0)
    # Rows of captions 0, 1 keep their target (logit 2) and image B (logit 0); caption 2's row keeps both copies of
    # image A (a different image) and its target. By symmetry both directions give the same value.
    a, b = -math.log(e / (e + 1)), -math.log(e / (e + 2))
    assert math.isclose(float(masked), (2 * a + b) / 3, rel_tol=1e-5)
    assert float(unmasked) > float(masked)
    smooth = make_cfg({"loss.infonce.label_smoothing": 0.2}).loss.infonce
    smoothed = call("infonce", out, {**batch, "img": torch.tensor([0, 0, 1])}, smooth, state)["infonce"]
    # smoothing mass goes only to the kept columns: 0.8 nll + 0.2 * mean(-logp over kept columns)
    row_a = 0.8 * a + 0.2 * 0.5 * (a - math.log(1 / (e + 1)))
    row_b = 0.8 * b + 0.2 * (b - 2 * math.log(1 / (e + 2))) / 3
    assert math.isclose(float(smoothed), (2 * row_a + row_b) / 3, rel_tol=1e-5)


def test_queue_infonce_degrades_to_in_batch_during_warmup():
    cfg = make_cfg({"loss.queue_infonce.warmup_epochs": 2, "loss.infonce.symmetric": False})
    state, tau = make_loss("queue_infonce", cfg), Temperature(cfg.temperature)
    state.epoch = 1
    model, batch = Tiny(), make_batch()
    out = model(batch["x"])
    q = state(out, batch, tau)["queue_infonce"]
    b = call("infonce", out, batch, cfg.loss.infonce, tau)["infonce"]
    assert torch.allclose(q, b)
    state.epoch = 2
    later = state(out, batch, tau)["queue_infonce"]
    assert not torch.allclose(later, b)


def test_queue_infonce_masks_queued_copies_of_the_own_image():
    cfg = make_cfg({"temperature.tau": 1.0})
    state, tau = queue_loss(cfg), Temperature(cfg.temperature)
    y = unit([[1.0, 0.0, 0.0]]).expand(2, 3)
    batch, out = {"y_n": y, "img": torch.tensor([4, 4])}, {"pred": y.clone()}
    state.enqueue(y[:1])  # a copy of the batch's own image
    assert float(state(out, batch, tau)["queue_infonce"]) < 1e-6
    state.enqueue(unit([[0.0, 1.0, 0.0]]))  # a genuine negative
    assert float(state(out, batch, tau)["queue_infonce"]) > 1e-6


def test_queue_masks_own_image_copies_by_index_as_by_cosine():
    """Training batches carry each caption's image (image_idx): the queue masks its copies by index, with the same
    loss as the cosine rule (the val loss's path) and without the second [B, Q] product."""
    torch.manual_seed(0)
    images = unit(torch.randn(6, D))
    cfg = make_cfg({"temperature.tau": 0.1, "loss.queue_infonce.size": 10})
    by_index, by_cos, tau = QueueInfoNCE(cfg.loss.queue_infonce, D), QueueInfoNCE(cfg.loss.queue_infonce, D), \
        Temperature(cfg.temperature)
    for ids in (torch.tensor([0, 1, 2, 3]), torch.tensor([4, 5, 0, 1]), torch.tensor([2, 2, 3, 5])):
        by_index.after_step({}, {"y_n": images[ids], "image_idx": ids})
        by_cos.after_step({}, {"y_n": images[ids]})
    img = torch.tensor([0, 2, 2, 5])
    out = {"pred": unit(torch.randn(4, D))}
    batch = {"y_n": images[img], "img": img}
    with_index = by_index(out, batch | {"image_idx": img}, tau)["queue_infonce"]
    assert torch.allclose(with_index, by_cos(out, batch, tau)["queue_infonce"], atol=1e-6)
    assert by_index.queue_img.tolist()[:2] == [3, 5] and int(by_index.queue_count) == 10  # wrapped around


def test_queue_only_negatives_drop_the_in_batch_images():
    cfg = make_cfg({"temperature.tau": 1.0, "loss.queue_infonce.in_batch": False})
    state, tau = queue_loss(cfg), Temperature(cfg.temperature)
    e = torch.eye(3)
    pred, y = e[:2].clone(), e[:2].clone()  # two captions of two distinct images
    batch, out = {"y_n": y, "img": torch.tensor([0, 1])}, {"pred": pred}
    # empty queue: the only column is the own image, log softmax of one logit = 0 (MoCo before anything is queued)
    assert float(state(out, batch, tau)["queue_infonce"]) == 0.0
    state.enqueue(e[2:])  # one queue negative, orthogonal to both predictions
    loss = float(state(out, batch, tau)["queue_infonce"])
    assert math.isclose(loss, math.log(1 + math.exp(-1.0)), rel_tol=1e-5)  # [pos 1, queue 0]: no in-batch column
    with_batch = queue_loss(make_cfg({"temperature.tau": 1.0}))
    with_batch.enqueue(e[2:])
    both = float(with_batch(out, batch, tau)["queue_infonce"])
    assert math.isclose(both, math.log(1 + 2 * math.exp(-1.0)), rel_tol=1e-5)  # the other image is a negative too


def test_all_images_infonce_equals_the_queue_holding_each_image_once():
    """The exact all-images loss is the limit of the queue: with every training image queued once and queue-only
    negatives (the own image's queued copy masked as a copy), both are the softmax over all images."""
    torch.manual_seed(1)
    images = unit(torch.randn(7, D))  # 7 distinct training images
    img = torch.tensor([0, 0, 3, 5, 6, 6])
    pred = unit(torch.randn(len(img), D))
    batch, out = {"y_n": images[img], "img": img, "bank": images, "bank_idx": img}, {"pred": pred}
    for smoothing in (0.0, 0.1):
        cfg = make_cfg({"temperature.tau": 0.07, "loss.queue_infonce.in_batch": False,
                        "loss.queue_infonce.size": len(images), "loss.queue_infonce.label_smoothing": smoothing,
                        "loss.all_images_infonce.symmetric": False,
                        "loss.all_images_infonce.label_smoothing": smoothing})
        tau = Temperature(cfg.temperature)
        queue = QueueInfoNCE(cfg.loss.queue_infonce, D)
        queue.enqueue(images)
        exact = call("all_images_infonce", out, batch, cfg.loss.all_images_infonce, tau)["all_images_infonce"]
        assert torch.allclose(exact, queue(out, batch, tau)["queue_infonce"], atol=1e-6)
        if smoothing == 0.0:  # and it is the plain cross-entropy over the 7 images, target = the caption's image
            assert torch.allclose(exact, F.cross_entropy(pred @ images.T / 0.07, img), atol=1e-6)


def _masked_ce_form(p, y, bank, idx, tau, smoothing):
    """The all-images loss as it was written before BankCE: masked_ce over cat([p @ y.T, p @ bank.T]) / tau."""
    rows = torch.arange(len(p))
    keep_bank = torch.ones(len(p), len(bank), dtype=torch.bool)
    keep_bank[rows, idx] = False
    keep = torch.cat([torch.eye(len(p), dtype=torch.bool), keep_bank], dim=1)
    return masked_ce(torch.cat([p @ y.T, p @ bank.T], dim=1) / tau, keep, rows, smoothing)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("learnable", [False, True])
@pytest.mark.parametrize("mixed", [False, True])
def test_bank_ce_gives_the_masked_ce_form_its_value_and_gradients(smoothing, learnable, mixed):
    """BankCE (one kept [B, Ni] block) against the masked_ce form it replaced: the loss and the gradients of the
    predictions, the targets and a learnable temperature, to float rounding; with a mixed target (mixup) too."""
    torch.manual_seed(3)
    bank = unit(torch.randn(53, D))
    idx = torch.randint(0, len(bank), (17,))
    y = (unit(bank[idx] + 0.3 * torch.randn(len(idx), D)) if mixed else bank[idx].clone()).requires_grad_(True)
    raw = torch.randn(len(idx), D, requires_grad=True)
    tau = torch.tensor(0.07, requires_grad=learnable)
    wrt = [raw, y] + ([tau] if learnable else [])
    fused = BankCE.apply(unit(raw), y, bank, idx, tau, smoothing)
    plain = _masked_ce_form(unit(raw), y, bank, idx, tau, smoothing)
    assert torch.allclose(fused, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(fused, wrt), torch.autograd.grad(plain, wrt)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-7)


def test_bank_ce_keeps_one_batch_by_bank_block_for_the_backward():
    """What autograd keeps for the backward between the forward and it: one [B, Ni] block (the softmax), where the
    masked_ce form kept more than three (the product, its scaled and masked copies, the log-softmax)."""
    bank, idx = unit(torch.randn(300, D)), torch.randint(0, 300, (20,))
    raw, tau = torch.randn(20, D, requires_grad=True), torch.tensor(0.05, requires_grad=True)

    def kept_blocks(form) -> int:
        sizes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
            loss = form(unit(raw), bank[idx], bank, idx, tau, 0.0)
        loss.backward()
        return sum(n >= 20 * 300 for n in sizes)

    assert kept_blocks(BankCE.apply) == 1
    assert kept_blocks(_masked_ce_form) > 3


def test_all_images_infonce_symmetric_adds_the_multipositive_image_to_caption_term():
    cfg = make_cfg({"temperature.tau": 0.1})
    batch, tau = make_batch(), Temperature(cfg.temperature)
    out = Tiny()(batch["x"])
    one_way = call("all_images_infonce", out, batch, dataclasses.replace(cfg.loss.all_images_infonce,
                                                                        symmetric=False), tau)["all_images_infonce"]
    both = call("all_images_infonce", out, batch, cfg.loss.all_images_infonce, tau)["all_images_infonce"]
    multipos = call("multipos_infonce", out, batch, cfg.loss.multipos_infonce, tau)["multipos_infonce"]
    c2i_batch = F.cross_entropy(out["pred"] @ unit(batch["bank"]).T / 0.1, IMG)  # this batch's bank = its 4 images
    i2c = 2 * multipos - c2i_batch  # multipos = (c2i over the batch's images + i2c) / 2
    assert torch.allclose(both, 0.5 * (one_way + i2c), atol=1e-5)


def test_queue_larger_than_the_training_images_is_capped_once(capsys):
    cfg = make_cfg({"loss.queue_infonce.size": 4099})
    ctx = EpochContext(embed_train=lambda: torch.zeros(0), n_targets=33)
    for _ in range(2):  # two trials of one study: the cap is said once
        loss = queue_loss(cfg)
        loss.on_epoch_start(0, ctx)
        assert loss.queue.shape[0] == 33
    assert capsys.readouterr().err.count("capped at 33") == 1
    small = queue_loss(make_cfg({"loss.queue_infonce.size": 8}))
    small.on_epoch_start(0, ctx)
    assert small.queue.shape[0] == 8


def test_moment_std_term_is_optional():
    pred, y = unit([[1.0, 0.0], [1.0, 0.0]]), unit([[1.0, 0.0], [0.0, 1.0]])
    batch = {"y_n": y}
    both = call("moment", {"pred": pred}, batch, make_cfg().loss.moment)
    means = call("moment", {"pred": pred}, batch, make_cfg({"loss.moment.std": False}).loss.moment)
    # batch means (1, 0) and (0.5, 0.5): 0.25 + 0.25; stds (0, 0) and (0.5, 0.5): 0.25 + 0.25
    assert set(means) == {"moment_mean"} and math.isclose(float(means["moment_mean"]), 0.5, rel_tol=1e-6)
    assert math.isclose(float(both["moment_std"]), 0.5, rel_tol=1e-6)


def test_agreement_is_the_mean_per_dimension_variance_of_an_images_captions():
    a = unit([[3.0, 4.0, 0.0], [3.0, 0.0, 4.0]])  # image 0: two captions
    b = unit([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # image 1: three captions
    lone = unit([[1.0, 1.0, 1.0]])  # image 2: one caption, no variance to count
    pred = torch.cat([a, b, lone])
    batch = {"img": torch.tensor([0, 0, 1, 1, 1, 2])}
    value = float(call("agreement", {"pred": pred}, batch, None)["agreement"])
    # by hand: image 0 varies in dims 1 and 2 by 0.8 (values 0.8/0 and 0/0.8): unbiased variance 0.32 each, 0 in
    # dim 0 -> mean 0.64/3; image 1: each dim holds (1, 0, 0): variance 1/3 -> mean 1/3. Averaged over the 2 images.
    assert math.isclose(value, (0.64 / 3 + 1 / 3) / 2, rel_tol=1e-5)
    torch_var = (a.var(dim=0).mean() + b.var(dim=0).mean()) / 2
    assert math.isclose(value, float(torch_var), rel_tol=1e-5)
    # the scale: D times smaller than the mean pairwise 1 - cos it replaces (the seed's definition)
    pairwise = float((1.0 - a[0] @ a[1] + (1.0 - b @ b.T).triu(1).sum() / 3) / 2)
    assert value < pairwise / 2
    single = {"img": torch.arange(6)}
    assert float(call("agreement", {"pred": pred}, single, None)["agreement"]) == 0.0


# ---------------------------------------------------------------------------------------------- queue buffers

def rows(start: int, stop: int) -> torch.Tensor:
    """Rows whose first coordinate is their index, to read the FIFO order back."""
    return torch.arange(start, stop, dtype=torch.float32)[:, None].repeat(1, 3)


def queue_ids(state: QueueInfoNCE) -> list[int]:
    return state.queue_negatives()[:, 0].long().tolist()


def test_queue_fifo_wraps_around():
    state = queue_loss(make_cfg())
    state.enqueue(rows(0, 5))
    assert queue_ids(state) == list(range(5)) and int(state.queue_count) == 5
    state.enqueue(rows(5, 10))
    state.enqueue(rows(10, 15))
    assert queue_ids(state) == list(range(7, 15)) and int(state.queue_count) == 8


def test_queue_batch_larger_than_queue_keeps_newest():
    state = queue_loss(make_cfg())
    state.enqueue(rows(0, 3))
    state.enqueue(rows(3, 14))
    assert queue_ids(state) == list(range(6, 14))
    state.enqueue(rows(14, 16))
    assert queue_ids(state) == list(range(8, 16))


def test_queue_is_a_non_persistent_buffer():
    # The queue is rebuilt in the first epoch; a 65,536 x 1536 queue would add 400 MB to every trial checkpoint.
    cfg = make_cfg()
    state = queue_loss(cfg)
    state.enqueue(rows(0, 11))
    state.enqueue(rows(11, 13))
    assert queue_ids(state) == list(range(5, 13)) and dict(state.state_dict()) == {}
    assert {name for name, _ in state.named_buffers()} == {"queue", "queue_ptr", "queue_count", "queue_img"}
    restored = queue_loss(cfg)
    restored.load_state_dict(state.state_dict())
    assert queue_ids(restored) == []
    restored.enqueue(rows(13, 14))
    assert queue_ids(restored) == [13]


def test_queue_warmup_returns_no_negatives():
    state = queue_loss(make_cfg({"loss.queue_infonce.warmup_epochs": 2}))
    state.enqueue(rows(0, 4))
    state.epoch = 1
    assert state.queue_negatives().shape == (0, 3)
    state.epoch = 2
    assert state.queue_negatives().shape == (4, 3)


def test_queue_slice_curriculum_grows_from_newest():
    cfg = make_cfg({"loss.queue_infonce.warmup_epochs": 1, "loss.queue_infonce.slice_start": 0.25,
                    "loss.queue_infonce.slice_epochs": 3})
    state = queue_loss(cfg)
    state.enqueue(rows(0, 8))
    sizes = {}
    for epoch in (1, 2, 3, 4, 9):
        state.epoch = epoch
        sizes[epoch] = len(queue_ids(state))
    assert sizes == {1: 2, 2: 4, 3: 6, 4: 8, 9: 8}
    state.epoch = 1
    assert queue_ids(state) == [6, 7]  # the newest quarter
    small = queue_loss(cfg)
    small.enqueue(rows(0, 1))
    small.epoch = 1
    assert queue_ids(small) == [0]  # round(0.25 * 1) = 0 -> at least one


def test_queue_stepwise_slices_double_from_the_newest():
    cfg = make_cfg({"loss.queue_infonce.warmup_epochs": 2, "loss.queue_infonce.slice_start": 0.25,
                    "loss.queue_infonce.slice_epochs": 1, "loss.queue_infonce.slice_mode": "stepwise",
                    "loss.queue_infonce.size": 16})
    state = queue_loss(cfg)
    state.enqueue(rows(0, 16))
    sizes = {}
    for epoch in range(7):
        state.epoch = epoch
        sizes[epoch] = len(queue_ids(state))
    # BigJump: 2 enqueue-only epochs, then a quarter, a half, the whole queue (16k -> 32k -> 65k of 65,536)
    assert sizes == {0: 0, 1: 0, 2: 4, 3: 8, 4: 16, 5: 16, 6: 16}
    state.epoch = 2
    assert queue_ids(state) == [12, 13, 14, 15]  # the newest quarter
    slow = queue_loss(with_values(cfg, {"loss.queue_infonce.slice_epochs": 2}))
    slow.enqueue(rows(0, 16))
    assert [len(queue_ids(slow)) for slow.epoch in range(2, 8)] == [4, 4, 8, 8, 16, 16]
    with pytest.raises(ConfigError, match="slice_start"):
        validate(with_values(cfg, {"loss.queue_infonce.slice_start": 0.0}))


@pytest.mark.parametrize("weight", [0.0, 0.5])
def test_queue_exists_and_enqueues_only_when_its_loss_is_on(weight):
    cfg = make_cfg({"loss.queue_infonce.weight": weight, "loss.cosine.weight": 1.0})
    criterion = Criterion(cfg, 3)
    out, batch = {"pred": unit(rows(0, 4))}, {"y_n": unit(rows(4, 8)), "img": torch.arange(4)}
    criterion.after_step(out, batch)
    queues = [b for name, b in criterion.named_buffers() if name.endswith(".queue")]
    if weight == 0:
        assert "queue_infonce" not in criterion.losses and queues == []
    else:
        queue = criterion.losses["queue_infonce"]
        assert queues == [queue.queue] and queue.queue.shape == (8, 3) and int(queue.queue_count) == 4
        assert torch.equal(queue.queue_negatives(), batch["y_n"])


# ---------------------------------------------------------------------------------------------- temperature

def test_tau_fixed_and_curriculum_endpoints():
    assert math.isclose(float(Temperature(make_cfg({"temperature.tau": 0.07}).temperature)()), 0.07, rel_tol=1e-6)
    state = Temperature(make_cfg({"temperature.mode": "curriculum", "temperature.tau_start": 0.2,
                                  "temperature.tau_end": 0.02}).temperature)
    for progress, expected in ((0.0, 0.2), (0.5, 0.11), (1.0, 0.02)):
        state.progress = progress
        assert math.isclose(float(state().detach()), expected, rel_tol=1e-5)


def test_tau_is_logged_when_it_moves_and_checkpointed():
    assert Criterion(make_cfg(), 3).log_values() == {}
    state = Criterion(make_cfg({"temperature.mode": "learnable", "temperature.tau": 0.1}), 3)
    assert math.isclose(state.log_values()["train/tau"], 0.1, rel_tol=1e-5)
    with torch.no_grad():
        state.temperature.logit_scale.fill_(math.log(1 / 0.04))
    restored = Criterion(make_cfg({"temperature.mode": "learnable", "temperature.tau": 0.1}), 3)
    restored.load_state_dict(state.state_dict())
    assert math.isclose(restored.log_values()["train/tau"], 0.04, rel_tol=1e-5)
    assert set(state.state_dict()) == {"temperature.logit_scale"}  # not the queue


def test_learnable_tau_moves_with_a_gradient_step_and_is_clamped():
    cfg = make_cfg({"temperature.mode": "learnable", "temperature.tau": 0.1, "loss.infonce.weight": 1.0})
    state = Temperature(cfg.temperature)
    assert math.isclose(float(state().detach()), 0.1, rel_tol=1e-5) and state.logit_scale.requires_grad
    batch = make_batch()
    out = Tiny()(batch["x"])
    call("infonce", out, batch, cfg.loss.infonce, state)["infonce"].backward()
    torch.optim.SGD(state.parameters(), lr=0.5).step()
    assert not math.isclose(float(state().detach()), 0.1, rel_tol=1e-4)
    with torch.no_grad():
        state.logit_scale.fill_(math.log(1000.0))
    assert math.isclose(float(state().detach()), 1 / cfg.temperature.max_logit_scale, rel_tol=1e-5)
    assert not Temperature(make_cfg().temperature).logit_scale.requires_grad


def _learned_criterion(tau: float) -> Criterion:
    criterion = Criterion(make_cfg({"temperature.mode": "learnable", "temperature.tau": 0.1}), D)
    with torch.no_grad():
        criterion.temperature.logit_scale.fill_(math.log(1 / tau))
    return criterion


def saved_loss_state(path) -> dict:
    """The criterion state a checkpoint saved (what a resumed run loads into its Criterion)."""
    state = torch.load(path, map_location="cpu", weights_only=True)["loss_state"]
    assert state  # the learned scale was saved
    return state


def test_checkpoint_round_trip_restores_the_learned_logit_scale(tmp_path):
    cfg = make_cfg({"temperature.mode": "learnable", "temperature.tau": 0.1})
    model = CenteredModel(build_model(cfg, ModelContext(DIN, D)), torch.zeros(DIN))
    trained = _learned_criterion(0.04)
    trained.after_step({}, {"y_n": F.normalize(torch.randn(5, D), dim=-1)})  # queue rows: not saved
    atomic_torch_save(checkpoint_payload(model, cfg, (DIN, D), {}, loss_state=trained.state_dict()),
                      tmp_path / "best.pt")
    resumed = Criterion(cfg, D)
    resumed.load_state_dict(saved_loss_state(tmp_path / "best.pt"))
    assert math.isclose(float(resumed.temperature().detach()), 0.04, rel_tol=1e-5)
    assert int(resumed.losses["queue_infonce"].queue_count) == 0  # rebuilt in the first epoch
    # a checkpoint of the earlier format (the scale as {"logit_scale": ...}, the queue knobs in a top-level [queue]
    # section) still loads: predict and pick read existing checkpoints
    old = checkpoint_payload(model, cfg, (DIN, D), {}, loss_state={"logit_scale": torch.tensor(math.log(1 / 0.02))})
    knobs = old["config"]["loss"]["queue_infonce"]
    old["config"]["loss"]["queue_infonce"] = {key: knobs.pop(key) for key in ("weight", "label_smoothing")}
    old["config"]["queue"] = knobs
    atomic_torch_save(old, tmp_path / "old.pt")
    resumed.load_state_dict(saved_loss_state(tmp_path / "old.pt"))
    assert math.isclose(float(resumed.temperature().detach()), 0.02, rel_tol=1e-5)
    assert load_model(tmp_path / "old.pt")[1] == cfg


# ---------------------------------------------------------------------------------------------- multi-label triplet

def test_multilabel_positive_and_negative_rules():
    labels = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0],
                           [1, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0]]).bool()
    idx = lambda m, i: torch.nonzero(m[i]).flatten().tolist()  # noqa: E731
    all_ = positive_mask(labels, "all")
    assert idx(all_, 0) == [1] and idx(all_, 1) == [0]  # identical label sets
    assert idx(all_, 2) == [0, 1, 4]  # no identical partner: falls back to sharing any label
    assert idx(all_, 5) == [] and idx(all_, 6) == []
    any_ = positive_mask(labels, "any")
    assert idx(any_, 0) == [1, 2, 4] and idx(any_, 3) == [4]
    neg = negative_mask(labels, labels)
    assert idx(neg, 0) == [3, 5, 6] and idx(neg, 4) == [5, 6] and idx(neg, 6) == list(range(7))


def test_multilabel_batch_hard_value():
    e0, e1 = [1.0, 0.0], [0.0, 1.0]
    out = {"pred": unit([e0, e0, e0, e1])}
    batch = {"labels": torch.tensor([[1, 0], [1, 0], [0, 1], [0, 1]]).bool()}
    cfg = make_cfg({"loss.multilabel_triplet.margin": 0.2}).loss.multilabel_triplet
    loss = call("multilabel_triplet", out, batch, cfg)["multilabel_triplet"]
    # anchors 0, 1: d_ap 0, hardest negative (item 2) d 0 -> 0.2; anchor 2: d_ap 1, d_an 0 -> 1.2; anchor 3: 0.2.
    assert math.isclose(float(loss), 0.45, rel_tol=1e-5)


def test_multilabel_global_hard_uses_bank_negatives_only():
    e0, e1 = [1.0, 0.0], [0.0, 1.0]
    cfg = make_cfg({"loss.multilabel_triplet.negatives": "global_hard"}).loss.multilabel_triplet
    out, batch = {"pred": unit([e0, e0])}, {"labels": torch.tensor([[1, 0], [1, 0]]).bool()}
    state = MultiLabelTriplet(cfg, 2)
    state.bank, state.bank_labels = unit([e0, e1]), torch.tensor([[1, 0], [0, 1]]).bool()
    # the bank copy of e0 shares the label: not a negative; e1 is at distance 1 > margin.
    assert float(state(out, batch)["multilabel_triplet"]) == 0.0
    state.bank, state.bank_labels = unit([e0, e1, e0]), torch.tensor([[1, 0], [0, 1], [0, 1]]).bool()
    assert math.isclose(float(state(out, batch)["multilabel_triplet"]),
                        cfg.margin, rel_tol=1e-5)


@pytest.mark.parametrize("negatives", ["random", "step_hard"])
def test_multilabel_task_negatives_use_neg_pred(negatives):
    cfg = make_cfg({"loss.multilabel_triplet.negatives": negatives}).loss.multilabel_triplet
    pred = unit([[1.0, 0.0], [1.0, 0.0]])
    batch = {"labels": torch.tensor([[1, 0], [1, 0]]).bool()}
    far = call("multilabel_triplet", {"pred": pred, "neg_pred": -pred}, batch, cfg)
    near = call("multilabel_triplet", {"pred": pred, "neg_pred": pred}, batch, cfg)
    assert float(far["multilabel_triplet"]) == 0.0
    assert math.isclose(float(near["multilabel_triplet"]), cfg.margin, rel_tol=1e-5)
    with pytest.raises(ConfigError, match="neg_pred"):
        call("multilabel_triplet", {"pred": pred}, batch, cfg)


def test_fixed_positives_are_drawn_once_among_items_sharing_a_label():
    labels = torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0], [1, 0, 0]]).bool()
    pos = draw_fixed_positives(labels, torch.Generator().manual_seed(0))
    assert pos[3] == -1 and pos[4] == -1  # the only item with label 2; an item without labels
    for i in (0, 1, 2, 5):
        assert pos[i] != i and bool((labels[i] & labels[pos[i]]).any())
    again = draw_fixed_positives(labels, torch.Generator().manual_seed(0))
    assert torch.equal(pos, again)  # a fixed draw for a fixed seed
    draws = {tuple(draw_fixed_positives(labels, torch.Generator().manual_seed(s)).tolist()) for s in range(20)}
    assert len(draws) > 1  # random, not the first candidate


def test_multilabel_fixed_positive_uses_pos_pred():
    cfg = make_cfg({"loss.multilabel_triplet.positives": "fixed"}).loss.multilabel_triplet
    e0, e1 = [1.0, 0.0], [0.0, 1.0]
    pred = unit([e0, e1])
    batch = {"labels": torch.tensor([[1, 0], [0, 1]]).bool(), "has_pos": torch.tensor([True, True])}
    # in-batch the only negative of each item is the other (distance 1); the fixed positive sets d(a, p)
    near = call("multilabel_triplet", {"pred": pred, "pos_pred": pred}, batch, cfg)
    far = call("multilabel_triplet", {"pred": pred, "pos_pred": -pred}, batch, cfg)
    assert float(near["multilabel_triplet"]) == 0.0
    assert math.isclose(float(far["multilabel_triplet"]), cfg.margin + 1.0, rel_tol=1e-5)
    none = {**batch, "has_pos": torch.tensor([False, False])}
    assert float(call("multilabel_triplet", {"pred": pred, "pos_pred": -pred}, none, cfg)
                 ["multilabel_triplet"]) == 0.0
    with pytest.raises(ConfigError, match="pos_pred"):
        call("multilabel_triplet", {"pred": pred}, batch, cfg)


# ---------------------------------------------------------------------------------------------- validate

@pytest.mark.parametrize("values, message", [
    ({"loss.slot_triplet.weight": 1.0}, "slots.k > 0"),
    ({"loss.condensation.weight": 1.0}, "slots.k > 0"),
    ({"loss.slot_diversity.weight": 1.0, "slots.k": 1}, "slots.k >= 2"),
    ({"loss.multilabel_triplet.weight": 1.0}, "data.task"),
    ({}, "no loss has a positive weight"),
])
def test_validate_rejects_inconsistent_configs(values, message):
    with pytest.raises(ConfigError, match=message):
        validate(with_values(Config(), values))


def test_validate_accepts_consistent_configs():
    validate(with_values(Config(), {"loss.infonce.weight": 1.0}))
    validate(with_values(Config(), {"loss.slot_diversity.weight": 1.0, "slots.k": 2}))
    validate(with_values(Config(), {"loss.multilabel_triplet.weight": 1.0, "data.task": "multilabel"}))


@pytest.mark.parametrize("name", [n for n in LOSSES.names() if LOSSES.get(n).min_slots > 0])
def test_a_loss_declaring_slots_fails_validation_without_the_slot_head(name):
    # the declaration (min_slots), not a list of names, is what validate reads
    cfg = with_values(Config(), {f"loss.{name}.weight": 1.0, "slots.k": 0})
    with pytest.raises(ConfigError, match=rf"^loss\.{name}\.weight > 0 needs the slot head: set slots\.k > 0$"):
        validate(cfg)


def test_multilabel_global_hard_builds_its_bank_at_epoch_start():
    cfg = make_cfg({"loss.multilabel_triplet.negatives": "global_hard"}).loss.multilabel_triplet
    loss, calls = MultiLabelTriplet(cfg, 2), []
    bank, labels = unit([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[1, 0], [0, 1]]).bool()
    ctx = EpochContext(embed_train=lambda: calls.append(1) or bank, train_labels=labels)
    loss.on_epoch_start(0, ctx)
    assert calls == [1] and loss.bank is bank and loss.bank_labels is labels
    batch_hard = MultiLabelTriplet(make_cfg().loss.multilabel_triplet, 2)
    batch_hard.on_epoch_start(0, ctx)
    assert calls == [1] and batch_hard.bank is None  # the other modes never embed the training set
