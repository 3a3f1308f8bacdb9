"""``fit``'s options: declared, documented, defaulted and checked once, for every front-end.

``Trainer.fit`` and ``Population.fit`` take the same options (``**options:
Unpack[FitArguments]``) besides what only one of them has (a Trainer's ``seed``, a
Population's ``shared_order`` and ``member_batches``). A new option is one entry in
:class:`FitArguments` and :data:`FIT_DEFAULTS`, its check in :func:`fit_options`, and its
use in the engine.
"""

from __future__ import annotations

import difflib
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, TypedDict

from flax import nnx

from nnxscan.pure.checks import check_count
from nnxscan.shell._engine.evaluation import fit_evaluation
from nnxscan.shell._engine.layout import DataKind
from nnxscan.shell._engine.streaming import is_stream


class FitArguments(TypedDict, total=False):
    """The options of ``Trainer.fit`` and ``Population.fit`` (all keyword-only, all optional).

    Attributes:
      batch_size: examples per step. Required for a data set; for a stream it may be left
        out (the batches carry their size), and when given every batch must have it.
      steps_per_epoch: with ``data=None``, the steps of one epoch of a step that takes no
        batch (its ``update`` receives ``batch=None``: an environment, a sampler or a
        generator lives in its ``opt_state``). Epochs then only name chunks of steps
        for logs, callbacks, evaluation and checkpoints.
      shuffle: permute a data set's examples each epoch (default True); False keeps their
        stored order, and each step of one model then slices its batch from the data set
        (nothing is gathered: a data set already in the order you want trains at the
        speed of a scan over stacked batches; a population still gathers).
      callbacks: objects with any of ``on_train_begin(trainer)``,
        ``on_epoch_begin(trainer, epoch)``, ``on_call_end(trainer, logs)``,
        ``on_epoch_end(trainer, epoch, logs)``, ``on_train_end(trainer, history)`` (see
        :mod:`nnxscan.shell.callbacks`). Setting ``trainer.stop_training = True`` in one
        ends ``fit`` after the current compiled call.
      progress: show a progress bar that advances once per compiled call (default True);
        off a terminal, one line per epoch.
      progress_logs: which of the step's scalar logs (its aux leaves that are a scalar per
        step, by their log names) the progress line shows after the loss, in this order:
        each call's mean on the bar, the epoch's on a plain line. None (the default): all
        of them, as many as fit the line. A name the step does not report is warned about
        once, at the first call.
      steps_per_call: steps per compiled call of the ``"scan"`` plan (default: the whole
        epoch for a data set); for a stream, the batches stacked per chunk (default 100,
        fewer if that passes 256 MiB). The ``"unrolled"`` plan keeps its own call size (4).
        A shorter final chunk compiles once, then is reused.
      drop_remainder: drop the final short batch (default True): for a data set the
        ``num_examples % batch_size`` examples each permutation leaves over (a new
        permutation each epoch, so none is left out for good); for a stream its short last
        batch, with a one-line warning giving the count. ``False`` trains on it as one more
        step of its own size (one extra compile, cached).
      prefetch: prepare a stream's next chunk in a background thread (default True).
      checkpoint_dir: save a checkpoint here every ``checkpoint_every`` epochs, counted by
        the global epoch index, and once the last epoch is trained (a rerun with
        ``resume=True`` then trains nothing). Epochs that nothing else needs the host
        between (no epoch or call hooks, ...: docs/performance.md) still fuse into one
        compiled call, which returns the states of the epochs whose checkpoints stay
        (bitwise what one call an epoch saves; docs/checkpoints.md).
      checkpoint_every: epochs between checkpoints (default 1).
      checkpoint_every_steps: also save every this many global steps, at the first
        compiled-call boundary at or after each multiple (the scan plan then runs calls of
        at most this many steps, and epochs never fuse).
      checkpoint_async: a save returns once the arrays are copied to the host and is
        written to disk in the background while training goes on (default True; the next
        save, the end of ``fit``, a preemption and any exception wait for it, so every
        checkpoint is on disk when ``fit`` returns or raises; a SIGKILL loses what is not
        yet renamed into place: docs/checkpoints.md). ``False``: each save is on disk
        before the next compiled call starts.
      resume: with a ``checkpoint_dir``, ``epochs`` counts the WHOLE run: if the directory
        holds a checkpoint, restore it (the History so far included) and train only what
        remains, finishing a partly trained epoch first; with none, train from the start.
        Rerunning the same command after a kill or a preemption gives bitwise the model an
        uninterrupted run gives. A damaged newest checkpoint (a crc32 that does not match,
        a truncated or deleted file, a torn run log) is skipped with a warning and moved
        aside to ``<step>.nnxscan-corrupt`` (never deleted); the newest good one is
        restored. ``resume=<step>`` (an int) resumes from that checkpoint instead; newer
        ones are moved aside to ``<step>.nnxscan-superseded``.
      max_steps: train at most this many steps (with ``resume``, of the whole run, as
        ``epochs`` counts): ``fit`` ends mid-epoch once they are trained, with the partial
        epoch logged as ``stopped`` and its place kept, so a later ``fit`` (or a resume)
        goes on inside it. ``fit(data, max_steps=K)`` alone trains K steps over as many
        epochs as they take (a data set, or a step without data; a stream needs
        ``epochs`` too); with ``epochs`` too, whichever ends first.
      eval_data, metric_fn, eval_every, eval_batch_size: every ``eval_every`` epochs
        (default 1), evaluate ``metric_fn`` on ``eval_data`` (a data set of arrays) and log
        each metric as ``eval_<name>`` (``eval_batch_size`` defaults to ``batch_size``, or
        256 for a stream).

    Example:
      >>> options: FitArguments = {"batch_size": 32, "progress": False}
      >>> trainer.fit(data, epochs=3, **options)
    """

    batch_size: int | None
    steps_per_epoch: int | None
    shuffle: bool
    callbacks: Sequence[Any]
    progress: bool
    progress_logs: Sequence[str] | None
    steps_per_call: int | None
    drop_remainder: bool
    prefetch: bool
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every: int
    checkpoint_every_steps: int | None
    checkpoint_async: bool
    resume: bool | int
    max_steps: int | None
    eval_data: Any
    metric_fn: Callable[[nnx.Module, Any], Any] | None
    eval_every: int
    eval_batch_size: int | None


#: Every option's default (what ``fit`` uses when it is left out).
FIT_DEFAULTS: dict[str, Any] = {
    "batch_size": None,
    "steps_per_epoch": None,
    "shuffle": True,
    "callbacks": (),
    "progress": True,
    "progress_logs": None,
    "steps_per_call": None,
    "drop_remainder": True,
    "prefetch": True,
    "checkpoint_dir": None,
    "checkpoint_every": 1,
    "checkpoint_every_steps": None,
    "checkpoint_async": True,
    "resume": False,
    "max_steps": None,
    "eval_data": None,
    "metric_fn": None,
    "eval_every": 1,
    "eval_batch_size": None,
}
assert set(FIT_DEFAULTS) == set(FitArguments.__annotations__)


class FitOptions(NamedTuple):
    """``fit``'s arguments once checked (the same for a Trainer and a Population)."""

    epochs: int | None  # None: as many as max_steps takes
    batch_size: int | None
    shuffle: bool
    steps_per_call: int | None
    drop_remainder: bool
    prefetch: bool
    callbacks: Sequence[Any]
    progress: bool
    evaluation: Any
    checkpoint_dir: pathlib.Path | None
    checkpoints: Any
    resume: bool | int  # True: the newest good checkpoint; an int: that step
    #: What identifies the run's data order, checked on resume and saved with it: one
    #: model's ``{"seed": s or None}``, a population's ``{"shared_order": bool}``.
    run_keys: dict[str, Any]
    member_batches: bool = False
    steps_per_epoch: int | None = None
    progress_logs: tuple[str, ...] | None = None
    max_steps: int | None = None
    #: What ``data`` is, decided here once: the engine and the layout read this, not the data.
    data_kind: DataKind = "arrays"


def fit_options(
    engine: Any,
    data: Any,
    epochs: Any,
    options: dict[str, Any],
    *,
    run_keys: dict[str, Any],
    member_batches: bool = False,
    front_end: str = "fit",
) -> FitOptions:
    """Checks ``fit``'s arguments, the same for every front-end, before anything compiles."""
    unknown = sorted(set(options) - set(FIT_DEFAULTS))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, [*FIT_DEFAULTS, "epochs"], n=2)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise TypeError(f"{front_end}() got an unexpected keyword argument {name!r}.{hint}")
    o = {**FIT_DEFAULTS, **options}
    max_steps = o["max_steps"]
    if max_steps is not None:
        max_steps = check_count(max_steps, "max_steps", 0)
    if epochs is None:
        if max_steps is None:
            raise TypeError(f"{front_end}() needs epochs=, max_steps=, or both.")
    else:
        epochs = check_count(epochs, "epochs", 0)
    directory, checkpoints = engine.checkpoints(
        o["checkpoint_dir"], o["checkpoint_every"], o["checkpoint_every_steps"], o["resume"],
        bool(o["checkpoint_async"]),
    )  # fmt: skip
    steps_per_call = o["steps_per_call"]
    if steps_per_call is not None:
        steps_per_call = check_count(steps_per_call, "steps_per_call", 1)
    elif checkpoints is not None and checkpoints.every_steps:
        steps_per_call = checkpoints.every_steps  # call boundaries to save at
    batch_size, steps_per_epoch = o["batch_size"], o["steps_per_epoch"]
    if batch_size is not None:
        batch_size = check_count(batch_size, "batch_size", 1)
    data_kind: DataKind = "none" if data is None else "stream" if is_stream(data) else "arrays"
    if data is None:
        if steps_per_epoch is None:
            raise ValueError(
                "data=None trains a step that takes no batch (its update gets batch=None): "
                "say how many steps an epoch is, fit(None, epochs=E, steps_per_epoch=K)."
            )
        steps_per_epoch = check_count(steps_per_epoch, "steps_per_epoch", 1)
        if batch_size is not None:
            raise ValueError("batch_size has no meaning with data=None: leave it out.")
    elif steps_per_epoch is not None:
        raise ValueError(
            "steps_per_epoch is for data=None (a step that takes no batch); an epoch over "
            "data is the data set (or the stream) once."
        )
    evaluation = fit_evaluation(
        engine, o["eval_data"], o["metric_fn"], o["eval_every"], o["eval_batch_size"], batch_size
    )
    callbacks = o["callbacks"]
    if isinstance(callbacks, str) or not isinstance(callbacks, Sequence):
        raise TypeError(
            f"callbacks must be a list of callback objects, got {type(callbacks).__name__}."
        )
    progress_logs = o["progress_logs"]
    if progress_logs is not None:
        if isinstance(progress_logs, str) or not isinstance(progress_logs, Sequence):
            raise TypeError(
                f"progress_logs must be a list of log names (e.g. ['episode_return']), got "
                f"{progress_logs!r}."
            )
        bad = [name for name in progress_logs if not isinstance(name, str)]
        if bad:
            raise TypeError(f"progress_logs holds names (str), got {bad[0]!r}.")
        progress_logs = tuple(progress_logs)
    return FitOptions(
        epochs=epochs, batch_size=batch_size, shuffle=bool(o["shuffle"]),
        steps_per_call=steps_per_call, drop_remainder=bool(o["drop_remainder"]),
        prefetch=bool(o["prefetch"]), callbacks=list(callbacks), progress=bool(o["progress"]),
        evaluation=evaluation, checkpoint_dir=directory, checkpoints=checkpoints,
        resume=_resume(o["resume"]), run_keys=run_keys, member_batches=bool(member_batches),
        steps_per_epoch=steps_per_epoch, progress_logs=progress_logs, max_steps=max_steps,
        data_kind=data_kind,
    )  # fmt: skip


def _resume(resume: Any) -> bool | int:
    """``resume``: a bool, or the step of the checkpoint to resume from (an int >= 0)."""
    if isinstance(resume, bool) or resume is None:
        return bool(resume)
    return check_count(resume, "resume (a checkpoint's step, or True)", 0)
