"""Benchmark: does one knob change help a recipe, decided on several image-disjoint holdouts with a paired interval.

For each holdout seed S (`latentsweep data holdout DEMO --seed S`) and each arm, `latentsweep train STUDY --set ...`
trains the study's [base] config with the arm's overrides (its own train/val split of the holdout's labelled images,
early stopping on val), `latentsweep predict` writes its submission for the held-out captions, and every caption's
reciprocal rank is kept. Each arm is compared with its control (the same overrides without the change) over the
pooled captions with a 95% paired bootstrap interval, and per holdout.

An arm is NAME=KEY=VALUE[,KEY=VALUE...]; `--change KEY=VALUE,...` is added to every arm to make its "+change" twin:

    python benchmarks/knob_ab.py --work DIR --study studies/full.toml \\
        --arm infonce= --arm ref=loss.infonce.weight=0,loss.multipos_infonce.weight=1,model.dropout=0.2 \\
        --change train.average=ema,train.ema_decay=0.995

    python benchmarks/knob_ab.py --smoke    # 1 arm (1 epoch, MLP 32), 1 holdout of tiny synthetic data, a temp dir
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from latentsweep.trainers.data.demo import default_train_path  # noqa: E402
from end_to_end import BOOT, CLI, paired, sh, submission_rr  # noqa: E402  (this script's directory is on sys.path)


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name=k=v,k=v' -> (name, ['k=v', 'k=v']); 'name=' is the study's base config unchanged."""
    name, _, sets = text.partition("=")
    return name, [s for s in sets.split(",") if s]


def holdout(work: Path, seed: int, train: Path | None = None) -> Path:
    out = work / f"holdout-{seed}"
    sh([*CLI, "data", "holdout", train or default_train_path(), "--seed", seed, "--out", out], work / "log.txt",
       out / "answers.npz")
    return out


def arm_rr(h: Path, study: str, name: str, sets: list[str], seed: int) -> np.ndarray:
    """Reciprocal ranks of one arm on one holdout (trained once; a rerun reuses its submission). Commands' output
    goes to the holdout's log.txt."""
    out, log = h / f"{name}-s{seed}", h / "log.txt"
    sh([*CLI, "train", study, "--data", h / "train.npz", "--quiet", "--seed", seed, "--out", out,
        "--state-dir", h / "state", *[a for s in sets for a in ("--set", s)]], log, out / "best.pt")
    sh([*CLI, "predict", out / "best.pt", "--test", h / "test.clean.npz", "--out", out / "sub.csv"], log,
       out / "sub.csv")
    return submission_rr(out / "sub.csv", h / "answers.npz")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path)
    p.add_argument("--study", default=str(ROOT / "studies" / "full.toml"))
    p.add_argument("--arm", action="append", help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable)")
    p.add_argument("--change", help="KEY=VALUE[,...] added to every arm")
    p.add_argument("--holdouts", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--seed", type=int, default=0, help="training seed of every model")
    p.add_argument("--smoke", action="store_true",
                   help="1 arm (1 epoch, MLP 32) on 1 holdout of tiny synthetic data, in a temp dir")
    a = p.parse_args(argv)
    if a.smoke:
        with tempfile.TemporaryDirectory(prefix="knob-ab-smoke-") as tmp:
            from latentsweep.trainers.data.synthetic import write_synthetic

            a.work, a.holdouts = Path(tmp), [0]
            a.arm, a.change = ["tiny=train.epochs=1,model.hidden=32"], "train.average=ema"
            return compare(a, write_synthetic(Path(tmp) / "data", 100, dim_text=32, dim_image=48)[0])
    if a.work is None or not a.arm or a.change is None:
        p.error("--work, --arm and --change are required (or --smoke)")
    return compare(a)


def compare(a: argparse.Namespace, train: Path | None = None) -> int:
    """Every arm and its +change twin on every holdout of `train` (default: the demo data); prints one line each."""
    change = parse_arm(f"x={a.change}")[1]
    rng = np.random.default_rng(0)
    for name, sets in map(parse_arm, a.arm):
        base, plus = [], []
        for s in a.holdouts:
            h = holdout(a.work, s, train)
            base.append(arm_rr(h, a.study, name, sets, a.seed))
            plus.append(arm_rr(h, a.study, f"{name}+change", sets + change, a.seed))
        per = " ".join(f"{np.mean(x) - np.mean(b):+.3f}" for x, b in zip(plus, base))
        pooled_b, pooled_p = np.concatenate(base), np.concatenate(plus)
        print(f"{name}: {pooled_b.mean():.4f} -> {pooled_p.mean():.4f}  change {paired(pooled_p, pooled_b, rng)}"
              f" | per holdout {per}  ({len(pooled_b)} captions, {BOOT} resamples)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
