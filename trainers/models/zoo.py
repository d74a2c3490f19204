"""The models registry: text->image translators (MLP family, closed-form geometry, relative anchors, the kernel model of
trainers/models/knn.py) and the slot head.

Every model maps x [B, dim_in] to {"pred": [B, dim_out] (L2-normalised iff cfg.model.out_norm), "raw": [B, dim_out]};
`build_model` adds "slots" [B, K, dim_out] in training mode when cfg.slots.k > 0.
"""
from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.core.errors import ConfigError, closest
from latentsweep.trainers.models.geometry import procrustes_fit, ridge_fit
from latentsweep.trainers.config.knobs import ModelCfg, add_section
from latentsweep.trainers.models.knn import KernelTranslator
from latentsweep.trainers.models.model_context import ModelContext
from latentsweep.trainers.config.registry import Registry
from latentsweep.trainers.models.translator import Translator

MODELS: Registry[Callable[[Config, "ModelContext"], nn.Module]] = Registry("model")


def register_model(name: str, config: type | None = None) -> Callable:
    """Register a builder `(cfg, ctx) -> nn.Module` as model.kind `name` (a plugin's model); its knobs, if any, are
    the section `model.<name>` made of `config` (a frozen dataclass of knobs with defaults, latentsweep.trainers.config.knobs.knob)."""

    def deco(builder: Callable) -> Callable:
        if name in MODELS:
            raise ValueError(f"model '{name}' is already registered (built-in: {', '.join(MODELS.names())})")
        if config is not None:
            add_section(ModelCfg, name, config)
        return MODELS.register(name)(builder)

    return deco


ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {"gelu": nn.GELU, "relu": nn.ReLU, "silu": nn.SiLU, "tanh": nn.Tanh}
NORMS: dict[str, Callable[[int], nn.Module]] = {
    "none": lambda width: nn.Identity(),
    "layernorm": nn.LayerNorm,
    "batchnorm": nn.BatchNorm1d,
}
# Weight initialisers for Linear layers (biases are zeroed); None keeps PyTorch's default (Kaiming-uniform, a=sqrt 5).
INITS: dict[str, Callable[[torch.Tensor], Any] | None] = {
    "default": None,
    "xavier": nn.init.xavier_uniform_,
    "kaiming": partial(nn.init.kaiming_uniform_, nonlinearity="relu"),
    "orthogonal": nn.init.orthogonal_,
}
# CLIP's initial temperature 0.07 (Radford et al. 2021), used by the relative model's anchor softmax.
_CLIP_INIT_TAU = 0.07


def lookup(table: dict[str, Any], key: str, name: str) -> Any:
    """table[name], or a ConfigError naming the key and the closest valid name."""
    if name not in table:
        raise ConfigError(f"{key}: unknown value '{name}'{closest(name, table)}; valid: {', '.join(table)}")
    return table[name]


def init_linears(module: nn.Module, mode: str) -> nn.Module:
    """Re-initialise every nn.Linear inside `module` with INITS[mode] (biases zeroed); returns the module."""
    fn = lookup(INITS, "model.init", mode)
    if fn is not None:
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                fn(layer.weight)
                if layer.bias is not None:
                    nn.init.zeros_(layer.bias)
    return module


class MLP(nn.Module):
    """Linear -> norm -> activation -> dropout per hidden width, then a final Linear (no activation) to dim_out.

    With `residual`, a hidden block whose input and output widths match adds its input (h = h + block(h)).
    With `bias` False no Linear layer has a bias (the multi-label seed's linear encoder).
    """

    def __init__(self, dim_in: int, dim_out: int, hidden: tuple[int, ...] = (), *, activation: str = "gelu",
                 norm: str = "none", dropout: float = 0.0, residual: bool = False, bias: bool = True):
        super().__init__()
        act = lookup(ACTIVATIONS, "model.activation", activation)
        make_norm = lookup(NORMS, "model.norm", norm)
        widths = (dim_in, *hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b, bias=bias), make_norm(b), act(), nn.Dropout(dropout))
            for a, b in zip(widths[:-1], widths[1:])
        )
        self.skips = [residual and a == b for a, b in zip(widths[:-1], widths[1:])]
        self.head = nn.Linear(widths[-1], dim_out, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, skip in zip(self.blocks, self.skips):
            x = x + block(x) if skip else block(x)
        return self.head(x)


class MLPTranslator(Translator):
    """x -> MLP(x): the linear map (no hidden layers), the VSE++/official MLP, the deep and MoCo variants."""

    def __init__(self, net: nn.Module, out_norm: bool):
        super().__init__(out_norm)
        self.net = net

    def translate(self, x):
        return self.net(x)


def _mlp(cfg: Config, dim_in: int, dim_out: int, **override) -> MLP:
    """An MLP through cfg.model.hidden with the config's activation/norm/dropout/residual unless overridden."""
    m = cfg.model
    kw = dict(activation=m.activation, norm=m.norm, dropout=m.dropout, residual=m.residual, bias=m.bias) | override
    return MLP(dim_in, dim_out, m.hidden, **kw)


@MODELS.register("linear")
def build_linear(cfg: Config, ctx: ModelContext) -> nn.Module:
    net = MLP(ctx.dim_in, ctx.dim_out, (), bias=cfg.model.bias)
    return MLPTranslator(init_linears(net, cfg.model.init), cfg.model.out_norm)


@MODELS.register("mlp")
def build_mlp(cfg: Config, ctx: ModelContext) -> nn.Module:
    """VSE++ MLP; hidden=(2048,) gelu is the 1024-2048-1536 translator, (2048, 2048) relu dropout 0.4 the baseline."""
    return MLPTranslator(init_linears(_mlp(cfg, ctx.dim_in, ctx.dim_out), cfg.model.init), cfg.model.out_norm)


# Hidden layers a model kind needs at least (kinds not listed take any number)
MIN_HIDDEN_LAYERS = {"deep_mlp": 2}
# Model kinds fitted when built, with nothing to train: the loop validates them once, the pick refits them once, and
# a slot head on them would be trained alone, for nothing the prediction uses.
UNTRAINED_KINDS = frozenset({"knn"})


def check_model(cfg: Config) -> None:
    """The model checks that need no data (run by latentsweep.trainers.config.validate before training and by the
    study-file check)."""
    MODELS.get(cfg.model.kind)
    need = MIN_HIDDEN_LAYERS.get(cfg.model.kind, 0)
    if len(cfg.model.hidden) < need:
        raise ConfigError(f"model.hidden: {cfg.model.kind} needs at least {need} hidden layers, "
                          f"got {list(cfg.model.hidden)}")
    if cfg.model.kind in UNTRAINED_KINDS and cfg.slots.k > 0:
        raise ConfigError(f"slots.k = {cfg.slots.k}: model.kind '{cfg.model.kind}' has no trained part for a slot "
                          "head to regularise; set slots.k = 0")


@MODELS.register("deep_mlp")
def build_deep_mlp(cfg: Config, ctx: ModelContext) -> nn.Module:
    """The MLP with >= 2 hidden layers and a norm between them (LayerNorm when model.norm is 'none')."""
    check_model(cfg)
    norm = {"none": "layernorm"}.get(cfg.model.norm, cfg.model.norm)
    net = _mlp(cfg, ctx.dim_in, ctx.dim_out, norm=norm)
    return MLPTranslator(init_linears(net, cfg.model.init), cfg.model.out_norm)


@MODELS.register("moco_mlp")
def build_moco_mlp(cfg: Config, ctx: ModelContext) -> nn.Module:
    """The MoCo translator: LayerNorm + GELU + dropout per hidden layer, Xavier init (unless model.init says else)."""
    net = _mlp(cfg, ctx.dim_in, ctx.dim_out, norm="layernorm", activation="gelu")
    init = {"default": "xavier"}.get(cfg.model.init, cfg.model.init)
    return MLPTranslator(init_linears(net, init), cfg.model.out_norm)


class ResidualMLP(Translator):
    """raw = W x + MLP(x): a linear skip path plus a nonlinear residual branch."""

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        self.skip = nn.Linear(ctx.dim_in, ctx.dim_out)
        self.branch = _mlp(cfg, ctx.dim_in, ctx.dim_out)
        init_linears(self, cfg.model.init)

    def translate(self, x):
        return self.skip(x) + self.branch(x)


MODELS.register("residual_mlp")(ResidualMLP)


class TwoHead(Translator):
    """Direction x scale: a shared MLP trunk whose final Linear has dim_out direction rows and 1 scale row.

    raw = normalise(direction) * softplus(scale) [B, dim_out], so the norm is predicted separately and is > 0.
    """

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        self.dim_out = ctx.dim_out
        self.net = init_linears(_mlp(cfg, ctx.dim_in, ctx.dim_out + 1), cfg.model.init)

    def translate(self, x):
        h = self.net(x)  # [B, dim_out + 1]
        direction, scale = h[:, :self.dim_out], h[:, self.dim_out:]
        return F.normalize(direction, dim=-1) * F.softplus(scale)


MODELS.register("two_head")(TwoHead)

# Closed-form initialisers of the geometry model, keyed by cfg.geometry.init.
GEOMETRY_FITS: dict[str, Callable[[torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, torch.Tensor]]] = {
    "ridge": lambda X, Y, g: ridge_fit(X, Y, g.ridge_lambda, g.whiten_eps),
    "procrustes": lambda X, Y, g: procrustes_fit(X, Y, g.whiten_eps),
}


class GeometryAdapter(Translator):
    """"BigJump": a closed-form base map A x + b plus a zero-initialised residual adapter on its output.

    raw = base + adapter(base), base = A x + b, so at init the model equals the closed-form fit.
    Freeze schedule (hooks called by the loop): A and b start frozen; b stays frozen. A is "micro-unfrozen" from
    epoch max(unfreeze_epoch, frozen_epochs) when unfreeze_epoch >= 0. After each epoch the best val metric and the
    A of that epoch are kept; if A is trainable and val drops below best - refreeze_drop, A is refrozen for good and
    restored to its best-epoch weights (the adapter is not rolled back: it keeps training against the restored A).
    """

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        self.geo = cfg.geometry
        self.base = nn.Linear(ctx.dim_in, ctx.dim_out)
        self.adapter = nn.Sequential(
            nn.Linear(ctx.dim_out, cfg.model.adapter_hidden), nn.GELU(), nn.Dropout(cfg.model.adapter_dropout),
            nn.Linear(cfg.model.adapter_hidden, ctx.dim_out),
        )
        init_linears(self.adapter, cfg.model.init)
        nn.init.zeros_(self.adapter[-1].weight)
        nn.init.zeros_(self.adapter[-1].bias)
        if ctx.has_fit:
            W, b = lookup(GEOMETRY_FITS, "geometry.init", cfg.geometry.init)(ctx.fit_x, ctx.fit_y, cfg.geometry)
            with torch.no_grad():
                self.base.weight.copy_(W.T)
                self.base.bias.copy_(b)
        self.base.requires_grad_(False)
        # A at the best epoch so far; not saved in checkpoints (only needed during training).
        self.register_buffer("best_weight", self.base.weight.detach().clone(), persistent=False)
        self.best_metric = -math.inf
        self.refrozen = False

    def translate(self, x):
        base = self.base(x)
        return base + self.adapter(base)

    def param_groups(self) -> list[tuple[str, list[nn.Parameter], float]]:
        return [("base", list(self.base.parameters()), self.geo.unfreeze_lr_scale),
                ("adapter", list(self.adapter.parameters()), 1.0)]

    def on_epoch_start(self, epoch: int) -> None:
        start = max(self.geo.unfreeze_epoch, self.geo.frozen_epochs)
        unfrozen = self.geo.unfreeze_epoch >= 0 and epoch >= start and not self.refrozen
        self.base.weight.requires_grad_(unfrozen)
        self.base.bias.requires_grad_(False)

    def on_epoch_end(self, epoch: int, val_metric: float) -> None:
        if val_metric > self.best_metric:
            self.best_metric = val_metric
            self.best_weight.copy_(self.base.weight.detach())
        elif self.base.weight.requires_grad and val_metric < self.best_metric - self.geo.refreeze_drop:
            with torch.no_grad():
                self.base.weight.copy_(self.best_weight)
            self.base.weight.requires_grad_(False)
            self.refrozen = True


MODELS.register("geometry")(GeometryAdapter)


class RelativeTranslator(Translator):
    """Relative representation: x -> cosine similarities to n text anchors [B, n] -> MLP -> dim_out.

    Anchors are n train rows picked by a permutation seeded with cfg.train.seed; their normalised text and paired
    normalised image embeddings are buffers. With cfg.model.anchor_mix, the softmax(sims / tau)-weighted mix of the
    image anchors is added to the MLP output (tau learnable, starting at CLIP's 0.07), so the MLP learns a correction
    to a nearest-anchors retrieval.
    """

    def __init__(self, cfg: Config, ctx: ModelContext):
        super().__init__(cfg.model.out_norm)
        n = cfg.model.n_anchors
        text, image = torch.zeros(n, ctx.dim_in), torch.zeros(n, ctx.dim_out)
        if ctx.has_fit:
            if n > ctx.fit_x.shape[0]:
                raise ConfigError(f"model.n_anchors: {n} anchors requested but only {ctx.fit_x.shape[0]} training rows")
            idx = torch.randperm(ctx.fit_x.shape[0], generator=torch.Generator().manual_seed(cfg.train.seed))[:n]
            idx = idx.to(ctx.fit_x.device)
            text = F.normalize(ctx.fit_x[idx].float(), dim=-1)
            image = F.normalize(ctx.fit_y[idx].float(), dim=-1)
        self.register_buffer("text_anchors", text)  # [n, dim_in]
        self.register_buffer("image_anchors", image)  # [n, dim_out]
        self.net = init_linears(_mlp(cfg, n, ctx.dim_out), cfg.model.init)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / _CLIP_INIT_TAU))) if cfg.model.anchor_mix else None

    def translate(self, x):
        sims = F.normalize(x, dim=-1) @ self.text_anchors.T  # [B, n]
        out = self.net(sims)
        if self.logit_scale is not None:
            out = out + torch.softmax(sims * self.logit_scale.exp(), dim=-1) @ self.image_anchors
        return out


MODELS.register("relative")(RelativeTranslator)
MODELS.register("knn")(KernelTranslator)


class SlotHead(nn.Module):
    """Auxiliary K-slot head: x -> Linear-GELU-Linear -> [B, K, dim_out], each slot L2-normalised."""

    def __init__(self, dim_in: int, dim_out: int, k: int, hidden: int):
        super().__init__()
        self.k, self.dim_out = k, dim_out
        self.net = nn.Sequential(nn.Linear(dim_in, hidden), nn.GELU(), nn.Linear(hidden, k * dim_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x).view(x.shape[0], self.k, self.dim_out), dim=-1)


class WithSlots(nn.Module):
    """Wraps a model: adds out["slots"] in training mode only; delegates the optional hooks to `inner`."""

    def __init__(self, inner: nn.Module, slots: SlotHead):
        super().__init__()
        self.inner, self.slots = inner, slots

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.inner(x)
        if self.training:
            out["slots"] = self.slots(x)
        return out

    def param_groups(self) -> list[tuple[str, list[nn.Parameter], float]]:
        """The inner groups with the slot params joined to the first group at multiplier 1.0 (else a new group)."""
        inner_groups = getattr(self.inner, "param_groups", None)
        groups = inner_groups() if inner_groups else [("main", list(self.inner.parameters()), 1.0)]
        slot_params = list(self.slots.parameters())
        main = next((i for i, g in enumerate(groups) if g[2] == 1.0), None)
        if main is None:
            return [*groups, ("slots", slot_params, 1.0)]
        name, params, mult = groups[main]
        return [*groups[:main], (name, [*params, *slot_params], mult), *groups[main + 1:]]

    def on_epoch_start(self, epoch: int) -> None:
        hook = getattr(self.inner, "on_epoch_start", None)
        if hook is not None:
            hook(epoch)

    def on_epoch_end(self, epoch: int, val_metric: float) -> None:
        hook = getattr(self.inner, "on_epoch_end", None)
        if hook is not None:
            hook(epoch, val_metric)


def build_model(cfg: Config, ctx: ModelContext) -> nn.Module:
    """cfg.model.kind from MODELS, wrapped with the slot head when cfg.slots.k > 0, on ctx.device (if given)."""
    model = MODELS.get(cfg.model.kind)(cfg, ctx)
    if cfg.slots.k > 0:
        head = init_linears(SlotHead(ctx.dim_in, ctx.dim_out, cfg.slots.k, cfg.slots.hidden), cfg.model.init)
        model = WithSlots(model, head)
    return model if ctx.device is None else model.to(ctx.device)
