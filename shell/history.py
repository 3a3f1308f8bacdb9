"""What ``Trainer.fit`` returns: per-step losses and one dict of logs per epoch."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import numpy as np

from nnxscan.adapters import _log_values, _plots

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
      num_members: how many members it logs: ``None`` for one model (``losses`` of shape
        ``(steps,)``, a value per log), ``N`` for a ``Population``'s (``losses`` of shape
        ``(steps, N)``, per-member logs of shape ``(N,)``). ``fit`` sets it; a History
        built without it (by hand, or pickled before it existed) takes it from its losses:
        ``(steps, N)`` is ``N`` members.

    Example:
      >>> history = trainer.fit(data, epochs=3, batch_size=32)
      >>> history.epochs[-1]["loss"], history.losses.shape
      >>> history.plot("curves.png")
      PosixPath('curves.png')
    """

    losses: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.float32))
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    num_members: int | None = None

    def __post_init__(self) -> None:
        self.num_members = _log_values.history_members(self.num_members, self.losses)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A History pickled before ``num_members`` existed holds no such entry.
        self.__dict__.update(state)
        self.num_members = _log_values.history_members(state.get("num_members"), self.losses)

    def _append(self, losses: np.ndarray, logs: dict[str, Any]) -> None:
        self.losses = np.concatenate([self.losses, np.asarray(losses, np.float32)])
        self.epochs.append(logs)

    def plot(self, path: str | os.PathLike[str], *, smooth: float | int = 0.98) -> pathlib.Path:
        """Writes a PNG of the training loss per step and the eval metrics per epoch.

        The top panel shows every step's loss, faint, under a smoothed curve; non-finite
        losses (skipped steps) are left out of both. A ``Population``'s History
        (:attr:`num_members` ``N``: losses of shape ``(steps, N)``, per-member logs) gets
        one smoothed curve per member (the faint raw ones only up to 4 members) and one
        eval line per member and metric, in the member's colour. The y-axis is logarithmic
        when every finite loss is positive. When any epoch logged ``eval_*`` metrics, a second panel
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
        return _plots.history_plot(self, path, smooth)
