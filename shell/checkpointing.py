"""Trainer checkpoints: what is saved, how it is restored, and the per-epoch callback.

The orbax code lives in ``nnxscan.adapters.checkpoint`` and works on plain pytrees; this
module decides what a Trainer's checkpoint holds and writes a restored one back into the
user's objects with ``nnx.update``.
"""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.adapters.nnx_optimizer import optimizer_state_update

if TYPE_CHECKING:
    from nnxscan.shell.trainer import Trainer

__all__ = ["EpochCheckpointer", "restore_trainer", "save_trainer"]


def _adapter() -> Any:
    # Imported when first needed: orbax is heavy, and importing nnxscan must stay cheap.
    import nnxscan.adapters.checkpoint as checkpoint

    return checkpoint


def _tree(trainer: Trainer) -> dict[str, Any]:
    meta = {"epoch": trainer.epoch, "step": trainer.step, "seed": trainer.seed}
    return {"state": nnx.state(trainer.model), "opt_state": trainer.opt_state, "meta": meta}


def save_trainer(
    trainer: Trainer, directory: str | os.PathLike[str], *, max_to_keep: int = 3
) -> pathlib.Path:
    """Saves ``trainer``'s state, optax state, counters and seed as checkpoint ``step``.

    Example:
      >>> save_trainer(trainer, "/tmp/run")
      PosixPath('/tmp/run/16')
    """
    ckpt = _adapter()
    path = pathlib.Path(directory).resolve()
    if ckpt.latest_step(path) == trainer.step:  # e.g. save() right after restore()
        return path / str(trainer.step)
    return ckpt.save_checkpoint(path, trainer.step, _tree(trainer), max_to_keep=max_to_keep)


def restore_trainer(
    trainer: Trainer, directory: str | os.PathLike[str], step: int | None = None
) -> int:
    """Restores a checkpoint into ``trainer``'s model, optimizer and counters; the epoch.

    Everything is read and checked before the first object is written, so a failed restore
    changes nothing.

    Example:
      >>> restore_trainer(trainer, "/tmp/run")
      2
    """
    template = _tree(trainer)
    shardings = trainer._placement.carry_shardings(
        jax.tree.leaves((template["state"], template["opt_state"]))
    )
    if shardings is not None:
        # On a mesh, orbax reads straight into the layout training uses (replicated or
        # FSDP), rather than onto one device of one process.
        carry, treedef = jax.tree.flatten((template["state"], template["opt_state"]))
        abstract = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            for x, sh in zip(carry, shardings, strict=True)
        ]
        template["state"], template["opt_state"] = jax.tree.unflatten(treedef, abstract)
    tree, _ = _adapter().restore_checkpoint(directory, template, step=step)
    meta = tree["meta"]
    for name in ("epoch", "step", "seed"):
        if not isinstance(meta[name], int):
            raise ValueError(f"checkpoint meta {name}={meta[name]!r} is not an int.")
    update = None
    if trainer.optimizer is not None:
        new_step = jnp.asarray(meta["step"], jnp.uint32)
        update = optimizer_state_update(trainer.optimizer, tree["opt_state"], new_step)
    nnx.update(trainer.model, tree["state"])
    if update is None:
        trainer._opt_state = tree["opt_state"]
    else:
        nnx.update(trainer.optimizer, update)
    trainer.epoch, trainer.step, trainer.seed = meta["epoch"], meta["step"], meta["seed"]
    return trainer.epoch


class EpochCheckpointer:
    """The callback ``fit(checkpoint_dir=..., checkpoint_every=n)`` adds."""

    def __init__(self, directory: str | os.PathLike[str], every: int):
        self.directory, self.every = pathlib.Path(directory).resolve(), every

    def on_epoch_end(self, trainer: Trainer, epoch: int, logs: dict) -> None:
        if (epoch + 1) % self.every == 0:
            save_trainer(trainer, self.directory)
