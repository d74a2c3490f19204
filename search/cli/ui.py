"""`latentsweep ui`: run the MLflow UI and optuna-dashboard on the state directory until Ctrl-C."""
from __future__ import annotations

import argparse
import math
import signal
import time

from latentsweep.search.ui import servers
from latentsweep.search.process import interrupt_on
from latentsweep.search.stores import add_state_arg, state_dir
from latentsweep.trainers.core.progress import say

MAX_PORT = 65535  # TCP ports are 16-bit
ML_WORKFLOW = "workflowType=machine_learning"  # MLflow UI URL parameter: its Model training pages, not GenAI
NO_STUDIES_HINT = "no studies yet: run `latentsweep study run studies/quickstart.toml`"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("ui", help="serve the MLflow UI and optuna-dashboard until Ctrl-C",
                              description="Start the MLflow tracking UI and optuna-dashboard on the state "
                                          "directory's stores, print their URLs and keep them running until Ctrl-C.")
    add_state_arg(p)
    p.add_argument("--host", default=servers.DEFAULT_HOST,
                   help="interface both servers bind to (default: 127.0.0.1; the UIs have no authentication)")
    p.add_argument("--mlflow-port", type=port, default=servers.DEFAULT_MLFLOW_PORT, help="MLflow UI port (5000)")
    p.add_argument("--dashboard-port", type=port, default=servers.DEFAULT_DASHBOARD_PORT,
                   help="optuna-dashboard port (8080)")
    p.add_argument("--storage", default=None, help="Optuna storage URL (default: sqlite:///STATE/optuna.db)")
    p.add_argument("--tracking-uri", default=None,
                   help="MLflow backend store (default: sqlite:///STATE/mlflow.db); an http(s) URI is an MLflow "
                        "server already running and is only reported")
    p.add_argument("--allowed-hosts", default=None,
                   help="Host headers the MLflow UI accepts, comma-separated (MLflow's default: localhost and "
                        "private IPs); needed to reach it by a public name or address")
    p.add_argument("--timeout", type=positive_seconds, default=servers.START_TIMEOUT_S,
                   help="seconds to wait for both servers to answer (default: %(default)s)")
    p.set_defaults(func=cmd_ui)


def port(text: str) -> int:
    """A TCP port a server can listen on (1-65535; 0 would let the OS pick one we could not announce)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 1 <= value <= MAX_PORT:
        raise argparse.ArgumentTypeError(f"port {value} is outside 1-{MAX_PORT}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of seconds {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def cmd_ui(args) -> int:
    root = state_dir(args.state_dir)
    if not servers.is_loopback(args.host):
        say(f"latentsweep: warning: binding to {args.host}: the MLflow UI and optuna-dashboard have no "
            "authentication; anyone who can reach this address can read and change your studies and runs")
    print("starting the MLflow UI and optuna-dashboard ...", flush=True)
    # SIGTERM and SIGHUP stop the servers as Ctrl-C does: they run in their own sessions, so a closed terminal or
    # `kill` reaches only this process, and its default death would leave them running.
    with interrupt_on(signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        # Ctrl-C while starting: start_ui stops what it started and cli.main reports the interrupt (exit 130).
        handle = servers.start_ui(root, host=args.host, mlflow_port=args.mlflow_port,
                                  dashboard_port=args.dashboard_port, storage=args.storage,
                                  tracking_uri=args.tracking_uri, allowed_hosts=args.allowed_hosts,
                                  timeout=args.timeout)
        try:
            _announce(handle)
            _serve_until_interrupted(handle)
        except KeyboardInterrupt:
            print("\nstopping ...", flush=True)
        finally:
            handle.stop()  # however the command ends (no process-wide exit hook)
    print("stopped")
    return 0


def _announce(handle: servers.UiHandle) -> None:
    print(f"MLflow UI:        {handle.mlflow_url}")
    # MLflow 3 opens in its GenAI mode unless the browser chose otherwise; studies are model-training runs.
    print(f"  (model-training view: {handle.mlflow_url}/#/experiments?{ML_WORKFLOW})")
    try:  # each study's trials with their value, state, knobs and warm-start source as columns
        links = servers.trials_links(handle.mlflow_url, ML_WORKFLOW)
    except (OSError, ValueError):
        links = []  # only a hint, as the studies' count below
    for study, url in links:
        print(f"  trials of {study}: {url}")
    print(f"optuna-dashboard: {handle.dashboard_url}")
    try:
        studies = servers.http_json(handle.dashboard_url + servers.DASHBOARD_PROBE).get("study_summaries", [])
    except (OSError, ValueError):
        studies = None  # only a hint: the dashboard answered its probe, a second failure here is not fatal
    if studies == []:
        print(NO_STUDIES_HINT)
    print("press Ctrl-C to stop", flush=True)


def _serve_until_interrupted(handle: servers.UiHandle) -> None:
    """Block until KeyboardInterrupt, or raise when a server dies."""
    while True:
        dead = handle.dead()
        if dead is not None:
            raise dead.failure(f"stopped unexpectedly (exit code {dead.proc.returncode})")
        time.sleep(1.0)


