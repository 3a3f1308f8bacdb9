"""``Population``: ``Trainer``'s front door and engine over the members' stacked state
(``_engine.members.StackedOwner``); ``member(i)`` hands out a fresh module."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Unpack

import numpy as np
import optax
from flax import nnx

from nnxscan.pure.checks import check_count
from nnxscan.shell import _population_checks as checks
from nnxscan.shell._config import Config, Owned
from nnxscan.shell._construction import PopulationArguments, construction_options
from nnxscan.shell._engine.layout import Members
from nnxscan.shell._engine.member_build import build_members
from nnxscan.shell._engine.options import FitArguments
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.plans import Plan
from nnxscan.shell._front_door import FrontDoor
from nnxscan.shell._tracebacks import at_the_call
from nnxscan.shell.history import History

__all__ = ["Population"]


class Population(FrontDoor):
    """N models of one architecture, trained together in one compiled call per epoch.

    Member ``i`` is ``model_fn(nnx.Rngs(seeds[i]))``, shuffles by its own
    ``epoch_order(seeds[i], epoch, n)`` and may have its own optax hyperparameters
    (``hyperparams={name: [one value per member]}``, set in the states that
    ``optax.inject_hyperparams`` makes): it trains what a ``Trainer`` of that model alone
    trains with ``seed=seeds[i]``, up to float rounding. ``tx`` and ``loss_fn``, or
    ``train_step`` (a :class:`nnxscan.pure.Step`), and the other arguments mean what
    they mean for ``Trainer``, per member; each is described in docs/populations.md,
    "Population's arguments".

    Example:
      >>> import numpy as np, optax
      >>> from flax import nnx
      >>> x = np.random.default_rng(0).normal(size=(64, 2)).astype(np.float32)
      >>> data = {"x": x, "y": x.sum(1, keepdims=True)}
      >>> loss_fn = lambda model, batch: optax.l2_loss(model(batch["x"]), batch["y"]).mean()
      >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
      >>> pop = Population(lambda rngs: nnx.Linear(2, 1, rngs=rngs), tx, loss_fn,
      ...                  seeds=[0, 1, 2], hyperparams={"learning_rate": [1e-3, 1e-2, 1e-1]})
      >>> history = pop.fit(data, epochs=2, batch_size=16, progress=False)
      >>> history.losses.shape  # (steps, members)
      (8, 3)
      >>> model = pop.member(pop.best("loss"))  # a fresh nnx.Module
    """

    _usage = (
        "an optax transform and a loss, Population(model_fn, optax.adam(1e-3), loss_fn, "
        "seeds=[...]), or your own step: Population(model_fn, train_step=step, "
        "seeds=[...]) with a nnxscan.pure.Step."
    )

    @at_the_call
    def __init__(
        self,
        model_fn: Callable[[nnx.Rngs], nnx.Module],
        tx: optax.GradientTransformation | None = None,
        loss_fn: Callable[..., Any] | None = None,
        **options: Unpack[PopulationArguments],
    ):
        o = construction_options("Population", options)
        checks.check_model_fn(model_fn)
        self._check_step(o, tx, loss_fn)
        train_step, rngs, metrics = o["train_step"], o["rngs"], o["metrics"]
        tx, wrt = checks.member_optimizer(self._step_kind, train_step, tx, o["wrt"])
        seeds = checks.check_seeds(o["seeds"])
        hyperparams = checks.check_hyperparams(o["hyperparams"], len(seeds))
        checks.check_member_rngs(rngs)
        placement = Placement(
            o["mesh"], o["data_axis"], o["fsdp_min_size"], o["member_axis"],
            rules=o["shardings"], tx=tx, wrt=wrt,
        )  # fmt: skip
        layout = Members(len(seeds))  # the owner's: everything else reads it from there
        # The step the members train with: its init builds their opt_states, in the
        # members wrapper that takes their hyperparameters.
        program = self._program(tx, wrt, rngs)
        # Members are built on the mesh they train on: a layer annotated with
        # with_partitioning is sharded as it is created, which needs the mesh in context.
        with placement.bound(layout).context():
            checks.check_hyperparam_names(
                model_fn, program.step.init, seeds[0], hyperparams, step=train_step is not None
            )
            owner = build_members(
                model_fn, program.step, seeds, hyperparams, layout, rngs=rngs, metrics=metrics
            )
        self._config.update(model_fn=model_fn, seeds=seeds, hyperparams=hyperparams)
        self._start(owner, placement, program, rngs)
        # The latest values best(name) can look up: evaluate's results, the last epoch's logs.
        self._latest: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_members

    seeds = Config("Each member's seed (its initialization and its shuffle).")
    model_fn = Config("``model_fn(rngs) -> nnx.Module``, which built every member.")

    @property
    def hyperparams(self) -> dict[str, list]:
        """The per-member hyperparameters the population was built with (a copy)."""
        return {k: list(v) for k, v in self._config["hyperparams"].items()}

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The ``nnx.GraphDef`` of one member's model (what :attr:`state` merges with)."""
        return self._owner.model_graphdef

    @property
    def state(self) -> nnx.State:
        """A copy of the members' stacked model ``nnx.State`` (leading axis: members)."""
        return self._owner.model_state()

    @property
    def opt_state(self) -> Any:
        """The members' stacked optax state (a copy, as :attr:`state`)."""
        return self._owner.copy_of(1)

    active = Owned[np.ndarray](
        "Which members train, shape ``(N,)`` bool (a copy); see :meth:`freeze`.",
        change="freeze() and unfreeze() change it",
    )

    def freeze(self, members: int | Sequence[int]) -> None:
        """Stops training these members from the next compiled call on, across ``fit``
        calls and checkpoints until :meth:`unfreeze` (their losses are still logged).

        Example:
          >>> pop.freeze([0, 2]); pop.active
          array([False,  True, False,  True])
        """
        self._owner.set_active(checks.check_member_indices(members, len(self)), False)

    def unfreeze(self, members: int | Sequence[int] | None = None) -> None:
        """Lets frozen members train again (all of them by default).

        Example:
          >>> pop.unfreeze()
        """
        indices = (
            slice(None) if members is None else checks.check_member_indices(members, len(self))
        )
        self._owner.set_active(indices, True)

    def load_state(self, state: nnx.State, *, where: Any = None) -> None:
        """Replaces the members' model state (every member's, or those where the ``(N,)``
        mask ``where`` is True) with a stacked one such as an earlier :attr:`state`; their
        optax states stay.

        Example:
          >>> before = pop.state; pop.fit(data, epochs=1, batch_size=32)
          >>> pop.load_state(before)
        """
        self._owner.load(state, checks.check_where(where, len(self)))

    def member(self, index: int) -> nnx.Module:
        """A fresh ``nnx.Module`` holding member ``index``'s state (sharing no buffer with it).

        Example:
          >>> Trainer(pop.member(2), optax.adam(1e-4), loss_fn).fit(data, epochs=1, batch_size=8)
        """
        return self._owner.member(check_count(index, "index", 0, len(self) - 1))

    def best(self, metric: str | Any, mode: str = "auto") -> int:
        """The index of the best member by ``metric``: one value per member (shape
        ``(N,)``), or the name of one (a metric of the latest :meth:`evaluate`, else a log
        of the latest epoch, such as ``"loss"``). ``mode``: ``"min"``, ``"max"``, or
        ``"auto"`` (the default): read off a name as ``EarlyStopping`` reads its monitor
        (``"max"`` for accuracy-like names, ``"min"`` for loss-like ones); a name it cannot
        tell, or values given directly, need ``"min"`` or ``"max"``. NaN values never win.

        Example:
          >>> pop.evaluate(test, accuracy, batch_size=256)
          >>> pop.best("accuracy", mode="max")
          2
        """
        values, mode = checks.check_best(metric, mode, self._latest, len(self))
        return int(np.nanargmin(values) if mode == "min" else np.nanargmax(values))

    @at_the_call
    def plan_for(self, data: Any, batch_size: int, *, member_batches: bool = False) -> Plan:
        """``Trainer.plan_for``'s plan for the members (``member_batches``: as for :meth:`fit`)."""
        return self._engine.plan_for(data, batch_size, member_batches)

    @at_the_call
    def fit(
        self,
        data: Any,
        *,
        epochs: int | None = None,
        shared_order: bool = False,
        member_batches: bool = False,
        **options: Unpack[FitArguments],
    ) -> History:
        """Trains every member ``epochs`` MORE epochs on ``data``, all in the same calls.

        The options are ``Trainer.fit``'s (:class:`nnxscan.shell.FitArguments`) less
        ``seed``, plus ``shared_order`` (``True``: every member visits a data set in the
        order of ``seeds[0]``) and ``member_batches`` (``True``: every leaf has a leading
        members axis, ``(N, examples, ...)`` or a stream's ``(N, batch, ...)``, member
        ``i`` training on its own slice). Returns a :class:`History` whose ``losses`` has
        shape ``(steps, N)`` and whose per-member epoch logs are ``(N,)`` arrays (see
        docs/populations.md, "Population's arguments").

        Example:
          >>> history = pop.fit(data, epochs=3, batch_size=32)
          >>> history.epochs[-1]["loss"]      # one mean loss per member
          array([0.31, 0.29, 0.35, 0.30], dtype=float32)
        """
        run_keys = {"shared_order": bool(shared_order)}
        history = self._fit(data, epochs, options, run_keys, member_batches=member_batches)
        logs = history.epochs[-1] if history.epochs else {}
        per_member = {k: v for k, v in logs.items() if isinstance(v, np.ndarray)}
        self._latest.update({k: v for k, v in per_member.items() if k != "active"})
        return history

    def _check_evaluation_metrics(self, metrics: Any, update_metrics: Any) -> None:
        """The members carry the NNX metrics they were built with, and only those."""
        if metrics is not None or update_metrics is not None:
            raise TypeError(
                "Population.evaluate takes a metric_fn, or evaluates the NNX metrics the "
                "members were built with: Population(..., metrics=..., update_metrics=...), "
                "then pop.evaluate(data, batch_size=...)."
            )

    def _evaluated(self, values: dict[str, Any]) -> dict[str, np.ndarray]:
        """``evaluate``'s values, one per member: what :meth:`best` looks up by name."""
        values = {k: np.asarray(v, np.float32) for k, v in values.items()}
        self._latest.update(values)
        return values
