"""One trained run between its epochs (RunState): what `latentsweep.trainers.train.loop._fit` and each member of a
population share.

The loop and `latentsweep.trainers.train.population` drive the same object: `begin_epoch()`, then the epoch's steps (the
loop's
`_train_epoch` for one run, the stacked step for a population), then `end_epoch(sums)` (averaging, validation, the
best epoch and its checkpoint, the schedule, the callback, early stopping), and `result()`. One copy of the epoch
bookkeeping, so a member of a population computes what the same run computes alone.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from latentsweep.trainers.train.capture import StepForward
from latentsweep.trainers.train.checkpoint import CenteredModel
from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.train.cost import Timing, mean_epoch
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.deadline import Deadline, DeadlineReached
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.losses import Criterion
from latentsweep.trainers.train.optim import MONITOR_MODES, build_optimizer
from latentsweep.trainers.train.records import EpochLog
from latentsweep.trainers.train.regularise import BatchAugment, build_average
from latentsweep.trainers.data.splits import captions_of
from latentsweep.trainers.train.tasks import split_images


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
    model: CenteredModel | None = field(repr=False)  # None once its caller released it (a study keeps best.pt)
    checkpoint: Path | None = None
    val_ranks: np.ndarray | None = field(default=None, repr=False)  # [Nval] exact ranks of the best model
    timing: Timing | None = None
    stopped_at_deadline: bool = False  # the deadline ended the run early; best_epoch is the best finished epoch
    # the step's path (latentsweep.trainers.train.capture.StepForward.path): none, compile, eager-fallback: why
    capture: str = "none"


@dataclass(frozen=True)
class StepParts:
    """The pluggable parts one training step calls, built once per run (RunState)."""
    cfg: Config
    task: Any
    model: torch.nn.Module
    criterion: Criterion
    opt: torch.optim.Optimizer
    schedule: Any  # latentsweep.trainers.train.optim's schedule: after_step() / after_epoch(watched)
    scaler: torch.amp.GradScaler
    gen: torch.Generator  # batch order
    steps: int  # per epoch
    amp: bool
    augment: BatchAugment
    average: Any  # latentsweep.trainers.train.regularise.WeightAverage
    deadline: Callable[[], Deadline] = Deadline.never  # after which no step starts
    forward: StepForward | None = None  # forward + loss as train.capture says (None: eager)


def now_past(deadline: Callable[[], Deadline]) -> bool:
    return deadline().passed()


def fits(deadline: Callable[[], Deadline], seconds: float | None) -> bool:
    """Whether work measured at `seconds` ends before the run's deadline (always, with Deadline.never())."""
    return deadline().fits(seconds)


def train_size(cfg: Config, data: TrainSet) -> tuple[int, int]:
    """(captions, images) the run trains on: the sizes its measured seconds are per."""
    train_img, _ = split_images(cfg, data)
    return len(captions_of(data.cap2img, train_img)), len(train_img)


class RunState:
    """A run's parts (criterion, optimiser, schedule, scaler, average, augmentation) and its bookkeeping between
    epochs (best epoch and its kept state, the monitored value, early stopping, the clock, metrics.csv).

    `best_pt` is latentsweep.trainers.train.loop._BestCheckpoint (best.pt of the best epoch so far); `gen` the batch
    order's generator
    (seeded with the model by latentsweep.trainers.train.loop.seed_everything)."""

    def __init__(self, cfg: Config, data: TrainSet, device: torch.device, task, model: CenteredModel,
                 gen: torch.Generator, started: float, *, callback: Callable[[EpochReport], None] | None,
                 out_dir: str | Path | None, progress: bool, deadline: Callable[[], Deadline],
                 best_pt) -> None:
        self.cfg, self.data, self.task, self.model, self.deadline = cfg, data, task, model, deadline
        self.callback, self.out_dir, self.best_pt = callback, out_dir, best_pt
        criterion = Criterion(cfg, task.dim_out).to(device)
        steps = task.steps_per_epoch()
        opt, schedule = build_optimizer(cfg, model, criterion, steps)
        amp = cfg.train.amp and device.type == "cuda"
        average = build_average(cfg, model)
        self.parts = StepParts(cfg, task, model, criterion, opt, schedule,
                               torch.amp.GradScaler(device.type, enabled=amp), gen, steps, amp,
                               BatchAugment(cfg, task.x), average, deadline,
                               StepForward(cfg, model, criterion, amp, device))
        self.log = EpochLog(out_dir)
        # Two different bests: `best` is the selection score (val/mrr, the checkpoint kept), `best_monitored` the
        # train.monitor value the schedule and early stopping watch (val/loss for MoCo); they differ by design.
        self.best, self.best_state, self.best_epoch, self.stale = -math.inf, None, -1, 0
        self.best_ranks = None  # [Nval] the best epoch's global val ranks (its rank plot), from that epoch's validation
        self.sign = 1.0 if MONITOR_MODES[cfg.train.monitor] == "max" else -1.0  # monitored value as higher-is-better
        self.best_monitored = -math.inf
        self.clock = RunClock(started, train_size(cfg, data), criterion.cost_per_image)
        self.stopped = False
        self.epoch = 0  # the next (or current) epoch, 0-based
        self.epochs = cfg.train.stop_after or cfg.train.epochs
        self.bar = tqdm(total=self.epochs, desc="epochs", disable=not progress, leave=False)

    def begin_epoch(self) -> bool:
        """Start epoch `self.epoch`; False: the run ends before it (its epochs are done, or the epoch would be cut by
        the deadline before its validation)."""
        if self.epoch >= self.epochs:
            return False
        if self.best_epoch >= 0 and not fits(self.deadline, self.clock.last_epoch()):
            self.stopped = True
            return False
        self.model.on_epoch_start(self.epoch)
        self.parts.criterion.on_epoch_start(self.epoch, self.task.epoch_context(self.model))
        self.clock.epoch_start()
        return True

    def cut(self) -> None:
        """The deadline passed during the epoch's steps: the run ends with its best finished epoch, or
        DeadlineReached without one."""
        if self.best_epoch < 0:
            raise DeadlineReached(f"the deadline passed during epoch {self.epoch}, before any epoch ended") from None
        self.stopped = True

    def end_epoch(self, sums: dict[str, float]) -> bool:
        """After the epoch's steps (`sums`: its train/* means): average, validate, keep the best epoch, step the
        schedule, report to the callback (which may raise). False: the run ends after this epoch."""
        p, task, epoch = self.parts, self.task, self.epoch
        p.average.after_epoch(epoch)
        self.clock.trained()
        if self.best_epoch >= 0 and not fits(self.deadline, self.clock.eval[-1] if self.clock.eval else None):
            self.stopped = True  # the first epoch is always validated: without it there is no model to keep
            return False
        release_free_heap()  # the epoch's freed batches would stay resident under the validation's blocks
        judged = p.average.model(self.model)  # the averaged weights when train.average is on: validated and saved
        metrics = {**sums, **p.criterion.log_values(), **task.evaluate(judged), "lr": p.opt.param_groups[0]["lr"]}
        validated = task.metric_key in metrics  # False with data.split = "all" (nothing held out)
        if self.cfg.train.monitor == "val/loss" and validated:
            metrics["val/loss"] = val_loss(task, judged, p.criterion)
        self.clock.evaluated()
        self.clock.predicted(task, judged)
        # Without validation every epoch counts as the best (the last one is kept), and the schedule and early
        # stopping watch the training loss instead.
        score = metrics.get(task.metric_key, -metrics["train/loss"])
        improved = score > self.best or not validated
        if improved:
            self.best, self.best_epoch = score, epoch
            self.best_state = self.best_pt.keep(judged.state_dict(), self.best_state, self.cfg, task, self.data,
                                                epoch, metrics, p.criterion.state_dict())
            self.best_ranks = task.last_ranks
        watched = metrics[self.cfg.train.monitor] if validated else -self.sign * metrics["train/loss"]
        self.stale = 0 if self.sign * watched > self.best_monitored else self.stale + 1
        self.best_monitored = max(self.best_monitored, self.sign * watched)
        self.model.on_epoch_end(epoch, score)
        p.schedule.after_epoch(watched)
        self.log.append(epoch, metrics)
        # score is val/mrr, or -train/loss without validation (data.split = "all")
        self.bar.update(1)
        self.bar.set_postfix({task.metric_key if validated else "-train/loss": f"{score:.4f}",
                              "best": f"{self.best:.4f}"})
        self.epoch += 1
        if self.callback is not None:
            self.callback(EpochReport(epoch, metrics, improved, self.clock.timing()))
        return not (self.cfg.train.early_stop and self.stale >= self.cfg.train.early_stop)

    def result(self) -> TrainResult:
        """The run's end: best.pt written, the model loaded with its best epoch's state."""
        self.bar.close()
        self.best_pt.write()
        self.model.load_state_dict(self.best_state)
        ckpt = Path(self.out_dir) / "best.pt" if self.out_dir is not None else None
        rows = self.log.rows
        return TrainResult(self.best_epoch, rows[self.best_epoch], rows, self.model, ckpt, self.best_ranks,
                           self.clock.timing(), self.stopped, self.parts.forward.path)


class RunClock:
    """The run's seconds by part (start-up, training and validation of each epoch):
    latentsweep.trainers.train.cost.Timing."""

    def __init__(self, started: float, size: tuple[int, int], per_image: bool):
        self.started, self.size, self.per_image = started, size, per_image
        self.setup: float | None = None
        self.train: list[float] = []
        self.eval: list[float] = []
        self.predict_s: float | None = None  # Task.predict_again_s, timed once (a model's cost does not change)
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

    def predicted(self, task, model: torch.nn.Module) -> None:
        """Time predicting the val split again (what the pick pays per candidate) after the first validation, outside
        the epoch's parts."""
        if self.predict_s is None:
            self.predict_s = task.predict_again_s(model)

    def last_epoch(self) -> float | None:
        """Seconds of the last epoch, training and validation (None before any)."""
        if not self.train:
            return None
        return self.train[-1] + (self.eval[-1] if self.eval else 0.0)

    def timing(self) -> Timing:
        return Timing(self.setup or 0.0, mean_epoch(self.train), mean_epoch(self.eval), *self.size, self.per_image,
                      self.predict_s)


@torch.no_grad()
def val_loss(task, model, criterion) -> float:
    """The configured losses on the validation batches, eval mode, no gradient, nothing enqueued: the mean over
    batches. Eval mode drops the slot head's output, so the slot losses are not part of it."""
    model.eval()
    total, n = 0.0, 0
    for batch in task.val_batches():
        loss, _ = criterion(model(batch["x"]), batch)
        total, n = total + float(loss), n + 1
    model.train()
    return total / max(n, 1)
