"""The one owner of the user's objects: reads ``(graphdef, state, opt_state)``, writes them back.

Everything the shell trains goes through an :class:`Owner`: it is the only code in nnxscan
that calls ``nnx.update`` on the user's module and optimizer, and it keeps the run's
counters. There is ONE step counter: with an ``nnx.Optimizer`` its ``step`` is the truth
(``trainer.step`` reads it, checkpoints save and restore it); without one the owner counts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscan.adapters.nnx_optimizer import optax_state_from_optimizer, optimizer_state_writer
from nnxscan.pure import init_opt_state, split_wrt
from nnxscan.pure._checks import check_transform
from nnxscan.pure._node import node_of


def metric_logs(computed: Any, metrics: nnx.Metric) -> dict[str, Any]:
    """``metrics.compute()``'s result as flat logs of host values (floats for scalars).

    An ``nnx.MultiMetric`` gives one entry per metric; a single metric is named by its
    ``argname`` (``Average("loss")`` -> ``loss``) or its class; a named tuple of
    statistics (``Welford``) gives ``<name>_<field>``.

    Example:
      >>> metric_logs(metrics.compute(), metrics)
      {'accuracy': 0.5, 'loss': 1.2}
    """
    name = getattr(metrics, "argname", None) or type(metrics).__name__.lower()
    if isinstance(computed, dict):
        items = dict(computed)
    elif hasattr(computed, "_asdict"):
        items = {f"{name}_{k}": v for k, v in computed._asdict().items()}
    else:
        items = {name: computed}
    host = jax.device_get(items)
    return {k: float(v) if np.ndim(v) == 0 else np.asarray(v) for k, v in host.items()}


Writer = Callable[[nnx.State, Any, int], None]


class Owner:
    """Holds the user's ``model`` (and ``optimizer``, if given) and the run's counters.

    Args:
      model: the user's ``nnx.Module``.
      tx_or_optimizer: an optax transform (the owner then keeps the optax state itself),
        or an ``nnx.Optimizer`` built on ``model`` (its state and ``step`` are then the
        truth, kept up to date after every compiled call).
      wrt: the filter of the trained variables (an optimizer brings its own).
      rngs, metrics: call-time ``nnx.Rngs`` and NNX metrics that travel with the model
        through every compiled call (the step splits ``(model, rngs, metrics)``) and are
        written back with it.
    """

    def __init__(
        self,
        model: nnx.Module,
        tx_or_optimizer: optax.GradientTransformation | nnx.Optimizer,
        wrt: nnx.filterlib.Filter = nnx.Param,
        *,
        rngs: nnx.Rngs | None = None,
        metrics: nnx.Metric | None = None,
    ):
        if not isinstance(model, nnx.Module):
            raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
        if rngs is not None and not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}.")
        if metrics is not None and not isinstance(metrics, nnx.Metric):
            raise TypeError(
                f"metrics must be an nnx.Metric or nnx.MultiMetric, got {type(metrics).__name__}."
            )
        self.model, self.rngs, self.metrics = model, rngs, metrics
        # What every compiled call carries: the model, or (model, rngs, metrics).
        self.node = node_of(model, rngs, metrics)
        self.optimizer: nnx.Optimizer | None = None
        if isinstance(tx_or_optimizer, nnx.Optimizer):
            if wrt is not nnx.Param and wrt != tx_or_optimizer.wrt:
                raise ValueError(
                    f"wrt={wrt!r} differs from the nnx.Optimizer's wrt="
                    f"{tx_or_optimizer.wrt!r}; leave wrt out when passing an optimizer."
                )
            self.optimizer = tx_or_optimizer
            self.wrt = tx_or_optimizer.wrt
            self.tx = check_transform(tx_or_optimizer.tx)
            params, _ = split_wrt(nnx.state(self.node), self.wrt)
            optax_state_from_optimizer(self.optimizer, params)  # validates, raises early
            self._opt_state = None
        else:
            self.tx = check_transform(tx_or_optimizer)
            self.wrt = wrt
            self._opt_state = init_opt_state(self.tx, nnx.state(self.node), wrt)
        self.epoch = 0
        self.seed = 0
        # Steps trained of epoch ``epoch`` when a run stopped inside it (0 at boundaries).
        self.epoch_step = 0
        # The History JSON the last restored checkpoint carried ("" if none).
        self.restored_run = ""
        self._own_step = 0
        # A state loaded into the model without a step (load()) makes a checkpoint at the
        # current step stale.
        self.loaded_since_checkpoint = False
        # The optimizer's step array as last read or written, and its value: reading
        # ``step`` then needs no device sync unless the user stepped the optimizer since.
        self._step_cache: tuple[Any, int] | None = None

    # -- reading ----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps trained: the ``nnx.Optimizer``'s ``step`` when there is one."""
        if self.optimizer is None:
            return self._own_step
        value = self.optimizer.step.get_value()
        if self._step_cache is None or self._step_cache[0] is not value:
            self._step_cache = (value, int(value))
        return self._step_cache[1]

    @property
    def opt_state(self) -> Any:
        """The optax state, in the structure ``tx.init(params)`` gives."""
        if self.optimizer is None:
            return self._opt_state
        params, _ = split_wrt(nnx.state(self.node), self.wrt)
        return optax_state_from_optimizer(self.optimizer, params)

    def read(self) -> tuple[nnx.GraphDef, nnx.State, Any]:
        """``(graphdef, state, opt_state)`` of the user's objects (their own buffers)."""
        graphdef, state = nnx.split(self.node)
        return graphdef, state, self.opt_state

    def reset_metrics(self) -> None:
        """Starts the training metrics afresh (at the start of a fit)."""
        if self.metrics is not None:
            self.metrics.reset()

    def read_state(self) -> nnx.State:
        """The module state of the user's objects (model, and rngs/metrics when given)."""
        return nnx.split(self.node)[1]

    def take_metrics(self) -> dict[str, Any]:
        """The training metrics accumulated since the last call, then reset (one host read).

        ``compute()`` of an ``nnx.MultiMetric`` gives one entry per metric; a single metric
        is named by its ``argname`` (``Average("loss")`` -> ``loss``) or its class.
        """
        if self.metrics is None:
            return {}
        values = metric_logs(self.metrics.compute(), self.metrics)
        self.metrics.reset()
        return values

    # -- writing ----------------------------------------------------------------------------

    def writer(self) -> Writer:
        """``write(state, opt_state, steps)``: puts a trained state into the user's objects and
        advances the step counter by ``steps``. Its leaf maps are built once, here: call it
        once per fit and use the result after every compiled call."""
        if self.optimizer is None:

            def write(state: nnx.State, opt_state: Any, steps: int) -> None:
                nnx.update(self.node, state)
                self._opt_state = opt_state
                self._own_step += steps

            return write

        build = optimizer_state_writer(self.optimizer)
        optimizer = self.optimizer

        def write_with_optimizer(state: nnx.State, opt_state: Any, steps: int) -> None:
            new_step = self.step + steps
            step_array = jnp.asarray(new_step, jnp.uint32)
            nnx.update(self.node, state)
            nnx.update(optimizer, build(opt_state, step_array))
            self._step_cache = (optimizer.step.get_value(), new_step)

        return write_with_optimizer

    def load(self, state: nnx.State) -> None:
        """Writes a module state (e.g. a kept copy of the best epoch) into the model only."""
        nnx.update(self.model, state)
        self.loaded_since_checkpoint = True

    def checkpoint_tree(self, run: str = "") -> dict[str, Any]:
        """What a checkpoint holds: module state, optax state, the counters, and ``run``
        (the fit's History so far, as JSON: what a resume needs to go on)."""
        meta = {
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.seed,
            "epoch_step": self.epoch_step,
            "run": run,
        }
        return {"state": nnx.state(self.node), "opt_state": self.opt_state, "meta": meta}

    def restore(self, tree: dict[str, Any]) -> None:
        """Writes a checkpoint tree (as :meth:`checkpoint_tree` made it) into the objects.

        The tree is checked first: a bad one raises and changes nothing.
        """
        meta = {"epoch_step": 0, "run": "", **tree["meta"]}  # 0.1 checkpoints lack the last two
        for name in ("epoch", "step", "seed", "epoch_step"):
            if isinstance(meta[name], bool) or not isinstance(meta[name], int):
                raise ValueError(f"checkpoint meta {name}={meta[name]!r} is not an int.")
        if self.optimizer is None:
            nnx.update(self.node, tree["state"])
            self._opt_state = tree["opt_state"]
            self._own_step = meta["step"]
        else:
            # Build the optimizer's update before touching the model: it can still raise.
            update = optimizer_state_writer(self.optimizer)(
                tree["opt_state"], jnp.asarray(meta["step"], jnp.uint32)
            )
            nnx.update(self.node, tree["state"])
            nnx.update(self.optimizer, update)
            self._step_cache = None
        self.epoch, self.seed = meta["epoch"], meta["seed"]
        self.epoch_step, self.restored_run = meta["epoch_step"], meta["run"]
        self.loaded_since_checkpoint = False
