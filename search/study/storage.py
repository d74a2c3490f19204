"""Optuna RDB storage: engines with small pools, SQLite busy timeouts and WAL, heartbeats, retries, a budget lock.

SQLite is the embedded default; several local worker processes share it safely because every connection waits up to
SQLITE_TIMEOUT_S for the write lock (instead of failing with "database is locked") and the file is in WAL mode, so
readers never block the writer. PostgreSQL is the choice for many workers and several machines.

Platform: POSIX only (Linux, macOS). The SQLite schema and budget locks are `fcntl.flock` locks on files beside the
database; on a platform without `fcntl` (Windows) file_lock raises a one-line error naming the platform instead of
running unlocked (docs/design.md, "POSIX only").
"""
from __future__ import annotations

import contextlib
import hashlib
import sqlite3
import sys
import time
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import optuna
import sqlalchemy as sa

try:
    import fcntl
except ImportError:  # not a POSIX system: file_lock says so when a lock is needed
    fcntl = None

from latentsweep.search.redact import redact_url  # one redaction rule for logs, params and tags
from latentsweep.trainers.core.errors import LatentsweepError

SQLITE_TIMEOUT_S = 120  # a trial's tell() can wait behind another worker's write burst; 2 min is ample
POOL_SIZE = 2  # per worker process: one for the trial loop, one for the heartbeat thread
# PostgreSQL budget locks live on their own NullPool engine: one extra connection per worker, only while it claims.
_LOCK_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage engine -> its lock engine
PG_CONNECT_TIMEOUT_S = 15  # an unreachable PostgreSQL host fails in seconds instead of the OS TCP timeout (minutes)
SCHEMA_ATTEMPTS, SCHEMA_RETRY_S = 3, 1.0  # a lost schema-creation race is retried after the winner committed


@dataclass(frozen=True)
class StorageSettings:
    url: str
    heartbeat_interval: int = 60  # seconds; trials run minutes, so a minute keeps the write load negligible
    grace_period: int = 180  # three missed heartbeats before a trial counts as dead
    max_retry: int = 2  # a trial whose worker died is retried at most twice


def is_sqlite(url: str) -> bool:
    return url.startswith("sqlite")


def sqlite_path(url: str) -> Path | None:
    if not is_sqlite(url):
        return None
    path = url.split(":///", 1)[1].split("?", 1)[0]
    return Path(path) if path and path != ":memory:" else None


def _engine_kwargs(url: str) -> dict:
    if is_sqlite(url):
        return {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    kwargs = {"pool_size": POOL_SIZE, "max_overflow": 0, "pool_pre_ping": True, "pool_recycle": 1800}
    if url.startswith("postgresql") and "connect_timeout" not in url:
        # libpq waits forever by default for a host that drops packets; a URL's own connect_timeout wins.
        kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT_S}
    return kwargs


def _make_sqlite_dir(url: str) -> None:
    path = sqlite_path(url)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LatentsweepError(f"cannot open SQLite storage {path}: {exc}") from None


def _set_wal(url: str) -> None:
    path = sqlite_path(url)
    if path is None:
        return
    try:
        with contextlib.closing(sqlite3.connect(path, timeout=SQLITE_TIMEOUT_S)) as conn:
            conn.execute("PRAGMA journal_mode=WAL")  # persistent in the file: every later connection uses it
    except (OSError, sqlite3.Error) as exc:
        raise LatentsweepError(f"cannot open SQLite storage {path}: {exc}") from None


def retry_callback(max_retry: int):
    """Optuna's own retry: a WAITING copy of the failed trial (params kept, system attr 'failed_trial' = its number)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry)


class RetryAndRecord:
    """Optuna's retry of a heartbeat-stale trial that also remembers the trials this process failed, so the caller can
    close their MLflow runs as FAILED whatever they say (a worker killed after ending its run as FINISHED but before
    telling Optuna leaves a FINISHED run for a FAIL trial, which no search for RUNNING runs would find)."""

    def __init__(self, max_retry: int):
        self.retry = retry_callback(max_retry)
        self.failed: list[optuna.trial.FrozenTrial] = []

    def __call__(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        self.failed.append(trial)
        self.retry(study, trial)

    def drain(self) -> list[optuna.trial.FrozenTrial]:
        failed, self.failed = self.failed, []
        return failed


def is_read_only(url: str) -> bool:
    """A SQLite URI opened read-only (see latentsweep.search.stores.read_only_storage): nothing may be created or
    migrated."""
    return is_sqlite(url) and ("mode=ro" in url or "immutable=1" in url)


@contextlib.contextmanager
def schema_lock(url: str) -> Iterator[None]:
    """Serialise first-time schema creation of a SQLite store (Optuna's or MLflow's) between processes on this
    machine: two first runs racing on CREATE TABLE otherwise kill one of them ("table ... already exists")."""
    path = sqlite_path(url) if not is_read_only(url) else None
    if path is None or not path.parent.is_dir():
        yield
        return
    with file_lock(path.with_suffix(path.suffix + ".schema.lock")):
        yield


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (created if missing) for the duration of the block: one process at a time.
    POSIX only (fcntl); elsewhere a LatentsweepError, since running unlocked could overrun the study's budget."""
    if fcntl is None:
        raise LatentsweepError(f"file locks need fcntl, which this platform ({sys.platform}) lacks: latentsweep "
                               "runs on POSIX systems (Linux, macOS); on Windows use WSL")
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def open_storage(settings: StorageSettings) -> optuna.storages.RDBStorage:
    """An RDBStorage with heartbeats and automatic retry of trials whose worker died; one-line error if unreachable.

    Schema creation is locked (SQLite) and retried (any database: a server-side race surfaces as an integrity or
    "already exists" error on the loser, whose second attempt finds the tables)."""
    read_only = is_read_only(settings.url)
    for attempt in range(SCHEMA_ATTEMPTS):
        try:
            if not read_only:
                _make_sqlite_dir(settings.url)
            with schema_lock(settings.url), warnings.catch_warnings():
                if not read_only:
                    _set_wal(settings.url)  # under the lock: switching a new file to WAL does not wait for busy peers
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # heartbeats: "experimental"
                return optuna.storages.RDBStorage(
                    settings.url,
                    engine_kwargs=_engine_kwargs(settings.url),
                    skip_table_creation=read_only,
                    heartbeat_interval=settings.heartbeat_interval,
                    grace_period=settings.grace_period,
                    heartbeat_stale_trial_callback=RetryAndRecord(settings.max_retry),
                )
        except (sa.exc.IntegrityError, sa.exc.ProgrammingError) as exc:
            if attempt + 1 < SCHEMA_ATTEMPTS:
                time.sleep(SCHEMA_RETRY_S)
                continue
            error = exc
        except (sa.exc.SQLAlchemyError, ImportError, ValueError) as exc:
            error = exc
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LatentsweepError(f"cannot open Optuna storage {redact_url(settings.url)}: {reason}") from None
    raise AssertionError("unreachable")


def tracking_has_experiment(uri: str, name: str) -> bool:
    """Whether a database tracking store already holds experiment `name`: read from MLflow's own table, creating
    nothing (a SQLite file that does not exist yet, or a database without MLflow's tables, holds none)."""
    url = sa.engine.make_url(uri)
    if url.get_backend_name() == "sqlite" and not Path(url.database or "").expanduser().is_file():
        return False
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool, connect_args=_engine_kwargs(uri).get("connect_args", {}))
    try:
        with engine.connect() as conn:
            if not sa.inspect(conn).has_table("experiments"):
                return False
            row = conn.execute(sa.text("SELECT 1 FROM experiments WHERE name = :name"), {"name": name}).first()
        return row is not None
    finally:
        engine.dispose()


def dispose(storage: optuna.storages.RDBStorage) -> None:
    """Close the pool at exit (PostgreSQL counts idle connections against max_connections)."""
    engine = getattr(storage, "engine", None)
    if engine is not None:
        lock_engine = _LOCK_ENGINES.pop(engine, None)
        if lock_engine is not None:
            lock_engine.dispose()
        engine.dispose()


def _lock_engine(engine: sa.engine.Engine) -> sa.engine.Engine:
    """A NullPool engine beside the storage's pool, so the advisory lock never takes one of the pool's connections
    (the trial loop's and the heartbeat thread's) and its connection, closed after each claim, never goes back to a
    pool still holding a session lock (an interrupted unlock would otherwise block every other worker)."""
    lock_engine = _LOCK_ENGINES.get(engine)
    if lock_engine is None:
        connect_args = _engine_kwargs(str(engine.url)).get("connect_args", {})
        lock_engine = sa.create_engine(engine.url, poolclass=sa.pool.NullPool, connect_args=connect_args)
        _LOCK_ENGINES[engine] = lock_engine
    return lock_engine


@contextlib.contextmanager
def budget_lock(storage: optuna.storages.RDBStorage, study_name: str) -> Iterator[None]:
    """Serialise "count trials, then ask for one" across workers so the trial budget is exact.

    PostgreSQL: a session-level advisory lock keyed by the study name (works across machines), on a connection of
    its own that is closed afterwards (closing releases the lock even if the unlock never ran).
    SQLite: an flock on a file beside the database (all SQLite workers share one machine by construction).
    """
    url = str(storage.engine.url)
    path = sqlite_path(url)
    if path is not None:
        with file_lock(path.with_suffix(path.suffix + ".lock")):
            yield
        return
    if storage.engine.dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(study_name.encode()).digest()[:8], "big", signed=True)
        with _lock_engine(storage.engine).connect() as conn:
            conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
            try:
                yield
            finally:
                conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                conn.commit()
        return
    yield  # other databases: best effort (the budget may overshoot by at most workers - 1)


# Optuna's storage API (heartbeats, trial state, system attrs) is keyed by the storage's trial id and called on the
# RDBStorage, and neither is public on Study or Trial: Optuna's own optimize loop reads `trial._trial_id` and
# `study._storage` for the same calls (optuna/study/_optimize.py). These two functions are the only places that read
# them, so a rename in Optuna breaks here, not at every caller.
def storage_of(study: optuna.Study) -> optuna.storages.RDBStorage:
    """The RDBStorage behind a study (Optuna wraps it in a private caching layer, `_CachedStorage._backend`)."""
    return getattr(study._storage, "_backend", study._storage)


def trial_id(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    """The storage's id of a trial (Trial and FrozenTrial expose only its number)."""
    return trial._trial_id
