"""Owners: the one place a fit reads ``(graphdef, state, opt_state)`` from and writes to.

The engine talks to an :class:`Owner` and never asks which kind it has (what differs is
its ``layout``). :class:`ModelOwner` holds the user's module and optimizer and is the only
code that calls ``nnx.update`` on them; ONE step counter: an ``nnx.Optimizer``'s ``step``
when there is one. ``members.StackedOwner`` holds a population's stacked members.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from nnxscan.adapters._checkpoint_manifest import COUNTERS, check_meta_ints
from nnxscan.adapters.nnx_optimizer import (
    _is_variable,
    optax_state_from_optimizer,
    optimizer_state_builder,
)
from nnxscan.pure import Step, init_opt_state, split_wrt
from nnxscan.pure.checks import check_transform
from nnxscan.pure.step_node import step_node
from nnxscan.shell._engine.layout import ONE_MODEL, Layout
from nnxscan.shell._engine.placement import context_mesh
from nnxscan.shell._engine.snapshot import remember, retrace
from nnxscan.shell._module_check import check_module

# ``write(leaves, treedef, steps)``: the carry ``(state, opt_state)`` as ``jax.tree.flatten``
# gives it, and the number of steps trained since the last write.
WriteBack = Callable[[list, Any, int], None]


class Owner(Protocol):
    """What the fit engine needs from whoever holds the trained objects.

    Attributes:
      layout: one model (:class:`~nnxscan.shell._engine.layout.OneModel`) or N members
        stacked (:class:`~nnxscan.shell._engine.layout.Members`): everything the engine
        does differently for them.
      metrics: the NNX training metrics (a template for members), or None.
      epoch: the global index of the next epoch; ``epoch_step``: steps of that epoch trained
        when a run stopped inside it (0 at boundaries).
      loaded_since_checkpoint: a state was loaded (EarlyStopping's best epoch) since the
        last checkpoint, so one at the current step is stale.
      revision: counts the changes :meth:`set_active` made to the carry: a fit in progress
        carries on from the owner's carry when it moves.
      restore_hint: what a restore error adds about the objects held ("" : nothing).
    """

    layout: Layout
    metrics: nnx.Metric | None
    epoch: int
    epoch_step: int
    loaded_since_checkpoint: bool
    revision: int
    restore_hint: str

    @property
    def step(self) -> int: ...
    def read(self) -> tuple[nnx.GraphDef, nnx.State, Any]: ...
    def read_state(self) -> nnx.State: ...
    def reads_held(self) -> contextlib.AbstractContextManager: ...
    def release_reads(self) -> None: ...
    def make_write_back(self) -> WriteBack: ...
    def reset_metrics(self) -> None: ...
    def take_metrics(self) -> dict[str, Any]: ...
    def load(self, state: nnx.State) -> None: ...
    def set_active(self, indices: Any, value: bool) -> None: ...
    def trains(self) -> bool: ...
    def active_logs(self) -> dict[str, Any]: ...
    def checkpoint_tree(self, run: str = "", carry: tuple | None = None) -> dict[str, Any]: ...
    def restore(self, tree: dict[str, Any], run_keys: dict[str, Any] | None = None) -> None: ...
    def run_seeds(self, run_keys: dict[str, Any]) -> tuple[int, ...]: ...
    def evaluation_node(
        self, model_only: bool, rngs: Any = None, metrics: Any = None
    ) -> tuple[nnx.GraphDef, Any]: ...
    def begin_run(self, run_keys: dict[str, Any]) -> None: ...


def metric_logs(computed: Any, metrics: nnx.Metric, layout: Layout) -> dict[str, Any]:
    """``metrics.compute()``'s result as flat logs of host values, as ``layout`` logs a
    value (:meth:`Layout.value`, the dtype kept): one model's scalars as floats; its array
    metrics (per class), and every value of members (``(N, ...)``, computed under their
    vmap), as numpy arrays.

    An ``nnx.MultiMetric`` gives one entry per metric; a single metric is named by its
    ``argname`` (``Average("loss")`` -> ``loss``) or its class; a named tuple of
    statistics (``Welford``) gives ``<name>_<field>``.

    Example:
      >>> metric_logs(metrics.compute(), metrics, ONE_MODEL)
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
    return {k: layout.value(v, dtype=None) for k, v in host.items()}


def counters(owner: Any) -> dict[str, int]:
    """The owner's :data:`COUNTERS`, as a checkpoint's meta holds them."""
    return {name: getattr(owner, name) for name in COUNTERS}


def restore_counters(owner: Any, meta: dict[str, Any]) -> None:
    """Sets the owner's :data:`COUNTERS` from a checked checkpoint's meta."""
    for name in COUNTERS:
        setattr(owner, name, meta[name])


class ModelOwner:
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
      hold_reads: for an owner made for one call (``scan_train``): the objects' read made
        here is held (as in :meth:`reads_held`) until :meth:`release_reads`, so the call's
        set-up does not walk them again. Nothing the user runs may come in between.
    """

    layout = ONE_MODEL
    revision = 0  # one model never freezes: its carry changes only by training
    restore_hint = ""  # a checkpoint's own error says what differs

    def __init__(
        self,
        model: nnx.Module,
        tx_or_optimizer: optax.GradientTransformation | nnx.Optimizer,
        wrt: nnx.filterlib.Filter = nnx.Param,
        *,
        rngs: nnx.Rngs | None = None,
        metrics: nnx.Metric | None = None,
        hold_reads: bool = False,
    ):
        check_module(model)
        check_rngs_and_metrics(rngs, metrics)
        optimizer = tx_or_optimizer if isinstance(tx_or_optimizer, nnx.Optimizer) else None
        if optimizer is not None and wrt is not nnx.Param and wrt != optimizer.wrt:
            raise ValueError(
                f"wrt={wrt!r} differs from the nnx.Optimizer's wrt={optimizer.wrt!r}; leave "
                f"wrt out when passing an optimizer."
            )
        tx = check_transform(tx_or_optimizer if optimizer is None else optimizer.tx)
        wrt = wrt if optimizer is None else optimizer.wrt
        # What every compiled call carries: the model, or (model, rngs, metrics).
        node = step_node(model, rngs, metrics)
        self._hold(
            model, node, optimizer, optimizer, tx, wrt, rngs, [] if metrics is None else [metrics]
        )
        if optimizer is None:
            self._opt_state = init_opt_state(tx, self.read_state(), wrt)
        else:
            self._opt_state = None
            # hold_reads: this read is the one the call being set up uses (its set-up
            # runs no user code in between, as reads_held's does): the objects are walked
            # once, not once here and again for the call.
            self._holding = hold_reads
            self.read()  # validates the optimizer's optax state: raises early

    @classmethod
    def of_step(
        cls,
        model: nnx.Module,
        step: Step | None = None,
        *,
        optimizer: nnx.Optimizer | None = None,
        extras: tuple = (),
    ) -> ModelOwner:
        """The owner of a user's step: a pure :class:`~nnxscan.pure.Step` (``step``; its ``init``
        makes the opt_state kept here), or a stateful NNX step (``step=None``) that mutates
        ``(model, optimizer, *extras)``, all carried as one node (every state lives in the objects;
        the carry's opt_state is ``()``)."""
        check_module(model)
        owner = cls.__new__(cls)
        objects = (model, *([optimizer] if optimizer is not None else []), *extras)
        tx, wrt = (optimizer.tx, optimizer.wrt) if optimizer else (None, None)
        rngs = next((x for x in extras if isinstance(x, nnx.Rngs)), None)
        metrics = [x for x in extras if isinstance(x, nnx.Metric)]
        node = objects if len(objects) > 1 else model
        owner._hold(model, node, optimizer, None, tx, wrt, rngs, metrics)
        owner._opt_state = () if step is None else step.init(*owner.split())
        return owner

    def _hold(self, model, node, optimizer, synced, tx, wrt, rngs, metrics: list) -> None:
        """Takes the objects and starts the run's counters (both constructors end here)."""
        self.model, self.node, self.optimizer, self.tx, self.wrt = model, node, optimizer, tx, wrt
        # The nnx.Optimizer whose optax state and step the carry's opt_state mirrors (the
        # built-in step's); a user's step keeps its opt_state here, or its objects in node.
        self._synced: nnx.Optimizer | None = synced
        self.rngs, self._metric_objects = rngs, metrics
        self.metrics = metrics[0] if metrics else None
        self._hijax: bool | None = None  # whether it holds hijax Variables: learnt on a split
        self.epoch = 0
        self.seed = 0
        self.epoch_step = 0
        self._own_step = 0
        self.loaded_since_checkpoint = False
        # The optimizer's step array as last read or written, and its value: reading
        # ``step`` then needs no device sync unless the user stepped the optimizer since.
        self._step_cache: tuple[Any, int] | None = None
        # reads_held: whether reads are held, and the read they all return.
        self._holding = False
        self._held: tuple[nnx.GraphDef, nnx.State, Any] | None = None

    # -- reading ----------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps trained: the ``nnx.Optimizer``'s ``step`` when there is one."""
        if self._synced is None:
            return self._own_step
        value = self._synced.step.get_value()
        if self._step_cache is None or self._step_cache[0] is not value:
            self._step_cache = (value, int(value))
        return self._step_cache[1]

    @step.setter
    def step(self, value: int) -> None:
        if self._synced is None:
            self._own_step = value
        elif value != self.step:
            self._synced.step.set_raw_value(step_array(value))
            self._step_cache = None

    @property
    def opt_state(self) -> Any:
        """The optax state, in the structure ``tx.init(params)`` gives."""
        return self._opt_state_of(self.read_state())

    def _opt_state_of(self, state: nnx.State) -> Any:
        """The optax state, given the node's state as just read (one graph walk, not two)."""
        if self._synced is None:
            return self._opt_state
        params, _ = split_wrt(state, self.wrt)
        return optax_state_from_optimizer(self._synced, params)

    def split(self, node: Any = None) -> tuple[nnx.GraphDef, nnx.State]:
        """``nnx.split(node)`` (the owner's node by default) as compiled calls take it:
        hijax Variables (``nnx.var_defaults(hijax=True)``) as plain ones holding the same
        arrays, so the graphdef merges plain Variables inside the call too (Flax 0.12.8
        can't differentiate hijax Variables a forward pass updates or creates). Writing
        back (``nnx.update``) puts the values into the user's hijax Variables."""
        node = self.node if node is None else node
        own = node is self.node
        if own and self._hijax is not True:
            found = retrace(node)  # the last split, when the graph is as it was
            if found is not None:
                return found
        if self._hijax:
            return nnx.split(nnx.with_vars(node, hijax=False))
        graphdef, state = nnx.split(node)
        if self._hijax is None:  # the first split tells (a leaf walk, once per owner)
            hijax = holds_hijax(state)
            if own:
                self._hijax = hijax
            if hijax:
                return nnx.split(nnx.with_vars(node, hijax=False))
        if own:
            remember(node, graphdef, state)  # the next reads retrace it, not walk again
        return graphdef, state

    def read(self) -> tuple[nnx.GraphDef, nnx.State, Any]:
        """``(graphdef, state, opt_state)`` of the user's objects (their own buffers)."""
        if self._held is not None:
            return self._held
        graphdef, state = self.split()
        read = (graphdef, state, self._opt_state_of(state))
        if self._holding:
            self._held = read
        return read

    @contextlib.contextmanager
    def reads_held(self) -> Iterator[None]:
        """Within: :meth:`read` walks the user's objects once and gives every later read
        the same result, until :meth:`release_reads` or a write. Held while one call is set
        up (a walk of a module graph is host time a short call feels); released before the
        first callback runs, since a callback may change the objects."""
        self._holding = True
        try:
            yield
        finally:
            self.release_reads()

    def release_reads(self) -> None:
        """Ends :meth:`reads_held`: every later read walks the objects again."""
        self._holding, self._held = False, None

    def read_state(self) -> nnx.State:
        """The module state of the user's objects (model, and rngs/metrics when given)."""
        return self.split()[1]

    def evaluation_node(
        self, model_only: bool, rngs: Any = None, metrics: Any = None
    ) -> tuple[nnx.GraphDef, nnx.State]:
        """``(graphdef, state)`` an evaluation merges: the model alone (for a
        ``metric_fn``), or it with call-time ``rngs`` and the NNX ``metrics`` to feed."""
        return self.split(self.model if model_only else step_node(self.model, rngs, metrics))

    def reset_metrics(self) -> None:
        """Starts the training metrics afresh (at the start of a fit)."""
        for metrics in self._metric_objects:
            metrics.reset()

    def take_metrics(self) -> dict[str, Any]:
        """The training metrics accumulated since the last reset, then reset (one host read)."""
        values: dict[str, Any] = {}
        for metrics in self._metric_objects:
            values.update(metric_logs(metrics.compute(), metrics, self.layout))
            metrics.reset()
        return values

    # -- writing ----------------------------------------------------------------------------

    def make_write_back(self) -> WriteBack:
        """``write(leaves, treedef, steps)``: puts a trained carry into the user's objects and
        advances the step counter by ``steps``; built once per fit. The leaves go straight
        into the Variables they were read from (a value swap each, no graph walk: a fit
        writes back after every call; docs/performance.md); another structure, and
        Variables a swap cannot write (hijax, array refs), go through ``nnx.update``."""
        _, state, opt_state = self.read()
        # Hijax Variables were read as plain copies: writes must reach the user's own.
        variables = None if self._hijax else _swappable(state, self._synced)
        # The carry's treedef, compared once per run of calls (LiveState keeps one object).
        expected, matched = jax.tree.structure((state, opt_state)), [None]
        model_leaves = len(jax.tree.leaves(state))
        optax_def = jax.tree.structure(opt_state)

        def direct(leaves: list, treedef: Any) -> bool:
            if variables is None or not (treedef is matched[0] or treedef == expected):
                return False
            matched[0] = treedef
            for variable, leaf in zip(variables, leaves, strict=False):
                variable.set_raw_value(leaf)
            return True

        if self._synced is None:

            def write(leaves: list, treedef: Any, steps: int) -> None:
                self.release_reads()
                if direct(leaves, treedef):
                    self._opt_state = jax.tree.unflatten(optax_def, leaves[model_leaves:])
                else:
                    state, self._opt_state = jax.tree.unflatten(treedef, leaves)
                    nnx.update(self.node, state)
                self._own_step += steps

            return write

        optimizer = self._synced
        # Built on first need: direct writes (the usual case) never need it, and building
        # it walks the optimizer's graph.
        builder: list = []

        def write_with_optimizer(leaves: list, treedef: Any, steps: int) -> None:
            self.release_reads()
            new_step = self.step + steps
            new_array = step_array(new_step)
            if direct(leaves, treedef):
                optimizer.step.set_raw_value(new_array)
            else:
                if not builder:
                    builder.append(optimizer_state_builder(optimizer))
                state, opt_state = jax.tree.unflatten(treedef, leaves)
                nnx.update(self.node, state)
                nnx.update(optimizer, builder[0](opt_state, new_array))
            self._step_cache = (optimizer.step.get_value(), new_step)

        return write_with_optimizer

    def load(self, state: nnx.State) -> None:
        """Writes a module state (e.g. a kept copy of the best epoch) into the model only."""
        self.release_reads()
        nnx.update(self.model, state)
        self.loaded_since_checkpoint = True

    def set_active(self, indices: Any, value: bool) -> None:
        raise ValueError("one model has no members to freeze: on_nonfinite='stop' stops it")

    def trains(self) -> bool:
        """Whether anything is left to train: one model never freezes (it stops)."""
        return True

    def active_logs(self) -> dict[str, Any]:
        """What an epoch's logs say of frozen members: nothing."""
        return {}

    # -- the run ----------------------------------------------------------------------------

    def run_seeds(self, run_keys: dict[str, Any]) -> tuple[int]:
        """The shuffle seed of a fit (one per model: one): the one given, else the last
        run's (0 at first)."""
        seed = run_keys.get("seed")
        return (self.seed if seed is None else seed,)

    def begin_run(self, run_keys: dict[str, Any]) -> None:
        (self.seed,) = self.run_seeds(run_keys)

    def checkpoint_tree(self, run: str = "", carry: tuple | None = None) -> dict[str, Any]:
        """What a checkpoint holds: module state, optax state, the counters, and ``run``
        (where the fit's History so far is in the run log: what a resume needs to go on).

        ``carry``: fit's ``(state, opt_state)``, just written into the objects: the same
        arrays, without walking the module and optimizer again to read them back. Ignored
        once a state was loaded into the model since (EarlyStopping)."""
        meta = {**counters(self), "seed": self.seed, "run": run}
        if carry is not None and not self.loaded_since_checkpoint:
            state, opt_state = carry
        else:
            state = self.read_state()
            opt_state = self._opt_state_of(state)
        return {"state": state, "opt_state": opt_state, "meta": meta}

    def restore(self, tree: dict[str, Any], run_keys: dict[str, Any] | None = None) -> None:
        """Writes a checkpoint tree (as :meth:`checkpoint_tree` made it) into the objects."""
        self.release_reads()
        meta = tree["meta"]
        check_meta_ints(meta, (*COUNTERS, "seed"))
        seed = (run_keys or {}).get("seed")
        if seed is not None and seed != meta["seed"]:
            raise ValueError(
                f"resume=True with seed={seed}, but the checkpoint's run used seed "
                f"{meta['seed']}: pass the same seed (or none) to resume it."
            )
        if self._synced is None:
            nnx.update(self.node, tree["state"])
            self._opt_state = tree["opt_state"]
        else:
            # Build the optimizer's update before touching the model: it can still raise.
            update = optimizer_state_builder(self._synced)(
                tree["opt_state"], step_array(meta["step"])
            )
            nnx.update(self.node, tree["state"])
            nnx.update(self._synced, update)
            self._step_cache = None
        restore_counters(self, meta)
        self.seed = meta["seed"]
        self.loaded_since_checkpoint = False


def step_array(step: int) -> jax.Array:
    """An optimizer's step counter as a uint32 array where ``jnp.asarray`` puts one
    (replicated over the context's mesh, else the default device), placed from the host:
    ``jnp.asarray`` would compile a conversion of its own, a program the run does not
    otherwise need."""
    mesh = context_mesh()
    where = None if mesh is None else NamedSharding(mesh, PartitionSpec())
    return jax.device_put(np.asarray(step, np.uint32), where)


def holds_hijax(state: nnx.State) -> bool:
    """Whether a state holds hijax Variables (``nnx.var_defaults(hijax=True)``)."""
    variables = jax.tree.leaves(state, is_leaf=_is_variable)
    return any(getattr(v, "hijax", False) for v in variables)


def split_plain(node: Any) -> tuple[nnx.GraphDef, nnx.State]:
    """``nnx.split(node)`` with hijax Variables as plain ones (see :meth:`ModelOwner.split`)."""
    graphdef, state = nnx.split(node)
    if holds_hijax(state):
        return nnx.split(nnx.with_vars(node, hijax=False))
    return graphdef, state


def _swappable(state: nnx.State, optimizer: nnx.Optimizer | None) -> list | None:
    """The user's Variables in the carry's leaf order (the module state's, then the
    optimizer's optax leaves), when each holds one plain array that a value swap can
    replace; else None (``nnx.update`` writes then)."""
    variables = jax.tree.leaves(state, is_leaf=_is_variable)
    if optimizer is not None:
        variables += jax.tree.leaves(optimizer.opt_state, is_leaf=_is_variable)
    for variable in variables:
        if (
            not isinstance(variable, nnx.Variable)
            or getattr(variable, "hijax", False)
            or not isinstance(variable.get_raw_value(), jax.Array | np.ndarray)
        ):
            return None
    return variables


def check_rngs_and_metrics(rngs: Any, metrics: Any) -> None:
    """Call-time ``rngs`` must be an ``nnx.Rngs``, ``metrics`` an ``nnx.Metric`` (or None)."""
    if rngs is not None and not isinstance(rngs, nnx.Rngs):
        raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}.")
    if metrics is not None and not isinstance(metrics, nnx.Metric):
        raise TypeError(
            f"metrics must be an nnx.Metric or nnx.MultiMetric, got {type(metrics).__name__}."
        )
