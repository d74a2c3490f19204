"""Faults injected below the code under test: MLflow's own SQL tracking store, subclassed and registered for sqlite://
in MLflow's tracking-store registry (where a plugin's store goes), fails the calls LATENTSWEEP_FAULT names.

LATENTSWEEP_FAULT = "<call>:<what>[:<n>]" (several joined by ","): every (no n, or "*"), the n-th, or the n-th to the
m-th ("n-m") matching call in each process raises. Calls: start (create_run of a trial), epoch (log_batch of a
trial's metrics: an epoch), note (log_batch of the "Complete:" note, after training), end (update_run_info to a
terminal status: end_trial), parent_end (the parent run's end). What: bug (a TypeError, as a bug of ours would),
outage (the call runs on an engine whose database cannot be opened: MLflow's own OperationalError ->
MlflowException(TEMPORARILY_UNAVAILABLE) path).
The variable is read at call time, so spawned workers that import this module (HOOK) fail the same way.
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

FAULT_ENV = "LATENTSWEEP_FAULT"
ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).resolve().parent
# A sitecustomize that installs the store in every Python process started with it on PYTHONPATH (spawned workers).
HOOK = "import fault_kit\nfault_kit.install()\n"
_calls: Counter = Counter()


def _fires(call: str) -> str | None:
    for spec in filter(None, os.environ.get(FAULT_ENV, "").split(",")):
        where, what, *nth = spec.split(":")
        if where != call:
            continue
        _calls[call] += 1
        if not nth or nth[0] == "*":
            return what
        first, _, last = nth[0].partition("-")
        if int(first) <= _calls[call] <= int(last or first):
            return what
    return None


def _store_class():
    import sqlalchemy
    from mlflow.store.db.utils import _get_managed_session_maker
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from sqlalchemy.orm import sessionmaker

    class FaultyStore(SqlAlchemyStore):
        def _call(self, call: str, method, *args):
            what = _fires(call)
            if what == "bug":
                raise TypeError(f"injected bug in {call}")
            if what != "outage":
                return method(*args)
            live = self.ManagedSessionMaker
            dead = sqlalchemy.create_engine("sqlite:////nonexistent-latentsweep-fault/mlflow.db")
            self.ManagedSessionMaker = _get_managed_session_maker(sessionmaker(bind=dead), "sqlite")
            try:
                return method(*args)
            finally:
                self.ManagedSessionMaker = live
                dead.dispose()

        def create_run(self, experiment_id, user_id, start_time, tags, run_name):
            call = "start" if (run_name or "").startswith("trial-") else "other"
            return self._call(call, super().create_run, experiment_id, user_id, start_time, tags, run_name)

        def log_batch(self, run_id, metrics, params, tags):
            trial = self.get_run(run_id).data.tags.get("latentsweep.role") == "trial"
            note = any(t.value.startswith("Complete:") for t in tags)
            call = "other" if not trial else "epoch" if metrics else "note" if note else "other"
            return self._call(call, super().log_batch, run_id, metrics, params, tags)

        def update_run_info(self, run_id, run_status, end_time, run_name):
            if end_time is None:
                return super().update_run_info(run_id, run_status, end_time, run_name)
            parent = self.get_run(run_id).data.tags.get("latentsweep.role") == "parent"
            return self._call("parent_end" if parent else "end", super().update_run_info, run_id, run_status,
                              end_time, run_name)

    return FaultyStore


def install():
    """Register the faulty store for sqlite:// (MLflow caches stores per URI: use a fresh URI after this)."""
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry

    cls = _store_class()
    previous = registry._registry["sqlite"]

    def faulty(store_uri, artifact_uri):
        store = previous(store_uri=store_uri, artifact_uri=artifact_uri)  # MLflow's own, then our subclass of it
        store.__class__ = cls
        return store

    registry.register("sqlite", faulty)
    return previous


def uninstall(previous) -> None:
    from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry

    registry.register("sqlite", previous)


def hook_env(tmp_path: Path, fault: str) -> dict[str, str]:
    """The environment of a `latentsweep` subprocess whose every process (spawned workers too) has the faulty store."""
    hook = tmp_path / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    return {**os.environ, FAULT_ENV: fault, "PYTHONPATH": os.pathsep.join([str(hook), str(TESTS), str(ROOT)])}
