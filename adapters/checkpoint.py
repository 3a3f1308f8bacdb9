"""Numbered, atomic checkpoints of plain pytrees: own files, or orbax-checkpoint if sharded.

A checkpoint holds everything a run needs to resume — the module state, the optax state, the
epoch and step counters, the seed — as one dict of pytrees, and restores it into the
structure of a template (the current state and opt_state of a freshly built model):

    save_checkpoint(directory, step, {"state": state, "opt_state": opt_state, "meta": meta})
    tree, step = restore_checkpoint(directory, like={"state": state, "opt_state": ..., ...})

Leaves are saved by their path, never by their Python container, so:

- ``nnx.Variable`` wrappers are dropped (their value is saved under the path of the
  Variable): an ``nnx.State`` and its pure dict (``nnx.to_pure_dict``) share one format and
  either restores into the other; restoring into a State template rebuilds its Variables,
  metadata included, from the template.
- optax states (NamedTuples, possibly holding ``nnx.State``) are saved leaf by leaf and come
  back in the caller's template structure.
- typed PRNG key arrays, which orbax cannot write, are saved as ``jax.random.key_data`` plus
  their implementation's name and rebuilt with ``jax.random.wrap_key_data``.
- Python ``bool``/``int``/``float``/``str`` leaves (counters, seeds) are stored exactly, as
  JSON, and come back with their type.

Storage. A tree this process holds whole (a single-process run whose arrays are on one
device or replicated, or numpy) is written as nnxscan's own files; arrays sharded over
devices or processes go through orbax-checkpoint's ``CheckpointManager``, each process
writing its shards (``storage="orbax"`` sends everything there). Both name a finished
checkpoint by its step, so one listing, one ``max_to_keep`` and one reader serve both::

    <directory>/                        absolute (resolved); created by the first save
      <step>/                           nnxscan's own files (see _checkpoint_files.py)
        manifest.json                   the manifest (below), plus each packed buffer's
                                        byte offset, dtype and size in arrays.bin
        arrays.bin                      the packed buffers, raw
      <step>/                           or orbax's
        _CHECKPOINT_METADATA            orbax: when it was written
        manifest/metadata               the manifest
        arrays/                         orbax PyTree (OCDBT/tensorstore): the packed
                                        buffers, and each array sharded over devices or
                                        processes on its own, named leaf_00000, ...
      <step>.nnxscan-tmp/               a save in progress, or one killed mid-way
      <step>.orbax-checkpoint-tmp-*/    (either storage's): never listed, never restored;
                                        the next save of that step replaces it
      history.jsonl                     the run log (either storage's): bytes appended with
                                        CheckpointWriter.append_log, each fsync'ed before
                                        the next checkpoint is renamed into place

The manifest (JSON): format name and version, and per leaf in flattening order its path
(jax keystr, e.g. "['state']['l1']['kernel']"), kind ("array", "key", or a Python type),
shape, dtype, key implementation, and either the packed buffer and offset holding its
elements (pack_float32, ...: the arrays this process holds whole, joined into one flat
buffer per dtype), its orbax array name, or the Python value itself.

Atomicity: a checkpoint is written under a temporary name and renamed to ``<step>`` only
after every file is written and flushed (our files are fsync'ed, the rename too); on a
local (POSIX) filesystem the rename is atomic, and step listings skip temporary names. A
process killed during a save therefore leaves every earlier checkpoint intact and
restorable, and ``latest_step`` never returns the half-written one. ``save_checkpoint``
returns only after the rename, so the checkpoint it reports is on disk.

The run log keeps a save's cost flat as a run grows: what grows (a fit's History) is
appended to the log, and a checkpoint's tree records only where its part of the log ends
(:meth:`CheckpointWriter.append_log` returns that offset; :func:`read_log` reads a range
back). A checkpoint never refers to bytes that are not on disk before it: appends are
written and fsync'ed, in the writer's order, before the next checkpoint's files. With
several processes only process 0 writes the log; every process reads it.

orbax-checkpoint ships with flax; it is imported only inside these functions, because
importing it configures absl logging on the root logger.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import pathlib
import threading
from typing import Any, NamedTuple

import jax
import numpy as np

from nnxscan.adapters import _checkpoint_files as _files
from nnxscan.adapters._extras import require_extra
from nnxscan.adapters.nnx_optimizer import _is_variable
from nnxscan.pure.checks import check_count

__all__ = [
    "CheckpointWriter",
    "all_steps",
    "latest_step",
    "read_log",
    "restore_checkpoint",
    "save_checkpoint",
]

_FORMAT = "nnxscan.checkpoint"
_VERSION = 3  # 2: small arrays packed into one buffer per dtype; 3: own files storage
_PYTHON_KINDS = {"bool": bool, "int": int, "float": float, "str": str}
_ARRAY_KINDS = ("array", "key")


def _orbax() -> Any:
    # orbax-checkpoint is a flax dependency; the extra pins the version tested.
    return require_extra("orbax.checkpoint", "checkpoint", needed_by="nnxscan checkpoints")


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """What one leaf is, as the manifest records it (the saved side) or a template has it."""

    path: str
    kind: str  # "array", "key", or a key of _PYTHON_KINDS
    shape: tuple[int, ...] = ()
    dtype: str = ""
    impl: str = ""  # PRNG implementation name, for keys
    name: str = ""  # the array's name in the orbax item, for arrays and keys
    value: Any = None  # the value itself, for Python leaves
    pack: str = ""  # the packed buffer holding this array's elements (see _layout)
    offset: int = 0  # where in that buffer its elements start
    data_shape: tuple[int, ...] = ()  # a packed key's raw data (its shape + the impl's)

    def describe(self) -> str:
        if self.kind == "array":
            return f"shape {self.shape} {self.dtype}"
        if self.kind == "key":
            return f"shape {self.shape} {self.dtype} (PRNG keys)"
        return f"a Python {self.kind}"

    def fits(self, other: _Leaf) -> bool:
        if self.kind in _ARRAY_KINDS:
            return (self.kind, self.shape, self.dtype) == (other.kind, other.shape, other.dtype)
        return self.kind == other.kind

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"path": self.path, "kind": self.kind}
        if self.kind in _ARRAY_KINDS:
            record.update(shape=list(self.shape), dtype=self.dtype, name=self.name)
            if self.kind == "key":
                record["impl"] = self.impl
            if self.pack:
                record.update(pack=self.pack, offset=self.offset, data_shape=list(self.data_shape))
        else:
            record["value"] = self.value
        return record

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> _Leaf:
        shapes = {k: tuple(record.get(k, ())) for k in ("shape", "data_shape")}
        return cls(**{**record, **shapes})


def _flatten(tree: Any) -> list[tuple[str, Any]]:
    """(path, leaf) pairs, Variables replaced by their values (their wrappers dropped).

    A Variable flattens to its value under an extra ``.value`` path entry; taking each
    Variable as a leaf and then its value gives an nnx.State and its pure dict the same
    paths. The leaves are in the order of ``jax.tree.leaves(tree)``, so the full treedef
    (Variables kept, see :func:`_treedef`) rebuilds the caller's Variables from them.
    """
    pairs = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_variable)[0]
    return [
        (jax.tree_util.keystr(path), leaf.get_value() if _is_variable(leaf) else leaf)
        for path, leaf in pairs
    ]


def _treedef(tree: Any, leaves: int) -> Any:
    treedef = jax.tree.structure(tree)
    if treedef.num_leaves != leaves:  # pragma: no cover - a Variable with extra children
        raise TypeError("a Variable in the tree flattens to more than its value")
    return treedef


def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def _dtype_kind(dtype: Any) -> tuple[str, str]:
    # Cached: a save describes every leaf, and naming a dtype costs microseconds each.
    return ("key" if _is_key(dtype) else "array"), str(dtype)


def _describe_template(path: str, leaf: Any) -> _Leaf:
    # numpy scalars first: np.float64 is also a Python float, but it is an array leaf.
    if isinstance(leaf, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct):
        kind, dtype = _dtype_kind(leaf.dtype)
        return _Leaf(path, kind, tuple(leaf.shape), dtype)
    if type(leaf) in _PYTHON_KINDS.values():  # exact types: an IntEnum is not a counter
        return _Leaf(path, type(leaf).__name__, value=leaf)
    raise TypeError(
        f"leaf {path} is a {type(leaf).__name__}: a checkpoint holds jax or numpy arrays "
        f"(PRNG keys included), jax.ShapeDtypeStruct in a template, and Python "
        f"bool/int/float/str. Convert the leaf, or keep it out of the tree."
    )


class _Layout(NamedTuple):
    """How a tree of one structure is saved, worked out once per structure: each leaf's
    record (path, kind, pack and offset), so that a save of the same structure only copies
    its arrays to the host (a fit saves one structure, every epoch)."""

    records: tuple[_Leaf, ...]  # per leaf; a Python leaf's value is filled in per save
    entries: tuple[dict[str, Any], ...]  # the records as the manifest's JSON
    python: tuple[int, ...]  # the Python leaves (bool/int/float/str), by index
    keys: frozenset[int]  # typed PRNG key leaves: saved as their key data
    packs: dict[str, tuple[int, ...]]  # packed buffer -> the leaves joined into it, in order
    arrays: dict[str, int]  # arrays left to orbax (sharded): name -> leaf
    held_whole: bool  # nnxscan's own files can hold it (see _held_whole)
    on_host: bool  # every packed array is numpy or on a CPU device: readable in place


# The layouts of the last few structures saved, newest first: shared by the writers of
# successive fits (and save_checkpoint calls) that save the same model. Compared, not
# hashed: a treedef's Variable metadata need not be hashable.
_LAYOUTS: list[tuple[Any, _Layout]] = []
_KEPT_LAYOUTS = 8
_LAYOUTS_LOCK = threading.Lock()  # writers may save from several threads


def _signature(leaf: Any) -> Any:
    """What a leaf's record depends on besides its path (a Python leaf's value does not)."""
    if isinstance(leaf, jax.Array):
        return leaf.shape, leaf.dtype, leaf.sharding
    if isinstance(leaf, np.ndarray | np.generic):
        return type(leaf), leaf.shape, leaf.dtype
    return type(leaf)


def _array_data(leaf: Any, is_key: bool) -> Any:
    if is_key:
        return jax.random.key_data(leaf)
    return np.asarray(leaf) if isinstance(leaf, np.generic) else leaf


def _layout(tree: dict[str, Any]) -> _Layout:
    """Checks every leaf of ``tree`` and lays out its manifest and buffers.

    orbax's cost is per array (~1 ms of CPU each here): the arrays this process holds whole
    (on one device, replicated, or numpy) are joined into one flat buffer per dtype, each
    leaf recorded by buffer and offset. Arrays sharded over several devices or processes
    are left to orbax, each process writing its own shards.
    """
    pairs = _flatten(tree)
    leaves = jax.tree.leaves(tree)
    if len(pairs) != len(leaves):  # pragma: no cover - a Variable with extra children
        raise TypeError("a Variable in the tree flattens to more than its value")
    records, python, keys, arrays, on_host = [], [], set(), {}, True
    packs: dict[str, list[int]] = {}
    sizes: dict[str, int] = {}
    for index, (path, leaf) in enumerate(pairs):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            raise TypeError(
                f"leaf {path} is an abstract jax.ShapeDtypeStruct: save concrete arrays "
                f"(templates with ShapeDtypeStruct leaves are for restore_checkpoint)"
            )
        record = _describe_template(path, leaf)
        if record.kind not in _ARRAY_KINDS:
            python.append(index)
            records.append(record)
            continue
        impl = ""
        if record.kind == "key":
            # orbax cannot write typed key arrays; their raw bits and the implementation
            # name rebuild them exactly.
            impl = str(jax.random.key_impl(leaf))
            keys.add(index)
        data = _array_data(leaves[index], record.kind == "key")
        if _packable(data):
            pack = f"pack_{_dtype_kind(data.dtype)[1]}"
            offset = sizes.get(pack, 0)
            sizes[pack] = offset + data.size
            packs.setdefault(pack, []).append(index)
            if isinstance(data, jax.Array):
                on_host = on_host and all(d.platform == "cpu" for d in data.devices())
            record = _Leaf(path, record.kind, record.shape, record.dtype, impl, "", None,
                           pack, offset, tuple(data.shape))  # fmt: skip
        else:
            name = f"leaf_{index:05d}"
            arrays[name] = index
            record = _Leaf(path, record.kind, record.shape, record.dtype, impl, name)
        records.append(record)
    return _Layout(
        records=tuple(records),
        entries=tuple(record.to_json() for record in records),
        python=tuple(python),
        keys=frozenset(keys),
        packs={pack: tuple(members) for pack, members in packs.items()},
        arrays=arrays,
        held_whole=_held_whole(records),
        on_host=on_host,
    )


def _fill(layout: _Layout, leaves: list) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The manifest's leaf entries and the arrays to write, for ``leaves`` laid out by
    ``layout``. The packed buffers are copies made here, on the host: what is written is
    what the tree held now, whatever happens to its device buffers next."""
    entries = list(layout.entries)
    for index in layout.python:
        leaf = leaves[index]
        entries[index] = _Leaf(layout.records[index].path, type(leaf).__name__,
                               value=leaf).to_json()  # fmt: skip
    arrays = {
        name: _array_data(leaves[index], index in layout.keys)
        for name, index in layout.arrays.items()
    }
    members = [index for indices in layout.packs.values() for index in indices]
    values = [_array_data(leaves[i], i in layout.keys) for i in members]
    host = iter(_to_host(values, start=not layout.on_host))
    for pack, indices in layout.packs.items():
        # The copy out of the device buffers (on the CPU, np.asarray is a view of them).
        arrays[pack] = np.concatenate([next(host).reshape(-1) for _ in indices])
    return entries, arrays


def _packable(x: Any) -> bool:
    """An array this process holds whole: on one device, replicated, or numpy."""
    if isinstance(x, np.ndarray):
        return True
    sharding = getattr(x, "sharding", None)
    return (
        isinstance(x, jax.Array)
        and x.is_fully_addressable
        and (len(sharding.device_set) == 1 or sharding.is_fully_replicated)
    )


def _to_host(arrays: list[Any], start: bool = True) -> list[np.ndarray]:
    """``jax.device_get`` of a flat list, without its per-leaf tree walk (5x faster for a
    hundred small arrays here): with ``start``, every transfer is started first (arrays on
    an accelerator), then each is read (on the CPU a read is a view of the device buffer:
    the caller copies before returning)."""
    if start:
        for x in arrays:
            if isinstance(x, jax.Array):
                x.copy_to_host_async()
    return [np.asarray(x) for x in arrays]


def _resolve(directory: str | os.PathLike[str]) -> pathlib.Path:
    # orbax requires absolute paths.
    return pathlib.Path(directory).expanduser().resolve()


def _as_step(step: Any, what: str) -> int:
    return check_count(step, what, 0)


def _reader(ocp: Any, path: pathlib.Path) -> Any:
    # create=False: reading must not create the directory, nor write anything into it.
    options = ocp.CheckpointManagerOptions(create=False, enable_async_checkpointing=False)
    return ocp.CheckpointManager(path, options=options)


_STORAGES = ("auto", "orbax")


def _held_whole(records: list[_Leaf]) -> bool:
    """Whether nnxscan's own files can hold the tree: one process, and every array packed
    (none sharded over devices: those are orbax's, each process writing its shards)."""
    arrays = [record for record in records if record.kind in _ARRAY_KINDS]
    return jax.process_count() == 1 and all(record.pack for record in arrays)


class CheckpointWriter:
    """Writes a run's checkpoints into ``directory``, by default in the background.

    With ``asynchronous`` (the default) a :meth:`save` returns once the arrays are copied
    from the devices to the host, and writes them to disk in a background thread: the next
    compiled call may donate the device buffers at once, and training goes on while the
    checkpoint is written. Every other use of the directory waits for the write in flight
    first — the next save, :meth:`latest_step`, :meth:`wait`, :meth:`close` — so a
    checkpoint is never read half-written and a run never ends before its last save is on
    disk, and a failed write raises there. A process killed mid-write loses only that save
    (a checkpoint is renamed into place only once every file is written and fsync'ed).
    ``asynchronous=False`` makes each save durable on return.

    Storage: a tree one process holds whole (every single-process run not sharded over
    devices) is written as one raw file of packed buffers plus a JSON manifest — a few ms
    of CPU, where orbax takes ~45 ms for a 5.6 MB model here, CPU that a background write
    takes from training. Arrays sharded over devices or processes go through one orbax
    ``CheckpointManager`` (each process writes its shards). ``storage="orbax"`` writes
    every checkpoint through orbax. :func:`restore_checkpoint` reads both, and a directory
    may hold both.

    Nothing touches the disk before the first save. Use it as a context manager, or call
    :meth:`close`.

    Example:
      >>> with CheckpointWriter("runs/ckpt") as writer:
      ...     writer.save(100, {"state": nnx.state(model), "meta": {"step": 100}})
      ...     train_more()                 # while step 100 is written
      ...     writer.save(200, tree)       # waits for step 100 first
      PosixPath('/home/me/runs/ckpt/100')
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        asynchronous: bool = True,
        storage: str = "auto",
    ) -> None:
        if storage not in _STORAGES:
            raise ValueError(f"storage must be one of {_STORAGES}, got {storage!r}")
        self.path = _resolve(directory)
        self.max_to_keep = check_count(max_to_keep, "max_to_keep", 1)
        self.asynchronous = bool(asynchronous)
        self.storage = storage
        self._manager: Any = None  # orbax's, opened by the first save that needs it
        self._thread: Any = None  # the background writer of our own files
        self._in_flight: Any = None  # that writer's Future
        self._cleaned = False  # leftovers of killed processes removed (at the first save)
        # The steps on disk or being written, newest last: read from the directory once,
        # then kept by this writer, so asking "is step N saved?" never waits for a write.
        self._steps: list[int] | None = None
        # The run log's size once every append so far is written (read from the disk at
        # the first append), and the appends not yet handed to a write.
        self._log_size: int | None = None
        self._log_pending: list[bytes] = []

    def _orbax_manager(self) -> Any:
        if self._manager is None:
            ocp = _orbax()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                create=True,
                enable_async_checkpointing=self.asynchronous,
            )
            self._manager = ocp.CheckpointManager(self.path, options=options)
        else:
            self._manager.reload()  # our own files may have come and gone since
        return self._manager

    def _layout_of(self, tree: dict[str, Any]) -> tuple[_Layout, list]:
        """The tree's leaves and their layout: worked out at the first save of each
        structure, then reused (a flat list and a comparison instead of a path walk)."""
        leaves, treedef = jax.tree.flatten(tree)
        key = (treedef, tuple(_signature(leaf) for leaf in leaves))
        with _LAYOUTS_LOCK:
            for index, (known, layout) in enumerate(_LAYOUTS):
                if known == key:
                    _LAYOUTS.insert(0, _LAYOUTS.pop(index))  # most recently used first
                    return layout, leaves
        layout = _layout(tree)  # raises for a bad leaf: nothing is kept then
        with _LAYOUTS_LOCK:
            _LAYOUTS.insert(0, (key, layout))
            del _LAYOUTS[_KEPT_LAYOUTS:]
        return layout, leaves

    def newest_step(self) -> int | None:
        """The newest checkpoint's step, on disk or being written (never waits)."""
        if self._steps is None:
            return latest_step(self.path)
        return self._steps[-1] if self._steps else None

    def wait(self) -> None:
        """Returns once the save in flight (if any) is on disk; re-raises its failure."""
        if self._manager is not None:
            self._manager.wait_until_finished()
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            try:
                in_flight.result()
            except BaseException:
                self._steps = _files.finished_steps(self.path)  # the failed one is not
                raise

    def append_log(self, data: bytes) -> int:
        """Appends ``data`` to the directory's run log (``history.jsonl``); returns the
        log's size in bytes with it, at once: the offset a checkpoint saved next records
        as the end of its part of the log (see :func:`read_log`).

        The bytes are written and fsync'ed, in order, before the next checkpoint's files
        (in the background with ``asynchronous``), or by :meth:`close`: a checkpoint never
        refers to bytes not on disk. ``append_log(b"")`` is the log's size now.

        Example:
          >>> with CheckpointWriter("runs/ckpt") as writer:
          ...     end = writer.append_log(b'{"epoch": 0}\\n')
          ...     writer.save(100, {"meta": {"log_end": end}})
        """
        if self._log_size is None:
            self._log_size = _files.log_size(self.path)
        if data:
            self._log_pending.append(bytes(data))
            self._log_size += len(data)
        return self._log_size

    def truncate_log(self, size: int) -> None:
        """Cuts the run log back to ``size`` bytes: what a restored checkpoint recorded as
        its end. What a killed process appended after its last finished checkpoint goes;
        appends start from there."""
        size = _as_step(size, "size")
        self.wait()
        self._log_pending.clear()
        if jax.process_index() == 0:  # only process 0 writes the log
            _files.truncate_log(self.path, size)
        self._log_size = size

    def _take_log(self) -> bytes:
        data, self._log_pending = b"".join(self._log_pending), []
        return data if jax.process_index() == 0 else b""

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step (after waiting for the one in flight)."""
        self.wait()
        return latest_step(self.path)

    def save(self, step: int, tree: dict[str, Any], *, replace: bool = False) -> pathlib.Path:
        """Saves ``tree`` as checkpoint ``step`` (see :func:`save_checkpoint` for the tree,
        ``replace`` and the errors); returns ``<directory>/<step>``, on disk once
        :meth:`wait` returns (at once with ``asynchronous=False``)."""
        if not isinstance(tree, dict):
            raise TypeError(f"tree must be a dict of pytrees, got {type(tree).__name__}")
        step = _as_step(step, "step")
        # Every leaf is checked before anything touches the disk. This copies the arrays to
        # the host: what is written is what the tree held now, whatever happens to it next.
        layout, leaves = self._layout_of(tree)
        entries, arrays = _fill(layout, leaves)
        manifest = {"format": _FORMAT, "version": _VERSION, "leaves": entries}
        own_files = self.storage == "auto" and layout.held_whole
        # One write at a time, in order: the previous one finishes before this one starts.
        self.wait()
        manager = None if own_files else self._orbax_manager()
        if self._steps is None:
            self._steps = _files.finished_steps(self.path)
        steps = self._steps
        if step in steps and replace:
            if manager is not None:
                manager.delete(step)
            else:
                _files.delete(self.path, step)
            steps.remove(step)
        if step in steps:
            raise FileExistsError(
                f"checkpoint {step} already exists in {self.path}: save under a new step, "
                f"or delete {self.path / str(step)} first"
            )
        if steps and step < steps[-1]:
            # orbax would silently skip such a save, and max_to_keep would delete it first.
            raise ValueError(
                f"step {step} is older than the latest checkpoint {steps[-1]} in "
                f"{self.path}: checkpoint steps must increase. Save into another directory, "
                f"or delete the newer checkpoints first."
            )
        log = self._take_log()  # before this checkpoint, in the same write
        if own_files:
            self._write_files(step, manifest, arrays, log)
        else:
            if log:  # orbax writes in its own threads: the log is on disk first
                _files.append_log(self.path, log)
            self._write_orbax(manager, step, manifest, arrays)
        self._steps = [*steps, step][-self.max_to_keep :]  # what max_to_keep will leave
        return self.path / str(step)

    def _write_files(
        self, step: int, manifest: dict[str, Any], buffers: dict, log: bytes = b""
    ) -> None:
        def write() -> None:
            if log:
                _files.append_log(self.path, log)
            _files.write(self.path, step, manifest, buffers)
            _files.keep_newest(self.path, self.max_to_keep)

        if not self._cleaned:
            _files.remove_leftovers(self.path)  # of a process killed mid-save or mid-delete
            self._cleaned = True
        if not self.asynchronous:
            write()
            return
        if self._thread is None:
            self._thread = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="nnxscan-checkpoint"
            )
        self._in_flight = self._thread.submit(write)

    def _write_orbax(self, manager: Any, step: int, manifest: dict, arrays: dict) -> None:
        ocp = _orbax()
        items = {"manifest": ocp.args.JsonSave(manifest)}
        if arrays:
            items["arrays"] = ocp.args.PyTreeSave(arrays)
        # force: the step checks of save() replace orbax's save-interval policy. With async
        # checkpointing this returns once the arrays are on the host.
        manager.save(step, args=ocp.args.Composite(**items), force=True)
        if not self.asynchronous:
            manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in flight, writes what was appended to the run log since,
        then releases the writer's threads."""
        try:
            self.wait()
            log = self._take_log()
            if log:
                _files.append_log(self.path, log)
        finally:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                manager.close()
            if self._thread is not None:
                thread, self._thread = self._thread, None
                thread.shutdown(wait=True)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    tree: dict[str, Any],
    *,
    max_to_keep: int = 3,
    replace: bool = False,
    storage: str = "auto",
) -> pathlib.Path:
    """Saves ``tree`` as checkpoint ``step`` under ``directory``; returns once it is on disk.

    Args:
      directory: the checkpoint directory (created if missing); relative paths are resolved.
      step: the checkpoint's number; it must be larger than every step already saved there.
      tree: a dict of pytrees whose leaves are jax or numpy arrays (typed PRNG keys included)
        or Python bool/int/float/str; ``nnx.State`` (with Variables) and optax states are
        fine.
      max_to_keep: after saving, only the newest ``max_to_keep`` checkpoints are kept.
      replace: when checkpoint ``step`` exists, delete it and save anew (the earlier
        checkpoints stay; a crash between the two leaves the latest one missing, never a
        half-written one).
      storage: ``"auto"`` writes a tree this process holds whole as nnxscan's own files
        and arrays sharded over devices or processes through orbax; ``"orbax"`` writes
        everything through orbax (see :class:`CheckpointWriter`).

    Returns:
      The checkpoint's own directory, ``<directory>/<step>``.

    Raises:
      TypeError: a leaf of another type (its path is named).
      FileExistsError: checkpoint ``step`` already exists (and not ``replace``).
      ValueError: ``step`` is older than the latest checkpoint, or not a non-negative int.

    Example:
      >>> tree = {"state": nnx.state(model), "opt_state": opt_state,
      ...         "meta": {"epoch": 2, "step": 200, "seed": 0}}
      >>> save_checkpoint("runs/ckpt", 200, tree)
      PosixPath('/home/me/runs/ckpt/200')
    """
    # The writer checks every leaf before anything touches the disk.
    with CheckpointWriter(
        directory, max_to_keep=max_to_keep, asynchronous=False, storage=storage
    ) as writer:
        return writer.save(step, tree, replace=replace)


def _pick_step(path: pathlib.Path, step: int | None) -> int:
    steps = _files.finished_steps(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {path}")
    if step is None:
        return steps[-1]
    step = _as_step(step, "step")
    if step not in steps:
        raise FileNotFoundError(f"no checkpoint {step} in {path}; available steps: {steps}")
    return step


def _read_manifest(raw: Any, where: pathlib.Path) -> list[_Leaf]:
    if not isinstance(raw, dict) or raw.get("format") != _FORMAT:
        raise ValueError(f"{where} was not written by nnxscan.adapters.checkpoint")
    if raw.get("version", 0) > _VERSION:
        raise ValueError(
            f"{where} has checkpoint format version {raw['version']}, newer than this "
            f"nnxscan reads ({_VERSION}): upgrade nnxscan"
        )
    return [_Leaf.from_json(record) for record in raw["leaves"]]


def _check_fits(saved: list[_Leaf], wanted: list[_Leaf], where: pathlib.Path) -> None:
    """Raises ValueError naming the first leaf where the checkpoint and template differ.

    The model's leaves are named first: a model of other sizes changes its optimizer
    state's shapes too, and the model is the cause. When only the optimizer state
    (``['opt_state']``) differs, the message says the optimizer differs and how."""
    by_path = {record.path: record for record in saved}
    problems = []
    for want in wanted:
        have = by_path.get(want.path)
        if have is None:
            problems.append(
                (want.path, f"missing in checkpoint ({_owner(want)} has {want.describe()})")
            )
        elif not have.fits(want):
            problems.append(
                (want.path, f"the checkpoint has {have.describe()}, {_owner(want)} has "
                 f"{want.describe()}")
            )  # fmt: skip
    wanted_paths = {want.path for want in wanted}
    problems += [
        (have.path, f"not in {_owner(have)} (the checkpoint has {have.describe()})")
        for have in saved
        if have.path not in wanted_paths
    ]
    if not problems:
        return
    problems.sort(key=lambda problem: problem[0].startswith(_OPT_STATE))  # stable
    first = f"{problems[0][0]}: {problems[0][1]}"
    more = f" ({len(problems) - 1} more leaves differ)" if len(problems) > 1 else ""
    if problems[0][0].startswith(_OPT_STATE):
        raise ValueError(
            f"checkpoint {where} was saved with another optimizer: its optimizer state holds "
            f"{_optimizer_layout(saved, wanted, saved)}, the optimizer given here holds "
            f"{_optimizer_layout(saved, wanted, wanted)} (the model's variables fit; first "
            f"difference at {first}{more}). Resume with the optax transform the checkpoint "
            f"was saved with (the same transforms, chained in the same order); to go on with "
            f"another optimizer, restore with the saved one, then build the new one on the "
            f"restored model."
        )
    raise ValueError(
        f"checkpoint {where} does not fit the template at {first}{more}. Restore "
        f"into a template built like the saved model (same layer sizes and variables), "
        f"or pick another checkpoint with step=."
    )


_OPT_STATE = "['opt_state']"
_STATE = "['state']"


def _owner(leaf: _Leaf) -> str:
    """Who holds a template leaf, in a message."""
    return "this optimizer" if leaf.path.startswith(_OPT_STATE) else "the model"


def _optimizer_layout(saved: list[_Leaf], wanted: list[_Leaf], side: list[_Leaf]) -> str:
    """The optimizer state's leaves of one side, each parameter tree shortened to ``[...]``:
    ``"[0].count, [0].mu[...], [0].nu[...]"`` for Adam, ``"no arrays"`` for plain SGD."""
    params = {
        leaf.path[len(_STATE) :] for leaf in (*saved, *wanted) if leaf.path.startswith(_STATE)
    }
    names: dict[str, None] = {}
    for leaf in side:
        if not leaf.path.startswith(_OPT_STATE):
            continue
        name = leaf.path[len(_OPT_STATE) :]
        # The longest tail that is a model variable's path: the per-parameter part.
        tails = [tail for tail in params if tail and name.endswith(tail)]
        if tails:
            name = name[: -len(max(tails, key=len))] + "[...]"
        names[name] = None
    if not names:
        return "no arrays"
    listed = list(names)
    shown = ", ".join(listed[:6]) + (f", ... ({len(listed)} in all)" if len(listed) > 6 else "")
    return shown


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _restore_args(ocp: Any, saved: _Leaf, template: Any) -> Any:
    if saved.kind == "key":
        # Key bits go to the default device; the rebuilt key is then placed like the template.
        return ocp.ArrayRestoreArgs(sharding=_default_sharding())
    if isinstance(template, np.ndarray | np.generic):
        return ocp.RestoreArgs(restore_type=np.ndarray)
    return ocp.ArrayRestoreArgs(sharding=getattr(template, "sharding", None) or _default_sharding())


def _unpack(saved: _Leaf, template: Any, arrays: dict[str, Any]) -> Any:
    """A packed array's elements, reshaped and placed as the template's leaf (keys: their
    raw data, placed; wrapped by the caller)."""
    shape = saved.data_shape
    size = int(np.prod(shape, dtype=np.int64))
    value = np.asarray(arrays[saved.pack][saved.offset : saved.offset + size]).reshape(shape)
    if saved.kind != "key" and isinstance(template, np.ndarray | np.generic):
        return value
    return jax.device_put(value, getattr(template, "sharding", None) or _default_sharding())


def _rebuild_leaf(saved: _Leaf, template: Any, arrays: dict[str, Any]) -> Any:
    if saved.kind in _PYTHON_KINDS:
        return _PYTHON_KINDS[saved.kind](saved.value)
    if saved.pack:
        data = _unpack(saved, template, arrays)
        if saved.kind == "key":
            return jax.random.wrap_key_data(data, impl=saved.impl)
        return data[()] if isinstance(template, np.generic) else data
    data = arrays[saved.name]
    if saved.kind == "key":
        sharding = getattr(template, "sharding", None)
        if sharding is not None:
            # A typed key cannot be put on a mesh spanning processes; its raw data can.
            data = jax.device_put(np.asarray(jax.device_get(data)), sharding)
        return jax.random.wrap_key_data(data, impl=saved.impl)
    if isinstance(template, np.generic):
        return np.asarray(data)[()]
    return data


def _matched(
    saved: list[_Leaf], pairs: list[tuple[str, Any]], wanted: list[_Leaf], where: pathlib.Path
) -> list[tuple[_Leaf, Any]]:
    """Each template leaf with the saved record of its path (after checking they fit)."""
    _check_fits(saved, wanted, where)
    by_path = {record.path: record for record in saved}
    return [(by_path[path], leaf) for path, leaf in pairs]


def _read_files(where: pathlib.Path, step: int, pairs: list, wanted: list) -> tuple:
    manifest = _files.read_manifest(where)
    matched = _matched(_read_manifest(manifest, where), pairs, wanted, where)
    packs = {record.pack for record, _ in matched if record.pack}
    return matched, _files.read_buffers(where, manifest, packs)


def _read_orbax(where: pathlib.Path, step: int, pairs: list, wanted: list) -> tuple:
    ocp = _orbax()
    with _reader(ocp, where.parent) as manager:
        raw = manager.restore(step, args=ocp.args.Composite(manifest=ocp.args.JsonRestore()))
        matched = _matched(_read_manifest(raw["manifest"], where), pairs, wanted, where)
        restore_args = {
            record.name: _restore_args(ocp, record, leaf)
            for record, leaf in matched
            if record.kind in _ARRAY_KINDS and not record.pack
        }
        for pack in {record.pack for record, _ in matched if record.pack}:
            restore_args[pack] = ocp.RestoreArgs(restore_type=np.ndarray)
        arrays = {}
        if restore_args:
            item = ocp.args.PyTreeRestore(restore_args=restore_args)
            arrays = manager.restore(step, args=ocp.args.Composite(arrays=item))["arrays"]
    return matched, arrays


def restore_checkpoint(
    directory: str | os.PathLike[str],
    like: dict[str, Any],
    *,
    step: int | None = None,
) -> tuple[dict[str, Any], int]:
    """Restores the latest (or the given) checkpoint into the structure of ``like``.

    ``like`` is a template: the same pytree structure, shapes and dtypes as the saved tree
    (e.g. a fresh model's state and opt_state). Its leaves may be arrays, typed PRNG keys,
    ``jax.ShapeDtypeStruct`` (from ``nnx.eval_shape`` / ``jax.eval_shape``) or Python
    bool/int/float/str. It is only read: the result is a new tree, and restored jax arrays
    are placed with the template leaf's sharding (the default device for a template leaf
    without one); numpy template leaves come back as numpy.

    Args:
      directory: the checkpoint directory ``save_checkpoint`` wrote.
      like: the template.
      step: the checkpoint to restore; ``None`` picks the latest.

    Returns:
      ``(tree, step)``: the restored tree, in ``like``'s structure (Variables and optax
      NamedTuples rebuilt from it), bitwise equal to what was saved; and the step restored.

    Raises:
      FileNotFoundError: ``directory`` does not exist, holds no checkpoint, or lacks ``step``
        (the message lists the steps it has).
      ValueError: the checkpoint's leaves differ from ``like``'s (another shape or dtype, a
        variable missing on either side); the message names the first differing path and
        both shapes. Raised before any array is read.

    Example:
      >>> like = {"state": nnx.state(model), "opt_state": tx.init(nnx.state(model, nnx.Param)),
      ...         "meta": {"epoch": 0, "step": 0, "seed": 0}}
      >>> tree, step = restore_checkpoint("runs/ckpt", like)
      >>> nnx.update(model, tree["state"])  # in the shell
    """
    if not isinstance(like, dict):
        raise TypeError(f"like must be a dict of pytrees, got {type(like).__name__}")
    pairs = _flatten(like)
    treedef = _treedef(like, len(pairs))
    wanted = [_describe_template(path, leaf) for path, leaf in pairs]
    path = _resolve(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    step = _pick_step(path, step)
    where = path / str(step)
    read = _read_files if _files.holds_files_checkpoint(where) else _read_orbax
    matched, arrays = read(where, step, pairs, wanted)
    leaves = [_rebuild_leaf(record, leaf, arrays) for record, leaf in matched]
    return jax.tree.unflatten(treedef, leaves), step


def read_log(directory: str | os.PathLike[str], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the run log that :meth:`CheckpointWriter.append_log`
    wrote in ``directory``.

    Raises:
      ValueError: the log is missing or shorter than ``end`` (its path is named).

    Example:
      >>> read_log("runs/ckpt", 0, end)
      b'{"epoch": 0}\\n'
    """
    start, end = _as_step(start, "start"), _as_step(end, "end")
    if start > end:
        raise ValueError(f"start={start} is past end={end}")
    return _files.read_log(_resolve(directory), start, end)


def all_steps(directory: str | os.PathLike[str]) -> list[int]:
    """The steps of the finished checkpoints in ``directory``, ascending (``[]`` if none).

    Example:
      >>> all_steps("runs/ckpt")
      [300, 400, 500]
    """
    return _files.finished_steps(_resolve(directory))


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest finished checkpoint's step in ``directory``, or ``None`` if it has none.

    Example:
      >>> latest_step("runs/ckpt")
      500
    """
    steps = all_steps(directory)
    return steps[-1] if steps else None
