"""Trainer checkpoints: what is saved, and how a restored one reaches the user's objects.

The orbax code lives in ``nnxscan.adapters.checkpoint`` and works on plain pytrees; the
:class:`~nnxscan.shell._owner.Owner` decides what a checkpoint holds and writes a restored
one back.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import numpy as np

from nnxscan.shell._owner import Owner
from nnxscan.shell._placement import Placement
from nnxscan.shell.history import History


def _adapter() -> Any:
    # Imported when first needed: orbax is heavy, and importing nnxscan must stay cheap.
    import nnxscan.adapters.checkpoint as checkpoint

    return checkpoint


def save(
    owner: Owner, directory: str | os.PathLike[str], *, max_to_keep: int = 3, run: str = ""
) -> pathlib.Path:
    """Saves the owner's objects and counters (and ``run``, the History so far as JSON) as
    checkpoint number ``owner.step``."""
    ckpt = _adapter()
    path = pathlib.Path(directory).resolve()
    step = owner.step
    existing = ckpt.latest_step(path) == step
    if existing and not owner.loaded_since_checkpoint:  # e.g. save() right after restore()
        return path / str(step)
    # A state loaded at the same step (EarlyStopping's best epoch) replaces the checkpoint.
    saved = ckpt.save_checkpoint(
        path, step, owner.checkpoint_tree(run), max_to_keep=max_to_keep, replace=existing
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
    adapter = _adapter()
    try:
        tree, _ = adapter.restore_checkpoint(directory, template, step=step)
    except ValueError as error:
        # A checkpoint written by nnxscan 0.1 has no epoch_step and run in its meta.
        old = dict(template, meta={k: template["meta"][k] for k in ("epoch", "step", "seed")})
        try:
            tree, _ = adapter.restore_checkpoint(directory, old, step=step)
        except ValueError:
            raise error from None
    owner.restore(tree)
    return owner.epoch


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest checkpoint's step in ``directory``, or None (no checkpoint, no folder)."""
    return _adapter().latest_step(pathlib.Path(directory).resolve())


def run_json(history: History, partial: np.ndarray) -> str:
    """The run so far as JSON, for a checkpoint: the completed epochs' logs and losses, and
    the losses of the unfinished epoch's trained steps."""
    epochs = [logs for logs in history.epochs if not logs.get("stopped")]
    done = sum(int(logs.get("steps", 0)) for logs in epochs)
    record = {
        "epochs": epochs,
        "losses": np.asarray(history.losses[:done], np.float64).tolist(),
        "partial": np.asarray(partial, np.float64).tolist(),
        "events": history.events,
    }
    return json.dumps(record, default=_plain)


def parse_run(text: str) -> tuple[History, np.ndarray]:
    """``(History, partial losses)`` back from :func:`run_json`'s text ("" gives empty)."""
    if not text:
        return History(), np.zeros((0,), np.float32)
    record = json.loads(text)
    history = History(np.asarray(record["losses"], np.float32), list(record["epochs"]))
    history.events = list(record.get("events", []))  # older checkpoints hold none
    return history, np.asarray(record["partial"], np.float32)


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)
