"""Population: N models of one architecture trained in one compiled program per epoch.

Each member is built by ``model_fn(nnx.Rngs(seed))`` from its own seed, shuffles the data
by its own ``epoch_order(seed, epoch, n)`` and may have its own optax hyperparameters
(``optax.inject_hyperparams``). The members' states are stacked and trained by
:func:`nnxscan.pure.vmap_members` of the same pure step ``Trainer`` compiles: that step,
vmapped over the members. Member ``i`` therefore trains what ``Trainer`` trains on that
model alone with ``seed=seeds[i]`` and that member's hyperparameters.

The population owns its stacked state (no user object is written to): ``member(i)`` hands
out a fresh, live ``nnx.Module`` holding member ``i``. Training runs on the one fit engine
``Trainer`` uses (``_engine``), with a stacked owner (``members.StackedOwner``) whose
layout (``layout.Members``) vmaps the runner over the members: plans, fused epochs,
streams, checkpoints, preemption, evaluation and progress are the Trainer's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Unpack

import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh

from nnxscan.pure import Step, init_opt_state
from nnxscan.pure.checks import (
    check_count,
    check_transform,
)
from nnxscan.shell._config import Config
from nnxscan.shell._engine.engine import Engine
from nnxscan.shell._engine.evaluation import evaluate
from nnxscan.shell._engine.layout import Members
from nnxscan.shell._engine.members import build_members
from nnxscan.shell._engine.options import FitArguments
from nnxscan.shell._engine.owner import check_rngs_and_metrics
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.plans import Plan, resolve_plan
from nnxscan.shell._engine.programs import step_program, train_program
from nnxscan.shell._front_door import FrontDoor, check_loss_options, check_policy
from nnxscan.shell._population_checks import (
    check_hyperparam_names,
    check_hyperparams,
    check_seeds,
    check_user_step,
)
from nnxscan.shell.history import History

__all__ = ["Population"]

_MODES = ("min", "max")


def _init_optax(tx: Any, wrt: Any, graphdef: nnx.GraphDef, state: Any) -> Any:
    """The built-in step's opt_state of one member: ``tx``'s state of its ``wrt`` part."""
    return init_opt_state(tx, state, wrt)


class Population(FrontDoor):
    """N models of one architecture, trained together in one compiled call per epoch.

    Args:
      model_fn: ``model_fn(rngs) -> nnx.Module`` builds one member from ``nnx.Rngs(seed)``.
        Every member must come out with the same structure and shapes.
      tx: the optax transform of every member. For per-member hyperparameters, make it
        with ``optax.inject_hyperparams`` (e.g.
        ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``).
      loss_fn: ``loss_fn(model, batch)``, a scalar (or ``(loss, aux)`` with ``has_aux``;
        ``loss_fn(model, batch, rngs)`` with ``rngs``).
      seeds: one non-negative int per member: its initialization (``nnx.Rngs(seed)``) and
        its shuffle (``epoch_order(seed, epoch, n)``, the rule of ``Trainer.fit``).
      train_step: your own step, a :class:`nnxscan.pure.Step`, in place of ``tx`` and
        ``loss_fn``: member ``i``'s opt_state is ``train_step.init(graphdef, state_i)``
        on its own split, and every member trains with ``train_step.update``, vmapped.
        The options of the built-in step (``tx``, ``loss_fn``, ``wrt``, ``has_aux``,
        ``accumulate``, ``rngs``, ``metrics``, ``update_metrics``) then raise a
        ``TypeError``; so does a stateful NNX function (a population builds its members
        and has no optimizer object to hand it: write it as a ``Step``).
      hyperparams: ``{name: [one value per member]}`` for names the injected ``tx`` holds
        (``learning_rate``, ``b1``...); each member's optax state starts with its values.
        With ``train_step``: names that the hyperparameter states in
        ``train_step.init``'s opt_state hold (``optax.inject_hyperparams``' own, or any
        NamedTuple with a ``hyperparams`` dict) (set in each such state holding the name;
        ``update`` reads them from there).
      wrt, has_aux, execution, accumulate: as for ``Trainer`` (``"auto"``: one call per
        epoch, CNNs on the CPU too).
      on_nonfinite: as for ``Trainer``, per member: ``"skip"`` leaves a member unchanged
        on its steps with a non-finite loss or gradient (the other members train on);
        ``"stop"`` freezes a member at the state before its first such step, warns, and
        the others go on.
      mesh, member_axis, data_axis: train on ``mesh`` (else the mesh ``jax.set_mesh``
        put in context): the members spread over ``member_axis`` when the mesh has it (N
        must divide by its size), each member's batches over ``data_axis`` (a name or a
        tuple, by default ``"data"`` when the mesh has it), and each member sharded over
        the other axes as ``Trainer`` shards one model. ``model_fn`` runs with that mesh
        in context, so layers annotated with ``nnx.with_partitioning`` are built sharded
        without a ``jax.set_mesh`` around the Population (logical names: build it inside
        ``nnx.logical_axis_rules(...)``).
      fsdp_min_size, shardings: as for ``Trainer``, for each member's own dimensions.
      rngs: call-time Rngs for ``loss_fn(model, batch, rngs)``: an ``nnx.Rngs`` every member
        starts from (the same dropout streams), or ``rngs(seed) -> nnx.Rngs`` for each
        member's own (member ``i`` then gets ``rngs(seeds[i])``).
      metrics, update_metrics: NNX metrics (an ``nnx.Metric`` / ``nnx.MultiMetric``) each
        member carries and updates inside the compiled step, as ``Trainer``'s: the epoch
        logs gain ``train_<name>`` with one value per member; ``evaluate`` and fit's
        evaluation use them when no ``metric_fn`` is given.

    Member ``i`` trains what ``Trainer(model_fn(nnx.Rngs(seeds[i])), tx_i, loss_fn).fit(
    data, epochs=..., batch_size=..., seed=seeds[i])`` trains, where ``tx_i`` is ``tx``
    with member ``i``'s hyperparameters (equal up to float rounding: the vmapped step may
    sum in another order).

    With ``train_step=S``, member ``i`` trains what ``Trainer(model_fn(nnx.Rngs(
    seeds[i])), train_step=S).fit(data, ..., seed=seeds[i])`` trains.

    Example:
      >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
      >>> pop = Population(lambda rngs: MLP(rngs=rngs), tx, loss_fn, seeds=[0, 1, 2, 3],
      ...                  hyperparams={"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2]})
      >>> history = pop.fit(data, epochs=5, batch_size=32)
      >>> history.losses.shape        # (steps, members)
      (160, 4)
      >>> scores = pop.evaluate(test, accuracy, batch_size=256)["accuracy"]
      >>> best_model = pop.member(pop.best(scores, mode="max"))
      >>> pop = Population(MLP, train_step=my_step, seeds=[0, 1, 2])  # your own Step
    """

    def __init__(
        self,
        model_fn: Callable[[nnx.Rngs], nnx.Module],
        tx: optax.GradientTransformation | None = None,
        loss_fn: Callable[..., Any] | None = None,
        *,
        seeds: Sequence[int],
        train_step: Step | None = None,
        hyperparams: Mapping[str, Sequence[Any]] | None = None,
        wrt: nnx.filterlib.Filter = nnx.Param,
        has_aux: bool = False,
        execution: str | Plan = "auto",
        on_nonfinite: str = "ignore",
        accumulate: int = 1,
        mesh: Mesh | None = None,
        member_axis: str = "members",
        data_axis: str | tuple[str, ...] | None = None,
        fsdp_min_size: int | None = None,
        shardings: Mapping[str, Any] | None = None,
        rngs: nnx.Rngs | Callable[[int], nnx.Rngs] | None = None,
        metrics: nnx.Metric | None = None,
        update_metrics: Callable[[Any, Any, Any, Any], Any] | None = None,
    ):
        # Every check runs before anything is built or compiled.
        if not callable(model_fn):
            raise TypeError(
                f"model_fn must be callable as model_fn(rngs) -> nnx.Module, got "
                f"{type(model_fn).__name__}."
            )
        if train_step is not None:
            options = dict(
                tx=tx is not None, loss_fn=loss_fn is not None, wrt=wrt is not nnx.Param,
                has_aux=bool(has_aux), accumulate=accumulate != 1, rngs=rngs is not None,
                metrics=metrics is not None, update_metrics=update_metrics is not None,
            )  # fmt: skip
            train_step = check_user_step(train_step, [k for k, v in options.items() if v])
            wrt = None
        else:
            if tx is None or loss_fn is None:
                raise TypeError(
                    "Population needs an optax transform and a loss, Population(model_fn, "
                    "optax.adam(1e-3), loss_fn, seeds=[...]), or your own step: "
                    "Population(model_fn, train_step=step, seeds=[...]) with a "
                    "nnxscan.pure.Step."
                )
            tx = check_transform(tx)
            accumulate = check_loss_options(
                loss_fn, accumulate=accumulate, metrics=metrics, update_metrics=update_metrics
            )
        seeds = check_seeds(seeds)
        hyperparams = check_hyperparams(hyperparams, len(seeds))
        check_policy(on_nonfinite)
        if rngs is not None and not (isinstance(rngs, nnx.Rngs) or callable(rngs)):
            raise TypeError(
                f"rngs must be an nnx.Rngs or a function seed -> nnx.Rngs, got "
                f"{type(rngs).__name__}."
            )
        check_rngs_and_metrics(None, metrics)
        explicit_plan = resolve_plan(execution)
        placement = Placement(
            mesh, data_axis, fsdp_min_size, member_axis, rules=shardings, tx=tx, wrt=wrt,
            layout=Members(len(seeds)),
        )  # fmt: skip
        if train_step is not None:
            init_opt = train_step.init
            program = step_program(train_step, on_nonfinite)
        else:
            init_opt = functools.partial(_init_optax, tx, wrt)
            program = train_program(
                loss_fn, tx, wrt, bool(has_aux), on_nonfinite, accumulate, rngs is not None,
                update_metrics,
            )  # fmt: skip
        self._config = dict(
            model_fn=model_fn, tx=tx, loss_fn=loss_fn, wrt=wrt, has_aux=program.has_aux,
            on_nonfinite=on_nonfinite, accumulate=accumulate, update_metrics=update_metrics,
            seeds=seeds, hyperparams={k: list(v) for k, v in hyperparams.items()},
            train_step=train_step,
        )  # fmt: skip
        # Members are built on the mesh they train on (mesh=, else the context's): a layer
        # annotated with with_partitioning is sharded as it is created, which needs the
        # mesh in context, so no jax.set_mesh is needed around the Population.
        with placement.bound().context():
            check_hyperparam_names(
                model_fn, init_opt, seeds[0], hyperparams, step=train_step is not None
            )
            self._owner = build_members(
                model_fn, init_opt, seeds, hyperparams, rngs=rngs, metrics=metrics
            )
        self._engine = Engine(
            program=program, owner=self._owner, placement=placement,
            explicit_plan=explicit_plan, subject=self,
            loss_fn=loss_fn, has_aux=program.has_aux, update_metrics=update_metrics,
            rngs=rngs,
        )  # fmt: skip
        #: Set by a callback (``EarlyStopping``) to end ``fit`` after the current call.
        self.stop_training = False
        # The latest values best(name) can look up: evaluate's results, the last epoch's logs.
        self._latest: dict[str, np.ndarray] = {}

    # -- configuration (read-only: the compiled program is built from it) -----------------

    def __len__(self) -> int:
        return self.num_members

    seeds = Config("Each member's seed (its initialization and its shuffle).")
    model_fn = Config("``model_fn(rngs) -> nnx.Module``, which built every member.")
    tx = Config("The optax transform of every member (None with ``train_step``).")
    loss_fn = Config("The loss the compiled step was built from (None with ``train_step``).")
    wrt = Config("The filter of the trained variables (None with ``train_step``).")
    has_aux = Config("Whether the step reports ``(loss, aux)``.")
    train_step = Config(
        "The user's ``nnxscan.pure.Step`` every member trains with, or None for the step "
        "built from ``loss_fn`` and ``tx``."
    )
    on_nonfinite = Config('The non-finite policy: ``"ignore"``, ``"skip"`` or ``"stop"``.')
    accumulate = Config("Micro-batches per step (1: none).")
    update_metrics = Config("The NNX metrics update run inside the step, when given.")

    @property
    def hyperparams(self) -> dict[str, list]:
        """The per-member hyperparameters the population was built with (a copy)."""
        return {k: list(v) for k, v in self._config["hyperparams"].items()}

    @property
    def metrics(self) -> nnx.Metric | None:
        """The NNX metrics template every member carries, when given."""
        return self._owner.metrics

    # -- what the population holds --------------------------------------------------------

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The ``nnx.GraphDef`` of one member's model (what :attr:`state` merges with)."""
        return self._owner.model_graphdef

    @property
    def state(self) -> nnx.State:
        """The members' stacked model ``nnx.State`` (leading axis: members), as a copy:
        later ``fit`` calls (which donate the population's own buffers) leave it intact."""
        return self._owner.model_state()

    @property
    def opt_state(self) -> Any:
        """The members' stacked optax state (a copy, as :attr:`state`)."""
        return self._owner.copy_of(1)

    @property
    def active(self) -> np.ndarray:
        """Which members train, shape ``(N,)`` bool (a copy); see :meth:`freeze`."""
        return self._owner.active.copy()

    def freeze(self, members: int | Sequence[int]) -> None:
        """Stops training these members: from the next compiled call on, their state and
        optax state stay exactly as they are (inside the call: the other members train on).
        Their losses are still computed and logged, at the frozen state. ``EarlyStopping``
        freezes each member whose patience runs out. Frozen members stay frozen across
        ``fit`` calls and checkpoints until :meth:`unfreeze`.

        Example:
          >>> pop.freeze([0, 2])
          >>> pop.active
          array([False,  True, False,  True])
        """
        self._owner.active[self._indices(members)] = False

    def unfreeze(self, members: int | Sequence[int] | None = None) -> None:
        """Lets frozen members train again (all of them by default).

        Example:
          >>> pop.unfreeze()
        """
        if members is None:
            self._owner.active[:] = True
            return
        self._owner.active[self._indices(members)] = True

    def _indices(self, members: int | Sequence[int]) -> list[int]:
        indices = [members] if isinstance(members, int | np.integer) else list(members)
        return [check_count(i, "member index", 0, len(self) - 1) for i in indices]

    def load_state(self, state: nnx.State, *, where: Any = None) -> None:
        """Replaces the members' model state with a stacked ``state`` of the same
        structure (e.g. an earlier :attr:`state`): every member's, or only those where
        the ``(N,)`` bool mask ``where`` is True. The optax states stay.

        Example:
          >>> before = pop.state
          >>> pop.fit(data, epochs=1, batch_size=32)
          >>> pop.load_state(before)
        """
        if where is not None and np.shape(where) != (len(self),):
            raise ValueError(
                f"where must be one bool per member, shape ({len(self)},); got shape "
                f"{np.shape(where)}."
            )
        self._owner.load(state, where)

    def member(self, index: int) -> nnx.Module:
        """A fresh, live ``nnx.Module`` holding member ``index``'s trained state.

        It shares nothing with the population: train it further with a ``Trainer``, or
        change it, and the population stays as it was.

        Example:
          >>> model = pop.member(2)
          >>> Trainer(model, optax.adam(1e-4), loss_fn).fit(data, epochs=1, batch_size=32)
        """
        return self._owner.member(check_count(index, "index", 0, len(self) - 1))

    def best(self, metric: str | Any, mode: str = "min") -> int:
        """The index of the best member by ``metric``.

        Args:
          metric: one value per member (an array of shape ``(N,)``, e.g. an entry of
            :meth:`evaluate`'s result), or the name of one: a metric of the latest
            :meth:`evaluate`, else a log of the latest epoch (``"loss"``).
          mode: ``"min"`` or ``"max"``. NaN values never win.

        Example:
          >>> pop.evaluate(test, accuracy, batch_size=256)
          >>> pop.best("accuracy", mode="max")
          2
        """
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}; use 'min' or 'max'.")
        if isinstance(metric, str):
            if metric not in self._latest:
                raise ValueError(
                    f"no values named {metric!r} yet; known: {sorted(self._latest) or 'none'} "
                    f"(from the latest evaluate() and the latest epoch's logs). Pass the "
                    f"values themselves, or run evaluate(...) first."
                )
            metric = self._latest[metric]
        values = np.asarray(metric, np.float64)
        if values.shape != (len(self),):
            raise ValueError(
                f"best needs one value per member, shape ({len(self)},); got shape {values.shape}."
            )
        if np.isnan(values).all():
            raise ValueError("every member's value is NaN: there is no best member.")
        return int(np.nanargmin(values) if mode == "min" else np.nanargmax(values))

    def plan_for(self, data: Any, batch_size: int, *, member_batches: bool = False) -> Plan:
        """The execution plan ``fit`` uses for this data and batch size (traces one
        member's step, compiles nothing), as ``Trainer.plan_for``.

        Example:
          >>> pop.plan_for({"x": x, "y": y}, 32)
          Plan(kind='scan', steps_per_call=None)
        """
        return self._engine.plan_for(data, batch_size, member_batches)

    # -- training -------------------------------------------------------------------------

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

        The options are ``Trainer.fit``'s (:class:`nnxscan.shell.FitArguments`), less
        ``seed`` (each member's seed was given to the population), plus:

        Args:
          data: a data set of arrays shared by every member, or a stream of batches (a
            list, a re-iterable, a zero-argument callable returning a fresh iterator per
            epoch), as for ``Trainer.fit``.
          shared_order: a data set's order. ``False``: member ``i`` visits the examples in
            the order ``epoch_order(seeds[i], epoch, n)``; ``True``: every member uses
            ``epoch_order(seeds[0], epoch, n)``.
          member_batches: ``False`` (default): every member trains on the same data.
            ``True``: every leaf has a leading members axis: ``(N, examples, ...)`` for a
            data set (member ``i`` trains on ``data[i]``), ``(N, batch, ...)`` for each
            batch of a stream (member ``i`` trains on ``batch[i]``).
          callbacks: called with the population as their first argument and per-member
            logs; ``EarlyStopping`` freezes each member whose own patience runs out and
            ends ``fit`` when none is left training.
          progress: a progress bar in a terminal (the members' median loss and range), one
            line per epoch in a log.

        Returns:
          A :class:`History` whose ``losses`` has shape ``(steps, N)`` and whose epoch
          logs hold numpy arrays of shape ``(N,)`` (``loss``, the means of scalar aux
          leaves, ``learning_rate`` with an injected ``tx``, ``train_*`` and ``eval_*``,
          ``active``, and ``skipped_steps`` under ``on_nonfinite="skip"``) next to the
          shared ``epoch``, ``steps``, ``steps_per_sec`` and ``wall_time``.
          ``History.plot`` draws one curve per member.

        Example:
          >>> history = pop.fit(data, epochs=3, batch_size=32)
          >>> history.epochs[-1]["loss"]      # one mean loss per member
          array([0.31, 0.29, 0.35, 0.30], dtype=float32)
        """
        if options.get("eval_data") is not None and options.get("metric_fn") is None:
            self._needs_metric_fn("evaluation during fit")
        run_keys = {"shared_order": bool(shared_order)}
        history = self._fit(data, epochs, options, run_keys, member_batches=member_batches)
        if history.epochs:
            logs = history.epochs[-1]
            self._latest.update(
                {k: v for k, v in logs.items() if isinstance(v, np.ndarray) and k != "active"}
            )
        return history

    # -- evaluation -----------------------------------------------------------------------

    def evaluate(
        self,
        data: Any,
        metric_fn: Callable[[nnx.Module, Any], Any] | None = None,
        *,
        batch_size: int,
        eval_mode: bool = True,
    ) -> dict[str, np.ndarray]:
        """Evaluates every member over EVERY example of ``data``: ``{name: values (N,)}``.

        ``metric_fn(model, batch)`` returns a metric or a dict of them, each the mean over
        the batch, as for ``Trainer.evaluate``; without one, the population's NNX metrics
        fed by its loss. The members run vmapped in one compiled call. Nothing in the
        population changes.

        Example:
          >>> pop.evaluate(test, accuracy, batch_size=256)
          {'accuracy': array([0.95, 0.97, 0.96, 0.91], dtype=float32)}
        """
        if metric_fn is None:
            self._needs_metric_fn("evaluate")
        values = evaluate(self._engine, data, metric_fn, batch_size=batch_size, eval_mode=eval_mode)
        values = {k: np.asarray(v, np.float32) for k, v in values.items()}
        self._latest.update(values)
        return values

    def _needs_metric_fn(self, what: str) -> None:
        """A population of a user's step has no NNX metrics fed by a loss: only a metric_fn."""
        if self.train_step is not None:
            raise ValueError(
                f"{what} of a Population(train_step=...) needs a metric_fn(model, batch): "
                f"its step computes its loss itself, so there is no loss_fn to feed NNX "
                f"metrics with."
            )
