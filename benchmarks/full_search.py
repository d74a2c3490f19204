"""What a `full` study buys per minute: trials and best value after 5, 10 and 15 minutes, over sampler seeds, for one
or two checkouts of the project (before / after a change), run side by side so that both see the same machine load.

For each seed, every checkout runs `python -m latentsweep study run studies/full.toml --timeout SECONDS` in its own
state
directory at the same time, each with `--threads` torch threads (OMP_NUM_THREADS; default 1: two arms share a 2-core
machine evenly).
The study file's sampler seed is replaced by the run's seed. Afterwards each study is read back and, for every
checkpoint, the trials finished by then (complete / pruned / failed) and the best value of the complete trials are
reported (Optuna's best value at that time).

    python benchmarks/full_search.py --repo OLD_CHECKOUT --repo . [--seeds 0 1 2] [--seconds 900] [--json OUT]
    python benchmarks/full_search.py --smoke    # this checkout, 1 seed, 8 s on tiny synthetic data, a temp dir
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import optuna
from optuna.trial import TrialState

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINTS = (300, 600, 900)


def seeded_copy(studies: Path, seed: int, out: Path) -> tuple[Path, str]:
    """A copy of studies/ with full.toml's sampler seed set to `seed`; (its path, the study name)."""
    out.mkdir(parents=True, exist_ok=True)
    for sibling in studies.glob("*.toml"):
        (out / sibling.name).write_text(sibling.read_text())
    path = out / "full.toml"
    text, n = re.subn(r"(sampler\s*=\s*\{[^}]*seed\s*=\s*)\d+", rf"\g<1>{seed}", path.read_text(), count=1)
    if n != 1:
        raise SystemExit(f"{path}: no sampler seed to vary")
    path.write_text(text)
    return path, re.search(r'name\s*=\s*"([^"]+)"', text).group(1)


def summary(state: Path, name: str, checkpoints) -> list[dict]:
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")
    trials = [t for t in study.trials if t.datetime_start]
    t0 = min(t.datetime_start for t in trials)
    rows = []
    for limit in checkpoints:
        done = [t for t in trials if t.datetime_complete and (t.datetime_complete - t0).total_seconds() <= limit]
        complete = [t.value for t in done if t.state == TrialState.COMPLETE]
        rows.append({"minutes": limit / 60, "complete": len(complete),
                     "pruned": sum(t.state == TrialState.PRUNED for t in done),
                     "failed": sum(t.state == TrialState.FAIL for t in done),
                     "best": max(complete) if complete else None})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, action="append", help="a checkout to run (repeat for before / after)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--seconds", type=float, default=900)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data", type=Path, default=None, help="train npz (default: the demo data)")
    p.add_argument("--work", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true",
                   help="this checkout, 1 seed, 8 s on tiny synthetic data, in a temp dir: the path in seconds")
    args = p.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="full-search-smoke-") as tmp:
            sys.path.insert(0, str(ROOT))  # the data generator of this checkout (the runs are subprocesses)
            from latentsweep.trainers.data.synthetic import write_synthetic

            # 8 s: its first trial starts (what the summary reads) even on a loaded machine
            args.repo, args.seeds, args.seconds, args.work = None, [0], 8.0, Path(tmp)
            args.data = write_synthetic(Path(tmp) / "data", 100, dim_text=32, dim_image=48)[0]
            return run(args)
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Every seed's study run in every checkout, side by side; prints a JSON line each and the table."""
    repos = [r.resolve() for r in (args.repo or [ROOT])]
    work = args.work or Path(tempfile.mkdtemp(prefix="latentsweep-full-search-"))
    checkpoints = [c for c in CHECKPOINTS if c <= args.seconds] or [args.seconds]
    results = []
    for seed in args.seeds:
        procs = []
        for i, repo in enumerate(repos):
            run = work / f"seed-{seed}" / f"arm-{i}"
            study, name = seeded_copy(repo / "studies", seed, run / "studies")
            argv_ = [sys.executable, "-m", "latentsweep", "study", "run", str(study), "--state-dir", str(run / "state"),
                     "--timeout", str(args.seconds), "--quiet"]
            if args.data:
                argv_ += ["--data", str(args.data)]
            log = open(run / "log.txt", "w")
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
            procs.append((repo, run, name, subprocess.Popen(argv_, cwd=repo, env=env, stdout=log,
                                                            stderr=subprocess.STDOUT), log))
        for repo, run, name, proc, log in procs:
            proc.wait()
            log.close()
            rows = summary(run / "state", name, checkpoints)
            results.append({"repo": str(repo), "seed": seed, "rows": rows})
            print(json.dumps(results[-1]), flush=True)
    print("| checkout | seed | " + " | ".join(f"{c / 60:.0f} min: complete/pruned/failed, best" for c in checkpoints)
          + " |")
    print("|---|---|" + "---|" * len(checkpoints))
    for r in results:
        cells = [f"{x['complete']}/{x['pruned']}/{x['failed']}, "
                 + (f"{x['best']:.4f}" if x["best"] is not None else "none") for x in r["rows"]]
        print(f"| {Path(r['repo']).name} | {r['seed']} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
