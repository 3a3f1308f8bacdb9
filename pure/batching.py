"""Batches from an order of examples: cut, gathered, placed on a mesh.

Epochs (``make_epoch``), population epochs, evaluations and the shell's compiled calls all
cut their orders here, so a loop of pure functions and ``Trainer.fit`` see the same batches.

- :func:`cut_batches`: an order of examples (over optional leading member axes) cut into
  full batches and a short tail.
- :func:`full_then_tail`: the rule every epoch and every evaluation follows: scan the full
  batches, then the tail once, as a step of its own shape.
- :func:`take_batch`: rows of every leaf of a data set, by index (:func:`take_rows`);
  :func:`steps_per_gather`: how many steps' batches a scan gathers at once;
  :func:`slices_in_loop`: whether a loop body may take its batch by an index read from an
  array (the CPU), or gathers the call's batches before the loop (an accelerator).
- :func:`shard_batch`, :func:`constrain_sharding`: a batch (an array) on a sharding inside
  traced code, on an Explicit or an Auto mesh.

Example:
  >>> from nnxscan.pure import epoch_order, scan_indexed_steps
  >>> from nnxscan.pure.batching import cut_batches, full_then_tail
  >>> full, tail = cut_batches(epoch_order(seed, epoch, n), 32, drop_remainder=False)
  >>> def scan(carry, indices, unroll):
  ...     *carry, losses = scan_indexed_steps(step, graphdef, *carry, data, indices,
  ...                                         unroll=unroll)
  ...     return tuple(carry), losses
  >>> (state, opt_state), losses = full_then_tail(scan, (state, opt_state), full, tail)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "constrain_sharding",
    "cut_batches",
    "full_then_tail",
    "shard_batch",
    "slices_in_loop",
    "steps_per_gather",
    "take_batch",
    "take_rows",
]


def cut_batches(order: Any, batch_size: int, *, drop_remainder: bool) -> tuple[Any, Any | None]:
    """Cuts orders of shape ``(..., n)`` into ``(full, tail)``.

    ``full`` has shape ``(..., n // batch_size, batch_size)``; ``tail`` holds the short
    final batch as a stack of ONE step, ``(..., 1, n % batch_size)``, or is ``None`` (dropped,
    or no remainder). The leading axes (members of a population) are kept. numpy in, numpy
    out; a JAX array in, JAX out.

    Args:
      order: the examples' indices in training order, ``(n,)`` (e.g. ``epoch_order(seed,
        epoch, n)``), or ``(N, n)``: one order per member.
      batch_size: examples per batch (checked by ``nnxscan.pure.checks.check_batch_size``
        where the core cuts).
      drop_remainder: drop the last ``n % batch_size`` examples instead of returning them
        as a tail.

    Returns:
      ``(full, tail)``: the indices of the full batches, ``(..., steps, batch_size)``, and
      of the short final batch, ``(..., 1, n % batch_size)`` or None.

    Example:
      >>> full, tail = cut_batches(np.arange(10), 4, drop_remainder=False)
      >>> full
      array([[0, 1, 2, 3],
             [4, 5, 6, 7]])
      >>> tail
      array([[8, 9]])
    """
    *lead, n = order.shape
    num_full = n // batch_size
    full = order[..., : num_full * batch_size].reshape(*lead, num_full, batch_size)
    if drop_remainder or n == num_full * batch_size:
        return full, None
    return full, order[..., None, num_full * batch_size :]


def take_batch(data: Any, indices: jax.Array, *, as_bytes: bool = False) -> Any:
    """Gathers the rows ``indices`` of every leaf of ``data`` (a scalar index: one row).

    Args:
      data: a pytree whose leaves share a leading examples axis.
      indices: an int array of row indices, of any shape (or a scalar).
      as_bytes: gather narrow rows through a byte view (:func:`take_rows`): faster on the
        CPU where the gather reads most of ``data`` once, outside any loop. Inside a loop
        body XLA hoists the view of loop-invariant data out of the loop as a copy of it.

    Returns:
      ``data`` with each leaf ``x`` replaced by ``x[indices]``: shape ``(*indices.shape,
      *x.shape[1:])``.

    Example:
      >>> take_batch({"x": jnp.arange(10.0)}, jnp.array([[0, 2], [4, 6]]))["x"]
      Array([[0., 2.],
             [4., 6.]], dtype=float32)
    """
    if as_bytes:
        return jax.tree.map(lambda x: take_rows(x, indices), data)
    return jax.tree.map(lambda x: jnp.take(x, indices, axis=0), data)


# XLA:CPU gathers rows of fewer than 128 elements slower than memory allows; the same row
# viewed as bytes has itemsize times the elements, and gathers bitwise the same
# (benchmarks/bench_gather.py; the numbers are in docs/performance.md).
_NARROW_ROW_ELEMENTS = 128


def _gathers_as_bytes(x: Any) -> bool:
    """Whether :func:`take_rows` gathers ``x``'s rows through a byte view: on the CPU, an
    integer or float array whose rows hold fewer than 128 elements but at least 128
    bytes (a row of 32 to 127 float32s). Narrower rows gather no faster as bytes
    (``benchmarks/bench_gather.py``)."""
    dtype = jnp.result_type(x)
    row = int(np.prod(jnp.shape(x)[1:], dtype=np.int64))
    return (
        jnp.ndim(x) >= 1
        and row < _NARROW_ROW_ELEMENTS <= row * dtype.itemsize
        and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating))
        and jax.default_backend() == "cpu"
    )


def take_rows(x: Any, indices: Any) -> jax.Array:
    """``jnp.take(x, indices, axis=0)``, on the CPU through a byte view of ``x``'s rows when
    a row has few elements (bitwise the same result, faster there: docs/performance.md).

    Args:
      x: an array with a leading rows axis.
      indices: an int array of row indices, of any shape.

    Returns:
      ``x[indices]``: shape ``(*indices.shape, *x.shape[1:])``.

    Example:
      >>> take_rows(jnp.arange(6.0).reshape(3, 2), jnp.array([2, 0]))
      Array([[4., 5.],
             [0., 1.]], dtype=float32)
    """
    if not _gathers_as_bytes(x):
        return jnp.take(x, indices, axis=0)
    dtype, shape = jnp.result_type(x), jnp.shape(x)
    row = int(np.prod(shape[1:], dtype=np.int64))
    rows = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(shape[0], row * dtype.itemsize)
    taken = jnp.take(rows, indices, axis=0)
    taken = taken.reshape(*jnp.shape(indices), *shape[1:], dtype.itemsize)
    return jax.lax.bitcast_convert_type(taken, dtype)


def constrain_sharding(x: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    """``x`` with ``sharding`` inside a traced function, on any mesh: on an Explicit mesh
    the sharding is part of the array's type, so it is changed with
    ``jax.sharding.reshard``; on an Auto mesh ``with_sharding_constraint`` tells XLA.

    Args:
      x: an array, inside a traced function.
      sharding: the sharding it should have, e.g. ``NamedSharding(mesh, P("data"))``.

    Returns:
      ``x`` with that sharding (the same values).

    Example:
      >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
      >>> spec = jax.sharding.NamedSharding(mesh, jax.P("data"))
      >>> jax.jit(lambda x: constrain_sharding(x * 2, spec))(jnp.ones(8))
      Array([2., 2., 2., 2., 2., 2., 2., 2.], dtype=float32)
    """
    mesh = getattr(sharding, "mesh", None)
    types = getattr(mesh, "axis_types", ())
    if types and all(t == jax.sharding.AxisType.Explicit for t in types):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def shard_batch(batch: Any, sharding: jax.sharding.Sharding | None) -> Any:
    """Constrains every leaf of ``batch`` to ``sharding`` (its batch axis over devices).

    ``None`` leaves it alone. Inside a compiled loop this is what makes a step
    data-parallel: XLA then all-reduces the gradient itself. A leaf whose leading size does
    not split evenly over the sharding's devices (a short final batch) stays as it is.

    Args:
      batch: a pytree of arrays with a leading batch axis.
      sharding: e.g. ``NamedSharding(mesh, P("data"))``, or None.

    Returns:
      ``batch``, each leaf constrained with :func:`constrain_sharding`.

    Example:
      >>> spec = jax.sharding.NamedSharding(mesh, jax.P("data"))
      >>> def step_on_shards(graphdef, state, opt_state, batch):
      ...     return step(graphdef, state, opt_state, shard_batch(batch, spec))
    """
    if sharding is None:
        return batch
    return jax.tree.map(
        lambda x: constrain_sharding(x, sharding) if _divides(x, sharding) else x, batch
    )


def _divides(x: jax.Array, sharding: jax.sharding.Sharding) -> bool:
    """Whether every sharded leading dimension splits evenly over its mesh axes (a short
    final batch that does not stays as it is)."""
    spec = getattr(sharding, "spec", None)
    mesh = getattr(sharding, "mesh", None)
    if not spec or mesh is None:
        return True
    shape = jnp.shape(x)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        if dim >= len(shape):
            return False
        size = 1
        for axis in entry if isinstance(entry, tuple) else (entry,):
            size *= mesh.shape[axis]
        if shape[dim] % size:
            return False
    return True


def full_then_tail(
    scan: Callable[[Any, Any, int | bool], tuple[Any, Any]],
    carry: Any,
    full: Any,
    tail: Any | None,
    *,
    unroll: int | bool = 1,
) -> tuple[Any, Any]:
    """Runs ``scan(carry, indices, unroll) -> (carry, outs)`` over the full batches, then
    over the tail once, fully unrolled (a step of its own shape, no loop: on the CPU a loop
    body runs convolution gradients far slower).

    ``full``'s and ``tail``'s leading axis counts steps; ``outs`` have a leading steps axis
    and are joined along it. An epoch with no full batch runs the tail alone; ``outs`` is
    ``None`` when nothing ran.

    Args:
      scan: ``scan(carry, indices, unroll) -> (carry, outs)``, e.g. a call of
        ``scan_indexed_steps``.
      carry: what the scans carry, e.g. ``(state, opt_state)``.
      full, tail: from :func:`cut_batches`.
      unroll: the full batches' ``unroll``.

    Returns:
      ``(carry, outs)`` after every batch.

    Example:
      >>> full, tail = cut_batches(order, 32, drop_remainder=False)
      >>> def scan(carry, indices, unroll):
      ...     *carry, losses = scan_indexed_steps(step, graphdef, *carry, data, indices,
      ...                                         unroll=unroll)
      ...     return tuple(carry), losses
      >>> (state, opt_state), losses = full_then_tail(scan, (state, opt_state), full, tail)
    """
    outs = None
    if full.shape[0]:
        carry, outs = scan(carry, full, unroll)
    if tail is not None:
        carry, tail_outs = scan(carry, tail, True)
        outs = tail_outs if outs is None else jax.tree.map(_concat, outs, tail_outs)
    return carry, outs


def _concat(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.concatenate([a, b], axis=0)


#: The most bytes of examples one traced loop copies out of the data set at once when it
#: gathers a call's batches before scanning them (see ``nnxscan.pure.scan_indexed_steps``).
#: An epoch whose batches take more is run as an outer loop over chunks of steps that fit.
#: Small on purpose: on the CPU a chunk this size stays in cache and its buffer is reused
#: chunk after chunk, where one copy of a whole large epoch page-faults a fresh buffer in
#: every call (measured in docs/performance.md: 4 MiB was as fast or faster than both a
#: whole-epoch copy and a gather per step, for rows of 256 B to 64 kB).
GATHER_BUDGET_BYTES = 4 * 1024 * 1024
#: The budget when the rows gather through bytes (``_gathers_as_bytes``; see
#: ``_gather_budget``):
#: such a gather is bound by XLA:CPU's per-element loop, not by the cache, and a call
#: gathered whole gets the byte view (in a chunk loop XLA would hoist the view of the
#: data set out of the loop as a copy). Below glibc's largest mmap threshold (32 MiB),
#: so the buffer is reused call after call (docs/performance.md).
NARROW_GATHER_BUDGET_BYTES = 24 * 1024 * 1024


#: Above the gather budget, a batch of at least this many bytes whose rows do not gather
#: as bytes is gathered by each step inside the loop body rather than in chunks of steps
#: (``nnxscan.pure.scan_indexed_steps``): measured in docs/performance.md, such a gather
#: costs the loop body what a chunk's costs it per step, and the program has one loop for
#: XLA to compile instead of two.
LOOP_GATHER_BYTES = 64 * 1024


#: The budget on a TPU (``slices_in_loop()`` False): there a copy of a call's batches
#: is cheap (device memory is fast, and large), while a loop body that takes its batch by
#: an index read from an array waits for that index every step (see ``slices_in_loop``).
ACCELERATOR_GATHER_BUDGET_BYTES = 256 * 1024 * 1024


def slices_in_loop() -> bool:
    """Whether a loop body may take each step's batch by an index READ FROM AN ARRAY (a
    whole stacked batch by number, a slice of the stored rows): everywhere but on a TPU.

    On the CPU that index is a load like any other. On a TPU a dynamic slice's offset must
    reach the chip's scalar unit first: an index that lives in an array in device memory
    costs every step a round trip there (a TPU v5e: a small MLP's step 4.9 -> 6.6 µs,
    docs/performance.md), where an offset computed from the loop's own counter costs
    nothing. So there ``scan_indexed_steps`` gathers the call's batches once, before the
    loop (in chunks of steps beyond the gather budget), and scans them. A GPU keeps the
    CPU's rules until they are measured there.

    Example:
      >>> slices_in_loop() == (jax.default_backend() != "tpu")
      True
    """
    return jax.default_backend() != "tpu"


def _gather_budget(data: Any) -> int:
    """The default bytes one gather of a call may copy for ``data``'s rows: on the CPU, the
    narrow budget (24 MiB) when rows that gather through bytes hold at least 90% of a row's
    bytes (an image or feature vector beside its int label), else 4 MiB; on a TPU
    ``ACCELERATOR_GATHER_BUDGET_BYTES`` (256 MiB). A call whose batches take more is
    gathered in chunks of steps (``scan_indexed_steps``).

    Example:
      >>> _gather_budget({"x": np.zeros((100, 64), np.float32), "y": np.zeros(100, np.int32)})
      25165824
    """
    if not slices_in_loop():
        return ACCELERATOR_GATHER_BUDGET_BYTES
    leaves = jax.tree.leaves(data)
    total = _batch_bytes(data, 1)
    narrow = sum(_batch_bytes(x, 1) for x in leaves if _gathers_as_bytes(x))
    if total and narrow >= 0.9 * total:
        return NARROW_GATHER_BUDGET_BYTES
    return GATHER_BUDGET_BYTES


def steps_per_gather(data: Any, rows_per_step: int, budget: int | None = None) -> int | None:
    """The most steps of ``rows_per_step`` rows each whose batches
    :func:`~nnxscan.pure.scan_indexed_steps` gathers from ``data`` at once, in one gather
    before its loop; a call of more steps runs an outer loop over chunks of steps, which
    XLA compiles longer than one loop (``docs/performance.md``). None when a call of any
    length is one loop: big batches of wide rows gather per step inside it.

    ``Trainer.fit`` fuses no more epochs into one call than this (when an epoch fits), so
    that its programs are one loop; a loop of your own can cut its calls the same way.

    Args:
      data: a pytree whose leaves share a leading examples axis.
      rows_per_step: the rows one step takes (a batch; ``N * batch`` for N members).
      budget: the gather budget in bytes (``scan_indexed_steps``' ``gather_budget``); by
        default the one it uses for ``data``.

    Example:
      >>> steps_per_gather({"x": np.zeros((64_000, 64), np.float32)}, 32)  # 8 KiB a step
      3072
      >>> steps_per_gather({"x": np.zeros((4096, 784), np.float32)}, 128) is None  # 392 KiB
      True
    """
    per_step = _batch_bytes(data, rows_per_step)
    if _gathers_in_loop(data, per_step):
        return None
    budget = _gather_budget(data) if budget is None else budget
    return max(1, budget // max(per_step, 1))


def _gathers_in_loop(data: Any, per_step: int, by_rows: bool = True) -> bool:
    """Whether each step gathers its batch (``per_step`` bytes) inside the loop body rather
    than the call's batches being gathered before it. On the CPU, for a call over the gather
    budget: at least ``LOOP_GATHER_BYTES`` of rows that do not gather as bytes (see
    ``LOOP_GATHER_BYTES``). On an accelerator, for any call whose batches take at least
    ``LOOP_GATHER_BYTES`` gathered ``by_rows`` (a vector of row indices a step: a TPU v5e
    then overlaps the gather with the step's work, where a copy of a call's wide batches
    made first cost the compute-bound MLP's step 1.5x; docs/performance.md); never for
    whole stacked batches taken by number (a scalar offset read from an array waits for
    the chip's scalar unit every step: ``slices_in_loop``)."""
    if per_step < LOOP_GATHER_BYTES:
        return False
    if not slices_in_loop():
        return by_rows
    return not any(_gathers_as_bytes(x) for x in jax.tree.leaves(data))


def _batch_bytes(data: Any, batch_size: int) -> int:
    """Bytes one batch of ``batch_size`` examples of ``data`` takes (every leaf's rows).

    Example:
      >>> _batch_bytes({"x": np.zeros((100, 64), np.float32)}, 32)
      8192
    """
    return batch_size * sum(
        (x.size // max(x.shape[0], 1)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(data)
    )


def _chunk_steps(steps: int, most: int) -> int:
    """Steps per chunk when a call of ``steps`` steps is gathered in chunks of at most
    ``most``: a divisor of ``steps`` of at least ``most / 2`` when there is one, so the
    chunks are one loop. A rest of another length is a second loop of the step, which XLA
    compiles again (docs/performance.md).

    Example:
      >>> _chunk_steps(2000, 1500)  # 2 chunks of 1,000 rather than 1,500 + 500
      1000
    """
    for size in range(most, max((most + 1) // 2, 2) - 1, -1):
        if steps % size == 0:
            return size
    return most
