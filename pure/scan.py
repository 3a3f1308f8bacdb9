"""Scan a pure step over batches, in one ``lax.scan``: a stack of batches, or batches taken
from a data set by index (a population's too: its indices have a members axis).

The loop body is the one every compiled training call of nnxscan runs (``make_epoch`` and
``Trainer``'s and ``Population``'s compiled calls are these scans), so a loop you write
from them trains what ``fit`` trains.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from nnxscan.pure import _loops, batching, checks
from nnxscan.pure.train_step import StepFn

__all__ = ["scan_indexed_steps", "scan_steps"]


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
    gather_budget: int | None = None,
    batch_rows: int | None = None,
) -> tuple[nnx.State, Any, Any]:
    """Scans ``step`` over batches gathered from ``data`` by a ``(steps, batch)`` index array
    (or ``(steps, N, batch)``: a batch per member of a population, for the step of
    :func:`~nnxscan.pure.vmap_members`; or ``(steps,)``: row ``i`` of ``data`` is a whole
    batch, as in a stream's chunk; or, with ``batch_rows``, batch number ``i`` of ``data``
    in its stored order).

    This is the scan under :func:`make_epoch` and under every compiled call of
    ``Trainer.fit`` on arrays: an epoch's order cut into batches of indices
    (``nnxscan.pure.batching.cut_batches``) and scanned, a call of ``steps_per_call`` steps
    at a time if you like.

    The batches are gathered ONCE, before the loop (``data[indices]``, shape ``(steps,
    batch, ...)``), and the loop scans over that stack exactly as :func:`scan_steps` scans
    a stack of batches: the same loop body, bitwise the same results. A gather of rows by
    index inside a loop body costs XLA:CPU more than a small model's whole step; one gather
    per call costs one copy of the call's examples. When that copy would exceed
    ``gather_budget`` bytes, each step gathers its own batch inside the loop when a batch
    takes at least ``LOOP_GATHER_BYTES`` (64 KiB) of rows that do not gather as bytes
    (there the gather is bound by memory, so the loop body runs it as fast, and the
    program compiles one loop instead of two); else the steps run as an outer loop over
    chunks of steps whose batches fit, each gathered once. Bitwise the same results either
    way: the step sees the same rows. A call that gathers most of ``data`` at once (an
    epoch) gathers narrow rows through a byte view on the CPU
    (:func:`nnxscan.pure.batching.take_rows`: bitwise the same rows, several times
    faster). On the CPU a ``(steps,)`` index (whole stacked batches) takes each step's
    batch by a dynamic slice, which costs nothing extra in the loop there, and so does
    ``batch_rows``; on a TPU both are gathered before the loop like any index
    (a loop body that reads its slice's offset from an array waits for it every step
    there: :func:`nnxscan.pure.batching.slices_in_loop`), within a gather budget of 256 MiB
    (``ACCELERATOR_GATHER_BUDGET_BYTES``) rather than the CPU's 4 MiB; and there a
    ``(steps, batch)`` index whose batches take ``LOOP_GATHER_BYTES`` or more gathers each
    step's batch in the loop body whatever the budget (the chip overlaps it with the step).

    Args:
      step: a pure step, ``step(graphdef, state, opt_state, batch) -> (state, opt_state,
        out)`` (a :class:`Step`, e.g. from :func:`make_train_step`).
      graphdef, state: ``nnx.split(model)``.
      opt_state: what the step carries besides the model (``step.init(graphdef, state)``).
      data: a pytree whose leaves share a leading examples axis ``(n, ...)``.
      indices: an int array ``(steps, batch)`` of rows of ``data``, one row of indices per
        step; ``(steps, N, batch)``: each step's batch has a leading members axis (member
        ``i`` trains ``data[indices[j, i]]``); or ``(steps,)`` when each row of ``data`` is
        a whole batch.
      unroll: forwarded to ``lax.scan``; ``True`` unrolls fully (no loop left).
      batch_sharding: shard each batch's leading axis, e.g. ``NamedSharding(mesh,
        P("data"))``, for data-parallel steps.
      gather_budget: the most bytes of examples one gather copies; by default 4 MiB on
        the CPU, or 24 MiB when the rows are narrow enough to gather as bytes there, and
        256 MiB on a TPU (see ``docs/performance.md``).
      batch_rows: with a ``(steps,)`` index, step ``j`` trains the rows
        ``indices[j] * batch_rows`` to ``indices[j] * batch_rows + batch_rows - 1`` of
        ``data`` (a data set in its stored order, cut into batches of ``batch_rows``): each
        step slices its batch, nothing is gathered or copied (an unshuffled epoch,
        ``fit(shuffle=False)``). Bitwise what the ``(steps, batch)`` index of the same rows
        trains. Every number must be below ``n // batch_rows`` (checked when ``indices``
        is concrete; a traced one out of range is clamped, as ``lax.dynamic_slice`` does).
        Under ``jax.jit``, pass it as a static argument (``static_argnames``). Not for
        members: vmapped, a per-member slice becomes a gather inside the loop.

    Returns:
      ``(state, opt_state, outs)``; ``outs`` (the losses, or ``(loss, aux)`` pairs) are
      stacked along a leading steps axis.

    Example:
      >>> order = epoch_order(seed, epoch, n)  # the order Trainer.fit uses
      >>> indices = order[: n // 32 * 32].reshape(-1, 32)  # (steps, batch)
      >>> state, opt_state, losses = jax.jit(scan_indexed_steps, static_argnums=0)(
      ...     step, graphdef, state, opt_state, data, indices)
      >>> in_order = jax.jit(scan_indexed_steps, static_argnums=0,
      ...                    static_argnames="batch_rows")  # the stored order, sliced
      >>> state, opt_state, losses = in_order(step, graphdef, state, opt_state, data,
      ...                                     np.arange(n // 32), batch_rows=32)
    """
    if batch_rows is not None and not batching.slices_in_loop():
        # An accelerator: the same rows as a (steps, batch_rows) index, gathered before
        # the loop (an index read from an array costs a loop body there every step).
        rows = checks.check_count(batch_rows, "batch_rows", 1)
        _check_batch_numbers(indices, data, rows)
        # The first rows clamped as the CPU's dynamic slice clamps them (a traced batch
        # number out of range, or the last rows when rows do not divide n).
        first = jnp.clip(indices * rows, 0, _num_rows(data) - rows)
        indices = first[:, None] + jnp.arange(rows, dtype=first.dtype)
        batch_rows = None
    elif batch_rows is not None:
        rows = checks.check_count(batch_rows, "batch_rows", 1)
        _check_batch_numbers(indices, data, rows)

        def batch_of(i):
            # A dynamic slice of the stored rows: no gather, no copy of the data.
            return jax.tree.map(lambda x: jax.lax.dynamic_slice_in_dim(x, i * rows, rows), data)

        return _loops.scan_batches(
            step, graphdef, state, opt_state, indices, batch_of,
            unroll=unroll, batch_sharding=batch_sharding,
        )  # fmt: skip
    if indices.ndim == 1 and (batching.slices_in_loop() or not jax.tree.leaves(data)):
        # (No data: a step that draws its own batch; its index is only a step count.)
        return _loops.scan_batches(
            step, graphdef, state, opt_state, indices, lambda i: batching.take_batch(data, i),
            unroll=unroll, batch_sharding=batch_sharding,
        )  # fmt: skip

    def run_chunk(carry, idx, as_bytes=False):
        batches = batching.take_batch(data, idx, as_bytes=as_bytes)
        state, opt_state, outs = _loops.scan_batches(
            step, graphdef, *carry, batches, lambda b: b,
            unroll=unroll, batch_sharding=batch_sharding,
        )  # fmt: skip
        return (state, opt_state), outs

    if gather_budget is None:
        gather_budget = batching._gather_budget(data)
    rows_per_step = int(np.prod(indices.shape[1:], dtype=np.int64))
    steps, per_step = indices.shape[0], batching._batch_bytes(data, rows_per_step)
    chunk = max(1, gather_budget // max(per_step, 1))
    data_bytes = batching._batch_bytes(data, _num_rows(data))
    in_loop = batching._gathers_in_loop(data, per_step, by_rows=indices.ndim > 1)
    # An accelerator gathers wide batches in the loop within the budget too (the CPU only
    # over it, below).
    if chunk >= steps and not (in_loop and not batching.slices_in_loop()):
        # Through bytes when the call reads most of the data (an epoch): the byte view
        # then costs at most one more pass over the data, where it is not fused.
        as_bytes = 2 * steps * per_step >= data_bytes
        carry, outs = run_chunk((state, opt_state), indices, as_bytes)
        return (*carry, outs)
    if in_loop:
        # Big batches of wide rows: each step gathers its own batch in the loop body, as
        # fast as a chunk's gather per row, and no outer loop of chunks for XLA to compile.
        return _loops.scan_batches(
            step, graphdef, state, opt_state, indices, lambda i: batching.take_batch(data, i),
            unroll=unroll, batch_sharding=batch_sharding,
        )  # fmt: skip
    chunk = batching._chunk_steps(steps, chunk)
    num_chunks = steps // chunk
    # The same rule per chunk: a chunk that reads most of the data (fused epochs of a data
    # set within the budget) gathers through bytes too.
    as_bytes = 2 * chunk * per_step >= data_bytes
    if steps % chunk and (unroll is False or (type(unroll) is int and unroll == 1)):
        return _chunks_with_rest(
            step, graphdef, (state, opt_state), data, indices, chunk, as_bytes, batch_sharding
        )
    head = indices[: num_chunks * chunk].reshape(num_chunks, chunk, *indices.shape[1:])
    carry, outs = jax.lax.scan(
        lambda carry, idx: run_chunk(carry, idx, as_bytes), (state, opt_state), head
    )
    outs = jax.tree.map(lambda x: x.reshape(num_chunks * chunk, *x.shape[2:]), outs)
    if steps > num_chunks * chunk:
        carry, rest = run_chunk(carry, indices[num_chunks * chunk :], as_bytes)
        outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, rest)
    return (*carry, outs)


def _chunks_with_rest(step, graphdef, carry, data, indices, chunk, as_bytes, batch_sharding):
    """Chunks of ``chunk`` steps whose last is short, in ONE loop of the step: every chunk
    gathers ``chunk`` batches (the last padded with the call's last batch, never trained) and
    trains its first steps, as many as it holds. A scan of the rest would compile the step
    a second time."""
    steps = indices.shape[0]
    num_chunks = -(-steps // chunk)
    pad = jnp.broadcast_to(indices[-1:], (num_chunks * chunk - steps, *indices.shape[1:]))
    chunks = jnp.concatenate([indices, pad]).reshape(num_chunks, chunk, *indices.shape[1:])
    counts = np.minimum(chunk, steps - chunk * np.arange(num_chunks)).astype(np.int32)
    body = _loops.loop_body(step, graphdef, lambda b: b, batch_sharding)

    def run_chunk(carry, chunk_and_count):
        idx, count = chunk_and_count
        return _loops.loop_first(
            body, carry, batching.take_batch(data, idx, as_bytes=as_bytes), count
        )

    carry, outs = jax.lax.scan(run_chunk, carry, (chunks, counts))
    outs = jax.tree.map(lambda x: x.reshape(num_chunks * chunk, *x.shape[2:])[:steps], outs)
    return (*carry, outs)


def _check_batch_numbers(indices: Any, data: Any, rows: int) -> None:
    """``batch_rows``' index: ``(steps,)`` batch numbers below ``n // rows`` (checked when
    the index is concrete)."""
    if indices.ndim != 1:
        raise ValueError(
            f"batch_rows takes a (steps,) index of batch numbers, got indices of shape "
            f"{tuple(indices.shape)}; pass batch_rows=None for a (steps, batch) index."
        )
    num_batches = _num_rows(data) // rows
    if not isinstance(indices, jax.core.Tracer) and indices.size:
        low, high = int(np.min(indices)), int(np.max(indices))
        if low < 0 or high >= num_batches:
            raise ValueError(
                f"batch numbers must lie in [0, {num_batches}) for {_num_rows(data)} "
                f"examples in batches of {rows}, got {low}..{high}."
            )


def _num_rows(data: Any) -> int:
    return jax.tree.leaves(data)[0].shape[0]
