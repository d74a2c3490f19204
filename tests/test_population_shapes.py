"""A population asks the trial that fills a place of a group with the group's shape fixed
(latentsweep.search.study.population, samplers.FixedWhereItFits): the shape knobs come from stack_key, joiners stack,
each trial keeps its own params, the other knobs still vary, an enqueued trial keeps its own values, and a fixed value
its distribution does not hold is sampled instead. Real Optuna on SQLite, real MLflow, the trainers' stacked step."""
from __future__ import annotations

import warnings
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from latentsweep.search.cli.main import main
from latentsweep.search.study.population import shape_params
from latentsweep.search.study.samplers import FixedWhereItFits, fixing
from latentsweep.search.study.space import sample
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.trainers.config.tree import flatten, with_values
from latentsweep.trainers.data.synthetic import write_synthetic

POP = "latentsweep.population"
SHAPE = ("train.batch_size", "model.hidden")

# Batch size and width searched (two values each: four shapes), the learning rate and epochs beside them. Trial 0 is
# enqueued with one shape and trials 1-3 with another (trial 4 is sampled): trial 1 must keep its own values, wait
# and lead the next group, whose places are asked with its shape; it trains 5 epochs and trials 2 and 3 two, so
# trials join the group (asked with its shape) while trial 1 still trains.
SHAPES = """
[study]
name = "{name}"
n_trials = 8
sampler = {{ name = "tpe", seed = 0, n_startup_trials = 2, multivariate = true, group = true }}
pruner = {{ name = "none" }}

[base.data]
val_ratio = 0.25

[base.model]
kind = "mlp"
hidden = [32]

[base.loss]
infonce = {{ weight = 1.0 }}

[base.train]
epochs = 2
batch_size = 64

[space]
"train.batch_size" = {{ type = "categorical", choices = [32, 64] }}
"model.hidden" = {{ type = "categorical", choices = ["16", "32"] }}
"optim.lr" = {{ type = "float", low = 1e-4, high = 1e-2, log = true }}
"train.epochs" = {{ type = "categorical", choices = [2, 5] }}

[[enqueue]]
"train.batch_size" = 64
"model.hidden" = "16"
"train.epochs" = 2

[[enqueue]]
"train.batch_size" = 32
"model.hidden" = "32"
"train.epochs" = 5

[[enqueue]]
"train.batch_size" = 32
"model.hidden" = "32"
"train.epochs" = 2

[[enqueue]]
"train.batch_size" = 32
"model.hidden" = "32"
"train.epochs" = 2
"optim.lr" = 0.003
"""


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> Path:
    train, _, _ = write_synthetic(tmp_path_factory.mktemp("syn"), 120, dim_text=8, dim_image=12, n_test=20)
    return train


def trials(state: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}").get_trials()


def most_at_once(group: list[optuna.trial.FrozenTrial]) -> int:
    """The most trials of `group` held at once, from their start and end times."""
    events = sorted([(t.datetime_start, 1) for t in group] + [(t.datetime_complete, -1) for t in group])
    held = peak = 0
    for _, step in events:
        held += step
        peak = max(peak, held)
    return peak


def test_joiners_take_their_groups_shape_stack_and_keep_their_own_params(synthetic, tmp_path, capsys):
    sf, state = tmp_path / "shapes.toml", tmp_path / "state"
    sf.write_text(SHAPES.format(name="shapes"))
    assert main(["study", "run", str(sf), "--data", str(synthetic), "--state-dir", str(state), "--quiet",
                 "--no-warm-start", "--population", "4"]) == 0
    got = trials(state, "shapes")
    assert len(got) == 8 and {t.state.name for t in got} == {"COMPLETE"}
    shape = {t.number: tuple(t.params[k] for k in SHAPE) for t in got}
    assert shape[0] == (64, "16") and shape[1] == (32, "32")  # enqueued: their own values, not a group's
    groups: dict[str, list] = {}
    for t in got:
        groups.setdefault(t.user_attrs[POP]["id"], []).append(t)
    led = next(g for g in groups.values() if g[0].number == 1)
    founders, joined = led[:4], led[4:]
    assert [t.number for t in founders] == [1, 2, 3, 4]  # trial 1's places filled before it trains
    assert {shape[t.number] for t in founders} == {(32, "32")}  # trial 4 sampled with trial 1's shape
    assert most_at_once(led) == 4  # trained stacked: the population's 4 places
    last = max(t.datetime_complete for t in founders)
    while_founders = [t for t in joined if t.datetime_start < last]
    assert len(while_founders) >= 2 and {shape[t.number] for t in while_founders} == {(32, "32")}
    lrs = [t.params["optim.lr"] for t in got if t.number >= 4]
    assert len(set(lrs)) == len(lrs)  # the sampler's proposals for the other knobs still vary
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    exp = client.get_experiment_by_name("shapes")
    by_name = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    for t in got:  # each trial records its own params, in Optuna and in its run
        params = by_name[f"trial-{t.number}"].data.params
        assert params["search.optim.lr"] == str(t.params["optim.lr"])
        assert params["train.batch_size"] == str(t.params["train.batch_size"])
    err = capsys.readouterr().err
    assert err.count("population: a trial that fills a place of a group is asked with the group's shape") == 1
    assert "train.batch_size, model.hidden of trial" in err


def test_the_shape_knobs_are_those_that_change_stack_key():
    """In full.toml's space: model kind, width (or the adapter's), slots and batch size at every sampled config; a
    loss weight where it turns the all-images bank on or off (the enqueued base, at 0); never the values only."""
    sf = load_study_file("full")
    base = flatten(sf.base)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3))
    for _ in range(6):
        trial = study.ask()
        cfg = with_values(sf.base, sample(trial, list(sf.space), base))
        width = "model.adapter_hidden" if trial.params["model.kind"] == "geometry" else "model.hidden"
        assert set(shape_params(cfg, trial.params, sf.space)) == {"model.kind", width, "slots.k", "train.batch_size"}
    enqueued = dict(sf.enqueue[0])  # the base config's values of every searched knob (no branches: name == key)
    assert enqueued["loss.all_images_infonce.weight"] == 0.0
    cfg = with_values(sf.base, enqueued)
    assert set(shape_params(cfg, enqueued, sf.space)) == {"model.kind", "model.hidden", "slots.k", "train.batch_size",
                                                          "loss.all_images_infonce.weight"}


def objective_space(trial: optuna.Trial) -> float:
    x = trial.suggest_categorical("x", [1, 2, 3])
    y = trial.suggest_float("y", 0.0, 1.0)
    z = trial.suggest_float("z", -1.0, 1.0)
    return x + y + z


@pytest.mark.parametrize("sampler", [
    optuna.samplers.TPESampler(seed=0, n_startup_trials=3, multivariate=True, group=True),
    optuna.samplers.TPESampler(seed=0, n_startup_trials=3), optuna.samplers.RandomSampler(seed=0)])
def test_fixed_parameters_hold_under_relative_sampling_and_the_others_vary(sampler):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        study = optuna.create_study(sampler=sampler)
    study.optimize(objective_space, n_trials=5)
    for _ in range(6):
        with fixing(study, {"x": 2, "y": 0.25}):
            trial = study.ask()
            value = objective_space(trial)
        study.tell(trial, value)
    asked = study.trials[5:]
    assert {(t.params["x"], t.params["y"]) for t in asked} == {(2, 0.25)}
    assert len({t.params["z"] for t in asked}) == 6  # sampled, relative (TPE after its startup) or independent
    assert study.sampler is sampler  # given back after each ask


def test_a_fixed_value_its_distribution_does_not_hold_is_sampled_instead():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    study.enqueue_trial({"y": 0.5})  # an enqueued trial keeps its own values over the fixed ones
    with fixing(study, {"x": 7, "y": 3.0}) as fixed:
        enqueued = study.ask()
        objective_space(enqueued)
        assert enqueued.params["y"] == 0.5
        trial = study.ask()
        objective_space(trial)  # neither raises (7 is no choice) nor records 3.0 out of [0, 1]
    assert isinstance(fixed, FixedWhereItFits) and fixed.unfit == {"x", "y"}
    assert trial.params["x"] in (1, 2, 3) and 0.0 <= trial.params["y"] <= 1.0


def test_a_join_takes_the_groups_shape_while_a_trial_it_started_with_trains():
    """After the last of them ends, a joiner is asked freely: a group of one shape must not take every trial."""
    from latentsweep.search.study.population import Population, Seat

    asked = []

    class Asks(Population):
        def _shape(self, leader):
            asked.append(leader)
            return {}

        def _claim_started(self, joining):
            return None

    first, second, waiting = (Seat(trial=None, beat=None, group=g) for g in (1, 1, 2))
    pop = Asks(study_file=None, spec=None, study=None, runner=None, size=2)
    pop.current, pop.founders = first, [first, second]
    pop._claim(joining=True)
    first.ended = True  # the group's first ended: the other it started with still trains
    pop._claim(joining=True)
    second.ended = True
    pop._claim(joining=True)
    pop.seats = [waiting]
    pop._claim()  # between groups: the waiting group's first
    assert asked == [first, first, None, waiting]
