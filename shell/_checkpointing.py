"""Checkpoints of a fit, for one model and for members alike: what is saved, and how a
restored one reaches the owner.

The orbax code lives in ``nnxscan.adapters.checkpoint`` and works on plain pytrees; the
owner (:class:`~nnxscan.shell._owner.Owner`) decides what a checkpoint holds, checks a
restored one and writes it back.
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


def writer(
    directory: str | os.PathLike[str], *, max_to_keep: int = 3, asynchronous: bool = True
) -> Any:
    """The one checkpoint writer of a fit (``adapters.checkpoint.CheckpointWriter``):
    saves return once the arrays are on the host and are written in the background."""
    return _adapter().CheckpointWriter(
        directory, max_to_keep=max_to_keep, asynchronous=asynchronous
    )


def save(
    owner: Owner, directory: str | os.PathLike[str], *, max_to_keep: int = 3, run: str = ""
) -> pathlib.Path:
    """Saves the owner's objects and counters now, durable on return (``save()``)."""
    with writer(directory, max_to_keep=max_to_keep, asynchronous=False) as synchronous:
        return save_with(synchronous, owner, run)


def save_with(
    checkpoints: Any, owner: Owner, run: str = "", carry: tuple | None = None
) -> pathlib.Path:
    """Saves the owner's objects and counters (and ``run``, the History so far as JSON) as
    checkpoint number ``owner.step`` through ``checkpoints`` (a ``CheckpointWriter``);
    ``carry`` is fit's ``(state, opt_state)`` when it was just written into the objects.

    Saving again at a step that already has a checkpoint keeps that one (e.g. ``save()``
    right after ``restore()``), unless a state was loaded into the owner since (e.g.
    EarlyStopping's best epoch): then it replaces it."""
    step = owner.step
    existing = checkpoints.newest_step() == step  # on disk or in flight; never waits
    if existing and not owner.loaded_since_checkpoint:
        return checkpoints.path / str(step)
    saved = checkpoints.save(step, owner.checkpoint_tree(run, carry), replace=existing)
    owner.loaded_since_checkpoint = False
    return saved


def restore(
    owner: Owner,
    placement: Placement,
    directory: str | os.PathLike[str],
    step: int | None,
    run_keys: dict[str, Any] | None = None,
) -> int:
    """Restores a checkpoint into the owner's objects and counters; returns the epoch.

    Everything is read and checked (against ``run_keys`` too, for a resumed fit) before the
    first object is written, so a failed restore changes nothing.
    """
    template = owner.checkpoint_tree()
    carry, treedef = jax.tree.flatten((template["state"], template["opt_state"]))
    # The model's CURRENT shardings (another mesh than the saved one's, too: elastic).
    shardings = placement.carry_shardings(template["state"], template["opt_state"])
    if shardings is not None:
        # On a mesh, orbax reads straight into the layout training uses (replicated,
        # FSDP, members over their axis), rather than onto one device of one process.
        abstract = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            for x, sh in zip(carry, shardings, strict=True)
        ]
        template["state"], template["opt_state"] = jax.tree.unflatten(treedef, abstract)
    try:
        tree, _ = _adapter().restore_checkpoint(directory, template, step=step)
    except ValueError as error:
        hint = getattr(owner, "restore_hint", "")
        if not hint:
            raise
        raise ValueError(f"{error} ({hint})") from None
    owner.restore(tree, run_keys)
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


def parse_run(text: str, members: int | None = None) -> tuple[History, np.ndarray]:
    """``(History, partial losses)`` back from :func:`run_json`'s text ("" gives empty):
    losses of shape ``(steps,)``, or ``(steps, N)`` for ``members``; logs that were arrays
    (per member, or a metric per class) are numpy arrays again."""
    shape = (-1,) if members is None else (-1, members)
    if not text:
        empty = np.zeros((0,), np.float32).reshape(shape)
        return History(empty), empty
    record = json.loads(text)
    epochs = [
        {k: np.asarray(v) if isinstance(v, list) else v for k, v in logs.items()}
        for logs in record["epochs"]
    ]
    losses = np.asarray(record["losses"], np.float32).reshape(shape)
    partial = np.asarray(record["partial"], np.float32).reshape(shape)
    history = History(losses, epochs)
    history.events = list(record.get("events", []))
    return history, partial


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)
