"""Callbacks: hooks around fit, and the built-ins EarlyStopping and LambdaCallback.

A callback is any object with any of these methods; none is required:

- ``on_train_begin(trainer)``
- ``on_epoch_begin(trainer, epoch)``
- ``on_call_end(trainer, logs)`` after each compiled call, the model written back;
  ``logs`` = ``{"epoch", "step"}``, Python ints only, so a callback reading it forces no
  host sync
- ``on_epoch_end(trainer, epoch, logs)`` after the model holds the epoch's state
- ``on_train_end(trainer, history)``

Any hook may set ``trainer.stop_training = True``: ``fit`` ends cleanly after the current
compiled call (or epoch), with the model written back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

__all__ = ["EarlyStopping", "LambdaCallback"]


class LambdaCallback:
    """A callback from plain functions, one per hook.

    Example:
      >>> seen = []
      >>> trainer.fit(data, epochs=3, batch_size=32, callbacks=[
      ...     LambdaCallback(on_epoch_end=lambda t, epoch, logs: seen.append(logs["loss"]))])
    """

    def __init__(
        self,
        *,
        on_train_begin: Callable | None = None,
        on_epoch_begin: Callable | None = None,
        on_call_end: Callable | None = None,
        on_epoch_end: Callable | None = None,
        on_train_end: Callable | None = None,
    ):
        given = dict(
            on_train_begin=on_train_begin,
            on_epoch_begin=on_epoch_begin,
            on_call_end=on_call_end,
            on_epoch_end=on_epoch_end,
            on_train_end=on_train_end,
        )
        for name, fn in given.items():
            if fn is not None:
                setattr(self, name, fn)


class EarlyStopping:
    """Stops ``fit`` when ``monitor`` has not improved for ``patience`` epochs.

    Args:
      monitor: the epoch-log key to watch, e.g. ``"eval_loss"`` (from
        ``fit(eval_data=..., metric_fn=...)``) or ``"loss"``. Epochs without it (eval every
        N epochs) are not counted.
      patience: stop after this many evaluated epochs without improvement (Keras's
        meaning; 0 behaves as 1).
      min_delta: the smallest change that counts as an improvement.
      mode: ``"min"``, ``"max"``, or ``"auto"`` (``"max"`` for keys containing "acc",
        else ``"min"``).
      restore_best: when training ends, write the model state of the best epoch back into
        the user's module (an on-device copy is kept; the optimizer state is not restored).

    Attributes:
      best, best_epoch, stopped_epoch: what happened, for inspection after ``fit``.

    Example:
      >>> stop = EarlyStopping("eval_loss", patience=3)
      >>> trainer.fit(train, epochs=100, batch_size=64, eval_data=val, metric_fn=loss,
      ...             callbacks=[stop])
    """

    def __init__(
        self,
        monitor: str = "eval_loss",
        *,
        patience: int = 0,
        min_delta: float = 0.0,
        mode: str = "auto",
        restore_best: bool = True,
    ):
        if mode == "auto":
            mode = "max" if "acc" in monitor else "min"
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min', 'max' or 'auto', got {mode!r}.")
        if patience < 0 or min_delta < 0:
            raise ValueError(f"patience and min_delta must be >= 0, got {patience}, {min_delta}.")
        self.monitor, self.patience, self.min_delta = monitor, patience, min_delta
        self.mode, self.restore_best = mode, restore_best
        self._reset()

    def _reset(self) -> None:
        self.best = math.inf if self.mode == "min" else -math.inf
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._wait = 0
        self._best_state: nnx.State | None = None
        self._best_step: int | None = None

    def _improved(self, value: float) -> bool:
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def on_train_begin(self, trainer: Any) -> None:
        self._reset()

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict) -> None:
        value = logs.get(self.monitor)
        if value is None or not math.isfinite(value):
            return
        if self._improved(value):
            self.best, self.best_epoch, self._wait = value, epoch, 0
            self._best_step = trainer.step
            if self.restore_best:
                # A copy on the device: the next compiled call donates the model's buffers.
                self._best_state = jax.tree.map(lambda x: x.copy(), nnx.state(trainer.model))
            return
        self._wait += 1
        if self._wait >= max(self.patience, 1):  # as Keras: stop after `patience` bad epochs
            self.stopped_epoch = epoch
            trainer.stop_training = True

    def on_train_end(self, trainer: Any, history: Any) -> None:
        # Whatever ran after the best epoch (more epochs, a cut-short one), rewind to it.
        if self._best_state is not None and trainer.step != self._best_step:
            trainer.load_state(self._best_state)
