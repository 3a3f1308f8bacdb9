"""nnxscan's own checkpoint storage: one raw file of packed buffers and a JSON manifest.

Used for the trees one process holds whole (after ``_checkpoint_packing.fill`` every array is a
host buffer), which is every single-process run that is not sharded over several devices.
Orbax is kept for the rest (arrays sharded over devices or processes), because it writes
each process's shards; its fixed CPU cost per save (mostly per array; measured in
docs/checkpoints.md) is what this storage avoids, so that a checkpoint written in the
background does not take the CPU from training.

The files of one checkpoint (both storages name a finished checkpoint by its step)::

    <directory>/<step>/
      manifest.json        the manifest of checkpoint.py (validated whole on read: see
                           _checkpoint_manifest.py), plus "buffers": per buffer its byte
                           offset, dtype, element count and crc32; the file's first
                           member is the crc32 of the rest of its text
      arrays.bin           the packed buffers, one per dtype, each starting on a 64-byte
                           boundary
      state/               the model state (the tree's "state" entry) again, as an orbax
                           item Flax's own code restores (_orbax_item.py), in the newest
                           checkpoint a checkpointer leaves when it closes: added to the
                           finished checkpoint by :func:`add_item`, off the training path

Atomicity, as orbax's: a checkpoint is written into ``<step>.nnxscan-tmp/``, every file
fsync'ed (all at once, with the run log's new bytes: one journal commit, not five), then
renamed to ``<step>/`` (atomic on a POSIX filesystem) and the directory fsync'ed (for
asynchronous saves, by the next save's fsyncs or the checkpointer's close). A checkpoint
is deleted by renaming it to ``<step>.nnxscan-deleting`` first, so a process killed
mid-delete never leaves a half-deleted checkpoint that lists as finished.

The run log, ``<directory>/history.jsonl``, is shared by both storages: bytes only ever
appended (and fsync'ed) before the checkpoint that refers to them is renamed into place,
so that a checkpoint records what grows with the run (a fit's History) as a byte range of
the log instead of a copy of it. It is cut back only to the end a restored checkpoint
recorded (what a killed process appended after its last finished checkpoint).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import os
import pathlib
import re
import shutil
import stat
import threading
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from nnxscan.adapters import _checkpoint_manifest as _manifest
from nnxscan.adapters import _orbax_item

MANIFEST = "manifest.json"
LOG = "history.jsonl"
DATA = _manifest.DATA
ITEM = "state"  # the model state as a Flax/orbax item: <step>/state/
TMP_SUFFIX = ".nnxscan-tmp"
DELETING_SUFFIX = ".nnxscan-deleting"
_ALIGN = 64
_MAX_MANIFEST = 256 * 2**20  # a manifest is JSON records, never near this
# orbax's default step names (no prefix, no padding): both storages list the same way.
_STEP_NAME = re.compile(r"0|[1-9]\d*")


def finished_steps(path: pathlib.Path) -> list[int]:
    """The steps of the finished checkpoints under ``path`` (either storage), ascending.

    A finished checkpoint is a directory named by its step alone; saves in progress (orbax's
    ``<step>.orbax-checkpoint-tmp-*``, ours ``<step>.nnxscan-tmp``) have longer names."""
    if not path.is_dir():
        return []
    return sorted(
        int(entry.name)
        for entry in os.scandir(path)
        if _STEP_NAME.fullmatch(entry.name) and entry.is_dir()
    )


def remove_leftovers(path: pathlib.Path) -> None:
    """Deletes what a killed process left of our saves and deletions (never a finished
    checkpoint, never orbax's files)."""
    if not path.is_dir():
        return
    for entry in os.scandir(path):
        if entry.name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            with contextlib.suppress(OSError):  # tried again at the next run's first save
                remove(pathlib.Path(entry.path))
        elif _STEP_NAME.fullmatch(entry.name):  # an item add_item did not finish
            with contextlib.suppress(OSError):
                remove(pathlib.Path(entry.path) / f"{ITEM}{TMP_SUFFIX}")


def remove_orbax_leftovers(path: pathlib.Path) -> None:
    """Deletes orbax's temporary folders (``<step>.orbax-checkpoint-tmp*``) under ``path``:
    what a failed orbax save left (a full disk). Never a finished checkpoint."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            if ".orbax-checkpoint-tmp" in entry.name and not _STEP_NAME.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    remove(pathlib.Path(entry.path))


def remove(entry: pathlib.Path) -> None:
    """Removes ``entry`` if it exists: a symbolic link (or a file) as itself, never what it
    points to; a folder with everything in it (``shutil.rmtree`` unlinks the links inside)."""
    try:
        info = os.lstat(entry)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(entry)
    else:
        os.unlink(entry)


def _fsync(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sync_directory(path: pathlib.Path) -> None:
    """fsyncs the checkpoint directory: the renames and deletions in it reach the disk."""
    with contextlib.suppress(FileNotFoundError):
        _fsync(path)


# The threads that fsync a batch's files at once: made when first needed, kept for the
# process (a thread made per path took a loaded 2-core machine ~3 ms each to schedule:
# 14 ms a batch, where waking these takes ~3 ms in all). A forked child makes its own.
_FSYNC_THREADS = 8
_POOL: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def _fsync_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            pool = concurrent.futures.ThreadPoolExecutor(
                _FSYNC_THREADS, thread_name_prefix="nnxscan-fsync"
            )
            _POOL = (os.getpid(), pool)
        return _POOL[1]


def _fsync_all(paths: list[pathlib.Path]) -> None:
    """fsyncs every path, all at once (on the fsync threads, the last on this one), and
    returns once every one is done; raises the first error. Concurrent fsyncs on one
    filesystem share the journal's commits (ext4, xfs): a checkpoint's four waits for the
    disk become about one (one after another, each waits for a commit of its own: 5x
    slower on a busy disk). At the interpreter's exit, when no thread may start, one after
    another."""
    futures, here = [], paths[-1:]
    for target in paths[:-1]:
        try:
            futures.append(_fsync_pool().submit(_fsync, target))
        except RuntimeError:  # the interpreter is shutting down: no new work for threads
            here.append(target)
    errors = []
    for target in here:
        try:
            _fsync(target)
        except BaseException as error:
            errors.append(error)
    for future in futures:
        error = future.exception()
        if error is not None:
            errors.append(error)
    if errors:
        raise errors[0]


def write_many(
    path: pathlib.Path,
    saves: list[tuple[int, dict[str, Any], dict[str, np.ndarray], bytes, Any]],
    *,
    sync_directory: bool = True,
    max_to_keep: int | None = None,
) -> list[pathlib.Path]:
    """Writes checkpoints ``(step, manifest, buffers, log, item)`` under ``path``, steps
    increasing, each atomically, with one wait for the disk for all; returns their folders.

    Every file of every checkpoint is written first, then all are fsync'ed at once (with
    the run log's new bytes and the directory: the previous write's renames), then each
    checkpoint is renamed from ``<step>.nnxscan-tmp`` to ``<step>``, in order, and the
    ``max_to_keep`` newest kept. ``log``: bytes appended to the run log first
    (:func:`append_log`). ``item``: None, or the model state's orbax item (``state/``, for
    Flax's code) to write into the checkpoint before it is renamed (else :func:`add_item`
    adds it later). ``sync_directory=False``: the renames reach the disk with the
    directory's next fsync (the next write's, or :func:`sync_directory`'s) instead of before
    this returns: a power loss meanwhile may lose these checkpoints (never tear one; the
    ones before stay), a killed process cannot.

    ``buffers``: name -> flat, contiguous host array that nobody else writes to while this
    runs (``_checkpoint_packing.fill`` makes copies, never views of device buffers), packed into
    ``arrays.bin``, each on a 64-byte boundary, its crc32 in the manifest (which carries
    its own: :func:`_checkpoint_manifest.dumps_checked`).

    A failed write renames none of them (each ``<step>.nnxscan-tmp`` is removed) and leaves
    every finished checkpoint as it was. A failed item only: the checkpoint is written
    whole without it, then the error raised (as :func:`add_item`'s).

    Raises:
      OSError: the disk is full (errno ENOSPC), or another error of the system's, named by
        errno, from Python's own writes; the message names the directory and the step (see
        :func:`disk_error`).
    """
    written: list[pathlib.Path] = []
    tmps: list[tuple[int, pathlib.Path]] = []
    finals: list[pathlib.Path] = []
    item_error = None
    finish_item = None  # an item being written (tensorstore's threads)
    try:
        path.mkdir(parents=True, exist_ok=True)
        for step, manifest, buffers, log, item in saves:
            if log:
                written += append_log(path, log, sync=False)
            tmp = path / f"{step}{TMP_SUFFIX}"
            remove(tmp)  # a save of this step killed mid-way: replaced, not an obstacle
            tmp.mkdir()
            tmps.append((step, tmp))
            if item is not None:  # committed in tensorstore's threads meanwhile
                try:
                    finish_item = _start_item(tmp / ITEM, item)
                except Exception as error:  # the checkpoint goes on without it
                    item_error = (step, error)
            written.append(tmp / DATA)
            placed = _write_data(tmp / DATA, buffers)
            text = _manifest.dumps_checked({**manifest, "buffers": placed})
            written.append(_write_file(tmp / MANIFEST, text))  # one write, not dozens
            if finish_item is not None:
                finish, finish_item = finish_item, None
                try:
                    written += finish()
                except Exception as error:
                    item_error = (step, error)
        # Every file and folder (and the log's bytes) reaches the disk before a rename
        # makes it a checkpoint; the directory too, with the previous write's renames.
        _fsync_all(list(dict.fromkeys([*written, *(tmp for _, tmp in tmps), path])))
        for step, tmp in tmps:
            os.rename(tmp, path / str(step))
            finals.append(path / str(step))
        if sync_directory:
            _fsync(path)
    except BaseException as error:
        if finish_item is not None:  # tensorstore's threads done before its folder goes
            with contextlib.suppress(BaseException):
                finish_item()
        for _, tmp in tmps[len(finals) :]:
            with contextlib.suppress(OSError):
                remove(tmp)
        steps = [save[0] for save in saves]
        what = f"checkpoint {steps[0]} was not written" if len(steps) == 1 else (
            f"checkpoints {steps} were not written")  # fmt: skip
        translated = disk_error(error, path, what)
        if translated is error:
            raise
        raise translated from error
    if max_to_keep is not None:
        keep_newest(path, max_to_keep)
    if item_error is not None:
        _raise_item_error(path, *item_error)
    return finals


def _write_item(where: pathlib.Path, item: tuple[list, list, dict[str, bytes]]) -> list:
    """Writes the model state's orbax item into the folder ``where``; returns its files
    (to fsync). A failure removes the folder (once tensorstore's threads are done)."""
    return _start_item(where, item)()


def _start_item(
    where: pathlib.Path, item: tuple[list, list, dict[str, bytes]]
) -> Callable[[], list[pathlib.Path]]:
    """Starts writing the model state's orbax item into the folder ``where`` (committed in
    tensorstore's threads); returns ``finish()``, which waits for it and returns its files
    (to fsync). A failure, here or in ``finish()``, removes the folder (once tensorstore's
    threads are done)."""
    try:
        pending = _orbax_item.write_item(where, *item)
    except BaseException:
        with contextlib.suppress(OSError):
            remove(where)
        raise

    def finish() -> list[pathlib.Path]:
        try:
            return pending()
        except BaseException:
            with contextlib.suppress(Exception):
                pending()  # tensorstore's threads done before the folder goes
            with contextlib.suppress(OSError):
                remove(where)
            raise

    return finish


def _raise_item_error(path: pathlib.Path, step: int, error: BaseException) -> None:
    translated = disk_error(
        error,
        path,
        f"the {ITEM}/ item of checkpoint {step} was not written (the checkpoint is whole "
        f"without it)",
    )
    if translated is error:
        raise error
    raise translated from error


def add_item(path: pathlib.Path, step: int, item: tuple[list, list, dict[str, bytes]]) -> None:
    """Adds the model state's orbax item, ``<step>/state/``, to the finished checkpoint
    ``step`` (nnxscan's own files) under ``path``, atomically: written into
    ``<step>/state.nnxscan-tmp``, every file fsync'ed, renamed to ``state`` and the step
    folder fsync'ed. Until the rename the checkpoint is the one it was (restores read
    ``arrays.bin``; a leftover ``state.nnxscan-tmp`` is ignored and removed by the next
    run's first save). Nothing to do when the checkpoint is gone or has its item already.

    Raises:
      OSError: as :func:`write_many` (a full disk is errno ENOSPC naming the directory); the
        temporary item is removed, the checkpoint stays as it was, without an item.
    """
    final = path / str(step)
    if not final.is_dir() or os.path.lexists(final / ITEM):
        return
    tmp = final / f"{ITEM}{TMP_SUFFIX}"
    try:
        remove(tmp)
        _fsync_all(_write_item(tmp, item))
        os.rename(tmp, final / ITEM)
        _fsync(final)
    except BaseException as error:
        with contextlib.suppress(OSError):
            remove(tmp)
        _raise_item_error(path, step, error)


def _write_data(where: pathlib.Path, buffers: dict[str, np.ndarray]) -> dict[str, Any]:
    """Writes the buffers into ``arrays.bin``, each on a 64-byte boundary; returns each one's
    record (offset, dtype, size, crc32)."""
    placed = {}
    with open(where, "wb") as file:
        offset = 0
        for name, buffer in buffers.items():
            padding = -offset % _ALIGN
            file.write(b"\0" * padding)
            offset += padding
            data = buffer.reshape(-1).view(np.uint8).data
            # crc32 here, on the background save thread (zlib releases the GIL for large buffers).
            placed[name] = {"offset": offset, "dtype": buffer.dtype.name, "size": buffer.size,
                            "crc32": _manifest.buffer_crc32(buffer)}  # fmt: skip
            file.write(data)
            offset += buffer.nbytes
    return placed


_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_error(error: BaseException, path: pathlib.Path, what: str) -> BaseException:
    """The error to raise for ``error``, met writing into checkpoint directory ``path``.

    A full disk (or quota) is an ``OSError`` with errno ENOSPC (EDQUOT) that names the
    directory, whether Python's own write raised it (without a path) or tensorstore
    (``ValueError: RESOURCE_EXHAUSTED: ... No space left on device [os_error_code='28']``);
    any other system error tensorstore reports becomes an ``OSError`` of its errno. Every
    other error is returned as it is."""
    code = None
    if isinstance(error, OSError) and error.errno in _DISK_FULL:
        code = error.errno
    elif isinstance(error, ValueError):  # tensorstore's
        found = _OS_ERROR_CODE.search(str(error))
        if found is not None:
            code = int(found[1])
        elif "No space left on device" in str(error):
            code = errno.ENOSPC
    if code is None:
        return error
    if code in _DISK_FULL:
        advice = "Free some space there (or give the run another directory), then resume"
    else:
        advice = f"The system said: {error}"
    return OSError(
        code,
        f"{os.strerror(code)} in checkpoint directory {path}: {what}; the checkpoints "
        f"written before are intact. {advice}",
        str(path),
    )


def _write_file(where: pathlib.Path, content: bytes) -> pathlib.Path:
    with open(where, "wb") as file:
        file.write(content)
    return where


def storage_of(step_path: pathlib.Path) -> str | None:
    """``"files"`` (nnxscan's own), ``"orbax"``, or None: neither storage's manifest is
    there (a deleted manifest, an emptied or foreign directory)."""
    if (step_path / MANIFEST).is_file():
        return "files"
    if (step_path / "manifest").is_dir():  # orbax's item holding the manifest
        return "orbax"
    return None


def read_manifest(step_path: pathlib.Path, file: pathlib.Path | None = None) -> tuple[Any, bool]:
    """The manifest (parsed) and whether it carried a matching crc32 (version 4; orbax's
    storage, whose manifest is ``file``: version 5). Raises ValueError for one that does
    not parse or whose crc32 does not match."""
    with open(step_path / MANIFEST if file is None else file, "rb") as file:
        raw = file.read(_MAX_MANIFEST + 1)
    if len(raw) > _MAX_MANIFEST:
        raise ValueError(f"it is larger than {_MAX_MANIFEST} bytes")
    return _manifest.loads_checked(raw)


def data_size(step_path: pathlib.Path) -> int | None:
    """The size in bytes of a checkpoint's ``arrays.bin`` (None if it is missing)."""
    try:
        return os.stat(step_path / DATA).st_size
    except (FileNotFoundError, NotADirectoryError):
        return None


def read_buffers(
    step_path: pathlib.Path, buffers: dict[str, dict[str, Any]], names: set[str]
) -> dict[str, np.ndarray]:
    """The buffers ``names`` of a checkpoint whose manifest was validated (each lies inside
    ``arrays.bin``), as writable numpy arrays; each checked against its crc32 when the
    manifest has one. Raises ValueError naming the buffer whose bytes are not what was
    written."""
    out = {}
    with open(step_path / DATA, "rb") as file:
        for name in sorted(names, key=lambda n: buffers[n]["offset"]):
            where = buffers[name]
            # jnp.dtype knows bfloat16, float8_* and int4 by name; numpy does not.
            buffer = np.empty(where["size"], dtype=jnp.dtype(where["dtype"]))
            view = buffer.view(np.uint8)
            file.seek(where["offset"])
            got = file.readinto(view)
            _manifest.check_buffer_read(
                name, DATA, got, where["nbytes"], "bytes", view, where.get("crc32")
            )
            out[name] = buffer
    return out


def log_size(path: pathlib.Path) -> int:
    """The run log's size in bytes (0 when there is none yet)."""
    try:
        return os.stat(path / LOG).st_size
    except FileNotFoundError:
        return 0


def append_log(path: pathlib.Path, data: bytes, *, sync: bool = True) -> list[pathlib.Path]:
    """Appends ``data`` to the run log and fsyncs it (and the directory, when the log is
    new): on disk before the checkpoint written next refers to it. ``sync=False``: returns
    those paths for the caller to fsync (with its own) instead."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        log = path / LOG
        new = not log.exists()
        with open(log, "ab") as file:
            file.write(data)
        unsynced = [log, path] if new else [log]
        if sync:
            _fsync_all(unsynced)
            return []
        return unsynced
    except OSError as error:  # a torn line is cut off by the next resume
        translated = disk_error(error, path, f"the run log {LOG} was not appended to")
        if translated is error:
            raise
        raise translated from error


def truncate_log(path: pathlib.Path, size: int) -> None:
    """Cuts the run log back to ``size`` bytes (nothing to do when it is that long)."""
    log = path / LOG
    if log_size(path) > size:
        with open(log, "r+b") as file:
            file.truncate(size)
            file.flush()
            os.fsync(file.fileno())


def read_log(path: pathlib.Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the run log; a log missing or shorter raises ValueError."""
    log = path / LOG
    size = log_size(path)
    if size < end:
        have = f"holds {size} bytes" if log.exists() else "is missing"
        raise ValueError(
            f"the run log {log} {have}, but the checkpoint's History is its bytes "
            f"[{start}, {end}): keep {LOG} with the checkpoints. To go on without the "
            f"History, restore() the checkpoint and fit without resume=True."
        )
    with open(log, "rb") as file:
        file.seek(start)
        return file.read(end - start)


def delete(path: pathlib.Path, step: int) -> None:
    """Deletes checkpoint ``step`` (either storage) so that it stops listing at once. A step
    folder that is a symbolic link is removed as a link: what it points to stays.

    Raises:
      OSError: it could not be deleted; the message names it (the errno is the system's).
    """
    doomed = path / f"{step}{DELETING_SUFFIX}"
    try:
        remove(doomed)
        os.rename(path / str(step), doomed)
        remove(doomed)
    except OSError as error:
        raise OSError(
            error.errno,
            f"could not delete checkpoint {step} of {path} ({path / str(step)}, renamed "
            f"{doomed.name} while deleted): {error.strerror or error}. The newer "
            f"checkpoints are on disk: make it deletable (or delete it), then resume",
            str(path / str(step)),
        ) from error


def keep_newest(path: pathlib.Path, max_to_keep: int) -> None:
    """Deletes all but the newest ``max_to_keep`` finished checkpoints under ``path``."""
    steps = finished_steps(path)
    for step in steps[: max(len(steps) - max_to_keep, 0)]:
        delete(path, step)


def set_aside(path: pathlib.Path, step: int, reason: str) -> pathlib.Path:
    """Renames checkpoint ``step`` to ``<step>.<reason>`` (``-2``, ``-3``... when taken):
    kept for the user to look at, no longer listed, restored or deleted by max_to_keep."""
    target = path / f"{step}.{reason}"
    count = 1
    while target.exists():
        count += 1
        target = path / f"{step}.{reason}-{count}"
    os.rename(path / str(step), target)
    _fsync(path)
    return target


def check_directory(path: pathlib.Path) -> None:
    """A checkpoint directory must be a directory we may write (or not exist yet, under a
    folder we may create it in): a ValueError naming it otherwise, before any training."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe == path and not path.is_dir():
        raise ValueError(
            f"checkpoint_dir {path} is a file, not a directory: pass a folder's path (it is "
            f"created if missing)."
        )
    if probe != path and not probe.is_dir():
        raise ValueError(
            f"checkpoint_dir {path} cannot be created: {probe} is a file, not a directory."
        )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"checkpoint_dir {path}: {probe} is not writable by this process: pass a folder "
            f"you may write to."
        )
