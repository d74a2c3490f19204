"""Temperature: the InfoNCE family's tau, fixed, learnable (CLIP logit scale) or on a cosine curriculum."""
from __future__ import annotations

import math

import torch
from torch import nn

from latentsweep.trainers.config.tree import TemperatureCfg


class Temperature(nn.Module):
    """`temperature()` is tau as a float32 scalar tensor on this module's device (see `forward`).

    Holds the CLIP logit scale as a parameter in every mode (so checkpoints have one shape); it only has a gradient in
    "learnable" mode, where the optimiser gives it its own param group (latentsweep.trainers.train.optim.param_groups:
    base LR, no
    weight decay). `progress` (0..1 over the whole run) drives the curriculum; the criterion sets it every step.
    """

    def __init__(self, cfg: TemperatureCfg):
        super().__init__()
        self.cfg = cfg
        # CLIP init: logit_scale = log(1 / tau).
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1.0 / cfg.tau), dtype=torch.float32),
                                        requires_grad=cfg.mode == "learnable")
        self.progress = 0.0

    def forward(self) -> torch.Tensor:
        """fixed: tau. learnable: 1 / exp(logit_scale), the scale clamped at max_logit_scale (as CLIP does, so
        tau >= 1 / max_logit_scale). curriculum: cosine interpolation from tau_start (progress 0) to tau_end
        (progress 1): tau = tau_end + (tau_start - tau_end) * (1 + cos(pi * progress)) / 2."""
        t = self.cfg
        device = self.logit_scale.device
        if t.mode == "learnable":
            scale = self.logit_scale.float().clamp(max=math.log(t.max_logit_scale)).exp()
            return 1.0 / scale
        if t.mode == "curriculum":
            p = min(max(float(self.progress), 0.0), 1.0)
            value = t.tau_end + (t.tau_start - t.tau_end) * 0.5 * (1.0 + math.cos(math.pi * p))
            return _scalar(value, device)
        return _scalar(t.tau, device)

    def log_values(self) -> dict[str, float]:
        """Per-epoch metrics: the temperature now (train/tau) when it moves (learnable or curriculum)."""
        if self.cfg.mode == "fixed":
            return {}
        return {"train/tau": float(self().detach())}


def _scalar(value: float, device: torch.device) -> torch.Tensor:
    """A float32 scalar tensor made on `device` by a fill: torch.tensor(value, device=cuda) builds it on the host and
    copies it over, a synchronising copy in every training step (issue 33); the value is the same float32."""
    return torch.full((), value, dtype=torch.float32, device=device)
