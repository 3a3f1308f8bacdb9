"""Helpers over a population's stacked pytrees: leaf paths, the members axis, and the
``optax.inject_hyperparams`` states in an optax state (their names, values replaced).

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


def num_members_of(stacked: Any, what: str = "states") -> int:
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


def hyperparam_names(opt_state: Any) -> tuple[set[str], set[str]]:
    """``(settable, scheduled)`` injected hyperparameter names (see population.py)."""
    settable: set[str] = set()
    scheduled: set[str] = set()
    for node in injected_states(opt_state):
        names = set(node.hyperparams)
        schedules = set(getattr(node, "hyperparams_states", None) or {})
        settable |= names - schedules
        scheduled |= schedules
    return settable, scheduled


def replace_hyperparams(opt_state: Any, values: dict[str, Any]) -> Any:
    """A copy of ``opt_state`` with the injected hyperparameters ``values`` written in,
    each in the dtype and shape of the value it replaces (a scalar in one member's state,
    ``(N,)`` in a stacked one); raises ValueError for a name that cannot be set."""
    settable, scheduled = hyperparam_names(opt_state)
    if not settable and not scheduled:
        raise ValueError(
            "this optax state holds no injected hyperparameters: build the transform with "
            "optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)"
            "(learning_rate=1e-3)."
        )
    for name in values:
        if name in scheduled:
            raise ValueError(
                f"hyperparameter {name!r} is a schedule, recomputed every step: a value set "
                f"in the state has no effect. Pass a number for it to inject_hyperparams."
            )
        if name not in settable:
            raise ValueError(
                f"{name!r} is not a hyperparameter of this transform; its injected "
                f"hyperparameters are {sorted(settable)}."
            )

    def replace(node: Any) -> Any:
        if not is_injected(node):
            return node
        new = {
            k: jnp.asarray(values[k], jnp.result_type(v)).reshape(jnp.shape(v))
            if k in values
            else v
            for k, v in node.hyperparams.items()
        }
        return node._replace(hyperparams=new)

    return jax.tree.map(replace, opt_state, is_leaf=is_injected)
