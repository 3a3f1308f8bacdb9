"""What the subprocess workers of the resume tests write: a run's final state, as numpy.

Imported by ``chaos_worker.py`` and ``distributed_resume_worker.py`` (run as scripts, so
this folder is on their ``sys.path``); not collected by pytest.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def _host(leaf: Any) -> np.ndarray:
    if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        if leaf.sharding.is_fully_replicated:
            leaf = leaf.addressable_shards[0].data  # the local copy is whole
        else:  # sharded over both processes' devices: the test's record needs it whole
            from jax.experimental import multihost_utils

            leaf = multihost_utils.process_allgather(leaf, tiled=True)
    return np.asarray(leaf)


def save_run(out: str, model: Any, trainer: Any, history: Any) -> None:
    """Every array of the model's state (RNG keys as their data) and of the optax state,
    the counters, and the History, into ``out`` (.npz). ``model`` is an ``nnx.Module`` or a
    (population's stacked) state. Losses are reductions XLA may fuse differently in calls
    of another length: tests compare them closely, the states bitwise.
    """
    arrays = {}
    state = nnx.state(model) if isinstance(model, nnx.Module) else model
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        arrays["state" + jax.tree_util.keystr(path)] = _host(leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.opt_state):
        arrays["opt_state" + jax.tree_util.keystr(path)] = _host(leaf)
    arrays["step"] = np.asarray(trainer.step)
    arrays["epoch"] = np.asarray(trainer.epoch)
    arrays["history_losses"] = np.asarray(history.losses)
    arrays["history_epochs"] = np.asarray([logs["epoch"] for logs in history.epochs])
    np.savez(out, **arrays)
