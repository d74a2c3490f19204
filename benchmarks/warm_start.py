"""Warm start against cold at short budgets, on image-disjoint holdouts of the demo data, with a paired interval.

For each holdout seed S (`latentsweep data holdout DEMO --seed S`): a first, cold study on the holdout's train part
(`study run STUDY --timeout FIRST --no-warm-start`, its own state directory); then for each budget T two one-budget
jobs, each in a fresh state directory: `run STUDY --time T --warm-from FIRST_STATE` (warm) and `run STUDY --time T
--no-warm-start` (cold). Their order alternates with the holdout, so that a drift in the machine's load falls on both.
Each submission is scored on the holdout's test part (leaderboard protocol); the table gives the test MRR of both and
their difference, and per budget the mean difference with a 95% bootstrap interval over holdouts (10,000 resamples).

    python benchmarks/warm_start.py --work DIR [--seeds 0 1 2] [--first 240] [--budgets 60]
    python benchmarks/warm_start.py --smoke    # tiny synthetic data: a 2-trial first study, one 60-s pair
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from one_budget import holdout  # this script's directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "latentsweep"]
RESAMPLES = 10_000  # bootstrap resamples of the holdouts


def call(argv: list[str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LATENTSWEEP_WARM_START": "on"}  # the product's default (a test suite may turn it off)
    proc = subprocess.run([*CLI, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:2])} failed (exit {proc.returncode}); see {log}")


def first_study(study: Path, train: Path, seconds: int, state: Path, n_trials: int | None) -> None:
    if not (state / "optuna.db").is_file():
        extra = ["--n-trials", str(n_trials)] if n_trials else []
        call(["study", "run", str(study), "--data", str(train), "--timeout", str(seconds), "--name", "first",
              "--state-dir", str(state), "--no-warm-start", "--quiet", *extra], state.parent / "first.log")


def one_run(study: Path, files: tuple[Path, Path, Path], budget: int, warm_from: Path | None, work: Path) -> float:
    """One `run --time budget` in a fresh state directory, warm from `warm_from` (None: cold); its test MRR."""
    from latentsweep.trainers.eval.submission import score_submission

    train, test, answers = files
    out = work / "submission.csv"
    warm = ["--warm-from", str(warm_from)] if warm_from else ["--no-warm-start"]
    call(["run", str(study), "--time", str(budget), "--data", str(train), "--test", str(test), "--out", str(out),
          "--state-dir", str(work / "state"), "--quiet", *warm], work / "log.txt")
    return float(score_submission(str(out), answers)["mrr"])


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean difference and its 95% bootstrap interval (resampling the holdouts)."""
    d = np.asarray(diffs)
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (RESAMPLES, len(d)))].mean(axis=1)
    return float(d.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def measure(study: Path, holdouts: dict[str, tuple[Path, Path, Path]], first_s: int, budgets: list[int],
            work: Path, n_trials: int | None = None) -> list[dict]:
    rows = []
    for i, (label, files) in enumerate(holdouts.items()):
        first = work / label / "first"
        first_study(study, files[0], first_s, first, n_trials)
        for budget in budgets:
            arms = [("warm", first), ("cold", None)][:: 1 if i % 2 == 0 else -1]  # alternate which runs first
            row = {"holdout": label, "budget": budget, "load": os.getloadavg()[0]}
            for arm, source in arms:
                row[arm] = one_run(study, files, budget, source, work / label / f"{arm}-{budget}")
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| holdout | budget s | load (1 min) | warm test MRR | cold test MRR | warm - cold |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['holdout']} | {r['budget']} | {r['load']:.1f} | {r['warm']:.4f} | {r['cold']:.4f} | "
              f"{r['warm'] - r['cold']:+.4f} |" for r in rows]
    for budget in sorted({r["budget"] for r in rows}):
        mean, low, high = interval([r["warm"] - r["cold"] for r in rows if r["budget"] == budget])
        lines.append(f"\nbudget {budget} s: warm - cold {mean:+.4f}, 95% bootstrap interval [{low:+.4f}, {high:+.4f}]")
    return "\n".join(lines)


def smoke() -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SPENT_S, tiny_study_file
    from latentsweep.search.process import TEST_SPENT_ENV
    from latentsweep.trainers.data.synthetic import write_synthetic

    os.environ[TEST_SPENT_ENV] = str(SPENT_S)  # each 60-s run starts back-dated: 50 s to wait, not 60 (tests only)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = write_synthetic(tmp / "data", 240, dim_text=24, dim_image=32, n_test=100)
        study = tiny_study_file(tmp, "smoke", n_trials=4, epochs=2)
        rows = measure(study, {"synthetic": files}, 30, [60], tmp / "work", n_trials=2)
        print(table(rows))
        return 0 if rows and rows[0]["warm"] > 0 and rows[0]["cold"] > 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="working directory (holdouts, studies, runs, results.json)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="holdout seeds (default 0 1 2)")
    p.add_argument("--first", type=int, default=240, help="the first study's --timeout (default 240)")
    p.add_argument("--budgets", type=int, nargs="+", default=[60], help="`run --time` budgets (default 60)")
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "full.toml")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic data: a 2-trial first study, one 60-s pair")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.work is None:
        p.error("--work is required (or --smoke)")
    sys.path.insert(0, str(ROOT))
    from latentsweep.trainers.data.demo import default_train_path

    holdouts = {f"holdout-{s}": holdout(default_train_path(), s, args.work / f"data-{s}") for s in args.seeds}
    rows = measure(args.study, holdouts, args.first, args.budgets, args.work)
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
