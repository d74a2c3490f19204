"""`latentsweep study run|create|list|status|reap` and `latentsweep worker`: launching, joining and inspecting studies.

`run`, `create` and `worker` read a study file; `list`, `status` and `reap` address a study by name in the state
directory's stores (or --storage / --tracking-uri), like `pick`."""
from __future__ import annotations

import base64
import contextlib
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from types import SimpleNamespace

from search.stores import add_state_arg, check_artifact_root, resolve_stores, safe_name, state_dir
from search.study.progress import is_terminal
from search.study.report import load_existing_study, studies_table, study_header, study_table
from search.study.runner import reap, run_study, run_worker
from search.study.storage import (
    StorageSettings, dispose, open_storage, probe_tracking_store, redact_url, tracking_has_experiment,
)
from search.study.studyfile import load_study_file, resolve_data_path
from search.study.worker import PARENT_ATTR, RunSpec, check_existing, dispose_study, load_or_create, open_tracker
from search.tracking import make_tracker
from search.tracking.base import DB_SCHEMES, default_artifact_root
from trainers.config import with_values
from trainers.data import load_train
from trainers.errors import LatentsweepError, closest
from trainers.loop import resolve_device
from trainers.tasks import TASKS, check_split
from trainers.validate import validate

# Seconds to wait for an http(s) MLflow tracking server's first answer before calling it unreachable.
TRACKING_PROBE_TIMEOUT_S = 15


def _common(p) -> None:
    p.add_argument("study", help="study TOML file")
    p.add_argument("--data", help="train npz (default: the study's data.path, else the bundled demo)")
    p.add_argument("--n-trials", type=int, help="total finished trials of the study (default: the file's)")
    p.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    p.add_argument("--name", help="study name (default: the file's study.name)")
    _stores(p)
    _liveness(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars (the one line per trial stays)")
    p.add_argument("--verbose", action="store_true",
                   help="also one line per epoch when stderr is not a terminal (a terminal shows an epoch bar)")


def _stores(p, tracking: bool = True) -> None:
    p.add_argument("--storage", help="Optuna storage URL (default: sqlite under the state directory)")
    if tracking:
        p.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite under the state directory)")
        p.add_argument("--artifact-root", help="where a new MLflow experiment stores artifacts (a path or URI; "
                                               "default: STATE/artifacts for the default tracking URI, else the "
                                               "server's)")
    add_state_arg(p)


def _liveness(p) -> None:
    p.add_argument("--heartbeat", type=int, default=60,
                   help="seconds between a running trial's heartbeats (default 60, for minute-long trials)")
    p.add_argument("--grace", type=int, default=180,
                   help="seconds without heartbeat before a trial is dead and retried (default 180: 3 missed beats)")


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
    listing = ssub.add_parser("list", help="the studies in the storage: trials by state, best value")
    _stores(listing, tracking=False)
    listing.add_argument("--csv", action="store_true", help="print the raw table as CSV")
    listing.set_defaults(func=cmd_list)
    status = ssub.add_parser("status", help="a study's counts and best value, then its trials, best first")
    status.add_argument("name", help="study name")
    _stores(status, tracking=False)
    status.add_argument("--csv", action="store_true", help="print the raw table as CSV (no header line)")
    status.set_defaults(func=cmd_status)
    reap = ssub.add_parser("reap", help="fail trials of dead workers (they are retried) and close their MLflow runs")
    reap.add_argument("name", help="study name (a study file's name is taken from it)")
    _stores(reap)
    _liveness(reap)
    reap.set_defaults(func=cmd_reap)
    worker = sub.add_parser("worker", help="join an existing study as one worker (any machine)")
    _common(worker)
    worker.set_defaults(func=cmd_worker)


def _check_liveness(args) -> None:
    if args.heartbeat < 1 or args.grace <= args.heartbeat:
        # a grace period within one beat would declare live trials dead (they would then run twice)
        raise LatentsweepError(f"--grace ({args.grace} s) must be longer than --heartbeat ({args.heartbeat} s), "
                               f"and --heartbeat at least 1 s")



def make_spec(args, study_file=None):
    """RunSpec from CLI arguments, the study file and the state-directory defaults."""
    _check_liveness(args)
    n_trials, timeout = getattr(args, "n_trials", None), getattr(args, "timeout", None)
    if n_trials is not None and n_trials < 1:  # 0 must not fall back to the file's value
        raise LatentsweepError(f"--n-trials must be >= 1, got {n_trials}")
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        raise LatentsweepError(f"--timeout must be a positive number of seconds, got {timeout}")
    name = safe_name(args.name, "--name") if args.name is not None else None
    study_file = study_file or load_study_file(args.study)
    stores = resolve_stores(state_dir(args.state_dir), args.storage, args.tracking_uri, args.artifact_root)
    data = resolve_data_path(getattr(args, "data", None) or study_file.base.data.path)
    return RunSpec(
        study_file=str(study_file.path), name=name or study_file.name,
        storage=StorageSettings(stores.storage, args.heartbeat, args.grace),
        tracking_uri=stores.tracking_uri, artifact_root=stores.artifact_root,
        state_dir=str(stores.root), data_path=str(data),
        n_trials=n_trials if n_trials is not None else study_file.n_trials,
        timeout=timeout if timeout is not None else study_file.timeout, progress=not args.quiet and is_terminal(),
        verbose=args.verbose,
    )


def _preflight(spec) -> None:
    """Fail before any trial, with everything that can be known then: the base config validates on this machine,
    the data loads and splits, the objective is a logged metric, both stores answer, and a stored study of that
    name agrees with the file (direction, distributions of its knobs)."""
    study_file = load_study_file(spec.study_file)
    validate(study_file.base)
    resolve_device(study_file.base.train.device)
    keys = TASKS.get(study_file.base.data.task).val_keys(study_file.base)
    if study_file.objective not in keys:
        raise LatentsweepError(f"{study_file.path}: study.objective '{study_file.objective}' is not a metric task "
                               f"'{study_file.base.data.task}' logs{closest(study_file.objective, keys)}; "
                               f"valid: {', '.join(keys)}")
    check_split(with_values(study_file.base, {"data.path": spec.data_path}), load_train(spec.data_path))
    _check_stores(spec)
    check_existing(study_file, spec)


def _check_stores(spec) -> None:
    """One-line errors, before anything is written to either store (no study without its MLflow parent run).

    The Optuna storage is opened once; an http(s) MLflow server is probed with one short request, because the
    MLflow client retries an unreachable server for minutes and then ends in a traceback.
    """
    if spec.tracking_uri.startswith(("http://", "https://")):
        _probe_tracking_server(spec.tracking_uri)  # first: it writes nothing, while opening SQLite creates the file
    else:
        probe_tracking_store(spec.tracking_uri)
    if spec.artifact_root:
        check_artifact_root(spec.artifact_root)
    else:
        _check_artifact_root_needed(spec)
    dispose(open_storage(spec.storage))


def _check_artifact_root_needed(spec) -> None:
    """A database tracking store needs an artifact root to create the study's experiment (else MLflow would use
    ./mlruns of whichever process creates it): said now, before the Optuna study is created, not after."""
    url = spec.tracking_uri
    if url.split(":", 1)[0].split("+")[0] not in DB_SCHEMES or default_artifact_root(url) is not None:
        return  # not a database, or SQLite: the tracker keeps artifacts beside its file
    if not tracking_has_experiment(url, spec.name):
        raise LatentsweepError(f"MLflow tracking URI {redact_url(url)} is a database and has no experiment "
                               f"'{spec.name}' yet: an artifact root is required (--artifact-root)")


def _probe_tracking_server(uri: str) -> None:
    """One short request that an MLflow server answers with JSON. Credentials in the URI go in a Basic auth header
    (urllib cannot open a URL with user:password@); a 401/403 still proves a server answers."""
    parts = urllib.parse.urlsplit(uri.rstrip("/"))
    bare = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
    request = urllib.request.Request(bare + "/api/2.0/mlflow/experiments/search?max_results=1")
    if parts.username is not None:
        pair = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        request.add_header("Authorization", "Basic " + base64.b64encode(pair.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=TRACKING_PROBE_TIMEOUT_S) as response:
            body = response.read(1 << 20)
    except urllib.error.HTTPError as exc:
        text = exc.read(200).decode("utf-8", "replace")
        if exc.code == 403 and "Host header" in text:
            raise LatentsweepError(f"MLflow tracking server {redact_url(uri)} refused the Host header "
                                   f"'{parts.hostname}': start it with --allowed-hosts including that name") from None
        if exc.code in (404, 405):  # MLflow serves this endpoint: whatever answered is something else
            raise LatentsweepError(f"{redact_url(uri)} answers but is not an MLflow tracking server (HTTP {exc.code} "
                                   f"for its experiments API)") from None
        return  # it answered (e.g. 401 without credentials): reachable, and the MLflow client does the rest
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise LatentsweepError(f"MLflow tracking server {redact_url(uri)} is not reachable: {reason}") from None
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not isinstance(answer, dict):
        raise LatentsweepError(f"{redact_url(uri)} answers but is not an MLflow tracking server (its experiments API "
                               f"did not return JSON)")


@contextlib.contextmanager
def _no_new_empty_state_dir(arg):
    """A command rejected by its checks leaves no empty state directory behind (it was made only to be checked)."""
    path = state_dir(arg, create=False)
    existed = path.exists()
    try:
        yield
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):  # not empty: a store was opened, keep it
                (path / ".write-probe").unlink(missing_ok=True)
                path.rmdir()
        raise


def cmd_run(args) -> int:
    if args.workers < 1:
        raise LatentsweepError(f"--workers must be >= 1, got {args.workers}")
    with _no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args)
        _preflight(spec)
    print(f"study '{spec.name}': storage {redact_url(spec.storage.url)}, tracking {redact_url(spec.tracking_uri)}",
          file=sys.stderr)
    summary = run_study(spec, workers=args.workers)
    print(json.dumps({"study": spec.name, **summary}, default=str))
    return 0


def cmd_create(args) -> int:
    study_file = load_study_file(args.study)
    with _no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args, study_file)
        _preflight(spec)
    study = load_or_create(study_file, spec, open_tracker(spec), create=True)
    dispose_study(study)
    print(f"study '{spec.name}' ready in {redact_url(spec.storage.url)}")
    return 0


def cmd_worker(args) -> int:
    with _no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args)
        _preflight(spec)
    ran = run_worker(spec, create=False)
    print(json.dumps({"study": spec.name, "trials_run_by_this_worker": ran}))
    return 0


def cmd_reap(args) -> int:
    """Reap the study `name`: the storage's stale-trial rule is --heartbeat/--grace, its runs are in --tracking-uri."""
    _check_liveness(args)
    name = args.name
    if name.endswith(".toml"):  # a study file names its study (and is checked like in every other command)
        name = load_study_file(name).name
    name = safe_name(name, "study name")
    stores = resolve_stores(state_dir(args.state_dir), args.storage, args.tracking_uri, args.artifact_root)
    storage = StorageSettings(stores.storage, args.heartbeat, args.grace)
    _check_stores(SimpleNamespace(storage=storage, tracking_uri=stores.tracking_uri,
                                  artifact_root=stores.artifact_root))
    study = load_existing_study(name, storage.url, args.heartbeat, args.grace)
    try:
        parent = study.user_attrs.get(PARENT_ATTR)
        if not parent:
            raise LatentsweepError(f"study '{name}' has no MLflow parent run recorded")
        tracker = make_tracker(stores.tracking_uri, stores.artifact_root)
        tracker.attach_study(name, parent, reopen=False)  # reaping never reopens a finished run
        closed = reap(study, tracker)
    finally:
        dispose_study(study)
    print(f"closed {len(closed)} stale MLflow run(s)")
    return 0


def cmd_status(args) -> int:
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


def cmd_list(args) -> int:
    storage = resolve_stores(state_dir(args.state_dir, create=False), args.storage, read_only=True).storage
    table = studies_table(storage)
    if args.csv:
        table.to_csv(sys.stdout, index=False)
    elif len(table):
        print(table.to_string(index=False, na_rep="-", float_format=lambda v: f"{v:.4f}"))
    else:
        print(f"no studies in {redact_url(storage)}")
    return 0
