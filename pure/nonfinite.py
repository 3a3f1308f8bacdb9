"""Non-finite guards that stay inside the compiled loop: selects, never host syncs."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure.step import Step

__all__ = ["all_finite", "halt_after_nonfinite", "skip_nonfinite", "tree_select"]


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


def _fresh_nodes(*trees: Any) -> tuple:
    """New pytree nodes (Variables, States) over the same arrays, for the step to take.

    A step that merges its state (``nnx.merge``, ``copy=False`` by default) and updates
    the module writes into the very Variables of the state it was given: without a
    fresh copy, the "old" state a guard falls back on would hold the new values. Free
    at run time (no array is copied)."""
    return tuple(jax.tree.map(lambda x: x, tree) for tree in trees)


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
        new_state, new_opt_state, out = step(graphdef, *_fresh_nodes(state, opt_state), batch)
        loss = out[0] if has_aux else out
        stop = halted | ~jnp.isfinite(loss)
        state = tree_select(stop, state, new_state)
        opt_state = tree_select(stop, opt_state, new_opt_state)
        loss = jnp.where(stop, jnp.nan, loss)
        out = (loss, out[1]) if has_aux else loss
        return state, (opt_state, stop), out

    return halting


def skip_nonfinite(step: Any, *, has_aux: bool | None = None) -> Any:
    """Wraps any step so that a step whose loss or new state is not finite changes nothing.

    The guard for a step you wrote (a :class:`~nnxscan.pure.Step`, or any
    ``step(graphdef, state, opt_state, batch)``): after ``update`` runs, its loss and every
    floating leaf of the new ``state`` and ``opt_state`` are checked; when one is not
    finite the step keeps the old ``state`` and ``opt_state`` and reports a NaN loss (a
    ``jnp.where`` select, no host sync). The gradient is not seen here, only what it made:
    :func:`~nnxscan.pure.make_train_step`'s own ``skip_nonfinite=True`` judges the gradient
    itself and still advances RNG counts.

    Args:
      step: the step to guard.
      has_aux: whether it reports ``(loss, aux)``; by default ``step.has_aux`` (False for
        a plain function).

    Returns:
      A step of the same kind (a ``Step`` for a ``Step``, with the same ``init``).

    Example:
      >>> guarded = skip_nonfinite(my_step)
      >>> state, opt_state, losses = scan_steps(guarded, graphdef, state, opt_state, batches)
    """
    if has_aux is None:
        has_aux = bool(getattr(step, "has_aux", False))
    update = step.update if isinstance(step, Step) else step

    def skipping(graphdef: nnx.GraphDef, state: nnx.State, opt_state: Any, batch: Any):
        new_state, new_opt_state, out = update(graphdef, *_fresh_nodes(state, opt_state), batch)
        loss = out[0] if has_aux else out
        ok = jnp.isfinite(loss) & all_finite(new_state, new_opt_state)
        state = tree_select(ok, new_state, state)
        opt_state = tree_select(ok, new_opt_state, opt_state)
        loss = jnp.where(ok, loss, jnp.nan)
        return state, opt_state, ((loss, out[1]) if has_aux else loss)

    if isinstance(step, Step):
        return Step(step.init, skipping, has_aux)
    return skipping
