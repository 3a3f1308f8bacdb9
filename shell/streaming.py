"""Streaming batches from host iterators into scanned calls, with bounded prefetch.

A loader yields one batch at a time; scanning still pays off when K consecutive batches are
stacked into one chunk ``(K, batch, ...)`` and trained in one compiled call. A background
thread pulls, checks, converts and stacks the next chunk, and starts its transfer to the
device, while the current chunk trains.

Memory stays bounded whatever the data set's size: the producer takes a slot before it
pulls a chunk and the trainer frees one when a call has finished, with two slots in all,
so the iterator is never more than two chunks (2·K batches) ahead of the last finished
call.
"""

from __future__ import annotations

import collections.abc
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import numpy as np

from nnxscan.adapters.data import to_numpy

__all__ = [
    "STREAM_STEPS_PER_CALL",
    "Chunk",
    "EpochSource",
    "is_stream",
    "stream_chunks",
]

# Steps per compiled call for a stream under the "scan" plan: long enough that the call's
# fixed cost (~0.1 ms) vanishes next to 100 steps, short enough that a chunk of 100
# batches is small in host memory and the progress bar moves.
STREAM_STEPS_PER_CALL = 100
_SLOTS = 2  # chunks the producer may hold beyond the last finished call


class Chunk(NamedTuple):
    """K stacked batches on the device, or (``tail``) one short final batch."""

    data: Any
    steps: int
    tail: bool = False


class _Failure(NamedTuple):
    error: BaseException


_END = object()


def is_stream(data: Any) -> bool:
    """Whether ``fit`` should stream ``data`` batch by batch rather than index into it.

    A zero-argument callable, a ``list`` (of batches), an iterator or any other iterable
    that is not a pytree container (a DataLoader) is a stream. Arrays, dicts, tuples and
    NamedTuples are pytrees of arrays: the whole data set.
    """
    if callable(data) and not hasattr(data, "__array__"):
        return True
    if isinstance(data, list):
        return True
    if isinstance(data, dict | tuple | np.ndarray | jax.Array) or hasattr(data, "__array__"):
        return False
    if isinstance(data, collections.abc.Mapping):
        return False
    return isinstance(data, Iterable)


class EpochSource:
    """Gives one fresh iterator per epoch from a callable, a re-iterable or an iterator."""

    def __init__(self, data: Any, epochs: int):
        self._data = data
        single_use = isinstance(data, Iterator)
        if single_use and epochs > 1:
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


def _describe(tree: Any) -> dict[str, tuple]:
    return {
        jax.tree_util.keystr(p): tuple(np.shape(x))
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


class _BatchChecker:
    """Every batch of an epoch must look like the first (a short FINAL batch aside)."""

    def __init__(self, batch_size: int | None):
        self.batch_size = batch_size
        self.shapes: dict[str, tuple] | None = None
        self.treedef = None

    def leading_size(self, index: int, batch: Any) -> int:
        shapes = _describe(batch)
        treedef = jax.tree.structure(batch)
        sizes = {s[0] for s in shapes.values()}
        if len(sizes) != 1:
            raise ValueError(
                f"batch {index}: leaves disagree on the batch size: {shapes}. Every leaf "
                f"of a batch needs the same leading size."
            )
        size = sizes.pop()
        if self.shapes is None:
            if self.batch_size is not None and size != self.batch_size:
                raise ValueError(
                    f"batch {index} has {size} examples but batch_size={self.batch_size}; "
                    f"leave batch_size out to take the loader's own batch size."
                )
            self.shapes, self.treedef = shapes, treedef
            return size
        if treedef != self.treedef:
            raise ValueError(
                f"batch {index} has another structure than batch 0: {sorted(shapes)} vs "
                f"{sorted(self.shapes)}."
            )
        for path, shape in shapes.items():
            want = self.shapes[path]
            if shape[1:] != want[1:] or shape[0] > want[0]:
                raise ValueError(
                    f"batch {index}, leaf {path}: shape {shape} differs from batch 0's "
                    f"{want}. Every batch of an epoch must have the same shapes (only the "
                    f"final batch may be shorter)."
                )
        return size

    @property
    def full_size(self) -> int:
        assert self.shapes is not None
        return next(iter(self.shapes.values()))[0]


def _chunks(
    iterator: Iterator,
    *,
    steps_per_call: int,
    batch_size: int | None,
    keep_tail: bool,
    device: Any,
    acquire: Callable[[], None],
    on_dropped: Callable[[int], None],
) -> Iterator[Chunk]:
    """Pulls, checks, stacks and transfers chunks of ``steps_per_call`` batches."""
    checker = _BatchChecker(batch_size)
    index, pending = 0, []
    acquire()
    for raw in iterator:
        batch = to_numpy(raw, index=index)
        size = checker.leading_size(index, batch)
        if size < checker.full_size:
            extra = next(iterator, _END)
            if extra is not _END:
                raise ValueError(
                    f"batch {index} has {size} examples but earlier batches have "
                    f"{checker.full_size}; only the final batch of an epoch may be shorter."
                )
            if pending:
                yield Chunk(jax.device_put(_stack(pending), device), len(pending))
                acquire()
            if keep_tail:
                yield Chunk(jax.device_put(_stack([batch]), device), 1, tail=True)
            else:
                on_dropped(size)
            return
        pending.append(batch)
        index += 1
        if len(pending) == steps_per_call:
            yield Chunk(jax.device_put(_stack(pending), device), len(pending))
            pending = []
            acquire()
    if index == 0 and checker.shapes is None:
        raise ValueError("data is empty: the iterator yielded no batch this epoch.")
    if pending:
        yield Chunk(jax.device_put(_stack(pending), device), len(pending))


def _stack(batches: list) -> Any:
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


class _Stopped(Exception):
    pass


def stream_chunks(
    iterator: Iterator,
    *,
    steps_per_call: int,
    batch_size: int | None,
    keep_tail: bool,
    device: Any,
    prefetch: bool,
    on_dropped: Callable[[int], None],
) -> Iterator[Chunk]:
    """Yields the epoch's chunks; with ``prefetch`` a thread prepares them ahead.

    Resuming the generator means the previous chunk's call has finished, which frees its
    slot. Closing it (or an exception in the consumer) stops the thread.
    """
    options = dict(
        steps_per_call=steps_per_call,
        batch_size=batch_size,
        keep_tail=keep_tail,
        device=device,
        on_dropped=on_dropped,
    )
    if not prefetch:
        yield from _chunks(iterator, acquire=lambda: None, **options)
        return

    slots = threading.Semaphore(_SLOTS)
    stop = threading.Event()
    items: queue.Queue = queue.Queue()

    def acquire() -> None:
        while not slots.acquire(timeout=0.05):
            if stop.is_set():
                raise _Stopped

    def produce() -> None:
        try:
            for chunk in _chunks(iterator, acquire=acquire, **options):
                items.put(chunk)
            items.put(_END)
        except _Stopped:
            pass
        except BaseException as error:  # the iterator's own error goes to the trainer
            items.put(_Failure(error))

    thread = threading.Thread(target=produce, name="nnxscan-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = items.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
            slots.release()
    finally:
        stop.set()
        thread.join(timeout=5.0)
