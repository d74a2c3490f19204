"""`latentsweep study list|status|reap`: inspecting and repairing studies by name in the state directory's stores (or
--storage / --tracking-uri), like `pick`."""
from __future__ import annotations

import sys

from latentsweep.search.stores import add_state_arg, resolve_stores, safe_name, state_dir
from latentsweep.search.study.preflight import StoreSpec, check_liveness, check_stores
from latentsweep.search.study.report import load_existing_study, studies_table, study_header, study_table
from latentsweep.search.study.runner import reap_study
from latentsweep.search.redact import redact_url
from latentsweep.search.study.storage import StorageSettings
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.search.study.worker import dispose_study


def add_actions(ssub) -> None:
    """The inspecting actions of `latentsweep study`, added to its subparsers."""
    listing = ssub.add_parser("list", help="the studies in the storage: trials by state, best value")
    stores_args(listing, tracking=False)
    listing.add_argument("--csv", action="store_true", help="print the raw table as CSV")
    listing.set_defaults(func=cmd_study_list)
    status = ssub.add_parser("status", help="a study's counts and best value, then its trials, best first")
    status.add_argument("name", help="study name")
    stores_args(status, tracking=False)
    status.add_argument("--csv", action="store_true", help="print the raw table as CSV (no header line)")
    status.set_defaults(func=cmd_study_status)
    reap = ssub.add_parser("reap", help="fail trials of dead workers (they are retried) and close their MLflow runs")
    reap.add_argument("name", help="study name (a study file's name is taken from it)")
    stores_args(reap)
    liveness_args(reap)
    reap.set_defaults(func=cmd_study_reap)


def stores_args(p, tracking: bool = True) -> None:
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite under the state directory)")
    if tracking:
        p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under the state directory)")
        p.add_argument("--artifact-root", help="where a new MLflow experiment stores artifacts (a path or URI; "
                                               "default: STATE/artifacts for the default tracking URI, else the "
                                               "server's)")
    add_state_arg(p)


def liveness_args(p) -> None:
    p.add_argument("--heartbeat", type=int, default=60,
                   help="seconds between a running trial's heartbeats (default 60, for minute-long trials)")
    p.add_argument("--grace", type=int, default=180,
                   help="seconds without heartbeat before a trial is dead and retried (default 180: 3 missed beats)")


def cmd_study_reap(args) -> int:
    """Reap the study `name`: the storage's stale-trial rule is --heartbeat/--grace, its runs are in --tracking-uri."""
    check_liveness(args.heartbeat, args.grace)
    name = load_study_file(args.name).name if args.name.endswith(".toml") else args.name  # a file names its study
    stores = resolve_stores(state_dir(args.state_dir), args.storage, args.tracking_uri, args.artifact_root)
    spec = StoreSpec(StorageSettings(stores.storage, args.heartbeat, args.grace), stores.tracking_uri,
                     stores.artifact_root)
    check_stores(spec)
    print(f"closed {len(reap_study(safe_name(name, 'study name'), spec))} stale MLflow run(s)")
    return 0


def cmd_study_status(args) -> int:
    storage = resolve_stores(state_dir(args.state_dir, create=False), args.storage, read_only=True).storage
    study = load_existing_study(args.name, storage)
    try:
        table = study_table(study)
        header = study_header(study)
    finally:
        dispose_study(study)
    if args.csv:
        table.to_csv(sys.stdout, index=False)
        return 0
    print(header)
    if len(table):
        print(table.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.4g}"))
    return 0


def cmd_study_list(args) -> int:
    storage = resolve_stores(state_dir(args.state_dir, create=False), args.storage, read_only=True).storage
    table = studies_table(storage)
    if args.csv:
        table.to_csv(sys.stdout, index=False)
    elif len(table):
        print(table.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.4f}"))
    else:
        print(f"no studies in {redact_url(storage)}")
    return 0
