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
from search.pick import plan as plan_mod
from search.pick.options import AUTO, Paths, PickOptions, check_options, pool_size, resolve_paths
from search.pick.outputs import PickResult, write_outputs
from search.pick.plan import Clock
from search.pick.refit import note
from search.pick.selection import Selection, fold_jobs, outputs, refit_jobs, screen, select, select_oof
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


def submission_models(cands: list[Candidate], sel: Selection, opts: PickOptions, data, picks: Path, device,
                      clock: Clock) -> tuple[list[SubmissionModel], list[str]]:
    """The models of the submission. Each chosen member's fold models (out-of-fold selection) are bagged in with its
    refits on every labelled image: seed 1 of every member, then seed 2, ... up to --seeds while the budget holds one
    more (job costs scaled by what the fold jobs really took against their estimates). A member's weight is shared
    equally by its models. Without refits and fold models (--no-refit), the trials' checkpoints."""
    chosen = [(c, float(w)) for c, w in zip(cands, sel.weights) if w > 0]
    if not opts.refit:
        return [SubmissionModel(c.name, c.name, c.checkpoint, w, c.origin, model=c.model) for c, w in chosen], []
    factor = sel.details.get("cost_factor", 1.0)  # trials' wall time includes validation and tracking
    per_seed = [refit_jobs([c for c, _ in chosen], 1, data, picks, seed_offset=s) for s in range(opts.refit_seeds)]
    queue = [job for jobs in per_seed for job in jobs]
    clock.announce(len(queue))
    made = {c.name: [(name, ckpt, "fold", None) for name, ckpt in sel.fold_models.get(c.name, [])]
            for c, _ in chosen}
    notes: list[str] = []
    left = factor * sum(j.cost for j in queue)
    for i, job in enumerate(queue):
        first = not any(made.values())
        if not first and clock.budget is not None and factor * job.cost > clock.left():
            notes.append(f"budget: {clock.left():.0f} s left, so {i} of {len(queue)} refits run")
            break
        ckpt, seconds = refit.run_job(job, data, opts.progress)
        left -= factor * job.cost
        clock.report(job.name, refit.describe(job, seconds), left)
        made[job.member].append((job.name, ckpt, "refit", job))
    out = []
    for c, w in chosen:
        for name, ckpt, origin, job in made[c.name]:
            out.append(SubmissionModel(name, c.name, ckpt, w / len(made[c.name]), origin, job,
                                       load_model(ckpt, device)[0]))
    return out, notes


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
        return cands, select(cands, data, opts.method, opts.size, opts.seed, device)
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
        models, notes = submission_models(cands, sel, opts, data, paths.picks, device, clock)
        for line in notes:
            note(line)
        sel.details.setdefault("notes", []).extend(notes)
        made = pd.DataFrame([{"role": "submission_model", "name": m.name, "weight": m.weight, "origin": m.origin}
                             for m in models])
        sel.table = pd.concat([sel.table, made], ignore_index=True)
        test_pred = ensemble.combine(outputs([m.model for m in models], test.embeddings, device),
                                     [m.weight for m in models])
        return write_outputs(tracker, opts, paths, study, cands, sel, models, data, test, test_pred)
