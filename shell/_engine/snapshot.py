"""A split of the user's objects, taken again cheaply while their structure stays the same.

``nnx.split(node)`` walks the whole object graph (a sort per node, an ``isinstance`` per
attribute): ~0.3 ms for a small MLP, ~0.6 ms with its ``nnx.Optimizer`` on a 2-core CPU,
more than a short compiled call of it. A shell that writes back after every call would pay
it on every call. :class:`GraphSnapshot` remembers what that walk found (every node's
attributes, each Variable's type and metadata, where it sits in the state) and retraces it
in a few tens of µs: while nothing in the graph was added, removed, replaced or
re-annotated, the same graphdef holds and the state is the current Variables in the same
order (a State of the user's own Variable objects, as ``nnx.split`` gives). Any change,
and anything it cannot follow (hijax or ref Variables, array attributes outside a Variable,
node types it does not know), makes it give up: the caller splits again.

It holds the user's objects only weakly (NNX objects by weak reference, Variables not at
all: they are found anew through their parents), so a cache of snapshots keeps no model,
and no device buffer, alive — except through its graphdef's static values (a bound method
kept as a module attribute holds its module), which is why the cache keeps a few models'.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import jax
from flax import nnx
from flax.core import FrozenDict
from flax.nnx import graphlib, variablelib


class GraphSnapshot:
    """What ``(graphdef, state) = nnx.split(node)`` found, to find it again.

    Args:
      node: what was split (a module, or a tuple of a module, Rngs, metrics...).
      graphdef, state: ``nnx.split(node)``, just taken.

    Example:
      >>> graphdef, state = nnx.split(model)
      >>> snapshot = GraphSnapshot(model, graphdef, state)
      >>> snapshot.split(model)  # nothing changed: the same graphdef, the current state
      (GraphDef(...), State(...))
      >>> model.head = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
      >>> snapshot.split(model) is None  # changed: split again
      True
    """

    __slots__ = ("_size", "_spec", "_state_def", "graphdef")

    def __init__(self, node: Any, graphdef: nnx.GraphDef, state: nnx.State):
        self.graphdef = graphdef
        variables, self._state_def = jax.tree.flatten(state, is_leaf=is_variable)
        self._size = len(variables)
        self._spec: Any = None
        if all(isinstance(v, nnx.Variable) for v in variables):
            positions = {id(v): i for i, v in enumerate(variables)}
            try:
                self._spec = _spec_of(node, positions, set())
            except _Unfollowable:
                self._spec = None

    @property
    def followable(self) -> bool:
        """Whether :meth:`split` can ever answer (else it always returns None)."""
        return self._spec is not None

    def split(self, node: Any) -> tuple[nnx.GraphDef, nnx.State] | None:
        """``nnx.split(node)`` when the graph is as it was (the same graphdef, a State of the
        current Variables); None when anything changed."""
        if self._spec is None:
            return None
        found: list = [None] * self._size
        if not _matches(node, self._spec, found) or any(v is None for v in found):
            return None
        if len({id(v) for v in found}) != self._size:
            return None  # one Variable now in two places (weights tied since): another graphdef
        return self.graphdef, jax.tree.unflatten(self._state_def, found)


class _Unfollowable(Exception):
    """A node the snapshot cannot retrace by identity."""


# Whether objects of a type are nnx Variables, by type: ``isinstance(x, nnx.Variable)``
# runs flax's metaclass check (~1 µs), and a carry's reads ask for every node of the graph
# and the optax state on every call. Only a Tracer and a hijax Variable are Variables or not
# by their value: those are asked every time.
_VARIABLE_TYPES: dict[type, bool] = {}
_BY_VALUE = (jax.core.Tracer, getattr(variablelib, "HijaxVariable", jax.core.Tracer))


def is_variable(x: Any) -> bool:
    """``isinstance(x, nnx.Variable)``, remembered per type.

    Example:
      >>> is_variable(nnx.Param(jnp.zeros(2))), is_variable(jnp.zeros(2))
      (True, False)
    """
    kind = type(x)
    known = _VARIABLE_TYPES.get(kind)
    if known is None:
        if issubclass(kind, _BY_VALUE):
            return isinstance(x, nnx.Variable)
        known = _VARIABLE_TYPES[kind] = isinstance(x, nnx.Variable)
    return known


# Spec entries: (kind, ...). A graph node: ("node", weakref, {attr: spec}); seen before:
# ("seen", weakref); a Variable: ("var", type, metadata, position); a tuple or a list, a
# dict or a State by contents: ("sequence", type, [specs]) / ("dict", type, {key: spec});
# anything else: ("value", value), compared by identity or, for plain values (ints,
# strings...), equality.
_PLAIN = (int, float, str, bool, bytes, type(None))


def _spec_of(x: Any, positions: dict[int, int], seen: set[int]) -> tuple:
    if isinstance(x, _PLAIN):
        return ("value", x)
    if is_variable(x):
        if getattr(x, "hijax", False) or getattr(x, "ref", False) or id(x) not in positions:
            raise _Unfollowable  # its value does not live in the Variable object
        return ("var", type(x), dict(x._var_metadata), positions[id(x)])
    if graphlib.is_graph_node(x):
        if not isinstance(x, nnx.Pytree):
            raise _Unfollowable  # a graph node of another make: its children are its own
        if id(x) in seen:
            return ("seen", weakref.ref(x))
        seen.add(id(x))
        try:
            ref = weakref.ref(x)
        except TypeError:
            raise _Unfollowable from None
        return ("node", ref, {k: _spec_of(v, positions, seen) for k, v in vars(x).items()})
    if isinstance(x, tuple) or type(x) is list:
        return ("sequence", type(x), [_spec_of(v, positions, seen) for v in x])
    if type(x) is dict or isinstance(x, nnx.State | FrozenDict):
        return ("dict", type(x), {k: _spec_of(v, positions, seen) for k, v in _items(x).items()})
    if isinstance(x, jax.Array) or (graphlib.is_node(x) and not _opaque(x)):
        raise _Unfollowable  # an array outside a Variable, or a pytree node of unknown make
    if _holds_nnx(x):
        # A bound method of a module kept as an attribute (or a partial, a closure over
        # one): kept here it would keep that module alive.
        raise _Unfollowable
    return ("value", x)


def _items(x: Any) -> Any:
    """A dict's, a State's or a FrozenDict's items, as a mapping."""
    return vars(x)["_mapping"] if isinstance(x, nnx.State) else x


def _holds_nnx(value: Any) -> bool:
    """Whether a static value refers to an NNX object: a bound method's ``__self__``, a
    ``functools.partial``'s function and arguments, a function's closure cells."""
    held = [getattr(value, "__self__", None), getattr(value, "func", None)]
    held += list(getattr(value, "args", ()) or ()) + list(
        (getattr(value, "keywords", None) or {}).values()
    )
    for cell in getattr(value, "__closure__", None) or ():
        try:
            held.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    return any(
        isinstance(h, nnx.Pytree | nnx.Variable) or (h is not value and _bound_to_nnx(h))
        for h in held
    )


def _bound_to_nnx(value: Any) -> bool:
    return isinstance(getattr(value, "__self__", None), nnx.Pytree | nnx.Variable)


def _opaque(x: Any) -> bool:
    """Pytree nodes a graph holds as static values (an optax transformation's functions)."""
    return callable(x) or type(x).__name__ == "PytreeState"


def _matches(x: Any, spec: tuple, found: list) -> bool:
    kind = spec[0]
    if kind == "var":
        if type(x) is not spec[1] or not _same_metadata(x._var_metadata, spec[2]):
            return False
        slot = found[spec[3]]
        if slot is None:
            found[spec[3]] = x
            return True
        return slot is x  # a Variable shared by two parents: the same one still
    if kind == "node":
        return spec[1]() is x and _same_children(vars(x), spec[2], found)
    if kind == "seen":
        return spec[1]() is x
    if kind == "sequence":  # a tuple (of its own type) or a list
        return (
            type(x) is spec[1]
            and len(x) == len(spec[2])
            and all(_matches(v, s, found) for v, s in zip(x, spec[2], strict=True))
        )
    if kind == "dict":
        return type(x) is spec[1] and _same_children(_items(x), spec[2], found)
    before = spec[1]  # "value"
    if x is before:
        return True
    return type(x) is type(before) and isinstance(x, _PLAIN) and x == before


def _same_children(children: Any, expected: dict, found: list) -> bool:
    """The same keys as ``expected``, each child matching its spec."""
    if len(children) != len(expected):
        return False
    for key, value in children.items():
        child = expected.get(key)
        if child is None or not _matches(value, child, found):
            return False
    return True


def _same_metadata(now: dict, then: dict) -> bool:
    """A Variable's metadata as it was (``set_metadata`` changes the dict in place)."""
    try:
        return bool(now == then)
    except Exception:  # an array in the metadata: no cheap answer, so not the same
        return False


# The snapshots of the nodes split lately, by their first object (a model), a few per model
# (a fit's node and an evaluation's differ: the model alone, or with its Rngs and metrics).
# Held weakly by the model, and at most _MODELS models: a snapshot holds its graphdef, whose
# static values (a bound method kept as an attribute) may hold the model itself, which would
# otherwise keep it, and its device buffers, alive for good.
_SNAPSHOTS: OrderedDict[int, tuple[weakref.ref, list[GraphSnapshot]]] = OrderedDict()
_PER_MODEL = 4
_MODELS = 8


def _key(node: Any) -> Any:
    return node[0] if isinstance(node, tuple) and node else node


def _entry(node: Any) -> list[GraphSnapshot] | None:
    model = _key(node)
    entry = _SNAPSHOTS.get(id(model))
    if entry is None or entry[0]() is not model:
        return None
    _SNAPSHOTS.move_to_end(id(model))
    return entry[1]


def retrace(node: Any) -> tuple[nnx.GraphDef, nnx.State] | None:
    """``nnx.split(node)`` from a snapshot :func:`remember` kept, when the graph is as it was
    then; else None (split it, and remember that)."""
    for snapshot in _entry(node) or ():
        found = snapshot.split(node)
        if found is not None:
            return found
    return None


def remember(node: Any, graphdef: nnx.GraphDef, state: nnx.State) -> None:
    """Keeps a snapshot of ``nnx.split(node)`` (just taken) for :func:`retrace`."""
    snapshot = GraphSnapshot(node, graphdef, state)
    if not snapshot.followable:
        return
    snapshots = _entry(node)
    if snapshots is None:
        model = _key(node)
        key = id(model)
        try:
            ref = weakref.ref(model, lambda _, key=key: _forget(key))
        except TypeError:  # not weakly referable: never remembered
            return
        snapshots = []
        _SNAPSHOTS[key] = (ref, snapshots)
        while len(_SNAPSHOTS) > _MODELS:
            _SNAPSHOTS.popitem(last=False)
    snapshots.insert(0, snapshot)
    del snapshots[_PER_MODEL:]


def _forget(key: int) -> None:
    entry = _SNAPSHOTS.get(key)
    if entry is not None and entry[0]() is None:
        del _SNAPSHOTS[key]
