"""Scan a pure step over a stack of batches, in one ``lax.scan``.

The loop body is the one every compiled training call of nnxscan runs (``make_epoch``
gathers its epoch's batches once and scans them through the same body).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from nnxscan.pure import _loops, checks
from nnxscan.pure.train_step import StepFn

__all__ = ["scan_steps"]


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
    checks.check_leading_size(batches, "batches")
    return _loops.scan_batches(
        step, graphdef, state, opt_state, batches, lambda batch: batch,
        unroll=unroll, batch_sharding=batch_sharding,
    )  # fmt: skip
