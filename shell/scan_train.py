"""``scan_train``: one compiled scan over many batches, on the user's model and optimizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure._checks import abstract_batch, check_leading_size
from nnxscan.shell._calls import LiveState, plan_calls, prepare_execution, run_calls
from nnxscan.shell._owner import Owner
from nnxscan.shell._placement import Placement
from nnxscan.shell._plans import Plan, resolve_plan
from nnxscan.shell._programs import train_program

__all__ = ["scan_train"]


def scan_train(
    model: nnx.Module,
    optimizer: nnx.Optimizer,
    loss_fn: Callable[[nnx.Module, Any], Any],
    batches: Any,
    *,
    execution: str | Plan = "auto",
) -> jax.Array:
    """Trains one step per entry of the leading axis of ``batches``, compiled as one scan.

    ``model`` and ``optimizer`` (its optax state and ``step`` counter) are updated in place,
    exactly as ``optimizer.update(model, grads)`` in a per-step loop would. A second call with
    the same ``loss_fn``, optimizer and shapes compiles nothing.

    Args:
      model: the ``nnx.Module`` to train.
      optimizer: an ``nnx.Optimizer`` built on ``model`` (its ``tx`` and ``wrt`` are used).
      loss_fn: ``loss_fn(model, batch)`` returning a scalar.
      batches: a pytree whose leaves share a leading steps axis: ``(steps, batch, ...)``.
      execution: the plan, as for :class:`Trainer` (``"auto"`` by default).

    Returns:
      The per-step losses, a ``(steps,)`` device array (not synced to the host).

    Example:
      >>> optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
      >>> losses = scan_train(model, optimizer, loss_fn, {"x": xs, "y": ys})  # (steps, B, ..)
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}.")
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"optimizer must be an nnx.Optimizer, got {type(optimizer).__name__}. For a plain "
            f"optax transform use Trainer or nnxscan.pure.scan_steps."
        )
    num_steps = check_leading_size(batches, "batches")
    explicit = resolve_plan(execution)
    owner = Owner(model, optimizer)
    graphdef, state, opt_state = owner.read()
    program = train_program(loss_fn, owner.tx, owner.wrt, False)
    batches = Placement().put_data(batches, state)
    one_batch = abstract_batch(batches, drop_leading=True)
    execution = prepare_execution(program, explicit, graphdef, state, opt_state, one_batch)
    live = LiveState(state, opt_state, owner.writer())
    indices = jnp.arange(num_steps, dtype=jnp.int32)
    calls = plan_calls(execution.plan, batches, indices, num_steps)
    outs = run_calls(program, execution, graphdef, live, calls)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs)
