"""`latentsweep pick`: a study's top trials as candidates, an ensemble chosen on data no member saw, the chosen members
refit on every labelled image, and the outputs (via search.pick.outputs).

Default (`--selection oof`): every candidate config is retrained on k-1 image folds for each fold
(search.pick.refit), so every labelled caption gets a prediction from a model that never saw its image; greedy
selection runs on all of them and nested folds give the honest gain with its spread (search.pick.oof). The chosen
members are then refit on all images with several seeds, each for the epochs its trial found best; the submission
averages them. `--selection halves` keeps the older scheme: weights on one half of the study's val split, figures
on the other. Candidates: search.pick.candidates; selection: search.pick.selection; options: search.pick.options.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from search.pick import ensemble, refit
from search.pick.candidates import (
    Candidate, check_agreement, check_data, check_test, load_candidates, resolve_data, seed_candidates,
)
from search.pick.options import Paths, PickOptions, check_options, resolve_paths
from search.pick.outputs import PickResult, write_outputs
from search.pick.refit import note
from search.pick.selection import Selection, fold_jobs, outputs, refit_jobs, select, select_oof
from search.study.report import load_existing_study
from search.tracking import make_tracker
from trainers.checkpoint import load_model
from trainers.data import load_test, load_train
from trainers.loop import resolve_device


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
    sel.details["notes"] = p.notes + sel.details.get("notes", [])
    return sel, seeds  # the refit step fits its seeds to what is left of the budget, with measured job costs


def run_pick(opts: PickOptions) -> PickResult:
    """The whole pick; returns search.pick.outputs.PickResult. Cheap checks come before any training."""
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
