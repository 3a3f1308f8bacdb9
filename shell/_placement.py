"""Where the carry (state, optax state) and the data live: one device, or a mesh.

Without a mesh everything is committed to the device that holds the model (so numpy,
uncommitted and committed inputs all reach the compiled call the same way and compile
once). With a ``jax.sharding.Mesh``, training is data-parallel over ``data_axis``: every
batch is sharded along its batch dimension, the state is replicated, and XLA inserts the
gradient all-reduce itself (GSPMD) — no hand-written communication. Optionally
(``fsdp_min_size``) large arrays of the carry are sharded too, FSDP-style.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec


def device_of(like: Any) -> Any:
    """The device holding ``like``'s first leaf (the default device if it is sharded)."""
    leaves = jax.tree.leaves(like)
    devices = leaves[0].devices() if leaves and hasattr(leaves[0], "devices") else set()
    return next(iter(devices)) if len(devices) == 1 else jax.devices()[0]


def fsdp_spec(shape: tuple[int, ...], axis_size: int, axis: str, min_size: int) -> PartitionSpec:
    """The FSDP rule: shard the largest dimension that ``axis_size`` divides over ``axis``.

    Arrays with fewer than ``min_size`` elements, and those with no such dimension, stay
    replicated. Parameters and their optax moments share a shape, so they shard alike.

    Example:
      >>> fsdp_spec((784, 512), 4, "data", 2**16)
      PartitionSpec('data', None)
    """
    if int(np.prod(shape, dtype=np.int64)) < min_size:
        return PartitionSpec()
    candidates = [d for d in range(len(shape)) if shape[d] % axis_size == 0 and shape[d] > 1]
    if not candidates:
        return PartitionSpec()
    dim = max(candidates, key=lambda d: (shape[d], -d))
    return PartitionSpec(*[axis if d == dim else None for d in range(len(shape))])


class Placement:
    """Places the carry, a data set, and stream chunks; validates batch sizes for a mesh."""

    def __init__(
        self,
        mesh: Mesh | None = None,
        data_axis: str | None = "data",
        fsdp_min_size: int | None = None,
        member_axis: str | None = None,
    ):
        if mesh is not None:
            if not isinstance(mesh, Mesh):
                raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
            for name, axis in (("data_axis", data_axis), ("member_axis", member_axis)):
                if axis is not None and axis not in mesh.axis_names:
                    raise ValueError(
                        f"{name}={axis!r} is not an axis of the mesh {mesh.axis_names}."
                    )
        elif fsdp_min_size is not None:
            raise ValueError("fsdp_min_size shards parameters over a mesh: pass mesh= too.")
        self.mesh, self.data_axis, self.fsdp_min_size = mesh, data_axis, fsdp_min_size
        # A population's members: the carry's leading (members) axis is sharded over it.
        self.member_axis = member_axis if mesh is not None else None

    @property
    def data_parallel(self) -> int:
        """Devices a batch is split over (1 without a mesh)."""
        if self.mesh is None or self.data_axis is None:
            return 1
        return self.mesh.shape[self.data_axis]

    @property
    def batch_sharding(self) -> NamedSharding | None:
        """Leading (batch) dimension over ``data_axis``; ``None`` without a mesh."""
        if self.mesh is None or self.data_axis is None:
            return None
        return NamedSharding(self.mesh, PartitionSpec(self.data_axis))

    def local_data_parallel(self) -> int:
        """Devices of this process a local batch is split over."""
        if self.mesh is None or self.data_axis is None:
            return 1
        return self.mesh.local_mesh.shape[self.data_axis]

    def check_batch_size(self, batch_size: int, *, local: bool = False) -> None:
        """A (global, or with ``local`` this process's) batch must split evenly."""
        devices = self.local_data_parallel() if local else self.data_parallel
        if batch_size % devices:
            where = "this process's devices" if local else "devices"
            raise ValueError(
                f"batch size {batch_size} does not divide by the {devices} {where} of mesh "
                f"axis {self.data_axis!r}; use a multiple of {devices}."
            )

    def carry_shardings(self, leaves: list) -> tuple | None:
        """One sharding per carry leaf on a mesh: replicated, by the FSDP rule, or (a
        population's) leading members axis over ``member_axis``."""
        if self.mesh is None:
            return None
        shardings = []
        members = (self.member_axis,) if self.member_axis else ()
        for leaf in leaves:
            spec = PartitionSpec(*members)
            is_key = jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
            if self.fsdp_min_size is not None and self.data_axis is not None and not is_key:
                # A member's own dimensions (past the members axis) follow the FSDP rule.
                shape = tuple(leaf.shape)[len(members) :]
                rule = fsdp_spec(shape, self.data_parallel, self.data_axis, self.fsdp_min_size)
                spec = PartitionSpec(*members, *rule)
            shardings.append(NamedSharding(self.mesh, spec))
        return tuple(shardings)

    def put_carry(self, leaves: list) -> list:
        shardings = self.carry_shardings(leaves)
        if shardings is None:
            return _commit(leaves, device_of(leaves))
        return [_put(x, s) for x, s in zip(leaves, shardings, strict=True)]

    def put_data(self, tree: Any, like: Any = None, *, device: Any = None) -> Any:
        """A whole data set: next to the model (``like``'s device, or ``device``), or
        replicated over the mesh — a full copy on every device (each step's batch is then
        gathered and sharded over ``data_axis`` inside the compiled call). For a data set
        too big for that, stream it: a stream's chunks are sharded."""
        if self.mesh is None:
            return _commit(tree, device if device is not None else device_of(like))
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def put_chunk(self, tree: Any, device: Any, *, member_batches: bool = False) -> Any:
        """A stream chunk ``(steps, batch, ...)``: batch dimension over ``data_axis``; a
        population's per-member chunk ``(members, steps, batch, ...)``: members over
        ``member_axis`` too."""
        if self.mesh is None:
            return jax.device_put(tree, device)
        spec = (None, self.data_axis)
        if member_batches:
            spec = (self.member_axis, None, self.data_axis)
        sharding = NamedSharding(self.mesh, PartitionSpec(*spec))
        if jax.process_count() > 1:
            # Each process holds its own share of every batch: assemble the global chunk.
            return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), tree)
        return jax.device_put(tree, sharding)


def _put(x: Any, sharding: Any) -> Any:
    """``jax.device_put`` that also places typed PRNG keys on a mesh spanning processes:
    JAX refuses a key there, so its raw data travels and is wrapped again."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.device_get(jax.random.key_data(x))), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(x, sharding)


def _commit(tree: Any, device: Any) -> Any:
    leaves, treedef = jax.tree.flatten(tree)
    # Arrays already committed to the device pass through: device_put costs ~20 µs a leaf
    # even when it has nothing to do, and fit calls this every time. Arrays the user
    # sharded over several devices keep their sharding.
    placed = [
        x
        if isinstance(x, jax.Array)
        and (len(x.devices()) > 1 or (x.committed and x.devices() == {device}))
        else jax.device_put(x, device)
        for x in leaves
    ]
    return jax.tree.unflatten(treedef, placed)


def to_host(tree: Any) -> Any:
    """``jax.device_get`` that also reads replicated arrays spanning several processes.

    Such an array is not fully addressable from one process; every process holds a full
    copy, so the local one is read.
    """

    def get(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(x.addressable_shards[0].data)
        return x

    return jax.device_get(jax.tree.map(get, tree))
