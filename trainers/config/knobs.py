"""Every knob: the frozen section dataclasses of the config tree, with defaults, ranges and choices.

Field metadata: `choices` (allowed values), `low`/`high` (inclusive range), `doc`;
`latentsweep.trainers.config.tree.coerce` checks them.
Registry-backed names (model kind, optimiser, scheduler, losses) are checked by `latentsweep.trainers.config.validate`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field, fields, is_dataclass

from latentsweep.trainers.config.registry import on_rollback

# numpy's legacy seeding (np.random.seed, used by seed_everything) accepts [0, 2**32 - 1] only.
MAX_SEED = 2**32 - 1
# Widest layer accepted: 65536 x 1536 float32 weights are 400 MB per layer; wider is a typo (an extra digit) that
# would fail at allocation with an out-of-memory traceback mid-trial.
MAX_WIDTH = 65536


def knob(default, *, low=None, high=None, choices=None, doc=""):
    """A field with range/choice metadata (checked by `latentsweep.trainers.config.tree.coerce`); an empty range is
    refused."""
    if low is not None and high is not None and low > high:
        raise ValueError(f"knob({default!r}, low={low!r}, high={high!r}): low is above high, so no value is valid")
    meta = {"low": low, "high": high, "choices": choices, "doc": doc}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


_f = knob  # the built-in sections' short name; plugins use `knob`


@dataclass(frozen=True)
class DataCfg:
    path: str = _f("", doc="train npz; empty = bundled demo data")
    task: str = _f("translate", choices=("translate", "multilabel"))
    split: str = _f("hash", choices=("hash", "kfold", "all"),
                    doc="all = every image trains, no validation (refits: the epoch count comes from a study)")
    val_ratio: float = _f(0.1, low=0.01, high=0.9)
    n_folds: int = _f(5, low=2)
    fold: int = _f(0, low=0)
    salt: str = _f("", doc="salt of the MD5 image-name split")
    center_text: bool = _f(False, doc="subtract the train mean caption embedding")


@dataclass(frozen=True)
class ModelCfg:
    kind: str = _f("mlp", doc="models registry name")
    hidden: tuple[int, ...] = _f((2048,), low=1, high=MAX_WIDTH,
                                 doc="hidden widths (each >= 1: a 0-wide layer cuts the signal)")
    activation: str = _f("gelu", choices=("gelu", "relu", "silu", "tanh"))
    norm: str = _f("none", choices=("none", "layernorm", "batchnorm"))
    dropout: float = _f(0.0, low=0.0, high=0.9)
    init: str = _f("default", choices=("default", "xavier", "kaiming", "orthogonal"))
    residual: bool = _f(False)
    out_norm: bool = _f(True, doc="L2-normalise the output")
    bias: bool = _f(True, doc="the Linear layers of the MLP (linear and MLP kinds) have a bias; "
                              "false: none, as the multi-label seed's linear encoder")
    out_dim: int = _f(0, low=0, high=MAX_WIDTH, doc="multilabel task embedding size; 0 = input size")
    n_anchors: int = _f(256, low=2, doc="relative-representation anchors")
    anchor_mix: bool = _f(False, doc="relative model: add the softmax(sims / tau) mix of the image anchors to the "
                                     "MLP output (a learned tau)")
    adapter_hidden: int = _f(512, low=1, high=MAX_WIDTH)
    adapter_dropout: float = _f(0.1, low=0.0, high=0.9)
    knn_k: int = _f(64, low=1, doc="knn model: nearest training captions mixed per prediction")
    knn_tau: float = _f(0.0, low=0.0, doc="knn model: softmax temperature over their cosines; 0 = chosen by "
                                          "leave-one-image-out MRR on the training captions")
    knn_center: float = _f(1.0, low=0.0, high=1.0, doc="knn model: fraction of the mean unit training image taken "
                                                        "off each prediction (a mean of images leans to their mean)")


@dataclass(frozen=True)
class GeometryCfg:
    init: str = _f("ridge", choices=("ridge", "procrustes"))
    ridge_lambda: float = _f(1.0, low=0.0)
    whiten_eps: float = _f(1e-3, low=0.0)
    frozen_epochs: int = _f(2, low=0, doc="epochs with the closed-form base frozen")
    unfreeze_epoch: int = _f(-1, low=-1, doc="micro-unfreeze A from this epoch; -1 = never")
    unfreeze_lr_scale: float = _f(0.1, low=0.0, high=1.0)
    refreeze_drop: float = _f(0.005, low=0.0, doc="refreeze if val MRR drops by more than this")


@dataclass(frozen=True)
class SlotCfg:
    k: int = _f(0, low=0, doc="number of slots; 0 = no slot head")
    hidden: int = _f(1024, low=1, high=MAX_WIDTH)


@dataclass(frozen=True)
class TripletCfg:
    weight: float = _f(0.0, low=0.0)
    margin: float = _f(0.2, low=0.0)
    max_violation: bool = _f(True, doc="VSE++ hardest negative; False = sum over negatives")
    warmup_epochs: int = _f(0, low=0, doc="sum over negatives before hardest negatives (VSE++ warm-up)")
    direction: str = _f("both", choices=("both", "c2i", "i2c"),
                        doc="caption->image, image->caption or both hinges (the VSE++ + slots seed: c2i)")


@dataclass(frozen=True)
class SlotTripletCfg:
    weight: float = _f(0.0, low=0.0)
    margin: float = _f(0.2, low=0.0)


@dataclass(frozen=True)
class SlotInfoNCECfg:
    weight: float = _f(0.0, low=0.0)
    tau: float = _f(0.07, low=1e-4)


@dataclass(frozen=True)
class DiversityCfg:
    weight: float = _f(0.0, low=0.0)
    delta: float = _f(0.5, low=-1.0, high=1.0, doc="max allowed cosine between two slots")


@dataclass(frozen=True)
class WeightCfg:
    weight: float = _f(0.0, low=0.0)


@dataclass(frozen=True)
class MomentCfg:
    weight: float = _f(0.0, low=0.0)
    std: bool = _f(True, doc="match the per-dimension stds too, not only the means (BigJump matches means only)")


@dataclass(frozen=True)
class InfoNCECfg:
    weight: float = _f(0.0, low=0.0)
    symmetric: bool = _f(True)
    label_smoothing: float = _f(0.0, low=0.0, high=0.5)


@dataclass(frozen=True)
class SmoothedInfoNCECfg:
    weight: float = _f(0.0, low=0.0)
    label_smoothing: float = _f(0.0, low=0.0, high=0.5)


@dataclass(frozen=True)
class MultiLabelTripletCfg:
    weight: float = _f(0.0, low=0.0)
    margin: float = _f(0.2, low=0.0)
    positives: str = _f("all", choices=("all", "any", "fixed"),
                        doc="hardest in-batch item sharing all labels (else one) or any label; fixed = one random "
                            "positive per anchor drawn once before training (the multi-label seed)")
    negatives: str = _f("batch_hard", choices=("batch_hard", "global_hard", "step_hard", "random"),
                        doc="hardest in-batch item sharing no label; global_hard: hardest over a bank of every "
                            "training item embedded at each epoch start (detached); step_hard: hardest over every "
                            "training item embedded by the live model at each step, then embedded with gradient "
                            "(the multi-label seed); random: a random item sharing no label")


@dataclass(frozen=True)
class QueueInfoNCECfg:
    """caption->image InfoNCE against in-batch images plus a FIFO queue of earlier batches' images."""

    weight: float = _f(0.0, low=0.0)
    label_smoothing: float = _f(0.0, low=0.0, high=0.5)
    size: int = _f(4096, low=1)
    warmup_epochs: int = _f(1, low=0, doc="enqueue-only epochs before queue negatives are used")
    slice_start: float = _f(1.0, low=0.0, high=1.0, doc="fraction of the queue (newest first) used at first")
    slice_epochs: int = _f(0, low=0, doc="linear: epochs to grow the used slice to the full queue; "
                                         "stepwise: epochs between two doublings of the slice")
    slice_mode: str = _f("linear", choices=("linear", "stepwise"),
                         doc="linear growth, or stepwise doubling (BigJump: 16k -> 32k -> 65k of a 65k queue)")
    in_batch: bool = _f(True, doc="in-batch images are negatives too; false = queue-only negatives (MoCo)")


@dataclass(frozen=True)
class AllImagesInfoNCECfg:
    """caption->image InfoNCE over every distinct training image (the exact limit of a queue of fixed targets)."""

    weight: float = _f(0.0, low=0.0)
    label_smoothing: float = _f(0.0, low=0.0, high=0.5)
    symmetric: bool = _f(True, doc="add image->caption over the batch's captions, all captions of an image "
                                   "positives (as multipos_infonce)")


# The scale of the image targets every translation loss compares predictions with (loss.targets).
TARGET_SCALES = ("unit", "raw")


@dataclass(frozen=True)
class LossCfg:
    """One section per registered loss (same names), plus `targets`: the image-target scale they all read.

    targets = "unit": each image embedding L2-normalised (cosine similarities; the default, and every recipe but
    the seeds that ran on raw embeddings). "raw": as the data file gives it, so a similarity pred_unit . y is
    |y| x cosine and a margin or a temperature acts on that scale (the VSE++ + slots notebook trains so: its margin
    0.2 and slot tau 0.09 act on targets of norm ~26 on the challenge data, ~16 on the demo). Distance losses
    (moment, mse) compare the model's raw output with the target at that scale. Retrieval metrics are cosine and
    do not depend on it."""

    targets: str = _f("unit", choices=TARGET_SCALES, doc="image targets of every loss: unit (L2-normalised) or raw "
                                                          "(as the data gives them); see LossCfg")
    triplet: TripletCfg = field(default_factory=TripletCfg)
    slot_triplet: SlotTripletCfg = field(default_factory=SlotTripletCfg)
    slot_infonce: SlotInfoNCECfg = field(default_factory=SlotInfoNCECfg)
    slot_diversity: DiversityCfg = field(default_factory=DiversityCfg)
    condensation: WeightCfg = field(default_factory=WeightCfg)
    infonce: InfoNCECfg = field(default_factory=InfoNCECfg)
    multipos_infonce: SmoothedInfoNCECfg = field(default_factory=SmoothedInfoNCECfg)
    queue_infonce: QueueInfoNCECfg = field(default_factory=QueueInfoNCECfg)
    all_images_infonce: AllImagesInfoNCECfg = field(default_factory=AllImagesInfoNCECfg)
    cosine: WeightCfg = field(default_factory=WeightCfg)
    moment: MomentCfg = field(default_factory=MomentCfg)
    agreement: WeightCfg = field(default_factory=WeightCfg)
    mse: WeightCfg = field(default_factory=WeightCfg)
    multilabel_triplet: MultiLabelTripletCfg = field(default_factory=MultiLabelTripletCfg)


@dataclass(frozen=True)
class TemperatureCfg:
    mode: str = _f("fixed", choices=("fixed", "learnable", "curriculum"))
    tau: float = _f(0.05, low=1e-4, high=10.0)
    tau_start: float = _f(0.1, low=1e-4, high=10.0)
    tau_end: float = _f(0.03, low=1e-4, high=10.0)
    max_logit_scale: float = _f(100.0, low=1.0, doc="CLIP clamps the learnable logit scale at 100")


@dataclass(frozen=True)
class OptimCfg:
    name: str = _f("adam", doc="optimisers registry name")
    lr: float = _f(1e-3, low=0.0)
    weight_decay: float = _f(0.0, low=0.0)
    beta1: float = _f(0.9, low=0.0, high=1.0)
    beta2: float = _f(0.999, low=0.0, high=1.0)


@dataclass(frozen=True)
class ScheduleCfg:
    name: str = _f("cosine", doc="schedulers registry name")
    warmup_epochs: float = _f(0.0, low=0.0)
    min_lr_ratio: float = _f(0.0, low=0.0, high=1.0, doc="cosine floor as a fraction of lr")
    step_epochs: int = _f(10, low=1)
    gamma: float = _f(0.1, low=0.0, high=1.0)
    plateau_patience: int = _f(2, low=0)
    plateau_factor: float = _f(0.5, low=0.0, high=1.0)


@dataclass(frozen=True)
class TrainCfg:
    epochs: int = _f(20, low=1)
    stop_after: int = _f(0, low=0, doc="stop after this many epochs, schedule still planned over train.epochs; "
                                         "0 = run all (refits replay a trial up to its best epoch)")
    batch_size: int = _f(256, low=2)
    grad_clip: float = _f(0.0, low=0.0, doc="max grad norm; 0 = off")
    amp: bool = _f(True, doc="mixed precision where the device supports it (CUDA)")
    early_stop: int = _f(0, low=0, doc="patience in epochs without val improvement; 0 = off")
    seed: int = _f(0, low=0, high=MAX_SEED)
    device: str = _f("auto", doc="auto | cpu | cuda | cuda:N")
    threads: int = _f(0, low=0, doc="torch CPU threads; 0 = leave as is")
    sampler: str = _f("caption", choices=("caption", "image"), doc="batches of captions, or of images with all their captions")
    capture: str = _f("none", choices=("none", "compile"),
                      doc="the step's forward + loss: eager, or torch.compile (CUDA graphs on CUDA) with an eager "
                          "fallback (trainers/train/capture.py; docs/gpu.md)")
    monitor: str = _f("val/mrr", choices=("val/mrr", "val/loss"),
                      doc="what ReduceLROnPlateau and early stopping watch; the best checkpoint is always by val/mrr")
    average: str = _f("none", doc="weight averaging validated and checkpointed: none | ema | swa (latentsweep.trainers.train.regularise)")
    ema_decay: float = _f(0.999, low=0.0, high=0.99999, doc="EMA decay per optimiser step (train.average = 'ema')")
    swa_start: float = _f(0.75, low=0.0, high=0.99, doc="SWA averages epochs from floor(swa_start * epochs) on")


@dataclass(frozen=True)
class AugmentCfg:
    mixup_alpha: float = _f(0.0, low=0.0, doc="embedding mixup, lambda ~ Beta(alpha, alpha); 0 = off (translate task)")
    noise_std: float = _f(0.0, low=0.0, doc="Gaussian input noise, in units of each input dim's train std; 0 = off")


@dataclass(frozen=True)
class EvalCfg:
    gallery_size: int = _f(100, low=2, doc="challenge leaderboard galleries have 100 images")
    seed: int = _f(0, low=0, high=MAX_SEED)
    recall_k: int = _f(10, low=1, doc="label recall@k for the multilabel task")


@dataclass(frozen=True)
class PluginsCfg:
    files: tuple[str, ...] = _f((), doc="plugin files as PATH#sha256=HEX, loaded (and checked) before the config is "
                                         "read: set from a study file's [study] plugins, not by hand")


@dataclass(frozen=True)
class Config:
    data: DataCfg = field(default_factory=DataCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    geometry: GeometryCfg = field(default_factory=GeometryCfg)
    slots: SlotCfg = field(default_factory=SlotCfg)
    loss: LossCfg = field(default_factory=LossCfg)
    temperature: TemperatureCfg = field(default_factory=TemperatureCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    schedule: ScheduleCfg = field(default_factory=ScheduleCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    augment: AugmentCfg = field(default_factory=AugmentCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)
    plugins: PluginsCfg = field(default_factory=PluginsCfg)


# ---------------------------------------------------------------------------------------------- plugin sections

# bumped by add_section: latentsweep.trainers.config.tree re-reads the leaves of the tree when it changes
_GENERATION = [0]
_GENERATED = ("__init__", "__repr__", "__eq__", "__hash__", "__match_args__")


def generation() -> int:
    return _GENERATION[0]


def add_section(parent: type, name: str, section: type) -> None:
    """Add `section` (a frozen dataclass whose every knob has a default) as the field `name` of the section class
    `parent` (LossCfg for a loss, ModelCfg for a model), in place: `Config` and every module that imported it see
    the new knobs. Configs made before keep working (they read the section's defaults). A name that is already a
    field of `parent` (a built-in knob or section) is refused."""
    where = f"{parent.__name__}.{name}"
    if not (isinstance(section, type) and is_dataclass(section) and section.__dataclass_params__.frozen):
        raise TypeError(f"{where}: the config section must be a @dataclass(frozen=True) class")
    if name in parent.__dataclass_fields__:
        raise ValueError(f"{where}: '{name}' clashes with a built-in knob or section of the same name")
    no_default = [f.name for f in fields(section) if f.default is MISSING and f.default_factory is MISSING]
    if no_default:
        raise ValueError(f"{section.__name__}: every knob needs a default (use knob(default, ...)); "
                         f"missing for {', '.join(no_default)}")
    on_rollback(_remover(parent, name))
    specs = [(f.name, f.type, field(default=f.default, default_factory=f.default_factory, metadata=f.metadata))
             for f in fields(parent)]
    specs.append((name, section, field(default_factory=section, metadata={"doc": section.__doc__ or ""})))
    rebuilt = dataclasses.make_dataclass(parent.__name__, specs, frozen=True)
    for attr in _GENERATED:
        setattr(parent, attr, rebuilt.__dict__[attr])
    parent.__dataclass_fields__[name] = rebuilt.__dataclass_fields__[name]
    parent.__annotations__[name] = section
    setattr(parent, name, section())  # what configs made before the section was added read
    _GENERATION[0] += 1


def _remover(parent: type, name: str):
    """How to take back add_section(parent, name, ...): the class as it was (a plugin's import failed after it)."""
    saved = {attr: parent.__dict__[attr] for attr in _GENERATED if attr in parent.__dict__}
    fields_before, annotations_before = dict(parent.__dataclass_fields__), dict(parent.__annotations__)

    def remove() -> None:
        for attr in _GENERATED:
            if attr in saved:
                setattr(parent, attr, saved[attr])
            elif attr in parent.__dict__:
                delattr(parent, attr)
        parent.__dataclass_fields__.clear()
        parent.__dataclass_fields__.update(fields_before)
        parent.__annotations__.clear()
        parent.__annotations__.update(annotations_before)
        if name in parent.__dict__:
            delattr(parent, name)
        _GENERATION[0] += 1

    return remove
