"""Population: N models of one architecture trained in one compiled program per epoch.

Each member is built by ``model_fn(nnx.Rngs(seed))`` from its own seed, shuffles the data
by its own ``epoch_order(seed, epoch, n)`` and may have its own optax hyperparameters
(``optax.inject_hyperparams``). The members' states are stacked and trained by
:func:`nnxscan.pure.make_population_epoch`: the same pure step ``Trainer`` compiles,
vmapped over the members. Member ``i`` therefore trains what ``Trainer`` trains on that
model alone with ``seed=seeds[i]`` and that member's hyperparameters.

The population owns its stacked state (no user object is written to): ``member(i)`` hands
out a fresh, live ``nnx.Module`` holding member ``i``.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from rich.console import Console

from nnxscan.pure import init_opt_state
from nnxscan.pure._checks import (
    check_batch_size,
    check_count,
    check_leading_size,
    check_no_captured_nnx,
    check_transform,
)
from nnxscan.pure.population import injected_values, stack_states, with_hyperparams
from nnxscan.shell import _checkpointing
from nnxscan.shell import _population_checkpoints as _checkpoints
from nnxscan.shell._fit import CallbackList, Checkpoints, Evaluation
from nnxscan.shell._members import Members
from nnxscan.shell._placement import Placement, to_host
from nnxscan.shell._plans import Plan, choose_plan, resolve_plan
from nnxscan.shell._population_checks import (
    call_model_fn,
    check_hyperparam_names,
    check_hyperparams,
    check_seeds,
    mesh_axes,
)
from nnxscan.shell._population_fit import (
    PopulationEpochs,
    PopulationFit,
    history_from_run,
    order_seeds,
)
from nnxscan.shell._programs import population_evaluator, population_runner, train_program
from nnxscan.shell.history import History

__all__ = ["Population"]

_MODES = ("min", "max")
_NONFINITE_POLICIES = ("ignore", "skip", "stop")


class Population:
    """N models of one architecture, trained together in one compiled call per epoch.

    Args:
      model_fn: ``model_fn(rngs) -> nnx.Module`` builds one member from ``nnx.Rngs(seed)``.
        Every member must come out with the same structure and shapes.
      tx: the optax transform of every member. For per-member hyperparameters, make it
        with ``optax.inject_hyperparams`` (e.g.
        ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``).
      loss_fn: ``loss_fn(model, batch)``, a scalar (or ``(loss, aux)`` with ``has_aux``).
      seeds: one non-negative int per member: its initialization (``nnx.Rngs(seed)``) and
        its shuffle (``epoch_order(seed, epoch, n)``, the rule of ``Trainer.fit``).
      hyperparams: ``{name: [one value per member]}`` for names the injected ``tx`` holds
        (``learning_rate``, ``b1``...); each member's optax state starts with its values.
      wrt, has_aux, execution: as for ``Trainer`` (``"auto"``: one call per epoch).
      on_nonfinite: as for ``Trainer``, per member: ``"skip"`` leaves a member unchanged
        on its steps with a non-finite loss or gradient (the other members train on);
        ``"stop"`` freezes a member at the state before its first such step, warns, and
        the others go on.
      mesh, member_axis, data_axis: spread the members over the mesh axis ``member_axis``
        (N must divide by its size) and split each member's batches over ``data_axis``
        (data parallelism); a mesh may have either axis or both.

    Member ``i`` trains what ``Trainer(model_fn(nnx.Rngs(seeds[i])), tx_i, loss_fn).fit(
    data, epochs=..., batch_size=..., seed=seeds[i])`` trains, where ``tx_i`` is ``tx``
    with member ``i``'s hyperparameters (equal up to float rounding: the vmapped step may
    sum in another order).

    Example:
      >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
      >>> pop = Population(lambda rngs: MLP(rngs=rngs), tx, loss_fn, seeds=[0, 1, 2, 3],
      ...                  hyperparams={"learning_rate": [1e-3, 3e-3, 1e-2, 3e-2]})
      >>> history = pop.fit(data, epochs=5, batch_size=32)
      >>> history.losses.shape        # (steps, members)
      (160, 4)
      >>> scores = pop.evaluate(test, accuracy, batch_size=256)["accuracy"]
      >>> best_model = pop.member(pop.best(scores, mode="max"))
    """

    def __init__(
        self,
        model_fn: Callable[[nnx.Rngs], nnx.Module],
        tx: optax.GradientTransformation,
        loss_fn: Callable[..., Any],
        *,
        seeds: Sequence[int],
        hyperparams: Mapping[str, Sequence[Any]] | None = None,
        wrt: nnx.filterlib.Filter = nnx.Param,
        has_aux: bool = False,
        execution: str | Plan = "auto",
        on_nonfinite: str = "ignore",
        mesh: Mesh | None = None,
        member_axis: str = "members",
        data_axis: str = "data",
    ):
        # Every check runs before anything is built or compiled.
        if not callable(model_fn):
            raise TypeError(
                f"model_fn must be callable as model_fn(rngs) -> nnx.Module, got "
                f"{type(model_fn).__name__}."
            )
        tx = check_transform(tx)
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}.")
        check_no_captured_nnx(loss_fn, "loss_fn")
        seeds = check_seeds(seeds)
        hyperparams = check_hyperparams(hyperparams, len(seeds))
        if on_nonfinite not in _NONFINITE_POLICIES:
            raise ValueError(
                f"on_nonfinite={on_nonfinite!r}; use one of {', '.join(_NONFINITE_POLICIES)}."
            )
        self._explicit_plan = resolve_plan(execution)
        member_axis, data_axis = mesh_axes(mesh, member_axis, data_axis, len(seeds))
        check_hyperparam_names(model_fn, tx, wrt, seeds[0], hyperparams)

        self.model_fn, self.tx, self.loss_fn = model_fn, tx, loss_fn
        self.wrt, self.has_aux, self.on_nonfinite = wrt, bool(has_aux), on_nonfinite
        self.seeds = seeds
        self.hyperparams = {k: list(v) for k, v in hyperparams.items()}
        self._program = train_program(loss_fn, tx, wrt, self.has_aux, on_nonfinite)
        graphdef, state, opt_state = self._build_members()
        placement = Placement(mesh, data_axis, member_axis=member_axis)
        self._members = Members(graphdef, state, opt_state, placement)
        #: Set by a callback (``EarlyStopping``) to end ``fit`` after the current epoch.
        self.stop_training = False
        # The latest values best(name) can look up: evaluate's results, the last epoch's logs.
        self._latest: dict[str, np.ndarray] = {}

    def _build_members(self) -> tuple[nnx.GraphDef, nnx.State, Any]:
        graphdef, states, opt_states = None, [], []
        for i, seed in enumerate(self.seeds):
            member_graphdef, state = nnx.split(call_model_fn(self.model_fn, seed))
            if graphdef is None:
                graphdef = member_graphdef
            elif member_graphdef != graphdef:
                raise ValueError(
                    f"model_fn built member {i} (seed {seed}) with a different structure "
                    f"from member 0 (seed {self.seeds[0]}): every member must be the same "
                    f"architecture; only the seed may change."
                )
            opt_state = init_opt_state(self.tx, state, self.wrt)
            values = {name: v[i] for name, v in self.hyperparams.items()}
            states.append(state)
            opt_states.append(with_hyperparams(opt_state, **values) if values else opt_state)
        return graphdef, stack_states(states), stack_states(opt_states)

    # -- what the population holds --------------------------------------------------------

    def __len__(self) -> int:
        return len(self.seeds)

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The members' shared ``nnx.GraphDef``."""
        return self._members.graphdef

    @property
    def state(self) -> nnx.State:
        """The members' stacked ``nnx.State`` (leading axis: members), as a copy: later
        ``fit`` calls (which donate the population's own buffers) leave it intact."""
        return self._members.copy_of(0)

    @property
    def opt_state(self) -> Any:
        """The members' stacked optax state (a copy, as :attr:`state`)."""
        return self._members.copy_of(1)

    @property
    def epoch(self) -> int:
        """The global index of the next epoch ``fit`` trains (epochs completed so far)."""
        return self._members.epoch

    @property
    def step(self) -> int:
        """Steps each member has trained so far (a frozen member's steps count too)."""
        return self._members.step

    @property
    def active(self) -> np.ndarray:
        """Which members train, shape ``(N,)`` bool (a copy); see :meth:`freeze`."""
        return self._members.active.copy()

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
        indices = [members] if isinstance(members, int | np.integer) else list(members)
        checked = [check_count(i, "member index", 0, len(self) - 1) for i in indices]
        self._members.active[checked] = False

    def unfreeze(self, members: int | Sequence[int] | None = None) -> None:
        """Lets frozen members train again (all of them by default).

        Example:
          >>> pop.unfreeze()
        """
        if members is None:
            self._members.active[:] = True
            return
        indices = [members] if isinstance(members, int | np.integer) else list(members)
        checked = [check_count(i, "member index", 0, len(self) - 1) for i in indices]
        self._members.active[checked] = True

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
        self._members.load_state(state, where)

    def member(self, index: int) -> nnx.Module:
        """A fresh, live ``nnx.Module`` holding member ``index``'s trained state.

        It shares nothing with the population: train it further with a ``Trainer``, or
        change it, and the population stays as it was.

        Example:
          >>> model = pop.member(2)
          >>> Trainer(model, optax.adam(1e-4), loss_fn).fit(data, epochs=1, batch_size=32)
        """
        index = check_count(index, "index", 0, len(self) - 1)
        return nnx.merge(self.graphdef, self._members.member(index))

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

    # -- training -------------------------------------------------------------------------

    def fit(
        self,
        data: Any,
        *,
        epochs: int,
        batch_size: int,
        shared_order: bool = False,
        drop_remainder: bool = True,
        callbacks: Sequence[Any] = (),
        eval_data: Any = None,
        metric_fn: Callable[[nnx.Module, Any], Any] | None = None,
        eval_every: int = 1,
        eval_batch_size: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 1,
        resume: bool = False,
        progress: bool = False,
    ) -> History:
        """Trains every member ``epochs`` MORE epochs on ``data``, all in the same calls.

        Args:
          data: a pytree of arrays sharing a leading examples axis, shared by all members.
          epochs: epochs to train (0 trains nothing).
          batch_size: examples per step, for every member.
          shared_order: ``False``: member ``i`` visits the examples in the order
            ``epoch_order(seeds[i], epoch, n)``; ``True``: every member uses
            ``epoch_order(seeds[0], epoch, n)``.
          drop_remainder: as for ``Trainer.fit`` (``False`` trains a final short batch).
          callbacks: as for ``Trainer.fit``, called with the population as their first
            argument and per-member logs. ``EarlyStopping`` freezes each member whose own
            patience runs out and ends ``fit`` when all are frozen; setting
            ``population.stop_training = True`` ends it after the current epoch.
          eval_data, metric_fn, eval_every, eval_batch_size: every ``eval_every`` epochs,
            :meth:`evaluate` and log each metric as ``eval_<name>`` (shape ``(N,)``).
          checkpoint_dir, checkpoint_every: save (:meth:`save`) every ``checkpoint_every``
            epochs by the global epoch index.
          resume: with a ``checkpoint_dir``, ``epochs`` counts the WHOLE run: restore the
            latest checkpoint there (the History so far included), if any, and train what
            remains.
          progress: print one line per epoch (the members' lowest, median, highest loss).

        Returns:
          A :class:`History` whose ``losses`` has shape ``(steps, N)`` and whose epoch
          logs hold numpy arrays of shape ``(N,)`` (``loss``, the means of scalar aux
          leaves, ``learning_rate`` with an injected ``tx``, ``eval_*``, ``active``, and
          ``skipped_steps`` under ``on_nonfinite="skip"``) next to the shared ``epoch``,
          ``steps``, ``steps_per_sec`` and ``wall_time``. ``History.plot`` draws one curve
          per member.

        Example:
          >>> history = pop.fit(data, epochs=3, batch_size=32)
          >>> history.epochs[-1]["loss"]      # one mean loss per member
          array([0.31, 0.29, 0.35, 0.30], dtype=float32)
        """
        epochs = check_count(epochs, "epochs", 0)
        n = check_leading_size(data, "data")
        batch_size = check_batch_size(batch_size, n, drop_remainder=True)
        members = self._members
        members.placement.check_batch_size(batch_size)
        if not drop_remainder and n % batch_size:
            members.placement.check_batch_size(n % batch_size)  # the short final batch
        evaluation = self._evaluation(eval_data, metric_fn, eval_every, eval_batch_size, batch_size)
        checkpoints = self._checkpoints(checkpoint_dir, checkpoint_every, resume, shared_order)
        history = History(losses=np.zeros((0, len(self)), np.float32))
        placed = members.placement.put_data(data, members.leaves)
        plan, donate = self._plan(placed, batch_size)  # traces the step: bad data raises here
        if resume and _checkpointing.latest_step(checkpoint_dir) is not None:
            # The last thing that may change the population before training.
            self._restore(checkpoint_dir, None, shared_order)
            history = history_from_run(_checkpointing.parse_run(members.restored_run), len(self))
            epochs = max(0, epochs - self.epoch)
        if epochs == 0:
            return history
        data = placed
        run = population_runner(
            self._program, self.graphdef, members.carry_def, donate=donate,
            member_axis=members.placement.member_axis,
            batch_sharding=members.placement.batch_sharding,
            carry_shardings=members.placement.carry_shardings(members.leaves),
        )  # fmt: skip
        spec = PopulationEpochs(
            data, n, batch_size, bool(drop_remainder), order_seeds(self.seeds, shared_order),
            plan, self.has_aux, self.on_nonfinite == "skip", self.on_nonfinite == "stop",
        )  # fmt: skip
        loop = PopulationFit(
            members, run, spec, CallbackList(callbacks, self), evaluation, checkpoints,
            _stacked_learning_rate, Console() if progress else None,
        )  # fmt: skip
        history = loop.train(history, epochs)
        if history.epochs:
            logs = history.epochs[-1]
            self._latest.update(
                {k: v for k, v in logs.items() if isinstance(v, np.ndarray) and k != "active"}
            )
        return history

    def _plan(self, data: Any, batch_size: int) -> tuple[Plan, bool]:
        """The execution plan (``"auto"``: the Trainer's rule on one member's step) and
        whether the carry may be donated (not with host callbacks in the step)."""
        # Shapes only: slicing the arrays would compile a slice per leaf shape.
        member = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
        state, opt_state = jax.tree.map(member, self._members.carry())
        batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((batch_size, *x.shape[1:]), x.dtype), data
        )
        traits = self._program.traits(self.graphdef, state, opt_state, batch)
        plan = self._explicit_plan or choose_plan(traits, jax.default_backend())
        return plan, not traits.has_callback

    def _evaluation(self, data, metric_fn, every, eval_batch_size, batch_size) -> Evaluation | None:
        if data is None and metric_fn is None:
            return None
        if data is None or metric_fn is None:
            raise ValueError("evaluation during fit needs both eval_data and a metric_fn.")
        if not callable(metric_fn):
            raise TypeError(f"metric_fn must be callable, got {type(metric_fn).__name__}.")
        n = check_leading_size(data, "eval_data")
        every = check_count(every, "eval_every", 1)
        size = check_count(eval_batch_size or batch_size, "eval_batch_size", 1)
        size = check_batch_size(min(size, n), n, drop_remainder=False)
        return Evaluation(every, lambda: self.evaluate(data, metric_fn, batch_size=size))

    def _checkpoints(self, directory, every, resume, shared_order) -> Checkpoints | None:
        every = check_count(every, "checkpoint_every", 1)
        if directory is None:
            if resume:
                raise ValueError("resume=True needs a checkpoint_dir to resume from.")
            return None

        def save(history: History, partial: np.ndarray) -> None:
            run = _checkpointing.run_json(history, partial)
            self._save(directory, run=run, shared_order=shared_order)

        return Checkpoints(every, None, save)

    # -- checkpoints ----------------------------------------------------------------------

    def save(self, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> pathlib.Path:
        """Saves the whole population (every member's state and optax state, the counters,
        the seeds and which members are frozen) as checkpoint number :attr:`step`.

        Example:
          >>> pop.save("runs/sweep")
          PosixPath('.../runs/sweep/220')
        """
        return self._save(directory, max_to_keep=max_to_keep)

    def _save(
        self, directory: Any, *, max_to_keep: int = 3, run: str = "", shared_order: bool = False
    ) -> pathlib.Path:
        return _checkpoints.save(
            self._members, directory, self.seeds, run=run, shared_order=shared_order,
            max_to_keep=max_to_keep,
        )  # fmt: skip

    def restore(self, directory: str | os.PathLike[str], *, step: int | None = None) -> int:
        """Restores a checkpoint of :meth:`save` (the latest, or ``step``) into this
        population, which must have the same members (seeds) and architecture; returns
        the epoch it resumes at. Everything is read and checked before anything changes.

        Example:
          >>> pop = Population(model_fn, tx, loss_fn, seeds=seeds)
          >>> pop.restore("runs/sweep")
          10
        """
        return self._restore(directory, step, None)

    def _restore(self, directory: Any, step: int | None, shared_order: bool | None) -> int:
        return _checkpoints.restore(
            self._members, directory, step, self.seeds, self.hyperparams, shared_order
        )

    # -- evaluation -----------------------------------------------------------------------

    def evaluate(
        self,
        data: Any,
        metric_fn: Callable[[nnx.Module, Any], Any],
        *,
        batch_size: int,
        eval_mode: bool = True,
    ) -> dict[str, np.ndarray]:
        """Evaluates every member over EVERY example of ``data``: ``{name: values (N,)}``.

        ``metric_fn(model, batch)`` returns a scalar (reported under its function name) or
        a dict of scalars, each the mean over the batch, as for ``Trainer.evaluate``; the
        members run vmapped in one compiled call. Nothing in the population changes.

        Example:
          >>> pop.evaluate(test, accuracy, batch_size=256)
          {'accuracy': array([0.95, 0.97, 0.96, 0.91], dtype=float32)}
        """
        if not callable(metric_fn):
            raise TypeError(f"metric_fn must be callable, got {type(metric_fn).__name__}.")
        n = check_leading_size(data, "data")
        batch_size = check_batch_size(batch_size, n, drop_remainder=False)
        run = population_evaluator(metric_fn, batch_size, bool(eval_mode))
        members = self._members
        data = members.placement.put_data(data, members.leaves)
        values = to_host(run(self.graphdef, members.carry()[0], data))
        values = {k: np.asarray(v, np.float32) for k, v in values.items()}
        self._latest.update(values)
        return values


def _stacked_learning_rate(opt_state: Any) -> Any:
    """The members' learning rates, shape ``(N,)``, when ``tx`` came from
    ``optax.inject_hyperparams``; else None."""
    return injected_values(opt_state, "learning_rate")
