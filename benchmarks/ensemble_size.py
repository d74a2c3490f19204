"""Benchmark: what more models buy an ensemble, seeds of one config against different configs (issue 19).

On image-disjoint holdouts of the demo data (`latentsweep data holdout --seed S`), the reference script's model
(benchmarks/reference_script.py: MLP, multi-positive InfoNCE, 40 epochs) is trained with seeds 0..7, and four variants
of it with seeds 0..2: EMA of the weights (decay 0.995 per step), Gaussian input noise (0.5 x the caption's norm over
sqrt(dim) per coordinate), a cosine learning-rate schedule, and a wider, more dropped-out MLP (2048, dropout 0.5).
Each prediction is kept, so every ensemble is scored on the same captions; differences are pooled over the holdouts
with 95% paired bootstrap intervals.

    python benchmarks/ensemble_size.py --work DIR [--seeds 0 1 2 3 4]      # trains (about 75 s per model, 1 thread)
    python benchmarks/ensemble_size.py --work DIR --report                  # the table from the saved predictions
    python benchmarks/ensemble_size.py --smoke    # 1 holdout of tiny synthetic data, 1 epoch per model, a temp dir
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from latentsweep.trainers.data.demo import default_train_path  # noqa: E402
from end_to_end import reciprocal_ranks  # noqa: E402  (this script's directory is on sys.path)

VARIANTS = {"base": {}, "ema": {"ema": 0.995}, "noise": {"noise": 0.5}, "cos": {"cos": True},
            "wide": {"hidden": 2048, "drop": 0.5}}
BASE_SEEDS, VARIANT_SEEDS = 8, 3
BOOT = 2000  # bootstrap resamples of the pooled captions
LR, EPOCHS, BATCH, TAU = 1e-3, 40, 256, 0.05  # the reference script's


def train_one(x, img, y, seed: int, v: dict, epochs: int = EPOCHS):
    """The reference script's training loop with the variant's changes; x [N, Dt], img [N], y [Ni, Di] unit rows."""
    import torch  # here, not at the top: --help answers without loading torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    hidden = v.get("hidden", 1024)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.GELU(),
                              torch.nn.Dropout(v.get("drop", 0.2)), torch.nn.Linear(hidden, y.shape[1]))
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=0.01)
    ema = [p.detach().clone() for p in net.parameters()] if v.get("ema") else None
    steps, k = epochs * ((len(x) + BATCH - 1) // BATCH), 0
    for _ in range(epochs):
        for idx in torch.randperm(len(x)).split(BATCH):
            if v.get("cos"):
                for g in opt.param_groups:
                    g["lr"] = LR * 0.5 * (1 + np.cos(np.pi * k / steps))
            k += 1
            xb = x[idx]
            if v.get("noise"):
                xb = xb + v["noise"] * torch.randn_like(xb) * xb.norm(dim=1, keepdim=True) / xb.shape[1] ** 0.5
            uniq, inv = torch.unique(img[idx], return_inverse=True)
            logits = F.normalize(net(xb), dim=1) @ y[uniq].T / TAU               # [B, U]
            pos = (inv[None, :] == torch.arange(len(uniq))[:, None]).float()    # [U, B]
            i2c = -(logits.T.log_softmax(1) * pos).sum(1) / pos.sum(1)
            loss = 0.5 * (F.cross_entropy(logits, inv) + i2c.mean())
            opt.zero_grad(), loss.backward(), opt.step()
            if ema is not None:
                with torch.no_grad():
                    for e, p in zip(ema, net.parameters()):
                        e.mul_(v["ema"]).add_(p, alpha=1 - v["ema"])
    if ema is not None:
        with torch.no_grad():
            for e, p in zip(ema, net.parameters()):
                p.copy_(e)
    return net.eval()


def train_holdout(h: Path, out: Path, epochs: int = EPOCHS) -> None:
    """Every model of one holdout, its test predictions (id order) saved as out/{variant}_s{seed}.npy."""
    import torch
    import torch.nn.functional as F

    z, t = np.load(h / "train.npz"), np.load(h / "test.clean.npz")
    x = torch.tensor(z["captions/embeddings"], dtype=torch.float32)
    img = torch.tensor(np.argmax(z["captions/label"], axis=1))
    y = F.normalize(torch.tensor(z["images/embeddings"], dtype=torch.float32), dim=1)
    xt = torch.tensor(t["captions/embeddings"], dtype=torch.float32)
    order = np.argsort(t["captions/ids"], kind="stable")
    for name, v in VARIANTS.items():
        for seed in range(BASE_SEEDS if name == "base" else VARIANT_SEEDS):
            path = out / f"{name}_s{seed}.npy"
            if not path.is_file():
                net = train_one(x, img, y, seed, v, epochs)  # trained with autograd on, predicted without
                with torch.no_grad():
                    np.save(path, F.normalize(net(xt), dim=1).numpy()[order])
                print(f"{h.name} {name} seed {seed}", flush=True)


def ensemble_rr(work: Path, holdouts: list[int], names: list[str]) -> list[np.ndarray]:
    """Per holdout: reciprocal ranks of the normalised mean of the named models' predictions."""
    out = []
    for s in holdouts:
        p = sum(np.load(work / f"holdout-{s}" / f"{n}.npy") for n in names)
        p = p / np.linalg.norm(p, axis=1, keepdims=True)
        out.append(reciprocal_ranks(p, work / f"holdout-{s}" / "answers.npz"))
    return out


def paired(a: list[np.ndarray], b: list[np.ndarray], rng) -> str:
    d = np.concatenate(a) - np.concatenate(b)
    lo, hi = np.percentile(d[rng.integers(0, len(d), (BOOT, len(d)))].mean(1), [2.5, 97.5])
    return f"{d.mean():+.4f} [{lo:+.4f}, {hi:+.4f}] | " + " ".join(f"{(x - y).mean():+.3f}" for x, y in zip(a, b))


def seeds(variant: str, n: int) -> list[str]:
    """The saved models of `variant`, seeds 0..n-1."""
    return [f"{variant}_s{s}" for s in range(n)]


def report(work: Path, holdouts: list[int]) -> str:
    rows = {"base, 1 seed": seeds("base", 1), "base, 3 seeds (the reference script)": seeds("base", 3),
            "base, 8 seeds": seeds("base", 8), **{f"{v}, 3 seeds": seeds(v, 3) for v in VARIANTS if v != "base"},
            "5 configs x 1 seed": [f"{v}_s0" for v in VARIANTS],
            "5 configs x 3 seeds": [n for v in VARIANTS for n in seeds(v, 3)]}
    rr = {k: ensemble_rr(work, holdouts, names) for k, names in rows.items()}
    ref, rng = rr["base, 3 seeds (the reference script)"], np.random.default_rng(0)
    lines = [f"{len(holdouts)} holdouts, {sum(map(len, ref))} test captions pooled", "",
             "| ensemble | models | pooled MRR | - reference, 95% paired bootstrap, then per holdout |",
             "|---|---|---|---|"]
    for k, v in rr.items():
        lines.append(f"| {k} | {len(rows[k])} | {np.concatenate(v).mean():.4f} | {paired(v, ref, rng)} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="holdout seeds")
    p.add_argument("--report", action="store_true", help="only print the table from the saved predictions")
    p.add_argument("--smoke", action="store_true",
                   help="one holdout of tiny synthetic data, 1 epoch per model, in a temp dir: the path in seconds")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="ensemble-smoke-") as tmp:
            from latentsweep.trainers.data.synthetic import write_synthetic

            train = write_synthetic(Path(tmp) / "data", 100, captions_per_image=5, dim_text=32, dim_image=48)[0]
            return run(Path(tmp) / "work", [0], False, train, epochs=1)
    if args.work is None:
        p.error("--work is required (or --smoke)")
    return run(args.work, args.seeds, args.report, default_train_path())


def run(work: Path, holdout_seeds: list[int], report_only: bool, train: Path, epochs: int = EPOCHS) -> int:
    """Cut each holdout of `train` (latentsweep data holdout), train its models, print the table."""
    for s in holdout_seeds if not report_only else []:
        h = work / f"holdout-{s}"
        if not (h / "answers.npz").is_file():
            subprocess.run([sys.executable, "-m", "latentsweep", "data", "holdout", str(train), "--seed",
                            str(s), "--out", str(h)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        train_holdout(h, h, epochs)
    print(report(work, holdout_seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
