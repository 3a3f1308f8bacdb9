"""Scan a pure step over many batches: given as a stack, or gathered from a data set by index.

Both go through one loop body (:func:`_scan_batches`), so a step trained from a stack of
batches and the same step trained on rows gathered from the data set compute the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure._checks import check_leading_size
from nnxscan.pure.train_step import StepFn

__all__ = ["scan_steps"]


def shard_batch(batch: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """Constrains every leaf of ``batch`` to ``sharding`` (its batch axis over devices).

    ``None`` leaves it alone. Inside a compiled loop this is what makes a step
    data-parallel: XLA then all-reduces the gradient itself.
    """
    if sharding is None:
        return batch
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), batch)


def take_batch(data: Any, indices: jax.Array) -> Any:
    """Gathers the rows ``indices`` of every leaf of ``data``."""
    return jax.tree.map(lambda x: jnp.take(x, indices, axis=0), data)


def scan_loop(body: Any, carry: Any, xs: Any, *, unroll: int | bool = 1) -> tuple[Any, Any]:
    """``lax.scan(body, carry, xs, unroll=unroll)``, except that a fully unrolled scan of
    length 1 really has no loop.

    jax 0.10 lowers ``lax.scan(..., unroll=True)`` of length 1 to a ``while`` loop, and on
    the CPU a loop body runs convolution gradients far slower (jax#12868): a one-step call
    must not pay that.
    """
    length = jax.tree.leaves(xs)[0].shape[0]
    full = unroll is True or (not isinstance(unroll, bool) and unroll >= length)
    if length == 1 and full:
        carry, out = body(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda y: y[None], out)
    return jax.lax.scan(body, carry, xs, unroll=unroll)


def _scan_batches(
    step: StepFn,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    opt_state: Any,
    xs: Any,
    batch_of: Callable[[Any], Any],
    *,
    unroll: int | bool,
    batch_sharding: jax.sharding.Sharding | None,
) -> tuple[nnx.State, Any, Any]:
    """The one training loop body: ``step`` on ``batch_of(x)`` for each entry ``x`` of ``xs``."""

    def body(carry, x):
        state, opt_state = carry
        batch = shard_batch(batch_of(x), batch_sharding)
        state, opt_state, out = step(graphdef, state, opt_state, batch)
        return (state, opt_state), out

    (state, opt_state), outs = scan_loop(body, (state, opt_state), xs, unroll=unroll)
    return state, opt_state, outs


def scan_steps(
    step: StepFn,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    opt_state: Any,
    batches: Any,
    *,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> tuple[nnx.State, Any, Any]:
    """Runs ``step`` once per entry of the leading axis of ``batches`` with ``lax.scan``.

    Args:
      step: a step from :func:`make_train_step`.
      graphdef, state: ``nnx.split(model)``.
      opt_state: from :func:`init_opt_state`.
      batches: a pytree whose leaves share a leading steps axis ``(steps, batch, ...)``.
      unroll: forwarded to ``lax.scan``; ``True`` unrolls fully (no loop left), which is
        faster on the CPU for convolution gradients (jax#12868).
      batch_sharding: shard each batch's leading axis, e.g.
        ``NamedSharding(mesh, P("data"))``, for data-parallel steps.

    Returns:
      ``(state, opt_state, losses)`` with ``losses`` stacked along the steps axis (a
      ``(loss, aux)`` pair of stacks for a ``has_aux`` step).

    Example:
      >>> state, opt_state, losses = jax.jit(scan_steps, static_argnums=0)(
      ...     step, graphdef, state, opt_state, batches)
    """
    check_leading_size(batches, "batches")
    return _scan_batches(
        step, graphdef, state, opt_state, batches, lambda batch: batch,
        unroll=unroll, batch_sharding=batch_sharding,
    )  # fmt: skip


def scan_indexed_steps(
    step: StepFn,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    opt_state: Any,
    data: Any,
    indices: jax.Array,
    *,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> tuple[nnx.State, Any, Any]:
    """Scans ``step`` over batches gathered from ``data`` by an ``(steps, batch)`` index array.

    This is the body of an epoch (and of every compiled call of one in the shell). The
    gather happens inside the loop, so memory holds one batch at a time besides ``data``.
    """
    return _scan_batches(
        step, graphdef, state, opt_state, indices, lambda idx: take_batch(data, idx),
        unroll=unroll, batch_sharding=batch_sharding,
    )  # fmt: skip
