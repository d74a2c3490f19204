"""Benchmark: the pick's cross-fitted selection (`oof.nested_select`, as `latentsweep run`'s pick makes it on the
study's val split) at challenge size: its time and peak RSS, this tree against git revision --before.

Usage: python benchmarks/pick_selection.py [--before REV] [--members 5] [--json OUT]
       python benchmarks/pick_selection.py --smoke    # a tiny shape, the path only (the tests run it)
The val split of the challenge-size file: 5,000 images x 5 captions, 1,536-dim predictions, 5 folds, greedy to 8
picks. Each member's predictions are made as the selection reads them (the pick predicts one model at a time); a
revision whose selection takes a list gets the list, all members made first, as its pick held them. Each arm runs in
its own child process (peak RSS: the child's ru_maxrss), the arms alternating, --repeats times each.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FULL = {"images": 5_000, "captions": 5, "dim": 1536}  # the val split of 25,000 images at data.val_ratio 0.2
SMOKE = {"images": 120, "captions": 5, "dim": 16}
NOISE = 8.0  # members' prediction noise per dimension against unit-variance images: val MRR near a trial's 0.8


def child(shape: dict, members: int) -> dict:
    """Run the selection in this process on members made from a seeded generator; its figures."""
    import numpy as np

    from latentsweep.search.pick import oof

    rng = np.random.default_rng(0)
    image = rng.standard_normal((shape["images"], shape["dim"])).astype(np.float32)
    cap2img = np.repeat(np.arange(shape["images"]), shape["captions"])

    def member(i: int):
        out = image[cap2img]
        out += rng.standard_normal(out.shape, dtype=np.float32) * np.float32(NOISE + i)
        return out

    folds = oof.Folds(np.arange(shape["images"]) % 5, cap2img)
    streams = "Iterable" in oof.nested_select.__annotations__.get("oof", "")
    started = time.perf_counter()
    preds = (member(i) for i in range(members)) if streams else [member(i) for i in range(members)]
    res = oof.nested_select(preds, folds, image, "greedy", 8, in_place=True)
    return {"seconds": time.perf_counter() - started, "streams": streams,
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "weights": [round(float(w), 4) for w in res.weights], "gain": res.gain}


def run_arm(code: Path, smoke: bool, members: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(code)}
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", "--members", str(members)]
    done = subprocess.run(argv + (["--smoke"] if smoke else []), env=env, cwd=code, capture_output=True, text=True,
                          check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", metavar="REV", help="also measure git revision REV")
    parser.add_argument("--members", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    shape = SMOKE if args.smoke else FULL
    if args.child:
        print(json.dumps(child(shape, args.members)))
        return 0
    arms = {"this tree": ROOT}
    with tempfile.TemporaryDirectory() as tmp:
        if args.before:
            sys.path.insert(0, str(ROOT / "benchmarks"))
            from memory_peak import export_revision

            arms = {f"before ({args.before})": export_revision(args.before, Path(tmp)), **arms}
        results: dict[str, list[dict]] = {label: [] for label in arms}
        for _ in range(1 if args.smoke else args.repeats):
            for label, code in arms.items():
                results[label].append(run_arm(code, args.smoke, args.members))
    print(f"nested_select: {shape['images']} images x {shape['captions']} captions, {shape['dim']} dims, "
          f"{args.members} members")
    for label, runs in results.items():
        secs = ", ".join(f"{r['seconds']:.1f}" for r in runs)
        peaks = ", ".join(f"{r['peak_rss'] / 1e9:.2f}" for r in runs)
        print(f"  {label}: {secs} s; peak RSS {peaks} GB; weights {runs[0]['weights']}, gain {runs[0]['gain']:+.4f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
