"""Continual learning: train one model on a sequence of tasks, and record what it forgets.

:func:`train_tasks` trains task after task with a fresh :class:`~nnxscan.shell.Trainer`
each (its own loss, a fresh optimizer state), and after each task evaluates every task
learned so far: the accuracy matrix ``[after task, task]`` shows what earlier tasks lost.
With a :class:`~nnxscan.pure.hyper.ConditionalHypernetwork` and
:func:`~nnxscan.pure.hyper.output_regularizer` in the loss, it is von Oswald et al.'s
continual learning with hypernetworks; with a plain network, fine-tuning task by task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

from nnxscan.pure.checks import (
    abstract_batch,
    check_batch_size,
    check_count,
    check_leading_size,
    check_transform,
)
from nnxscan.pure.evaluation import make_eval_step
from nnxscan.shell._module_check import check_module
from nnxscan.shell.trainer import Trainer

__all__ = ["train_tasks"]

LossFn = Callable[[nnx.Module, Any], jax.Array]


def _check_tasks(tasks: Any, batch_size: int, eval_batch_size: int | None) -> list[tuple]:
    # The type first: `not tasks` on a numpy array raises numpy's own, unrelated error.
    if not isinstance(tasks, Sequence) or isinstance(tasks, str | bytes):
        raise ValueError(
            "tasks must be a non-empty sequence (a list) of (train_data, test_data) pairs, "
            f"one per task; got {type(tasks).__name__}."
        )
    if len(tasks) == 0:
        raise ValueError(
            "tasks must be a non-empty sequence of (train_data, test_data) pairs, one per "
            "task; got an empty one."
        )
    checked = []
    for t, task in enumerate(tasks):
        if not isinstance(task, tuple | list) or len(task) != 2:
            raise ValueError(
                f"tasks[{t}] must be a (train_data, test_data) pair, got {type(task).__name__}"
                f"{f' of length {len(task)}' if isinstance(task, tuple | list) else ''}."
            )
        train, test = task
        n_train = check_leading_size(train, f"tasks[{t}] train data")
        check_batch_size(batch_size, n_train, drop_remainder=True)
        n_test = check_leading_size(test, f"tasks[{t}] test data")
        if eval_batch_size is not None:
            check_batch_size(eval_batch_size, n_test, drop_remainder=False)
        checked.append((train, test))
    return checked


def _check_metrics(
    model: nnx.Module, metric_fns: list[LossFn], tasks: list[tuple], eval_batch_size: int | None
) -> None:
    """Traces each metric on its first test batch (shapes only): one scalar each, or raise."""
    graphdef, state = nnx.split(model)
    seen = set()
    for j, fn in enumerate(metric_fns):
        if not callable(fn):
            raise TypeError(
                f"metric_for_task({j}) must return a callable, got {type(fn).__name__}."
            )
        test = tasks[j][1]
        size = min(eval_batch_size or check_leading_size(test), check_leading_size(test))
        batch = abstract_batch(test, leading=size)
        leaves, treedef = jax.tree.flatten(batch)
        key = (id(fn), treedef, tuple(leaves))
        if key in seen:  # one function for every task: trace it once per batch shape
            continue
        seen.add(key)
        try:
            out = jax.eval_shape(make_eval_step(fn), graphdef, state, batch)
        except ValueError as error:
            raise ValueError(f"metric_for_task({j}) on task {j}'s test data: {error}") from error
        if len(out) != 1:
            raise ValueError(
                f"metric_for_task({j}) must return one scalar metric (the batch mean), got a "
                f"dict of {sorted(out)}. Return a single scalar; train_tasks records one "
                f"number per task."
            )
        (shape,) = (value.shape for value in out.values())
        if shape != ():
            raise ValueError(
                f"metric_for_task({j}) on task {j}'s test data: the metric must be a scalar "
                f"(the mean over the batch), got shape {shape}; train_tasks records one "
                f"number per task."
            )


def train_tasks(
    model: nnx.Module,
    tx: optax.GradientTransformation,
    tasks: Sequence[tuple[Any, Any]],
    loss_for_task: Callable[[int, nnx.Module], LossFn],
    metric_for_task: Callable[[int], LossFn],
    *,
    epochs: int,
    batch_size: int,
    eval_batch_size: int | None = None,
    seed: int = 0,
    wrt: nnx.filterlib.Filter = nnx.Param,
    progress: bool = True,
    label: str | None = None,
) -> np.ndarray:
    """Trains ``model`` on each task in turn; returns held-out accuracy after every task.

    For task ``t = 0, 1, ...`` this runs exactly::

        loss_fn = loss_for_task(t, model)          # model: the live, trained-so-far module
        trainer = Trainer(model, tx, loss_fn, wrt=wrt)   # fresh optimizer state per task
        trainer.fit(train_t, epochs=epochs, batch_size=batch_size, seed=seed + t)
        for j in range(t + 1):
            accuracy[t, j] = trainer.evaluate(test_j, metric_fns[j], batch_size=...)

    with ``metric_fns[j] = metric_for_task(j)`` built once per task (so each metric compiles
    once). ``loss_for_task`` is called right before task ``t`` trains, so it can store what
    the model does now, e.g. the weights a hypernetwork generates for tasks ``< t``
    (:func:`~nnxscan.pure.hyper.snapshot_generated`), and return a loss that keeps them
    (:func:`~nnxscan.pure.hyper.output_regularizer`). The loss it returns must not capture
    ``model`` (it receives the model as its first argument).

    Args:
      model: the NNX module to train; it is the live object and ends trained on every task.
      tx: the optax transform; each task starts from a fresh ``tx.init`` state.
      tasks: ``(train_data, test_data)`` pairs, one per task: pytrees of arrays with a
        leading examples axis, as ``Trainer.fit`` takes them. All are checked before
        anything trains.
      loss_for_task: ``loss_for_task(t, model)`` returns task ``t``'s
        ``loss_fn(model, batch)``.
      metric_for_task: ``metric_for_task(j)`` returns task ``j``'s
        ``metric_fn(model, batch)``: a scalar, the batch mean (e.g. accuracy).
      epochs: epochs per task.
      batch_size: training batch size.
      eval_batch_size: evaluation batch size (default: each test set whole).
      seed: task ``t`` shuffles with ``seed + t``.
      wrt: the filter of the trained variables.
      progress: show ``fit``'s progress bar (off a terminal, its lines per epoch), each
        task's under a line naming it: ``"<label>: task 2 of 5"``.
      label: the name of this learner in those lines, so that the progress of several
        ``train_tasks`` runs can be told apart (default: none, ``"task 2 of 5"``).

    Returns:
      ``accuracy``, a ``(T, T)`` float64 array: ``accuracy[i, j]`` is task ``j``'s metric
      after training tasks ``0..i``; entries for tasks not yet trained (``j > i``) are NaN.

    Raises:
      TypeError, ValueError: bad arguments or data, before anything trains: the tasks'
        sizes, and every ``metric_for_task(j)`` traced (shapes only, nothing compiles) on
        task ``j``'s first test batch, which must give one scalar.

    ``loss_for_task`` is called only when its task starts, so an error it raises (or one
    from tracing the loss it returns) at task ``t > 0`` leaves ``model`` trained on tasks
    ``0 .. t - 1``, as it was when task ``t`` started.

    Example:
      >>> def loss_for_task(t, hnet):
      ...     stored = hyper.snapshot_generated(hnet.generate, jnp.arange(t))
      ...     def loss_fn(hnet, batch):
      ...         return cross_entropy(hnet(t, batch["x"]), batch["y"]) + (
      ...             hyper.output_regularizer(hnet.generate, jnp.arange(t), stored, 0.05))
      ...     return loss_fn
      >>> def metric_for_task(j):
      ...     return lambda hnet, batch: jnp.mean(hnet(j, batch["x"]).argmax(-1) == batch["y"])
      >>> acc = train_tasks(hnet, optax.adam(1e-3), [(train0, test0), (train1, test1)],
      ...                   loss_for_task, metric_for_task, epochs=20, batch_size=32)
      >>> acc[-1].mean()          # final average accuracy; acc[0, 0] - acc[-1, 0]: forgetting
    """
    check_module(model)
    tx = check_transform(tx)
    for name, fn in (("loss_for_task", loss_for_task), ("metric_for_task", metric_for_task)):
        if not callable(fn):
            raise TypeError(f"{name} must be callable, got {type(fn).__name__}.")
    if label is not None and not isinstance(label, str):
        raise TypeError(f"label must be a str (or None), got {type(label).__name__}.")
    epochs = check_count(epochs, "epochs", 1)
    batch_size = check_count(batch_size, "batch_size", 1)
    if eval_batch_size is not None:
        eval_batch_size = check_count(eval_batch_size, "eval_batch_size", 1)
    tasks = _check_tasks(tasks, batch_size, eval_batch_size)
    seed = check_count(seed, "seed", 0, 2**31 - 1 - len(tasks))  # Trainer's int32 seeds

    metric_fns = [metric_for_task(j) for j in range(len(tasks))]
    _check_metrics(model, metric_fns, tasks, eval_batch_size)
    accuracy = np.full((len(tasks), len(tasks)), np.nan)
    for t, (train, test) in enumerate(tasks):
        loss_fn = loss_for_task(t, model)
        trainer = Trainer(model, tx, loss_fn, wrt=wrt)
        if progress:
            print(f"{f'{label}: ' if label else ''}task {t + 1} of {len(tasks)}", flush=True)
        # Task t is evaluated by fit at its last epoch (the program evaluate would run):
        # fit compiles it on a thread while the training program compiles.
        history = trainer.fit(
            train, epochs=epochs, batch_size=batch_size, seed=seed + t, progress=progress,
            eval_data=test, metric_fn=metric_fns[t], eval_every=epochs,
            eval_batch_size=eval_batch_size or check_leading_size(test),
        )  # fmt: skip
        (accuracy[t, t],) = (v for k, v in history.epochs[-1].items() if k.startswith("eval_"))
        for j in range(t):
            test = tasks[j][1]
            size = eval_batch_size or check_leading_size(test)
            (value,) = trainer.evaluate(test, metric_fns[j], batch_size=size).values()
            accuracy[t, j] = value
    return accuracy
