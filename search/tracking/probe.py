"""One probe of an MLflow tracking store for every scheme, with the real client's auth: one line in seconds, no
writes."""
from __future__ import annotations

import urllib.parse
from pathlib import Path

import sqlalchemy as sa
from mlflow.exceptions import MlflowException
from mlflow.utils.credentials import get_default_host_creds
from mlflow.utils.rest_utils import http_request

from latentsweep.search.redact import redact_url
from latentsweep.trainers.core.errors import LatentsweepError

# Seconds to wait for a tracking store's first answer before calling it unreachable (MLflow's client would retry an
# unreachable server for minutes, then end in a traceback after the study was created or the pick trained).
PROBE_TIMEOUT_S = 15
DATABASES = ("postgresql", "mysql", "mssql")
SEARCH_ENDPOINT = "/api/2.0/mlflow/experiments/search"


def scheme_of(uri: str) -> str:
    """'http', 'sqlite', 'postgresql', ... ('' for a plain path, MLflow's file store)."""
    return uri.split(":", 1)[0].split("+")[0].lower() if "://" in uri or uri.startswith("file:") else ""


def probe_tracking_store(uri: str, timeout: float = PROBE_TIMEOUT_S) -> None:
    """Raise a one-line LatentsweepError when the MLflow client could not use `uri`: a server that does not answer,
    refuses the client's credentials or is not MLflow; a database that refuses the connection; a SQLite file whose
    directory is missing; a scheme MLflow has no store for here. Writes nothing (a new SQLite file is not created)."""
    scheme = scheme_of(uri)
    if scheme in ("http", "https"):
        _probe_server(uri, timeout)
    elif scheme == "sqlite":
        database = sa.engine.make_url(uri).database
        parent = Path(database or ".").expanduser().parent
        if database not in (None, "", ":memory:") and not parent.is_dir():
            raise LatentsweepError(f"MLflow tracking store {redact_url(uri)}: directory {parent} does not exist")
    elif scheme in DATABASES:
        _probe_database(uri, timeout)
    elif scheme in ("", "file"):
        path = Path(uri.removeprefix("file://").removeprefix("file:")).expanduser()
        if path.exists() and not path.is_dir():
            raise LatentsweepError(f"MLflow tracking store {uri}: {path} is a file, not a directory")
    else:
        raise LatentsweepError(f"MLflow tracking URI {redact_url(uri)}: scheme '{scheme}' is not supported here "
                               f"(http(s)://, sqlite:///, postgresql+psycopg2://, mysql://, mssql:// or a directory)")


def _probe_database(uri: str, timeout: float) -> None:
    connect_args = {"connect_timeout": int(timeout)} if uri.startswith("postgresql") and "connect_timeout" not in uri \
        else {}
    try:
        engine = sa.create_engine(uri, poolclass=sa.pool.NullPool, connect_args=connect_args)
        try:
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        finally:
            engine.dispose()
    except (sa.exc.SQLAlchemyError, ImportError, ValueError) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LatentsweepError(f"MLflow tracking store {redact_url(uri)} is not reachable: {redact_url(reason)}") \
            from None


def _probe_server(uri: str, timeout: float) -> None:
    """One request through MLflow's own HTTP client: the credentials it would send (MLFLOW_TRACKING_USERNAME and
    _PASSWORD, MLFLOW_TRACKING_TOKEN, user:password@ in the URI), its TLS settings and proxies; no retries."""
    shown = redact_url(uri)
    try:
        response = http_request(get_default_host_creds(uri.rstrip("/")), SEARCH_ENDPOINT, "GET", max_retries=0,
                                timeout=timeout, raise_on_status=False, params={"max_results": 1})
    except MlflowException as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        raise LatentsweepError(f"MLflow tracking server {shown} is not reachable: {redact_url(reason)}") from None
    text = response.text[:200]
    if response.status_code == 403 and "Host header" in text:
        host = urllib.parse.urlsplit(uri).hostname
        raise LatentsweepError(f"MLflow tracking server {shown} refused the Host header '{host}': start it with "
                               f"--allowed-hosts including that name")
    if response.status_code in (401, 403):
        raise LatentsweepError(f"MLflow tracking server {shown} refused the credentials (HTTP {response.status_code}): "
                               f"set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN")
    if response.status_code in (404, 405):  # MLflow serves this endpoint: whatever answered is something else
        raise LatentsweepError(f"{shown} answers but is not an MLflow tracking server (HTTP {response.status_code} "
                               f"for its experiments API)")
    if response.status_code >= 500:
        raise LatentsweepError(f"MLflow tracking server {shown} failed: HTTP {response.status_code} "
                               f"({text.strip().splitlines()[0] if text.strip() else 'no message'})")
    try:
        answer = response.json()
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise LatentsweepError(f"{shown} answers but is not an MLflow tracking server (its experiments API did not "
                               f"return JSON)")
