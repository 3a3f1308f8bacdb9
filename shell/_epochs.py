"""One epoch as a sequence of compiled calls, for a data set of arrays or a stream.

``Trainer.fit`` runs every epoch the same way (``run_calls`` over an epoch's calls, one host
sync for the logs); this module builds those calls and reads the results.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from nnxscan.adapters.data import to_numpy
from nnxscan.pure import epoch_order
from nnxscan.pure.epoch import batches_from_order
from nnxscan.shell._calls import Call, plan_calls
from nnxscan.shell._placement import to_host
from nnxscan.shell._plans import Plan
from nnxscan.shell._streaming import BatchChecker, ChunkStream, EpochSource

_RESERVED_LOGS = frozenset(
    {
        "epoch",
        "loss",
        "steps",
        "steps_per_sec",
        "wall_time",
        "dropped_examples",
        "skipped_steps",
        "learning_rate",
    }
)


class EpochStats:
    """What one epoch's calls report back: completeness and dropped examples."""

    def __init__(self) -> None:
        self.expected_steps: int | None = None  # known for a data set
        self.exhausted = False  # a stream ran to its end
        self.at_end: Callable[[], bool] = lambda: False  # every chunk handed out
        self.dropped = 0

    def drop(self, count: int) -> None:
        self.dropped += count

    def complete(self, steps_done: int) -> bool:
        if self.expected_steps is not None:
            return steps_done == self.expected_steps
        return self.exhausted or self.at_end()


EpochCalls = Callable[[int, EpochStats], Iterator[Call]]


def with_steps_per_call(plan: Plan, steps_per_call: int | None) -> Plan:
    """The ``"scan"`` plan with calls of ``steps_per_call`` steps (a data set's epoch).

    The ``"unrolled"`` and ``"step"`` plans keep their own call size: unrolling 100 steps
    would take minutes to compile. ``Plan("unrolled", k)`` sets it.
    """
    if steps_per_call is None or plan.kind != "scan":
        return plan
    return plan._replace(steps_per_call=steps_per_call)


@functools.cache
def _arange(length: int) -> jax.Array:
    # One index vector per chunk length, made once: a stream's chunk is indexed 0..K-1.
    return jnp.arange(length, dtype=jnp.int32)


class ArrayEpochs:
    """The calls of one or more epochs over a device-resident data set.

    ``epochs(epoch, stats)`` yields epoch ``epoch``'s calls; ``epochs(epoch, stats,
    count=k)`` yields the calls of ``k`` consecutive epochs FUSED: their orders are joined
    into one index array, so the scan plan trains them in one compiled call (the same
    steps in the same order: bitwise what ``k`` separate epochs train). Fusing needs
    every epoch to have the same batch shape: not with a kept short final batch.

    ``put`` places the index arrays next to the data (replicated on a mesh).
    """

    def __init__(
        self,
        plan: Plan,
        data: Any,
        put: Callable[[Any], Any],
        *,
        num_examples: int,
        batch_size: int,
        seed: int,
        shuffle: bool,
        keep_tail: bool,
    ):
        self.plan, self.data, self.put = plan, data, put
        self.num_examples, self.batch_size = num_examples, batch_size
        self.seed, self.shuffle, self.keep_tail = seed, shuffle, keep_tail
        self.steps_per_epoch = num_examples // batch_size + keep_tail
        self.fusable = not keep_tail

    def calls(self, count: int = 1) -> int:
        """How many compiled calls ``count`` fused epochs take."""
        full_steps = count * (self.num_examples // self.batch_size)
        return len(self.plan.chunks(full_steps)) + self.keep_tail

    def __call__(
        self, epoch: int, stats: EpochStats, count: int = 1, skip: int = 0
    ) -> Iterator[Call]:
        """The calls of epochs ``epoch .. epoch + count - 1``, less their first ``skip``
        steps (trained before a resume)."""
        if count > 1 and not self.fusable:
            raise ValueError("epochs with a kept short batch cannot be fused")
        fulls, tail = [], None
        for e in range(epoch, epoch + count):
            # The same order and cut as pure.make_epoch: a loop of make_epoch calls fed
            # epoch_order(seed, e, n) trains exactly what fit trains.
            order = epoch_order(self.seed, e, self.num_examples, shuffle=self.shuffle)
            full, tail = batches_from_order(
                order, self.batch_size, drop_remainder=not self.keep_tail
            )
            fulls.append(full)
        full = fulls[0] if count == 1 else np.concatenate(fulls)
        if skip > len(full) + (tail is not None):
            raise ValueError(f"cannot skip {skip} steps of a {self.steps_per_epoch}-step epoch")
        if skip > len(full):  # every full batch and the tail were trained
            tail = None
        full = full[min(skip, len(full)) :]
        full, tail = self.put((full, None if tail is None else tail[None]))
        stats.expected_steps = count * self.steps_per_epoch - skip
        if full.shape[0]:
            yield from plan_calls(self.plan, self.data, full, full.shape[0])
        if tail is not None:
            yield Call(self.data, tail, 0, 1)


def peek_stream(source: EpochSource) -> tuple[Any, Iterator]:
    """The first epoch's first batch (as numpy), and that epoch's iterator with it put back.

    The plan depends on the step's jaxpr, and the chunk size on the batch's bytes: both
    need a batch before the stream starts.
    """
    first_epoch = source.epoch()
    first = next(first_epoch, None)
    if first is None:
        raise ValueError("data is empty: the iterator yielded no batch.")
    return to_numpy(first, index=0), itertools.chain([first], first_epoch)


def stream_epochs(
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
) -> EpochCalls:
    """An epoch's calls over a stream: chunks of ``chunk_size`` batches, each trained in
    the plan's calls (one scan for ``"scan"``; calls of 4 unrolled steps for ``"unrolled"``).

    After dispatching chunk ``i``'s calls it waits for chunk ``i - 1``'s to finish before
    asking for chunk ``i + 1``: one call runs, the next waits in the device queue, and the
    iterator is never more than two chunks ahead of the last finished call.
    """
    pending = [first_epoch]
    checker = BatchChecker(batch_size)  # one for the whole fit: the step was traced once

    def epoch_calls(epoch: int, stats: EpochStats, skip: int = 0) -> Iterator[Call]:
        batches = pending.pop() if pending else source.epoch()
        if skip:  # a resumed epoch: the batches trained before the interruption
            batches = itertools.islice(batches, skip, None)
        stream = ChunkStream(
            batches,
            prefetch=prefetch,
            chunk_size=chunk_size,
            checker=checker,
            epoch=epoch,
            keep_tail=not drop_remainder,
            put=put,
            tail_divisor=tail_divisor,
            on_dropped=stats.drop,
            resumed=bool(skip),
        )
        stats.at_end = stream.at_end
        previous: list | None = None
        try:
            for chunk in stream:
                sink: list = []
                for start, length in plan.chunks(chunk.steps):
                    yield Call(chunk.data, _arange(chunk.steps), start, length, sink)
                if previous is not None:
                    jax.block_until_ready(previous)
                    stream.finished()
                previous = sink
            stats.exhausted = True
        finally:
            stream.close()

    return epoch_calls


def learning_rate(opt_state: Any) -> float | None:
    """The current learning rate, when ``tx`` came from ``optax.inject_hyperparams``.

    ``inject_hyperparams`` keeps the hyperparameters in the optax state (the first such
    state found, e.g. inside an ``optax.chain``, is used); one host read per epoch.
    """
    is_injected = lambda x: hasattr(x, "hyperparams") and isinstance(x.hyperparams, dict)  # noqa: E731
    for node in jax.tree.leaves(opt_state, is_leaf=is_injected):
        if is_injected(node) and "learning_rate" in node.hyperparams:
            return float(to_host(node.hyperparams["learning_rate"]))
    return None


def _scalar_means(tree: Any) -> dict[str, float]:
    """Means over steps of every aux leaf that is a scalar per step, keyed by its path.

    A key that would shadow one of fit's own logs (``loss``, ``steps``...) gets ``aux/``.
    """
    logs = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if np.ndim(leaf) == 1:
            key = jax.tree_util.keystr(path, simple=True, separator="/") or "aux"
            logs[f"aux/{key}" if key in _RESERVED_LOGS else key] = float(np.mean(leaf))
    return logs


def host_outputs(outs: list[Any], start: float) -> tuple[Any, float]:
    """The calls' stacked outputs joined on the host, and the seconds since ``start``.

    One host transfer per epoch (or fused group of epochs): the only sync fit makes. The
    clock stops after it, so steps/s counts the work, not just its asynchronous dispatch.
    """
    outs = to_host(outs)
    wall_time = time.perf_counter() - start
    return jax.tree.map(lambda *xs: np.concatenate(xs), *outs), wall_time


def split_steps(stacked: Any, count: int) -> list[Any]:
    """``stacked`` outputs of ``count`` fused epochs of equal length, one per epoch."""
    return [jax.tree.map(lambda x, i=i: np.array_split(x, count)[i], stacked) for i in range(count)]


def epoch_logs(
    epoch: int,
    stacked: Any,
    wall_time: float,
    has_aux: bool,
    stats: EpochStats,
    skipping: bool = False,
) -> tuple[dict[str, Any], np.ndarray]:
    """The epoch's logs and its per-step losses, from its outputs on the host."""
    losses, aux = stacked if has_aux else (stacked, None)
    logs: dict[str, Any] = {"epoch": epoch, "loss": float(np.mean(losses))}
    if skipping:
        # A skipped step reports NaN: the loss is the mean over the steps that trained.
        finite = np.isfinite(losses)
        logs["loss"] = float(np.mean(losses[finite])) if finite.any() else float("nan")
        logs["skipped_steps"] = int(np.sum(~finite))
    if aux is not None:
        logs.update(_scalar_means(aux))
    steps = int(losses.shape[0])
    logs.update(steps=steps, steps_per_sec=steps / max(wall_time, 1e-9), wall_time=wall_time)
    if stats.dropped:
        logs["dropped_examples"] = stats.dropped
    return logs, losses
