"""Checkpoints of a fit, for one model and for members alike: what is saved, and how a
restored one reaches the owner.

The orbax code lives in ``nnxscan.adapters.checkpoint`` and works on plain pytrees; the
owner (:class:`~nnxscan.shell._engine.owner.Owner`) decides what a checkpoint holds, checks a
restored one and writes it back.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax
import numpy as np

from nnxscan.shell._engine.owner import Owner
from nnxscan.shell._engine.placement import Placement
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
    """Saves the owner's objects and counters (and ``run``, where the History so far is in
    the run log: :meth:`RunLog.record`) as
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
    owner.restore(_read(owner, placement, directory, step), run_keys)
    return owner.epoch


def resume(
    owner: Owner, placement: Placement, directory: pathlib.Path, run_keys: dict[str, Any]
) -> tuple[History, np.ndarray, dict[str, Any], dict[str, np.ndarray] | None]:
    """Restores the latest checkpoint for a resumed fit; returns its run's History, the
    partial losses of its unfinished epoch, where they are in the run log, and the
    unfinished epoch's scalar aux logs per step (see :meth:`RunLog.read`). The History is
    read before the first object is written: a log that does not hold it raises and
    changes nothing."""
    tree = _read(owner, placement, directory, None)
    run = RunLog.read(directory, tree["meta"]["run"], owner.num_members)
    owner.restore(tree, run_keys)
    return run


def _read(
    owner: Owner, placement: Placement, directory: str | os.PathLike[str], step: int | None
) -> dict[str, Any]:
    """A checkpoint's tree, checked against the owner's and placed as its state is."""
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
    return tree


def latest_step(directory: str | os.PathLike[str]) -> int | None:
    """The newest checkpoint's step in ``directory``, or None (no checkpoint, no folder)."""
    return _adapter().latest_step(pathlib.Path(directory).resolve())


LOG = "history.jsonl"  # the run log's name (adapters/_checkpoint_files.py writes it)


class RunLog:
    """A fit's History in the checkpoint directory's run log (``history.jsonl``).

    Each save appends one JSON line of what the History gained since the last save: the
    new steps' losses (those of the unfinished epoch too), the new epochs' logs and the
    new events; a save inside an epoch adds that epoch's scalar aux logs per step so far
    (at most an epoch's worth), so a resume logs the epoch's aux over all its steps. The
    checkpoint itself records only where the fit's lines are in the log (:meth:`record`'s
    small JSON): a save costs the same at epoch 10 and epoch 10,000.
    A resume reads the lines back (:meth:`read`), cuts off what a killed process appended
    after the restored checkpoint, and appends after them (:meth:`resumed`).
    """

    def __init__(self, writer: Any):
        self.writer = writer
        self.start: int | None = None  # where this fit's lines start in the log
        self.steps = 0  # losses logged: the completed epochs', then the unfinished one's
        self.epochs = 0  # epochs of the History looked at (logged, unless stopped)
        self.logged_epochs = 0  # of them, logged (a stopped epoch is not)
        self.done = 0  # the steps of the logged epochs
        self.events = 0

    def record(
        self,
        history: History,
        partial: np.ndarray,
        partial_aux: dict[str, np.ndarray] | None = None,
    ) -> str:
        """Appends what ``history`` (and ``partial``, the losses of the unfinished epoch's
        trained steps, with ``partial_aux``, their scalar aux logs) gained since the last
        call; returns the run's meta for the checkpoint saved next."""
        epochs = history.epochs
        fresh = self.start is None or len(epochs) < self.epochs
        fresh = fresh or len(history.events) < self.events
        if not fresh:
            new_epochs, done, losses = self._since(history, partial)
            fresh = losses is None
        if fresh:  # the first save of this fit (or a History that shrank): lines anew
            self.start = self.writer.append_log(b"")
            self.steps = self.epochs = self.logged_epochs = self.done = self.events = 0
            new_epochs, done, losses = self._since(history, partial)
        line = {
            "losses": np.asarray(losses, np.float64).tolist(),
            "epochs": new_epochs,
            "events": history.events[self.events :],
        }
        if len(partial) and partial_aux:
            # Whole (not since the last line): a resume reads the last line's.
            line["partial_aux"] = {
                key: {"dtype": np.asarray(v).dtype.name, "values": np.asarray(v).tolist()}
                for key, v in partial_aux.items()
            }
        end = self.writer.append_log((json.dumps(line, default=_plain) + "\n").encode())
        self.steps += len(losses)
        self.epochs, self.logged_epochs = len(epochs), self.logged_epochs + len(new_epochs)
        self.done, self.events = done, len(history.events)
        return json.dumps(
            {"log": LOG, "start": self.start, "end": end, "steps": self.steps,
             "epochs": self.logged_epochs, "events": self.events}
        )  # fmt: skip

    def _since(self, history: History, partial: np.ndarray) -> tuple[list, int, Any]:
        """The epochs completed since the last record, the steps of all logged epochs,
        and the losses to log: the completed epochs', then the unfinished epoch's
        (``partial``, or a stopped epoch's: the History's last steps). They only ever grow;
        None when fewer than were logged (the History was changed)."""
        new_epochs = [logs for logs in history.epochs[self.epochs :] if not logs.get("stopped")]
        done = self.done + sum(int(logs.get("steps", 0)) for logs in new_epochs)
        total = done + len(partial) if len(partial) else len(history.losses)
        if total < self.steps or len(history.losses) < done:
            return new_epochs, done, None
        if len(partial):
            tail = partial[max(self.steps - done, 0) :]
            losses = np.concatenate([history.losses[self.steps : done], tail])
        else:
            losses = history.losses[self.steps :]
        return new_epochs, done, losses

    @staticmethod
    def read(
        directory: str | os.PathLike[str], text: str, members: int | None = None
    ) -> tuple[History, np.ndarray, dict[str, Any], dict[str, np.ndarray] | None]:
        """``(History, partial losses, where, partial aux)`` of the run a checkpoint's meta
        ``text`` names ("" gives an empty History): losses of shape ``(steps,)``, or
        ``(steps, N)`` for ``members``; logs that were arrays are numpy arrays again; the
        partial aux: the unfinished epoch's scalar aux logs per step, in their dtypes
        (None when the log did not keep them). Only reads: a log missing or not holding
        what the checkpoint recorded raises ValueError."""
        shape = (-1,) if members is None else (-1, members)
        if not text:
            empty = np.zeros((0,), np.float32).reshape(shape)
            return History(empty), empty, {}, {}
        where = json.loads(text)
        if "log" not in where:  # written before the run log: the History inline
            history, partial = _inline_run(where, shape)
            return history, partial, {}, None if len(partial) else {}
        raw = _adapter().read_log(directory, where["start"], where["end"])
        losses, epochs, events, record = [], [], [], {}
        for line in raw.decode().splitlines():
            record = json.loads(line)
            losses += record["losses"]
            epochs += record["epochs"]
            events += record["events"]
        counts = (len(losses), len(epochs), len(events))
        if counts != (where["steps"], where["epochs"], where["events"]):
            raise ValueError(
                f"the run log {pathlib.Path(directory) / LOG} holds {counts} (steps, epochs, "
                f"events) where the checkpoint recorded {where['steps']}, {where['epochs']} "
                f"and {where['events']}: the log was changed; restore() the checkpoint and "
                f"fit without resume=True to go on without the History."
            )
        history, partial = _history(losses, epochs, events, shape)
        return history, partial, where, _partial_aux(record, len(partial))

    def resumed(self, history: History, partial: np.ndarray, where: dict[str, Any]) -> None:
        """The fit goes on from a restored checkpoint: its lines are this fit's so far, and
        what a killed process appended after them is cut off."""
        if not where:
            return  # nothing logged (an old checkpoint, or a save() outside fit)
        self.writer.truncate_log(where["end"])
        self.start, self.steps = where["start"], where["steps"]
        self.epochs = self.logged_epochs = len(history.epochs)
        self.done, self.events = len(history.losses), len(history.events)


def _history(losses: list, epochs: list, events: list, shape: tuple) -> tuple[History, np.ndarray]:
    """The History of logged epochs (the first steps' losses) and the partial losses after."""
    epochs = [
        {k: np.asarray(v) if isinstance(v, list) else v for k, v in logs.items()} for logs in epochs
    ]
    done = sum(int(logs.get("steps", 0)) for logs in epochs)
    losses = np.asarray(losses, np.float32).reshape(shape)
    history = History(losses[:done], epochs)
    history.events = list(events)
    return history, losses[done:]


def _partial_aux(record: dict[str, Any], steps: int) -> dict[str, np.ndarray] | None:
    """The unfinished epoch's scalar aux logs per step, from the log's last line (the
    restored checkpoint's): ``{}`` when no step of it was trained, None when that line does
    not hold them for every one of its ``steps`` steps (written without them)."""
    if not steps:
        return {}
    saved = record.get("partial_aux")
    if not saved:
        return None
    aux = {key: np.asarray(v["values"], jax.numpy.dtype(v["dtype"])) for key, v in saved.items()}
    return aux if all(len(v) == steps for v in aux.values()) else None


def _inline_run(record: dict[str, Any], shape: tuple) -> tuple[History, np.ndarray]:
    losses = np.asarray(record["losses"], np.float32).reshape(shape)
    partial = np.asarray(record["partial"], np.float32).reshape(shape)
    history, _ = _history([], record["epochs"], record.get("events", []), shape)
    history.losses = losses
    return history, partial


def _plain(value: Any) -> Any:
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)
