"""Figures of a run drawn with matplotlib (the ``demo`` extra, imported when a figure is
drawn): ``History.plot``'s loss and eval curves, ``LRFinderResult.plot``'s two panels. They
draw on plain data (losses, epoch logs, events) and touch no pyplot global state.
"""

from __future__ import annotations

import numbers
import os
import pathlib
from typing import Any

import numpy as np

from nnxscan.adapters._extras import require_extra
from nnxscan.adapters._log_values import MemberLogs, ModelLogs, is_number, logs_of


def history_plot(history: Any, path: str | os.PathLike[str], smooth: float | int) -> pathlib.Path:
    """``History.plot`` of ``history`` (a ``History``: its ``losses``, ``epochs``, ``events``
    and ``num_members``; see its docstring)."""
    losses = np.asarray(history.losses, np.float64)
    epochs, events = history.epochs, history.events
    if losses.size == 0:
        raise ValueError("nothing to plot: this History holds no training losses")
    # One column per model: a single model's losses, or each member's.
    columns = losses.reshape(len(losses), -1)
    num_members = columns.shape[1]
    window = _smoothing_window(smooth, columns.shape[0])
    figure_mod = require_extra("matplotlib.figure", "demo", needed_by="History.plot")
    agg = require_extra("matplotlib.backends.backend_agg", "demo", needed_by="History.plot")

    steps = np.arange(1, columns.shape[0] + 1)
    ends = _epoch_end_steps(epochs, columns.shape[0])
    evals = _eval_series(epochs, ends, logs_of(history))
    fig = figure_mod.Figure(figsize=(7, 5.5 if evals else 3.5), dpi=100)
    agg.FigureCanvasAgg(fig)
    axes = fig.subplots(2 if evals else 1, 1, sharex=True, squeeze=False)[:, 0]
    ax = axes[0]
    finite = np.isfinite(columns)
    labelled = num_members <= _LEGEND_MEMBERS
    for m in range(num_members):
        color = f"C{m % 10}"
        single = num_members == 1
        if num_members <= 4:
            ax.plot(steps, columns[:, m], lw=0.6, alpha=0.3, color=color,
                    label="loss" if single else None)  # fmt: skip
        label = "loss (smoothed)" if single else (f"member {m}" if labelled else None)
        ax.plot(steps, _smooth(columns[:, m], window), lw=1.5 if single else 1.0,
                color=color, label=label)  # fmt: skip
    if finite.any() and (columns[finite] > 0).all():
        ax.set_yscale("log")
    ax.set_ylabel("training loss" if num_members == 1 else f"training loss, {num_members} members")
    styles = ("-", "--", ":", "-.")
    names = sorted({name for name, _ in evals})
    for (name, member), (xs, ys) in evals.items():
        style = styles[names.index(name) % len(styles)]
        if member is None:
            axes[1].plot(xs, ys, marker="o", ms=3, lw=1.2, ls=style, label=name)
        else:
            label = f"{name}, member {member}" if labelled else None
            axes[1].plot(xs, ys, marker="o", ms=2, lw=1.0, ls=style,
                         color=f"C{member % 10}", label=label)  # fmt: skip
    if evals:
        axes[1].set_ylabel(f"eval ({_eval_cadence(epochs)})")
        if labelled:
            axes[1].legend(loc="best", fontsize="small")
    _mark_events(axes, events, epochs, ends, single=num_members == 1)
    if labelled or events:
        ax.legend(loc="upper right", fontsize="small")
    # Epoch boundaries help read the loss against the eval points; past a few dozen
    # epochs they would only hatch the plot.
    if 1 < len(ends) <= 40:
        for a in axes:
            for end in ends[:-1]:
                a.axvline(end, color="0.85", lw=0.6, zorder=0)
    for a in axes:
        a.grid(axis="y", alpha=0.3)  # vertical lines are kept for epoch boundaries
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)  # as the writers and --out do
    fig.savefig(path, format="png")
    return path


def lr_finder_plot(result: Any, path: str | os.PathLike[str] | None) -> Any:
    """``LRFinderResult.plot`` of ``result`` (an ``LRFinderResult``): see its docstring."""
    figure_mod = require_extra("matplotlib.figure", "demo", needed_by="LRFinderResult.plot")
    agg = require_extra("matplotlib.backends.backend_agg", "demo", needed_by="LRFinderResult.plot")
    colormaps = require_extra("matplotlib", "demo", needed_by="LRFinderResult.plot").colormaps
    fig = figure_mod.Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    agg.FigureCanvasAgg(fig)
    curves, finals = fig.subplots(1, 2)
    rates, num = result.learning_rates, len(result.learning_rates)
    colors = colormaps["viridis"](np.linspace(0.0, 0.9, num))
    steps = np.arange(1, result.losses.shape[0] + 1)
    # Each step's loss averaged with the steps before it, over the window the final
    # loss averages: a curve ends at its rate's final loss, and 16 raw curves of
    # per-batch noise would hide each other.
    averaged = _trailing_mean(result.losses, result.window)
    for i in range(num):
        curves.plot(steps, averaged[:, i], lw=1.2, color=colors[i], label=f"{rates[i]:.2g}")
    finite = averaged[np.isfinite(averaged)]
    if finite.size and (finite > 0).all():
        curves.set_yscale("log")
    start = result.losses[0, 0]
    if np.isfinite(start) and start > 0 and finite.size and finite.max() > 4 * start:
        # Rates that blow up early would stretch the axis and flatten the others.
        curves.set_ylim(top=4 * start)
    curves.set_xlabel("step")
    curves.set_ylabel(f"training loss (mean of the last {result.window} steps)")
    curves.set_title(f"{num} learning rates trained side by side")
    curves.legend(title="learning rate", fontsize="x-small", ncols=2 if num > 8 else 1)

    kept = np.where(result.diverged, np.nan, result.final_losses)
    finals.plot(rates, kept, marker="o", ms=4, color="C0", label="final loss")
    finals.axhline(result.losses[0, 0], color="0.5", ls=":", lw=1, label="starting loss")
    best = result.best
    if best is not None:
        # The band the rule accepts: within tolerance of the lowest final loss.
        lowest = result.final_losses[best]
        finals.axhspan(lowest, lowest + result.tolerance * abs(lowest), color="C2", alpha=0.15,
                       lw=0, label=f"within {result.tolerance:.0%} of the lowest")  # fmt: skip
    # A diverged rate is a cross: at its final loss when that is finite (it ended above
    # 4x the starting loss), else at the top of the panel.
    above = result.diverged & np.isfinite(result.final_losses)
    if above.any():
        finals.plot(rates[above], result.final_losses[above], "x", color="C3", ms=7,
                    label="diverged")  # fmt: skip
    gone = result.diverged & ~np.isfinite(result.final_losses)
    if gone.any():
        finals.plot(rates[gone], np.full(int(gone.sum()), 0.97), "x", color="C3", ms=7,
                    transform=finals.get_xaxis_transform(),
                    label=None if above.any() else "diverged")  # fmt: skip
    if result.suggestion is not None:
        finals.axvline(result.suggestion, color="C2", ls="--", lw=1.2,
                       label=f"suggested {result.suggestion:.2g}")  # fmt: skip
    shown = result.final_losses[np.isfinite(result.final_losses)]
    if shown.size and (shown > 0).all() and result.losses[0, 0] > 0:
        finals.set_yscale("log")
    finals.set_xscale("log")
    finals.set_xlabel("learning rate")
    finals.set_ylabel(f"final loss (mean of the last {result.window} steps)")
    finals.set_title(f"suggested: the smallest rate within {result.tolerance:.0%} of the best")
    finals.grid(alpha=0.3)
    finals.legend(fontsize="small", loc="best")
    if path is not None:
        os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
        fig.savefig(os.fspath(path))
    return fig


def _trailing_mean(losses: np.ndarray, window: int) -> np.ndarray:
    """Row ``t``: the mean of rows ``max(0, t - window + 1) .. t`` (NaN once a NaN is in)."""
    sums = np.cumsum(losses, axis=0)
    ahead = np.concatenate([np.zeros((window, losses.shape[1])), sums[:-window]])[: len(sums)]
    counts = np.minimum(np.arange(1, len(losses) + 1), window)[:, None]
    return (sums - ahead) / counts


# Up to this many members, the plot's legends name each one.
_LEGEND_MEMBERS = 10


def _smoothing_window(smooth: float | int, n_steps: int) -> int:
    """How many steps ``smooth`` averages over, at most a tenth of ``n_steps``."""
    if isinstance(smooth, numbers.Integral) and not isinstance(smooth, bool) and smooth >= 1:
        window = int(smooth)
    elif isinstance(smooth, numbers.Real) and not isinstance(smooth, bool) and 0 <= smooth < 1:
        window = round((1.0 + float(smooth)) / (1.0 - float(smooth)))
    else:
        raise ValueError(f"smooth must be a float in [0, 1) or an int >= 1, got {smooth!r}")
    return max(min(window, n_steps // 10), 1)


def _smooth(losses: np.ndarray, window: int) -> np.ndarray:
    """The smoothed loss curve: each step's mean over a window centred on it."""
    n = losses.size
    finite = np.isfinite(losses)
    steps = np.arange(n)
    half = np.minimum(window // 2, steps // 3)
    lo, hi = steps - half, np.minimum(steps + half + 1, n)
    # Window sums from running sums: O(n) whatever the window.
    runs = np.cumsum([np.where(finite, losses, 0.0), finite], axis=1)
    sums = np.concatenate([np.zeros((2, 1)), runs], axis=1)
    total, count = sums[:, hi] - sums[:, lo]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    tail = np.flatnonzero(steps + half > n - 1)  # the windows cut short by the run's end
    out[tail] = _tail_lines(losses, finite, lo[tail], tail)
    return out


def _tail_lines(losses: np.ndarray, finite: np.ndarray, lo: np.ndarray, at: np.ndarray):
    """Lines fitted to the finite losses in ``[lo, end)``, read at ``at``, clipped to them."""
    start = int(lo[0]) if lo.size else losses.size
    ok = finite[start:]
    x = np.where(ok, losses[start:], 0.0)
    # Positions counted back from the end keep the sums of squares small.
    pos = np.where(ok, np.arange(start, losses.size) - (losses.size - 1.0), 0.0)

    def suffix_sum(values):  # sum over [lo, end) for each window
        return np.cumsum(values[::-1])[::-1][lo - start]

    count = suffix_sum(ok.astype(np.float64))
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_p, mean_x = suffix_sum(pos) / count, suffix_sum(x) / count
        var_p = suffix_sum(pos * pos) / count - mean_p**2
        cov = suffix_sum(pos * x) / count - mean_p * mean_x
        # Two or more finite losses sit at distinct steps, so var_p >= 1/4 then.
        slope = np.where(count >= 2, cov / np.where(count >= 2, var_p, 1.0), 0.0)
        line = mean_x + slope * (at - (losses.size - 1.0) - mean_p)
    lowest = np.minimum.accumulate(np.where(ok, losses[start:], np.inf)[::-1])[::-1]
    highest = np.maximum.accumulate(np.where(ok, losses[start:], -np.inf)[::-1])[::-1]
    line = np.clip(line, lowest[lo - start], highest[lo - start])
    return np.where(count > 0, line, np.nan)


def _epoch_end_steps(epochs: list[dict[str, Any]], n_steps: int) -> np.ndarray:
    """The step count at the end of each epoch; evenly spread if an epoch lacks ``steps``."""
    if epochs and all(isinstance(e.get("steps"), numbers.Integral) for e in epochs):
        return np.cumsum([int(e["steps"]) for e in epochs])
    return np.linspace(n_steps / max(len(epochs), 1), n_steps, len(epochs))


def _eval_series(
    epochs: list[dict[str, Any]], ends: np.ndarray, logs: ModelLogs | MemberLogs
) -> dict[tuple[str, int | None], tuple[list[float], list[float]]]:
    """Each ``eval_*`` key's (end step, value) pairs over the epochs that logged it, keyed ``(key,
    None)``; a population's per-member values (``logs``: the History's, :func:`logs_of`) are
    keyed ``(key, member)``."""
    series: dict[tuple[str, int | None], tuple[list[float], list[float]]] = {}
    for end, epoch_logs in zip(ends.tolist(), epochs, strict=True):
        for key, value in epoch_logs.items():
            if not key.startswith("eval_"):
                continue
            if logs.per_member(value):
                values = [(m, v) for m, v in enumerate(np.asarray(value, np.float64))]
            elif is_number(value):
                values = [(None, value)]
            else:
                continue
            for member, v in values:
                xs, ys = series.setdefault((key, member), ([], []))
                xs.append(end)
                ys.append(float(v))
    return series


def _ordinal(n: int) -> str:
    if 10 <= n % 100 <= 20:
        return f"{n}th"
    return f"{n}{ {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th') }"


def _eval_cadence(epochs: list[dict[str, Any]]) -> str:
    """When the eval metrics were logged, in words: "per epoch", "every 5th epoch",
    "epochs 3, 7 and 20", "12 of 40 epochs"."""
    logged = [
        int(logs.get("epoch", i))
        for i, logs in enumerate(epochs)
        if any(key.startswith("eval_") for key in logs)
    ]
    gaps = set(np.diff(logged).tolist())
    if len(logged) > 1 and len(gaps) == 1:
        (gap,) = gaps
        return "per epoch" if gap == 1 else f"every {_ordinal(gap)} epoch"
    if len(logged) == 1:
        return f"epoch {logged[0]}"
    if len(logged) <= 4:
        return f"epochs {', '.join(map(str, logged[:-1]))} and {logged[-1]}"
    return f"{len(logged)} of {len(epochs)} epochs"


# How each event is drawn: colour (a single model's; a population's use the member's),
# line style, and the words of its label.
_EVENT_STYLES = {
    "early_stopping_stopped": ("C3", "--", "early stopping: stopped"),
    "restored_best": ("C2", ":", "restored best"),
}


def _mark_events(axes, events, epochs, ends: np.ndarray, *, single: bool) -> None:
    """A vertical line on every panel at the last step of each event's epoch, labelled in
    the top panel's legend (one entry per kind for a population's per-member lines)."""
    row_of = {logs.get("epoch", i): i for i, logs in enumerate(epochs)}
    labelled = set()
    for event in events:
        style, row = _EVENT_STYLES.get(event.get("what")), row_of.get(event.get("epoch"))
        if style is None or row is None:  # another callback's event, or another fit's epoch
            continue
        color, line, words = style
        member = event.get("member")
        if member is not None:
            color = f"C{member % 10}"
        x = float(ends[row])
        label = (
            f"{words} (epoch {event['epoch']})" if single else f"{words}, in each member's colour"
        )
        for i, ax in enumerate(axes):
            first = i == 0 and label not in labelled
            ax.axvline(x, color=color, ls=line, lw=1.2, zorder=3, label=label if first else None)
        labelled.add(label)
