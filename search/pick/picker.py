"""`latentsweep pick`: a study's top trials as candidates, an ensemble chosen on data no member saw, the chosen members
refit on every labelled image, and the outputs (via search.pick.outputs).

Default (`--selection oof`): every candidate config is retrained on k-1 image folds for each fold (search.pick.refit), so
every labelled caption gets a prediction from a model that never saw its image; greedy selection runs on all of them
and nested folds give the honest gain with its spread (search.pick.oof). The chosen members are then refit on all images
with several seeds, each for the epochs its trial found best; the submission averages them. `--selection halves`
keeps the older scheme: weights on one half of the study's val split, figures on the other.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from search.pick import ensemble, refit
from search.pick import oof as oof_mod
from search.stores import resolve_stores, state_dir, writable_dir
from search.tracking import make_tracker
from search.tracking.base import Tracker
from search.tracking.paths import resolve_in_state
from trainers.config import Config, dump_toml, with_values
from trainers.data import captions_of
from trainers.errors import DataError, LatentsweepError

SPLIT_KEYS = ("split", "val_ratio", "salt", "n_folds", "fold")
# Only the best few configs get seed re-runs: each re-run is a full training, and past the top 3 the members are
# weaker than the extra seeds of the strongest ones.
SEED_CONFIGS = 3
DONE_FILE = "done.json"  # written after a seed re-run finished; a re-run with the same config and data is reused
# Refit seeds per chosen member by default: averaging 3 seeds was worth about +0.015 MRR on challenge-format data.
REFIT_SEEDS = 3
SELECTIONS = ("oof", "halves")


@dataclass(frozen=True)
class PickOptions:
    study: str
    state_dir: str | None = None
    storage: str | None = None
    tracking_uri: str | None = None
    top: int = 5
    method: str = "greedy"
    size: int = 10
    seeds: int | None = None  # refit: seeds per chosen member (default 3); --no-refit --selection halves: extra
    # seed re-runs of the best configs as candidates (default 0, the behaviour before refits existed)
    selection: str = "oof"  # "oof": k-fold out-of-fold on every labelled image; "halves": halves of the val split
    folds: int = 5
    refit: bool = True
    budget: float | None = None  # seconds for the whole pick; None = no limit
    data: str | None = None
    test: str | None = None
    out: str | None = None
    register: str | None = None
    seed: int = 0  # seed of the leaderboard galleries' shuffle on both halves
    device: str = "auto"
    progress: bool = True

    @property
    def refit_seeds(self) -> int:
        """Seeds per refit member; 0 without refits."""
        return (REFIT_SEEDS if self.seeds is None else self.seeds) if self.refit else 0


@dataclass
class Candidate:
    name: str  # "trial-3" or "trial-3/seed-2"
    trial: int
    checkpoint: Path
    cfg: Config
    dims: tuple[int, int]  # (Dt, Di)
    value: float | None  # the study's objective value (None for seed re-runs)
    data_fingerprint: str | None
    origin: str  # where the checkpoint came from: "local", "runs:/<id>/best.pt" or "retrained"
    model: torch.nn.Module = field(repr=False)
    best_epoch: int = 0  # 0-based epoch of the checkpoint (the trial's best)
    seconds: float | None = None  # the trial's wall time, for the budget plan (None: unknown)
    epochs_run: int = 1  # epochs the trial trained (pruned or early-stopped trials stop before train.epochs)

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(dump_toml(self.cfg).encode()).hexdigest()


@dataclass(frozen=True)
class Paths:
    root: Path
    storage: str
    tracking_uri: str
    artifact_root: str | None
    picks: Path  # STATE/picks/<study> (beside --out when the state dir is read-only): fold jobs, refits, re-runs
    out: Path
    manifest: Path
    report: Path


def note(message: str) -> None:
    print(f"latentsweep: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- paths and checks

def resolve_paths(opts: PickOptions) -> Paths:
    """Storage/tracking from the state directory unless given; the default out is STATE/picks/<study>/submission.csv."""
    root = state_dir(opts.state_dir, create=False)
    stores = resolve_stores(root, opts.storage, opts.tracking_uri, read_only=True)  # no optuna.db: one-line error
    if opts.tracking_uri is None and not writable_dir(root):
        raise LatentsweepError(f"state directory {root} is read-only: pick reads the study from it, but its MLflow "
                               "run needs a writable store: pass --tracking-uri (e.g. sqlite:///elsewhere/mlflow.db) "
                               "and --out")
    picks = root / "picks" / opts.study
    out = Path(opts.out).expanduser() if opts.out else picks / "submission.csv"
    out = out.resolve()
    check_writable(out)
    if not writable_dir(root):  # fold jobs and refits are kept beside the submission instead (and reused there)
        picks = out.parent / f".{opts.study}-runs"
    return Paths(root, stores.storage, stores.tracking_uri, stores.artifact_root, picks, out,
                 out.with_name(f"{out.stem}.manifest.json"), out.with_name(f"{out.stem}.report.csv"))


def check_writable(path: Path) -> None:
    """Fail now (before any training) when `path` cannot be written; creates nothing."""
    if path.is_dir():
        raise LatentsweepError(f"--out {path}: is a directory")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise LatentsweepError(f"--out {path}: cannot create it, {ancestor} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as exc:
        raise LatentsweepError(f"--out {path}: {ancestor} is not writable ({exc.strerror})") from None
    if path.exists() and not path.is_file():
        raise LatentsweepError(f"--out {path}: exists and is not a regular file")


def check_options(opts: PickOptions) -> None:
    if opts.top < 1:
        raise LatentsweepError(f"--top must be >= 1, got {opts.top}")
    if opts.size < 1:
        raise LatentsweepError(f"--size must be >= 1, got {opts.size}")
    if opts.seeds is not None and (opts.seeds < 0 or (opts.refit and opts.seeds < 1)):
        raise LatentsweepError(f"--seeds must be >= {1 if opts.refit else 0}, got {opts.seeds}")
    if opts.selection not in SELECTIONS:
        raise LatentsweepError(f"--selection must be one of {', '.join(SELECTIONS)}, got '{opts.selection}'")
    if opts.folds < 2:
        raise LatentsweepError(f"--folds must be >= 2, got {opts.folds}")
    if opts.budget is not None and not opts.budget > 0:
        raise LatentsweepError(f"--budget must be a positive number of seconds, got {opts.budget}")
    if opts.method not in ensemble.METHODS:
        raise LatentsweepError(f"--method must be one of {', '.join(ensemble.METHODS)}, got '{opts.method}'")


# ---------------------------------------------------------------------------------------------- candidates

def trial_value(trial, maximize: bool) -> float | None:
    """A complete trial's value; a pruned trial's best reported value (its checkpoint is that epoch's)."""
    if trial.value is not None:
        return float(trial.value)
    reported = list(trial.intermediate_values.values())
    return (max(reported) if maximize else min(reported)) if reported else None


def top_trials(study, k: int) -> list:
    """The k best trials by value in the study's direction, COMPLETE and PRUNED alike: a trial pruned at a low
    fidelity can still be a strong member, and out-of-fold selection re-measures every candidate anyway."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    maximize = study.direction == StudyDirection.MAXIMIZE
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
            if trial_value(t, maximize) is not None]
    if not done:
        states = pd.Series([t.state.name for t in study.get_trials(deepcopy=False)]).value_counts().to_dict()
        raise LatentsweepError(f"study '{study.study_name}' has no complete trials "
                               f"({', '.join(f'{n} {s}' for s, n in states.items()) or 'no trials at all'})")
    key = lambda t: (-trial_value(t, maximize) if maximize else trial_value(t, maximize), t.number)  # noqa: E731
    return sorted(done, key=key)[:k]


def fetch_checkpoint(trial, tracker: Tracker, download_dir: Path, root: Path | None = None
                     ) -> tuple[Path, str] | None:
    """(path, origin) of the trial's best.pt: the local path in user_attrs (relative to the state directory `root`),
    else downloaded from its tracked run; None (with a warning naming the trial) if neither."""
    # a pruned trial records no "checkpoint", but its best epoch's best.pt is in its out_dir
    out_dir = trial.user_attrs.get("out_dir")
    local = trial.user_attrs.get("checkpoint") or (f"{out_dir}/best.pt" if out_dir else None)
    if local and resolve_in_state(local, root or Path.cwd()).is_file():
        return resolve_in_state(local, root or Path.cwd()), "local"
    run_id = trial.user_attrs.get("mlflow_run_id")
    reason = f"{local or 'no local checkpoint recorded'} is missing"
    if run_id:
        try:
            path = tracker.download_artifact(run_id, "best.pt", download_dir / f"trial-{trial.number}")
            return path, f"runs:/{run_id}/best.pt"
        except Exception as exc:  # noqa: BLE001 - any failure means: no checkpoint for this trial
            reason += f" and MLflow run {run_id} has no best.pt ({type(exc).__name__})"
    note(f"warning: trial {trial.number} skipped: {reason}")
    return None


def make_candidate(name: str, trial: int, path: Path, origin: str, value: float | None, device) -> Candidate:
    from trainers.checkpoint import load_model
    from trainers.tasks import predict

    model, cfg, meta = load_model(path, device)
    dim_in = int(model.text_mean.numel())
    dim_out = int(predict(model, torch.zeros(1, dim_in, device=device)).shape[1])
    return Candidate(name, trial, path, cfg, (dim_in, dim_out), value, meta.get("data_fingerprint"), origin, model,
                     best_epoch=int(meta.get("epoch", cfg.train.epochs - 1)))


def load_candidates(study, k: int, tracker: Tracker, download_dir: Path, device, root: Path | None = None
                    ) -> list[Candidate]:
    out = []
    for t in top_trials(study, k):
        found = fetch_checkpoint(t, tracker, download_dir, root)
        if found is not None:
            value = trial_value(t, study.direction.name == "MAXIMIZE")
            cand = make_candidate(f"trial-{t.number}", t.number, *found, value, device)
            if t.datetime_start and t.datetime_complete:
                cand.seconds = (t.datetime_complete - t.datetime_start).total_seconds()
            cand.epochs_run = max(len(t.intermediate_values), cand.best_epoch + 1)
            out.append(cand)
    if not out:
        raise LatentsweepError(f"study '{study.study_name}': none of the top {k} complete trials has a checkpoint")
    return out


def check_agreement(cands: list[Candidate], same_split: bool) -> None:
    """Every candidate must be a translate model with the same dims; with `same_split` (selection on halves of the
    val split) they must also share the val split (data.split, val_ratio, salt, n_folds, fold). Out-of-fold
    selection retrains every candidate on the same folds, so there the study's splits may differ."""
    ref = cands[0]
    for c in cands:
        if c.cfg.data.task != "translate":
            raise LatentsweepError(f"{c.name} has data.task='{c.cfg.data.task}': pick ensembles translate models only")
    for c in cands[1:]:
        for key in SPLIT_KEYS if same_split else ():
            mine, theirs = getattr(c.cfg.data, key), getattr(ref.cfg.data, key)
            if mine != theirs:
                raise LatentsweepError(f"{c.name} has data.{key}={mine!r} but {ref.name} has {theirs!r}: "
                                       "candidates must share one val split (or use --selection oof)")
        if c.dims != ref.dims:
            raise LatentsweepError(f"{c.name} maps dims {c.dims} but {ref.name} maps {ref.dims}")


def resolve_data(opts: PickOptions, cands: list[Candidate]) -> tuple[Path, Path]:
    """(train npz, test npz): --data, else the path recorded in the trials' config, else the demo; --test, else the
    demo test (demo data) or a test.clean.npz beside the train file."""
    from search.study.studyfile import resolve_data_path
    from trainers.demo import default_test_path, default_train_path

    recorded = next((c.cfg.data.path for c in cands if c.cfg.data.path), "")
    data = resolve_data_path(opts.data or recorded)
    if opts.test:
        return data, Path(opts.test).expanduser()
    if data.resolve() == default_train_path().resolve():
        return data, default_test_path()
    beside = data.parent / "test.clean.npz"
    if beside.is_file():
        return data, beside
    raise LatentsweepError(f"--test is required: {data} is not the demo data and has no test.clean.npz beside it")


def check_test(cands: list[Candidate], test) -> None:
    """The test file must have the models' text dimension."""
    dim_in = cands[0].dims[0]
    if test.embeddings.shape[1] != dim_in:
        raise DataError(f"{test.path}: captions/embeddings has dim {test.embeddings.shape[1]}, the models expect "
                        f"{dim_in}")


def check_data(cands: list[Candidate], data) -> None:
    """The data must be what the trials trained on (same dims, same fingerprint)."""
    if (data.text.shape[1], data.image.shape[1]) != cands[0].dims:
        raise DataError(f"{data.path}: dims ({data.text.shape[1]}, {data.image.shape[1]}) differ from the models' "
                        f"{cands[0].dims}")
    for c in cands:
        if c.data_fingerprint and c.data_fingerprint != data.fingerprint:
            raise DataError(f"{data.path}: fingerprint {data.fingerprint} differs from the data {c.name} was trained "
                            f"on ({c.data_fingerprint}); pass --data with the study's training file")


# ---------------------------------------------------------------------------------------------- seed re-runs

def seed_candidates(cands: list[Candidate], seeds: int, data, picks: Path, device, progress: bool) -> list[Candidate]:
    """Retrain the best min(K, 3) configs with train.seed = original + 1..seeds (reusing finished identical runs)."""
    from trainers.loop import train

    jobs = [(c, c.cfg.train.seed + s) for c in cands[:SEED_CONFIGS] for s in range(1, seeds + 1)]
    out = []
    for i, (base, seed) in enumerate(jobs, start=1):
        cfg = with_values(base.cfg, {"train.seed": seed})
        name = f"trial-{base.trial}/seed-{seed}"
        run_dir = picks / "seeds" / f"trial-{base.trial}-seed-{seed}"
        stamp = {"config_sha256": hashlib.sha256(dump_toml(cfg).encode()).hexdigest(),
                 "data_fingerprint": data.fingerprint}
        done = run_dir / DONE_FILE
        if done.is_file() and (run_dir / "best.pt").is_file() and json.loads(done.read_text()) == stamp:
            note(f"seed re-run {i}/{len(jobs)}: {name} (reused {run_dir})")
        else:
            note(f"seed re-run {i}/{len(jobs)}: {name} ({cfg.train.epochs} epochs)")
            run_dir.mkdir(parents=True, exist_ok=True)
            done.unlink(missing_ok=True)
            (run_dir / "config.toml").write_text(dump_toml(cfg))
            train(cfg, data, out_dir=run_dir, progress=progress)
            done.write_text(json.dumps(stamp))
        out.append(make_candidate(name, base.trial, run_dir / "best.pt", "retrained", None, device))
    return out


# ---------------------------------------------------------------------------------------------- selection

def outputs(models: list[torch.nn.Module], x: np.ndarray, device) -> list[np.ndarray]:
    """Each model's predictions [N, Di] (numpy float32) for caption embeddings x [N, Dt]."""
    from trainers.tasks import predict

    xt = torch.as_tensor(np.ascontiguousarray(x, np.float32), device=device)
    return [predict(m, xt).cpu().numpy() for m in models]


@dataclass
class Selection:
    weights: np.ndarray  # [M] sum 1
    table: pd.DataFrame  # one row per member, then best_single, mean, ensemble
    best_single: str
    gain: float  # ensemble - best single on images the selection never saw
    gain_std: float  # spread of that gain (std over folds; nan where not measured)
    kind: str  # "oof" or "halves"
    metrics: dict[str, float]  # for the MLflow pick run
    details: dict[str, Any]  # for the manifest


def select(cands: list[Candidate], data, method: str, size: int, seed: int, device) -> Selection:
    """Halves: fit the weights on the select half; measure members, best single, mean and ensemble on both."""
    from trainers.tasks import split_images

    _, val_img = split_images(cands[0].cfg, data)
    halves = ensemble.split_halves(val_img, data.image_names, data.cap2img)
    scores, outs = {}, {}
    for half in halves:
        fn = ensemble.scorer(half, data.image, seed)
        outs[half.name] = out = outputs([c.model for c in cands], data.text[half.captions], device)
        scores[half.name] = (fn, [fn(o) for o in out])
    sel_fn, sel_members = scores["select"]
    weights = ensemble.method_weights(method, outs["select"], lambda p: sel_fn(p)["mrr"], size)
    best = int(np.argmax([m["mrr"] for m in sel_members]))
    uniform = np.full(len(cands), 1.0 / len(cands))
    summary: dict[str, Any] = {}
    for name, (fn, members) in scores.items():
        summary[name] = {"best_single": members[best], "mean": fn(ensemble.combine(outs[name], uniform)),
                         "ensemble": fn(ensemble.combine(outs[name], weights)), "members": members}
    rows = [_row("member", c.name, w, c.value, summary, i) for i, (c, w) in enumerate(zip(cands, weights))]
    rows += [_row("best_single", cands[best].name, None, cands[best].value, summary, "best_single"),
             _row("mean", f"mean of {len(cands)}", None, None, summary, "mean"),
             _row("ensemble", method, None, None, summary, "ensemble")]
    gain = summary["report"]["ensemble"]["mrr"] - summary["report"]["best_single"]["mrr"]
    metrics = {"report/gain_mrr": gain}
    for half in ("select", "report"):
        for kind in ("best_single", "mean", "ensemble"):
            metrics.update({f"{half}/{kind}_{k}": float(summary[half][kind][k]) for k in ("mrr", "r1", "r10")})
        metrics.update({f"member/{c.name}/{half}_mrr": float(m["mrr"])
                        for c, m in zip(cands, summary[half]["members"])})
    details = {"scores": {h: {k: summary[h][k] for k in ("best_single", "mean", "ensemble")}
                          for h in ("select", "report")} | {"gain_report_mrr": gain},
               "halves": {"salt": ensemble.HALF_SALT, **{h.name: {"images": len(h.images), "captions": len(h.captions),
                                                                  "gallery_size": h.gallery_size} for h in halves}}}
    return Selection(weights, pd.DataFrame(rows), cands[best].name, gain, float("nan"), "halves", metrics, details)


def _row(role: str, name: str, weight, value, summary: dict, key) -> dict[str, Any]:
    def get(half: str) -> dict[str, float]:
        return summary[half]["members"][key] if isinstance(key, int) else summary[half][key]

    sel, rep = get("select"), get("report")
    return {"role": role, "name": name, "weight": weight, "study_value": value, "select_mrr": sel["mrr"],
            "report_mrr": rep["mrr"], "report_r1": rep["r1"], "report_r10": rep["r10"]}


# ---------------------------------------------------------------------------------------------- out-of-fold + refit

def job_cost(cand: Candidate, data) -> float:
    """Estimated seconds per caption per epoch of `cand`'s config, from its trial's wall time on its train split."""
    from trainers.tasks import split_images

    if cand.seconds is None:
        return 0.0
    train_img, _ = split_images(cand.cfg, data)
    return cand.seconds / max(cand.epochs_run, 1) / max(len(captions_of(data.cap2img, train_img)), 1)


def fold_jobs(cands: list[Candidate], data, n_folds: int, picks: Path) -> list[refit.Job]:
    fold_of = refit.fold_assignment(data.image_names, n_folds)
    return [refit.make_job(f"{c.name}/fold-{f + 1}-of-{n_folds}", c.name, refit.replay_config(c.cfg, c.best_epoch),
                           data, np.flatnonzero(fold_of != f), picks / "runs" / f"{c.name}-fold-{f + 1}-of-{n_folds}",
                           job_cost(c, data))
            for c in cands for f in range(n_folds)]


def refit_jobs(cands: list[Candidate], seeds: int, data, picks: Path) -> list[refit.Job]:
    jobs = []
    for c in cands:
        for s in range(seeds):
            seed = c.cfg.train.seed + s
            jobs.append(refit.make_job(f"{c.name}/refit-seed-{seed}", c.name,
                                       refit.replay_config(c.cfg, c.best_epoch, seed), data, None,
                                       picks / "runs" / f"{c.name}-refit-seed-{seed}", job_cost(c, data)))
    return jobs


def select_oof(cands: list[Candidate], data, n_folds: int, opts: PickOptions, picks: Path, device) -> Selection:
    """Train every candidate on k-1 folds for each fold, predict the held-out fold, select on all images."""
    from trainers.checkpoint import load_model

    oof = [np.zeros((len(data.cap2img), c.dims[1]), np.float32) for c in cands]
    fold_of = refit.fold_assignment(data.image_names, n_folds)
    spent = estimated = 0.0
    for job in fold_jobs(cands, data, n_folds, picks):
        i = next(k for k, c in enumerate(cands) if c.name == job.member)
        ckpt, seconds = refit.run_job(job, data, opts.progress)
        if seconds is not None:
            spent, estimated = spent + seconds, estimated + job.cost
        model = load_model(ckpt, device)[0]
        held = captions_of(data.cap2img, np.setdiff1d(np.arange(len(data.image)), job.images))
        oof[i][held] = outputs([model], data.text[held], device)[0]
    folds = oof_mod.Folds(fold_of, np.asarray(data.cap2img, np.int64))
    res = oof_mod.select(oof, folds, data.image, opts.method, opts.size, opts.seed)
    rows = [{"role": "member", "name": c.name, "weight": float(w), "study_value": c.value, "oof_mrr": float(m)}
            for c, w, m in zip(cands, res.weights, res.member_mrr)]
    rows += [{"role": "best_single", "name": cands[res.best_single].name, "weight": None,
              "study_value": cands[res.best_single].value, "oof_mrr": float(res.member_mrr[res.best_single]),
              "nested_mrr": float(res.fold_best.mean())},
             {"role": "mean", "name": f"mean of {len(cands)}", "weight": None, "study_value": None,
              "oof_mrr": res.mean_mrr},
             {"role": "ensemble", "name": opts.method, "weight": None, "study_value": None,
              "oof_mrr": res.ensemble_mrr, "nested_mrr": float(res.fold_ensemble.mean())}]
    metrics = {"nested/gain_mrr": res.gain, "nested/gain_mrr_std": res.gain_std,
               "nested/ensemble_mrr": float(res.fold_ensemble.mean()),
               "nested/best_single_mrr": float(res.fold_best.mean()), "oof/ensemble_mrr": res.ensemble_mrr,
               "oof/mean_mrr": res.mean_mrr, **{f"member/{c.name}/oof_mrr": float(m)
                                                for c, m in zip(cands, res.member_mrr)}}
    details = {"folds": n_folds, "images": len(data.image), "captions": len(data.cap2img),
               # measured / estimated seconds of the fold jobs: the refit plan scales its estimates by it
               "cost_factor": spent / estimated if spent and estimated else 1.0,
               "nested": {"gain_mrr": res.gain, "gain_mrr_std": res.gain_std,
                          "fold_gains": res.fold_gains.tolist(), "fold_ensemble_mrr": res.fold_ensemble.tolist(),
                          "fold_best_single_mrr": res.fold_best.tolist()},
               "oof": {"ensemble_mrr": res.ensemble_mrr, "mean_mrr": res.mean_mrr,
                       "best_single_mrr": float(res.member_mrr[res.best_single])}}
    return Selection(res.weights, pd.DataFrame(rows), cands[res.best_single].name, res.gain, res.gain_std, "oof",
                     metrics, details)


@dataclass
class SubmissionModel:
    """One model that makes the submission: a member's refit (one per seed) or its trial checkpoint."""
    name: str
    member: str
    checkpoint: Path
    weight: float  # the member's weight shared equally by its seeds
    origin: str  # "refit", "local", "runs:/..." ...
    job: refit.Job | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)


def submission_models(cands: list[Candidate], sel: Selection, seeds: int, opts: PickOptions, data, picks: Path,
                      device, budget_left: float | None) -> tuple[list[SubmissionModel], list[str]]:
    """Refit each chosen member on every labelled image with `seeds` seeds (fewer if the budget is short), or keep
    the trial checkpoints (--no-refit, or no budget left even for one seed each)."""
    from trainers.checkpoint import load_model

    chosen = [(c, float(w)) for c, w in zip(cands, sel.weights) if w > 0]
    notes: list[str] = []
    factor = sel.details.get("cost_factor", 1.0)  # trials' wall time includes validation and tracking
    while seeds > 0 and budget_left is not None and factor * sum(
            j.cost for j in refit_jobs([c for c, _ in chosen], seeds, data, picks)) > budget_left:
        seeds -= 1
        notes.append(f"--budget: {budget_left:.0f} s left, refit seeds per member -> {seeds}")
    if opts.refit and seeds == 0:
        notes.append("--budget: no time left to refit; the submission uses the trials' checkpoints")
    if seeds == 0:
        return [SubmissionModel(c.name, c.name, c.checkpoint, w, c.origin, model=c.model) for c, w in chosen], notes
    out = []
    for job in refit_jobs([c for c, _ in chosen], seeds, data, picks):
        weight = dict((c.name, w) for c, w in chosen)[job.member] / seeds
        ckpt, _ = refit.run_job(job, data, opts.progress)
        out.append(SubmissionModel(job.name, job.member, ckpt, weight, "refit", job, load_model(ckpt, device)[0]))
    return out, notes


# ---------------------------------------------------------------------------------------------- the command

def choose(opts: PickOptions, cands: list[Candidate], data, paths: Paths, device,
           started: float) -> tuple[Selection, int]:
    """(selection, refit seeds per member) by --selection: out-of-fold, planned with the refits to fit the budget
    (a single candidate needs no selection), or halves of the study's val split."""
    seeds = opts.refit_seeds
    if opts.selection == "halves":
        check_agreement(cands, same_split=True)
        if opts.seeds and not opts.refit:
            cands += seed_candidates(cands, opts.seeds, data, paths.picks, device, opts.progress)
            check_agreement(cands, same_split=True)
        return select(cands, data, opts.method, opts.size, opts.seed, device), seeds
    check_agreement(cands, same_split=False)

    def cost(top: int, folds: int, seeds: int) -> float:
        chosen = cands[:top]
        jobs = (fold_jobs(chosen, data, folds, paths.picks) if folds else []) + (
            refit_jobs(chosen, seeds, data, paths.picks) if opts.refit else [])
        return sum(j.cost for j in jobs)

    budget = None if opts.budget is None else opts.budget - (time.monotonic() - started)
    # One refit per candidate is reserved here; more seeds are added at the refit step as what is left of the budget
    # allows, with job costs measured on the fold jobs (the members are only known after selection).
    p = refit.plan(cost, len(cands), opts.folds, min(seeds, 1), budget)
    for line in p.notes:
        note(line)
    note(f"plan: {p.describe()}")
    del cands[p.top:]
    if p.folds == 0:
        table = pd.DataFrame([{"role": "member", "name": cands[0].name, "weight": 1.0, "study_value": cands[0].value}])
        sel = Selection(np.ones(1), table, cands[0].name, 0.0, float("nan"), "single", {}, {})
    else:
        sel = select_oof(cands, data, p.folds, opts, paths.picks, device)
    sel.details["notes"] = p.notes
    return sel, seeds  # the refit step fits its seeds to what is left of the budget, with measured job costs


def run_pick(opts: PickOptions):
    """The whole pick; returns search.pick.outputs.PickResult. Cheap checks come before any training."""
    from search.pick.outputs import write_outputs
    from search.study.report import load_existing_study
    from trainers.data import load_test, load_train
    from trainers.loop import resolve_device

    started = time.monotonic()
    check_options(opts)
    paths = resolve_paths(opts)
    study = load_existing_study(opts.study, paths.storage)
    device = resolve_device(opts.device)
    with tempfile.TemporaryDirectory(prefix="latentsweep-pick-") as downloads:
        tracker = make_tracker(paths.tracking_uri, paths.artifact_root)
        cands = load_candidates(study, opts.top, tracker, Path(downloads), device, paths.root)
        data_path, test_path = resolve_data(opts, cands)
        test = load_test(test_path)
        check_test(cands, test)
        data = load_train(data_path)
        check_data(cands, data)
        sel, seeds = choose(opts, cands, data, paths, device, started)
        left = None if opts.budget is None else opts.budget - (time.monotonic() - started)
        models, notes = submission_models(cands, sel, seeds, opts, data, paths.picks, device, left)
        for line in notes:
            note(line)
        sel.details.setdefault("notes", []).extend(notes)
        made = pd.DataFrame([{"role": "submission_model", "name": m.name, "weight": m.weight, "origin": m.origin}
                             for m in models])
        sel.table = pd.concat([sel.table, made], ignore_index=True)
        test_pred = ensemble.combine(outputs([m.model for m in models], test.embeddings, device),
                                     [m.weight for m in models])
        return write_outputs(tracker, opts, paths, study, cands, sel, models, data, test, test_pred)
