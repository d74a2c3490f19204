"""A latentsweep plugin: the sigmoid pairwise loss of SigLIP (Zhai et al. 2023), which no seed recipe uses.

Every caption-image pair of the batch is its own binary problem: logit = scale * cos(pred_i, y_j) + bias, label +1
when caption i describes image j (captions of the same image count as positives), else -1; the loss is the mean over
captions of the summed -log sigmoid(label * logit) over the batch's images. No softmax: no temperature is shared
across the row, and the large negative bias keeps the many negatives from dominating at the start.

Use it from a study file beside this one:  [study] plugins = ["siglip_loss.py"], then `loss.siglip.*` are knobs.
"""
from dataclasses import dataclass

import torch.nn.functional as F

from latentsweep.trainers.config.knobs import knob
from latentsweep.trainers.losses.base import Loss, register_loss, same_image, unit


@dataclass(frozen=True)
class SigLIPCfg:
    """SigLIP's sigmoid pairwise loss (loss.siglip)."""

    weight: float = knob(0.0, low=0.0, doc="weight of the term; 0 = off")
    scale: float = knob(10.0, low=0.1, high=100.0, doc="logit scale t (SigLIP initialises t = 10)")
    bias: float = knob(-10.0, low=-30.0, high=10.0, doc="logit bias b (SigLIP initialises b = -10)")


@register_loss("siglip", config=SigLIPCfg)
class SigLIP(Loss):
    """-mean_i sum_j log sigmoid(z_ij * (scale * cos(pred_i, y_j) + bias)), z_ij = +1 for the same image, else -1."""

    def terms(self, out, batch, temperature):
        logits = self.cfg.scale * unit(out["pred"]) @ unit(batch["y_n"]).T + self.cfg.bias
        labels = same_image(batch["img"]).float() * 2.0 - 1.0
        return {"siglip": -F.logsigmoid(labels * logits).sum(dim=1).mean()}
