"""The training loop: pluggable task, model, losses, optimiser and schedule; best epoch by val MRR; per-epoch
callback."""
from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from latentsweep.trainers.train.capture import step_forward
from latentsweep.trainers.train.checkpoint import CenteredModel, atomic_torch_save, checkpoint_payload
from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.devices import resolve_device
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.models import knn
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.models.zoo import UNTRAINED_KINDS, build_model
from latentsweep.trainers.train.records import EpochLog
# The run's epochs live in latentsweep.trainers.train.run (shared with latentsweep.trainers.train.population); their
# types are re-exported here.
from latentsweep.trainers.train.run import (DeadlineReached, EpochReport, RunClock, RunState, StepParts, TrainResult, now_past,
                          train_size)
from latentsweep.trainers.train.tasks import TASKS
from latentsweep.trainers.config.validate import validate


class TrainingDiverged(LatentsweepError):
    """The loss became NaN/Inf: the configuration is unstable (a study marks such a trial failed)."""


# An improved epoch's best.pt is written at once when the last write is at least this old, else when the run ends
# (_BestCheckpoint): what a crash of a run that improves every epoch can lose.
CHECKPOINT_EVERY_S = 10.0


def seed_everything(seed: int) -> torch.Generator:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


@contextlib.contextmanager
def torch_threads(threads: int):
    """Run the block with `threads` torch CPU threads (0: as is), then restore the previous count: the thread count
    is process-wide, and a library call must not leave it changed for the caller."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if threads:
            torch.set_num_threads(previous)


def train(cfg: Config, data: TrainSet, *, callback: Callable[[EpochReport], None] | None = None,
          out_dir: str | Path | None = None, progress: bool = False,
          deadline: Callable[[], Deadline] = Deadline.never) -> TrainResult:
    """Train `cfg` on `data`; keep the best epoch by val/mrr; `callback` sees every epoch (and may raise to stop).
    Runs with cfg.train.threads torch threads (when > 0), restored on return.

    `deadline()` (a latentsweep.trainers.core.deadline.Deadline, Deadline.never() for none): read before every step, so
    the caller
    may move it while the run goes on (a one-budget run re-estimates it after each epoch). Once an epoch has
    finished, the next epoch, or an epoch's validation, starts only when its last measured seconds fit before the
    deadline; a step never starts after it. Then the run returns its best finished epoch (`stopped_at_deadline`), or
    raises DeadlineReached when no epoch has finished (or the deadline had passed before the run started)."""
    validate(cfg)
    device = resolve_device(cfg.train.device)
    best_pt = _BestCheckpoint(out_dir)
    try:
        with torch_threads(cfg.train.threads):
            return _fit(cfg, data, device, callback, out_dir, progress, deadline, best_pt)
    except BaseException:
        best_pt.write(quiet=True)  # whatever stopped the run (a pruner, Ctrl-C), best.pt is its best epoch so far
        raise
    finally:
        # The run's freed tensors (optimiser state, batches, validation blocks) would stay resident under glibc and
        # under whatever the caller does next (a study logs its plots, then trains the next trial).
        release_free_heap()


def _fit(cfg: Config, data: TrainSet, device: torch.device, callback: Callable[[EpochReport], None] | None,
         out_dir: str | Path | None, progress: bool, deadline: Callable[[], Deadline],
         best_pt: "_BestCheckpoint") -> TrainResult:
    """The body of `train`, under its thread count: the run's epochs (latentsweep.trainers.train.run.RunState), each
    trained by
    `_train_epoch`."""
    started = time.monotonic()
    if now_past(deadline):  # nothing built yet: a trial claimed just before the end costs nothing
        raise DeadlineReached("the deadline had passed before the run started")
    knn.check_fits(cfg, data, deadline())  # its cost grows with the captions squared: estimated before it is built
    gen = seed_everything(cfg.train.seed)
    task = TASKS.get(cfg.data.task)(cfg, data, device)
    model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean).to(device)
    if cfg.model.kind in UNTRAINED_KINDS:
        clock = RunClock(started, train_size(cfg, data), per_image=False)
        return _fit_untrained(cfg, data, task, model, out_dir, callback, clock)
    run = RunState(cfg, data, device, task, model, gen, started, callback=callback, out_dir=out_dir,
                   progress=progress, deadline=deadline, best_pt=best_pt)
    while run.begin_epoch():
        try:
            sums = _train_epoch(run.parts, run.epoch)
        except _PastDeadline:
            run.cut()
            break
        if not run.end_epoch(sums):
            break
    return run.result()


def _fit_untrained(cfg: Config, data: TrainSet, task, model: CenteredModel, out_dir: str | Path | None,
                   callback: Callable[[EpochReport], None] | None, clock: RunClock) -> TrainResult:
    """A model fitted when built (model.kind knn): one epoch with no training step validates and saves it. No copy
    of its state is kept for a best epoch: there is one, and at challenge size the state is the training set."""
    clock.epoch_start()
    clock.trained()
    if getattr(task, "val_x", None) is not None:  # thousands of rows a call, kept by its memo for the validation
        knn.predict_ahead(model, task.val_x)
    metrics = {**task.evaluate(model), "lr": 0.0}
    clock.evaluated()
    clock.predicted(task, model)
    log = EpochLog(out_dir)
    ckpt = _save_best(out_dir, model, cfg, task, data, 0, metrics, None)
    log.append(0, metrics)
    if callback is not None:
        callback(EpochReport(0, metrics, True, clock.timing()))
    return TrainResult(0, log.rows[0], log.rows, model, ckpt, task.last_ranks, clock.timing())


def _save_best(out_dir: str | Path | None, model: CenteredModel | dict, cfg: Config, task, data: TrainSet, epoch: int,
               metrics: dict[str, float], loss_state: dict | None) -> Path | None:
    """Write the best epoch's checkpoint (`model`, or its state dict) to out_dir/best.pt (nothing without out_dir);
    returns its path or None."""
    if out_dir is None:
        return None
    path = Path(out_dir) / "best.pt"
    atomic_torch_save(checkpoint_payload(model, cfg, (task.dim_in, task.dim_out),
                                         {"epoch": epoch, "metrics": metrics, "data_fingerprint": data.fingerprint},
                                         loss_state=loss_state), path)
    return path


class _BestCheckpoint:
    """best.pt of a run's best epoch so far, written from its kept copy of the best state (no second copy): at once
    when the last write is CHECKPOINT_EVERY_S old or more (the first improved epoch always), else when the run ends,
    whatever ends it (train). A fast device improving every epoch (a refit: no validation, every epoch is the best)
    pays one write per CHECKPOINT_EVERY_S instead of a GPU-to-host copy, a torch.save and an fsync per epoch; only
    a crash (the process killed) can leave best.pt up to CHECKPOINT_EVERY_S of epochs behind."""

    def __init__(self, out_dir: str | Path | None):
        self.out_dir, self.pending, self.written = out_dir, None, -math.inf

    def keep(self, state: dict, into: dict | None, cfg: Config, task, data: TrainSet, epoch: int,
             metrics: dict[str, float], loss_state: dict) -> dict:
        """The new best epoch: returns the copy of its model's `state` (into the previous copy `into`, see
        _copy_state), which is what best.pt is written from."""
        self.pending = None  # `into` is overwritten now: a copy cut short (Ctrl-C) is never written
        state = _copy_state(state, into)
        if self.out_dir is None:
            return state
        loss_state = {k: v.detach().clone() for k, v in loss_state.items()}  # the logit scale trains on
        self.pending = (state, cfg, task, data, epoch, dict(metrics), loss_state)
        if time.monotonic() - self.written >= CHECKPOINT_EVERY_S:
            self.write()
        return state

    def write(self, quiet: bool = False) -> None:
        """Write the kept best epoch if it is not on disk yet; `quiet`: an error is dropped (a run that is already
        failing keeps its own error)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            _save_best(self.out_dir, *pending)
        except Exception:
            if not quiet:
                raise
        self.written = time.monotonic()


def _copy_state(state: dict, into: dict | None) -> dict:
    """A copy of the state dict `state` that training does not change, as copy.deepcopy made it, but copied into the
    tensors of `into` (the previous best epoch's copy) when they match: no new allocation per improved epoch."""
    if into is None or into.keys() != state.keys() or any(
            (t.shape, t.dtype, t.device) != (state[k].shape, state[k].dtype, state[k].device) for k, t in into.items()):
        return copy.deepcopy(state)
    with torch.no_grad():
        for k, t in state.items():
            into[k].copy_(t)
    return into


class _PastDeadline(Exception):
    """Raised between two steps when the run's deadline has passed (caught by _fit)."""


def _train_epoch(p: StepParts, epoch: int) -> dict[str, float]:
    """One pass over the training batches; returns the mean of every loss term as train/<term>."""
    cfg, task, model, criterion, opt, scaler = p.cfg, p.task, p.model, p.criterion, p.opt, p.scaler
    model.train()
    sums: dict[str, torch.Tensor] = {}
    n = 0
    forward = p.forward or (lambda batch: step_forward(model, criterion, batch, p.amp))  # train.capture's, or eager
    for i, real in enumerate(task.batches(p.gen)):
        if now_past(p.deadline):
            raise _PastDeadline
        criterion.set_progress((epoch + i / p.steps) / cfg.train.epochs)
        batch = p.augment(real)  # the losses train on this one; their after_step gets the real one
        out, loss, terms = forward(batch)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        if cfg.train.grad_clip > 0:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        scaler.step(opt)
        scaler.update()
        p.schedule.after_step()
        p.average.after_step()
        criterion.after_step(out, real)
        # Sum on the device: no host sync per step (the .item() happens once per epoch).
        for k, v in {"loss": loss.detach(), **terms}.items():
            sums[k] = sums.get(k, 0) + v.detach().float()
        n += 1
    means = {f"train/{k}": float(v) / max(n, 1) for k, v in sums.items()}
    if not all(math.isfinite(v) for v in means.values()):
        raise TrainingDiverged(f"loss is not finite at epoch {epoch}: {means}")
    return means | (p.forward.epoch_metrics() if p.forward is not None else {})
