"""The one training loop body, and how many bytes a call's gathered batches may take.

Every compiled training call of nnxscan (``scan_steps``, ``scan_indexed_steps``,
``scan_member_steps``, so ``make_epoch``, ``make_population_epoch`` and the shell's calls)
runs :func:`scan_batches`' body, so a step trained from a stack of batches and the same step
trained on rows gathered by index compute the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure.batching import gathers_as_bytes, shard_batch
from nnxscan.pure.train_step import StepFn


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


def keep_carry_types(new: Any, old: Any) -> Any:
    """``new`` with each leaf on its ``old`` leaf's sharding where an Explicit mesh makes
    the sharding part of the type and the step changed it (a parameter updated by moments
    sharded otherwise, as in Flax's cookbook, comes out with the moments' sharding): a scan
    carry keeps one type, as the cookbook's loop reshards the model after each step."""

    def keep(x: Any, like: Any) -> Any:
        want = getattr(jax.typeof(like), "sharding", None)
        got = getattr(jax.typeof(x), "sharding", None)
        spec = getattr(want, "spec", None)
        if spec is None or getattr(got, "spec", None) == spec or not _explicit(want):
            return x
        return jax.sharding.reshard(x, spec)

    return jax.tree.map(keep, new, old)


def _explicit(sharding: Any) -> bool:
    types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def scan_batches(
    step: StepFn,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    opt_state: Any,
    xs: Any,
    batch_of: Callable[[Any], Any],
    *,
    unroll: int | bool = 1,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> tuple[nnx.State, Any, Any]:
    """The one training loop body: ``step`` on ``batch_of(x)`` for each entry ``x`` of ``xs``."""

    def body(carry, x):
        state, opt_state = carry
        batch = shard_batch(batch_of(x), batch_sharding)
        new = step(graphdef, state, opt_state, batch)
        state, opt_state = keep_carry_types(new[:2], carry)
        return (state, opt_state), new[2]

    (state, opt_state), outs = scan_loop(body, (state, opt_state), xs, unroll=unroll)
    return state, opt_state, outs


#: The most bytes of examples one traced loop copies out of the data set at once when it
#: gathers a call's batches before scanning them (see ``nnxscan.pure.scan_indexed_steps``).
#: An epoch whose batches take more is run as an outer loop over chunks of steps that fit.
#: Small on purpose: on the CPU a chunk this size stays in cache and its buffer is reused
#: chunk after chunk, where one copy of a whole large epoch page-faults a fresh buffer in
#: every call (measured in docs/performance.md: 4 MiB was as fast or faster than both a
#: whole-epoch copy and a gather per step, for rows of 256 B to 64 kB).
GATHER_BUDGET_BYTES = 4 * 1024 * 1024
#: The budget when the rows gather through bytes (``batching.gathers_as_bytes``; see
#: :func:`gather_budget`):
#: such a gather is bound by XLA:CPU's per-element loop, not by the cache, and a call
#: gathered whole gets the byte view (in a chunk loop XLA would hoist the view of the
#: data set out of the loop as a copy). Below glibc's largest mmap threshold (32 MiB),
#: so the buffer is reused call after call (docs/performance.md).
NARROW_GATHER_BUDGET_BYTES = 24 * 1024 * 1024


def gather_budget(data: Any) -> int:
    """The default bytes one gather of a call may copy for ``data``'s rows: the narrow
    budget when rows that gather through bytes hold at least 90% of a row's bytes (an
    image or feature vector beside its int label)."""
    leaves = jax.tree.leaves(data)
    total = batch_bytes(data, 1)
    narrow = sum(batch_bytes(x, 1) for x in leaves if gathers_as_bytes(x))
    if total and narrow >= 0.9 * total:
        return NARROW_GATHER_BUDGET_BYTES
    return GATHER_BUDGET_BYTES


def chunk_steps(steps: int, most: int) -> int:
    """Steps per chunk when a call of ``steps`` steps is gathered in chunks of at most
    ``most``: a divisor of ``steps`` of at least ``most / 2`` when there is one, so the
    chunks are one loop. A rest of another length is a second loop of the step, which XLA
    compiles again (~0.3 s for a small MLP's step, more for larger ones)."""
    for size in range(most, max((most + 1) // 2, 2) - 1, -1):
        if steps % size == 0:
            return size
    return most


def batch_bytes(data: Any, batch_size: int) -> int:
    """Bytes one batch of ``batch_size`` examples of ``data`` takes (every leaf's rows)."""
    return batch_size * sum(
        (x.size // max(x.shape[0], 1)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(data)
    )
