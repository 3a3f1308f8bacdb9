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

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from rich.console import Console

from nnxscan.pure import epoch_order, init_opt_state
from nnxscan.pure._checks import (
    check_batch_size,
    check_count,
    check_leading_size,
    check_no_captured_nnx,
    check_transform,
)
from nnxscan.pure.population import (
    hyperparam_names,
    member_state,
    stack_states,
    with_hyperparams,
)
from nnxscan.shell._calls import held_interrupts
from nnxscan.shell._epochs import _RESERVED_LOGS
from nnxscan.shell._placement import Placement, to_host
from nnxscan.shell._programs import population_evaluator, population_runner, train_program
from nnxscan.shell.history import History

__all__ = ["Population"]

_MAX_SEED = 2**31 - 1  # as Trainer: the seed enters numpy's generator as an int32
_MODES = ("min", "max")


def _check_seeds(seeds: Any) -> tuple[int, ...]:
    if isinstance(seeds, str | bytes) or not isinstance(seeds, Sequence | np.ndarray):
        raise TypeError(
            f"seeds must be a list of ints, one per member (e.g. seeds=[0, 1, 2, 3]); got "
            f"{type(seeds).__name__} {seeds!r}."
        )
    if len(seeds) == 0:
        raise ValueError("seeds is empty: give one seed per member, e.g. seeds=[0, 1, 2, 3].")
    return tuple(check_count(s, f"seeds[{i}]", 0, _MAX_SEED) for i, s in enumerate(seeds))


def _check_hyperparams(hyperparams: Any, members: int) -> dict[str, tuple]:
    """``{name: N values}`` after checking the form (the names are checked against tx)."""
    if hyperparams is None:
        return {}
    if not isinstance(hyperparams, Mapping):
        raise TypeError(
            f"hyperparams must map names to one value per member, e.g. "
            f"{{'learning_rate': [1e-3, 3e-3]}}; got {type(hyperparams).__name__}."
        )
    checked = {}
    for name, values in hyperparams.items():
        if isinstance(values, str | bytes) or not isinstance(values, Sequence | np.ndarray):
            raise TypeError(
                f"hyperparams[{name!r}] must be a list of {members} values (one per seed), "
                f"got {type(values).__name__}."
            )
        if len(values) != members:
            raise ValueError(
                f"hyperparams[{name!r}] has {len(values)} values but there are {members} "
                f"seeds: give exactly one value per member."
            )
        for i, value in enumerate(values):
            if np.ndim(value) != 0 or not np.issubdtype(np.asarray(value).dtype, np.number):
                raise ValueError(f"hyperparams[{name!r}][{i}] must be a number, got {value!r}.")
        checked[name] = tuple(values)
    return checked


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
      wrt, has_aux: as for ``Trainer``.

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
        seeds = _check_seeds(seeds)
        hyperparams = _check_hyperparams(hyperparams, len(seeds))
        self._check_hyperparam_names(model_fn, tx, wrt, seeds[0], hyperparams)

        self.model_fn, self.tx, self.loss_fn = model_fn, tx, loss_fn
        self.wrt, self.has_aux = wrt, bool(has_aux)
        self.seeds = seeds
        self.hyperparams = {k: list(v) for k, v in hyperparams.items()}
        self._program = train_program(loss_fn, tx, wrt, self.has_aux)
        self._program_key = self._program  # cached by (loss_fn, tx, wrt, has_aux) already
        self.graphdef, state, opt_state = self._build_members()
        self._placement = Placement()
        leaves, self._carry_def = jax.tree.flatten((state, opt_state))
        self._leaves = self._placement.put_carry(leaves)
        self._epoch = 0
        self._step = 0
        # The latest values best(name) can look up: evaluate's results, the last epoch's logs.
        self._latest: dict[str, np.ndarray] = {}

    @staticmethod
    def _check_hyperparam_names(model_fn, tx, wrt, seed, hyperparams) -> None:
        """Traces one member and its optax state (shapes only, nothing compiles) to check
        the hyperparameter names against what ``tx`` injects."""
        if not hyperparams:
            return
        abstract = nnx.eval_shape(lambda: _call_model_fn(model_fn, seed))
        _, abstract_state = nnx.split(abstract)
        abstract_opt = jax.eval_shape(lambda s: init_opt_state(tx, s, wrt), abstract_state)
        settable, scheduled = hyperparam_names(abstract_opt)
        if not settable and not scheduled:
            raise ValueError(
                f"hyperparams={sorted(hyperparams)} needs a tx made with "
                f"optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)"
                f"(learning_rate=1e-3); this tx holds no injected hyperparameters."
            )
        for name in hyperparams:
            if name in scheduled:
                raise ValueError(
                    f"hyperparams[{name!r}]: tx computes {name!r} from a schedule every "
                    f"step, so per-member values would have no effect. Pass a number for "
                    f"it to inject_hyperparams."
                )
            if name not in settable:
                raise ValueError(
                    f"hyperparams[{name!r}]: {name!r} is not a hyperparameter of tx; its "
                    f"injected hyperparameters are {sorted(settable)}."
                )

    def _build_members(self) -> tuple[nnx.GraphDef, nnx.State, Any]:
        graphdef, states, opt_states = None, [], []
        for i, seed in enumerate(self.seeds):
            member_graphdef, state = nnx.split(_call_model_fn(self.model_fn, seed))
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
    def state(self) -> nnx.State:
        """The members' stacked ``nnx.State`` (leading axis: members), as a copy: later
        ``fit`` calls (which donate the population's own buffers) leave it intact."""
        state, _ = self._carry(copy=True)
        return state

    @property
    def opt_state(self) -> Any:
        """The members' stacked optax state (a copy, as :attr:`state`)."""
        _, opt_state = self._carry(copy=True)
        return opt_state

    @property
    def epoch(self) -> int:
        """The global index of the next epoch ``fit`` trains (epochs completed so far)."""
        return self._epoch

    @property
    def step(self) -> int:
        """Steps each member has trained so far."""
        return self._step

    def _carry(self, copy: bool = False) -> tuple[nnx.State, Any]:
        leaves = [x.copy() for x in self._leaves] if copy else self._leaves
        return jax.tree.unflatten(self._carry_def, leaves)

    def member(self, index: int) -> nnx.Module:
        """A fresh, live ``nnx.Module`` holding member ``index``'s trained state.

        It shares nothing with the population: train it further with a ``Trainer``, or
        change it, and the population stays as it was.

        Example:
          >>> model = pop.member(2)
          >>> Trainer(model, optax.adam(1e-4), loss_fn).fit(data, epochs=1, batch_size=32)
        """
        index = check_count(index, "index", 0, len(self) - 1)
        state, _ = self._carry()
        return nnx.merge(self.graphdef, member_state(state, index))

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
        progress: bool = False,
    ) -> History:
        """Trains every member ``epochs`` MORE epochs on ``data``; one compiled call per epoch.

        Args:
          data: a pytree of arrays sharing a leading examples axis, shared by all members.
          epochs: epochs to train (0 trains nothing).
          batch_size: examples per step, for every member.
          shared_order: ``False``: member ``i`` visits the examples in the order
            ``epoch_order(seeds[i], epoch, n)``; ``True``: every member uses
            ``epoch_order(seeds[0], epoch, n)``.
          drop_remainder: as for ``Trainer.fit`` (``False`` trains a final short batch).
          progress: print one line per epoch (the members' lowest, median, highest loss).

        Returns:
          A :class:`History` whose ``losses`` has shape ``(steps, N)`` and whose epoch
          logs hold numpy arrays of shape ``(N,)`` (``loss``, the means of scalar aux
          leaves, ``learning_rate`` with an injected ``tx``) next to the shared ``epoch``,
          ``steps``, ``steps_per_sec`` and ``wall_time``. (``History.plot`` draws a single
          model's curve: plot a column yourself.)

        Example:
          >>> history = pop.fit(data, epochs=3, batch_size=32)
          >>> history.epochs[-1]["loss"]      # one mean loss per member
          array([0.31, 0.29, 0.35, 0.30], dtype=float32)
        """
        epochs = check_count(epochs, "epochs", 0)
        n = check_leading_size(data, "data")
        batch_size = check_batch_size(batch_size, n, drop_remainder=True)
        members = len(self)
        history = History(losses=np.zeros((0, members), np.float32))
        if epochs == 0:
            return history
        leaves = self._leaves
        data = self._placement.put_data(data, leaves)
        run = population_runner(
            self._program.step, self._program_key, self.graphdef, self._carry_def,
            batch_size, bool(drop_remainder),
        )  # fmt: skip
        tail = 0 if drop_remainder else n % batch_size
        steps = n // batch_size + (tail > 0)
        dropped = n % batch_size if drop_remainder else 0
        injected = _stacked_learning_rate(self._carry()[1]) is not None
        console = Console() if progress else None
        for _ in range(epochs):
            epoch = self._epoch
            seeds = (self.seeds[0],) * members if shared_order else self.seeds
            orders = np.stack([epoch_order(seed, epoch, n) for seed in seeds])
            start = time.perf_counter()
            # A Ctrl-C while the call runs lands after its result is kept: the population
            # never holds the donated (deleted) buffers.
            with held_interrupts() as interrupted:
                new_leaves, outs = run(self._leaves, data, orders)
                self._leaves = new_leaves
                self._epoch, self._step = epoch + 1, self._step + steps
            logs, losses = self._epoch_logs(epoch, outs, start, injected, dropped)
            history.losses = np.concatenate([history.losses, losses])
            history.epochs.append(logs)
            if console is not None:
                low, mid, high = np.nanpercentile(logs["loss"], [0, 50, 100])
                console.print(
                    f"epoch {epoch}: loss over {members} members min {low:.4g} median "
                    f"{mid:.4g} max {high:.4g}",
                    highlight=False, markup=False,
                )  # fmt: skip
            if interrupted():
                raise KeyboardInterrupt
        return history

    def _epoch_logs(
        self, epoch: int, outs: Any, start: float, injected: bool, dropped: int
    ) -> tuple[dict[str, Any], np.ndarray]:
        """The epoch's logs (per-member arrays) and its ``(steps, N)`` losses: one host read."""
        rate = _stacked_learning_rate(self._carry()[1]) if injected else None
        outs, rate = to_host((outs, rate))
        wall_time = time.perf_counter() - start
        losses, aux = outs if self.has_aux else (outs, None)
        losses = np.asarray(losses, np.float32)
        logs: dict[str, Any] = {"epoch": epoch, "loss": losses.mean(axis=0)}
        for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
            if np.ndim(leaf) == 2:  # a scalar per step and member
                key = jax.tree_util.keystr(path, simple=True, separator="/") or "aux"
                logs[f"aux/{key}" if key in _RESERVED_LOGS else key] = np.asarray(leaf).mean(axis=0)
        if rate is not None:
            logs["learning_rate"] = np.asarray(rate)
        steps = int(losses.shape[0])
        logs.update(steps=steps, steps_per_sec=steps / max(wall_time, 1e-9), wall_time=wall_time)
        if dropped:
            logs["dropped_examples"] = dropped
        self._latest.update({k: v for k, v in logs.items() if isinstance(v, np.ndarray)})
        return logs, losses

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
        state, _ = self._carry()
        data = self._placement.put_data(data, self._leaves)
        values = to_host(run(self.graphdef, state, data))
        values = {k: np.asarray(v, np.float32) for k, v in values.items()}
        self._latest.update(values)
        return values


def _stacked_learning_rate(opt_state: Any) -> Any:
    """The members' learning rates, shape ``(N,)``, when ``tx`` came from
    ``optax.inject_hyperparams`` (the first injected state holding one); else None."""
    is_injected = lambda x: isinstance(getattr(x, "hyperparams", None), dict)  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=is_injected):
        if is_injected(node) and "learning_rate" in node.hyperparams:
            return node.hyperparams["learning_rate"]
    return None


def _call_model_fn(model_fn: Callable, seed: int) -> nnx.Module:
    model = model_fn(nnx.Rngs(seed))
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model_fn(nnx.Rngs({seed})) returned {type(model).__name__}, not an nnx.Module: "
            f"it must build and return one module, e.g. model_fn=lambda rngs: MLP(rngs=rngs)."
        )
    return model
