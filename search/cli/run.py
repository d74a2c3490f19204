"""`latentsweep run STUDY.toml --time 30m`: search and pick within one wall-clock budget, ending with the submission,
the MLflow runs and the registered model."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from latentsweep.search.cli.pick import print_result
from latentsweep.search.cli.study import add_worker_args, make_spec, say_plan, warm_args, worker_plan
from latentsweep.search.cli.study_inspect import liveness_args, stores_args
from latentsweep.search.checks import check_device_option, check_outputs
from latentsweep.search.pick.candidates import test_path_for
from latentsweep.search.pick.options import out_path, pick_files, pick_outputs
from latentsweep.search.pick.onebudget import check_pick_inputs, parse_duration, run_one_budget
from latentsweep.search.pick.picker import PickOptions
from latentsweep.search.stores import protected_paths, safe_name
from latentsweep.search.study.preflight import no_new_empty_state_dir, preflight
from latentsweep.search.redact import redact_url
from latentsweep.trainers.data.sets import load_test_shared
from latentsweep.trainers.core.progress import say


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="search and pick within one time budget: the submission, MLflow runs and a "
                                   "registered model at the end")
    p.add_argument("study", help="study TOML file")
    p.add_argument("--time", required=True, help="the whole job's wall-clock budget: 30m, 1h30m, 900s or 900")
    p.add_argument("--data", help="train npz (default: the study's data.path, else the bundled demo)")
    p.add_argument("--test", help="test.clean.npz (default: the demo test for the demo data, else the one beside "
                                  "--data)")
    p.add_argument("--out", help="submission CSV (default: STATE_DIR/picks/<study>/submission.csv)")
    p.add_argument("--register", metavar="NAME", help="Model Registry name (default: the study's name)")
    p.add_argument("--name", help="study name (default: the file's study.name)")
    p.add_argument("--n-trials", type=int, help="the search also ends after this many finished trials (default: the "
                                                "file's n_trials)")
    add_worker_args(p)
    warm_args(p)
    p.add_argument("--device", default=PickOptions.device, help="the pick's device: auto | cpu | cuda | cuda:N")
    stores_args(p)
    liveness_args(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars (the one line per trial and job stays)")
    p.add_argument("--verbose", action="store_true", help="also one line per epoch when stderr is not a terminal")
    p.set_defaults(func=cmd_run)


def check_run_files(spec, args) -> None:
    """Before a store is opened: the test file loads (finite float embeddings), the pick's device exists, and the
    submission, with the pick's manifest and report beside it, replaces no input and nothing the state needs."""
    test = test_path_for(Path(spec.data_path), args.test)
    load_test_shared(test)  # read once: the floor, the keeper and the pick use this copy
    check_device_option("--device", args.device)  # the pick's device, before preflight writes the stores' files
    out = out_path(PickOptions(study=safe_name(spec.name), out=args.out), Path(spec.state_dir))
    check_outputs("--out", pick_outputs(args.out, out), {"STUDY": spec.study_file, "--data": spec.data_path,
                                                         "--test": test},
                  protected_paths(Path(spec.state_dir), spec.storage.url, spec.tracking_uri, spec.artifact_root))


def keep_earlier(out: Path) -> None:
    """An earlier job's submission at --out, with its manifest and report, is moved aside (NAME.earlier.*) and said:
    this job's answers replace only its own, and what lies beside a submission is always from the job that wrote it
    (the manifest and report move first: killed midway, no manifest is left beside another job's submission)."""
    earlier = out.with_name(f"{out.stem}.earlier{out.suffix}")
    moved = [(now, then) for now, then in zip(pick_files(out)[::-1], pick_files(earlier)[::-1]) if now.exists()]
    for now, then in moved:
        os.replace(now, then)
    if moved:
        say(f"latentsweep: an earlier submission at {out} was kept aside as {earlier} (with its manifest and report)")


def cmd_run(args) -> int:
    started = getattr(args, "started", None) or time.monotonic()  # set by latentsweep.search.cli.main at its start
    total = parse_duration(args.time)
    plan = worker_plan(args)  # --workers/--gpus/--per-gpu, checked against this machine before anything is stored
    args.timeout = None  # the budget is the bound
    with no_new_empty_state_dir(args.state_dir):
        spec = make_spec(args, plan=plan)
        check_run_files(spec, args)  # before preflight opens a store
        preflight(spec)
        pick = check_pick_inputs(PickOptions(
            study=safe_name(spec.name), state_dir=spec.state_dir, storage=spec.storage.url,
            tracking_uri=spec.tracking_uri, data=spec.data_path, test=args.test, out=args.out,
            register=args.register or spec.name, device=args.device, progress=spec.progress), spec.data_path)
    say_plan(plan, spec)
    print(f"study '{spec.name}': storage {redact_url(spec.storage.url)}, tracking {redact_url(spec.tracking_uri)}",
          file=sys.stderr)
    keep_earlier(Path(pick.out))
    done = run_one_budget(spec, total, pick, plan.workers, started)
    print(json.dumps({"study": spec.name, **done.summary}, default=str))
    if done.pick is not None:
        print_result(done.pick)
    else:
        print(f"submission: {done.answer.path} ({done.answer.source})")
    wall = time.monotonic() - started
    print(f"wall time {wall:.0f} s of {total:.0f} s" + (f": over by {done.overrun_s:.0f} s, first in "
                                                       f"{done.overrun_in}" if done.overrun_s > 0 else ""))
    return 0

