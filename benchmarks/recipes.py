"""Measure every seed recipe (its study file's [base]) on the demo data against a closed-form ridge baseline.

Same split for all (data.split/val_ratio of each recipe: hash, 0.2), leaderboard protocol on the validation images,
plus the held-out demo test file scored with the challenge protocol through its answer key. Prints a markdown table.

    python benchmarks/recipes.py [--data trainers/data/demo_data/train.npz] [--epochs N] [--only bigjump,moco]
    python benchmarks/recipes.py --smoke    # every recipe for 1 epoch on tiny synthetic data in a temp dir (tests)
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from latentsweep.search.study.studyfile import load_study_file  # noqa: E402
from latentsweep.trainers.eval import metrics  # noqa: E402
from latentsweep.trainers.config.tree import with_values  # noqa: E402
from latentsweep.trainers.data.sets import load_answers, load_test, load_train  # noqa: E402
from latentsweep.trainers.data.demo import DEMO_DIR  # noqa: E402
from latentsweep.trainers.models.geometry import ridge_fit  # noqa: E402
from latentsweep.trainers.train.loop import train  # noqa: E402
from latentsweep.trainers.train.tasks import TASKS, predict  # noqa: E402

RECIPES = ("baseline_mse", "vsepp_slots", "bigjump", "moco", "multilabel_triplet")
RIDGE_LAMBDAS = (0.1, 1.0, 10.0, 100.0, 1000.0)  # a small grid, chosen on val like a user would


def test_score(model, test_path: Path, answers_path: Path) -> float:
    test = load_test(test_path)
    ids, image = load_answers(answers_path)
    order = np.argsort(test.ids)
    pred = predict(model, torch.as_tensor(test.embeddings[order]))
    truth = dict(zip(ids.tolist(), image))
    return metrics.leaderboard_from_ordered(pred, np.stack([truth[i] for i in test.ids[order]]))["mrr"]


def ridge_baseline(cfg, data, test_path: Path, answers_path: Path) -> dict:
    """Closed-form ridge (whitened text, lambda picked on val) on the same split as the recipes."""
    task = TASKS.get("translate")(cfg, data, torch.device("cpu"))
    ctx = task.model_context()
    best = None
    for lam in RIDGE_LAMBDAS:
        w, b = ridge_fit(ctx.fit_x, ctx.fit_y, lam, cfg.geometry.whiten_eps)
        scores = metrics.evaluate(task.val_x.materialize() @ w + b, task.val_images, task.val_img)
        if best is None or scores["mrr"] > best[0]["mrr"]:
            best = (scores, w, b, lam)
    scores, w, b, lam = best
    model = _Linear(w, b)
    return {"val/mrr": scores["mrr"], "val/mrr_global": scores["mrr_global"], "lambda": lam,
            "test/mrr": test_score(model, test_path, answers_path)}


class _Linear(torch.nn.Module):
    def __init__(self, w, b):
        super().__init__()
        self.w, self.b = w, b

    def forward(self, x):
        return {"pred": x @ self.w + self.b}


def run_recipe(name: str, data, epochs: int | None, test_path: Path, answers_path: Path) -> dict:
    study_file = load_study_file(ROOT / "studies" / f"{name}.toml")
    cfg = study_file.base if epochs is None else with_values(study_file.base, {"train.epochs": epochs})
    start = time.perf_counter()
    result = train(cfg, data)
    row = {"recipe": name, "task": cfg.data.task, "epochs": cfg.train.epochs, "best_epoch": result.best_epoch,
           "val/mrr": result.best_metrics["val/mrr"], "seconds": round(time.perf_counter() - start, 1)}
    if cfg.data.task == "translate":
        row["val/mrr_global"] = result.best_metrics["val/mrr_global"]
        row["test/mrr"] = test_score(result.model, test_path, answers_path)
    else:
        row["val/recall@10"] = result.best_metrics.get(f"val/recall@{cfg.eval.recall_k}")
        task = TASKS.get("multilabel")(cfg, data, torch.device("cpu"))
        raw = metrics.label_retrieval(task.val_x, task.val_labels, k=cfg.eval.recall_k)
        row["baseline (raw image features) val/mrr"] = raw["mrr"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEMO_DIR / "train.npz"))
    parser.add_argument("--test", default=str(DEMO_DIR / "test.clean.npz"))
    parser.add_argument("--answers", default=str(DEMO_DIR / "answers.npz"))
    parser.add_argument("--epochs", type=int, help="override every recipe's epochs (quick look)")
    parser.add_argument("--only", help="comma-separated recipe names")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--smoke", action="store_true",
                        help="every recipe for 1 epoch on tiny synthetic data (a temp dir): the code path in seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="recipes-smoke-") as tmp:
            args.data, args.test, args.answers = map(str, smoke_data(Path(tmp)))
            args.epochs = 1
            return report(args)
    return report(args)


def smoke_data(out_dir: Path) -> tuple[Path, Path, Path]:
    """A tiny challenge-shaped train / test / answers set with image labels (the multilabel recipe needs them)."""
    from latentsweep.trainers.data.synthetic import write_synthetic

    return write_synthetic(out_dir, 150, captions_per_image=3, dim_text=32, dim_image=48, n_labels=6, n_test=30)


def report(args: argparse.Namespace) -> int:
    """Train and score every recipe and the ridge baseline; print the rows and the table."""
    data = load_train(args.data)
    names = args.only.split(",") if args.only else RECIPES
    rows = []
    base = load_study_file(ROOT / "studies" / "vsepp_slots.toml").base
    ridge = ridge_baseline(base, data, Path(args.test), Path(args.answers))
    rows.append({"recipe": f"ridge (closed form, lambda={ridge['lambda']})", "task": "translate", **ridge})
    print(json.dumps(rows[-1]), flush=True)
    for name in names:
        rows.append(run_recipe(name, data, args.epochs, Path(args.test), Path(args.answers)))
        print(json.dumps(rows[-1]), flush=True)
    print("\n| recipe | val MRR (leaderboard) | val MRR (global) | demo test MRR | beats ridge | epochs (best) | s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["task"] != "translate":
            continue
        beats = "" if r["recipe"].startswith("ridge") else ("yes" if r["val/mrr"] > ridge["val/mrr"] else "NO")
        print(f"| {r['recipe']} | {r['val/mrr']:.4f} | {r['val/mrr_global']:.4f} | {r['test/mrr']:.4f} | {beats} | "
              f"{r.get('epochs', '')} ({r.get('best_epoch', '')}) | {r.get('seconds', '')} |")
    for r in rows:
        if r["task"] == "multilabel":
            print(f"\nmultilabel_triplet: val label MRR {r['val/mrr']:.4f} (raw image features "
                  f"{r['baseline (raw image features) val/mrr']:.4f}), val recall@10 {r['val/recall@10']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
