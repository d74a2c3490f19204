"""The translator base: the output contract every model of the registry keeps ({"pred", "raw"})."""
from __future__ import annotations

import torch
from torch import nn


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """F.normalize(x, dim=-1) with the same values and gradients, dividing by the [B, 1] norm without expanding it
    to [B, D] first: its backward then divides by a [B, 1] tensor instead of a materialised [B, D] one."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


class Translator(nn.Module):
    """Base class: subclasses implement `translate(x) -> raw [B, dim_out]`; forward builds the contract's dict."""

    def __init__(self, out_norm: bool):
        super().__init__()
        self.out_norm = out_norm

    def translate(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raw = self.translate(x)
        return {"pred": l2_normalize(raw) if self.out_norm else raw, "raw": raw}
