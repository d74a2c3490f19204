"""Where a trial's seconds go: setup, training, validation, checkpoints, per-epoch store writes, the trial's start and
close (issue 33). Times are taken from OUTSIDE the code: the script wraps functions of the library (module globals and
methods) with time.perf_counter before running them, and nothing in the library is changed.

Two measurements, each repeated --repeats times in a fresh temp state directory:

* study: `latentsweep study run` of a study file (default studies/quickstart.toml, its epochs capped by --epochs) for
  --trials trials, in this process. Every wrapped call is timed under its caller, so the tree below the trial shows
  exclusive seconds (a part's own, its wrapped callees left out); "(rest)" rows are what no wrapped part covers.
* refit: `latentsweep.trainers.train.loop.train` of the study's [base] config with `data.split = "all"` for
--refit-epochs epochs, as
  the pick's refits run it (no validation: every epoch counts as the best one).

    python benchmarks/trial_costs.py [--data demo|PATH|synthetic:N_IMAGES] [--trials 3] [--epochs 4] [--repeats 2]
                                     [--refit-epochs 8] [--study FILE] [--json OUT]
    python benchmarks/trial_costs.py --smoke    # tests: tiny synthetic data (100 images, 32 -> 48) in a temp dir

`synthetic:N` writes N images x 5 captions at challenge dims (1024 -> 1536, trainers/data/synthetic.py) into the temp
dir.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Timers:
    """perf_counter timers keyed by their call path: (outer label, ..., label) -> [calls, exclusive s, inclusive s]."""

    def __init__(self):
        self.stack: list[list] = []  # [label, start, seconds of wrapped callees]
        self.rows: dict[tuple[str, ...], list] = defaultdict(lambda: [0, 0.0, 0.0])

    def wrap(self, label: str, fn):
        def timed(*args, **kwargs):
            path = tuple(f[0] for f in self.stack) + (label,)
            frame = [label, time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                took = time.perf_counter() - frame[1]
                self.stack.pop()
                if self.stack:
                    self.stack[-1][2] += took
                row = self.rows[path]
                row[0] += 1
                row[1] += took - frame[2]
                row[2] += took
        timed.__wrapped__ = fn
        return timed


@contextlib.contextmanager
def patched(timers: Timers, targets: list[tuple[object, str, str]]):
    """Replace each (owner, attribute) present with its timed wrapper; restore them all afterwards."""
    saved = []
    try:
        for owner, attr, label in targets:
            if owner is None or attr not in vars(owner):
                continue  # an older or newer checkout without that function
            original = vars(owner)[attr]
            fn = original.__func__ if isinstance(original, staticmethod) else original
            saved.append((owner, attr, original))
            setattr(owner, attr, timers.wrap(label, fn))
        yield
    finally:
        for owner, attr, original in reversed(saved):
            setattr(owner, attr, original)


def targets() -> list[tuple[object, str, str]]:
    """What is timed: the worker's per-trial calls, the trial's start/close, the loop's parts, the stores' calls."""
    import optuna
    import latentsweep.trainers.train.loop as loop
    import latentsweep.trainers.train.records as records
    from latentsweep.search.study import objective, runner, worker
    from latentsweep.search.tracking.mlflow import MlflowTracker
    from latentsweep.trainers.train.tasks import TASKS

    out = [
        (worker, "claim_trial", "claim_trial"), (worker, "close_dead_runs", "close_dead_runs"),
        (worker.Heartbeat, "__enter__", "heartbeat start"), (worker.Heartbeat, "__exit__", "heartbeat stop"),
        (objective.TrialRunner, "next_trial_fits", "next_trial_fits"), (optuna.Study, "tell", "study.tell"),
        (runner, "open_tracker", "study start: open tracker"), (runner, "load_or_create", "study start: load/create"),
        (runner, "load_train_shared", "study start: load data"), (runner, "finish", "study end: summary, figures"),
        (objective.TrialRunner, "run", "trial"), (objective, "train", "train"),
        (objective.TrialRunner, "start", "start"), (objective.TrialRunner, "_tags", "tags"),
        (MlflowTracker, "start_trial", "mlflow start_trial"), (MlflowTracker, "log_dataset", "mlflow log_dataset"),
        (loop, "train", "train"), (loop, "_train_epoch", "training"), (loop, "_val_loss", "validation (val loss)"),
        (loop, "build_model", "setup: model"), (loop, "build_optimizer", "setup: optimiser"),
        (loop, "_save_best", "checkpoint"), (loop, "atomic_torch_save", "torch.save+fsync"),
        (loop, "release_free_heap", "heap trim"), (records.EpochLog, "append", "metrics.csv"),
        (loop, "_copy_state", "best-state copy"),
        (objective.TrialRunner, "_report", "epoch report"), (MlflowTracker, "log", "mlflow log"),
        (optuna.trial.Trial, "report", "optuna report"), (optuna.trial.Trial, "set_user_attr", "optuna user attr"),
        (optuna.trial.Trial, "should_prune", "optuna should_prune"),
        (objective.TrialRunner, "search_end_now", "search_end_now"),
        (objective.TrialRunner, "_close", "close"), (MlflowTracker, "log_artifacts", "mlflow log_artifacts"),
        (objective, "rank_histogram", "rank figure (draw)"), (MlflowTracker, "log_figure", "mlflow log_figure"),
        (MlflowTracker, "end_trial", "mlflow end_trial"),
    ]
    for name in TASKS._items:  # every task's construction and validation
        cls = TASKS.get(name)
        out += [(cls, "__init__", "setup: task (data to device)"), (cls, "evaluate", "validation")]
    return out


@contextlib.contextmanager
def timed_deepcopy(timers: Timers):
    """The loop's `copy.deepcopy` (the best epoch's state, in the code before issue 33), timed in the loop only."""
    import copy
    import types

    import latentsweep.trainers.train.loop as loop

    if not hasattr(loop, "copy") or hasattr(loop, "_copy_state"):  # the newer code: _copy_state is timed
        yield
        return
    loop.copy = types.SimpleNamespace(deepcopy=timers.wrap("best-state copy", copy.deepcopy))
    try:
        yield
    finally:
        loop.copy = copy


def study_file_for(source: Path, epochs: int | None, out: Path) -> Path:
    """The study file with its epochs capped (and its [[enqueue]] recipes resolved from studies/)."""
    text = source.read_text()
    if epochs is not None:
        import re

        text = re.sub(r"(?m)^epochs\s*=\s*\d+", f"epochs = {epochs}", text)
    path = out / source.name
    path.write_text(text)
    return path


def run_study(study: Path, data: str, trials: int, work: Path, timers: Timers, tracking: str | None) -> float:
    from latentsweep.search.cli.main import main as cli

    args = ["study", "run", str(study), "--state-dir", str(work / "state"), "--n-trials", str(trials), "--quiet",
            "--data", data, *(["--tracking-uri", tracking] if tracking else [])]
    start = time.perf_counter()
    with patched(timers, targets()), timed_deepcopy(timers), contextlib.redirect_stdout(sys.stderr):
        rc = cli(args)
    if rc != 0:
        raise SystemExit(f"study run failed ({rc})")
    return time.perf_counter() - start


def run_refit(study: Path, data: str, epochs: int, work: Path, timers: Timers) -> float:
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.trainers.config.tree import with_values
    from latentsweep.trainers.data.sets import load_train
    import latentsweep.trainers.train.loop as loop

    cfg = with_values(load_study_file(study).base, {"data.split": "all", "train.stop_after": epochs,
                                                    "train.epochs": epochs, "data.path": data})
    train_set = load_train(data)
    start = time.perf_counter()
    with patched(timers, targets()), timed_deepcopy(timers):
        loop.train(cfg, train_set, out_dir=work / "refit")
    return time.perf_counter() - start


def epochs_of(work: Path) -> int:
    """Epochs trained by the study's trials (rows of their metrics.csv)."""
    return sum(max(0, len(p.read_text().splitlines()) - 1) for p in work.glob("state/studies/*/trial-*/metrics.csv"))


def table(results: list[dict], per: str) -> list[str]:
    """One row per call path: calls and exclusive seconds per repeat (median, min), per trial/epoch."""
    paths = sorted({p for r in results for p in r["rows"]})
    lines = [f"{'part (exclusive seconds; indented under its caller)':62s} {'calls':>6s} {'median s':>9s} "
             f"{'min s':>8s} {'per ' + per:>10s} {'per epoch':>10s}"]
    for path in paths:
        rows = [r["rows"].get(path, [0, 0.0, 0.0]) for r in results]
        excl = [row[1] for row in rows]
        count = statistics.median(r[per + "s"] for r in results) or 1
        epochs = statistics.median(r["epochs"] for r in results) or 1
        lines.append(f"{'  ' * (len(path) - 1) + path[-1]:62s} {rows[0][0]:6d} {statistics.median(excl):9.3f} "
                     f"{min(excl):8.3f} {statistics.median(excl) / count:10.4f} "
                     f"{statistics.median(excl) / epochs:10.4f}")
    return lines


def measure(args, work_root: Path) -> dict:
    data = args.data
    if data == "demo":
        from latentsweep.trainers.data.demo import default_train_path

        data = str(default_train_path())
    elif data.startswith("synthetic:"):
        from latentsweep.trainers.data.synthetic import write_synthetic

        data = str(write_synthetic(work_root / "data", int(data.split(":", 1)[1]), dim_text=1024,
                                   dim_image=1536)[0])
    study = study_file_for(Path(args.study), args.epochs, work_root)
    out = {"data": data, "study": [], "refit": []}
    for repeat in range(args.repeats):
        work = work_root / f"study-{repeat}"
        timers = Timers()
        if args.trials:
            wall = run_study(study, data, args.trials, work, timers, args.tracking_uri)
            out["study"].append({"wall_s": wall, "trials": args.trials, "epochs": epochs_of(work),
                                 "rows": dict(timers.rows)})
        if args.refit_epochs:
            timers = Timers()
            wall = run_refit(study, data, args.refit_epochs, work_root / f"refit-{repeat}", timers)
            out["refit"].append({"wall_s": wall, "epochs": args.refit_epochs, "rows": dict(timers.rows)})
    return out


def report(out: dict) -> None:
    print(f"data: {out['data']}")
    for kind, per in (("study", "trial"), ("refit", "epoch")):
        results = out[kind]
        if not results:
            continue
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in results)
        print(f"\n{kind}: {len(results)} repeats, wall s {walls}; "
              + (f"{results[0]['trials']} trials, {results[0]['epochs']} epochs trained"
                 if kind == "study" else f"{results[0]['epochs']} epochs"))
        for line in table(results, per):
            print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default="demo", help="demo (default), a train.npz, or synthetic:N_IMAGES")
    parser.add_argument("--study", default=str(ROOT / "studies" / "quickstart.toml"), help="study file")
    parser.add_argument("--trials", type=int, default=3, help="trials per repeat (default 3; 0: the refit only)")
    parser.add_argument("--epochs", type=int, default=4, help="cap of the study's epochs (default 4; 0: as is)")
    parser.add_argument("--repeats", type=int, default=2, help="repeats, each in a fresh state dir (default 2)")
    parser.add_argument("--refit-epochs", type=int, default=8, help="epochs of the refit measurement (0: none)")
    parser.add_argument("--tracking-uri", help="MLflow tracking URI (default: sqlite in the temp state dir; "
                                               "memory: no MLflow)")
    parser.add_argument("--json", help="also write the measurements here")
    parser.add_argument("--smoke", action="store_true", help="a few seconds on tiny synthetic data (tests)")
    args = parser.parse_args(argv)
    if args.epochs == 0:
        args.epochs = None
    with tempfile.TemporaryDirectory(prefix="trial-costs-") as tmp:
        if args.smoke:
            from latentsweep.trainers.data.synthetic import write_synthetic

            args.data = str(write_synthetic(Path(tmp) / "data", 100, dim_text=32, dim_image=48)[0])
            args.trials, args.epochs, args.repeats, args.refit_epochs = 1, 2, 1, 2
            args.tracking_uri = "memory"  # MLflow's first schema migration alone takes 10+ s
        out = measure(args, Path(tmp))
    report(out)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {k: v if k == "data" else [{**r, "rows": {" / ".join(p): row for p, row in r["rows"].items()}}
                                      for r in v] for k, v in out.items()}, indent=1))
    if args.smoke:
        trial = [r for r in out["study"][0]["rows"] if r[-1] == "trial"]
        assert trial and out["refit"], "smoke: no trial or refit was timed"
        print("smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
