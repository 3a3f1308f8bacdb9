"""A trained model from a checkpoint, for inference: no optimizer, no Trainer.

Flax's checkpointing guide restores a model into an abstract one (``nnx.eval_shape``), and
so does :func:`load_model`, from any checkpoint a ``Trainer`` (``fit`` with a
``checkpoint_dir``, or ``save``) or :func:`~nnxscan.adapters.checkpoint.save_checkpoint`
wrote: it reads the model state alone (the optimizer state and counters stay unread), checked
as every restore is (manifest, crc32s, shapes), and builds a new module from it. Flax's own
``ocp.StandardCheckpointer().restore(<checkpoint_dir>/<step>/state, abstract_state)`` reads
the same state from the checkpoint's ``state/`` item (the newest checkpoint of a run has
one) but checks nothing; ``load_model`` also checks that item, when there is one, holds
exactly the verified arrays, so a checkpoint it accepts is one Flax's restore loads as
saved, or cannot load at all (no item; see docs/checkpoints.md).
"""

from __future__ import annotations

import os

from flax import nnx

__all__ = ["load_model"]


def load_model(
    directory: str | os.PathLike[str], model: nnx.Module, *, step: int | None = None
) -> nnx.Module:
    """A new module holding the model state of a checkpoint in ``directory``.

    Args:
      directory: a checkpoint directory (``fit``'s ``checkpoint_dir``, ``Trainer.save``'s).
      model: the architecture: an abstract module (``nnx.eval_shape(lambda: Model(...))``,
        no memory spent on weights) or a concrete one; only read, never changed.
      step: the checkpoint to load; None: the newest good one (a damaged newer one is
        skipped with a warning).

    The checkpoint's ``state/`` item (what Flax's ``StandardCheckpointer`` restores,
    verifying nothing; written for the newest checkpoint of a run) is read too when there
    is one and must hold exactly the verified model state: a flipped bit there, another
    checkpoint's item or a symbolic link makes the checkpoint damaged.

    Returns:
      A new module: ``model``'s graph with the checkpoint's state (parameters, batch
      statistics, RNG state), every array on the default device.

    Raises:
      FileNotFoundError: no such directory or checkpoint.
      CorruptCheckpointError: (a ValueError) the checkpoint is damaged, its ``state/``
        item included (``step`` given), or every checkpoint is.
      ValueError: the checkpoint's model does not fit ``model`` (the first differing path
        and both shapes are named).

    Example:
      >>> abstract = nnx.eval_shape(lambda: MLP(nnx.Rngs(0)))
      >>> model = load_model("runs/ckpt", abstract)
      >>> model(x)
    """
    from nnxscan.adapters.checkpoint import restore_checkpoint

    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model must be an nnx.Module (abstract from nnx.eval_shape, or concrete), got "
            f"{type(model).__name__}."
        )
    graphdef, state = nnx.split(model)
    tree, _ = restore_checkpoint(
        directory, {"state": state}, step=step, fallback=step is None, check_item=True
    )
    return nnx.merge(graphdef, tree["state"])
