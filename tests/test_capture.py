"""Tests of issue 33: no host sync or per-step host work in a training step, and train.capture
(trainers/train/capture.py)
computing what the eager step does, with its eager fallbacks recorded."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from latentsweep.trainers.train.capture import StepForward
from latentsweep.trainers.train.checkpoint import CenteredModel
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.core.errors import ConfigError
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.train.loop import StepParts, _train_epoch, seed_everything, train
from latentsweep.trainers.losses import Criterion
from latentsweep.trainers.models.zoo import build_model
from latentsweep.trainers.train.optim import build_optimizer
from latentsweep.trainers.train.regularise import BatchAugment, build_average
from latentsweep.trainers.data.synthetic import write_synthetic
from latentsweep.trainers.train.tasks import TASKS

SMALL = {"model.hidden": "64", "train.batch_size": 64, "train.epochs": 2, "data.val_ratio": 0.2,
         "eval.gallery_size": 20, "train.seed": 0, "train.device": "cpu"}
# Recipes whose every step must be free of host syncs: the default loss, the VSE++ hinge, the queue after its warm-up,
# the slot losses, multi-positive with agreement, the all-images bank, the temperature curriculum, EMA, noise, clipping.
SYNC_FREE = {
    "infonce": {"loss.infonce.weight": 1.0, "train.average": "ema", "train.grad_clip": 1.0},
    "vsepp": {"loss.triplet.weight": 1.0, "loss.triplet.max_violation": True, "loss.triplet.warmup_epochs": 1},
    "queue": {"loss.queue_infonce.weight": 1.0, "loss.queue_infonce.size": 128, "train.sampler": "image"},
    "slots": {"loss.triplet.weight": 1.0, "slots.k": 3, "loss.slot_diversity.weight": 0.1,
              "loss.slot_triplet.weight": 0.5, "loss.condensation.weight": 0.1},
    "agreement": {"loss.infonce.weight": 1.0, "loss.agreement.weight": 0.5, "loss.moment.weight": 0.1,
                  "temperature.mode": "curriculum", "augment.noise_std": 0.1},
    "bank": {"loss.all_images_infonce.weight": 1.0, "temperature.mode": "learnable"},
}
MULTILABEL = {"data.task": "multilabel", "loss.multilabel_triplet.weight": 1.0,
              "loss.multilabel_triplet.negatives": "random"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train_path, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 300, dim_text=32, dim_image=48, n_labels=5)
    return load_train(train_path)


def cfg_of(values: dict) -> Config:
    return with_values(Config(), {**SMALL, **values})


def parts_of(cfg: Config, data, forward_backend: str | None = None) -> StepParts:
    """The parts `_fit` builds for a run on the CPU; with forward_backend, a StepForward compiled by that backend."""
    device = torch.device("cpu")
    gen = seed_everything(cfg.train.seed)
    task = TASKS.get(cfg.data.task)(cfg, data, device)
    model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean)
    criterion = Criterion(cfg, task.dim_out)
    steps = task.steps_per_epoch()
    opt, schedule = build_optimizer(cfg, model, criterion, steps)
    forward = None if forward_backend is None else StepForward(cfg, model, criterion, False, device, forward_backend)
    return StepParts(cfg, task, model, criterion, opt, schedule, torch.amp.GradScaler("cpu", enabled=False), gen,
                     steps, False, BatchAugment(cfg, task.x), build_average(cfg, model), Deadline.never, forward)


def _refuse(name: str):
    def refused(*args, **kwargs):
        raise AssertionError(f"host sync in a training step: {name}")
    return refused


def _no_bool_mask_getitem(original):
    """Tensor indexing that refuses a bool tensor index: the device counts its True entries for the host (a sync)."""
    def getitem(self, index):
        for part in index if isinstance(index, tuple) else (index,):
            if isinstance(part, torch.Tensor) and part.dtype == torch.bool:
                raise AssertionError("host sync in a training step: indexing by a bool mask")
        return original(self, index)
    return getitem


@contextlib.contextmanager
def host_syncs_refused(monkeypatch):
    """Within the block, the tensor calls that read a device value on the host raise (CUDA's sync debug mode
    does not exist on the CPU), as does torch.tensor: on CUDA a host tensor copied to the device, a sync."""
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__"):
            m.setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"))
        m.setattr(torch.Tensor, "__getitem__", _no_bool_mask_getitem(torch.Tensor.__getitem__))
        m.setattr(torch, "tensor", _refuse("torch.tensor"))
        yield


class SyncFreeTask:
    """The run's task, whose batch iterator runs with the host syncs refused until it is exhausted: so every step
    of the epoch (made between two batches) does, and the one read per epoch after the last step does not."""

    def __init__(self, task, monkeypatch):
        self.task, self.monkeypatch = task, monkeypatch

    def __getattr__(self, name):
        return getattr(self.task, name)

    def batches(self, generator):
        with host_syncs_refused(self.monkeypatch):
            yield from self.task.batches(generator)


def train_epoch_without_syncs(parts: StepParts, epoch: int, monkeypatch) -> dict[str, float]:
    return _train_epoch(dataclasses.replace(parts, task=SyncFreeTask(parts.task, monkeypatch)), epoch)


# ---------------------------------------------------------------------------------------------- host syncs

@pytest.mark.parametrize("recipe", sorted(SYNC_FREE))
def test_a_training_step_reads_nothing_back_on_the_host(recipe, data, monkeypatch):
    parts = parts_of(cfg_of(SYNC_FREE[recipe]), data)
    for epoch in range(2):  # the second epoch: past the warm-ups (hardest negatives, the queue filled)
        parts.criterion.on_epoch_start(epoch, parts.task.epoch_context(parts.model))
        means = train_epoch_without_syncs(parts, epoch, monkeypatch)
    assert means["train/loss"] > 0


def test_a_multilabel_step_reads_nothing_back_and_draws_its_negatives_once_per_epoch(data, monkeypatch):
    parts = parts_of(cfg_of(MULTILABEL), data)
    draws = []
    randint = torch.randint
    monkeypatch.setattr(torch, "randint", lambda *a, **k: draws.append(1) or randint(*a, **k))
    parts.criterion.on_epoch_start(0, parts.task.epoch_context(parts.model))
    train_epoch_without_syncs(parts, 0, monkeypatch)
    assert len(draws) == 1 and parts.steps > 1  # one draw for the epoch, not one host tensor per step


def test_the_epochs_negatives_are_the_ones_a_draw_per_batch_gives(data):
    cfg = cfg_of(MULTILABEL)
    task = TASKS.get("multilabel")(cfg, data, torch.device("cpu"))
    batches = list(task.batches(torch.Generator().manual_seed(5)))
    gen = torch.Generator().manual_seed(5)
    perm = torch.randperm(len(task.x), generator=gen)
    b = cfg.train.batch_size
    for k, batch in enumerate(batches):  # the draw per batch the task made before issue 33
        idx = perm[k * b:(k + 1) * b]
        cand = torch.randint(len(task.x), (b, 16), generator=gen)
        assert torch.equal(batch["neg_x"], task.x[task._random_negatives(idx, cand)])


# ---------------------------------------------------------------------------------------------- train.capture

def test_capture_is_off_by_default_and_a_choice(data):
    assert Config().train.capture == "none"
    result = train(cfg_of({"loss.infonce.weight": 1.0, "train.epochs": 1}), data)
    assert result.capture == "none" and "train/captured" not in result.history[0]
    with pytest.raises(ConfigError):
        cfg_of({"train.capture": "graphs"})


@pytest.mark.parametrize("values, reason", [
    ({"loss.queue_infonce.weight": 1.0, "loss.queue_infonce.size": 128}, "loss.queue_infonce"),
    ({"loss.infonce.weight": 1.0, "temperature.mode": "curriculum"}, "temperature.mode = 'curriculum'"),
])
def test_a_step_with_per_step_python_state_runs_eager_and_says_why(values, reason, data):
    eager = train(cfg_of(values), data)
    captured = train(cfg_of({**values, "train.capture": "compile"}), data)
    assert captured.capture.startswith(f"eager-fallback: {reason}")
    assert [row["train/captured"] for row in captured.history] == [0.0, 0.0]
    assert [row["train/loss"] for row in captured.history] == [row["train/loss"] for row in eager.history]


def test_a_compile_that_fails_falls_back_to_the_eager_step(data, monkeypatch):
    def broken(fn, **kwargs):
        def run(batch):
            raise RuntimeError("backend compiler failed\nsecond line")
        return run

    monkeypatch.setattr(torch, "compile", broken)
    values = {"loss.infonce.weight": 1.0}
    eager = train(cfg_of(values), data)
    fallback = train(cfg_of({**values, "train.capture": "compile"}), data)
    assert fallback.capture == "eager-fallback: RuntimeError: backend compiler failed"
    assert [row["train/loss"] for row in fallback.history] == [row["train/loss"] for row in eager.history]
    assert all(torch.equal(a, b) for a, b in zip(eager.model.state_dict().values(),
                                                 fallback.model.state_dict().values()))


def _eager_and_captured(values: dict, data, backend: str, epochs: int = 2):
    """(eager means, captured means, eager parts, captured parts) after `epochs` epochs from the same start."""
    eager = parts_of(cfg_of(values), data)
    captured = parts_of(cfg_of({**values, "train.capture": "compile"}), data, backend)
    for epoch in range(epochs):
        for p in (eager, captured):
            p.criterion.on_epoch_start(epoch, p.task.epoch_context(p.model))
        means = _train_epoch(eager, epoch), _train_epoch(captured, epoch)
    return (*means, eager, captured)


def _assert_same_step(values: dict, data, backend: str) -> None:
    eager_means, captured_means, eager, captured = _eager_and_captured(values, data, backend)
    assert captured.forward.path == "compile" and captured_means.pop("train/captured") == 1.0
    # Captured, `unit` normalises the known-unit targets again (Criterion.forward): float32 rounding apart
    assert captured_means == pytest.approx(eager_means, rel=1e-5)
    for a, b in zip(eager.model.state_dict().values(), captured.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_captured_step_computes_the_eager_step(data):
    # aot_eager: dynamo's graph and AOTAutograd's backward, without inductor's C++ build (minutes on 2 cores)
    _assert_same_step({"loss.infonce.weight": 1.0, "train.average": "ema"}, data, "aot_eager")


@pytest.mark.slow
@pytest.mark.parametrize("values", [
    {"loss.triplet.weight": 1.0, "loss.triplet.max_violation": True, "loss.triplet.warmup_epochs": 1},
    {"loss.multipos_infonce.weight": 1.0, "loss.agreement.weight": 0.5},  # graph breaks at torch.unique
    {"loss.all_images_infonce.weight": 1.0, "loss.all_images_infonce.symmetric": False,
     "temperature.mode": "learnable"},  # the bank's autograd.Function (losses/bank.py: BankCE), its in-place backward
])
def test_captured_recipes_compute_the_eager_step(values, data):
    _assert_same_step(values, data, "aot_eager")


@pytest.mark.slow
def test_a_run_captured_by_inductor_computes_the_eager_run(data):
    values = {"loss.infonce.weight": 1.0}
    eager = train(cfg_of(values), data)
    captured = train(cfg_of({**values, "train.capture": "compile"}), data)
    assert captured.capture == "compile" and [row["train/captured"] for row in captured.history] == [1.0, 1.0]
    assert ([row["train/loss"] for row in captured.history]
            == pytest.approx([row["train/loss"] for row in eager.history], rel=1e-5))
