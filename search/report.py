"""Tables of a study's trials (pandas), shared by `study status`, the picker and the benchmarks."""
from __future__ import annotations

import optuna
import pandas as pd

from trainers.errors import LatentsweepError


def load_existing_study(name: str, storage: str) -> optuna.Study:
    """Load a study by name with a one-line error naming the known studies when it does not exist."""
    from search.storage import StorageSettings, open_storage, redact_url

    rdb = open_storage(StorageSettings(storage))
    try:
        return optuna.load_study(study_name=name, storage=rdb)
    except KeyError:
        known = [s.study_name for s in optuna.get_all_study_summaries(rdb)]
        raise LatentsweepError(
            f"no study named '{name}' in {redact_url(storage)}; known: {', '.join(known) or 'none'}"
        ) from None


def trials_table(name: str, storage: str, varying_only: bool = True) -> pd.DataFrame:
    """number, state, value, duration (s), then the searched knobs (only those that vary when varying_only)."""
    study = load_existing_study(name, storage)
    rows = []
    for t in study.get_trials(deepcopy=False):
        duration = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and t.datetime_start else None
        rows.append({"number": t.number, "state": t.state.name, "value": t.value,
                     "duration_s": None if duration is None else round(duration, 1), **t.params})
    table = pd.DataFrame(rows)
    if varying_only and len(table):
        fixed = ["number", "state", "value", "duration_s"]
        knobs = [c for c in table.columns if c not in fixed and table[c].astype(str).nunique(dropna=False) > 1]
        table = table[fixed + knobs]
    return table
