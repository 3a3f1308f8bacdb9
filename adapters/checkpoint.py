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
      .nnxscan-lock                     the directory lock (one run per directory)
      <step>/                           nnxscan's own files (see _checkpoint_files.py)
        manifest.json                   the manifest (below), its own crc32 first, plus
                                        each buffer's file, offset, dtype, size and crc32
        arrays.bin                      the packed buffers, raw
        state/                          the model state again, as an orbax item (OCDBT,
                                        zarr) that Flax's StandardCheckpointer reads:
                                        in the newest checkpoint a Checkpointer saved,
                                        added when it closes (state.nnxscan-tmp/ while
                                        it is written; ignored, removed later)
      <step>/                           or orbax's
        _CHECKPOINT_METADATA            orbax: when it was written
        manifest/metadata               the manifest (with the crc32 of each packed
                                        buffer and of each shard of a sharded array)
        arrays/                         orbax PyTree (OCDBT/tensorstore): the packed
                                        buffers, and each array sharded over devices or
                                        processes on its own, named leaf_00000, ...
        state/                          the model state, orbax's StandardSave
      <step>.nnxscan-tmp/               a save in progress, or one killed mid-way
      <step>.orbax-checkpoint-tmp-*/    (either storage's): never listed, never restored;
                                        the next save of that step replaces it
      <step>.nnxscan-corrupt/           a damaged checkpoint a resume skipped; kept
      <step>.nnxscan-superseded/        newer than the step a resume was told to start
                                        from; kept
      history.jsonl                     the run log (either storage's): bytes appended with
                                        Checkpointer.append_log, each fsync'ed before
                                        the next checkpoint is renamed into place

The manifest (JSON): format name and version, and per leaf in flattening order its path
(jax keystr, e.g. "['state']['l1']['kernel']"), kind ("array", "key", or a Python type),
shape, dtype, key implementation, and either the buffer and element offset holding its
elements (pack_float32, ...: the arrays this process holds whole, joined into one flat
buffer per dtype), its orbax array name, or the Python value itself. The reader trusts
none of it: the manifest is validated whole (``_checkpoint_manifest.py``) before any
buffer is read, every buffer is checked against its crc32 as it is read, and a damaged
checkpoint is a :class:`CorruptCheckpointError` naming the directory, the step, the leaf
or file and what is wrong; :func:`newest_good` (``restore_checkpoint(...,
fallback=True)``) skips those.

Atomicity: a checkpoint is written under a temporary name and renamed to ``<step>`` only
after every file is written and flushed (our files are fsync'ed, the rename too); on a
local (POSIX) filesystem the rename is atomic, and step listings skip temporary names. A
process killed during a save therefore leaves every earlier checkpoint intact and
restorable, and ``latest_step`` never returns the half-written one. ``save_checkpoint``
returns only after the rename, so the checkpoint it reports is on disk.

The run log keeps a save's cost flat as a run grows: what grows (a fit's History) is
appended to the log, and a checkpoint's tree records only where its part of the log ends
(:meth:`Checkpointer.append_log` returns that offset; :func:`read_log` reads a range
back). A checkpoint never refers to bytes that are not on disk before it: appends are
written and fsync'ed, in the order appended, before the next checkpoint's files. With
several processes only process 0 writes the log; every process reads it.

orbax-checkpoint ships with flax; it is imported only inside these functions, because
importing it configures absl logging on the root logger.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax

from nnxscan.adapters import _checkpoint_files as _files
from nnxscan.adapters import _checkpoint_lock as _lock
from nnxscan.adapters import _checkpoint_manifest as _manifest
from nnxscan.adapters import _checkpoint_packing as _packing
from nnxscan.adapters import _checkpoint_read as _read
from nnxscan.adapters import _checkpoint_shards as _shards
from nnxscan.adapters._checkpoint_lock import CheckpointLockedError
from nnxscan.adapters._checkpoint_manifest import CorruptCheckpointError
from nnxscan.adapters._checkpoint_save_thread import SaveThread
from nnxscan.pure.checks import check_count

__all__ = [
    "CheckpointLockedError",
    "Checkpointer",
    "CorruptCheckpointError",
    "all_steps",
    "latest_step",
    "newest_good",
    "read_log",
    "restore_checkpoint",
    "save_checkpoint",
]

_STORAGES = ("auto", "orbax")
T = TypeVar("T")


def _resolve(directory: str | os.PathLike[str]) -> pathlib.Path:
    # orbax requires absolute paths.
    return pathlib.Path(directory).expanduser().resolve()


def _as_step(step: Any, what: str) -> int:
    return check_count(step, what, 0)


def _orbax_state(state: Any) -> bool:
    """Whether orbax writes the model state as its own item (every leaf an array)."""
    return state is not None and all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(state))


class Checkpointer:
    """Writes a run's checkpoints into ``directory``, by default in the background.

    With ``asynchronous`` (the default) a :meth:`save` returns once the arrays are copied
    from the devices to the host, and writes them to disk in a background thread: the next
    compiled call may donate the device buffers at once, and training goes on while the
    checkpoint is written. Saves queue behind a write in progress and the save thread takes
    everything queued at once (one wait for the disk for several saves; see
    ``_checkpoint_save_thread.py``); a save waits only when the save thread is more than one
    job behind (a job: a save, or the saves of a :meth:`together` block, written as one
    batch). Every other use of the directory waits for every queued save first —
    :meth:`latest_step`, :meth:`wait`, :meth:`close`, a ``replace`` — so a checkpoint is
    never read half-written and a run never ends before its last save is on disk, and a
    failed write raises there (or at the next save). A process killed meanwhile loses the
    saves not yet renamed into place (at most 4 jobs; a checkpoint is renamed only once
    every file is written and fsync'ed). ``asynchronous=False`` makes each save durable on
    return (a :meth:`together` block's, as the block ends).

    Storage: a tree one process holds whole (every single-process run not sharded over
    devices) is written as nnxscan's own files: a raw file of packed buffers, the model
    state as an orbax item Flax's code restores (the newest checkpoint's, written by
    :meth:`close`), and a JSON manifest, every buffer with a crc32 — a fraction of the CPU
    orbax's own save costs (docs/checkpoints.md), CPU that a background write takes from
    training. Arrays sharded over devices or processes go through one orbax
    ``CheckpointManager`` (each process writes its shards). ``storage="orbax"`` writes
    every checkpoint through orbax. :func:`restore_checkpoint` reads both, and a
    directory may hold both.

    One checkpointer per directory: the first save (or :meth:`lock`) takes an advisory lock
    on the directory, :meth:`close` releases it; a second one meanwhile gets a
    :class:`CheckpointLockedError`. Nothing touches the disk before the first save or
    :meth:`lock`. Use it as a context manager, or call :meth:`close`.

    Example:
      >>> with Checkpointer("runs/ckpt") as checkpointer:
      ...     checkpointer.save(100, {"state": nnx.state(model), "meta": {"step": 100}})
      ...     train_more()                 # while step 100 is written
      ...     checkpointer.save(200, tree)       # waits for step 100 first
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
        self._save_thread: Any = None  # writes our own files in the background (asynchronous)
        self._cleaned = False  # leftovers of killed processes removed (at the first save)
        # The steps on disk or being written, newest last: read from the directory once,
        # then kept by this checkpointer, so asking "is step N saved?" never waits for a write.
        self._steps: list[int] | None = None
        # The run log's size once every append so far is written (read from the disk at
        # the first append), and the appends not yet handed to a write.
        self._log_size: int | None = None
        self._log_pending: list[bytes] = []
        self._lock: int | None = None  # the directory lock, once taken
        self._locked = False
        # (step, item) of the newest checkpoint saved as own files: its state/ item, for
        # Flax's code, is written by close() (one per run, off the training path).
        self._item: tuple[int, Any] | None = None
        # Saves of own files made inside together(), written as one batch when it ends.
        self._group: list | None = None
        # Whether renames of asynchronous saves wait for the directory's fsync (close's).
        self._renamed = False

    def lock(self) -> None:
        """Takes the directory lock now (the first save or log append takes it
        otherwise), creating the directory; :meth:`close` releases it. One checkpointer per
        directory: a second one, in this process or another, gets a
        :class:`CheckpointLockedError` naming the directory and the holder's process id,
        and the directory is left as it was. Only process 0 of a multi-process run locks
        (every process writes its shards into the same directory).

        Raises:
          CheckpointLockedError: another run holds the directory (the holder named).
          ValueError: the path is a file, or not writable; or its lock file is a symbolic
            link, a hard link or not a regular file (never written through).
        """
        if self._locked:
            return
        _files.check_directory(self.path)
        if jax.process_index() == 0:
            self._lock = _lock.lock(self.path)
        self._locked = True

    def _orbax_manager(self) -> Any:
        if self._manager is None:
            ocp = _read.orbax()
            options = ocp.CheckpointManagerOptions(
                max_to_keep=self.max_to_keep,
                create=True,
                enable_async_checkpointing=self.asynchronous,
            )
            self._manager = ocp.CheckpointManager(self.path, options=options)
        else:
            self._manager.reload()  # our own files may have come and gone since
        return self._manager

    def newest_step(self) -> int | None:
        """The newest checkpoint's step, on disk or being written (never waits)."""
        if self._steps is None:
            return latest_step(self.path)
        return self._steps[-1] if self._steps else None

    @contextlib.contextmanager
    def together(self, *, last: bool = False) -> Iterator[None]:
        """Saves of nnxscan's own files made inside the block are written as one batch as
        it ends (one wait for the disk for all; a save asks for no room in the save
        thread's queue meanwhile, the block's saves holding their host copies until then), in order;
        with ``asynchronous=False``, durable once the block ends. ``last``: the block holds
        the newest save this checkpointer makes, whose ``state/`` item (what :meth:`close`
        adds) then goes into the same batch, written on this thread as the block ends (the
        :meth:`close` that follows would wait for it: handing it to the background thread
        only adds that thread's wake-up, several ms on a loaded machine). Any other use of
        the directory (:meth:`wait`, :meth:`close`, a save through orbax) writes the
        block's saves first.

        Example:
          >>> with Checkpointer("runs/ckpt") as checkpointer:
          ...     with checkpointer.together(last=True):
          ...         for step, tree in states_of_fused_epochs:  # written as one batch
          ...             checkpointer.save(step, tree)
        """
        if self._group is not None:  # within another block: that one writes them
            yield
            return
        self._group = []
        try:
            yield
        finally:
            group, self._group = self._group, None
            if group and last:
                if self._item is not None and self._item[0] == group[-1][0]:
                    (_, item), self._item = self._item, None
                    group[-1] = (*group[-1][:4], item)
                if self._save_thread is not None:
                    self._wait_for_saves(self._save_thread.drain)  # in order: queued ones first
                self._wait_for_saves(lambda: self._write_batch(group))
            elif group:
                self._submit(group)

    def _flush_group(self) -> None:
        """Writes (queues) the saves a :meth:`together` block holds so far."""
        if self._group:
            group, self._group = self._group, []
            self._submit(group)

    def _submit(self, saves: list) -> None:
        """Writes saves of own files as one batch: queued for the save thread (one job,
        once it is at most one job behind), or written now (``asynchronous=False``)."""
        if not self.asynchronous:
            self._write_batch(saves)
            return
        if self._save_thread is None:
            self._save_thread = SaveThread(self._write_jobs, _weigh)
        else:
            self._wait_for_saves(self._save_thread.make_room)
        self._save_thread.submit(saves)

    def _write_jobs(self, jobs: list[list]) -> None:
        """The save thread's batch: the saves of every job it took, in order."""
        self._write_batch([save for job in jobs for save in job])

    def wait(self) -> None:
        """Returns once every queued save is on disk; re-raises a failed write's error."""
        self._flush_group()
        if self._manager is not None:
            with self._disk_errors("the checkpoint in flight was not written"):
                self._manager.wait_until_finished()
        if self._save_thread is not None:
            self._wait_for_saves(self._save_thread.drain)

    def _wait_for_saves(self, until: Callable[[], None]) -> None:
        """Runs ``until`` (a wait for the save thread, or a batch written here); a failed
        save re-reads which steps are on disk before its error is raised."""
        try:
            until()
        except BaseException:
            self._steps = _files.finished_steps(self.path)  # the failed ones are not
            raise

    def append_log(self, data: bytes) -> int:
        """Appends ``data`` to the directory's run log (``history.jsonl``); returns the
        log's size in bytes with it, at once: the offset a checkpoint saved next records
        as the end of its part of the log (see :func:`read_log`).

        The bytes are written and fsync'ed, in order, before the next checkpoint's files
        (in the background with ``asynchronous``), or by :meth:`close`: a checkpoint never
        refers to bytes not on disk. ``append_log(b"")`` is the log's size now.

        Example:
          >>> with Checkpointer("runs/ckpt") as checkpointer:
          ...     end = checkpointer.append_log(b'{"epoch": 0}\\n')
          ...     checkpointer.save(100, {"meta": {"log_end": end}})
        """
        self.lock()
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
        self.lock()
        self.wait()
        self._log_pending.clear()
        if jax.process_index() == 0:  # only process 0 writes the log
            _files.truncate_log(self.path, size)
        self._log_size = size

    def _take_log(self) -> bytes:
        data, self._log_pending = b"".join(self._log_pending), []
        return data if jax.process_index() == 0 else b""

    def latest_step(self) -> int | None:
        """The newest finished checkpoint's step (after waiting for every queued save)."""
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
        packing, leaves = _packing.packing_of(tree, with_item=self.storage == "auto")
        entries, buffers, item_arrays = _packing.fill(packing, leaves)
        manifest = {"format": _manifest.FORMAT, "version": _manifest.VERSION, "leaves": entries}
        own_files = self.storage == "auto" and packing.held_whole
        self.lock()
        # Writes in order. Our own files' save thread may be behind (it writes what is queued
        # together, one wait for the disk); this save waits only when it is too far behind
        # (in _submit; a together() block's, as it ends). Anything else (orbax, replacing a
        # step) starts once every write is done.
        if not own_files or replace:
            self.wait()
        if self._steps is None:
            self._steps = _files.finished_steps(self.path)
        steps = self._steps
        if not own_files:
            self._unlink_linked_steps([*steps, step][: -self.max_to_keep])
        manager = None if own_files else self._orbax_manager()
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
        self._item = None  # an older checkpoint's item is not written any more
        if own_files:
            if packing.item:
                leaves = [leaf for _, leaf in packing.item]
                self._item = (step, (leaves, item_arrays, packing.item_files))
            self._write_files(step, manifest, buffers, log)
        else:
            if log:  # orbax writes in its own threads: the log is on disk first
                _files.append_log(self.path, log)
            self._write_orbax(manager, step, manifest, buffers, packing.packs, tree.get("state"))
        self._steps = [*steps, step][-self.max_to_keep :]  # what max_to_keep will leave
        return self.path / str(step)

    def keep_item(self, step: int, tree: Callable[[], dict[str, Any]]) -> None:
        """Checkpoint ``step``, the newest, already holds ``tree()`` (a fit resumed from it
        that saves nothing new): if it lacks the ``state/`` item Flax's code restores (a
        process killed while adding it), :meth:`close` adds it. ``tree`` is called only
        then."""
        if self._item is not None or self.storage != "auto" or jax.process_index() != 0:
            return
        where = self.path / str(step)
        if _files.storage_of(where) != "files" or os.path.lexists(where / _files.ITEM):
            return
        packing, leaves = _packing.packing_of(tree(), with_item=True)
        if packing.item:
            _, _, item_arrays = _packing.fill(packing, leaves)
            leaves_of_item = [leaf for _, leaf in packing.item]
            self._item = (step, (leaves_of_item, item_arrays, packing.item_files))

    def _unlink_linked_steps(self, doomed: list[int]) -> None:
        """Removes the step folders among ``doomed`` (those orbax's ``max_to_keep`` deletes
        after the next save) that are symbolic links, as links: orbax would fail on them
        (``rmtree`` of a link) after the save, and must never delete what they point to."""
        if jax.process_index() != 0:
            return
        for old in doomed:
            if (self.path / str(old)).is_symlink():
                _files.delete(self.path, old)
                self._steps.remove(old)

    def _write_batch(self, saves: list[tuple[int, dict, dict, bytes, Any]]) -> None:
        """Writes saves of own files (one, or several queued), then applies max_to_keep.
        The renames of asynchronous saves reach the disk with the next batch's fsyncs, or
        close()'s: one wait for the disk a batch instead of two. Of a batch longer than
        max_to_keep only the newest max_to_keep are written (the others would be deleted
        as soon as written: the directory ends the same); their run log bytes are."""
        skipped, saves = saves[: -self.max_to_keep], saves[-self.max_to_keep :]
        if skipped:
            step, manifest, buffers, log, item = saves[0]
            log = b"".join(save[3] for save in skipped) + log
            saves = [(step, manifest, buffers, log, item), *saves[1:]]
        # close() fsyncs the directory after the renames (set first: a failure after some
        # renames still has them synced).
        self._renamed = self._renamed or self.asynchronous
        _files.write_many(
            self.path, saves, sync_directory=not self.asynchronous, max_to_keep=self.max_to_keep
        )

    def _write_files(self, step: int, manifest: dict[str, Any], buffers: dict, log: bytes) -> None:
        if not self._cleaned:
            _files.remove_leftovers(self.path)  # of a process killed mid-save or mid-delete
            self._cleaned = True
        save = (step, manifest, buffers, log, None)
        if self._group is not None:
            self._group.append(save)
        else:
            self._submit([save])

    def _write_orbax(
        self,
        manager: Any,
        step: int,
        manifest: dict,
        buffers: dict,
        packed: dict,
        state: Any,
    ) -> None:
        ocp = _read.orbax()
        arrays = buffers
        packs = {name: buffers[name] for name in packed}
        # Each packed buffer's crc32 (a host copy, whole in every process), and the
        # manifest's own: orbax's JsonSave writes json.dumps of it, the checked text.
        manifest = {
            **manifest,
            "buffers": {
                n: {"dtype": a.dtype.name, "size": a.size, "crc32": _manifest.buffer_crc32(a)}
                for n, a in packs.items()
            },
            # Each shard's crc32, by the process holding it, from its own copy (no gather).
            "shards": _shards.crc32s({n: a for n, a in buffers.items() if n not in packs}),
        }
        items = {"manifest": ocp.args.JsonSave(_manifest.with_crc32(manifest))}
        if arrays:
            items["arrays"] = ocp.args.PyTreeSave(arrays)
        if _orbax_state(state):  # the model state as Flax's guide saves it: <step>/state
            items["state"] = ocp.args.StandardSave(state)
        # force: the step checks of save() replace orbax's save-interval policy. With async
        # checkpointing this returns once the arrays are on the host.
        with self._disk_errors(f"checkpoint {step} was not written"):
            manager.save(step, args=ocp.args.Composite(**items), force=True)
            if not self.asynchronous:
                manager.wait_until_finished()

    @contextlib.contextmanager
    def _disk_errors(self, what: str) -> Iterator[None]:
        """tensorstore's errors from orbax's writes (``ValueError: RESOURCE_EXHAUSTED ...``)
        as the ``OSError`` users catch, naming the directory (``_files.disk_error``)."""
        try:
            yield
        except ValueError as error:
            translated = _files.disk_error(error, self.path, what)
            if translated is error:
                raise
            if jax.process_index() == 0:
                # orbax leaves the failed save's <step>.orbax-checkpoint-tmp-*: nothing of
                # this checkpointer's is in flight once a write failed, and no one else
                # writes here (the lock), so every such folder is a failed save's.
                _files.remove_orbax_leftovers(self.path)
            raise translated from error

    def close(self) -> None:
        """Waits for the queued saves, writes what was appended to the run log since, adds
        the model state's ``state/`` item (what Flax's ``StandardCheckpointer`` restores)
        to the newest checkpoint it saved, then releases its threads and the directory's
        lock.

        Only the newest checkpoint gets the item, here: writing one per save (tensorstore's
        files, written, synced, then deleted by ``max_to_keep``) cost a small model's run
        more than the rest of the checkpoint. A failed save leaves no item to write."""
        try:
            self._flush_group()
            if self._item is not None and self._save_thread is not None:
                # The newest save not yet written: its item goes with it, into its folder
                # before the rename (one wait for the disk, not two).
                step, item = self._item

                def with_item(job: list) -> list | None:
                    *older, (newest, *rest) = job
                    return [*older, (newest, *rest[:3], item)] if newest == step else None

                if self._save_thread.amend_last(with_item):
                    self._item = None
            self.wait()
            if self._renamed:  # asynchronous saves' last renames, deletions
                self._renamed = False
                _files.sync_directory(self.path)
            log = self._take_log()
            if log:
                _files.append_log(self.path, log)
            if self._item is not None:
                (step, item), self._item = self._item, None
                if jax.process_index() == 0:
                    _files.add_item(self.path, step, item)
        finally:
            if self._manager is not None:
                manager, self._manager = self._manager, None
                manager.close()
            if self._save_thread is not None:
                save_thread, self._save_thread = self._save_thread, None
                save_thread.close()
            lock, self._lock, self._locked = self._lock, None, False
            _lock.unlock(lock)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _weigh(saves: list[tuple[int, dict, dict, bytes, Any]]) -> int:
    """The host bytes a queued job's saves hold."""
    return sum(sum(b.nbytes for b in save[2].values()) + len(save[3]) for save in saves)


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
        everything through orbax (see :class:`Checkpointer`).

    Returns:
      The checkpoint's own directory, ``<directory>/<step>``.

    Raises:
      TypeError: a leaf of another type (its path is named).
      FileExistsError: checkpoint ``step`` already exists (and not ``replace``).
      ValueError: ``step`` is older than the latest checkpoint, or not a non-negative int.
      OSError: the write failed; a full disk is errno ENOSPC naming the directory (also
        when tensorstore raised it as a ValueError), with the earlier checkpoints intact.
        A checkpoint ``max_to_keep`` could not delete is named (step folders that are
        symbolic links are removed as links).

    Example:
      >>> tree = {"state": nnx.state(model), "opt_state": opt_state,
      ...         "meta": {"epoch": 2, "step": 200, "seed": 0}}
      >>> save_checkpoint("runs/ckpt", 200, tree)
      PosixPath('/home/me/runs/ckpt/200')
    """
    # The checkpointer checks every leaf before anything touches the disk.
    with Checkpointer(
        directory, max_to_keep=max_to_keep, asynchronous=False, storage=storage
    ) as checkpointer:
        return checkpointer.save(step, tree, replace=replace)


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


def newest_good(
    directory: str | os.PathLike[str],
    read: Callable[[int], T],
    *,
    warn: Callable[[str], None] | None = None,
) -> tuple[T, int, dict[int, CorruptCheckpointError]]:
    """``read(step)`` of the newest checkpoint in ``directory`` that is not corrupt.

    Calls ``read`` on the newest checkpoint and, while it raises
    :class:`CorruptCheckpointError`, on the next older one, warning (``UserWarning``) for
    each one skipped, naming it and why (through ``warn``, if given). Nothing is deleted.
    Any other error is raised at once (a template that does not fit one checkpoint fits no
    older one either).

    Returns:
      ``(result, step, skipped)``: ``read``'s result, the step it read, and the corrupt
      newer checkpoints skipped (step -> error).

    Raises:
      FileNotFoundError: no checkpoint in ``directory``.
      CorruptCheckpointError: every checkpoint is corrupt (the newest one's error, the
        others' steps listed).

    Example:
      >>> tree, step, skipped = newest_good(
      ...     "runs/ckpt", lambda s: restore_checkpoint("runs/ckpt", like, step=s)[0])
    """
    path = _resolve(directory)
    steps = _files.finished_steps(path)
    if not steps:
        raise FileNotFoundError(f"no checkpoint in {path}")
    skipped: dict[int, CorruptCheckpointError] = {}
    for step in reversed(steps):
        try:
            result = read(step)
        except CorruptCheckpointError as error:
            skipped[step] = error
            continue
        for bad, error in skipped.items():
            message = (
                f"skipped checkpoint {bad} in {path} and restored {step}, the newest good "
                f"one: {error}"
            )
            if warn is None:
                warnings.warn(message, stacklevel=3)
            else:
                warn(message)
        return result, step, skipped
    newest = skipped[steps[-1]]
    raise CorruptCheckpointError(
        f"every checkpoint in {path} is damaged (steps {steps}); the newest: {newest}"
    ) from newest


def restore_checkpoint(
    directory: str | os.PathLike[str],
    like: dict[str, Any],
    *,
    step: int | None = None,
    fallback: bool = False,
    check_item: bool = False,
) -> tuple[dict[str, Any], int]:
    """Restores the latest (or the given) checkpoint into the structure of ``like``.

    ``like`` is a template: the same pytree structure, shapes and dtypes as the saved tree
    (e.g. a fresh model's state and opt_state), or some of its top-level entries (e.g.
    ``{"state": abstract_state}`` restores the model state alone, the rest unread). Its
    leaves may be arrays, typed PRNG keys, ``jax.ShapeDtypeStruct`` (from
    ``nnx.eval_shape`` / ``jax.eval_shape``) or Python bool/int/float/str. It is only read:
    the result is a new tree, and restored jax arrays are placed with the template leaf's
    sharding (the default device for a template leaf without one); numpy template leaves
    come back as numpy.

    What is read is checked first: the manifest whole (paths, kinds, shapes, dtypes,
    offsets and sizes inside their files, counters' types, the format version) before any
    buffer is read, and each buffer against its crc32 as it is read.

    Args:
      directory: the checkpoint directory ``save_checkpoint`` wrote.
      like: the template.
      step: the checkpoint to restore; ``None`` picks the latest.
      fallback: with ``step=None``, skip corrupt checkpoints (newest first, each with a
        warning) and restore the newest good one (see :func:`newest_good`).
      check_item: also read the checkpoint's ``state/`` item — the copy of the model state
        that Flax's own ``StandardCheckpointer`` restores, checking nothing — and refuse the
        checkpoint (:class:`CorruptCheckpointError`) unless it holds exactly the restored,
        verified ``state`` (``like`` must have a ``"state"`` entry). Costs a second read of
        the model state; ``load_model`` does it.

    Returns:
      ``(tree, step)``: the restored tree, in ``like``'s structure (Variables and optax
      NamedTuples rebuilt from it), bitwise equal to what was saved; and the step restored.

    Raises:
      FileNotFoundError: ``directory`` does not exist, holds no checkpoint, or lacks ``step``
        (the message lists the steps it has).
      CorruptCheckpointError: (a ValueError) the checkpoint is damaged or not what
        nnxscan writes: a buffer whose crc32 does not match, a truncated or deleted file, a
        manifest that is torn or says what nnxscan never writes; it names the checkpoint
        directory, the step, the leaf or file, and what is wrong.
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
    pairs = _packing.flatten(like)
    treedef = _packing.treedef_of(like, len(pairs))
    wanted = [_packing.describe_template(path, leaf) for path, leaf in pairs]
    path = _resolve(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")

    template = _read.template_of(like, pairs, wanted)

    if check_item and "state" not in like:
        raise ValueError("check_item=True checks the model state: like needs a 'state' entry")

    def read(step: int) -> dict[str, Any]:
        matched, arrays = _read.read(path / str(step), template)
        tree = jax.tree.unflatten(treedef, _read.rebuild(matched, arrays))
        if check_item:
            _read.check_item(path / str(step), tree["state"])
        return tree

    if fallback and step is None:
        tree, step, _ = newest_good(path, read)
        return tree, step
    asked = step
    step = _pick_step(path, step)
    try:
        return read(step), step
    except CorruptCheckpointError as error:
        # A note, not the message: ``newest_good``'s warnings quote the message of a
        # checkpoint it skipped, where this advice would be false.
        error.add_note(
            f"Restore another checkpoint: all_steps({str(path)!r}) lists them, and "
            f"restore_checkpoint(directory, like, fallback=True) restores the newest good one."
            if asked is not None
            else "restore_checkpoint(directory, like, fallback=True) skips a damaged "
            "checkpoint and restores the newest good one."
        )
        raise


def read_log(directory: str | os.PathLike[str], start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the run log that :meth:`Checkpointer.append_log`
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
