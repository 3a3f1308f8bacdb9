"""crc32s of the arrays orbax writes shard by shard (orbax's storage: ``leaf_00000``...).

An array sharded over devices or processes is never whole on one host, so it gets no crc32
of its own: each of its distinct shards (a block of the global array: one ``[start, stop)``
per axis) gets the crc32 of its elements' bytes in C order (:func:`buffer_crc32`, the one
checksum of both storages), computed by the process holding the shard's first replica, from
the copy it holds, as the save starts. One pass over each process's own shards: a save
costs what the model's size costs, the same at step 10 and step 10 million, and no array is
gathered anywhere. With several processes the crc32s (8 bytes a shard) are gathered to the
manifest, which process 0 writes: the checksums live outside ``arrays/``, so another
checkpoint's ``arrays/`` copied in is refused like a flipped bit.

A restore checks every recorded block against the array it read (onto any mesh): a block
inside one of the process's shards is checked from that shard; a block spread over several
of them, from the array assembled on the host when the process holds it whole. With
several processes each checks the blocks it holds, and all agree (one small gather) before
any of them raises, so that every process falls back to the same checkpoint.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from nnxscan.adapters._checkpoint_manifest import buffer_crc32

Block = tuple[tuple[int, int], ...]


def _block(index: tuple[slice, ...], shape: tuple[int, ...]) -> Block:
    """A shard's index (slices, ``slice(None)`` for a whole axis) as ``(start, stop)`` per axis."""
    bounds = []
    for part, size in zip(index, shape, strict=True):
        start, stop, _ = part.indices(size)
        bounds.append((start, stop))
    return tuple(bounds)


def blocks(array: jax.Array) -> list[Block]:
    """The array's distinct shards' blocks, in the sharding's device order (the same in
    every process)."""
    shape = tuple(array.shape)
    seen: dict[Block, None] = {}
    for index in array.sharding.devices_indices_map(shape).values():
        seen.setdefault(_block(index, shape), None)
    return list(seen)


def crc32s(arrays: dict[str, jax.Array]) -> dict[str, list[list[Any]]]:
    """``{name: [[block, crc32], ...]}``: each distinct shard's block (``[[start, stop],
    ...]``) and the crc32 of its bytes, computed where the shard's first replica is."""
    held_blocks = {name: blocks(array) for name, array in arrays.items()}
    every = [(name, block) for name, held in held_blocks.items() for block in held]
    row = {key: i for i, key in enumerate(every)}
    mine = []
    for name, array in arrays.items():
        for shard in array.addressable_shards:
            if shard.replica_id == 0:
                shard.data.copy_to_host_async()  # every transfer started before any is read
                mine.append((row[name, _block(shard.index, tuple(array.shape))], shard.data))
    # 0 where another process holds the shard: each shard is one process's, so the
    # largest of the processes' values is its crc32 (uint32: jax gathers no int64 by default).
    table = np.zeros(len(row), np.uint32)
    for at, data in mine:
        table[at] = int(buffer_crc32(np.asarray(data)), 16)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        table = np.max(np.asarray(multihost_utils.process_allgather(table)), axis=0)
    return {
        name: [[[list(b) for b in block], f"{int(table[row[name, block]]):08x}"] for block in held]
        for name, held in held_blocks.items()
    }


def damaged(array: Any, recorded: list[tuple[Block, str]]) -> Block | None:
    """The first recorded block whose bytes in ``array`` (what orbax read back, on any
    mesh, or numpy) do not match their crc32; None when every block this process can see
    matches. Blocks held by other processes are theirs to check (:func:`agree`)."""
    if isinstance(array, np.ndarray | np.generic):
        shards = [(tuple((0, n) for n in np.shape(array)), np.asarray(array))]
        whole = None
    else:
        shape = tuple(array.shape)
        shards = [(_block(s.index, shape), s.data) for s in array.addressable_shards]
        whole = array if array.is_fully_addressable else None
    host: dict[int, np.ndarray] = {}
    for block, crc in recorded:
        data = None
        for at, (held, shard) in enumerate(shards):
            pairs = list(zip(held, block, strict=True))
            if all(h0 <= b0 and b1 <= h1 for (h0, h1), (b0, b1) in pairs):
                if at not in host:
                    host[at] = np.asarray(shard)
                data = host[at][tuple(slice(b0 - h0, b1 - h0) for (h0, _), (b0, b1) in pairs)]
                break
        if data is None and whole is not None:  # spread over this process's shards
            if -1 not in host:
                host[-1] = np.asarray(whole)
            data = host[-1][tuple(slice(b0, b1) for b0, b1 in block)]
        if data is not None and buffer_crc32(data) != crc:
            return block
    return None


def agree(found: bool) -> bool:
    """Whether any process found a damaged block (every process asks: one small gather)."""
    if jax.process_count() == 1:
        return found
    from jax.experimental import multihost_utils

    flags = multihost_utils.process_allgather(np.asarray([int(found)], np.int32))
    return bool(np.asarray(flags).any())
