"""A population's stacked training step (each member's RNG, batch, loss and optimiser; one forward and backward for
all) and the population size measured on the device."""
from __future__ import annotations

import contextlib
import random
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import numpy as np
import torch

from trainers.config import Config
from trainers.data import TrainSet
from trainers.run import RunState, TrainResult, now_past
from trainers.stack import stack_key, used_outputs

# Population size on a CPU: 1 (each trial trains alone). Measured on the 2-core machine of issue 38 with
# benchmarks/gpu.py --population-cpu (docs/gpu.md, "Population trials"): K = 4 stacked was no faster than 4 runs
# one after another, since one run's matmuls already use every core.
CPU_POPULATION = 1
# The share of the card's free memory a population may plan to use: the rest covers the allocator's fragmentation
# and the validation's blocks (trainers.tasks.EVAL_CHUNK rows), measured outside the training step.
MEMORY_SHARE = 0.8
# A doubled population is kept only when its summed samples per second gain at least this much: past that, the
# card is busy and more members only cost memory and make each trial slower.
MIN_GAIN = 1.15
MAX_POPULATION = 64  # the largest K population_size measures (issue 38's benchmark goes to 32)
MEASURE_STEPS = 5  # timed stacked steps per measured K, after one untimed step (allocator, kernels)


@dataclass(eq=False)
class Live:
    """A member in the stack: its run, its RNG states, and the epoch in progress."""
    member: Any  # trainers.population.Member
    slot: int  # its place in the ends (the order members started)
    run: RunState
    best_pt: Any  # trainers.loop._BestCheckpoint
    rng: tuple  # (torch CPU, torch CUDA or None, numpy, random) states: its own
    batches: Iterator[dict] | None = None
    sums: dict = field(default_factory=dict)
    steps: int = 0
    cut: bool = False  # its deadline passed during this epoch: no more steps
    end: TrainResult | BaseException | None = None


def rng_state(cuda: bool, full: bool) -> tuple:
    return (torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None,
            np.random.get_state() if full else None, random.getstate() if full else None)


def _set_rng(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
    if state[2] is not None:
        np.random.set_state(state[2])
        random.setstate(state[3])


@contextlib.contextmanager
def own_rng(live: Live, cuda: bool, full: bool = True):
    """The member's global RNG state in place for the block, saved back after (`full`: numpy's and Python's too; a
    step needs only torch's: nothing in a step draws from the other two)."""
    _set_rng(live.rng if full else (*live.rng[:2], None, None))
    try:
        yield
    finally:
        now = rng_state(cuda, full)
        live.rng = now if full else (*now[:2], *live.rng[2:])


def stacked_step(pop, batches: list[dict | None]) -> None:
    """One training step of every member of `pop` (trainers.population._Population) with a batch (`batches[k]`
    for member k, None: it takes no step): what trainers.loop._train_epoch does per step, with the forward and the
    backward shared. A member's error ends it alone; an error of the shared forward or backward ends them all."""
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
                masks[k] = stack.draw_masks(lv.run.model, inputs[k]["x"].shape[0])
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
                p.opt.zero_grad(set_to_none=True)
                scaled = p.scaler.scale(loss)
        except Exception as exc:  # noqa: BLE001 - this member's end
            pop.finish(lv, exc)
            continue
        # A non-finite loss (a diverging member) enters the shared backward as 0: its own epoch mean still reports it
        # (TrainingDiverged at the epoch's end, as alone), and nothing of it can reach another member's slice.
        scaled = torch.where(torch.isfinite(scaled), scaled, torch.zeros_like(scaled))
        total = scaled if total is None else total + scaled
        taken[k] = (out_k, loss, terms, used_outputs(loss, out_k))
    if total is None:
        return
    stack.zero_grad()
    try:
        total.backward()
    except Exception as exc:  # noqa: BLE001 - the shared backward: every member's end
        for k in taken:
            pop.finish(pop.live[k], exc)
        return
    for k, (out_k, loss, terms, used) in taken.items():
        lv = pop.live[k]
        if lv.end is None:
            _after_backward(lv, k, stack, cuda, batches[k], (out_k, loss, terms, used), pop)


def _after_backward(lv: Live, k: int, stack, cuda: bool, real: dict, taken: tuple, pop) -> None:
    """Member k's grads (views of its slice; `taken`: its outputs, loss, terms and the outputs its loss read), then its own clipping, optimiser, scaler, schedule, average and
    loss state, as trainers.loop._train_epoch runs them."""
    p, (out_k, loss, terms, used) = lv.run.parts, taken
    try:
        stack.grads_to(k, lv.run.model, used)
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
    # Summed on the device: no host sync per step (the .item() happens once per epoch).
    for name, v in {"loss": loss.detach(), **terms}.items():
        lv.sums[name] = lv.sums.get(name, 0) + v.detach().float()
    lv.steps += 1


def measure(cfg: Config, data: TrainSet, k: int, steps: int = MEASURE_STEPS) -> tuple[float, int]:
    """(seconds per stacked step, peak device bytes) of K members of `cfg` (seeds 0..K-1) over `steps` steps after
    one untimed step; bytes are CUDA's peak allocation (0 on a CPU)."""
    from trainers.population import Member, _Population  # the population builds its members; it imports this module

    pop = _Population(data, progress=False)
    for seed in range(k):
        if not pop.start(Member(replace(cfg, train=replace(cfg.train, seed=seed)))):
            raise ValueError("this config does not stack (stack_key is None)")
    for lv in pop.live:
        lv.run.begin_epoch()
        lv.run.model.train()
    cuda = pop.cuda
    if cuda:
        torch.cuda.synchronize(pop.device)
        torch.cuda.reset_peak_memory_stats(pop.device)
    n_batches = pop.task.steps_per_epoch()
    started = None
    for i in range(steps + 1):
        if i == 1:
            if cuda:
                torch.cuda.synchronize(pop.device)
            started = time.perf_counter()
        batches = []
        for lv in pop.live:
            if lv.batches is None or lv.steps % n_batches == 0:  # a new pass when the epoch's batches run out
                lv.batches = lv.run.task.batches(lv.run.parts.gen)
            batches.append(next(lv.batches))
        stacked_step(pop, batches)
    if cuda:
        torch.cuda.synchronize(pop.device)
    seconds = (time.perf_counter() - started) / max(steps, 1)
    peak = torch.cuda.max_memory_allocated(pop.device) if cuda else 0
    ended = [lv.end for lv in pop.live if isinstance(lv.end, BaseException)]
    if ended:
        raise ended[0]
    return seconds, peak


def population_size(cfg: Config, data: TrainSet, device: torch.device) -> int:
    """How many members of `cfg`'s shape group to train stacked on `device`: 1 when it does not stack, CPU_POPULATION
    on a CPU; on CUDA, from the measured peak memory of K = 1 and 2 (the second member's bytes: its parameters,
    optimiser state, average, best-state copy and activations) against the card's free memory, then K doubled while
    the measured summed samples per second gain at least MIN_GAIN."""
    if stack_key(cfg) is None:
        return 1
    if device.type != "cuda":
        return CPU_POPULATION
    cfg = replace(cfg, train=replace(cfg.train, device=str(device)))
    free, _ = torch.cuda.mem_get_info(device)
    t1, peak1 = measure(cfg, data, 1)
    t2, peak2 = measure(cfg, data, 2)
    per_member = max(peak2 - peak1, 1)
    fit = max(1, int((free * MEMORY_SHARE - max(peak1 - per_member, 0)) // per_member))
    best, rate = 2, 2 / t2
    if rate < MIN_GAIN * (1 / t1):
        return 1
    k = 4
    while k <= min(fit, MAX_POPULATION):
        t, _ = measure(cfg, data, k)
        if k / t < MIN_GAIN * rate:
            break
        best, rate = k, k / t
        k *= 2
    return min(best, fit)
