"""Warm start (search/study/warm.py): a new study first tries the best configurations of earlier studies on the same
data, translated into its space, with their source recorded, and its sampler learns from their trials; the portfolio
when there are none; off with a flag."""
from __future__ import annotations

import fnmatch
import math
import tomllib
from pathlib import Path

import numpy as np
import optuna
import pytest
from mlflow import MlflowClient
from optuna.distributions import FloatDistribution

from conftest import tiny_study_file
from latentsweep.search.cli.main import build_parser, main
from latentsweep.search.cli.study import make_spec
from latentsweep.search.study.report import study_table
from latentsweep.search.study.samplers import PastTrialsSampler, fixing
from latentsweep.search.study.side import SIDE_ATTR
from latentsweep.search.study.space import sample
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.search.study.warm import IDENTITY_ATTR, PORTFOLIO, WARM_ATTR, identity, portfolio, warm_sources
from latentsweep.search.study.worker import load_or_create
from latentsweep.search.tracking import make_tracker
from latentsweep.trainers.data.demo import default_train_path
from latentsweep.trainers.data.synthetic import write_synthetic

ROOT = Path(__file__).resolve().parents[1]
LR, WEIGHT, MARGIN = "optim.lr", "loss.triplet.weight", "loss.triplet.margin"
# The earlier study's trials: (lr, triplet weight, margin or None when the weight is too small for it, value)
EARLIER = [(3e-3, 0.9, 0.3, 0.50), (5e-3, 0.2, None, 0.40), (2e-4, 0.8, 0.1, 0.30), (1e-3, 0.7, 0.2, 0.10)]


@pytest.fixture(autouse=True)
def warm_start_default(monkeypatch):
    """The product's default (tests/conftest.py turns warm start off for the rest of the suite)."""
    monkeypatch.delenv("LATENTSWEEP_WARM_START", raising=False)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """Two small train files: one, and other data (a different seed: other bytes, another fingerprint)."""
    root = tmp_path_factory.mktemp("warm")
    same, _, _ = write_synthetic(root / "same", 120, dim_text=16, dim_image=16)
    other, _, _ = write_synthetic(root / "other", 120, dim_text=16, dim_image=16, seed=1)
    return same, other


def earlier_study(tmp_path: Path, train: Path) -> Path:
    """A finished study 'earlier' on `train` in a fresh state directory, written directly (no training)."""
    state = tmp_path / "state"
    state.mkdir()
    study = optuna.create_study(study_name="earlier", storage=f"sqlite:///{state / 'optuna.db'}",
                                direction="maximize")
    study.set_user_attr(IDENTITY_ATTR, identity(load_study_file(tiny_study_file(tmp_path, "earlier")), str(train)))
    for lr, weight, margin, value in EARLIER:
        params = {LR: lr, WEIGHT: weight, **({MARGIN: margin} if margin is not None else {})}
        dists = {LR: FloatDistribution(1e-4, 1e-2, log=True), WEIGHT: FloatDistribution(0.0, 1.0),
                 MARGIN: FloatDistribution(0.05, 0.4)}
        study.add_trial(optuna.trial.create_trial(params=params, distributions={k: dists[k] for k in params},
                                                  value=value))
    return state


def create(tmp_path: Path, state: Path, train: Path, name: str, extra_args=(), **file) -> optuna.Study:
    """`study create` of a tiny study file (no trial runs); the stored study."""
    sf = tiny_study_file(tmp_path, name, **file)
    assert main(["study", "create", str(sf), "--data", str(train), "--state-dir", str(state), *extra_args]) == 0
    return optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")


def warm(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials() if WARM_ATTR in t.user_attrs]


def test_a_new_study_on_the_same_data_queues_the_earlier_best_first(tmp_path, data, capsys):
    state = earlier_study(tmp_path, data[0])
    recipe = '[[enqueue]]\n"optim.lr" = 0.002\n"loss.triplet.weight" = 0.1\n[[side]]\nmodel = { kind = "knn" }\n'
    study = create(tmp_path, state, data[0], "second", extra=recipe)
    queued = warm(study)
    assert [t.user_attrs[WARM_ATTR] for t in queued] == ["earlier:0", "earlier:1", "earlier:2", "earlier:3"]
    # the file's cheap side trial (trial 0) first, then the best known, then the file's recipe (trial 5)
    assert study.trials[0].user_attrs[SIDE_ATTR] and study.trials[0].system_attrs["fixed_params"] == {}
    assert [t.number for t in queued] == [1, 2, 3, 4]
    assert study.trials[5].system_attrs["fixed_params"] == {LR: 0.002, WEIGHT: 0.1}
    assert queued[0].system_attrs["fixed_params"] == {LR: 3e-3, WEIGHT: 0.9, MARGIN: 0.3}
    assert all(t.state == optuna.trial.TrialState.WAITING for t in queued)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warm start:")]
    assert len(lines) == 1 and "4 configuration(s)" in lines[0] and "from study 'earlier'" in lines[0]
    assert "warm_from" in study_table(study, varying_only=False).columns  # `study status` shows the source


def test_no_warm_start_takes_nothing(tmp_path, data, capsys, monkeypatch):
    state = earlier_study(tmp_path, data[0])
    study = create(tmp_path, state, data[0], "cold", ["--no-warm-start"])
    assert warm(study) == [] and "warm start" not in capsys.readouterr().err
    assert study.user_attrs[IDENTITY_ATTR]["fingerprint"]  # still recorded: a later study can warm-start from it
    monkeypatch.setenv("LATENTSWEEP_WARM_START", "off")  # the environment's default, for suites and benchmarks
    assert warm(create(tmp_path, state, data[0], "cold-env")) == []


def test_a_changed_space_takes_what_fits_and_says_what_changed(tmp_path, data, capsys):
    state = earlier_study(tmp_path, data[0])
    # lr narrowed to [1e-4, 1e-3], the margin removed, dropout added
    sf = tiny_study_file(tmp_path, "changed", extra='"model.dropout" = { type = "float", low = 0.0, high = 0.3 }\n')
    sf.write_text(sf.read_text().replace("high = 1e-2", "high = 1e-3").replace(
        '"loss.triplet.margin" = { type = "float", low = 0.05, high = 0.4, when = "loss.triplet.weight > 0.5" }', ""))
    assert main(["study", "create", str(sf), "--data", str(data[0]), "--state-dir", str(state)]) == 0
    study = optuna.load_study(study_name="changed", storage=f"sqlite:///{state / 'optuna.db'}")
    fixed = [t.system_attrs["fixed_params"] for t in warm(study)]
    assert fixed[0] == {LR: 1e-3, WEIGHT: 0.9}  # clipped, margin dropped, dropout left to the sampler
    assert all(set(f) == {LR, WEIGHT} and f[LR] <= 1e-3 for f in fixed)
    err = capsys.readouterr().err
    assert "dropped (not in this study's space): loss.triplet.margin" in err
    assert "clipped into this study's range: optim.lr" in err
    assert "new in this study (left to the sampler): model.dropout" in err


def test_a_categorical_choice_the_new_space_lacks_skips_that_configuration(tmp_path, data, capsys):
    state = earlier_study(tmp_path, data[0])
    extra = '"model.kind" = { type = "categorical", choices = ["residual_mlp"] }\n'
    study = optuna.load_study(study_name="earlier", storage=f"sqlite:///{state / 'optuna.db'}")
    trial = study.trials[0]
    study.add_trial(optuna.trial.create_trial(  # the best earlier trial, a kind the new study does not search
        params={**trial.params, "model.kind": "mlp"}, value=0.9,
        distributions={**trial.distributions,
                       "model.kind": optuna.distributions.CategoricalDistribution(["mlp", "residual_mlp"])}))
    created = create(tmp_path, state, data[0], "kinds", extra=extra)
    assert "earlier:4" not in [t.user_attrs[WARM_ATTR] for t in warm(created)]
    assert "outside this study's choices (their configurations skipped): model.kind" in capsys.readouterr().err


def test_other_data_takes_nothing_and_gets_the_portfolio(tmp_path, data):
    state = earlier_study(tmp_path, data[0])
    study = create(tmp_path, state, data[1], "elsewhere")
    sources = [t.user_attrs[WARM_ATTR] for t in warm(study)]
    assert sources and all(s.startswith("portfolio:") for s in sources)


def test_warm_from_another_state_directory(tmp_path, data):
    elsewhere = earlier_study(tmp_path, data[0])
    (tmp_path / "mine").mkdir()
    study = create(tmp_path / "mine", tmp_path / "mine" / "state", data[0], "fresh", ["--warm-from", str(elsewhere)])
    assert warm(study)[0].user_attrs[WARM_ATTR] == "earlier:0"


def test_the_portfolio_ships_in_the_wheel_and_fits_the_full_study():
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(fnmatch.fnmatch(PORTFOLIO.name, pattern) for pattern in package_data["latentsweep.search.study"])
    configs = portfolio()
    assert configs, f"{PORTFOLIO} holds no configuration"
    space = {p.name: p for p in load_study_file(ROOT / "studies" / "full.toml").space}
    for config in configs:
        assert set(config) <= set(space) and all(space[k].contains(v) for k, v in config.items())


@pytest.mark.slow
def test_a_second_study_run_starts_from_the_first_with_no_flag(tmp_path, data, capsys):
    state = tmp_path / "state"
    sf = tiny_study_file(tmp_path, "first", n_trials=3)
    args = ["--data", str(data[0]), "--state-dir", str(state), "--quiet"]
    assert main(["study", "run", str(sf), *args]) == 0
    assert main(["study", "run", str(sf), "--name", "second", "--n-trials", "1", *args]) == 0
    storage = f"sqlite:///{state / 'optuna.db'}"
    first = optuna.load_study(study_name="first", storage=storage)
    trial = optuna.load_study(study_name="second", storage=storage).trials[0]
    assert trial.user_attrs[WARM_ATTR] == f"first:{first.best_trial.number}"
    assert trial.params == first.best_trial.params
    run = MlflowClient(f"sqlite:///{state / 'mlflow.db'}").get_run(trial.user_attrs["mlflow_run_id"])
    assert run.data.tags[WARM_ATTR] == f"first:{first.best_trial.number}"
    assert "from study 'first'" in capsys.readouterr().err


# The sampler learns from the earlier trials (samplers.PastTrialsSampler). The earlier study's value is a clear
# optimum in one knob: 1 - |log10(lr / OPT_LR)|, the triplet weight noise; OPT_LR sits 0.2 decades from the low end.
OPT_LR, N_EARLIER, N_SAMPLED = 1.5e-4, 30, 5


def synthetic_value(params: dict) -> float:
    return 1.0 - abs(math.log10(params[LR] / OPT_LR))


def synthetic_earlier(state: Path, train: Path, sf: Path, pruned: bool = False) -> None:
    """A finished study 'earlier' of N_EARLIER random trials on `train` (the identity of study file `sf`); with
    `pruned`, every trial reports its value at epoch 0 and is pruned there (what most trials of a short study are)."""
    state.mkdir(parents=True, exist_ok=True)
    study = optuna.create_study(study_name="earlier", storage=f"sqlite:///{state / 'optuna.db'}",
                                direction="maximize", sampler=optuna.samplers.RandomSampler(seed=7))
    study.set_user_attr(IDENTITY_ATTR, identity(load_study_file(sf), str(train)))
    space = load_study_file(sf).space
    for _ in range(N_EARLIER):
        trial = study.ask()
        sample(trial, space, {WEIGHT: 0.0})
        if pruned:
            trial.report(synthetic_value(trial.params), 0)
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, synthetic_value(trial.params))


def opened(sf: Path, state: Path, train: Path, *flags: str, create: bool = True) -> optuna.Study:
    """The study as `study run` opens it (worker.load_or_create: its sampler included); no trial runs."""
    spec = make_spec(build_parser().parse_args(["study", "run", str(sf), "--data", str(train), "--state-dir",
                                                str(state), *flags]))
    return load_or_create(load_study_file(sf), spec, make_tracker(spec.tracking_uri, spec.artifact_root),
                          create=create)


def search(study: optuna.Study, sf: Path) -> list[float]:
    """Run the queued trials, then N_SAMPLED proposals, on the synthetic value; the proposals' lr."""
    space, proposed = load_study_file(sf).space, []
    while True:
        trial = study.ask()
        queued = "fixed_params" in trial._cached_frozen_trial.system_attrs
        sample(trial, space, {WEIGHT: 0.0})
        study.tell(trial, synthetic_value(trial.params))
        if not queued:
            proposed.append(trial.params[LR])
            if len(proposed) == N_SAMPLED:
                return proposed


def decades(lrs: list[float]) -> float:
    return float(np.mean([abs(math.log10(lr / OPT_LR)) for lr in lrs]))


def slow_start_file(tmp_path: Path, name: str, **file) -> Path:
    """The tiny study file with 10 start-up trials: more than the 5 queued, so a sampler that learnt only from the
    study's own trials would still draw at random after them."""
    sf = tiny_study_file(tmp_path, name, **file)
    sf.write_text(sf.read_text().replace("n_startup_trials = 2", "n_startup_trials = 10"))
    return sf


def test_the_sampler_learns_from_the_earlier_trials_without_the_study_holding_them(tmp_path, capsys):
    train = default_train_path()  # the demo data
    synthetic_earlier(tmp_path / "state", train, slow_start_file(tmp_path, "earlier"))
    sf = slow_start_file(tmp_path, "second")
    warm_study = opened(sf, tmp_path / "state", train)
    cold_study = opened(slow_start_file(tmp_path, "cold"), tmp_path / "state", train, "--no-warm-start")
    assert isinstance(warm_study.sampler, PastTrialsSampler) and len(warm_study.sampler.past) == N_EARLIER
    assert not isinstance(cold_study.sampler, PastTrialsSampler)
    line = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warm start: 5 configuration(s)")]
    assert line and line[0].endswith(f"the sampler learns from {N_EARLIER} finished trial(s) of theirs on the "
                                     f"same validation split")
    warm_lrs, cold_lrs = search(warm_study, sf), search(cold_study, sf)
    # The first proposal after the 5 queued configurations is already the model's: near the earlier optimum, where
    # the cold study's start-up draws spread over the 2 decades of the range.
    assert decades(warm_lrs) < 0.35 < decades(cold_lrs), (warm_lrs, cold_lrs)
    trials = warm_study.get_trials()
    assert [t.number for t in trials] == list(range(5 + N_SAMPLED))  # its own trials only
    assert len(study_table(warm_study, varying_only=False)) == 5 + N_SAMPLED  # `study status`
    assert warm_study.best_trial.number < 5 + N_SAMPLED
    stored = optuna.load_study(study_name="second", storage=f"sqlite:///{tmp_path / 'state' / 'optuna.db'}")
    assert len(stored.trials) == 5 + N_SAMPLED


def test_the_sampler_learns_from_earlier_pruned_trials_and_only_complete_ones_are_queued(tmp_path, capsys):
    train = default_train_path()
    synthetic_earlier(tmp_path / "state", train, slow_start_file(tmp_path, "earlier"), pruned=True)
    sf = slow_start_file(tmp_path, "second")
    study = opened(sf, tmp_path / "state", train)
    past = study.sampler.past
    assert len(past) == N_EARLIER and all(t.state == optuna.trial.TrialState.PRUNED for t in past)
    assert all(t.intermediate_values == {0: synthetic_value(t.params)} for t in past)
    err = capsys.readouterr().err
    assert "warm start: 0 configuration(s)" in err and f"learns from {N_EARLIER} finished trial(s)" in err
    # nothing complete to queue: the portfolio goes after the recipes, as on new data
    assert warm(study) and all(s.startswith("portfolio:") for s in warm_sources(study).values())


def test_a_resumed_study_or_a_joining_worker_learns_too_and_the_switch_turns_it_off(tmp_path, capsys, monkeypatch):
    train = default_train_path()
    sf = slow_start_file(tmp_path, "earlier")
    synthetic_earlier(tmp_path / "state", train, sf)
    opened(slow_start_file(tmp_path, "second"), tmp_path / "state", train)
    capsys.readouterr()
    sf = tmp_path / "second.toml"
    resumed = opened(sf, tmp_path / "state", train)
    assert len(resumed.sampler.past) == N_EARLIER and "learns from 30 finished trial(s)" in capsys.readouterr().err
    joined = opened(sf, tmp_path / "state", train, create=False)
    assert len(joined.sampler.past) == N_EARLIER and "warm start" not in capsys.readouterr().err  # said once
    assert not isinstance(opened(sf, tmp_path / "state", train, "--no-warm-start").sampler, PastTrialsSampler)
    monkeypatch.setenv("LATENTSWEEP_WARM_START", "off")
    assert not isinstance(opened(sf, tmp_path / "state", train).sampler, PastTrialsSampler)


def test_a_changed_space_learns_the_translated_trials(tmp_path, capsys):
    train = default_train_path()
    synthetic_earlier(tmp_path / "state", train, slow_start_file(tmp_path, "earlier"))
    # lr narrowed to [1e-4, 1e-3], the margin removed, dropout added
    sf = slow_start_file(tmp_path, "changed", extra='"model.dropout" = { type = "float", low = 0.0, high = 0.3 }\n')
    sf.write_text(sf.read_text().replace("high = 1e-2", "high = 1e-3").replace(
        '"loss.triplet.margin" = { type = "float", low = 0.05, high = 0.4, when = "loss.triplet.weight > 0.5" }', ""))
    study = opened(sf, tmp_path / "state", train)
    past = study.sampler.past
    assert len(past) == N_EARLIER and all(set(t.params) == {LR, WEIGHT} and t.params[LR] <= 1e-3 for t in past)
    assert "clipped into this study's range: optim.lr" in capsys.readouterr().err
    lrs = search(study, sf)  # dropout, which no earlier trial has, is proposed beside them
    assert decades(lrs) < 0.35 and all("model.dropout" in t.params for t in study.get_trials())


def test_another_split_queues_but_does_not_learn_and_other_data_takes_nothing(tmp_path, capsys):
    train = default_train_path()
    synthetic_earlier(tmp_path / "state", train, slow_start_file(tmp_path, "earlier"))
    sf = slow_start_file(tmp_path, "resplit")
    sf.write_text(sf.read_text().replace("val_ratio = 0.25", "val_ratio = 0.2"))
    study = opened(sf, tmp_path / "state", train)
    assert not isinstance(study.sampler, PastTrialsSampler) and len(warm(study)) == 5  # values not comparable
    assert "the sampler learns from 0 finished trial(s)" in capsys.readouterr().err
    other, _, _ = write_synthetic(tmp_path / "other", 120, dim_text=16, dim_image=16)
    study = opened(slow_start_file(tmp_path, "elsewhere"), tmp_path / "state", other)
    assert not isinstance(study.sampler, PastTrialsSampler)
    assert all(s.startswith("portfolio:") for s in warm_sources(study).values())


X_OPT = 3.0  # the optimum of the in-memory studies below: value -|x - 3| - |y - 5| over x, y in [-10, 10]


def in_memory_past(n: int = 40, pruned: bool = False) -> list[optuna.trial.FrozenTrial]:
    """n random trials of the in-memory objective: COMPLETE, or PRUNED at step 0 with the value reported there."""
    dist = FloatDistribution(-10.0, 10.0)
    points = np.random.default_rng(0).uniform(-10.0, 10.0, (n, 2))
    value = [-abs(x - X_OPT) - abs(y - 5.0) for x, y in points]
    if pruned:
        return [optuna.trial.create_trial(params={"x": x, "y": y}, distributions={"x": dist, "y": dist},
                                          state=optuna.trial.TrialState.PRUNED, intermediate_values={0: v})
                for (x, y), v in zip(points, value)]
    return [optuna.trial.create_trial(params={"x": x, "y": y}, distributions={"x": dist, "y": dist}, value=v)
            for (x, y), v in zip(points, value)]


def test_tpe_proposes_near_the_optimum_of_past_pruned_trials_from_its_first_trial():
    """TPE ranks pruned trials by their last intermediate value (GP reads COMPLETE trials only): past trials all
    pruned at one step guide it as the same trials complete with those values do, from its first proposal."""
    def proposals(past) -> list[float]:
        sampler = optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True)
        study = optuna.create_study(direction="maximize",
                                    sampler=PastTrialsSampler(sampler, past) if past is not None else sampler)
        return [study.ask().suggest_float("x", -10.0, 10.0) for _ in range(5)]

    pruned, complete, alone = proposals(in_memory_past(pruned=True)), proposals(in_memory_past()), proposals(None)
    assert pruned == complete
    # 1.25 from the optimum on average, where TPE's start-up draws lie 2.18 from it (seed 0)
    assert np.mean([abs(x - X_OPT) for x in pruned]) < np.mean([abs(x - X_OPT) for x in alone]), (pruned, alone)


@pytest.mark.parametrize("sampler", [
    lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=False),
    lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True, group=True),
    lambda: optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True, constant_liar=True),
    lambda: optuna.samplers.GPSampler(seed=0, n_startup_trials=10),
], ids=["tpe", "tpe-group", "tpe-constant-liar", "gp"])
def test_each_learning_sampler_proposes_near_the_past_optimum_from_its_first_trial(sampler):
    study = optuna.create_study(direction="maximize", sampler=PastTrialsSampler(sampler(), in_memory_past()))
    proposed = []
    for _ in range(3):
        trial = study.ask()
        proposed.append(trial.suggest_float("x", -10.0, 10.0))
        study.tell(trial, -abs(proposed[-1] - X_OPT) - abs(trial.suggest_float("y", -10.0, 10.0) - 5.0))
    # 0.26 to 0.90 here; each sampler alone draws its 3 start-up trials at random: 2.5 from the optimum (seed 0)
    assert np.mean([abs(x - X_OPT) for x in proposed]) < 1.25, proposed
    assert [t.number for t in study.trials] == [0, 1, 2]


def test_a_population_joiners_fixed_knobs_hold_and_the_rest_still_learns():
    study = optuna.create_study(direction="maximize", sampler=PastTrialsSampler(
        optuna.samplers.TPESampler(seed=0, n_startup_trials=10, multivariate=True, group=True), in_memory_past()))
    for _ in range(3):
        with fixing(study, {"x": 1.0}):  # search/study/population.py's joiners: the group's shape held
            trial = study.ask()
            x, y = trial.suggest_float("x", -10.0, 10.0), trial.suggest_float("y", -10.0, 10.0)
        assert x == 1.0 and abs(y - 5.0) < 1.5, y
        study.tell(trial, -abs(x - X_OPT) - abs(y - 5.0))
    assert isinstance(study.sampler, PastTrialsSampler)
