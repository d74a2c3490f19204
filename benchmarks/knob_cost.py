"""Seconds per training epoch for every seed recipe and for each expensive knob, as a ratio of this machine's matmul
rate, at the demo size and at challenge size (25,000 images x 5 captions, 1024 -> 1536, trainers/data/synthetic.py).

Each row trains its config with the real trainer (`latentsweep.trainers.train.loop.train`, validation included) for WARM
+ 1 epochs and
times the last one. At challenge size only a fraction of the captions is kept (every image stays, so the bank and
queue sizes are the real ones) and the epoch time is scaled back to all captions: per-step costs scale with the
caption count, and the [batch x images] products of the queue and all-images losses keep their true width.

Columns: s/epoch; matmul-TFLOP (s/epoch x the machine's float32 matmul GFLOP/s / 1000: the epoch's cost in units of
dense matmul work, comparable across machines); x default (against the InfoNCE MLP default of studies/full.toml).

    python benchmarks/knob_cost.py [--size demo|challenge|both] [--fraction 0.1] [--json OUT]
    python benchmarks/knob_cost.py --smoke    # tiny synthetic data (120 images, 32 -> 48), for tests: every knob row
                                              # and one recipe trained, every recipe's config built; fails on n/a

`--repo PATH` measures another checkout of the project (e.g. an older commit, for a before/after table); a row whose
knob that checkout does not have prints "n/a".
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The default every knob row starts from: the [base] of studies/full.toml (written out, so that an older checkout,
# whose full.toml differs, measures the same configs).
BASE = {"model.kind": "mlp", "model.hidden": "1024", "model.activation": "gelu", "loss.infonce.weight": 1.0,
        "temperature.mode": "fixed", "temperature.tau": 0.05, "optim.name": "adamw", "optim.lr": 1e-3,
        "optim.weight_decay": 0.01, "train.batch_size": 256, "data.val_ratio": 0.2}
# (row name, knob values over BASE); recipes are read from studies/<name>.toml's [base].
KNOBS = [
    ("default: InfoNCE MLP 1024", {}),
    ("multipos_infonce", {"loss.infonce.weight": 0.0, "loss.multipos_infonce.weight": 1.0}),
    ("all_images_infonce", {"loss.infonce.weight": 0.0, "loss.all_images_infonce.weight": 1.0}),
    ("queue 4096", {"loss.infonce.weight": 0.0, "loss.queue_infonce.weight": 1.0, "loss.queue_infonce.size": 4096,
                    "loss.queue_infonce.warmup_epochs": 0}),
    ("queue 16384", {"loss.infonce.weight": 0.0, "loss.queue_infonce.weight": 1.0,
                     "loss.queue_infonce.size": 16384, "loss.queue_infonce.warmup_epochs": 0}),
    ("queue 65536", {"loss.infonce.weight": 0.0, "loss.queue_infonce.weight": 1.0,
                     "loss.queue_infonce.size": 65536, "loss.queue_infonce.warmup_epochs": 0}),
    ("triplet (VSE++ max violation)", {"loss.infonce.weight": 0.0, "loss.triplet.weight": 1.0}),
    ("slots k=1 (+slot losses)", {"slots.k": 1, "loss.slot_infonce.weight": 0.5, "loss.slot_triplet.weight": 0.5}),
    ("slots k=4 (+slot losses)", {"slots.k": 4, "loss.slot_infonce.weight": 0.5, "loss.slot_triplet.weight": 0.5,
                                  "loss.slot_diversity.weight": 0.1}),
    ("EMA", {"train.average": "ema"}),
    ("SWA", {"train.average": "swa", "train.swa_start": 0.0}),
    ("mixup 0.2", {"augment.mixup_alpha": 0.2}),
    ("noise 0.1", {"augment.noise_std": 0.1}),
    ("hidden 2048", {"model.hidden": "2048"}),
    ("deep_mlp 2048,2048", {"model.kind": "deep_mlp", "model.hidden": "2048,2048"}),
    ("residual_mlp 1024", {"model.kind": "residual_mlp"}),
    ("moco_mlp 1024", {"model.kind": "moco_mlp"}),
    ("relative (256 anchors)", {"model.kind": "relative", "model.n_anchors": 256}),
    ("geometry + adapter", {"model.kind": "geometry"}),
    ("batch 128", {"train.batch_size": 128}),
    ("batch 512", {"train.batch_size": 512}),
]
RECIPES = ["quickstart", "baseline_mse", "vsepp_slots", "bigjump", "moco"]
WARM = 1  # epochs before the timed one: the queue fills, caches warm up
SMOKE_RECIPES = ("recipe bigjump",)  # --smoke trains this recipe only (the quickest)


def matmul_gflops(n: int = 2048, reps: int = 10) -> float:
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e9


def challenge_data(work: Path, fraction: float):
    """25,000 images x 5 captions at challenge dims, keeping `fraction` of the captions (every image)."""
    import numpy as np
    from dataclasses import replace

    from latentsweep.trainers.data.sets import load_train
    from latentsweep.trainers.data.synthetic import write_synthetic

    train, _, _ = write_synthetic(work, 25_000, captions_per_image=5, seed=0)
    data = load_train(train)
    keep = np.sort(np.random.default_rng(0).permutation(len(data.cap2img))[: int(fraction * len(data.cap2img))])
    return replace(data, caption_ids=data.caption_ids[keep], text=data.text[keep],
                   cap2img=data.cap2img[keep]), 1.0 / fraction


def epoch_seconds(cfg, data) -> float:
    from latentsweep.trainers.train.loop import train

    stamps: list[float] = []
    start = time.perf_counter()
    train(cfg, data, callback=lambda report: stamps.append(time.perf_counter()))
    stamps.insert(0, start)
    return stamps[-1] - stamps[-2]


def configs() -> list[tuple[str, object]]:
    """(row, Config or the error that prevents it) for every recipe and knob row."""
    from latentsweep.trainers.config.tree import Config, with_values
    from latentsweep.trainers.core.errors import LatentsweepError
    from latentsweep.search.study.studyfile import load_study_file

    full = with_values(Config(), BASE)
    common = {"train.epochs": WARM + 1, "train.early_stop": 0, "train.stop_after": 0, "data.split": "hash"}
    rows = []
    for name in RECIPES:
        try:
            rows.append((f"recipe {name}", with_values(load_study_file(ROOT / "studies" / f"{name}.toml").base,
                                                       common)))
        except LatentsweepError as exc:
            rows.append((f"recipe {name}", exc))
    for name, values in KNOBS:
        try:
            rows.append((name, with_values(full, {**common, **values})))
        except LatentsweepError as exc:
            rows.append((name, exc))
    return rows


def smoke_data(work: Path):
    """Tiny synthetic data (120 images x 5 captions, 32 -> 48): every row's code path in seconds."""
    from latentsweep.trainers.data.sets import load_train
    from latentsweep.trainers.data.synthetic import write_synthetic

    train, _, _ = write_synthetic(work, 120, captions_per_image=5, dim_text=32, dim_image=48, seed=0)
    return load_train(train), 1.0


def measure(size: str, fraction: float) -> list[dict]:
    from latentsweep.trainers.data.sets import load_train
    from latentsweep.trainers.data.demo import default_train_path

    with tempfile.TemporaryDirectory() as tmp:
        if size == "demo":
            data, scale = load_train(default_train_path()), 1.0
        elif size == "smoke":
            data, scale = smoke_data(Path(tmp))
        else:
            data, scale = challenge_data(Path(tmp), fraction)
        rate = matmul_gflops(128 if size == "smoke" else 2048)
        out = []
        for name, cfg in configs():
            if size == "smoke" and name.startswith("recipe") and name not in SMOKE_RECIPES:
                continue  # the recipes' configs are built (above); training them all takes 15 s more, same path
            if isinstance(cfg, Exception):
                out.append({"size": size, "row": name, "seconds": None, "error": str(cfg).splitlines()[0]})
            else:
                seconds = epoch_seconds(cfg, data) * scale
                out.append({"size": size, "row": name, "seconds": seconds, "tflop": seconds * rate / 1e3})
            print(json.dumps(out[-1]), flush=True)
    default = next(r["seconds"] for r in out if r["row"].startswith("default"))
    for r in out:
        r["x_default"] = None if r["seconds"] is None else r["seconds"] / default
    return out


def table(rows: list[dict]) -> str:
    lines = ["| size | config | s/epoch | matmul-TFLOP | x default |", "|---|---|---|---|---|"]
    for r in rows:
        if r["seconds"] is None:
            lines.append(f"| {r['size']} | {r['row']} | n/a | n/a | n/a |")
        else:
            lines.append(f"| {r['size']} | {r['row']} | {r['seconds']:.2f} | {r['tflop']:.2f} | "
                         f"{r['x_default']:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("demo", "challenge", "both"), default="both")
    p.add_argument("--fraction", type=float, default=0.1, help="challenge size: captions kept (default 0.1)")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="every row on tiny synthetic data: the code path in seconds")
    args = p.parse_args(argv)
    sys.path.insert(0, str(args.repo.resolve()))
    sizes = ("demo", "challenge") if args.size == "both" else (args.size,)
    if args.smoke:
        sizes = ("smoke",)
    rows = [r for size in sizes for r in measure(size, args.fraction)]
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    # In this checkout every row must apply: an n/a here is a knob renamed or removed under the benchmark.
    return 1 if args.smoke and any(r["seconds"] is None for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
