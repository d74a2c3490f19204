"""The loss registry and the `Loss` base module: what a loss declares, its hooks, and the helpers losses share.

Conventions shared by all losses:
  * Terms are computed in float32 with autocast disabled (`Loss.forward`; inputs cast with .float()), so logits
    divided by a small temperature cannot overflow half precision.
  * Cosine similarities: `pred`, `slots` and `y_n` are (re-)normalised by `unit`, so `model.out_norm = false` is
    fine; the criterion tells `unit` which float32 tensors are unit already (`known_unit`: y_n; pred when
    model.out_norm), so the hot path does not normalise them twice.
  * Image targets: `self.target(batch)` [B, D] float32 is what a loss compares predictions with, by
    cfg.loss.targets (the criterion passes it): "unit" = unit(y_n) (cosine), "raw" = y as the data gives it (the
    VSE++ + slots notebook's scale). Losses that are scale-free in the target (cosine, the condensation argmax)
    read y_n directly.
  * False negatives: captions of the same image (equal batch["img"]) are never negatives of each other; contrastive
    losses mask them out (multipos_infonce instead counts them as positives).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch
from torch import nn

from latentsweep.trainers.config.knobs import LossCfg, add_section
from latentsweep.trainers.config.registry import Registry

# Fill value for masked logits: finite (not -inf) so that 0 * log_softmax stays 0 in the label-smoothing sum, and far
# below any real logit (|cos| / tau <= 1e4 for the smallest allowed tau, 1e-4).
MASKED = -1e9
# The float32 tensors of the current criterion call that are L2-normalised already (`unit` returns them as is).
_KNOWN_UNIT: contextvars.ContextVar[tuple[torch.Tensor, ...]] = contextvars.ContextVar("known_unit", default=())


@dataclass(frozen=True)
class EpochContext:
    """What a loss may use at the start of an epoch, supplied by the task (`Task.epoch_context`)."""

    embed_train: Callable[[], torch.Tensor]  # eval-mode outputs of the model now for every training item [N, D]
    train_labels: torch.Tensor | None = None  # [N, L] bool labels of those items (tasks with labels)
    n_targets: int | None = None  # distinct training targets (images of the translate task): a queue's useful cap


class Loss(nn.Module):
    """A registered loss: built from its config section as `cls(cfg_term, dim_out)`; `forward(out, batch,
    temperature)` returns named UNWEIGHTED scalar terms whose sum is the loss (the criterion weights it).

    What it needs is declared, not looked up by name (latentsweep.trainers.config.validate and the tasks read these):
      task: the data.task whose batches it reads ("translate": paired image embeddings; "multilabel": labels).
      min_slots: the slots.k it needs (0: no slot head).
      batch_keys(cfg_term): extra batch entries the task must supply for that config.
      check(cfg_term): its own check of values that only make sense together (latentsweep.trainers.config.validate calls
      it).
    targets: the image-target scale, "unit" or "raw" (cfg.loss.targets; `target` reads it).
    Hooks (called by the criterion): `on_epoch_start(epoch, ctx)` before each epoch, `after_step(out, batch)` after
    each optimiser step with the real (un-augmented) batch. The base keeps `epoch` for losses with a schedule.
    """

    name: ClassVar[str] = ""  # the registry name, = its `LossCfg` field (set by register_loss)
    task: ClassVar[str] = "translate"
    min_slots: ClassVar[int] = 0
    # a step's cost grows with the training images (latentsweep.trainers.train.cost)
    cost_per_image: ClassVar[bool] = False

    def __init__(self, cfg: Any, dim_out: int, targets: str = "unit"):
        super().__init__()
        self.cfg = cfg
        self.epoch = 0
        self.raw_targets = targets == "raw"

    def target(self, batch: dict) -> torch.Tensor:
        """[B, D] float32 image targets at the configured scale: the unit y_n (as is when known unit), or raw y."""
        return batch["y"].float() if self.raw_targets else unit(batch["y_n"])

    def prediction(self, out: dict) -> torch.Tensor:
        """[B, D] float32 prediction for a distance to `target` (moment, mse): unit pred for unit targets, the
        model's raw output for raw ones (a distance between a unit vector and a raw target measures the norm)."""
        return out["raw"].float() if self.raw_targets else unit(out["pred"])

    @classmethod
    def batch_keys(cls, cfg: Any) -> frozenset[str]:
        """Extra batch entries (e.g. "neg_x") this loss reads under config section `cfg`; none by default."""
        return frozenset()

    @classmethod
    def check(cls, cfg: Any) -> None:
        """Raise a ConfigError for values of its section that only make sense together; nothing by default."""

    @classmethod
    def capture_refusal(cls, cfg: Any) -> str | None:
        """Why a step with this loss cannot be captured (train.capture, trainers/train/capture.py), e.g. Python-side
        state
        that changes every step; None (the default): it can."""
        return None

    def forward(self, out: dict, batch: dict, temperature: Callable[[], torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor]:
        with torch.autocast(device_type=out["pred"].device.type, enabled=False):
            return self.terms(out, batch, temperature)

    def terms(self, out: dict, batch: dict, temperature) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def on_epoch_start(self, epoch: int, ctx: EpochContext | None) -> None:
        self.epoch = epoch

    def after_step(self, out: dict, batch: dict) -> None:
        """Nothing by default; stateful losses (the queue) update their buffers here."""


LOSSES: Registry[type[Loss]] = Registry("loss")


def register_loss(name: str, config: type | None = None) -> Callable[[type[Loss]], type[Loss]]:
    """Register a Loss subclass under `name`: a `LossCfg` field name, or (a plugin's loss) a new section `loss.<name>`
    made of `config`, a frozen dataclass of knobs with defaults that has a `weight` (latentsweep.trainers.config.knobs.knob)."""

    def deco(cls: type[Loss]) -> type[Loss]:
        if name in LOSSES:
            raise ValueError(f"loss '{name}' is already registered (built-in losses: {', '.join(LOSSES.names())})")
        if config is not None:
            if "weight" not in getattr(config, "__dataclass_fields__", {}):
                raise ValueError(f"{config.__name__}: a loss's config section needs a `weight` knob (0 = off)")
            add_section(LossCfg, name, config)
        elif name not in LossCfg.__dataclass_fields__:
            raise ValueError(f"loss '{name}' has no config section: pass register_loss('{name}', config=...)")
        cls.name = name
        return LOSSES.register(name)(cls)

    return deco


# ---------------------------------------------------------------------------------------------- helpers

@contextlib.contextmanager
def known_unit(tensors: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """Within the block `unit` returns these (L2-normalised float32) tensors as they are."""
    token = _KNOWN_UNIT.set(tensors)
    try:
        yield
    finally:
        _KNOWN_UNIT.reset(token)


def unit(x: torch.Tensor) -> torch.Tensor:
    """float32 rows L2-normalised along the last dim (eps guards zero vectors); a known-unit tensor as is (not
    under torch.compile, which cannot trace the ContextVar: see Criterion.forward)."""
    if not torch.compiler.is_compiling() and any(x is known for known in _KNOWN_UNIT.get()):
        return x
    x = x.float()
    return x / x.norm(dim=-1, keepdim=True).clamp_min(1e-8)  # = F.normalize(x, dim=-1, eps=1e-8), see l2_normalize


def same_image(img: torch.Tensor) -> torch.Tensor:
    """[B, B] bool: captions i and j describe the same image (diagonal included)."""
    return img[:, None] == img[None, :]


def zero_like(t: torch.Tensor) -> torch.Tensor:
    """A 0 that stays in the autograd graph of `t` (so backward works even if it is the only term)."""
    return t.float().sum() * 0.0


def masked_ce(logits: torch.Tensor, keep: torch.Tensor, target: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over rows of logits [N, C] with columns where keep [N, C] is False removed.

    Label smoothing (as in torch: eps spread uniformly, target gets 1 - eps + eps / C) is spread only over the kept
    columns, so masked false negatives receive no probability mass. The target column must be kept.
    """
    logp = logits.masked_fill(~keep, MASKED).log_softmax(dim=-1)
    nll = -logp.gather(1, target[:, None]).squeeze(1)
    if smoothing == 0.0:
        return nll.mean()
    uniform = -(logp * keep).sum(dim=-1) / keep.sum(dim=-1)
    return ((1.0 - smoothing) * nll + smoothing * uniform).mean()


def multipos_i2c(logits: torch.Tensor, inverse: torch.Tensor, smoothing: float = 0.0) -> torch.Tensor:
    """image->caption SupCon (Khosla et al. 2020) from caption->image logits [B, U] over the batch's U distinct
    images: for each image, the mean over ALL its captions (inverse [B]: each caption's image in 0..U-1) of -log
    softmax over the B captions (positives stay in the denominator); smoothing eps spread uniformly over the B."""
    positives = (inverse[None, :] == torch.arange(logits.shape[1], device=logits.device)[:, None]).float()  # [U, B]
    logp = logits.T.log_softmax(dim=-1)
    i2c = (-(logp * positives).sum(dim=-1) / positives.sum(dim=-1)).mean()
    return (1.0 - smoothing) * i2c - smoothing * logp.mean(dim=-1).mean()
