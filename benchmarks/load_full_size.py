"""Benchmark: write and load a challenge-size train.npz; report wall time and peak RSS against the float arrays' size.

Usage: python benchmarks/load_full_size.py [--dir DIR | --data FILE] [--small] [--rebuild] [--before REV] [--repeats N]
       python benchmarks/load_full_size.py --smoke     # 100 images x 32 -> 48, in a temp dir (tests)
The file is built once with latentsweep.trainers.data.synthetic (cached in DIR, default a temp dir; --data: an
existing train.npz instead) and loaded in a child process, whose peak RSS (resource.getrusage ru_maxrss) is compared
with the bytes of the float arrays it must hold. --before REV: load_train with the code of git revision REV too
(exported with git archive), REV's and this tree's children in turn, --repeats times each (the machine may be shared:
the medians and the pairwise ratio are the figures to quote). Then `load_train_shared` in two more child processes
with an empty data cache (latentsweep.trainers.data.sets.CACHE_ENV): the first parses the npz and writes the
memory-mapped copy, the second (a spawned worker, the next run) maps it.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if sys.argv[1:2] != ["--child-load"]:  # a load child measures the code its PYTHONPATH names (--before REV's)
    sys.path.insert(0, str(ROOT))

# Real challenge train.npz: 25,000 images x 5 captions, text dim 1024, image dim 1536 (shared/data-sources.md).
FULL = {"n_images": 25_000, "captions_per_image": 5, "dim_text": 1024, "dim_image": 1536}
SMALL = {"n_images": 2_000, "captions_per_image": 5, "dim_text": 1024, "dim_image": 1536}
SMOKE = {"n_images": 100, "captions_per_image": 5, "dim_text": 32, "dim_image": 48}
GOAL_RATIO = 1.5  # peak RSS of the loader / bytes of the float arrays
MB = 2 ** 20


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes


def child_build(out_dir: str, params: dict) -> dict:
    from latentsweep.trainers.data.synthetic import write_synthetic

    start = time.perf_counter()
    write_synthetic(out_dir, **params)
    return {"wall_s": time.perf_counter() - start, "peak_rss": _peak_rss_bytes()}


def child_load(path: str) -> dict:
    from latentsweep.trainers.data import sets
    from latentsweep.trainers.data.sets import fingerprint, load_train

    baseline = _peak_rss_bytes()  # interpreter + numpy, before any data
    start, cpu_start = time.perf_counter(), time.process_time()
    ts = load_train(path, texts=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _peak_rss_bytes()
    start = time.perf_counter()
    fingerprint(path)
    return {"wall_s": wall, "cpu_s": cpu, "fingerprint_s": time.perf_counter() - start, "peak_rss": peak,
            "baseline_rss": baseline, "code": sets.__file__,
            "float_bytes": ts.text.nbytes + ts.image.nbytes, "text_bytes": ts.caption_text.nbytes,
            "n_captions": len(ts.text), "n_images": len(ts.image)}


def child_shared(path: str) -> dict:
    from latentsweep.trainers.data import sets as data

    start = time.perf_counter()
    ts = data.load_train_shared(path)
    return {"wall_s": time.perf_counter() - start, "peak_rss": _peak_rss_bytes(), "reads": data.reads,
            "mapped": type(ts.text).__name__ == "memmap"}


def _run_child(*args: str, env: dict | None = None, code: Path = ROOT) -> dict:
    """A child process of this script with the package at `code` first on its path; its last line's JSON."""
    out = subprocess.run([sys.executable, __file__, *args], check=True, capture_output=True, text=True,
                         env={**os.environ, **(env or {}), "PYTHONPATH": str(code)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_loads(train: Path, codes: dict[str, Path], repeats: int) -> dict[str, list[dict]]:
    """load_train of `train` in a child per run, the codes in turn (A B A B ...), `repeats` runs each; prints every
    run, then each code's medians (min-max) and, with two codes, the second's wall over the first's, pair by pair."""
    runs: dict[str, list[dict]] = {label: [] for label in codes}
    for i in range(repeats):
        for label, code in codes.items():
            r = _run_child("--child-load", str(train), code=code)
            if not Path(r["code"]).resolve().is_relative_to(code.resolve()):
                raise SystemExit(f"{label}: the child imported {r['code']}, not the code under {code}")
            runs[label].append(r)
            print(f"run {i + 1} {label}: load_train {r['wall_s']:.2f} s wall, {r['cpu_s']:.2f} s CPU, "
                  f"peak RSS {r['peak_rss'] / MB:.0f} MB", flush=True)
    for label, rs in runs.items():
        print(f"{label}: load_train wall {_spread([r['wall_s'] for r in rs], 's')}, "
              f"CPU {_spread([r['cpu_s'] for r in rs], 's')}, "
              f"peak RSS {_spread([r['peak_rss'] / MB for r in rs], 'MB', '.0f')} (median, min-max of {len(rs)})")
    if len(runs) == 2:
        first, second = runs.values()
        ratios = [b["wall_s"] / a["wall_s"] for a, b in zip(first, second)]
        print(f"wall {' / '.join(reversed(runs))}, pair by pair: {_spread(ratios, '')}")
    return runs


def _spread(values: list[float], unit: str, fmt: str = ".2f") -> str:
    return (f"{statistics.median(values):{fmt}}{' ' + unit if unit else ''} "
            f"({min(values):{fmt}}-{max(values):{fmt}})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", help="where to build / find train.npz (default: a fixed temp dir)")
    ap.add_argument("--small", action="store_true", help=f"quick run: {SMALL['n_images']} images instead of 25,000")
    ap.add_argument("--rebuild", action="store_true", help="rebuild the file even if cached")
    ap.add_argument("--data", help="load this train.npz instead of building one")
    ap.add_argument("--before", metavar="REV", help="also time load_train with git revision REV's code (e.g. HEAD)")
    ap.add_argument("--repeats", type=int, default=1, help="load_train runs of each code (default 1)")
    ap.add_argument("--smoke", action="store_true", help="a tiny file in a fresh temp dir: the code path in seconds")
    ap.add_argument("--child-build", nargs=2, metavar=("DIR", "PARAMS"), help=argparse.SUPPRESS)
    ap.add_argument("--child-load", metavar="PATH", help=argparse.SUPPRESS)
    ap.add_argument("--child-shared", metavar="PATH", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_build:
        print(json.dumps(child_build(args.child_build[0], json.loads(args.child_build[1]))))
        return 0
    if args.child_load:
        print(json.dumps(child_load(args.child_load)))
        return 0
    if args.child_shared:
        print(json.dumps(child_shared(args.child_shared)))
        return 0
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="load-smoke-") as tmp:
            return measure(SMOKE, Path(tmp), rebuild=True)
    params = SMALL if args.small else FULL
    out_dir = Path(args.dir or Path(tempfile.gettempdir()) / f"latentsweep-bench-{'small' if args.small else 'full'}")
    return measure(params, out_dir, args.rebuild, data=args.data, before=args.before, repeats=args.repeats)


def measure(params: dict, out_dir: Path, rebuild: bool, data: str | None = None, before: str | None = None,
            repeats: int = 1) -> int:
    """Build (or reuse) out_dir/train.npz with `params` (or take `data`), load it in child processes (this tree's
    code, and `before`'s in turn with it) and print the figures."""
    train, stamp = (Path(data), None) if data else (out_dir / "train.npz", out_dir / "params.json")
    cached = data or (train.exists() and stamp.exists() and json.loads(stamp.read_text()) == params)
    if data:
        print(f"using {train}")
    elif rebuild or not cached:
        out_dir.mkdir(parents=True, exist_ok=True)
        stamp.unlink(missing_ok=True)
        built = _run_child("--child-build", str(out_dir), json.dumps(params))
        stamp.write_text(json.dumps(params))
        print(f"built {train} in {built['wall_s']:.1f} s, writer peak RSS {built['peak_rss'] / MB:.0f} MB")
    else:
        print(f"using cached {train}")

    # memory_peak puts this checkout first on sys.path when imported: never in a load child (this script's
    # directory is on sys.path)
    from memory_peak import export_revision

    with tempfile.TemporaryDirectory(prefix="load-before-") as tmp:
        codes = {f"before ({before})": export_revision(before, Path(tmp))} if before else {}
        r = compare_loads(train, {**codes, "this tree": ROOT}, max(1, repeats))["this tree"][-1]
    dense_label = r["n_captions"] * r["n_images"]
    ratio = r["peak_rss"] / r["float_bytes"]
    print(f"file: {train.stat().st_size / MB:.0f} MB on disk; {r['n_captions']} captions x {r['n_images']} images; "
          f"dense label would be {dense_label / MB:.0f} MB")
    print(f"load_train wall time: {r['wall_s']:.1f} s, CPU time {r['cpu_s']:.1f} s "
          f"(sha256 fingerprint alone: {r['fingerprint_s']:.1f} s wall)")
    print(f"float arrays: {r['float_bytes'] / MB:.0f} MB; caption strings: {r['text_bytes'] / MB:.0f} MB; "
          f"interpreter baseline RSS: {r['baseline_rss'] / MB:.0f} MB")
    print(f"peak RSS of loader: {r['peak_rss'] / MB:.0f} MB")
    verdict = "met" if ratio <= GOAL_RATIO else "NOT met"
    print(f"ratio peak_rss / float_bytes = {ratio:.2f} (goal <= {GOAL_RATIO}: {verdict})")
    from latentsweep.trainers.data.sets import CACHE_ENV

    with tempfile.TemporaryDirectory(prefix="load-cache-") as cache:
        for which in ("first process (parse + write the cache)", "second process (maps the cache)"):
            s = _run_child("--child-shared", str(train), env={CACHE_ENV: cache})
            print(f"load_train_shared, {which}: {s['wall_s']:.1f} s wall, peak RSS {s['peak_rss'] / MB:.0f} MB, "
                  f"reads {s['reads']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
