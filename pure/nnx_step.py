"""A stateful NNX training step, as written for Flax's own loops, as a pure :class:`Step`.

Flax's tutorials write a step that mutates its objects: ``train_step(model, optimizer,
metrics, rngs, batch)`` calls ``optimizer.update(model, grads)`` and ``metrics.update(...)``
and returns nothing, or a loss. :func:`nnx_train_step` runs such a function unchanged inside
pure code: the objects are split into ``(graphdef, state)`` once, and each ``update`` merges
them, calls the function, and returns the objects' new state. A ``lax.scan`` over it is
what Flax's ``nnx.scan`` over ``nnx.Carry`` does, written on the pure core.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
from flax import nnx

from nnxscan.pure.step import Step
from nnxscan.pure.threefry import _unrolled_on_cpu

__all__ = ["nnx_train_step", "step_outputs"]


def step_outputs(out: Any) -> tuple[Any, dict[str, Any] | Any, bool]:
    """What a stateful step returned, as ``(loss, aux, has_loss)``.

    ``None`` (nothing): no loss, empty aux; a scalar: the loss; ``(loss, aux)``: both; a
    dict (Keras' ``train_step`` returns one): its ``"loss"`` entry, if any, is the loss
    and the other entries the aux. Without a loss, ``loss`` is a NaN placeholder and
    ``has_loss`` False (a Python bool, known while tracing).

    Example:
      >>> step_outputs({"loss": 0.5, "accuracy": 0.9})
      (0.5, {'accuracy': 0.9}, True)
    """
    if out is None:
        return jnp.float32(jnp.nan), {}, False
    if isinstance(out, Mapping):
        aux = {k: v for k, v in out.items() if k != "loss"}
        if "loss" in out:
            return out["loss"], aux, True
        return jnp.float32(jnp.nan), aux, False
    if isinstance(out, tuple | list):
        if len(out) != 2:
            raise ValueError(
                f"train_step returned a {type(out).__name__} of {len(out)} values; return "
                f"nothing, a scalar loss, (loss, aux) or a dict of scalars."
            )
        return out[0], out[1], True
    if jnp.shape(out) != ():
        raise ValueError(
            f"train_step returned an array of shape {jnp.shape(out)}; return a scalar loss "
            f"(reduce it, e.g. with jnp.mean), (loss, aux) or a dict of scalars."
        )
    return out, {}, True


def nnx_train_step(fn: Callable[..., Any]) -> Step:
    """The pure :class:`Step` of a stateful NNX step ``fn(*objects, batch)``.

    Split the tuple of the objects ``fn`` takes before the batch, and run the step
    anywhere a :class:`Step` runs (``scan_steps``, ``make_epoch``, your own ``lax.scan``):

    Args:
      fn: ``fn(*objects, batch)`` that trains by mutating its NNX objects (model,
        ``nnx.Optimizer``, metrics, ``nnx.Rngs``...), as Flax's tutorials write it (an
        ``@nnx.jit`` decoration is fine). It returns nothing, a scalar loss,
        ``(loss, aux)`` or a dict of scalars (see :func:`step_outputs`).

    Returns:
      ``Step(init, update, has_aux=True)``: ``init`` returns ``()`` (every state lives in
      the objects), ``update(graphdef, state, (), batch) -> (state, (), (loss, aux))`` with
      ``graphdef, state = nnx.split(objects)``. A step that reports no loss gives NaN.

    Example:
      >>> def train_step(model, optimizer, batch):
      ...     loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
      ...     optimizer.update(model, grads)
      ...     return loss
      >>> step = nnx_train_step(train_step)
      >>> graphdef, state = nnx.split((model, optimizer))
      >>> state, _, (losses, aux) = scan_steps(step, graphdef, state, (), batches)
      >>> nnx.update((model, optimizer), state)
    """
    if not callable(fn):
        raise TypeError(f"train_step must be callable, got {type(fn).__name__}.")

    def init(graphdef: nnx.GraphDef, state: nnx.State) -> tuple:
        return ()

    def update(graphdef: nnx.GraphDef, state: nnx.State, opt_state: Any, batch: Any):
        objects = nnx.merge(graphdef, state)
        if not isinstance(objects, tuple):
            objects = (objects,)
        loss, aux, _ = step_outputs(fn(*objects, batch))
        return nnx.state(objects if len(objects) > 1 else objects[0]), opt_state, (loss, aux)

    # As make_train_step's: draws through the threefry hash unrolled on the CPU.
    return Step(init, _unrolled_on_cpu(update), has_aux=True)
