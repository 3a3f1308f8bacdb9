"""Scanned epochs: order the examples, cut them into batches and train, in one traced function.

The data stays where it is (on the device) and never returns to the host. The epoch's
batches are gathered in ONE gather before the loop (a copy of the epoch's examples, in
chunks of steps when that copy would pass a memory budget) and the loop scans the stack as
:func:`~nnxscan.pure.scan_steps` does: a gather by index inside a loop body costs XLA:CPU
more than a small model's whole step.

The order of an epoch is either drawn on the device from a PRNG key, or given as an array,
typically :func:`epoch_order` — the host permutation ``Trainer.fit`` uses, so a loop of
``make_epoch`` calls reproduces ``fit`` exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscan.pure import batching, checks
from nnxscan.pure.scan import scan_indexed_steps
from nnxscan.pure.train_step import StepFn

__all__ = ["epoch_order", "make_epoch"]


def epoch_order(seed: int, epoch: int, num_examples: int, *, shuffle: bool = True) -> np.ndarray:
    """The order of the examples in epoch ``epoch`` of a run seeded with ``seed``.

    ``np.random.default_rng((seed, epoch)).permutation(num_examples)`` as int32: the shuffle
    rule of ``Trainer.fit``. It is drawn on the host, the same in every process and on every
    platform, and costs far less than a permutation on the device (which sorts). Pass it to
    the epoch function :func:`make_epoch` builds to train exactly the batches ``fit`` trains.

    Args:
      seed, epoch: non-negative ints; ``epoch`` is the global epoch index (it keeps counting
        across ``fit`` calls).
      num_examples: the size of the data set.
      shuffle: ``False`` gives ``arange(num_examples)`` (``fit(shuffle=False)``).

    Example:
      >>> epoch_order(0, 3, 10).shape
      (10,)
    """
    seed = checks.check_count(seed, "seed", 0)
    epoch = checks.check_count(epoch, "epoch", 0)
    num_examples = checks.check_count(num_examples, "num_examples", 1)
    if not shuffle:
        return np.arange(num_examples, dtype=np.int32)
    return np.random.default_rng((seed, epoch)).permutation(num_examples).astype(np.int32)


def _is_key(x: Any) -> bool:
    """A typed PRNG key, or a raw one (``jax.random.PRNGKey``: unsigned ints). Orders are
    signed ints, so the two never mix up."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return False
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return jnp.issubdtype(dtype, jnp.unsignedinteger)


def _epoch_order(key_or_order: Any, n: int, shuffle: bool) -> jax.Array:
    """The epoch's order, ``(n,)``; or ``(N, n)``, one per member, from ``N`` keys or an
    ``(N, n)`` order array."""
    if key_or_order is None:
        if shuffle:
            raise ValueError(
                "the epoch needs a PRNG key or an order (epoch_order(seed, epoch, n)) when "
                "shuffle=True; pass one, or build the epoch with shuffle=False."
            )
        return jnp.arange(n, dtype=jnp.int32)
    if _is_key(key_or_order):
        members = _key_members(key_or_order)
        if not shuffle:
            order = jnp.arange(n, dtype=jnp.int32)
            return order if members is None else jnp.broadcast_to(order, (members, n))
        if members is not None:
            permute = jax.vmap(lambda key: jax.random.permutation(key, n))
            return permute(key_or_order).astype(jnp.int32)
        return jax.random.permutation(key_or_order, n).astype(jnp.int32)
    dtype = getattr(key_or_order, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.signedinteger):
        raise TypeError(
            f"the epoch's last argument must be a PRNG key (jax.random.key(i)) or a signed "
            f"integer order array such as epoch_order(seed, epoch, n), got "
            f"{type(key_or_order).__name__} with dtype {dtype}."
        )
    shape = tuple(np.shape(key_or_order))
    if shape[-1:] != (n,) or len(shape) > 2:
        raise ValueError(
            f"the epoch's order has shape {shape}, but the data has {n} examples: pass an "
            f"order of shape ({n},), e.g. epoch_order(seed, epoch, {n}), or one per member, "
            f"shape (members, {n})."
        )
    return jnp.asarray(key_or_order, jnp.int32)


def _key_members(key: Any) -> int | None:
    """The number of members a key array holds keys for (None: one key)."""
    typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
    ndim = np.ndim(key) if typed else np.ndim(key) - 1  # a raw key has a trailing data axis
    if ndim == 0:
        return None
    if ndim == 1:
        return int(np.shape(key)[0])
    raise ValueError(
        f"the epoch's keys have shape {np.shape(key)}: pass one key, or one per member."
    )


def make_epoch(
    step: StepFn,
    *,
    batch_size: int,
    shuffle: bool = True,
    drop_remainder: bool = True,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable[..., tuple[nnx.State, Any, Any]]:
    """Builds ``epoch(graphdef, state, opt_state, data, key_or_order)`` that trains one epoch.

    The epoch orders the examples, cuts them into batches of ``batch_size`` and scans
    ``step`` over them. The order is

    - a PRNG key (``jax.random.key(i)``): a permutation drawn on the device;
    - an int order array of shape ``(num_examples,)``: used as given. With
      ``epoch_order(seed, e, n)`` for ``e = 0, 1, ...`` the loop trains bitwise what
      ``Trainer(model, tx, loss_fn).fit(data, epochs=..., batch_size=..., seed=seed)``
      trains under the ``"scan"`` plan (same ``wrt``, same ``tx``);
    - ``None`` with ``shuffle=False``: the examples in their stored order.

    A population's step (:func:`~nnxscan.pure.vmap_members`) takes one order per member:
    an ``(N, num_examples)`` order array (``np.stack([epoch_order(s, e, n) for s in
    seeds])``, what ``Population.fit`` trains), or ``N`` keys (``jax.random.split(key,
    N)``); each step's batch then has a leading members axis.

    With ``shuffle=False`` a key is ignored, and with no order given each step slices its
    batch from the stored rows: nothing is gathered. With ``drop_remainder=False`` a final short
    batch is trained as one more step of its own shape (no padding, no masking), so every
    example is used exactly once.

    Returns:
      ``epoch(graphdef, state, opt_state, data, key_or_order) -> (state, opt_state,
      losses)``; ``data`` is a pytree whose leaves share a leading examples axis.
      ``losses`` has one entry per step.

    Example:
      >>> epoch = jax.jit(make_epoch(step, batch_size=32))
      >>> for e in range(10):
      ...     state, opt_state, losses = epoch(graphdef, state, opt_state, data,
      ...                                      epoch_order(0, e, n))
    """
    checks.check_batch_size(batch_size, batch_size, drop_remainder=False)

    def epoch(graphdef, state, opt_state, data, key_or_order=None):
        n = checks.check_leading_size(data, "data")
        checks.check_batch_size(batch_size, n, drop_remainder=drop_remainder)
        order = _epoch_order(key_or_order, n, shuffle)
        full, tail = batching.cut_batches(order, batch_size, drop_remainder=drop_remainder)
        if order.ndim == 2:  # one order per member: (N, steps, batch) -> (steps, N, batch)
            full = jnp.swapaxes(full, 0, 1)
            tail = None if tail is None else jnp.swapaxes(tail, 0, 1)
        elif not shuffle and (key_or_order is None or _is_key(key_or_order)):
            # The stored order: each step slices its batch (batch numbers, no gather).
            full = jnp.arange(full.shape[0], dtype=jnp.int32)

        def scan(carry, idx, unroll):
            state, opt_state, outs = scan_indexed_steps(
                step, graphdef, *carry, data, idx, unroll=unroll, batch_sharding=batch_sharding,
                batch_rows=batch_size if idx.ndim == 1 else None,
            )  # fmt: skip
            return (state, opt_state), outs

        (state, opt_state), outs = batching.full_then_tail(
            scan, (state, opt_state), full, tail, unroll=unroll
        )
        return state, opt_state, outs

    return epoch
