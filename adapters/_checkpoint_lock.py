"""The directory lock of a checkpoint directory: one run writes a directory at a time.

An advisory ``flock`` on ``<directory>/.nnxscan-lock``, held from a run's first save (or
``Checkpointer.lock``) until it closes, released by the kernel when the holder dies however
it dies. The file names the holder (``process <pid> on <host>``) for the error a second
run gets. What a user's or a killed run's leftovers cannot do to it:

- the lock file is opened without following a symbolic link and must be a regular file of
  its own (no hard link): nothing is ever written through it or created outside the
  directory;
- a process this one forks without exec (multiprocessing's "fork": a data loader's
  workers) closes its copy of the descriptor, so a worker that outlives a killed run does
  not keep the directory (a flock belongs to the open file, shared by every copy); exec'd
  children never get it (``O_CLOEXEC``);
- when a lock is held but the process the file names has ended (a child forked outside
  Python kept it), the error names the live processes that hold it, read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import socket
import stat


class CheckpointLockedError(RuntimeError):
    """Another process (or another Checkpointer in this one) is writing checkpoints into the same
    directory: two runs on one ``checkpoint_dir`` would mix their steps and run logs."""


LOCK = ".nnxscan-lock"
# The descriptors of the locks this process holds. A child made by fork() without exec
# (multiprocessing's "fork", a data loader's workers) gets copies of them, and a flock
# belongs to the open file, not to a process: a child that kept its copy would hold the
# directory after its parent died. The copies are closed in every such child (closing a
# copy leaves the parent's lock held); exec'd children never get them (O_CLOEXEC).
_HELD: set[int] = set()
_FORK_HOOK: list[bool] = []


def _close_in_child() -> None:
    for descriptor in _HELD:
        with contextlib.suppress(OSError):
            os.close(descriptor)
    _HELD.clear()


def lock(path: pathlib.Path) -> int | None:
    """Takes the directory lock (an advisory ``flock`` on ``<path>/.nnxscan-lock``,
    released when the file is closed, or by the kernel when the process dies however it
    dies); returns its file descriptor (None where ``fcntl`` does not exist, on Windows).
    The file names the holder (process id and host) for the error a second run gets.

    The lock file is opened without following a symbolic link (``O_NOFOLLOW``) and must be
    a regular file of its own: nothing is ever written through a link or into another
    file. Processes forked from this one do not keep the lock (see ``_HELD``).

    Raises:
      CheckpointLockedError: another open lock holds it, naming the directory and the
        process that holds it.
      ValueError: the lock file is a symbolic link, or not a regular file of its own
        (the path is named); nothing was written.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks, no check
        return None
    path.mkdir(parents=True, exist_ok=True)
    if not _FORK_HOOK and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_close_in_child)
        _FORK_HOOK.append(True)
    where = path / LOCK
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        descriptor = os.open(where, flags, 0o644)
    except OSError as error:
        if os.path.islink(where):  # ELOOP: O_NOFOLLOW refused it, dangling or not
            raise ValueError(
                f"checkpoint directory {path}: its lock file {where} is a symbolic link (to "
                f"{os.readlink(where)}); nnxscan never writes through a link. Remove the "
                f"link, or give this run another checkpoint_dir."
            ) from None
        raise OSError(
            error.errno,
            f"checkpoint directory {path}: cannot open its lock file {where}: "
            f"{error.strerror}. Make it a plain file this process may write, or remove it",
            str(where),
        ) from error
    try:
        info = os.fstat(descriptor)
        what = None
        if not stat.S_ISREG(info.st_mode):
            what = "not a regular file"
        elif info.st_nlink > 1:  # another name of a file elsewhere: never written into
            what = f"a hard link (one of {info.st_nlink} names of one file)"
        if what is not None:
            raise ValueError(
                f"checkpoint directory {path}: its lock file {where} is {what}; nnxscan "
                f"writes the holder's name into it and writes into no other file. Remove "
                f"it, or give this run another checkpoint_dir."
            )
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            recorded = os.pread(descriptor, 200, 0).decode(errors="replace").strip()
            raise CheckpointLockedError(
                f"checkpoint directory {path} is in use by another run "
                f"({_holder(recorded, info)}): two runs writing one directory would mix "
                f"their checkpoints and run logs. Wait for it to end (or stop it), or give "
                f"this run another checkpoint_dir."
            ) from None
    except BaseException:
        os.close(descriptor)
        raise
    os.ftruncate(descriptor, 0)
    os.pwrite(descriptor, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    _HELD.add(descriptor)
    return descriptor


def _holder(recorded: str, info: os.stat_result) -> str:
    """Who holds the lock: what its file records (``process <pid> on <host>``), or, when
    that process has ended (a child forked without our hook kept the lock: a C library's
    fork), the live processes that hold it, read from ``/proc`` (Linux)."""
    found = re.fullmatch(r"process (\d+) on (.*)", recorded)
    if found is None or found[2] != socket.gethostname() or _alive(int(found[1])):
        return recorded or "unknown"
    holders = _lock_holders(info)
    if holders:
        names = ", ".join(f"process {pid} ({command})" for pid, command in holders)
        return (
            f"held by {names} on {found[2]}; the lock file names process {found[1]}, which "
            f"has ended: a process it started inherited the lock"
        )
    return (
        f"the lock file names process {found[1]} on {found[2]}, which has ended; a process "
        f"it started (a forked data-loader worker) still holds the lock: `fuser` or "
        f"`lsof` on {LOCK} names it"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive
    return True


def _lock_holders(info: os.stat_result) -> list[tuple[int, str]]:
    """The processes (pid, command) with an open descriptor of the lock file that holds a
    flock on it, as /proc shows them (only what this user may read; [] elsewhere)."""
    holders = []
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return []
    for pid in pids:
        if pid == os.getpid():
            continue
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in descriptors:
            try:
                target = os.stat(f"/proc/{pid}/fd/{fd}")
                if (target.st_dev, target.st_ino) != (info.st_dev, info.st_ino):
                    continue
                with open(f"/proc/{pid}/fdinfo/{fd}") as fdinfo:
                    if "FLOCK" not in fdinfo.read():
                        continue
                with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                    command = cmdline.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            holders.append((pid, " ".join(command.split())[:80] or "?"))
            break
    return holders


def unlock(descriptor: int | None) -> None:
    # Only a lock this process took: in a forked child the copy is closed already, and
    # its number may name another file by now.
    if descriptor is not None and descriptor in _HELD:
        _HELD.discard(descriptor)
        os.close(descriptor)  # releases the flock
