"""The stacked optimiser (latentsweep.trainers.train.stacked_optim) steps each member of a stack as its own torch
Adam/AdamW, GradScaler, clip_grad_norm_ and EMA step it alone: per-member learning rates, weight decay (0 included,
Adam's coupled one too), clipping, step counts of members that joined late, grads that are None for a member (an
unreached head, a frozen layer), a found-inf member under AMP skipping alone; its state stays readable as each
member's own torch objects, and a member that leaves gets its own storage back."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from latentsweep.trainers.train.regularise import EMA, WeightAverage
from latentsweep.trainers.train.stack import Stack
from latentsweep.trainers.train.stacked_optim import Slot, StackedOptim, uncovered

STEPS = 6
DIM_IN = 6


class Net(nn.Module):
    """A trunk, a "pred" head and a "slots" head: a member whose loss reads only "pred" gets no grad on "head"."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(DIM_IN, 8)
        self.out = nn.Linear(8, 5)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return {"pred": self.out(h), "slots": self.head(h)}


@dataclass
class Spec:
    """One member: its optimiser, clipping, EMA, the outputs its loss reads, a frozen trunk, steps taken alone
    before it joins the stack."""
    adam: type = torch.optim.AdamW
    lr: float = 1e-2
    wd: float = 0.0
    clip: float = 0.0
    ema: bool = False
    reads: tuple = ("pred", "slots")
    frozen: bool = False
    before: int = 0
    tau: bool = False  # a parameter outside the model in its optimiser (a learnable temperature)


SPECS = [Spec(lr=1e-2, wd=0.01, clip=0.05, ema=True),  # clipped most steps
         Spec(lr=3e-3, wd=0.0, reads=("pred",), tau=True),  # its head gets no grad: not decayed, no moments
         Spec(adam=torch.optim.Adam, lr=5e-3, wd=0.1, clip=10.0, ema=True),  # Adam's coupled decay
         Spec(lr=2e-2, wd=0.05, frozen=True, before=3)]  # joins with 3 steps taken, its trunk frozen


class _Cfg:
    class train:
        ema_decay = 0.9


def _slot(spec: Spec, seed: int, fused: bool, amp: bool) -> Slot:
    torch.manual_seed(seed)
    model = Net()
    groups = [{"params": list(model.parameters())}]
    if spec.tau:  # outside the model, as a criterion's learnable temperature: not stacked
        groups.append({"params": [nn.Parameter(torch.ones(()))], "weight_decay": 0.0})
    opt = spec.adam(groups, lr=spec.lr, weight_decay=spec.wd, fused=fused, foreach=False if not fused else None)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2, enabled=amp)
    average = EMA(_Cfg, model) if spec.ema else WeightAverage(_Cfg, model)
    return Slot(model, opt, scaler, average, spec.clip)


def _tau(slot: Slot) -> nn.Parameter | None:
    groups = slot.opt.param_groups
    return groups[1]["params"][0] if len(groups) > 1 else None


def _grads(model: nn.Module, spec: Spec, gen: torch.Generator, scale: float, inf: bool) -> dict[str, torch.Tensor]:
    """Member grads as its own backward leaves them (None where it does not reach), times its loss scale; "tau":
    its parameter outside the model."""
    out = {"tau": torch.randn((), generator=gen) * scale} if spec.tau else {}
    for name, p in model.named_parameters():
        reached = name.startswith(("trunk", "out")) if spec.reads == ("pred",) else True
        if reached and p.requires_grad:
            out[name] = torch.randn(p.shape, generator=gen) * 0.1 * scale
    if inf:
        out["tau" if spec.tau else "out.weight"].view(-1)[0] = float("inf")
    return out


def _step_alone(slot: Slot, grads: dict[str, torch.Tensor]) -> None:
    """latentsweep.trainers.train.loop._train_epoch's step after the backward (scale(): the loss's scaling, which
    creates the scale at the first step)."""
    slot.scaler.scale(torch.zeros(()))
    for name, p in slot.model.named_parameters():
        p.grad = grads[name].clone() if name in grads else None
    if _tau(slot) is not None:
        _tau(slot).grad = grads["tau"].clone()
    if slot.max_norm > 0:
        slot.scaler.unscale_(slot.opt)
        torch.nn.utils.clip_grad_norm_(slot.model.parameters(), slot.max_norm)
    slot.scaler.step(slot.opt)
    slot.scaler.update()
    slot.average.after_step()


def _pair(fused: bool, amp: bool):
    """(stacked slots, their stack and optimiser, alone slots): the same members twice, each pre-stepped alone."""
    gen = torch.Generator().manual_seed(7)
    slots, alone = [], []
    for k, spec in enumerate(SPECS):
        a, b = _slot(spec, k, fused, amp), _slot(spec, k, fused, amp)
        for s in (a, b):
            s.model.trunk.requires_grad_(not spec.frozen)
        for _ in range(spec.before):
            grads = _grads(a.model, spec, gen, a.scaler.get_scale() if amp else 1.0, False)
            _step_alone(a, grads)
            _step_alone(b, grads)
        slots.append(a)
        alone.append(b)
    stack = Stack(slots[0].model, torch.device("cpu"), False, 4, DIM_IN)
    stack.bind([s.model for s in slots])
    return slots, stack, alone, gen


def _same(slot: Slot, alone: Slot) -> None:
    """The same bits: parameters, optimiser state (step counts included), scale and growth tracker, EMA copy."""
    tol = {"rtol": 0, "atol": 0}
    torch.testing.assert_close(dict(slot.model.named_parameters()), dict(alone.model.named_parameters()), **tol)
    torch.testing.assert_close(_tau(slot), _tau(alone), **tol)
    s, a = slot.opt.state_dict(), alone.opt.state_dict()
    assert s["state"].keys() == a["state"].keys()  # a parameter never stepped has no state, as alone
    torch.testing.assert_close(s["state"], a["state"], **tol)
    if slot.scaler.is_enabled():
        assert slot.scaler.get_scale() == alone.scaler.get_scale()
        assert int(slot.scaler._growth_tracker) == int(alone.scaler._growth_tracker)
    if isinstance(slot.average, EMA):
        assert slot.average.n == alone.average.n
        torch.testing.assert_close(slot.average.avg.state_dict(), alone.average.avg.state_dict(), **tol)


def _step_stacked(optim: StackedOptim, stack: Stack, slots: list[Slot], per_member: list[dict]) -> None:
    """The population's step after its shared backward: the stacked grads, each member's grads outside the model,
    the stacked step, then each member's own step of those (latentsweep.trainers.train.population_step)."""
    for name, leaf in stack.params.items():
        leaf.grad = torch.stack([g.get(name, torch.zeros(leaf.shape[1:])) for g in per_member])
    for slot, grads in zip(slots, per_member):
        if _tau(slot) is not None:
            _tau(slot).grad = grads["tau"].clone()
    optim.step({k: stack.reached_names(set(spec.reads)) for k, spec in enumerate(SPECS)})
    for k in range(len(slots)):
        if optim.extras[k]:
            optim.step_extras(k)


# Under AMP: (member, step) whose grads hold an inf, member 1's in its parameter outside the model.
INFS = {(2, 3), (1, 4)}


@pytest.mark.parametrize("adam,amp", [("kernel", False), ("kernel", True), ("math", False), ("math", True)])
def test_each_member_steps_as_its_own_optimiser_scaler_clip_and_ema(adam, amp):
    """"kernel" against fused torch optimisers, "math" against single-tensor ones: the same bits; under AMP a
    member whose grads hold an inf (INFS) alone skips that step, model and temperature, and backs its scale off."""
    slots, stack, alone, gen = _pair(fused=adam == "kernel", amp=amp)
    optim = StackedOptim(stack, adam)
    optim.bind(slots)
    for s in slots:
        s.average.rebind(s.model)
    skipped = []
    for step in range(STEPS):
        per_member = [_grads(s.model, spec, gen, s.scaler.get_scale() if amp else 1.0, amp and (k, step) in INFS)
                      for k, (s, spec) in enumerate(zip(alone, SPECS))]
        before = [copy.deepcopy([*s.model.parameters(), *([_tau(s)] if _tau(s) is not None else [])])
                  for s in slots]
        for k, grads in enumerate(per_member):
            _step_alone(alone[k], grads)
        _step_stacked(optim, stack, slots, per_member)
        for k, s in enumerate(slots):
            if amp and (k, step) in INFS:
                skipped.append(k)
                torch.testing.assert_close([*s.model.parameters(), *([_tau(s)] if _tau(s) is not None else [])],
                                           before[k], rtol=0, atol=0)
        for s, a in zip(slots, alone):
            _same(s, a)
    assert "head.weight" not in {n for n, p in slots[1].model.named_parameters() if p in slots[1].opt.state}
    assert not amp or sorted(skipped) == [1, 2]
    assert not amp or max(slots[1].scaler.get_scale(), slots[2].scaler.get_scale()) < slots[0].scaler.get_scale()


def test_a_member_leaving_gets_its_own_storage_and_keeps_its_state():
    slots, stack, alone, gen = _pair(fused=True, amp=False)
    optim = StackedOptim(stack)
    optim.bind(slots)
    _step_stacked(optim, stack, slots, [_grads(s.model, spec, gen, 1.0, False) for s, spec in zip(slots, SPECS)])
    kept = copy.deepcopy(slots[0].opt.state_dict())
    Stack.release(slots[0].model)
    StackedOptim.release(slots[0])
    for t in [*optim.exp_avg, *optim.exp_avg_sq, optim.steps, *optim.ema_avg]:
        t.zero_()
    torch.testing.assert_close(slots[0].opt.state_dict(), kept, rtol=0, atol=0)
    assert all(float(st["step"]) > 0 for st in slots[0].opt.state.values())
    assert any(float(t.abs().sum()) > 0 for t in slots[0].average.avg.state_dict().values())


def test_a_member_rebound_continues_from_its_own_state():
    """Binding again (members left or joined) gathers each member's state from its own torch objects."""
    slots, stack, alone, gen = _pair(fused=True, amp=False)
    optim = StackedOptim(stack)
    for step in range(3):
        stack.bind([s.model for s in slots])  # a re-stack every step: the state must follow the members
        optim.bind(slots)
        for s in slots:
            s.average.rebind(s.model)
        per_member = [_grads(a.model, spec, gen, 1.0, False) for a, spec in zip(alone, SPECS)]
        for k, grads in enumerate(per_member):
            _step_alone(alone[k], grads)
        _step_stacked(optim, stack, slots, per_member)
    for s, a in zip(slots, alone):
        _same(s, a)


def test_configurations_it_does_not_cover_keep_their_own_step():
    model = Net()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    plain = Slot(model, torch.optim.AdamW(model.parameters()), scaler, WeightAverage(_Cfg, model), 0.0)
    assert uncovered(plain) is None
    sgd = Slot(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler, plain.average, 0.0)
    assert "SGD" in uncovered(sgd)
    ams = Slot(model, torch.optim.Adam(model.parameters(), amsgrad=True), scaler, plain.average, 0.0)
    assert "amsgrad" in uncovered(ams)
    tau = nn.Parameter(torch.zeros(()))
    extra = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [tau]}])
    assert uncovered(Slot(model, extra, scaler, plain.average, 0.0)) is None  # stepped by its own optimiser
    amp = torch.amp.GradScaler("cpu", enabled=True)
    assert uncovered(Slot(model, extra, amp, plain.average, 0.0)) is None
    with pytest.raises(ValueError):
        StackedOptim(Stack(model, torch.device("cpu"), False, 4, DIM_IN), "sgd")
