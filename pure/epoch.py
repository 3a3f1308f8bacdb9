"""Scanned epochs: permute, cut into batches and train, all inside one traced function.

The data stays where it is (on the device): each step gathers its batch by index inside the
loop body, so an epoch never copies the data set and never returns to the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure.scan import scan_loop, shard_batch
from nnxscan.pure.train_step import StepFn
from nnxscan.pure.validation import check_batch_size, check_leading_size

__all__ = ["batch_indices", "make_epoch", "scan_indexed_steps", "take_batch"]


def batch_indices(
    key: jax.Array | None,
    num_examples: int,
    batch_size: int,
    *,
    drop_remainder: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
    """Example indices of one epoch, cut into batches.

    Args:
      key: a PRNG key to permute the examples with, or ``None`` to keep their order.
      num_examples, batch_size: static Python ints.
      drop_remainder: drop the ``num_examples % batch_size`` examples that do not fill a
        batch, or return them as a short tail batch.

    Returns:
      ``(full, tail)``: ``full`` is ``(num_batches, batch_size)`` int32; ``tail`` is the short
      final batch's ``(num_examples % batch_size,)`` indices, or ``None``.

    Example:
      >>> full, tail = batch_indices(jax.random.key(0), 10, 4, drop_remainder=False)
      >>> full.shape, tail.shape
      ((2, 4), (2,))
    """
    batch_size = check_batch_size(batch_size, num_examples, drop_remainder=drop_remainder)
    order = (
        jnp.arange(num_examples, dtype=jnp.int32)
        if key is None
        else jax.random.permutation(key, num_examples).astype(jnp.int32)
    )
    num_full = num_examples // batch_size
    full = order[: num_full * batch_size].reshape(num_full, batch_size)
    rem = num_examples - num_full * batch_size
    tail = None if drop_remainder or rem == 0 else order[num_full * batch_size :]
    return full, tail


def take_batch(data: Any, indices: jax.Array) -> Any:
    """Gathers the rows ``indices`` of every leaf of ``data``."""
    return jax.tree.map(lambda x: jnp.take(x, indices, axis=0), data)


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

    This is the body of an epoch (and of every chunk of one). The gather happens inside the
    loop, so memory holds one batch at a time besides ``data`` itself. ``batch_sharding``
    (e.g. ``NamedSharding(mesh, P("data"))``) shards each gathered batch, making the step
    data-parallel.

    Example:
      >>> full, _ = batch_indices(key, n, 32)
      >>> state, opt_state, losses = scan_indexed_steps(step, g, state, opt, data, full)
    """

    def body(carry, idx):
        state, opt_state = carry
        batch = shard_batch(take_batch(data, idx), batch_sharding)
        state, opt_state, out = step(graphdef, state, opt_state, batch)
        return (state, opt_state), out

    (state, opt_state), outs = scan_loop(body, (state, opt_state), indices, unroll=unroll)
    return state, opt_state, outs


def make_epoch(
    step: StepFn,
    *,
    batch_size: int,
    shuffle: bool = True,
    drop_remainder: bool = True,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable[..., tuple[nnx.State, Any, Any]]:
    """Builds ``epoch(graphdef, state, opt_state, data, key)`` that trains one epoch.

    The epoch permutes the examples with ``key`` (when ``shuffle``), cuts them into batches of
    ``batch_size`` and scans ``step`` over them. With ``drop_remainder=False`` a final short
    batch is trained as one more step of its own shape (no padding, no masking), so every
    example is used exactly once.

    Returns:
      ``epoch(graphdef, state, opt_state, data, key) -> (state, opt_state, losses)``;
      ``data`` is a pytree whose leaves share a leading examples axis; ``key`` may be ``None``
      when ``shuffle=False``. ``losses`` has one entry per step.

    Example:
      >>> epoch = jax.jit(make_epoch(step, batch_size=32))
      >>> for i in range(10):
      ...     state, opt_state, losses = epoch(graphdef, state, opt_state, data,
      ...                                      jax.random.key(i))
    """
    check_batch_size(batch_size, batch_size, drop_remainder=False)

    def epoch(graphdef, state, opt_state, data, key):
        n = check_leading_size(data, "data")
        if shuffle and key is None:
            raise ValueError("epoch(..., key=None) needs a PRNG key when shuffle=True.")
        full, tail = batch_indices(
            key if shuffle else None, n, batch_size, drop_remainder=drop_remainder
        )
        outs = None
        if full.shape[0]:
            state, opt_state, outs = scan_indexed_steps(
                step, graphdef, state, opt_state, data, full, unroll=unroll,
                batch_sharding=batch_sharding,
            )  # fmt: skip
        if tail is not None:
            tail_batch = shard_batch(take_batch(data, tail), batch_sharding)
            state, opt_state, out = step(graphdef, state, opt_state, tail_batch)
            out = jax.tree.map(lambda x: x[None], out)
            outs = out if outs is None else jax.tree.map(_concat, outs, out)
        return state, opt_state, outs

    return epoch


def _concat(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b], axis=0)
