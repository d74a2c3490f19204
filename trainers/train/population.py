"""Population trials: several trials of one shape group trained side by side, each member its own run.

The contract (search/ builds on it): a `Member` is one trial's config with its own callback (Optuna's report and
prune), output folder, deadline and `done` hook; `train_population` trains them and hands each member's end (a
TrainResult, or the exception that ended it) to its `done` hook, once, however it ended. A member that fails
(NaN, a bad configuration, a pruner) ends alone; the others go on. KeyboardInterrupt/SystemExit stop them all, after
each member's best.pt is written (no `done` then: the caller's stop handling fails the trials it holds).
`join()` is asked for a new member whenever a place is free; None means no more.

Members of one `stack_key` train in one stacked step (latentsweep.trainers.train.stack): each is built exactly as
`latentsweep.trainers.train.loop.train`
builds its run (seeded, its model, its latentsweep.trainers.train.run.RunState: criterion, optimiser, schedule, scaler,
average,
augmentation, checkpoint), keeps its own global RNG state (swapped in around everything it does: its dropout masks
are drawn in its own order) and its own batch order; the forward and backward are one for all, and so is the
optimiser step (latentsweep.trainers.train.stacked_optim: clipping, scaler, Adam/AdamW and EMA of every member it
covers, each member's torch state kept as views of the stacked state). A member whose key
is None, or differs from the stack's, trains alone through `train`. Each member computes what it computes alone
(tests/test_population.py compares histories, best epochs, pruning points and best.pt).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import torch

from latentsweep.trainers.train.checkpoint import CenteredModel
from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.devices import resolve_device
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.train.loop import TrainingDiverged, _BestCheckpoint, seed_everything, torch_threads, train
from latentsweep.trainers.models.zoo import build_model
from latentsweep.trainers.train.population_step import Live, own_rng, rng_state, slot_of, stacked_step
from latentsweep.trainers.train.run import DeadlineReached, EpochReport, RunState, TrainResult, now_past
from latentsweep.trainers.train.stack import NotStackable, Stack, stack_key
from latentsweep.trainers.train.stacked_optim import StackedOptim, uncovered
from latentsweep.trainers.train.tasks import TASKS
from latentsweep.trainers.config.validate import validate


# Population size on a CPU: 1 (each trial trains alone). Measured on the 2-core machine of issue 38 with
# benchmarks/gpu.py --population-cpu (docs/gpu.md, "Population trials"): K = 4 stacked was no faster than 4 runs
# one after another, since one run's matmuls already use every core.
CPU_POPULATION = 1
# The share of the card's free memory a population may plan to use: the rest covers the allocator's fragmentation
# and the validation's blocks (latentsweep.trainers.train.tasks.EVAL_CHUNK rows), measured outside the training step.
MEMORY_SHARE = 0.8
# A doubled population is kept only when its summed samples per second gain at least this much: past that, the
# card is busy and more members only cost memory and make each trial slower.
MIN_GAIN = 1.15
MAX_POPULATION = 64  # the largest K population_size measures (issue 38's benchmark goes to 32)
MEASURE_STEPS = 5  # timed stacked steps per measured K, after one untimed step (allocator, kernels)


@dataclass(frozen=True)
class Member:
    """One trial of a population: what `latentsweep.trainers.train.loop.train` takes for one run, plus its `done`
    hook."""
    cfg: Config
    callback: Callable[[EpochReport], None] | None = None  # sees each epoch; raising ends this member alone
    out_dir: Path | None = None
    deadline: Callable[[], Deadline] = Deadline.never
    done: Callable[[TrainResult | BaseException], None] | None = None  # the member's end, called once


class _Population:
    """The members in training, their stack, and the ends handed back."""

    def __init__(self, data: TrainSet, progress: bool, stacked_optim: str | None = "auto"):
        # stacked_optim: the stacked optimiser's Adam backend (latentsweep.trainers.train.stacked_optim.ADAM_BACKENDS,
        # or "auto"); None: every member steps its own optimiser (the path before the stacked optimiser; kept for
        # members it does not cover, and for benchmarks/population_step.py's comparison)
        self.data, self.progress, self.stacked_optim = data, progress, stacked_optim
        self.live: list[Live] = []
        self.ends: list[TrainResult | BaseException | None] = []
        self.key: tuple | None = None
        self.task = None
        self.stack: Stack | None = None
        self.optim: StackedOptim | None = None
        self.device: torch.device | None = None

    def alone(self, member: Member) -> None:
        """A member that cannot stack here: trained through `train`, now."""
        self.ends.append(None)
        try:
            end: TrainResult | BaseException = train(member.cfg, self.data, callback=member.callback,
                                                     out_dir=member.out_dir, progress=self.progress,
                                                     deadline=member.deadline)
        except Exception as exc:  # noqa: BLE001 - the member's end, handed to its caller who classifies it
            end = exc
        self._hand(member, len(self.ends) - 1, end)

    def _hand(self, member: Member, slot: int, end: TrainResult | BaseException) -> None:
        self.ends[slot] = end
        release_free_heap()
        if member.done is not None:
            member.done(end)

    def start(self, member: Member) -> bool:
        """Build the member as `train` builds its run and put it in the stack; False: it trains alone instead."""
        cfg = member.cfg
        key = stack_key(cfg)
        if key is None or (self.live and key != self.key):
            return False
        self.ends.append(None)
        slot, best_pt = len(self.ends) - 1, _BestCheckpoint(member.out_dir)
        try:
            started = time.monotonic()
            validate(cfg)
            if now_past(member.deadline):
                raise DeadlineReached("the deadline had passed before the run started")
            if key != self.key or self.task is None:  # a new group: its task (no RNG drawn: shared by its members)
                self.key, self.stack, self.device = key, None, resolve_device(cfg.train.device)
                self.task = TASKS.get(cfg.data.task)(cfg, self.data, self.device)
            gen = seed_everything(cfg.train.seed)
            model = CenteredModel(build_model(cfg, self.task.model_context()), self.task.text_mean).to(self.device)
            run = RunState(cfg, self.data, self.device, self.task, model, gen, started, callback=member.callback,
                           out_dir=member.out_dir, progress=self.progress, deadline=member.deadline, best_pt=best_pt)
            if self.stack is None:
                self.stack = Stack(model, self.device, run.parts.amp, cfg.train.batch_size, self.task.dim_in)
                self.optim = StackedOptim(self.stack, self.stacked_optim or "auto")
        except NotStackable:
            self.ends.pop()
            return False
        except Exception as exc:  # noqa: BLE001 - this member's end (a bad configuration): alone
            best_pt.write(quiet=True)
            self._hand(member, slot, exc)
            return True
        stacked = self.stacked_optim is not None and uncovered(slot_of(run.parts)) is None
        self.live.append(Live(member, slot, run, best_pt, rng_state(self.cuda, full=True), stacked=stacked))
        self.rebind()
        return True

    def rebind(self) -> None:
        """The members changed: stack their tensors and optimiser state again (each one's average re-paired with
        its moved tensors)."""
        self.stack.bind([lv.run.model for lv in self.live])
        self.optim.bind([slot_of(lv.run.parts) if lv.stacked else None for lv in self.live])
        for lv in self.live:
            lv.run.parts.average.rebind(lv.run.model)

    def finish(self, lv: Live, end: TrainResult | BaseException | None = None) -> None:
        """The member leaves: its own storage back, its result (or `end`), its done hook."""
        Stack.release(lv.run.model)
        StackedOptim.release(slot_of(lv.run.parts))
        lv.run.parts.average.rebind(lv.run.model)
        if end is None:
            try:
                with own_rng(lv, self.cuda):
                    end = lv.run.result()
            except Exception as exc:  # noqa: BLE001 - writing its best.pt failed: its end
                end = exc
        if isinstance(end, BaseException):
            lv.run.bar.close()
            lv.best_pt.write(quiet=True)  # whatever ended it, best.pt is its best epoch so far
        lv.end = end  # it keeps its place in the stack (unused) until the epoch's end binds the others again
        self._hand(lv.member, lv.slot, end)

    @property
    def cuda(self) -> torch.device | None:
        """The CUDA device of the members (whose RNG they own), None on a CPU."""
        return self.device if self.device is not None and self.device.type == "cuda" else None

    def epoch(self) -> None:
        """One epoch of every member (each at its own epoch number), then their validation; members that end
        leave and the stack is bound again."""
        before = list(self.live)
        for lv in before:
            try:
                with own_rng(lv, self.cuda):
                    going = lv.run.begin_epoch()
            except Exception as exc:  # noqa: BLE001 - a hook's error: this member's end
                self.finish(lv, exc)
                continue
            if not going:
                self.finish(lv)
                continue
            lv.run.model.train()
            lv.batches, lv.sums, lv.steps, lv.cut = lv.run.task.batches(lv.run.parts.gen), {}, 0, False
        if any(lv.end is None for lv in self.live):
            self._steps()
        for lv in before:
            if lv.end is None:
                self._end_epoch(lv)
        self.live = [lv for lv in self.live if lv.end is None]
        if self.live and len(self.live) != len(before):
            self.rebind()

    def _end_epoch(self, lv: Live) -> None:
        try:
            with own_rng(lv, self.cuda):
                if lv.cut:
                    lv.run.cut()
                    going = False
                else:
                    means = {f"train/{k}": float(v) / max(lv.steps, 1) for k, v in lv.sums.items()}
                    if not all(math.isfinite(v) for v in means.values()):
                        raise TrainingDiverged(f"loss is not finite at epoch {lv.run.epoch}: {means}")
                    going = lv.run.end_epoch(means)
        except Exception as exc:  # noqa: BLE001 - a pruner, a diverged loss, the deadline: this member's end
            self.finish(lv, exc)
            return
        if not going:
            self.finish(lv)

    def _steps(self) -> None:
        """The epoch's steps of every member in the stack: one stacked forward and one backward per step."""
        while True:
            batches = []
            for lv in self.live:
                batch = next(lv.batches, None) if not lv.cut and lv.end is None else None
                batches.append(batch)
            if all(b is None for b in batches):
                return
            stacked_step(self, batches)


def train_population(members: Sequence[Member], data: TrainSet, *, join: Callable[[], Member | None] | None = None,
                     progress: bool = False, stacked_optim: str | None = "auto") -> list[TrainResult | BaseException]:
    """Train `members` (and those `join` adds, at epoch boundaries, each from its own epoch 0) and return each
    one's end in the order they started. Members of one stack_key share a stacked step; the places are
    len(members) (at least 1). `stacked_optim`: the stacked optimiser's Adam backend ("auto", "kernel", "math");
    None steps each member's own optimiser."""
    places = max(1, len(members))
    pop = _Population(data, progress, stacked_optim)
    queue = list(members)
    threads = members[0].cfg.train.threads if members else 0
    try:
        with torch_threads(threads):
            while True:
                while len(pop.live) < places and (queue or join is not None):
                    member = queue.pop(0) if queue else join()
                    if member is None:
                        join = None
                        break
                    if not pop.start(member):
                        pop.alone(member)
                if not pop.live:
                    break
                pop.epoch()
    except BaseException:
        for lv in pop.live:
            lv.best_pt.write(quiet=True)  # a stop (Ctrl-C): each member's best.pt is its best epoch so far
        raise
    finally:
        release_free_heap()
    return [end for end in pop.ends if end is not None]


def measure(cfg: Config, data: TrainSet, k: int, steps: int = MEASURE_STEPS, stacked_optim: str | None = "auto") \
        -> tuple[float, int]:
    """(seconds per stacked step, peak device bytes) of K members of `cfg` (seeds 0..K-1) over `steps` steps after
    one untimed step; bytes are CUDA's peak allocation (0 on a CPU). `stacked_optim`: as train_population's."""
    gc.collect()  # an earlier measure's population (its stack and vmapped forward refer to each other) is freed now
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    pop = _Population(data, progress=False, stacked_optim=stacked_optim)
    for seed in range(k):
        if not pop.start(Member(replace(cfg, train=replace(cfg.train, seed=seed)))):
            raise ValueError("this config does not stack (stack_key is None)")
    for lv in pop.live:
        lv.run.begin_epoch()
        lv.run.model.train()
    cuda = pop.cuda is not None
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
    the measured summed samples per second gain at least MIN_GAIN (the last step to as many as the memory holds)."""
    if stack_key(cfg) is None:
        return 1
    if device.type != "cuda":
        return CPU_POPULATION
    cfg = replace(cfg, train=replace(cfg.train, device=str(device)))
    free, _ = torch.cuda.mem_get_info(device)
    t1, peak1 = measure(cfg, data, 1)
    try:
        t2, peak2 = measure(cfg, data, 2)
    except torch.cuda.OutOfMemoryError:
        return 1
    # the second member's bytes, plus the copy of its best epoch's state that a measured step does not allocate
    measured = max(peak2 - peak1, 1)
    per_member = measured + _state_bytes(cfg, data)
    fit = max(1, int((free * MEMORY_SHARE - max(peak1 - measured, 0)) // per_member))
    best, rate = 2, 2 / t2
    if rate < MIN_GAIN * (1 / t1):
        return 1
    while (k := min(2 * best, fit, MAX_POPULATION)) > best:  # doubled, or as many as the memory holds
        try:
            t, _ = measure(cfg, data, k)
        except torch.cuda.OutOfMemoryError:  # the estimate was short: the last K that ran
            break
        if k / t < MIN_GAIN * rate:
            break
        best, rate = k, k / t
    return min(best, fit)


def _state_bytes(cfg: Config, data: TrainSet) -> int:
    """Bytes of one member's model state (float32, as the loop keeps its best epoch's copy), from a model built on
    the CPU with the data's dims (no closed-form fit: the sizes are the same)."""
    from latentsweep.trainers.models.model_context import ModelContext

    ctx = ModelContext(data.text.shape[1], data.image.shape[1], fit_x=None, fit_y=None)
    model = build_model(replace(cfg, train=replace(cfg.train, device="cpu")), ctx)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


__all__ = ["Member", "measure", "population_size", "stack_key", "train_population"]
