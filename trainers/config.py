"""The configuration tree: frozen dataclasses for every knob, built from TOML and `key=value` overrides, checked strictly.

Keys are dotted paths (`loss.triplet.margin`). A study's search space writes into the same paths with `with_values`.
Each field may carry metadata: `choices` (allowed values), `low`/`high` (inclusive range). Registry-backed names
(model kind, optimiser, scheduler) are checked against their registries by `trainers.build.validate`.
"""
from __future__ import annotations

import dataclasses
import functools
import tomllib
import typing
from dataclasses import dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any

from trainers.errors import ConfigError, closest


# numpy's legacy seeding (np.random.seed, used by seed_everything) accepts [0, 2**32 - 1] only.
MAX_SEED = 2**32 - 1
# Widest layer accepted: 65536 x 1536 float32 weights are 400 MB per layer; wider is a typo (an extra digit) that
# would fail at allocation with an out-of-memory traceback mid-trial.
MAX_WIDTH = 65536


def _f(default, *, low=None, high=None, choices=None, doc=""):
    """A field with range/choice metadata (checked by `check_values`)."""
    meta = {"low": low, "high": high, "choices": choices, "doc": doc}
    if isinstance(default, (list, tuple)):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


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
    negatives: str = _f("batch_hard", choices=("batch_hard", "global_hard", "random"))


@dataclass(frozen=True)
class LossCfg:
    triplet: TripletCfg = field(default_factory=TripletCfg)
    slot_triplet: SlotTripletCfg = field(default_factory=SlotTripletCfg)
    slot_infonce: SlotInfoNCECfg = field(default_factory=SlotInfoNCECfg)
    slot_diversity: DiversityCfg = field(default_factory=DiversityCfg)
    condensation: WeightCfg = field(default_factory=WeightCfg)
    infonce: InfoNCECfg = field(default_factory=InfoNCECfg)
    multipos_infonce: SmoothedInfoNCECfg = field(default_factory=SmoothedInfoNCECfg)
    queue_infonce: SmoothedInfoNCECfg = field(default_factory=SmoothedInfoNCECfg)
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
class QueueCfg:
    size: int = _f(4096, low=1)
    warmup_epochs: int = _f(1, low=0, doc="enqueue-only epochs before queue negatives are used")
    slice_start: float = _f(1.0, low=0.0, high=1.0, doc="fraction of the queue (newest first) used at first")
    slice_epochs: int = _f(0, low=0, doc="linear: epochs to grow the used slice to the full queue; "
                                         "stepwise: epochs between two doublings of the slice")
    slice_mode: str = _f("linear", choices=("linear", "stepwise"),
                         doc="linear growth, or stepwise doubling (BigJump: 16k -> 32k -> 65k of a 65k queue)")
    in_batch: bool = _f(True, doc="in-batch images are negatives too; false = queue-only negatives (MoCo)")


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
    monitor: str = _f("val/mrr", choices=("val/mrr", "val/loss"),
                      doc="what ReduceLROnPlateau and early stopping watch; the best checkpoint is always by val/mrr")
    average: str = _f("none", doc="weight averaging validated and checkpointed: none | ema | swa (trainers.regularise)")
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
class Config:
    data: DataCfg = field(default_factory=DataCfg)
    model: ModelCfg = field(default_factory=ModelCfg)
    geometry: GeometryCfg = field(default_factory=GeometryCfg)
    slots: SlotCfg = field(default_factory=SlotCfg)
    loss: LossCfg = field(default_factory=LossCfg)
    temperature: TemperatureCfg = field(default_factory=TemperatureCfg)
    queue: QueueCfg = field(default_factory=QueueCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    schedule: ScheduleCfg = field(default_factory=ScheduleCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    augment: AugmentCfg = field(default_factory=AugmentCfg)
    eval: EvalCfg = field(default_factory=EvalCfg)


# ---------------------------------------------------------------------------------------------- flattening

def flatten(cfg: Any, prefix: str = "") -> dict[str, Any]:
    """{'loss.triplet.margin': 0.2, ...} for every leaf of the tree."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        key = f"{prefix}{f.name}"
        if is_dataclass(value):
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def flatten_tree(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested plain dict (a TOML table) as {'a.b.c': leaf}; no key checking (see `from_dict` for that)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten_tree(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """Nested plain dict (tuples become lists) suitable for TOML/JSON."""
    out: dict[str, Any] = {}
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        out[f.name] = to_dict(value) if is_dataclass(value) else (list(value) if isinstance(value, tuple) else value)
    return out


def leaf_fields(cls: type = Config, prefix: str = "") -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every leaf key -> (its dataclass Field, its resolved Python type)."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[dataclasses.Field, Any]] = {}
    for f in fields(cls):
        hint = hints[f.name]
        if isinstance(hint, type) and is_dataclass(hint):
            out.update(leaf_fields(hint, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = (f, hint)
    return out


@functools.lru_cache(maxsize=None)
def _leaves() -> dict[str, tuple[dataclasses.Field, Any]]:
    return leaf_fields()


def valid_keys() -> list[str]:
    return sorted(_leaves())


def check_key(key: str) -> None:
    """Fail loudly on an unknown key, naming the closest valid one."""
    if key not in _leaves():
        raise ConfigError(f"unknown config key '{key}'{closest(key, valid_keys())}")


# ---------------------------------------------------------------------------------------------- values

def coerce(key: str, value: Any) -> Any:
    """Convert `value` (from TOML, a CLI string or a sampler) to the field's type, then range/choice-check it."""
    check_key(key)
    f, hint = _leaves()[key]
    try:
        value = _to_type(hint, value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}") from None
    meta = f.metadata
    if meta.get("choices") is not None and value not in meta["choices"]:
        raise ConfigError(
            f"{key}: {value!r} is not one of {', '.join(map(str, meta['choices']))}"
            f"{closest(str(value), map(str, meta['choices']))}"
        )
    items = value if isinstance(value, tuple) else (value,)
    for item in items:
        if meta.get("low") is not None and item < meta["low"]:
            raise ConfigError(f"{key}: {item!r} is below the minimum {meta['low']}")
        if meta.get("high") is not None and item > meta["high"]:
            raise ConfigError(f"{key}: {item!r} is above the maximum {meta['high']}")
    return value


def _type_name(hint: Any) -> str:
    return "a list of int" if typing.get_origin(hint) is tuple else getattr(hint, "__name__", str(hint))


def _to_type(hint: Any, value: Any) -> Any:
    if typing.get_origin(hint) is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return tuple(_to_type(int, v) for v in value)
    if hint is bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.strip().lower() in ("true", "1", "yes")
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        raise TypeError
    if hint is int:
        if isinstance(value, bool):
            raise TypeError
        if isinstance(value, float) and not value.is_integer():
            raise ValueError
        return int(value) if not isinstance(value, str) else int(value.strip())
    if hint is float:
        if isinstance(value, bool):
            raise TypeError
        result = float(value)
        if result != result or result in (float("inf"), float("-inf")):
            raise ValueError
        return result
    if hint is str:
        if not isinstance(value, str):
            raise TypeError
        return value
    raise TypeError


def with_values(cfg: Config, values: dict[str, Any]) -> Config:
    """A copy of `cfg` with dotted-key values set (each checked); the way overrides and search spaces write."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        value = coerce(key, value)
        node = nested
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _replace_nested(cfg, nested)


def _replace_nested(obj: Any, changes: dict[str, Any]) -> Any:
    updates = {
        name: _replace_nested(getattr(obj, name), value) if isinstance(value, dict) else value
        for name, value in changes.items()
    }
    return replace(obj, **updates)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """['a.b=1', ...] -> {'a.b': '1'}; each key checked (values are coerced by `with_values`)."""
    out: dict[str, Any] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        check_key(key)
        out[key] = value.strip()
    return out


def from_dict(tree: dict[str, Any], base: Config | None = None, where: str = "config") -> Config:
    """Build a Config from a nested dict (a TOML table): every key checked, unknown ones named with the closest."""
    flat: dict[str, Any] = {}
    _flatten_dict(tree, "", flat, where)
    try:
        return with_values(base or Config(), flat)
    except ConfigError as exc:  # a value out of range or of the wrong type: name the file like the key errors do
        raise ConfigError(f"{where}: {exc}") from None


def _flatten_dict(tree: dict[str, Any], prefix: str, out: dict[str, Any], where: str) -> None:
    leaves = _leaves()
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            if not any(k.startswith(key + ".") for k in leaves):
                raise ConfigError(f"{where}: unknown config section '{key}'{closest(key, _sections())}")
            _flatten_dict(value, key + ".", out, where)
        else:
            if key not in leaves:
                raise ConfigError(f"{where}: unknown config key '{key}'{closest(key, valid_keys())}")
            out[key] = value


def _sections() -> set[str]:
    return {k.rsplit(".", 1)[0] for k in _leaves()} | {k.split(".", 1)[0] for k in _leaves()}


def load_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file with one-line errors for a missing file or bad syntax."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: malformed TOML: {exc}") from None


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (sections per sub-config), readable back by `from_dict`."""
    lines: list[str] = []
    _dump_table(to_dict(cfg), "", lines)
    return "\n".join(lines).strip() + "\n"


def _dump_table(tree: dict[str, Any], prefix: str, lines: list[str]) -> None:
    scalars = {k: v for k, v in tree.items() if not isinstance(v, dict)}
    if scalars:
        if prefix:
            lines.append(f"\n[{prefix}]")
        for key, value in scalars.items():
            lines.append(f"{key} = {_toml_value(value)}")
    for key, value in tree.items():
        if isinstance(value, dict):
            _dump_table(value, f"{prefix}.{key}" if prefix else key, lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + "".join(_toml_char(ch) for ch in value) + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return repr(value)


def _toml_char(ch: str) -> str:
    """One character of a TOML basic string: quote, backslash and control characters (TOML forbids them raw) escaped."""
    if ch in ('"', "\\"):
        return "\\" + ch
    if ord(ch) < 0x20 or ord(ch) == 0x7F:  # tab is allowed raw, but the escape is valid too
        return f"\\u{ord(ch):04X}"
    return ch
