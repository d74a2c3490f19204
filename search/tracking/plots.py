"""Figures logged to the tracker: rank histograms of a model, the pick's ensemble and Optuna study plots (matplotlib;
entry points choose the Agg backend, see latentsweep.search.process)."""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
from optuna.exceptions import ExperimentalWarning
from optuna.trial import TrialState
from latentsweep.trainers.core.progress import say

if TYPE_CHECKING:
    from matplotlib.figure import Figure


HIST_BINS = 40  # log-spaced bins between rank 1 and the worst rank
# Below this many complete trials the importance plot is left out: fANOVA fits a random forest on the trials, and
# with a handful of points its ranking mostly reflects which knobs TPE happened to move (the issue saw 4).
MIN_IMPORTANCE_TRIALS = 10


def rank_histogram(ranks: np.ndarray, title: str) -> Figure:
    """Histogram of the exact rank of the true image per val caption among all val images (global protocol, log x
    axis), its MRR and median in the title; says that val/mrr, the objective, uses the leaderboard protocol."""
    ranks = np.asarray(ranks).reshape(-1)
    if ranks.size and ranks.min() < 1:
        raise ValueError(f"ranks start at 1, got {ranks.min()}")
    from matplotlib.figure import Figure  # matplotlib costs 28 MB of RSS: loaded by the first figure, not at start

    fig = Figure(figsize=(8, 5))  # not registered with pyplot: nothing to leak if the caller never closes it
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
    ax.set_xlabel("rank of the true image among all val images (1 = best; global protocol)")
    ax.set_ylabel("val captions")
    mrr = float(np.mean(1.0 / ranks))
    ax.set_title(f"{title}, best epoch: global protocol (each caption vs all val images)\n"
                 f"MRR {mrr:.4f} (= val/mrr_global), median rank {np.median(ranks):g}, n={ranks.size} captions",
                 fontsize=10)
    fig.text(0.01, 0.01, "The objective val/mrr uses the leaderboard protocol (galleries of 100 images), so it is "
             "higher than this MRR.", fontsize=8, color="dimgray")
    # The margins tight_layout(rect=(0, 0.04, 1, 1)) chose for this layout (counts up to 5 digits), fixed: measuring
    # every tick label of the log axis was about half of drawing and saving the figure (docs/trial-costs.md).
    fig.subplots_adjust(left=0.115, right=0.981, bottom=0.162, top=0.894)
    return fig


def ensemble_figure(names: list[str], weights: np.ndarray, report_mrr: list[float], ensemble_mrr: float,
                    best_single_mrr: float, title: str,
                    where: str = "MRR on data the selection never saw") -> Figure:
    """Ensemble weights per candidate (left) and each candidate's MRR with the ensemble's (right), both measured on
    data the selection did not see (`where` says which)."""
    height = max(4.0, 0.45 * len(names) + 2.0)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, height))
    left, right = fig.subplots(1, 2, sharey=True)
    pos = np.arange(len(names))
    colors = ["tab:blue" if w > 0 else "lightgray" for w in weights]
    left.barh(pos, weights, color=colors)
    left.set_yticks(pos, names)
    left.invert_yaxis()
    left.set_xlabel("ensemble weight (gray: not selected)")
    for y, w in zip(pos, weights):
        left.text(w, y, f" {w:.2f}", va="center", fontsize=9)
    right.barh(pos, report_mrr, color=colors)
    right.axvline(ensemble_mrr, color="tab:red", label=f"ensemble {ensemble_mrr:.4f}")
    right.axvline(best_single_mrr, color="black", linestyle="--", label=f"best single {best_single_mrr:.4f}")
    right.set_xlabel(where)
    right.legend(loc="lower right", fontsize=9)
    lo = min([*report_mrr, ensemble_mrr]) * 0.9
    right.set_xlim(lo, max([*report_mrr, ensemble_mrr]) * 1.03)
    fig.suptitle(f"{title}: gain over the best single member {ensemble_mrr - best_single_mrr:+.4f} MRR")
    fig.tight_layout()
    return fig


def _figure_of(plot: Any) -> Any:
    """Optuna's matplotlib plots return Axes (or an array of them); the tracker logs their Figure."""
    if isinstance(plot, np.ndarray):
        plot = plot.flat[0]
    return plot.figure if hasattr(plot, "figure") else plot


def with_pruned(plot: Any, study: Any) -> Any:
    """Optuna's history plot draws complete trials only: a study whose pruner stopped most trials (the quickstart's
    ASHA stopped 11 of 12 on the demo data) showed one point. Pruned trials are added, in gray, at the value Optuna
    records for them (their last reported epoch's), and said so in the legend."""
    pruned = [t for t in study.get_trials(deepcopy=False, states=(TrialState.PRUNED,)) if t.value is not None]
    if pruned:
        ax = plot.flat[0] if isinstance(plot, np.ndarray) else plot
        ax.scatter([t.number for t in pruned], [t.value for t in pruned], marker="x", color="gray",
                   label="pruned (value when stopped)")
        ax.legend(bbox_to_anchor=(1.05, 1.0), loc="upper left")  # where Optuna puts its own legend
    return plot


def varying_params(trials: list) -> list[str]:
    """Names of the params that take more than one value among `trials`, sorted."""
    names = sorted({name for t in trials for name in t.params})
    return [name for name in names if len({repr(t.params.get(name)) for t in trials}) > 1]


def _readable(figure: Any, name: str, n_params: int, note: str | None) -> Any:
    """Size the figure for its content, un-clip the labels, add a note under the plot."""
    width = max(10.0, 2.0 * n_params + 3.0) if name == "parallel_coordinate.png" else 10.0
    height = max(5.0, 0.5 * n_params + 2.5) if name == "param_importances.png" else 6.0
    figure.set_size_inches(width, height)
    for ax in figure.axes:
        for label in ax.get_xticklabels() if name == "parallel_coordinate.png" else []:
            label.set_rotation(15)
            label.set_horizontalalignment("right")
    if note:
        figure.text(0.01, 0.01, note, fontsize=9, color="dimgray")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # twin axes of the parallel plot: tight_layout is best effort
        figure.tight_layout(rect=(0, 0.05 if note else 0, 1, 1))
    return figure


def study_figures(study: Any, objective: str | None = None) -> dict[str, Any]:
    """Optimization history, parallel coordinates of the varying knobs and, from MIN_IMPORTANCE_TRIALS complete
    trials on, param importances; a plot that fails is skipped with a progress line (plots must never fail a study)."""
    # pyplot and Optuna's matplotlib plots take about a second to import: only the end of a study pays for them
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as ovm

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not complete:
        return {}
    target = objective or (study.metric_names or ["objective"])[0]
    varying = varying_params(complete)
    count = f"{len(complete)} complete trials"
    plots = {"optimization_history.png": (
        lambda s: with_pruned(ovm.plot_optimization_history(s, target_name=target), s), None)}
    if varying:
        plots["parallel_coordinate.png"] = (
            lambda s: ovm.plot_parallel_coordinate(s, params=varying, target_name=target),
            f"{count}; knobs that did not vary are left out")
    if len(complete) >= MIN_IMPORTANCE_TRIALS and varying:
        plots["param_importances.png"] = (
            lambda s: ovm.plot_param_importances(s, params=varying, target_name=target),
            f"fANOVA importances from {count}: indicative only with few trials")
    figures = {}
    for name, (plot, note) in plots.items():
        before = set(plt.get_fignums())
        try:
            with warnings.catch_warnings():  # "experimental", and accuracy notes on few trials: noise on stderr
                warnings.simplefilter("ignore", ExperimentalWarning)
                warnings.simplefilter("ignore", UserWarning)
                figures[name] = _readable(_figure_of(plot(study)), name, len(varying), note)
        except Exception as exc:  # noqa: BLE001  (multi-objective studies, degenerate spaces, plotting bugs)
            say(f"skipping {name}: {exc}")
            for num in set(plt.get_fignums()) - before:
                plt.close(num)
    return figures
