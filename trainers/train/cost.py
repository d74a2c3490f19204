"""What a training job costs in seconds: measured by the loop (start-up, training and validation per epoch), and
extrapolated from one job to another of the same config on other data sizes (a refit on every image, a fold model)."""
from __future__ import annotations

import math
import os
from dataclasses import MISSING, asdict, dataclass, fields

from latentsweep.trainers.core.devices import usable_cores


@dataclass(frozen=True)
class Timing:
    """Seconds measured in one training run, each part on its own because each scales differently: start-up is
    paid once (data on the device, model, optimiser), training grows with the captions (and with the images for a
    loss over every image), validation is paid only by jobs that hold images out."""
    setup_s: float  # from train() to the first batch
    train_s: float  # mean seconds per training epoch
    eval_s: float  # mean seconds per epoch of validation (0 without a val split)
    captions: int  # training captions of that run
    images: int  # training images of that run
    per_image: bool  # a step's cost grows with the number of training images (loss.all_images_infonce)
    # seconds the trained model takes to predict the val split again (what the pick pays per candidate, besides its
    # load; latentsweep.trainers.train.tasks.Task.predict_again_s); None in timings recorded before it existed
    predict_s: float | None = None

    def as_attrs(self) -> dict:
        """A JSON-able dict (Optuna user attrs, manifests)."""
        return asdict(self)

    @classmethod
    def from_attrs(cls, attrs) -> "Timing | None":
        """The Timing stored by as_attrs, or None for anything else (trials written before timings existed)."""
        names = {f.name for f in fields(cls)}
        optional = {f.name: f.default for f in fields(cls) if f.default is not MISSING}  # later additions: None
        if not isinstance(attrs, dict) or not names - set(optional) <= set(attrs) <= names:
            return None
        attrs = {**optional, **attrs}
        kinds = {f.name: (bool,) if f.type in (bool, "bool") else (int, float) for f in fields(cls)}
        for name, value in attrs.items():  # a study edited by hand or damaged: wrong types read as no timing
            if value is None and name in optional:
                continue
            numeric = kinds[name] != (bool,)
            if not isinstance(value, kinds[name]) or (numeric and (isinstance(value, bool) or not
                                                                   math.isfinite(value) or value < 0)):
                return None
        return cls(**attrs)

    def pick_s(self) -> float:
        """What predicting the val split costs the pick for this trial's model: predict_s, else (an older record)
        the whole validation pass, an upper bound."""
        return self.eval_s if self.predict_s is None else self.predict_s

    def estimate(self, captions: int, images: int, epochs: int, validate: bool = False) -> float:
        """Estimated seconds of the same config trained `epochs` epochs on `captions` captions of `images` images."""
        scale = captions / max(self.captions, 1)
        if self.per_image:  # [batch x images] logits per step: the cost per caption grows with the images
            scale *= images / max(self.images, 1)
        return self.setup_s + epochs * (self.train_s * scale + (self.eval_s if validate else 0.0))


def contention(load: float | None = None, cores: int | None = None) -> float:
    """How many times longer a fixed cost measured on a quiet machine takes now: the 1-minute load average per usable
    core, at least 1 (this job's own busy threads count too, so a quiet machine reads about 1). Costs measured in
    this job (a trial's epochs, the keeper's scoring of a checkpoint, the floor) already carry the load: not scaled.
    1 where the system has no load average."""
    if load is None:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if cores is None:
        cores = usable_cores()
    return max(1.0, load / max(cores, 1))


def mean_epoch(seconds: list[float]) -> float:
    """Mean of per-epoch seconds without the first epoch when there are more (it pays one-off warm-up costs)."""
    kept = seconds[1:] if len(seconds) > 1 else seconds
    return sum(kept) / len(kept) if kept else 0.0


__all__ = ["Timing", "contention", "mean_epoch"]
