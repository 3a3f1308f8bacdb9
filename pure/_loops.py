"""The one training loop body, scanned over stacks of batches or over indices into a data
set, for one model or for members vmapped.

Every compiled training call of nnxscan (``scan_steps``, ``make_epoch``,
``make_population_epoch`` and the shell's calls) runs :func:`scan_batches`' body, so a step
trained from a stack of batches and the same step trained on rows gathered by index compute
the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure._batching import shard_batch, take_batch
from nnxscan.pure.nonfinite import tree_select
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
#: gathers a call's batches before scanning them (see :func:`scan_indexed_steps`). An epoch
#: whose batches take more is run as an outer loop over chunks of steps that each fit.
#: Small on purpose: on the CPU a chunk this size stays in cache and its buffer is reused
#: chunk after chunk, where one copy of a whole large epoch page-faults a fresh buffer in
#: every call (measured in docs/performance.md: 4 MiB was as fast or faster than both a
#: whole-epoch copy and a gather per step, for rows of 256 B to 64 kB).
GATHER_BUDGET_BYTES = 4 * 1024 * 1024


def batch_bytes(data: Any, batch_size: int) -> int:
    """Bytes one batch of ``batch_size`` examples of ``data`` takes (every leaf's rows)."""
    return batch_size * sum(
        (x.size // max(x.shape[0], 1)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(data)
    )


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
    gather_budget: int = GATHER_BUDGET_BYTES,
) -> tuple[nnx.State, Any, Any]:
    """Scans ``step`` over batches gathered from ``data`` by a ``(steps, batch)`` index array
    (or ``(steps,)``: row ``i`` of ``data`` is a whole batch, as in a stream's chunk).

    The batches are gathered ONCE, before the loop (``data[indices]``, shape ``(steps,
    batch, ...)``), and the loop scans over that stack exactly as :func:`scan_steps` scans
    a stack of batches: the same loop body, bitwise the same results. A gather of rows by
    index inside a loop body costs XLA:CPU more than a small model's whole step; one gather
    per call costs one copy of the call's examples. When that copy would exceed
    ``gather_budget`` bytes, the steps run as an outer loop over chunks of steps whose
    batches fit, each gathered once. A ``(steps,)`` index (whole stacked batches) takes
    each step's batch by a dynamic slice, which costs nothing extra in the loop.
    """
    if indices.ndim == 1:
        return scan_batches(
            step, graphdef, state, opt_state, indices, lambda i: take_batch(data, i),
            unroll=unroll, batch_sharding=batch_sharding,
        )  # fmt: skip

    def run_chunk(carry, idx):
        state, opt_state, outs = scan_batches(
            step, graphdef, *carry, take_batch(data, idx), lambda b: b,
            unroll=unroll, batch_sharding=batch_sharding,
        )  # fmt: skip
        return (state, opt_state), outs

    steps, per_step = indices.shape[0], batch_bytes(data, indices.shape[1])
    chunk = max(1, gather_budget // max(per_step, 1))
    if chunk >= steps:  # the whole call in one gather
        carry, outs = run_chunk((state, opt_state), indices)
        return (*carry, outs)
    num_chunks = steps // chunk
    head = indices[: num_chunks * chunk].reshape(num_chunks, chunk, *indices.shape[1:])
    carry, outs = jax.lax.scan(run_chunk, (state, opt_state), head)
    outs = jax.tree.map(lambda x: x.reshape(num_chunks * chunk, *x.shape[2:]), outs)
    if steps > num_chunks * chunk:
        carry, rest = run_chunk(carry, indices[num_chunks * chunk :])
        outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, rest)
    return (*carry, outs)


def _frozen_aware(step: StepFn, active: jax.Array) -> StepFn:
    """``step`` for ONE member that changes nothing while ``active`` is False: the loss is
    still computed (at the frozen state) and reported."""

    def guarded(graphdef, state, opt_state, batch):
        new_state, new_opt_state, out = step(graphdef, state, opt_state, batch)
        state = tree_select(active, new_state, state)
        return state, tree_select(active, new_opt_state, opt_state), out

    return guarded


def scan_member_steps(
    step: StepFn,
    graphdef: Any,
    states: Any,
    opt_states: Any,
    data: Any,
    indices: jax.Array,
    *,
    active: jax.Array | None = None,
    unroll: int | bool = 1,
    member_axis: str | None = None,
    batch_sharding: jax.sharding.Sharding | None = None,
    data_per_member: bool = False,
    gather_budget: int = GATHER_BUDGET_BYTES,
) -> tuple[Any, Any, Any]:
    """:func:`scan_indexed_steps` vmapped over the members of a population.

    ``indices`` has shape ``(N, steps, ...)``: member ``i`` trains the batches ``indices[i]``
    gathered from the shared ``data`` (or from ``data[i]`` with ``data_per_member``: every
    leaf then has a leading members axis). ``active`` (``(N,)`` bool) freezes the members
    where it is False: their state and optax state stay as they are at every step.
    ``member_axis`` names the mesh axis the members are sharded over (``vmap``'s
    ``spmd_axis_name``), so a ``batch_sharding`` of one member's batch becomes a sharding
    of the members' batches over both axes. Returns the outputs with a leading steps axis,
    then members: ``(steps, N, ...)``. Each member gathers its own batches once (a copy per
    member): ``gather_budget`` bounds the members' copies together.
    """
    member_budget = max(1, gather_budget // indices.shape[0])

    def member(state, opt_state, member_data, idx, alive):
        member_step = step if alive is None else _frozen_aware(step, alive)
        return scan_indexed_steps(
            member_step, graphdef, state, opt_state, member_data, idx, unroll=unroll,
            batch_sharding=batch_sharding, gather_budget=member_budget,
        )  # fmt: skip

    in_axes = (0, 0, 0 if data_per_member else None, 0, None if active is None else 0)
    states, opt_states, outs = jax.vmap(member, in_axes=in_axes, spmd_axis_name=member_axis)(
        states, opt_states, data, indices, active
    )
    return states, opt_states, jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), outs)
