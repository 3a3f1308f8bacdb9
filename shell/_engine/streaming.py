"""Streaming batches from host iterators into scanned calls, with bounded prefetch.

A background thread pulls, checks, converts and stacks the next chunk of K batches
``(K, batch, ...)`` and starts its transfer while the current chunk trains. Memory stays
bounded: the producer takes one of two slots before it pulls a chunk, and the trainer frees
one when a chunk's call has FINISHED on the device (not merely been dispatched), so the
iterator is never more than two chunks ahead of the last finished call.
"""

from __future__ import annotations

import collections.abc
import inspect
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from nnxscan.adapters.data import to_numpy

# Batches per chunk for a stream: long enough that a call's fixed cost (its dispatch, the
# write-back) vanishes next to 100 steps, short enough that the progress bar moves (and see
# CHUNK_BYTES).
STREAM_STEPS_PER_CALL = 100
_SLOTS = 2  # chunks the producer may hold beyond the last finished call
# A chunk of big batches must stay small in memory: K shrinks to fit this many bytes.
CHUNK_BYTES = 256 * 2**20


def default_chunk_size(first_batch: Any) -> int:
    """Batches per chunk for a stream: 100, fewer when that would pass ``CHUNK_BYTES``."""
    nbytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(first_batch))
    return int(max(1, min(STREAM_STEPS_PER_CALL, CHUNK_BYTES // max(nbytes, 1))))


class Chunk(NamedTuple):
    """``steps`` stacked batches on the device (one, for a kept short final batch)."""

    data: Any
    steps: int


class _Failure(NamedTuple):
    error: BaseException


_END = object()


def is_stream(data: Any) -> bool:
    """Whether ``fit`` should stream ``data`` batch by batch rather than index into it."""
    if callable(data) and not hasattr(data, "__array__"):
        return True
    if isinstance(data, list):
        return True
    if isinstance(data, collections.abc.Mapping | tuple | np.ndarray | jax.Array):
        return False
    return isinstance(data, Iterable) and not hasattr(data, "__array__")


def stream_hint(data: Any) -> str:
    """What a message about a bad batch adds for the kind of stream the batch came from:
    a list of arrays may have been meant as a data set; a generator's batches are its own."""
    if isinstance(data, list):
        return (
            "(A list is read as a list of batches: pass a tuple (x, y) for a data set of arrays.)"
        )
    if inspect.isgenerator(data):
        source = "the generator"
    elif callable(data):
        name = getattr(data, "__name__", type(data).__name__)
        source = f"the iterator your data callable {name} returns"
    elif isinstance(data, Iterator):
        source = f"the iterator ({type(data).__name__})"
    else:
        source = f"the {type(data).__name__}"
    return (
        f"(Every batch {source} yields is one step, trained as it comes: make it yield the "
        f"same structure, shapes and dtypes each time, or pass the whole data set as "
        f"arrays, e.g. a tuple (x, y), and let fit cut the batches.)"
    )


class EpochSource:
    """Gives one fresh iterator per epoch from a callable, a re-iterable or an iterator."""

    def __init__(self, data: Any, epochs: int):
        self._data = data
        #: Ends the messages about a bad batch (see :func:`stream_hint`).
        self.hint = stream_hint(data)
        if isinstance(data, Iterator) and epochs > 1:
            raise ValueError(
                f"data is a single-use iterator ({type(data).__name__}), so it can't give "
                f"{epochs} epochs. Pass a zero-argument callable that returns a fresh "
                f"iterator per epoch, e.g. fit(lambda: make_batches(), ...), or a "
                f"re-iterable such as a list or a DataLoader."
            )

    def epoch(self) -> Iterator:
        data = self._data
        it = data() if callable(data) else iter(data)
        if not isinstance(it, Iterator):
            try:
                it = iter(it)
            except TypeError:
                raise TypeError(
                    f"the data callable returned a {type(it).__name__}, not an iterator of batches."
                ) from None
        return it

    def peek(self) -> tuple[Any, Iterator]:
        """The first epoch's first batch (as numpy), and that epoch's iterator with it put
        back."""
        first_epoch = self.epoch()
        first = next(first_epoch, None)
        if first is None:
            raise ValueError("data is empty: the iterator yielded no batch.")
        return to_numpy(first, index=0), itertools.chain([first], first_epoch)


def _describe(tree: Any) -> dict[str, tuple[tuple, str]]:
    """Path -> (shape, dtype as JAX will see it) for every leaf of a batch."""
    return {
        jax.tree_util.keystr(p): (
            tuple(np.shape(x)),
            str(jax.dtypes.canonicalize_dtype(np.result_type(x))),
        )
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


class BatchChecker:
    """Every batch must look like the first of the fit (a short FINAL batch aside).

    One checker serves all epochs of a ``fit``: the step was traced on the first batch, so
    a later epoch with other shapes or dtypes is as wrong as a later batch. With a ``lead``
    of ``(N,)`` (members with their own batches) every batch holds one batch per member,
    ``(N, batch, ...)``: the batch size is then the second dimension.
    """

    def __init__(self, batch_size: int | None, lead: tuple[int, ...] = (), hint: str = ""):
        self.batch_size = batch_size
        self.lead = lead
        self.hint = hint
        self.leaves: dict[str, tuple[tuple, str]] | None = None
        self.treedef = None

    def _batch_axis(self, where: str, leaves: dict[str, tuple[tuple, str]]) -> int:
        axis = len(self.lead)
        for path, (shape, _) in leaves.items():
            # (A leaf without a batch axis never gets here: to_numpy refuses it.)
            if len(shape) <= axis or shape[:axis] != self.lead:
                raise ValueError(
                    f"{where}, leaf {path}: shape {shape}, but with member_batches=True every "
                    f"leaf needs a leading members axis of {self.lead[0]} and a batch axis: "
                    f"(members, batch, ...)."
                )
        return axis

    def leading_size(self, index: int, batch: Any, epoch: int = 0) -> int:
        where = f"batch {index}" + (f" of epoch {epoch}" if epoch else "")
        leaves = _describe(batch)
        treedef = jax.tree.structure(batch)
        axis = self._batch_axis(where, leaves)
        sizes = {shape[axis] for shape, _ in leaves.values()}
        if len(sizes) != 1:
            raise ValueError(
                f"{where}: leaves disagree on the batch size: "
                f"{ {p: shape for p, (shape, _) in leaves.items()} }. Every leaf of a batch "
                f"needs the same leading size."
            )
        size = sizes.pop()
        if self.leaves is None:
            if self.batch_size is not None and size != self.batch_size:
                raise ValueError(
                    f"{where} has {size} examples but batch_size={self.batch_size}; "
                    f"leave batch_size out to take the loader's own batch size."
                )
            self.leaves, self.treedef = leaves, treedef
            return size
        if treedef != self.treedef:
            raise ValueError(
                f"{where} has another structure than batch 0: "
                f"{ {p: shape for p, (shape, _) in leaves.items()} } vs "
                f"{ {p: shape for p, (shape, _) in self.leaves.items()} }. {self.hint}".rstrip()
            )
        for path, (shape, dtype) in leaves.items():
            want_shape, want_dtype = self.leaves[path]
            other_dims = shape[:axis] + shape[axis + 1 :]
            if (
                other_dims != want_shape[:axis] + want_shape[axis + 1 :]
                or shape[axis] > want_shape[axis]
                or dtype != want_dtype
            ):
                raise ValueError(
                    f"{where}, leaf {path}: shape {shape} {dtype} differs from batch 0's "
                    f"{want_shape} {want_dtype}. Every batch must have the same shapes and "
                    f"dtypes (only the final batch of an epoch may be shorter). "
                    f"{self.hint}".rstrip()
                )
        return size

    @property
    def full_size(self) -> int:
        assert self.leaves is not None
        return next(iter(self.leaves.values()))[0][len(self.lead)]


class _Stopped(Exception):
    pass


def _stack(batches: list) -> Any:
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def _chunks(
    iterator: Iterator,
    *,
    chunk_size: int,
    checker: BatchChecker,
    epoch: int,
    keep_tail: bool,
    put: Callable[[Any], Any],
    acquire: Callable[[], None],
    tail_divisor: int = 1,
    check_stop: Callable[[], None],
    on_dropped: Callable[[int], None],
    resumed: bool = False,
) -> Iterator[Chunk]:
    """Pulls, checks, stacks and transfers (``put``) chunks of ``chunk_size`` batches."""
    index, pending = 0, []

    def pull() -> Any:
        check_stop()  # a stopped fit takes nothing more from the user's iterator
        return next(iterator, _END)

    acquire()
    while (raw := pull()) is not _END:
        batch = to_numpy(raw, index=index)
        size = checker.leading_size(index, batch, epoch)
        if size < checker.full_size:
            if pull() is not _END:
                raise ValueError(
                    f"batch {index} has {size} examples but earlier batches have "
                    f"{checker.full_size}; only the final batch of an epoch may be shorter."
                )
            if pending:
                yield Chunk(put(_stack(pending)), len(pending))
                acquire()
            # On a mesh a kept short batch must still split over the devices; one that
            # can't is dropped (and counted in the warning) rather than failing mid-epoch.
            if keep_tail and size % tail_divisor == 0:
                yield Chunk(put(_stack([batch])), 1)
            else:
                on_dropped(size)
            return
        pending.append(batch)
        index += 1
        if len(pending) == chunk_size:
            yield Chunk(put(_stack(pending)), len(pending))
            pending = []
            acquire()
    if index == 0 and not resumed:
        hint = (
            " A re-iterable must give a fresh pass every epoch; pass a zero-argument "
            "callable that returns a new iterator."
            if epoch
            else ""
        )
        raise ValueError(f"data is empty: the iterator yielded no batch in epoch {epoch}.{hint}")
    if pending:
        yield Chunk(put(_stack(pending)), len(pending))


class ChunkStream:
    """One epoch's chunks, produced ahead by a thread (or inline without ``prefetch``).

    Iterate it for the chunks. Call ``finished(i)`` when the call of chunk ``i`` has
    finished on the device: that frees the slot the producer needs for the chunk two
    ahead. ``close()`` stops the producer (it takes no more batches from the iterator).
    ``at_end()`` tells whether every chunk of the epoch has been handed out.
    """

    def __init__(self, iterator: Iterator, *, prefetch: bool, **options: Any):
        self._stop = threading.Event()
        self._slots = threading.Semaphore(_SLOTS)
        self._produced = 0
        self._handed = 0
        self._producer_done = False
        self._thread = None

        def check_stop() -> None:
            if self._stop.is_set():
                raise _Stopped

        def acquire() -> None:
            while prefetch and not self._slots.acquire(timeout=0.05):
                check_stop()

        self._chunks = _chunks(iterator, acquire=acquire, check_stop=check_stop, **options)
        if prefetch:
            self._items: queue.Queue = queue.Queue()
            self._thread = threading.Thread(
                target=self._produce, name="nnxscan-prefetch", daemon=True
            )
            self._thread.start()

    def _produce(self) -> None:
        try:
            for chunk in self._chunks:
                self._produced += 1
                self._items.put(chunk)
            self._producer_done = True
            self._items.put(_END)
        except _Stopped:
            pass
        except BaseException as error:  # the iterator's own error goes to the trainer
            self._items.put(_Failure(error))

    def __iter__(self) -> Iterator[Chunk]:
        if self._thread is None:
            for chunk in self._chunks:
                self._handed += 1
                yield chunk
            self._producer_done = True
            return
        while True:
            item = self._items.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            self._handed += 1
            yield item

    def finished(self, count: int = 1) -> None:
        for _ in range(count):
            self._slots.release()

    def at_end(self) -> bool:
        return self._producer_done and self._handed == self._produced

    def close(self) -> None:
        self._stop.set()
        if self._thread is None:
            self._chunks.close()
        else:
            # The producer checks the stop flag before every pull; only a user iterator
            # blocked inside next() can outlive this wait (the thread is a daemon).
            self._thread.join(timeout=2.0)
