"""Checks for deploy/smoke.sh, run inside the stack (the mlflow container: the project's Python, PG* credentials).

    python - poll STUDY                       one JSON line: trials by state, and running trials past their 1st epoch
    python - check STUDY N_TRIALS MLFLOW_URL  the final checks; prints a summary, exit status 1 if any check fails

The Optuna storage is the compose PostgreSQL (postgres:$PGPORT/$POSTGRES_DB, password from PGPASSWORD via libpq).
"""
from __future__ import annotations

import json
import os
import sys
from collections import Counter

import optuna
from mlflow import MlflowClient

from latentsweep.search.tracking.base import STATUS_OF_STATE  # the image has latentsweep installed

# Terminal MLflow status per Optuna state, as the tracker sets it (a reaped trial's run ends FAILED).
RUN_STATUS = {**STATUS_OF_STATE, "FAIL": "FAILED"}


def load(study: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    url = f"postgresql+psycopg2://{os.environ['PGUSER']}@postgres:{os.environ['PGPORT']}/{os.environ['POSTGRES_DB']}"
    return optuna.load_study(study_name=study, storage=url)


def poll(study: str) -> int:
    trials = load(study).get_trials(deepcopy=False)
    states = Counter(t.state.name for t in trials)
    mid = sum(t.state.name == "RUNNING" and bool(t.intermediate_values) for t in trials)
    print(json.dumps({**states, "running_past_first_epoch": mid}))
    return 0


def check(study_name: str, n_trials: int, mlflow_url: str) -> int:
    failures: list[str] = []
    trials = load(study_name).get_trials(deepcopy=False)
    states = Counter(t.state.name for t in trials)
    counted = states["COMPLETE"] + states["PRUNED"]
    print(f"optuna: {len(trials)} trials: " + " ".join(f"{s}={n}" for s, n in sorted(states.items())))
    if counted != n_trials:
        failures.append(f"budget: COMPLETE+PRUNED = {counted}, expected exactly {n_trials}")
    else:
        print(f"optuna: budget exact: COMPLETE+PRUNED = {counted} = n_trials")
    left = [t.number for t in trials if t.state.name in ("RUNNING", "WAITING")]
    if left:
        failures.append(f"trials left RUNNING/WAITING: {left}")

    retried = {t.system_attrs.get("failed_trial"): t for t in trials if "failed_trial" in t.system_attrs}
    failed = [t for t in trials if t.state.name == "FAIL"]
    if not failed:
        failures.append("no FAIL trial: the killed worker was not running a trial (or its trial was not reaped)")
    for t in failed:
        retry = retried.get(t.number)
        if retry is None:
            failures.append(f"trial {t.number} FAILED but was never retried")
        else:
            print(f"optuna: trial {t.number} (killed worker's) FAIL, retried as trial {retry.number} "
                  f"({retry.state.name}, same params: {retry.params == t.params})")

    before = len(failures)
    client = MlflowClient(mlflow_url)
    exp = client.get_experiment_by_name(study_name)
    if exp is None:
        failures.append(f"no MLflow experiment '{study_name}' on {mlflow_url}")
        return report(failures)
    runs = client.search_runs([exp.experiment_id], max_results=1000)
    by_id = {r.info.run_id: r for r in runs}
    roles = Counter(r.data.tags.get("latentsweep.role") for r in runs)
    statuses = Counter(r.info.status for r in runs)
    print(f"mlflow: {len(runs)} runs on {mlflow_url} ({roles['parent']} parent, {roles['trial']} trial): "
          + " ".join(f"{s}={n}" for s, n in sorted(statuses.items())))
    running = [r.info.run_name for r in runs if r.info.status == "RUNNING"]
    if running:
        failures.append(f"MLflow runs left RUNNING: {running}")
    parents = [r for r in runs if r.data.tags.get("latentsweep.role") == "parent"]
    if [r.info.status for r in parents] != ["FINISHED"]:
        failures.append(f"parent runs: {[r.info.status for r in parents]}, expected one FINISHED")
    with_run = [t for t in trials if "mlflow_run_id" in t.user_attrs]
    if roles["trial"] != len(with_run):
        failures.append(f"{roles['trial']} trial runs on the server for {len(with_run)} trials that opened one")
    artifacts = 0
    for t in trials:
        run = by_id.get(t.user_attrs.get("mlflow_run_id"))
        if run is None:
            failures.append(f"trial {t.number} ({t.state.name}) has no run on the server")
            continue
        want = RUN_STATUS.get(t.state.name)
        tags = run.data.tags
        if (run.info.status, tags.get("optuna.trial_number"), tags.get("optuna.state")) != \
                (want, str(t.number), t.state.name):
            failures.append(f"trial {t.number} ({t.state.name}): run {run.info.run_id} is {run.info.status} for "
                            f"trial {tags.get('optuna.trial_number')} in state {tags.get('optuna.state')}, "
                            f"expected {want}")
        if t.state.name == "FAIL" and run.data.tags.get("latentsweep.reaped") != "true":
            failures.append(f"trial {t.number}'s run was not closed by the reaper")
        if t.state.name in ("COMPLETE", "PRUNED"):
            names = {a.path for a in client.list_artifacts(run.info.run_id)}
            if "config.toml" not in names:
                failures.append(f"trial {t.number}'s run has no config.toml artifact on the server ({sorted(names)})")
            artifacts += 1
    print(f"mlflow: every trial has its run on the server, in the matching state; artifacts of {artifacts} "
          "finished trials served by the tracking server" if len(failures) == before else "mlflow: see failures below")
    return report(failures)


def report(failures: list[str]) -> int:
    for failure in failures:
        print(f"FAIL: {failure}")
    return 1 if failures else 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["poll"] and len(argv) == 2:
        return poll(argv[1])
    if argv[:1] == ["check"] and len(argv) == 4:
        return check(argv[1], int(argv[2]), argv[3])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
