"""Choosing the ensemble of `latentsweep pick`: the diversity screen of the candidate pool, out-of-fold selection on
every labelled image (over the fold jobs' predictions, with the nested gain), or the older halves of the study's val
split."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from latentsweep.trainers.core.pages import take
from latentsweep.search.pick import ensemble, jobs
from latentsweep.search.pick import oof as oof_mod
from latentsweep.search.pick.candidates import SPLIT_KEYS, Candidate
from latentsweep.search.pick.boards import Board
from latentsweep.search.pick.ensemble import caption_rows, predict_all, predict_each
from latentsweep.search.pick.options import PickOptions
from latentsweep.search.pick.plan import Clock, Plan
from latentsweep.trainers.core.errors import DataError
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.core.progress import say
from latentsweep.trainers.data.splits import captions_and_local_images, fold_assignment
from latentsweep.trainers.train.tasks import split_images


@dataclass
class Selection:
    weights: np.ndarray  # [M] sum 1
    table: pd.DataFrame  # one row per member, then best_single, mean, ensemble
    best_single: str
    gain: float  # ensemble - best single on images the selection never saw
    gain_se: float  # standard error of that gain over the folds (nan where not measured)
    kind: str  # "val", "oof", "halves", or "single" (one candidate: no selection)
    metrics: dict[str, float]  # for the MLflow pick run
    details: dict[str, Any]  # facts for the manifest only (nothing downstream reads them)
    fold_models: dict[str, list[tuple[str, Path]]] = field(default_factory=dict)  # oof: (job, checkpoint) each
    notes: list[str] = field(default_factory=list)  # what the pick gave up or changed, in the order it happened
    ensemble_used: bool | None = None  # False: gain not above its standard error, the best single member submitted
    # (never False with --fallback never)
    plan: Plan | None = None  # oof: the fold plan that fitted the budget


def select_halves(cands: list[Candidate], data, method: str, size: int, seed: int, device) -> Selection:
    """Halves: fit the weights on the select half; measure members, best single, mean and ensemble on both."""
    _, val_img = split_images(cands[0].cfg, data)
    halves = ensemble.split_halves(val_img, data.image_names, data.cap2img)
    scores, outs = {}, {}
    for half in halves:
        fn = ensemble.half_scorer(half, data.image, seed)
        outs[half.name] = out = predict_all([c.model for c in cands], take(data.text, half.captions), device)
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


def screen(cands: list[Candidate], data, device, size: int, seed: int = 0) -> tuple[list[Candidate], str]:
    """The candidate pool reordered for diversity, at no training cost: when the trials share one val split, greedy
    forward selection (Caruana) on their checkpoints' val predictions picks members that add to one another, and
    those come first (by weight), then the rest by study rank. Each trial chose its best epoch on that split, so its
    figures are optimistic; it only orders the pool, and the out-of-fold selection re-measures every candidate."""
    shared = all(getattr(c.cfg.data, k) == getattr(cands[0].cfg.data, k) for c in cands for k in SPLIT_KEYS)
    if len(cands) < 3 or not shared or cands[0].cfg.data.split == "all":
        return cands, "by study rank"
    _, val_img = split_images(cands[0].cfg, data)
    if len(val_img) < 2:
        return cands, "by study rank"
    caps, local = captions_and_local_images(data.cap2img, val_img)
    board = Board(np.arange(len(val_img)), data.image[val_img], local, seed)  # images_scorer's galleries
    for pred in predict_each([c.model for c in cands], caption_rows(data.text, caps, device), device):
        board.add(ensemble.l2n_(pred))  # one member's [Nq, Di] at a time, its [Nq, 100] similarities kept
        del pred
    weights = ensemble.weights_by("greedy", len(cands), board.score, size)
    order = sorted(range(len(cands)), key=lambda i: (-weights[i], i))
    picked = ", ".join(f"{cands[i].name} {weights[i]:.2f}" for i in order if weights[i] > 0)
    return [cands[i] for i in order], f"greedy on the study's val split first ({picked}), then by study rank"


def ensemble_kept(res: oof_mod.OofSelection, fallback: str) -> bool:
    """Whether the selection's ensemble stands: always with --fallback never; with one-se only when its nested gain
    is above its standard error over the folds."""
    return fallback == "never" or res.gain_is_real


def submitted_weights(res: oof_mod.OofSelection, names: list[str], fallback: str) -> tuple[np.ndarray, list[str]]:
    """(weights, notes): the selection's weights, or the best single member alone when the ensemble does not stand
    (`ensemble_kept`; greedy may also have chosen one member by itself)."""
    if ensemble_kept(res, fallback) or (res.weights > 0).sum() <= 1:
        return res.weights, []
    return np.eye(len(names))[res.best_single], [
        f"ensemble not used: its nested gain {res.gain:+.4f} is not above its standard error over the folds "
        f"({res.gain_se:.4f}); the submission is the best single member, {names[res.best_single]}"]


# Folds of the study's val images for the cross-fitted selection: weights on 4/5, scored on the other 1/5.
VAL_FOLDS = 5
# Each selection is made on some folds and scored on another: at least two images, one on each side.
MIN_VAL_IMAGES = 2
# What each selection's gain figure is measured on (said in the CLI, the MLflow run's description and the figure).
WHERE = {
    "val": "cross-fitted on the study's val split: each fifth of its images scored by a selection made on the other "
           "four (the trials' epochs were also chosen on that split, so members and ensemble are optimistic alike)",
    "oof": "nested folds of every labelled image: each fold scored by a selection made on the other folds",
    "halves": "the report half of the study's val split, never seen by the selection",
}


def spread_text(gain_se: float) -> str:
    """" +/- SE (standard error over the folds)" for a measured standard error, "" where none was (halves)."""
    return f" +/- {gain_se:.4f} (standard error over the folds)" if gain_se == gain_se else ""


def select_val(cands: list[Candidate], data, opts: PickOptions, device) -> Selection:
    """Ensemble selection on the trials' own checkpoints' predictions of the study's shared val split, at no training
    cost: greedy (or --method) weights on every val image, and the gain cross-fitted over VAL_FOLDS image folds."""
    _, val_img = split_images(cands[0].cfg, data)
    if len(val_img) < MIN_VAL_IMAGES:  # a tiny train file (10 images): no fold to score a selection on
        raise DataError(f"{data.path}: the study's val split has {len(val_img)} image(s); the pick's selection needs "
                        f"at least {MIN_VAL_IMAGES} (more images, or a larger data.val_ratio)")
    caps, local = captions_and_local_images(data.cap2img, val_img)
    folds = oof_mod.Folds(fold_assignment(data.image_names[val_img], min(VAL_FOLDS, len(val_img))), local)
    # [Nval_caps, Di] each, made as the selection reads it and let go once ranked (oof.nested_select)
    preds = predict_each([c.model for c in cands], caption_rows(data.text, caps, device), device)
    res = oof_mod.nested_select(preds, folds, take(data.image, val_img), opts.method, opts.size, opts.seed, in_place=True)
    release_free_heap()  # the galleries' row blocks (under glibc's mmap threshold): 0.5-0.9 GB kept resident before
    return _crossfit_selection(cands, res, opts, "val", {"val_folds": folds.n, "val_images": len(val_img),
                                                         "val_captions": len(caps)})


def select_oof(cands: list[Candidate], data, n_folds: int, opts: PickOptions, picks: Path, device,
               clock: Clock) -> tuple[list[Candidate], Selection | None]:
    """Out-of-fold selection over the candidates whose fold jobs fit the budget: (those candidates, the selection);
    no selection (None) when not even the first candidate's folds fit."""
    cands, oof, fold_models = jobs.run_fold_jobs(cands, data, n_folds, picks, device, clock, opts.progress)
    if not cands:
        return [], None
    fold_of = fold_assignment(data.image_names, n_folds)
    folds = oof_mod.Folds(fold_of, np.asarray(data.cap2img, np.int64))
    res = oof_mod.nested_select(oof, folds, data.image, opts.method, opts.size, opts.seed, in_place=True)
    del oof
    sel = _crossfit_selection(cands, res, opts, "oof", {"folds": n_folds, "images": len(data.image),
                                                        "captions": len(data.cap2img)})
    sel.fold_models = fold_models
    return cands, sel


def _crossfit_selection(cands: list[Candidate], res: oof_mod.OofSelection, opts: PickOptions, kind: str,
                        facts: dict[str, Any]) -> Selection:
    """The Selection of a cross-fitted choice (val folds or out-of-fold): the submitted weights (or the best single
    member when the gain is not above its standard error), its table, metrics and manifest details."""
    weights, notes = submitted_weights(res, [c.name for c in cands], opts.fallback)
    for line in notes:
        say(f"latentsweep: {line}")
    rows = [{"role": "member", "name": c.name, "weight": float(w), "study_value": c.value, "oof_mrr": float(m)}
            for c, w, m in zip(cands, weights, res.member_mrr)]
    rows += [{"role": "best_single", "name": cands[res.best_single].name, "weight": None,
              "study_value": cands[res.best_single].value, "oof_mrr": float(res.member_mrr[res.best_single]),
              "nested_mrr": float(res.fold_best.mean())},
             {"role": "mean", "name": f"mean of {len(cands)}", "weight": None, "study_value": None,
              "oof_mrr": res.mean_mrr},
             {"role": "ensemble", "name": opts.method, "weight": None, "study_value": None,
              "oof_mrr": res.ensemble_mrr, "nested_mrr": float(res.fold_ensemble.mean())}]
    metrics = {"nested/gain_mrr": res.gain, "nested/gain_mrr_std": res.gain_std,
               "nested/gain_mrr_se": res.gain_se,
               "nested/ensemble_mrr": float(res.fold_ensemble.mean()),
               "nested/best_single_mrr": float(res.fold_best.mean()), "oof/ensemble_mrr": res.ensemble_mrr,
               "oof/mean_mrr": res.mean_mrr, **{f"member/{c.name}/oof_mrr": float(m)
                                                for c, m in zip(cands, res.member_mrr)}}
    details = {**facts, "measured_on": WHERE[kind],
               "nested": {"gain_mrr": res.gain, "gain_mrr_std": res.gain_std, "gain_mrr_se": res.gain_se,
                          "fold_gains": res.fold_gains.tolist(), "fold_ensemble_mrr": res.fold_ensemble.tolist(),
                          "fold_best_single_mrr": res.fold_best.tolist()},
               "oof": {"ensemble_mrr": res.ensemble_mrr, "mean_mrr": res.mean_mrr,
                       "best_single_mrr": float(res.member_mrr[res.best_single])},
               }
    return Selection(weights, pd.DataFrame(rows), cands[res.best_single].name, res.gain, res.gain_se, kind,
                     metrics, details, notes=notes, ensemble_used=ensemble_kept(res, opts.fallback))
