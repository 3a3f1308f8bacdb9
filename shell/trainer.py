"""The Trainer: scanned epochs on the user's own NNX module and optimizer.

``Trainer`` checks its arguments and delegates to the one fit engine (``_engine.Engine``,
shared with ``Population``): a :class:`~nnxscan.shell._engine.owner.ModelOwner` reads and writes
the user's objects, a compiled program from ``_programs`` runs the pure step, and
``_fit.FitLoop`` runs the epochs with callbacks, evaluation, checkpoints and progress.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import jax
import optax
from flax import nnx

from nnxscan.pure import Step
from nnxscan.pure.checks import abstract_batch, check_count
from nnxscan.shell._config import Config
from nnxscan.shell._engine.engine import Engine
from nnxscan.shell._engine.evaluation import evaluate
from nnxscan.shell._engine.options import FitArguments
from nnxscan.shell._engine.owner import ModelOwner
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.plans import Plan, resolve_plan
from nnxscan.shell._engine.programs import (
    TrainProgram,
    nnx_step_program,
    step_program,
    train_program,
)
from nnxscan.shell._front_door import FrontDoor, check_loss_options, check_policy
from nnxscan.shell._user_steps import (
    loss_arguments,
    refuse_loss_options,
    user_step_owner,
)
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


def _user_step(
    model: nnx.Module,
    optimizer: Any,
    loss_fn: Any,
    train_step: Any,
    extras: tuple,
    on_nonfinite: str,
    loss_options: list[str],
) -> tuple[ModelOwner, TrainProgram]:
    """The owner and program of ``Trainer(model, [optimizer], train_step=..., extras=...)``,
    after checking that nothing meant for the built-in step was given."""
    refuse_loss_options((["loss_fn"] if loss_fn is not None else []) + loss_options)
    owner, pure = user_step_owner(
        model, optimizer, train_step, extras, pure_call="Trainer(model, train_step=step)",
        stateful_front="Trainer",
    )  # fmt: skip
    program = step_program if pure else nnx_step_program
    return owner, program(train_step, on_nonfinite)


_MAX_SEED = 2**31 - 1  # the seed enters numpy's generator and checkpoints as an int32


class Trainer(FrontDoor):
    """Trains the user's NNX module with compiled, scanned epochs.

    Args:
      model: the ``nnx.Module`` to train. It is the live object: after every compiled call
        (or, with the ``"step"`` plan, every stretch of calls) it holds the trained state.
      tx_or_optimizer: an optax ``GradientTransformation``, or an ``nnx.Optimizer`` built on
        ``model`` whose state and ``step`` counter are then kept up to date as well: its
        ``step`` is the one step counter (``trainer.step`` reads it; checkpoints save and
        restore it).
      loss_fn: ``loss_fn(model, batch)`` returning a scalar, or ``(loss, aux)`` with
        ``has_aux=True``; with ``rngs``, ``loss_fn(model, batch, rngs)``.
      train_step: your own step instead of ``tx_or_optimizer`` + ``loss_fn``: a pure
        :class:`nnxscan.pure.Step` (``Trainer(model, train_step=step)``: its ``init``
        makes the ``opt_state`` the trainer keeps, checkpoints and restores), or a
        stateful NNX function ``fn(model, optimizer, *extras, batch)`` as Flax's tutorials
        write it (``Trainer(model, optimizer, train_step=fn, extras=(...))``, the optimizer
        optional), run inside the compiled scan with every object written back after each
        call; it may return nothing, a loss, ``(loss, aux)`` or a dict of scalars (the
        epoch's logs). The options of the built-in step (``wrt``, ``has_aux``,
        ``accumulate``, ``rngs``, ``metrics``, ``update_metrics``) do not apply. See
        ``docs/custom_steps.md``. ``trainer.step`` stays the step counter.
      extras: the other NNX objects a stateful ``train_step`` mutates (``nnx.Metric``s,
        logged as ``train_<name>`` and reset each epoch; ``nnx.Rngs``; an ``nnx.EMA``...).
      wrt: the NNX filter of the variables to train (an ``nnx.Optimizer`` brings its own).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; scalar aux leaves are averaged
        into the epoch logs.
      execution: ``"auto"``, ``"scan"``, ``"unrolled"``, ``"step"`` or a ``Plan`` (see
        ``docs/performance.md`` for the rule ``"auto"`` follows).
      on_nonfinite: what a step with a non-finite loss or gradient does. ``"ignore"`` (the
        default, the plain loop's behaviour): it is applied. ``"skip"``: it leaves the
        model and optax state unchanged (inside the compiled loop, no host sync), reports
        a NaN loss, and each epoch's logs count ``skipped_steps``. ``"stop"``: training
        halts right before it and ``fit`` raises ``FloatingPointError`` naming the epoch
        and step, with the model at the state before that step (one host sync per call).
      accumulate: split each batch into this many micro-batches and apply their averaged
        gradient once (see :func:`nnxscan.pure.make_train_step`).
      mesh, data_axis: the ``jax.sharding.Mesh`` to train on; without one, the mesh
        ``jax.set_mesh`` put in context when ``fit`` runs (none: one device). Every
        variable keeps the sharding the model gives it (its array's ``NamedSharding``, or
        its NNX annotation, logical names included), optax moments follow their
        parameters, and each batch is split over ``data_axis`` (a name or a tuple; by
        default the mesh's ``"data"`` axis when it has one). See ``docs/scaling.md``.
      fsdp_min_size: on a mesh, also shard every array the model does not place, of at
        least this many elements, along its largest dimension the data axes divide.
      shardings: path rules ``{regex: PartitionSpec}`` for variables (searched in paths
        such as ``"layers/0/attention/query/kernel"``): a matching rule wins over the
        model's own sharding; shards a third-party model without editing it.
      rngs: call-time ``nnx.Rngs``, as the Flax NNX tutorial passes to each step: the loss
        is called as ``loss_fn(model, batch, rngs)``, the Rngs' state travels through every
        compiled call and is written back, advancing exactly as in the tutorial's loop.
      metrics, update_metrics: an ``nnx.Metric`` / ``nnx.MultiMetric`` and
        ``update_metrics(metrics, loss, aux, batch)`` that updates it inside the compiled
        step (no host sync per step). Each epoch's logs gain ``train_<name>`` from
        ``metrics.compute()``, then the metrics are reset. ``evaluate`` and ``fit``'s
        evaluation use them too when no ``metric_fn`` is given.

    Example:
      >>> trainer = Trainer(model, optax.adam(1e-3), loss_fn)
      >>> history = trainer.fit({"x": x, "y": y}, epochs=10, batch_size=32)
      >>> Trainer(model, optimizer, train_step=train_step).fit(data, epochs=3, batch_size=32)
      >>> trainer.evaluate({"x": x_test, "y": y_test}, accuracy, batch_size=256)
      {'accuracy': 0.97}

      The Flax NNX MNIST tutorial's own model, loss and metrics, unchanged:

      >>> trainer = Trainer(model, optimizer, loss_fn, has_aux=True, rngs=nnx.Rngs(0),
      ...     metrics=metrics, update_metrics=lambda m, loss, logits, b: m.update(
      ...         loss=loss, logits=logits, labels=b["label"]))
      >>> trainer.fit(train, epochs=3, batch_size=32, eval_data=test)  # train_/eval_ metrics
    """

    def __init__(
        self,
        model: nnx.Module,
        tx_or_optimizer: optax.GradientTransformation | nnx.Optimizer | None = None,
        loss_fn: Callable[..., Any] | None = None,
        *mixed_up: Any,
        train_step: Step | Callable[..., Any] | None = None,
        extras: Sequence[Any] = (),
        wrt: nnx.filterlib.Filter = nnx.Param,
        has_aux: bool = False,
        execution: str | Plan = "auto",
        on_nonfinite: str = "ignore",
        accumulate: int = 1,
        mesh: jax.sharding.Mesh | None = None,
        data_axis: str | tuple[str, ...] | None = None,
        fsdp_min_size: int | None = None,
        shardings: Mapping[str, Any] | None = None,
        rngs: nnx.Rngs | None = None,
        metrics: nnx.Metric | None = None,
        update_metrics: Callable[[Any, Any, Any, Any], Any] | None = None,
    ):
        # ``*mixed_up`` only catches extra positional arguments to explain them: Python's
        # own "takes 4 positional arguments but 5 were given" says nothing useful.
        _check_positional(tx_or_optimizer, loss_fn, mixed_up)
        check_policy(on_nonfinite)
        #: Set by a callback (``EarlyStopping``) to end ``fit`` after the current call.
        self.stop_training = False
        if train_step is not None:
            loss_options = dict(
                wrt=wrt is not nnx.Param, has_aux=has_aux, accumulate=accumulate != 1,
                rngs=rngs is not None, metrics=metrics is not None,
                update_metrics=update_metrics is not None,
            )  # fmt: skip
            self._owner, program = _user_step(
                model, tx_or_optimizer, loss_fn, train_step, tuple(extras), on_nonfinite,
                [name for name, given in loss_options.items() if given],
            )  # fmt: skip
            self._config = dict(
                loss_fn=None, has_aux=program.has_aux, update_metrics=None,
                on_nonfinite=on_nonfinite, accumulate=1, train_step=train_step,
            )  # fmt: skip
        else:
            if tx_or_optimizer is None or loss_fn is None:
                raise TypeError(
                    "Trainer needs an optimizer and a loss, Trainer(model, optax.adam(1e-3), "
                    "loss_fn), or your own step: Trainer(model, train_step=step) with a "
                    "nnxscan.pure.Step, or Trainer(model, optimizer, train_step=fn) with a "
                    "stateful NNX fn(model, optimizer, batch)."
                )
            if extras:
                raise TypeError("extras= goes with a stateful train_step=fn; pass rngs= and "
                                "metrics= to a Trainer built from a loss.")  # fmt: skip
            captured = loss_arguments(loss_fn, model, rngs) if callable(loss_fn) else None
            accumulate = check_loss_options(
                loss_fn, accumulate=accumulate, metrics=metrics, update_metrics=update_metrics,
                captured=captured,
            )  # fmt: skip
            self._owner = ModelOwner(model, tx_or_optimizer, wrt, rngs=rngs, metrics=metrics)
            program = train_program(
                loss_fn, self.tx, self.wrt, bool(has_aux), on_nonfinite, accumulate,
                rngs is not None, update_metrics,
            )  # fmt: skip
            # What the compiled program is built from: read-only from here on (properties).
            self._config = dict(
                loss_fn=loss_fn, has_aux=bool(has_aux), update_metrics=update_metrics,
                on_nonfinite=on_nonfinite, accumulate=accumulate, train_step=None,
            )  # fmt: skip
        placement = Placement(
            mesh, data_axis, fsdp_min_size, rules=shardings, tx=self.tx, wrt=self.wrt
        )
        self._engine = Engine(
            program=program, owner=self._owner, placement=placement,
            explicit_plan=resolve_plan(execution), members=None, subject=self,
            loss_fn=self.loss_fn, has_aux=self.has_aux, update_metrics=self.update_metrics,
            rngs=self._owner.rngs if self.loss_fn is not None else None,
        )  # fmt: skip

    # -- configuration (read-only: the compiled program is built from it) -----------------

    #: A Trainer trains one model (a ``Population``: N). Callbacks and writers read this.
    num_members = None

    loss_fn = Config("The loss the compiled step was built from.")
    has_aux = Config("Whether ``loss_fn`` returns ``(loss, aux)``.")
    update_metrics = Config("The NNX metrics update run inside the step, when given.")
    on_nonfinite = Config('The non-finite policy: ``"ignore"``, ``"skip"`` or ``"stop"``.')
    accumulate = Config("Micro-batches per step (1: none).")
    train_step = Config(
        "The user's step (a ``nnxscan.pure.Step`` or a stateful NNX function), or None "
        "for the step built from ``loss_fn``."
    )

    # -- the user's objects and the counters (all held by the owner) ----------------------

    @property
    def model(self) -> nnx.Module:
        """The user's module: after every compiled call it holds the trained state."""
        return self._owner.model

    @property
    def optimizer(self) -> nnx.Optimizer | None:
        """The user's ``nnx.Optimizer``, when one was given."""
        return self._owner.optimizer

    @property
    def tx(self) -> optax.GradientTransformation:
        """The optax transform that trains the ``wrt`` variables."""
        return self._owner.tx

    @property
    def wrt(self) -> nnx.filterlib.Filter:
        """The filter of the trained variables."""
        return self._owner.wrt

    @property
    def rngs(self) -> nnx.Rngs | None:
        """The call-time ``nnx.Rngs`` the loss receives, when one was given."""
        return self._owner.rngs

    @property
    def metrics(self) -> nnx.Metric | None:
        """The training metrics, when given (reset after each epoch's logs read them)."""
        return self._owner.metrics

    @property
    def opt_state(self) -> Any:
        """The optax state (read from the ``nnx.Optimizer`` when one was given)."""
        return self._owner.opt_state

    @property
    def seed(self) -> int:
        """The shuffle seed of the last ``fit`` (or of the restored checkpoint)."""
        return self._owner.seed

    def load_state(self, state: nnx.State) -> None:
        """Writes a module state into the model (e.g. a copy a callback kept).

        Example:
          >>> best = jax.tree.map(lambda x: x.copy(), nnx.state(trainer.model))
          >>> trainer.fit(data, epochs=5, batch_size=32)
          >>> trainer.load_state(best)
        """
        self._owner.load(state)

    def plan_for(self, data: Any, batch_size: int) -> Plan:
        """The execution plan ``fit`` uses for this data and batch size (traces, no compile).

        Example:
          >>> trainer.plan_for({"x": x, "y": y}, 32)
          Plan(kind='scan', steps_per_call=None)
        """
        with self._engine.bind().context():
            return self._engine.execution(abstract_batch(data, leading=batch_size)).plan

    # -- training -------------------------------------------------------------------------

    def fit(
        self,
        data: Any,
        *,
        epochs: int | None = None,
        seed: int | None = None,
        **options: Unpack[FitArguments],
    ) -> History:
        """Trains ``epochs`` MORE epochs on ``data`` and returns their :class:`History`.

        ``data`` is either the whole data set or a stream of batches:

        - a pytree of arrays (dict, tuple, NamedTuple, array) sharing a leading examples
          axis, numpy or JAX, moved to the device once per call. Each epoch permutes the
          examples in the order ``nnxscan.pure.epoch_order(seed, global epoch index, n)``
          gives (numpy's ``default_rng((seed, epoch)).permutation``), so ``fit(epochs=2)``
          twice gives bitwise the model ``fit(epochs=4)`` gives, and a loop of
          ``nnxscan.pure.make_epoch`` calls fed the same orders gives it too.
        - a stream: a ``list`` of batches, any re-iterable (a DataLoader), or a
          zero-argument callable returning a fresh iterator per epoch (a single-use
          iterator only for ``epochs=1``). Each batch is a pytree of arrays (numpy, JAX,
          PyTorch CPU tensors, lists; see :func:`nnxscan.adapters.data.to_numpy`) with a
          leading batch axis. Batches are used in the order the stream yields them
          (``shuffle`` and ``seed`` are the loader's business); ``steps_per_call`` of them
          are stacked into one chunk and trained in one compiled call while a background
          thread prepares the next (``prefetch``), never pulling more than two chunks
          beyond the last finished call.

        Args:
          data: the data set or the stream, as above.
          epochs: number of epochs to train (0 trains nothing); may be left out with
            ``max_steps`` (the steps then decide).
          seed: the shuffle seed of a data set; ``None`` keeps the trainer's seed (0, or
            the one a restored checkpoint recorded, so a resumed run shuffles as the
            original did).
          **options: ``batch_size``, ``shuffle``, ``callbacks``, ``progress``,
            ``steps_per_call``, ``drop_remainder``, ``prefetch``, ``checkpoint_dir``,
            ``checkpoint_every``, ``checkpoint_every_steps``, ``checkpoint_async``,
            ``resume``, ``eval_data``, ``metric_fn``, ``eval_every``, ``eval_batch_size``:
            the options ``Population.fit`` takes too, each documented on
            :class:`nnxscan.shell.FitArguments`.

        Example:
          >>> history = trainer.fit({"x": x, "y": y}, epochs=5, batch_size=64)
          >>> history = trainer.fit(lambda: loader_batches(), epochs=5, steps_per_call=50)
        """
        if seed is not None:
            seed = check_count(seed, "seed", 0, _MAX_SEED)
        return self._fit(data, epochs, options, run_keys={"seed": seed})

    # -- evaluation -----------------------------------------------------------------------

    def evaluate(
        self,
        data: Any,
        metric_fn: Callable[[nnx.Module, Any], Any] | None = None,
        *,
        batch_size: int,
        eval_mode: bool = True,
        metrics: nnx.Metric | None = None,
        update_metrics: Callable[[Any, Any, Any, Any], Any] | None = None,
    ) -> dict[str, Any]:
        """Evaluates the model over EVERY example of ``data``; returns ``{name: value}``.

        Two ways, one per call:

        - ``metric_fn(model, batch)`` returns a metric (reported under its function name,
          or ``"metric"``) or a dict of metrics, each the mean over the batch: a scalar
          (a float in the result) or an array of any fixed shape, such as a per-class
          accuracy (a numpy array, averaged elementwise); the result averages them over all
          examples (a final short batch counts with its true size).
        - NNX metrics: ``metrics`` (an ``nnx.Metric`` / ``nnx.MultiMetric``) and
          ``update_metrics(metrics, loss, aux, batch)``, fed with ``loss_fn`` — the Flax
          tutorial's ``eval_step``. They default to the trainer's own; the result is
          ``metrics.compute()`` from a fresh (reset) copy, and the given object is not
          changed.

        With ``eval_mode`` the model runs after ``model.eval()`` (Dropout off, BatchNorm
        on running statistics). Nothing in the model, its RNG state or the metrics
        changes.

        Example:
          >>> def accuracy(model, batch):
          ...     return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])
          >>> trainer.evaluate(test_data, accuracy, batch_size=500)
          {'accuracy': 0.975}
          >>> trainer.evaluate(test_data, batch_size=500)  # the trainer's NNX metrics
          {'accuracy': 0.975, 'loss': 0.08}
        """
        return evaluate(
            self._engine, data, metric_fn, batch_size=batch_size, eval_mode=eval_mode,
            metrics=metrics, update_metrics=update_metrics,
        )  # fmt: skip
