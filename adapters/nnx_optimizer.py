"""Edge to ``nnx.Optimizer``: read its optax state as a plain pytree, and build the State
that ``nnx.update`` applies to make it hold a trained one.

``optimizer.opt_state`` wraps every optax leaf in an ``OptVariable``/``OptArray``, so its tree
differs from ``tx.init(params)``'s. The two hold the same leaves in the same order (the
optimizer built its state with ``tx.init``), so the conversion goes by leaves, never by
structure. Nothing here mutates the optimizer: the shell applies the result with
``nnx.update``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

__all__ = ["optax_state_from_optimizer", "optimizer_state_builder"]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def optax_state_from_optimizer(optimizer: nnx.Optimizer, params: nnx.State) -> Any:
    """Returns ``optimizer``'s optax state in the structure ``optimizer.tx.init(params)`` has.

    The leaves are the optimizer's own arrays (no copy).

    Raises:
      ValueError: the optimizer's state has another number of leaves than ``tx.init(params)``
        would (it was built for another model, or another ``wrt``).

    Example:
      >>> opt_state = optax_state_from_optimizer(optimizer, nnx.state(model, nnx.Param))
    """
    expected, shapes = _expected_structure(optimizer, params)
    leaves = _optax_leaves(optimizer.opt_state)
    if len(leaves) != expected.num_leaves:
        raise ValueError(
            f"the nnx.Optimizer's state has {len(leaves)} leaves but its transform "
            f"expects {expected.num_leaves} for this model's wrt={optimizer.wrt!r} "
            f"variables. Was the optimizer built for another model?"
        )
    for (path, want), got in zip(shapes, leaves, strict=True):
        if want != (got.shape if isinstance(got, jax.Array) else tuple(jnp.shape(got))):
            raise ValueError(
                f"the nnx.Optimizer's state leaf {path} has shape {tuple(jnp.shape(got))}, "
                f"but this model needs {want}. Was the optimizer built for another model?"
            )
    return jax.tree.unflatten(expected, leaves)


def _optax_leaves(opt_state: Any) -> list:
    """The arrays of an ``nnx.Optimizer``'s state, hijax Variables
    (``nnx.var_defaults(hijax=True)``) read as plain ones: a hijax Variable is itself a
    leaf, not a pytree around its array."""
    variables = jax.tree.leaves(opt_state, is_leaf=_is_variable)
    if any(getattr(v, "hijax", False) for v in variables):
        opt_state = nnx.with_vars(opt_state, hijax=False)
    return jax.tree.leaves(opt_state)


# Per optimizer: the structure tx.init gives for a params structure. Tracing tx.init is
# not free, and the shell reads the optax state at every checkpoint.
_STRUCTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _expected_structure(optimizer: nnx.Optimizer, params: nnx.State) -> tuple[Any, list]:
    """``(treedef, [(leaf path, shape), ...])`` of ``optimizer.tx.init(params)``."""
    leaves, treedef = jax.tree.flatten(params)
    key = (optimizer.tx, treedef, tuple(_shape_dtype(x) for x in leaves))
    known = _STRUCTURES.get(optimizer)
    if known is not None and known[0] == key:
        return known[1]
    template = jax.eval_shape(optimizer.tx.init, params)
    shapes = [
        (jax.tree_util.keystr(path), tuple(leaf.shape))
        for path, leaf in jax.tree_util.tree_flatten_with_path(template)[0]
    ]
    structure = (jax.tree.structure(template), shapes)
    _STRUCTURES[optimizer] = (key, structure)
    return structure


def _shape_dtype(x: Any) -> tuple:
    if isinstance(x, jax.Array | np.ndarray):  # the usual leaf, without jnp's dtype rules
        return (x.shape, x.dtype)
    return (jnp.shape(x), jnp.result_type(x))


def optimizer_state_builder(optimizer: nnx.Optimizer) -> Callable[[Any, Any], nnx.State]:
    """Returns ``build(opt_state, step)``: the State that ``nnx.update(optimizer, ...)`` takes to
    hold the optax state ``opt_state`` and the step counter ``step``.

    The map from optax leaves to the optimizer's Variables is built once here, not per
    call: the shell writes back after every compiled call.

    Example:
      >>> build = optimizer_state_builder(optimizer)
      >>> nnx.update(optimizer, build(opt_state, jnp.uint32(10)))
    """
    position = {
        id(var): i
        for i, var in enumerate(jax.tree.leaves(optimizer.opt_state, is_leaf=_is_variable))
    }
    step_id = id(optimizer.step)
    # Only the optimizer's own Variables: an nnx.ModelAndOptimizer (or any subclass that
    # keeps the model, or more) holds the model's Variables too, which the shell writes
    # through the model, and which an update built from the optax state must not touch.
    own = nnx.state(optimizer, lambda _, var: id(var) == step_id or id(var) in position)
    flat, treedef = jax.tree.flatten(own, is_leaf=_is_variable)
    # For each Variable of the optimizer's state: the index of its new optax leaf, or -1
    # for the step counter.
    sources = [-1 if id(var) == step_id else position[id(var)] for var in flat]

    def build(opt_state: Any, step: Any) -> nnx.State:
        leaves = jax.tree.leaves(opt_state)
        return jax.tree.unflatten(treedef, [step if i < 0 else leaves[i] for i in sources])

    return build
