"""GPU benchmark for one 15-minute slot (issue 38): the step, populations, trials per minute, a one-budget run.

Printing a markdown table; the parts run in the order a, d, b, c. A command on the lent machine runs at most 10
minutes, so one 15-minute slot takes two calls: `--parts a d b` (about 7 minutes) and `--parts c` (about 6):
  (a) the trainer's epoch (benchmarks/throughput.py: the VSE++ MLP 1024 -> 2048 -> 1536 at batch 512) eager and
      captured (train.capture = compile), against a plain DataLoader loop, as a fraction of the float32 matmul rate;
  (d) population trials (latentsweep.trainers.train.population): K members of studies/full.toml's [base] in one
      stacked step on challenge-size data (25,000 images x 5 captions, 1024 -> 1536, trainers/data/synthetic.py),
      K = 1, 2, 4, 8, 16, 32: ms per step, samples/s summed over members, fraction of the matmul rate, peak memory,
      one member's step alone (the loop's own step), and two members stacked against alone on the card;
  (b) trials per minute of `latentsweep study run studies/full.toml` on that data with the defaults (no device flags:
      every GPU, a worker per 2 cores on each, at most 8) against `--workers 1 --population 1` (one trial at a
      time); `--arms` adds the defaults under MPS (the daemon started for the arm) and one worker's population
      auto: trials complete or pruned within --window seconds of the first start, the run stopped after that;
  (c) `latentsweep run studies/full.toml --time 300` with the defaults on the same data: wall, first answer, test MRR
      against the closed-form floor's, the manifest's winner.
A part that would overrun --budget is skipped and says so.

    python benchmarks/gpu.py [--budget 540] [--window 90] [--parts a d b c] [--run-time 300] [--json OUT]
    python benchmarks/gpu.py --smoke    # on CPU in seconds: (a) and (d) at toy sizes, tiny data written;
                                        # the command lines of (b) and (c) checked by the CLI's parser, not run
    python benchmarks/gpu.py --parts d --images 2804 --ks 1 4   # (d) alone, here on a CPU at demo size

On the lent GPU machine (see ../shared/gpu/README.md): `bash .gpu/setup.sh`, then
`python3 benchmarks/gpu.py --json "$OUT/gpu.json" | tee "$OUT/gpu.md"`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "latentsweep"]
FULL = {"n_images": 25_000, "captions_per_image": 5, "n_test": 1_500}  # challenge dims are the generator's defaults
SMOKE_DATA = {"n_images": 100, "captions_per_image": 5, "n_test": 20, "dim_text": 32, "dim_image": 48}
STOP_GRACE_S = 15  # after the window: in-flight trials may finish, then the run is stopped (they do not count)
LEAD_S = 15  # the study's --timeout is the window and this: its workers' start-up (population sizing) counts in it
START_UP_S = 45  # the most a run's start-up (imports, the challenge-size file) may take before the window
# Trials finishing after this many seconds of an arm count as its steady rate too: by then the workers have started
# and the first trials (enqueued, not prunable before others reach a rung) are behind them (docs/gpu.md, H200).
STEADY_AFTER_S = 30


class Clock:
    """The whole call's budget: a part starts only when its estimate fits in what is left."""

    def __init__(self, budget: float):
        self.end = time.monotonic() + budget

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds


# ---- (a) the training step -------------------------------------------------------------------------------------

def capture_mode() -> str | None:
    """The trainer's compiled step (train.capture = compile, trainers/train/capture.py) when this checkout has it."""
    try:
        from latentsweep.trainers.train.capture import CAPTURES
    except ImportError:
        return None
    return "compile" if "compile" in CAPTURES else None


def step_rows(device: str, smoke: bool, steps: int = 30) -> list[tuple[str, str]]:
    """(label, value) rows of part (a), from benchmarks/throughput.py's measurements."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput as tp

    dims, dev = (tp.SMOKE if smoke else tp.CHALLENGE), torch.device(device)
    steps = 3 if smoke else steps
    warm = tp.TrainerEpoch(dev, 2, dims)
    warm.run()  # allocator, kernels, fused-optimiser state
    epoch = tp.TrainerEpoch(dev, steps, dims)
    peak = tp.matmul_rate(dev, dims.matmul if smoke else 8192)
    ours = max(epoch.run() for _ in range(2))
    theirs = tp.dataloader_loop(dev, steps, dims)
    gflops = ours * dims.flops_per_sample() / 1e9
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    rows = [("device", f"{name}, batch {dims.batch}, MLP {dims.text}-{dims.hidden}-{dims.image}"),
            ("float32 matmul rate", f"{peak:,.0f} GFLOP/s"),
            ("trainer epoch, eager", f"{ours:,.0f} samples/s = {gflops:,.0f} GFLOP/s = {gflops / peak:.2f} of the "
                                     "matmul rate"),
            ("DataLoader(TensorDataset) loop", f"{theirs:,.0f} samples/s; trainer / DataLoader = {ours / theirs:.2f}")]
    mode = capture_mode()
    if smoke:  # inductor's C++ compile is minutes on 2 loaded cores; tests/test_capture.py runs the compiled step
        rows.append(("trainer epoch, captured", "not run (--smoke)"))
    else:
        rows.append(("trainer epoch, captured", "n/a: no train.capture = compile in this checkout" if mode is None
                     else captured_rate(dev, steps, dims, mode, ours)))
    return rows


def captured_rate(dev, steps: int, dims, mode: str, eager: float) -> str:
    """The same epoch with train.capture = `mode`; the warm-up epoch takes the compile."""
    import throughput as tp

    tp.TrainerEpoch(dev, 2, dims, mode).run()
    epoch = tp.TrainerEpoch(dev, steps, dims, mode)
    rate = max(epoch.run() for _ in range(2))
    return f"{rate:,.0f} samples/s = {rate / eager:.2f}x eager (step: {epoch.parts.forward.path})"


# ---- (b) trials per minute: the defaults against one trial at a time ----------------------------------------------

ARMS = {"defaults": [],  # issue 38's arms: the defaults (a worker per 2 cores on each GPU, at most 8) against one
        "defaults under MPS": [],  # trial at a time; the defaults with NVIDIA's MPS daemon started for the arm;
        "one worker, population auto": ["--workers", "1", "--population", "auto"],  # and the stacked population
        "one at a time": ["--workers", "1", "--population", "1"]}
DEFAULT_ARMS = ["defaults", "one at a time"]
MPS_CONTROL = "nvidia-cuda-mps-control"


@contextlib.contextmanager
def mps(on: bool):
    """NVIDIA's MPS control daemon for an arm (started and stopped here, unless one already listens)."""
    from latentsweep.search.study.devices import mps_running

    started = on and not mps_running() and shutil.which(MPS_CONTROL) is not None
    if started:
        subprocess.run([MPS_CONTROL, "-d"], check=True)
        time.sleep(2)  # the daemon's socket appears asynchronously
    try:
        yield
    finally:
        if started:
            subprocess.run([MPS_CONTROL], input="quit\n", text=True, check=False)
            time.sleep(2)


def study_run_argv(data: Path, flags: list[str], window: float, state: Path) -> list[str]:
    return [*CLI, "study", "run", str(ROOT / "studies" / "full.toml"), "--data", str(data), *flags,
            "--timeout", str(window + LEAD_S), "--state-dir", str(state), "--quiet"]


def stop_group(proc: subprocess.Popen, wait_s: float) -> None:
    """Wait up to wait_s, then SIGTERM the run's process group (its workers too), then SIGKILL."""
    try:
        proc.wait(timeout=wait_s)
        return
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=grace)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


class Finished(NamedTuple):
    """An arm's trials counted from its first trial's start."""
    ok: int  # COMPLETE or PRUNED within the window
    failed: int  # FAIL within the window
    size: int  # the largest population a trial trained in
    steady: int  # COMPLETE or PRUNED after STEADY_AFTER_S (the workers' start-up and first trials behind them)
    epoch_s: float | None  # the median seconds of a training epoch of the trials that recorded one


def finished_within(storage: str, window: float) -> Finished:
    """The trials of study `full` in `storage` (an Optuna URL) counted within `window` s of its first trial's start."""
    import statistics

    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    trials = optuna.load_study(study_name="full", storage=storage).trials
    started = [t.datetime_start for t in trials if t.datetime_start]
    if not started:
        return Finished(0, 0, 0, 0, None)
    t0 = min(started)
    ends = {t.number: (t.datetime_complete - t0).total_seconds() for t in trials if t.datetime_complete}
    done = [t for t in trials if t.number in ends and ends[t.number] <= window]
    ok = [t for t in done if t.state.name in ("COMPLETE", "PRUNED")]
    sizes = [(t.user_attrs.get("latentsweep.population") or {}).get("size", 1) for t in trials]
    epochs = [t.user_attrs["timing"]["train_s"] for t in done if (t.user_attrs.get("timing") or {}).get("train_s")]
    return Finished(len(ok), sum(t.state.name == "FAIL" for t in done), max(sizes, default=0),
                    sum(ends[t.number] > STEADY_AFTER_S for t in ok), statistics.median(epochs) if epochs else None)


def trials_per_minute(data: Path, arm: str, window: float, work: Path) -> tuple[str, float]:
    """(row text, trials per minute) of `study run` with the arm's flags for `window` s."""
    name = arm.replace(" ", "-")
    state, log = work / f"arm-{name}", work / f"arm-{name}.log"
    with open(log, "w") as fh:
        with mps("MPS" in arm):
            proc = subprocess.Popen(study_run_argv(data, ARMS[arm], window, state), cwd=ROOT, stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            start = time.monotonic()
            stop_group(proc, window + LEAD_S + STOP_GRACE_S + START_UP_S)  # start-up (imports, data) before the window
    if not (state / "optuna.db").is_file():
        return f"failed (exit {proc.returncode}): {log.read_text()[-300:]!r}", 0.0
    got = finished_within(f"sqlite:///{state / 'optuna.db'}", window)
    plan = re.findall(r"^(using .*)$", log.read_text(), re.M)
    extra = (f", {got.failed} failed" if got.failed else "") + (f"; plan: {plan[0][:160]}" if plan else "")
    rate = got.ok / window * 60
    steady = got.steady / max(window - STEADY_AFTER_S, 1) * 60
    epoch = f", median epoch {got.epoch_s:.2f} s" if got.epoch_s is not None else ""
    return (f"{rate:.1f} trials/min ({got.ok} complete or pruned in {window:.0f} s; {steady:.1f}/min after "
            f"{STEADY_AFTER_S} s{epoch}; largest population {got.size}{extra}; wall {time.monotonic() - start:.0f} s)"
            ), rate


def arm_rows(data: Path, arms: list[str], window: float, work: Path, clock: Clock, smoke: bool) \
        -> list[tuple[str, str]]:
    rows, rates = [], {}
    for arm in arms:
        label = f"(b) study run full.toml, {arm}" + (f" ({' '.join(ARMS[arm])})" if ARMS[arm] else "")
        if smoke and "MPS" in arm:
            rows.append((label, "not run (--smoke): MPS needs CUDA"))
        elif smoke:
            rows.append((label, check_argv(study_run_argv(data, ARMS[arm], window, work / arm))))
        elif clock.fits(window + LEAD_S + STOP_GRACE_S + 30):
            text, rates[arm] = trials_per_minute(data, arm, window, work)
            rows.append((label, text))
        else:
            rows.append((label, f"skipped: {clock.left():.0f} s left of the budget"))
    for arm in (a for a in rates if a != "one at a time" and rates.get("one at a time")):
        rows.append((f"(b) {arm} / one at a time", f"{rates[arm] / rates['one at a time']:.1f}x"))
    return rows


# ---- (c) a one-budget run ----------------------------------------------------------------------------------------

def run_argv(paths: tuple[Path, Path, Path], work: Path, seconds: int) -> list[str]:
    train, test, _ = paths
    return [*CLI, "run", str(ROOT / "studies" / "full.toml"), "--time", str(seconds), "--data", str(train),
            "--test", str(test), "--out", str(work / "run.csv"), "--state-dir", str(work / "run-state")]


def check_argv(argv: list[str]) -> str:
    """--smoke: the command line parsed by the CLI's own parser (its flags still exist), not run: a real `study run`
    or `run` costs a minute of start-up and search on CPU, and `run` takes 60 s at least."""
    sys.path.insert(0, str(ROOT))
    from latentsweep.search.cli.main import build_parser

    build_parser().parse_args([str(a) for a in argv[len(CLI):]])
    return "not run (--smoke): command line accepted by the CLI parser"


def one_budget_run(paths: tuple[Path, Path, Path], work: Path, seconds: int) -> str:
    """`run --time seconds` with the defaults: wall, first answer, test MRR against the floor's, the manifest's
    winner (benchmarks/one_budget.py's readers)."""
    import one_budget as ob

    start = time.monotonic()
    done = subprocess.run(run_argv(paths, work, seconds), cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - start
    (work / "run.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        return f"failed (exit {done.returncode}): {(done.stdout + done.stderr)[-300:]!r}"
    first = re.search(r"first answer ([\d.]+) s into the job", done.stderr)
    plan = re.findall(r"^(using .*)$", done.stderr, re.M)
    verdict = ob.winner(work / "run.csv")
    mrr, floor = ob.score(str(work / "run.csv"), paths[2]), ob.floor_mrr(*paths, work)
    return (f"wall {wall:.0f} s of {seconds}; first answer {first.group(1) if first else '?'} s; test MRR {mrr:.4f}, "
            f"floor {floor:.4f}; winner on val: {verdict['winner']} ({verdict['winner_val']}); "
            f"plan: {plan[0][:120] if plan else '-'}")


# ---- the call ----------------------------------------------------------------------------------------------------

def write_data(work: Path, smoke: bool, images: int | None = None) -> tuple[Path, Path, Path]:
    sys.path.insert(0, str(ROOT))
    from latentsweep.trainers.data.synthetic import write_synthetic

    sizes = SMOKE_DATA if smoke else FULL
    return write_synthetic(work / "data", **(sizes | ({"n_images": images} if images else {})), seed=0)


class Rows(list):
    """The table's rows, written to --json as each part ends: a call stopped at its limit keeps what it measured."""

    def __init__(self, path: Path | None):
        super().__init__()
        self.path = path

    def __iadd__(self, rows):
        super().__iadd__(rows)
        if self.path:
            self.path.write_text(json.dumps(dict(self), indent=2))
        return self

    def append(self, row) -> None:
        self += [row]


def measure(args: argparse.Namespace, work: Path) -> Rows:
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    clock, parts, rows = Clock(args.budget), set(args.parts), Rows(args.json)
    if "a" in parts:
        rows += step_rows("cuda" if cuda else "cpu", args.smoke)
    start = time.monotonic()
    paths = write_data(work, args.smoke, args.images)
    rows.append(("synthetic data", f"{paths[0].stat().st_size / 2**20:,.0f} MB written in "
                                   f"{time.monotonic() - start:.0f} s"))
    ks = tuple(args.ks or ((1, 2, 4) if args.smoke else (1, 2, 4, 8, 16, 32)))
    if "d" in parts:
        import population_step

        for row in population_step.population_rows(paths[0], "cuda" if cuda else "cpu", args.smoke, ks, clock):
            rows.append(row)  # written to --json as each is measured
    if "b" in parts:
        rows += arm_rows(paths[0], args.arms, args.window, work, clock, args.smoke)
    if "c" in parts:
        label = f"(c) run full.toml --time {args.run_time}, the defaults"
        if args.smoke:
            rows.append((label, check_argv(run_argv(paths, work, args.run_time))))
        elif clock.fits(args.run_time + 40):
            rows.append((label, one_budget_run(paths, work, args.run_time)))
        else:
            rows.append((label, f"skipped: {clock.left():.0f} s left of the budget"))
    return rows


def table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| measurement | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--budget", type=float, default=540, help="seconds for the whole call (default 540)")
    p.add_argument("--window", type=float, default=90,
                   help="seconds of trials counted per arm, from its first trial's start (default 90)")
    p.add_argument("--parts", nargs="+", choices="abcd", default=list("abcd"),
                   help="(a) step, (d) population, (b) trials per minute, (c) run; run in the order a, d, b, c")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=DEFAULT_ARMS,
                   help=f"the arms of (b) (default: {', '.join(DEFAULT_ARMS)})")
    p.add_argument("--run-time", type=int, default=300, help="seconds of (c)'s run (default 300)")
    p.add_argument("--work", type=Path, help="keep the data, states and logs here (default: a temp dir)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--ks", type=int, nargs="+", help="population sizes of (d) (default 1 2 4 8 16 32)")
    p.add_argument("--images", type=int, help="images of the synthetic data (default: the challenge's 25,000)")
    p.add_argument("--smoke", action="store_true",
                   help="on CPU in seconds: (a) at toy sizes, tiny data, (b) and (c) command lines parsed, not run")
    args = p.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # latentsweep, and throughput/one_budget beside this file
    if args.smoke:
        args.work = None
    with tempfile.TemporaryDirectory(prefix="gpu-bench-") as tmp:
        rows = measure(args, args.work or Path(tmp))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
