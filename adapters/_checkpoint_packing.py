"""How a tree is laid out in a checkpoint: each leaf's record, and the buffers it is saved in.

Worked out once per tree structure (a fit saves one structure, every epoch), so a save of
the same structure only copies its arrays to the host:

- the arrays this process holds whole (on one device, replicated, or numpy): joined into
  one flat buffer per dtype in ``arrays.bin`` (orbax's cost is per array); the model state
  (the tree's ``state`` entry) is also written as the ``state/`` item Flax's code restores
  (``_orbax_item.py``), when orbax would write it so;
- arrays sharded over several devices or processes: left to orbax, each process writing
  its own shards;
- Python bool/int/float/str leaves: their values, in the manifest.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from nnxscan.adapters import _orbax_item
from nnxscan.adapters._checkpoint_manifest import ARRAY_KINDS, PYTHON_KINDS, Leaf
from nnxscan.adapters.nnx_optimizer import _is_variable

_STATE = "['state']"


def flatten(tree: Any) -> list[tuple[str, Any]]:
    """(path, leaf) pairs, Variables replaced by their values (their wrappers dropped).

    A Variable flattens to its value under an extra ``.value`` path entry; taking each
    Variable as a leaf and then its value gives an nnx.State and its pure dict the same
    paths. The leaves are in the order of ``jax.tree.leaves(tree)``, so the full treedef
    (Variables kept, see :func:`treedef_of`) rebuilds the caller's Variables from them.
    """
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
    return [
        (jax.tree_util.keystr(path), leaf.get_value() if _is_variable(leaf) else leaf)
        for path, leaf in pairs
    ]


def treedef_of(tree: Any, leaves: int) -> Any:
    treedef = jax.tree.structure(tree)
    if treedef.num_leaves != leaves:  # pragma: no cover - a Variable with extra children
        raise TypeError("a Variable in the tree flattens to more than its value")
    return treedef


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def _dtype_kind(dtype: Any) -> tuple[str, str]:
    # Cached: a save describes every leaf, and naming a dtype is not free.
    return ("key" if _is_key(dtype) else "array"), str(dtype)


def describe_template(path: str, leaf: Any) -> Leaf:
    """The record of a template's (or a saved tree's) leaf, before any packing."""
    # numpy scalars first: np.float64 is also a Python float, but it is an array leaf.
    if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        kind, dtype = _dtype_kind(leaf.dtype)
        return Leaf(path, kind, tuple(leaf.shape), dtype)
    if type(leaf) in PYTHON_KINDS.values():  # exact types: an IntEnum is not a counter
        return Leaf(path, type(leaf).__name__, value=leaf)
    raise TypeError(
        f"leaf {path} is a {type(leaf).__name__}: a checkpoint holds jax or numpy arrays "
        f"(PRNG keys included), jax.ShapeDtypeStruct in a template, and Python "
        f"bool/int/float/str. Convert the leaf, or keep it out of the tree."
    )


class Packing(NamedTuple):
    """How a tree of one structure is saved: each leaf's record (path, kind, buffer and
    offset) and which leaves each buffer holds."""

    records: tuple[Leaf, ...]  # per leaf; a Python leaf's value is filled in per save
    entries: tuple[dict[str, Any], ...]  # the records as the manifest's JSON
    python: tuple[int, ...]  # the Python leaves (bool/int/float/str), by index
    keys: frozenset[int]  # typed PRNG key leaves: saved as their key data
    packs: dict[str, tuple[int, ...]]  # packed buffer of arrays.bin -> its leaves, in order
    item: tuple[tuple[int, Any], ...]  # (leaf, ItemLeaf) of the state item (() without one)
    item_files: dict[str, bytes]  # the state item's metadata ({} without an item)
    arrays: dict[str, int]  # arrays left to orbax (sharded): name -> leaf
    held_whole: bool  # nnxscan's own files can hold it (see _held_whole)
    on_host: bool  # every packed array is numpy or on a CPU device: readable in place


# The packings of the last few structures saved, newest first: shared by the checkpointers
# of successive fits (and save_checkpoint calls) that save the same model. Compared, not
# hashed: a treedef's Variable metadata need not be hashable.
_PACKINGS: list[tuple[Any, Packing]] = []
_KEPT_PACKINGS = 8
_PACKINGS_LOCK = threading.Lock()  # checkpointers may save from several threads


def _signature(leaf: Any) -> Any:
    """What a leaf's record depends on besides its path (a Python leaf's value does not)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, leaf.sharding
    if isinstance(leaf, np.ndarray | np.generic):
        return type(leaf), leaf.shape, leaf.dtype
    return type(leaf)


def packing_of(tree: dict[str, Any], with_item: bool = True) -> tuple[Packing, list]:
    """The tree's leaves and their packing: worked out at the first save of each structure,
    then reused (a flat list and a comparison instead of a path walk). ``with_item``: lay
    the model state out as the ``state/`` item where nnxscan's own files can hold it."""
    leaves, treedef = jax.tree.flatten(tree)
    key = (treedef, tuple(_signature(leaf) for leaf in leaves), with_item)
    with _PACKINGS_LOCK:
        for index, (known, packing) in enumerate(_PACKINGS):
            if known == key:
                _PACKINGS.insert(0, _PACKINGS.pop(index))  # most recently used first
                return packing, leaves
    packing = _packing(tree, with_item)  # raises for a bad leaf: nothing is kept then
    with _PACKINGS_LOCK:
        _PACKINGS.insert(0, (key, packing))
        del _PACKINGS[_KEPT_PACKINGS:]
    return packing, leaves


def array_data(leaf: Any, is_key: bool) -> Any:
    if is_key:
        return jax.random.key_data(leaf)
    return np.asarray(leaf) if isinstance(leaf, np.generic) else leaf


def packable(x: Any) -> bool:
    """An array this process holds whole: on one device, replicated, or numpy."""
    if isinstance(x, np.ndarray):
        return True
    sharding = getattr(x, "sharding", None)
    return (
        isinstance(x, jax.Array)
        and x.is_fully_addressable
        and (len(sharding.device_set) == 1 or sharding.is_fully_replicated)
    )


def _item_leaves(tree: dict[str, Any], data: list[Any]) -> list[_orbax_item.ItemLeaf] | None:
    """The ``state`` entry's arrays as an orbax item (``data``: their stored arrays, in
    order), or None when orbax would not write it so (see _orbax_item.py)."""
    paths = jax.tree_util.tree_flatten_with_path(tree["state"])[0]
    leaves = []
    for (path, leaf), stored in zip(paths, data, strict=True):
        keys = _orbax_item.item_keys(path)
        dtype = np.dtype(stored.dtype).name
        if keys is None or not _orbax_item.storable(tuple(stored.shape), dtype):
            return None
        impl = str(jax.random.key_impl(leaf)) if _is_key(leaf.dtype) else ""
        leaves.append(_orbax_item.ItemLeaf(keys, tuple(stored.shape), dtype, impl))
    if len({leaf.name for leaf in leaves}) != len(leaves):
        return None  # two paths with one orbax name ("a.b" and "a"/"b")
    return leaves


def _packing(tree: dict[str, Any], with_item: bool) -> Packing:
    """Checks every leaf of ``tree`` and lays out its manifest and buffers."""
    pairs = flatten(tree)
    leaves = jax.tree.leaves(tree)
    if len(pairs) != len(leaves):  # pragma: no cover - a Variable with extra children
        raise TypeError("a Variable in the tree flattens to more than its value")
    described, data = [], []
    for (path, leaf), value in zip(pairs, leaves, strict=True):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"leaf {path} is an abstract jax.ShapeDtypeStruct: save concrete arrays "
                f"(templates with ShapeDtypeStruct leaves are for restore_checkpoint)"
            )
        record = describe_template(path, leaf)
        described.append(record)
        data.append(array_data(value, record.kind == "key") if record.kind in ARRAY_KINDS else None)
    arrays_held = all(packable(x) for x in data if x is not None)
    held_whole = jax.process_count() == 1 and arrays_held
    state = [i for i, (path, _) in enumerate(pairs) if path.startswith(_STATE)]
    item_leaves = None
    if with_item and held_whole and state and all(data[i] is not None for i in state):
        item_leaves = _item_leaves(tree, [data[i] for i in state])
    records, python, keys, arrays, on_host = [], [], set(), {}, True
    packs: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for index, ((path, leaf), record) in enumerate(zip(pairs, described, strict=True)):
        if record.kind not in ARRAY_KINDS:
            python.append(index)
            records.append(record)
            continue
        impl = ""
        if record.kind == "key":
            # orbax cannot write typed key arrays; their raw bits and the implementation
            # name rebuild them exactly.
            impl = str(jax.random.key_impl(leaf))
            keys.add(index)
        value = data[index]
        if packable(value):
            buffer = f"pack_{_dtype_kind(value.dtype)[1]}"
            offset = sizes.get(buffer, 0)
            sizes[buffer] = offset + value.size
            packs.setdefault(buffer, []).append(index)
        else:
            name = f"leaf_{index:05d}"
            arrays[name] = index
            records.append(Leaf(path, record.kind, record.shape, record.dtype, impl, name))
            continue
        if isinstance(value, jax.Array):
            on_host = on_host and all(d.platform == "cpu" for d in value.devices())
        records.append(Leaf(path, record.kind, record.shape, record.dtype, impl, "", None,
                            buffer, offset, tuple(value.shape)))  # fmt: skip
    item_files = {}
    if item_leaves:
        device = _orbax_item.device_name(data[state[0]])
        item_files = _orbax_item.item_files(item_leaves, device)
    return Packing(
        records=tuple(records),
        entries=tuple(record.to_json() for record in records),
        python=tuple(python),
        keys=frozenset(keys),
        packs={pack: tuple(indices) for pack, indices in packs.items()},
        item=tuple(zip(state, item_leaves, strict=True)) if item_leaves else (),
        item_files=item_files,
        arrays=arrays,
        held_whole=held_whole,
        on_host=on_host,
    )


def fill(packing: Packing, leaves: list) -> tuple[list[dict[str, Any]], dict[str, Any], list]:
    """The manifest's leaf entries, the buffers to write (name -> array: the packed
    buffers of ``arrays.bin``, and the arrays left to orbax) and the state item's arrays
    (views of the packed buffers), for ``leaves`` laid out by ``packing``. Every packed
    buffer is a copy made here, on the host: what is written is what the tree held now,
    whatever happens to its device buffers next."""
    entries = list(packing.entries)
    for index in packing.python:
        leaf = leaves[index]
        entries[index] = Leaf(packing.records[index].path, type(leaf).__name__,
                              value=leaf).to_json()  # fmt: skip
    buffers: dict[str, Any] = {
        name: array_data(leaves[index], index in packing.keys)
        for name, index in packing.arrays.items()
    }
    packed = [index for indices in packing.packs.values() for index in indices]
    values = [array_data(leaves[i], i in packing.keys) for i in packed]
    host = iter(_to_host(values, start=not packing.on_host))
    for pack, indices in packing.packs.items():
        # The copy out of the device buffers (on the CPU, np.asarray is a view of them).
        buffers[pack] = np.concatenate([next(host).reshape(-1) for _ in indices])
    item = []
    for index, _ in packing.item:
        record = packing.records[index]
        size = int(np.prod(record.data_shape, dtype=np.int64))
        flat = buffers[record.buffer][record.offset : record.offset + size]
        item.append(flat.reshape(record.data_shape))
    return entries, buffers, item


def _to_host(arrays: list[Any], start: bool = True) -> list[np.ndarray]:
    """``jax.device_get`` of a flat list, without its per-leaf tree walk (a save holds many
    small arrays; docs/performance.md): with ``start``, every transfer is started first
    (arrays on an accelerator), then each is read (on the CPU a read is a view of the device
    buffer: the caller copies before returning)."""
    if start:
        for x in arrays:
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
    return [np.asarray(x) for x in arrays]
