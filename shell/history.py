"""What ``Trainer.fit`` returns: per-step losses and one dict of logs per epoch."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

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
    """

    losses: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0,), np.float32))
    epochs: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def _append(self, losses: np.ndarray, logs: dict[str, Any]) -> None:
        self.losses = np.concatenate([self.losses, np.asarray(losses, np.float32)])
        self.epochs.append(logs)
