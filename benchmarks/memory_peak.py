"""Benchmark: peak RSS of `latentsweep train` and of a 1-trial study at challenge size, over the float arrays' bytes.

Usage: python benchmarks/memory_peak.py [--dir DIR] [--before REV] [--study FILE] [--json OUT]
       python benchmarks/memory_peak.py --smoke    # the same commands on a tiny file in a temp dir (no goal check)
The challenge-size train.npz (25,000 images x 5 captions, 1024 -> 1536, latentsweep.trainers.data.synthetic) is built
once in DIR
(default: a temp dir). Each command runs as a child process; its peak RSS is the ru_maxrss that os.wait4 returns,
which covers the child and every process it waited for (a study's workers). --before REV runs the same commands
on the code of git revision REV too (exported with git archive), for a before/after table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Real challenge train.npz: 25,000 images x 5 captions, text dim 1024, image dim 1536 (shared/data-sources.md).
FULL = {"n_images": 25_000, "captions_per_image": 5, "dim_text": 1024, "dim_image": 1536}
SMOKE = {"n_images": 120, "captions_per_image": 5, "dim_text": 32, "dim_image": 48}  # --smoke: the path, not the RSS
GOAL_RATIO = 2.0  # issue 20: peak RSS of training <= 2x the float arrays


def build(directory: Path, params: dict = FULL) -> Path:
    """The challenge-size (or `params`-size) train.npz in `directory` (reused when present)."""
    path = directory / "train.npz"
    if not path.is_file():
        from latentsweep.trainers.data.synthetic import write_synthetic

        start = time.perf_counter()
        write_synthetic(directory, **params)
        print(f"built {path} in {time.perf_counter() - start:.0f} s", flush=True)
    return path


def float_bytes(path: Path) -> int:
    """Bytes of the float arrays a loader must hold: captions/embeddings + images/embeddings (from the headers)."""
    from latentsweep.trainers.data.sets import describe_npz

    keys = describe_npz(path)["keys"]
    total = 0
    for key in ("captions/embeddings", "images/embeddings"):
        shape, dtype = keys[key]
        total += int(shape[0]) * int(shape[1]) * 4  # loaded as float32 whatever the stored dtype
    return total


def one_epoch_study(source: Path, directory: Path) -> Path:
    """`source`'s study with 1 epoch, 1 trial and no enqueued recipes: one trial at the base config's size."""
    doc = tomllib.loads(source.read_text())
    doc["study"].update(name="memory-peak", n_trials=1)
    doc["base"].setdefault("train", {})["epochs"] = 1
    doc.pop("enqueue", None)
    out = directory / "memory_peak.toml"
    out.write_text(tomli_w.dumps(doc))
    return out


def peak_rss(argv: list[str], code: Path, work: Path) -> tuple[int, float]:
    """(peak RSS bytes, wall s) of `argv` run with the package at `code` (also the cwd, which `python -m` puts
    first on sys.path), state under `work`; the output is shown only if it fails."""
    env = {**os.environ, "PYTHONPATH": str(code), "LATENTSWEEP_STATE_DIR": str(work / "state")}
    start = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(argv, cwd=code, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            log.seek(0)
            sys.exit(f"{' '.join(argv)} failed ({proc.returncode}):\n{log.read().decode()[-3000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start  # Linux reports kilobytes


def commands(study: Path, data: Path, work: Path) -> dict[str, list[str]]:
    cli = [sys.executable, "-m", "latentsweep"]
    return {
        "load only": [sys.executable, "-c", f"from latentsweep.trainers.data.sets import load_train; load_train({str(data)!r})"],
        "train --epochs 1": [*cli, "train", str(study), "--data", str(data), "--epochs", "1", "--quiet",
                             "--out", str(work / "train")],
        "study run (1 trial)": [*cli, "study", "run", str(study), "--data", str(data), "--n-trials", "1",
                                "--state-dir", str(work / "study"), "--quiet"],
    }


def measure(code: Path, study: Path, data: Path) -> dict[str, dict]:
    out = {}
    work = Path(tempfile.mkdtemp(prefix="memory-peak-", dir=study.parent))  # removed with the caller's temp dir
    for name, argv in commands(study, data, work).items():
        rss, wall = peak_rss(argv, code, work)
        out[name] = {"peak_rss": rss, "wall_s": wall}
        print(f"  {name:22s} peak {rss / 1e9:5.2f} GB  ({wall:.0f} s)", flush=True)
    return out


def export_revision(rev: str, directory: Path) -> Path:
    """The tree of git revision `rev`, extracted into directory/src (the code a 'before' run imports)."""
    src = directory / "src"
    src.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return src


def table(results: dict[str, dict], floats: int) -> str:
    labels = list(results)
    rows = [f"| command | {' | '.join(f'{label}: peak RSS (x floats)' for label in labels)} |",
            "|---|" + "---|" * len(labels)]
    for name in next(iter(results.values())):
        cells = [f"{r[name]['peak_rss'] / 1e9:.2f} GB ({r[name]['peak_rss'] / floats:.2f}x)" for r in results.values()]
        rows.append(f"| `{name}` | {' | '.join(cells)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the challenge-size file is built (kept; default: temp dir)")
    parser.add_argument("--before", metavar="REV", help="also measure git revision REV (e.g. main)")
    parser.add_argument("--study", type=Path, default=ROOT / "studies" / "quickstart.toml")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny file in a temp dir: every command runs, the goal is not checked")
    args = parser.parse_args(argv)
    if args.smoke:
        args.dir, args.before = None, None
    with tempfile.TemporaryDirectory(prefix="memory-peak-") as tmp:
        directory = args.dir or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        data = build(directory, SMOKE if args.smoke else FULL)
        floats = float_bytes(data)
        study = one_epoch_study(args.study, Path(tmp))
        print(f"float arrays: {floats / 1e9:.3f} GB; goal: peak <= {GOAL_RATIO:g}x = {GOAL_RATIO * floats / 1e9:.2f} GB")
        results = {}
        if args.before:
            print(f"before ({args.before}):", flush=True)
            results[f"before ({args.before})"] = measure(export_revision(args.before, Path(tmp)), study, data)
        print("this tree:", flush=True)
        results["after" if args.before else "this tree"] = measure(ROOT, study, data)
    print(table(results, floats))
    if args.json:
        args.json.write_text(json.dumps({"float_bytes": floats, "results": results}, indent=2))
    last = results[list(results)[-1]]
    over = [name for name, r in last.items() if name != "load only" and r["peak_rss"] > GOAL_RATIO * floats]
    # a tiny file's floats are far below the interpreter's own RSS: the goal means nothing there
    return 1 if over and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
