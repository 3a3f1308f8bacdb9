"""nnxscan's own checkpoint storage: one raw file of packed buffers and a JSON manifest.

Used for the trees one process holds whole (after ``checkpoint._fill`` every array is one
host buffer per dtype), which is every single-process run that is not sharded over several
devices. Orbax is kept for the rest (arrays sharded over devices or processes), because it
writes each process's shards; its fixed cost (~45 ms of CPU per save for a 5.6 MB model on
this project's 2-core machine, against ~3 ms here) is what this storage avoids, so that a
checkpoint written in the background does not take the CPU from training.

Layout of one checkpoint (both storages name a finished checkpoint by its step)::

    <directory>/<step>/
      manifest.json        the manifest of checkpoint.py, plus "buffers": per packed
                           buffer its byte offset in arrays.bin, dtype and element count
      arrays.bin           the packed buffers, each starting on a 64-byte boundary

Atomicity, as orbax's: a checkpoint is written into ``<step>.nnxscan-tmp/``, every file
fsync'ed, then renamed to ``<step>/`` (atomic on a POSIX filesystem) and the directory
fsync'ed. A checkpoint is deleted by renaming it to ``<step>.nnxscan-deleting`` first, so
a process killed mid-delete never leaves a half-deleted checkpoint that lists as finished.

The run log, ``<directory>/history.jsonl``, is shared by both storages: bytes only ever
appended (and fsync'ed) before the checkpoint that refers to them is renamed into place,
so that a checkpoint records what grows with the run (a fit's History) as a byte range of
the log instead of a copy of it. It is cut back only to the end a restored checkpoint
recorded (what a killed process appended after its last finished checkpoint).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

import jax.numpy as jnp
import numpy as np

MANIFEST = "manifest.json"
LOG = "history.jsonl"
DATA = "arrays.bin"
TMP_SUFFIX = ".nnxscan-tmp"
DELETING_SUFFIX = ".nnxscan-deleting"
_ALIGN = 64
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


def holds_files_checkpoint(step_path: pathlib.Path) -> bool:
    """Whether ``<directory>/<step>`` was written by this storage (else by orbax)."""
    return (step_path / MANIFEST).is_file()


def remove_leftovers(path: pathlib.Path) -> None:
    """Deletes what a killed process left of our saves and deletions (never a finished
    checkpoint, never orbax's files)."""
    if not path.is_dir():
        return
    for entry in os.scandir(path):
        if entry.name.endswith((TMP_SUFFIX, DELETING_SUFFIX)):
            shutil.rmtree(entry.path, ignore_errors=True)


def _fsync(path: pathlib.Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write(
    path: pathlib.Path, step: int, manifest: dict[str, Any], buffers: dict[str, np.ndarray]
) -> pathlib.Path:
    """Writes checkpoint ``step`` under ``path`` atomically; returns ``<path>/<step>``.

    ``buffers`` are flat, contiguous host arrays that nobody else writes to while this runs
    (``checkpoint._fill`` makes them: copies, never views of device buffers)."""
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"{step}{TMP_SUFFIX}"
    if tmp.exists():  # a save of this step killed mid-way: replaced, not an obstacle
        shutil.rmtree(tmp)
    tmp.mkdir()
    placed = {}
    with open(tmp / DATA, "wb") as file:
        offset = 0
        for name, buffer in buffers.items():
            padding = -offset % _ALIGN
            file.write(b"\0" * padding)
            offset += padding
            placed[name] = {"offset": offset, "dtype": buffer.dtype.name, "size": buffer.size}
            file.write(buffer.reshape(-1).view(np.uint8).data)
            offset += buffer.nbytes
        file.flush()
        os.fsync(file.fileno())
    with open(tmp / MANIFEST, "w") as file:
        file.write(json.dumps({**manifest, "buffers": placed}))  # one write, not dozens
        file.flush()
        os.fsync(file.fileno())
    _fsync(tmp)
    final = path / str(step)
    os.rename(tmp, final)
    _fsync(path)
    return final


def log_size(path: pathlib.Path) -> int:
    """The run log's size in bytes (0 when there is none yet)."""
    try:
        return os.stat(path / LOG).st_size
    except FileNotFoundError:
        return 0


def append_log(path: pathlib.Path, data: bytes) -> None:
    """Appends ``data`` to the run log and fsyncs it (and the directory, when the log is
    new): on disk before the checkpoint written next refers to it."""
    path.mkdir(parents=True, exist_ok=True)
    log = path / LOG
    new = not log.exists()
    with open(log, "ab") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())
    if new:
        _fsync(path)


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
    """Deletes checkpoint ``step`` (either storage) so that it stops listing at once."""
    doomed = path / f"{step}{DELETING_SUFFIX}"
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path / str(step), doomed)
    shutil.rmtree(doomed)


def keep_newest(path: pathlib.Path, max_to_keep: int) -> None:
    """Deletes all but the newest ``max_to_keep`` finished checkpoints under ``path``."""
    steps = finished_steps(path)
    for step in steps[: max(len(steps) - max_to_keep, 0)]:
        delete(path, step)


def read_manifest(step_path: pathlib.Path) -> dict[str, Any]:
    with open(step_path / MANIFEST) as file:
        return json.load(file)


def read_buffers(step_path: pathlib.Path, manifest: dict[str, Any], names: set[str]) -> dict:
    """The packed buffers ``names`` of checkpoint ``step_path``, as writable numpy arrays."""
    out = {}
    with open(step_path / DATA, "rb") as file:
        for name in names:
            where = manifest["buffers"][name]
            file.seek(where["offset"])
            # jnp.dtype knows bfloat16, float8_* and int4 by name; numpy does not.
            buffer = np.fromfile(file, dtype=jnp.dtype(where["dtype"]), count=where["size"])
            if buffer.size != where["size"]:
                raise ValueError(
                    f"{step_path / DATA} is truncated: {name} holds {buffer.size} of its "
                    f"{where['size']} elements. Restore another checkpoint with step=."
                )
            out[name] = buffer
    return out
