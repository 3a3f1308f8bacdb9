"""What ``Trainer.fit`` returns: per-step losses and one dict of logs per epoch."""

from __future__ import annotations

import dataclasses
import numbers
import os
import pathlib
from typing import Any

import numpy as np

from nnxscan.adapters._extras import require_extra

__all__ = ["History"]


@dataclasses.dataclass
class History:
    """The record of one ``fit`` call.

    Attributes:
      losses: per-step training losses of this call, a 1-D numpy array.
      epochs: one dict of logs per epoch: ``epoch`` (global index), ``loss`` (mean),
        the means of scalar ``aux`` leaves, ``steps``, ``wall_time`` (compilation included),
        ``compile_time`` (its compiling part) and ``steps_per_sec`` (the steady rate:
        ``steps / (wall_time - compile_time)``).
      events: what callbacks recorded about the run, in order, as plain dicts that
        checkpoints keep: ``EarlyStopping`` adds ``{"epoch": e, "step": s, "what":
        "early_stopping_stopped"}`` when it stops ``fit`` and ``{..., "what":
        "restored_best"}`` when it writes its best epoch back (``epoch`` the global
        index, ``step`` the global step count at that epoch's end; a ``Population``'s
        carry ``"member": i``, one per member). ``plot`` marks them.

    Example:
      >>> history = trainer.fit(data, epochs=3, batch_size=32)
      >>> history.epochs[-1]["loss"], history.losses.shape
      >>> history.plot("curves.png")
      PosixPath('curves.png')
    """

    losses: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.float32))
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def _append(self, losses: np.ndarray, logs: dict[str, Any]) -> None:
        self.losses = np.concatenate([self.losses, np.asarray(losses, np.float32)])
        self.epochs.append(logs)

    def plot(self, path: str | os.PathLike[str], *, smooth: float | int = 0.98) -> pathlib.Path:
        """Writes a PNG of the training loss per step and the eval metrics per epoch.

        The top panel shows every step's loss, faint, under a smoothed curve; non-finite
        losses (skipped steps) are left out of both. A ``Population``'s History (losses of
        shape ``(steps, N)``, per-member logs) gets one smoothed curve per member (the
        faint raw ones only up to 4 members) and one eval line per member and metric, in
        the member's colour. The y-axis is logarithmic when every
        finite loss is positive. When any epoch logged ``eval_*`` metrics, a second panel
        below, on the same step axis, marks each at its epoch's last step (the running sum of
        the epochs' ``steps``); its label says when they were logged (``eval (every 5th
        epoch)``). The epochs :attr:`events` name (EarlyStopping's stop and restore) are
        marked by a labelled vertical line at their last step. Needs matplotlib: ``pip
        install 'nnxscan[demo]'``; pyplot's global state is not touched.

        Args:
          path: where to write the PNG (its folder is created when missing).
          smooth: how much noise to average away. A float ``w`` in [0, 1) removes as much
            as TensorBoard's smoothing slider at ``w`` (an exponential moving average of
            weight ``w``), but without its lag, by averaging over ``(1 + w) / (1 - w)``
            steps; an int >= 1 is that number of steps. 0 or 1 plots no smoothing. The
            average is centred on each step (half the steps before it, half after), so a
            falling loss is not drawn above where it is; it spans at most a tenth of the
            run, and fewer steps near the start, where losses fall fastest. In the last
            steps, short of steps ahead, the curve follows a straight line fitted to the
            losses around them.

        Returns:
          ``path`` as a ``pathlib.Path``.

        Raises:
          ValueError: the history has no losses, or ``smooth`` is out of range.

        Example:
          >>> history = trainer.fit(data, epochs=20, batch_size=32, eval_data=test,
          ...                       metric_fn=accuracy, eval_every=5)
          >>> history.plot("run/curves.png", smooth=50)
        """
        losses = np.asarray(self.losses, np.float64)
        if losses.size == 0:
            raise ValueError("nothing to plot: this History holds no training losses")
        # One column per model: a single model's losses, or a population's members.
        columns = losses.reshape(losses.shape[0], -1) if losses.ndim == 2 else losses.reshape(-1, 1)
        members = columns.shape[1]
        window = _smoothing_window(smooth, columns.shape[0])
        figure_mod = require_extra("matplotlib.figure", "demo", needed_by="History.plot")
        agg = require_extra("matplotlib.backends.backend_agg", "demo", needed_by="History.plot")

        steps = np.arange(1, columns.shape[0] + 1)
        ends = _epoch_end_steps(self.epochs, columns.shape[0])
        evals = _eval_series(self.epochs, ends, per_member=losses.ndim == 2)
        fig = figure_mod.Figure(figsize=(7, 5.5 if evals else 3.5), dpi=100)
        agg.FigureCanvasAgg(fig)
        axes = fig.subplots(2 if evals else 1, 1, sharex=True, squeeze=False)[:, 0]
        ax = axes[0]
        finite = np.isfinite(columns)
        labelled = members <= _LEGEND_MEMBERS
        for m in range(members):
            color = f"C{m % 10}"
            single = members == 1
            if members <= 4:
                ax.plot(steps, columns[:, m], lw=0.6, alpha=0.3, color=color,
                        label="loss" if single else None)  # fmt: skip
            label = "loss (smoothed)" if single else (f"member {m}" if labelled else None)
            ax.plot(steps, _smooth(columns[:, m], window), lw=1.5 if single else 1.0,
                    color=color, label=label)  # fmt: skip
        if finite.any() and (columns[finite] > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel("training loss" if members == 1 else f"training loss, {members} members")
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
            axes[1].set_ylabel(f"eval ({_eval_cadence(self.epochs)})")
            if labelled:
                axes[1].legend(loc="best", fontsize="small")
        _mark_events(axes, self.events, self.epochs, ends, single=members == 1)
        if labelled or self.events:
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
    epochs: list[dict[str, Any]], ends: np.ndarray, *, per_member: bool = False
) -> dict[tuple[str, int | None], tuple[list[float], list[float]]]:
    """Each ``eval_*`` key's (end step, value) pairs over the epochs that logged it, keyed ``(key,
    None)``; a population's per-member values (``per_member``: its History's losses are ``(steps,
    N)``) are keyed ``(key, member)``."""
    series: dict[tuple[str, int | None], tuple[list[float], list[float]]] = {}
    for end, logs in zip(ends.tolist(), epochs, strict=True):
        for key, value in logs.items():
            if not key.startswith("eval_"):
                continue
            if per_member and np.ndim(value) == 1:  # one value per member
                values = [(m, v) for m, v in enumerate(np.asarray(value, np.float64))]
            elif isinstance(value, numbers.Real) and not isinstance(value, bool):
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
