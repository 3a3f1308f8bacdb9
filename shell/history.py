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
        the means of scalar ``aux`` leaves, ``steps``, ``steps_per_sec`` and ``wall_time``.

    Example:
      >>> history = trainer.fit(data, epochs=3, batch_size=32)
      >>> history.epochs[-1]["loss"], history.losses.shape
      >>> history.plot("curves.png")
      PosixPath('curves.png')
    """

    losses: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.float32))
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def _append(self, losses: np.ndarray, logs: dict[str, Any]) -> None:
        self.losses = np.concatenate([self.losses, np.asarray(losses, np.float32)])
        self.epochs.append(logs)

    def plot(self, path: str | os.PathLike[str], *, smooth: float | int = 0.98) -> pathlib.Path:
        """Writes a PNG of the training loss per step and the eval metrics per epoch.

        The top panel shows every step's loss, faint, under a smoothed curve; non-finite
        losses (skipped steps) are left out of both. The y-axis is logarithmic when every
        finite loss is positive. When any epoch logged ``eval_*`` metrics, a second panel
        below, on the same step axis, marks each at its epoch's last step (the running sum of
        the epochs' ``steps``). Needs matplotlib: ``pip install 'nnxscan[demo]'``; pyplot's
        global state is not touched.

        Args:
          path: where to write the PNG.
          smooth: a float in [0, 1) is an exponential moving average's weight (TensorBoard's
            smoothing slider, bias-corrected so the curve starts at the first loss); an int
            >= 1 is a trailing moving-average window in steps. 0 or 1 plots no smoothing.
            Either is capped to average over at most a tenth of the steps, so the default
            does not lag a short run's curve far behind its losses.

        Returns:
          ``path`` as a ``pathlib.Path``.

        Raises:
          ValueError: the history has no losses, or ``smooth`` is out of range.

        Example:
          >>> history = trainer.fit(data, epochs=20, batch_size=32, eval_data=test,
          ...                       metric_fn=accuracy, eval_every=5)
          >>> history.plot("run/curves.png", smooth=50)
        """
        losses = np.asarray(self.losses, np.float64).reshape(-1)
        if losses.size == 0:
            raise ValueError("nothing to plot: this History holds no training losses")
        smoothed = _smooth(losses, _cap_smoothing(smooth, losses.size))
        figure_mod = require_extra("matplotlib.figure", "demo", needed_by="History.plot")
        agg = require_extra("matplotlib.backends.backend_agg", "demo", needed_by="History.plot")

        steps = np.arange(1, losses.size + 1)
        ends = _epoch_end_steps(self.epochs, losses.size)
        evals = _eval_series(self.epochs, ends)
        fig = figure_mod.Figure(figsize=(7, 5.5 if evals else 3.5), dpi=100)
        agg.FigureCanvasAgg(fig)
        axes = fig.subplots(2 if evals else 1, 1, sharex=True, squeeze=False)[:, 0]
        ax = axes[0]
        finite = np.isfinite(losses)
        ax.plot(steps, losses, lw=0.6, alpha=0.3, color="C0", label="loss")
        ax.plot(steps, smoothed, lw=1.5, color="C0", label="loss (smoothed)")
        if finite.any() and (losses[finite] > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel("training loss")
        ax.legend(loc="upper right", fontsize="small")
        for name, (xs, ys) in evals.items():
            axes[1].plot(xs, ys, marker="o", ms=3, lw=1.2, label=name)
        if evals:
            axes[1].set_ylabel("eval (per epoch)")
            axes[1].legend(loc="best", fontsize="small")
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
        fig.savefig(path, format="png")
        return path


def _cap_smoothing(smooth: float | int, n_steps: int) -> float | int:
    """``smooth`` limited to an average over at most a tenth of ``n_steps`` steps."""
    span = max(n_steps / 10, 1.0)
    if isinstance(smooth, numbers.Integral) and not isinstance(smooth, bool) and smooth >= 1:
        return min(int(smooth), int(span))
    if isinstance(smooth, numbers.Real) and not isinstance(smooth, bool) and 0 <= smooth < 1:
        # An EMA of weight w averages over about 1 / (1 - w) steps.
        return min(float(smooth), 1.0 - 1.0 / span)
    return smooth  # out of range: _smooth says so


def _smooth(losses: np.ndarray, smooth: float | int) -> np.ndarray:
    """The smoothed loss curve; non-finite losses are skipped and the last value held."""
    if isinstance(smooth, bool) or not isinstance(smooth, numbers.Real):
        raise ValueError(f"smooth must be a float in [0, 1) or an int >= 1, got {smooth!r}")
    finite = np.isfinite(losses)
    if isinstance(smooth, numbers.Integral) and smooth >= 1:
        smooth = int(smooth)
        # Trailing window mean over the finite values in it, from running sums (O(n)).
        sums = np.concatenate([[0.0], np.cumsum(np.where(finite, losses, 0.0))])
        counts = np.concatenate([[0], np.cumsum(finite)])
        hi = np.arange(1, losses.size + 1)
        lo = np.maximum(hi - smooth, 0)
        n = counts[hi] - counts[lo]
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(n > 0, (sums[hi] - sums[lo]) / np.maximum(n, 1), np.nan)
    if not 0 <= smooth < 1:
        raise ValueError(f"smooth must be a float in [0, 1) or an int >= 1, got {smooth!r}")
    out = np.full(losses.shape, np.nan)
    average, seen, weight = 0.0, 0, float(smooth)
    for i, (value, ok) in enumerate(zip(losses.tolist(), finite.tolist(), strict=True)):
        if ok:
            average = weight * average + (1.0 - weight) * value
            seen += 1
        if seen:
            # Dividing out the weight of the zero start (Adam's bias correction) keeps the
            # first steps from being dragged towards zero.
            out[i] = average / (1.0 - weight**seen)
    return out


def _epoch_end_steps(epochs: list[dict[str, Any]], n_steps: int) -> np.ndarray:
    """The step count at the end of each epoch; evenly spread if an epoch lacks ``steps``."""
    if epochs and all(isinstance(e.get("steps"), numbers.Integral) for e in epochs):
        return np.cumsum([int(e["steps"]) for e in epochs])
    return np.linspace(n_steps / max(len(epochs), 1), n_steps, len(epochs))


def _eval_series(
    epochs: list[dict[str, Any]], ends: np.ndarray
) -> dict[str, tuple[list[float], list[float]]]:
    """Each ``eval_*`` key's (end step, value) pairs over the epochs that logged it."""
    series: dict[str, tuple[list[float], list[float]]] = {}
    for end, logs in zip(ends.tolist(), epochs, strict=True):
        for key, value in logs.items():
            numeric = isinstance(value, numbers.Real) and not isinstance(value, bool)
            if key.startswith("eval_") and numeric:
                xs, ys = series.setdefault(key, ([], []))
                xs.append(end)
                ys.append(float(value))
    return series
