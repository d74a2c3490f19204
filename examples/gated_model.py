"""A latentsweep plugin: a gated residual translator, model.kind = "gated" with its own knobs (model.gated.*).

pred = normalise(W x + g(x) * MLP(x)): a linear map (initialised by ridge regression when training data is given)
plus a non-linear correction whose per-dimension gate g(x) = sigmoid(V x + gate_bias) starts nearly closed, so the
model begins as the closed-form solution and learns how far to leave it.

Use it from a study file beside this one:  [study] plugins = ["gated_model.py"], [base.model] kind = "gated".
"""
from dataclasses import dataclass

import torch
from torch import nn

from latentsweep.trainers.models.geometry import ridge_fit
from latentsweep.trainers.config.knobs import knob
from latentsweep.trainers.models.zoo import MLP, register_model


@dataclass(frozen=True)
class GatedCfg:
    """The gated residual translator (model.gated)."""

    width: int = knob(512, low=1, high=65536, doc="hidden width of the correction MLP")
    gate_bias: float = knob(-2.0, low=-10.0, high=10.0, doc="initial gate logit (sigmoid(-2) = 0.12 open)")
    ridge_lambda: float = knob(1.0, low=0.0, doc="ridge penalty of the linear map's initialisation")


class GatedTranslator(nn.Module):
    def __init__(self, dim_in: int, dim_out: int, cfg: GatedCfg, dropout: float, out_norm: bool):
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)
        self.correction = MLP(dim_in, dim_out, (cfg.width,), dropout=dropout)
        self.gate = nn.Linear(dim_in, dim_out)
        nn.init.zeros_(self.gate.weight)
        nn.init.constant_(self.gate.bias, cfg.gate_bias)
        self.out_norm = out_norm

    def forward(self, x):
        raw = self.linear(x) + torch.sigmoid(self.gate(x)) * self.correction(x)
        pred = nn.functional.normalize(raw, dim=-1) if self.out_norm else raw
        return {"pred": pred, "raw": raw}


@register_model("gated", config=GatedCfg)
def build_gated(cfg, ctx):
    model = GatedTranslator(ctx.dim_in, ctx.dim_out, cfg.model.gated, cfg.model.dropout, cfg.model.out_norm)
    if ctx.fit_x is not None:
        model.to(ctx.fit_x.device)
        weight, bias = ridge_fit(ctx.fit_x, ctx.fit_y, cfg.model.gated.ridge_lambda, cfg.geometry.whiten_eps)
        with torch.no_grad():  # ridge_fit's W is [dim_in, dim_out]: y = x W + b
            model.linear.weight.copy_(weight.T)
            model.linear.bias.copy_(bias)
    return model
