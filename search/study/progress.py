"""A study's progress: a tqdm bar on a terminal, plain lines otherwise (one per trial; one per epoch with --verbose),
the lines said on the progress channel (latentsweep.trainers.core.progress.say)."""
from __future__ import annotations

import sys
from typing import Any

from latentsweep.search.study.contract import ERROR_ATTR


def is_terminal() -> bool:
    """Whether stderr is a terminal (bars and carriage returns only make sense there: not in CI, nohup or docker)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def trial_line(study: Any, frozen: Any) -> str:
    """`study NAME trial N COMPLETE value V best B (trial K) duration S s`; pruned trials give their last reported
    value and epoch, failed ones their error."""
    best, best_number = None, None
    try:
        best_trial = study.best_trial
        best, best_number = best_trial.value, best_trial.number
    except ValueError:  # no complete trial yet
        pass
    duration = None
    if frozen.datetime_start and frozen.datetime_complete:
        duration = (frozen.datetime_complete - frozen.datetime_start).total_seconds()
    parts = [f"study {study.study_name} trial {frozen.number} {frozen.state.name}", f"value {_fmt(frozen.value)}"]
    if frozen.state.name == "PRUNED" and frozen.intermediate_values:
        step = max(frozen.intermediate_values)
        parts[-1] = f"value {_fmt(frozen.intermediate_values[step])} at epoch {step}"
    parts.append(f"best {_fmt(best)}" + ("" if best_number is None else f" (trial {best_number})"))
    parts.append("duration " + ("-" if duration is None else f"{duration:.1f} s"))
    error = frozen.user_attrs.get(ERROR_ATTR)
    if error:
        parts.append(f"error: {error}")
    return "  ".join(parts)
