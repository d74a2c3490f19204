"""Warm start and the portfolio against cold at short budgets, on image-disjoint holdouts of the demo data, with
paired intervals.

For each holdout seed S (`latentsweep data holdout DEMO --seed S`): a first, cold study on the holdout's train part
(`study run STUDY --timeout FIRST --no-warm-start`, its own state directory); then for each budget T up to three
one-budget jobs, each in a fresh state directory: `run STUDY --time T --warm-from FIRST_STATE` (warm), `run STUDY
--time T` with nothing earlier on the data (portfolio: the product's default on new data), and `run STUDY --time T
--no-warm-start` (cold). The portfolio arm runs at the budgets of --portfolio-budgets only. The arms' order rotates
with the holdout, so that a drift in the machine's load falls on each. Each submission is scored on the holdout's test
part (leaderboard protocol), beside the closed-form floor's score and the job's wall time over its budget; the table
gives, per budget, each arm's mean difference to cold with a 95% bootstrap interval over holdouts (10,000 resamples).
Every finished job appends its row to WORK/results.jsonl (a stopped benchmark resumes where it stopped, and several
run side by side with their own --work merge with --table).

    python benchmarks/warm_start.py --work DIR [--seeds 3 4] [--first 600] [--budgets 60 120 300]
                                    [--portfolio-budgets 60 120]
    python benchmarks/warm_start.py --table DIR [DIR ...]   # one table of several --work directories
    python benchmarks/warm_start.py --smoke    # tiny synthetic data: a 2-trial first study, one 20-s triple
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from one_budget import floor_mrr, holdout  # this script's directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "latentsweep"]
RESAMPLES = 10_000  # bootstrap resamples of the holdouts


def call(argv: list[str], log: Path) -> float:
    """Run the CLI with `argv`, its output in `log`; its wall seconds."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LATENTSWEEP_WARM_START": "on"}  # the product's default (a test suite may turn it off)
    started = time.monotonic()
    proc = subprocess.run([*CLI, *argv], cwd=ROOT, capture_output=True, text=True, env=env)
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:2])} failed (exit {proc.returncode}); see {log}")
    return time.monotonic() - started


def first_study(study: Path, train: Path, seconds: int, state: Path, n_trials: int | None) -> None:
    if not (state / "optuna.db").is_file():
        extra = ["--n-trials", str(n_trials)] if n_trials else []
        call(["study", "run", str(study), "--data", str(train), "--timeout", str(seconds), "--name", "first",
              "--state-dir", str(state), "--no-warm-start", "--quiet", *extra], state.parent / "first.log")


ARM_FLAGS = {"warm": lambda first: ["--warm-from", str(first)], "portfolio": lambda first: [],
             "cold": lambda first: ["--no-warm-start"]}


def one_run(study: Path, files: tuple[Path, Path, Path], budget: int, flags: list[str], work: Path) -> dict:
    """One `run --time budget` in a fresh state directory with `flags`; its test MRR and wall / budget."""
    from latentsweep.trainers.eval.submission import score_submission

    train, test, answers = files
    out = work / "submission.csv"
    wall = call(["run", str(study), "--time", str(budget), "--data", str(train), "--test", str(test), "--out",
                 str(out), "--state-dir", str(work / "state"), "--quiet", *flags], work / "log.txt")
    return {"mrr": float(score_submission(str(out), answers)["mrr"]), "wall_ratio": wall / budget}


def interval(diffs: list[float]) -> tuple[float, float, float]:
    """Mean difference and its 95% bootstrap interval (resampling the holdouts)."""
    d = np.asarray(diffs)
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (RESAMPLES, len(d)))].mean(axis=1)
    return float(d.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def done_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def measure(study: Path, holdouts: dict[str, tuple[Path, Path, Path]], first_s: int, budgets: list[int],
            portfolio_budgets: list[int], work: Path, n_trials: int | None = None) -> list[dict]:
    results = work / "results.jsonl"
    rows = done_rows(results)
    done = {(r["holdout"], r["budget"], r["arm"]) for r in rows}
    for i, (label, files) in enumerate(holdouts.items()):
        first = work / label / "first"
        first_study(study, files[0], first_s, first, n_trials)
        floor = floor_mrr(*files, work / label)
        for budget in budgets:
            arms = [a for a in ARM_FLAGS if a != "portfolio" or budget in portfolio_budgets]
            arms = arms[i % len(arms):] + arms[:i % len(arms)]  # rotate which runs first
            for arm in arms:
                if (label, budget, arm) in done:
                    continue
                row = {"holdout": label, "budget": budget, "arm": arm, "load": os.getloadavg()[0], "floor": floor,
                       **one_run(study, files, budget, ARM_FLAGS[arm](first), work / label / f"{arm}-{budget}")}
                with results.open("a") as f:
                    f.write(json.dumps(row) + "\n")
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    by = {(r["holdout"], r["budget"], r["arm"]): r for r in rows}
    keys = sorted({(r["holdout"], r["budget"]) for r in rows}, key=lambda k: (k[1], k[0]))
    lines = ["| holdout | budget s | floor | warm | portfolio | cold | warm - cold | portfolio - cold | "
             "wall / budget (max) | load (1 min) |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda r, key, spec: "-" if r is None else format(r[key], spec)  # noqa: E731
    for h, b in keys:
        w, p, c = (by.get((h, b, a)) for a in ("warm", "portfolio", "cold"))
        present = [r for r in (w, p, c) if r]
        diff = lambda r: "-" if r is None or c is None else f"{r['mrr'] - c['mrr']:+.4f}"  # noqa: E731
        lines.append(f"| {h} | {b} | {present[0]['floor']:.4f} | {fmt(w, 'mrr', '.4f')} | {fmt(p, 'mrr', '.4f')} | "
                     f"{fmt(c, 'mrr', '.4f')} | {diff(w)} | {diff(p)} | "
                     f"{max(r['wall_ratio'] for r in present):.2f} | {max(r['load'] for r in present):.1f} |")
    lines.append("")
    for b in sorted({k[1] for k in keys}):
        for arm in ("warm", "portfolio"):
            diffs = [by[(h, b, arm)]["mrr"] - by[(h, b, "cold")]["mrr"] for h, bb in keys
                     if bb == b and (h, b, arm) in by and (h, b, "cold") in by]
            if diffs:
                mean, low, high = interval(diffs)
                lines.append(f"budget {b} s, {arm} - cold over {len(diffs)} holdout(s): {mean:+.4f}, "
                             f"95% bootstrap interval [{low:+.4f}, {high:+.4f}]")
    return "\n".join(lines)


def smoke() -> int:
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SHORT_TIME_S, tiny_study_file
    from latentsweep.search.process import TEST_MIN_TIME_ENV
    from latentsweep.trainers.data.synthetic import write_synthetic

    os.environ[TEST_MIN_TIME_ENV] = str(SHORT_TIME_S)  # `run --time 20` accepted (tests only): 20 s each, not 60
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = write_synthetic(tmp / "data", 240, dim_text=24, dim_image=32, n_test=100)
        study = tiny_study_file(tmp, "smoke", n_trials=4, epochs=2)
        rows = measure(study, {"synthetic": files}, 30, [SHORT_TIME_S], [SHORT_TIME_S], tmp / "work", n_trials=2)
        print(table(rows))
        return 0 if len(rows) == 3 and all(r["mrr"] > 0 for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="working directory (holdouts, studies, runs, results.jsonl)")
    p.add_argument("--seeds", type=int, nargs="+", default=[3, 4, 5, 6, 7],
                   help="holdout seeds (default 3-7: the bundled portfolio was built on seeds 0-2)")
    p.add_argument("--first", type=int, default=600, help="the first study's --timeout (default 600)")
    p.add_argument("--budgets", type=int, nargs="+", default=[60, 120, 300], help="`run --time` budgets")
    p.add_argument("--portfolio-budgets", type=int, nargs="*", default=[60, 120],
                   help="budgets that also run the portfolio arm (default 60 120)")
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "full.toml")
    p.add_argument("--table", type=Path, nargs="+", metavar="WORK", help="print one table of these --work dirs")
    p.add_argument("--smoke", action="store_true", help="tiny synthetic data: a 2-trial first study, one 20-s triple")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.table:
        print(table([r for w in args.table for r in done_rows(w / "results.jsonl")]))
        return 0
    if args.work is None:
        p.error("--work is required (or --table, --smoke)")
    sys.path.insert(0, str(ROOT))
    from latentsweep.trainers.data.demo import default_train_path

    holdouts = {f"holdout-{s}": holdout(default_train_path(), s, args.work / f"data-{s}") for s in args.seeds}
    rows = measure(args.study, holdouts, args.first, args.budgets, args.portfolio_budgets, args.work)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
