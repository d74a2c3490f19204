"""The training jobs of `latentsweep pick` and the two stages that run them: out-of-fold models of every candidate
(k jobs each, on k-1 image folds) and refits of the chosen members on every labelled image; each job cached on disk,
started only while the budget (latentsweep.search.pick.plan) lasts.

A job replays one trial's configuration with `data.split = "all"` (no validation) on a set of images for the number
of epochs the trial found best (`train.stop_after = best epoch + 1`), keeping the trial's schedule horizon
(`train.epochs`), so the learning-rate curve up to that epoch is the one that produced the trial's best value. An epoch
is one pass over the data, so a larger training set gets proportionally more steps at the same epoch count.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from latentsweep.trainers.core.pages import take
from latentsweep.search.checks import check_folds
from latentsweep.search.failures import raise_stop
from latentsweep.search.pick.candidates import Candidate, make_candidate, share_data
from latentsweep.search.pick.ensemble import predict_all
from latentsweep.search.pick.plan import Clock
from latentsweep.trainers.train.checkpoint import load_model
from latentsweep.trainers.config.tree import Config, dump_toml, with_values
from latentsweep.trainers.data.sets import TrainSet
from latentsweep.trainers.core.io import atomic_write
from latentsweep.trainers.core.deadline import Deadline
from latentsweep.trainers.train.loop import DeadlineReached, train
from latentsweep.trainers.models.zoo import UNTRAINED_KINDS
from latentsweep.trainers.core.progress import say
from latentsweep.trainers.data.splits import captions_and_local_images, captions_of, fold_assignment
from latentsweep.trainers.train.tasks import split_images

DONE_FILE = "done.json"  # written when a job finished; a job with the same config and data reuses its model
# Only the best few configs get seed re-runs (--no-refit --selection halves): each re-run is a full training, and past
# the top 3 the members are weaker than the extra seeds of the strongest ones.
SEED_CONFIGS = 3


def subset(data: TrainSet, images: np.ndarray) -> TrainSet:
    """The TrainSet restricted to `images` (sorted int64 indices) and their captions; a fingerprint of its own."""
    images = np.sort(np.asarray(images, np.int64))
    caps, local = captions_and_local_images(data.cap2img, images)
    labels = None if data.image_labels is None else data.image_labels[images]
    return replace(data, fingerprint=subset_fingerprint(data, images), caption_ids=data.caption_ids[caps],
                   caption_text=None if data.caption_text is None else data.caption_text[caps],
                   text=take(data.text, caps), image=take(data.image, images),
                   cap2img=local, image_names=data.image_names[images], image_labels=labels)


def subset_fingerprint(data: TrainSet, images: np.ndarray | None) -> str:
    """The data's fingerprint, extended with a digest of the image subset (None = every image)."""
    if images is None:
        return data.fingerprint
    digest = hashlib.md5(np.sort(np.asarray(images, np.int64)).tobytes()).hexdigest()[:12]
    return f"{data.fingerprint}/images-{digest}"


@dataclass(frozen=True)
class Job:
    name: str  # "trial-3/fold-1-of-5" or "trial-3/seed-1"
    member: str  # the candidate it belongs to ("trial-3")
    cfg: Config
    images: np.ndarray | None  # training images; None = every labelled image
    run_dir: Path
    cost: float | None  # estimated seconds (0: a finished identical job is reused; None: nothing measured)


def replay_config(cfg: Config, best_epoch: int, seed: int | None = None) -> Config:
    """The trial's config trained without validation up to its best epoch (0-based), optionally with another seed."""
    values = {"data.split": "all", "train.stop_after": best_epoch + 1}
    if seed is not None:
        values["train.seed"] = seed
    return with_values(cfg, values)


def done_stamp(cfg: Config, fingerprint: str) -> dict[str, str]:
    return {"config_sha256": hashlib.sha256(dump_toml(cfg).encode()).hexdigest(), "data_fingerprint": fingerprint}


def is_done(run_dir: Path, stamp: dict) -> bool:
    done = run_dir / DONE_FILE
    return done.is_file() and (run_dir / "best.pt").is_file() and json.loads(done.read_text()) == stamp


def make_job(name: str, member: str, cfg: Config, cand: Candidate, data: TrainSet, images, run_dir: Path) -> Job:
    """A job replaying `cand`'s config `cfg` on `images` (None: every image), its cost estimated from the trial."""
    if is_done(run_dir, done_stamp(cfg, subset_fingerprint(data, images))):
        return Job(name, member, cfg, images, run_dir, 0.0)
    n_img = len(data.image) if images is None else len(images)
    n_caps = len(data.cap2img) if images is None else len(captions_of(data.cap2img, images))
    return Job(name, member, cfg, images, run_dir, job_cost(cand, data, n_caps, n_img, cfg.train.stop_after))


def run_job(job: Job, data: TrainSet, progress: bool,
            deadline: Deadline = Deadline.never()) -> tuple[Path | None, float | None]:
    """Train (or reuse) the job: (its checkpoint, seconds spent training; None when reused). It stops at `deadline`
    keeping its best finished epoch (latentsweep.trainers.train.loop.train), or is dropped when no epoch finished before
    it: (None,
    seconds spent). The done stamp is written only after training finished every planned epoch, so a job cut by the
    deadline is trained again, whole, by the next pick."""
    part = data if job.images is None else subset(data, job.images)
    stamp = done_stamp(job.cfg, part.fingerprint)
    ckpt = job.run_dir / "best.pt"
    if is_done(job.run_dir, stamp):
        return ckpt, None
    job.run_dir.mkdir(parents=True, exist_ok=True)
    (job.run_dir / DONE_FILE).unlink(missing_ok=True)
    with atomic_write(job.run_dir / "config.toml") as fh:
        fh.write(dump_toml(job.cfg))
    start = time.monotonic()
    try:
        result = train(job.cfg, part, out_dir=job.run_dir, progress=progress, deadline=lambda: deadline)
    except DeadlineReached:
        return None, time.monotonic() - start
    except Exception as exc:  # classified once (search/failures.py): a bug keeps its traceback, the rest one line
        raise_stop(exc, f"pick job {job.name}")
    if not result.stopped_at_deadline:
        with atomic_write(job.run_dir / DONE_FILE) as fh:
            fh.write(json.dumps(stamp))
    return ckpt, time.monotonic() - start


def job_cost(cand: Candidate, data, captions: int, images: int, epochs: int) -> float | None:
    """Estimated seconds of `cand`'s config trained `epochs` epochs without validation on `captions` captions of
    `images` images: from the trial's measured start-up and per-epoch seconds (latentsweep.trainers.train.cost), else
    from its wall time
    per caption-epoch (trials recorded before timings: validation and logging included, so it overestimates), else
    None (nothing measured)."""
    if cand.timing is not None:
        return cand.timing.estimate(captions, images, epochs)
    if cand.seconds is None:
        return None
    train_img, _ = split_images(cand.cfg, data)
    per_caption_epoch = cand.seconds / max(cand.epochs_run, 1) / max(len(captions_of(data.cap2img, train_img)), 1)
    return per_caption_epoch * captions * epochs


def fold_jobs(cands: list[Candidate], data, n_folds: int, picks: Path) -> list[Job]:
    check_folds("--folds", n_folds, len(data.image_names))  # before k jobs per candidate are built and priced
    fold_of = fold_assignment(data.image_names, n_folds)
    return [make_job(f"{c.name}/fold-{f + 1}-of-{n_folds}", c.name, replay_config(c.cfg, c.best_epoch), c,
                     data, np.flatnonzero(fold_of != f), picks / "runs" / f"{c.name}-fold-{f + 1}-of-{n_folds}")
            for c in cands for f in range(n_folds)]


def refit_jobs(cands: list[Candidate], seeds: int, data, picks: Path, seed_offset: int = 0) -> list[Job]:
    """Refits on every labelled image, seeds train.seed + seed_offset .. + seed_offset + seeds - 1 of each candidate;
    a model kind with nothing to train (knn) gets its first seed only: more would be the same model again."""
    jobs = []
    for c in cands:
        n = seeds if c.cfg.model.kind not in UNTRAINED_KINDS else max(0, min(seeds, 1 - seed_offset))
        for s in range(seed_offset, seed_offset + n):
            seed = c.cfg.train.seed + s
            jobs.append(make_job(f"{c.name}/refit-seed-{seed}", c.name, replay_config(c.cfg, c.best_epoch, seed), c,
                                 data, None, picks / "runs" / f"{c.name}-refit-seed-{seed}"))
    return jobs


def run_fold_jobs(cands: list[Candidate], data, n_folds: int, picks: Path, device, clock: Clock,
                  progress: bool) -> tuple[list[Candidate], list[np.ndarray], dict[str, list[tuple[str, Path]]]]:
    """Train every candidate on k-1 folds for each fold and predict the held-out fold, candidate by candidate, each
    job started only while the clock admits it. Returns (the candidates whose folds all finished, their out-of-fold
    predictions [Nc, Di] each, their (job name, fold checkpoint) lists by name)."""
    jobs = fold_jobs(cands, data, n_folds, picks)
    clock.announce(len(jobs))
    kept, oof, models = [], [], {}
    for cand in cands:
        mine = [j for j in jobs if j.member == cand.name]
        pred, ckpts = np.zeros((len(data.cap2img), cand.dims[1]), np.float32), []
        for job in mine:
            if not clock.admits(job.cost):
                break
            ckpt = clock.timed(job, lambda j=job: run_job(j, data, progress, clock.job_deadline()), jobs)
            if ckpt is None:
                break
            held = captions_of(data.cap2img, np.setdiff1d(np.arange(len(data.image)), job.images))
            pred[held] = predict_all([loaded(ckpt, data, device)], take(data.text, held), device)[0]
            ckpts.append((job.name, ckpt))
        if len(ckpts) < len(mine):
            say(f"latentsweep: budget: {cand.name} and the candidates after it leave the selection (their finished "
                "fold jobs are kept for the next pick)")
            break
        kept.append(cand)
        oof.append(pred)
        models[cand.name] = ckpts
    return kept, oof, models


@dataclass
class SubmissionModel:
    """One model that makes the submission: one of a member's fold models, one of its refits (one per seed), or its
    trial checkpoint (--no-refit)."""
    name: str
    member: str
    checkpoint: Path
    weight: float  # the member's weight shared equally by its models
    origin: str  # "fold", "refit", or the trial checkpoint's: "local", "runs:/..."
    job: Job | None = None
    model: torch.nn.Module | None = field(default=None, repr=False)


def refit_queue(chosen: list[tuple[Candidate, float]], seeds: int, data, picks: Path) -> list[Job]:
    """The refits in the order a pick runs them: seed 1 of every member by weight, then seed 2, ... up to `seeds`."""
    members = [c for c, _ in sorted(chosen, key=lambda cw: -cw[1])]
    return [job for s in range(seeds) for job in refit_jobs(members, 1, data, picks, seed_offset=s)]


def refit_members(chosen: list[tuple[Candidate, float]], fold_models: dict[str, list[tuple[str, Path]]],
                  seeds: int, data, picks: Path, device, clock: Clock,
                  progress: bool) -> tuple[list[SubmissionModel], list[str]]:
    """The models of the submission: each chosen (member, weight)'s fold models (oof selection) bagged in with its
    refits on every labelled image: seed 1 of every member by weight, then seed 2, ... up to `seeds`, each refit
    started only while the clock admits its estimate. A member's weight is shared equally by its models; a member
    left without any model (the budget ran out first) leaves the submission."""
    chosen = sorted(chosen, key=lambda cw: -cw[1])
    queue = refit_queue(chosen, seeds, data, picks)
    clock.announce(len(queue))
    made = {c.name: [(name, ckpt, "fold", None) for name, ckpt in fold_models.get(c.name, [])] for c, _ in chosen}
    notes: list[str] = []
    for i, job in enumerate(queue):
        clock.models = sum(map(len, made.values())) + 1
        if not clock.admits(job.cost):
            notes.append(f"budget: {clock.left():.0f} s left, so {i} of {len(queue)} refits run")
            break
        ckpt = clock.timed(job, lambda j=job: run_job(j, data, progress, clock.job_deadline()), queue)
        if ckpt is None:
            notes.append(f"budget: refit {job.name} dropped at the deadline, {i} of {len(queue)} refits run")
            break
        made[job.member].append((job.name, ckpt, "refit", job))
    kept = [(c, w) for c, w in chosen if made[c.name]]
    total = sum(w for _, w in kept)
    out = [SubmissionModel(name, c.name, ckpt, w / total / len(made[c.name]), origin, job, loaded(ckpt, data, device))
           for c, w in kept for name, ckpt, origin, job in made[c.name]]
    return out, notes


def loaded(checkpoint: Path, data, device) -> torch.nn.Module:
    """The checkpoint's model, reading what it reads of the training data (a knn model's keys) from `data`, the
    loaded TrainSet it was made from (candidates.share_data), not from its checkpoint's copy."""
    model, _, meta = load_model(checkpoint, device)
    share_data(model, data, meta.get("data_fingerprint"))
    return model


def seed_candidates(cands: list[Candidate], seeds: int, data, picks: Path, device, clock: Clock,
                    progress: bool) -> list[Candidate]:
    """Retrain the best min(K, SEED_CONFIGS) configs with train.seed = original + 1..seeds on their own split (not a
    replay: --selection halves scores them on the study's val split), reusing finished identical runs; each re-run
    started only while the clock admits its estimate (the trial's epochs, validation included)."""
    todo = []
    for c in cands[:SEED_CONFIGS]:
        train_img, _ = split_images(c.cfg, data)  # one split per config, shared by its re-runs
        for s in range(1, seeds + 1):
            cfg = with_values(c.cfg, {"train.seed": c.cfg.train.seed + s})
            run_dir = picks / "seeds" / f"trial-{c.trial}-seed-{c.cfg.train.seed + s}"
            cost = 0.0 if is_done(run_dir, done_stamp(cfg, data.fingerprint)) else (
                c.timing.estimate(len(captions_of(data.cap2img, train_img)), len(train_img), c.epochs_run, True)
                if c.timing is not None else c.seconds)
            todo.append((c, Job(f"trial-{c.trial}/seed-{c.cfg.train.seed + s}", c.name, cfg, None, run_dir, cost)))
    clock.announce(len(todo))
    out = []
    for base, job in todo:
        if not clock.admits(job.cost):
            say(f"latentsweep: budget: {clock.left():.0f} s left, so {len(out)} of {len(todo)} seed re-runs run")
            break
        ckpt = clock.timed(job, lambda j=job: run_job(j, data, progress, clock.job_deadline()), [j for _, j in todo])
        if ckpt is None:
            break
        out.append(make_candidate(job.name, base.trial, ckpt, "retrained", None, device))
        share_data(out[-1].model, data, out[-1].data_fingerprint)
    return out
