"""A data set's next call gathered on the host while the current call trains (the CPU).

XLA:CPU runs one program at a time on a device, and a call that gathers its batches before
scanning them pays the gather inside the call: ~2.5 ms for a 16 MB epoch of the small MLP,
~10% of its 2,000 steps (docs/performance.md). A data loader's answer is to prepare the
next batches while the current ones train. On the CPU backend the device's memory is the
host's: a worker thread takes the next call's rows with numpy (``np.take`` of each leaf,
read through zero-copy views of the data set's arrays) and puts them on the device, on the
other core, while the main thread waits for the running call. The call then scans those
stacked batches, slicing one per step as a stream's chunk is sliced: the same rows, so
bitwise the same training as the gather inside the call.

Used only where it cannot cost: the CPU backend with at least two cores, one model on
one device (no mesh), the ``"scan"`` plan. A call's batches take at most
:data:`HOST_GATHER_BUDGET_BYTES`: a call the fit sizes itself (an epoch, or fused epochs)
is cut into calls of equal length that fit (``nnxscan.pure.batching.chunk_steps``: one
program); calls of the user's ``steps_per_call`` that do not fit gather inside the call,
in chunks, as everywhere else. At most two calls' batches exist at once (the one
training, the one prepared): 64 MiB.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from nnxscan.pure.batching import batch_bytes

#: The most bytes of batches one call gathered on the host takes. Larger than the core's
#: in-call budget (4 or 24 MiB, sized for XLA:CPU's cache and its allocator): here the
#: copy runs on another core while a call trains, and fewer, longer calls cost less host
#: work. Two such calls exist at once.
HOST_GATHER_BUDGET_BYTES = 32 * 1024 * 1024


def host_gather_applies(data: Any, *, one_model: bool, plan_kind: str, mesh: Any) -> bool:
    """Whether a fit over ``data`` prepares its calls' batches on the host (see module)."""
    if not one_model or plan_kind != "scan" or mesh is not None:
        return False
    if jax.default_backend() != "cpu" or _cores() < 2:
        return False
    for leaf in jax.tree.leaves(data):
        if not isinstance(leaf, jax.Array) or len(leaf.sharding.device_set) != 1:
            return False
        if not np.issubdtype(leaf.dtype, np.number) and leaf.dtype != np.bool_:
            return False  # extended dtypes (PRNG keys) have no numpy view
    return True


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class HostGather:
    """Gathers calls' batches of ``data`` (rows of a ``(steps, batch)`` index array) on a
    worker thread: ``submit(key, rows)`` starts one, ``take(key, rows)`` returns it (or
    gathers now when none was started for ``key``), ``close()`` drops what is pending.

    ``most_steps(batch_size)`` is the longest call gathered here (its batches within
    :data:`HOST_GATHER_BUDGET_BYTES`).
    """

    def __init__(self, data: Any, device: Any):
        self.device = device
        leaves, self.treedef = jax.tree.flatten(data)
        # Views of the device's buffers, not copies: on the CPU they are host memory.
        self._host = [np.asarray(leaf) for leaf in leaves]
        self._row_bytes = batch_bytes(data, 1)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: dict[Hashable, concurrent.futures.Future] = {}

    def most_steps(self, batch_size: int) -> int:
        return max(1, HOST_GATHER_BUDGET_BYTES // max(1, batch_size * self._row_bytes))

    def gather(self, rows: np.ndarray) -> Any:
        """The batches ``data[rows]``, shape ``(steps, batch, ...)``, on the device."""
        taken = [np.take(leaf, rows, axis=0) for leaf in self._host]
        return jax.device_put(jax.tree.unflatten(self.treedef, taken), self.device)

    def submit(self, key: Hashable, rows: Callable[[], np.ndarray]) -> None:
        """Starts gathering ``rows()`` (computed on the worker too) unless already started."""
        if key in self._pending:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="nnxscan-gather"
            )
        self._pending[key] = self._pool.submit(lambda: self.gather(rows()))

    def take(self, key: Hashable, rows: Callable[[], np.ndarray]) -> Any:
        """The batches started for ``key``, else ``rows()`` gathered now."""
        future = self._pending.pop(key, None)
        if future is None:
            return self.gather(rows())
        return future.result()

    def discard_except(self, keep: Hashable) -> None:
        """Drops every pending gather but ``keep``'s (a prediction that did not come true)."""
        for key in [k for k in self._pending if k != keep]:
            self._pending.pop(key).cancel()

    def close(self) -> None:
        """Drops what is pending; a gather already running finishes on its own."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
