"""Population trials (latentsweep.trainers.train.population): K members trained in one stacked step compute what each
computes alone
with latentsweep.trainers.train.loop.train (same seed, CPU, float tolerance): histories, best epoch, pruning point,
best.pt; a failing
member fails alone; joiners; done once per member; unstackable configs alone."""
from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from latentsweep.trainers.config.tree import Config, from_dict, with_values
from latentsweep.trainers.data.sets import load_train
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.train.loop import TrainingDiverged, train
from latentsweep.trainers.train.population import Member, population_size, stack_key, train_population
from latentsweep.trainers.train.run import DeadlineReached, TrainResult
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
EPOCHS = 3
# Small sizes for every recipe: 3 epochs of 32-row batches, narrow layers, a short queue.
SMALL = {"train.batch_size": 32, "train.epochs": EPOCHS, "train.early_stop": 0, "data.val_ratio": 0.2,
         "eval.gallery_size": 20, "train.device": "cpu", "train.threads": 0}
TOL = {"rtol": 1e-4, "atol": 1e-5}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    train_path, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=24, dim_image=32, n_labels=5)
    return load_train(train_path)


def recipe(name: str, **values) -> Config:
    """studies/<name>.toml's [base] config at the small sizes, with `values` set."""
    base = from_dict(tomllib.loads((ROOT / "studies" / f"{name}.toml").read_text())["base"])
    return with_values(base, {**SMALL, **values})


# Each stackable recipe of studies/ (its [base]) with three members varying knobs of its search space.
RECIPES = {
    "full_mlp": (recipe("full", **{"model.hidden": "32"}), [
        {"train.seed": 0}, {"train.seed": 1, "optim.lr": 3e-3, "model.dropout": 0.3, "augment.noise_std": 0.2},
        {"train.seed": 2, "optim.weight_decay": 0.05, "temperature.tau": 0.1, "train.average": "ema",
         "train.ema_decay": 0.99, "augment.mixup_alpha": 0.3, "loss.triplet.weight": 0.5,
         "loss.triplet.margin": 0.3}]),
    "full_residual_mlp": (recipe("full", **{"model.kind": "residual_mlp", "model.hidden": "32,32"}), [
        {"train.seed": 3}, {"train.seed": 4, "model.dropout": 0.2, "loss.multipos_infonce.weight": 0.5},
        {"train.seed": 5, "temperature.mode": "learnable", "loss.cosine.weight": 0.3}]),
    "full_moco_mlp_slots": (recipe("full", **{"model.kind": "moco_mlp", "model.hidden": "32", "slots.k": 2,
                                              "slots.hidden": 16}), [
        {"train.seed": 0, "loss.slot_infonce.weight": 0.5}, {"train.seed": 1, "model.dropout": 0.4},
        {"train.seed": 2, "loss.all_images_infonce.weight": 0.0, "optim.lr": 5e-3}]),
    "full_geometry": (recipe("full", **{"model.kind": "geometry", "model.adapter_hidden": 16}), [
        {"train.seed": 0}, {"train.seed": 1, "model.adapter_dropout": 0.3, "optim.lr": 2e-3},
        {"train.seed": 2, "geometry.unfreeze_epoch": 1, "geometry.frozen_epochs": 0}]),
    "baseline_mse": (recipe("baseline_mse", **{"model.hidden": "32,32"}), [
        {"train.seed": 0}, {"train.seed": 1, "model.dropout": 0.0, "loss.cosine.weight": 0.5, "loss.targets": "unit"},
        {"train.seed": 2, "optim.lr": 3e-3}]),
    "moco_queue": (recipe("moco", **{"model.hidden": "32,24", "loss.queue_infonce.size": 64,
                                     "train.early_stop": 2}), [
        {"train.seed": 0}, {"train.seed": 1, "temperature.tau": 0.1, "loss.queue_infonce.in_batch": True},
        {"train.seed": 2, "optim.lr": 1e-3, "loss.mse.weight": 0.5, "train.monitor": "val/mrr"}]),
    "bigjump": (recipe("bigjump", **{"model.adapter_hidden": 16, "loss.queue_infonce.size": 64,
                                     "loss.queue_infonce.warmup_epochs": 1, "geometry.unfreeze_epoch": 1,
                                     "geometry.frozen_epochs": 1}), [
        {"train.seed": 0}, {"train.seed": 1, "temperature.tau_start": 0.15, "loss.moment.weight": 0.1},
        {"train.seed": 2, "geometry.unfreeze_epoch": -1, "optim.lr": 3e-3, "geometry.init": "ridge"}]),
    # moco.toml's space: its other model kinds, two members each
    "moco_linear": (recipe("moco", **{"model.kind": "linear", "loss.queue_infonce.size": 64}), [
        {"train.seed": 0}, {"train.seed": 1, "optim.lr": 1e-3, "optim.weight_decay": 0.01}]),
    "moco_deep_mlp": (recipe("moco", **{"model.kind": "deep_mlp", "model.hidden": "32,32",
                                        "loss.queue_infonce.size": 64}), [
        {"train.seed": 0}, {"train.seed": 1, "model.dropout": 0.1, "loss.targets": "unit"}]),
    "moco_two_head": (recipe("moco", **{"model.kind": "two_head", "model.hidden": "32",
                                        "loss.queue_infonce.size": 64}), [
        {"train.seed": 0}, {"train.seed": 1, "model.dropout": 0.2, "temperature.tau": 0.03}]),
    "moco_relative": (recipe("moco", **{"model.kind": "relative", "model.hidden": "32", "model.n_anchors": 16,
                                        "model.anchor_mix": True,
                                        "loss.queue_infonce.size": 64}), [
        {"train.seed": 0}, {"train.seed": 1, "model.dropout": 0.3}]),
    "vsepp_slots": (recipe("vsepp_slots", **{"model.hidden": "32", "slots.hidden": 16}), [
        {"train.seed": 0}, {"train.seed": 1, "loss.slot_triplet.weight": 0.5, "loss.triplet.margin": 0.1},
        {"train.seed": 2, "loss.slot_diversity.weight": 0.1, "optim.lr": 1e-3}]),
}


def members_of(name: str, out: Path) -> list[tuple[Config, Path]]:
    base, variations = RECIPES[name]
    return [(with_values(base, v), out / f"m{i}") for i, v in enumerate(variations)]


def assert_same_run(alone: TrainResult, stacked: TrainResult, alone_dir: Path | None, stacked_dir: Path | None):
    """The stacked member's history, best epoch and best.pt are the alone run's, within float tolerance."""
    assert isinstance(stacked, TrainResult), stacked
    assert stacked.best_epoch == alone.best_epoch
    assert [r.keys() for r in stacked.history] == [r.keys() for r in alone.history]
    for a, s in zip(alone.history, stacked.history):
        torch.testing.assert_close(s, a, **TOL)
    if alone_dir is not None:
        assert_same_checkpoint(alone_dir / "best.pt", stacked_dir / "best.pt")


def assert_same_checkpoint(alone: Path, stacked: Path) -> None:
    a, s = (torch.load(p, weights_only=True) for p in (alone, stacked))
    assert s["config"] == a["config"] and s["meta"]["epoch"] == a["meta"]["epoch"]
    torch.testing.assert_close(s["state_dict"], a["state_dict"], **TOL)
    torch.testing.assert_close(s["loss_state"], a["loss_state"], **TOL)
    torch.testing.assert_close(s["meta"]["metrics"], a["meta"]["metrics"], **TOL)


def alone_runs(runs: list[tuple[Config, Path]], data, tmp_path: Path, callbacks=None):
    ends = []
    for i, (cfg, out) in enumerate(runs):
        cb = callbacks[i] if callbacks else None
        try:
            ends.append(train(cfg, data, out_dir=tmp_path / "alone" / out.name, callback=cb))
        except Exception as exc:  # noqa: BLE001 - compared with the stacked member's end
            ends.append(exc)
    return ends


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_stacked_members_compute_what_they_compute_alone(name, data, tmp_path):
    runs = members_of(name, tmp_path / "stacked")
    keys = {stack_key(cfg) for cfg, _ in runs}
    assert len(keys) == 1 and None not in keys  # the recipe's members form one shape group
    done: list = []
    ends = train_population([Member(cfg, out_dir=out, done=done.append) for cfg, out in runs], data)
    assert len(ends) == len(runs) and done == ends  # done once per member, with its end
    for (cfg, out), alone, end in zip(runs, alone_runs(runs, data, tmp_path), ends):
        assert_same_run(alone, end, tmp_path / "alone" / out.name, out)


def test_a_diverging_member_fails_alone_and_the_others_still_match(data, tmp_path):
    base = recipe("baseline_mse", **{"model.hidden": "32", "optim.name": "sgd"})
    runs = [(with_values(base, {"train.seed": i, "optim.lr": lr}), tmp_path / "stacked" / f"m{i}")
            for i, lr in enumerate([1e-3, 10.0, 3e-3])]
    alone = alone_runs(runs, data, tmp_path)
    assert isinstance(alone[1], TrainingDiverged)  # the huge learning rate diverges alone too
    ends = train_population([Member(cfg, out_dir=out) for cfg, out in runs], data)
    assert isinstance(ends[1], TrainingDiverged) and str(ends[1]).split(":")[0] == str(alone[1]).split(":")[0]
    for i in (0, 2):
        assert_same_run(alone[i], ends[i], tmp_path / "alone" / f"m{i}", runs[i][1])


class Pruned(Exception):
    """What a pruner raises from the callback (optuna's TrialPruned is not imported by trainers)."""


def pruner_at(epoch: int | None, seen: list):
    """A callback recording (epoch, metrics, improved) and raising Pruned at `epoch` (None: never)."""
    def callback(report):
        seen.append((report.epoch, dict(report.metrics), report.improved))
        if report.epoch == epoch:
            raise Pruned(f"pruned at {epoch}")
    return callback


def test_a_pruned_member_leaves_and_a_joiner_takes_its_place(data, tmp_path):
    base = recipe("full", **{"model.hidden": "32", "train.epochs": 4})
    runs = [(with_values(base, {"train.seed": i, "optim.lr": 1e-3 * (i + 1)}), tmp_path / "stacked" / f"m{i}")
            for i in range(3)]
    joiner = (with_values(base, {"train.seed": 7, "model.dropout": 0.2}), tmp_path / "stacked" / "m3")
    alone_seen: list[list] = [[] for _ in range(4)]
    alone = alone_runs(runs + [joiner], data, tmp_path,
                       callbacks=[pruner_at(1, alone_seen[0]), *(pruner_at(None, s) for s in alone_seen[1:])])
    seen: list[list] = [[] for _ in range(4)]
    callbacks = [pruner_at(1, seen[0]), pruner_at(None, seen[1]), pruner_at(None, seen[2])]
    done: dict[int, list] = {i: [] for i in range(4)}
    members = [Member(cfg, callback=cb, out_dir=out, done=done[i].append)
               for i, ((cfg, out), cb) in enumerate(zip(runs, callbacks))]
    offers = [Member(joiner[0], callback=pruner_at(None, seen[3]), out_dir=joiner[1], done=done[3].append)]
    ends = train_population(members, data, join=lambda: offers.pop() if offers else None)
    assert [len(d) for d in done.values()] == [1, 1, 1, 1]  # each member's done, once
    assert isinstance(ends[0], Pruned) and isinstance(alone[0], Pruned)
    assert [e for e, _, _ in seen[0]] == [0, 1]  # pruned at the same point as alone, after the same reports
    for (e, m, imp), (ea, ma, impa) in zip(seen[0], alone_seen[0]):
        assert (e, imp) == (ea, impa)
        torch.testing.assert_close({k: v for k, v in m.items()}, ma, **TOL)
    assert_same_checkpoint(tmp_path / "alone" / "m0" / "best.pt", runs[0][1] / "best.pt")
    for i in (1, 2, 3):
        assert_same_run(alone[i], ends[i], tmp_path / "alone" / f"m{i}", (runs + [joiner])[i][1])
        assert [e for e, _, _ in seen[i]] == list(range(4))


def test_configs_that_do_not_stack_train_alone(data, tmp_path):
    knn = recipe("full", **{"model.kind": "knn"})
    multilabel = with_values(recipe("multilabel_triplet"), {"train.batch_size": 16})
    mlp = recipe("full", **{"model.hidden": "32"})
    assert stack_key(knn) is None and stack_key(multilabel) is None and stack_key(mlp) is not None
    runs = [(knn, tmp_path / "stacked" / "m0"), (mlp, tmp_path / "stacked" / "m1"),
            (multilabel, tmp_path / "stacked" / "m2")]
    ends = train_population([Member(cfg, out_dir=out) for cfg, out in runs], data)
    for i, alone in enumerate(alone_runs(runs, data, tmp_path)):
        assert_same_run(alone, ends[i], tmp_path / "alone" / f"m{i}", runs[i][1])


def test_stack_key_splits_shapes_and_data_not_values():
    base = recipe("full", **{"model.hidden": "32"})
    same = {"optim.lr": 1e-2, "train.seed": 3, "model.dropout": 0.4, "train.epochs": 7, "train.average": "ema",
            "loss.triplet.weight": 0.5, "temperature.mode": "learnable", "augment.mixup_alpha": 0.2}
    assert stack_key(with_values(base, same)) == stack_key(base)
    for knob, value in {"model.hidden": "64", "train.batch_size": 64, "slots.k": 2, "data.val_ratio": 0.3,
                        "model.kind": "moco_mlp", "train.sampler": "image", "loss.all_images_infonce.weight": 1.0,
                        "train.amp": False, "model.norm": "layernorm"}.items():
        assert stack_key(with_values(base, {knob: value})) != stack_key(base), knob
    assert stack_key(with_values(base, {"model.norm": "batchnorm"})) is None
    assert stack_key(with_values(base, {"train.capture": "compile"})) is None


def test_a_bad_config_or_a_passed_deadline_ends_that_member_alone(data, tmp_path):
    base = recipe("full", **{"model.hidden": "32"})
    passed = Deadline.after(0.0)
    runs = [Member(base, out_dir=tmp_path / "m0"), Member(base, deadline=lambda: passed),
            Member(with_values(base, {"train.seed": 1}), out_dir=tmp_path / "m2")]
    ends = train_population(runs, data)
    assert isinstance(ends[1], DeadlineReached)
    assert isinstance(ends[0], TrainResult) and isinstance(ends[2], TrainResult)
    assert_same_run(train(base, data), ends[0], None, None)


def test_an_interrupt_stops_all_after_writing_each_best_pt(data, tmp_path):
    base = recipe("full", **{"model.hidden": "32", "train.epochs": 4})

    def interrupt(report):
        if report.epoch == 1:
            raise KeyboardInterrupt

    runs = [Member(with_values(base, {"train.seed": i}), callback=interrupt if i == 1 else None,
                   out_dir=tmp_path / f"m{i}") for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        train_population(runs, data)
    for i in range(3):
        assert (tmp_path / f"m{i}" / "best.pt").exists()


def test_population_size_is_one_on_a_cpu_and_for_unstackable_configs(data):
    base = recipe("full", **{"model.hidden": "32"})
    assert population_size(base, data, torch.device("cpu")) == 1
    assert population_size(with_values(base, {"model.kind": "knn"}), data, torch.device("cpu")) == 1


class CountedDeadline:
    """A deadline that passes at its `n`-th reading: the same point of a run however long its steps take (a run
    reads its deadline before each step and at each epoch's end)."""

    def __init__(self, n: int):
        self.n, self.reads = n, 0

    def __call__(self) -> Deadline:
        self.reads += 1
        return Deadline.after(0.0) if self.reads >= self.n else Deadline.never()


def test_a_deadline_passing_mid_epoch_stops_that_member_as_alone(data, tmp_path):
    base = recipe("full", **{"model.hidden": "32", "train.epochs": 4})
    cfgs = [with_values(base, {"train.seed": i}) for i in range(3)]
    # 15 steps an epoch (480 training captions, batch 32): the 22nd reading is during epoch 1's steps
    alone = train(cfgs[1], data, deadline=CountedDeadline(22))
    assert alone.stopped_at_deadline and alone.best_epoch == 0 and len(alone.history) == 1
    ends = train_population([Member(cfgs[0]), Member(cfgs[1], deadline=CountedDeadline(22)), Member(cfgs[2])],
                            data)
    assert ends[1].stopped_at_deadline
    assert_same_run(alone, ends[1], None, None)
    assert_same_run(train(cfgs[2], data), ends[2], None, None)


def test_population_size_on_cuda_follows_measured_memory_and_step_time(data, monkeypatch):
    """The CUDA branch with the card faked: K doubles while the summed rate gains, and the memory caps it."""
    import latentsweep.trainers.train.population as population

    base = recipe("full", **{"model.hidden": "32"})
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * gib, 80 * gib))

    def card(step_s, per_member=gib):
        # measure(cfg, data, k): seconds per stacked step and peak bytes (1 GiB of base + 1 GiB a member)
        monkeypatch.setattr(population, "measure", lambda cfg, data, k, steps=5: (step_s(k), gib + k * per_member))

    cuda = torch.device("cuda")
    card(lambda k: 1.0)  # the step takes as long for any K: the rate grows with K until the memory is full
    # (0.8 x 10 GiB - 1 GiB of base) // (1 GiB a member + its best-state copy): 6 members
    assert population_size(base, data, cuda) == 6
    card(lambda k: 1.0 if k <= 4 else k / 4)  # busy from K = 4 on: doubling again gains nothing
    assert population_size(base, data, cuda) == 4
    card(lambda k: float(k))  # no gain at all from stacking
    assert population_size(base, data, cuda) == 1

    def oom_past_2(k):
        if k > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return 1.0

    card(oom_past_2)
    assert population_size(base, data, cuda) == 2


def _stacked_members(cfgs: list[Config], data) -> list[bool]:
    """Whether each config, started in one population, steps in the stacked optimiser (not its own)."""
    from latentsweep.trainers.train.population import _Population

    pop = _Population(data, progress=False)
    assert all(pop.start(Member(cfg)) for cfg in cfgs)
    return [lv.stacked for lv in pop.live]


def test_every_stackable_recipe_steps_in_the_stacked_optimiser(data):
    for name in sorted(RECIPES):
        base, variations = RECIPES[name]
        assert all(_stacked_members([with_values(base, v) for v in variations], data)), name
    sgd = recipe("baseline_mse", **{"model.hidden": "32", "optim.name": "sgd"})
    assert _stacked_members([sgd, with_values(sgd, {"optim.name": "adamw"})], data) == [False, True]


def test_stacked_optimiser_members_clip_decay_join_late_and_fail_alone(data, tmp_path):
    """Clipping, weight decay 0, a slot head no member but one gets a grad for, EMA, a joiner whose step counts
    start when the others are an epoch in, and a NaN member (AdamW, lr 1e6): each computes what it computes alone,
    and the NaN one fails alone."""
    base = recipe("full", **{"model.kind": "moco_mlp", "model.hidden": "32", "slots.k": 2, "slots.hidden": 16,
                             "train.epochs": 3})
    variations = [{"train.seed": 0, "train.grad_clip": 0.5, "loss.slot_infonce.weight": 0.5},
                  {"train.seed": 1, "optim.weight_decay": 0.0},
                  {"train.seed": 2, "optim.lr": 1e6, "train.grad_clip": 1.0},
                  {"train.seed": 3, "train.average": "ema", "train.ema_decay": 0.9, "optim.weight_decay": 0.1}]
    runs = [(with_values(base, v), tmp_path / "stacked" / f"m{i}") for i, v in enumerate(variations)]
    assert all(_stacked_members([cfg for cfg, _ in runs], data))
    alone = alone_runs(runs, data, tmp_path)
    assert isinstance(alone[2], TrainingDiverged)
    joiner = [Member(runs[3][0], out_dir=runs[3][1])]
    ends = train_population([Member(cfg, out_dir=out) for cfg, out in runs[:3]], data,
                            join=lambda: joiner.pop() if joiner else None)
    assert isinstance(ends[2], TrainingDiverged)
    for i in (0, 1, 3):
        assert_same_run(alone[i], ends[i], tmp_path / "alone" / f"m{i}", runs[i][1])


@pytest.mark.parametrize("backend", [None, "math"])
def test_other_optimiser_paths_compute_what_members_compute_alone(backend, data, tmp_path):
    """The per-member path (None) and the [K]-column Adam ("math", the fused kernel's arithmetic to float
    rounding) on a recipe without a chaotic parameter."""
    runs = members_of("full_mlp", tmp_path / "stacked")
    ends = train_population([Member(cfg, out_dir=out) for cfg, out in runs], data, stacked_optim=backend)
    for (cfg, out), alone, end in zip(runs, alone_runs(runs, data, tmp_path), ends):
        assert_same_run(alone, end, tmp_path / "alone" / out.name, out)
