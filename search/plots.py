"""Figures logged to the tracker: rank histograms of a model and Optuna study plots (matplotlib, Agg backend)."""
from __future__ import annotations

import logging
import warnings
from typing import Any

import matplotlib

matplotlib.use("Agg")  # figures are only written to files: never open a display (headless workers, CI)

import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

log = logging.getLogger(__name__)

HIST_BINS = 40  # log-spaced bins between rank 1 and the worst rank


def rank_histogram(ranks: np.ndarray, title: str) -> Figure:
    """Histogram of the exact rank of the true image per query (log x axis), MRR and median in the title."""
    ranks = np.asarray(ranks).reshape(-1)
    if ranks.size and ranks.min() < 1:
        raise ValueError(f"ranks start at 1, got {ranks.min()}")
    fig = Figure(figsize=(6, 4))  # not registered with pyplot: nothing to leak if the caller never closes it
    ax = fig.subplots()
    if ranks.size == 0:
        ax.text(0.5, 0.5, "no ranks", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} (no queries)")
        return fig
    top = int(ranks.max())
    edges = np.unique(np.geomspace(1, top + 1, HIST_BINS).round())  # integer edges; bin i covers [e_i, e_i+1)
    if edges.size < 2:
        edges = np.array([1.0, 2.0])
    ax.hist(ranks, bins=edges, color="tab:blue", edgecolor="white")
    ax.set_xscale("log")
    ax.set_xlabel("rank of the true image (1 = best)")
    ax.set_ylabel("queries")
    mrr = float(np.mean(1.0 / ranks))
    ax.set_title(f"{title}\nMRR {mrr:.4f}, median rank {np.median(ranks):g}, n={ranks.size}")
    fig.tight_layout()
    return fig


def _figure_of(plot: Any) -> Any:
    """Optuna's matplotlib plots return Axes (or an array of them); the tracker logs their Figure."""
    if isinstance(plot, np.ndarray):
        plot = plot.flat[0]
    return plot.figure if hasattr(plot, "figure") else plot


def _varying_param(trials: list) -> bool:
    names = {name for t in trials for name in t.params}
    return any(len({repr(t.params.get(name)) for t in trials}) > 1 for name in names)


def study_figures(study: Any) -> dict[str, Any]:
    """Optimization history, parallel coordinates and (when meaningful) param importances; a plot that fails is
    skipped with a log line, since plots must never fail a study."""
    from optuna.exceptions import ExperimentalWarning
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return {}
    plots = {"optimization_history.png": ovm.plot_optimization_history,
             "parallel_coordinate.png": ovm.plot_parallel_coordinate}
    if len(complete) >= 2 and _varying_param(complete):
        plots["param_importances.png"] = ovm.plot_param_importances
    figures = {}
    for name, plot in plots.items():
        before = set(plt.get_fignums())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                figures[name] = _figure_of(plot(study))
        except Exception as exc:  # noqa: BLE001  (multi-objective studies, degenerate spaces, plotting bugs)
            log.info("skipping %s: %s", name, exc)
            for num in set(plt.get_fignums()) - before:
                plt.close(num)
    return figures
