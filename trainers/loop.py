"""The training loop: pluggable task, model, losses, optimiser and schedule; best epoch by val MRR; per-epoch callback."""
from __future__ import annotations

import contextlib
import copy
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from trainers.capture import StepForward, step_forward
from trainers.checkpoint import CenteredModel, atomic_torch_save, checkpoint_payload
from trainers.config import Config
from trainers.cost import Timing, mean_epoch
from trainers.data import TrainSet
from trainers.deadline import Deadline
from trainers.devices import resolve_device
from trainers.errors import LatentsweepError
from trainers.heap import release_free_heap
from trainers.losses import Criterion
from trainers.models import UNTRAINED_KINDS, build_model
from trainers.optim import MONITOR_MODES, build_optimizer
from trainers.records import EpochLog
from trainers.regularise import BatchAugment, build_average
from trainers.splits import captions_of
from trainers.tasks import TASKS, split_images
from trainers.validate import validate


class TrainingDiverged(LatentsweepError):
    """The loss became NaN/Inf: the configuration is unstable (a study marks such a trial failed)."""


# An improved epoch's best.pt is written at once when the last write is at least this old, else when the run ends
# (_BestCheckpoint): what a crash of a run that improves every epoch can lose.
CHECKPOINT_EVERY_S = 10.0


class DeadlineReached(Exception):
    """The run's deadline passed before its first epoch ended: there is no model to keep (not a config error)."""


@dataclass(frozen=True)
class EpochReport:
    epoch: int  # 0-based
    metrics: dict[str, float]  # train/* terms, val/* metrics, lr
    improved: bool  # val/mrr is the best so far
    timing: Timing | None = None  # the run's measured seconds so far (start-up, per-epoch training and validation)


@dataclass
class TrainResult:
    best_epoch: int
    best_metrics: dict[str, float]
    history: list[dict[str, float]]
    model: CenteredModel = field(repr=False)
    checkpoint: Path | None = None
    val_ranks: np.ndarray | None = field(default=None, repr=False)  # [Nval] exact ranks of the best model
    timing: Timing | None = None
    stopped_at_deadline: bool = False  # the deadline ended the run early; best_epoch is the best finished epoch
    capture: str = "none"  # the step's path (trainers.capture.StepForward.path): none, compile, eager-fallback: why


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
          deadline: Callable[[], Deadline | None] | None = None) -> TrainResult:
    """Train `cfg` on `data`; keep the best epoch by val/mrr; `callback` sees every epoch (and may raise to stop).
    Runs with cfg.train.threads torch threads (when > 0), restored on return.

    `deadline()` (a trainers.deadline.Deadline, or None for none): read before every step, so the caller may move
    it while the run goes on (a one-budget run re-estimates it after each epoch). Once an epoch has finished, the
    next epoch, or an epoch's validation, starts only when its last measured seconds fit before the deadline; a step
    never starts after it. Then the run returns its best finished epoch (`stopped_at_deadline`), or raises
    DeadlineReached when no epoch has finished (or the deadline had passed before the run started)."""
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
         out_dir: str | Path | None, progress: bool, deadline: Callable[[], Deadline | None] | None,
         best_pt: "_BestCheckpoint") -> TrainResult:
    """The body of `train`, under its thread count."""
    started = time.monotonic()
    if _now_past(deadline):  # nothing built yet: a trial claimed just before the end costs nothing
        raise DeadlineReached("the deadline had passed before the run started")
    gen = seed_everything(cfg.train.seed)
    task = TASKS.get(cfg.data.task)(cfg, data, device)
    model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean).to(device)
    if cfg.model.kind in UNTRAINED_KINDS:
        clock = _RunClock(started, _train_size(cfg, data), per_image=False)
        return _fit_untrained(cfg, data, task, model, out_dir, callback, clock)
    criterion = Criterion(cfg, task.dim_out).to(device)
    steps = task.steps_per_epoch()
    opt, schedule = build_optimizer(cfg, model, criterion, steps)
    amp = cfg.train.amp and device.type == "cuda"
    average = build_average(cfg, model)
    parts = StepParts(cfg, task, model, criterion, opt, schedule, torch.amp.GradScaler(device.type, enabled=amp),
                      gen, steps, amp, BatchAugment(cfg, task.x), average, deadline,
                      StepForward(cfg, model, criterion, amp, device))
    log = EpochLog(out_dir)
    # Two different bests: `best` is the selection score (val/mrr, the checkpoint kept), `best_monitored` the
    # train.monitor value the schedule and early stopping watch (val/loss for MoCo); they differ by design.
    best, best_state, best_epoch, stale = -math.inf, None, -1, 0
    best_ranks = None  # [Nval] the best epoch's global val ranks (its rank plot), from that epoch's validation
    sign = 1.0 if MONITOR_MODES[cfg.train.monitor] == "max" else -1.0  # monitored value as higher-is-better
    best_monitored = -math.inf
    clock = _RunClock(started, _train_size(cfg, data), criterion.cost_per_image)
    stopped = False
    epochs = tqdm(range(cfg.train.stop_after or cfg.train.epochs), desc="epochs", disable=not progress, leave=False)
    for epoch in epochs:
        if best_epoch >= 0 and not _fits(deadline, clock.last_epoch()):  # it would be cut before its validation
            stopped = True
            break
        model.on_epoch_start(epoch)
        criterion.on_epoch_start(epoch, task.epoch_context(model))
        clock.epoch_start()
        try:
            sums = _train_epoch(parts, epoch)
        except _PastDeadline:
            if best_epoch < 0:
                raise DeadlineReached(f"the deadline passed during epoch {epoch}, before any epoch ended") from None
            stopped = True
            break
        average.after_epoch(epoch)
        clock.trained()
        if best_epoch >= 0 and not _fits(deadline, clock.eval[-1] if clock.eval else None):
            stopped = True  # the first epoch is always validated: without it there is no model to keep
            break
        release_free_heap()  # the epoch's freed batches would stay resident under the validation's blocks
        judged = average.model(model)  # the averaged weights when train.average is on: validated and saved
        metrics = {**sums, **criterion.log_values(), **task.evaluate(judged), "lr": opt.param_groups[0]["lr"]}
        validated = task.metric_key in metrics  # False with data.split = "all" (nothing held out)
        if cfg.train.monitor == "val/loss" and validated:
            metrics["val/loss"] = _val_loss(task, judged, criterion)
        clock.evaluated()
        # Without validation every epoch counts as the best (the last one is kept), and the schedule and early
        # stopping watch the training loss instead.
        score = metrics.get(task.metric_key, -metrics["train/loss"])
        improved = score > best or not validated
        if improved:
            best, best_epoch = score, epoch
            best_state = best_pt.keep(judged.state_dict(), best_state, cfg, task, data, epoch, metrics,
                                      criterion.state_dict())
            best_ranks = task.last_ranks
        watched = metrics[cfg.train.monitor] if validated else -sign * metrics["train/loss"]
        stale = 0 if sign * watched > best_monitored else stale + 1
        best_monitored = max(best_monitored, sign * watched)
        model.on_epoch_end(epoch, score)
        schedule.after_epoch(watched)
        log.append(epoch, metrics)
        # score is val/mrr, or -train/loss without validation (data.split = "all")
        epochs.set_postfix({task.metric_key if validated else "-train/loss": f"{score:.4f}", "best": f"{best:.4f}"})
        if callback is not None:
            callback(EpochReport(epoch, metrics, improved, clock.timing()))
        if cfg.train.early_stop and stale >= cfg.train.early_stop:
            break
    best_pt.write()
    model.load_state_dict(best_state)
    ckpt = Path(out_dir) / "best.pt" if out_dir is not None else None
    return TrainResult(best_epoch, log.rows[best_epoch], log.rows, model, ckpt, best_ranks, clock.timing(), stopped,
                       parts.forward.path)


def _fit_untrained(cfg: Config, data: TrainSet, task, model: CenteredModel, out_dir: str | Path | None,
                   callback: Callable[[EpochReport], None] | None, clock: "_RunClock") -> TrainResult:
    """A model fitted when built (model.kind knn): one epoch with no training step validates and saves it. No copy
    of its state is kept for a best epoch: there is one, and at challenge size the state is the training set."""
    clock.epoch_start()
    clock.trained()
    metrics = {**task.evaluate(model), "lr": 0.0}
    clock.evaluated()
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


def _train_size(cfg: Config, data: TrainSet) -> tuple[int, int]:
    """(captions, images) the run trains on: the sizes its measured seconds are per."""
    train_img, _ = split_images(cfg, data)
    return len(captions_of(data.cap2img, train_img)), len(train_img)


class _PastDeadline(Exception):
    """Raised between two steps when the run's deadline has passed (caught by _fit)."""


def _now_past(deadline: Callable[[], Deadline | None] | None) -> bool:
    end = deadline() if deadline is not None else None
    return end is not None and end.passed()


def _fits(deadline: Callable[[], Deadline | None] | None, seconds: float | None) -> bool:
    """Whether work measured at `seconds` ends before the run's deadline (always, without one)."""
    end = deadline() if deadline is not None else None
    return end is None or end.fits(seconds)


class _RunClock:
    """The run's seconds by part (start-up, training and validation of each epoch): trainers.cost.Timing."""

    def __init__(self, started: float, size: tuple[int, int], per_image: bool):
        self.started, self.size, self.per_image = started, size, per_image
        self.setup: float | None = None
        self.train: list[float] = []
        self.eval: list[float] = []
        self.mark = started

    def epoch_start(self) -> None:
        now = time.monotonic()
        if self.setup is None:
            self.setup = now - self.started
        self.mark = now

    def trained(self) -> None:
        now = time.monotonic()
        self.train.append(now - self.mark)
        self.mark = now

    def evaluated(self) -> None:
        now = time.monotonic()
        self.eval.append(now - self.mark)
        self.mark = now

    def last_epoch(self) -> float | None:
        """Seconds of the last epoch, training and validation (None before any)."""
        if not self.train:
            return None
        return self.train[-1] + (self.eval[-1] if self.eval else 0.0)

    def timing(self) -> Timing:
        return Timing(self.setup or 0.0, mean_epoch(self.train), mean_epoch(self.eval), *self.size, self.per_image)


@dataclass(frozen=True)
class StepParts:
    """The pluggable parts one training step calls, built once per run by `_fit`."""
    cfg: Config
    task: Any
    model: torch.nn.Module
    criterion: Criterion
    opt: torch.optim.Optimizer
    schedule: Any  # trainers.optim's schedule: after_step() / after_epoch(watched)
    scaler: torch.amp.GradScaler
    gen: torch.Generator  # batch order
    steps: int  # per epoch
    amp: bool
    augment: BatchAugment
    average: Any  # trainers.regularise.WeightAverage
    deadline: Callable[[], Deadline | None] | None = None  # after which no step starts
    forward: StepForward | None = None  # forward + loss as train.capture says (None: eager)


def _train_epoch(p: StepParts, epoch: int) -> dict[str, float]:
    """One pass over the training batches; returns the mean of every loss term as train/<term>."""
    cfg, task, model, criterion, opt, scaler = p.cfg, p.task, p.model, p.criterion, p.opt, p.scaler
    model.train()
    sums: dict[str, torch.Tensor] = {}
    n = 0
    forward = p.forward or (lambda batch: step_forward(model, criterion, batch, p.amp))  # train.capture's, or eager
    for i, real in enumerate(task.batches(p.gen)):
        if _now_past(p.deadline):
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


@torch.no_grad()
def _val_loss(task, model, criterion) -> float:
    """The configured losses on the validation batches, eval mode, no gradient, nothing enqueued: the mean over
    batches. Eval mode drops the slot head's output, so the slot losses are not part of it."""
    model.eval()
    total, n = 0.0, 0
    for batch in task.val_batches():
        loss, _ = criterion(model(batch["x"]), batch)
        total, n = total + float(loss), n + 1
    model.train()
    return total / max(n, 1)
