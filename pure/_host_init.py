"""An optimizer's initial state without compiling: its constant leaves made on the host.

Run eagerly, ``tx.init(params)`` dispatches op by op, and each new shape of zeros compiles a
program of its own (Adam on an MLP of three layers: a dozen). Most inits only fill arrays
with constants: traced, every output is a literal or a ``broadcast_in_dim`` of one. Those
are built here with numpy and put where the eager ops put them, with the eager bits and
nothing compiled. Eagerly, ``zeros_like(p)`` lands where ``p`` is when ``p`` is committed
to a device, and a constant of its own (Adam's count) uncommitted on the default device:
here a broadcast goes where the params are and a literal to the default device, which is
that rule when the params all sit on one CPU device and every broadcast has a param's
shape and dtype while no literal has (a scalar param's ``zeros_like`` is a literal too).
Any other init (one that copies or computes from the params, an effect, a weakly typed
output) or placement (params sharded, on several devices, or on an accelerator, where a
host copy is no cheaper than a program) runs ``tx.init`` itself, as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex
import numpy as np

_EAGER = object()  # the params' placement leaves the init to tx.init


def initial_state(init: Callable[[Any], Any], params: Any) -> Any:
    """``init(params)``: the same values, dtypes and placement, compiling nothing where
    every output leaf is a constant (see the module doc)."""
    leaves = jax.tree.leaves(params)
    where = _placement(leaves)
    if where is _EAGER:
        return init(params)
    try:
        closed, shapes = jax.make_jaxpr(init, return_shape=True)(params)
    except Exception:  # not traceable (a host read of a value, say): init raises or runs it
        return init(params)
    outputs = _constant_outputs(closed)
    if outputs is None:
        return init(params)
    avals = {(np.shape(x), np.dtype(x.dtype)) for x in leaves}
    values, devices = [], []
    for value, broadcast in outputs:
        like_param = (value.shape, value.dtype) in avals
        if broadcast != like_param:  # a zeros_like of no param, or a scalar param's
            return init(params)
        values.append(value)
        devices.append(where if broadcast else None)
    # One copy onto the device, owned by it (no alias of numpy's memory to donate).
    placed = jax.device_put(values, devices, may_alias=False)
    return jax.tree.unflatten(jax.tree.structure(shapes), placed)


def _placement(leaves: list[Any]) -> Any:
    """Where eager ``zeros_like(p)`` puts its output: None (uncommitted, the default
    device), the params' one-CPU-device sharding, or ``_EAGER`` (anything else)."""
    if not leaves or any(jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended) for x in leaves):
        return _EAGER  # nothing to place, or keys: no numpy twin
    if all(isinstance(x, np.ndarray | np.generic) for x in leaves):
        return None if jax.default_backend() == "cpu" else _EAGER
    if not all(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) for x in leaves):
        return _EAGER
    shardings = {x.sharding for x in leaves}
    committed = {x.committed for x in leaves}
    if len(shardings) != 1 or len(committed) != 1:
        return _EAGER
    (sharding,) = shardings
    devices = sharding.device_set
    if len(devices) != 1 or next(iter(devices)).platform != "cpu":
        return _EAGER
    if not committed.pop():
        return None if next(iter(devices)) == jax.devices()[0] else _EAGER
    return sharding


def _constant_outputs(closed: jex.ClosedJaxpr) -> list[tuple[np.ndarray, bool]] | None:
    """``(value, made by a broadcast)`` for each output when all are literals or
    broadcasts of one, else None."""
    jaxpr = closed.jaxpr
    if jaxpr.effects:
        return None
    broadcasts = {
        eqn.outvars[0]: eqn.invars[0].val
        for eqn in jaxpr.eqns
        if eqn.primitive.name == "broadcast_in_dim"
        and len(eqn.invars) == 1
        and isinstance(eqn.invars[0], jex.Literal)
        and eqn.params.get("sharding") is None
    }
    outputs = []
    for var in jaxpr.outvars:
        if isinstance(var, jex.Literal):
            value, broadcast = var.val, False
        elif var in broadcasts:
            value, broadcast = broadcasts[var], True
        else:
            return None
        if var.aval.weak_type or jax.dtypes.issubdtype(var.aval.dtype, jax.dtypes.extended):
            return None
        outputs.append((np.full(var.aval.shape, value, var.aval.dtype), broadcast))
    return outputs
