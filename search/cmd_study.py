"""`latentsweep study run|create|status|reap` and `latentsweep worker`: launching, joining and inspecting studies."""
from __future__ import annotations

import json
import sys

from search.state import add_state_arg, default_artifact_root, default_storage, default_tracking_uri, state_dir
from search.storage import StorageSettings, redact_url
from search.studyfile import load_study_file, resolve_data_path
from trainers.errors import LatentsweepError

# Seconds to wait for an http(s) MLflow tracking server's first answer before calling it unreachable.
TRACKING_PROBE_TIMEOUT_S = 15


def _common(p, study_file: bool = True) -> None:
    if study_file:
        p.add_argument("study", help="study TOML file")
        p.add_argument("--data", help="train npz (default: the study's data.path, else the bundled demo)")
        p.add_argument("--n-trials", type=int, help="total finished trials of the study (default: the file's)")
        p.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    p.add_argument("--name", help="study name (default: the file's study.name)")
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite under the state directory)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under the state directory)")
    p.add_argument("--heartbeat", type=int, default=60,
                   help="seconds between a running trial's heartbeats (default 60, for minute-long trials)")
    p.add_argument("--grace", type=int, default=180,
                   help="seconds without heartbeat before a trial is dead and retried (default 180: 3 missed beats)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    add_state_arg(p)


def add_parser(sub) -> None:
    study = sub.add_parser("study", help="run and inspect Optuna studies")
    ssub = study.add_subparsers(dest="study_cmd", metavar="ACTION")
    ssub.required = True
    run = ssub.add_parser("run", help="create or resume a study and run trials on this machine")
    _common(run)
    run.add_argument("--workers", type=int, default=1, help="worker processes on this machine (default 1)")
    run.set_defaults(func=cmd_run)
    create = ssub.add_parser("create", help="create a study (and its MLflow parent run) without running trials")
    _common(create)
    create.set_defaults(func=cmd_create)
    status = ssub.add_parser("status", help="table of a study's trials")
    status.add_argument("name", help="study name")
    status.add_argument("--storage", help="Optuna storage URL (default: sqlite under the state directory)")
    status.add_argument("--csv", action="store_true", help="print the raw table as CSV")
    add_state_arg(status)
    status.set_defaults(func=cmd_status)
    reap = ssub.add_parser("reap", help="fail trials of dead workers and close their MLflow runs")
    _common(reap)
    reap.set_defaults(func=cmd_reap)
    worker = sub.add_parser("worker", help="join an existing study as one worker (any machine)")
    _common(worker)
    worker.set_defaults(func=cmd_worker)


def make_spec(args, sf=None):
    """RunSpec from CLI arguments, the study file and the state-directory defaults."""
    from search.study import RunSpec

    if args.heartbeat < 1 or args.grace <= args.heartbeat:
        # a grace period within one beat would declare live trials dead (they would then run twice)
        raise LatentsweepError(f"--grace ({args.grace} s) must be longer than --heartbeat ({args.heartbeat} s), "
                               f"and --heartbeat at least 1 s")
    sf = sf or load_study_file(args.study)
    root = state_dir(args.state_dir)
    tracking = args.tracking_uri or default_tracking_uri(root)
    data = resolve_data_path(getattr(args, "data", None) or sf.base.data.path)
    return RunSpec(
        study_file=str(sf.path), name=args.name or sf.name,
        storage=StorageSettings(args.storage or default_storage(root), args.heartbeat, args.grace),
        tracking_uri=tracking, artifact_root=None if args.tracking_uri else default_artifact_root(root),
        state_dir=str(root), data_path=str(data), n_trials=getattr(args, "n_trials", None) or sf.n_trials,
        timeout=getattr(args, "timeout", None) or sf.timeout, progress=not args.quiet,
    )


def _preflight(spec) -> None:
    """Fail before any trial: the data must load, the base config must validate, both stores must answer."""
    from trainers.data import load_train
    from trainers.validate import validate

    sf = load_study_file(spec.study_file)
    validate(sf.base)
    load_train(spec.data_path)
    _check_stores(spec)


def _check_stores(spec) -> None:
    """One-line errors, before anything is written to either store (no study without its MLflow parent run).

    The Optuna storage is opened once; an http(s) MLflow server is probed with one short request, because the
    MLflow client retries an unreachable server for minutes and then ends in a traceback.
    """
    from search.storage import dispose, open_storage

    if spec.tracking_uri.startswith(("http://", "https://")):
        _probe_tracking_server(spec.tracking_uri)  # first: it writes nothing, while opening SQLite creates the file
    dispose(open_storage(spec.storage))


def _probe_tracking_server(uri: str) -> None:
    import urllib.error
    import urllib.parse
    import urllib.request

    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        with urllib.request.urlopen(url, timeout=TRACKING_PROBE_TIMEOUT_S):
            return
    except urllib.error.HTTPError as exc:
        body = exc.read(200).decode("utf-8", "replace")
        if exc.code == 403 and "Host header" in body:
            raise LatentsweepError(f"MLflow tracking server {redact_url(uri)} refused the Host header "
                                   f"'{urllib.parse.urlparse(uri).netloc}': start it with --allowed-hosts "
                                   "including that name") from None
        return  # it answered (e.g. 401 without credentials): reachable, and the MLflow client does the rest
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LatentsweepError(f"MLflow tracking server {redact_url(uri)} is not reachable: {reason}") from None


def cmd_run(args) -> int:
    from search.runner import run_study

    if args.workers < 1:
        raise LatentsweepError(f"--workers must be >= 1, got {args.workers}")
    spec = make_spec(args)
    _preflight(spec)
    print(f"study '{spec.name}': storage {redact_url(spec.storage.url)}, tracking {redact_url(spec.tracking_uri)}",
          file=sys.stderr)
    summary = run_study(spec, workers=args.workers)
    print(json.dumps({"study": spec.name, **summary}, default=str))
    return 0


def cmd_create(args) -> int:
    from search.runner import quiet_optuna
    from search.study import dispose_study, load_or_create
    from search.tracking import make_tracker

    quiet_optuna()
    sf = load_study_file(args.study)
    spec = make_spec(args, sf)
    _preflight(spec)
    study = load_or_create(sf, spec, make_tracker(spec.tracking_uri, spec.artifact_root), create=True)
    dispose_study(study)
    print(f"study '{spec.name}' ready in {redact_url(spec.storage.url)}")
    return 0


def cmd_worker(args) -> int:
    from search.runner import run_worker

    spec = make_spec(args)
    _preflight(spec)
    ran = run_worker(spec, create=False)
    print(json.dumps({"study": spec.name, "trials_run_by_this_worker": ran}))
    return 0


def cmd_reap(args) -> int:
    from search.runner import quiet_optuna, reap
    from search.study import dispose_study, load_or_create
    from search.tracking import make_tracker

    quiet_optuna()
    sf = load_study_file(args.study)
    spec = make_spec(args, sf)
    _check_stores(spec)
    tracker = make_tracker(spec.tracking_uri, spec.artifact_root)
    study = load_or_create(sf, spec, tracker, create=False)
    closed = reap(study, tracker)
    dispose_study(study)
    print(f"closed {len(closed)} stale MLflow run(s)")
    return 0


def cmd_status(args) -> int:
    from search.report import trials_table

    storage = args.storage or default_storage(state_dir(args.state_dir))
    table = trials_table(args.name, storage)
    if args.csv:
        table.to_csv(sys.stdout, index=False)
    else:
        print(table.to_string(index=False) if len(table) else f"study '{args.name}' has no trials yet")
    return 0
