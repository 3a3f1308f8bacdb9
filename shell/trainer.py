"""The Trainer: scanned epochs on the user's own NNX module and optimizer."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters.nnx_optimizer import optax_state_from_optimizer, optimizer_state_update
from nnxscan.pure import (
    check_batch_size,
    check_leading_size,
    check_transform,
    init_opt_state,
    split_wrt,
)
from nnxscan.shell.history import History
from nnxscan.shell.loop import Execution, LiveState, on_device_of, prepare_execution, run_plan
from nnxscan.shell.plans import Plan, resolve_plan
from nnxscan.shell.programs import evaluator, first_batch, train_program
from nnxscan.shell.progress import EpochProgress

__all__ = ["Trainer"]


_MAX_SEED = 2**31 - 1  # the seed enters the compiled call as an int32
_RESERVED_LOGS = frozenset({"epoch", "loss", "steps", "steps_per_sec", "wall_time"})


def _check_count(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}.")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}.")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}.")
    return int(value)


def _scalar_means(tree: Any) -> dict[str, float]:
    """Means over steps of every aux leaf that is a scalar per step, keyed by its path.

    A key that would shadow one of fit's own logs (``loss``, ``steps``...) gets ``aux/``.
    """
    logs = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if np.ndim(leaf) == 1:
            key = jax.tree_util.keystr(path, simple=True, separator="/") or "aux"
            logs[f"aux/{key}" if key in _RESERVED_LOGS else key] = float(np.mean(leaf))
    return logs


class Trainer:
    """Trains the user's NNX module with compiled, scanned epochs.

    Args:
      model: the ``nnx.Module`` to train. It is the live object: after every compiled call
        (or, with the ``"step"`` plan, every stretch of calls) it holds the trained state.
      tx_or_optimizer: an optax ``GradientTransformation``, or an ``nnx.Optimizer`` built on
        ``model`` whose state and ``step`` counter are then kept up to date as well.
      loss_fn: ``loss_fn(model, batch)`` returning a scalar, or ``(loss, aux)`` with
        ``has_aux=True``.
      wrt: the NNX filter of the variables to train (an ``nnx.Optimizer`` brings its own).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; scalar aux leaves are averaged
        into the epoch logs.
      execution: ``"auto"``, ``"scan"``, ``"unrolled"``, ``"step"`` or a ``Plan`` (see
        :mod:`nnxscan.shell.plans` for the rule ``"auto"`` follows).

    Example:
      >>> trainer = Trainer(model, optax.adam(1e-3), loss_fn)
      >>> history = trainer.fit({"x": x, "y": y}, epochs=10, batch_size=32)
      >>> trainer.evaluate({"x": x_test, "y": y_test}, accuracy, batch_size=256)
      {'accuracy': 0.97}
    """

    def __init__(
        self,
        model: nnx.Module,
        tx_or_optimizer: optax.GradientTransformation | nnx.Optimizer,
        loss_fn: Callable[[nnx.Module, Any], Any],
        *,
        wrt: nnx.filterlib.Filter = nnx.Param,
        has_aux: bool = False,
        execution: str | Plan = "auto",
    ):
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        self.optimizer: nnx.Optimizer | None = None
        if isinstance(tx_or_optimizer, nnx.Optimizer):
            self.optimizer = tx_or_optimizer
            if wrt is not nnx.Param and wrt != tx_or_optimizer.wrt:
                raise ValueError(
                    f"wrt={wrt!r} differs from the nnx.Optimizer's wrt="
                    f"{tx_or_optimizer.wrt!r}; leave wrt out when passing an optimizer."
                )
            wrt = tx_or_optimizer.wrt
            tx = check_transform(tx_or_optimizer.tx)
        else:
            tx = check_transform(tx_or_optimizer)
        self._explicit_plan = resolve_plan(execution)
        self.model = model
        self.tx = tx
        self.loss_fn = loss_fn
        self.wrt = wrt
        self.has_aux = bool(has_aux)
        params, _ = split_wrt(nnx.state(model), wrt)
        if self.optimizer is None:
            self._opt_state = init_opt_state(tx, nnx.state(model), wrt)
        else:
            optax_state_from_optimizer(self.optimizer, params)  # validates, raises early
            self._opt_state = None
        self.epoch = 0
        self.step = 0
        self.stop_training = False
        self._program = train_program(loss_fn, tx, wrt, self.has_aux)

    # -- state crossing -------------------------------------------------------------------

    @property
    def opt_state(self) -> Any:
        """The optax state (read from the ``nnx.Optimizer`` when one was given)."""
        if self.optimizer is None:
            return self._opt_state
        params, _ = split_wrt(nnx.state(self.model), self.wrt)
        return optax_state_from_optimizer(self.optimizer, params)

    def _write(self, state: nnx.State, opt_state: Any, steps: int) -> None:
        nnx.update(self.model, state)
        if self.optimizer is None:
            self._opt_state = opt_state
        else:
            new_step = self.optimizer.step[...] + jnp.asarray(steps, jnp.uint32)
            nnx.update(self.optimizer, optimizer_state_update(self.optimizer, opt_state, new_step))
        self.step += steps

    def plan_for(self, data: Any, batch_size: int) -> Plan:
        """The execution plan ``fit`` uses for this data and batch size (traces, no compile)."""
        graphdef, state = nnx.split(self.model)
        return self._execution(graphdef, state, self.opt_state, data, batch_size).plan

    def _execution(self, graphdef, state, opt_state, data, batch_size: int) -> Execution:
        batch = first_batch(data, batch_size)
        return prepare_execution(
            self._program, self._explicit_plan, graphdef, state, opt_state, batch
        )

    # -- training -------------------------------------------------------------------------

    def fit(
        self,
        data: Any,
        *,
        epochs: int,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        callbacks: Sequence[Any] = (),
        progress: bool = True,
    ) -> History:
        """Trains ``epochs`` MORE epochs on ``data`` and returns their :class:`History`.

        Each epoch permutes the examples with a key derived from ``(seed, global epoch
        index)``, so ``fit(epochs=2)`` twice gives bitwise the model ``fit(epochs=4)`` gives.
        The last ``num_examples % batch_size`` examples of each permutation are dropped (a
        fresh permutation each epoch, so every example is used in expectation).

        Args:
          data: a pytree of arrays sharing a leading examples axis (numpy or JAX; moved to
            the device once per call, never back).
          epochs: number of epochs to train (0 trains nothing).
          batch_size: examples per step, at most the number of examples.
          seed: the shuffle seed.
          shuffle: permute the examples each epoch; False keeps their order.
          callbacks: objects with an optional ``on_epoch_end(trainer, epoch, logs)`` method,
            called after the model holds the epoch's state. Setting
            ``trainer.stop_training = True`` in one ends ``fit`` after that epoch.
          progress: show a progress bar that advances once per compiled call.

        Example:
          >>> history = trainer.fit({"x": x, "y": y}, epochs=5, batch_size=64)
          >>> history.epochs[-1]["loss"]
        """
        epochs = _check_count(epochs, "epochs", 0)
        seed = _check_count(seed, "seed", 0, _MAX_SEED)
        n = check_leading_size(data, "data")
        batch_size = check_batch_size(batch_size, n, drop_remainder=True)
        callbacks = tuple(callbacks)
        graphdef, state = nnx.split(self.model)
        data = on_device_of(data, state)
        opt_state = self.opt_state
        execution = self._execution(graphdef, state, opt_state, data, batch_size)
        plan = execution.plan
        num_steps = n // batch_size
        history = History()
        if epochs == 0:
            return history
        live = LiveState(state, opt_state, self._write)
        self.stop_training = False
        with EpochProgress(epochs, len(plan.chunks(num_steps)), progress) as bar:
            for _ in range(epochs):
                start = time.perf_counter()
                epoch = self.epoch
                indices = self._program.epoch_indices(
                    seed, epoch, num_examples=n, batch_size=batch_size, shuffle=shuffle
                )
                first_step = self.step
                try:
                    outs = run_plan(
                        self._program,
                        execution,
                        graphdef,
                        live,
                        data,
                        indices,
                        num_steps,
                        bar.advance,
                    )
                finally:
                    # The epoch counts as soon as all its steps are in the model, even if
                    # an interrupt lands later (in the progress bar or the host sync).
                    if self.step == first_step + num_steps:
                        self.epoch = epoch + 1
                logs = self._epoch_logs(epoch, outs, start)
                history._append(logs.pop("_losses"), logs)
                bar.epoch_done(epoch, logs)
                for callback in callbacks:
                    hook = getattr(callback, "on_epoch_end", None)
                    if hook is not None:
                        hook(self, epoch, logs)
                if self.stop_training:
                    break
        return history

    def _epoch_logs(self, epoch: int, outs: list[Any], start: float) -> dict[str, Any]:
        # One host transfer per epoch: the only sync fit makes. The clock stops after it,
        # so steps/s counts the work, not just its asynchronous dispatch.
        outs = jax.device_get(outs)
        wall_time = time.perf_counter() - start
        stacked = jax.tree.map(lambda *xs: np.concatenate(xs), *outs)
        losses, aux = stacked if self.has_aux else (stacked, None)
        logs: dict[str, Any] = {"epoch": epoch, "loss": float(np.mean(losses))}
        if aux is not None:
            logs.update(_scalar_means(aux))
        logs.update(
            steps=int(losses.shape[0]),
            steps_per_sec=losses.shape[0] / wall_time,
            wall_time=wall_time,
            _losses=losses,
        )
        return logs

    # -- evaluation -----------------------------------------------------------------------

    def evaluate(
        self,
        data: Any,
        metric_fn: Callable[[nnx.Module, Any], Any],
        *,
        batch_size: int,
        eval_mode: bool = True,
    ) -> dict[str, float]:
        """Averages ``metric_fn(model, batch)`` over EVERY example of ``data``.

        ``metric_fn`` returns a scalar (reported under its function name, or ``"metric"``)
        or a dict of scalars, each the mean over the batch. A final short batch counts with
        its true size. With ``eval_mode`` the model runs after ``model.eval()`` (Dropout
        off, BatchNorm on running statistics); the model itself is not changed.

        Example:
          >>> def accuracy(model, batch):
          ...     return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])
          >>> trainer.evaluate(test_data, accuracy, batch_size=500)
          {'accuracy': 0.975}
        """
        n = check_leading_size(data, "data")
        batch_size = check_batch_size(batch_size, n, drop_remainder=False)
        if not callable(metric_fn):
            raise TypeError(f"metric_fn must be callable, got {type(metric_fn).__name__}.")
        graphdef, state = nnx.split(self.model)
        data = on_device_of(data, state)
        metrics = evaluator(metric_fn, batch_size, eval_mode)(graphdef, state, data)
        return {k: float(v) for k, v in metrics.items()}
