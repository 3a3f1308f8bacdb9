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
from nnxscan.pure.members import _epoch_orders, _epoch_orders_given
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


def _epoch_order(key_or_order: Any, n: int, shuffle: bool, orders: Any) -> jax.Array:
    """The epoch's order, ``(*orders.lead, n)``: ``(n,)`` for one model, ``(N, n)`` for N
    members (:func:`~nnxscan.pure.members._epoch_orders` says which)."""
    if key_or_order is None:
        if shuffle:
            raise ValueError(
                "the epoch needs a PRNG key or an order (epoch_order(seed, epoch, n)) when "
                "shuffle=True; pass one, or build the epoch with shuffle=False."
            )
        return orders.stored(n)
    if _is_key(key_or_order):
        typed = jax.dtypes.issubdtype(key_or_order.dtype, jax.dtypes.prng_key)
        shape = np.shape(key_or_order)
        # A raw key (jax.random.PRNGKey) has a trailing axis of key data.
        if (shape if typed else shape[:-1]) != orders.lead:
            raise ValueError(f"the epoch's keys have shape {shape}: pass {orders.keys_text}.")
        return orders.permutation(key_or_order, n) if shuffle else orders.stored(n)
    dtype = getattr(key_or_order, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.signedinteger):
        raise TypeError(
            f"the epoch's last argument must be a PRNG key (jax.random.key(i)) or a signed "
            f"integer order array such as epoch_order(seed, epoch, n), got "
            f"{type(key_or_order).__name__} with dtype {dtype}."
        )
    shape = tuple(np.shape(key_or_order))
    if shape != (*orders.lead, n):
        raise ValueError(
            f"the epoch's order has shape {shape}, but the data has {n} examples: pass "
            f"{orders.orders_text(n)}."
        )
    return jnp.asarray(key_or_order, jnp.int32)


def make_epoch(
    step: StepFn,
    *,
    batch_size: int,
    shuffle: bool = True,
    drop_remainder: bool = True,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
    num_members: int | None = None,
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

    An epoch of N members (the step of :func:`~nnxscan.pure.vmap_members`) is built with
    ``num_members=N`` and takes one order per member: an ``(N, num_examples)`` order array
    (``np.stack([epoch_order(s, e, n) for s in seeds])``, what ``Population.fit`` trains),
    or ``N`` keys (``jax.random.split(key, N)``); each step's batch then has a leading
    members axis, ``(N, batch, ...)``. With ``num_members=N`` the count is the epoch's own:
    one order for all members (a ``shared_batch`` step) and one order per member are told
    apart by what the epoch was built for, and a wrong shape is an error that says which
    was expected. Built without it (the form before ``num_members`` existed, which keeps
    working), the epoch takes N keys or an ``(N, n)`` order array as N members' own and
    one key or order as one model's (or one for all members), as it always did.

    With ``shuffle=False`` a key is ignored, and with no order given each step slices its
    batch from the stored rows: nothing is gathered (N members gather theirs: a slice
    vmapped over members would be a gather per step). With ``drop_remainder=False`` a final short
    batch is trained as one more step of its own shape (no padding, no masking), so every
    example is used exactly once.

    Args:
      step: the step to train (a :class:`~nnxscan.pure.Step`, or its update function).
      batch_size: examples per step (per member).
      shuffle: order each epoch by ``key_or_order``; ``False``: the stored order.
      drop_remainder: drop the last ``num_examples % batch_size`` examples, or train them
        as a final short step.
      unroll: the scan's ``unroll``.
      batch_sharding: each step's batch is constrained to it (a mesh's data axes).
      num_members: ``N``: one key or order per member, each step's batch ``(N, batch,
        ...)``, any other shape refused; ``None``: told by each call's keys or orders (N
        of them: N members).

    Returns:
      ``epoch(graphdef, state, opt_state, data, key_or_order) -> (state, opt_state,
      losses)``; ``data`` is a pytree whose leaves share a leading examples axis.
      ``losses`` has one entry per step (``(steps, N)`` for N members).

    Raises:
      ValueError: (when called) keys or an order of another shape than the epoch takes.

    Example:
      >>> epoch = jax.jit(make_epoch(step, batch_size=32))
      >>> for e in range(10):
      ...     state, opt_state, losses = epoch(graphdef, state, opt_state, data,
      ...                                      epoch_order(0, e, n))
      >>> members = jax.jit(make_epoch(vmap_members(step), batch_size=32, num_members=4))
      >>> orders = np.stack([epoch_order(s, 0, n) for s in range(4)])
      >>> states, opt_state, losses = members(graphdef, states, members_state, data, orders)
      >>> losses.shape
      (n // 32, 4)
    """
    checks.check_batch_size(batch_size, batch_size, drop_remainder=False)
    orders, told = _epoch_orders(num_members), num_members is not None

    def epoch(graphdef, state, opt_state, data, key_or_order=None):
        n = checks.check_leading_size(data, "data")
        checks.check_batch_size(batch_size, n, drop_remainder=drop_remainder)
        # Told its members (num_members=N), or, built without, by what it is given.
        orders_of = orders if told else _epoch_orders_given(key_or_order)
        order = _epoch_order(key_or_order, n, shuffle, orders_of)
        full, tail = batching.cut_batches(order, batch_size, drop_remainder=drop_remainder)
        # Steps first, as the step's batches are laid out: (steps, *members, batch).
        full = orders_of.steps_first(full)
        tail = None if tail is None else orders_of.steps_first(tail)
        rows = None  # every batch gathered by its indices ...
        if not shuffle and (key_or_order is None or _is_key(key_or_order)):
            # ... except the stored order's full batches, sliced by number where they can be.
            full, rows = orders_of.batch_numbers(full, batch_size)

        def scan(carry, idx, unroll):
            state, opt_state, outs = scan_indexed_steps(
                step, graphdef, *carry, data, idx, unroll=unroll, batch_sharding=batch_sharding,
                batch_rows=rows if idx is full else None,  # the tail's are indices
            )  # fmt: skip
            return (state, opt_state), outs

        (state, opt_state), outs = batching.full_then_tail(
            scan, (state, opt_state), full, tail, unroll=unroll
        )
        return state, opt_state, outs

    return epoch
