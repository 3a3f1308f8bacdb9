"""Populations: many models of one architecture, trained side by side in one traced function.

A population is N members that share a ``graphdef``: their states are stacked along a new
leading members axis (:func:`stack_states`), and the ONE pure step of one model is
``jax.vmap``-ed over that axis by :func:`~nnxscan.pure.vmap_members`. Each member keeps its
own parameters, batch statistics, RNG state and optax state, and shuffles the shared data
by its own order. Per-member hyperparameters ride in the optax state of a transform made
with ``optax.inject_hyperparams`` (:func:`with_hyperparams`, or ``vmap_members(...,
hyperparams=)``), so they are data, not code: one compiled program trains every learning
rate of a sweep. This module holds the helpers over stacked pytrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.pure import _members

__all__ = [
    "hyperparam_names",
    "hyperparam_value",
    "member_state",
    "select_members",
    "stack_states",
    "unstack_states",
    "with_hyperparams",
]


def stack_states(states: Sequence[Any]) -> Any:
    """Stacks equally-structured pytrees along a new leading members axis.

    Args:
      states: a non-empty list of pytrees with the same structure, and the same shape and
        dtype at every leaf: ``nnx.split`` states of one architecture, their optax states.
        PRNG key leaves (``nnx.RngKey``) stack like any other.

    Returns:
      One pytree of that structure whose every leaf has a leading axis of ``len(states)``.

    Raises:
      ValueError: the list is empty, or two entries differ in structure (the paths found
        in one but not the other are named) or in a leaf's shape or dtype.

    Example:
      >>> states = [nnx.split(MLP(nnx.Rngs(seed)))[1] for seed in range(4)]
      >>> stacked = stack_states(states)
      >>> stacked["l1"]["kernel"].shape
      (4, 2, 16)
    """
    if not isinstance(states, list | tuple) or not states:
        kind = type(states).__name__
        what = f"an empty {kind}" if isinstance(states, list | tuple) else f"a {kind}"
        raise ValueError(f"stack_states needs a non-empty list of pytrees, got {what}.")
    first = _members.leaf_paths(states[0])
    first_def = jax.tree.structure(states[0])
    for i, state in enumerate(states[1:], start=1):
        if jax.tree.structure(state) != first_def:
            paths = _members.leaf_paths(state)
            only_first = sorted(set(first) - set(paths))[:3]
            only_this = sorted(set(paths) - set(first))[:3]
            raise ValueError(
                f"states[{i}] has a different structure from states[0] (paths only in "
                f"states[0]: {only_first or 'none'}; only in states[{i}]: "
                f"{only_this or 'none'}). Every member must be built by the same code: one "
                f"architecture, one optax transform."
            )
        for path, leaf in _members.leaf_paths(state).items():
            if _members.shape_dtype(leaf) != _members.shape_dtype(first[path]):
                raise ValueError(
                    f"states[{i}]{path} has shape/dtype {_members.shape_dtype(leaf)} but "
                    f"states[0] has {_members.shape_dtype(first[path])}: members must match "
                    f"leaf for leaf."
                )
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)


def unstack_states(stacked: Any) -> list[Any]:
    """Splits a stacked pytree (:func:`stack_states`) back into one pytree per member.

    Example:
      >>> states = unstack_states(stacked)
      >>> model_2 = nnx.merge(graphdef, states[2])
    """
    size = _members.num_members_of(stacked, "stacked")
    return [member_state(stacked, i) for i in range(size)]


def member_state(stacked: Any, index: int | jax.Array) -> Any:
    """Member ``index`` of a stacked pytree (a new pytree; ``stacked`` is left as it is).

    Works under ``jax.jit`` with a traced ``index`` (one compiled program for every
    member), where :func:`unstack_states` splits every member on the host.

    Args:
      stacked: a pytree whose leaves share a leading members axis (:func:`stack_states`).
      index: the member, an int or a scalar int array.

    Returns:
      The member's pytree: each leaf ``x`` becomes ``x[index]``.

    Example:
      >>> best = int(jnp.argmin(val_losses))
      >>> model = nnx.merge(graphdef, member_state(stacked, best))
    """
    return jax.tree.map(lambda x: x[index], stacked)


def select_members(mask: Any, on_true: Any, on_false: Any) -> Any:
    """Member ``i`` of ``on_true`` where ``mask[i]``, else of ``on_false``.

    The per-member ``where``: keep the improved members' weights, roll back the members
    whose step went wrong, restore only the members a checkpoint should.

    Args:
      mask: bools of shape ``(N,)``.
      on_true, on_false: two stacks of the same structure, leaves ``(N, ...)``.

    Returns:
      A stack of that structure, each member taken from one of the two.

    Example:
      >>> improved = val_losses < best_losses  # (N,)
      >>> best_states = select_members(improved, states, best_states)
    """

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        where = jnp.reshape(jnp.asarray(mask, bool), (-1,) + (1,) * (a.ndim - 1))
        return jnp.where(where, a, b)

    return jax.tree.map(pick, on_true, on_false)


def with_hyperparams(opt_state: Any, **values: Any) -> Any:
    """A copy of ``opt_state`` with the named ``inject_hyperparams`` values replaced.

    Build the transform with ``optax.inject_hyperparams`` (e.g.
    ``optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)``): its state then holds its
    numeric hyperparameters, and ``tx.update`` reads them from there. Setting each member's
    value before :func:`stack_states` gives every member its own hyperparameter in one
    compiled program. Each value keeps the dtype of the value it replaces; a name held by
    several injected states (a chain of them) is set in each. Nothing is changed in place.

    Raises:
      ValueError: ``opt_state`` holds no injected hyperparameters, a name is not one of
        them (the existing names are listed), a name is driven by a schedule (setting it
        would have no effect), or a value is not a scalar.

    Example:
      >>> tx = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
      >>> opt_state = with_hyperparams(init_opt_state(tx, state), learning_rate=3e-4)
      >>> float(opt_state.hyperparams["learning_rate"])
      0.0003
    """
    for name, value in values.items():
        if np.ndim(value) != 0:
            raise ValueError(
                f"hyperparameter {name!r} must be a scalar, got shape {np.shape(value)}."
            )
    return _members.replace_hyperparams(opt_state, values)


def hyperparam_names(opt_state: Any) -> tuple[set[str], set[str]]:
    """The numeric hyperparameters ``optax.inject_hyperparams`` keeps in ``opt_state``.

    Args:
      opt_state: an optax state, one member's or stacked; injected states anywhere in it
        (a chain, ``optax.multi_transform``) are found.

    Returns:
      ``(settable, scheduled)``: the names :func:`with_hyperparams` can set, and the names
      a schedule recomputes every step (setting those would have no effect).

    Example:
      >>> tx = optax.inject_hyperparams(optax.adam)(
      ...     learning_rate=optax.linear_schedule(1e-3, 0.0, 100), b1=0.9)
      >>> settable, scheduled = hyperparam_names(init_opt_state(tx, state))
      >>> sorted(settable), sorted(scheduled)
      (['b1', 'b2', 'eps', 'eps_root'], ['learning_rate'])
    """
    return _members.hyperparam_names(opt_state)


def hyperparam_value(opt_state: Any, name: str) -> Any:
    """The value of hyperparameter ``name`` that ``optax.inject_hyperparams`` keeps.

    Args:
      opt_state: an optax state, one member's or stacked.
      name: a hyperparameter's name, e.g. ``"learning_rate"`` (scheduled ones included:
        their state holds the value of the last step).

    Returns:
      The value in the first injected state holding ``name``: a scalar array, or ``(N,)``
      in a stacked state; None where no injected state holds it.

    Example:
      >>> opt_states = stack_states([with_hyperparams(opt_state, learning_rate=lr)
      ...                            for lr in (1e-3, 3e-4)])
      >>> hyperparam_value(opt_states, "learning_rate")
      Array([0.001 , 0.0003], dtype=float32)
    """
    for node in _members.injected_states(opt_state):
        if name in node.hyperparams:
            return node.hyperparams[name]
    return None
