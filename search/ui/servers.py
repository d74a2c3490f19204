"""Start, wait for and stop the two local UI servers (MLflow UI, optuna-dashboard) as process groups (POSIX only)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import sqlalchemy as sa
import tomli_w

from latentsweep.search.stores import resolve_stores
from latentsweep.search.study.storage import StorageSettings, dispose, open_storage
from latentsweep.search.tracking.base import SHARED_VIEW_PREFIX, TRIALS_VIEW
from latentsweep.search.tracking.probe import probe_tracking_store
from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.core.progress import say

DEFAULT_HOST = "127.0.0.1"
DEFAULT_MLFLOW_PORT = 5000  # `mlflow server`'s own default port
DEFAULT_DASHBOARD_PORT = 8080  # `optuna-dashboard`'s own default port
# Measured on 2 cores: mlflow server needs ~14 s of CPU to answer (CLI import, then uvicorn importing the FastAPI
# app) and answered after 33-42 s wall on a loaded machine; optuna-dashboard ~4 s CPU, ~15 s wall loaded. Two
# minutes leaves room for a busier machine and a first-use schema migration.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0  # `mlflow server` forwards SIGTERM to uvicorn and waits for it; a few seconds when idle
POLL_S = 0.25
LOG_TAIL_LINES = 4
TRACEBACK_NOISE = ("Traceback (most recent call last)", "The above exception", "During handling of the above")
LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}
WILDCARD = {"0.0.0.0", "::", "[::]", ""}
MLFLOW_PROBE = "/api/2.0/mlflow/experiments/search?max_results=1"
DASHBOARD_PROBE = "/api/studies"
EXPERIMENTS_SEARCH = "/api/2.0/mlflow/experiments/search"
# `latentsweep ui` prints the trials-table link of this many studies, newest first (one line each, so they fit a
# terminal); older studies are one click away in the UI's experiment list.
MAX_VIEW_LINKS = 10
# The servers are local: an http_proxy in the environment must not intercept the probes.
LOCAL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def is_loopback(host: str) -> bool:
    return host.lower() in LOOPBACK or host.startswith("127.")


def connect_host(host: str) -> str:
    """Address a local client uses to reach a server bound to `host` (wildcards -> loopback), URL-ready."""
    if host in WILDCARD:
        return "[::1]" if ":" in host else "127.0.0.1"
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def url_for(host: str, port: int) -> str:
    return f"http://{connect_host(host)}:{port}"


def free_port(host: str = DEFAULT_HOST) -> int:
    """A port the OS reports free right now (bind to port 0); tests use it to avoid fixed ports."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host.strip("[]"), 0))
        return sock.getsockname()[1]


def check_port_free(host: str, port: int, name: str, flag: str) -> None:
    """Fail early with one line when something already listens on host:port (clearer than a dead server's log)."""
    bind_host = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR as uvicorn/wsgiref use it: a port in TIME_WAIT is usable, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            raise LatentsweepError(
                f"cannot start {name}: port {port} on {host} is not available ({exc.strerror}); "
                f"stop what uses it or pass {flag} with another port") from None


def http_json(url: str, body: dict | None = None, timeout: float = 10.0) -> dict:
    """GET (or POST `body` as JSON) and decode the JSON answer; urllib only, so tests need no extra package."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    with LOCAL_OPENER.open(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode() or "{}")


def trials_links(mlflow_url: str, query: str = "") -> list[tuple[str, str]]:
    """(study, URL) of the trials view (latentsweep.search.tracking.base.trials_view) of the newest studies that
    have one, `query` added to each URL; asks the MLflow server, so it raises what http_json raises."""
    search = urllib.parse.urlencode({"max_results": MAX_VIEW_LINKS, "order_by": "creation_time DESC",
                                     "filter": f"tags.`{SHARED_VIEW_PREFIX}{TRIALS_VIEW}` LIKE '%'"})
    found = http_json(f"{mlflow_url}{EXPERIMENTS_SEARCH}?{search}")
    return [(exp["name"], f"{mlflow_url}/#/experiments/{exp['experiment_id']}/runs?viewStateShareKey={TRIALS_VIEW}"
             + (f"&{query}" if query else "")) for exp in found.get("experiments", [])]


@dataclass
class ServerProcess:
    """One server subprocess, leader of its own process group (so stop() also reaches uvicorn workers)."""

    name: str
    url: str
    probe_path: str
    log_path: Path
    proc: subprocess.Popen

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last unindented log lines joined by ' | ' (of a traceback: its exception lines, not its frames)."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        kept = [line.strip() for line in text
                if line.strip() and not line[0].isspace() and not line.startswith(TRACEBACK_NOISE)]
        return " | ".join(kept[-lines:]) or "(empty log)"

    def failure(self, what: str) -> LatentsweepError:
        """One line: which server, what happened, the end of its log, and where the whole log is."""
        return LatentsweepError(f"{self.name} ({self.url}) {what}; log tail: {self.log_tail()} "
                                f"(full log: {self.log_path})")

    def probe(self) -> bool:
        """True once the server we started answers its API with 200; a 403 means the Host header was refused (fatal).
        A readiness poll of our own child, not a store probe: a tracking store the user names is probed by
        latentsweep.search.tracking.probe, with the MLflow client's credentials."""
        try:
            with LOCAL_OPENER.open(self.url + self.probe_path, timeout=5) as resp:
                return resp.status == 200
        except urllib.error.HTTPError as exc:
            if exc.code == 403:
                raise self.failure("refused the request (HTTP 403: Host header not allowed; see --allowed-hosts)")
            return False
        except (urllib.error.URLError, OSError):
            return False

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM the whole group, wait, then SIGKILL whatever is left of it (workers included)."""
        _signal_group(self.proc.pid, signal.SIGTERM)
        if not self._wait(timeout):
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        deadline = time.monotonic() + timeout
        while group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if group_alive(self.proc.pid):
            _signal_group(self.proc.pid, signal.SIGKILL)  # children that outlived their leader

    def _wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process remains in the group (zombies wait for a reaper and hold no port)."""
    for proc in psutil.process_iter(["status"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, PermissionError):  # gone since the listing, or not ours to ask about
            continue
    return False


def spawn(name: str, argv: list[str], url: str, probe_path: str, log_path: Path,
          env: dict[str, str] | None = None) -> ServerProcess:
    """Start argv in a new session (own process group: Ctrl-C in the terminal reaches only us, we stop it)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=full_env, start_new_session=True)
    return ServerProcess(name, url, probe_path, log_path, proc)


def wait_ready(servers: list[ServerProcess], timeout: float = START_TIMEOUT_S) -> None:
    """Poll until every server answers; raise one line naming the first that died or did not answer in time."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while pending:
        for server in list(pending):
            if server.probe():
                pending.remove(server)
            elif not server.alive():
                raise server.failure(f"failed to start (exit code {server.proc.returncode})")
        if pending and time.monotonic() > deadline:
            raise pending[0].failure(f"did not answer within {timeout:.0f} s")
        if pending:
            time.sleep(POLL_S)


def mlflow_argv(backend_uri: str, artifact_root: str, host: str, port: int,
                allowed_hosts: str | None) -> list[str]:
    argv = [sys.executable, "-m", "mlflow", "server",
            "--backend-store-uri", backend_uri,
            # New experiments (e.g. created in the UI) get the same file root the tracker uses; proxied
            # mlflow-artifacts:/ URIs resolve there too.
            "--default-artifact-root", artifact_root,
            "--serve-artifacts", "--artifacts-destination", artifact_root,
            "--host", host.strip("[]"), "--port", str(port),
            # One worker: SQLite serialises writes anyway, and each uvicorn worker costs ~8 s CPU to import.
            "--workers", "1"]
    if allowed_hosts is None and not is_loopback(host) and host not in WILDCARD:
        # MLflow >= 3.5 rejects Host headers other than localhost/private IPs; a server bound to a specific
        # public address must accept that address.
        allowed_hosts = f"localhost,localhost:*,127.0.0.1,127.0.0.1:*,{host},{host}:*"
    if allowed_hosts:
        argv += ["--allowed-hosts", allowed_hosts]
    return argv


def mlflow_env() -> dict[str, str]:
    """Extra environment of the MLflow server.

    Its job runner starts seven huey consumer processes at boot, which doubled the startup time on 2 cores; it
    only serves GenAI evaluation jobs, which latentsweep never submits. An explicit user setting wins.
    """
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}


def ensure_optuna_schema(storage: str) -> None:
    """Create Optuna's tables in an RDB storage that lacks them (e.g. no study run yet).

    optuna-dashboard 0.21 opens RDB URLs with skip_table_creation=True and exits with "no such table:
    version_info" on a new SQLite file; journal files and redis URLs need no schema.
    """
    if "://" not in storage or storage.startswith("redis"):
        return

    try:
        dispose(open_storage(StorageSettings(storage)))
    except RuntimeError as exc:  # tables made by another Optuna version: they exist, and the dashboard skips the check
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        say(f"optuna-dashboard: the storage's tables were not (re)created ({first}); the dashboard reads them as "
            "they are")


def dashboard_argv(config: Path, host: str, port: int) -> list[str]:
    """optuna-dashboard reading its storage URL from `config` (see dashboard_config): never on the command line,
    where any local user could read a password with `ps`."""
    script = Path(sys.executable).with_name("optuna-dashboard")
    exe = str(script) if script.exists() else shutil.which("optuna-dashboard")
    if exe is None:
        raise LatentsweepError("cannot start optuna-dashboard: it is not installed (pip install optuna-dashboard)")
    # wsgiref (threaded) rather than gunicorn: one process that exits at once on SIGTERM; ample for one user.
    return [exe, "--from-config", str(config), "--host", host.strip("[]"), "--port", str(port), "--server", "wsgiref"]


def dashboard_config(storage: str) -> Path:
    """A TOML file readable by this user only ([optuna_dashboard] storage = URL), in a private temporary
    directory; the caller removes it once the dashboard has read it."""
    fd, path = tempfile.mkstemp(prefix="latentsweep-dashboard-", suffix=".toml")  # mode 0600
    with os.fdopen(fd, "wb") as fh:
        tomli_w.dump({"optuna_dashboard": {"storage": storage}}, fh)
    return Path(path)


def password_to_env(argv: list[str], env: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Move a backend URI that carries a password from MLflow's command line to MLFLOW_BACKEND_STORE_URI (the
    option's environment variable), out of sight of `ps`."""
    at = argv.index("--backend-store-uri")
    try:
        secret = sa.engine.make_url(argv[at + 1]).password is not None
    except sa.exc.ArgumentError:
        secret = False
    if not secret:
        return argv, env
    return argv[:at] + argv[at + 2:], {**env, "MLFLOW_BACKEND_STORE_URI": argv[at + 1]}


@dataclass
class UiHandle:
    """The running UI: URLs, the server processes this call started, and stop(); a context manager, so that the
    caller's `with` stops the servers however it ends (no process-wide exit hook)."""

    mlflow_url: str
    dashboard_url: str
    servers: list[ServerProcess] = field(default_factory=list)

    def dead(self) -> ServerProcess | None:
        """The first server that has exited, if any."""
        return next((s for s in self.servers if not s.alive()), None)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> UiHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_ui(state_dir: Path, host: str = DEFAULT_HOST, mlflow_port: int = DEFAULT_MLFLOW_PORT,
             dashboard_port: int = DEFAULT_DASHBOARD_PORT, storage: str | None = None,
             tracking_uri: str | None = None, allowed_hosts: str | None = None,
             timeout: float = START_TIMEOUT_S) -> UiHandle:
    """Start the MLflow UI and optuna-dashboard on the state directory's stores; return once both answer HTTP.

    An http(s) tracking URI is an MLflow server already running: it is probed as the MLflow client would use it
    (latentsweep.search.tracking.probe) and reported, not started.
    On any failure, whatever was started is stopped before the one-line LatentsweepError propagates.
    """
    state_dir = Path(state_dir)
    stores = resolve_stores(state_dir, storage, tracking_uri)
    storage, tracking_uri = stores.storage, stores.tracking_uri
    remote_mlflow = tracking_uri.startswith(("http://", "https://"))
    if remote_mlflow:
        probe_tracking_store(tracking_uri)
    if not remote_mlflow and mlflow_port == dashboard_port:
        raise LatentsweepError(f"--mlflow-port and --dashboard-port are both {mlflow_port}: give them different ports")
    if not remote_mlflow:
        check_port_free(host, mlflow_port, "the MLflow UI", "--mlflow-port")
    check_port_free(host, dashboard_port, "optuna-dashboard", "--dashboard-port")

    logs = state_dir / "logs"
    handle = UiHandle(mlflow_url=tracking_uri.rstrip("/") if remote_mlflow else url_for(host, mlflow_port),
                      dashboard_url=url_for(host, dashboard_port))
    try:
        if not remote_mlflow:
            argv = mlflow_argv(tracking_uri, stores.server_artifact_root, host, mlflow_port, allowed_hosts)
            argv, env = password_to_env(argv, mlflow_env())
            handle.servers.append(spawn("the MLflow UI", argv, handle.mlflow_url, MLFLOW_PROBE,
                                        logs / f"mlflow-ui-{mlflow_port}.log", env))
        ensure_optuna_schema(storage)
        config = dashboard_config(storage)
        try:
            handle.servers.append(spawn("optuna-dashboard", dashboard_argv(config, host, dashboard_port),
                                        handle.dashboard_url, DASHBOARD_PROBE,
                                        logs / f"optuna-dashboard-{dashboard_port}.log"))
            wait_ready(handle.servers, timeout)  # once it answers, it has read its storage URL
        finally:
            config.unlink(missing_ok=True)
    except BaseException:
        handle.stop()
        raise
    return handle
