"""The search-to-pick contract (search/study/contract.py): one dataclass written by the objective and read by the
pick and the reaper, stored under the attribute names studies have always used."""
from __future__ import annotations

import optuna

from search.study.contract import TrialOutputs


def test_round_trip_through_a_stored_trial():
    study = optuna.create_study()
    trial = study.ask()
    TrialOutputs(mlflow_run_id="abc", out_dir="study/trial-0").record(trial)
    TrialOutputs(checkpoint="study/trial-0/best.pt", best_epoch=3).record(trial)  # at the end: the start's stay
    study.tell(trial, 0.5)
    assert TrialOutputs.of(study.trials[0]) == TrialOutputs("abc", "study/trial-0", "study/trial-0/best.pt", 3)


def test_a_study_written_before_the_contract_reads_the_same():
    old = {"mlflow_run_id": "r1", "out_dir": "s/trial-2", "checkpoint": "s/trial-2/best.pt", "best_epoch": 4,
           "latentsweep.timing": {"setup_s": 1.0}}  # the literal keys the objective wrote, beside other attrs
    trial = optuna.trial.create_trial(value=0.1, user_attrs=old)
    assert TrialOutputs.of(trial) == TrialOutputs("r1", "s/trial-2", "s/trial-2/best.pt", 4)


def test_a_pruned_trial_points_at_its_folders_checkpoint_and_bad_values_read_as_absent():
    pruned = TrialOutputs.from_attrs({"mlflow_run_id": "r", "out_dir": "s/trial-5"})
    assert pruned.local_checkpoint == "s/trial-5/best.pt" and pruned.best_epoch is None
    assert TrialOutputs.from_attrs({}).local_checkpoint is None
    assert TrialOutputs.from_attrs({"best_epoch": True, "checkpoint": 3, "out_dir": None}) == TrialOutputs()
    assert TrialOutputs(best_epoch=0).as_attrs() == {"best_epoch": 0}

