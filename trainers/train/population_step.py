"""A population's stacked training step: each member's RNG, batch, loss and optimiser; one forward and backward for
all."""
from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from latentsweep.trainers.train.run import RunState, StepParts, TrainResult, now_past
from latentsweep.trainers.train.stacked_optim import Slot


@dataclass(eq=False)
class Live:
    """A member in the stack: its run, its RNG states, and the epoch in progress."""
    member: Any  # latentsweep.trainers.train.population.Member
    slot: int  # its place in the ends (the order members started)
    run: RunState
    best_pt: Any  # latentsweep.trainers.train.loop._BestCheckpoint
    rng: tuple  # (torch CPU, torch CUDA or None, numpy, random) states: its own
    batches: Iterator[dict] | None = None
    sums: dict = field(default_factory=dict)
    steps: int = 0
    cut: bool = False  # its deadline passed during this epoch: no more steps
    stacked: bool = False  # its optimiser steps in the stacked optimiser (stacked_optim.uncovered is None)
    end: TrainResult | BaseException | None = None


def rng_state(cuda: torch.device | None, full: bool) -> tuple:
    """The global RNG states a member owns: torch's CPU one, its CUDA device's (`cuda`, None on a CPU), and with
    `full` numpy's and Python's."""
    return (torch.get_rng_state(), torch.cuda.get_rng_state(cuda) if cuda is not None else None,
            np.random.get_state() if full else None, random.getstate() if full else None)


def _set_rng(state: tuple, cuda: torch.device | None) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], cuda)
    if state[2] is not None:
        np.random.set_state(state[2])
        random.setstate(state[3])


@contextlib.contextmanager
def own_rng(live: Live, cuda: torch.device | None, full: bool = True):
    """The member's global RNG state in place for the block, saved back after (`full`: numpy's and Python's too; a
    step needs only torch's: nothing in a step draws from the other two)."""
    _set_rng(live.rng if full else (*live.rng[:2], None, None), cuda)
    try:
        yield
    finally:
        now = rng_state(cuda, full)
        live.rng = now if full else (*now[:2], *live.rng[2:])


def stacked_step(pop, batches: list[dict | None]) -> None:
    """One training step of every member of `pop` (latentsweep.trainers.train.population._Population) with a batch
    (`batches[k]` for member k, None: it takes no step): what latentsweep.trainers.train.loop._train_epoch does per
    step, with the forward and the backward shared. A member's error ends it alone; an error of the shared forward or
    backward ends them all."""
    stack, cuda = pop.stack, pop.cuda
    inputs: list[dict | None] = [None] * len(batches)  # the augmented batches the losses train on
    masks: list[list[torch.Tensor] | None] = [None] * len(batches)
    for k, (lv, real) in enumerate(zip(pop.live, batches)):
        if real is None:
            continue
        p = lv.run.parts
        try:
            with own_rng(lv, cuda, full=False):
                if now_past(p.deadline):
                    lv.cut = True
                    continue
                p.criterion.set_progress((lv.run.epoch + lv.steps / p.steps) / p.cfg.train.epochs)
                inputs[k] = p.augment(real)
                masks[k] = stack.draw_masks(k, inputs[k]["x"].shape[0])
        except Exception as exc:  # noqa: BLE001 - this member's end
            inputs[k] = None
            pop.finish(lv, exc)
    active = [k for k, b in enumerate(inputs) if b is not None]
    if not active:
        return
    first = inputs[active[0]]
    # [K, B, D_in]: a member without a step this time fills its slice with zeros (its outputs are not read)
    x = torch.stack([b["x"] if b is not None else torch.zeros_like(first["x"]) for b in inputs])
    try:
        out = stack.forward(x, [m if m is not None else masks[active[0]] for m in masks])
    except Exception as exc:  # noqa: BLE001 - the shared forward: every member's end
        for k in active:
            pop.finish(pop.live[k], exc)
        return
    total, taken = None, {}
    for k in active:
        lv = pop.live[k]
        p = lv.run.parts
        try:
            with own_rng(lv, cuda, full=False):
                out_k = {name: v[k] for name, v in out.items()}  # member k's outputs [B, ...]
                loss, terms = p.criterion(out_k, inputs[k])
                if not lv.stacked or pop.optim.extras[k]:  # a stacked member's model grads are never set
                    p.opt.zero_grad(set_to_none=True)
                scaled = p.scaler.scale(loss)
                if not scaled.requires_grad:  # its own backward would raise this: it fails alone, as alone
                    raise RuntimeError("element 0 of tensors does not require grad and does not have a grad_fn")
        except Exception as exc:  # noqa: BLE001 - this member's end
            pop.finish(lv, exc)
            continue
        # A non-finite loss (a diverging member) enters the shared backward as 0: its own epoch mean still reports it
        # (TrainingDiverged at the epoch's end, as alone), and nothing of it can reach another member's slice.
        scaled = torch.where(torch.isfinite(scaled), scaled, torch.zeros_like(scaled))
        total = scaled if total is None else total + scaled
        taken[k] = (out_k, loss, terms, _reads(out_k))
    if total is None:
        return
    stack.zero_grad()
    try:
        total.backward()
    except Exception as exc:  # noqa: BLE001 - the shared backward: every member's end
        for k in taken:
            pop.finish(pop.live[k], exc)
        return
    _step_members(pop, taken, batches)


def _step_members(pop, taken: dict[int, tuple], batches: list[dict | None]) -> None:
    """After the shared backward: each member in `taken` (k -> its outputs, loss, terms and the outputs its loss read)
    stepped by its own optimiser, or with the others in the stacked one (latentsweep.trainers.train.stacked_optim)."""
    stack, cuda = pop.stack, pop.cuda
    stepping = {}
    for k, (out_k, loss, terms, used) in taken.items():
        lv = pop.live[k]
        if lv.end is None and lv.stacked:
            stepping[k] = stack.reached_names(used)
        elif lv.end is None:  # its own optimiser, first: the stacked step then reads the grads it leaves alone
            _after_backward(lv, k, stack, cuda, batches[k], (out_k, loss, terms, used), pop)
    if stepping:
        try:
            pop.optim.step(stepping)
        except Exception as exc:  # noqa: BLE001 - the shared optimiser step: its members' end
            for k in stepping:
                pop.finish(pop.live[k], exc)
            return
        for k in stepping:
            _after_stacked(pop.live[k], k, cuda, batches[k], taken[k], pop)


def slot_of(p: StepParts) -> Slot:
    """What the stacked optimiser (latentsweep.trainers.train.stacked_optim) steps of one member."""
    return Slot(p.model, p.opt, p.scaler, p.average, p.cfg.train.grad_clip)


def _after_stacked(lv: Live, k: int, cuda: torch.device | None, real: dict, taken: tuple, pop) -> None:
    """Member k (`lv`) after the stacked optimiser stepped it (clipping, scaler, optimiser and EMA included): its own
    optimiser for parameters outside the model (a learnable temperature: the model's grads are None there), its
    schedule, its loss state and its epoch sums."""
    p, (out_k, loss, terms, _) = lv.run.parts, taken
    try:
        with own_rng(lv, cuda, full=False):
            if pop.optim.extras[k]:
                pop.optim.step_extras(k)
            p.schedule.after_step()
            p.criterion.after_step(out_k, real)
    except Exception as exc:  # noqa: BLE001 - this member's end
        pop.finish(lv, exc)
        return
    _add_sums(lv, loss, terms)


def _reads(out: dict[str, torch.Tensor]) -> set[str]:
    """The keys of one member's outputs `out` its loss's backward reaches, filled by the shared backward: a hook on
    each output fires only when gradient flows into it (its own backward would reach it)."""
    used: set[str] = set()
    for key, value in out.items():
        if value.requires_grad:
            value.register_hook(lambda _grad, key=key: used.add(key))
    return used


def _after_backward(lv: Live, k: int, stack, cuda: torch.device | None, real: dict, taken: tuple, pop) -> None:
    """Member k's grads (views of its slice; `taken`: its outputs, loss, terms and the outputs its loss read), then
    its own clipping, optimiser, scaler, schedule, average and loss state, as
    latentsweep.trainers.train.loop._train_epoch runs them (the per-member path: a member the stacked optimiser
    does not cover)."""
    p, (out_k, loss, terms, used) = lv.run.parts, taken
    try:
        stack.grads_to(k, used)
        with own_rng(lv, cuda, full=False):
            if p.cfg.train.grad_clip > 0:
                p.scaler.unscale_(p.opt)
                torch.nn.utils.clip_grad_norm_(lv.run.model.parameters(), p.cfg.train.grad_clip)
            p.scaler.step(p.opt)
            p.scaler.update()
            p.schedule.after_step()
            p.average.after_step()
            p.criterion.after_step(out_k, real)
    except Exception as exc:  # noqa: BLE001 - this member's end
        pop.finish(lv, exc)
        return
    _add_sums(lv, loss, terms)


def _add_sums(lv: Live, loss: torch.Tensor, terms: dict) -> None:
    # Summed on the device: no host sync per step (the .item() happens once per epoch).
    for name, v in {"loss": loss.detach(), **terms}.items():
        lv.sums[name] = lv.sums.get(name, 0) + v.detach().float()
    lv.steps += 1
