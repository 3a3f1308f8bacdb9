"""Evaluation for a Trainer and a Population alike: ``metric_fn`` or NNX metrics over every
example, on the mesh of the call, as the owner's layout runs it (vmapped over members for a
population).

The engine (``engine.Engine``) hands itself in: its owner (what to evaluate, and its
layout), the front-end's loss and metrics update (what NNX metrics are fed with) and
``bind()`` (the mesh of this call).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from nnxscan.pure import paused_gc
from nnxscan.pure.checks import check_batch_size, check_count, check_leading_size
from nnxscan.shell._edges.host import to_host
from nnxscan.shell._engine import programs as _programs
from nnxscan.shell._engine.fit import Evaluation
from nnxscan.shell._engine.owner import metric_logs
from nnxscan.shell._engine.placement import Placement
from nnxscan.shell._engine.trace_notes import noting_batch


def fit_evaluation(
    engine: Any,
    data: Any,
    metric_fn: Callable | None,
    every: Any,
    eval_batch_size: Any,
    batch_size: Any,
) -> Evaluation | None:
    """Checks fit's evaluation arguments (before anything compiles)."""
    if data is None and metric_fn is None:
        return None
    if data is None or (metric_fn is None and engine.owner.metrics is None):
        raise ValueError(
            "evaluation during fit needs both eval_data and a metric_fn, or NNX "
            "metrics given as metrics=/update_metrics=."
        )
    n = check_leading_size(data, "eval_data")
    every = check_count(every, "eval_every", 1)
    size = eval_batch_size or (batch_size if isinstance(batch_size, int) else 256)
    size = check_batch_size(
        min(check_count(size, "eval_batch_size", 1), n), n, drop_remainder=False
    )
    run = make_evaluate_fn(engine, metric_fn, None, None, size, True)
    return Evaluation(every, lambda: run(data), lambda: run.lowered(data))


def make_evaluate_fn(
    engine: Any,
    metric_fn: Callable | None,
    metrics: nnx.Metric | None,
    update_metrics: Callable | None,
    batch_size: int,
    eval_mode: bool,
) -> Callable[[Any], dict[str, Any]]:
    """Checks the evaluation arguments (before anything compiles); returns ``run(data)``."""
    if metric_fn is not None:
        if metrics is not None or update_metrics is not None:
            raise ValueError("pass either metric_fn or metrics/update_metrics, not both.")
        if not callable(metric_fn):
            raise TypeError(f"metric_fn must be callable, got {type(metric_fn).__name__}.")
    else:
        metrics = engine.owner.metrics if metrics is None else metrics
        update_metrics = engine.update_metrics if update_metrics is None else update_metrics
        if metrics is None or update_metrics is None:
            raise ValueError(
                "evaluate needs a metric_fn, or NNX metrics: metrics= and "
                "update_metrics= here or on the Trainer (or Population)."
            )
        if not isinstance(metrics, nnx.Metric):
            raise TypeError(f"metrics must be an nnx.Metric, got {type(metrics).__name__}.")
    owner, layout = engine.owner, engine.owner.layout
    loss_fn, has_aux, rngs = engine.loss_fn, engine.program.has_aux, engine.rngs
    # What an error while tracing names (with the batch's leaves): the user's functions.
    traced = metric_fn or {"loss_fn": loss_fn, "update_metrics": update_metrics}

    def inputs(placement: Placement, data: Any) -> tuple[Callable, tuple]:
        # The program is looked up per call (cached): its batch sharding is this call's mesh's.
        if metric_fn is not None:
            program = _programs.jit_evaluate(
                metric_fn, batch_size, eval_mode, placement.batch_sharding
            )
        else:
            program = _programs.jit_evaluate_metrics(
                loss_fn, update_metrics, batch_size, has_aux=has_aux,
                with_rngs=rngs is not None, eval_mode=eval_mode,
                batch_sharding=placement.batch_sharding,
            )  # fmt: skip
        graphdef, state = owner.evaluation_node(metric_fn is not None, rngs, metrics)
        leaves, treedef = jax.tree.flatten(state)
        placed = placement.put_carry(leaves, placement.state_shardings(state))
        state = jax.tree.unflatten(treedef, placed)
        return layout.evaluate(program), (graphdef, state, placement.put_data(data, state))

    def run(data: Any) -> dict[str, Any]:
        placement = engine.bind()
        with placement.context():
            evaluate, args = inputs(placement, data)
            with noting_batch("evaluation", traced, args[2], batch_size=batch_size):
                with paused_gc():  # a first call traces (nothing else is slowed)
                    values = evaluate(*args)
                values = to_host(values)
            if metric_fn is None:
                return metric_logs(values, metrics, layout)
            return {k: layout.value(v) for k, v in values.items()}

    def lowered(data: Any) -> Any:
        """The program ``run(data)`` will call, traced and lowered on the owner's state as
        it is now (the same shapes as every later call's): ``.compile()`` compiles what
        that call would, filling jit's cache."""
        placement = engine.bind()
        with placement.context():
            evaluate, args = inputs(placement, data)
            with paused_gc():
                return evaluate.lower(*args)

    run.lowered = lowered
    return run


def evaluate(
    engine: Any,
    data: Any,
    metric_fn: Callable | None,
    *,
    batch_size: Any,
    eval_mode: bool,
    metrics: nnx.Metric | None = None,
    update_metrics: Callable | None = None,
) -> dict[str, Any]:
    """``evaluate`` of a front-end: every example of ``data``, checked before compiling."""
    n = check_leading_size(data, "data")
    batch_size = check_batch_size(batch_size, n, drop_remainder=False)
    run = make_evaluate_fn(engine, metric_fn, metrics, update_metrics, batch_size, bool(eval_mode))
    return run(data)
