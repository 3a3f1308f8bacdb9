"""The one batching primitive: an order of examples cut into batches, over optional leading
member axes, and the "full batches, then the short tail once" rule every epoch and every
evaluation follows.

Epochs (``make_epoch``), population epochs, evaluations and the shell's compiled calls all
cut their orders here, so a loop of pure functions and ``Trainer.fit`` see the same batches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def cut_batches(order: Any, batch_size: int, *, drop_remainder: bool) -> tuple[Any, Any | None]:
    """Cuts orders of shape ``(..., n)`` into ``(full, tail)``.

    ``full`` has shape ``(..., n // batch_size, batch_size)``; ``tail`` holds the short
    final batch as a stack of ONE step, ``(..., 1, n % batch_size)``, or is ``None`` (dropped,
    or no remainder). The leading axes (members of a population) are kept. numpy in, numpy
    out; a JAX array in, JAX out.
    """
    *lead, n = order.shape
    num_full = n // batch_size
    full = order[..., : num_full * batch_size].reshape(*lead, num_full, batch_size)
    if drop_remainder or n == num_full * batch_size:
        return full, None
    return full, order[..., None, num_full * batch_size :]


def take_batch(data: Any, indices: jax.Array) -> Any:
    """Gathers the rows ``indices`` of every leaf of ``data`` (a scalar index: one row)."""
    return jax.tree.map(lambda x: jnp.take(x, indices, axis=0), data)


def constrain(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` with ``sharding`` inside a traced function, on any mesh: on an Explicit mesh
    the sharding is part of the array's type, so it is changed with
    ``jax.sharding.reshard``; on an Auto mesh ``with_sharding_constraint`` tells XLA."""
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if types and all(t == jax.sharding.AxisType.Explicit for t in types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def shard_batch(batch: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """Constrains every leaf of ``batch`` to ``sharding`` (its batch axis over devices).

    ``None`` leaves it alone. Inside a compiled loop this is what makes a step
    data-parallel: XLA then all-reduces the gradient itself.
    """
    if sharding is None:
        return batch
    return jax.tree.map(lambda x: constrain(x, sharding) if _divides(x, sharding) else x, batch)


def _divides(x: jax.Array, sharding: jax.sharding.Sharding) -> bool:
    """Whether the leading dimension splits evenly over the sharding's first entry (a
    short final batch that does not stays as it is)."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if not spec or spec[0] is None or mesh is None or not jnp.ndim(x):
        return True
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    size = 1
    for axis in axes:
        size *= mesh.shape[axis]
    return jnp.shape(x)[0] % size == 0


def full_then_tail(
    scan: Callable[[Any, Any, int | bool], tuple[Any, Any]],
    carry: Any,
    full: Any,
    tail: Any | None,
    *,
    unroll: int | bool = 1,
    steps_axis: int = 0,
) -> tuple[Any, Any]:
    """Runs ``scan(carry, indices, unroll) -> (carry, outs)`` over the full batches, then
    over the tail once, fully unrolled (a step of its own shape, no loop: on the CPU a loop
    body runs convolution gradients far slower).

    ``full``'s steps run along ``steps_axis`` (1 for a population's ``(N, steps, batch)``);
    ``outs`` always have a leading steps axis and are joined along it. An epoch with no
    full batch runs the tail alone; ``outs`` is ``None`` when nothing ran.
    """
    outs = None
    if full.shape[steps_axis]:
        carry, outs = scan(carry, full, unroll)
    if tail is not None:
        carry, tail_outs = scan(carry, tail, True)
        outs = tail_outs if outs is None else jax.tree.map(_concat, outs, tail_outs)
    return carry, outs


def _concat(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b], axis=0)
