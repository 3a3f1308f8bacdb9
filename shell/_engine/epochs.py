"""Epoch sources: a schedule's stretch (``schedule.Stretch``: epochs, and which of their
steps) as compiled calls, for a data set, a step without data or a stream.

A source has ``steps_per_epoch`` (None: a stream's), ``keep_tail`` (whether an epoch ends
with a short batch), ``fused_steps`` (the most steps a fused stretch of its epochs should
take) and ``source(stretch, stats)``; the fit loop knows nothing else about the data. A
data set's orders are cut with the core's own primitive, so a loop of ``pure.make_epoch``
calls trains what ``fit`` trains.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from nnxscan.pure import epoch_order
from nnxscan.pure.batching import steps_per_gather
from nnxscan.shell._engine.calls import Call
from nnxscan.shell._engine.layout import ONE_MODEL, Layout
from nnxscan.shell._engine.plans import Plan
from nnxscan.shell._engine.schedule import FUSED_STEPS, Stretch
from nnxscan.shell._engine.streaming import BatchChecker, ChunkStream, EpochSource


class EpochStats:
    """What a stream's epoch reports while its calls run: ``ended()`` (it ran to its end, or
    handed out every chunk), and the examples it ``dropped``."""

    def __init__(self) -> None:
        self.ended: Callable[[], bool] = lambda: False
        self.dropped = 0

    def drop(self, count: int) -> None:
        self.dropped += count


@functools.cache
def _arange(length: int) -> np.ndarray:
    # One index array per chunk length, made once: a stream's chunk is indexed 0..K-1 (a
    # population's members share each row, or the row holds their batches). Made on the
    # host and placed by the caller: jnp.arange would compile a program of its own.
    steps = np.arange(length, dtype=np.int32)
    steps.flags.writeable = False  # cached: shared by every caller
    return steps


def kept_slots(stretch: Stretch, put: Callable[[Any], Any]) -> tuple[int, Any] | None:
    """``Call.kept`` of a stretch of fused epochs that save (its one call): how many end
    states it returns, and each epoch's slot (``put`` on the device; the spare slot for an
    epoch whose state is not kept). None when it keeps none."""
    if not stretch.held:
        return None
    assert len(stretch.calls) == 1 and stretch.skip == 0, "kept states need one whole call"
    count = len(stretch.held)
    slots = np.full(stretch.epochs, count, np.int32)
    slots[list(stretch.held)] = np.arange(count, dtype=np.int32)
    return count, put(slots)


class EpochOrders:
    """The epochs' orders (``epoch_order(seed, epoch, n)``), the next epoch's drawn AHEAD.

    Drawn when the fit loop asks for a call after a stretch's last one was dispatched: the
    device is busy with it, the host waits (see docs/performance.md). One per engine, so a
    loop of ``fit(epochs=1)`` calls gets them too. An order is the same whenever it is
    drawn: this changes when, never what. Only that epoch's orders are held (a new draw
    replaces them), none past ``AHEAD_MAX_ROWS`` indices; a stretch that stops early, or
    that ``max_steps`` cuts, draws nothing.
    """

    #: The most indices drawn ahead (64 MiB of int32): past that an unused order would cost
    #: the host noticeable memory and time.
    AHEAD_MAX_ROWS = 1 << 24

    def __init__(self) -> None:
        self._ahead: dict[tuple, np.ndarray] = {}

    def get(self, seed: int, epoch: int, n: int, shuffle: bool) -> np.ndarray:
        """``epoch_order(seed, epoch, n, shuffle=shuffle)``, the drawn-ahead one if held."""
        order = self._ahead.pop((seed, epoch, n, shuffle), None)
        if order is None:
            order = epoch_order(seed, epoch, n, shuffle=shuffle)
        return order

    def draw_ahead(self, seeds: tuple[int, ...], epoch: int, n: int, shuffle: bool) -> None:
        """Draws (and holds, in place of any held before) epoch ``epoch``'s order for each
        of ``seeds``. An unshuffled order is an ``arange``: nothing to gain."""
        keys = [(s, epoch, n, shuffle) for s in dict.fromkeys(seeds)]
        held, self._ahead = self._ahead, {}
        if shuffle and len(keys) * n <= self.AHEAD_MAX_ROWS:
            self._ahead = {k: held[k] if k in held else epoch_order(*k[:3]) for k in keys}


class ArrayEpochs:
    """The calls of one or more epochs over a device-resident data set.

    ``seeds`` holds one shuffle seed per model of the ``layout``: one model's (indices
    ``(steps, batch)``), or one per member (indices ``(steps, N, batch)``, member ``i`` in
    the order ``epoch_order(seeds[i], epoch, n)``). A stretch of several epochs FUSES them:
    their orders are joined along the steps axis, so the scan plan trains them in one
    compiled call (the same steps in the same order: bitwise what separate epochs train).

    ``put`` places the index arrays next to the data (replicated on a mesh). ``orders``
    (the engine's, so that they outlive this fit) draws each order; the next call's are
    drawn once this call's last compiled call is dispatched, and, when each epoch is a
    call of its own and the fit (ending before ``end_epoch``) has another, cut and placed
    then too.
    """

    def __init__(
        self,
        data: Any,
        put: Callable[[Any], Any],
        *,
        num_examples: int,
        batch_size: int,
        seeds: tuple[int, ...],
        shuffle: bool,
        keep_tail: bool,
        orders: EpochOrders | None = None,
        layout: Layout = ONE_MODEL,
        end_epoch: int | None = None,
    ):
        self.data, self.put, self.layout = data, put, layout
        self.end_epoch = end_epoch  # the fit's (None: unknown, max_steps decides)
        self.orders = EpochOrders() if orders is None else orders
        self.num_examples, self.batch_size = num_examples, batch_size
        self.seeds, self.shuffle, self.keep_tail = seeds, shuffle, keep_tail
        self.steps_per_epoch = num_examples // batch_size + keep_tail
        # The next epoch's orders, cut and placed while the device runs this stretch's last
        # call: (epoch, numpy orders, placed (full, tail)); see _place_ahead.
        self._ahead: tuple[int, list, Any] | None = None
        # Fused epochs gather their batches in one go where they fit one gather, so each
        # call is one loop; a shuffled order only (the stored order slices its batches).
        gathered = steps_per_gather(data, batch_size * len(seeds)) if shuffle else None
        self.fused_steps = min(FUSED_STEPS, gathered or FUSED_STEPS)

    #: The most indices (all members') placed ahead: a second order on the device for a
    #: while. Placing costs a short epoch's call ~0.1 ms on the CPU; a long one hides it.
    PLACE_AHEAD_MAX_ROWS = 1 << 20

    def _orders(self, epoch: int) -> list[np.ndarray]:
        if self._ahead is not None and self._ahead[0] == epoch:
            return self._ahead[1]
        n, shuffle = self.num_examples, self.shuffle
        # One draw per distinct seed (a population's shared_order: one for all).
        unique = {s: self.orders.get(s, epoch, n, shuffle) for s in dict.fromkeys(self.seeds)}
        return [unique[seed] for seed in self.seeds]

    def __call__(self, stretch: Stretch, stats: EpochStats | None = None) -> Iterator[Call]:
        yield from self._calls(stretch, self._orders)
        if stretch.steps == stretch.ends:  # the device is busy with the last call
            next_epoch = stretch.epoch + stretch.epochs
            self.orders.draw_ahead(self.seeds, next_epoch, self.num_examples, self.shuffle)
            if stretch.epochs == 1 and (self.end_epoch is None or next_epoch < self.end_epoch):
                self._place_ahead(next_epoch)  # epochs one call each, and one more to come

    def _place_ahead(self, epoch: int) -> None:
        """Cuts and places epoch ``epoch``'s orders now, for a next stretch of that one
        epoch from its first step (each epoch its own call: hooks, evaluation): placing an
        order is host time the call would otherwise wait for. The same arrays whenever
        placed: this changes when, never what."""
        self._ahead = None
        rows = self.num_examples * len(self.seeds)
        if not self.shuffle or rows > self.PLACE_AHEAD_MAX_ROWS:
            return
        orders = self._orders(epoch)
        cut = self.layout.cut(orders, self.batch_size, not self.keep_tail)
        self._ahead = (epoch, orders, self.put(cut))

    def placeholder_calls(self, stretch: Stretch) -> Iterator[Call]:
        """The stretch's calls as ``__call__`` makes them, but every epoch in the stored
        order: the same shapes and places, so the same programs (to compile them ahead)."""
        stored = np.arange(self.num_examples)
        return self._calls(stretch, lambda epoch: [stored] * len(self.seeds))

    def _calls(self, stretch: Stretch, orders: Callable[[int], list]) -> Iterator[Call]:
        ahead = self._ahead
        if (
            ahead is not None
            and orders == self._orders
            and (stretch.epoch, stretch.epochs, stretch.skip) == (ahead[0], 1, 0)
        ):
            self._ahead = None
            yield from self._yield_calls(stretch, *ahead[2], None)
            return
        # Any other stretch cuts its own (a fused one, a resumed epoch's rest); the orders
        # drawn ahead still serve it through _orders.
        fulls, tail, drop = [], None, not self.keep_tail
        for e in range(stretch.epoch, stretch.epoch + stretch.epochs):
            # The core's cut of the same orders make_epoch uses, steps first as it scans
            # them: a loop of make_epoch calls fed epoch_order(seed, e, n) trains exactly
            # what fit trains.
            full, tail = self.layout.cut(orders(e), self.batch_size, drop)
            fulls.append(full)
        full = fulls[0] if len(fulls) == 1 else np.concatenate(fulls)
        # The index holds every step of the stretch's epochs left, the budget's cut too: a
        # call's program depends on the index's length, not on where the budget ends.
        full = full[min(stretch.skip, full.shape[0]) :]
        rows = None
        if not self.shuffle:
            # The stored order: each step may slice its batch by number, gathering nothing.
            full, rows = self.layout.batch_numbers(full, self.batch_size)
        full, tail = self.put((full, tail))
        yield from self._yield_calls(stretch, full, tail, rows)

    def _yield_calls(self, stretch: Stretch, full: Any, tail: Any, rows: Any) -> Iterator[Call]:
        kept = kept_slots(stretch, self.put)
        for start, length in stretch.calls:
            if start < full.shape[0]:
                yield Call(self.data, full, start, length, rows=rows, kept=kept)
            else:  # the short batch: one step of its own shape, unrolled (no loop)
                yield Call(self.data, tail, 0, 1, unroll=True)


class StepEpochs:
    """The calls of epochs of a step that takes no data: ``steps_per_epoch`` steps each,
    every step's batch ``None`` (the step's ``opt_state`` carries what it samples from).

    The calls scan a ``(steps,)`` index that selects nothing (``data`` is None), one step
    per step of the stretch's epochs left (the budget's cut too, as a data set's).
    """

    keep_tail = False
    fused_steps = FUSED_STEPS

    def __init__(self, steps_per_epoch: int, put: Callable[[Any], Any]):
        self.steps_per_epoch = steps_per_epoch
        self._put = put
        self._indices = functools.cache(lambda length: put(_arange(length)))  # placed once

    def __call__(self, stretch: Stretch, stats: EpochStats | None = None) -> Iterator[Call]:
        indices = self._indices(stretch.ends)
        kept = kept_slots(stretch, self._put)
        for start, length in stretch.calls:
            yield Call(None, indices, start, length, kept=kept)


class StreamEpochs:
    """An epoch's calls over a stream: chunks of ``chunk_size`` batches, each trained in
    the plan's calls (one scan for ``"scan"``; calls of 4 unrolled steps for ``"unrolled"``).

    ``batch_lead`` is the layout's ``data_lead``: for members with their own batches,
    ``(N,)``: each batch has a leading members axis ``(N, batch, ...)``, member ``i`` trains
    on ``batch[i]`` and chunks are ``(K, N, batch, ...)``; else ``()``.

    After dispatching chunk ``i``'s calls it waits for chunk ``i - 1``'s to finish before
    asking for chunk ``i + 1``: one call runs, the next waits in the device queue, and the
    iterator is never more than two chunks ahead of the last finished call.
    """

    steps_per_epoch = None
    keep_tail = False
    fused_steps = FUSED_STEPS  # a stream's epochs are never fused

    def __init__(
        self,
        source: EpochSource,
        first_epoch: Iterator,
        plan: Plan,
        *,
        chunk_size: int,
        put: Callable[[Any], Any],
        batch_size: int | None,
        drop_remainder: bool,
        prefetch: bool,
        tail_divisor: int = 1,
        batch_lead: tuple[int, ...] = (),
    ):
        self.source, self.plan = source, plan
        self._pending = [first_epoch]
        # One checker for the whole fit: the step was traced on the first batch.
        self.checker = BatchChecker(batch_size, lead=batch_lead, hint=source.hint)
        self.options = dict(
            prefetch=prefetch, chunk_size=chunk_size, keep_tail=not drop_remainder, put=put,
            tail_divisor=tail_divisor,
        )  # fmt: skip

    def __call__(self, stretch: Stretch, stats: EpochStats) -> Iterator[Call]:
        batches = self._pending.pop() if self._pending else self.source.epoch()
        skip = stretch.skip
        left = float("inf") if stretch.steps is None else stretch.steps  # the budget's steps
        if skip:  # a resumed epoch: the batches trained before the interruption
            batches = itertools.islice(batches, skip, None)
        stream = ChunkStream(
            batches, checker=self.checker, epoch=stretch.epoch, on_dropped=stats.drop,
            resumed=bool(skip), **self.options,
        )  # fmt: skip
        stats.ended = stream.at_end
        previous: list | None = None
        try:
            for chunk in stream:
                sink: list = []
                for start, length in self.plan.chunks(chunk.steps):
                    if left < length:  # the budget ends before the epoch: so does the call
                        stats.ended = lambda: False
                        if left <= 0:
                            return
                    # The chunk's batches in order: no index (programs.chunk_runner).
                    yield Call(chunk.data, None, start, min(length, left), sink=sink)
                    left -= length
                if previous is not None:
                    jax.block_until_ready(previous)
                    stream.finished()
                previous = sink
            if left >= 0:  # every batch trained (the budget may end with the epoch)
                stats.ended = lambda: True
        finally:
            stream.close()


#: An epoch source (see the module's docstring).
Epochs = ArrayEpochs | StepEpochs | StreamEpochs
