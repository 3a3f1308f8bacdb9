"""A ``scan_train`` call's set-up, kept for the next call on the same objects.

A call of ``scan_train(model, optimizer, loss_fn, batches)`` sets up before it dispatches:
it checks the objects, walks them for ``(graphdef, state, opt_state)``, converts the
optimizer's state to optax's, places the carry, looks its program up and builds the
write-back. On a short call of a small model that costs more than the compiled steps
(docs/performance.md, "Per call"). Users call ``scan_train`` in a loop over the same
objects, so most of it is the same every time: :class:`KeptSetUp` keeps what does not
depend on the arrays (the program's runner, the carry's structure and shardings, the plan
of each batch shape) and, on the next call, checks that the objects are as the last call
left them and rebuilds only the carry, from the Variables' current arrays.

What "as the last call left them" means, checked on every reuse (anything else: the full
set-up runs, as on a first call):

- the same model, optimizer and call-time ``rngs`` objects, the same ``loss_fn``, options
  and mesh in context;
- the model's graph unchanged: :func:`~nnxscan.shell._engine.snapshot.retrace` finds the
  same graphdef, with the very Variable objects the write-back writes into;
- the optimizer's ``tx`` and ``wrt`` the same objects, its optax state the same tree of
  the same Variables;
- every Variable holding a ``jax.Array`` of the shape, dtype and placement the carry had
  (values may differ: a user may ``nnx.update`` new weights in; they are what the call
  trains from).

Nothing here holds the user's objects or their arrays between calls: the model, optimizer
and Rngs by weak reference, the Variables not at all (found anew through the model), so
dropping the model frees its buffers as before. The runner's cache key holds the graphdef,
whose static values may hold a model (as ``snapshot.py`` says), hence few entries.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import jax
from flax import nnx

from nnxscan.pure.step_node import step_node
from nnxscan.shell._engine.calls import Execution, LiveState, plan_calls, run_calls
from nnxscan.shell._engine.owner import ModelOwner, step_array
from nnxscan.shell._engine.placement import Placement, context_mesh
from nnxscan.shell._engine.programs import TrainProgram
from nnxscan.shell._engine.snapshot import is_variable, retrace

_KEPT: OrderedDict[int, KeptSetUp] = OrderedDict()
_ENTRIES = 4


def _aval(x: Any) -> Hashable | None:
    """What the carry's compiled call fixes of an array: shape, dtype and placement."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    return (x.shape, x.dtype, x.sharding, x.committed)


class KeptSetUp:
    """The parts of a finished builtin-step ``scan_train`` call that the next call with the
    same ``key`` on the same objects can reuse (see the module doc)."""

    def __init__(
        self,
        key: tuple,
        owner: ModelOwner,
        program: TrainProgram,
        placement: Placement,
        live: LiveState,
        device: Any,
    ):
        self.key = key
        optimizer = owner.optimizer
        self._model = weakref.ref(owner.model)
        self._optimizer = weakref.ref(optimizer)
        self._rngs = None if owner.rngs is None else weakref.ref(owner.rngs)
        self._tx, self._wrt = optimizer.tx, optimizer.wrt
        self._opt_def = jax.tree.structure(optimizer.opt_state, is_leaf=is_variable)
        self.program, self.placement, self.device = program, placement, device
        self.graphdef = owner.split()[0]
        self.executions: dict[Hashable, Execution] = {}
        # The carry, its runner built (LiveState.runner): the engine that built it refers
        # to the owner, which holds the user's objects, so it is not kept.
        self._live = live
        # The write-back made the Variables hold the carry's leaves: their avals are the
        # carry's, and the step counter's array is the one written (no sync to read it).
        self.avals = [_aval(x) for x in live.leaves]
        # Weak references to the arrays last written into the Variables: a Variable that
        # still holds its array needs no aval check (the carry's by construction), and
        # nothing of the user's is kept alive by them.
        self._written = [weakref.ref(x) for x in live.leaves]
        self._step = (optimizer.step.get_value(), owner.step)
        self.donate = live.keep_between_runs()

    def variables(self, model: Any, optimizer: nnx.Optimizer, rngs: Any) -> list | None:
        """The Variables the carry's leaves live in, in its order, when the objects are as
        the last call left them; else None."""
        if (
            self._model() is not model
            or self._optimizer() is not optimizer
            or (None if self._rngs is None else self._rngs()) is not rngs
            or optimizer.tx is not self._tx
            or optimizer.wrt is not self._wrt
        ):
            return None
        found = retrace(step_node(model, rngs, None))
        if found is None or found[0] is not self.graphdef:
            return None
        opt_variables, opt_def = jax.tree.flatten(optimizer.opt_state, is_leaf=is_variable)
        if opt_def != self._opt_def:
            return None
        variables = jax.tree.leaves(found[1], is_leaf=is_variable) + opt_variables
        if len(variables) != len(self.avals):
            return None
        for variable, aval, written in zip(variables, self.avals, self._written, strict=True):
            if not is_variable(variable):
                return None
            value = variable.get_raw_value()
            if value is not written() and _aval(value) != aval:
                return None
        return variables

    def run(self, variables: list, optimizer: nnx.Optimizer, execution: Execution, batches: Any,
            num: int) -> Any:  # fmt: skip
        """Trains ``num`` stacked ``batches`` (placed) from the Variables' arrays; returns the
        losses. The Variables hold the trained state after it, whatever happens."""
        live = self._live

        def write(leaves: list, treedef: Any, steps: int) -> None:
            for variable, leaf in zip(variables, leaves, strict=True):
                variable.set_raw_value(leaf)
            self._written = [weakref.ref(x) for x in leaves]
            new = self._step[1] + steps
            array = step_array(new)
            optimizer.step.set_raw_value(array)
            self._step = (array, new)

        if optimizer.step.get_value() is not self._step[0]:  # the user stepped it since
            self._step = (optimizer.step.get_value(), int(optimizer.step.get_value()))
        # As a read from the owner: the Variables and this list hold each array once, and
        # the carry's list once more (see LiveState.donatable).
        live.start_run([variable.get_raw_value() for variable in variables], write)
        try:
            calls = plan_calls(execution.plan, batches, None, num)
            return run_calls(self.program, execution, live, calls)
        finally:
            live.keep_between_runs()


def kept(key: tuple, optimizer: nnx.Optimizer) -> KeptSetUp | None:
    """The set-up kept for ``optimizer`` under ``key``, or None."""
    entry = _KEPT.get(id(optimizer))
    if entry is None or entry.key != key:
        return None
    _KEPT.move_to_end(id(optimizer))
    return entry


def keep(setup: KeptSetUp, optimizer: nnx.Optimizer) -> None:
    """Keeps ``setup`` for the next call on ``optimizer`` (forgotten when it is collected)."""
    key = id(optimizer)
    if key not in _KEPT:
        weakref.finalize(optimizer, _KEPT.pop, key, None)
    _KEPT[key] = setup
    _KEPT.move_to_end(key)
    while len(_KEPT) > _ENTRIES:
        _KEPT.popitem(last=False)


def forget(optimizer: nnx.Optimizer) -> None:
    """Drops what was kept for ``optimizer`` (a call that failed: the next one sets up anew)."""
    _KEPT.pop(id(optimizer), None)


def call_key(loss_fn: Callable, rngs: Any, explicit: Any, mesh: Any, data_axis: Any,
             shardings: Any) -> tuple:  # fmt: skip
    """What besides the objects a kept set-up depends on."""
    return (loss_fn, id(rngs), explicit, mesh, data_axis, id(shardings), context_mesh())


def batch_key(batches: Any) -> Hashable:
    """What a kept plan depends on: the stacked batches' tree, shapes and dtypes."""
    leaves, treedef = jax.tree.flatten(batches)
    return treedef, tuple((x.shape, x.dtype) for x in leaves)


def keep_after_call(
    key: tuple, owner: ModelOwner, program: TrainProgram, placement: Placement, call: tuple
) -> None:
    """After a first call completed: keeps its set-up when its write-back wrote the carry's
    arrays straight into the user's Variables (plain Variables holding arrays, the usual
    case); a call that wrote through ``nnx.update`` (hijax Variables) is set up anew.
    ``call``: the call's ``(live, device, execution, batches)`` (``scan_train._scan``'s)."""
    live, device, execution, batches = call
    optimizer = owner.optimizer
    variables = jax.tree.leaves(owner.read_state(), is_leaf=is_variable)
    variables += jax.tree.leaves(optimizer.opt_state, is_leaf=is_variable)
    if len(variables) != len(live.leaves) or not all(
        is_variable(v) and _aval(leaf) is not None and v.get_raw_value() is leaf
        for v, leaf in zip(variables, live.leaves, strict=True)
    ):
        forget(optimizer)
        return
    del variables
    setup = KeptSetUp(key, owner, program, placement, live, device)
    setup.executions[batch_key(batches)] = execution
    keep(setup, optimizer)
