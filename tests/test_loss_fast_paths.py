"""The losses' fast paths (hardest-negative hinge by masked max, no second normalisation of unit tensors) give the
same values and gradients as the direct formulas."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.losses import Criterion
from latentsweep.trainers.losses.base import same_image, unit
from latentsweep.trainers.losses.core import _vse_hinge

IMG = torch.tensor([0, 0, 1, 2, 2, 3, 4, 5])  # captions of the same image are not negatives of each other
LOSS_MIX = {"loss.triplet.weight": 1.0, "loss.multipos_infonce.weight": 0.5, "loss.cosine.weight": 0.2,
            "loss.infonce.weight": 0.3}


def reference_hinge(sim, neg, margin, hardest):
    """The VSE++ hinge written out over the whole matrix (the form the fast path must match)."""
    pos = sim.diagonal()
    c2i = (margin + sim - pos[:, None]).clamp(min=0) * neg
    i2c = (margin + sim - pos[None, :]).clamp(min=0) * neg
    if hardest:
        return c2i.max(dim=1).values.mean(), i2c.max(dim=0).values.mean()
    return c2i.sum(dim=1).mean(), i2c.sum(dim=0).mean()


def test_hardest_hinge_matches_the_full_matrix_form_in_value_and_gradient():
    g = torch.Generator().manual_seed(0)
    for margin in (0.05, 0.2, 2.5):  # 2.5: every negative violates; 0.05: many hinges are 0
        base = F.normalize(torch.randn(len(IMG), 16, generator=g), dim=-1)
        sims = []
        for fn in (_vse_hinge, reference_hinge):
            sim = (base @ base.T).clone().requires_grad_(True)
            c2i, i2c = fn(sim, ~same_image(IMG), margin, True)
            (c2i + 2 * i2c).backward()
            sims.append((c2i.detach(), i2c.detach(), sim.grad))
        for got, want in zip(*sims):
            assert torch.equal(got, want), margin


def _grads(cfg: Config, pred_dtype=torch.float32):
    torch.manual_seed(0)
    raw = torch.randn(len(IMG), 12, requires_grad=True)
    y = torch.randn(6, 12)[IMG]
    batch = {"x": raw.detach(), "y": y, "y_n": F.normalize(y, dim=-1), "img": IMG}
    out = {"pred": F.normalize(raw, dim=-1).to(pred_dtype), "raw": raw}
    loss, terms = Criterion(cfg, 12)(out, batch)
    loss.backward()
    return loss.detach(), terms, raw.grad


def test_unit_tensors_are_not_normalised_twice_and_results_do_not_change():
    fast = with_values(Config(), {**LOSS_MIX, "model.out_norm": True})
    # out_norm = false: the losses re-normalise pred (already unit here) as they did before the fast path
    slow = with_values(Config(), {**LOSS_MIX, "model.out_norm": False})
    loss_f, terms_f, grad_f = _grads(fast)
    loss_s, terms_s, grad_s = _grads(slow)
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad_f, grad_s, rtol=1e-5, atol=1e-7)
    assert terms_f.keys() == terms_s.keys()


def test_known_unit_tensors_are_scoped_to_one_call():
    cfg = with_values(Config(), {"loss.triplet.weight": 1.0})
    y = torch.randn(len(IMG), 4) * 3
    batch = {"x": y, "y": y, "y_n": y, "img": IMG}  # a y_n that breaks the contract: normalised only inside
    Criterion(cfg, 4)({"pred": F.normalize(y, dim=-1), "raw": y}, batch)
    torch.testing.assert_close(unit(y).norm(dim=-1), torch.ones(len(IMG)))


def test_half_precision_pred_is_still_normalised_in_float32():
    cfg = with_values(Config(), {**LOSS_MIX, "model.out_norm": True})
    loss_h, _, _ = _grads(cfg, torch.float16)
    loss_f, _, _ = _grads(cfg)
    assert torch.isfinite(loss_h) and abs(float(loss_h) - float(loss_f)) < 1e-2


def test_l2_normalize_matches_f_normalize_in_value_and_gradient():
    from latentsweep.trainers.models.translator import l2_normalize

    x = torch.randn(64, 48, requires_grad=True)
    g = torch.randn(64, 48)
    results = []
    for fn in (l2_normalize, lambda t: F.normalize(t, dim=-1)):
        x.grad = None
        y = fn(x)
        y.backward(g)
        results.append((y.detach(), x.grad.clone()))
    torch.testing.assert_close(results[0], results[1], rtol=1e-6, atol=1e-7)
    zero = torch.zeros(2, 3)
    assert torch.equal(l2_normalize(zero), F.normalize(zero, dim=-1))  # eps guards the zero vector alike
