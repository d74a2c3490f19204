"""Benchmark: peak RSS of `latentsweep train`, of a 1-trial study and of a one-budget job at challenge size, over the
float arrays' bytes.

Usage: python benchmarks/memory_peak.py [--dir DIR] [--before REV] [--study FILE] [--json OUT]
       python benchmarks/memory_peak.py --one-budget 300 [--dir DIR] [--before REV] [--keep STATE]  # `run --time 300`
       python benchmarks/memory_peak.py --pick-state STATE [--pick-study full] [--dir DIR] [--before REV]  # the pick
       python benchmarks/memory_peak.py --smoke    # the same commands on a tiny file in a temp dir (no goal check)
The challenge-size train.npz (25,000 images x 5 captions, 1024 -> 1536, latentsweep.trainers.data.synthetic; with
5,000 test captions for --one-budget) is built once in DIR (default: a temp dir). Each command runs as a child
process; its peak RSS is the ru_maxrss that os.wait4 returns, which covers the child and every process it waited for
(a study's workers). --before REV runs the same commands on the code of git revision REV too (exported with git
archive), for a before/after table. --one-budget SECONDS runs `latentsweep run studies/full.toml --time SECONDS` with
its defaults instead (goal: 2.5x the floats, issue 38), in a child that samples its own RSS (anonymous and
file-backed) every 20 ms and names the step running at each sample (the library's functions wrapped from outside,
STEPS): each step's peak is printed. --pick-state STATE measures the pick of a one-budget run alone, on a copy of a
state directory whose study has trials with checkpoints (`study run` or `run` on the challenge-size file in DIR): in a
child that loads the data and reads every page of it (as the run's trials did before its pick), scores the floor, then
runs the pick with the run's gate, by step as above (a state written by --before's code, which may not read newer
checkpoints).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import tomli_w

ROOT = Path(__file__).resolve().parents[1]
if sys.argv[1:2] not in (["--child-trace"], ["--child-pick"]):  # a child measures its PYTHONPATH's code (--before's)
    sys.path.insert(0, str(ROOT))

# Real challenge train.npz: 25,000 images x 5 captions, text dim 1024, image dim 1536 (shared/data-sources.md).
FULL = {"n_images": 25_000, "captions_per_image": 5, "dim_text": 1024, "dim_image": 1536}
SMOKE = {"n_images": 120, "captions_per_image": 5, "dim_text": 32, "dim_image": 48}  # --smoke: the path, not the RSS
GOAL_RATIO = 2.0  # issue 20: peak RSS of training <= 2x the float arrays
JOB_GOAL_RATIO = 2.5  # issue 38: peak RSS of `run --time` at challenge size <= 2.5x the float arrays
TEST_CAPTIONS = {"full": 5_000, "smoke": 50}  # the one-budget job's test file (docs/trial-costs.md's real-size file)
SAMPLE_S = 0.02  # the one-budget child's RSS sampling period
WHERE_FRAMES = 4  # frames of each thread recorded at a step's new peak (its `where`)
OUR_PATHS = ("latentsweep", "/trainers/", "/search/")  # a frame of the measured package (this tree or --before's)
JOB_SMOKE_S = 20  # --smoke's `run --time` (tests only: below the product's 60-s minimum)
PICK_BUDGET_S = 900  # --pick-state: the pick's deadline (a `run --time 1200` leaves it 150-600 s)
PICK_FLOOR_ALPHA = 0.1  # --pick-state: the floor's ridge strength (the one the challenge-size file's floor chose)
# The steps of a one-budget job a sample is labelled with: (module, function or Class.method, label). A name the
# measured code lacks (--before an older revision) is skipped.
STEPS = (
    ("latentsweep.trainers.data.sets", "load_train_shared", "data"),
    ("latentsweep.search.pick.safe", "ridge_answer", "floor"),
    ("latentsweep.trainers.models.closed_form", "fit_ridge", "fit"),
    ("latentsweep.trainers.eval.submission", "check_submission", "check csv"),
    ("latentsweep.search.pick.judge", "make_judge", "judge"),
    ("latentsweep.search.pick.judge", "Judge.score_floor", "score floor"),
    ("latentsweep.search.pick.judge", "Judge.score_models", "score models"),
    ("latentsweep.trainers.train.loop", "train", "trial"),
    ("latentsweep.trainers.models.knn", "KernelTranslator.__init__", "knn build"),
    ("latentsweep.trainers.train.tasks", "TranslateTask.evaluate", "validate"),
    ("latentsweep.trainers.train.loop", "_train_epoch", "epoch"),
    ("latentsweep.trainers.train.loop", "_save_best", "save"),
    ("latentsweep.search.study.objective", "TrialRunner._close", "trial close"),
    ("latentsweep.search.pick.safe", "Keeper._consider", "keeper"),
    ("latentsweep.search.pick.picker", "pick_until", "pick"),
    ("latentsweep.search.pick.picker", "load_inputs", "inputs"),
    ("latentsweep.search.pick.picker", "choose", "selection"),
    ("latentsweep.search.pick.jobs", "run_job", "refit"),
    ("latentsweep.search.pick.picker", "write_outputs", "outputs"),
    ("latentsweep.search.pick.ensemble", "predict_all", "predict"),
    ("latentsweep.search.pick.oof", "nested_select", "nested selection"),
)


def build(directory: Path, params: dict = FULL) -> Path:
    """The challenge-size (or `params`-size) train.npz in `directory` (reused when present, with its test.clean.npz
    when `params` asks for test captions)."""
    path = directory / "train.npz"
    if not path.is_file() or (params.get("n_test") and not (directory / "test.clean.npz").is_file()):
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


def peak_rss(argv: list[str], code: Path, work: Path, env: dict | None = None) -> tuple[int, float]:
    """(peak RSS bytes, wall s) of `argv` run with the package at `code` (also the cwd, which `python -m` puts
    first on sys.path), state under `work`, `env` added to the environment; the output is shown only if it fails."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(code), "LATENTSWEEP_STATE_DIR": str(work / "state")}
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


def _status() -> dict[str, int]:
    """This process's resident bytes now: VmRSS, RssAnon (its own pages) and RssFile (mapped files: the data cache,
    a mapped checkpoint, libraries)."""
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS", "RssAnon", "RssFile")))
    return {key: int(value.split()[0]) * 1024 for key, value in fields.items()}


def _label_steps(stacks: dict[int, list[str]]) -> None:
    """Wrap STEPS so that each thread's running steps are in stacks[thread] (every module that imported a function by
    name gets the wrapper too)."""
    import functools
    import importlib
    import threading

    def wrap(fn, label):
        @functools.wraps(fn)
        def step(*args, **kwargs):
            stack = stacks.setdefault(threading.get_ident(), [])
            stack.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()
        return step

    for module, name, label in STEPS:
        owner_name, _, attr = name.rpartition(".")
        try:
            owner = importlib.import_module(module)
            owner = getattr(owner, owner_name) if owner_name else owner
            fn = getattr(owner, attr)
        except (ImportError, AttributeError):  # not in the measured revision
            continue
        step = wrap(fn, label)
        setattr(owner, attr, step)
        for other in list(sys.modules.values()) if not owner_name else ():
            if getattr(other, "__name__", "").startswith("latentsweep") and getattr(other, attr, None) is fn:
                setattr(other, attr, step)


def child_trace(out: str, argv: list[str]) -> int:
    """Run `latentsweep ARGV` in this process (its clock from the process's start, as the CLI's), sampling its RSS
    every SAMPLE_S with the steps running then (each thread's, outermost first); write {label: peak} to `out`."""
    import latentsweep.search.cli.run  # noqa: F401 - the job's modules, imported before their steps are wrapped
    import latentsweep.search.pick.picker  # noqa: F401
    import latentsweep.search.study.runner  # noqa: F401
    from latentsweep.search.cli.main import main

    sys.argv = ["latentsweep", *argv]
    return traced(out, main)


def _where(stacks: dict[int, list[str]]) -> list[str]:
    """The innermost WHERE_FRAMES latentsweep frames (file:line function) of each thread running a step: what held
    the memory at a step's new peak. Read from faulthandler's dump of every thread's stack, never through frame
    objects: a frame object taken from a running thread (sys._current_frames) keeps its locals alive once that frame
    returns, until the object is collected, and did so here: the pick measured 1.63 GB of anonymous memory with them
    taken, 0.97 GB without (docs/memory.md, "sixth round")."""
    import faulthandler
    import re
    import tempfile

    with tempfile.TemporaryFile("w+") as fh:
        faulthandler.dump_traceback(fh, all_threads=True)
        fh.seek(0)
        dump = fh.read()
    out = []
    for block in dump.split("\n\n"):
        head = re.search(r"[Tt]hread (0x[0-9a-f]+)", block)
        if head is None or not stacks.get(int(head.group(1), 16)):
            continue
        lines = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', block)
        mine = [f"{Path(name).name}:{line} {func}" for name, line, func in lines
                if any(part in name for part in OUR_PATHS)]
        out += mine[:WHERE_FRAMES]
    return out


def traced(out: str, run) -> int:
    """run() with STEPS labelled and this process's RSS sampled every SAMPLE_S; {label: peak} written to `out`."""
    import threading

    stacks: dict[int, list[str]] = {}
    peaks: dict[str, dict] = {}
    stop = threading.Event()

    def sample() -> None:
        start = time.monotonic()
        while not stop.wait(SAMPLE_S):
            label = " | ".join("/".join(s) for s in list(stacks.values()) if s) or "between steps"
            now = {**_status(), "t": time.monotonic() - start}
            peak = peaks.setdefault(label, {**now, "first_s": now["t"]})
            if now["VmRSS"] > peak["VmRSS"]:
                peak.update(now, where=_where(stacks))

    _label_steps(stacks)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        return run()
    finally:
        stop.set()
        sampler.join()
        Path(out).write_text(json.dumps(peaks))


def child_pick(out: str, state: str, study: str, study_file: str, data: str, test: str) -> int:
    """The pick of a one-budget run on `state` (traced as child_trace): the data loaded (its rows read from the file as
    the run reads them, latentsweep.trainers.core.pages.take); the judge and the floor's score; pick_until with the
    run's gate."""
    from latentsweep.search.pick import onebudget
    from latentsweep.search.pick.judge import Standing, make_judge
    from latentsweep.search.pick.options import PickOptions
    from latentsweep.search.pick.picker import pick_until
    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.trainers.core.deadline import Deadline
    from latentsweep.trainers.core.errors import LatentsweepError
    from latentsweep.trainers.data.sets import load_train_shared

    def pick() -> int:
        loaded = load_train_shared(data)
        judge = make_judge(load_study_file(Path(study_file)).base, loaded)
        standing = Standing("the closed-form ridge", judge.score_floor(loaded, PICK_FLOOR_ALPHA))
        opts = PickOptions(study=study, state_dir=state, data=data, test=test, out=f"{state}/picks/{study}/sub.csv",
                           register=study, progress=False)
        try:
            made = pick_until(opts, Deadline.after(PICK_BUDGET_S), onebudget._gate(judge, standing))
        except LatentsweepError as exc:  # not a state with a study's trials (its parent folder given?): said
            print(f"  no pick: {exc}", flush=True)
            return 1
        print(f"  the pick {'wrote its ensemble' if made else 'lost to the floor (nothing written)'}", flush=True)
        return 0

    return traced(out, pick)


def pick_peak(code: Path, state: Path, study: str, study_file: Path, data: Path, work: Path) -> dict:
    """child_pick with the code at `code` on a copy of `state` (the pick writes into its state): peak RSS (wait4),
    wall seconds and each step's peak."""
    work.mkdir(parents=True, exist_ok=True)
    copy, steps = work / "state", work / "steps.json"
    shutil.copytree(state, copy)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child-pick", str(steps), str(copy), study,
            str(study_file), str(data), str(data.parent / "test.clean.npz")]
    rss, wall = peak_rss(argv, code, work)
    print(f"  pick: peak {rss / 1e9:.2f} GB ({wall:.0f} s)", flush=True)
    return {"peak_rss": rss, "wall_s": wall, "steps": json.loads(steps.read_text())}


def pick_main(args, tmp: Path, state: Path, data: Path) -> int:
    """--pick-state: the pick alone on a copy of the state, this tree and --before's."""
    floats = float_bytes(data)
    goal = JOB_GOAL_RATIO * floats
    print(f"float arrays: {floats / 1e9:.3f} GB; goal: peak <= {JOB_GOAL_RATIO:g}x = {goal / 1e9:.2f} GB", flush=True)
    results = {}
    for label, code in ([(f"before ({args.before})", None)] if args.before else []) + [("this tree", ROOT)]:
        print(f"{label}:", flush=True)
        code = code or export_revision(args.before, tmp / "before")
        results[label] = pick_peak(code, state, args.pick_study, code / "studies" / args.pick_file, data,
                                   tmp / label.split()[0])
    for label, r in results.items():
        print(f"\n{label}: the pick peaked at {r['peak_rss'] / 1e9:.2f} GB = {r['peak_rss'] / floats:.2f}x the floats "
              f"in {r['wall_s']:.0f} s\n{steps_table(r, floats)}")
    if args.json:
        args.json.write_text(json.dumps({"float_bytes": floats, "results": results}, indent=2))
    return 0 if args.smoke or results["this tree"]["peak_rss"] <= goal else 1


def one_budget(code: Path, data: Path, seconds: int, work: Path, env: dict | None = None) -> dict:
    """`latentsweep run studies/full.toml --time SECONDS` on `data` with the code at `code`: its peak RSS (wait4) and
    each step's peak (child_trace)."""
    work.mkdir(parents=True, exist_ok=True)
    steps = work / "steps.json"
    argv = [sys.executable, str(Path(__file__).resolve()), "--child-trace", str(steps), "--", "run",
            str(code / "studies" / "full.toml"), "--time", str(seconds), "--data", str(data), "--state-dir",
            str(work / "state"), "--quiet"]
    rss, wall = peak_rss(argv, code, work, env)
    print(f"  run --time {seconds}: peak {rss / 1e9:.2f} GB ({wall:.0f} s)", flush=True)
    return {"peak_rss": rss, "wall_s": wall, "steps": json.loads(steps.read_text())}


def steps_table(result: dict, floats: int) -> str:
    """Each step's peak RSS (x floats) with its anonymous and file-backed parts, in the order the steps began."""
    rows = ["| step (innermost last; a keeper thread's after a bar) | peak RSS (x floats) | anon | file | at s |",
            "|---|---|---|---|---|"]
    for label, p in sorted(result["steps"].items(), key=lambda kv: kv[1]["first_s"]):
        rows.append(f"| {label} | {p['VmRSS'] / 1e9:.2f} GB ({p['VmRSS'] / floats:.2f}x) | "
                    f"{p['RssAnon'] / 1e9:.2f} | {p['RssFile'] / 1e9:.2f} | {p['t']:.0f} |")
    label, top = max(result["steps"].items(), key=lambda kv: kv[1]["VmRSS"])
    return "\n".join(rows + [f"\nat the peak ({label}): " + " < ".join(top.get("where", []))])


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


def job_main(args, tmp: Path) -> int:
    """--one-budget (and the smoke's job): `run --time` on the file with test captions, this tree and --before's."""
    size, name = (SMOKE, "smoke") if args.smoke else (FULL, "full")
    data = build(args.dir or tmp, {**size, "n_test": TEST_CAPTIONS[name]})
    floats = float_bytes(data)
    seconds, env = args.one_budget, None
    if args.smoke:  # below the product's 60-s minimum, tests only (latentsweep.search.process.least_time)
        from latentsweep.search.process import TEST_MIN_TIME_ENV

        seconds, env = JOB_SMOKE_S, {TEST_MIN_TIME_ENV: str(JOB_SMOKE_S)}
    goal = JOB_GOAL_RATIO * floats
    print(f"float arrays: {floats / 1e9:.3f} GB; goal: peak <= {JOB_GOAL_RATIO:g}x = {goal / 1e9:.2f} GB", flush=True)
    results = {}
    if args.before:
        print(f"before ({args.before}):", flush=True)
        results[f"before ({args.before})"] = one_budget(export_revision(args.before, tmp), data, seconds,
                                                        tmp / "before", env)
    print("this tree:", flush=True)
    results["after" if args.before else "this tree"] = one_budget(ROOT, data, seconds,
                                                                  tmp / ("after" if args.before else "this"), env)
    for label, r in results.items():
        verdict = "met" if r["peak_rss"] <= goal else "missed"
        print(f"\n{label}: `run --time {seconds}` peak {r['peak_rss'] / 1e9:.2f} GB = {r['peak_rss'] / floats:.2f}x "
              f"the floats in {r['wall_s']:.0f} s (goal {JOB_GOAL_RATIO:g}x: {verdict})\n{steps_table(r, floats)}")
    if args.json:
        args.json.write_text(json.dumps({"float_bytes": floats, "results": results}, indent=2))
    if args.keep:  # the job's state (its study, checkpoints and picks), for --pick-state
        shutil.copytree(tmp / ("after" if args.before else "this") / "state", args.keep, dirs_exist_ok=True)
    return 0 if args.smoke or results[list(results)[-1]]["peak_rss"] <= goal else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child-trace"]:  # one_budget's child: --child-trace OUT -- latentsweep's arguments
        return child_trace(argv[1], argv[3:])
    if argv[:1] == ["--child-pick"]:  # pick_peak's child: --child-pick OUT STATE STUDY FILE DATA TEST
        return child_pick(*argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the challenge-size file is built (kept; default: temp dir)")
    parser.add_argument("--before", metavar="REV", help="also measure git revision REV (e.g. main)")
    parser.add_argument("--study", type=Path, default=ROOT / "studies" / "quickstart.toml")
    parser.add_argument("--one-budget", type=int, metavar="SECONDS",
                        help="measure `latentsweep run studies/full.toml --time SECONDS` by step instead (goal 2.5x)")
    parser.add_argument("--pick-state", type=Path, metavar="STATE",
                        help="measure the pick of a one-budget run alone, on a copy of this state directory")
    parser.add_argument("--pick-study", default="full", help="--pick-state: the study's name (default full)")
    parser.add_argument("--pick-file", default="full.toml",
                        help="--pick-state: its study file under studies/ (the judge's split; default full.toml)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--keep", type=Path, metavar="STATE", help="--one-budget: copy the job's state here")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny file in a temp dir: every command runs, the goal is not checked")
    args = parser.parse_args(argv)
    if args.smoke:
        args.dir, args.before = None, None
    with tempfile.TemporaryDirectory(prefix="memory-peak-") as tmp:
        if args.one_budget:
            return job_main(args, Path(tmp))
        if args.pick_state:
            return pick_main(args, Path(tmp), args.pick_state, build(args.dir or Path(tmp), {**FULL, "n_test": 5_000}))
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
        if args.smoke:  # the one-budget job's path too, then the pick alone on a 2-trial study's state
            job_main(args, Path(tmp) / "job")
            job_data, state = Path(tmp) / "job" / "train.npz", Path(tmp) / "pick-state"
            peak_rss([sys.executable, "-m", "latentsweep", "study", "run", str(study), "--data", str(job_data),
                      "--n-trials", "2", "--state-dir", str(state), "--quiet"], ROOT, Path(tmp))
            args.pick_study = tomllib.loads(study.read_text())["study"]["name"]
            pick_main(args, Path(tmp) / "pick", state, job_data)
    print(table(results, floats))
    if args.json:
        args.json.write_text(json.dumps({"float_bytes": floats, "results": results}, indent=2))
    last = results[list(results)[-1]]
    over = [name for name, r in last.items() if name != "load only" and r["peak_rss"] > GOAL_RATIO * floats]
    # a tiny file's floats are far below the interpreter's own RSS: the goal means nothing there
    return 1 if over and not args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
