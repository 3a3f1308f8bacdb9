"""Helpers over a population's stacked pytrees: leaf paths, the members axis, the
``optax.inject_hyperparams`` states in an optax state, and a check of members' orders.

Internal: the public population functions (``nnxscan.pure.stack_states``,
``member_state``, ``hyperparam_names`` and the others in ``pure/population.py``) build on
these.
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


def is_injected(node: Any) -> bool:
    """A hyperparameter state: a NamedTuple with a ``hyperparams`` dict, the shape of
    ``optax.inject_hyperparams``' states (and of a step's own, such as the PPO demo's
    coefficients). The learning-rate LOG reads only optax's own classes (shell logs)."""
    return (
        isinstance(node, tuple)
        and hasattr(node, "_replace")
        and isinstance(getattr(node, "hyperparams", None), dict)
    )


def injected_states(opt_state: Any) -> list[Any]:
    return [n for n in jax.tree.leaves(opt_state, is_leaf=is_injected) if is_injected(n)]


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
