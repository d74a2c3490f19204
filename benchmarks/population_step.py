"""Population trials' step (issue 38, latentsweep.trainers.train.population): K members of studies/full.toml's [base]
trained in one stacked step, K = 1, 2, 4, 8, 16, 32 by default: ms per step, samples/s summed over members, the MLP's
FLOP rate as a fraction of the float32 matmul rate, peak memory on CUDA, one member's step alone (the loop's own step),
and two members trained one epoch stacked and alone on the device. Each K is timed with each optimiser path
(OPTIMISER_PATHS: every member's own torch optimiser, or latentsweep.trainers.train.stacked_optim with either Adam
backend), interleaved, the best of --repeats. Part (d) of benchmarks/gpu.py.

    python benchmarks/population_step.py [--images 25000] [--ks 1 2 4] [--device cuda]
    python benchmarks/population_step.py --small --threads 1   # narrow layers: per-op overhead bounds the step
    python benchmarks/population_step.py --set train.grad_clip=1.0 --set train.average=ema   # knobs of the space
    python benchmarks/population_step.py --smoke   # tiny data on the CPU, in seconds
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # latentsweep, and throughput beside this file

POPULATION_KS = (1, 2, 4, 8, 16, 32)
POPULATION_STEPS = 10  # timed steps per K (after one untimed step); --smoke: 2
# The optimiser step of a population: label -> train_population's stacked_optim (None: each member's own optimiser).
OPTIMISER_PATHS = {"per-member": None, "stacked kernel": "kernel", "stacked math": "math"}
# --small: the launch-bound proxy on a CPU, where the dispatch overhead of each op stands for a GPU's kernel launch:
# layers narrow enough that a member's arithmetic is a few microseconds (the data's dims, the MLP's width, the batch).
SMALL = {"dim_text": 32, "dim_image": 48, "hidden": "64", "batch": 32}


def population_cfg(data: Path, device: str):
    """studies/full.toml's [base] (the MLP of the search's first trials) on `data` and `device`."""
    import tomllib

    sys.path.insert(0, str(ROOT))
    from latentsweep.trainers.config.tree import from_dict, with_values

    base = from_dict(tomllib.loads((ROOT / "studies" / "full.toml").read_text())["base"])
    return with_values(base, {"data.path": str(data), "train.device": device})


class _FirstBatches:
    """A task whose epoch is `n` batches, the task's epochs one after another (the alone step timed over a few
    steps; a small data set has fewer batches than that in an epoch)."""

    def __init__(self, task, n: int):
        self.task, self.n = task, n

    def batches(self, gen):
        import itertools

        epochs = (batch for _ in itertools.count() for batch in self.task.batches(gen))
        return itertools.islice(epochs, self.n)


def alone_step_seconds(cfg, data, steps: int) -> float:
    """Seconds per step of one run of `cfg` through latentsweep.trainers.train.loop's own step (_train_epoch), after one
    step."""
    import dataclasses

    import torch
    from latentsweep.trainers.train.checkpoint import CenteredModel
    from latentsweep.trainers.core.devices import resolve_device
    from latentsweep.trainers.train.loop import _BestCheckpoint, _train_epoch, seed_everything
    from latentsweep.trainers.models.zoo import build_model
    from latentsweep.trainers.core.deadline import Deadline
    from latentsweep.trainers.train.run import RunState
    from latentsweep.trainers.train.tasks import TASKS

    device = resolve_device(cfg.train.device)
    gen = seed_everything(0)
    task = TASKS.get(cfg.data.task)(cfg, data, device)
    model = CenteredModel(build_model(cfg, task.model_context()), task.text_mean).to(device)
    run = RunState(cfg, data, device, task, model, gen, time.monotonic(), callback=None, out_dir=None,
                   progress=False, deadline=Deadline.never, best_pt=_BestCheckpoint(None))
    run.begin_epoch()
    _train_epoch(dataclasses.replace(run.parts, task=_FirstBatches(task, 1)), 0)  # float() at its end: synced
    start = time.perf_counter()
    _train_epoch(dataclasses.replace(run.parts, task=_FirstBatches(task, steps)), 0)
    return (time.perf_counter() - start) / steps


def exactness(cfg, data) -> str:
    """Two members (different seeds, learning rates, dropout) trained one epoch stacked and alone: the largest
    relative difference of their epoch metrics (tests/test_population.py checks the same on CPU)."""
    from latentsweep.trainers.config.tree import with_values
    from latentsweep.trainers.train.loop import train
    from latentsweep.trainers.train.population import Member, train_population

    cfgs = [with_values(cfg, {"train.stop_after": 1, "train.seed": seed, "optim.lr": lr, "model.dropout": drop})
            for seed, lr, drop in ((0, 1e-3, 0.0), (1, 3e-3, 0.3))]
    stacked = train_population([Member(c) for c in cfgs], data)
    worst = 0.0
    for c, end in zip(cfgs, stacked):
        if isinstance(end, BaseException):
            return f"failed: {type(end).__name__}: {str(end)[:120]}"
        alone = train(c, data).history[0]
        worst = max(worst, *(abs(end.history[0][k] - v) / max(abs(v), 1e-12) for k, v in alone.items()))
    return f"largest relative difference of 2 members' epoch metrics: {worst:.1e}"


def population_rows(data_path: Path, device: str, smoke: bool, ks: tuple[int, ...], clock=None,
                    values: dict | None = None, repeats: int = 1, steps: int | None = None):
    """(label, value) rows of part (d), yielded as each is measured (a call stopped at its time limit keeps the rows
    so far); a K starts only while `clock` (benchmarks/gpu.py's Clock, None: no bound)
    has 30 s left. `values`: config knobs set on the [base] (with_values); each K's paths are timed `repeats` times,
    interleaved, and the fastest kept (the machine's other load only adds time); `steps` timed steps per K
    (None: POPULATION_STEPS, 2 with `smoke`)."""
    import throughput as tp
    import torch
    from latentsweep.trainers.config.tree import with_values
    from latentsweep.trainers.data.sets import load_train

    dev = torch.device(device)
    cfg = with_values(population_cfg(data_path, device), values or {})
    data = load_train(data_path)
    steps = steps or (2 if smoke else POPULATION_STEPS)
    hidden, batch = cfg.model.hidden, cfg.train.batch_size
    widths = (data.text.shape[1], *hidden, data.image.shape[1])
    flops = 3 * 2 * sum(a * b for a, b in zip(widths[:-1], widths[1:]))  # forward + backward matmuls per sample
    peak = tp.matmul_rate(dev, 128 if smoke else 8192)
    alone = alone_step_seconds(cfg, data, steps)
    yield ("(d) population: config", f"studies/full.toml [base], MLP {'-'.join(map(str, widths))}, batch {batch}, "
                                     f"amp {cfg.train.amp and dev.type == 'cuda'}, {len(data.text):,} captions")
    yield ("(d) one run alone (the loop's step)", f"{alone * 1e3:.1f} ms/step = {batch / alone:,.0f} samples/s = "
                                                  f"{batch * flops / alone / 1e9 / peak:.2f} of the matmul rate")
    for k in ks:
        if clock is not None and not clock.fits(30):
            yield (f"(d) population K={k}", f"skipped: {clock.left():.0f} s left of the budget")
            continue
        try:
            timed = _time_paths(cfg, data, k, steps, repeats)
        except Exception as exc:  # noqa: BLE001 - out of memory at a large K is a measurement
            yield (f"(d) population K={k}", f"failed: {type(exc).__name__}: {str(exc)[:120]}")
            break
        for label, (seconds, peak_bytes) in timed.items():
            rate = k * batch / seconds
            memory = f"; peak {peak_bytes / 2**30:.2f} GiB" if dev.type == "cuda" else ""
            yield (f"(d) population K={k}, {label} optimiser",
                   f"{seconds * 1e3:.2f} ms/step, {rate:,.0f} samples/s summed ({rate / (batch / alone):.2f}x "
                   f"one alone) = {rate * flops / 1e9 / peak:.3f} of the matmul rate{memory}")
        optimiser = {label: min(optimiser_seconds(cfg, data, k, steps, path) for _ in range(max(1, repeats)))
                     for label, path in OPTIMISER_PATHS.items()}
        yield (f"(d) population K={k}, the optimiser part of a step",
               ", ".join(f"{label} {s * 1e3:.2f} ms" for label, s in optimiser.items()))
    if clock is None or clock.fits(30):  # two members' epoch stacked and alone: after the rates, which say more
        yield ("(d) stacked = alone on this device", exactness(cfg, data))


def _time_paths(cfg, data, k: int, steps: int, repeats: int) -> dict[str, tuple[float, int]]:
    """label -> (seconds per stacked step, peak bytes) of K members with each optimiser path, the fastest of
    `repeats` rounds that time every path once."""
    from latentsweep.trainers.train.population import measure

    best: dict[str, tuple[float, int]] = {}
    for _ in range(max(1, repeats)):
        for label, path in OPTIMISER_PATHS.items():
            seconds, peak = measure(cfg, data, k, steps, stacked_optim=path)
            if label not in best or seconds < best[label][0]:
                best[label] = (seconds, peak)
    return best


def optimiser_seconds(cfg, data, k: int, steps: int, path: str | None) -> float:
    """Seconds of the optimiser part of one population step of K members of `cfg` (seeds 0..K-1): from the shared
    backward's grads to the members' updated weights (clipping, AMP scaler, optimiser, schedule, EMA), with each
    member's own objects (`path` None, latentsweep.trainers.train.population_step._after_backward's part) or the
    stacked optimiser (latentsweep.trainers.train.stacked_optim), the same grads each time; after one untimed
    round."""
    import dataclasses

    import torch
    from latentsweep.trainers.train.population import Member, _Population
    from latentsweep.trainers.train.population_step import stacked_step

    pop = _Population(data, progress=False, stacked_optim=path)
    for seed in range(k):
        pop.start(Member(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))))
    for lv in pop.live:
        lv.run.begin_epoch()
        lv.batches = lv.run.task.batches(lv.run.parts.gen)
    stacked_step(pop, [next(lv.batches) for lv in pop.live])  # the stack's grads of one real step
    reads = set(pop.stack.reach)  # every output: each member reaches every parameter
    stepping = {i: pop.stack.reached_names(reads) for i in range(k)}
    sync = torch.cuda.synchronize if pop.cuda is not None else (lambda: None)
    for timed in (False, True):
        sync()
        start = time.perf_counter()
        for _ in range(steps if timed else 1):
            if path is not None:
                pop.optim.step(stepping)
            for i, lv in enumerate(pop.live):
                p = lv.run.parts
                if path is None:
                    pop.stack.grads_to(i, reads)
                    if p.cfg.train.grad_clip > 0:
                        p.scaler.unscale_(p.opt)
                        torch.nn.utils.clip_grad_norm_(lv.run.model.parameters(), p.cfg.train.grad_clip)
                    p.scaler.step(p.opt)
                    p.scaler.update()
                    p.average.after_step()
                p.schedule.after_step()
        sync()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=25_000, help="images of the synthetic data (5 captions each)")
    p.add_argument("--ks", type=int, nargs="+", default=list(POPULATION_KS))
    p.add_argument("--device", default="cuda" if __import__("torch").cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny data on the CPU, K = 1 and 2, in seconds")
    p.add_argument("--small", action="store_true", help=f"narrow layers, the launch-bound proxy on a CPU: {SMALL}")
    p.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE", help="a config knob on the [base]")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: as is)")
    p.add_argument("--repeats", type=int, default=1, help="timings per K and path, the fastest kept")
    p.add_argument("--steps", type=int, default=POPULATION_STEPS, help="timed steps per K and path")
    args = p.parse_args(argv)
    import torch
    from latentsweep.trainers.data.synthetic import write_synthetic

    if args.threads:
        torch.set_num_threads(args.threads)
    values = dict(kv.split("=", 1) for kv in args.set)
    sizes = {"n_images": args.images, "n_test": 20}
    if args.smoke or args.small:
        sizes.update(dim_text=SMALL["dim_text"], dim_image=SMALL["dim_image"])
        values = {"model.hidden": SMALL["hidden"], "train.batch_size": SMALL["batch"], **values}
    if args.smoke:
        sizes["n_images"] = 100
    with tempfile.TemporaryDirectory(prefix="population-step-") as tmp:
        train, _, _ = write_synthetic(Path(tmp), **sizes, seed=0)
        print("| measurement | value |\n|---|---|", flush=True)
        for k, v in population_rows(train, "cpu" if args.smoke else args.device, args.smoke,
                                    (1, 2) if args.smoke else tuple(args.ks), None, values, args.repeats,
                                    2 if args.smoke else args.steps):
            print(f"| {k} | {v} |", flush=True)  # each row as it is measured
    return 0


if __name__ == "__main__":
    sys.exit(main())
