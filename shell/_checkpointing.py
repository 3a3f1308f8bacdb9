"""Trainer checkpoints: what is saved, and how a restored one reaches the user's objects.

The orbax code lives in ``nnxscan.adapters.checkpoint`` and works on plain pytrees; the
:class:`~nnxscan.shell._owner.Owner` decides what a checkpoint holds and writes a restored
one back.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any

import jax

from nnxscan.shell._owner import Owner
from nnxscan.shell._placement import Placement


def _adapter() -> Any:
    # Imported when first needed: orbax is heavy, and importing nnxscan must stay cheap.
    import nnxscan.adapters.checkpoint as checkpoint

    return checkpoint


def save(owner: Owner, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> pathlib.Path:
    """Saves the owner's objects and counters as checkpoint number ``owner.step``."""
    ckpt = _adapter()
    path = pathlib.Path(directory).resolve()
    step = owner.step
    existing = ckpt.latest_step(path) == step
    if existing and not owner.loaded_since_checkpoint:  # e.g. save() right after restore()
        return path / str(step)
    # A state loaded at the same step (EarlyStopping's best epoch) replaces the checkpoint.
    saved = ckpt.save_checkpoint(
        path, step, owner.checkpoint_tree(), max_to_keep=max_to_keep, replace=existing
    )
    owner.loaded_since_checkpoint = False
    return saved


def restore(
    owner: Owner, placement: Placement, directory: str | os.PathLike[str], step: int | None
) -> int:
    """Restores a checkpoint into the owner's objects and counters; returns the epoch.

    Everything is read and checked before the first object is written, so a failed restore
    changes nothing.
    """
    template = owner.checkpoint_tree()
    carry, treedef = jax.tree.flatten((template["state"], template["opt_state"]))
    shardings = placement.carry_shardings(carry)
    if shardings is not None:
        # On a mesh, orbax reads straight into the layout training uses (replicated or
        # FSDP), rather than onto one device of one process.
        abstract = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            for x, sh in zip(carry, shardings, strict=True)
        ]
        template["state"], template["opt_state"] = jax.tree.unflatten(treedef, abstract)
    tree, _ = _adapter().restore_checkpoint(directory, template, step=step)
    owner.restore(tree)
    return owner.epoch


class EpochCheckpointer:
    """The callback ``fit(checkpoint_dir=..., checkpoint_every=n)`` adds: ``trainer.save``."""

    def __init__(self, directory: str | os.PathLike[str], every: int):
        self.directory, self.every = pathlib.Path(directory).resolve(), every

    def on_epoch_end(self, trainer: Any, epoch: int, logs: dict) -> None:
        if (epoch + 1) % self.every == 0:
            trainer.save(self.directory)
