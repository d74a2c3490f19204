"""One check per kind of user value (types, counts, seeds, durations, registry names, outputs): one-line errors."""
from __future__ import annotations

import math
from pathlib import Path

from latentsweep.trainers.core.errors import LatentsweepError
from latentsweep.trainers.config.knobs import MAX_SEED

# Longest duration accepted (--time, --timeout, budgets): a week, as `run --time`
# (latentsweep.search.pick.onebudget.MAX_TOTAL_S).
# Longer is a typo (a digit too many) or an infinity ("1e999", 400 nines) that no plan can be made for.
MAX_SECONDS = 7 * 24 * 3600.0
# Refit seeds per chosen member: averaging gains flatten after a few seeds (REFIT_SEEDS = 3 is the default); more
# than this is a typo that would build that many refit jobs per member before the budget trims them.
MAX_REFIT_SEEDS = 100

_KINDS = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}


def check_type(name: str, value, *types: type, none: bool = False):
    """`value` when it is one of `types` (a bool is not a number here), or None when `none`; else one line naming
    the argument and the type expected."""
    if value is None and none:
        return value
    numeric = any(t in (int, float) for t in types) and bool not in types
    if isinstance(value, tuple(types)) and not (numeric and isinstance(value, bool)):
        return value
    shown = [t for t in types if not (t is int and float in types)]  # int or float: "a number"
    expected = " or ".join(_KINDS.get(t, t.__name__) for t in shown) + (" or None" if none else "")
    raise LatentsweepError(f"{name} must be {expected}, got {type(value).__name__} {value!r}")


def check_count(name: str, value, low: int = 1, high: int | None = None, why: str = "") -> int:
    """A whole number in [low, high]; `why` says where the upper bound comes from."""
    check_type(name, value, int)
    if value < low:
        raise LatentsweepError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise LatentsweepError(f"{name} must be <= {high}{why}, got {value}")
    return value


def check_seed(name: str, value) -> int:
    """A seed numpy and torch both accept: 0 .. 2**32 - 1."""
    return check_count(name, value, 0, MAX_SEED)


def check_seconds(name: str, value) -> float:
    """A positive, finite duration of at most MAX_SECONDS."""
    check_type(name, value, int, float)
    if not (math.isfinite(value) and 0 < value <= MAX_SECONDS):
        raise LatentsweepError(f"{name} must be a positive number of seconds up to {MAX_SECONDS:.0f} (7 days), "
                               f"got {value:g}")
    return float(value)


def check_folds(name: str, folds: int, images: int) -> int:
    """Image folds: each needs at least one image, so no more folds than the data has images."""
    return check_count(name, folds, 2, images, f" (the data has {images} images)")


def check_registry_name(name: str, value) -> str:
    """A name the MLflow Model Registry accepts, by MLflow's own rule, checked before any work (not at
    registration, after every refit)."""
    check_type(name, value, str)
    if not value.strip():
        raise LatentsweepError(f"{name} {value!r}: a registered model name cannot be blank")
    from latentsweep.search.tracking.mlflow import registry_name_problem  # MLflow is loaded only when a name is given

    problem = registry_name_problem(value)
    if problem:
        raise LatentsweepError(f"{name} {value!r}: the MLflow Model Registry refuses it ({problem})")
    return value


def check_outputs(option: str, outputs: list[Path | str], inputs: dict[str, Path | str | None],
                  protected: dict[Path, str] | None = None) -> None:
    """No output may resolve (through symlinks) to one of the command's `inputs` (name: path; None skipped), nor to
    or into a file or folder the state needs (`protected`: latentsweep.search.stores.protected_paths). Checked before
    any work:
    writing there would replace what is being read, or a store."""
    guarded = {Path(path).expanduser(): f"the input {name}" for name, path in inputs.items() if path}
    guarded.update(protected or {})
    held = {path.resolve(): what for path, what in guarded.items()}
    for out in outputs:
        given = Path(out).expanduser()
        target = given.resolve()
        via = f" (through the link to {target})" if target != given.absolute() else ""
        for path, what in held.items():
            if target == path or (path.is_dir() and path in target.parents):
                where = "is" if target == path else "is inside"
                raise LatentsweepError(f"{option}: {given} {where} {what}{via}: writing it would replace "
                                       f"{'the input' if what.startswith('the input') else what}; choose another "
                                       "path")


def check_new_files(option: str, paths: list[Path], force: str = "--force") -> None:
    """Outputs must not exist yet unless `force` is given: a command never silently replaces earlier results."""
    there = [str(p) for p in paths if p.exists()]
    if there:
        raise LatentsweepError(f"{option}: {', '.join(there)} already {'exists' if len(there) == 1 else 'exist'}; "
                               f"pass {force} to replace, or choose another directory")


def check_device_option(option: str, name: str) -> None:
    """A device option (`--device` of `run` and `pick`) names a device of this machine; its error names the option."""
    from latentsweep.trainers.core.devices import resolve_device  # torch: only when a device is checked

    try:
        resolve_device(name)
    except LatentsweepError as exc:
        raise LatentsweepError(f"{option}: {exc}") from None
