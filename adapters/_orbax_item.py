"""The model state of an nnxscan checkpoint as an orbax item that Flax's own code restores.

Flax's checkpointing guide loads a model for inference with
``ocp.StandardCheckpointer().restore(path, abstract_state)``. For that to read an nnxscan
checkpoint, nnxscan's own files storage also writes the tree's ``state`` entry as
``<step>/state/``, in the format orbax's ``StandardCheckpointer`` writes by default (an
OCDBT key-value store of zarr v2 arrays; orbax reads every format it ever wrote):

    <step>/state/
      _METADATA                      the tree: each leaf's key path and shape
      _sharding                      each array's device
      array_metadatas/process_0      shapes, and the PRNG implementation of key arrays
      manifest.ocdbt, d/<hash>       the OCDBT store (tensorstore, which flax installs)
                                     holding, per array, ``<param name>/.zarray`` (shape,
                                     dtype, one chunk, no compressor) and its chunk
                                     ``<param name>/0[.0...]``: the raw bytes, C order

Written through tensorstore's OCDBT driver in one transaction, committed while the rest of
the checkpoint is written: a handful of files however many arrays (deleting an old
checkpoint stays cheap), and far less of the background save thread's CPU than orbax's own save
(its per-array machinery; docs/checkpoints.md). nnxscan itself reads
the model state from ``arrays.bin``, checked by its crc32; this item is for Flax's code.
What orbax writes for the same tree is the reference (tests/test_checkpoint_trust.py).

Only a tree orbax would write this way gets an item: every leaf a jax/numpy array or PRNG
key of a dtype zarr stores, with no zero-sized axis, under a key path of plain names
(attribute names, dict keys and list indices of letters, digits, ``_`` and ``-``).
"""

from __future__ import annotations

import base64
import functools
import json
import pathlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

ITEM = "state"

# numpy's type strings as zarr v2 stores them; ml_dtypes' by name, as orbax writes them.
_ZARR_DTYPES = {
    "bool": "|b1", "int8": "|i1", "uint8": "|u1", "int16": "<i2", "uint16": "<u2",
    "int32": "<i4", "uint32": "<u4", "int64": "<i8", "uint64": "<u8", "float16": "<f2",
    "float32": "<f4", "float64": "<f8", "complex64": "<c8", "complex128": "<c16",
    "bfloat16": "bfloat16",
}  # fmt: skip
_KEY_NAME = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class ItemLeaf(NamedTuple):
    """One array of the item: its key path, the shape and dtype of its stored data (a key
    array's raw data), and the key implementation (keys only)."""

    keys: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    impl: str = ""

    @property
    def name(self) -> str:
        return ".".join(self.keys)

    @property
    def chunk(self) -> str:
        """The chunk's key in the item's store."""
        return f"{self.name}/{'.'.join(['0'] * max(len(self.shape), 1))}"


def item_keys(path: tuple) -> tuple[str, ...] | None:
    """A key path as orbax names it (None when a key is not a plain name)."""
    keys = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            key = entry.key
        elif isinstance(entry, jax.tree_util.GetAttrKey):
            key = entry.name
        elif isinstance(entry, jax.tree_util.SequenceKey):
            key = entry.idx
        else:
            return None
        key = str(key)
        if not key or not set(key) <= _KEY_NAME:
            return None
        keys.append(key)
    return tuple(keys)


def storable(shape: tuple[int, ...], dtype: str) -> bool:
    return dtype in _ZARR_DTYPES and all(n > 0 for n in shape)


def item_files(leaves: list[ItemLeaf], device: str) -> dict[str, bytes]:
    """The item's metadata: its files (paths relative to the item, ``_METADATA``...) and
    its store's ``.zarray`` keys (``<param name>/.zarray``)."""
    tree, sharding, arrays, files = {}, {}, [], {}
    placed = json.dumps({"sharding_type": "SingleDeviceSharding", "device_str": device})
    for leaf in leaves:
        name = leaf.name
        tree[str(leaf.keys)] = {
            "key_metadata": [{"key": key, "key_type": 2} for key in leaf.keys],
            "value_metadata": {
                "value_type": "jax.Array",
                "skip_deserialize": False,
                "write_shape": list(leaf.shape),
            },
        }
        sharding[base64.b64encode(name.encode()).decode()] = placed
        arrays.append(
            {
                "array_metadata": {
                    "param_name": name,
                    "write_shape": list(leaf.shape),
                    "chunk_shape": list(leaf.shape),
                    "ext_metadata": {"random_key_impl": leaf.impl} if leaf.impl else None,
                }
            }
        )
        zarray = {
            "chunks": list(leaf.shape), "compressor": None, "dimension_separator": ".",
            "dtype": _ZARR_DTYPES[leaf.dtype], "fill_value": None, "filters": None,
            "order": "C", "shape": list(leaf.shape), "zarr_format": 2,
        }  # fmt: skip
        files[f"{name}/.zarray"] = json.dumps(zarray).encode()
    metadata = {
        "tree_metadata": tree,
        "use_ocdbt": True,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    files["_METADATA"] = json.dumps(metadata).encode()
    files["_sharding"] = json.dumps(sharding).encode()
    files["array_metadatas/process_0"] = json.dumps({"array_metadatas": arrays}).encode()
    return files


#: The item's own files (the rest of ``item_files`` are keys of its store).
FILES = ("_METADATA", "_sharding", "array_metadatas/process_0")


def write_item(
    path: pathlib.Path, leaves: list[ItemLeaf], arrays: list[Any], files: dict[str, bytes]
) -> Callable[[], list[pathlib.Path]]:
    """Starts writing the item into the (new) folder ``path``: the store's keys in one
    tensorstore transaction, committed in tensorstore's threads while the caller writes its
    own files; returns ``finish()``, which waits for the commit, writes the metadata files
    and returns every file and folder of the item, for the caller to fsync with its own
    (tensorstore's own syncs are off: one pass of fsyncs covers everything)."""
    import tensorstore  # flax installs it; imported here, where it is first needed

    spec = {"driver": "ocdbt", "base": f"file://{path}/", "config": {"compression": None}}
    store = tensorstore.KvStore.open(spec, context=_context()).result()
    transaction = tensorstore.Transaction()
    keys = store.with_transaction(transaction)
    for leaf, array in zip(leaves, arrays, strict=True):
        keys[f"{leaf.name}/.zarray"] = files[f"{leaf.name}/.zarray"]
        keys[leaf.chunk] = np.ascontiguousarray(array).tobytes()
    committed = transaction.commit_async()

    def finish() -> list[pathlib.Path]:
        committed.result()
        for name in FILES:
            target = path / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(files[name])
        # Files first, then their folders, deepest first.
        written = sorted(path.rglob("*"), key=lambda p: (p.is_dir(), -len(p.parts)))
        return [*written, path]

    return finish


@functools.cache
def _context() -> Any:
    """One tensorstore context for every item this process writes (its thread pools made
    once), with its own fsyncs off: the checkpointer syncs the item's files itself,
    with its own, before the rename that makes the checkpoint."""
    import tensorstore

    return tensorstore.Context({"file_io_sync": False})


def device_name(array: Any) -> str:
    """The device orbax would record for a single-device (or host) array."""
    if isinstance(array, jax.Array):
        return str(next(iter(array.sharding.device_set)))
    return str(jax.local_devices()[0])
