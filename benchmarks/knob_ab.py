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
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainers.demo import default_train_path  # noqa: E402
from end_to_end import BOOT, paired, submission_rr  # noqa: E402  (this script's directory is on sys.path)

CLI = [sys.executable, "-m", "search"]


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name=k=v,k=v' -> (name, ['k=v', 'k=v']); 'name=' is the study's base config unchanged."""
    name, _, sets = text.partition("=")
    return name, [s for s in sets.split(",") if s]


def holdout(work: Path, seed: int) -> Path:
    out = work / f"holdout-{seed}"
    if not (out / "answers.npz").is_file():
        subprocess.run([*CLI, "data", "holdout", str(default_train_path()), "--seed", str(seed), "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return out


def arm_rr(h: Path, study: str, name: str, sets: list[str], seed: int) -> np.ndarray:
    """Reciprocal ranks of one arm on one holdout (trained once; a rerun reuses its submission)."""
    out = h / f"{name}-s{seed}"
    if not (out / "sub.csv").is_file():
        args = [*CLI, "train", study, "--data", str(h / "train.npz"), "--quiet", "--seed", str(seed),
                "--out", str(out), "--state-dir", str(h / "state")]
        for s in sets:
            args += ["--set", s]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        subprocess.run([*CLI, "predict", str(out / "best.pt"), "--test", str(h / "test.clean.npz"),
                        "--out", str(out / "sub.csv")], check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
    return submission_rr(out / "sub.csv", h / "answers.npz")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--study", default=str(ROOT / "studies" / "full.toml"))
    p.add_argument("--arm", action="append", required=True, help="NAME=KEY=VALUE[,KEY=VALUE...] (repeatable)")
    p.add_argument("--change", required=True, help="KEY=VALUE[,...] added to every arm")
    p.add_argument("--holdouts", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--seed", type=int, default=0, help="training seed of every model")
    a = p.parse_args(argv)
    change = parse_arm(f"x={a.change}")[1]
    rng = np.random.default_rng(0)
    for name, sets in map(parse_arm, a.arm):
        base, plus = [], []
        for s in a.holdouts:
            h = holdout(a.work, s)
            base.append(arm_rr(h, a.study, name, sets, a.seed))
            plus.append(arm_rr(h, a.study, f"{name}+change", sets + change, a.seed))
        per = " ".join(f"{np.mean(x) - np.mean(b):+.3f}" for x, b in zip(plus, base))
        pooled_b, pooled_p = np.concatenate(base), np.concatenate(plus)
        print(f"{name}: {pooled_b.mean():.4f} -> {pooled_p.mean():.4f}  change {paired(pooled_p, pooled_b, rng)}"
              f" | per holdout {per}  ({len(pooled_b)} captions, {BOOT} resamples)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
