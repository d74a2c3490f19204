"""A trial of `latentsweep run` is reproducible from its seed: the keeper that watches the search from the same
process draws nothing from torch's global generator (its models are built on the meta device), so a trial re-run
alone with `latentsweep train`, its recorded parameters and its seed gives the same value, on the same device."""
from __future__ import annotations

import json
import tomllib
import types
from pathlib import Path

import optuna
import pytest
import torch

from latentsweep.search.cli.main import main
from latentsweep.search.pick import safe
from latentsweep.search.pick.judge import Standing, make_judge
from latentsweep.search.pick.safe import Keeper, SafeAnswer
from latentsweep.search.study.contract import TrialOutputs
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.search.tracking.paths import resolve_in_state
from latentsweep.trainers.train.checkpoint import CenteredModel, atomic_torch_save, checkpoint_payload, load_model
from latentsweep.trainers.config.tree import Config, with_values
from latentsweep.trainers.data.sets import load_test, load_train
from latentsweep.trainers.models.zoo import ModelContext, build_model
from latentsweep.trainers.data.synthetic import write_synthetic

# The trained model draws from torch's global generator at every step (CPU dropout), and its first layers are drawn
# right after the trial's seeding: a build beside it at any moment of the trial changes its value.
STUDY = """
[study]
name = "{name}"
n_trials = {n_trials}
sampler = {{ name = "random", seed = 0 }}
pruner = {{ name = "none" }}

[base.data]
val_ratio = 0.25

[base.model]
kind = "mlp"
hidden = [64]
dropout = 0.3

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = 4
batch_size = 32

[space]
"optim.lr" = {{ type = "float", low = 1e-3, high = 1e-2, log = true }}
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("repro")
    train, test, _ = write_synthetic(root / "data", 240, dim_text=24, dim_image=32, n_test=60)
    return types.SimpleNamespace(root=root, train=train, test=test)


@pytest.mark.parametrize("values", [{"model.kind": "mlp", "model.hidden": [64], "model.dropout": 0.3},
                                    {"model.kind": "geometry"}, {"model.kind": "knn"},
                                    {"model.kind": "mlp", "slots.k": 4}])
def test_the_keepers_load_leaves_the_global_generator_alone(tmp_path, values):
    x, y = torch.randn(200, 24), torch.randn(200, 32)
    cfg = with_values(Config(), values)
    model = CenteredModel(build_model(cfg, ModelContext(24, 32, x, y)), x.mean(0))
    path = tmp_path / "best.pt"
    atomic_torch_save(checkpoint_payload(model, cfg, (24, 32), {}), path)
    before = torch.random.get_rng_state().clone()
    quiet, _, _ = load_model(path, rng_free=True)
    assert torch.equal(before, torch.random.get_rng_state())
    loud, _, _ = load_model(path)  # the ordinary build draws its initial weights (what the keeper used to do)
    if any(p.requires_grad for p in loud.parameters()) and values["model.kind"] != "knn":
        assert not torch.equal(before, torch.random.get_rng_state())
    probe = torch.randn(7, 24)
    with torch.no_grad():
        assert torch.allclose(quiet(probe)["pred"], loud(probe)["pred"])


def _study(tmp: Path, name: str, n_trials: int) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(STUDY.format(name=name, n_trials=n_trials))
    return path


@pytest.mark.slow  # a study of 2 trials: 10-17 s on 2 cores
def test_a_keeper_look_draws_nothing_and_reopens_no_storage(world, tmp_path, monkeypatch):
    """The keeper's look at a study with a new best trial: its checkpoint is loaded and scored, the global generator
    is untouched, and the storage is opened once for all looks."""
    study_file = _study(tmp_path, "look", 2)
    state = tmp_path / "state"
    assert main(["study", "run", str(study_file), "--data", str(world.train), "--state-dir", str(state),
                 "--quiet"]) == 0
    opened = []
    real = safe.load_existing_study
    monkeypatch.setattr(safe, "load_existing_study", lambda *a, **k: opened.append(a) or real(*a, **k))
    data = load_train(world.train)
    judge = make_judge(load_study_file(study_file).base, data)
    out = tmp_path / "sub.csv"
    keeper = Keeper("look", f"sqlite:///{state / 'optuna.db'}", state, load_test(world.test), out, "cpu",
                    SafeAnswer(out, "nothing yet", 0.0), judge, Standing("nothing yet", None))
    before = torch.random.get_rng_state().clone()
    answer = keeper.refresh()
    assert torch.equal(before, torch.random.get_rng_state())
    assert answer.source.startswith("trial ") and out.is_file()
    for _ in range(3):
        keeper.refresh()
    keeper.close()
    assert len(opened) == 1


@pytest.mark.slow  # 35-50 s on 2 cores (loaded): a run of 4 trials and 4 re-runs
def test_a_run_trial_reproduces_alone_with_train_while_the_keeper_watches(world, tmp_path, monkeypatch):
    """`run` with one in-process worker and the keeper looking every 0.7 s (a trial here takes 2-4 s: its loads of
    each new best fall inside the next trial; looking at once would load during the last trial's close), then every
    finished trial re-run alone with `latentsweep train` and its parameters and seed. With the keeper's models built
    the ordinary way this failed (trial 1: 0.4684 alone, 0.4666 in the run)."""
    monkeypatch.setattr(safe, "KEEP_POLL_S", 0.7)
    study_file = _study(tmp_path, "repro", 4)
    state = tmp_path / "state"
    assert main(["run", str(study_file), "--time", "120", "--data", str(world.train), "--test", str(world.test),
                 "--state-dir", str(state), "--quiet"]) == 0
    study = optuna.load_study(study_name="repro", storage=f"sqlite:///{state / 'optuna.db'}")
    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) >= 3
    for t in done:
        recorded = tomllib.loads((resolve_in_state(TrialOutputs.of(t).out_dir, state) / "config.toml").read_text())
        seed = recorded["train"]["seed"]
        out = tmp_path / f"alone-{t.number}"
        sets = [f"{k}={v!r}" for k, v in t.params.items()]
        assert main(["train", str(study_file), "--data", str(world.train), "--out", str(out), "--quiet",
                     "--seed", str(seed), *[a for s in sets for a in ("--set", s)]]) == 0
        alone = json.loads((out / "result.json").read_text())["val/mrr"]
        assert alone == pytest.approx(t.value, abs=1e-6), (t.number, t.params)
