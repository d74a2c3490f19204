"""Build the warm-start portfolio (search/study/portfolio.toml): the configurations that did best on demo holdouts.

For each holdout seed S (`latentsweep data holdout DEMO --seed S`), a cold study `studies/full.toml` runs on the
holdout's train part for SECONDS (`study run --timeout SECONDS --no-warm-start`, its own state directory), from a
copy of the study file without its [[enqueue]] recipes and [[side]] trials (every study tries those anyway, and a
short study would spend its seconds on them) whose sampler seed is the holdout's index (one seed would draw the same
first configurations on every holdout). The sampled trials are ranked within their holdout: complete ones by
value, then pruned ones by the epochs they reached and their last value. The portfolio takes them round robin (the
first of each holdout, then the second of each, ..., skipping repeats) until SIZE configurations, each written as its
Optuna parameters of studies/full.toml with its source and its value relative to its holdout's first. A new study on
new data tries them after its own recipes (search/study/warm.py).

    python benchmarks/portfolio.py --work DIR [--seeds 0 1 2] [--seconds 120] [--size 5] [--out PATH]
    python benchmarks/portfolio.py --smoke    # tiny synthetic data, one 15-s study, a temp file (about a minute)
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

from one_budget import holdout  # this script's directory is on sys.path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "latentsweep"]
OUT = ROOT / "search" / "study" / "portfolio.toml"


def searched_only(study: Path, out: Path, seed: int) -> Path:
    """A copy of `study` without its [[enqueue]] recipes and [[side]] trials (every study tries those anyway, so the
    portfolio's short studies spend their seconds on sampled configurations only), its sampler seed set to `seed`:
    with one seed, every holdout's study draws the same first configurations."""
    keep, skipping = [], False
    for line in study.read_text().splitlines():
        if re.match(r"\s*\[\[(enqueue|side)\]\]", line):
            skipping = True
        elif re.match(r"\s*\[", line):
            skipping = False
        if not skipping:
            keep.append(line)
    out.mkdir(parents=True, exist_ok=True)
    copy = out / study.name
    text, n = re.subn(r"(sampler\s*=\s*\{[^}]*seed\s*=\s*)\d+", rf"\g<1>{seed}", "\n".join(keep) + "\n", count=1)
    if n != 1:
        raise SystemExit(f"{study}: no sampler seed to vary")
    copy.write_text(text)
    sys.path.insert(0, str(ROOT))
    from latentsweep.search.study.studyfile import load_study_file

    loaded = load_study_file(copy)
    if loaded.enqueue or loaded.side:
        raise SystemExit(f"{copy}: could not remove the recipes and side trials of {study}")
    return copy


def cold_study(study: Path, train: Path, seconds: int, state: Path) -> list[dict]:
    """Run one cold study; its sampled trials with a value as {params, value, epochs, trial}, best first: COMPLETE
    ones by value, then PRUNED ones by the epochs they reached (a trial the pruner promoted to a later rung beat
    those it stopped earlier) and their last value. A short study on a busy machine completes few trials, so the
    pruned ones are ranked too rather than leaving the portfolio empty."""
    import optuna

    name = f"portfolio-{state.name}"
    proc = subprocess.run([*CLI, "study", "run", str(study), "--data", str(train), "--timeout", str(seconds),
                           "--name", name, "--state-dir", str(state), "--no-warm-start", "--quiet"], cwd=ROOT,
                          capture_output=True, text=True)
    (state / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"study on {train} failed (exit {proc.returncode}); see {state / 'log.txt'}")
    loaded = optuna.load_study(study_name=name, storage=f"sqlite:///{state / 'optuna.db'}")
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = [t for t in loaded.get_trials(states=states)
            if t.params and "latentsweep.enqueued" not in t.user_attrs and t.intermediate_values]
    sign = -1.0 if loaded.direction == optuna.study.StudyDirection.MAXIMIZE else 1.0

    def value(t) -> float:
        return t.value if t.value is not None else t.intermediate_values[max(t.intermediate_values)]

    def key(t) -> tuple:
        return t.state != optuna.trial.TrialState.COMPLETE, -len(t.intermediate_values), sign * value(t)

    return [{"params": t.params, "value": value(t), "epochs": len(t.intermediate_values), "state": t.state.name,
             "trial": t.number} for t in sorted(done, key=key)]


def round_robin(per_holdout: dict[str, list[dict]], size: int) -> list[dict]:
    """The best of each holdout, then the second of each, ..., skipping repeated parameters, up to `size`."""
    chosen, seen = [], set()
    for rank in range(max((len(v) for v in per_holdout.values()), default=0)):
        for label, rows in per_holdout.items():
            if rank < len(rows) and len(chosen) < size:
                key = json.dumps(rows[rank]["params"], sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    best = rows[0]["value"]
                    row = rows[rank]
                    chosen.append({**row, "source": f"{label} trial {row['trial']} ({row['state']} after "
                                                    f"{row['epochs']} epoch(s))",
                                   "relative": rows[rank]["value"] / best if best else 1.0})
    return chosen


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string (JSON escapes are TOML's)


def write_portfolio(chosen: list[dict], out: Path, header: str) -> None:
    lines = [f"# {line}" for line in header.splitlines()]
    for c in chosen:
        lines += ["", "[[config]]", f"source = {toml_value(c['source'])}",
                  f"value = {c['relative']:.4f}  # its value relative to its holdout's first-ranked"]
        lines += [f"{json.dumps(k)} = {toml_value(v)}" for k, v in sorted(c["params"].items())]
    out.write_text("\n".join(lines) + "\n")


def build(study: Path, trains: dict[str, Path], seconds: int, size: int, work: Path, out: Path) -> list[dict]:
    started, load = time.monotonic(), os.getloadavg()[0]
    per_holdout = {label: cold_study(searched_only(study, work / label / "study", i), train, seconds, work / label)
                   for i, (label, train) in enumerate(trains.items())}
    for label, rows in per_holdout.items():
        print(f"{label}: {len(rows)} sampled trial(s) with a value, "
              f"{sum(r['state'] == 'COMPLETE' for r in rows)} complete")
    chosen = round_robin(per_holdout, size)
    header = (f"The warm-start portfolio (search/study/warm.py): written by benchmarks/portfolio.py, do not edit.\n"
              f"{len(trains)} holdout(s) ({', '.join(trains)}) x a {seconds}-s cold study of {study.name}; "
              f"{len(chosen)} configuration(s), round robin by rank.\n"
              f"Built in {time.monotonic() - started:.0f} s, 1-minute load average {load:.1f} at the start "
              f"({os.cpu_count()} cores).")
    write_portfolio(chosen, out, header)
    print(f"wrote {out}: {len(chosen)} configuration(s)")
    return chosen


def smoke() -> int:
    """One 15-s study of a tiny study file on tiny synthetic data, written to a temp portfolio and read back."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    import tomllib

    from conftest import tiny_study_file
    from latentsweep.trainers.data.synthetic import write_synthetic

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        train, _, _ = write_synthetic(tmp / "data", 240, dim_text=24, dim_image=32, n_test=100)
        study = tiny_study_file(tmp, "smoke", n_trials=3, epochs=2)
        out = tmp / "portfolio.toml"
        chosen = build(study, {"holdout-synthetic": train}, 15, 2, tmp, out)
        configs = tomllib.loads(out.read_text())["config"]
        return 0 if chosen and len(configs) == len(chosen) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="working directory (holdouts, studies)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="holdout seeds (default 0 1 2)")
    p.add_argument("--seconds", type=int, default=120, help="each cold study's --timeout (default 120)")
    p.add_argument("--size", type=int, default=5, help="configurations in the portfolio (default 5)")
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "full.toml")
    p.add_argument("--out", type=Path, default=OUT, help=f"portfolio file (default {OUT.relative_to(ROOT)})")
    p.add_argument("--smoke", action="store_true", help="one 15-s study on tiny synthetic data, a temp file")
    args = p.parse_args(argv)
    if args.smoke:
        return smoke()
    if args.work is None:
        p.error("--work is required (or --smoke)")
    sys.path.insert(0, str(ROOT))
    from latentsweep.trainers.data.demo import default_train_path

    trains = {f"holdout-{s}": holdout(default_train_path(), s, args.work / f"data-{s}")[0] for s in args.seeds}
    build(args.study, trains, args.seconds, args.size, args.work, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
