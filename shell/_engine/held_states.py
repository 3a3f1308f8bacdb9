"""The epoch-end states a fused call returns for the checkpoints of its epochs.

Fused epochs that save (``schedule.Stretch.held``) run as an outer loop over the epochs, each
one the loop of steps a call of one epoch runs (bitwise the same steps); after each epoch the
carry's leaves are written into a slot of a bank the outer loop carries: one buffer per dtype
holding every leaf of that dtype flattened and joined, so that keeping a state costs one
copy per dtype, not one op per leaf (per-leaf copies made the program compile ~0.2 s longer
for a 19-leaf MLP). An epoch whose state is not kept writes into a spare slot. Typed PRNG
keys (which no buffer of numbers holds) keep a slot array of their own.

On the host the banks' slots are taken apart again (:meth:`BankPacking.unpack`): numpy views
of one copy per dtype (on the CPU, of the device buffer itself) and the keys' own arrays,
the carry's leaves in its order, bitwise what the carry held at that epoch's end.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


class BankPacking(NamedTuple):
    """How a carry's leaves are packed into the banks: ``places[i]``, where leaf ``i`` lies,
    is ``(group, offset)`` in the dtype group's buffer, or ``(-1, k)`` for the ``k``-th key
    leaf; ``groups``, the dtypes in order of first appearance; ``shapes``, each leaf's."""

    groups: tuple[str, ...]
    places: tuple[tuple[int, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]  # each group's elements

    @classmethod
    def of(cls, leaves: list) -> BankPacking:
        """The packing of a carry's leaves (arrays or their shapes and dtypes)."""
        groups: dict[str, int] = {}
        sizes: list[int] = []
        places, keys = [], 0
        for x in leaves:
            if _is_key(x):
                places.append((-1, keys))
                keys += 1
                continue
            group = groups.setdefault(np.dtype(x.dtype).name, len(groups))
            if group == len(sizes):
                sizes.append(0)
            places.append((group, sizes[group]))
            sizes[group] += int(np.prod(x.shape, dtype=np.int64))
        shapes = tuple(tuple(x.shape) for x in leaves)
        return cls(tuple(groups), tuple(places), shapes, tuple(sizes))

    def empty(self, leaves: list, slots: int) -> tuple[list, list]:
        """Banks of ``slots`` slots (traced, in the compiled call), the keys' filled with
        ``leaves``' own (a key array cannot be made of zeros)."""
        shapes = zip(self.groups, self.sizes, strict=True)
        packs = [jnp.zeros((slots, size), group) for group, size in shapes]
        keys = [jnp.broadcast_to(x, (slots, *x.shape)) for x in leaves if _is_key(x)]
        return packs, keys

    def put(self, banks: tuple[list, list], leaves: list, slot: Any) -> tuple[list, list]:
        """The banks with ``leaves`` written into slot ``slot`` (traced)."""
        packs, keys = banks
        parts: list[list] = [[] for _ in self.groups]
        new_keys = []
        for x, (group, _) in zip(leaves, self.places, strict=True):
            if group < 0:
                new_keys.append(x)
            else:
                parts[group].append(x.reshape(-1))
        packs = [
            jax.lax.dynamic_update_index_in_dim(pack, jnp.concatenate(part), slot, 0)
            for pack, part in zip(packs, parts, strict=True)
        ]
        keys = [
            jax.lax.dynamic_update_index_in_dim(bank, x, slot, 0)
            for bank, x in zip(keys, new_keys, strict=True)
        ]
        return packs, keys

    def outputs(self, banks: tuple[list, list], count: int) -> tuple[list, list]:
        """What the call returns of the banks: their first ``count`` slots (the spare one
        left), each key slot an array of its own."""
        packs, keys = banks
        return [pack[:count] for pack in packs], [[k[j] for k in keys] for j in range(count)]

    def unpack(self, outputs: tuple[list, list], count: int) -> list[list]:
        """The ``count`` kept states' leaves, in the carry's order: numpy views of one host
        copy per dtype group, and the key leaves' arrays."""
        packs, keys = outputs
        host = [np.asarray(pack) for pack in jax.device_get(packs)]
        states = []
        for j in range(count):
            leaves = []
            for (group, at), shape in zip(self.places, self.shapes, strict=True):
                if group < 0:
                    leaves.append(keys[j][at])
                    continue
                size = int(np.prod(shape, dtype=np.int64))
                leaves.append(host[group][j, at : at + size].reshape(shape))
            states.append(leaves)
        return states
