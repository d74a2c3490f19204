"""`latentsweep pick`: a study's top trials (+ seed re-runs) as candidates, selection on one half of the val images,
honest figures on the other half, and the outputs (via search.pick_outputs).

Selection never sees the report half: candidates are scored on the select half only, the best single member is
chosen there, and the ensemble weights are fitted there; the report half only measures. (The trials themselves were
ranked and early-stopped by the study on the whole val split, so both halves flatter every member alike; the gain
"ensemble - best single" on the report half is the fair comparison.)
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from search import ensemble
from search.state import default_artifact_root, default_storage, default_tracking_uri, state_dir
from trainers.config import Config, dump_toml, with_values
from trainers.errors import DataError, LatentsweepError

SPLIT_KEYS = ("split", "val_ratio", "salt", "n_folds", "fold")
# Only the best few configs get seed re-runs: each re-run is a full training, and past the top 3 the members are
# weaker than the extra seeds of the strongest ones.
SEED_CONFIGS = 3
DONE_FILE = "done.json"  # written after a seed re-run finished; a re-run with the same config and data is reused


@dataclass(frozen=True)
class PickOptions:
    study: str
    state_dir: str | None = None
    storage: str | None = None
    tracking_uri: str | None = None
    top: int = 5
    method: str = "greedy"
    size: int = 10
    seeds: int = 0
    data: str | None = None
    test: str | None = None
    out: str | None = None
    register: str | None = None
    seed: int = 0  # seed of the leaderboard galleries' shuffle on both halves
    device: str = "auto"
    progress: bool = True


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

    @property
    def config_sha256(self) -> str:
        return hashlib.sha256(dump_toml(self.cfg).encode()).hexdigest()


@dataclass(frozen=True)
class Paths:
    root: Path
    storage: str
    tracking_uri: str
    artifact_root: str | None
    picks: Path  # STATE/picks/<study>: seed re-runs
    out: Path
    manifest: Path
    report: Path


def note(message: str) -> None:
    print(f"latentsweep: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------- paths and checks

def resolve_paths(opts: PickOptions) -> Paths:
    """Storage/tracking from the state directory unless given; the default out is STATE/picks/<study>/submission.csv."""
    root = state_dir(opts.state_dir, create=False)
    if opts.storage is None and not (root / "optuna.db").is_file():
        raise LatentsweepError(f"no Optuna storage in {root} (optuna.db not found): run `latentsweep study run` "
                               "first, or pass --state-dir / --storage")
    picks = root / "picks" / opts.study
    out = Path(opts.out).expanduser() if opts.out else picks / "submission.csv"
    out = out.resolve()
    check_writable(out)
    return Paths(root, opts.storage or default_storage(root), opts.tracking_uri or default_tracking_uri(root),
                 None if opts.tracking_uri else default_artifact_root(root), picks, out,
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
    if opts.seeds < 0:
        raise LatentsweepError(f"--seeds must be >= 0, got {opts.seeds}")
    if opts.method not in ensemble.METHODS:
        raise LatentsweepError(f"--method must be one of {', '.join(ensemble.METHODS)}, got '{opts.method}'")


# ---------------------------------------------------------------------------------------------- candidates

def top_trials(study, k: int) -> list:
    """The k best COMPLETE trials by value in the study's direction."""
    from optuna.study import StudyDirection
    from optuna.trial import TrialState

    complete = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
    if not complete:
        states = pd.Series([t.state.name for t in study.get_trials(deepcopy=False)]).value_counts().to_dict()
        raise LatentsweepError(f"study '{study.study_name}' has no complete trials "
                               f"({', '.join(f'{n} {s}' for s, n in states.items()) or 'no trials at all'})")
    maximize = study.direction == StudyDirection.MAXIMIZE
    return sorted(complete, key=lambda t: (-t.value if maximize else t.value, t.number))[:k]


def fetch_checkpoint(trial, tracking_uri: str, download_dir: Path) -> tuple[Path, str] | None:
    """(path, origin) of the trial's best.pt: the local path in user_attrs, else downloaded from its MLflow run;
    None (with a warning naming the trial) if neither."""
    local = trial.user_attrs.get("checkpoint")
    if local and Path(local).is_file():
        return Path(local), "local"
    run_id = trial.user_attrs.get("mlflow_run_id")
    reason = f"{local or 'no local checkpoint recorded'} is missing"
    if run_id:
        from mlflow import MlflowClient

        dst = download_dir / f"trial-{trial.number}"
        dst.mkdir(parents=True, exist_ok=True)
        try:
            path = MlflowClient(tracking_uri).download_artifacts(run_id, "best.pt", str(dst))
            return Path(path), f"runs:/{run_id}/best.pt"
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
    return Candidate(name, trial, path, cfg, (dim_in, dim_out), value, meta.get("data_fingerprint"), origin, model)


def load_candidates(study, k: int, tracking_uri: str, download_dir: Path, device) -> list[Candidate]:
    out = []
    for t in top_trials(study, k):
        found = fetch_checkpoint(t, tracking_uri, download_dir)
        if found is not None:
            out.append(make_candidate(f"trial-{t.number}", t.number, *found, float(t.value), device))
    if not out:
        raise LatentsweepError(f"study '{study.study_name}': none of the top {k} complete trials has a checkpoint")
    check_agreement(out)
    return out


def check_agreement(cands: list[Candidate]) -> None:
    """Every candidate must be a translate model sharing the val split (data.split, val_ratio, salt, n_folds, fold)
    and the dims."""
    ref = cands[0]
    for c in cands:
        if c.cfg.data.task != "translate":
            raise LatentsweepError(f"{c.name} has data.task='{c.cfg.data.task}': pick ensembles translate models only")
    for c in cands[1:]:
        for key in SPLIT_KEYS:
            mine, theirs = getattr(c.cfg.data, key), getattr(ref.cfg.data, key)
            if mine != theirs:
                raise LatentsweepError(f"{c.name} has data.{key}={mine!r} but {ref.name} has {theirs!r}: "
                                       "candidates must share one val split")
        if c.dims != ref.dims:
            raise LatentsweepError(f"{c.name} maps dims {c.dims} but {ref.name} maps {ref.dims}")


def resolve_data(opts: PickOptions, cands: list[Candidate]) -> tuple[Path, Path]:
    """(train npz, test npz): --data, else the path recorded in the trials' config, else the demo; --test, else the
    demo test (demo data) or a test.clean.npz beside the train file."""
    from search.studyfile import resolve_data_path
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

def outputs(cands: list[Candidate], x: np.ndarray, device) -> list[np.ndarray]:
    """Each candidate's predictions [N, Di] (numpy float32) for caption embeddings x [N, Dt]."""
    from trainers.tasks import predict

    xt = torch.as_tensor(np.ascontiguousarray(x, np.float32), device=device)
    return [predict(c.model, xt).cpu().numpy() for c in cands]


@dataclass
class Selection:
    weights: np.ndarray  # [M] sum 1
    table: pd.DataFrame
    scores: dict[str, Any]
    best_single: str
    halves: tuple[ensemble.Half, ensemble.Half]


def select(cands: list[Candidate], data, method: str, size: int, seed: int, device) -> Selection:
    """Fit the weights on the select half; measure members, best single, mean and ensemble on both halves."""
    from trainers.tasks import split_images

    _, val_img = split_images(cands[0].cfg, data)
    halves = ensemble.split_halves(val_img, data.image_names, data.cap2img)
    scores, outs = {}, {}
    for half in halves:
        fn = ensemble.scorer(half, data.image, seed)
        outs[half.name] = out = outputs(cands, data.text[half.captions], device)
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
    return Selection(weights, pd.DataFrame(rows), {**summary, "gain_report_mrr": gain}, cands[best].name, halves)


def _row(role: str, name: str, weight, value, summary: dict, key) -> dict[str, Any]:
    def get(half: str) -> dict[str, float]:
        return summary[half]["members"][key] if isinstance(key, int) else summary[half][key]

    sel, rep = get("select"), get("report")
    return {"role": role, "name": name, "weight": weight, "study_value": value, "select_mrr": sel["mrr"],
            "report_mrr": rep["mrr"], "report_r1": rep["r1"], "report_r10": rep["r10"]}


# ---------------------------------------------------------------------------------------------- the command

def run_pick(opts: PickOptions):
    """The whole pick; returns search.pick_outputs.PickResult. Cheap checks come before any training."""
    from search.pick_outputs import write_outputs
    from search.report import load_existing_study
    from trainers.data import load_test, load_train
    from trainers.loop import resolve_device

    check_options(opts)
    paths = resolve_paths(opts)
    study = load_existing_study(opts.study, paths.storage)
    device = resolve_device(opts.device)
    with tempfile.TemporaryDirectory(prefix="latentsweep-pick-") as downloads:
        cands = load_candidates(study, opts.top, paths.tracking_uri, Path(downloads), device)
        data_path, test_path = resolve_data(opts, cands)
        test = load_test(test_path)
        check_test(cands, test)
        data = load_train(data_path)
        check_data(cands, data)
        if opts.seeds:
            cands += seed_candidates(cands, opts.seeds, data, paths.picks, device, opts.progress)
            check_agreement(cands)
        sel = select(cands, data, opts.method, opts.size, opts.seed, device)
        keep = [i for i, w in enumerate(sel.weights) if w > 0]
        test_pred = ensemble.combine(outputs([cands[i] for i in keep], test.embeddings, device), sel.weights[keep])
        return write_outputs(opts, paths, study, cands, sel, data, test, test_pred)
