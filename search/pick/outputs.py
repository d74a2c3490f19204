"""What `latentsweep pick` writes: the submission CSV, its manifest JSON and report table (all or none), the MLflow
run `pick-<method>` holding them with the report metrics, and the ensemble as a pyfunc model (optionally registered).

The files are staged in a hidden directory beside --out and moved into place together before anything is tracked:
the answer never waits for MLflow. A tracking failure after that leaves the files in place, marks the run FAILED and
is said in one line; a failure before it leaves nothing behind but what was there.
"""
from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pandas as pd

from latentsweep.search.failures import Kind, best_effort, first_line, kind_of, release_interrupted
from latentsweep.search.pick.candidates import Candidate
from latentsweep.search.pick.jobs import SubmissionModel
from latentsweep.search.pick.options import Paths, PickOptions
from latentsweep.search.pick.pyfunc_model import ModelCard, log_ensemble, model_name
from latentsweep.search.pick.selection import WHERE, Selection, spread_text
from latentsweep.search.study.contract import StudyRecord
from latentsweep.search.redact import redact_url
from latentsweep.search.tracking.base import NOTE_TAG, PARENT_TAG, ROLE_TAG, STUDY_TAG, DatasetRecord, Tracker
from latentsweep.search.tracking.source import source_tags
from latentsweep.search.tracking.plots import ensemble_figure
from latentsweep.trainers.data.sets import TestSet, TrainSet
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.io import atomic_path, atomic_write
from latentsweep.trainers.core.progress import say
from latentsweep.trainers.eval.submission import check_submission, write_submission

PICK_ROLE = "pick"


@dataclass
class PickResult:
    submission: Path
    manifest: Path
    report: Path
    table: pd.DataFrame
    weights: dict[str, float]  # members with weight > 0
    best_single: str
    gain: float  # ensemble - best single, measured as latentsweep.search.pick.selection.WHERE says for its selection
    gain_se: float  # standard error of the gain over the folds (nan for halves)
    selection: str  # "val", "oof", "halves" or "single"
    run_id: str | None  # None: the tracking failed after the files were in place (said in a warning)
    model_uri: str | None
    tracking_uri: str
    registered: dict[str, str] | None


@dataclass(frozen=True)
class PickRun:
    """Everything a finished pick writes out: its options and paths, the study, the candidates kept, the selection,
    the models of the submission (latentsweep.search.pick.jobs.SubmissionModel), the data and test files and the submission."""
    opts: PickOptions
    paths: Paths
    study: optuna.Study
    cands: list[Candidate]
    sel: Selection
    models: list[SubmissionModel]
    data: TrainSet
    test: TestSet
    test_pred: np.ndarray  # [N_test, Di] the submission's rows
    budget: float | None  # the seconds the pick had (None: no bound)
    answer: dict[str, Any] | None = None  # a one-budget job's standings: which answer won on the val split, by how
    # much, against which (latentsweep.search.pick.judge.Standing.record); None for `latentsweep pick`
    deadline: Deadline = field(default_factory=Deadline.never)  # the pick's (a one-budget job's): the export's bound


def _make_dirs(directory: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (outermost first) so that a failure can remove them."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir()
    return list(reversed(missing))


def start_run(tracker: Tracker, study, method: str) -> tuple[str, str]:
    """(experiment id, run id) of a new run `pick-<method>` in the study's experiment, nested under its parent run."""
    name = study.study_name
    exp_id = tracker.open_experiment(name)
    tags = {ROLE_TAG: PICK_ROLE, STUDY_TAG: name, "latentsweep.method": method,
            **source_tags(f"latentsweep pick {name}")}
    parent = StudyRecord.of(study).parent_run_id
    if parent and tracker.has_run(parent):  # else the parent lives in another tracking store: the run stands alone
        tags[PARENT_TAG] = parent
    return exp_id, tracker.start_run(f"pick-{method}", tags)


def _models_per_member(models) -> int:
    members = {m.member for m in models}
    return len(models) // max(len(members), 1)


def _log_refits(tracker: Tracker, run_id: str, models, study_name: str) -> dict[str, str]:
    """One FINISHED MLflow run per refit model, nested under the pick run, with its config and checkpoint;
    returns {model name: run id}."""
    out = {}
    for m in models:
        if m.job is None:
            continue
        tags = {PARENT_TAG: run_id, ROLE_TAG: "refit", STUDY_TAG: study_name, "latentsweep.member": m.member}
        child = tracker.start_run(m.name.replace("/", "-"), tags)
        tracker.log(child, params={"member": m.member, "seed": m.job.cfg.train.seed,
                                   "epochs": m.job.cfg.train.stop_after, "schedule_epochs": m.job.cfg.train.epochs,
                                   "weight": m.weight})
        files = [m.job.run_dir / "config.toml", m.job.run_dir / "metrics.csv", m.checkpoint]
        tracker.log_artifacts(child, [path for path in files if path.is_file()])
        tracker.end_run(child)
        out[m.name] = child
    return out


def run_params(r: PickRun) -> dict[str, Any]:
    opts, cands, sel, models, data, test = r.opts, r.cands, r.sel, r.models, r.data, r.test
    return {"method": opts.method, "selection": sel.kind, "top": opts.top, "size": opts.size,
            "folds": sel.details.get("folds", ""), "refit": opts.refit, "models_per_member": _models_per_member(models),
            "budget_s": r.budget, "seed": opts.seed,
            "n_candidates": len(cands),
            "n_members": int((sel.weights > 0).sum()), "n_models": len(models), "best_single": sel.best_single,
            "data_fingerprint": data.fingerprint, "test_path": test.path}


def _gain_metrics(sel) -> dict[str, float]:
    out = {"gain_mrr": float(sel.gain)}
    if sel.gain_se == sel.gain_se:
        out["gain_mrr_se"] = float(sel.gain_se)
    return out


def describe(study_name: str, method: str, sel, models, dims: tuple[int, int]) -> str:
    """The pick run's and the model's description: members, weights, the honest gain and what made the submission."""
    members = ", ".join(f"{name} {w:.2f}" for name, w in zip(sel.table["name"], sel.weights) if w > 0)
    where = WHERE.get(sel.kind)
    gain = (f" Gain over the best single member ({sel.best_single}), {where}: {sel.gain:+.4f}"
            f"{spread_text(sel.gain_se)}." if where else "")
    if sel.ensemble_used is False:
        gain += " That is not above its standard error, so the submission is the best single member."
    origins = sorted({m.origin for m in models})
    return (f"Ensemble ({method}, {sel.kind} selection) of study {study_name}: {members}.{gain} Made of "
            f"{len(models)} model(s) ({', '.join(origins)}). Input: caption embeddings [N, {dims[0]}] (float32 or "
            f"float64); output: image-space embeddings [N, {dims[1]}].")


def _figure(opts, sel):
    """Weights and per-member MRR on data the selection never saw (or out-of-fold); None for a single member."""
    table = sel.table.set_index("role")
    column = {"val": "oof_mrr", "oof": "oof_mrr", "halves": "report_mrr"}.get(sel.kind)
    if column is None:
        return None
    members = sel.table[sel.table["role"] == "member"]
    ens_col = "report_mrr" if sel.kind == "halves" else "nested_mrr"
    where = {"val": "members: MRR per fold of the val split's images; lines: cross-fitted (selection made on the "
                    "other folds)",
             "oof": "members: out-of-fold MRR; lines: nested folds (selection made on the other folds)",
             "halves": "MRR on the report half (never seen by selection)"}[sel.kind]
    return ensemble_figure(list(members["name"]), sel.weights, list(members[column]),
                           float(table.loc["ensemble", ens_col]), float(table.loc["best_single", ens_col]),
                           f"{opts.study}: {opts.method} ensemble", where)


def _log_run(tracker: Tracker, run_id: str, r: PickRun, note: str) -> None:
    opts, sel, data, test = r.opts, r.sel, r.data, r.test
    tracker.log(run_id, params=run_params(r), tags={NOTE_TAG: note},
                metrics={k: float(v) for k, v in {**sel.metrics, **_gain_metrics(sel)}.items()})
    figure = _figure(opts, sel)
    if figure is not None:
        tracker.log_figure(run_id, figure, "ensemble_weights.png")
    for files, context in ((data, "train"), (test, "test")):
        tracker.log_dataset(run_id, DatasetRecord(Path(files.path).name, files.fingerprint, str(files.path), context))


def manifest(r: PickRun, run: dict[str, Any]) -> dict[str, Any]:
    """Everything needed to audit or rebuild the pick (JSON-ready)."""
    opts, paths, study, cands, sel, models, data, test = (r.opts, r.paths, r.study, r.cands, r.sel, r.models, r.data,
                                                           r.test)
    rows = sel.table[sel.table["role"] == "member"].drop(columns=["role", "name", "weight", "study_value"])
    members = [{"name": c.name, "trial": c.trial, "train_seed": c.cfg.train.seed, "best_epoch": c.best_epoch,
                "checkpoint": str(c.checkpoint), "origin": c.origin, "config_sha256": c.config_sha256,
                "study_value": c.value, "weight": float(w), **row.dropna().to_dict()}
               for c, w, (_, row) in zip(cands, sel.weights, rows.iterrows())]
    refit_runs = run.get("refit_runs", {})
    made_by = [{"name": m.name, "member": m.member, "weight": m.weight, "origin": m.origin,
                "checkpoint": str(m.checkpoint), "mlflow_run_id": refit_runs.get(m.name)} for m in models]
    return {
        "study": study.study_name, "direction": study.direction.name.lower(), "method": opts.method,
        "selection": sel.kind,
        "options": {"top": opts.top, "size": opts.size, "seeds": opts.seeds, "seed": opts.seed, "folds": opts.folds,
                    "refit": opts.refit, "budget": r.budget},
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "members": members,
        "weights": {c.name: float(w) for c, w in zip(cands, sel.weights) if w > 0},
        "best_single": sel.best_single,
        "gain_mrr": sel.gain, "gain_mrr_se": None if sel.gain_se != sel.gain_se else sel.gain_se,
        **sel.details,
        "notes": sel.notes, "ensemble_used": sel.ensemble_used,
        "plan": None if sel.plan is None else {"top": sel.plan.top, "folds": sel.plan.folds, "seeds": sel.plan.seeds,
                                               "estimate_s": sel.plan.estimate},
        "submission_models": made_by,
        "data": {"path": str(data.path), "fingerprint": data.fingerprint},
        "test": {"path": str(test.path), "fingerprint": test.fingerprint, "rows": int(len(test.ids))},
        "submission": str(paths.out), "report_table": str(paths.report),
        **({"answer": r.answer} if r.answer is not None else {}),
        "mlflow": run,
    }


def write_outputs(tracker: Tracker, r: PickRun) -> PickResult:
    """The submission, report and manifest first, in place together (staged beside --out, then renamed); then the
    MLflow run and model, whose failure (a store down, a full disk) leaves the files in place and is said in one
    line: the answer never waits for the tracking. The manifest is rewritten with the run once it exists."""
    paths = r.paths
    doc = _put_files(r)
    run = _track(tracker, r)
    if run is not None:
        doc = manifest(r, run)
        with atomic_write(paths.manifest) as fh:
            fh.write(json.dumps(doc, indent=2, default=float) + "\n")
        with best_effort("log the pick's files to its MLflow run"):  # they are in place already
            tracker.log_artifacts(run["run_id"], [paths.out, paths.report, paths.manifest])
    registered = run["registered"] if run else None
    return PickResult(paths.out, paths.manifest, paths.report, r.sel.table, doc["weights"], r.sel.best_single,
                      float(r.sel.gain), float(r.sel.gain_se), r.sel.kind, run["run_id"] if run else None,
                      run["model_uri"] if run else None, paths.tracking_uri, registered)


def _put_files(r: PickRun) -> dict[str, Any]:
    """Stage the submission (checked against the test set), report and manifest beside their places
    (latentsweep.trainers.core.io.atomic_path), then move them into place; on a failure nothing is moved and the
    directories created
    for --out are removed. Returns the manifest."""
    paths = r.paths
    created = _make_dirs(paths.out.parent)
    try:
        with contextlib.ExitStack() as stack:
            # entered in reverse, so moved in this order at the block's end: the submission, the report, and the
            # new manifest last
            staged = {p: stack.enter_context(atomic_path(p, parents=False))
                      for p in (paths.manifest, paths.report, paths.out)}
            write_submission(staged[paths.out], r.test.ids, r.test_pred)
            check_submission(staged[paths.out], r.test, dim=r.test_pred.shape[1])
            r.sel.table.to_csv(staged[paths.report], index=False)
            doc = manifest(r, {"tracking_uri": redact_url(paths.tracking_uri), "run_id": None})
            staged[paths.manifest].write_text(json.dumps(doc, indent=2, default=float) + "\n")
            # An earlier job's manifest and report go first: killed at any moment, the files beside the submission
            # are from the job that wrote it, or absent.
            for final in (paths.manifest, paths.report):
                final.unlink(missing_ok=True)
        return doc
    except BaseException:
        _remove_empty(created)
        raise


def _track(tracker: Tracker, r: PickRun) -> dict[str, Any] | None:
    """The pick's MLflow run, its refits' runs and the pyfunc model (registered with --register): the run's record
    for the manifest, or None when the tracking failed on anything but our own bug (said in one line, the run marked
    FAILED). An interrupt or a bug marks the run (KILLED, FAILED) and is raised."""
    opts, study, sel = r.opts, r.study, r.sel
    run_id = None
    try:
        exp_id, run_id = start_run(tracker, study, opts.method)
        note = describe(study.study_name, opts.method, sel, r.models, r.cands[0].dims)
        _log_run(tracker, run_id, r, note)
        refit_runs = _log_refits(tracker, run_id, r.models, study.study_name)
        card = ModelCard(model_name(study.study_name), {STUDY_TAG: study.study_name, "latentsweep.method": opts.method},
                         run_params(r), _gain_metrics(sel), note)
        logged = log_ensemble(tracker, run_id, [(m.name, m.checkpoint, m.weight) for m in r.models], r.cands[0].dims,
                              card, register=opts.register, deadline=r.deadline, data=r.data)
        if logged is None:
            say(f"latentsweep: the ensemble's MLflow model was not logged: {r.deadline.left():.0f} s left of the "
                f"budget, too few for exporting {len(r.models)} member(s); the submission, its manifest, report and "
                "MLflow run are in place (`latentsweep pick` with a --budget logs a model)")
        registered = ({"name": logged.registered_name, "version": logged.registered_version}
                      if logged is not None and logged.registered_name else None)
        tracker.end_run(run_id)
        return {"tracking_uri": redact_url(r.paths.tracking_uri), "experiment_id": exp_id, "run_id": run_id,
                "model_id": logged and logged.model_id, "model_uri": logged and logged.model_uri,
                "registered": registered, "refit_runs": refit_runs}
    except BaseException as exc:
        # Ctrl-C is the user's stop, not a failure: MLflow's KILLED (as `mlflow run` marks an interrupted run)
        release_interrupted(exc)
        kind = kind_of(exc)
        _end_failed(tracker, run_id, "KILLED" if kind is Kind.INTERRUPT else "FAILED")
        if kind in (Kind.BUG, Kind.INTERRUPT):
            raise
        say(f"the submission is in place, but its MLflow run and model could not be written ({first_line(exc)})")
        return None


def _end_failed(tracker: Tracker, run_id: str | None, status: str) -> None:
    """After a failure or an interrupt: end the MLflow run with `status` (FAILED or KILLED)."""
    if run_id is not None:
        try:
            tracker.end_run(run_id, status)
        except Exception as exc:  # noqa: BLE001 - the original error is the one to report; this one in a line
            say(f"could not mark the pick's MLflow run {run_id} {status} ({first_line(exc)})")


def _remove_empty(created: list[Path]) -> None:
    """Remove the directories created for --out (when still empty), innermost first."""
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            pass
