"""Search efficiency on the demo data at equal wall-clock budget: TPE + median pruning vs random search without pruning
vs the study's seed recipe alone. Reports the best val/mrr each reaches and the time each needs to reach the recipe's.

    python benchmarks/search_efficiency.py [--study studies/quickstart.toml] [--budget 600] [--epochs 8]
    python benchmarks/search_efficiency.py --smoke    # 1 epoch, 3 s per arm on tiny synthetic data, then --summary

Both searches run the same space (the study file's [space]) with nothing enqueued, one worker, real SQLite Optuna
storage and an in-memory tracker (MLflow overhead would be the same for both and is not what is compared).

`--summary STATE_DIR [--name full] [--budget 900]` instead reads a study already run with the CLI
(`latentsweep study run studies/full.toml --timeout 900 --state-dir STATE_DIR`) and prints its trials
complete/pruned/failed and the best value within the budget, enqueued recipes and searched trials apart.

`full` study, 15 minutes on the 2-core machine (`--timeout 900`), both runs UNDER LOAD (5-6 other processes
training on the same 2 cores, load average 7-12), so absolute counts are several times below a quiet machine's:

| full.toml | trials complete / pruned / failed | best recipe | best searched trial |
|---|---|---|---|
| before (ASHA, 20 random startup trials, recipes 20-30 epochs, vsepp first) | 0 / 0 / 0 (first recipe at epoch 13 of
30) | none finished (0.060 at epoch 13) | none started |
| after (see README) | AFTER_COUNTS | AFTER_RECIPE | AFTER_SEARCHED |
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Optuna, torch and the project's modules are imported where they are used: --help answers without them

ARMS = {
    "tpe+median": ({"name": "tpe", "seed": 0, "n_startup_trials": 5},
                   {"name": "median", "n_startup_trials": 3, "n_warmup_steps": 2}),
    "random, no pruning": ({"name": "random", "seed": 0}, {"name": "none"}),
}


def run_arm(study_file, name: str, sampler: dict, pruner: dict, data, data_path: str, budget: float,
            root: Path) -> list:
    """Run a search for `budget` seconds; returns [(seconds since start, running best)] at each finished trial."""
    import optuna

    from latentsweep.search.study.objective import TrialRunner
    from latentsweep.search.study.storage import StorageSettings
    from latentsweep.search.study.worker import RunSpec, load_or_create, worker_loop
    from latentsweep.search.tracking.memory import InMemoryTracker

    arm_study_file = dataclasses.replace(study_file, name=name, sampler=sampler, pruner=pruner, enqueue=())
    spec = RunSpec(study_file=str(study_file.path), name=name,
                   storage=StorageSettings(f"sqlite:///{root / 'optuna.db'}"),
                   tracking_uri="memory", artifact_root=None, state_dir=str(root), data_path=data_path,
                   n_trials=10_000, timeout=budget, threads=0, progress=False)
    tracker = InMemoryTracker()
    study = load_or_create(arm_study_file, spec, tracker)
    runner = TrialRunner(arm_study_file, spec, data, tracker, root / name)
    start, curve, best = time.monotonic(), [], -1.0

    def on_trial(frozen: optuna.trial.FrozenTrial) -> None:
        nonlocal best
        if frozen.state == optuna.trial.TrialState.COMPLETE:
            best = max(best, frozen.value)
        curve.append((time.monotonic() - start, best, frozen.state.name))

    worker_loop(arm_study_file, spec, study, runner, on_trial=on_trial)
    return curve


def time_to_reach(curve: list, target: float) -> float | None:
    return next((t for t, best, _ in curve if best >= target), None)


def summarize(state_dir: str, name: str, budget: float) -> int:
    """Counts and best values of a CLI-run study within `budget` seconds of its first trial's start."""
    import optuna

    storage = f"sqlite:///{Path(state_dir) / 'optuna.db'}"
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    started = [t.datetime_start for t in trials if t.datetime_start is not None]
    if not started:
        print(f"study '{name}': no trial started")
        return 1
    origin = min(started)
    within = [t for t in trials if t.datetime_complete is not None
              and (t.datetime_complete - origin).total_seconds() <= budget]
    counts = {state: sum(t.state.name == state for t in within) for state in ("COMPLETE", "PRUNED", "FAIL")}
    best: dict[bool, tuple[float, int] | None] = {True: None, False: None}
    for t in within:
        if t.state.name == "COMPLETE":
            enqueued = bool(t.user_attrs.get("latentsweep.enqueued"))
            if best[enqueued] is None or t.value > best[enqueued][0]:
                best[enqueued] = (t.value, t.number)
    unfinished = [t for t in trials if t not in within and t.datetime_start is not None]
    show = {k: "none" if v is None else f"{v[0]:.4f} (trial {v[1]})" for k, v in best.items()}
    print(f"study '{name}', first {budget:.0f} s: {counts['COMPLETE']} complete / {counts['PRUNED']} pruned / "
          f"{counts['FAIL']} failed ({len(unfinished)} more started, finished later or not at all)")
    print(f"best enqueued recipe: {show[True]}; best searched trial: {show[False]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--summary", metavar="STATE_DIR", help="summarise a study run with the CLI instead")
    parser.add_argument("--name", default="full", help="study name for --summary")
    parser.add_argument("--study", default=str(ROOT / "studies" / "quickstart.toml"))
    parser.add_argument("--budget", type=float, default=600.0, help="seconds per search arm")
    parser.add_argument("--epochs", type=int, help="override the base config's epochs")
    parser.add_argument("--data", default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="1 epoch, 3 s per arm on tiny synthetic data (a temp dir), then --summary of one arm")
    args = parser.parse_args(argv)
    if args.summary:
        return summarize(args.summary, args.name, args.budget)
    from latentsweep.search.process import quiet_optuna

    quiet_optuna()
    if args.smoke:
        from latentsweep.trainers.data.synthetic import write_synthetic

        with tempfile.TemporaryDirectory(prefix="search-efficiency-smoke-") as tmp:
            args.epochs, args.budget = 1, 3.0
            args.data = str(write_synthetic(Path(tmp) / "data", 100, dim_text=32, dim_image=48)[0])
            compare(args, Path(tmp) / "state")
            return summarize(str(Path(tmp) / "state"), "tpe-median", args.budget)
    with tempfile.TemporaryDirectory() as tmp:
        return compare(args, Path(tmp))


def compare(args: argparse.Namespace, state: Path) -> int:
    """The recipe alone, then each arm for args.budget seconds with its state in `state`; prints the table."""
    from latentsweep.search.study.studyfile import load_study_file, resolve_data_path
    from latentsweep.trainers.config.tree import with_values
    from latentsweep.trainers.data.sets import load_train
    from latentsweep.trainers.train.loop import train

    state.mkdir(parents=True, exist_ok=True)
    study_file = load_study_file(args.study)
    if args.epochs:
        study_file = dataclasses.replace(study_file, base=with_values(study_file.base, {"train.epochs": args.epochs}))
    data_path = str(resolve_data_path(args.data or study_file.base.data.path))
    data = load_train(data_path)
    start = time.monotonic()
    recipe = train(study_file.base, data).best_metrics["val/mrr"]
    recipe_s = time.monotonic() - start
    print(f"recipe alone ({study_file.path.name} [base]): val/mrr {recipe:.4f} in {recipe_s:.0f} s", flush=True)
    curves = {name: run_arm(study_file, name.replace(" ", "").replace(",", "-").replace("+", "-"), s, p, data,
                            data_path, args.budget, state)
              for name, (s, p) in ARMS.items()}
    print(f"\nbudget {args.budget:.0f} s per arm, space of {study_file.path.name} ({len(study_file.space)} knobs)")
    print("| arm | trials (complete/pruned) | best val/mrr | time to reach the recipe's value |")
    print("|---|---|---|---|")
    print(f"| recipe alone | 1 | {recipe:.4f} | {recipe_s:.0f} s |")
    reach = {}
    for name, curve in curves.items():
        done = sum(s == "COMPLETE" for *_, s in curve)
        pruned = sum(s == "PRUNED" for *_, s in curve)
        best = curve[-1][1] if curve else float("nan")
        reach[name] = time_to_reach(curve, recipe)
        shown = f"{reach[name]:.0f} s" if reach[name] is not None else "not reached"
        print(f"| {name} | {len(curve)} ({done}/{pruned}) | {best:.4f} | {shown} |")
    tpe, rnd = reach["tpe+median"], reach["random, no pruning"]
    if tpe is not None and rnd is not None:
        print(f"\ntime-to-recipe ratio TPE+pruning / random = {tpe / rnd:.2f} (goal <= 0.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
