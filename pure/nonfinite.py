"""Non-finite guards that stay inside the compiled loop: selects, never host syncs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["all_finite", "halt_after_nonfinite", "tree_select"]


def all_finite(*trees: Any) -> jax.Array:
    """A scalar bool: every floating leaf of ``trees`` is finite.

    Example:
      >>> all_finite(loss, grads)
      Array(True, dtype=bool)
    """
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(trees)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(checks)) if checks else jnp.bool_(True)


def tree_select(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """``jnp.where(pred, a, b)`` leaf by leaf, for two trees of the same structure.

    Example:
      >>> params = tree_select(all_finite(loss, grads), new_params, params)
    """
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def halt_after_nonfinite(step: Any, *, has_aux: bool = False) -> Any:
    """Wraps a step so that from its first non-finite loss on, nothing changes any more.

    The wrapped step carries ``(opt_state, halted)`` in place of ``opt_state``; once a step's
    loss is not finite, it and every later step leave state and optax state as they were
    and report a NaN loss. Scanning it over a chunk and starting with ``halted=False``
    stops training exactly before the offending step, with no host sync.

    Example:
      >>> halting = halt_after_nonfinite(step)
      >>> state, (opt_state, halted), losses = scan_steps(
      ...     halting, graphdef, state, (opt_state, jnp.bool_(False)), batches)
    """

    def halting(graphdef: nnx.GraphDef, state: nnx.State, carry: Any, batch: Any):
        opt_state, halted = carry
        new_state, new_opt_state, out = step(graphdef, state, opt_state, batch)
        loss = out[0] if has_aux else out
        stop = halted | ~jnp.isfinite(loss)
        state = tree_select(stop, state, new_state)
        opt_state = tree_select(stop, opt_state, new_opt_state)
        loss = jnp.where(stop, jnp.nan, loss)
        out = (loss, out[1]) if has_aux else loss
        return state, (opt_state, stop), out

    return halting
