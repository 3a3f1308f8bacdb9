"""Pure evaluation: a metric step and a scanned average over every example."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from nnxscan.pure import _loops, batching, checks
from nnxscan.pure.step_node import call_loss, unpack_step_node

__all__ = ["make_eval_step", "make_evaluate", "make_evaluate_metrics"]

MetricFn = Callable[[nnx.Module, Any], Any]


def _metric_name(metric_fn: MetricFn) -> str:
    """The key a scalar metric is reported under: the function's name, else ``"metric"``."""
    name = getattr(metric_fn, "__name__", "")
    return name if name.isidentifier() else "metric"


def make_eval_step(
    metric_fn: MetricFn, *, eval_mode: bool = True
) -> Callable[[nnx.GraphDef, nnx.State, Any], dict[str, jax.Array]]:
    """Builds ``eval_step(graphdef, state, batch) -> dict`` of metrics.

    Args:
      metric_fn: ``metric_fn(model, batch)`` returning a metric or a dict of metrics, each the
        MEAN over the batch's examples: a scalar, or an array of any fixed shape (per-class
        accuracy, say), averaged elementwise. A single metric is reported under the
        function's name.
      eval_mode: call ``model.eval()`` first (Dropout off, BatchNorm on running statistics).

    The state is read, never changed: evaluation draws no RNG and moves no statistics in the
    caller's state.

    Example:
      >>> eval_step = make_eval_step(lambda m, b: jnp.mean(m(b["x"]).argmax(-1) == b["y"]))
      >>> eval_step(graphdef, state, batch)
      {'metric': Array(0.93, dtype=float32)}
    """
    name = _metric_name(metric_fn)

    def eval_step(graphdef, state, batch):
        model = nnx.merge(graphdef, state, copy=True)
        if eval_mode:
            model.eval()
        out = metric_fn(model, batch)
        metrics = dict(out) if isinstance(out, dict) else {name: out}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric names must be strings, got {key!r}.")
            dtype = jnp.result_type(value)
            if not (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_):
                raise TypeError(
                    f"metric {key!r} has dtype {jnp.result_type(value)}; a metric is a "
                    f"number (or an array of numbers): the mean over the batch."
                )
        return {k: jnp.asarray(v, jnp.float32) for k, v in metrics.items()}

    return eval_step


def make_evaluate(
    metric_fn: MetricFn,
    *,
    batch_size: int,
    eval_mode: bool = True,
    batch_sharding: jax.sharding.Sharding | None = None,
) -> Callable[[nnx.GraphDef, nnx.State, Any], dict[str, jax.Array]]:
    """Builds ``evaluate(graphdef, state, data) -> dict`` averaging over EVERY example.

    Full batches are scanned; the final short batch runs once at its own size; each batch's
    mean is weighted by its size, so the result is the exact mean over all examples.
    ``batch_sharding`` shards each batch as training does (e.g.
    ``NamedSharding(mesh, P("data"))``; a batch that does not divide stays as it is).

    Example:
      >>> evaluate = jax.jit(make_evaluate(accuracy, batch_size=256))
      >>> evaluate(graphdef, state, {"x": x_test, "y": y_test})["accuracy"]
    """
    eval_step = make_eval_step(metric_fn, eval_mode=eval_mode)
    checks.check_batch_size(batch_size, batch_size, drop_remainder=False)

    def evaluate(graphdef, state, data):
        n = checks.check_leading_size(data, "data")
        size = min(batch_size, n)
        full, tail = batching.cut_batches(
            jnp.arange(n, dtype=jnp.int32), size, drop_remainder=False
        )

        def scan(carry, idx, unroll):
            def body(carry, i):
                batch = batching.shard_batch(batching.take_batch(data, i), batch_sharding)
                return carry, eval_step(graphdef, state, batch)

            return _loops.scan_loop(body, carry, idx, unroll=unroll)

        _, per_batch = batching.full_then_tail(scan, None, full, tail)
        # Each batch's mean weighted by its size: the exact mean over every example.
        num_full = full.shape[0]
        rest = n - num_full * size

        def mean(m):
            total = jnp.sum(m[:num_full], axis=0) * size if num_full else 0.0
            return (total + (m[num_full] * rest if rest else 0.0)) / n

        return jax.tree.map(mean, per_batch)

    return evaluate


def make_evaluate_metrics(
    loss_fn: Callable,
    update_metrics: Callable[[Any, Any, Any, Any], Any],
    *,
    batch_size: int,
    has_aux: bool = False,
    with_rngs: bool = False,
    eval_mode: bool = True,
    batch_sharding: jax.sharding.Sharding | None = None,
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
    checks.check_batch_size(batch_size, batch_size, drop_remainder=False)
    if not callable(update_metrics):
        raise TypeError(f"update_metrics must be callable, got {type(update_metrics).__name__}.")
    checks.check_no_captured_nnx(loss_fn, "loss_fn")

    def update(graphdef, state, batch):
        node = nnx.merge(graphdef, state, copy=True)
        parts = unpack_step_node(node, with_rngs=with_rngs, with_metrics=True)
        loss, aux = call_loss(loss_fn, parts, batch, has_aux)
        update_metrics(parts.metrics, loss, aux, batch)
        return nnx.state(node)

    def evaluate(graphdef, state, data):
        n = checks.check_leading_size(data, "data")
        # A private copy: eval mode (a static attribute, so in the graphdef) and reset
        # metrics, never the caller's.
        node = nnx.merge(graphdef, state, copy=True)
        parts = unpack_step_node(node, with_rngs=with_rngs, with_metrics=True)
        if eval_mode:
            parts.model.eval()
        parts.metrics.reset()
        graphdef, state = nnx.split(node)
        full, tail = batching.cut_batches(
            jnp.arange(n, dtype=jnp.int32), min(batch_size, n), drop_remainder=False
        )

        def scan(state, idx, unroll):
            def body(state, i):
                batch = batching.shard_batch(batching.take_batch(data, i), batch_sharding)
                return update(graphdef, state, batch), None

            return _loops.scan_loop(body, state, idx, unroll=unroll)

        state, _ = batching.full_then_tail(scan, state, full, tail)
        node = nnx.merge(graphdef, state)
        return unpack_step_node(node, with_rngs=with_rngs, with_metrics=True).metrics.compute()

    return evaluate
