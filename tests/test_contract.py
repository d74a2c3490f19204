"""The search-to-pick contract (search/study/contract.py): what a trial left and what the study recorded, written under
the attribute names studies have always used and read back through one typed reader; a damaged study is one line
naming the study and the trial, never a traceback."""
from __future__ import annotations

import sqlite3

import optuna
import pytest

from latentsweep.search.pick.candidates import load_candidates, top_trials
from latentsweep.search.study.budget import TrialCost, refit_costs
from latentsweep.search.study.contract import (
    OBJECTIVE_ATTR, PARENT_ATTR, SIDE_ATTR, TIMING_ATTR, DamagedStudy, StudyRecord, TrialOutputs, TrialRecord,
)
from latentsweep.trainers.train.cost import Timing
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.progress import progress_to


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



# ---- everything the pick reads of a trial, through one reader -----------------------------------------------------

TIMING = {"setup_s": 1.0, "train_s": 2.0, "eval_s": 0.5, "captions": 8, "images": 4, "per_image": False}


def test_a_trial_record_reads_what_the_search_wrote_under_the_contracts_keys():
    study = optuna.create_study(study_name="s")
    trial = study.ask()
    TrialOutputs(mlflow_run_id="r", out_dir="s/trial-0", checkpoint="s/trial-0/best.pt", best_epoch=2).record(trial)
    trial.set_user_attr(TIMING_ATTR, TIMING)
    trial.set_user_attr(SIDE_ATTR, '{"model.kind": "knn"}')
    study.tell(trial, 0.5)
    record = TrialRecord.of(study.trials[0], "s")
    assert record.outputs == TrialOutputs("r", "s/trial-0", "s/trial-0/best.pt", 2)
    assert record.timing == Timing(**TIMING) and record.side == {"model.kind": "knn"}
    sampled = TrialRecord.of(optuna.trial.create_trial(value=0.1), "s")  # nothing recorded: all absent
    assert (sampled.outputs, sampled.timing, sampled.side) == (TrialOutputs(), None, None)


def test_damaged_values_read_as_absent_each_said_once_naming_the_study_the_trial_and_the_key():
    damaged = optuna.trial.create_trial(value=0.1, user_attrs={
        "best_epoch": "two", "checkpoint": 3, TIMING_ATTR: {**TIMING, "setup_s": "slow"}, SIDE_ATTR: "{not json"})
    damaged.number = 4
    lines: list[str] = []
    with progress_to(lines.append):
        for _ in range(3):  # the budget and the keeper read the study again at every epoch and poll: said once
            record = TrialRecord.of(damaged, "mine")
    assert (record.outputs, record.timing, record.side) == (TrialOutputs(), None, None)
    assert len(lines) == 4 and all("study 'mine' trial 4" in line and "\n" not in line for line in lines)
    for key in ("best_epoch", "checkpoint", TIMING_ATTR, SIDE_ATTR):
        assert sum(key in line for line in lines) == 1, key


def _damage_in_storage(path, table: str, key: str) -> None:
    """Write a value that is not JSON straight into the storage (what a hand edit or a broken copy leaves)."""
    with sqlite3.connect(path) as conn:
        conn.execute(f"UPDATE {table} SET value_json = ? WHERE key = ?", ("{not json", key))


def test_an_attribute_that_is_not_json_is_one_line_naming_the_study_and_the_trial(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="hurt", storage=url, direction="maximize")
    for value in (0.1, 0.2, 0.3):
        trial = study.ask()
        trial.set_user_attr(TIMING_ATTR, TIMING)
        study.tell(trial, value)
    _damage_in_storage(tmp_path / "optuna.db", "trial_user_attributes",
                       TIMING_ATTR)  # every trial's: the first found is named
    with pytest.raises(DamagedStudy) as raised:
        top_trials(optuna.load_study(study_name="hurt", storage=url), 2)  # the pick's first read of the study
    message = str(raised.value)
    assert isinstance(raised.value, LatentsweepError) and "\n" not in message
    assert message.startswith("study 'hurt' trial 0: ") and "not JSON" in message


def test_the_studys_own_attributes_are_read_through_the_study_record(tmp_path):
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    study = optuna.create_study(study_name="st", storage=url, direction="maximize")
    study.set_user_attr(PARENT_ATTR, "parent-1")
    study.set_user_attr(OBJECTIVE_ATTR, "val/mrr")
    assert StudyRecord.of(study) == StudyRecord("st", "val/mrr", True, "parent-1")
    study.set_user_attr(PARENT_ATTR, ["not", "a", "run"])  # a wrong type: no parent (the pick's run stands alone)
    lines: list[str] = []
    with progress_to(lines.append):
        assert StudyRecord.of(study).parent_run_id is None
    assert len(lines) == 1 and "study 'st'" in lines[0] and PARENT_ATTR in lines[0]
    _damage_in_storage(tmp_path / "optuna.db", "study_user_attributes", OBJECTIVE_ATTR)
    with pytest.raises(DamagedStudy, match=r"^study 'st': an attribute of the study is not JSON"):
        StudyRecord.of(optuna.load_study(study_name="st", storage=url))


def test_the_budget_leaves_out_a_trial_whose_timing_is_damaged():
    study = optuna.create_study(study_name="b", direction="maximize")
    for value, timing in ((0.5, TIMING), (0.9, {**TIMING, "train_s": "fast"})):  # the better trial's is damaged
        study.add_trial(optuna.trial.create_trial(value=value, intermediate_values={0: value},
                                                  user_attrs={TIMING_ATTR: timing}))
    with progress_to(None):
        costs = refit_costs(study, captions=8, images=4)
    assert costs == [TrialCost(0, Timing(**TIMING).estimate(8, 4, 1), TIMING["eval_s"], 0.5)]


def test_a_study_whose_trials_left_no_checkpoint_is_one_line_naming_it(tmp_path):
    study = optuna.create_study(study_name="bare", direction="maximize")
    for value in (0.1, 0.2):
        study.add_trial(optuna.trial.create_trial(value=value))  # complete, but nothing recorded (a worker died)
    lines: list[str] = []
    with progress_to(lines.append), pytest.raises(LatentsweepError, match=r"^study 'bare': none of its top 2"):
        load_candidates(study, 2, tracker=None, download_dir=tmp_path, device="cpu", root=tmp_path)
    assert [line.split(" skipped")[0] for line in lines] == [
        "latentsweep: warning: study 'bare' trial 1", "latentsweep: warning: study 'bare' trial 0"]
