"""`latentsweep pick`: a study's best trials ensembled into a submission, in the order a reader follows:
budget and candidates -> plan (search.pick.plan) -> fold jobs (search.pick.jobs) -> selection (search.pick.selection,
out-of-fold with the nested gain in search.pick.oof) -> refits (search.pick.jobs) -> outputs (search.pick.outputs).

Default (`--selection oof`): every candidate config is retrained on k-1 image folds for each fold, so every labelled
caption gets a prediction from a model that never saw its image; greedy selection runs on all of them and nested folds
give the honest gain with its spread. The chosen members' fold models are bagged with their refits on all images,
each replaying the epochs its trial found best. `--selection halves` keeps the older scheme: weights on one half of
the study's val split, figures on the other. Candidates: search.pick.candidates; options: search.pick.options.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

from search.pick import ensemble
from search.pick import plan as plan_mod
from search.pick.candidates import (
    Candidate, check_agreement, check_data, check_test, load_candidates, resolve_data,
)
from search.pick.jobs import SubmissionModel, fold_jobs, refit_jobs, refit_members, seed_candidates
from search.pick.options import AUTO, Paths, PickOptions, check_options, pool_size, resolve_paths
from search.pick.outputs import PickResult, PickRun, write_outputs
from search.pick.plan import Clock, note
from search.pick.selection import Selection, screen, select_halves, select_oof
from search.study.report import load_existing_study
from search.tracking.probe import probe_tracking_store
from search.tracking import make_tracker
from trainers.data import load_test, load_train
from trainers.loop import resolve_device


def choose(opts: PickOptions, pool: list[Candidate], data, paths: Paths, device,
           clock: Clock) -> tuple[list[Candidate], Selection]:
    """(the candidates kept, the selection) by --selection: out-of-fold over a pool ordered for diversity and planned
    to fit the budget (a single candidate needs no selection), or halves of the study's val split."""
    if opts.selection == "halves":
        check_agreement(pool, same_split=True)
        cands = list(pool[:opts.top])
        if opts.seeds and not opts.refit:
            cands += seed_candidates(cands, opts.seeds, data, paths.picks, device, opts.progress)
            check_agreement(cands, same_split=True)
        return cands, select_halves(cands, data, opts.method, opts.size, opts.seed, device)
    check_agreement(pool, same_split=False)
    ordered, how = screen(pool, data, device, opts.size, opts.seed)
    note(f"candidates: {len(pool)} best trials, ordered {how}")

    def cost(top: int, folds: int, seeds: int) -> float:
        chosen = ordered[:top]
        refits = refit_jobs(chosen[:1], 1 if folds else seeds, data, paths.picks) if opts.refit else []
        return sum(j.cost for j in (fold_jobs(chosen, data, folds, paths.picks) if folds else []) + refits)

    p = plan_mod.plan(cost, min(opts.top, len(ordered)), opts.folds, opts.refit_seeds, clock.left())
    for line in p.notes:
        note(line)
    budget = f" (budget {clock.budget:.0f} s)" if clock.budget is not None else ""
    note(f"plan: {p.describe()}{budget}")
    cands = ordered[:p.top]
    if p.folds == 0:
        table = pd.DataFrame([{"role": "member", "name": cands[0].name, "weight": 1.0, "study_value": cands[0].value}])
        sel = Selection(np.ones(1), table, cands[0].name, 0.0, float("nan"), "single", {}, {})
    else:
        cands, sel = select_oof(cands, data, p.folds, opts, paths.picks, device, clock)
    sel.details["notes"] = p.notes + sel.details.get("notes", [])
    sel.details["plan"] = {"top": p.top, "folds": p.folds, "seeds": p.seeds, "estimate_s": p.estimate,
                           "budget_s": clock.budget, "candidates_order": how}
    return cands, sel


def pick_budget(opts: PickOptions, study) -> float | None:
    """The pick's budget in seconds: --budget, none, or the default derived from the study's wall time (printed)."""
    if opts.budget != AUTO:
        return opts.budget
    budget, why = plan_mod.default_budget(plan_mod.study_wall_seconds(study.get_trials(deepcopy=False)))
    note(f"budget: {budget:.0f} s ({why}; --budget SECONDS or --budget none to change)")
    return budget


def run_pick(opts: PickOptions) -> PickResult:
    """The whole pick; returns search.pick.outputs.PickResult. Cheap checks come before any training."""
    started = time.monotonic()
    check_options(opts)
    paths = resolve_paths(opts)
    probe_tracking_store(paths.tracking_uri)  # in seconds, before any training: the run is written last
    study = load_existing_study(opts.study, paths.storage)
    device = resolve_device(opts.device)
    clock = Clock(pick_budget(opts, study), started)
    with tempfile.TemporaryDirectory(prefix="latentsweep-pick-") as downloads:
        tracker = make_tracker(paths.tracking_uri, paths.artifact_root)
        pool = load_candidates(study, pool_size(opts), tracker, Path(downloads), device, paths.root)
        data_path, test_path = resolve_data(opts, pool)
        test = load_test(test_path)
        check_test(pool, test)
        data = load_train(data_path)
        check_data(pool, data)
        cands, sel = choose(opts, pool, data, paths, device, clock)
        chosen = [(c, float(w)) for c, w in zip(cands, sel.weights) if w > 0]
        if opts.refit:
            models, notes = refit_members(chosen, sel.fold_models, opts.refit_seeds,
                                          sel.details.get("cost_factor", 1.0), data, paths.picks, device, clock,
                                          opts.progress)
        else:  # --no-refit: the trials' own checkpoints
            models, notes = [SubmissionModel(c.name, c.name, c.checkpoint, w, c.origin, model=c.model)
                             for c, w in chosen], []
        for line in notes:
            note(line)
        sel.details.setdefault("notes", []).extend(notes)
        made = pd.DataFrame([{"role": "submission_model", "name": m.name, "weight": m.weight, "origin": m.origin}
                             for m in models])
        sel.table = pd.concat([sel.table, made], ignore_index=True)
        test_pred = ensemble.combine(ensemble.predict_all([m.model for m in models], test.embeddings, device),
                                     [m.weight for m in models])
        return write_outputs(tracker, PickRun(opts, paths, study, cands, sel, models, data, test, test_pred))
