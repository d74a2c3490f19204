"""Whole-step capture (train.capture): a training step's forward and loss, eager or compiled, and the path taken.

Issue 33: at batch 512 an H200 was busy ~14% of a step (profiler: 174 ms CPU vs 24.7 ms CUDA for 59 steps), the rest
kernel launches. `train.capture = "compile"` hands the step's model forward and criterion (the part that launches
most kernels) to torch.compile, in mode "reduce-overhead" on CUDA (CUDA graphs: the step's kernels replayed with
one launch) and the default mode elsewhere; backward goes through the compiled graph, the optimiser stays eager.
It is opt-in ("none", eager, is the default): no GPU measurement has yet shown it faster for every recipe.

A captured step computes what the eager one does (tests/test_capture.py compares the losses and weights). The step
runs eager instead, and `path` says why ("eager-fallback: <reason>"), when
  * a part keeps Python-side state that changes every step (`refusal`): a recompile per step, or a stale graph,
  * the device is neither CPU nor CUDA,
  * compiling or running the compiled step raises (a compile error, or more recompiles than dynamo's limit: a
    shape that changes from step to step). The tasks drop the ragged last batch, so every step has one shape.
"""
from __future__ import annotations

import torch

from latentsweep.trainers.config.tree import Config
from latentsweep.trainers.losses import Criterion

# train.capture's values: "none" (eager, the default) and "compile" (torch.compile of forward + loss).
CAPTURES = ("none", "compile")
# The compile mode by device: CUDA graphs on CUDA; "reduce-overhead" has no meaning without them.
_MODES = {"cuda": "reduce-overhead", "cpu": "default"}
# The longest reason kept in `path` (an exception's first line can be a page long).
_REASON_CHARS = 200


def step_forward(model: torch.nn.Module, criterion: Criterion, batch: dict, amp: bool):
    """(out, loss, terms) of one training step: the model's outputs for batch["x"] (plus the multilabel task's
    negatives' and positives' predictions), under autocast when `amp`, and the criterion's loss on them."""
    with torch.autocast(batch["x"].device.type, enabled=amp):
        out = model(batch["x"])
        for extra in ("neg", "pos"):  # the multilabel task's random negatives and fixed positives
            if f"{extra}_x" in batch:
                out[f"{extra}_pred"] = model(batch[f"{extra}_x"])["pred"]
    loss, terms = criterion(out, batch)
    return out, loss, terms


def refusal(cfg: Config, criterion: Criterion) -> str | None:
    """Why this run's step cannot be captured (None: it can): a part whose Python-side state changes each step."""
    for loss in criterion.losses.values():
        reason = type(loss).capture_refusal(loss.cfg)
        if reason is not None:
            return reason
    if cfg.temperature.mode == "curriculum":
        return "temperature.mode = 'curriculum': tau is a Python float that changes every step"
    return None


class StepForward:
    """`forward(batch) -> (out, loss, terms)` for every training step of a run, as train.capture says.

    `path`: "none" (eager by choice), "compile" (every step so far ran compiled) or "eager-fallback: <reason>";
    `captured` / `steps`: steps run compiled / all steps (the loop logs their ratio as train/captured)."""

    def __init__(self, cfg: Config, model: torch.nn.Module, criterion: Criterion, amp: bool,
                 device: torch.device, backend: str = "inductor"):
        self.model, self.criterion, self.amp, self.device = model, criterion, amp, device
        self.captured = self.steps = 0
        self.compiled = None
        self.path = cfg.train.capture
        if cfg.train.capture == "none":
            return
        reason = refusal(cfg, criterion) or (None if device.type in _MODES else f"device {device.type}")
        if reason is not None:
            self.path = f"eager-fallback: {reason}"
            return
        # dynamic left to dynamo: the batch shape is one (the tasks drop the ragged tail), and a Python int that
        # changes (a loss's epoch) becomes symbolic after its first change instead of a recompile per epoch.
        # `backend` is for tests: "aot_eager" traces the same graph without inductor's C++ build (minutes on 2 cores).
        mode = _MODES[device.type] if backend == "inductor" else None
        self.compiled = torch.compile(self.eager, mode=mode, backend=backend)

    def eager(self, batch: dict):
        return step_forward(self.model, self.criterion, batch, self.amp)

    def __call__(self, batch: dict):
        self.steps += 1
        if self.compiled is None:
            return self.eager(batch)
        try:
            if self.device.type == "cuda":
                # A new step: the CUDA graphs' previous outputs may be overwritten (the loop has summed them).
                torch.compiler.cudagraph_mark_step_begin()
            # Past the recompile limit dynamo would run the step eager without a word; raising makes it a fallback.
            with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
                result = self.compiled(batch)
        except Exception as exc:  # noqa: BLE001 - any failure to capture falls back; eager re-raises a real error
            self.compiled = None
            first = (str(exc).strip().splitlines() or [""])[0][:_REASON_CHARS]
            self.path = f"eager-fallback: {type(exc).__name__}: {first}"
            return self.eager(batch)
        self.captured += 1
        return result

    def epoch_metrics(self) -> dict[str, float]:
        """{"train/captured": share of the steps so far that ran compiled}; nothing when capture is off."""
        if self.path == "none":
            return {}
        return {"train/captured": self.captured / max(self.steps, 1)}
