"""Per-epoch metric records: kept in memory and rewritten to metrics.csv after every epoch (a crash loses nothing)."""
from __future__ import annotations

import csv
from pathlib import Path

from latentsweep.trainers.core.io import atomic_write


class EpochLog:
    """Rows of {'epoch': e, **metrics}; mirrored to `out_dir/metrics.csv` when out_dir is given."""

    def __init__(self, out_dir: str | Path | None):
        self.path = Path(out_dir) / "metrics.csv" if out_dir is not None else None
        self.rows: list[dict[str, float]] = []

    def append(self, epoch: int, metrics: dict[str, float]) -> None:
        self.rows.append({"epoch": epoch, **metrics})
        if self.path is not None:
            write_csv(self.path, self.rows)


def write_csv(path: Path, rows: list[dict]) -> None:
    """Atomic rewrite (latentsweep.trainers.core.io.atomic_write): a reader never sees a half-written file; columns are
    the union
    of keys."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    with atomic_write(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
