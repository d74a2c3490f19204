"""`latentsweep pick`: a study's best trials ensembled into a submission, in the order a reader follows:
budget and candidates -> plan (latentsweep.search.pick.plan) -> fold jobs (latentsweep.search.pick.jobs) -> selection
(latentsweep.search.pick.selection,
out-of-fold with the nested gain in latentsweep.search.pick.oof) -> refits (latentsweep.search.pick.jobs) -> outputs
(latentsweep.search.pick.outputs).

Default (`--selection oof`): every candidate config is retrained on k-1 image folds for each fold, so every labelled
caption gets a prediction from a model that never saw its image; greedy selection runs on all of them and nested folds
give the honest gain with its spread. The chosen members' fold models are bagged with their refits on all images,
each replaying the epochs its trial found best. `--selection halves` keeps the older scheme: weights on one half of
the study's val split, figures on the other. Candidates: latentsweep.search.pick.candidates; options:
latentsweep.search.pick.options.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna
import pandas as pd

from latentsweep.search.checks import check_folds
from latentsweep.search.pick import ensemble
from latentsweep.search.pick import plan as plan_mod
from latentsweep.search.pick.candidates import (
    SPLIT_KEYS, Candidate, check_agreement, check_data, check_test, load_candidates, resolve_data, share_data,
)
from latentsweep.search.pick.jobs import SubmissionModel, fold_jobs, refit_jobs, refit_members, seed_candidates
from latentsweep.search.pick.options import AUTO, Paths, PickOptions, check_options, pool_size, resolve_paths
from latentsweep.search.pick.outputs import PickResult, PickRun, write_outputs
from latentsweep.search.pick.plan import Clock
from latentsweep.search.pick.selection import Selection, screen, select_halves, select_oof, select_val
from latentsweep.search.study.contract import read_trials
from latentsweep.search.study.report import load_existing_study
from latentsweep.search.tracking.probe import probe_tracking_store
from latentsweep.search.tracking import make_tracker
from latentsweep.search.tracking.base import Tracker
from latentsweep.trainers.data.sets import TestSet, TrainSet, load_test_shared, load_train_shared
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.core.heap import release_free_heap
from latentsweep.trainers.train.loop import resolve_device
from latentsweep.trainers.core.progress import say


def choose(opts: PickOptions, pool: list[Candidate], data, paths: Paths, device,
           clock: Clock) -> tuple[list[Candidate], Selection]:
    """(the candidates kept, the selection) by --selection: on the trials' own val predictions (val, no training),
    halves of the study's val split, or out-of-fold over fold jobs planned to fit the budget."""
    data.hand_back_pages()  # a search read every page; a selection reads its val captions, fold jobs what they train on
    if opts.selection == "halves":
        check_agreement(pool, same_split=True)
        cands = list(pool[:opts.top])
        if opts.seeds and not opts.refit:
            cands += seed_candidates(cands, opts.seeds, data, paths.picks, device, clock, opts.progress)
            check_agreement(cands, same_split=True)
        return cands, select_halves(cands, data, opts.method, opts.size, opts.seed, device)
    if opts.selection == "val":
        check_agreement(pool, same_split=False)
        if shares_val_split(pool):
            say(f"latentsweep: candidates: the {len(pool)} best trials, selected on their own checkpoints' "
                "predictions of the study's val split (no training)")
            return pool, select_val(pool, data, opts, device)
        say("latentsweep: candidates: the trials do not share one val split, so they are selected out-of-fold (fold "
            "models)")
    return choose_oof(opts, pool, data, paths, device, clock)


def choose_oof(opts: PickOptions, pool: list[Candidate], data, paths: Paths, device,
               clock: Clock) -> tuple[list[Candidate], Selection]:
    """Out-of-fold selection over a pool ordered for diversity and planned to fit the budget; a single candidate (or
    a budget that holds no candidate's folds) needs no selection."""
    check_agreement(pool, same_split=False)
    ordered, how = screen(pool, data, device, opts.size, opts.seed)
    say(f"latentsweep: candidates: {len(pool)} best trials, ordered {how}")

    def cost(top: int, folds: int, seeds: int) -> float:
        chosen = ordered[:top]
        refits = refit_jobs(chosen[:1], 1 if folds else seeds, data, paths.picks) if opts.refit else []
        jobs = (fold_jobs(chosen, data, folds, paths.picks) if folds else []) + refits
        return sum(clock.expect(j.cost) for j in jobs) + clock.export_reserve()

    p = plan_mod.plan(cost, min(opts.top, len(ordered)), opts.folds, opts.refit_seeds, clock.left())
    for line in p.notes:
        say(f"latentsweep: {line}")
    budget = f" (budget {clock.left():.0f} s left)" if clock.budget is not None else ""
    say(f"latentsweep: plan: {p.describe()}{budget}")
    cands, sel = (ordered[:p.top], None) if p.folds == 0 else select_oof(ordered[:p.top], data, p.folds, opts,
                                                                         paths.picks, device, clock)
    if sel is None:
        cands = ordered[:1]
        table = pd.DataFrame([{"role": "member", "name": cands[0].name, "weight": 1.0, "study_value": cands[0].value}])
        sel = Selection(np.ones(1), table, cands[0].name, 0.0, float("nan"), "single", {}, {})
    sel.notes[:0] = p.notes
    sel.plan = p
    sel.details["candidates_order"] = how
    return cands, sel


def shares_val_split(cands: list[Candidate]) -> bool:
    """Whether every candidate validated on the same images (so their checkpoints' val predictions compare)."""
    ref = cands[0].cfg.data
    return ref.split != "all" and all(getattr(c.cfg.data, k) == getattr(ref, k) for c in cands for k in SPLIT_KEYS)


def refit_plan(chosen: list[tuple[Candidate, float]], seeds: int, data, paths: Paths, clock: Clock) -> None:
    """Print what the refits will be and their estimate before any of them starts."""
    jobs = refit_jobs([c for c, _ in chosen], seeds, data, paths.picks)
    clock.models = len(jobs)
    estimate = sum(clock.expect(j.cost) for j in jobs) + clock.export_reserve()
    budget = f"; budget {clock.left():.0f} s left" if clock.budget is not None else ""
    say(f"latentsweep: plan: refit {len(chosen)} member(s) on every labelled image, seed 1 of each then more up to "
        f"{seeds} seed(s) while the budget lasts: {len(jobs)} jobs and the export, estimated {estimate:.0f} s{budget}")


def submission_models(opts: PickOptions, cands: list[Candidate], sel: Selection, data, paths: Paths, device,
                      clock: Clock) -> tuple[list[SubmissionModel], list[str]]:
    """The models of the submission: the chosen members' refits (and fold models) while the budget lasts, or their
    trials' own checkpoints (--no-refit, or when not even one refit fits)."""
    chosen = [(c, float(w)) for c, w in zip(cands, sel.weights) if w > 0]
    if opts.refit:
        refit_plan(chosen, opts.refit_seeds, data, paths, clock)
        models, notes = refit_members(chosen, sel.fold_models, opts.refit_seeds, data, paths.picks, device, clock,
                                      opts.progress)
        if models:
            return models, notes
        notes.append("budget: no refit fits, so the submission is made of the trials' own checkpoints")
    else:
        notes = []
    return [SubmissionModel(c.name, c.name, c.checkpoint, w, c.origin, model=c.model) for c, w in chosen], notes


def pick_budget(opts: PickOptions, study) -> float | None:
    """The pick's budget in seconds: --budget, none, or the default derived from the study's wall time (printed)."""
    if opts.budget != AUTO:
        return opts.budget
    budget, why = plan_mod.default_budget(plan_mod.study_wall_seconds(read_trials(study)))
    say(f"latentsweep: budget: {budget:.0f} s ({why}; --budget SECONDS or --budget none to change)")
    return budget


@dataclass
class PickInputs:
    """What every pick step reads: resolved paths, the study, its tracker, the candidate pool, train and test data."""
    paths: Paths
    study: optuna.Study
    tracker: Tracker
    pool: list[Candidate]
    data: TrainSet
    test: TestSet


def load_inputs(opts: PickOptions, downloads: Path, device) -> PickInputs:
    """Resolve and check everything a pick needs, in seconds, before any training (the run is written last, so its
    tracking store is probed first)."""
    paths = resolve_paths(opts)
    probe_tracking_store(paths.tracking_uri)
    study = load_existing_study(opts.study, paths.storage)
    tracker = make_tracker(paths.tracking_uri, paths.artifact_root)
    pool = load_candidates(study, pool_size(opts), tracker, downloads, device, paths.root)
    data_path, test_path = resolve_data(opts, pool)
    test = load_test_shared(test_path)  # a one-budget run read it already
    check_test(pool, test)
    data = load_train_shared(data_path)  # a one-budget run's search read it already
    check_data(pool, data)
    for cand in pool:  # a knn candidate's keys: the loaded captions, not its checkpoint's copy of them
        share_data(cand.model, data, cand.data_fingerprint)
    if opts.selection == "oof":  # a fold needs an image: known only once the data is
        check_folds("--folds", opts.folds, len(data.image_names))
    return PickInputs(paths, study, tracker, pool, data, test)


def run_pick(opts: PickOptions) -> PickResult:
    """`latentsweep pick`: the whole pick within --budget (latentsweep.search.pick.plan); returns
    latentsweep.search.pick.outputs.PickResult.
    Cheap checks come before any training."""
    started = time.monotonic()
    check_options(opts)
    device = resolve_device(opts.device)
    with tempfile.TemporaryDirectory(prefix="latentsweep-pick-") as downloads:
        inp = load_inputs(opts, Path(downloads), device)
        return _pick(opts, inp, Deadline.after(pick_budget(opts, inp.study), started), device, None, started)


def pick_until(opts: PickOptions, deadline: Deadline, gate=None) -> PickResult | None:
    """The pick of a one-budget job (latentsweep.search.pick.onebudget): inside the job's `deadline` (opts.budget is not
    read),
    and, with `gate(models, weights, device) -> manifest record or None`, written only when the gate lets the chosen
    ensemble replace the answer in place (None: it lost, nothing written)."""
    started = time.monotonic()
    check_options(opts)
    device = resolve_device(opts.device)
    release_free_heap()  # what the job's search freed (its trials, the keeper's scores), kept resident by glibc
    with tempfile.TemporaryDirectory(prefix="latentsweep-pick-") as downloads:
        inp = load_inputs(opts, Path(downloads), device)
        return _pick(opts, inp, deadline, device, gate, started)


def _pick(opts: PickOptions, inp: PickInputs, deadline: Deadline, device, gate, started: float) -> PickResult | None:
    """Selection, refits and outputs on the loaded inputs; the gate (if any) judges the chosen trials' checkpoints
    with the chosen weights before anything is written."""
    paths, data, test = inp.paths, inp.data, inp.test
    clock = Clock(deadline, started)
    cands, sel = choose(opts, inp.pool, data, paths, device, clock)
    answer = None
    if gate is not None:
        answer = gate([c.model for c in cands], list(sel.weights), device)
        if answer is None:
            return None
    models, notes = submission_models(opts, cands, sel, data, paths, device, clock)
    for line in notes:
        say(f"latentsweep: {line}")
    sel.notes.extend(notes)
    made = pd.DataFrame([{"role": "submission_model", "name": m.name, "weight": m.weight, "origin": m.origin}
                         for m in models])
    sel.table = pd.concat([sel.table, made], ignore_index=True)
    test_pred = ensemble.predict_combined([m.model for m in models], [m.weight for m in models], test.embeddings,
                                          device)
    result = write_outputs(inp.tracker, PickRun(opts, paths, inp.study, cands, sel, models, data, test, test_pred,
                                                clock.budget, answer, deadline))
    budget = f" of its {clock.budget:.0f} s budget" if clock.budget is not None else ""
    say(f"latentsweep: pick done in {clock.elapsed:.0f} s{budget}: {len(models)} model(s) in the submission")
    return result
