"""Non-finite guards that stay inside the compiled loop: selects, never host syncs."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure.step import Step

__all__ = ["HaltState", "all_finite", "halt_after_nonfinite", "skip_nonfinite", "tree_select"]


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


class HaltState(NamedTuple):
    """The state of :func:`halt_after_nonfinite`'s step: the inner step's state, and
    whether a non-finite loss halted training (a scalar bool; per member under
    :func:`~nnxscan.pure.vmap_members`).

    Example:
      >>> carry = HaltState(opt_state, jnp.bool_(False))  # around a state you hold
      >>> state, carry, losses = scan_steps(halting, graphdef, state, carry, batches)
      >>> opt_state, stopped = carry.inner, bool(carry.halted)
    """

    inner: Any
    halted: jax.Array


def _update_of(step: Any) -> Any:
    return step.update if isinstance(step, Step) else step


def _init_of(step: Any, guard: str) -> Any:
    if isinstance(step, Step):
        return step.init

    def init(graphdef: nnx.GraphDef, state: nnx.State) -> Any:
        raise TypeError(
            f"{guard} wrapped a plain step function, which has no init: wrap a "
            f"nnxscan.pure.Step (make_train_step returns one), or build the state yourself."
        )

    return init


def halt_after_nonfinite(step: Any, *, has_aux: bool | None = None) -> Step:
    """Wraps a step so that from its first non-finite loss on, nothing changes any more.

    The wrapped step's state is a :class:`HaltState` ``(inner, halted)``: once a step's loss
    is not finite (any element of it: every member's, for a population's step), it and every
    later step leave the model state and the inner state as they were and report a NaN loss.
    Scanning it over a chunk stops training exactly before the offending step, with no host
    sync; ``halted`` says whether it did. ``vmap_members(halt_after_nonfinite(step))``
    halts each member at its own first non-finite loss.

    Args:
      step: the step to guard (a :class:`~nnxscan.pure.Step`, or a step function).
      has_aux: whether it reports ``(loss, aux)``; by default ``step.has_aux``.

    Returns:
      A ``Step``: ``init`` wraps the inner ``init`` (``halted=False``); for a step function,
      build the state as ``HaltState(opt_state, jnp.bool_(False))``.

    Example:
      >>> halting = halt_after_nonfinite(step)
      >>> state, halt, losses = scan_steps(
      ...     halting, graphdef, state, HaltState(opt_state, jnp.bool_(False)), batches)
      >>> bool(halt.halted), halt.inner  # whether it stopped, the inner optax state
    """
    if has_aux is None:
        has_aux = bool(getattr(step, "has_aux", False))
    update, init = _update_of(step), _init_of(step, "halt_after_nonfinite")

    def halting_init(graphdef: nnx.GraphDef, state: nnx.State) -> HaltState:
        return HaltState(init(graphdef, state), jnp.bool_(False))

    def halting(graphdef: nnx.GraphDef, state: nnx.State, opt_state: HaltState, batch: Any):
        inner = opt_state.inner
        new_state, new_inner, out = update(graphdef, *_fresh_nodes(state, inner), batch)
        loss = out[0] if has_aux else out
        stop = opt_state.halted | ~all_finite(loss)
        state = tree_select(stop, state, new_state)
        inner = tree_select(stop, inner, new_inner)
        loss = jnp.where(stop, jnp.nan, loss)
        out = (loss, out[1]) if has_aux else loss
        return state, HaltState(inner, stop), out

    return Step(halting_init, halting, has_aux)


def skip_nonfinite(step: Any, *, has_aux: bool | None = None) -> Step:
    """Wraps any step so that a step whose loss or new state is not finite changes nothing.

    The guard for a step you wrote (a :class:`~nnxscan.pure.Step`, or any
    ``step(graphdef, state, opt_state, batch)``): after ``update`` runs, its loss and every
    floating leaf of the new ``state`` and ``opt_state`` are checked; when one is not
    finite the step keeps the old ``state`` and ``opt_state`` and reports a NaN loss (a
    ``jnp.where`` select, no host sync). The gradient is not seen here, only what it made:
    :func:`~nnxscan.pure.make_train_step`'s own ``skip_nonfinite=True`` judges the gradient
    itself and still advances RNG counts. Around a population's step
    (:func:`~nnxscan.pure.vmap_members`) it skips every member's step when any member's is
    not finite; inside it (``vmap_members(skip_nonfinite(step))``), each member's alone.

    Args:
      step: the step to guard.
      has_aux: whether it reports ``(loss, aux)``; by default ``step.has_aux`` (False for
        a plain function).

    Returns:
      A ``Step`` with the inner step's ``init`` and state.

    Example:
      >>> guarded = skip_nonfinite(my_step)
      >>> state, opt_state, losses = scan_steps(guarded, graphdef, state, opt_state, batches)
    """
    if has_aux is None:
        has_aux = bool(getattr(step, "has_aux", False))
    update = _update_of(step)

    def skipping(graphdef: nnx.GraphDef, state: nnx.State, opt_state: Any, batch: Any):
        new_state, new_opt_state, out = update(graphdef, *_fresh_nodes(state, opt_state), batch)
        loss = out[0] if has_aux else out
        ok = all_finite(loss, new_state, new_opt_state)
        state = tree_select(ok, new_state, state)
        opt_state = tree_select(ok, new_opt_state, opt_state)
        loss = jnp.where(ok, loss, jnp.nan)
        return state, opt_state, ((loss, out[1]) if has_aux else loss)

    return Step(_init_of(step, "skip_nonfinite"), skipping, has_aux)
