"""The platform's defaults against a careful hand-written script, on image-disjoint holdouts of the labelled data.

For each holdout seed S (`latentsweep data holdout TRAIN --seed S`: 20% of the images, every caption of each, scored
like the leaderboard), in a fresh state directory:
  * platform: `latentsweep run studies/full.toml --time T` with its defaults (search, then the default pick);
  * reference: benchmarks/reference_script.py (one MLP, multi-positive InfoNCE, all images, 3 seeds);
  * best trial refit: the study's best trial alone, refit on every labelled image (one seed);
  * old pick: `pick --selection oof` (fold models bagged with refits, the previous default) on the same study with the
    same budget the new pick had;
  * fallback never: the default pick with `--fallback never` (the ensemble even when its cross-fitted gain is not
    above its standard error), same study, same budget;
  * split F: the same study cut at F x T (the trials finished by then, as an Optuna study of their own), then the
    default pick with the (1 - F) x T left: the search/pick split at a fixed ratio, paired with the default run;
  * job kinds: test MRR of the first member's first refit, plus one more seed, plus the second member's first refit,
    and the first member's fold models (old pick), with the seconds each took.
Every submission's per-caption reciprocal ranks are kept (results.npz), so differences are pooled over all holdouts'
captions with paired bootstrap intervals (`--report` prints them again from the saved results).

    python benchmarks/end_to_end.py --work DIR [--seeds 0 1 2 3 4] [--time 600] [--splits 0.5 0.7] [--headline]
    python benchmarks/end_to_end.py --work DIR --report
    python benchmarks/end_to_end.py --smoke    # --headline, 1 holdout of tiny data, a tiny study, --time 60, temp dir
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# torch, Optuna and the project's modules are imported where they are used: --help answers without them
from latentsweep.search.pick.plan import PICK_MIN_S  # noqa: E402
from latentsweep.trainers.data.demo import default_train_path  # noqa: E402

CLI = [sys.executable, "-m", "latentsweep"]
STUDY = "full"
BOOT = 10_000  # bootstrap resamples of the pooled captions
# --smoke's study: named like full.toml's (the script reads study STUDY back), trials of a second or two, so that the
# 60-s run finishes trials even on a loaded machine; 4 of them, so that its search ends with them (and the pick then
# runs with the seconds left) instead of at the pick's reserve, half of the 60 s
SMOKE_STUDY = """
[study]
name = "full"
n_trials = 4
sampler = { name = "tpe", seed = 0, n_startup_trials = 2 }
pruner = { name = "none" }

[base.model]
kind = "mlp"
hidden = [32]

[base.loss]
infonce = { weight = 1.0 }

[base.train]
epochs = 2
batch_size = 64

[space]
"optim.lr" = { type = "float", low = 1e-4, high = 1e-2, log = true }
"""


def sh(argv: list[str], log: Path, makes: Path | None = None) -> float | None:
    """Run a command with its output appended to `log`; returns its wall time; raises on a non-zero exit. When the
    file `makes` exists already (an earlier, interrupted benchmark made it), nothing runs and None is returned."""
    if makes is not None and makes.is_file():
        return None
    start = time.monotonic()
    with open(log, "a") as fh:
        fh.write(f"\n$ {' '.join(map(str, argv))}\n")
        fh.flush()
        done = subprocess.run([str(a) for a in argv], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode != 0:  # the log may be in a temp dir about to go: show why here
        sys.stderr.write(log.read_text()[-3000:])
        done.check_returncode()
    return time.monotonic() - start


def reciprocal_ranks(pred: np.ndarray, answers: Path) -> np.ndarray:
    """[N] 1/rank of each test caption (id order) against its leaderboard chunk's images, as `submission score`."""
    from latentsweep.trainers.data.sets import load_answers
    from latentsweep.trainers.eval.metrics import GALLERY_SIZE, ranks

    ids, image = load_answers(answers)
    truth = np.asarray(image, np.float32)[np.argsort(ids, kind="stable")]
    out = []
    for start in range(0, len(truth), GALLERY_SIZE):
        rows = slice(start, start + GALLERY_SIZE)
        out.append(1.0 / ranks(pred[rows], truth[rows], np.arange(len(truth[rows]))))
    return np.concatenate(out)


def submission_rr(csv: Path, answers: Path) -> np.ndarray:
    from latentsweep.trainers.eval.submission import read_submission

    ids, emb = read_submission(csv)
    return reciprocal_ranks(emb[np.argsort(ids, kind="stable")], answers)


def models_rr(ckpts: list[str], weights: list[float], test, answers: Path) -> np.ndarray:
    """Reciprocal ranks of the weighted ensemble of checkpoints on the test file."""
    import torch

    from latentsweep.search.pick import ensemble
    from latentsweep.trainers.train.checkpoint import load_model
    from latentsweep.trainers.train.tasks import predict

    x = torch.as_tensor(test.embeddings)
    preds = [predict(load_model(c)[0], x).numpy() for c in ckpts]
    pred = ensemble.combine(preds, np.asarray(weights) / np.sum(weights))
    return reciprocal_ranks(pred[np.argsort(test.ids, kind="stable")], answers)


def truncate(storage: str, seconds: float, name: str) -> None:
    """A copy of study STUDY holding only the trials finished within `seconds` of its first trial's start."""
    import optuna

    study = optuna.load_study(study_name=STUDY, storage=storage)
    start = min(t.datetime_start for t in study.trials if t.datetime_start)
    kept = [t for t in study.trials if t.state.is_finished() and t.datetime_complete
            and (t.datetime_complete - start).total_seconds() <= seconds]
    copy = optuna.create_study(study_name=name, storage=storage, direction=study.direction, load_if_exists=True)
    copy.add_trials(kept)


def job_seconds(log: Path) -> dict[str, float]:
    """{job name: seconds trained} from the pick's progress lines."""
    found = re.findall(r"job \d+/\d+ (\S+): trained \d+ epochs in (\d+) s", log.read_text())
    return {name: float(s) for name, s in found}


def job_kinds(manifest: dict, old: dict, seconds: dict, test, answers: Path) -> dict:
    """Test reciprocal ranks (and training seconds) of the pieces a pick buys, from its cached models."""
    models = manifest["submission_models"]
    members = sorted(manifest["weights"], key=lambda m: -manifest["weights"][m])
    refits = {m: [x for x in models if x["member"] == m and x["origin"] == "refit"] for m in members}
    out: dict = {}
    first = refits[members[0]]
    if first:
        out["one_refit"] = (models_rr([first[0]["checkpoint"]], [1], test, answers), seconds.get(first[0]["name"]))
    if len(first) > 1:
        out["plus_seed"] = (models_rr([m["checkpoint"] for m in first[:2]], [1, 1], test, answers),
                            seconds.get(first[1]["name"]))
    if len(members) > 1 and refits[members[1]] and first:
        second = refits[members[1]][0]
        w = [manifest["weights"][members[0]], manifest["weights"][members[1]]]
        out["plus_member"] = (models_rr([first[0]["checkpoint"], second["checkpoint"]], w, test, answers),
                              seconds.get(second["name"]))
    folds = [m for m in old.get("submission_models", []) if m["member"] == members[0] and m["origin"] == "fold"]
    if folds:
        out["fold_models"] = (models_rr([m["checkpoint"] for m in folds], [1] * len(folds), test, answers),
                              sum(seconds.get(m["name"], 0.0) for m in folds))
    return out


def trial_refits(state: Path, number: int, seeds: int, test, answers: Path, log: Path) -> np.ndarray:
    """Trial `number` of the study refit on every labelled image, seeds 0..seeds-1 of its config, equally weighted
    (the pick's cached refits of the same config and data are reused)."""
    import optuna

    from latentsweep.search.pick.candidates import make_candidate
    from latentsweep.search.pick.jobs import refit_jobs, run_job
    from latentsweep.trainers.data.sets import load_train

    study = optuna.load_study(study_name=STUDY, storage=f"sqlite:///{state / 'optuna.db'}")
    trial = study.trials[number]
    ckpt = state / trial.user_attrs.get("checkpoint", f"{trial.user_attrs['out_dir']}/best.pt")
    cand = make_candidate(f"trial-{number}", number, ckpt, "local", None, "cpu")
    train = load_train(state.parent / "holdout" / "train.npz")
    paths = []
    for job in refit_jobs([cand], seeds, train, state / "picks" / STUDY):
        path, seconds = run_job(job, train, False)
        paths.append(str(path))
        with open(log, "a") as fh:
            fh.write(f"trial {number} {job.name}: {'reused' if seconds is None else f'{seconds:.0f} s'}\n")
    return models_rr(paths, [1] * len(paths), test, answers)


def old_rule(manifest: dict, state: Path, test, answers: Path, log: Path, platform: np.ndarray) -> np.ndarray:
    """The submission under the previous fallback rule (ensemble only when its nested gain is above the std of the
    fold gains, not its standard error): the platform's own submission when both rules agree, else the best single
    member refit with 3 seeds, as the pick then made it."""
    nested = manifest.get("nested") or {}
    members = [m for m, w in manifest["weights"].items() if w > 0]
    if len(members) <= 1 or not nested or nested["gain_mrr"] > nested["gain_mrr_std"]:
        return platform
    return trial_refits(state, int(manifest["best_single"].split("-")[1]), 3, test, answers, log)


def one_holdout(seed: int, args, work: Path) -> dict:
    """Every submission of one holdout; saves work/results.npz (reciprocal ranks) and returns the timings."""
    import optuna

    from latentsweep.trainers.data.sets import load_test

    log, state, h = work / "log.txt", work / "state", work / "holdout"
    sh([*CLI, "data", "holdout", args.data, "--seed", seed, "--out", h], log, h / "answers.npz")
    data, test_path, answers = h / "train.npz", h / "test.clean.npz", h / "answers.npz"
    test = load_test(test_path)
    common = ["--state-dir", state, "--test", test_path, "--quiet"]
    row = {"seed": seed, "run_s": sh([*CLI, "run", args.study, "--time", args.time, "--data", data,
                                      "--out", work / "platform.csv", *common], log, work / "platform.csv")}
    # the comparison picks get the job's pick's seconds, or the least a pick starts with when the job's search left
    # it less (its pick then did not run: "under the pick's ... minimum")
    given = re.findall(r"the pick gets the (\d+) s left", log.read_text())
    pick_budget = float(given[-1]) if given else PICK_MIN_S
    rr = {"platform": submission_rr(work / "platform.csv", answers)}
    row["reference_s"] = sh([sys.executable, ROOT / "benchmarks" / "reference_script.py", data, test_path,
                             work / "reference.csv", *getattr(args, "reference_args", [])], log,
                            work / "reference.csv")
    rr["reference"] = submission_rr(work / "reference.csv", answers)
    from latentsweep.search.pick.candidates import top_trials
    from latentsweep.trainers.core.errors import LatentsweepError
    try:
        best = top_trials(optuna.load_study(study_name=STUDY, storage=f"sqlite:///{state / 'optuna.db'}"), 1)[0]
        rr["best_trial_refit"] = trial_refits(state, best.number, 1, test, answers, log)
    except LatentsweepError as exc:  # a budget too short for one trial: the run's answer is the closed-form one
        print(f"holdout {seed}: no best trial to refit ({exc})", flush=True)
    manifest = json.loads((work / "platform.manifest.json").read_text())
    if not args.headline:  # the other submissions and job kinds on the same study
        row["old_pick_s"] = sh([*CLI, "pick", STUDY, "--selection", "oof", "--budget", pick_budget, "--data", data,
                                "--out", work / "old.csv", *common], log, work / "old.csv")
        rr["old_pick"] = submission_rr(work / "old.csv", answers)
        row["never_s"] = sh([*CLI, "pick", STUDY, "--fallback", "never", "--budget", pick_budget, "--data", data,
                             "--out", work / "never.csv", *common], log, work / "never.csv")
        rr["fallback_never"] = submission_rr(work / "never.csv", answers)
        for frac in args.splits:
            name = f"{STUDY}-split{int(frac * 100)}"
            if not (work / f"{name}.csv").is_file():
                truncate(f"sqlite:///{state / 'optuna.db'}", frac * args.seconds, name)
            sh([*CLI, "pick", name, "--budget", (1 - frac) * args.seconds, "--data", data,
                "--out", work / f"{name}.csv", *common], log, work / f"{name}.csv")
            rr[f"split{int(frac * 100)}"] = submission_rr(work / f"{name}.csv", answers)
        rr["old_rule"] = old_rule(manifest, state, test, answers, log, rr["platform"])
        old = json.loads((work / "old.manifest.json").read_text())
        kinds = job_kinds(manifest, old, job_seconds(log), test, answers)
        row["job_seconds"] = {k: v[1] for k, v in kinds.items()}
        rr.update({f"kind_{k}": v[0] for k, v in kinds.items()})
    # A pick that lost to the answer in place (latentsweep.search.pick.judge) leaves run's own manifest: no weights, no
    # gain
    row["members"], row["gain"] = manifest.get("weights"), [manifest.get("gain_mrr"), manifest.get("gain_mrr_se")]
    row["answer"] = manifest.get("answer")  # which answer won on the val split, and by how much
    row["trials"] = sum(1 for _ in optuna.load_study(study_name=STUDY, storage=f"sqlite:///{state / 'optuna.db'}"
                                                      ).get_trials(deepcopy=False))
    np.savez(work / "results.npz", **rr)
    (work / "row.json").write_text(json.dumps(row, indent=2))
    return row


def paired(a: np.ndarray, b: np.ndarray, rng) -> str:
    """Mean of a - b over the pooled captions with its 95% paired bootstrap interval."""
    d = a - b
    boots = d[rng.integers(0, len(d), (BOOT, len(d)))].mean(1)
    lo, hi = np.percentile(boots, [2.5, 97.5])
    return f"{d.mean():+.4f} [{lo:+.4f}, {hi:+.4f}]"


def report(work: Path) -> str:
    runs = sorted(work.glob("holdout-*/results.npz"))
    res = [dict(np.load(r)) for r in runs]
    rows = [json.loads((r.parent / "row.json").read_text()) for r in runs]
    rng = np.random.default_rng(0)
    keys = [k for k in res[0] if all(k in r for r in res)]
    pooled = {k: np.concatenate([r[k] for r in res]) for k in keys}
    lines = [f"{len(res)} holdouts, {len(pooled['platform'])} test captions pooled", "",
             "| submission | " + " | ".join(f"holdout {r['seed']}" for r in rows) + " | pooled |",
             "|---|" + "---|" * (len(rows) + 1)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(f"{r[k].mean():.4f}" for r in res) + f" | {pooled[k].mean():.4f} |")
    # The caption bootstrap holds each holdout's study fixed; the per-holdout column shows the study-to-study spread
    # (a difference carried by one or two holdouts is a property of those studies' trial choices).
    lines += ["", "| difference (pooled, 95% paired bootstrap) | | per holdout |", "|---|---|---|"]
    for a, b in [("platform", "reference"), ("platform", "best_trial_refit"), ("platform", "old_pick"),
                 ("platform", "old_rule"), ("fallback_never", "platform"), ("fallback_never", "reference"),
                 *[("platform", k) for k in keys if k.startswith("split")],
                 ("kind_plus_seed", "kind_one_refit"), ("kind_plus_member", "kind_one_refit"),
                 ("kind_fold_models", "kind_one_refit")]:
        if a in pooled and b in pooled:
            per = " ".join(f"{(r[a] - r[b]).mean():+.3f}" for r in res)
            lines.append(f"| {a} - {b} | {paired(pooled[a], pooled[b], rng)} | {per} |")
    lines += ["", "| timings | " + " | ".join(f"holdout {r['seed']}" for r in rows) + " |",
              "|---|" + "---|" * len(rows)]
    for k in ("run_s", "reference_s", "old_pick_s", "never_s", "trials"):
        lines.append(f"| {k} | " + " | ".join(f"{r[k]:.0f}" if r.get(k) is not None else "-" for r in rows) + " |")
    for k in ("one_refit", "plus_seed", "plus_member", "fold_models"):
        lines.append(f"| job seconds: {k} | " + " | ".join(str(r.get("job_seconds", {}).get(k)) for r in rows) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, help="runs and results go here")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="holdout seeds")
    p.add_argument("--time", default="600", help="latentsweep run --time (default 600 s)")
    p.add_argument("--splits", type=float, nargs="*", default=[0.5, 0.7], help="fixed search fractions to compare")
    p.add_argument("--study", type=Path, default=ROOT / "studies" / "full.toml")
    p.add_argument("--data", type=Path, default=default_train_path())
    p.add_argument("--report", action="store_true", help="only print the report of the saved results")
    p.add_argument("--headline", action="store_true",
                   help="only the platform, the reference and the best trial's refit (after a change to a member)")
    p.add_argument("--smoke", action="store_true",
                   help="--headline on 1 holdout of tiny synthetic data, --time 60 (the least `run` takes), in a "
                        "temp dir: about 2 minutes")
    args = p.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="end-to-end-smoke-") as tmp:
            from latentsweep.trainers.data.synthetic import write_synthetic

            # --headline: the old picks and splits would add 3 more picks (minutes); same helpers as the headline
            args.work, args.seeds, args.time, args.report, args.headline = Path(tmp) / "work", [0], "60", False, True
            args.reference_args = ["--seeds", "1", "--epochs", "2"]
            args.study = Path(tmp) / "full.toml"
            args.study.write_text(SMOKE_STUDY)
            args.data = write_synthetic(Path(tmp) / "data", 150, dim_text=32, dim_image=48)[0]
            return run(args)
    if args.work is None:
        p.error("--work is required (or --smoke)")
    return run(args)


def run(args: argparse.Namespace) -> int:
    """Every holdout not done yet in args.work, then the report of all of them."""
    args.seconds = float(args.time)
    if not args.report:
        for seed in args.seeds:
            work = args.work / f"holdout-{seed}"
            if (work / "results.npz").is_file():
                continue
            work.mkdir(parents=True, exist_ok=True)
            print(json.dumps(one_holdout(seed, args, work)), flush=True)
    print(report(args.work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
