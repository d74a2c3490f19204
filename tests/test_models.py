"""Tests of the models registry, the closed-form geometry solvers, the freeze schedule and the slot head."""
from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.models.geometry import procrustes_fit, ridge_fit
from latentsweep.trainers.models.zoo import MODELS, UNTRAINED_KINDS, ModelContext, build_model

DIN, DOUT, N = 16, 24, 96
TRAINED = [k for k in MODELS.names() if k not in UNTRAINED_KINDS]  # the knn model has its own tests (test_knn.py)


def small_cfg(**values) -> Config:
    base = {"model.hidden": (32, 32), "model.n_anchors": 8, "model.adapter_hidden": 16, "slots.hidden": 16,
            "model.dropout": 0.1}
    return with_values(Config(), base | values)


def make_ctx(seed: int = 0) -> ModelContext:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, DIN, generator=g)
    y = x @ torch.randn(DIN, DOUT, generator=g) + 0.1 * torch.randn(N, DOUT, generator=g)
    return ModelContext(dim_in=DIN, dim_out=DOUT, fit_x=x, fit_y=y)


def unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "inner", model)


def toy_loss(out: dict) -> torch.Tensor:
    """Touches every output so every trainable parameter is on the graph."""
    target = torch.linspace(-1, 1, DOUT)
    loss = -(out["pred"] * target).sum() + out["raw"].square().mean()
    return loss + out["slots"].sum() if "slots" in out else loss


def optimiser(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    groups = model.param_groups() if hasattr(model, "param_groups") else [("main", list(model.parameters()), 1.0)]
    return torch.optim.SGD([{"params": p, "lr": lr * m} for _, p, m in groups], lr=lr)


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> set[str]:
    """One optimiser step; the names of the parameters whose values changed."""
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    opt.zero_grad()
    toy_loss(model(x)).backward()
    opt.step()
    return {k for k, v in model.named_parameters() if not torch.equal(v, before[k])}


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("kind", TRAINED)
def test_forward_backward_every_model(kind, k):
    torch.manual_seed(0)
    model = build_model(small_cfg(**{"model.kind": kind, "slots.k": k}), make_ctx())
    if hasattr(model, "on_epoch_start"):
        model.on_epoch_start(0)
    model.train()
    x = torch.randn(5, DIN)
    out = model(x)
    assert out["pred"].shape == (5, DOUT) and out["raw"].shape == (5, DOUT)
    assert torch.allclose(out["pred"].norm(dim=-1), torch.ones(5), atol=1e-5)
    assert all(torch.isfinite(v).all() for v in out.values())
    if k:
        assert out["slots"].shape == (5, k, DOUT)
        assert torch.allclose(out["slots"].norm(dim=-1), torch.ones(5, k), atol=1e-5)
    else:
        assert "slots" not in out
    toy_loss(out).backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert trainable
    for name, p in trainable:
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    model.eval()
    assert "slots" not in model(x)


@pytest.mark.parametrize("kind", MODELS.names())
def test_out_norm_off_returns_raw(kind):
    model = build_model(small_cfg(**{"model.kind": kind, "model.out_norm": False}), make_ctx()).eval()
    out = model(torch.randn(4, DIN))
    assert torch.equal(out["pred"], out["raw"])
    assert not torch.allclose(out["raw"].norm(dim=-1), torch.ones(4), atol=1e-3)


@pytest.mark.parametrize("kind,norm,residual", [("mlp", "batchnorm", True), ("mlp", "layernorm", False),
                                                ("deep_mlp", "none", True), ("relative", "none", True)])
def test_norm_and_residual_variants(kind, norm, residual):
    # the relative model's anchor mix has its own knob (model.residual is the MLP skip connection everywhere)
    knob = "model.anchor_mix" if kind == "relative" else "model.residual"
    model = build_model(small_cfg(**{"model.kind": kind, "model.norm": norm, knob: residual}), make_ctx())
    out = model(torch.randn(6, DIN))
    toy_loss(out).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    expected = {"batchnorm": nn.BatchNorm1d, "layernorm": nn.LayerNorm, "none": nn.LayerNorm}[norm]
    if kind == "relative":
        assert model.logit_scale is not None and model.logit_scale.grad is not None
    else:
        assert any(isinstance(m, expected) for m in model.modules())


def test_mlp_shapes_match_the_config():
    cfg = small_cfg(**{"model.kind": "mlp", "model.hidden": (40,), "model.activation": "relu"})
    model = build_model(cfg, make_ctx())
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [tuple(m.weight.shape) for m in linears] == [(40, DIN), (DOUT, 40)]
    assert any(isinstance(m, nn.ReLU) for m in model.modules())
    moco = build_model(small_cfg(**{"model.kind": "moco_mlp"}), make_ctx())
    assert sum(isinstance(m, nn.LayerNorm) for m in moco.modules()) == 2


@pytest.mark.parametrize("kind, hidden", [("linear", ()), ("mlp", (40, 40)), ("moco_mlp", (40,))])
def test_bias_off_removes_every_linear_bias(kind, hidden):
    on = build_model(small_cfg(**{"model.kind": kind, "model.hidden": hidden or (40,)}), make_ctx())
    off = build_model(small_cfg(**{"model.kind": kind, "model.hidden": hidden or (40,), "model.bias": False}),
                      make_ctx())
    assert all(m.bias is not None for m in on.modules() if isinstance(m, nn.Linear))
    linears = [m for m in off.modules() if isinstance(m, nn.Linear)]
    assert linears and all(m.bias is None for m in linears)
    if kind != "moco_mlp":  # (its LayerNorm keeps a shift) without biases, 0 maps to 0
        assert torch.equal(off(torch.zeros(2, DIN))["raw"], torch.zeros(2, DOUT))
    if kind == "linear":  # the seed's encoder: a pure linear map, f(a x) = a f(x)
        x = torch.randn(3, DIN)
        assert torch.allclose(off(2 * x)["raw"], 2 * off(x)["raw"], atol=1e-5)


def test_deep_mlp_needs_two_hidden_layers():
    with pytest.raises(ConfigError, match="model.hidden"):
        build_model(small_cfg(**{"model.kind": "deep_mlp", "model.hidden": (32,)}), make_ctx())


def test_unknown_kind_names_closest():
    with pytest.raises(ConfigError, match="did you mean 'mlp'"):
        build_model(small_cfg(**{"model.kind": "mlpp"}), make_ctx())


def test_init_modes_differ():
    weights = {}
    for mode in ("default", "xavier", "kaiming", "orthogonal"):
        torch.manual_seed(0)
        model = build_model(small_cfg(**{"model.kind": "mlp", "model.init": mode}), make_ctx())
        weights[mode] = [m for m in model.modules() if isinstance(m, nn.Linear)][0].weight.detach()
    for a, b in itertools.combinations(weights, 2):
        assert not torch.allclose(weights[a], weights[b]), (a, b)
    w = weights["orthogonal"]  # [32, 16]: orthonormal columns
    assert torch.allclose(w.T @ w, torch.eye(DIN), atol=1e-5)


# ---------------------------------------------------------------------------------------------- closed form

def _well_conditioned_x(n: int, d: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 3.0, d, dtype=torch.float64)  # anisotropic but condition number 6
    return torch.randn(n, d, generator=g, dtype=torch.float64) * scales + 2.0


def _orthogonal(rows: int, cols: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(max(rows, cols), max(rows, cols), generator=g, dtype=torch.float64))
    return q[:rows, :cols]


@pytest.mark.parametrize("dout", [DIN, DOUT])
def test_procrustes_recovers_rotation(dout):
    X = _well_conditioned_x(400, DIN)
    R = _orthogonal(DIN, dout)  # R R^T = I
    shift = torch.linspace(-1, 1, dout, dtype=torch.float64)
    Y = X @ R + shift
    W, b = procrustes_fit(X, Y, whiten_eps=1e-12)
    assert W.shape == (DIN, dout) and b.shape == (dout,)
    assert torch.allclose(X @ W + b, Y, atol=1e-6)
    assert torch.allclose(W @ W.T, torch.eye(DIN, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(W, R, atol=1e-6)
    assert torch.allclose(b, shift, atol=1e-6)


def test_procrustes_matches_target_covariance_and_keeps_dtype():
    # With both sides whitened, W maps X's covariance onto Y's exactly (W^T Cxx W = Cyy) even for noisy pairs,
    # which least squares (shrinking towards the mean) does not.
    X = _well_conditioned_x(400, DIN)
    g = torch.Generator().manual_seed(3)
    Y = X @ torch.randn(DIN, DIN, generator=g, dtype=torch.float64) + torch.randn(400, DIN, generator=g,
                                                                                  dtype=torch.float64)
    cov = lambda a: torch.cov(a.T, correction=0)  # noqa: E731
    W, _ = procrustes_fit(X, Y, whiten_eps=1e-12)
    assert torch.allclose(W.T @ cov(X) @ W, cov(Y), atol=1e-6)
    ridge_w, _ = ridge_fit(X, Y, lam=1e-9, whiten_eps=1e-12)
    assert not torch.allclose(ridge_w.T @ cov(X) @ ridge_w, cov(Y), atol=1e-2)
    W32, b32 = procrustes_fit(X.float(), Y.float(), whiten_eps=1e-9)
    assert W32.dtype == b32.dtype == torch.float32 and torch.allclose(W32.double(), W, atol=1e-3)


def test_ridge_recovers_linear_map_and_lambda_shrinks():
    X = _well_conditioned_x(400, DIN)
    g = torch.Generator().manual_seed(2)
    M = torch.randn(DIN, DOUT, generator=g, dtype=torch.float64)
    c = torch.randn(DOUT, generator=g, dtype=torch.float64)
    Y = X @ M + c
    W, b = ridge_fit(X, Y, lam=1e-8, whiten_eps=1e-12)
    assert torch.allclose(W, M, atol=1e-6) and torch.allclose(b, c, atol=1e-5)
    W_big, _ = ridge_fit(X, Y, lam=1e4, whiten_eps=1e-12)
    assert W_big.norm() < 0.5 * W.norm()


@pytest.mark.parametrize("init", ["ridge", "procrustes"])
def test_geometry_model_equals_closed_form_at_init(init):
    ctx = make_ctx()
    cfg = small_cfg(**{"model.kind": "geometry", "geometry.init": init, "model.out_norm": False})
    model = build_model(cfg, ctx).eval()
    fit = {"ridge": lambda: ridge_fit(ctx.fit_x, ctx.fit_y, cfg.geometry.ridge_lambda, cfg.geometry.whiten_eps),
           "procrustes": lambda: procrustes_fit(ctx.fit_x, ctx.fit_y, cfg.geometry.whiten_eps)}[init]
    W, b = fit()
    x = torch.randn(7, DIN)
    assert torch.allclose(model(x)["raw"], x @ W + b, atol=1e-4)


# ---------------------------------------------------------------------------------------------- freeze schedule

@pytest.mark.parametrize("k", [0, 2])
def test_geometry_freeze_unfreeze_refreeze(k):
    cfg = small_cfg(**{"model.kind": "geometry", "slots.k": k, "geometry.frozen_epochs": 1,
                       "geometry.unfreeze_epoch": 2, "geometry.refreeze_drop": 0.01,
                       "geometry.unfreeze_lr_scale": 0.5, "model.dropout": 0.0, "model.adapter_dropout": 0.0})
    model = build_model(cfg, make_ctx())
    geo, prefix = unwrap(model), "inner." if k else ""
    A, bias, last = f"{prefix}base.weight", f"{prefix}base.bias", f"{prefix}adapter.3.weight"
    opt, x = optimiser(model), torch.randn(8, DIN)
    for epoch in (0, 1):  # frozen: only the adapter (and slots) move
        model.on_epoch_start(epoch)
        changed = step(model, opt, x)
        assert A not in changed and bias not in changed and last in changed
        assert (k == 0) or any(n.startswith("slots.") for n in changed)
        model.on_epoch_end(epoch, 0.5)
    model.on_epoch_start(2)  # micro-unfreeze: A only
    assert geo.base.weight.requires_grad and not geo.base.bias.requires_grad
    changed = step(model, opt, x)
    assert A in changed and bias not in changed
    model.on_epoch_end(2, 0.6)  # new best: A of epoch 2 remembered
    best_A = geo.base.weight.detach().clone()
    model.on_epoch_start(3)
    assert A in step(model, opt, x)
    model.on_epoch_end(3, 0.595)  # drop 0.005 < refreeze_drop: stays trainable
    assert geo.base.weight.requires_grad
    model.on_epoch_start(4)
    step(model, opt, x)
    model.on_epoch_end(4, 0.58)  # drop 0.02 > refreeze_drop: refrozen and restored
    assert not geo.base.weight.requires_grad
    assert torch.equal(geo.base.weight, best_A)
    model.on_epoch_start(5)  # stays frozen for good
    changed = step(model, opt, x)
    assert A not in changed and bias not in changed and last in changed


def test_geometry_unfreeze_waits_for_frozen_epochs_and_never_when_disabled():
    ctx = make_ctx()
    late = build_model(small_cfg(**{"model.kind": "geometry", "geometry.frozen_epochs": 3,
                                    "geometry.unfreeze_epoch": 1}), ctx)
    never = build_model(small_cfg(**{"model.kind": "geometry", "geometry.unfreeze_epoch": -1}), ctx)
    trainable = []
    for epoch in range(5):
        late.on_epoch_start(epoch)
        never.on_epoch_start(epoch)
        trainable.append(late.base.weight.requires_grad)
        assert not never.base.weight.requires_grad and not never.base.bias.requires_grad
    assert trainable == [False, False, False, True, True]


@pytest.mark.parametrize("k", [0, 2])
def test_geometry_param_groups(k):
    cfg = small_cfg(**{"model.kind": "geometry", "slots.k": k, "geometry.unfreeze_lr_scale": 0.25})
    model = build_model(cfg, make_ctx())
    groups = model.param_groups()
    assert [(name, mult) for name, _, mult in groups] == [("base", 0.25), ("adapter", 1.0)]
    geo = unwrap(model)
    assert [id(p) for p in groups[0][1]] == [id(geo.base.weight), id(geo.base.bias)]
    grouped = [id(p) for _, ps, _ in groups for p in ps]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # every parameter exactly once


def test_slot_wrapper_default_group_holds_everything():
    model = build_model(small_cfg(**{"model.kind": "mlp", "slots.k": 2}), make_ctx())
    (name, params, mult), = model.param_groups()
    assert mult == 1.0 and sorted(map(id, params)) == sorted(id(p) for p in model.parameters())


# ---------------------------------------------------------------------------------------------- relative / checkpoints

def test_relative_anchors_are_seeded_and_checked():
    ctx = make_ctx()
    a = build_model(small_cfg(**{"model.kind": "relative", "train.seed": 1}), ctx)
    b = build_model(small_cfg(**{"model.kind": "relative", "train.seed": 1}), ctx)
    c = build_model(small_cfg(**{"model.kind": "relative", "train.seed": 2}), ctx)
    assert a.text_anchors.shape == (8, DIN) and a.image_anchors.shape == (8, DOUT)
    assert torch.equal(a.text_anchors, b.text_anchors) and not torch.equal(a.text_anchors, c.text_anchors)
    assert torch.allclose(a.image_anchors.norm(dim=-1), torch.ones(8), atol=1e-5)
    with pytest.raises(ConfigError, match="model.n_anchors"):
        build_model(small_cfg(**{"model.kind": "relative", "model.n_anchors": N + 1}), ctx)


@pytest.mark.parametrize("kind", ["geometry", "relative", "knn"])
def test_build_without_fit_data_loads_checkpoint(kind):
    cfg = small_cfg(**{"model.kind": kind})
    fitted = build_model(cfg, make_ctx()).eval()
    blank = build_model(cfg, ModelContext(dim_in=DIN, dim_out=DOUT)).eval()
    blank.load_state_dict(fitted.state_dict())
    x = torch.randn(3, DIN)
    assert torch.equal(blank(x)["pred"], fitted(x)["pred"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", MODELS.names())
def test_builds_and_runs_on_cuda(kind):
    ctx = make_ctx()
    ctx = ModelContext(DIN, DOUT, ctx.fit_x.cuda(), ctx.fit_y.cuda())
    slots = 0 if kind in UNTRAINED_KINDS else 2
    model = build_model(small_cfg(**{"model.kind": kind, "slots.k": slots}), ctx).train()
    assert all(t.is_cuda for t in itertools.chain(model.parameters(), model.buffers()))
    out = model(torch.randn(4, DIN, device="cuda"))
    assert out["pred"].is_cuda and (not slots or out["slots"].is_cuda)
