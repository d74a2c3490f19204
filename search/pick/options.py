"""The options of `latentsweep pick` and the paths they resolve to, all checked before any training."""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from latentsweep.search.checks import (
    MAX_REFIT_SEEDS, check_count, check_device_option, check_outputs, check_registry_name, check_seconds, check_seed,
    check_type,
)
from latentsweep.search.pick.ensemble import METHODS
from latentsweep.search.stores import protected_paths, resolve_stores, state_dir, writable_dir
from latentsweep.trainers.core.errors import LatentsweepError

# Refit seeds per chosen member by default: averaging 3 seeds was worth about +0.015 MRR on challenge-format data.
REFIT_SEEDS = 3
SELECTIONS = ("val", "oof", "halves")
# When the cross-fitted selection falls back to the best single member: "one-se" when the ensemble's nested gain is
# not above its standard error (latentsweep.search.pick.oof.OofSelection.gain_is_real), "never" (the ensemble always).
FALLBACKS = ("one-se", "never")
AUTO = "auto"  # --budget default: derived from the study's wall time (latentsweep.search.pick.plan.default_budget)
# Out-of-fold selection screens this many times --top trials (ordered for diversity on the study's val split, from
# their checkpoints: no training) before the plan keeps --top of them.
POOL_FACTOR = 2


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
    selection: str = "val"  # "val": cross-fitted on the trials' val predictions (no training); "oof": k-fold
    # out-of-fold on every labelled image (fold jobs); "halves": halves of the val split
    folds: int = 5
    fallback: str = FALLBACKS[0]
    refit: bool = True
    budget: float | str | None = AUTO  # seconds for the whole pick; None = no limit; AUTO = from the study's time
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


def resolve_paths(opts: PickOptions) -> Paths:
    """Storage/tracking from the state directory unless given; the default out is STATE/picks/<study>/submission.csv."""
    root = state_dir(opts.state_dir, create=False)
    stores = resolve_stores(root, opts.storage, opts.tracking_uri, read_only=True)  # no optuna.db: one-line error
    if opts.tracking_uri is None and not writable_dir(root):
        raise LatentsweepError(f"state directory {root} is read-only: pick reads the study from it, but its MLflow "
                               "run needs a writable store: pass --tracking-uri (e.g. sqlite:///elsewhere/mlflow.db) "
                               "and --out")
    picks = root / "picks" / opts.study
    out = out_path(opts, root)
    check_writable(out)
    check_outputs("--out", pick_outputs(opts.out, out), {"--data": opts.data, "--test": opts.test},
                  protected_paths(root, stores.storage, stores.tracking_uri, stores.artifact_root))
    if not writable_dir(root):  # fold jobs and refits are kept beside the submission instead (and reused there)
        picks = out.parent / f".{opts.study}-runs"
    return Paths(root, stores.storage, stores.tracking_uri, stores.artifact_root, picks, *pick_files(out))


def pick_files(out: Path) -> tuple[Path, Path, Path]:
    """What a pick writes for the submission `out`: itself, its manifest and its report table, side by side."""
    return out, out.with_name(f"{out.stem}.manifest.json"), out.with_name(f"{out.stem}.report.csv")


def pick_outputs(given: str | None, out: Path) -> list[Path]:
    """pick_files of --out as the user wrote it (so an error names their path) and of `out`, where it resolves."""
    return [*(pick_files(Path(given).expanduser()) if given else ()), *pick_files(out)]


def out_path(opts: PickOptions, root: Path) -> Path:
    """--out, else STATE/picks/<study>/submission.csv under the state directory `root`; absolute."""
    return (Path(opts.out).expanduser() if opts.out else root / "picks" / opts.study / "submission.csv").resolve()


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
    """Every option's type and range (shared checks, latentsweep.search.checks), before anything is read or trained."""
    check_count("--top", opts.top)
    check_count("--size", opts.size)
    if opts.seeds is not None:
        check_count("--seeds", opts.seeds, 1 if opts.refit else 0, MAX_REFIT_SEEDS, " seeds per member")
    check_seed("--seed", opts.seed)
    check_count("--folds", opts.folds, 2)
    for name in ("refit", "progress"):
        check_type(name, getattr(opts, name), bool)
    for name in ("study", "method", "selection", "fallback", "device"):
        check_type(name, getattr(opts, name), str)
    check_device_option("--device", opts.device)
    for name in ("state_dir", "storage", "tracking_uri", "data", "test", "out"):
        check_type(name, getattr(opts, name), str, Path, none=True)
    if opts.register is not None:
        check_registry_name("--register", opts.register)
    _choice("--selection", opts.selection, SELECTIONS)
    _choice("--fallback", opts.fallback, FALLBACKS)
    _choice("--method", opts.method, METHODS)
    if opts.budget not in (None, AUTO):
        check_type("--budget", opts.budget, int, float)
        check_seconds("--budget", opts.budget)


def _choice(name: str, value: str, choices) -> None:
    if value not in choices:
        raise LatentsweepError(f"{name} must be one of {', '.join(choices)}, got '{value}'")


def pool_size(opts: PickOptions) -> int:
    """How many of the study's best trials to load: --top, or POOL_FACTOR x --top for val and out-of-fold selection."""
    return opts.top * POOL_FACTOR if opts.selection in ("val", "oof") else opts.top


def parse_budget(text: str) -> float | str | None:
    """--budget: seconds, 'auto' (the default) or 'none' (no bound)."""
    word = text.strip().lower()
    if word in ("none", "inf", "unlimited"):
        return None
    if word == AUTO:
        return AUTO
    try:
        return float(word)
    except ValueError:
        raise LatentsweepError(f"--budget must be a number of seconds, 'auto' or 'none', got '{text}'") from None
