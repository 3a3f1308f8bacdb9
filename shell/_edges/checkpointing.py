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
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from nnxscan.adapters import _checkpoint_files, _checkpoint_manifest, _log_values
from nnxscan.adapters._checkpoint_manifest import check_meta_ints
from nnxscan.shell._edges.logs import empty_history, empty_losses
from nnxscan.shell._edges.warn import warn
from nnxscan.shell.history import History

if TYPE_CHECKING:  # the engine's types only: the edges import nothing of the engine
    from nnxscan.shell._engine.layout import Layout
    from nnxscan.shell._engine.owner import Owner
    from nnxscan.shell._engine.placement import Placement


def _adapter() -> Any:
    # Imported when first needed: orbax is heavy, and importing nnxscan must stay cheap.
    import nnxscan.adapters.checkpoint as checkpoint

    return checkpoint


def open_checkpointer(
    directory: str | os.PathLike[str], *, max_to_keep: int = 3, asynchronous: bool = True
) -> Any:
    """The one checkpointer of a fit (``adapters.checkpoint.Checkpointer``):
    saves return once the arrays are on the host and are written in the background."""
    return _adapter().Checkpointer(directory, max_to_keep=max_to_keep, asynchronous=asynchronous)


def save(owner: Owner, directory: str | os.PathLike[str], *, max_to_keep: int = 3) -> pathlib.Path:
    """Saves the owner's objects and counters now, durable on return (``save()``)."""
    with open_checkpointer(directory, max_to_keep=max_to_keep, asynchronous=False) as synchronous:
        return save_with(synchronous, owner)


def save_with(
    checkpoints: Any,
    owner: Owner,
    run: str = "",
    carry: tuple | None = None,
    at: dict[str, int] | None = None,
) -> pathlib.Path:
    """Saves the owner's objects and counters (and ``run``, where the History so far is in
    the run log: :meth:`RunLog.record`) as checkpoint number ``owner.step``; ``carry`` is
    fit's ``(state, opt_state)`` when it was just written into the objects, or with ``at``
    (counters: ``epoch``, ``step``, ``epoch_step``) the state at an earlier epoch end of
    the run (a fused call's), saved as checkpoint ``at["step"]`` with those counters. A
    step that has a checkpoint keeps it (``save()`` right after ``restore()``), unless a
    state was loaded since (EarlyStopping's best epoch)."""
    step = owner.step if at is None else at["step"]
    existing = checkpoints.newest_step() == step  # on disk or in flight; never waits
    if existing and not owner.loaded_since_checkpoint:
        return checkpoints.path / str(step)
    tree = owner.checkpoint_tree(run, carry)
    if at is not None:
        tree["meta"] = {**tree["meta"], **at}
    saved = checkpoints.save(step, tree, replace=existing)
    owner.loaded_since_checkpoint = False
    return saved


def restore(
    owner: Owner, placement: Placement, directory: str | os.PathLike[str], step: int | None
) -> int:
    """Restores a checkpoint into the owner's objects and counters; returns the epoch."""
    template = _template(owner, placement)

    def read(at: int) -> dict[str, Any]:
        return _read(owner, directory, template, at)

    if step is None:
        tree, _, _ = _adapter().newest_good(directory, read)
    else:
        tree = _read_asked(read, step, "restore() without step=")
    owner.restore(tree)
    return owner.epoch


def resume(
    owner: Owner,
    placement: Placement,
    directory: pathlib.Path,
    run_keys: dict[str, Any],
    step: int | None = None,
) -> tuple[History, np.ndarray, dict[str, Any], dict[str, np.ndarray] | None]:
    """Restores the newest good checkpoint (or ``step``) for a resumed fit; returns its run's
    History, the partial losses of its unfinished epoch, where they are in the run log, and the
    unfinished epoch's scalar aux logs per step (see :meth:`RunLog.read`)."""
    template = _template(owner, placement)

    def read(at: int) -> tuple[dict[str, Any], Any]:
        tree = _read(owner, directory, template, at)
        return tree, RunLog.read(directory, tree["meta"]["run"], owner.layout)

    adapter = _adapter()
    if step is None:
        (tree, run), step, skipped = adapter.newest_good(directory, read, warn=warn)
    else:
        (tree, run), skipped = _read_asked(read, step, "fit(resume=True)"), {}
    owner.restore(tree, run_keys)
    for newer in (s for s in adapter.all_steps(directory) if s > step):
        reason = "nnxscan-corrupt" if newer in skipped else "nnxscan-superseded"
        moved = _checkpoint_files.set_aside(pathlib.Path(directory).resolve(), newer, reason)
        if reason == "nnxscan-superseded":
            warn(
                f"resumed from checkpoint {step} of {directory}; the newer checkpoint {newer} "
                f"was moved aside to {moved.name} (not deleted) so that this run's steps "
                f"follow {step}."
            )
    return run


def _read_asked(read: Any, step: int, fallback: str) -> Any:
    """``read(step)`` of the one checkpoint the user asked for: a damaged one is an error
    that says how to get the newest good one instead (nothing was skipped)."""
    corrupt = _adapter().CorruptCheckpointError
    try:
        return read(step)
    except corrupt as error:
        raise corrupt(
            f"{str(error).rstrip('.')}. Restore another checkpoint: {fallback} skips a "
            f"damaged one and restores the newest good one."
        ) from None


def _template(owner: Owner, placement: Placement) -> dict[str, Any]:
    """The owner's checkpoint tree as a template, placed as its state is now."""
    template = owner.checkpoint_tree()
    carry, treedef = jax.tree.flatten((template["state"], template["opt_state"]))
    # The model's CURRENT shardings (another mesh than the saved one's, too: elastic).
    shardings = placement.carry_shardings(template["state"], template["opt_state"])
    if shardings is not None:
        # On a mesh, orbax reads straight into the shardings training uses (replicated,
        # FSDP, members over their axis), rather than onto one device of one process.
        abstract = [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
            for x, sh in zip(carry, shardings, strict=True)
        ]
        template["state"], template["opt_state"] = jax.tree.unflatten(treedef, abstract)
    return template


def _read(
    owner: Owner, directory: str | os.PathLike[str], template: dict[str, Any], step: int
) -> dict[str, Any]:
    """Checkpoint ``step``'s tree, checked against the owner's template, its counters too
    (a negative or non-int one is a damaged or crafted checkpoint, skipped like one)."""
    try:
        tree, _ = _adapter().restore_checkpoint(directory, template, step=step)
    except ValueError as error:
        hint = owner.restore_hint
        if not hint or isinstance(error, _adapter().CorruptCheckpointError):
            raise
        raise ValueError(f"{error} ({hint})") from None
    where = f"checkpoint {pathlib.Path(directory).resolve()} step {step}"
    check_meta_ints(tree["meta"], where=where)
    return tree


#: A ``checkpoint_dir`` that is a file, or not writable: a ValueError, before training.
check_directory = _checkpoint_files.check_directory


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

    def __init__(self, checkpointer: Any):
        self.checkpointer = checkpointer
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
            self.start = self.checkpointer.append_log(b"")
            self.steps = self.epochs = self.logged_epochs = self.done = self.events = 0
            new_epochs, done, losses = self._since(history, partial)
        first = self.logged_epochs
        line = {
            # Where this line starts: a line read elsewhere was torn or interleaved.
            "at": self.checkpointer.append_log(b""),
            "losses": np.asarray(losses, np.float64).tolist(),
            "epochs": [
                _log_values.to_exact_json(logs, f"History.epochs[{first + i}]")
                for i, logs in enumerate(new_epochs)
            ],
            "events": _log_values.to_exact_json(
                history.events[self.events :], f"History.events[{self.events}:]"
            ),
        }
        if len(partial) and partial_aux:
            # Whole (not since the last line): a resume reads the last line's.
            line["partial_aux"] = {
                key: {"dtype": np.asarray(v).dtype.name, "values": np.asarray(v).tolist()}
                for key, v in partial_aux.items()
            }
        end = self.checkpointer.append_log(_checkpoint_manifest.dumps_checked(line) + b"\n")
        self.steps += len(losses)
        self.epochs, self.logged_epochs = len(epochs), self.logged_epochs + len(new_epochs)
        self.done, self.events = done, len(history.events)
        return json.dumps(
            {"log": LOG, "start": self.start, "end": end, "steps": self.steps,
             "epochs": self.logged_epochs, "events": self.events}
        )  # fmt: skip

    @staticmethod
    def check(epoch: int, logs: dict[str, Any]) -> None:
        """Raises TypeError, naming the key and its type, for an epoch log the run log
        cannot store exactly (checked each epoch, not only at the epochs that save)."""
        _log_values.to_exact_json(dict(logs), f"History.epochs[{epoch}]")

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
        directory: str | os.PathLike[str], text: str, layout: Layout
    ) -> tuple[History, np.ndarray, dict[str, Any], dict[str, np.ndarray] | None]:
        """``(History, partial losses, where, partial aux)`` of the run a checkpoint's meta ``text``
        names ("" gives an empty History), laid out as the owner's ``layout``: losses of shape
        ``(steps, *layout.shape)``, the History's ``num_members`` the layout's; logs that were
        arrays are numpy arrays again; the partial aux: the unfinished epoch's scalar aux logs per
        step, in their dtypes (None when the log did not keep them)."""
        if not text:
            return empty_history(layout), empty_losses(layout), {}, {}
        log = pathlib.Path(directory) / LOG
        where = _run_meta(text, log)
        if "log" not in where:  # written before the run log: the History inline
            history, partial = _inline_run(where, layout)
            return history, partial, {}, None if len(partial) else {}
        corrupt = _adapter().CorruptCheckpointError
        try:
            raw = _adapter().read_log(directory, where["start"], where["end"])
        except ValueError as error:
            raise corrupt(str(error)) from None
        losses, epochs, events, record = [], [], [], {}
        offset = where["start"]
        lines = raw.split(b"\n")
        if lines[-1]:
            raise corrupt(f"the run log {log} ends mid-line at byte {where['end']} (torn)")
        for line in lines[:-1]:
            try:
                record, checked = _checkpoint_manifest.loads_checked(line)
                if checked and record.get("at") != offset:
                    raise corrupt(
                        f"the run log {log} has a line written for byte {record.get('at')} at "
                        f"byte {offset}: lines of two runs are interleaved (two runs wrote "
                        f"one directory)"
                    )
                losses += list(record["losses"])
                if checked:
                    epochs += _log_values.from_exact_json(record["epochs"])
                    events += _log_values.from_exact_json(record["events"])
                else:  # written before exact values: arrays were lists
                    epochs += _legacy_epochs(record["epochs"])
                    events += record["events"]
            except (KeyError, TypeError, ValueError, AttributeError) as error:
                if isinstance(error, corrupt):
                    raise
                raise corrupt(
                    f"the run log {log} has a damaged line at byte {offset}: {error}"
                ) from None
            offset += len(line) + 1
        counts = (len(losses), len(epochs), len(events))
        if counts != (where["steps"], where["epochs"], where["events"]):
            raise corrupt(
                f"the run log {log} holds {counts} (steps, epochs, events) where the "
                f"checkpoint recorded {where['steps']}, {where['epochs']} and "
                f"{where['events']}: the log was changed; restore() the checkpoint and fit "
                f"without resume=True to go on without the History."
            )
        try:
            history, partial = _history(losses, epochs, events, layout)
        except (TypeError, ValueError) as error:
            raise corrupt(f"the run log {log} holds losses that are not numbers: {error}") from None
        return history, partial, where, _partial_aux(record, len(partial))

    def resumed(self, history: History, partial: np.ndarray, where: dict[str, Any]) -> None:
        """The fit goes on from a restored checkpoint: its lines are this fit's so far, and
        what a killed process appended after them is cut off."""
        if not where:
            return  # nothing logged (an old checkpoint, or a save() outside fit)
        self.checkpointer.truncate_log(where["end"])
        self.start, self.steps = where["start"], where["steps"]
        self.epochs = self.logged_epochs = len(history.epochs)
        self.done, self.events = len(history.losses), len(history.events)


def _run_meta(text: str, log: pathlib.Path) -> dict[str, Any]:
    """A checkpoint's record of where its run is in the log, checked: counts, not garbage."""
    corrupt = _adapter().CorruptCheckpointError
    try:
        where = json.loads(text)
    except (TypeError, json.JSONDecodeError):
        raise corrupt(f"a checkpoint's record of its run in {log} is not JSON") from None
    if not isinstance(where, dict):
        raise corrupt(f"a checkpoint's record of its run in {log} is not a mapping")
    if "log" in where:
        names = ("start", "end", "steps", "epochs", "events")
        bad = [n for n in names if not _count(where.get(n))]
        if bad or where["start"] > where["end"]:
            raise corrupt(
                f"a checkpoint's record of its run in {log} has no valid byte range and "
                f"counts ({bad[0] if bad else 'start > end'})"
            )
    return where


def _legacy_epochs(epochs: list) -> list:
    """Epoch logs of a run log written before exact values: arrays as lists."""
    return [
        {k: np.asarray(v) if isinstance(v, list) else v for k, v in logs.items()} for logs in epochs
    ]


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _history(
    losses: list, epochs: list, events: list, layout: Layout
) -> tuple[History, np.ndarray]:
    """The History of logged epochs (the first steps' losses) and the partial losses after."""
    done = sum(int(logs.get("steps", 0)) for logs in epochs)
    losses = np.asarray(losses, np.float32).reshape(-1, *layout.shape)
    history = History(losses[:done], epochs, list(events), layout.num_members)
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
    aux = {
        key: np.asarray(v["values"], jax.numpy.dtype(v["dtype"]))
        for key, v in saved.items()
        if v.get("dtype") in _checkpoint_manifest.DTYPES
    }
    if len(aux) != len(saved):
        return None  # a dtype nnxscan never writes: the epoch's aux covers the steps after
    return aux if all(len(v) == steps for v in aux.values()) else None


def _inline_run(record: dict[str, Any], layout: Layout) -> tuple[History, np.ndarray]:
    shape = (-1, *layout.shape)
    losses = np.asarray(record["losses"], np.float32).reshape(shape)
    partial = np.asarray(record["partial"], np.float32).reshape(shape)
    history, _ = _history([], _legacy_epochs(record["epochs"]), record.get("events", []), layout)
    history.losses = losses
    return history, partial
