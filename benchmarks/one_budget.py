"""The one-budget job at several budgets, quiet and under load, on image-disjoint holdouts of the demo data.

For each holdout seed S (`latentsweep data holdout TRAIN --seed S`), each budget T and each load (quiet, or LOAD_PROCS
busy processes beside the job), in a fresh state directory: `latentsweep run studies/full.toml --time T` with its
defaults. Reported per run: wall / budget, the machine's load average over the run (the machine may be shared), the
seconds the first (closed-form) answer took, which answer the manifest says won on the study's val split and by how
much (latentsweep.search.pick.judge), whether the pick's answer is the submission, the test MRR of the submission
(leaderboard
protocol, `submission score`), the test MRR of the closed-form floor alone (fit on the same train file) and whether
the submission scores at least that on the held-out images.

    python benchmarks/one_budget.py --work DIR [--seeds 0 1] [--budgets 60 120 240] [--loads quiet loaded]
    python benchmarks/one_budget.py --smoke     # tiny synthetic data, one 20-s run (tests only: below --time's minimum)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "latentsweep"]
# Busy processes beside a loaded run: as many as this machine's 2 cores, so the job gets about half of them.
LOAD_PROCS = 2


def run_once(study: Path, train: Path, test: Path, budget: int, loaded: bool, work: Path) -> dict:
    """One `latentsweep run` in a fresh state directory under `work`; its figures as a dict."""
    work.mkdir(parents=True, exist_ok=True)
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(LOAD_PROCS if loaded else 0)]
    start, load_before = time.monotonic(), os.getloadavg()[0]
    try:
        proc = subprocess.run([*CLI, "run", str(study), "--time", str(budget), "--data", str(train), "--test",
                               str(test), "--state-dir", str(work / "state"), "--quiet"], cwd=ROOT,
                              capture_output=True, text=True)
    finally:
        for p in busy:
            p.kill()
    wall = time.monotonic() - start
    loadavg = (os.getloadavg()[0] + load_before) / 2  # 1-min load average, at the start and the end
    (work / "log.txt").write_text(proc.stdout + proc.stderr)
    first = re.search(r"first answer ([\d.]+) s into the job", proc.stderr)
    submission = work / "state" / "picks" / study.stem / "submission.csv"
    return {"budget": budget, "load": "loaded" if loaded else "quiet", "loadavg": loadavg, "rc": proc.returncode,
            "wall": wall, "first_s": float(first.group(1)) if first else None, "pick": "pick done" in proc.stderr,
            "submission": str(submission), **winner(submission)}


def winner(submission: Path) -> dict:
    """The manifest's verdict (latentsweep.search.pick.judge.Standing.record): which answer won on the val split, its
    val MRR
    and its margin over the best answer it beat; Nones when there is no manifest."""
    manifest = submission.with_name(f"{submission.stem}.manifest.json")
    if not manifest.is_file():
        return {"winner": None, "winner_val": None, "margin": None}
    answer = json.loads(manifest.read_text()).get("answer") or {}
    return {"winner": answer.get("winner"), "winner_val": answer.get("val_mrr"),
            "margin": answer.get("margin_val_mrr")}


def floor_mrr(train: Path, test: Path, answers: Path, work: Path) -> float:
    """Test MRR of the closed-form floor alone (latentsweep.search.pick.safe.ridge_answer on the same train file): what
    every
    submission must at least score on the held-out images."""
    from latentsweep.search.pick.safe import ridge_answer
    from latentsweep.trainers.data.sets import load_test, load_train_shared

    csv = work / "floor.csv"
    if not csv.is_file():
        ridge_answer(load_train_shared(str(train)), load_test(test), csv)
    return score(str(csv), answers)


def score(csv: str, answers: Path) -> float | None:
    from latentsweep.trainers.eval.submission import score_submission

    return score_submission(csv, answers)["mrr"] if Path(csv).is_file() else None


def holdout(train: Path, seed: int, out: Path) -> tuple[Path, Path, Path]:
    """(train, test.clean, answers) of holdout `seed` of `train` in `out` (made once)."""
    if not (out / "answers.npz").is_file():
        subprocess.run([*CLI, "data", "holdout", str(train), "--seed", str(seed), "--out", str(out)], cwd=ROOT,
                       check=True, capture_output=True)
    return out / "train.npz", out / "test.clean.npz", out / "answers.npz"


def table(rows: list[dict]) -> str:
    lines = ["| holdout | budget s | load (loadavg) | wall / budget | first answer s | winner on val (MRR, margin) | "
             "pick | test MRR | floor test MRR | >= floor |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fmt = lambda v, spec=".1f": "-" if v is None else format(v, spec)  # noqa: E731
        won = ("-" if r["winner"] is None else
               f"{r['winner']} ({fmt(r['winner_val'], '.4f')}, {fmt(r['margin'], '+.4f')})")
        at_least = "-" if r["mrr"] is None or r["floor"] is None else ("yes" if r["mrr"] >= r["floor"] else "**no**")
        lines.append(f"| {r['seed']} | {r['budget']} | {r['load']} ({r['loadavg']:.1f}) | "
                     f"{r['wall'] / r['budget']:.2f} | {fmt(r['first_s'])} | {won} | "
                     f"{'yes' if r['pick'] else 'no'} | {fmt(r['mrr'], '.4f')} | {fmt(r['floor'], '.4f')} | "
                     f"{at_least} |")
    return "\n".join(lines)


def smoke() -> int:
    """One run of the least budget a test asks for (conftest.SHORT_TIME_S, below the product's minimum for tests only)
    of a tiny study on tiny synthetic data (the code path of the benchmark, end to end)."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import SHORT_TIME_S, tiny_study_file
    from latentsweep.search.process import TEST_MIN_TIME_ENV
    from latentsweep.trainers.data.synthetic import write_synthetic

    os.environ[TEST_MIN_TIME_ENV] = str(SHORT_TIME_S)  # `run --time 20` accepted (tests only): 20 s, not 60
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, test, answers = write_synthetic(tmp / "data", 240, dim_text=24, dim_image=32, n_test=100)
        study = tiny_study_file(tmp, "smoke", n_trials=4, epochs=2)
        row = {"seed": "synthetic", **run_once(study, train, test, SHORT_TIME_S, False, tmp / "run")}
        row["mrr"], row["floor"] = score(row["submission"], answers), floor_mrr(train, test, answers, tmp)
        print(table([row]))
        return 0 if row["rc"] == 0 and row["mrr"] is not None and row["winner"] is not None else 1


def measure(work: Path, seeds: list[int], budgets: list[int], loads: list[str]) -> list[dict]:
    """Every (holdout, budget, load) run, in that order; each row printed as it ends."""
    sys.path.insert(0, str(ROOT))
    from latentsweep.trainers.data.demo import default_train_path

    rows = []
    for seed in seeds:
        train, test, answers = holdout(default_train_path(), seed, work / f"holdout-{seed}")
        for budget in budgets:
            for load in loads:
                row = {"seed": seed, **run_once(ROOT / "studies" / "full.toml", train, test, budget,
                                                load == "loaded", work / f"h{seed}-t{budget}-{load}")}
                row["mrr"] = score(row["submission"], answers)
                row["floor"] = floor_mrr(train, test, answers, work / f"holdout-{seed}")
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="working directory (holdouts, runs, results.json)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--budgets", type=int, nargs="+", default=[60, 120, 240])
    p.add_argument("--loads", nargs="+", default=["quiet", "loaded"], choices=["quiet", "loaded"])
    p.add_argument("--smoke", action="store_true", help="one 20-s run on tiny synthetic data (tests only)")
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
