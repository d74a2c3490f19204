"""One Adam/AdamW step for every member of a population's stack (latentsweep.trainers.train.stack): per-member
hyperparameters, step counts, the grad-None rule, AMP scaler, grad clipping and EMA over the stacked [K, ...] leaves.

Per step, the members' own `torch.optim.Adam`/`AdamW`, `GradScaler`, `clip_grad_norm_` and EMA (what
latentsweep.trainers.train.loop._train_epoch runs per member) are replaced by a fixed number of ops per leaf for all
K members: per-member values (learning rate as the member's schedule left it in its param group, weight decay,
betas, eps, bias corrections, clip norm, loss scale, EMA weight) are [K] columns of one table, broadcast over the
member dimension. A member that does not step a leaf (its grad would be None: frozen, or unreached by the outputs its
loss reads; or a skipped AMP step) gets weight 0 and a zeroed grad row, which leaves its parameter and moments
unchanged to the bit, as torch's optimiser skips a None grad.

Source of truth: as the stack makes each member's Parameters views of its slice, `bind` makes each member's own
optimiser state (exp_avg, exp_avg_sq, step), its scaler's scale and growth tracker and its EMA copy views of slice k
of stacked tensors. The member's torch objects therefore stay readable (state_dict) at every moment, and `release`
(a member leaving) gives them their own storage back, so nothing converts between two representations. Writing a
member's state (opt.load_state_dict replaces its tensors) while it is bound is seen by the stacked step only after
the next `bind`, which gathers every member's state from its own objects.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from latentsweep.trainers.train.regularise import EMA, SWA, WeightAverage

# torch.nn.utils.clip_grad_norm_'s coefficient: max_norm / (total_norm + 1e-6)
CLIP_EPS = 1e-6
# Fields of the host table, [F, L, K]: per leaf l and member k, from member k's param group of that leaf.
HYPER = ("lr", "wd_decoupled", "wd_l2", "beta1", "beta2", "eps")
# Rows of the coefficient table, [C, L, K], in the order torch's fused CPU Adam kernel (FusedAdamKernel.cpp) applies
# its float32 scalars, so a member's update is the same float arithmetic as its own optimiser's:
#   g += l2 p;  p *= decay;  m.lerp_(g, w1);  v = v b2 + (c2 g) g;  d = sqrt(v) / bc2s + eps;  p += (neg_size m) / d
COEFFS = ("l2", "decay", "w1", "b2", "c2", "bc2s", "eps", "neg_size")


# How the Adam update runs over the stack (everything else, found-inf, unscale, clipping, step counts, scaler update
# and EMA, is stacked either way):
# - "kernel" (the default): torch's own fused Adam kernel (torch._fused_adam_/_fused_adamw_, what a member's fused
#   optimiser calls) once per member and param group on the member's slice views: the same bits as the member alone
#   on the same device, one op per member, one pass over its memory. A chaotic parameter (two_head's scale row,
#   whose grad is float noise that Adam normalises to a full step) turns any rounding difference into another
#   trajectory, so bit-equality is what keeps a member's run the same as alone.
# - "math": the [K]-column update (COEFFS), a fixed number of ops per leaf for all K members, whatever K. Its float32
#   arithmetic is torch's single-tensor/foreach Adam's (the same bits, tests/test_stacked_optim.py); torch's fused
#   kernels contract some of it into FMAs, so it agrees with a fused member to float rounding only. About 11 passes
#   over [K, ...] tensors instead of one: it wins where launches bound the step (small layers), loses where memory
#   bandwidth does (docs/gpu.md, "Stacked optimiser").
ADAM_BACKENDS = ("math", "kernel")


@dataclass(frozen=True)
class Slot:
    """What the stacked step needs of one member (latentsweep.trainers.train.run.StepParts)."""
    model: nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    average: WeightAverage
    max_norm: float  # train.grad_clip: 0 is no clipping


def uncovered(slot: Slot) -> str | None:
    """Why this member's optimiser configuration is not one the stacked step computes exactly (None: it is).
    Such a member keeps its own per-member step."""
    opt = slot.opt
    if type(opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"optimiser {type(opt).__name__}"
    for g in opt.param_groups:
        if g.get("amsgrad") or g.get("maximize") or g.get("differentiable"):
            return "amsgrad, maximize or differentiable"
        if any(isinstance(g[key], torch.Tensor) for key in ("lr", "weight_decay", "eps")) or \
                any(isinstance(b, torch.Tensor) for b in g["betas"]):
            return "a tensor hyperparameter"
    grouped = [id(p) for g in opt.param_groups for p in g["params"]]
    model = [id(p) for p in slot.model.parameters()]
    if len(set(grouped)) != len(grouped) or not set(model) <= set(grouped):
        return "a model parameter in no param group, or in two"
    if type(slot.average) not in (WeightAverage, EMA, SWA):
        return f"weight average {type(slot.average).__name__}"
    if isinstance(slot.average, EMA) and slot.average.others:
        return "an EMA over non-float state"
    if type(slot.scaler) is not torch.amp.GradScaler:
        return f"scaler {type(slot.scaler).__name__}"
    return None


def coefficients(xp, on, hyper, steps):
    """The [C, L, K] coefficient table (COEFFS) from `on` [L, K] (1: member k steps leaf l now), `hyper` [F, L, K]
    (HYPER) and `steps` [L, K] (the step count after this step), in double as torch computes them; `xp` is numpy
    (host) or torch (device): one formula for both. A member not stepping gets the identity: l2 0, decay 1, w1 0,
    b2 1, c2 0, bc2s 1, eps 1, neg_size 0 (p, m and v unchanged to the bit for a finite zeroed grad)."""
    lr, wd_dec, wd_l2, b1, b2, eps = hyper
    live = on > 0
    bc1 = xp.where(live, 1 - b1 ** steps, 1.0)  # Adam's bias corrections
    bc2 = xp.where(live, 1 - b2 ** steps, 1.0)
    return xp.stack([wd_l2 * on, xp.where(live, 1 - lr * wd_dec, 1.0), (1 - b1) * on, xp.where(live, b2, 1.0),
                     (1 - b2) * on, xp.sqrt(bc2), xp.where(live, eps, 1.0), -(lr / bc1) * on])


class StackedOptim:
    """The stacked optimiser state of the members bound to `stack` and its one step for all of them."""

    def __init__(self, stack, adam: str = "auto"):
        # adam: how the Adam update itself runs (ADAM_BACKENDS); "auto": "kernel"
        if adam not in ("auto", *ADAM_BACKENDS):
            raise ValueError(f"adam must be auto or one of {ADAM_BACKENDS}, not {adam!r}")
        self.stack = stack
        self.adam = "kernel" if adam == "auto" else adam
        self.slots: list[Slot | None] = []

    def bind(self, slots: list[Slot | None]) -> None:
        """After stack.bind: gather each member's optimiser state, scaler and EMA copy (slots[k], None: member k
        is not covered) into stacked tensors and make the member's own tensors views of slice k."""
        stack, self.slots = self.stack, slots
        leaves = list(stack.params.values())
        n_leaves, k_all, device = len(leaves), len(slots), leaves[0].device
        self.bshape = [(k_all,) + (1,) * (leaf.dim() - 1) for leaf in leaves]  # a [K] column against leaf l
        self.exp_avg = [torch.zeros_like(leaf) for leaf in leaves]  # [K, ...] each
        self.exp_avg_sq = [torch.zeros_like(leaf) for leaf in leaves]
        self.steps = torch.zeros(n_leaves, k_all, dtype=torch.float32, device=device)  # [L, K] torch's state["step"]
        self.started = np.zeros((n_leaves, k_all), dtype=bool)  # the member's torch state exists (stepped once)
        self.group = np.zeros((n_leaves, k_all), dtype=np.int64)  # index of leaf l's param group in member k
        self.extras: list[list] = [[] for _ in slots]  # member k's parameters outside the model (stepped by it)
        self.by_group: list[list[list[int]]] = [[] for _ in slots]  # member k's leaves of each of its param groups
        with torch.no_grad():
            for k, slot in enumerate(slots):
                if slot is not None:
                    self._gather(k, slot)
        for l, k in zip(*np.nonzero(self.started)):
            self._view(int(l), int(k))
        self.host_steps = self.steps.cpu().double().numpy().copy()  # [L, K] without AMP (no skipped step): exact
        self._bind_scalers(device)
        self._bind_ema(device)

    def _gather(self, k: int, slot: Slot) -> None:
        index = {id(p): g for g, group in enumerate(slot.opt.param_groups) for p in group["params"]}
        for l, (_, p) in enumerate(self.stack.named[k]):
            self.group[l, k] = index[id(p)]
            state = slot.opt.state.get(p)
            if state:
                self.exp_avg[l][k].copy_(state["exp_avg"])
                self.exp_avg_sq[l][k].copy_(state["exp_avg_sq"])
                self.steps[l, k] = state["step"]
                self.started[l, k] = True
        model = {id(p) for _, p in self.stack.named[k]}
        self.extras[k] = [p for group in slot.opt.param_groups for p in group["params"] if id(p) not in model]
        self.by_group[k] = [[l for l in range(len(self.stack.named[k])) if self.group[l, k] == g]
                            for g in range(len(slot.opt.param_groups))]

    def _view(self, l: int, k: int) -> None:
        """Member k's torch state of leaf l as views of the stacked tensors (created as torch creates it: at the
        leaf's first step)."""
        p = self.stack.named[k][l][1]
        self.slots[k].opt.state[p].update(exp_avg=self.exp_avg[l][k], exp_avg_sq=self.exp_avg_sq[l][k],
                                          step=self.steps[l, k])

    def _bind_scalers(self, device: torch.device) -> None:
        on = [k for k, s in enumerate(self.slots) if s is not None and s.scaler.is_enabled()]
        self.amp = bool(on)
        if not on:
            return
        k_all = len(self.slots)
        self.scale = torch.ones(k_all, dtype=torch.float32, device=device)
        self.tracker = torch.zeros(k_all, dtype=torch.int32, device=device)
        growth, backoff, interval = np.ones(k_all), np.ones(k_all), np.ones(k_all)
        for k in on:
            scaler = self.slots[k].scaler
            if scaler._scale is None:  # its first scale() call would create them: the same values
                scaler._lazy_init_scale_growth_tracker(device)
            self.scale[k] = scaler._scale.reshape(())
            self.tracker[k] = scaler._growth_tracker.reshape(())
            scaler._scale, scaler._growth_tracker = self.scale[k], self.tracker[k]
            growth[k], backoff[k], interval[k] = scaler._growth_factor, scaler._backoff_factor, \
                scaler._growth_interval
        self.growth, self.backoff, self.interval = (torch.tensor(a, dtype=torch.float64, device=device)
                                                   for a in (growth, backoff, interval))

    def _bind_ema(self, device: torch.device) -> None:
        """EMA members' averaged copies (their state dict's float entries: parameters and persistent buffers) as
        views of [K, ...] tensors, blended in one op per entry; the rows of other members are unused zeros."""
        rows = [k for k, s in enumerate(self.slots) if s is not None and isinstance(s.average, EMA)]
        self.ema_live, self.ema_avg = [], []
        if not rows:
            return
        live = {**self.stack.params, **self.stack.buffers}
        keys = [n for n, t in self.slots[rows[0]].model.state_dict().items() if t.is_floating_point()]
        self.ema_avg = [torch.zeros_like(live[n], requires_grad=False) for n in keys]
        self.ema_live = [live[n] for n in keys]
        for k in rows:
            avg = self.slots[k].average.avg
            own = {**dict(avg.named_parameters()), **dict(avg.named_buffers())}
            for n, stacked in zip(keys, self.ema_avg):
                stacked[k].copy_(own[n].detach())
                own[n].data = stacked[k]

    @staticmethod
    def release(slot: Slot) -> None:
        """The member leaves the stack: its optimiser state, scaler and EMA copy get their own storage again."""
        for state in slot.opt.state.values():
            for key in ("exp_avg", "exp_avg_sq", "step"):
                if key in state:
                    state[key] = state[key].clone()
        if slot.scaler.is_enabled() and slot.scaler._scale is not None:
            slot.scaler._scale = slot.scaler._scale.clone()
            slot.scaler._growth_tracker = slot.scaler._growth_tracker.clone()
        if isinstance(slot.average, EMA):
            for t in [*slot.average.avg.parameters(), *slot.average.avg.buffers()]:
                t.data = t.data.clone()

    def _hyper(self, stepping: dict[int, set[str]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(on [L, K], hyper [F, L, K], clip [K], ema weight [K]) of this step, from the members' param groups as
        their schedules left them (hyper only for the "math" backend: the kernel reads the groups itself); advances
        each EMA member's update count as its after_step would."""
        n_leaves, k_all = self.group.shape
        on = np.zeros((n_leaves, k_all), dtype=bool)
        hyper = np.zeros((len(HYPER), n_leaves, k_all))
        clip, ema = np.zeros(k_all), np.zeros(k_all)
        grads = np.array([leaf.grad is not None for leaf in self.stack.params.values()])
        for k, reached in stepping.items():
            slot = self.slots[k]
            on[:, k] = [p.requires_grad and n in reached for n, p in self.stack.named[k]]
            if self.adam == "math":
                hyper[:, :, k] = self._groups(slot)[self.group[:, k]].T
            clip[k] = slot.max_norm
            if isinstance(slot.average, EMA):
                ema[k] = 1.0 - slot.average.decay()
                slot.average.n += 1
        on &= grads[:, None]  # a leaf no member's loss reached has no stacked grad
        for l, k in zip(*np.nonzero(on & ~self.started)):  # torch creates a leaf's state at its first step
            self.started[l, k] = True
            self._view(int(l), int(k))
        return on, hyper, clip, ema

    @staticmethod
    def _groups(slot: Slot) -> np.ndarray:
        """[G, F]: the HYPER values of each of the member's param groups."""
        return np.array([[g["lr"], g["weight_decay"] if g["decoupled_weight_decay"] else 0.0,
                          0.0 if g["decoupled_weight_decay"] else g["weight_decay"], *g["betas"], g["eps"]]
                         for g in slot.opt.param_groups])

    def step(self, stepping: dict[int, set[str]]) -> None:
        """One optimiser step of each member k in `stepping` (k -> the parameter names its own backward reaches,
        latentsweep.trainers.train.stack.Stack.reached_names) over the stacked grads: unscale and found-inf (AMP),
        clip, Adam/AdamW, scaler update and EMA, as torch's objects would step each member."""
        on, hyper, clip, ema = self._hyper(stepping)
        device = self.steps.device
        leaves = list(self.stack.params.values())
        active = [l for l in range(len(leaves)) if on[l].any()]
        with torch.no_grad():
            if self.amp:
                live, found = self._unscale(stepping, on, leaves, active)
                self.steps.add_(live)
                coef = coefficients(torch, live.double(), torch.from_numpy(hyper).to(device),
                                    self.steps.double()).float() if self.adam == "math" else None
            elif self.adam == "math":
                self.host_steps += on
                steps = self.host_steps
                coef = torch.from_numpy(np.concatenate([coefficients(np, on.astype(float), hyper, steps),
                                                        steps[None]]).astype(np.float32)).to(device)
                self.steps.copy_(coef[-1])
                live = torch.from_numpy(on).to(device)
            else:  # the kernel reads only the step counts
                self.host_steps += on
                self.steps.copy_(torch.from_numpy(self.host_steps))
                coef, live = None, torch.from_numpy(on).to(device)
            grads = {l: self._masked(leaves[l].grad, live[l] > 0, on[l].all() and not self.amp, l) for l in active}
            if clip.any():
                self._clip(grads, torch.from_numpy(clip.astype(np.float32)).to(device))
            if not grads:
                pass
            elif self.adam == "math":
                self._adam(leaves, grads, coef, hyper)
            else:
                self._kernels(stepping, on, grads, found if self.amp else None)
            if ema.any():
                weight = torch.from_numpy(ema.astype(np.float32)).to(device)
                torch._foreach_lerp_(self.ema_avg, self.ema_live,
                                     [weight.view((-1,) + (1,) * (t.dim() - 1)) for t in self.ema_avg])
            if self.amp:
                self._update_scale(found, stepping)

    def _masked(self, grad: torch.Tensor, live: torch.Tensor, all_on: bool, l: int) -> torch.Tensor:
        """Leaf l's stacked grad with the rows of members not stepping it zeroed (their garbage, infs under AMP,
        must not reach their moments)."""
        return grad if all_on else torch.where(live.view(self.bshape[l]), grad, 0.0)

    def _unscale(self, stepping, on, leaves, active) -> tuple[torch.Tensor, torch.Tensor]:
        """AMP: each member's found-inf over its own grads (before unscaling, as GradScaler checks them), then its
        grads divided by its scale; returns (live [L, K]: on and not skipped, found [K])."""
        device = self.steps.device
        on_t = torch.from_numpy(on).to(device)
        bad = torch.zeros(len(self.slots), dtype=torch.bool, device=device)
        for l in active:
            rows = ~torch.isfinite(leaves[l].grad).reshape(len(self.slots), -1).all(dim=1)
            bad |= rows & on_t[l]
        inv = self.scale.double().reciprocal().float()  # GradScaler.unscale_'s inv_scale
        for k in stepping:  # parameters outside the model: checked and unscaled as GradScaler does, per member
            grads = [p.grad for p in self.extras[k] if p.grad is not None]
            if grads:
                found = torch.zeros(1, device=device)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv[k:k + 1])
                bad[k:k + 1] |= found > 0
        self.found = bad  # [K]: the member skips its whole step (step_extras too)
        live = on_t & ~bad
        for l in active:
            leaves[l].grad.mul_(inv.view(self.bshape[l]))
        return live.float(), bad

    def _clip(self, grads: dict[int, torch.Tensor], max_norm: torch.Tensor) -> None:
        """clip_grad_norm_ per member: the 2-norm of its per-leaf 2-norms over its own (reached) grads, then its
        grads times min(1, max_norm / (norm + CLIP_EPS)); members without clipping keep factor 1."""
        k_all = max_norm.shape[0]
        # [K, L]: each member's leaf norms contiguous, reduced as torch reduces the stack of one member's norms
        norms = torch.stack([torch.linalg.vector_norm(g.reshape(k_all, -1), dim=1) for g in grads.values()], dim=1)
        total = torch.linalg.vector_norm(norms, dim=1)  # [K]
        # float32 as torch computes max_norm / (total + 1e-6): a Python number over a tensor is reciprocal() * number
        factor = torch.where(max_norm > 0, torch.clamp((total + CLIP_EPS).reciprocal() * max_norm, max=1.0), 1.0)
        torch._foreach_mul_(list(grads.values()), [factor.view(self.bshape[l]) for l in grads])

    def _adam(self, leaves, grads: dict[int, torch.Tensor], coef: torch.Tensor, hyper: np.ndarray) -> None:
        """The Adam/AdamW update of the active leaves, every member at once (coef: COEFFS rows [L, K]), op for op
        as torch's fused CPU kernel computes one member's."""
        ls = list(grads)
        col = {name: [coef[i, l].view(self.bshape[l]) for l in ls] for i, name in enumerate(COEFFS)}
        params = [leaves[l] for l in ls]
        g = list(grads.values())
        if hyper[HYPER.index("wd_l2")].any():  # Adam's weight decay: grad + p wd
            g = [torch.addcmul(gi, p, w) for gi, p, w in zip(g, params, col["l2"])]
        if hyper[HYPER.index("wd_decoupled")].any():
            torch._foreach_mul_(params, col["decay"])
        m, v = [self.exp_avg[l] for l in ls], [self.exp_avg_sq[l] for l in ls]
        torch._foreach_lerp_(m, g, col["w1"])
        torch._foreach_mul_(v, col["b2"])
        torch._foreach_addcmul_(v, torch._foreach_mul(g, col["c2"]), g)
        denom = torch._foreach_sqrt(v)
        torch._foreach_div_(denom, col["bc2s"])
        torch._foreach_add_(denom, col["eps"])
        torch._foreach_addcdiv_(params, torch._foreach_mul(m, col["neg_size"]), denom)

    def _kernels(self, stepping: dict[int, set[str]], on: np.ndarray, grads: dict[int, torch.Tensor],
                 found: torch.Tensor | None) -> None:
        """The "kernel" backend: torch's fused Adam kernel per member and param group over its slices of the leaves
        it steps (as torch.optim.Adam._fused_adam calls it, the step counts already advanced; under AMP the kernel
        skips a member whose found-inf is set)."""
        skip = found.float() if found is not None else None
        for k in stepping:
            groups = self.slots[k].opt.param_groups
            for g, ls in enumerate(self.by_group[k]):
                ls = [l for l in ls if on[l, k]]
                if not ls:
                    continue
                group = groups[g]
                fused = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
                fused([self.stack.named[k][l][1] for l in ls], [grads[l][k] for l in ls],
                      [self.exp_avg[l][k] for l in ls], [self.exp_avg_sq[l][k] for l in ls], [],
                      [self.steps[l, k] for l in ls], amsgrad=False, lr=group["lr"], beta1=group["betas"][0],
                      beta2=group["betas"][1], weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
                      grad_scale=None, found_inf=skip[k:k + 1] if skip is not None else None)

    def step_extras(self, k: int) -> None:
        """Member k's parameters outside the model (a learnable temperature), after `step`: its own optimiser, whose
        model grads are None; under AMP its found-inf (model and extras) handed to its fused step as its scaler
        hands it, so it skips them when the stacked step skipped the rest."""
        opt = self.slots[k].opt
        if not self.amp:
            opt.step()
        elif getattr(opt, "_step_supports_amp_scaling", False):  # fused: it skips on found_inf, no host sync
            opt.grad_scale, opt.found_inf = None, self.found[k].float()  # grads already unscaled (_unscale)
            try:
                opt.step()
            finally:
                del opt.grad_scale, opt.found_inf
        elif not bool(self.found[k]):  # GradScaler's own host check for an optimiser that cannot skip itself
            opt.step()

    def _update_scale(self, found: torch.Tensor, stepping: dict[int, set[str]]) -> None:
        """GradScaler.update for each AMP member that stepped (torch._amp_update_scale_'s rule, per member):
        backoff on found-inf, growth after `interval` clean steps when the grown scale is finite."""
        device = self.scale.device
        mine = torch.zeros(len(self.slots), dtype=torch.bool, device=device)
        mine[[k for k in stepping if self.slots[k].scaler.is_enabled()]] = True
        scale = self.scale.double()
        tracked = self.tracker + 1
        grow = ~found & (tracked == self.interval.to(torch.int32))
        grown = (scale * self.growth).float()
        new = torch.where(found, (scale * self.backoff).float(),
                          torch.where(grow & torch.isfinite(grown), grown, self.scale))
        self.scale.copy_(torch.where(mine, new, self.scale))
        self.tracker.copy_(torch.where(mine, torch.where(found | grow, 0, tracked).to(torch.int32), self.tracker))
