"""The one-budget job at several budgets, quiet and under load, on image-disjoint holdouts of the demo data.

For each holdout seed S (`latentsweep data holdout TRAIN --seed S`), each budget T and each load (quiet, or LOAD_PROCS
busy processes beside the job), in a fresh state directory: `latentsweep run studies/full.toml --time T` with its
defaults. Reported per run: wall / budget, the seconds the first (closed-form) answer and the best trial's answer took,
whether the pick finished, and the test MRR of the submission (leaderboard protocol, `submission score`).

    python benchmarks/one_budget.py --work DIR [--seeds 0 1] [--budgets 60 120 240] [--loads quiet loaded]
    python benchmarks/one_budget.py --smoke     # tiny synthetic data, one 60-s run (about a minute)
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "search"]
# Busy processes beside a loaded run: as many as this machine's 2 cores, so the job gets about half of them.
LOAD_PROCS = 2


def run_once(study: Path, train: Path, test: Path, budget: int, loaded: bool, work: Path) -> dict:
    """One `latentsweep run` in a fresh state directory under `work`; its figures as a dict."""
    work.mkdir(parents=True, exist_ok=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(LOAD_PROCS if loaded else 0)]
    start = time.monotonic()
    try:
        proc = subprocess.run([*CLI, "run", str(study), "--time", str(budget), "--data", str(train), "--test",
                               str(test), "--state-dir", str(work / "state"), "--quiet"], cwd=ROOT,
                              capture_output=True, text=True)
    finally:
        for p in busy:
            p.kill()
    wall = time.monotonic() - start
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    first = re.search(r"first answer in ([\d.]+) s", proc.stderr)
    safe = re.search(r"safe answer: .*\(written in ([\d.]+) s\)", proc.stderr)
    return {"budget": budget, "load": "loaded" if loaded else "quiet", "rc": proc.returncode, "wall": wall,
            "first_s": float(first.group(1)) if first else None, "safe_s": float(safe.group(1)) if safe else None,
            "pick": "pick done" in proc.stderr, "submission": str(work / "state" / "picks" / study.stem
                                                              / "submission.csv")}


def score(csv: str, answers: Path) -> float | None:
    from trainers.submission import score_submission

    return score_submission(csv, answers)["mrr"] if Path(csv).is_file() else None


def holdout(train: Path, seed: int, out: Path) -> tuple[Path, Path, Path]:
    """(train, test.clean, answers) of holdout `seed` of `train` in `out` (made once)."""
    if not (out / "answers.npz").is_file():
        subprocess.run([*CLI, "data", "holdout", str(train), "--seed", str(seed), "--out", str(out)], cwd=ROOT,
                       check=True, capture_output=True)
    return out / "train.npz", out / "test.clean.npz", out / "answers.npz"


def table(rows: list[dict]) -> str:
    lines = ["| holdout | budget s | load | wall / budget | first answer s | best-trial answer s | pick | test MRR |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        mrr = "-" if r["mrr"] is None else f"{r['mrr']:.4f}"
        lines.append(f"| {r['seed']} | {r['budget']} | {r['load']} | {r['wall'] / r['budget']:.2f} | "
                     f"{fmt(r['first_s'])} | {fmt(r['safe_s'])} | {'yes' if r['pick'] else 'no'} | {mrr} |")
    return "\n".join(lines)


def smoke() -> int:
    """One 60-s run of a tiny study on tiny synthetic data (the code path of the benchmark, end to end)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import tiny_study_file
    from trainers.synthetic import write_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, test, answers = write_synthetic(tmp / "data", 240, dim_text=24, dim_image=32, n_test=100)
        study = tiny_study_file(tmp, "smoke", n_trials=4, epochs=2)
        row = {"seed": "synthetic", **run_once(study, train, test, 60, False, tmp / "run")}
        row["mrr"] = score(row["submission"], answers)
        print(table([row]))
        return 0 if row["rc"] == 0 and row["mrr"] is not None else 1


def measure(work: Path, seeds: list[int], budgets: list[int], loads: list[str]) -> list[dict]:
    """Every (holdout, budget, load) run, in that order; each row printed as it ends."""
    sys.path.insert(0, str(ROOT))
    from trainers.demo import default_train_path

    rows = []
    for seed in seeds:
        train, test, answers = holdout(default_train_path(), seed, work / f"holdout-{seed}")
        for budget in budgets:
            for load in loads:
                row = {"seed": seed, **run_once(ROOT / "studies" / "full.toml", train, test, budget,
                                                load == "loaded", work / f"h{seed}-t{budget}-{load}")}
                row["mrr"] = score(row["submission"], answers)
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="working directory (holdouts, runs, results.json)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--budgets", type=int, nargs="+", default=[60, 120, 240])
    p.add_argument("--loads", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    p.add_argument("--smoke", action="store_true", help="one 60-s run on tiny synthetic data")
    args = p.parse_args(argv)
    if not args.smoke and args.work is None:
        p.error("--work is required (or --smoke)")
    if args.smoke:
        return smoke()
    rows = measure(args.work, args.seeds, args.budgets, args.loads)
    (args.work / "results.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
