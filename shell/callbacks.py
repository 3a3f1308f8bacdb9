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
compiled call (or epoch), with the model written back. A ``Population`` passes itself as
``trainer``, with per-member logs (``(N,)`` arrays), and stops after the current epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnxscan.adapters._log_values import logs_of
from nnxscan.adapters.distributed import is_primary
from nnxscan.pure import select_members
from nnxscan.shell._edges.stop_events import record_members, record_one_model
from nnxscan.shell._edges.warn import warn
from nnxscan.shell._metric_direction import metric_direction

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
        hooks = (on_train_begin, on_epoch_begin, on_call_end, on_epoch_end, on_train_end)
        names = ("on_train_begin", "on_epoch_begin", "on_call_end", "on_epoch_end", "on_train_end")
        for name, fn in zip(names, hooks, strict=True):
            if fn is not None:
                setattr(self, name, fn)


class EarlyStopping:
    """Stops ``fit`` when ``monitor`` has stopped improving: Keras's ``EarlyStopping``.

    Each epoch whose logs hold ``monitor`` (from ``start_from_epoch`` on) adds one to a
    count of epochs without improvement; an epoch that improves on the best value so far
    (by more than ``min_delta``) becomes the best and resets the count to 0, but only if
    it also beats ``baseline`` (when one is given). A NaN or infinite value is never an
    improvement. An epoch that does not improve stops ``fit`` once the count reaches
    ``patience`` (patience 0 behaves as 1; never at epoch 0).

    Epochs whose logs lack ``monitor`` are skipped: evaluation every N epochs logs
    ``eval_*`` keys only every N-th epoch. A monitor that is not logged at all is a
    mistake, caught once per ``fit``: on the first epoch that logs any ``eval_*`` key (on
    the first epoch, for a monitor without the ``eval_`` prefix) a missing monitor raises
    ``ValueError`` listing the keys there are.

    Args:
      monitor: the epoch-log key to watch: ``"eval_<name>"`` (from
        ``fit(eval_data=..., metric_fn=...)``), ``"loss"`` or any other log key.
      patience: epochs without improvement after which training stops.
      min_delta: the smallest change that counts as an improvement (its sign is ignored).
      mode: ``"min"``, ``"max"``, or ``"auto"``: ``"max"`` for names (less the ``eval_``
        prefix) with a word such as acc, accuracy, auc, precision, recall, f1, iou, r2;
        ``"min"`` for loss, error, mse, mae, crossentropy, hinge, ...; for any other name
        the first checked epoch raises ``ValueError`` asking for ``mode``.
      baseline: a value to beat; while no epoch beats it (by ``min_delta``), improvements
        on the best so far do not reset the count, so training stops ``patience`` epochs
        after the first monitored one at the latest, unless every epoch improves.
      start_from_epoch: epochs (by the global index ``fit`` logs) before this one are not
        monitored: a warm-up in which training is never stopped.
      restore_best: when training ends (stopped or not), write the model state of the best
        epoch back into the user's module (an on-device copy is kept; the optimizer state
        is not restored). ``restore_best_weights`` is accepted as Keras's name for it.
      verbose: print one line when it stops training and one when it restores the model.

    Attributes:
      best, best_epoch, stopped_epoch, wait: what happened, for inspection after ``fit``
      (None until set; ``wait`` is the count).

    On a :class:`~nnxscan.shell.Population`, whose logs hold one value per member, each
    member is watched on its own: a member whose patience runs out is frozen (its state
    stops changing inside the compiled calls, the others train on) and ``fit`` ends when
    none is left training; ``restore_best`` restores each member from its own best epoch.
    The attributes are then arrays of shape ``(N,)`` (``best`` NaN and ``best_epoch``,
    ``stopped_epoch`` -1 where there is none).

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
        baseline: float | None = None,
        start_from_epoch: int = 0,
        restore_best: bool = True,
        restore_best_weights: bool | None = None,
        verbose: bool = True,
    ):
        if mode not in ("auto", "min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min', 'max' or 'auto', got {mode!r}.")
        for name, count in (("patience", patience), ("start_from_epoch", start_from_epoch)):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"EarlyStopping: {name} must be an int >= 0, got {count!r}.")
        self.monitor = monitor
        # "auto" stays only when the name says nothing; the first checked epoch raises then.
        self.mode = (metric_direction(monitor) or "auto") if mode == "auto" else mode
        self.patience, self.min_delta = patience, abs(float(min_delta))
        self.baseline = None if baseline is None else float(baseline)
        self.start_from_epoch = start_from_epoch
        if restore_best_weights is not None:
            restore_best = restore_best_weights
        self.restore_best, self.verbose = bool(restore_best), bool(verbose)
        self._reset()

    def _reset(self) -> None:
        self.best: Any = None
        self.best_epoch: Any = None
        self.stopped_epoch: Any = None
        self.wait: Any = 0
        self._checked = False  # whether this fit's logs were checked for the monitor
        self._epochs = 0
        self._best_state: nnx.State | None = None
        self._best_step: int | None = None
        # What it watches (one model or members: _Watch), from the first monitored epoch
        # of this fit on, and its record, one entry per watched model: the best value,
        # its epoch (-1: none yet), the epoch it stopped (-1: not), the epochs waited.
        self._watch: _Watch | None = None
        self._record: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def _better(self, value: Any, reference: Any) -> Any:
        """Whether ``value`` improves on ``reference`` by more than ``min_delta`` (arrays too)."""
        if self.mode == "min":
            return value + self.min_delta < reference
        return value - self.min_delta > reference

    def on_train_begin(self, trainer: Any) -> None:
        self._reset()  # a fresh start at every fit, as Keras

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict) -> None:
        self._epochs += 1
        value = logs.get(self.monitor)
        if not self._checked and (value is not None or self._check_due(logs)):
            self._checked = True
            self._check(logs)
        if value is None or epoch < self.start_from_epoch:
            return
        if self._watch is None:
            # What it watches: one model (it stops fit and restores the model) or each
            # member of a population (it freezes and restores members one by one), as the
            # object training runs declares it (nnxscan.adapters' logs_of).
            self._watch = logs_of(trainer).pick(_ModelWatch, _MembersWatch)(self, trainer)
        values = self._watch.values(value)
        if self._record is None:  # the first monitored epoch of this fit
            size = values.shape[0]
            self._record = (np.full(size, np.nan), np.full(size, -1), np.full(size, -1),
                            np.zeros(size, int))  # fmt: skip
        best, best_epoch, stopped, wait = self._record
        improved, exhausted, wait = self._rule(values, best, wait, self._watch.alive(), epoch)
        best = np.where(improved, values, best)
        best_epoch = np.where(improved, epoch, best_epoch)
        stopped = np.where(exhausted, epoch, stopped)
        self._record = (best, best_epoch, stopped, wait)
        if self.restore_best and improved.any():
            self._watch.keep_best(improved)
        self._watch.publish(*self._record)
        if exhausted.any():
            self._watch.stop(exhausted)

    def _rule(
        self, values: np.ndarray, best: np.ndarray, wait: np.ndarray, alive: np.ndarray, epoch: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The one rule, for N watched values at once (one model: N = 1): which improved on their
        best (NaN: none yet), which ran out of patience, and the new waits."""
        wait = wait + alive
        finite = np.isfinite(values)
        with np.errstate(invalid="ignore"):
            improved = alive & finite & (np.isnan(best) | self._better(values, best))
            beats_baseline = self.baseline is None or self._better(values, self.baseline)
        wait = np.where(improved & beats_baseline, 0, wait)
        exhausted = alive & ~improved & (wait >= self.patience) & (epoch > 0)
        return improved, exhausted, wait

    def on_train_end(self, trainer: Any, history: Any) -> None:
        if self._epochs and not self._checked:
            warn(
                f"EarlyStopping(monitor={self.monitor!r}): no epoch of this fit logged any "
                f"eval_* key (fit needs eval_data and metric_fn, and at least eval_every "
                f"epochs), so it neither stopped nor restored anything."
            )
        if self._watch is None:  # no epoch of this fit was monitored
            return
        self._watch.record(history)  # history.events, before restoring
        say = self.verbose and is_primary()
        best_state, self._best_state = self._best_state, None  # free the device copy
        self._watch.train_end(best_state, say)

    def _why(self) -> str:
        name, epochs = self.monitor, f"{self.wait} epoch{'s' if self.wait != 1 else ''}"
        if self.best is None:
            return f"{name} was not finite for {epochs}"
        best = f"best {self.best:.6g} at epoch {self.best_epoch}"
        if self.baseline is not None and not self._better(self.best, self.baseline):
            return f"{name} did not beat the baseline {self.baseline:.6g} in {epochs} ({best})"
        return f"{name} did not improve for {epochs} ({best})"

    def _check_due(self, logs: dict) -> bool:
        if not self.monitor.startswith("eval_"):
            return True
        return any(key.startswith("eval_") for key in logs)

    def _check(self, logs: dict) -> None:
        if self.monitor not in logs:
            raise ValueError(
                f"EarlyStopping(monitor={self.monitor!r}): no such key in the epoch logs; "
                f"keys: {', '.join(sorted(logs))}. Pass one of them as monitor."
            )
        if self.mode == "auto":
            raise ValueError(
                f"EarlyStopping(monitor={self.monitor!r}): mode='auto' cannot tell from the "
                f"name whether it should be minimized or maximized; pass mode='min' or "
                f"mode='max'."
            )


class _ModelWatch:
    """What EarlyStopping does for one model: its one value, stopping fit, restoring the model."""

    def __init__(self, stop: EarlyStopping, trainer: Any):
        self.stop_, self.trainer = stop, trainer

    def values(self, value: Any) -> np.ndarray:
        # One model's logs have no members axis (logs_of said so when this watch was
        # picked): the monitored value must be of shape (), as _MembersWatch's is (N,).
        values = np.asarray(value, np.float64)
        if values.shape != ():
            raise ValueError(
                f"EarlyStopping(monitor={self.stop_.monitor!r}) watches one number per epoch, "
                f"but {self.stop_.monitor!r} is an array of shape {values.shape} (a metric "
                f"per class, say): monitor a scalar log, e.g. its mean logged as a metric of "
                f"its own."
            )
        return values.reshape(1)

    def alive(self) -> np.ndarray:
        return np.array([True])

    def keep_best(self, improved: np.ndarray) -> None:
        # A copy on the device: the next compiled call donates the model's buffers.
        self.stop_._best_state = jax.tree.map(lambda x: x.copy(), nnx.state(self.trainer.model))
        self.stop_._best_step = self.trainer.step

    def publish(self, best, best_epoch, stopped, wait) -> None:
        stop = self.stop_
        stop.best = None if np.isnan(best[0]) else float(best[0])
        stop.best_epoch = None if best_epoch[0] < 0 else int(best_epoch[0])
        stop.stopped_epoch = None if stopped[0] < 0 else int(stopped[0])
        stop.wait = int(wait[0])

    def stop(self, exhausted: np.ndarray) -> None:
        self.trainer.stop_training = True

    def record(self, history: Any) -> None:
        record_one_model(self.stop_, self.trainer, history)

    def train_end(self, best_state: Any, say: bool) -> None:
        stop, trainer = self.stop_, self.trainer
        if say and stop.stopped_epoch is not None:
            print(f"EarlyStopping: stopped at epoch {stop.stopped_epoch}: {stop._why()}")
        # The model is at the best epoch already when nothing trained after it.
        if best_state is not None and trainer.step != stop._best_step:
            trainer.load_state(best_state)
            if say:
                print(
                    f"EarlyStopping: restored the model from epoch {stop.best_epoch} "
                    f"({stop.monitor} {stop.best:.6g})"
                )


class _MembersWatch:
    """What EarlyStopping does for a population: one value per member, freezing members
    (``population.freeze``; fit ends when none trains), restoring each member."""

    def __init__(self, stop: EarlyStopping, population: Any):
        self.stop_, self.population = stop, population

    def values(self, value: Any) -> np.ndarray:
        values = np.asarray(value, np.float64)
        num_members = len(self.population)
        if values.shape != (num_members,):
            raise ValueError(
                f"EarlyStopping(monitor={self.stop_.monitor!r}) on a population of {num_members} "
                f"members needs one number per member, but {self.stop_.monitor!r} has shape "
                f"{values.shape}."
            )
        return values

    def alive(self) -> np.ndarray:
        return np.asarray(self.population.active, bool)

    def keep_best(self, improved: np.ndarray) -> None:
        # A copy on the device (population.state copies): later calls donate buffers.
        current, kept = self.population.state, self.stop_._best_state
        kept = current if kept is None else select_members(improved, current, kept)
        self.stop_._best_state = kept

    def publish(self, best, best_epoch, stopped, wait) -> None:
        stop = self.stop_
        stop.best, stop.best_epoch, stop.stopped_epoch, stop.wait = best, best_epoch, stopped, wait

    def stop(self, exhausted: np.ndarray) -> None:
        for i in np.flatnonzero(exhausted):
            self.population.freeze(int(i))
        if not self.population.active.any():
            self.population.stop_training = True

    def record(self, history: Any) -> None:
        record_members(self.stop_, self.population, history)

    def train_end(self, best_state: Any, say: bool) -> None:
        stop, population = self.stop_, self.population
        stopped = np.flatnonzero(stop.stopped_epoch >= 0)
        if say and stopped.size:
            print(
                f"EarlyStopping: froze members {stopped.tolist()} ({stop.monitor} did not "
                f"improve for {max(stop.patience, 1)} epochs)"
            )
        if best_state is not None:
            has_best = stop.best_epoch >= 0
            population.load_state(best_state, where=has_best)
            if say:
                print(
                    f"EarlyStopping: restored members {np.flatnonzero(has_best).tolist()} "
                    f"from their best epochs {stop.best_epoch[has_best].tolist()}"
                )


_Watch = _ModelWatch | _MembersWatch
