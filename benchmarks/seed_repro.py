"""Reproduce the VSE++ + slots notebook's own code (seed 000) on the demo data beside `studies/vsepp_slots.toml`.

The notebook's code cells are read from the seed file at run time and executed as they stand; nothing of it is copied
into this repository. Only the data loading is replaced: the notebook imports `load_data`, `prepare_train_data`,
`generate_submission` from the challenge's `challenge.src.common` and `mrr`, `recall_at_k`, `ndcg` (and a
visualiser) from `challenge.src.eval`, which are not in the seed. Stand-ins for those modules are put in
`sys.modules`: `load_data` returns the demo train file (trainers/data/sets.py `load_train`, trainers/data/demo.py's
path)
under the challenge's key names, `prepare_train_data` returns X (caption embeddings), y (each caption's RAW image
embedding) and the caption->image label, as torch tensors; the metrics are the challenge's definitions over the
top-k index lists the notebook passes (reciprocal rank of the true image, 0 past k).

Lines patched at run time, and why:
  * `RUN_ID = 3` -> `RUN_ID = <seed>`: the notebook's own seed knob (SEED = 42 + RUN_ID; its ensemble cell lists
    seeds 0-5), so 3 seeds run.
  * with --epochs N only, `EPOCHS = 24` -> `EPOCHS = N` (its cosine schedule spans EPOCHS), and the recipe runs with
    `--epochs N` too: both sides on the same shortened schedule, for machines where 24 epochs x 9 runs is too long.
Cells run: the 6 code cells up to and including training (imports and constants, image split, models, losses,
evaluation, training loop). Not run: the three cells after training (re-evaluation of the last epoch's model,
retrieval pictures, test submission of the ensemble); they do not change the best checkpoint. The notebook writes its
checkpoints under `models/` in a scratch directory.

The split is the notebook's own MD5 rule (first 8 hex digits / 0xFFFFFFFF < 0.10); the script checks it selects the
same validation images as the recipe's (trainers/data/splits.py). The metric is the same: the best epoch's val MRR over
the global val gallery; for both sides it is recomputed with trainers/eval/metrics.py (`val/mrr_global`) on each epoch's
checkpoint. Both select the best epoch by that figure (the notebook's rule; the trainer's best.pt is chosen by the
leaderboard val/mrr, so its per-epoch metrics.csv is read instead). Demo test MRR of each best checkpoint is printed
too, as a second, held-out figure.

    python benchmarks/seed_repro.py [--seeds 0,1,2] [--epochs N] [--threads 1] [--sides seed,recipe,variant]
    python benchmarks/seed_repro.py --summarise A.log B.log     # the report of two processes' rows
    python benchmarks/seed_repro.py --smoke    # seed 0, 1 epoch, notebook + recipe on tiny synthetic data (temp dir)

--smoke needs the seed file (../shared/seeds/); without it, it runs the recipe side only and says so.

Prints one JSON line per run, then mean +/- std (sample std, n-1) of each side and the difference in std units:
|mean_seed - mean_recipe| / sqrt((std_seed^2 + std_recipe^2) / 2).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# torch and the trainer's modules are imported where they are used: --help answers without them
from latentsweep.trainers.data.demo import default_answers_path, default_test_path, default_train_path  # noqa: E402

SEED_FILE = ROOT.parent / "shared" / "seeds" / "000_c10626d535106e76.txt"
CELL_START = "In [None]:"
TRAINING_CELLS = 6  # imports/constants, split, models, losses, evaluation, training loop (see the docstring)
RUN_ID_LINE = re.compile(r"^RUN_ID = \d+$", re.M)


def code_cells(text: str) -> list[str]:
    """The notebook's code cells in order: the lines after each `In [None]:` up to the next markdown heading or
    the next cell (the export's markdown cells start with a heading)."""
    cells, current = [], None
    for line in text.splitlines():
        if line.strip() == CELL_START:
            if current is not None:
                cells.append("\n".join(current))
            current = []
        elif current is not None and re.match(r"^#{1,6} ", line):
            cells.append("\n".join(current))
            current = None
        elif current is not None:
            current.append(line)
    if current is not None:
        cells.append("\n".join(current))
    return cells


# ---------------------------------------------------------------------------------------------- stand-ins

def _reciprocal_ranks(pred_indices: np.ndarray, gt: np.ndarray) -> np.ndarray:
    hit = pred_indices == np.asarray(gt)[:, None]  # [Nq, k]
    first = hit.argmax(axis=1)
    return np.where(hit.any(axis=1), 1.0 / (first + 1), 0.0)


def challenge_modules(train_path: Path) -> dict[str, types.ModuleType]:
    """Stand-ins for the challenge helpers the notebook imports (data loading and the metric definitions)."""
    import torch
    from scipy import sparse

    from latentsweep.trainers.data.sets import load_train

    def load_data(path):  # the notebook's data/train/train.npz -> the demo data, challenge key names
        data = load_train(train_path, texts=True)
        label = sparse.csr_matrix((np.ones(len(data.cap2img), np.float32),
                                   (np.arange(len(data.cap2img)), data.cap2img)),
                                  shape=(len(data.cap2img), len(data.image)))
        return {"images/names": data.image_names, "images/embeddings": data.image, "captions/label": label,
                "captions/text": data.caption_text, "captions/embeddings": data.text, "_cap2img": data.cap2img}

    def prepare_train_data(train_data):
        x = torch.from_numpy(np.asarray(train_data["captions/embeddings"], np.float32))
        y = torch.from_numpy(np.asarray(train_data["images/embeddings"], np.float32)[train_data["_cap2img"]])
        return x, y, torch.from_numpy(train_data["_cap2img"])

    def mrr(pred_indices, gt):
        return float(_reciprocal_ranks(pred_indices, gt).mean())

    def recall_at_k(pred_indices, gt, k):
        return float((pred_indices[:, :k] == np.asarray(gt)[:, None]).any(axis=1).mean())

    def ndcg(pred_indices, gt):
        hit = pred_indices == np.asarray(gt)[:, None]
        return float((hit / np.log2(np.arange(2, hit.shape[1] + 2))).sum(axis=1).mean())

    def unavailable(*args, **kwargs):
        raise RuntimeError("not available in the reproduction (only the training cells run)")

    mods = {name: types.ModuleType(name) for name in
            ("challenge", "challenge.src", "challenge.src.common", "challenge.src.eval",
             "challenge.src.eval.metrics", "challenge.src.eval.visualize")}
    mods["challenge.src.common"].__dict__.update(load_data=load_data, prepare_train_data=prepare_train_data,
                                                 generate_submission=unavailable)
    mods["challenge.src.eval.metrics"].__dict__.update(mrr=mrr, recall_at_k=recall_at_k, ndcg=ndcg)
    mods["challenge.src.eval.visualize"].visualize_retrieval = unavailable
    return mods


# ---------------------------------------------------------------------------------------------- the two sides

def test_mrr(predict_fn, test_path: Path, answers_path: Path) -> float:
    """Demo test MRR (challenge protocol, captions in id order in galleries of 100) of pred = predict_fn(x)."""
    import torch

    from latentsweep.trainers.eval import metrics
    from latentsweep.trainers.data.sets import load_answers, load_test

    test = load_test(test_path)
    ids, image = load_answers(answers_path)
    order = np.argsort(test.ids)
    with torch.no_grad():
        pred = predict_fn(torch.as_tensor(test.embeddings[order]))
    truth = dict(zip(ids.tolist(), image))
    return metrics.leaderboard_from_ordered(pred, np.stack([truth[i] for i in test.ids[order]]))["mrr"]


def run_seed_code(seed_file: Path, seed: int, epochs: int | None, threads: int, train_path: Path, test_path: Path,
                  answers_path: Path) -> dict:
    """Execute the notebook's training cells (RUN_ID = seed) in a scratch directory; score each epoch's checkpoint."""
    import torch

    torch.set_num_threads(threads)
    cells = code_cells(seed_file.read_text(encoding="utf-8"))[:TRAINING_CELLS]
    assert RUN_ID_LINE.search(cells[0]), "the notebook's RUN_ID line moved"
    cells[0] = RUN_ID_LINE.sub(f"RUN_ID = {seed}", cells[0])
    if epochs is not None:  # a quick look only; the figures use the notebook's 24
        cells[0] = re.sub(r"^EPOCHS = \d+$", f"EPOCHS = {epochs}", cells[0], flags=re.M)
    saved = {k: sys.modules.get(k) for k in challenge_modules(train_path)}
    sys.modules.update(challenge_modules(train_path))
    cwd = os.getcwd()
    ns: dict = {"__name__": "seed_notebook"}
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as scratch:
        os.chdir(scratch)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(io.StringIO()):
                for cell in cells:
                    exec(compile(cell, str(seed_file), "exec"), ns)
            return _score_notebook_run(ns, Path(scratch), log.getvalue(), seed, test_path, answers_path)
        finally:
            os.chdir(cwd)
            for k, v in saved.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v


def _score_notebook_run(ns: dict, scratch: Path, log: str, seed: int, test_path: Path, answers_path: Path) -> dict:
    """Our val/mrr_global of every epoch checkpoint the notebook saved; the best epoch's, its own figure, test MRR."""
    import torch

    from latentsweep.trainers.eval import metrics

    model = ns["model"].eval()
    val_x, val_gallery = ns["X_val"], ns["img_emb_all"][torch.from_numpy(ns["IMG_VAL_MASK"])]
    per_epoch = []
    for ckpt in sorted((scratch / "models").glob("checkpoints_vsepp_seed*/epoch_*.pth")):
        model.load_state_dict(torch.load(ckpt, map_location="cpu"))
        with torch.no_grad():
            per_epoch.append(metrics.evaluate_global(model(val_x), val_gallery, ns["val_label"])["mrr"])
    best = int(np.argmax(per_epoch))
    model.load_state_dict(torch.load(scratch / ns["MODEL_PATH"], map_location="cpu"))
    own = float(re.findall(r"Best MRR val: ([0-9.]+)", log)[-1])
    return {"side": "seed code", "seed": seed, "val/mrr_global": per_epoch[best], "best_epoch": best,
            "notebook's own best val MRR": own, "test/mrr": test_mrr(model, test_path, answers_path),
            "val_images": int(ns["IMG_VAL_MASK"].sum()), "train_captions": len(ns["X_train"])}


def run_recipe(study: Path, seed: int, epochs: int | None, threads: int, train_path: Path, test_path: Path,
               answers_path: Path) -> dict:
    """`latentsweep train STUDY --seed S` as a user runs it; best epoch by val/mrr_global from its metrics.csv."""
    from latentsweep.trainers.train.checkpoint import load_model

    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "latentsweep", "train", str(study), "--data", str(train_path), "--seed", str(seed),
               "--quiet", "--out", out, "--set", f"train.threads={threads}"]
        cmd += ["--epochs", str(epochs)] if epochs else []
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, cwd=ROOT)
        import csv

        rows = list(csv.DictReader(open(Path(out) / "metrics.csv")))
        per_epoch = [float(r["val/mrr_global"]) for r in rows]
        best = int(np.argmax(per_epoch))
        model = load_model(Path(out) / "best.pt", device="cpu")[0]
        model.eval()
        test = test_mrr(lambda x: model(x)["pred"], test_path, answers_path)
    return {"side": study.stem, "seed": seed, "val/mrr_global": per_epoch[best], "best_epoch": best,
            "test/mrr (best.pt, chosen by val/mrr)": test}


def summary(rows: list[dict], key: str) -> tuple[float, float]:
    values = [r[key] for r in rows]
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, help="override both sides' 24 epochs (quick look only)")
    parser.add_argument("--recipe", default=str(ROOT / "studies" / "vsepp_slots.toml"))
    parser.add_argument("--variant", default=str(ROOT / "studies" / "vsepp_slots_unit.toml"),
                        help="a second recipe to run beside them ('' = none)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed-file", default=str(SEED_FILE), help="the STM notebook (seed 000)")
    parser.add_argument("--sides", default="seed,recipe,variant",
                        help="which to run here (two processes can share the work; --summarise joins their logs)")
    parser.add_argument("--summarise", nargs="+", metavar="LOG", help="only print the report of these logs' rows")
    parser.add_argument("--smoke", action="store_true",
                        help="seed 0, 1 epoch, the notebook and the recipe on tiny synthetic data in a temp dir")
    args = parser.parse_args(argv)
    if args.summarise:
        rows = [json.loads(line) for log in args.summarise for line in open(log) if line.startswith("{")]
        sides: dict[str, list[dict]] = {}
        for row in rows:
            sides.setdefault(row["side"], []).append(row)
        report(sides, Path(args.recipe).stem)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("TQDM_DISABLE", "1")
    if args.smoke:
        return smoke(args)
    return compare(args, (default_train_path(), default_test_path(), default_answers_path()))


def smoke(args: argparse.Namespace) -> int:
    """compare() for seed 0, 1 epoch, on a tiny synthetic train / test / answers set in a temp dir."""
    from latentsweep.trainers.data.synthetic import write_synthetic

    args.seeds, args.epochs, args.sides = "0", 1, "seed,recipe"
    if not Path(args.seed_file).is_file():
        print(f"smoke: no seed file at {args.seed_file}: the notebook side is skipped", flush=True)
        args.sides = "recipe"
    with tempfile.TemporaryDirectory(prefix="seed-repro-smoke-") as tmp:
        paths = write_synthetic(tmp, 200, captions_per_image=5, dim_text=32, dim_image=48, n_test=40)
        return compare(args, paths)


def compare(args: argparse.Namespace, paths: tuple[Path, Path, Path]) -> int:
    """Run the wanted sides for every seed on (train, test, answers); print each row and the report."""
    seeds = [int(s) for s in args.seeds.split(",")]
    check_same_split(Path(args.recipe), paths[0])
    wanted = set(args.sides.split(","))
    recipes = [Path(p) for side, p in (("recipe", args.recipe), ("variant", args.variant)) if p and side in wanted]
    sides: dict[str, list[dict]] = {}
    for runs in ([lambda s=s: run_seed_code(Path(args.seed_file), s, args.epochs, args.threads, *paths)
                  for s in seeds] if "seed" in wanted else [],
                 *[[lambda s=s, study=study: run_recipe(study, s, args.epochs, args.threads, *paths)
                    for s in seeds] for study in recipes]):
        for run in runs:
            row = run()
            sides.setdefault(row["side"], []).append(row)
            print(json.dumps(row), flush=True)
    if "seed code" in sides:
        report(sides, Path(args.recipe).stem)
    return 0


def check_same_split(recipe: Path, train_path: Path) -> None:
    """The notebook's MD5 rule (first 8 hex digits / 0xFFFFFFFF < val_ratio) must select the recipe's val images."""
    import hashlib

    from latentsweep.search.study.studyfile import load_study_file
    from latentsweep.trainers.data.sets import load_train
    from latentsweep.trainers.data.splits import split_by_hash

    base = load_study_file(recipe).base
    names = load_train(train_path).image_names
    theirs = np.flatnonzero([int(hashlib.md5(n.encode("utf-8")).hexdigest()[:8], 16) / 0xFFFFFFFF
                             < base.data.val_ratio for n in names])
    ours = split_by_hash(names, base.data.val_ratio, salt=base.data.salt)[1]
    assert np.array_equal(theirs, ours), "the notebook's split and the recipe's differ"
    print(f"split: the same {len(ours)} validation images of {len(names)} on both sides", flush=True)


def report(sides: dict[str, list[dict]], recipe: str) -> None:
    ref_mean, ref_std = summary(sides["seed code"], "val/mrr_global")
    print("\n| side | val MRR (global, best epoch), mean +/- std | demo test MRR, mean +/- std | best epochs | runs |")
    print("|---|---|---|---|---|")
    for name, rows in sides.items():
        mean, std = summary(rows, "val/mrr_global")
        test_mean, test_std = summary(rows, next(k for k in rows[0] if k.startswith("test/mrr")))
        epochs = ", ".join(str(r["best_epoch"]) for r in rows)
        print(f"| {name} | {mean:.4f} +/- {std:.4f} | {test_mean:.4f} +/- {test_std:.4f} | {epochs} | {len(rows)} |")
    for name, rows in sides.items():
        if name == "seed code":
            continue
        mean, std = summary(rows, "val/mrr_global")
        pooled = ((ref_std ** 2 + std ** 2) / 2) ** 0.5
        gap = abs(mean - ref_mean) / pooled if pooled > 0 else float("inf")
        verdict = "within 2 std" if gap <= 2 else "NOT within 2 std"
        print(f"{name} - seed code: {mean - ref_mean:+.4f} val MRR = {gap:.2f} std ({verdict})"
              + (" [the faithful recipe]" if name == recipe else ""))


if __name__ == "__main__":
    sys.exit(main())
