"""``Trainer``: scanned epochs on the user's own NNX module and optimizer.

A facade over the one fit engine: it checks its arguments (``_front_door``, shared with
``Population``) and hands the engine an owner of the user's objects
(``_engine.owner.ModelOwner``) and its placement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Unpack

import optax
from flax import nnx

from nnxscan.shell._config import Owned
from nnxscan.shell._construction import TrainerArguments, construction_options
from nnxscan.shell._engine.options import FitArguments
from nnxscan.shell._engine.owner import ModelOwner
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._front_door import FrontDoor, check_seed
from nnxscan.shell._tracebacks import at_the_call
from nnxscan.shell._user_steps import user_step_owner
from nnxscan.shell.history import History

__all__ = ["Trainer"]


def _check_positional(tx_or_optimizer: Any, loss_fn: Any, extra: tuple) -> None:
    """Explains the usual mix-up: an nnx.Optimizer AND an optax transform, or no loss."""
    transform = optax.GradientTransformation | optax.MultiSteps
    if extra or isinstance(loss_fn, transform):
        got = ", ".join(type(x).__name__ for x in (tx_or_optimizer, loss_fn, *extra))
        raise TypeError(
            f"Trainer(model, tx_or_optimizer, loss_fn) takes ONE of an nnx.Optimizer or an "
            f"optax transform, then the loss; got (model, {got}). An nnx.Optimizer already "
            f"holds its transform: Trainer(model, nnx.Optimizer(model, optax.adam(1e-3), "
            f"wrt=nnx.Param), loss_fn), or Trainer(model, optax.adam(1e-3), loss_fn). "
            f"Options such as has_aux= are keyword-only."
        )


class Trainer(FrontDoor):
    """Trains the user's NNX module with compiled, scanned epochs.

    Every argument is described in docs/training.md, "Trainer's arguments". In brief:

    Args:
      model: the ``nnx.Module`` to train; the live object holds the trained state after
        every compiled call.
      tx_or_optimizer: an optax transform, or an ``nnx.Optimizer`` on ``model`` (then kept
        up to date too; its ``step`` is the step counter).
      loss_fn: ``loss_fn(model, batch)`` returning a scalar, ``(loss, aux)`` with
        ``has_aux``; ``loss_fn(model, batch, rngs)`` with ``rngs``.
      train_step, extras: your own step instead: a pure :class:`nnxscan.pure.Step`
        (``Trainer(model, train_step=step)``), or a stateful NNX
        ``fn(model, optimizer, *extras, batch)`` (``Trainer(model, optimizer,
        train_step=fn, extras=(metrics, rngs))``); docs/custom_steps.md.
      wrt, has_aux, accumulate, rngs, metrics, update_metrics: options of the step built
        from ``loss_fn``: what trains, aux outputs, micro-batches, call-time ``nnx.Rngs``,
        NNX metrics updated inside the step (logged ``train_<name>``).
      execution: ``"auto"``, ``"scan"``, ``"unrolled"``, ``"step"`` or a ``Plan``.
      on_nonfinite: ``"ignore"`` (apply the step), ``"skip"`` (leave it out) or ``"stop"``
        (``fit`` raises ``FloatingPointError`` with the model before the step).
      mesh, data_axis, fsdp_min_size, shardings: train on a mesh; every variable keeps
        the sharding the model gives it (docs/scaling.md).

    Example:
      >>> import numpy as np, optax
      >>> from flax import nnx
      >>> def loss_fn(model, batch):
      ...     return ((model(batch["x"]) - batch["y"]) ** 2).mean()
      >>> data = {"x": np.ones((64, 2), np.float32), "y": np.zeros((64, 1), np.float32)}
      >>> trainer = Trainer(nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optax.adam(1e-2), loss_fn)
      >>> history = trainer.fit(data, epochs=2, batch_size=16, progress=False)
      >>> history.losses.shape, trainer.step
      ((8,), 8)
    """

    _usage = (
        "an optimizer and a loss, Trainer(model, optax.adam(1e-3), loss_fn), or your own "
        "step: Trainer(model, train_step=step) with a nnxscan.pure.Step, or Trainer(model, "
        "optimizer, train_step=fn) with a stateful NNX fn(model, optimizer, batch)."
    )

    @at_the_call
    def __init__(
        self,
        model: nnx.Module,
        tx_or_optimizer: optax.GradientTransformation | nnx.Optimizer | None = None,
        loss_fn: Callable[..., Any] | None = None,
        *mixed_up: Any,
        **options: Unpack[TrainerArguments],
    ):
        # ``*mixed_up`` only catches extra positional arguments to explain them: Python's
        # own "takes 4 positional arguments but 5 were given" says nothing useful.
        _check_positional(tx_or_optimizer, loss_fn, mixed_up)
        o = construction_options("Trainer", options)
        o["extras"] = tuple(o["extras"])
        train_step, rngs = o["train_step"], o["rngs"]
        # With a user's step the second argument is the optimizer the step receives.
        self._check_step(o, tx_or_optimizer if train_step is None else None, loss_fn, model=model)
        if self._step_kind == "loss":
            owner = ModelOwner(model, tx_or_optimizer, o["wrt"], rngs=rngs, metrics=o["metrics"])
        else:
            owner = user_step_owner(
                model, tx_or_optimizer, train_step, o["extras"], kind=self._step_kind,
                stateful_front="Trainer", pure_call="Trainer(model, train_step=step)",
            )  # fmt: skip
        placement = Placement(
            o["mesh"], o["data_axis"], o["fsdp_min_size"], rules=o["shardings"], tx=owner.tx,
            wrt=owner.wrt,
        )  # fmt: skip
        self._start(owner, placement, self._program(owner.tx, owner.wrt, rngs), rngs)

    # -- the user's objects (held by the owner) -------------------------------------------

    model = Owned[nnx.Module](
        "The user's module: after every compiled call it holds the trained state."
    )
    optimizer = Owned[nnx.Optimizer | None]("The user's ``nnx.Optimizer``, when one was given.")
    rngs = Owned[nnx.Rngs | None](
        "The call-time ``nnx.Rngs`` the loss receives, when one was given."
    )
    opt_state = Owned[Any]("The optax state (read from the ``nnx.Optimizer`` when one was given).")
    seed = Owned[int]("The shuffle seed of the last ``fit`` (or of the restored checkpoint).")

    @at_the_call
    def fit(
        self,
        data: Any,
        *,
        epochs: int | None = None,
        seed: int | None = None,
        **options: Unpack[FitArguments],
    ) -> History:
        """Trains ``epochs`` MORE epochs on ``data`` and returns their :class:`History`.

        ``data`` is a data set (a pytree of arrays sharing a leading examples axis), each
        epoch permuted as ``nnxscan.pure.epoch_order(seed, global epoch, n)`` gives, so
        ``fit(epochs=2)`` twice is bitwise ``fit(epochs=4)``; or a stream of batches (a
        list, a re-iterable such as a DataLoader, a zero-argument callable returning a
        fresh iterator per epoch), used in the order it yields them, ``steps_per_call``
        batches per compiled call (docs/streaming.md).

        Args:
          data: the data set or the stream.
          epochs: number of epochs to train (0 trains nothing); may be left out with
            ``max_steps``.
          seed: the shuffle seed of a data set; ``None`` keeps the trainer's (0, or the one
            a restored checkpoint recorded, so a resumed run shuffles as the original did).
          **options: ``batch_size``, ``callbacks``, ``eval_data``, ``checkpoint_dir``...:
            the options ``Population.fit`` takes too, each documented on
            :class:`nnxscan.shell.FitArguments`.

        Example:
          >>> history = trainer.fit({"x": x, "y": y}, epochs=5, batch_size=64)
          >>> history = trainer.fit(lambda: loader_batches(), epochs=5, steps_per_call=50)
        """
        if seed is not None:
            seed = check_seed(seed)
        return self._fit(data, epochs, options, run_keys={"seed": seed})
