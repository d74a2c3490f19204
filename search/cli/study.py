"""`latentsweep study run|create` and `latentsweep worker`: launching and joining studies from a study file (`list`,
`status` and `reap`, which address a study by name, are in latentsweep.search.cli.study_inspect)."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

from latentsweep.search.cli import presets, study_inspect
from latentsweep.search.cli.study_inspect import liveness_args, stores_args
from latentsweep.search.study.devices import (
    GPUS_ENV, PER_GPU_ENV, WorkerPlan, claim_slot, count_arg, describe_plan, pin_process, plan_workers_env,
    workers_arg,
)
from latentsweep.search.study.preflight import no_new_empty_state_dir, preflight
from latentsweep.search.study.progress import is_terminal
from latentsweep.search.study.runner import close_parent_if_idle, run_study, run_worker
from latentsweep.search.study.spec import build_spec
from latentsweep.search.redact import redact_url
from latentsweep.search.study.studyfile import load_study_file
from latentsweep.search.study.worker import dispose_study, load_or_create, open_tracker


def _common(p) -> None:
    p.add_argument("study", help="study TOML file, or a preset's name (latentsweep study presets)")
    p.add_argument("--data", help="train npz (default: the study's data.path, else the bundled demo)")
    p.add_argument("--n-trials", type=int, help="total finished trials of the study (default: the file's)")
    p.add_argument("--timeout", type=float, help="stop starting trials after this many seconds")
    p.add_argument("--name", help="study name (default: the file's study.name)")
    stores_args(p)
    liveness_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars (the one line per trial stays)")
    p.add_argument("--verbose", action="store_true",
                   help="also one line per epoch when stderr is not a terminal (a terminal shows an epoch bar)")


def add_parser(sub) -> None:
    study = sub.add_parser("study", help="run and inspect Optuna studies")
    ssub = study.add_subparsers(dest="study_cmd", metavar="ACTION")
    ssub.required = True
    run = ssub.add_parser("run", help="create or resume a study and run trials on this machine")
    _common(run)
    add_worker_args(run)
    warm_args(run)
    run.set_defaults(func=cmd_study_run)
    create = ssub.add_parser("create", help="create a study (and its MLflow parent run) without running trials")
    _common(create)
    warm_args(create)
    create.set_defaults(func=cmd_study_create)
    study_inspect.add_actions(ssub)
    presets.add_actions(ssub)
    worker = sub.add_parser("worker", help="join an existing study as one worker (any machine)")
    _common(worker)
    gpu_args(worker, "this worker takes the first free slot of GPUs x --per-gpu (a lock in the state directory) "
                     "and sees that GPU alone (its cuda:0)")
    worker.set_defaults(func=cmd_worker)


def add_worker_args(p) -> None:
    """--workers, --gpus and --per-gpu of the commands that start local workers (`study run`, `run`)."""
    p.add_argument("--workers", type=workers_arg,
                   help="worker processes on this machine: a number, or auto (every GPU slot: GPUs x --per-gpu; "
                        "without GPUs one per 2 cores) (default: one per GPU on a CUDA machine, else 1)")
    gpu_args(p, "each worker sees one GPU (its cuda:0)")


def warm_args(p) -> None:
    """--no-warm-start and --warm-from (latentsweep.search.study.warm): what a new study tries first."""
    p.add_argument("--no-warm-start", dest="warm_start", action="store_false", default=None,
                   help="a new study does not first try the best configurations of earlier studies on the same data "
                        "(nor the bundled portfolio when there are none)")
    p.add_argument("--warm-from", action="append", default=[], metavar="STATE_DIR|URL",
                   help="also look for earlier studies on the same data there (repeatable)")


def gpu_args(p, each: str) -> None:
    """--gpus and --per-gpu; their defaults come from the environment (how compose's worker replicas get them)."""
    p.add_argument("--gpus", metavar="LIST", default=None,
                   help=f"GPUs the workers share: all, or numbers such as 0,1; {each} (default ${GPUS_ENV}, else "
                        f"none: nothing pinned)")
    p.add_argument("--per-gpu", type=count_arg, metavar="M", default=None,
                   help=f"workers per GPU of --gpus (default ${PER_GPU_ENV}, else 1)")
    p.add_argument("--population", type=workers_arg, default=1, metavar="N|auto",
                   help="trials each worker trains side by side, each its own trial and run (default 1; auto: sized "
                        "on the worker's GPU, 1 on a CPU)")


def worker_plan(args) -> WorkerPlan:
    """The local workers of --workers/--gpus/--per-gpu, checked against this machine before anything is stored."""
    return plan_workers_env(args.workers, args.gpus, args.per_gpu)


def make_spec(args, study_file=None, plan: WorkerPlan | None = None):
    """RunSpec from CLI arguments, the study file, the state-directory defaults and the local workers' GPUs."""
    spec = build_spec(study_file or load_study_file(args.study), data=getattr(args, "data", None),
                      n_trials=getattr(args, "n_trials", None), timeout=getattr(args, "timeout", None),
                      name=args.name, state=args.state_dir, storage=args.storage, tracking_uri=args.tracking_uri,
                      artifact_root=args.artifact_root, heartbeat=args.heartbeat, grace=args.grace,
                      progress=not args.quiet and is_terminal(), verbose=args.verbose,
                      population=getattr(args, "population", 1),
                      warm_start=getattr(args, "warm_start", None), warm_from=tuple(getattr(args, "warm_from", ())))
    return spec if plan is None else replace(spec, gpus=plan.gpus, per_gpu=plan.per_gpu)


def cmd_study_run(args) -> int:
    plan = worker_plan(args)
    with no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args, plan=plan)
        preflight(spec)
    say_plan(plan, spec)
    print(f"study '{spec.name}': storage {redact_url(spec.storage.url)}, tracking {redact_url(spec.tracking_uri)}",
          file=sys.stderr)
    summary = run_study(spec, workers=plan.workers)
    print(json.dumps({"study": spec.name, **summary}, default=str))
    return 0


def say_plan(plan: WorkerPlan, spec, slot: str | None = None) -> None:
    if line := describe_plan(plan, spec.population, slot):  # GPUs, workers and population: what is used, one line
        print(line, file=sys.stderr)


def cmd_study_create(args) -> int:
    study_file = load_study_file(args.study)
    with no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args, study_file)
        preflight(spec)
    tracker = open_tracker(spec)
    study = load_or_create(study_file, spec, tracker, create=True)
    try:
        close_parent_if_idle(study, tracker)  # no trial runs yet: its MLflow parent run is not left RUNNING
    finally:
        dispose_study(study)
    print(f"study '{spec.name}' ready in {redact_url(spec.storage.url)}")
    return 0


def cmd_worker(args) -> int:
    plan = plan_workers_env(1, args.gpus, args.per_gpu)
    with no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args, plan=plan)
        preflight(spec)  # with --gpus it asks CUDA nothing: the slot is pinned first, below
    pin_process(slot := claim_slot(spec.gpus, spec.per_gpu, Path(spec.state_dir) / "gpu-slots"))
    say_plan(plan, spec, slot)
    ran = run_worker(spec, create=False)
    print(json.dumps({"study": spec.name, "trials_run_by_this_worker": ran}))
    return 0


