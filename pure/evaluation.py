"""Pure evaluation: a metric step and a scanned average over every example."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure._checks import check_batch_size, check_leading_size, check_no_captured_nnx
from nnxscan.pure._node import unpack
from nnxscan.pure.epoch import batches_from_order
from nnxscan.pure.scan import take_batch
from nnxscan.pure.train_step import call_loss

__all__ = ["make_eval_step", "make_evaluate", "make_evaluate_metrics"]

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


def make_evaluate_metrics(
    loss_fn: Callable,
    update_metrics: Callable[[Any, Any, Any, Any], Any],
    *,
    batch_size: int,
    has_aux: bool = False,
    with_rngs: bool = False,
    eval_mode: bool = True,
) -> Callable[[nnx.GraphDef, nnx.State, Any], Any]:
    """Builds ``evaluate(graphdef, state, data) -> metrics.compute()`` for NNX metrics.

    ``graphdef, state = nnx.split((model, metrics))`` (or ``(model, rngs, metrics)`` with
    ``with_rngs``). The metrics start from their reset state, every batch runs
    ``update_metrics(metrics, *loss_fn(model, batch[, rngs]), batch)`` — the Flax NNX
    tutorial's ``eval_step`` — and the result is ``metrics.compute()`` over every example
    (the final short batch included, at its own size). Nothing in ``state`` changes: the
    caller's metrics, RNG counts and batch statistics are left as they were.

    Example:
      >>> evaluate = jax.jit(make_evaluate_metrics(loss_fn, update, batch_size=64,
      ...                                          has_aux=True))
      >>> evaluate(*nnx.split((model, metrics)), test_data)
      {'accuracy': Array(0.97, dtype=float32), 'loss': Array(0.1, dtype=float32)}
    """
    check_batch_size(batch_size, batch_size, drop_remainder=False)
    if not callable(update_metrics):
        raise TypeError(f"update_metrics must be callable, got {type(update_metrics).__name__}.")
    check_no_captured_nnx(loss_fn, "loss_fn")

    def update(graphdef, state, batch):
        node = nnx.merge(graphdef, state, copy=True)
        parts = unpack(node, with_rngs=with_rngs, with_metrics=True)
        loss, aux = call_loss(loss_fn, parts, batch, has_aux)
        update_metrics(parts.metrics, loss, aux, batch)
        return nnx.state(node)

    def evaluate(graphdef, state, data):
        n = check_leading_size(data, "data")
        # A private copy: eval mode (a static attribute, so in the graphdef) and reset
        # metrics, never the caller's.
        node = nnx.merge(graphdef, state, copy=True)
        parts = unpack(node, with_rngs=with_rngs, with_metrics=True)
        if eval_mode:
            parts.model.eval()
        parts.metrics.reset()
        graphdef, state = nnx.split(node)
        order = jnp.arange(n, dtype=jnp.int32)
        full, tail = batches_from_order(order, min(batch_size, n), drop_remainder=False)
        if full.shape[0]:

            def body(state, idx):
                return update(graphdef, state, take_batch(data, idx)), None

            state, _ = jax.lax.scan(body, state, full)
        if tail is not None:
            state = update(graphdef, state, take_batch(data, tail))
        node = nnx.merge(graphdef, state)
        return unpack(node, with_rngs=with_rngs, with_metrics=True).metrics.compute()

    return evaluate
