"""The save thread of a checkpointer's asynchronous saves: a bounded queue, in order.

Jobs (a save, or the saves a fused call made together) are queued as they come; one
thread takes everything queued at once and writes it as one batch (the checkpointer's
``_write_jobs``: every file of the batch fsync'ed together, then each checkpoint renamed
into place, in order), so that a save thread that falls behind waits for the disk once for
several saves instead of once for each. The training thread waits only when the save thread
is more than one job behind: when :data:`QUEUED` jobs already wait behind the batch being
written, or one job of more than :data:`QUEUED_BYTES` does (a save's host copy is held
until it is written). A process killed meanwhile loses what is not yet renamed into place:
the batch being written and the jobs queued, at most ``2 * QUEUED`` jobs (the checkpoints
before stay).

A failed batch drops the saves queued behind it (they would follow a checkpoint that is
not there) and its error is raised, once, by the next :meth:`SaveThread.make_room`
or :meth:`SaveThread.drain`.
"""

from __future__ import annotations

import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import Any

#: A job waits while this many jobs are queued, not yet taken by the save thread ...
QUEUED = 2
#: ... or one job holding more bytes than this (large models keep one copy queued).
QUEUED_BYTES = 64 * 2**20


class SaveThread:
    """Writes queued jobs in order, on one thread, several per ``write`` call when behind.

    Example:
      >>> save_thread = SaveThread(lambda batch: print([job for job in batch]))
      >>> save_thread.submit(1); save_thread.drain(); save_thread.close()
      [1]
    """

    def __init__(
        self,
        write: Callable[[list[Any]], None],
        weigh: Callable[[Any], int] = lambda job: 0,
        queued_bytes: int = QUEUED_BYTES,
    ) -> None:
        self._write = write
        self._weigh = weigh
        self._limit = queued_bytes
        self._bytes = 0  # what the queued jobs weigh
        self._cond = threading.Condition()
        self._queued: list[Any] = []
        self._writing = 0
        self._error: BaseException | None = None
        self._closing = False
        self._thread: threading.Thread | None = None

    def submit(self, job: Any) -> None:
        """Queues ``job`` (call :meth:`make_room` first: this does not wait)."""
        with self._cond:
            self._queued.append(job)
            self._bytes += self._weigh(job)
            if self._thread is None:
                # A daemon thread, so that a checkpointer never closed cannot hang the
                # interpreter's exit; what it queued is written at exit (_drain_at_exit).
                self._thread = threading.Thread(
                    target=self._run, name="nnxscan-checkpoint", daemon=True
                )
                self._thread.start()
                if not _LIVE:  # registered when first needed: importing changes nothing
                    atexit.unregister(_drain_at_exit)
                    atexit.register(_drain_at_exit)
                _LIVE.add(self)
            self._cond.notify_all()

    def amend_last(self, change: Callable[[Any], Any]) -> bool:
        """Replaces the newest queued job (not yet taken by the save thread) by ``change(job)``,
        unless that is None; returns whether it did."""
        with self._cond:
            if not self._queued:
                return False
            new = change(self._queued[-1])
            if new is None:
                return False
            self._queued[-1] = new
            return True

    def make_room(self) -> None:
        """Returns once fewer than :data:`QUEUED` jobs wait behind the batch being written
        (none, when those waiting hold more than ``queued_bytes``); raises a failed batch's
        error."""
        self._wait_until(
            lambda: len(self._queued) < QUEUED and (not self._queued or self._bytes <= self._limit)
        )

    def drain(self) -> None:
        """Returns once every queued job is written; raises a failed batch's error."""
        self._wait_until(lambda: not self._queued and not self._writing)

    def _wait_until(self, done: Callable[[], bool]) -> None:
        with self._cond:
            while self._error is None and not done():
                self._cond.wait()
            if self._error is not None:
                error, self._error = self._error, None
                raise error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closing:
                    self._cond.wait()
                if not self._queued:
                    return
                batch, self._queued, self._bytes = self._queued, [], 0
                self._writing = len(batch)
            try:
                self._write(batch)
            except BaseException as error:  # raised on the training thread, at its next wait
                with self._cond:
                    self._error = error
                    self._queued, self._bytes = [], 0
            finally:
                with self._cond:
                    self._writing = 0
                    self._cond.notify_all()

    def close(self) -> None:
        """Lets the thread end once the queue is empty (after :meth:`drain`), and joins it."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()


_LIVE: weakref.WeakSet[SaveThread] = weakref.WeakSet()


def _drain_at_exit() -> None:
    """At the interpreter's exit, writes what save threads never closed still queue (as the
    executor that wrote saves before did: its threads were joined at exit)."""
    for save_thread in list(_LIVE):
        with contextlib.suppress(BaseException):  # raised already, or the next run's to see
            save_thread.drain()
