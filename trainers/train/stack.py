"""The stacked parameters of a population and its one forward for all members (torch.func.vmap over a template).

Each member keeps its own modules, optimiser, schedule, scaler, average and criterion
(latentsweep.trainers.train.run.RunState): its
nn.Parameters and buffers become views of slice k of one leaf tensor per name [K, ...] (`bind`), so the optimiser,
keyed by the Parameter object, steps the stack in place and survives a re-stack when members leave or join. The
forward is `functional_call(template, stacked tensors)` under `vmap` over the member dimension: batched matmuls,
one backward for all. Gradients stay per slice (no op mixes members), and each member's .grad is a view of its
slice of the stacked grad (`grads_to`).

Dropout draws from the global RNG inside the forward, which vmap cannot give per member: the template's nn.Dropout
modules multiply by a mask drawn beforehand from each member's own RNG state, with F.dropout on a ones tensor of the
shape, dtype and device the layer sees (found by one probe forward), so the RNG is consumed as in the member's own
forward and the mask is the noise F.dropout multiplies by.
"""
from __future__ import annotations

import copy
from dataclasses import astuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, vmap

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.losses import batch_keys

# Model kinds whose forward is the same Python code for every member of a shape group (no data-dependent control
# flow, no buffer written in the forward): the MLP family, the geometry adapter and the relative model. knn trains
# nothing; a plugin's model is unknown to this list and trains alone.
STACKABLE_KINDS = frozenset({"linear", "mlp", "deep_mlp", "moco_mlp", "residual_mlp", "two_head", "geometry",
                             "relative"})


def stack_key(cfg: Config) -> tuple | None:
    """Members whose keys are equal may share one stacked step; None: this config trains alone
    (latentsweep.trainers.train.loop.train).

    The key holds everything that shapes the template's forward (the model's structural knobs, the slot head), the
    shared task's batches and validation (data, eval, batch size, sampler, the all-images bank and its scale) and
    the device, precision and threads. What only changes values (learning rate, weight decay, schedule, epochs,
    seeds, dropout rates, init, losses and their weights, temperature, averaging, augmentation) may differ."""
    m, t = cfg.model, cfg.train
    if (m.kind not in STACKABLE_KINDS or cfg.data.task != "translate" or m.norm == "batchnorm"
            or t.capture != "none" or cfg.plugins.files):
        # multilabel: its batches embed the training set with the live model (step_hard) and its step calls the
        # model up to three times; batchnorm writes running statistics in the forward; capture compiles one run.
        return None
    model = (m.kind, tuple(m.hidden), m.activation, m.norm, m.residual, m.out_norm, m.bias, m.out_dim, m.n_anchors,
             m.anchor_mix, m.adapter_hidden)
    slots = (cfg.slots.k, cfg.slots.hidden if cfg.slots.k else 0)
    bank = "bank" in batch_keys(cfg)  # the task holds the all-images bank at the losses' target scale
    batches = (t.batch_size, t.sampler, bank, cfg.loss.targets if bank else None)
    return ("stack", model, slots, astuple(cfg.data), astuple(cfg.eval), batches, t.device, t.amp, t.threads)


class MaskDropout(nn.Module):
    """nn.Dropout's place in the template: x times a mask drawn before the forward (per member, [B, width])."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.empty(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.mask


class NotStackable(Exception):
    """The model's forward cannot run stacked (found by the probe): its members train alone."""


class Stack:
    """The template, the stacked tensors of the members bound to it, and the stacked forward.

    `model` is one member's CenteredModel (its structure; its values are not used); `batch_size` and `dim_in` the
    training batch's shape; `amp` autocast as the loop's step uses it."""

    def __init__(self, model: nn.Module, device: torch.device, amp: bool, batch_size: int, dim_in: int):
        self.device, self.amp = device, amp
        # [(name, width, dtype)] in call order; output key -> the parameters it depends on
        self.dropouts, self.reach = _probe(model, device, amp, batch_size, dim_in)
        self.template = copy.deepcopy(model).train()
        for name, _, _ in self.dropouts:
            parent, _, leaf = name.rpartition(".")
            setattr(self.template.get_submodule(parent), leaf, MaskDropout())
        for name, buf in self.template.named_buffers():
            if not buf.is_floating_point() and not name.endswith(".mask"):
                raise NotStackable(f"integer buffer {name}")
        self.params: dict[str, torch.Tensor] = {}  # name -> leaf [K, ...]
        self.named: list[list[tuple[str, nn.Parameter]]] = []
        self.drops: list[list[nn.Module]] = []  # member k's nn.Dropout modules, in self.dropouts' order
        self.reached: dict[frozenset, set[str]] = {}  # output keys read -> the parameter names they reach
        self.buffers: dict[str, torch.Tensor] = {}  # name -> [K, ...]
        self.forward_all = vmap(self._one, in_dims=(0, 0))

    def _one(self, tensors: dict[str, torch.Tensor], x: torch.Tensor) -> dict[str, torch.Tensor]:
        return functional_call(self.template, tensors, (x,))

    def bind(self, models: list[nn.Module]) -> None:
        """Stack the members' current parameters and buffers (a copy) and make each member's tensors views of its
        slice k, keeping their objects (the optimiser's state is keyed by the Parameter)."""
        own = [(dict(m.named_parameters()), dict(m.named_buffers())) for m in models]
        self.named = [list(params.items()) for params, _ in own]  # member k's (name, Parameter): grads_to
        self.drops = [[m.get_submodule(name) for name, _, _ in self.dropouts] for m in models]  # draw_masks
        with torch.no_grad():
            self.params = {n: torch.stack([p[n].detach() for p, _ in own]).requires_grad_(True) for n in own[0][0]}
            self.buffers = {n: torch.stack([b[n] for _, b in own]) for n in own[0][1]}
        for k, (params, buffers) in enumerate(own):
            for n, p in params.items():
                p.data = self.params[n].data[k]
            for n, b in buffers.items():
                b.data = self.buffers[n][k]

    @staticmethod
    def release(model: nn.Module) -> None:
        """The member leaves: its parameters and buffers get their own storage again (the stack may be freed)."""
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()

    def draw_masks(self, k: int, batch: int) -> list[torch.Tensor]:
        """Member k's dropout masks [B, width] in its forward's call order, drawn from the global RNG as its own
        forward draws them, each at its own module's rate (call with the member's RNG state in place)."""
        masks = []
        for (_, width, dtype), module in zip(self.dropouts, self.drops[k]):
            ones = torch.ones(batch, width, dtype=dtype, device=self.device)
            masks.append(F.dropout(ones, module.p, training=True))
        return masks

    def forward(self, x: torch.Tensor, masks: list[list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Every member's training outputs {"pred", "raw"[, "slots"]} [K, B, ...] for x [K, B, D_in], `masks[k]`
        member k's masks (draw_masks)."""
        tensors = {**self.params, **self.buffers}
        for i, (name, _, _) in enumerate(self.dropouts):
            tensors[f"{name}.mask"] = torch.stack([m[i] for m in masks])  # [K, B, width]
        with torch.autocast(self.device.type, enabled=self.amp):
            return self.forward_all(tensors, x)

    def zero_grad(self) -> None:
        for leaf in self.params.values():
            leaf.grad = None

    def reached_names(self, used: set[str]) -> set[str]:
        """The names of the parameters that the outputs `used` depend on (what a backward from them reaches)."""
        key = frozenset(used)
        if key not in self.reached:
            self.reached[key] = set().union(*(self.reach.get(name, ()) for name in used))
        return self.reached[key]

    def grads_to(self, k: int, used: set[str]) -> None:
        """Member k's .grad: views of its slice of the stacked grads, for the parameters its own backward reaches:
        those the outputs its loss read (`used`) depend on and that it trains now. The others get None, as in its
        own backward (a frozen one, or the slot head under a loss that reads no slot): its optimiser then skips them,
        weight decay and moments included, where a zero grad would step them."""
        reached = self.reached_names(used)
        for n, p in self.named[k]:
            g = self.params[n].grad
            p.grad = g[k] if (p.requires_grad and g is not None and n in reached) else None


def _probe(model: nn.Module, device: torch.device, amp: bool, batch: int, dim_in: int) \
        -> tuple[list[tuple[str, int, torch.dtype]], dict[str, set[str]]]:
    """From one training forward of a copy on zeros, with the RNG forked (nothing of the caller's RNG is consumed):
    (name, width, dtype) of every nn.Dropout in the order the forward calls it, and for each output key the names of
    the parameters it depends on."""
    probe = copy.deepcopy(model).train()
    seen: list[tuple[str, int, torch.dtype]] = []
    for name, mod in probe.named_modules():
        if isinstance(mod, nn.Dropout):
            mod.register_forward_pre_hook(
                lambda _m, args, name=name: seen.append((name, args[0].shape[-1], args[0].dtype)))
        elif isinstance(mod, nn.modules.dropout._DropoutNd):
            raise NotStackable(f"{type(mod).__name__} at {name}")
    devices = [device] if device.type == "cuda" else []
    params = dict(probe.named_parameters())
    for p in params.values():
        p.requires_grad_(True)  # a frozen one (geometry's base) too: reachable is structural
    with torch.random.fork_rng(devices=devices), torch.autocast(device.type, enabled=amp):
        out = probe(torch.zeros(batch, dim_in, device=device))
    reach = {}
    for key, value in out.items():
        grads = torch.autograd.grad(value.float().sum(), list(params.values()), allow_unused=True, retain_graph=True)
        reach[key] = {n for n, g in zip(params, grads) if g is not None}
    names = [n for n, _, _ in seen]
    if len(set(names)) != len(names):
        raise NotStackable("a dropout module called twice in one forward")
    return seen, reach
