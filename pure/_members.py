"""Helpers over a population's stacked pytrees: the members axis, one member, a mask of
members, and the hyperparameters ``optax.inject_hyperparams`` keeps in an optax state.

Internal: the public population functions (``nnxscan.pure.stack_states`` and friends) and
the shell build on these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def leaf_paths(tree: Any) -> dict[str, Any]:
    """``{path: leaf}`` of a pytree, paths as readable strings."""
    return {
        jax.tree_util.keystr(path) or "<root>": leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
    }


def shape_dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(np.shape(leaf)), str(leaf.dtype)


def members_of(stacked: Any, what: str = "states") -> int:
    """The size of the leading members axis every leaf of ``stacked`` shares."""
    leaves = leaf_paths(stacked)
    if not leaves:
        raise ValueError(f"{what} has no array leaves, so it holds no members.")
    sizes = {path: (np.shape(leaf)[:1] or (None,))[0] for path, leaf in leaves.items()}
    first_path, size = next(iter(sizes.items()))
    for path, other in sizes.items():
        if other is None or other != size:
            raise ValueError(
                f"{what} is not a stack of members: {what}{first_path} has leading size "
                f"{size} but {what}{path} has shape {tuple(np.shape(leaves[path]))}. Build "
                f"it with stack_states([...])."
            )
    return int(size)


def member_state(stacked: Any, index: int) -> Any:
    """Member ``index`` of a stacked pytree (a new pytree; ``stacked`` is left as it is)."""
    return jax.tree.map(lambda x: x[index], stacked)


def select_members(mask: Any, on_true: Any, on_false: Any) -> Any:
    """Member ``i`` of ``on_true`` where ``mask[i]``, else of ``on_false`` (two stacks of
    one structure; ``mask`` has shape ``(N,)``)."""

    def pick(a: jax.Array, b: jax.Array) -> jax.Array:
        where = jnp.reshape(jnp.asarray(mask, bool), (-1,) + (1,) * (a.ndim - 1))
        return jnp.where(where, a, b)

    return jax.tree.map(pick, on_true, on_false)


def is_injected(node: Any) -> bool:
    """An ``optax.inject_hyperparams`` state: a NamedTuple with a ``hyperparams`` dict."""
    return (
        isinstance(node, tuple)
        and hasattr(node, "_replace")
        and isinstance(getattr(node, "hyperparams", None), dict)
    )


def injected_states(opt_state: Any) -> list[Any]:
    return [n for n in jax.tree.leaves(opt_state, is_leaf=is_injected) if is_injected(n)]


def hyperparam_names(opt_state: Any) -> tuple[set[str], set[str]]:
    """``(settable, scheduled)``: the numeric hyperparameter names ``inject_hyperparams``
    keeps in ``opt_state``, and those among them that a schedule recomputes every step."""
    settable: set[str] = set()
    scheduled: set[str] = set()
    for node in injected_states(opt_state):
        names = set(node.hyperparams)
        schedules = set(getattr(node, "hyperparams_states", None) or {})
        settable |= names - schedules
        scheduled |= schedules
    return settable, scheduled


def injected_values(opt_state: Any, name: str) -> Any:
    """The value of hyperparameter ``name`` in the first injected state holding it (an
    array with a leading members axis in a stacked state), or None."""
    for node in injected_states(opt_state):
        if name in node.hyperparams:
            return node.hyperparams[name]
    return None


def check_orders(orders: Any, members: int, n: int) -> None:
    """``orders`` must be a signed int array of shape ``(members, n)``."""
    dtype = getattr(orders, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.signedinteger):
        raise TypeError(
            f"orders must be a signed integer array of shape ({members}, {n}), e.g. "
            f"np.stack([epoch_order(seed, epoch, {n}) for seed in seeds]); got "
            f"{type(orders).__name__} with dtype {dtype}."
        )
    if tuple(np.shape(orders)) != (members, n):
        raise ValueError(
            f"orders has shape {tuple(np.shape(orders))}, but there are {members} members "
            f"and {n} examples: pass one order per member, shape ({members}, {n})."
        )
