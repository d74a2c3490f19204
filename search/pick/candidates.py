"""The candidates of `latentsweep pick`: a study's best trials with their checkpoints (local, or downloaded from their
tracked runs), and the checks that they and the data agree."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from optuna.study import StudyDirection
from optuna.trial import TrialState

from latentsweep.search.checks import check_outputs
from latentsweep.search.pick.options import PickOptions, out_path, pick_outputs
from latentsweep.search.study.contract import TrialOutputs, TrialRecord, read_side, read_trials
from latentsweep.search.stores import state_dir
from latentsweep.search.study.studyfile import resolve_data_path
from latentsweep.search.tracking.base import Tracker
from latentsweep.search.tracking.paths import resolve_in_state
from latentsweep.trainers.train.checkpoint import checkpoint_dims, load_model
from latentsweep.trainers.config.tree import Config, dump_toml
from latentsweep.trainers.train.cost import Timing
from latentsweep.trainers.data.sets import check_text_dim
from latentsweep.trainers.data.demo import default_test_path, default_train_path
from latentsweep.trainers.core.errors import DataError, LatentsweepError
from latentsweep.trainers.core.progress import say

SPLIT_KEYS = ("split", "val_ratio", "salt", "n_folds", "fold")
KIND_PARAM = "model.kind"  # the Optuna parameter of a study that searches the model kind


@dataclass
class Candidate:
    name: str  # "trial-3" or "trial-3/seed-2"
    trial: int
    checkpoint: Path
    cfg: Config
    dims: tuple[int, int]  # (Dt, Di)
    value: float | None  # the study's objective value (None for seed re-runs)
    data_fingerprint: str | None
    origin: str  # where the checkpoint came from: "local", "runs:/<id>/best.pt" or "retrained"
    model: torch.nn.Module = field(repr=False)
    best_epoch: int = 0  # 0-based epoch of the checkpoint (the trial's best)
    seconds: float | None = None  # the trial's wall time, for the budget plan (None: unknown)
    epochs_run: int = 1  # epochs the trial trained (pruned or early-stopped trials stop before train.epochs)
    timing: Timing | None = None  # the trial's measured start-up and per-epoch seconds (None: not recorded)

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(dump_toml(self.cfg).encode()).hexdigest()


def trial_value(trial, maximize: bool) -> float | None:
    """A complete trial's value; a pruned trial's best reported value (its checkpoint is that epoch's)."""
    if trial.value is not None:
        return float(trial.value)
    reported = list(trial.intermediate_values.values())
    return (max(reported) if maximize else min(reported)) if reported else None


def top_trials(study, k: int) -> list:
    """The k best trials by value in the study's direction, COMPLETE and PRUNED alike (a trial pruned at a low
    fidelity can still be a strong member, and the selection re-measures every candidate anyway), then the best trial
    of each other model kind the study tried."""
    maximize = study.direction == StudyDirection.MAXIMIZE
    done = [t for t in read_trials(study, (TrialState.COMPLETE, TrialState.PRUNED))
            if trial_value(t, maximize) is not None]
    if not done:
        states = pd.Series([t.state.name for t in read_trials(study)]).value_counts().to_dict()
        raise LatentsweepError(f"study '{study.study_name}' has no complete or pruned trial with a value "
                               f"({', '.join(f'{n} {s}' for s, n in states.items()) or 'no trials at all'})")
    key = lambda t: (-trial_value(t, maximize) if maximize else trial_value(t, maximize), t.number)  # noqa: E731
    ranked = sorted(done, key=key)
    top = ranked[:k]
    return top + [t for t in best_of_each_kind(ranked, study.study_name) if t not in top]


def best_of_each_kind(ranked: list, study: str | None = None) -> list:
    """The best trial of each searched model.kind (trials in rank order): a kind whose best trial ranks below the top
    k can still be the member that adds most (the knn model's errors differ from a trained model's)."""
    seen: dict[str, object] = {}
    for t in ranked:  # a side trial (the knn of full.toml) has no parameters: its kind is in its side values
        seen.setdefault(str(t.params.get(KIND_PARAM) or (read_side(t, study) or {}).get(KIND_PARAM)), t)
    return list(seen.values()) if len(seen) > 1 else []


def fetch_checkpoint(trial, tracker: Tracker, download_dir: Path, root: Path | None = None,
                     study: str | None = None) -> tuple[Path, str] | None:
    """(path, origin) of the trial's best.pt: the local path it recorded
    (latentsweep.search.study.contract.TrialOutputs, relative
    to the state directory `root`), else downloaded from its tracked run; None (with a warning naming the trial of
    study `study`) if neither."""
    outputs = TrialOutputs.of(trial, study)
    local = outputs.local_checkpoint
    if local and resolve_in_state(local, root or Path.cwd()).is_file():
        return resolve_in_state(local, root or Path.cwd()), "local"
    run_id = outputs.mlflow_run_id
    reason = f"{local or 'no local checkpoint recorded'} is missing"
    if run_id:
        try:
            path = tracker.download_artifact(run_id, "best.pt", download_dir / f"trial-{trial.number}")
            return path, f"runs:/{run_id}/best.pt"
        except Exception as exc:  # noqa: BLE001 - any failure means: no checkpoint for this trial
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            reason += f" and MLflow run {run_id} has no best.pt ({type(exc).__name__}: {first})"
    where = f"study '{study}' trial {trial.number}" if study else f"trial {trial.number}"
    say(f"latentsweep: warning: {where} skipped: {reason}")
    return None


def make_candidate(name: str, trial: int, path: Path, origin: str, value: float | None, device) -> Candidate:
    model, cfg, meta = load_model(path, device)
    return Candidate(name, trial, path, cfg, checkpoint_dims(path), value, meta.get("data_fingerprint"), origin, model,
                     best_epoch=int(meta.get("epoch", cfg.train.epochs - 1)))


def load_candidates(study, k: int, tracker: Tracker, download_dir: Path, device, root: Path | None = None
                    ) -> list[Candidate]:
    out = []
    for t in top_trials(study, k):
        record = TrialRecord.of(t, study.study_name)
        found = fetch_checkpoint(t, tracker, download_dir, root, study.study_name)
        if found is not None:
            value = trial_value(t, study.direction.name == "MAXIMIZE")
            cand = make_candidate(f"trial-{t.number}", t.number, *found, value, device)
            if t.datetime_start and t.datetime_complete:
                cand.seconds = (t.datetime_complete - t.datetime_start).total_seconds()
            cand.epochs_run = max(len(t.intermediate_values), cand.best_epoch + 1)
            cand.timing = record.timing
            out.append(cand)
    if not out:
        raise LatentsweepError(f"study '{study.study_name}': none of its top {k} trials (complete or pruned) has a "
                               f"checkpoint")
    return out


def check_agreement(cands: list[Candidate], same_split: bool) -> None:
    """Every candidate must be a translate model with the same dims; with `same_split` (selection on halves of the
    val split) they must also share the val split (data.split, val_ratio, salt, n_folds, fold). Out-of-fold
    selection retrains every candidate on the same folds, so there the study's splits may differ."""
    ref = cands[0]
    for c in cands:
        if c.cfg.data.task != "translate":
            raise LatentsweepError(f"{c.name} has data.task='{c.cfg.data.task}': pick ensembles translate models only")
    for c in cands[1:]:
        for key in SPLIT_KEYS if same_split else ():
            mine, theirs = getattr(c.cfg.data, key), getattr(ref.cfg.data, key)
            if mine != theirs:
                raise LatentsweepError(f"{c.name} has data.{key}={mine!r} but {ref.name} has {theirs!r}: "
                                       "candidates must share one val split (or use --selection oof)")
        if c.dims != ref.dims:
            raise LatentsweepError(f"{c.name} maps dims {c.dims} but {ref.name} maps {ref.dims}")


def resolve_data(opts: PickOptions, cands: list[Candidate]) -> tuple[Path, Path]:
    """(train npz, test npz): --data, else the path recorded in the trials' config, else the demo; --test, else the
    demo test (demo data) or a test.clean.npz beside the train file."""
    recorded = next((c.cfg.data.path for c in cands if c.cfg.data.path), "")
    data = resolve_data_path(opts.data or recorded)
    test = test_path_for(data, opts.test)
    check_outputs("--out", pick_outputs(opts.out, out_path(opts, state_dir(opts.state_dir, create=False))),
                  {"--data": data, "--test": test})  # the recorded train file and the test beside it
    return data, test


def test_path_for(data: Path, test: str | None) -> Path:
    """--test, else the demo test (demo data) or a test.clean.npz beside the train file `data`."""
    if test:
        return Path(test).expanduser()
    if data.resolve() == default_train_path().resolve():
        return default_test_path()
    beside = data.parent / "test.clean.npz"
    if beside.is_file():
        return beside
    raise LatentsweepError(f"--test is required: {data} is not the demo data and has no test.clean.npz beside it")


def check_test(cands: list[Candidate], test) -> None:
    """The test file must have the models' text dimension."""
    check_text_dim(test, cands[0].dims[0], "the models expect")


def share_data(model: torch.nn.Module, data, fingerprint: str | None) -> bool:
    """Let a model that reads its training rows when it predicts (the knn model: KernelTranslator.share_rows) read
    them from `data`, the loaded TrainSet, instead of its checkpoint's copy (mapped from the file: 0.67 GB more once
    read at challenge size), when its checkpoint was made from this file (`fingerprint`). Whether it now does."""
    inner = getattr(model, "inner", model)
    if not hasattr(inner, "share_rows") or not fingerprint or fingerprint != data.fingerprint:
        return False
    return inner.share_rows(torch.as_tensor(data.text), torch.as_tensor(data.image))


def check_data(cands: list[Candidate], data) -> None:
    """The data must be what the trials trained on (same dims, same fingerprint)."""
    if (data.text.shape[1], data.image.shape[1]) != cands[0].dims:
        raise DataError(f"{data.path}: dims ({data.text.shape[1]}, {data.image.shape[1]}) differ from the models' "
                        f"{cands[0].dims}")
    for c in cands:
        if c.data_fingerprint and c.data_fingerprint != data.fingerprint:
            raise DataError(f"{data.path}: fingerprint {data.fingerprint} differs from the data {c.name} was trained "
                            f"on ({c.data_fingerprint}); pass --data with the study's training file")
