"""Edge to ``jax.distributed``: several processes training one model, JAX's own engine.

Each process runs the same program. After :func:`initialize`, ``jax.devices()`` lists the
devices of every process; a ``jax.sharding.Mesh`` over them makes ``Trainer(mesh=...)``
train data-parallel across processes, with XLA's collectives (gloo on the CPU) doing all
the communication. Each process feeds its own share of every batch (the shell assembles
the global batch with ``jax.make_array_from_process_local_data``); only process 0 shows
progress.
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["initialize", "is_primary"]


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    cpu_collectives: str = "gloo",
    **kwargs: Any,
) -> None:
    """Joins this process to a multi-process run (``jax.distributed.initialize``).

    On the CPU it first selects ``cpu_collectives`` (gloo), without which CPU devices of
    different processes cannot all-reduce. Call it once, before any other JAX call.

    Args:
      coordinator_address: ``"host:port"`` of process 0 (e.g. ``"127.0.0.1:12345"``).
      num_processes: how many processes take part.
      process_id: this process's index, 0 .. num_processes-1.
      cpu_collectives: the CPU collectives implementation (``"gloo"`` or ``"mpi"``).
      **kwargs: passed on to ``jax.distributed.initialize`` (e.g. ``local_device_ids``,
        ``initialization_timeout``).

    Example:
      >>> initialize("127.0.0.1:12345", num_processes=2, process_id=int(sys.argv[1]))
      >>> mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
      >>> Trainer(model, tx, loss_fn, mesh=mesh).fit(my_share_of_batches, epochs=3)
    """
    if cpu_collectives:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        **kwargs,
    )


def is_primary() -> bool:
    """Whether this is process 0, the one that prints progress and writes logs.

    Example:
      >>> if is_primary():
      ...     print(history.epochs[-1])
    """
    return jax.process_index() == 0
