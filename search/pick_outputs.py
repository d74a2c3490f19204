"""What `latentsweep pick` writes: the submission CSV, its manifest JSON and report table (all or none), the MLflow
run `pick-<method>` holding them with the report metrics, and the ensemble as a pyfunc model (optionally registered).

Files are staged in a hidden directory beside --out and moved into place only after everything (MLflow included)
succeeded; on any failure the staging directory, any directory created for --out, and nothing else is left behind,
and the MLflow run is marked FAILED.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from search.ensemble import HALF_SALT
from search.study import PARENT_ATTR
from search.tracking import PARENT_TAG, ROLE_TAG, STUDY_TAG, default_artifact_root, redact_url
from trainers.submission import check_submission, write_submission

PICK_ROLE = "pick"


@dataclass
class PickResult:
    submission: Path
    manifest: Path
    report: Path
    table: pd.DataFrame
    weights: dict[str, float]  # members with weight > 0
    best_single: str
    gain: float  # report-half MRR: ensemble - best single
    run_id: str
    model_uri: str
    tracking_uri: str
    registered: dict[str, str] | None


def _make_dirs(directory: Path) -> list[Path]:
    """mkdir -p, returning the directories it created (outermost first) so that a failure can remove them."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        d.mkdir()
    return list(reversed(missing))


def _client(tracking_uri: str):
    from mlflow import MlflowClient

    for name in ("mlflow.store.db.utils", "alembic.runtime.migration", "alembic"):  # per-migration INFO lines
        logger = logging.getLogger(name)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.WARNING)
    return MlflowClient(tracking_uri)


def start_run(client, paths, study, method: str) -> tuple[str, str]:
    """(experiment id, run id) of a new run `pick-<method>` in the study's experiment, nested under its parent run."""
    from mlflow.exceptions import MlflowException

    name = study.study_name
    exp = client.get_experiment_by_name(name)
    if exp is None:
        root = paths.artifact_root or default_artifact_root(paths.tracking_uri)
        safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "study"
        exp_id = client.create_experiment(name, artifact_location=f"{root.rstrip('/')}/{safe}" if root else None)
    else:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        exp_id = exp.experiment_id
    tags = {ROLE_TAG: PICK_ROLE, STUDY_TAG: name, "latentsweep.method": method}
    parent = study.user_attrs.get(PARENT_ATTR)
    if parent:
        try:
            if client.get_run(parent).info.experiment_id == exp_id:
                tags[PARENT_TAG] = parent
        except MlflowException:
            pass  # the parent lives in another tracking store: the pick run stands alone
    return exp_id, client.create_run(exp_id, run_name=f"pick-{method}", tags=tags).info.run_id


def run_metrics(cands, sel) -> dict[str, float]:
    """select/* and report/* figures, the gain, and each member's MRR on both halves."""
    out: dict[str, float] = {"report/gain_mrr": float(sel.scores["gain_report_mrr"])}
    for half in ("select", "report"):
        for kind in ("best_single", "mean", "ensemble"):
            for key in ("mrr", "r1", "r10"):
                out[f"{half}/{kind}_{key}"] = float(sel.scores[half][kind][key])
        for c, m in zip(cands, sel.scores[half]["members"]):
            out[f"member/{c.name}/{half}_mrr"] = float(m["mrr"])
    return out


def _log_run(client, run_id: str, opts, cands, sel, data, test) -> None:
    from mlflow.entities import Metric, Param

    params = {"method": opts.method, "top": opts.top, "size": opts.size, "seeds": opts.seeds, "seed": opts.seed,
              "n_candidates": len(cands), "n_members": int((sel.weights > 0).sum()), "best_single": sel.best_single,
              "data_fingerprint": data.fingerprint, "test_path": test.path, "halves_salt": HALF_SALT}
    now = int(time.time() * 1000)
    client.log_batch(run_id, params=[Param(k, str(v)) for k, v in params.items()], synchronous=True)
    client.log_batch(run_id, metrics=[Metric(k, v, now, 0) for k, v in run_metrics(cands, sel).items()],
                     synchronous=True)


def manifest(opts, paths, study, cands, sel, data, test, run: dict[str, Any]) -> dict[str, Any]:
    """Everything needed to audit or rebuild the pick (JSON-ready)."""
    select, report = sel.halves
    members = []
    for c, w, s, r in zip(cands, sel.weights, sel.scores["select"]["members"], sel.scores["report"]["members"]):
        members.append({"name": c.name, "trial": c.trial, "train_seed": c.cfg.train.seed,
                        "checkpoint": str(c.checkpoint), "origin": c.origin, "config_sha256": c.config_sha256,
                        "study_value": c.value, "weight": float(w), "select_mrr": s["mrr"], "report_mrr": r["mrr"]})
    scores = {half: {k: sel.scores[half][k] for k in ("best_single", "mean", "ensemble")}
              for half in ("select", "report")}
    return {
        "study": study.study_name, "direction": study.direction.name.lower(), "method": opts.method,
        "options": {"top": opts.top, "size": opts.size, "seeds": opts.seeds, "seed": opts.seed},
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "members": members,
        "weights": {c.name: float(w) for c, w in zip(cands, sel.weights) if w > 0},
        "best_single": sel.best_single,
        "scores": {**scores, "gain_report_mrr": sel.scores["gain_report_mrr"]},
        "halves": {"salt": HALF_SALT, **{h.name: {"images": len(h.images), "captions": len(h.captions),
                                                  "gallery_size": h.gallery_size} for h in (select, report)}},
        "data": {"path": str(data.path), "fingerprint": data.fingerprint},
        "test": {"path": str(test.path), "fingerprint": test.fingerprint, "rows": int(len(test.ids))},
        "submission": str(paths.out), "report_table": str(paths.report),
        "mlflow": run,
    }


def write_outputs(opts, paths, study, cands, sel, data, test, test_pred: np.ndarray) -> PickResult:
    """Stage submission + report, log the MLflow run and model, write the manifest, then move the files into place."""
    from search.pyfunc_model import log_ensemble

    created = _make_dirs(paths.out.parent)
    stage = Path(tempfile.mkdtemp(prefix=".pick-", dir=paths.out.parent))
    client, run_id, ok = None, None, False
    try:
        staged = {p: stage / p.name for p in (paths.out, paths.report, paths.manifest)}
        write_submission(staged[paths.out], test.ids, test_pred)
        check_submission(staged[paths.out], test, dim=test_pred.shape[1])
        sel.table.to_csv(staged[paths.report], index=False)
        client = _client(paths.tracking_uri)
        exp_id, run_id = start_run(client, paths, study, opts.method)
        _log_run(client, run_id, opts, cands, sel, data, test)
        logged = log_ensemble(client, exp_id, run_id, [(c.name, c.checkpoint) for c in cands], sel.weights,
                              cands[0].dims, register=opts.register,
                              tags={STUDY_TAG: study.study_name, "latentsweep.method": opts.method})
        registered = ({"name": logged.registered_name, "version": logged.registered_version}
                      if logged.registered_name else None)
        run = {"tracking_uri": redact_url(paths.tracking_uri), "experiment_id": exp_id, "run_id": run_id,
               "model_id": logged.model_id, "model_uri": logged.model_uri, "registered": registered}
        doc = manifest(opts, paths, study, cands, sel, data, test, run)
        staged[paths.manifest].write_text(json.dumps(doc, indent=2, default=float) + "\n")
        for path in staged.values():
            client.log_artifact(run_id, str(path))
        client.set_terminated(run_id, status="FINISHED")
        for final, tmp in staged.items():
            os.replace(tmp, final)
        ok = True
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if not ok:
            _undo(client, run_id, created)
    return PickResult(paths.out, paths.manifest, paths.report, sel.table, doc["weights"], sel.best_single,
                      float(sel.scores["gain_report_mrr"]), run_id, logged.model_uri, paths.tracking_uri, registered)


def _undo(client, run_id: str | None, created: list[Path]) -> None:
    """After a failure: mark the MLflow run FAILED and remove directories created for --out (when still empty)."""
    if client is not None and run_id is not None:
        try:
            client.set_terminated(run_id, status="FAILED")
        except Exception:  # noqa: BLE001 - the original error is the one to report
            pass
    for directory in reversed(created):
        try:
            directory.rmdir()
        except OSError:
            pass
