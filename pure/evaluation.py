"""Pure evaluation: a metric step and a scanned average over every example."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure._checks import check_batch_size, check_leading_size
from nnxscan.pure.epoch import batches_from_order
from nnxscan.pure.scan import take_batch

__all__ = ["make_eval_step", "make_evaluate"]

MetricFn = Callable[[nnx.Module, Any], Any]


def metric_name(metric_fn: MetricFn) -> str:
    """The key a scalar metric is reported under: the function's name, else ``"metric"``."""
    name = getattr(metric_fn, "__name__", "")
    return name if name.isidentifier() else "metric"


def make_eval_step(
    metric_fn: MetricFn, *, eval_mode: bool = True
) -> Callable[[nnx.GraphDef, nnx.State, Any], dict[str, jax.Array]]:
    """Builds ``eval_step(graphdef, state, batch) -> dict`` of scalar metrics.

    Args:
      metric_fn: ``metric_fn(model, batch)`` returning a scalar or a dict of scalars, each the
        MEAN over the batch's examples. A scalar is reported under the function's name.
      eval_mode: call ``model.eval()`` first (Dropout off, BatchNorm on running statistics).

    The state is read, never changed: evaluation draws no RNG and moves no statistics in the
    caller's state.

    Example:
      >>> eval_step = make_eval_step(lambda m, b: jnp.mean(m(b["x"]).argmax(-1) == b["y"]))
      >>> eval_step(graphdef, state, batch)
      {'metric': Array(0.93, dtype=float32)}
    """
    name = metric_name(metric_fn)

    def eval_step(graphdef, state, batch):
        model = nnx.merge(graphdef, state, copy=True)
        if eval_mode:
            model.eval()
        out = metric_fn(model, batch)
        metrics = dict(out) if isinstance(out, dict) else {name: out}
        for key, value in metrics.items():
            if jnp.shape(value) != ():
                raise ValueError(
                    f"metric {key!r} must be a scalar (the mean over the batch), got shape "
                    f"{jnp.shape(value)}."
                )
        return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    return eval_step


def make_evaluate(
    metric_fn: MetricFn, *, batch_size: int, eval_mode: bool = True
) -> Callable[[nnx.GraphDef, nnx.State, Any], dict[str, jax.Array]]:
    """Builds ``evaluate(graphdef, state, data) -> dict`` averaging over EVERY example.

    Full batches are scanned; the final short batch runs once at its own size; each batch's
    mean is weighted by its size, so the result is the exact mean over all examples.

    Example:
      >>> evaluate = jax.jit(make_evaluate(accuracy, batch_size=256))
      >>> evaluate(graphdef, state, {"x": x_test, "y": y_test})["accuracy"]
    """
    eval_step = make_eval_step(metric_fn, eval_mode=eval_mode)
    check_batch_size(batch_size, batch_size, drop_remainder=False)

    def evaluate(graphdef, state, data):
        n = check_leading_size(data, "data")
        order = jnp.arange(n, dtype=jnp.int32)
        full, tail = batches_from_order(order, min(batch_size, n), drop_remainder=False)
        total = None
        if full.shape[0]:

            def body(_, idx):
                return None, eval_step(graphdef, state, take_batch(data, idx))

            _, per_batch = jax.lax.scan(body, None, full)
            total = jax.tree.map(lambda m: jnp.sum(m) * full.shape[1], per_batch)
        if tail is not None:
            tail_metrics = eval_step(graphdef, state, take_batch(data, tail))
            weighted = jax.tree.map(lambda m: m * tail.shape[0], tail_metrics)
            total = weighted if total is None else jax.tree.map(jnp.add, total, weighted)
        return jax.tree.map(lambda t: t / n, total)

    return evaluate
