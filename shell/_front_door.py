"""What ``Trainer`` and ``Population`` share, written once: the checks of the step's
arguments, the compiled program built from them, and every method that only talks to the
engine (the counters, ``fit``'s hand-over, ``evaluate``, ``save``, ``restore``).

Both are facades over the one fit engine (``_engine.Engine``). They differ only in the owner
and placement they hand it (the user's objects, or stacked members) and in what their
``fit`` calls a run (one seed, or the members' order rule).
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable
from typing import Any

from flax import nnx

from nnxscan.pure.checks import check_count
from nnxscan.shell._config import Config, Owned
from nnxscan.shell._construction import loss_options_given, step_kind
from nnxscan.shell._edges import checkpointing as _checkpointing
from nnxscan.shell._engine.engine import Engine
from nnxscan.shell._engine.evaluation import evaluate
from nnxscan.shell._engine.options import fit_options
from nnxscan.shell._engine.owner import check_rngs_and_metrics
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.plans import Plan, resolve_plan
from nnxscan.shell._engine.programs import (
    TrainProgram,
    nnx_step_program,
    step_program,
    train_program,
)
from nnxscan.shell._tracebacks import at_the_call
from nnxscan.shell._user_steps import check_loss_fn, refuse_loss_options
from nnxscan.shell.history import History

NONFINITE_POLICIES = ("ignore", "skip", "stop")
MAX_SEED = 2**31 - 1  # a seed enters numpy's generator and checkpoints as an int32


def check_seed(seed: Any, name: str = "seed") -> int:
    """A shuffle seed: an int in ``[0, 2**31 - 1]``."""
    return check_count(seed, name, 0, MAX_SEED)


class FrontDoor:
    """The part of ``Trainer`` and ``Population`` that does not depend on which one it is.

    A subclass's ``__init__`` runs :meth:`_check_step` before anything else is read, built
    or compiled, then builds its owner and placement and hands them to :meth:`_start`.
    """

    _engine: Engine
    _owner: Any
    _config: dict[str, Any]
    #: How to build one, quoted when neither a loss nor a step is given.
    _usage: str

    # -- configuration (read-only: the compiled program is built from it) -----------------

    loss_fn = Config("The loss the compiled step was built from (None with ``train_step``).")
    has_aux = Config("Whether the step reports ``(loss, aux)``.")
    update_metrics = Config("The NNX metrics update run inside the step, when given.")
    on_nonfinite = Config('The non-finite policy: ``"ignore"``, ``"skip"`` or ``"stop"``.')
    accumulate = Config("Micro-batches per step (1: none).")
    train_step = Config(
        "The user's step (a ``nnxscan.pure.Step``, or a Trainer's stateful NNX function), or "
        "None for the step built from ``loss_fn``."
    )
    tx = Config("The optax transform that trains the ``wrt`` variables (None for a Step).")
    wrt = Config("The filter of the trained variables (None for a Step).")

    def _check_step(
        self, options: dict[str, Any], tx: Any, loss_fn: Any, *, model: Any = None
    ) -> None:
        """Checks a user's ``train_step`` XOR the step built from ``tx`` and ``loss_fn`` with its
        options (``options``: the front door's, defaults filled in by
        :func:`~nnxscan.shell._construction.construction_options`), the non-finite policy
        and the plan; keeps what the program is built from."""
        on_nonfinite, train_step = options["on_nonfinite"], options["train_step"]
        if on_nonfinite not in NONFINITE_POLICIES:
            raise ValueError(
                f"on_nonfinite={on_nonfinite!r}; use one of {', '.join(NONFINITE_POLICIES)}."
            )
        self._plan = resolve_plan(options["execution"])
        self._step_kind = step_kind(train_step)
        self._config = dict(train_step=train_step, on_nonfinite=on_nonfinite)
        if self._step_kind != "loss":
            positional = [name for name, x in (("tx", tx), ("loss_fn", loss_fn)) if x is not None]
            given = positional + loss_options_given(options)
            refuse_loss_options(given, extras="extras" in options)  # a Population takes none
            self._config.update(loss_fn=None, has_aux=False, update_metrics=None, accumulate=1)
            return
        if tx is None or loss_fn is None:
            raise TypeError(f"{type(self).__name__} needs {self._usage}")
        rngs, metrics, update_metrics = (options[n] for n in ("rngs", "metrics", "update_metrics"))
        has_aux, accumulate = options["has_aux"], options["accumulate"]
        if options.get("extras"):
            raise TypeError(
                f"extras= goes with a stateful train_step=fn; pass rngs= and metrics= to a "
                f"{type(self).__name__} built from a loss."
            )
        check_loss_fn(loss_fn, model, rngs)
        if (metrics is None) != (update_metrics is None):
            raise ValueError(
                "metrics and update_metrics go together: metrics=nnx.MultiMetric(...) and "
                "update_metrics=lambda metrics, loss, aux, batch: metrics.update(...)."
            )
        if update_metrics is not None and not callable(update_metrics):
            got = type(update_metrics).__name__
            raise TypeError(f"update_metrics must be callable, got {got}.")
        check_rngs_and_metrics(None, metrics)
        self._config.update(
            loss_fn=loss_fn, has_aux=bool(has_aux), update_metrics=update_metrics,
            accumulate=check_count(accumulate, "accumulate", 1),
        )  # fmt: skip

    def _program(self, tx: Any, wrt: Any, rngs: Any) -> TrainProgram:
        """The program of the checked step (its ``step`` is what the owner's state is for)."""
        c = self._config
        if c["train_step"] is None:
            program = train_program(
                c["loss_fn"], tx, wrt, c["has_aux"], c["on_nonfinite"], c["accumulate"],
                rngs is not None, c["update_metrics"],
            )  # fmt: skip
        else:
            pure = self._step_kind == "pure"
            program = (step_program if pure else nnx_step_program)(
                c["train_step"], c["on_nonfinite"]
            )
        c.update(tx=tx, wrt=wrt, has_aux=program.has_aux)
        return program

    def _start(self, owner: Any, placement: Placement, program: TrainProgram, rngs: Any) -> None:
        """The engine of ``program`` over ``owner``."""
        c = self._config
        self._owner = owner
        self._engine = Engine(
            program=program, owner=owner, placement=placement, explicit_plan=self._plan,
            trainer=self, loss_fn=c["loss_fn"], update_metrics=c["update_metrics"], rngs=rngs,
        )  # fmt: skip
        #: Set by a callback (``EarlyStopping``) to end ``fit`` after the current call.
        self.stop_training = False

    # -- the counters and what the owner holds --------------------------------------------

    @property
    def num_members(self) -> int | None:
        """How many members train (a Trainer: None): callbacks and writers read this."""
        return self._owner.layout.num_members

    step = Owned[int](
        "Steps trained so far (an ``nnx.Optimizer``'s ``step`` when a Trainer has one)."
    )
    epoch = Owned[int](
        "The global index of the next epoch ``fit`` trains (epochs completed so far)."
    )
    metrics = Owned[nnx.Metric | None](
        "The training NNX metrics (each member's template), when given; reset after each "
        "epoch's logs read them."
    )

    def load_state(self, state: nnx.State) -> None:
        """Writes a module state into the model (e.g. a copy a callback kept).

        Example:
          >>> best = jax.tree.map(lambda x: x.copy(), nnx.state(trainer.model))
          >>> trainer.fit(data, epochs=5, batch_size=32)
          >>> trainer.load_state(best)
        """
        self._owner.load(state)

    @at_the_call
    def plan_for(self, data: Any, batch_size: int) -> Plan:
        """The execution plan ``fit`` uses for this data and batch size (traces one model's
        step, compiles nothing).

        Example:
          >>> trainer.plan_for({"x": x, "y": y}, 32)
          Plan(kind='scan', steps_per_call=None)
        """
        return self._engine.plan_for(data, batch_size)

    # -- training and evaluation ----------------------------------------------------------

    def _fit(
        self,
        data: Any,
        epochs: int | None,
        options: dict[str, Any],
        run_keys: dict[str, Any],
        member_batches: bool = False,
    ) -> History:
        if options.get("eval_data") is not None and options.get("metric_fn") is None:
            self._needs_metric_fn("evaluation during fit")
        checked = fit_options(
            self._engine, data, epochs, options, run_keys=run_keys,
            member_batches=member_batches, front_end="fit",
        )  # fmt: skip
        return self._engine.fit(data, checked)

    @at_the_call
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

        Either ``metric_fn(model, batch)``, returning a metric (named after the function,
        or ``"metric"``) or a dict of them, each the mean over the batch (a scalar, or an
        array of any fixed shape such as a per-class accuracy, averaged elementwise); the
        result averages them over all examples, a final short batch counting with its
        true size. Or NNX ``metrics`` and ``update_metrics(metrics, loss, aux, batch)``
        fed with ``loss_fn`` (the Flax tutorial's ``eval_step``), by default the
        trainer's own: the result is ``metrics.compute()`` of a fresh copy. With
        ``eval_mode`` the model runs after ``model.eval()``. Nothing the trainer holds
        changes. A ``Population`` evaluates every member, vmapped in one call: ``{name:
        values (N,)}``, which :meth:`Population.best` can then look up by name. See
        docs/evaluation.md.

        Example:
          >>> def accuracy(model, batch):
          ...     return jnp.mean(model(batch["x"]).argmax(-1) == batch["y"])
          >>> trainer.evaluate(test_data, accuracy, batch_size=500)
          {'accuracy': 0.975}
          >>> trainer.evaluate(test_data, batch_size=500)  # the trainer's NNX metrics
          {'accuracy': 0.975, 'loss': 0.08}
        """
        if metric_fn is None:
            self._needs_metric_fn("evaluate")
        self._check_evaluation_metrics(metrics, update_metrics)
        values = evaluate(
            self._engine, data, metric_fn, batch_size=batch_size, eval_mode=eval_mode,
            metrics=metrics, update_metrics=update_metrics,
        )  # fmt: skip
        return self._evaluated(values)

    def _check_evaluation_metrics(self, metrics: Any, update_metrics: Any) -> None:
        """``evaluate``'s own NNX metrics, when a front door cannot take them."""

    def _evaluated(self, values: dict[str, Any]) -> dict[str, Any]:
        """What ``evaluate`` returns of the values computed (a Population keeps them too)."""
        return values

    def _needs_metric_fn(self, what: str) -> None:
        """A user's step has no NNX metrics fed by a loss: only a metric_fn evaluates it."""
        if self.train_step is not None:
            raise ValueError(
                f"{what} of a {type(self).__name__}(train_step=...) needs a "
                f"metric_fn(model, batch): its step computes its loss itself, so there is "
                f"no loss_fn to feed NNX metrics with."
            )

    # -- checkpoints ----------------------------------------------------------------------

    @at_the_call
    def save(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> pathlib.Path:
        """Writes a checkpoint of everything a resume needs, numbered by the global step:
        the model state (every member's, for a population: parameters, batch statistics,
        RNG keys and counts), the optax state, the epoch and step counters, the seed (the
        seeds and frozen members). The last ``max_to_keep`` are kept. Atomic: a crash
        mid-save leaves the earlier ones restorable. Saving again at a step that has a
        checkpoint keeps it, unless a state was loaded since.

        Example:
          >>> trainer.fit(data, epochs=2, batch_size=32)
          >>> trainer.save("/tmp/run")
          PosixPath('/tmp/run/16')
        """
        return _checkpointing.save(self._owner, directory, max_to_keep=max_to_keep)

    @at_the_call
    def restore(self, directory: str | os.PathLike[str], *, step: int | None = None) -> int:
        """Loads the newest good (or the given) checkpoint into the model and optimizer
        (the members) and the counters; returns the epoch reached.

        A later ``fit`` continues exactly where the saved run stopped (seed included).
        Without ``step``, a damaged newer checkpoint (crc32 mismatch, truncated or missing
        files, a manifest nnxscan never writes) is skipped with a warning and left on
        disk; with ``step``, it raises ``CorruptCheckpointError`` (a ``ValueError``). A
        checkpoint whose structure or shapes differ (another architecture, other seeds)
        raises ``ValueError`` naming the first mismatching path and both shapes; a missing
        directory or checkpoint raises ``FileNotFoundError``. Every check runs before
        anything changes.

        Example:
          >>> trainer = Trainer(Model(nnx.Rngs(0)), optax.adam(1e-3), loss_fn)
          >>> trainer.restore("/tmp/run")
          2
        """
        # Onto the model's current shardings, on the mesh of this call.
        return _checkpointing.restore(self._owner, self._engine.bind(), directory, step)
